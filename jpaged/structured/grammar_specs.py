"""A StructuredOutputsParams as llguidance grammar text: the one place the request's kinds meet the backend.

JSON is compiled without free whitespace between tokens (`whitespace_flexible=False`): a grammar that allows any
run of spaces and newlines lets a small model fill its whole budget with them, and compact JSON parses the same.
"""

from __future__ import annotations

import json

import llguidance

from jpaged.sampling_params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = {"type": "object"}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for `spec`; ValueError for JSON that is not a schema object.

    Whether the grammar compiles (a bad regex, a schema keyword llguidance lacks, a Lark syntax error) is told
    by building a matcher from it, in GrammarCompiler."""
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", spec.choice)
    assert spec.grammar is not None
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
