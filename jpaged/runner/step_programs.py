"""The step's compiled programs, one per input layout: each loaded from the executable cache or compiled, at warm-up
(in sets, possibly in the background: warmup_stages.py) or when a step first needs it, which is counted apart
because that compile is a wait paid by live requests (the num_live_compilations metric).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jpaged.runner.executable_cache import step_cache
from jpaged.runner.packed_inputs import PackedLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProgramInputs:
    """What the programs are lowered for besides their layouts: the runner's arrays as shapes, dtypes and
    shardings (the arrays themselves are donated and replaced step by step)."""

    params: Any
    kv_cache: Any
    last_tokens: Any
    neutral_wide: dict[int, dict]  # row count -> the sampling's wide fields
    logits_sharding: Any
    hidden: jax.ShapeDtypeStruct  # one token's hidden state, with the prompt-logprobs input's sharding
    vocab_size: int

    @classmethod
    def of(
        cls, params, kv_cache, last_tokens, neutral_wide, logits_sharding, hidden, vocab_size
    ) -> ProgramInputs:
        return cls(
            *(abstract(tree) for tree in (params, kv_cache, last_tokens, neutral_wide)),
            logits_sharding,
            hidden,
            vocab_size,
        )


@dataclass(frozen=True)
class ProgramSet:
    """Programs compiled together: forwards by batch layout, samplings by (layout, history width), prompt logprobs
    by token count, copy-on-write copies by row count."""

    forwards: tuple[PackedLayout, ...] = ()
    samplings: tuple[tuple[PackedLayout, int], ...] = ()
    prompts: tuple[int, ...] = ()
    copies: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.forwards) + len(self.samplings) + len(self.prompts) + len(self.copies)

    @classmethod
    def joined(cls, sets: list[ProgramSet]) -> ProgramSet:
        return cls(*(sum((getattr(s, f.name) for s in sets), ()) for f in fields(cls)))


@dataclass
class CompiledSet:
    """A ProgramSet's executables, by the same keys."""

    forwards: dict = field(default_factory=dict)
    samplings: dict = field(default_factory=dict)
    prompts: dict = field(default_factory=dict)
    copies: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.forwards) + len(self.samplings) + len(self.prompts) + len(self.copies)


