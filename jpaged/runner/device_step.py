"""The device step as two pure functions, dispatched back to back: the forward (params, KV cache, last tokens, the
packed batch) -> (KV cache, logits, hidden states, expert load), and the sampling (logits, last tokens, packed sampling inputs,
wide sampling inputs) -> (last tokens, sampled rows). The runner jits the forward once per shape bucket with the
cache donated, the sampling once per row count with the last tokens donated; prompt logprobs are a third program
over the step's hidden states, one per token bucket.

Two programs, because the sampling inputs of a constrained request (its grammar's token bitmask) can only be built
once the previous step's token reached its matcher: the host fills them while the forward runs (vLLM's
execute_model / sample_tokens split), and the forward compiles independently of which sampling variant follows.

`last_tokens` [R] holds the tokens the previous step sampled, row by row: a step scheduled before the previous
one's tokens reached the host (async scheduling) names such an input token -(row + 1), and takes it from there."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.models.llama import KVCache
from jpaged.models.lora import XLA_LORA, XlaLoRA, split_adapters
from jpaged.models.products import MatrixProducts
from jpaged.runner.expert_load import load_histogram
from jpaged.runner.packed_inputs import unpack
from jpaged.runner.sampler import gather_logprobs, sample
from jpaged.sampling_params import MAX_LOGPROBS


def forward_step(
    params,
    kv_cache,
    last_tokens,
    packed,
    *,
    layout,
    graphdef,
    attention,
    products,
    logits_sharding,
    lora_deltas=XLA_LORA,
):
    """`packed` holds the step's batch (packed_inputs.py); `params` may carry LoRA stacks (models/lora.py). Returns the KV cache, the float32 logits [S, V] of the
    rows to sample (in `logits_sharding` where a mesh splits them), every token's hidden states [T, D], which
    `prompt_logprobs` reads when a request asks for them (kept on the device otherwise), and the step's
    expert-load histogram (expert_load.py; all zero for a dense model)."""
    batch = unpack(packed, layout)
    batch = batch._replace(token_ids=with_last_tokens(batch.token_ids, last_tokens))
    params, lora = split_adapters(params)
    model = nnx.merge(graphdef, params)
    hidden, kv_cache, counts = model.hidden_states(
        kv_cache, batch, attention=attention, products=products, lora=lora, lora_deltas=lora_deltas
    )
    logits = model.logits(hidden[batch.logits_indices], batch.num_logits[0], products)
    if logits_sharding is not None:
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    return kv_cache, logits, hidden, load_histogram(counts)


def sample_step(logits, last_tokens, packed, wide, *, layout, branch_free):
    """`packed` holds the sampling tensors but their wide fields (packed_inputs.py), `wide` the wide fields
    (sampling_inputs.WIDE_FIELDS). The sampled tokens also land in `last_tokens`, where the next step's forward
    may take its inputs from."""
    sampling = unpack(packed, layout)._replace(**wide)
    sampled = sample(logits, sampling, branch_free=branch_free)
    return last_tokens.at[: logits.shape[0]].set(sampled.token_ids), sampled


def prompt_logprobs(params, hidden, targets, num_tokens, *, graphdef, products):
    """The top MAX_LOGPROBS logprobs at every token of a step, and those of each token's target (its next prompt
    token): values and ids [T, 1 + K], ranks [T]; `num_tokens` [1] of the T are real (the rest is padding)."""
    model = nnx.merge(graphdef, split_adapters(params)[0])
    return gather_logprobs(model.logits(hidden, num_tokens[0], products), targets, MAX_LOGPROBS)


def with_last_tokens(token_ids: jax.Array, last_tokens: jax.Array) -> jax.Array:
    """Input tokens with each -(row + 1) replaced by the token the previous step sampled in that row."""
    return jnp.where(token_ids < 0, jnp.take(last_tokens, jnp.maximum(-1 - token_ids, 0)), token_ids)


class StepFunctions(NamedTuple):
    """The two halves of a step, bound to one model and engine (see the module doc)."""

    forward: Callable  # forward_step(params, kv_cache, last_tokens, packed, *, layout)
    sample: Callable  # sample_step(logits, last_tokens, packed, wide, *, layout)

    def whole(self, params, kv_cache, last_tokens, batch, sampling, wide, *, batch_layout, sampling_layout):
        """Both halves as one function, for what looks at a whole step: its memory at the peak
        (activation_peak.py), its primitives (tests)."""
        kv_cache, logits, hidden, _ = self.forward(params, kv_cache, last_tokens, batch, layout=batch_layout)
        last_tokens, sampled = self.sample(logits, last_tokens, sampling, wide, layout=sampling_layout)
        return kv_cache, last_tokens, sampled, hidden


def bind_step(
    graphdef: nnx.GraphDef,
    attention: Callable,
    products: MatrixProducts,
    *,
    branch_free: bool,
    logits_sharding: jax.sharding.Sharding | None = None,
    lora_deltas: XlaLoRA = XLA_LORA,
) -> StepFunctions:
    """The step's halves for one model (the static half of its `nnx.split`), attention implementation, weight
    layout, logits sharding, LoRA stacks' layout and sampler form (all static; branch-free on accelerators, see
    sampler.py)."""
    return StepFunctions(
        functools.partial(
            forward_step,
            graphdef=graphdef,
            attention=attention,
            products=products,
            logits_sharding=logits_sharding,
            lora_deltas=lora_deltas,
        ),
        functools.partial(sample_step, branch_free=branch_free),
    )


def bind_prompt_logprobs(graphdef: nnx.GraphDef, products: MatrixProducts) -> Callable:
    return functools.partial(prompt_logprobs, graphdef=graphdef, products=products)


def copy_blocks(kv_cache: KVCache, copies: jax.Array) -> KVCache:
    """Copy block src to block dst, all layers, for each (src, dst) row of `copies` [R, 2]; padding rows are
    (0, 0), the null block onto itself. One gather and one scatter of fixed shape (no loop whose trip count the
    device decides), run by the runner before a step that has copies: no dst is also a src (dst blocks are
    fresh)."""
    src, dst = copies[:, 0], copies[:, 1]
    return KVCache(*(pages.at[:, dst].set(pages[:, src]) for pages in kv_cache))


def scatter_blocks(kv_cache: KVCache, ids: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    """Blocks `ids` of every layer set to k, v [L, len(ids), B, Hk, D] (swap-in, and copies outside a step)."""
    return KVCache(kv_cache.k.at[:, ids].set(k), kv_cache.v.at[:, ids].set(v))
