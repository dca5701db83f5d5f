"""The step's compiled programs, one per input layout: each loaded from the executable cache or compiled when first
needed, and counted, because a compile after warm-up is a wait paid by a live request (the num_compilations metric).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


def abstract(tree):
    """The tree's arrays as ShapeDtypeStructs with their shardings."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


class StepPrograms:
    """The forward of each batch layout, the sampling of each (sampling layout, history width) and the prompt
    logprobs of each token count; `fingerprint` is what all of them depend on beyond their inputs."""

    def __init__(
        self,
        forward: Callable,
        sample: Callable,
        prompt_logprobs: Callable,
        inputs: ProgramInputs,
        cache_dir: str | None,
        fingerprint: tuple,
    ) -> None:
        self._forward, self._sample, self._prompt_logprobs = forward, sample, prompt_logprobs
        self.inputs = inputs
        self._saved = step_cache(cache_dir)
        self._fingerprint = fingerprint
        self.forwards: dict = {}  # the batch's PackedLayout -> compiled forward
        self.samplings: dict = {}  # (sampling tensors' PackedLayout, history width) -> compiled sampling
        self.prompts: dict = {}  # tokens T -> compiled prompt logprobs
        self.num_compilations = 0
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

    def _get(self, table: dict, key, describe: Callable[[], str], compile_fn: Callable):
        """`table[key]`, compiled (and counted) on a miss: a miss after warm-up is logged, naming `describe()`."""
        program = table.get(key)
        if program is None:
            if self.warmed_up:
                logger.warning("compiling %s after warm-up", describe())
            program = table[key] = compile_fn()
            self.num_compilations += 1
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

    def compile(self, jitted, args: tuple, name: str, layout: PackedLayout | None = None):
        """`jitted` lowered for `args` (and its static `layout`), from the executable cache when it holds it."""
        static = {} if layout is None else {"layout": layout}
        layout_key = () if layout is None else (str(layout.treedef), layout.arrays)
        key = (name, *arguments_key(args), *layout_key, *self._fingerprint)
        return self._saved.get_or_compile(key, lambda: jitted.lower(*args, **static).compile())

    def compile_all(
        self,
        forward_layouts: Iterable[PackedLayout],
        sampling_keys: Iterable[tuple[PackedLayout, int]],
        token_sizes: Iterable[int],
        progress: bool,
    ) -> None:
        """Compile (or load) every program named, one per core at a time (XLA compiles outside the GIL)."""
        forward_layouts = list(forward_layouts)
        with (
            ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool,
            tqdm(
                total=len(forward_layouts), desc="warm-up (compiling step shapes)", disable=not progress
            ) as bar,
        ):
            futures = [
                *((self.forwards, key, pool.submit(self.compile_forward, key)) for key in forward_layouts),
                *((self.samplings, key, pool.submit(self.compile_sample, *key)) for key in sampling_keys),
                *((self.prompts, key, pool.submit(self.compile_prompt, key)) for key in token_sizes),
            ]
            for table, key, future in futures:
                table[key] = future.result()
                self.num_compilations += 1
                bar.update(table is self.forwards)

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
