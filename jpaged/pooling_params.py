"""A pooling (embedding) request's parameters and its output, in vLLM's shapes: PoolingParams, and
EmbeddingRequestOutput > EmbeddingOutput (`output.outputs.embedding`, a list of floats)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PoolingParams:
    """`dimensions`: keep the first this many values (Matryoshka models only), before normalising;
    `normalize`: L2-normalise (None: as the model's pooling config says); `truncate_prompt_tokens`: keep only the
    prompt's last k tokens (-1: the last max_model_len)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
