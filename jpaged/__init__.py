"""jpaged: PagedAttention LLM inference in JAX and Pallas.

Public names load lazily, so `import jpaged.core.block_manager` (pure Python) does not pull in JAX or transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "jpaged.entrypoints.llm",
    "generate": "jpaged.entrypoints.llm",
    "GeneratedArrays": "jpaged.entrypoints.arrays",
    "LLMEngine": "jpaged.engine.llm_engine",
    "BeamSearchParams": "jpaged.sampling_params",
    "EngineConfig": "jpaged.config",
    "SamplingParams": "jpaged.sampling_params",
    "RequestOutputKind": "jpaged.sampling_params",
    "RequestOutput": "jpaged.outputs",
    "CompletionOutput": "jpaged.outputs",
    "Logprob": "jpaged.outputs",
    "LoRARequest": "jpaged.lora_request",
    "initialize_distributed": "jpaged.runner.multihost",
    "follow": "jpaged.engine.follower",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jpaged' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
