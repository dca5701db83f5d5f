"""The runner of a pooling engine: the ModelRunner's weights, KV pool, shape buckets and step-program table, with
the pooling forward (pooling.py) in place of the generation forward, and no sampling. Warm-up compiles the
forward of every (T, S) bucket, so a warmed pooling engine compiles nothing more."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
from tqdm.auto import tqdm

from jpaged.runner.device_step import StepFunctions
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.packed_inputs import pack
from jpaged.runner.pooling import bind_pooling_forward
from jpaged.runner.step_batch import PreparedStep, dummy_batch
from jpaged.runner.step_programs import ProgramSet

logger = logging.getLogger(__name__)


class PoolingRunner(ModelRunner):
    """`pool(step)` in place of forward/sample: each scheduled sequence's pooled vector [S, D] (see pooling.py)."""

    def __init__(self, *args, pooling: str, **kwargs) -> None:
        self.pooling = pooling  # read by bind_step, which ModelRunner.__init__ calls
        self.program_kind = ("pooling", pooling)
        super().__init__(*args, **kwargs)

    def bind_step(self, attention: Callable) -> StepFunctions:
        generation = super().bind_step(attention)  # its sample half is never compiled here
        forward = bind_pooling_forward(self.graphdef, attention, self.products, self.pooling)
        return StepFunctions(forward, generation.sample)

    def pool(self, step: PreparedStep) -> jax.Array:
        """Run the step: its KV written, each row's pooled float32 vector [S, D] returned (on the device)."""
        packed, layout = pack(step.batch)
        self._not_run.pop(layout, None)
        compiled = self.programs.forward(layout)
        self.kv_cache, pooled = compiled(self.params, self.kv_cache, self.last_tokens, packed)
        return pooled

    def warmup(self, progress: bool = True, progressive: bool = False) -> float:
        """Compile the pooling forward of every (T, S) bucket pair, then run the decode-sized ones once (see
        ModelRunner.warmup); returns the seconds taken. Always whole: an embedding engine's steps are few and
        short, and `progressive` is not staged here."""
        start = time.perf_counter()
        steps = [
            PreparedStep(dummy_batch(t, s, self.max_blocks_per_seq)) for t, s in self.shapes.all_shapes()
        ]
        layouts = [pack(step.batch)[1] for step in steps]
        self.programs.add(self.programs.compile_set(ProgramSet(tuple(layouts)), progress=progress))
        self._not_run.update(zip(layouts, steps, strict=True))
        if self.kv_pool_mapper is not None:
            self.kv_pool_mapper.map_now()
        limit = self.config.max_num_seqs
        small = [step for step in steps if step.batch.token_ids.shape[0] <= limit]
        for step in tqdm(small, desc="warm-up (first runs)", disable=not progress):
            self.pool(step).block_until_ready()
        self.programs.warmed_up = True
        seconds = time.perf_counter() - start
        logger.info(
            "warm-up: %d pooling programs compiled (or loaded) in %.1f s", self.num_compilations, seconds
        )
        return seconds

    def run_unrun_shape(self) -> bool:
        if not self._not_run:
            return False
        self.pool(next(iter(self._not_run.values()))).block_until_ready()
        return True
