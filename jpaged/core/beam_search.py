"""Beam search as transformers defines it (`num_beams`, `length_penalty`, `early_stopping=False`): the pure
selection step. The engine owns the sequences and their blocks; this module only decides.

Every step each live beam proposes its best next tokens with their logprobs. Over all beams of the request the K
best continuations by cumulative logprob are ranked (K = (1 + number of EOS ids) * beam_width, at least
2 * beam_width, so beam_width of them can go on even when the best ones end). In rank order, a continuation that
ends (an EOS, or max_tokens reached) becomes a finished hypothesis if it ranks among the first beam_width, scored
`cumulative_logprob / num_generated_tokens ** length_penalty` (the EOS counted); the best beam_width that do not
end become the next live beams. The best beam_width hypotheses are kept. The search stops at max_tokens, or, as
transformers' `early_stopping=False` does, once beam_width hypotheses are kept and the best live beam, scored at
its current length, no longer beats the worst of them. Under a grammar, the proposals are the beam's best
allowed tokens (transformers' constrained beam search: its logprobs with the disallowed tokens at -inf).

vLLM's `LLM.beam_search` differs in details (it counts prompt tokens in the length, leaves the EOS out, keeps every
ended candidate and never stops early); we follow transformers so the two can be compared token for token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from jpaged.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams


@dataclass(slots=True)
class Beam:
    token_ids: list[int]  # generated so far
    cumulative_logprob: float = 0.0


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its tokens (the EOS included when it ended on one) and its length-penalised score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    ended_on_eos: bool


@dataclass(slots=True)
class BeamSearch:
    """One request's search: its live beams (best first), its best hypotheses (best first), and whether it is done."""

    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # params.max_tokens, capped by the room left in the context
    beams: list[Beam] = field(default_factory=lambda: [Beam([])])
    hypotheses: list[Hypothesis] = field(default_factory=list)
    done: bool = False

    @classmethod
    def start(cls, params: BeamSearchParams, eos_token_ids: Iterable[int], max_tokens: int) -> BeamSearch:
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        search = cls(params, eos, min(params.max_tokens, max_tokens))
        if search.num_candidates > MAX_LOGPROBS:
            per_beam = search.num_candidates // params.beam_width
            raise ValueError(
                f"beam_width must be at most {MAX_LOGPROBS // per_beam} with this model, got {params.beam_width}: "
                f"each beam proposes {per_beam} x beam_width candidates (1 + its {len(eos)} EOS ids, at least 2) "
                f"and a step returns at most {MAX_LOGPROBS} logprobs"
            )
        return search

    @property
    def num_candidates(self) -> int:
        """K: continuations ranked per step, and the top-K logprobs each live beam must propose."""
        return max(2, 1 + len(self.eos_token_ids)) * self.params.beam_width

    def sampling_params(self) -> SamplingParams:
        """What the engine samples for every live beam: greedy, with the top-K logprobs as the proposals."""
        return SamplingParams(
            temperature=0.0,
            logprobs=self.num_candidates,
            max_tokens=self.max_tokens,
            ignore_eos=True,  # the search decides where beams end
            detokenize=False,
            structured_outputs=self.params.structured_outputs,
        )

    def step(self, proposals: Sequence[Sequence[tuple[int, float]]]) -> list[int]:
        """Advance by one token. `proposals[i]` holds (token id, logprob) pairs for live beam i, at least K of
        them (or the whole vocabulary); a -inf logprob is a token its grammar does not allow, never taken (so a
        grammar that allows few tokens can leave fewer than beam_width live beams). Returns, for each new live
        beam in `self.beams`, the index of the old beam it extends; an old beam no index names is dropped. Empty
        once the search is done."""
        if self.done:
            raise ValueError("the beam search is done: it takes no more steps")
        if len(proposals) != len(self.beams):
            raise ValueError(f"got proposals for {len(proposals)} beams, but {len(self.beams)} are live")
        width, length = self.params.beam_width, len(self.beams[0].token_ids) + 1
        ranked = sorted(
            (
                (beam.cumulative_logprob + float(logprob), index, int(token))
                for index, (beam, tokens) in enumerate(zip(self.beams, proposals, strict=True))
                for token, logprob in tokens
                if logprob != -math.inf  # a token its grammar does not allow
            ),
            key=lambda candidate: -candidate[0],
        )[: self.num_candidates]
        at_limit = length >= self.max_tokens
        beams, parents = [], []
        for rank, (cumulative, index, token) in enumerate(ranked):
            tokens = [*self.beams[index].token_ids, token]
            if at_limit or token in self.eos_token_ids:
                if rank < width:  # lower ranks only back up the live beams
                    ended_on_eos = token in self.eos_token_ids
                    self._keep(Hypothesis(tokens, cumulative, self._score(cumulative, length), ended_on_eos))
            elif len(beams) < width:
                beams.append(Beam(tokens, cumulative))
                parents.append(index)
        self.beams = beams
        self.done = at_limit or not beams or not self._can_improve(length)
        if self.done:
            self.beams, parents = [], []
        return parents

    def _score(self, cumulative_logprob: float, length: int) -> float:
        return cumulative_logprob / length**self.params.length_penalty

    def _keep(self, hypothesis: Hypothesis) -> None:
        """Insert after equal scores (the earlier one wins a tie) and keep the best beam_width."""
        position = sum(1 for kept in self.hypotheses if kept.score >= hypothesis.score)
        self.hypotheses.insert(position, hypothesis)
        del self.hypotheses[self.params.beam_width :]

    def _can_improve(self, length: int) -> bool:
        """transformers' early_stopping=False heuristic: the best live beam scored at its current length."""
        if len(self.hypotheses) < self.params.beam_width:
            return True
        return self._score(self.beams[0].cumulative_logprob, length) > self.hypotheses[-1].score
