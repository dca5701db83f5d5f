"""From a schedule to one jitted device step: pad to a shape bucket, run, bring back only the sampled tokens.

Shapes are bucketed (tokens T and sequences S; see step_shapes.py) so the step compiles once per bucket at warm-up;
every compiled executable is kept in a table keyed by its shapes, so a compilation after warm-up is counted and
logged, never silent. The KV cache is donated: XLA updates it in place.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jpaged.config import EngineConfig
from jpaged.core.sequence import SequenceState
from jpaged.engine.step_sampling import step_sampling_tensors
from jpaged.models.config import ModelConfig
from jpaged.models.llama import KVCache, StepBatch, device_params, forward, init_kv_cache
from jpaged.pallas import cpu_attention, cpu_matmul, get_attention_fn, resolve_attention_impl
from jpaged.runner.executable_cache import step_cache
from jpaged.runner.sampler import (
    SamplerOutput,
    SamplingRow,
    SamplingTensors,
    gather_logprobs,
    sample,
)
from jpaged.runner.step_shapes import StepShapes

logger = logging.getLogger(__name__)


def _step(
    params,
    kv_cache,
    batch,
    sampling,
    copies,
    prompt_targets,
    *,
    config,
    attention,
    num_logprobs,
    num_prompt_logprobs,
):
    """Copy-on-write block copies, the model, then sampling: one device program.

    With `prompt_targets` [T] (the prompt-logprobs variant), the batch asks for the logits of every token after
    the S sampled rows, and the logprobs of each token's next prompt token come back too."""
    kv_cache = _copy_blocks(kv_cache, copies)
    logits, kv_cache = forward(params, kv_cache, batch, config=config, attention=attention)
    num_rows = sampling.temperature.shape[0]
    sampled = sample(logits[:num_rows], sampling, num_logprobs=num_logprobs)
    if prompt_targets is None:
        return kv_cache, sampled, None
    return kv_cache, sampled, gather_logprobs(logits[num_rows:], prompt_targets, num_prompt_logprobs)


def _copy_blocks(kv_cache: KVCache, copies: jax.Array) -> KVCache:
    """Copy block src to block dst, all layers, for each (src, dst) row of `copies` [S, 2] up to the first padding
    row (dst 0, the null block). A loop over the real copies only: most steps have none, and a batched gather and
    scatter of all S rows moved ~100 MB a step (64 rows, SmolLM2) to copy nothing."""

    def copy(i: jax.Array, cache: KVCache) -> KVCache:
        src, dst = copies[i, 0], copies[i, 1]
        return KVCache(*(pages.at[:, dst].set(pages[:, src]) for pages in cache))

    return jax.lax.fori_loop(0, jnp.sum(copies[:, 1] > 0), copy, kv_cache)


