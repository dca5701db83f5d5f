"""A draft model's proposals (vLLM's `{"model": PATH, "num_speculative_tokens": k}`): a smaller model of the same
tokenizer, run by its own ModelRunner beside the target's.

Its KV pool mirrors the target's block for block (the same block ids, tables and slot mapping, a block costing
both models' bytes), so the engine's one BlockManager serves both: prefix hits, copy-on-write copies and
recomputation after preemption hold for the draft as they do for the target. The draft keeps up by running every
step the target runs, on the same batch (its logits unused), right after the target's forward; then, before a step
that verifies, k decode steps of its own propose: the first takes each sequence's latest token, each later one the
token the draft sampled in the step before (on the device, no host round trip between them), greedily. The
proposals are its argmax: one token each, which the target's acceptance treats as engine/speculation.py says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from jpaged.config import EngineConfig
from jpaged.core.block_manager import BlockManager
from jpaged.core.sequence import SequenceState
from jpaged.models.loader import LoadedModel
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.packed_inputs import pack
from jpaged.runner.step_batch import PreparedStep, StepSchedule


class DraftModel:
    """The draft's runner, and what the engine asks of it (see the module doc)."""

    def __init__(
        self,
        config: EngineConfig,
        draft: LoadedModel,
        target: ModelRunner,
        blocks: BlockManager,
        **runner_args,
    ) -> None:
        target_vocab_size = target.model_config.vocab_size
        if jax.process_count() > 1:
            raise ValueError("speculative_config with a draft model runs in one process")
        if draft.config.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config model: the draft's vocabulary ({draft.config.vocab_size} tokens) must be the "
                f"target's ({target_vocab_size}): a draft proposes the target's token ids"
            )
        own = dataclasses.replace(config, enable_lora=False, speculative_config=None)
        self.runner = ModelRunner(own, draft.config, draft.params, **runner_args)
        self._greedy: dict = {}  # plain greedy sampling tensors, by row count
        self._target, self._blocks = target, blocks  # the target's runner, and the blocks both pools mirror

    def warmup(self, progressive: bool = False) -> float:
        return self.runner.warmup(progress=False, progressive=progressive)

    def catch_up(self, step: PreparedStep, last_tokens) -> None:
        """Run the target's step on the draft, writing its KV: dispatched after the target's forward, before its
        sampling, so that inputs the step takes from the target's previous sampling (`last_tokens`) are there."""
        runner = self.runner
        packed, layout = pack(step.batch)
        compiled = runner.programs.forward(layout)
        runner.kv_cache, *_ = compiled(runner.step_weights, runner.kv_cache, last_tokens, packed)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if copies:
            self.runner.copy_blocks(copies)

    def propose(self, wanted: list[tuple[SequenceState, int]]) -> list[list[int]]:
        """k greedy proposals for each (sequence, k), after the slots of its verifying step (none where the pool
        has no room for them) and copies of the shared blocks among them, on both pools."""
        blocks = self._blocks
        ks = [
            k if blocks.allocate_slots(seq.seq_id, seq.num_computed_tokens, 1 + k) else 0 for seq, k in wanted
        ]
        copies = blocks.take_pending_copies()
        self._target.copy_blocks(copies)
        self.copy_blocks(copies)
        # The sequences that propose, longest first: each step's are the first rows of the step before.
        order = sorted((i for i, k in enumerate(ks) if k), key=lambda i: -ks[i])
        proposals: list[list[int]] = [[] for _ in wanted]
        if not order:
            return proposals
        seqs = [wanted[i][0] for i in order]
        tables = blocks.block_tables([seq.seq_id for seq in seqs])
        outputs = []
        for j in range(ks[order[0]]):
            rows = sum(1 for i in order if ks[i] > j)  # the sequences that propose a (j + 1)-th token
            schedule = StepSchedule(
                [seq.token_ids for seq in seqs[:rows]],
                [seq.num_computed_tokens + j for seq in seqs[:rows]],
                [1] * rows,
                tables[:rows],
                list(range(rows)),
                [-1 if j == 0 else row for row in range(rows)],  # later steps: the draft's own last token
                prompt_lens=[seq.num_prompt_tokens for seq in seqs[:rows]],
            )
            prepared = self.runner.prepare(schedule)
            self.runner.forward(prepared)
            outputs.append((rows, self.runner.sample(self._greedy_tensors(prepared.num_rows))))
        for rows, pending in outputs:
            tokens = pending.result().sampled.token_ids
            for row in range(rows):
                proposals[order[row]].append(int(tokens[row]))
        return proposals

    def _greedy_tensors(self, num_rows: int):
        tensors = self._greedy.get(num_rows)
        if tensors is None:
            tensors = self._greedy[num_rows] = self.runner.sampling_tensors((), num_rows)
        return tensors
