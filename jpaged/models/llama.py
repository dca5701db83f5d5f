"""The shared decoder of the Llama-shaped families (families/: Llama 2/3/3.1, SmolLM2, Mistral, Qwen2/2.5, Qwen3,
Phi-3/3.5/4, Gemma 2/3) as Flax NNX modules; a family's features are ModelConfig fields, its checkpoint names its
module's.

Shapes: T tokens in the step, S sequences (rows whose logits are wanted), D hidden size, F MLP size, V vocabulary,
L layers, Hq/Hk query/KV heads, Dh head dim, N blocks, B block size.

The modules and their state (weights stored [in, out]; q/k/v and gate/up fused so each is one matmul):
  CausalLM     embed.weight [V, D], layers (one DecoderLayer stack), final_norm.weight [D],
               lm_head [D, V] (absent when tied to the embedding)
  DecoderLayer attn_norm.weight, attn (qkv [D, (Hq + 2 Hk) Dh], qkv_bias (Qwen2), q_norm / k_norm.weight [Dh]
               (Qwen3, Gemma 3), o [Hq Dh, D]), attn_post_norm.weight (Gemma), mlp_norm.weight, mlp (gate_up
               [D, 2F], down [F, D]; or a mixture of experts, moe.py), mlp_post_norm.weight (Gemma); every leaf stacked on a leading L axis (an
               `nnx.vmap`-built stack) so that `lax.scan` compiles one layer, not thirty. What differs between
               layers (Gemma's sliding-window layers, their RoPE base) is data indexed by the layer, so local and
               global layers are one program.
Every weight names its logical axes (`out_sharding` metadata, see `partition_specs`) for tensor parallelism.

The engine runs the model functionally: it holds `model_graphdef(config)` and the state as a plain dict
(`nnx.to_pure_dict`: what the loaders build and `update_weights` takes), and its jitted step merges the two
(`forward`), so the step stays a pure function of (state, KV cache, batch).

KV cache: (k, v), each [L, N, B, Hk, Dh]; the step writes its new K/V through `slot_mapping` and attends through
`block_tables`. Both are donated by the caller, so the scatter updates them in place.

Attention and the matrix products are injected at call time: the modules know no kernel and no weight layout.
The runner passes the attention callable for its backend and a `MatrixProducts` for the layout it keeps the
weights in (products.py: the stacks above, `StackedProducts`, unless it chose another, e.g. the CPU kernel's
panels).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.models.activations import act_and_mul
from jpaged.models.batch import KVCache, StepBatch
from jpaged.models.config import ModelConfig
from jpaged.models.fused_columns import fused_sizes, split_fused
from jpaged.models.lora import XLA_LORA, XlaLoRA
from jpaged.models.moe import SparseMoE
from jpaged.models.products import EXPERT_MATRICES, LAYER_MATRICES, STACKED, MatrixProducts
from jpaged.models.rope import cos_sin, rotate

# Logical axis names of the weights: tensor parallelism maps them onto mesh axes.
VOCAB, EMBED, QKV, HEADS, MLP, HEAD_DIM, LAYERS = (
    "vocab",
    "embed",
    "qkv",
    "heads",
    "mlp",
    "head_dim",
    "layers",
)


def _weight(shape: tuple[int, ...], dtype, axes: tuple[str | None, ...], fill: float = 0.0) -> nnx.Param:
    """A weight named by its logical axes, filled with `fill` until a loader's state replaces it."""
    return nnx.Param(jnp.full(shape, fill, dtype), out_sharding=axes, eager_sharding=False)


