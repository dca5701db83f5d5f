"""Suffix-decoding proposals (core/suffix_proposer.py), as arctic-inference's SuffixDecodingCache makes them."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from jpaged.core.suffix_proposer import SuffixProposer


def test_a_repeated_pattern_proposes_what_followed_it():
    # "1 2 3 4 | 1 2 3": 1 2 3 occurred twice, once followed by 4 1.
    assert SuffixProposer().propose("a", [1, 2, 3, 4, 1, 2, 3], 0, k=2) == [4, 1]
    assert SuffixProposer().propose("a", [1, 2, 3, 4, 1, 2, 3], 0, k=1) == [4]
    assert SuffixProposer().propose("a", [1, 2, 3, 4, 1, 2, 3], 0, k=0) == []


def test_a_long_repeating_pattern_proposes_k_tokens():
    assert SuffixProposer().propose("a", [5, 6, 7] * 20, 0, k=8) == [5, 6, 7, 5, 6, 7, 5, 6]


def test_nothing_without_an_earlier_match():
    assert SuffixProposer().propose("a", [1, 2, 3, 4], 0, k=3) == []
    assert SuffixProposer().propose("a", [], 0, k=3) == []


def test_a_match_of_length_m_proposes_at_most_floor_max_spec_factor_times_m():
    tokens = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # the longest match that continues: 1 2 (m = 2)
    assert SuffixProposer(max_spec_factor=1.0).propose("a", tokens, 0, k=10) == [3, 4]
    assert SuffixProposer(max_spec_factor=2.0).propose("a", tokens, 0, k=10) == [3, 4, 5, 6]
    assert SuffixProposer(max_spec_factor=0.5).propose("a", tokens, 0, k=10) == [3]
    assert SuffixProposer(max_spec_factor=0.4).propose("a", tokens, 0, k=10) == []


def test_the_most_frequent_continuation_first_and_a_stop_under_min_token_prob():
    # 5 was followed once by 7 and three times by 8; with the sequence's own last 5, P(8) = 3/5.
    tokens = [1, 5, 7, 2, 5, 8, 3, 5, 8, 4, 5, 8, 6, 5]
    assert SuffixProposer(max_spec_factor=3, min_token_prob=0.1).propose("a", tokens, 0, k=3)[0] == 8
    # After 5 8 come 3, 4 or 6: P(8 then any one) = 3/5 * 1/3 = 0.2, under 0.25.
    assert SuffixProposer(max_spec_factor=3, min_token_prob=0.25).propose("a", tokens, 0, k=3) == [8]
    assert SuffixProposer(max_spec_factor=3, min_token_prob=0.7).propose("a", tokens, 0, k=3) == []


def test_a_finished_output_is_proposed_to_a_new_sequence_that_ends_with_its_beginning():
    proposer = SuffixProposer()
    proposer.propose("done", [100, 101, 10, 11, 12, 13, 14, 15], num_prompt_tokens=2, k=4)
    proposer.finish("done")
    assert proposer.propose("new", [7, 8, 10, 11, 12], num_prompt_tokens=2, k=5) == [13, 14, 15]
    assert proposer.propose("new2", [7, 100], num_prompt_tokens=1, k=5) == []  # prompts are not cached


def test_a_dropped_sequence_is_not_cached():
    proposer = SuffixProposer()
    proposer.propose("aborted", [100, 101, 10, 11, 12, 13, 14, 15], num_prompt_tokens=2, k=4)
    proposer.drop("aborted")
    assert proposer.propose("new", [7, 8, 10, 11, 12], num_prompt_tokens=2, k=5) == []


def test_past_max_cached_requests_the_oldest_output_is_forgotten():
    proposer = SuffixProposer(max_cached_requests=1)
    proposer.propose("first", [10, 11, 12, 13], num_prompt_tokens=0, k=1)
    proposer.finish("first")
    proposer.propose("second", [20, 21, 22, 23], num_prompt_tokens=0, k=1)
    proposer.finish("second")
    assert proposer.propose("x", [9, 10, 11], num_prompt_tokens=1, k=2) == []
    assert proposer.propose("y", [9, 20, 21], num_prompt_tokens=1, k=2) == [22, 23]


def random_case(rng: random.Random) -> tuple[list[int], int, float]:
    return (
        [rng.randrange(4) for _ in range(rng.randrange(1, 30))],
        rng.randrange(6),
        rng.choice([0.5, 1.0, 2.0]),
    )


def test_proposals_made_step_by_step_equal_those_from_the_whole_list_at_once():
    rng = random.Random(0)
    for case in range(200):
        tokens, k, factor = random_case(rng)
        incremental = SuffixProposer(max_tree_depth=6, max_spec_factor=factor)
        for n in range(1, len(tokens) + 1):
            fresh = SuffixProposer(max_tree_depth=6, max_spec_factor=factor)
            assert incremental.propose("s", tokens[:n], 0, k) == fresh.propose("s", tokens[:n], 0, k), case
        shorter = tokens[: len(tokens) // 2]  # a shrink (preemption) rebuilds
        fresh = SuffixProposer(max_tree_depth=6, max_spec_factor=factor)
        assert incremental.propose("s", shorter, 0, k) == fresh.propose("s", shorter, 0, k), case


def reference(
    corpus: list[list[int]], context: list[int], k: int, depth: int, factor: float, min_prob: float
):
    """arctic's best draft, counting occurrences directly in the corpus's token lists: over every match length
    m, follow the most frequent next token (P = its count / the occurrences of the path so far, ties to the smaller
    token) for at most floor(factor * m) tokens and paths of at most `depth`; the highest sum of P wins."""

    def occurrences(path: list[int]) -> list[tuple[list[int], int]]:
        n = len(path)
        return [(seq, i) for seq in corpus for i in range(len(seq) - n + 1) if seq[i : i + n] == path]

    best, best_score = [], 0.0
    for m in range(1, len(context) + 1):
        path = context[-m:]
        if not occurrences(path):
            break
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < min(k, int(factor * m)) and len(path) < depth:
            found = occurrences(path)
            following = Counter(seq[i + len(path)] for seq, i in found if i + len(path) < len(seq))
            if not following:
                break
            token, count = max(following.items(), key=lambda item: (item[1], -item[0]))
            prob *= count / len(found)
            if prob < min_prob:
                break
            draft, score, path = [*draft, token], score + prob, [*path, token]
        if score >= best_score:
            best, best_score = draft, score
    return best, best_score


def test_proposals_equal_a_plain_count_over_the_sequence_and_the_finished_outputs():
    rng = random.Random(1)
    depth, min_prob = 5, 0.2
    for case in range(200):
        proposer = SuffixProposer(max_tree_depth=depth, max_cached_requests=2, min_token_prob=min_prob)
        outputs = []
        for done in range(rng.randrange(4)):
            tokens, _, _ = random_case(rng)
            num_prompt = rng.randrange(len(tokens) + 1)
            proposer.propose(f"done{done}", tokens, num_prompt, 1)
            proposer.finish(f"done{done}")
            outputs = [*outputs, tokens[num_prompt:]][-2:]
        tokens, k, _ = random_case(rng)
        own = reference([tokens], tokens[-depth:], k, depth, 1.0, min_prob)
        cached = reference(outputs, tokens[-depth:], k, depth, 1.0, min_prob)
        expected = own[0] if own[1] >= cached[1] else cached[0]
        assert proposer.propose("s", tokens, 0, k) == expected, case


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tree_depth": 0}, "max_tree_depth"),
        ({"min_token_prob": -0.1}, "min_token_prob"),
        ({"min_token_prob": 1.5}, "min_token_prob"),
        ({"max_spec_factor": 0.0}, "max_spec_factor"),
        ({"max_cached_requests": -1}, "max_cached_requests"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SuffixProposer(**kwargs)


def test_a_negative_k_is_refused_by_name():
    with pytest.raises(ValueError, match="k"):
        SuffixProposer().propose("a", [1, 2], 0, k=-1)
