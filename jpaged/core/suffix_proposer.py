"""Suffix-decoding proposals for speculative decoding (vLLM's `"method": "suffix"`, Snowflake's SuffixDecoding in
arctic-inference), for agent loops and RL rollouts that repeat themselves: a trie of every substring (up to
`max_tree_depth` tokens, each node counting its occurrences) over each live sequence's own tokens, and one over the
outputs of recently finished sequences; the context's suffix, matched in a trie, is followed down its most frequent
children. arctic-inference itself is not usable here (an sdist only, whose C++ build needs torch), so this is its
algorithm in plain Python. Host core: no JAX.

Choices as arctic makes them: every match length of the context (1 .. its last `max_tree_depth` tokens) gives a
draft, at most `floor(max_spec_factor * length)` tokens long; a token's probability is the running product of
child count / node count (the node's count includes occurrences that end there, such as the sequence's own last
one, so the end of the sequence dilutes a continuation); a draft stops below `min_token_prob`; the draft with the
highest score (the sum of its probabilities; a tie goes to the longer match, then to the sequence's own trie) wins.
Equal counts go to the smaller token id, so proposals are deterministic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class _Node(dict):
    """A trie node: child token -> _Node. A dict subclass so that a leaf, most nodes, costs one empty dict."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        super().__init__()
        self.count = 0  # occurrences of the substring spelled from the root to here


@dataclass(slots=True)
class _Sequence:
    tokens: list[int]
    num_prompt_tokens: int
    root: _Node
    ends: list[_Node]  # ends[i]: the node of the sequence's last i + 1 tokens (its matches, free)


def _append(root: _Node, ends: list[_Node], token: int, depth: int) -> list[_Node]:
    """Count the substrings that `token` ends (O(depth)); the new `ends`."""
    new_ends = []
    for node in [root, *ends[: depth - 1]]:
        child = node.get(token)
        if child is None:
            child = node[token] = _Node()
        child.count += 1
        new_ends.append(child)
    return new_ends


def _remove(root: _Node, tokens: list[int], depth: int) -> None:
    """Uncount every substring of `tokens`; a node no occurrence passes through goes, with its subtree."""
    for start in range(len(tokens)):
        node = root
        for token in tokens[start : start + depth]:
            child = node[token]
            child.count -= 1
            if child.count == 0:
                del node[token]
                break
            node = child


def _match(root: _Node, context: list[int]) -> list[_Node]:
    """The nodes of the context's suffixes of length 1, 2, ... while they occur (a longer one needs the shorter)."""
    nodes = []
    for length in range(1, len(context) + 1):
        node: _Node | None = root
        for token in context[-length:]:
            node = node.get(token)
            if node is None:
                return nodes
        nodes.append(node)
    return nodes


def _by_count(item: tuple[int, _Node]) -> tuple[int, int]:
    return item[1].count, -item[0]


def _draft(node: _Node, limit: int, min_token_prob: float) -> tuple[list[int], float]:
    """The greedy walk down the most frequent children, and its score."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < limit and node:
        token, child = max(node.items(), key=_by_count)
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        tokens.append(token)
        score += prob
        node = child
    return tokens, score


class SuffixProposer:
    """Suffix tries per live sequence (keyed by the engine's id) and one over recently finished outputs."""

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        if max_tree_depth < 1:
            raise ValueError(f"max_tree_depth ({max_tree_depth}) must be >= 1")
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests ({max_cached_requests}) must be >= 0")
        if not max_spec_factor > 0:
            raise ValueError(f"max_spec_factor ({max_spec_factor}) must be > 0")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob ({min_token_prob}) must be in [0, 1]")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._live: dict[str, _Sequence] = {}
        self._cached_root = _Node()
        self._cached: dict[str, list[int]] = {}  # finished outputs, oldest first

    def propose(self, key: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to k proposed next tokens for the sequence `key` whose tokens (prompt then output) are token_ids."""
        if k < 0:
            raise ValueError(f"k ({k}) must be >= 0")
        seq = self._live.get(key)
        # Only the tokens appended since the last call are counted; a shorter list, or one whose last seen token
        # changed, is a different history: rebuilt from scratch.
        if (
            seq is None
            or len(token_ids) < len(seq.tokens)
            or (seq.tokens and token_ids[len(seq.tokens) - 1] != seq.tokens[-1])
        ):
            seq = self._live[key] = _Sequence([], num_prompt_tokens, _Node(), [])
        seq.num_prompt_tokens = num_prompt_tokens
        for token in token_ids[len(seq.tokens) :]:
            seq.ends = _append(seq.root, seq.ends, int(token), self.max_tree_depth)
            seq.tokens.append(int(token))
        if k == 0:
            return []
        own, own_score = self._best(seq.ends, k)
        cached, cached_score = self._best(_match(self._cached_root, seq.tokens[-self.max_tree_depth :]), k)
        return own if own_score >= cached_score else cached

    def finish(self, key: str) -> None:
        """The sequence ended: its tokens (its output; arctic caches responses) join the global tree of recent
        requests (the oldest evicted past max_cached_requests); its own tree is dropped."""
        seq = self._live.pop(key, None)
        if seq is None or self.max_cached_requests == 0:
            return
        if key in self._cached:
            _remove(self._cached_root, self._cached.pop(key), self.max_tree_depth)
        output = seq.tokens[seq.num_prompt_tokens :]
        ends: list[_Node] = []
        for token in output:
            ends = _append(self._cached_root, ends, token, self.max_tree_depth)
        self._cached[key] = output
        while len(self._cached) > self.max_cached_requests:
            _remove(self._cached_root, self._cached.pop(next(iter(self._cached))), self.max_tree_depth)

    def drop(self, key: str) -> None:
        """Forget the sequence without caching it (aborted)."""
        self._live.pop(key, None)

    def _best(self, matches: list[_Node], k: int) -> tuple[list[int], float]:
        """The best-scoring draft over the match lengths (matches[i] is the match of length i + 1)."""
        best: list[int] = []
        best_score = 0.0
        for length, node in enumerate(matches, 1):
            limit = min(k, int(length * self.max_spec_factor + 1e-6))
            tokens, score = _draft(node, limit, self.min_token_prob)
            if score >= best_score:
                best, best_score = tokens, score
        return best, best_score
