"""The scratch memory XLA needs for the largest step, which KV sizing on an accelerator leaves free."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jpaged.config import EngineConfig
from jpaged.models.config import ModelConfig
from jpaged.models.llama import KVCache, model_graphdef, params_dtype
from jpaged.rounding import cdiv
from jpaged.runner.device_step import bind_step
from jpaged.runner.model_runner import attention_for
from jpaged.runner.packed_inputs import pack
from jpaged.runner.sampling_inputs import SamplingWidths, build_sampling_tensors, neutral_wide, split_wide
from jpaged.runner.step_batch import dummy_batch
from jpaged.runner.weight_layout import choose_products


def activation_peak_bytes(
    config: EngineConfig, model_config: ModelConfig, params: dict, max_model_len: int
) -> int:
    """Scratch memory XLA needs for the largest step bucket, read from its compiled memory analysis.

    Sizing the KV pool on an accelerator subtracts this, so the pool never squeezes out the step's activations.
    Everything is abstract (ShapeDtypeStructs): nothing is allocated to measure it.
    """
    dtype = params_dtype(params)
    abstract = functools.partial(jax.tree_util.tree_map, lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype))
    cache_shape = (
        model_config.num_layers,
        2,
        config.block_size,
        model_config.num_kv_heads,
        model_config.head_dim,
    )
    cache = KVCache(*(jax.ShapeDtypeStruct(cache_shape, dtype) for _ in range(2)))
    tokens, seqs = config.max_num_batched_tokens, config.max_num_seqs
    batch = dummy_batch(tokens, seqs, cdiv(max_model_len, config.block_size))
    widths = SamplingWidths(model_config.vocab_size, max_model_len)
    sampling, _ = split_wide(build_sampling_tensors([], seqs, widths))  # with top_k/top_p: the larger variant
    products = choose_products(
        abstract(params), activation=model_config.hidden_activation, quantization=config.quantization
    )
    attention = attention_for(config, model_config, config.attention_impl, dtype)
    (packed_batch, batch_layout), (packed_sampling, sampling_layout) = pack(batch), pack(sampling)
    branch_free = jax.default_backend() != "cpu"
    functions = bind_step(model_graphdef(model_config), attention, products, branch_free=branch_free)
    # The whole step (the forward's logits live into the sampling): the larger of the two programs' peaks.
    step = functools.partial(functions.whole, batch_layout=batch_layout, sampling_layout=sampling_layout)
    device_params = jax.eval_shape(products.layout, abstract(params))
    last_tokens = jax.ShapeDtypeStruct((seqs,), np.int32)
    wide = abstract(neutral_wide(seqs, widths))
    wide["history"] = jax.ShapeDtypeStruct((seqs, widths.history_len), np.int32)  # the widest a step sends
    args = (device_params, cache, last_tokens, packed_batch, packed_sampling, wide)
    compiled = jax.jit(step).lower(*args).compile()
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes) if analysis is not None else 0
