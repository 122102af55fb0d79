"""Listwise judging output: the JSON schema of one scored list and its parser (strict, then lenient).

A list prompt shows k bullets numbered 1..k and asks for a JSON array with one object per bullet,
`[{"id": 1, "score": 7}, {"id": 2, "score": 0}, ...]`, scores on an integer 0-10 scale (bounded:
one or two tokens each, and exact under a grammar). The schema pins the array to exactly the
listed ids, each once, in order (`prefixItems` with `const` ids, no further items), so an engine
with structured output cannot return a missing, repeated or invented id. Scores are returned in
[0, 1] (score / 10). Like `memprune.llm.parsing`, nothing here raises on model text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from memprune.llm.parsing import Parsed, _json_objects, _short, _strip_fence

SCALE = 10  # integer scores 0..SCALE, mapped to [0, 1] by / SCALE


def listwise_schema(k: int) -> dict[str, Any]:
    """The JSON schema of a list of `k` bullets: exactly ids 1..k, once each, in order, integer scores 0..10."""
    if k < 1:
        raise ValueError(f"a list needs at least one bullet, got {k}")
    item = {"type": "object", "properties": {"id": None, "score": {"type": "integer", "minimum": 0, "maximum": SCALE}},
            "required": ["id", "score"], "additionalProperties": False}
    items = [{**item, "properties": {**item["properties"], "id": {"const": i}}} for i in range(1, k + 1)]
    return {"type": "array", "prefixItems": items, "items": False, "minItems": k, "maxItems": k}


def _scale_score(value: Any) -> float | None:
    """A 0..10 score as a number in [0, 1], or None (booleans and non-numbers are not scores)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value / SCALE if 0.0 <= value <= SCALE else None


def _id_of(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _scores_from_items(items: list[Any], k: int, strict: bool) -> Parsed:
    """`[{"id", "score"}...]` -> k scores in id order; every id 1..k exactly once."""
    got: dict[int, float] = {}
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            return Parsed(error=f"item {i} is {type(item).__name__}, expected an object")
        if strict and set(item) != {"id", "score"}:
            return Parsed(error=f"item {i} keys {sorted(item)}, expected ['id', 'score']")
        ident = item.get("id") if strict else _id_of(item.get("id"))
        if not isinstance(ident, int) or isinstance(ident, bool) or not 1 <= ident <= k:
            return Parsed(error=f"item {i} id {item.get('id')!r} is not one of the listed ids 1..{k}")
        if ident in got:
            return Parsed(error=f"id {ident} appears twice")
        if strict and (isinstance(item["score"], bool) or not isinstance(item["score"], int)):
            return Parsed(error=f"id {ident} score {item['score']!r} is not an integer 0..{SCALE}")
        score = _scale_score(item.get("score"))
        if score is None:
            return Parsed(error=f"id {ident} score {item.get('score')!r} is not a number in 0..{SCALE}")
        got[ident] = score
    missing = [i for i in range(1, k + 1) if i not in got]
    if missing:
        return Parsed(error=f"ids {missing} missing from the list of {k}")
    return Parsed(value=[got[i] for i in range(1, k + 1)], method="strict" if strict else "lenient")


def parse_listwise_strict(text: str, k: int) -> Parsed:
    """The whole output (optionally fenced) is the schema's array: k objects {"id", "score"}, ids 1..k once each."""
    try:
        obj = json.loads(_strip_fence(text or ""))
    except ValueError as exc:
        return Parsed(error=f"not JSON ({exc.msg})")
    if not isinstance(obj, list):
        return Parsed(error=f"JSON {type(obj).__name__}, expected an array")
    if len(obj) != k:
        return Parsed(error=f"{len(obj)} items, expected {k}")
    return _scores_from_items(obj, k, strict=True)


def parse_listwise_lenient(text: str, k: int) -> Parsed:
    """An embedded array of {id, score} objects (ids may be strings), an object {"1": s, ...}, or an array of k numbers.

    Every listed id must be scored exactly once; a partial list is an error (the row is retried,
    then falls back to pairwise judging), never padded with default scores.
    """
    reasons = []
    for obj in _json_objects(text or ""):
        if isinstance(obj, list) and obj and all(isinstance(x, Mapping) for x in obj):
            parsed = _scores_from_items(obj, k, strict=False)
        elif isinstance(obj, list) and len(obj) == k and all(_scale_score(x) is not None for x in obj):
            parsed = Parsed(value=[_scale_score(x) for x in obj], method="lenient")
        elif isinstance(obj, Mapping) and obj and all(_id_of(key) is not None for key in obj):
            parsed = _scores_from_items([{"id": key, "score": v} for key, v in obj.items()], k, strict=False)
        else:
            continue
        if parsed.ok:
            parsed.method = "lenient"
            return parsed
        reasons.append(parsed.error)
    return Parsed(error=reasons[0] if reasons else "no JSON list of scores in the output")


def parse_listwise(text: str | None, k: int) -> Parsed:
    """Strict, then lenient; the value is k scores in [0, 1] in id order. The error names both reasons."""
    if text is None or not text.strip():
        return Parsed(error="empty output")
    strict = parse_listwise_strict(text, k)
    if strict.ok:
        return strict
    lenient = parse_listwise_lenient(text, k)
    if lenient.ok:
        return lenient
    return Parsed(error=f"unparseable list output: strict: {strict.error}; lenient: {lenient.error}; "
                        f"text {_short(text)!r}")
