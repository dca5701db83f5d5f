"""Engine configuration: every knob in one place, named as in vLLM, validated on construction."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

DTYPES = ("auto", "float32", "bfloat16", "float16")
PREEMPTION_MODES = ("recompute", "swap")
# How much warm-up compiles before the engine takes requests: every step program ("full"), or the smallest steps'
# with the rest compiled in the background while it serves ("progressive"; runner/warmup_stages.py). `jpaged serve`
# defaults to progressive, LLM and LLMEngine to full.
WARMUPS = ("full", "progressive")
# (max_num_seqs, max_num_batched_tokens) where the config leaves them None: vLLM's on accelerators; on CPU smaller,
# since every padded token of a step costs there and compiling many shapes is slow.
PLATFORM_DEFAULTS = {"cpu": (64, 512), "gpu": (256, 8192), "tpu": (256, 8192)}
# Whether steps overlap (async_scheduling) where the config leaves it None: measured by scripts/bench_overlap.py.
ASYNC_SCHEDULING_DEFAULTS = {"cpu": True, "gpu": True, "tpu": True}
# The attention implementations jpaged.pallas dispatches to; auto picks by platform.
ATTENTION_IMPLS = ("auto", "reference", "pallas", "mosaic_gpu", "triton", "cpu")
# vLLM's --runner and --convert: a decoder model runs as a pooling (embedding) model with runner="pooling",
# convert="embed"; "auto" runner means pooling when convert asks for it, generate otherwise.
RUNNERS = ("auto", "generate", "pooling")
# vLLM's --quantization for a float checkpoint, quantised at load (online): W8A8 with dynamic per-token activations.
QUANTIZATIONS = ("int8", "fp8")
# --quantization none: a quantized checkpoint (a GGUF's blocks) dequantised to the model's dtype at load. Left
# unset, a checkpoint's quantized matrices are held as they are stored (models/gguf_blocks.py).
NO_QUANTIZATION = "none"
# vLLM's --kv-cache-dtype: "auto" stores K/V in the model's dtype; "fp8" (= "fp8_e4m3") as float8 e4m3, half the
# bytes of bfloat16 a token.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
CONVERTS = ("auto", "none", "embed")
# vLLM's speculative_config methods that jpaged runs: proposals from the sequence's own tokens (n-gram prompt lookup),
# from a suffix tree over them and recently finished requests (core/suffix_proposer.py), or from a smaller model of
# the same tokenizer (`model`; engine/draft_model.py).
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
# Named by vLLM, not run here yet: refused by name rather than ignored.
UNSUPPORTED_SPECULATIVE_METHODS = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config: each decode step verifies `num_speculative_tokens` proposed tokens per sequence
    in one forward (k per engine: the step shapes stay those warm-up compiled). Keys as vLLM spells them."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: the draft's path (any format the engine loads)
    prompt_lookup_min: int | None = None  # ngram: shortest n-gram looked up (vLLM: defaults to the max, or 5)
    prompt_lookup_max: int | None = None
    # Speculation steps aside while this many sequences run (vLLM's disable_by_batch_size); None: never.
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method in UNSUPPORTED_SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported yet; use one of {SPECULATIVE_METHODS}"
            )
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        _positive(self, "num_speculative_tokens", "suffix_decoding_max_tree_depth")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method == "ngram":  # vLLM's defaults: the one given for both, else 5
            low, high = low or high or 5, high or low or 5
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
            _positive(self, "prompt_lookup_min", "prompt_lookup_max")
            if low > high:
                raise ValueError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config: a draft model needs 'model' (its path), and only it takes one"
            )
        if self.disable_by_batch_size is not None:
            _positive(self, "disable_by_batch_size")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError(
                f"suffix_decoding_min_token_prob must be in [0, 1], got {self.suffix_decoding_min_token_prob}"
            )
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError(
                f"suffix_decoding_max_spec_factor must be > 0, got {self.suffix_decoding_max_spec_factor}"
            )

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping | str) -> SpeculativeConfig:
        """From a dict or its JSON (the CLI's --speculative-config): unknown keys are refused by name. A `model`
        key without a method means a draft model, as in vLLM."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict or its JSON, got {type(value).__name__}")
        values = dict(value)
        if values.get("model") is not None:
            values.setdefault("method", "draft_model")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; jpaged takes {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in values:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**values)


