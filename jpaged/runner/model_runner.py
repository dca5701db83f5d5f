"""From a schedule to a jitted device step: pad to a shape bucket, run, bring back only the sampled tokens.

A step is two programs (device_step.py): the forward, compiled once per shape bucket (tokens T and sequences S;
see step_shapes.py), and the sampling, once per row count and sampling variant. Both compile at warm-up, into
tables keyed by their input layouts (step_programs.py), so a compilation after warm-up is counted and logged, never
silent. The KV cache is donated: XLA updates it in place.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jpaged.config import EngineConfig
from jpaged.models.config import ModelConfig
from jpaged.models.llama import KVCache, init_kv_cache, model_graphdef, params_dtype
from jpaged.models.lora import ADAPTERS, XLA_LORA
from jpaged.models.lora_weights import lora_shapes
from jpaged.pallas import get_attention_fn, resolve_attention_impl
from jpaged.pallas.common import FP8_PAGES
from jpaged.pallas.cpu import attention as cpu_attention
from jpaged.pallas.cpu import huge_pages
from jpaged.rounding import cdiv
from jpaged.runner.background_warmup import BackgroundWarmup
from jpaged.runner.device_step import (
    StepFunctions,
    bind_prompt_logprobs,
    bind_step,
    copy_blocks,
    scatter_blocks,
)
from jpaged.runner.expert_parallel import expert_parallel_products
from jpaged.runner.kv_pool_mapper import KVPoolMapper
from jpaged.runner.kv_transfer import HostSwapSpace
from jpaged.runner.lora_stacks import lora_layout, lora_stacks
from jpaged.runner.packed_inputs import pack
from jpaged.runner.sampling_inputs import (
    SamplingRow,
    SamplingTensors,
    SamplingWidths,
    build_sampling_tensors,
    neutral_wide,
    split_wide,
)
from jpaged.runner.step_batch import PreparedStep, StepSchedule, dummy_batch, pad_batch
from jpaged.runner.step_output import PendingOutput
from jpaged.runner.step_programs import ProgramInputs, ProgramSet, StepPrograms
from jpaged.runner.step_shapes import StepShapes
from jpaged.runner.tensor_parallel import (
    kv_head_copies,
    kv_sharding,
    logits_sharding,
    shard_attention,
    tensor_parallel_config,
    tensor_parallel_mesh,
)
from jpaged.runner.warmup_stages import WarmupStage, warmup_stages
from jpaged.runner.weight_layout import choose_products, tensor_parallel_products
from jpaged.runner.weight_placement import WeightPlacement

logger = logging.getLogger(__name__)


def _in_huge_pages(arrays, what: str):
    """`arrays`, on a CPU in memory asked for as huge pages (jpaged/pallas/cpu/huge_pages.py says why)."""
    logger.debug("%s: %.0f MiB asked for in huge pages", what, huge_pages.advise(arrays) / 2**20)
    return arrays


class ModelRunner:
    """The device side of an engine: the weights, the KV pool, the compiled step programs."""

    failure: str | None = None  # why the devices cannot go on (a multi-process engine's lost follower)

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        params: dict,
        num_blocks: int,
        max_model_len: int,
        num_swap_blocks: int = 0,
    ) -> None:
        self.config = config
        tp = config.tensor_parallel_size
        loaded_config = model_config  # the weights' shapes as loaded; model_config is the one run
        self.model_config = model_config = tensor_parallel_config(tp, model_config)
        self.block_size = config.block_size
        self.max_blocks_per_seq = cdiv(max_model_len, config.block_size)
        self.dtype = params_dtype(params)
        self.mesh = tensor_parallel_mesh(tp, loaded_config) if tp > 1 else None
        self.products = products = (
            tensor_parallel_products(params, model_config, tp, config.quantization)
            if self.mesh
            else choose_products(
                params, activation=model_config.hidden_activation, quantization=config.quantization
            )
        )
        if self.mesh and config.enable_expert_parallel:
            self.products = products = expert_parallel_products(products, self.mesh, model_config)
        if config.enable_lora and getattr(products, "gated_form", False):
            # A LoRA delta joins gate|up before the activation: the kernel's gated form computes it on its sums.
            self.products = products = dataclasses.replace(products, gated_form=False)
        kv_copies = kv_head_copies(tp, loaded_config)
        self.weights = (
            WeightPlacement.over(
                self.mesh, products, loaded_config, kv_copies, params, config.enable_expert_parallel
            )
            if self.mesh
            else WeightPlacement(products, loaded_config, kv_copies)
        )
        self.params = _in_huge_pages(self.weights.place(params), "weights")
        self._host_params = None  # the weights while asleep (sleep level 1)
        self.shapes = StepShapes(config.max_num_batched_tokens, config.max_num_seqs)
        self.attention_impl = resolve_attention_impl(
            config.attention_impl, head_dim=model_config.head_dim, dtype=self.dtype
        )
        # Accelerators run the step without device-decided branches (see sampler.py).
        self.branch_free = jax.default_backend() != "cpu"
        self.num_blocks = num_blocks
        # The C++ kernel reads a bfloat16 pool as its 16-bit words, which XLA writes in place (see KVCache).
        words = self.attention_impl == "cpu" and self.dtype == jnp.bfloat16
        self.kv_dtype = jnp.dtype(jnp.uint16) if words else self.dtype
        if (
            config.fp8_kv_cache
        ):  # as its bytes for the C++ kernel: XLA CPU copies a float8 pool on every write
            self.kv_dtype = jnp.dtype(jnp.uint8 if self.attention_impl == "cpu" else jnp.float8_e4m3fn)
        self.kv_cache = self._allocate_kv_cache()
        # Each step's sampled tokens, which the next step may take its inputs from (device_step.py).
        replicated = NamedSharding(self.mesh, PartitionSpec()) if self.mesh else None
        self.last_tokens = jax.device_put(np.zeros(max(self.shapes.seq_sizes), np.int32), replicated)
        self.sampling_widths = SamplingWidths(model_config.vocab_size, max_model_len)
        # The wide sampling fields of rows that need none, per row count: kept on the device, never re-sent.
        self._neutral_wide = {
            seqs: jax.device_put(neutral_wide(seqs, self.sampling_widths), replicated)
            for seqs in {s for _, s in self.shapes.all_shapes()}
        }
        if self.mesh:
            logger.info(
                "tensor parallel over %s: %.1f MiB of weights and %.1f MiB of KV pool per device",
                self.mesh.devices.tolist(),
                sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree_util.tree_leaves(self.params))
                / 2**20,
                sum(pages.addressable_shards[0].data.nbytes for pages in self.kv_cache) / 2**20,
            )
        self.swap_space = None
        if config.preemption_mode == "swap" and num_swap_blocks:
            mc = model_config
            shape = (mc.num_layers, num_swap_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
            self.swap_space = HostSwapSpace(shape, self.kv_dtype)
        self.graphdef = model_graphdef(model_config)
        attention = attention_for(config, model_config, self.attention_impl, self.dtype)
        if self.mesh:
            attention = shard_attention(attention, self.mesh)
        self._logits_sharding = logits_sharding(self.mesh, model_config.vocab_size) if self.mesh else None
        # The adapter slots (with enable_lora): the step reads them beside the weights (models/lora.py).
        self.lora = self.lora_deltas = None
        if config.enable_lora:
            shapes = lora_shapes(loaded_config, config.max_lora_rank)
            self.lora_deltas = lora_layout(products, shapes, config.max_loras, jax.default_backend())
            self.lora = lora_stacks(
                config, loaded_config, shapes, self.dtype, self.mesh, self.weights, self.lora_deltas
            )
        step = self.bind_step(attention)
        inputs = ProgramInputs.of(
            self.step_weights,
            self.kv_cache,
            self.last_tokens,
            self._neutral_wide,
            self._logits_sharding,
            jax.ShapeDtypeStruct((1, model_config.hidden_size), self.dtype, sharding=replicated),
            model_config.vocab_size,
        )
        self.programs = StepPrograms(
            jax.jit(step.forward, static_argnames=("layout",), donate_argnums=(1,)),
            jax.jit(step.sample, static_argnames=("layout",), donate_argnums=(1,)),
            jax.jit(bind_prompt_logprobs(self.graphdef, products)),
            jax.jit(copy_blocks, donate_argnums=0),
            inputs,
            config.compilation_cache_dir,
            # The products decide the program too (expert parallelism's form, for one), not only its inputs.
            (
                repr(model_config),
                repr(products),
                self.attention_impl,
                self.branch_free,
                repr(self.lora_deltas),
                *self.program_kind,
            ),
        )
        if self.lora is not None:
            self.lora.compile_writer(self.programs.compile)
        self._not_run: dict = {}  # warm-up shapes never run yet -> their dummy (batch, sampling); see warmup
        # The dispatched forward's (logits, prompt logprobs), until `sample` takes them.
        self._forwarded = None
        self._scatter_blocks = jax.jit(scatter_blocks, donate_argnums=0)
        # Steps of at most (tokens, sequence rows) have every program they need; warm-up may lower it for a while.
        self.step_limits = (config.max_num_batched_tokens, config.max_num_seqs)
        # The stages still compiling (a progressive warm-up).
        self.background_warmup: BackgroundWarmup | None = None

    # What the step programs compute beyond the model (the pooling runner's forward pools): part of their key
    # in the executable cache, so programs of different kinds over one model never stand in for each other.
    program_kind: tuple[str, ...] = ()

    def bind_step(self, attention: Callable) -> StepFunctions:
        """The step's two halves for this model (device_step.py); a runner of another kind (pooling) binds its
        own forward."""
        return bind_step(
            self.graphdef,
            attention,
            self.products,
            branch_free=self.branch_free,
            logits_sharding=self._logits_sharding,
            lora_deltas=self.lora_deltas or XLA_LORA,
        )

    # ---- a step ----

    def prepare(self, schedule: StepSchedule) -> PreparedStep:
        """The schedule as the padded inputs of its shape bucket."""
        return pad_batch(schedule, self.shapes, self.block_size, self.max_blocks_per_seq)

    def sampling_tensors(self, rows: Sequence[SamplingRow], num_rows: int) -> SamplingTensors:
        """Branch-free, top_k/top_p only when some row truncates (a variant warm-up compiles; see sampler.py)."""
        return build_sampling_tensors(rows, num_rows, self.sampling_widths, truncation=not self.branch_free)

    def dispatch(self, step: PreparedStep, sampling: SamplingTensors) -> PendingOutput:
        """`forward` then `sample`: the whole step, for sampling inputs known before it starts."""
        self.forward(step)
        return self.sample(sampling)

    def forward(self, step: PreparedStep) -> None:
        """Start the step's forward (and its prompt logprobs) on the device and return at once (JAX dispatches
        asynchronously): the host builds the sampling inputs meanwhile, for `sample`, which must come next."""
        packed, layout = pack(step.batch)
        self._not_run.pop(layout, None)
        compiled = self.programs.forward(layout)
        self.kv_cache, logits, hidden, load = compiled(
            self.step_weights, self.kv_cache, self.last_tokens, packed
        )
        prompt = None
        if step.prompt_targets is not None:
            num_tokens = np.array([step.batch.query_start[step.batch.num_seqs[0]]], np.int32)
            program = self.programs.prompt(len(step.prompt_targets))
            prompt = program(self.step_weights, hidden, step.prompt_targets, num_tokens)
        self._forwarded = (logits, prompt, load if self.model_config.num_experts else None)

    @property
    def step_weights(self) -> dict:
        """What the step multiplies by: the weights, and the adapter stacks where there are (models/lora.py)."""
        return self.params if self.lora is None else {**self.params, ADAPTERS: self.lora.stacks}

    @property
    def forward_running(self) -> bool:
        """Whether the forward just dispatched is still on the device: the host's work before `sample` is hidden
        behind it while it is."""
        return self._forwarded is not None and not self._forwarded[0].is_ready()

    def sample(self, sampling: SamplingTensors) -> PendingOutput:
        """Sample the forward just dispatched; its outputs follow to the host while the host goes on."""
        if self._forwarded is None:
            raise RuntimeError("sample() needs a forward() dispatched before it")
        (logits, prompt, load), self._forwarded = self._forwarded, None
        packed, layout, wide = self._sampling_inputs(sampling)
        program = self.programs.sample(layout, wide["history"].shape[1])
        self.last_tokens, sampled = program(logits, self.last_tokens, packed, wide)
        return PendingOutput(sampled, prompt, load)

    def _sampling_inputs(self, sampling: SamplingTensors):
        """The sampling tensors' packed buffer (one transfer), its layout, and the wide fields: the host's where
        it built them, the device's neutral ones elsewhere."""
        small, wide = split_wide(sampling)
        packed, layout = pack(small)
        neutral = self._neutral_wide[sampling.temperature.shape[0]]
        return packed, layout, {name: neutral[name] if v is None else v for name, v in wide.items()}

    @property
    def num_compilations(self) -> int:
        return self.programs.num_compilations

    # ---- warm-up ----

    def _dummy_sampling(self, num_seqs: int) -> list[SamplingTensors]:
        """Sampling tensors of `num_seqs` rows of no live sequence, in each variant the host may choose
        (branch-free: with and without top-k/top-p)."""
        variants = [self.sampling_tensors([], num_seqs)]
        if self.branch_free:
            variants.append(build_sampling_tensors([], num_seqs, self.sampling_widths))
        return variants

    def warmup(self, progress: bool = True, progressive: bool = False) -> float:
        """Compile every program a step can need (warmup_stages.py: the forward of every (T, S) bucket pair, the
        sampling of every S in each variant and history width, the prompt logprobs of every T, the block copies),
        one compile per core at a time (XLA compiles outside the GIL), then run each decode-sized shape (T <=
        max_num_seqs) once on its dummy batch (every token writes to the null block 0, no sequence is live);
        returns the seconds taken. `progressive`: only the first stage now, the rest on a thread of its own
        (background_warmup.py), the step limits rising as they land (`take_landed_stages`). A CPU KV pool's first
        blocks are mapped in before it returns, or with `progressive` while the engine idles (kv_pool_mapper.py).

        An executable's first run sets things up (XLA CPU builds each matmul's YNNPACK runtime then; see
        scripts/KERNELS.md). Decode shapes run here because a stream's every token waits on them; the larger
        prefill shapes, which would lengthen a start, wait for `run_unrun_shape` (a server runs them while idle)
        or pay it on first use."""
        start = time.perf_counter()
        stages = [(stage, self._stage_programs(stage)) for stage in warmup_stages(self.shapes)]
        now, later = (stages[:1], stages[1:]) if progressive else (stages, [])
        programs = ProgramSet.joined([programs for _, programs in now])
        self.programs.add(self.programs.compile_set(programs, progress=progress))
        self.step_limits = (now[-1][0].max_num_batched_tokens, now[-1][0].max_num_seqs)
        self._add_unrun(shape for stage, _ in now for shape in stage.shapes)
        if self.kv_pool_mapper is not None and not progressive:
            self.kv_pool_mapper.map_now()
        compiled_in = time.perf_counter() - start
        decode_sized = [
            (p, t)
            for p, t in self._not_run.values()
            if p.batch.token_ids.shape[0] <= self.config.max_num_seqs
        ]
        for step, tensors in tqdm(decode_sized, desc="warm-up (first runs)", disable=not progress):
            self.dispatch(step, tensors).result()
        self.programs.warmed_up = True
        if later:
            self.background_warmup = BackgroundWarmup(later, self.programs.compile_set)
        if self.kv_pool_mapper is not None and progressive:
            self.kv_pool_mapper.map_while_idle()
        seconds = time.perf_counter() - start
        logger.info(
            "warm-up: %d step programs compiled (or loaded) in %.1f s, %d decode shapes run once in %.1f s; %s",
            self.num_compilations,
            compiled_in,
            len(decode_sized),
            seconds - compiled_in,
            f"steps of up to {self.step_limits[0]} tokens and {self.step_limits[1]} sequences until the "
            f"{self.warmup_programs_remaining} programs left compile in the background"
            if later
            else "every step shape ready",
        )
        return seconds

    def _stage_programs(self, stage: WarmupStage) -> ProgramSet:
        """A warm-up stage's programs, by the layouts of its dummy batches and sampling tensors."""
        forwards = tuple(pack(self._dummy_step(t, s).batch)[1] for t, s in stage.shapes)
        samplings = tuple(
            (self._sampling_inputs(tensors)[1], width)
            for rows in stage.sampling_rows
            for tensors in self._dummy_sampling(rows)
            for width in self.sampling_widths.history_widths
        )
        return ProgramSet(forwards, samplings, stage.prompt_tokens, stage.copy_rows)

    def _dummy_step(self, num_tokens: int, num_seqs: int) -> PreparedStep:
        return PreparedStep(
            dummy_batch(num_tokens, num_seqs, self.max_blocks_per_seq, lora=self.lora is not None)
        )

    def _add_unrun(self, shapes) -> None:
        """The (T, S) forwards just compiled join the shapes to run once (see warmup), smallest first."""
        for num_tokens, num_seqs in shapes:
            step = self._dummy_step(num_tokens, num_seqs)
            self._not_run[pack(step.batch)[1]] = (step, self._dummy_sampling(num_seqs)[0])

    def take_landed_stages(self) -> bool:
        """Add the programs the background warm-up compiled since the last call and raise `step_limits` to
        what they allow; True when they rose. Called from the engine's thread, between steps."""
        if self.background_warmup is None:
            return False
        landed = self.background_warmup.take()
        for stage in landed:
            self.programs.add(stage.compiled)
            self._add_unrun(stage.stage.shapes)
            self.step_limits = (stage.stage.max_num_batched_tokens, stage.stage.max_num_seqs)
            logger.info(
                "warm-up: steps of up to %d tokens and %d sequences ready (%d programs in %.1f s in the background); "
                "%d programs left",
                *self.step_limits,
                len(stage.compiled),
                stage.seconds,
                self.warmup_programs_remaining,
            )
        if not self.warmup_programs_remaining:
            self.background_warmup = None
        return bool(landed)

    def engine_idle(self, idle: bool) -> None:
        """Whether the engine has no request to step: the KV pool's background mapping runs only while it has
        none (kv_pool_mapper.py)."""
        if self.kv_pool_mapper is not None:
            self.kv_pool_mapper.engine_idle(idle)

    @property
    def warmup_programs_remaining(self) -> int:
        """Programs the background warm-up has not handed over yet (0 once every step shape is ready)."""
        return 0 if self.background_warmup is None else self.background_warmup.remaining

    @property
    def num_unrun_shapes(self) -> int:
        """Warm-up shapes that have not run yet: each pays its first-run set-up (see warmup) when it does."""
        return len(self._not_run)

    def run_unrun_shape(self) -> bool:
        """Run one warm-up shape that has not run yet on its dummy batch (the smallest first); False when none
        is left. For a loop with nothing else to do: it writes only the null block, like padding does."""
        if not self._not_run:
            return False
        step, tensors = next(iter(self._not_run.values()))
        self.dispatch(step, tensors).result()  # forgets the shape (_compiled_for)
        return True

    # ---- weights and memory between steps ----

    def _allocate_kv_cache(self) -> KVCache:
        allocate = cpu_attention.uninitialized if self.attention_impl == "cpu" else jnp.zeros
        if self.mesh:
            sharding = kv_sharding(self.mesh)
            allocate = lambda shape, dtype: jax.jit(  # noqa: E731
                lambda: jnp.zeros(shape, dtype), out_shardings=sharding
            )()
        mc = self.model_config
        kv_cache = _in_huge_pages(
            init_kv_cache(mc, self.num_blocks, self.block_size, self.kv_dtype, allocate), "KV pool"
        )
        # The C++ kernel's pool is mapped in ahead of its first writes by warm-up (kv_pool_mapper.py): as much as a
        # full batch of max_model_len sequences can hold, lowest blocks first (those the first requests write). The
        # rest, prefix cache only, maps in as written.
        self.kv_pool_mapper = None
        if allocate is cpu_attention.uninitialized:
            blocks = 1 + self.config.max_num_seqs * self.max_blocks_per_seq
            self.kv_pool_mapper = KVPoolMapper(cpu_attention.pool_spans(kv_cache), blocks)
        return kv_cache

    def update_weights(self, params: dict) -> None:
        """Run on these weights from the next step (the loaders' layout; the engine checks that they match the
        compiled steps' inputs leaf for leaf, so nothing recompiles). Asleep, they wait in host memory."""
        if self.asleep:
            self._host_params = jax.device_get(self.weights.layout(params))
        else:
            self.params = _in_huge_pages(self.weights.place(params), "weights")

    @property
    def asleep(self) -> bool:
        return self.kv_cache is None

    def sleep(self, level: int) -> None:
        """Give the device memory back: the KV pool is deleted; the weights are let go of (level 1 keeps a copy in
        host memory for wake_up; level 2 keeps none, so update_weights must bring them back first). Arrays the
        caller still holds (a trainer's own weights) stay theirs."""
        if level not in (1, 2):
            raise ValueError(
                f"level must be 1 (keep the weights on the host) or 2 (drop them), got {level!r}"
            )
        for pages in self.kv_cache:
            pages.delete()
        self.kv_cache = None
        self._host_params = jax.device_get(self.params) if level == 1 else None
        self.params = None

    def wake_up(self) -> None:
        """The pool and the weights back on the device, in the shapes the compiled steps take."""
        if self._host_params is None:
            raise ValueError("the weights were dropped by sleep(level=2): call update_weights before wake_up")
        self.params = _in_huge_pages(self.weights.to_device(self._host_params), "weights")
        self._host_params = None
        self.kv_cache = self._allocate_kv_cache()
        if self.kv_pool_mapper is not None:  # a waking engine's requests come at once: map when it idles
            self.kv_pool_mapper.map_while_idle()

    def write_lora(self, slot: int, weights: dict) -> None:
        """Adapter slot `slot` set to these weights (lora_stacks.LoRAStacks.write), before the step that reads it."""
        self.lora.write(slot, weights)

    # ---- KV blocks outside a step ----

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write copies (src, dst), before the step that writes into them: up to the step limits' sequence
        count at a time, padded to a copy size (each compiled at warm-up; most steps have none)."""
        if not copies:  # most steps
            return
        sizes = [rows for rows in self.shapes.copy_sizes if rows <= self.step_limits[1]]
        for start in range(0, len(copies), sizes[-1]):
            chunk = copies[start : start + sizes[-1]]
            rows = next(rows for rows in sizes if rows >= len(chunk))
            padded = np.zeros((rows, 2), np.int32)  # (0, 0): the null block onto itself
            padded[: len(chunk)] = chunk
            self.kv_cache = self.programs.copy(rows)(self.kv_cache, padded)

    def swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """Blocks to host memory (swap_out: (block, slot)) and back (swap_in: (slot, block))."""
        if swap_out or swap_in:
            self.swap_space.transfer(self, swap_out, swap_in)

    def read_blocks(self, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(block_ids, np.int32)
        return np.asarray(self.kv_cache.k[:, ids]), np.asarray(self.kv_cache.v[:, ids])

    def write_blocks(self, block_ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> None:
        self.kv_cache = self._scatter_blocks(self.kv_cache, np.asarray(block_ids, np.int32), k, v)


def attention_for(config: EngineConfig, model_config: ModelConfig, impl: str, dtype) -> Callable:
    return get_attention_fn(
        impl,
        num_q_heads=model_config.num_heads,
        num_kv_heads=model_config.num_kv_heads,
        kv_dtype=FP8_PAGES if config.fp8_kv_cache else dtype,
        block_size=config.block_size,
        head_dim=model_config.head_dim,
        dtype=dtype,
    )
