"""RL post-training with jpaged generating the rollouts in-process: a tiny random-init Llama policy learns a toy
reward by REINFORCE with group baselines (GRPO-style), optax updating its weights and `LLM.update_weights` handing
them to the engine every step, with no copy through disk and no recompilation.

The reward: the share of a rollout's tokens below `--target-below` (a tenth of the policy's small vocabulary by
default; the embedded model's tokenizer only stands in, as rollouts stay token ids). The training forward pass is
jpaged's own CausalLM (`models.llama.forward` merges it with the state dict optax updates) with a differentiable
dense causal attention injected in place of the paged kernels.

With --lora R the policy's weights stay frozen and only a rank-R LoRA adapter on all seven layer matrices trains
(in the engine's own layout, models/lora_weights.adapter_from_layout: the training forward reads the same stacks the
engine serves); `LLM.update_lora` swaps it into its device slot every step.

  python scripts/rl_rollout_demo.py                 # 20 steps, 4 prompts x 4 samples of 16 tokens
  python scripts/rl_rollout_demo.py --steps 2       # a quick check
  python scripts/rl_rollout_demo.py --lora 8        # train a rank-8 adapter only
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jpaged.entrypoints.llm import LLM  # noqa: E402
from jpaged.lora_request import LoRARequest  # noqa: E402
from jpaged.models.config import ModelConfig  # noqa: E402
from jpaged.models.llama import StepBatch, forward, init_kv_cache  # noqa: E402
from jpaged.models.loader import load_model  # noqa: E402
from jpaged.models.lora_weights import lora_shapes  # noqa: E402
from jpaged.models.params import random_params  # noqa: E402
from jpaged.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
POLICY = LoRARequest("policy", 1)  # --lora: the adapter being trained, given to the engine as arrays


def policy_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )


def dense_attention(
    q, k_cache, v_cache, layer, kv_lens, block_tables, query_start, num_seqs, *, sm_scale, **_
):
    """Causal attention of S equal-length sequences, each in its own pages: no data-dependent loops, so it can be
    differentiated (the paged kernels loop over each sequence's own pages)."""
    num_seqs_static, pages = block_tables.shape
    length = q.shape[0] // num_seqs_static
    _, _, _, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads

    def pages_of(cache):
        return cache[layer][block_tables].reshape(num_seqs_static, pages * BLOCK_SIZE, num_kv_heads, head_dim)

    k, v = pages_of(k_cache)[:, :length], pages_of(v_cache)[:, :length]
    queries = q.reshape(num_seqs_static, length, num_kv_heads, group, head_dim)
    scores = jnp.einsum("sthgd,skhd->shgtk", queries, k).astype(jnp.float32) * sm_scale
    causal = jnp.tril(jnp.ones((length, length), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(q.dtype)
    return jnp.einsum("shgtk,skhd->sthgd", probs, v).reshape(q.shape)


def training_batch(num_seqs: int, length: int, tokens: jax.Array) -> StepBatch:
    """Whole sequences as one step over a fresh cache: sequence s in blocks 1 + s * pages ..., every logit kept."""
    pages = -(-length // BLOCK_SIZE)
    positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), num_seqs)
    seq = jnp.repeat(jnp.arange(num_seqs, dtype=jnp.int32), length)
    tables = 1 + jnp.arange(num_seqs * pages, dtype=jnp.int32).reshape(num_seqs, pages)
    slots = tables[seq, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    total = num_seqs * length
    return StepBatch(
        tokens.reshape(-1),
        positions,
        slots,
        tables,
        jnp.arange(num_seqs + 1, dtype=jnp.int32) * length,
        jnp.full(num_seqs, length, jnp.int32),
        jnp.array([num_seqs], jnp.int32),
        jnp.arange(total, dtype=jnp.int32),
        jnp.array([total], jnp.int32),
    )


def initial_adapter(config: ModelConfig, rank: int, seed: int) -> dict:
    """A LoRA adapter in the engine's layout that changes nothing yet: A random, B zero (PEFT's initialisation)."""
    rng = np.random.default_rng(seed)
    return {
        name: {
            "a": jnp.asarray(rng.normal(0, fan_in**-0.5, (config.num_layers, fan_in, width)), jnp.float32),
            "b": jnp.zeros((config.num_layers, width, fan_out), jnp.float32),
        }
        for name, (fan_in, width, fan_out) in lora_shapes(config, rank).items()
    }


def token_logprobs(
    params: dict, tokens: jax.Array, config: ModelConfig, adapter: dict | None = None
) -> jax.Array:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) under the policy (through `adapter` where given), [S, T - 1]."""
    num_seqs, length = tokens.shape
    cache = init_kv_cache(config, 1 + num_seqs * -(-length // BLOCK_SIZE), BLOCK_SIZE, jnp.float32)
    batch = training_batch(num_seqs, length, tokens)
    lora = None
    if adapter is not None:  # one slot, every token in it
        lora = {name: {part: w[:, None] for part, w in pair.items()} for name, pair in adapter.items()}
        batch = batch._replace(lora_slots=jnp.ones(num_seqs * length, jnp.int32))
    logits, _ = forward(params, cache, batch, config=config, attention=dense_attention, lora=lora)
    logp = jax.nn.log_softmax(logits.reshape(num_seqs, length, -1)[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def policy_loss(trained, frozen, tokens, output_mask, advantages, config):
    """REINFORCE with the group baseline: -mean over generated tokens of advantage x log-probability. `trained`:
    the weights (`frozen` None), or the adapter over the `frozen` weights."""
    params, adapter = (trained, None) if frozen is None else (frozen, trained)
    logp = token_logprobs(params, tokens, config, adapter)
    return -jnp.sum(advantages[:, None] * logp * output_mask) / jnp.sum(output_mask)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument(
        "--samples", type=int, default=4, help="rollouts per prompt (the group of its baseline)"
    )
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--target-below", type=int, default=None, help="rewarded token ids (default V / 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", type=int, default=0, help="train only a LoRA adapter of this rank")
    args = parser.parse_args()

    tokenizer = load_model(
        None, progress=False
    ).tokenizer  # unused by token-id rollouts, but the engine wants one
    config = policy_config(args.vocab_size)
    target = args.target_below or config.vocab_size // 10
    params = jax.device_put(random_params(config, args.seed))
    rows = args.prompts * args.samples
    length = args.prompt_len + args.max_tokens
    llm = LLM.from_params(
        params,
        config,
        tokenizer,
        max_model_len=length,
        max_num_seqs=rows,
        max_num_batched_tokens=max(rows * args.prompt_len, rows),
        num_blocks=1 + rows * -(-length // BLOCK_SIZE),
        enforce_eager=True,  # compiles the few shapes the rollouts meet, on first use
        seed=args.seed,
        **(dict(enable_lora=True, max_lora_rank=args.lora) if args.lora else {}),
    )
    trained, frozen, lora_request = params, None, None
    if args.lora:
        trained, frozen, lora_request = initial_adapter(config, args.lora, args.seed), params, POLICY
        llm.add_lora(POLICY, trained)
    rng = np.random.default_rng(args.seed)
    prompts = np.repeat(
        rng.integers(0, config.vocab_size, (args.prompts, args.prompt_len)), args.samples, axis=0
    )
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, detokenize=False)
    optimizer = optax.adam(args.learning_rate)
    opt_state = optimizer.init(trained)
    grad_fn = jax.jit(jax.value_and_grad(functools.partial(policy_loss, config=config)))
    output_mask = (jnp.arange(1, length) >= args.prompt_len).astype(jnp.float32)[None, :]

    generation = training = 0.0
    compilations = None
    print(f"{rows} rollouts of {args.max_tokens} tokens a step; reward: share of tokens below {target}")
    print("| step | mean reward |")
    print("|---|---|")
    for step in range(args.steps):
        start = time.perf_counter()
        rollouts = llm.generate_arrays(prompts, sampling_params=sampling, lora_request=lora_request)
        generated = time.perf_counter()
        rewards = jnp.mean((rollouts.tokens < target).astype(jnp.float32), axis=1)
        groups = rewards.reshape(args.prompts, args.samples)
        advantages = (
            (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)
        ).reshape(-1)
        tokens = jnp.concatenate([jnp.asarray(prompts, jnp.int32), rollouts.tokens], axis=1)
        _, grads = grad_fn(trained, frozen, tokens, output_mask, advantages)
        updates, opt_state = optimizer.update(grads, opt_state, trained)
        trained = optax.apply_updates(trained, updates)
        if args.lora:
            llm.update_lora(POLICY.lora_name, trained)
        else:
            llm.update_weights(trained)
        jax.block_until_ready(trained)
        generation += generated - start
        training += time.perf_counter() - generated
        if step == 0:
            compilations = llm.metrics()["num_compilations"]
        print(f"| {step} | {float(rewards.mean()):.3f} |")
    total = generation + training
    print(
        f"\nrollouts/s {rows * args.steps / generation:.1f}; time in generation {generation / total:.0%}, "
        f"in training {training / total:.0%} (first step's compiles included)"
    )
    print(f"compilations after the first step: {llm.metrics()['num_compilations'] - compilations}")
    print("command: python scripts/rl_rollout_demo.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