@dataclasses.dataclass
class EngineConfig:
    """Engine arguments. `None` sizes (max_model_len, memory) are filled in from the model and the device."""

    model: str | None = None  # path, GGUF file, orbax checkpoint dir, hub id; None = embedded SmolLM2
    max_model_len: int | None = None  # default: min(model's max positions, 2048)
    max_num_seqs: int | None = None  # None: the platform's default (PLATFORM_DEFAULTS)
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes, CPU sizing
    num_blocks: int | None = None  # overrides memory-based sizing
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 1.0  # GiB of host memory for swapped-out blocks
    dtype: str = "auto"  # bfloat16 on GPU/TPU and on CPUs with bfloat16 dot products, else float32
    seed: int = 0
    tensor_parallel_size: int = 1
    # A mixture of experts' experts split whole over the tensor-parallel devices (E / tp each), attention still
    # split by heads (vLLM's --enable-expert-parallel; runner/expert_parallel.py). No effect at tp 1 or without experts.
    enable_expert_parallel: bool = False
    attention_impl: str = (
        "auto"  # "reference" (XLA), "pallas" (GPU/TPU), "mosaic_gpu"/"triton" (GPU), "cpu" (C++)
    )
    enforce_eager: bool = False  # skip warm-up; buckets compile on first use
    warmup: str = "full"  # or "progressive" (see WARMUPS)
    # Schedule step N+1 while step N runs (its sampled tokens feed N+1 on the device); None: the platform's
    # default (ASYNC_SCHEDULING_DEFAULTS).
    async_scheduling: bool | None = None
    compilation_cache_dir: str | None = None  # compiled steps kept here; default ~/.cache/jpaged/xla
    runner: str = "auto"  # "generate", or "pooling" (embeddings; see RUNNERS)
    convert: str = "auto"  # "embed": the decoder's hidden states pooled as embeddings (see CONVERTS)
    quantization: str | None = None  # "int8"/"fp8": layer matrices quantized at load; "none": dequantised
    kv_cache_dtype: str = "auto"  # "fp8": the KV pool in float8 e4m3 (see KV_CACHE_DTYPES)
    # LoRA adapters (vLLM's --enable-lora ...): max_loras device slots, each up to max_lora_rank, filled LRU from a
    # host cache of max_cpu_loras adapters (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's speculative_config (a dict, its JSON, or a SpeculativeConfig): held as a SpeculativeConfig.
    speculative_config: str | dict | SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        _positive(self, "block_size", "tensor_parallel_size", "max_loras", "max_lora_rank")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if None not in (self.max_num_seqs, self.max_num_batched_tokens) and (
            self.max_num_batched_tokens < self.max_num_seqs
        ):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        _one_of(self, "preemption_mode", PREEMPTION_MODES)
        _one_of(self, "warmup", WARMUPS)
        _one_of(self, "dtype", DTYPES)
        _one_of(self, "attention_impl", ATTENTION_IMPLS)
        _one_of(self, "runner", RUNNERS)
        _one_of(self, "convert", CONVERTS)
        _one_of(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        if self.quantization is not None:
            _one_of(self, "quantization", (*QUANTIZATIONS, NO_QUANTIZATION))
        if self.enable_lora and self.is_pooling:
            raise ValueError("enable_lora serves adapters for generation: a pooling model takes none")
        if self.speculative_config is not None and self.is_pooling:
            raise ValueError("speculative_config speeds up generation: a pooling model generates nothing")
        if self.draft_model is not None and self.preemption_mode == "swap":
            raise ValueError(
                "speculative_config with a draft model takes preemption_mode 'recompute' (its KV pool is not swapped)"
            )
        if self.runner == "generate" and self.convert == "embed":
            raise ValueError("convert 'embed' makes a pooling model: it needs runner 'pooling' (or 'auto')")
        if self.runner == "pooling" and self.convert == "none":
            raise ValueError(
                "runner 'pooling' needs convert 'embed' (or 'auto'): a decoder model pools only when converted"
            )

    @property
    def draft_model(self) -> str | None:
        """The draft model's path, where speculative_config names one."""
        spec = self.speculative_config
        return spec.model if spec is not None and spec.method == "draft_model" else None

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def keeps_checkpoint_quantization(self) -> bool:
        """Whether a quantized checkpoint's matrices are held as stored: unless --quantization asks otherwise."""
        return self.quantization is None

    @property
    def lora_cache_size(self) -> int:
        """How many adapters the host keeps read (max_cpu_loras, at least the device slots)."""
        return self.max_cpu_loras or self.max_loras

    @property
    def is_pooling(self) -> bool:
        """Whether the engine serves embeddings (pooling requests) rather than generation."""
        return self.runner == "pooling" or self.convert == "embed"

    def for_platform(self, platform: str) -> EngineConfig:
        """This config with what it leaves None filled in for `platform` (PLATFORM_DEFAULTS,
        ASYNC_SCHEDULING_DEFAULTS); a size given keeps its value, and the other one is raised to it if needed
        (tokens per step >= sequences)."""
        default_seqs, default_tokens = PLATFORM_DEFAULTS.get(platform, PLATFORM_DEFAULTS["gpu"])
        seqs = self.max_num_seqs or min(default_seqs, self.max_num_batched_tokens or default_seqs)
        tokens = self.max_num_batched_tokens or max(default_tokens, seqs)
        overlap = self.async_scheduling
        if overlap is None:
            overlap = ASYNC_SCHEDULING_DEFAULTS.get(platform, ASYNC_SCHEDULING_DEFAULTS["gpu"])
        return dataclasses.replace(
            self, max_num_seqs=seqs, max_num_batched_tokens=tokens, async_scheduling=overlap
        )

    def check_fan_out(self, name: str, value: int, why: str) -> None:
        """A request whose sequences (n samples, beams) must all run in one step needs at most max_num_seqs of
        them: queued, a bigger one could never be admitted and would hold up every request behind it."""
        if value > self.max_num_seqs:
            raise ValueError(f"{name} must be at most max_num_seqs ({self.max_num_seqs}): {why}, got {value}")


def _positive(config: EngineConfig | SpeculativeConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _one_of(config: EngineConfig, name: str, allowed: tuple[str, ...]) -> None:
    if getattr(config, name) not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {getattr(config, name)!r}")