@dataclass(frozen=True)
class StepContext:
    """What every layer of one step shares: the batch, RoPE's cos/sin, where the new K/V go, the kernels, and
    what tells the layers apart (the config's `sliding_layers`)."""

    config: ModelConfig
    batch: StepBatch
    cos: jax.Array  # [T, 1, R] (R: the rotary part of Dh)
    sin: jax.Array
    local_rotation: tuple[jax.Array, jax.Array] | None  # cos and sin of the sliding layers' own RoPE base
    write_block: jax.Array  # [T]
    write_offset: jax.Array  # [T]
    live_tokens: jax.Array  # the step's real tokens (the rest of T is padding)
    attention: Callable
    products: MatrixProducts
    # The LoRA stacks (name -> {"a", "b"}: models/lora.py; the layer's, or whole where `lora_deltas` reads them
    # so) and how the deltas are computed; each token's slot is batch.lora_slots. None without adapters.
    lora: dict | None = None
    lora_deltas: XlaLoRA = XLA_LORA

    def matmul(self, name: str, weight: nnx.Param, x: jax.Array, layer: jax.Array) -> jax.Array:
        out = self.products.layer(name, weight[...], x, layer, self.live_tokens)
        if self.lora is None or name not in self.lora:
            return out
        slots = self.batch.lora_slots
        return out + self.lora_deltas.delta(name, x, self.lora[name], slots, layer, self.live_tokens)

    def gated(self, weight: nnx.Param, x: jax.Array, layer: jax.Array, sizes: tuple[int, int]) -> jax.Array:
        activation = self.config.hidden_activation
        if self.lora is not None and "gate_up" in self.lora:  # the delta joins gate|up before the activation
            gate_up = self.matmul("gate_up", weight, x, layer)
            return act_and_mul(gate_up, sizes, self.products.fused_groups, activation)
        return self.products.gated(weight[...], x, layer, self.live_tokens, sizes, activation)

    def rotation(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos and sin for layer `layer`: the sliding layers' own where they have a RoPE base of their own."""
        if self.local_rotation is None:
            return self.cos, self.sin
        local = jnp.asarray(self.config.sliding_layers)[layer]
        (local_cos, local_sin) = self.local_rotation
        return jnp.where(local, local_cos, self.cos), jnp.where(local, local_sin, self.sin)

    def window(self, layer: jax.Array) -> int | jax.Array | None:
        """Layer `layer`'s sliding window: the config's (static) where every layer has it, else an int32 that is
        0 (none) on the global layers, so the one scanned layer program serves both kinds."""
        window = self.config.sliding_window
        if self.config.sliding_layers is None or window is None:
            return window
        return jnp.where(jnp.asarray(self.config.sliding_layers)[layer], jnp.int32(window), jnp.int32(0))


class RMSNorm(nnx.Module):
    """transformers' RMSNorm: Llama's scales the normalised x, rounded to x's dtype, by w; Gemma's (an `offset` of
    1) scales it by (1 + w) in float32 before rounding, gpt-oss's (`in_float32`) by w in float32 before rounding.
    The state holds the checkpoint's w either way."""

    def __init__(
        self, dim: int, eps: float, dtype, axis: str, offset: float = 0.0, in_float32: bool = False
    ) -> None:
        self.eps = eps
        self.offset = offset
        self.in_float32 = in_float32 or bool(offset)
        self.weight = _weight((dim,), dtype, (axis,), fill=1.0 - offset)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.in_float32:
            return (x32 * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * x32.astype(x.dtype)


def _norm(config: ModelConfig, dim: int, dtype, axis: str) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, dtype, axis, config.norm_offset, config.norm_scale_in_float32)


class Embedding(nnx.Module):
    """Token embeddings, times sqrt(D) where the config says (Gemma: the factor rounded to the dtype first, as
    transformers does)."""

    def __init__(self, vocab_size: int, dim: int, dtype, scaled: bool = False) -> None:
        self.scale = dim**0.5 if scaled else None
        self.weight = _weight((vocab_size, dim), dtype, (VOCAB, EMBED))

    def __call__(self, token_ids: jax.Array, products: MatrixProducts) -> jax.Array:
        x = products.embed(self.weight[...], token_ids)
        return x if self.scale is None else x * jnp.asarray(self.scale, x.dtype)


class Attention(nnx.Module):
    """Fused QKV projection, optional bias (Qwen2) and q/k norms (Qwen3), RoPE, the paged cache write, the
    injected attention (with gpt-oss's sinks: a logit a query head adds to its softmax's denominator) and the
    output projection (with gpt-oss's bias)."""

    def __init__(self, config: ModelConfig, dtype) -> None:
        c = self.config = config
        width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.qkv = _weight((c.hidden_size, width), dtype, (EMBED, QKV))
        self.qkv_bias = _weight((width,), dtype, (QKV,)) if c.attention_bias else None
        self.q_norm = _norm(c, c.head_dim, dtype, HEAD_DIM) if c.qk_norm else None
        self.k_norm = _norm(c, c.head_dim, dtype, HEAD_DIM) if c.qk_norm else None
        self.o = _weight((c.num_heads * c.head_dim, c.hidden_size), dtype, (HEADS, EMBED))
        self.o_bias = _weight((c.hidden_size,), dtype, (EMBED,)) if c.attention_output_bias else None
        self.sinks = _weight((c.num_heads,), dtype, (HEADS,)) if c.attention_sinks else None
        # The checkpoint's scales of K and V (in that order) for float8 pages: stored divided by them.
        self.kv_scales = _weight((2,), dtype, (None,), fill=1.0) if c.kv_cache_scales else None

    def __call__(
        self, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, step: StepContext
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        c, b = self.config, step.batch
        num_tokens = x.shape[0]
        q_size = c.num_heads * c.head_dim
        qkv = step.matmul("qkv", self.qkv, x, layer)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...]
        q, k, v = split_fused(qkv, fused_sizes(c)["qkv"], step.products.fused_groups)
        q = q.reshape(num_tokens, c.num_heads, c.head_dim)
        k = k.reshape(num_tokens, c.num_kv_heads, c.head_dim)
        v = v.reshape(num_tokens, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = step.rotation(layer)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        options = {} if self.sinks is None else dict(sinks=self.sinks[...].astype(jnp.float32))
        if self.kv_scales is not None and is_float8_pool(k_cache.dtype):
            k_scale, v_scale = self.kv_scales[...].astype(jnp.float32)
            k, v = k / k_scale, v / v_scale
            options.update(k_scale=k_scale, v_scale=v_scale)
        k_cache = k_cache.at[layer, step.write_block, step.write_offset].set(as_stored(k, k_cache.dtype))
        v_cache = v_cache.at[layer, step.write_block, step.write_offset].set(as_stored(v, v_cache.dtype))
        attn = step.attention(
            q,
            k_cache,
            v_cache,
            layer,
            b.kv_lens,
            b.block_tables,
            b.query_start,
            b.num_seqs,
            sm_scale=(c.query_pre_attn_scalar or c.head_dim) ** -0.5,
            sliding_window=step.window(layer),
            logits_soft_cap=c.attn_logit_softcap,
            **options,
        )
        out = step.matmul("o", self.o, attn.reshape(num_tokens, q_size).astype(x.dtype), layer)
        return (out if self.o_bias is None else out + self.o_bias[...]), k_cache, v_cache


class GatedMLP(nnx.Module):
    def __init__(self, config: ModelConfig, dtype) -> None:
        d, f = config.hidden_size, config.intermediate_size
        self.sizes = fused_sizes(config)["gate_up"]
        self.gate_up = _weight((d, 2 * f), dtype, (EMBED, MLP))
        self.down = _weight((f, d), dtype, (MLP, EMBED))

    def __call__(self, x: jax.Array, layer: jax.Array, step: StepContext) -> jax.Array:
        return step.matmul("down", self.down, step.gated(self.gate_up, x, layer, self.sizes), layer)


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks, each with a norm of its output too where the config says (Gemma)."""

    def __init__(self, config: ModelConfig, dtype) -> None:
        d, post = config.hidden_size, config.post_norms
        self.attn_norm = _norm(config, d, dtype, EMBED)
        self.attn = Attention(config, dtype)
        self.attn_post_norm = _norm(config, d, dtype, EMBED) if post else None
        self.mlp_norm = _norm(config, d, dtype, EMBED)
        self.mlp = SparseMoE(config, dtype) if config.num_experts else GatedMLP(config, dtype)
        self.mlp_post_norm = _norm(config, d, dtype, EMBED) if post else None

    def __call__(
        self, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, step: StepContext
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
        """((x, k_cache, v_cache) after the layer, its experts' token counts [E] (none for a dense MLP))."""
        h, k_cache, v_cache = self.attn(self.attn_norm(x), k_cache, v_cache, layer, step)
        x = x + (h if self.attn_post_norm is None else self.attn_post_norm(h))
        if isinstance(self.mlp, SparseMoE):
            h, counts = self.mlp(self.mlp_norm(x), layer, step)
        else:
            h, counts = self.mlp(self.mlp_norm(x), layer, step), jnp.zeros((0,), jnp.int32)
        return (x + (h if self.mlp_post_norm is None else self.mlp_post_norm(h)), k_cache, v_cache), counts


def _layer_stack(config: ModelConfig, dtype) -> DecoderLayer:
    """`config.num_layers` decoder layers as one module whose every leaf has a leading L axis."""

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def build(_: jax.Array) -> DecoderLayer:
        return DecoderLayer(config, dtype)

    return build(jnp.arange(config.num_layers))


class CausalLM(nnx.Module):
    """A Llama-family decoder over the paged KV cache."""

    def __init__(self, config: ModelConfig, dtype=jnp.float32) -> None:
        c = self.config = config
        self.embed = Embedding(c.vocab_size, c.hidden_size, dtype, scaled=c.embed_scale)
        self.layers = _layer_stack(c, dtype)
        self.final_norm = _norm(c, c.hidden_size, dtype, EMBED)
        tied = c.tie_word_embeddings
        self.lm_head = None if tied else _weight((c.hidden_size, c.vocab_size), dtype, (EMBED, VOCAB))

    def __call__(
        self,
        kv_cache: KVCache,
        batch: StepBatch,
        *,
        attention: Callable,
        products: MatrixProducts = STACKED,
        lora: dict | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Run the step's tokens through the model (through LoRA stacks, `hidden_states`); returns (float32 logits
        [R, V] of the rows `batch.logits_indices` names, updated cache)."""
        x, kv_cache, _ = self.hidden_states(
            kv_cache, batch, attention=attention, products=products, lora=lora
        )
        return self.logits(x[batch.logits_indices], batch.num_logits[0], products), kv_cache

    def hidden_states(
        self,
        kv_cache: KVCache,
        batch: StepBatch,
        *,
        attention: Callable,
        products: MatrixProducts = STACKED,
        lora: dict | None = None,
        lora_deltas: XlaLoRA = XLA_LORA,
    ) -> tuple[jax.Array, KVCache]:
        """The last layer's output for every token [T, D] (before the final norm), the updated cache, and how many
        of the step's tokens each layer's experts took [L, E] (a mixture of experts'; [L, 0] for a dense model).
        `lora`: the adapter stacks as `lora_deltas` reads them (models/lora.py), each token's slot in
        batch.lora_slots."""
        c = self.config
        dtype = self.final_norm.weight[...].dtype
        block_size = kv_cache.k.shape[2]
        local_rotation = None
        if c.local_rope_theta is not None:
            local = replace(c, rope_theta=c.local_rope_theta, rope_scaling=None)
            local_rotation = cos_sin(batch.positions, local, dtype, batch.rope_lengths)
        step = StepContext(
            c,
            batch,
            *cos_sin(batch.positions, c, dtype, batch.rope_lengths),
            local_rotation,
            batch.slot_mapping // block_size,
            batch.slot_mapping % block_size,
            batch.query_start[batch.num_seqs[0]],
            attention,
            products,
            lora=lora if lora_deltas.whole_stacks else None,
            lora_deltas=lora_deltas,
        )
        layer_lora = None if lora_deltas.whole_stacks else lora  # sliced to each layer by the scan
        whole_paths = {{**LAYER_MATRICES, **EXPERT_MATRICES}[name] for name in products.whole_matrices}
        graphdef, whole, sliced = nnx.split(self.layers, lambda path, _: tuple(path) in whole_paths, ...)

        def layer(carry, xs):
            state, index, sliced_lora = xs
            layer_step = step if sliced_lora is None else replace(step, lora=sliced_lora)
            return nnx.merge(graphdef, whole, state)(*carry, index, layer_step)

        x = self.embed(batch.token_ids, products)
        layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
        (x, k_cache, v_cache), counts = jax.lax.scan(
            layer, (x, kv_cache.k, kv_cache.v), (sliced, layer_ids, layer_lora)
        )
        return x, KVCache(k_cache, v_cache), counts

    def logits(self, x: jax.Array, rows: jax.Array, products: MatrixProducts = STACKED) -> jax.Array:
        """float32 logits [R, V] of hidden states x [R, D], soft-capped where the config says (Gemma 2); rows past
        `rows` are padding (may be zero)."""
        tied = self.lm_head is None
        head = self.embed.weight[...] if tied else self.lm_head[...]
        logits = products.lm_head(head, self.final_norm(x), rows, tied=tied)
        cap = self.config.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


@functools.lru_cache(maxsize=32)
def model_graphdef(config: ModelConfig) -> nnx.GraphDef:
    """The static half of `nnx.split(CausalLM(config))` (built abstractly: nothing is allocated)."""
    return nnx.graphdef(nnx.eval_shape(lambda: CausalLM(config)))


def _abstract_state(config: ModelConfig, dtype) -> nnx.State:
    return nnx.state(nnx.eval_shape(lambda: CausalLM(config, dtype)))


def abstract_params(config: ModelConfig, dtype=jnp.float32) -> dict:
    """The state tree of `CausalLM(config, dtype)` as ShapeDtypeStructs: what loaders and callers must provide."""
    return nnx.to_pure_dict(_abstract_state(config, dtype))


def partition_specs(config: ModelConfig) -> dict:
    """Each weight's logical axes as a PartitionSpec (the state tree's shape)."""
    return nnx.to_pure_dict(nnx.get_partition_spec(_abstract_state(config, jnp.float32)))


def as_params(weights: dict | nnx.State | nnx.Module) -> dict:
    """The plain state dict of a CausalLM, its nnx.State, or a state dict as it is."""
    if isinstance(weights, nnx.Module):
        weights = nnx.state(weights)
    return nnx.to_pure_dict(weights) if isinstance(weights, nnx.State) else weights


def params_dtype(params: dict):
    """The dtype the model computes in: its weights'."""
    return jnp.dtype(params["final_norm"]["weight"].dtype)


def forward(
    params: dict,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    config: ModelConfig,
    attention: Callable,
    products: MatrixProducts = STACKED,
    lora: dict | None = None,
) -> tuple[jax.Array, KVCache]:
    """The model as a pure function of its state dict (for jit, grad, and the runner's step), and of LoRA stacks
    where given (models/lora.py: differentiable too, for a trainer of an adapter)."""
    model = nnx.merge(model_graphdef(config), params)
    return model(kv_cache, batch, attention=attention, products=products, lora=lora)


def is_float8_pool(dtype) -> bool:
    """Whether a pool of this dtype holds e4m3 (as itself, or as its bytes for the C++ attention)."""
    return jnp.dtype(dtype) in (jnp.float8_e4m3fn, jnp.uint8)


def as_stored(x: jax.Array, dtype) -> jax.Array:
    """x as the pool stores it: its dtype, or its raw words where the pool keeps a 16-bit float as uint16 or e4m3 as
    uint8 (see KVCache); e4m3 saturated at its largest finite value (e4m3fn has no infinity: past it is NaN)."""
    if is_float8_pool(dtype):
        limit = float(jnp.finfo(jnp.float8_e4m3fn).max)
        e4m3 = jnp.clip(x.astype(jnp.float32), -limit, limit).astype(jnp.float8_e4m3fn)
        return (
            e4m3 if jnp.dtype(dtype) == jnp.float8_e4m3fn else jax.lax.bitcast_convert_type(e4m3, jnp.uint8)
        )
    if jnp.dtype(dtype) == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(dtype)


def init_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype, allocate: Callable = jnp.zeros
) -> KVCache:
    """The pool, zero-filled unless `allocate` says otherwise (attention that reads whole pages needs finite
    values in the slots it masks)."""
    shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return KVCache(allocate(shape, dtype), allocate(shape, dtype))
