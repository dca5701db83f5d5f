"""POST /v1/embeddings' request and response bodies, in OpenAI's shape with vLLM's extras (truncate_prompt_tokens,
normalize, add_special_tokens). Fields a client sends that are not declared here are ignored, as vLLM ignores
them; `null` stands for a field's default, as OpenAI's spec allows."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

EmbeddingInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {
                k: v for k, v in data.items() if v is not None or k not in cls.model_fields or k == "input"
            }
        return data


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a str: base64 of the little-endian float32 values


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
