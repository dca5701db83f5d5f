"""Structured outputs on the host: grammars from StructuredOutputsParams, compiled off the engine loop, and
per-request matchers that fill token bitmasks (llguidance is the backend; README's "Structured outputs and tool
calls" says why). No JAX here: the engine ships the bitmask to the device and applies it there."""

from jpaged.structured.bitmask import allocate_bitmask, allowed_tokens, num_words
from jpaged.structured.compiler import CompiledGrammar, GrammarCompiler, GrammarFuture, shared_compiler
from jpaged.structured.matcher import GrammarMatcher, fill_bitmasks

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarFuture",
    "GrammarMatcher",
    "allocate_bitmask",
    "allowed_tokens",
    "fill_bitmasks",
    "num_words",
    "shared_compiler",
]