def abstract(tree):
    """The tree's arrays as ShapeDtypeStructs with their shardings."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


class StepPrograms:
    """The forward of each batch layout, the sampling of each (sampling layout, history width), the prompt
    logprobs of each token count and the block copies of each row count; `fingerprint` is what all of them depend
    on beyond their inputs. The tables are read and written by the engine's thread only."""

    def __init__(
        self,
        forward: Callable,
        sample: Callable,
        prompt_logprobs: Callable,
        copy_blocks: Callable,
        inputs: ProgramInputs,
        cache_dir: str | None,
        fingerprint: tuple,
    ) -> None:
        self._forward, self._sample, self._prompt_logprobs = forward, sample, prompt_logprobs
        self._copy_blocks = copy_blocks
        self.inputs = inputs
        self._saved = step_cache(cache_dir)
        self._fingerprint = fingerprint
        self.forwards: dict = {}  # the batch's PackedLayout -> compiled forward
        self.samplings: dict = {}  # (sampling tensors' PackedLayout, history width) -> compiled sampling
        self.prompts: dict = {}  # tokens T -> compiled prompt logprobs
        self.copies: dict = {}  # rows -> compiled copy_blocks
        self.num_compilations = 0  # every program compiled or loaded, warm-up's included
        self.num_live_compilations = 0  # of those, the ones a step had to wait for
        self.warmed_up = False

    def forward(self, layout: PackedLayout):
        return self._get(
            self.forwards,
            layout,
            lambda: f"a new step shape: {_shapes(layout)}",
            lambda: self.compile_forward(layout),
        )

    def sample(self, layout: PackedLayout, history_width: int):
        return self._get(
            self.samplings,
            (layout, history_width),
            lambda: f"a new sampling shape (history {history_width}): {_shapes(layout)}",
            lambda: self.compile_sample(layout, history_width),
        )

    def prompt(self, num_tokens: int):
        return self._get(
            self.prompts,
            num_tokens,
            lambda: f"prompt logprobs for {num_tokens} tokens",
            lambda: self.compile_prompt(num_tokens),
        )

    def copy(self, rows: int):
        return self._get(
            self.copies, rows, lambda: f"block copies of {rows} rows", lambda: self.compile_copy(rows)
        )

    def _get(self, table: dict, key, describe: Callable[[], str], compile_fn: Callable):
        """`table[key]`, compiled (and counted as live) on a miss: a miss after warm-up is logged, naming
        `describe()`."""
        program = table.get(key)
        if program is None:
            if self.warmed_up:
                logger.warning("compiling %s after warm-up", describe())
            program = table[key] = compile_fn()
            self.num_compilations += 1
            self.num_live_compilations += 1
        return program

    def compile_forward(self, layout: PackedLayout):
        """The forward for a batch of this layout (it donates the KV pool)."""
        i = self.inputs
        args = (i.params, i.kv_cache, i.last_tokens, _zeros_for(layout))
        return self.compile(self._forward, args, "forward", layout)

    def compile_sample(self, layout: PackedLayout, history_width: int):
        """The sampling of the forward's float32 logits, for tensors of this layout and a history this wide."""
        num_rows = layout.arrays[0][0][0]  # the first tensor, temperature, is [S]
        wide = dict(self.inputs.neutral_wide[num_rows])
        history = wide["history"]
        wide["history"] = jax.ShapeDtypeStruct(
            (num_rows, history_width), history.dtype, sharding=history.sharding
        )
        shape = (num_rows, self.inputs.vocab_size)
        logits = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=self.inputs.logits_sharding)
        args = (logits, self.inputs.last_tokens, _zeros_for(layout), wide)
        return self.compile(self._sample, args, "sample", layout)

    def compile_prompt(self, num_tokens: int):
        hidden = self.inputs.hidden
        hidden = jax.ShapeDtypeStruct((num_tokens, hidden.shape[-1]), hidden.dtype, sharding=hidden.sharding)
        args = (self.inputs.params, hidden, np.zeros(num_tokens, np.int32), np.zeros(1, np.int32))
        return self.compile(self._prompt_logprobs, args, "prompt_logprobs")

    def compile_copy(self, rows: int):
        """Copy-on-write block copies, `rows` (src, dst) pairs at a time (it donates the KV pool)."""
        args = (self.inputs.kv_cache, np.zeros((rows, 2), np.int32))
        return self.compile(self._copy_blocks, args, "copy_blocks")

    def compile(self, jitted, args: tuple, name: str, layout: PackedLayout | None = None):
        """`jitted` lowered for `args` (and its static `layout`), from the executable cache when it holds it."""
        static = {} if layout is None else {"layout": layout}
        layout_key = () if layout is None else (str(layout.treedef), layout.arrays)
        key = (name, *arguments_key(args), *layout_key, *self._fingerprint)
        return self._saved.get_or_compile(key, lambda: jitted.lower(*args, **static).compile())

    def compile_set(
        self, programs: ProgramSet, workers: int | None = None, progress: bool = False
    ) -> CompiledSet:
        """Compile (or load) every program of `programs`, `workers` at a time (default one per core: XLA compiles
        outside the GIL), without adding them to the tables: a background warm-up compiles while steps read them."""
        with (
            ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool,
            tqdm(
                total=len(programs.forwards), desc="warm-up (compiling step shapes)", disable=not progress
            ) as bar,
        ):
            compiled = CompiledSet()
            futures = [
                *(
                    (compiled.forwards, key, pool.submit(self.compile_forward, key))
                    for key in programs.forwards
                ),
                *(
                    (compiled.samplings, key, pool.submit(self.compile_sample, *key))
                    for key in programs.samplings
                ),
                *((compiled.prompts, key, pool.submit(self.compile_prompt, key)) for key in programs.prompts),
                *((compiled.copies, key, pool.submit(self.compile_copy, key)) for key in programs.copies),
            ]
            for table, key, future in futures:
                table[key] = future.result()
                bar.update(table is compiled.forwards)
        return compiled

    def add(self, compiled: CompiledSet) -> None:
        """Programs `compile_set` compiled, from now on what steps of their layouts run."""
        for table, programs in (
            (self.forwards, compiled.forwards),
            (self.samplings, compiled.samplings),
            (self.prompts, compiled.prompts),
            (self.copies, compiled.copies),
        ):
            table.update(programs)
        self.num_compilations += len(compiled)

    def step_texts(self, num_tokens: int | None = None) -> list[str]:
        """The optimised HLO of every forward compiled so far, or of those of `num_tokens` tokens."""
        return [
            compiled.as_text()
            for layout, compiled in self.forwards.items()
            if num_tokens is None or layout.arrays[0][0] == (num_tokens,)  # the batch's token_ids come first
        ]


def arguments_key(args) -> tuple:
    """What an executable depends on in its arguments: their tree, shapes, dtypes and shardings."""
    leaves = [
        (np.shape(x), str(x.dtype), str(getattr(x, "sharding", ""))) for x in jax.tree_util.tree_leaves(args)
    ]
    return str(jax.tree_util.tree_structure(args)), leaves


def _shapes(layout: PackedLayout) -> list[tuple[int, ...]]:
    return [shape for shape, _, _ in layout.arrays]


def _zeros_for(layout: PackedLayout) -> np.ndarray:
    """A packed buffer of this layout (what a program is lowered for: only its shape counts)."""
    return np.zeros(sum(int(np.prod(shape)) for shape, _, _ in layout.arrays), np.int32)