def _step_params(params: dict) -> dict:
    """The params layout the step reads: on CPU, where the matmul kernel builds and takes the dtype, its panels
    (llama.device_params); elsewhere the stacks, sliced per layer."""
    on_cpu = jax.default_backend() == "cpu"
    return device_params(params) if on_cpu and cpu_matmul.supports(params["final_norm"].dtype) else params


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        params: dict,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        self.dtype = jnp.dtype(params["embed"].dtype)
        self.params = jax.device_put(_step_params(params))
        self.shapes = StepShapes(config.max_num_batched_tokens, config.max_num_seqs)
        self.attention_impl = resolve_attention_impl(
            config.attention_impl, head_dim=model_config.head_dim, dtype=self.dtype
        )
        allocate = cpu_attention.uninitialized if self.attention_impl == "cpu" else jnp.zeros
        self.kv_cache = init_kv_cache(model_config, num_blocks, config.block_size, self.dtype, allocate)
        attention = get_attention_fn(
            self.attention_impl,
            num_kv_heads=model_config.num_kv_heads,
            block_size=config.block_size,
            head_dim=model_config.head_dim,
            dtype=self.dtype,
        )
        step = functools.partial(_step, config=model_config, attention=attention)
        self._step = jax.jit(step, static_argnames=("num_logprobs", "num_prompt_logprobs"), donate_argnums=1)
        self._saved = step_cache(config.compilation_cache_dir)
        self._compiled: dict = {}
        self._not_run: dict = {}  # warm-up shapes never run yet -> their dummy (batch, sampling); see warmup
        self.num_compilations = 0
        self.warmed_up = False
        self._move_blocks = jax.jit(_scatter_blocks, donate_argnums=0)

    # ---- batch preparation (host) ----

    def prepare(
        self,
        seqs: Sequence[SequenceState],
        num_new_tokens: Sequence[int],
        block_tables: np.ndarray,
        sample_rows: Sequence[int],
        prompt_logprob_seqs: Sequence[int] = (),
    ) -> tuple[StepBatch, int, np.ndarray | None]:
        """Flat padded arrays for the scheduled sequences (seqs[i] computes num_new_tokens[i] tokens from its
        num_computed_tokens on, with the block table in row i of `block_tables` [S', W], padded with the null
        block 0); `sample_rows[i]` is the scheduled index of sampled row i.

        `prompt_logprob_seqs` (scheduled indices) want prompt logprobs: then the batch asks for every token's
        logits too, and the third result [T] holds each of their tokens' next prompt token (the target of its
        logprob), else None."""
        num_seqs = len(seqs)
        computed_counts = [seq.num_computed_tokens for seq in seqs]
        num_new = np.array(num_new_tokens, np.int32)
        computed = np.array(computed_counts, np.int32)
        num_tokens = sum(num_new_tokens)
        t_bucket, s_bucket = self.shapes.shape_for(num_tokens, max(num_seqs, len(sample_rows)))
        query_start = np.full(s_bucket + 1, num_tokens, np.int32)
        query_start[0] = 0
        np.cumsum(num_new, out=query_start[1 : num_seqs + 1])
        token_ids = np.zeros(t_bucket, np.int32)
        positions = np.zeros(t_bucket, np.int32)
        if num_tokens == num_seqs and max(num_new_tokens, default=0) == 1:  # decodes only: one token each
            seq_of_token = np.arange(num_seqs)
            positions[:num_tokens] = computed
            token_ids[:num_tokens] = [seq.token_ids[c] for seq, c in zip(seqs, computed_counts, strict=True)]
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), num_new)
            positions[:num_tokens] = (
                np.arange(num_tokens) - query_start[seq_of_token] + computed[seq_of_token]
            )
            chunks = (
                seq.token_ids[c : c + n]
                for seq, c, n in zip(seqs, computed_counts, num_new_tokens, strict=True)
            )
            token_ids[:num_tokens] = np.fromiter(itertools.chain.from_iterable(chunks), np.int32, num_tokens)
        tables = np.zeros((s_bucket, self.max_blocks_per_seq), np.int32)
        width = min(block_tables.shape[1], self.max_blocks_per_seq)  # columns past P are padding
        tables[:num_seqs, :width] = block_tables[:, :width]
        slot_mapping = np.zeros(t_bucket, np.int32)
        live = positions[:num_tokens]
        slot_mapping[:num_tokens] = (
            tables[seq_of_token, live // self.block_size] * self.block_size + live % self.block_size
        )
        kv_lens = np.zeros(s_bucket, np.int32)
        kv_lens[:num_seqs] = computed + num_new
        logits_indices = np.zeros(s_bucket, np.int32)
        logits_indices[: len(sample_rows)] = query_start[np.asarray(sample_rows, np.int32) + 1] - 1
        num_logits = len(sample_rows)
        prompt_targets = None
        if prompt_logprob_seqs:
            num_logits = s_bucket + t_bucket  # the sampled rows' padding included
            logits_indices = np.concatenate([logits_indices, np.arange(t_bucket, dtype=np.int32)])
            prompt_targets = np.zeros(t_bucket, np.int32)
            for i in prompt_logprob_seqs:
                seq, start, first = seqs[i], query_start[i], computed[i]
                prompt = seq.request.prompt_token_ids
                # Tokens at positions first .. len(prompt) - 2 have a next prompt token; the last one has none.
                count = max(0, min(int(num_new[i]), len(prompt) - 1 - first))
                prompt_targets[start : start + count] = prompt[first + 1 : first + 1 + count]
        batch = StepBatch(
            token_ids,
            positions,
            slot_mapping,
            tables,
            query_start,
            kv_lens,
            np.array([num_seqs], np.int32),
            logits_indices,
            np.array([num_logits], np.int32),
        )
        return batch, s_bucket, prompt_targets

    def sampling_tensors(self, rows: Sequence[SamplingRow], num_rows: int) -> SamplingTensors:
        return step_sampling_tensors(rows, num_rows, self.model_config.vocab_size)

    # ---- device step ----

    def execute(
        self,
        batch: StepBatch,
        sampling: SamplingTensors,
        copies: Sequence[tuple[int, int]],
        num_logprobs: int | None,
        prompt_targets: np.ndarray | None = None,
        num_prompt_logprobs: int | None = None,
    ) -> tuple[SamplerOutput, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """Sampled rows, and with `prompt_targets` (from `prepare`) the prompt logprobs of every token:
        values and ids [T, 1 + K] (the target, then the top `num_prompt_logprobs`) and the target's rank [T]."""
        s_bucket = batch.kv_lens.shape[0]
        copy_array = np.zeros((s_bucket, 2), np.int32)
        if copies:
            copy_array[: len(copies)] = copies
        args = (self.params, self.kv_cache, batch, sampling, copy_array, prompt_targets)
        compiled = self._compiled_for(args, num_logprobs, num_prompt_logprobs)
        self.kv_cache, out, prompt = compiled(*args)
        return jax.tree_util.tree_map(np.asarray, out), jax.tree_util.tree_map(np.asarray, prompt)

    def _compiled_for(self, args, num_logprobs, num_prompt_logprobs=None):
        key = self._key(args, num_logprobs, num_prompt_logprobs)
        self._not_run.pop(key, None)
        compiled = self._compiled.get(key)
        if compiled is None:
            if self.warmed_up:
                logger.warning(
                    "compiling a new step shape after warm-up: %s, logprobs=%s, prompt logprobs=%s",
                    key[0][1],
                    num_logprobs,
                    num_prompt_logprobs,
                )
            compiled = self._compiled[key] = self._compile(args, num_logprobs, num_prompt_logprobs)
            self.num_compilations += 1
        return compiled

    @staticmethod
    def _key(args, num_logprobs, num_prompt_logprobs) -> tuple:
        shapes = tuple((np.shape(x), np.result_type(x)) for x in jax.tree_util.tree_leaves(args[2:]))
        return (jax.tree_util.tree_structure(args), shapes), num_logprobs, num_prompt_logprobs

    def _compile(self, args, num_logprobs, num_prompt_logprobs):
        """The step for these inputs: loaded from the executable cache, else traced, lowered and compiled."""
        leaves = [
            (np.shape(x), str(x.dtype), str(getattr(x, "sharding", "")))
            for x in jax.tree_util.tree_leaves(args)
        ]
        key = (
            str(jax.tree_util.tree_structure(args)),
            leaves,
            repr(self.model_config),
            self.attention_impl,
            num_logprobs,
            num_prompt_logprobs,
        )
        return self._saved.get_or_compile(
            key,
            lambda: self._step.lower(
                *args, num_logprobs=num_logprobs, num_prompt_logprobs=num_prompt_logprobs
            ).compile(),
        )

    def warmup(self, progress: bool = True) -> float:
        """Compile every (T, S) bucket pair that can occur, one compile per core at a time (XLA compiles outside
        the GIL), then run each decode-sized shape (T <= max_num_seqs) once on its dummy batch (every token writes
        to the null block 0, no sequence is live); returns the seconds taken.

        An executable's first run sets things up: XLA CPU builds each matmul's YNNPACK runtime then (~4 ms for
        each of a SmolLM2 step's ~125 matmuls: ~0.7 s a decode shape, ~1 s a 512-token one). Decode shapes run
        here because a stream's every token waits on them; the larger prefill shapes, which would add ~10 s to a
        start, wait for `run_unrun_shape` (a server runs them while idle) or pay it on first use."""
        start = time.perf_counter()
        jobs = []
        for t, s in self.shapes.all_shapes():
            batch = _dummy_batch(t, s, self.max_blocks_per_seq)
            tensors = self.sampling_tensors([], s)
            jobs.append((self.params, self.kv_cache, batch, tensors, np.zeros((s, 2), np.int32), None))
        with (
            ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool,
            tqdm(total=len(jobs), desc="warm-up (compiling step shapes)", disable=not progress) as bar,
        ):
            futures = [(args, pool.submit(self._compile, args, None, None)) for args in jobs]
            for args, future in futures:
                key = self._key(args, None, None)
                self._compiled[key] = future.result()
                self._not_run[key] = args[2:4]  # the dummy batch and sampling tensors
                self.num_compilations += 1
                bar.update(1)
        compiled_in = time.perf_counter() - start
        limit = self.config.max_num_seqs
        decode_sized = [(b, t) for b, t in self._not_run.values() if b.token_ids.shape[0] <= limit]
        for batch, tensors in tqdm(decode_sized, desc="warm-up (first runs)", disable=not progress):
            self.execute(batch, tensors, (), None)
        self.warmed_up = True
        seconds = time.perf_counter() - start
        logger.info(
            "warm-up: %d step shapes compiled (or loaded) in %.1f s, %d decode shapes run once in %.1f s",
            self.num_compilations,
            compiled_in,
            len(decode_sized),
            seconds - compiled_in,
        )
        return seconds

    @property
    def num_unrun_shapes(self) -> int:
        """Warm-up shapes that have not run yet: each pays its first-run set-up (see warmup) when it does."""
        return len(self._not_run)

    def run_unrun_shape(self) -> bool:
        """Run one warm-up shape that has not run yet on its dummy batch (the smallest first); False when none
        is left. For a loop with nothing else to do: it writes only the null block, like padding does."""
        if not self._not_run:
            return False
        batch, tensors = next(iter(self._not_run.values()))
        self.execute(batch, tensors, (), None)  # forgets the shape (_compiled_for)
        return True

    # ---- swap transfers ----

    def read_blocks(self, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(block_ids, np.int32)
        return np.asarray(self.kv_cache.k[:, ids]), np.asarray(self.kv_cache.v[:, ids])

    def write_blocks(self, block_ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> None:
        self.kv_cache = self._move_blocks(self.kv_cache, np.asarray(block_ids, np.int32), k, v)


def activation_peak_bytes(
    config: EngineConfig, model_config: ModelConfig, params: dict, max_model_len: int
) -> int:
    """Scratch memory XLA needs for the largest step bucket, read from its compiled memory analysis.

    Sizing the KV pool on an accelerator subtracts this, so the pool never squeezes out the step's activations.
    Everything is abstract (ShapeDtypeStructs): nothing is allocated to measure it.
    """
    dtype = jnp.dtype(params["embed"].dtype)
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
    batch = _dummy_batch(tokens, seqs, -(-max_model_len // config.block_size))
    sampling = step_sampling_tensors([], seqs, model_config.vocab_size)
    attention = get_attention_fn(
        config.attention_impl,
        num_kv_heads=model_config.num_kv_heads,
        block_size=config.block_size,
        head_dim=model_config.head_dim,
        dtype=dtype,
    )
    step = functools.partial(
        _step, config=model_config, attention=attention, num_logprobs=None, num_prompt_logprobs=None
    )
    copies = np.zeros((seqs, 2), np.int32)
    compiled = (
        jax.jit(step)
        .lower(jax.eval_shape(_step_params, abstract(params)), cache, batch, sampling, copies, None)
        .compile()
    )
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes) if analysis is not None else 0


def _scatter_blocks(kv_cache: KVCache, ids, k, v) -> KVCache:
    return KVCache(kv_cache.k.at[:, ids].set(k), kv_cache.v.at[:, ids].set(v))


def _dummy_batch(num_tokens: int, num_seqs: int, width: int) -> StepBatch:
    zeros = functools.partial(np.zeros, dtype=np.int32)
    return StepBatch(
        zeros(num_tokens),
        zeros(num_tokens),
        zeros(num_tokens),
        zeros((num_seqs, width)),
        zeros(num_seqs + 1),
        zeros(num_seqs),
        np.array([0], np.int32),
        zeros(num_seqs),
        np.array([0], np.int32),
    )
