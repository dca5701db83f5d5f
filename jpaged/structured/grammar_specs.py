"""A StructuredOutputsParams as llguidance grammar text: the one place the request's kinds meet the backend.

JSON is compiled without free whitespace between tokens (`whitespace_flexible=False`): a grammar that allows any
run of spaces and newlines lets a small model fill its whole budget with them, and compact JSON parses the same.
An object schema that lists its properties generates only those unless it says `additionalProperties` itself
(vLLM's default backend does the same): JSON Schema's default admits any other key, and a small model under a
tool's schema would otherwise invent keys until its budget ran out.
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
        return llguidance.LLMatcher.grammar_from_json_schema(
            declared_properties_only(schema), defaults=JSON_OPTIONS
        )
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", spec.choice)
    assert spec.grammar is not None
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark


# Keywords whose value is a subschema, a list of them, or a map of names to them.
_SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def declared_properties_only(schema):
    """A copy of `schema` where every object schema with `properties` or `patternProperties` and no
    `additionalProperties` (or `unevaluatedProperties`) of its own gets `additionalProperties: false`."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = declared_properties_only(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [declared_properties_only(item) for item in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: declared_properties_only(item) for name, item in out[key].items()}
    lists_properties = "properties" in out or "patternProperties" in out
    if lists_properties and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out
