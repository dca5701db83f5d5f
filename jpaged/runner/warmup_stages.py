"""Warm-up in stages, smallest steps first, so an engine can serve before every step program is compiled.

A stage holds the programs of every step shape of its token size (step_shapes.py): the forwards of each (T, S), the
sampling of each new row count S, the prompt logprobs of T, and the copy-on-write programs of up to its sequence
cap. Once a stage and those before it are compiled, every step of at most `max_num_batched_tokens` tokens and
`max_num_seqs` sequence rows pads up to a compiled shape (`StepShapes.shape_for` answers none bigger), so a
scheduler held to those limits never makes a step wait on a compilation. The first stage (steps of up to
READY_TOKENS tokens: decodes of a few sequences, prefill in small chunks) is what an engine compiles before it
serves; the rest compile behind it, and the limits rise as each lands.
"""

from __future__ import annotations

from dataclasses import dataclass

from jpaged.runner.step_shapes import StepShapes

READY_TOKENS = 8  # the first stage's steps: ~1/10 of the default CPU shape set, compiled in seconds


@dataclass(frozen=True, slots=True)
class WarmupStage:
    max_num_batched_tokens: int  # with the stages before it, steps of up to this many tokens...
    max_num_seqs: int  # ...and this many sequence rows have every program they need
    shapes: tuple[tuple[int, int], ...]  # the (T, S) forwards it compiles
    sampling_rows: tuple[int, ...]  # row counts S whose sampling programs it compiles (none compiled before)
    prompt_tokens: tuple[int, ...]  # token counts T whose prompt-logprobs programs it compiles
    copy_rows: tuple[int, ...]  # copy-on-write program sizes it compiles

    @property
    def num_programs(self) -> int:
        """Forwards, prompt-logprobs and copy programs (samplings are counted by the runner, per variant)."""
        return len(self.shapes) + len(self.prompt_tokens) + len(self.copy_rows)


def warmup_stages(shapes: StepShapes) -> list[WarmupStage]:
    """Every program warm-up compiles, once, in stages of growing token size; the last stage's limits are the
    configured ones."""
    first = min(READY_TOKENS, shapes.max_num_batched_tokens)
    caps = [t for t in shapes.token_sizes if t >= first]
    stages, rows_done, copies_done, below = [], set(), set(), 0
    for cap in caps:
        stage_shapes = tuple((t, s) for t, s in shapes.all_shapes() if below < t <= cap)
        seqs = min(shapes.max_num_seqs, cap)
        rows = sorted({s for _, s in stage_shapes} - rows_done)
        copies = [r for r in shapes.copy_sizes if r <= seqs and r not in copies_done]
        tokens = sorted({t for t, _ in stage_shapes})
        stages.append(WarmupStage(cap, seqs, stage_shapes, tuple(rows), tuple(tokens), tuple(copies)))
        rows_done.update(rows)
        copies_done.update(copies)
        below = cap
    return stages
