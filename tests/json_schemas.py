"""Twenty JSON schemas of the kinds users send: nested objects with required and optional keys, arrays with
bounds, enums, bounded numbers, strings; generated from fixed seeds."""

from __future__ import annotations

import random


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects (nested, required and optional keys), arrays with bounds, enums, bounded numbers, strings."""
    kinds = ["integer", "number", "string", "boolean", "enum", "array"] + (
        ["object"] * 2 if depth < 2 else []
    )
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        # Not exclusiveMinimum 0: a greedy model then writes 0.000... for ever, each digit keeping it valid.
        return {"type": "number", "minimum": rng.choice([-5, 0]), "maximum": rng.choice([1, 10, 1000])}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x y", 'quo"te', 3, None], 3)}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low, "maxItems": low + 3}
    return random_object(rng, depth)


def random_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["id", "name", "tags", "size", "owner", "price", "valid", "meta"], rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {name: random_schema(rng, depth + 1) for name in names},
        "required": rng.sample(names, rng.randint(0, len(names))),
        "additionalProperties": False,
    }


OBJECT_SCHEMAS = [random_object(random.Random(seed)) for seed in range(20)]
