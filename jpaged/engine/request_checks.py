"""What a request must satisfy on this engine, beyond what SamplingParams checks on its own (that needs the model's
vocabulary and the engine's limits).

Apart from the loop so that the server can run the same checks before a streaming response commits to status 200
(jpaged_server.sampling): bad input is a 400 up front, never an error in the middle of a stream. Host-side: no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jpaged.config import EngineConfig
    from jpaged.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestChecks:
    """Each check raises ValueError naming what is wrong; it passes silently otherwise."""

    config: EngineConfig
    max_model_len: int
    vocab_size: int

    def check_prompt(self, token_ids: Sequence[int]) -> None:
        """At least one token, room for one generated token after it, and every id inside the vocabulary."""
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long, but max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def check_params(self, params: SamplingParams) -> None:
        """What sampling params must also satisfy on this engine: ids inside the vocabulary, and n samples that
        fit in one step, since all of them come from the prompt's last step together."""
        params.check_for_vocab(self.vocab_size)
        self.config.check_fan_out(
            "n", params.n, "a request's samples are all drawn from its prompt's last step"
        )
