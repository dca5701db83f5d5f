"""N-gram proposals (core/ngram_proposer.py), as vLLM's prompt lookup makes them."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.core.ngram_proposer import propose_ngram


def test_the_tokens_after_the_last_ngrams_earlier_occurrence_are_proposed():
    # "... 5 6 7 8 9 | ... 5 6": the 2-gram 5 6 occurred, followed by 7 8 9.
    assert propose_ngram([1, 5, 6, 7, 8, 9, 2, 5, 6], k=3, min_n=1, max_n=3) == [7, 8, 9]


def test_the_longest_matching_ngram_wins_and_its_most_recent_occurrence():
    tokens = [4, 6, 1, 9, 5, 6, 2, 3, 5, 6]  # 5 6 occurred once (-> 2 3), 6 twice (most recently -> 2 3)
    assert propose_ngram(tokens, k=2, min_n=1, max_n=2) == [2, 3]
    tokens = [
        6,
        7,
        7,
        5,
        6,
        8,
        5,
        6,
    ]  # 2-gram 5 6 -> 8; the 1-gram 6 alone would propose 8 as well, last: 8 5
    assert propose_ngram(tokens, k=2, min_n=2, max_n=2) == [8, 5]
    assert propose_ngram([3, 1, 2, 9, 1, 2, 7, 1, 2], k=1, min_n=2, max_n=2) == [7]  # the latest of two


def test_fewer_or_no_tokens_when_the_context_gives_fewer():
    assert propose_ngram([1, 2, 3, 1, 2], k=5, min_n=1, max_n=2) == [3, 1, 2]
    assert propose_ngram([1, 2, 3, 4], k=3, min_n=1, max_n=3) == []  # no token repeats
    assert propose_ngram([1, 2, 3, 4], k=3, min_n=2, max_n=3) == []
    assert propose_ngram([7], k=3, min_n=1, max_n=3) == []


def test_a_match_is_never_the_suffix_itself():
    assert propose_ngram([8, 8], k=2, min_n=1, max_n=2) == [8]  # the first 8 is followed by the second
    assert propose_ngram([1, 2, 1, 2], k=2, min_n=2, max_n=3) == [1, 2]


def test_it_equals_a_plain_search_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, rng.integers(1, 30)).tolist()
        min_n, max_n, k = 1, int(rng.integers(1, 5)), int(rng.integers(1, 5))
        expected = []
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == tokens[-n:]]
            if ends:
                expected = tokens[ends[-1] : ends[-1] + k]
                break
        assert propose_ngram(tokens, k, min_n, max_n) == expected, (tokens, k, max_n)


def test_bad_bounds_are_a_value_error_naming_them():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        propose_ngram([1, 2], k=1, min_n=3, max_n=2)
