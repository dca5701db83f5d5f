"""Host-side pooling state: a pooling request's prompt runs in chunks (chunked prefill), each step's forward pools
its chunk (runner/pooling.py), and the request's embedding is made of its chunks' here.

  last   the chunk that ends the prompt gives it;
  cls    the chunk that starts the prompt gives it;
  mean   the chunks' sums, added up, over the prompt's length.

A sequence preempted for recompute runs again from its first token: a chunk starting at 0 starts afresh (prefix
caching is off in a pooling engine, so no chunk starts past tokens it has not pooled)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class PooledPrompt:
    pooling_type: str  # "last" | "mean" | "cls"
    num_tokens: int  # the prompt's
    pooled: np.ndarray | None = None  # [D] float64: the vector so far (mean: the sum so far)
    num_pooled: int = 0  # tokens pooled so far, from the first on

    def add_chunk(self, start: int, num_tokens: int, chunk: np.ndarray) -> None:
        """The chunk's pooled vector [D] (its last or first token, or its sum) for tokens start .. start + n - 1."""
        if start == 0:
            self.pooled, self.num_pooled = None, 0
        if start != self.num_pooled:
            raise ValueError(
                f"pooled chunks must follow each other: tokens {start}.. after {self.num_pooled}"
            )
        chunk = np.asarray(chunk, np.float64)
        if self.pooling_type == "mean":
            self.pooled = chunk if self.pooled is None else self.pooled + chunk
        elif self.pooling_type == "last" or start == 0:
            self.pooled = chunk
        self.num_pooled += num_tokens

    @property
    def done(self) -> bool:
        return self.num_pooled == self.num_tokens

    def vector(self, dimensions: int | None = None, normalize: bool = True) -> np.ndarray:
        """The embedding: pooled, its first `dimensions` values kept (Matryoshka), then L2-normalised (as
        torch.nn.functional.normalize: a zero vector stays zero)."""
        if not self.done:
            raise ValueError(f"{self.num_pooled} of the prompt's {self.num_tokens} tokens are pooled so far")
        vector = self.pooled / self.num_tokens if self.pooling_type == "mean" else self.pooled
        vector = vector[:dimensions]
        if normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.astype(np.float32)
