"""The sampler's inputs for each step, built from the rows' params only when they change.

Plain greedy rows are exactly the sampler's padding rows, so an all-plain batch reuses one cached set of tensors
per row count; a batch of the same static rows as the previous step reuses that step's tensors with each row's
step count one higher. Anything else is built from the rows' params.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jpaged.core.sequence import Request, SequenceState
from jpaged.engine.scheduled_step import SampledRows
from jpaged.engine.tokenizer import tokenize_bad_words
from jpaged.runner.sampling_inputs import SamplingRow, SamplingTensors
from jpaged.sampling_params import SamplingParams


def sample_seed_for(request: Request, index: int) -> int:
    """Sample i of a request draws from its own stream: reproducible, independent of batch composition."""
    return (request.seed + index * 0x9E3779B97F4A7C15) % 2**63


def has_static_sampling(params: SamplingParams) -> bool:
    """Whether nothing in the sampler's inputs for this request depends on what it generated."""
    return (
        params.min_tokens == 0
        and not params.bad_words
        and not params.presence_penalty
        and not params.frequency_penalty
        and params.repetition_penalty == 1.0
        and params.structured_outputs is None
    )


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that biases or restricts a token and no logprobs asked (penalties, bad words and
    min_tokens are ruled out by static sampling): sampled exactly like the sampler's padding rows."""
    return (
        params.is_greedy
        and params.logprobs is None
        and not params.logit_bias
        and params.allowed_token_ids is None
    )


def describe_sampling(request: Request, tokenizer) -> None:
    """Work out once what the sampler's inputs need to know about a new request: its bad words as token ids,
    and whether its inputs are static (or even those of plain greedy rows). A beam search's never are: its
    beams fork and end every step."""
    params = request.params
    if params.bad_words:
        request.bad_words_token_ids = tokenize_bad_words(params.bad_words, tokenizer)
    request.static_sampling = request.beam is None and has_static_sampling(params)
    request.plain_greedy = request.static_sampling and is_plain_greedy(params)


def _row_seeds(rows: SampledRows) -> list[int]:
    """Each row's seed: its sequence's, and for the k-th extra row of a fan-out, that of sample index + k."""
    seeds, k = [], 0
    for row, seq in enumerate(rows.seqs):
        k = k + 1 if rows.forks(row) else 0
        seeds.append(sample_seed_for(seq.request, seq.index + k) if k else seq.seed)
    return seeds


def _output_token_ids(rows: SampledRows) -> list[list[int]]:
    """Each row's output tokens before the token it samples: a row after a proposal counts the proposals up to
    it as generated (its draw, penalties and bans are those of the position, as if they were accepted)."""
    positions = rows.draft_positions or [0] * len(rows.seqs)
    return [
        seq.output_token_ids + seq.draft_token_ids[:position] if position else seq.output_token_ids
        for seq, position in zip(rows.seqs, positions, strict=True)
    ]


class StepSampling:
    """Per-engine cache of sampler inputs (see the module doc); `inputs` is called once per step."""

    def __init__(
        self,
        build: Callable[[Sequence[SamplingRow], int], SamplingTensors],
        eos_token_id: int | None,
        bitmasks: Callable[[Sequence[SequenceState]], list],
    ) -> None:
        self._build = build  # ModelRunner.sampling_tensors
        self._eos_token_id = eos_token_id
        self._bitmasks = bitmasks  # ConstrainedDecoding.bitmasks
        self._plain: dict[int, SamplingTensors] = {}  # inputs of plain greedy rows, by row count
        # The previous step's static rows and their inputs: (row_seqs, tensors, num_rows).
        self._static: tuple[list[SequenceState], SamplingTensors, int] | None = None

    def inputs(self, rows: SampledRows, num_rows: int) -> SamplingTensors:
        """The sampler's inputs for these rows (padded to `num_rows`)."""
        row_seqs, all_static, all_plain = rows.seqs, rows.all_static, rows.all_plain
        if all_plain:
            tensors = self._plain.get(num_rows)
            if tensors is None:
                tensors = self._plain[num_rows] = self._build((), num_rows)
            return tensors
        previous = self._static
        all_static = all_static and rows.draft_positions is None  # proposals move rows by more than a token
        if all_static and previous is not None and previous[0] == row_seqs and previous[2] == num_rows:
            tensors = previous[1]
            steps = tensors.steps.copy()
            steps[: len(row_seqs)] += 1
            tensors = tensors._replace(steps=steps)
        else:
            sampling_rows = [
                SamplingRow(
                    seq.request.params,
                    seq.request.prompt_token_ids,
                    output_token_ids,
                    seed,
                    None if seq.request.params.ignore_eos else self._eos_token_id,
                    seq.request.bad_words_token_ids,
                    seq.num_pending,
                    grammar_bitmask,
                    masked_top_logprobs=seq.request.beam is not None,
                )
                for seq, output_token_ids, seed, grammar_bitmask in zip(
                    row_seqs, _output_token_ids(rows), _row_seeds(rows), self._bitmasks(rows), strict=True
                )
            ]
            tensors = self._build(sampling_rows, num_rows)
        self._static = (row_seqs, tensors, num_rows) if all_static else None
        return tensors
