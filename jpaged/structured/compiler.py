"""Grammars compiled off the caller's thread, cached by their spec.

The engine loop must never wait on a compile (a large schema takes tens of milliseconds, llguidance's tokenizer
view a second): `submit` returns at once with a handle the loop polls each step (`ready()`), and a request waits
for its own grammar while the rest of the batch runs. The cache holds the compiled, never-advanced matcher of
each recent spec; each request takes a copy (`CompiledGrammar.matcher()`), which shares the compiled lexer and
parser, so a cached schema costs a request a copy, not a compile. Invalid specs are cached too: the same bad
schema gets the same ValueError at once.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.hf

from jpaged.sampling_params import StructuredOutputsParams
from jpaged.structured.grammar_specs import grammar_text
from jpaged.structured.matcher import GrammarMatcher

DEFAULT_CACHE_SIZE = (
    256  # compiled grammars kept (vLLM keeps no cache for llguidance; xgrammar's is unbounded)
)
WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A spec's grammar, compiled for one tokenizer and vocabulary; hands out matchers at its start state."""

    spec: StructuredOutputsParams
    _start: llguidance.LLMatcher  # never advanced: only copied
    vocab_size: int

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._start.deep_copy(), self.vocab_size)


@dataclass(frozen=True, slots=True)
class GrammarFuture:
    """A compile in flight or done; `future` is there for asyncio.wrap_future."""

    future: Future

    def ready(self) -> bool:
        """True once `result()` returns (or raises) without waiting."""
        return self.future.done()

    def result(self, timeout: float | None = None) -> CompiledGrammar:
        """The compiled grammar; ValueError naming the problem if the spec does not compile."""
        return self.future.result(timeout)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer in a worker thread, with an LRU cache by spec.

    `vocab_size` is the model's (its logits' width), which may exceed the tokenizer's: the extra ids are never
    allowed. Thread-safe: any thread may submit."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int] | None = None,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        num_threads: int = 1,
    ) -> None:
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids) if eos_token_ids else None
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="jpaged-grammar")

    def submit(self, spec: StructuredOutputsParams) -> GrammarFuture:
        """Start compiling `spec` (or find it cached); never blocks on a compile."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._compile, spec)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return GrammarFuture(future)

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """`submit(spec).result()`: waits for the worker."""
        return self.submit(spec).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        what = WHAT[spec.kind]
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError) as err:
            raise ValueError(f"invalid {what}: {err}") from None
        start = llguidance.LLMatcher(self._llguidance_tokenizer(), text, log_level=0)
        if start.is_error():
            raise ValueError(f"invalid {what}: {start.get_error().strip()}")
        return CompiledGrammar(spec, start, self.vocab_size)

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (about a second to build): made once, in the worker."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_llguidance_tokenizer()
        return self._ll_tokenizer

    def _build_llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        if len(self._tokenizer) > self.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(self._tokenizer)} tokens, more than the model's vocabulary of "
                f"{self.vocab_size}: structured outputs need every token id to be one the model has"
            )
        return llguidance.hf.from_tokenizer(
            self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids
        )


@functools.cache
def shared_compiler(
    tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | None = None
) -> GrammarCompiler:
    """The one compiler (and cache) per tokenizer and vocabulary in this process, so the server's up-front
    validation and the engine's compile of the same spec are one compile."""
    return GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
