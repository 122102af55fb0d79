"""Output schemas and parsers: strict (the JSON schema) first, then a lenient fallback.

Nothing the model returns is executed: outputs are only decoded with `json` and regular
expressions. A parser never raises on model text; it returns a `Parsed` with either a
value or the reason it failed, so the caller can retry the row or turn it into an error row.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

JUDGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["score"],
    "additionalProperties": False,
}

SUMMARY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "bullets": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "speaker": {"type": "string"},
                    "text": {"type": "string"},
                    "evidence": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["speaker", "text", "evidence"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["bullets"],
    "additionalProperties": False,
}

VERDICTS = ("CORRECT", "WRONG")
QA_JUDGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"verdict": {"type": "string", "enum": list(VERDICTS)}},
    "required": ["verdict"],
    "additionalProperties": False,
}

UPDATE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"update": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["update"],
    "additionalProperties": False,
}


_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.DOTALL)
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_LABEL = re.compile(r"\b[Tt](\d+)\b")
_BULLET_LINE = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])\s+(.*\S)\s*$")
MIN_BULLET_CHARS = 3


@dataclass
class Parsed:
    """A parse outcome: `value` on success (with `method` strict or lenient), else `error`."""

    value: Any = None
    method: str | None = None
    error: str | None = None
    notes: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


def _strip_fence(text: str) -> str:
    text = text.strip()
    match = _FENCE.match(text)
    return match.group(1).strip() if match else text


def _json_objects(text: str) -> list[Any]:
    """Every JSON value that starts at a `{` or `[` in `text`, in order (for the lenient parsers)."""
    decoder = json.JSONDecoder()
    found, i = [], 0
    while True:
        starts = [p for p in (text.find("{", i), text.find("[", i)) if p >= 0]
        if not starts:
            return found
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            i = start + 1
            continue
        found.append(value)
        i = end


def _score_value(value: Any) -> float | None:
    """`value` as a score when it is a real number in [0, 1] (booleans are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and 0.0 <= value <= 1.0 else None


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _json_body(text: str | None) -> tuple[Any, Parsed | None]:
    """The whole output (optionally in a ``` fence) decoded as JSON, or the `Parsed` error saying why not."""
    try:
        return json.loads(_strip_fence(text or "")), None
    except ValueError as exc:
        return None, Parsed(error=f"not JSON ({exc.msg})")


def _strict_then_lenient(text: str | None, strict: Callable[[str], Parsed], lenient: Callable[[str], Parsed],
                         what: str) -> Parsed:
    """`strict(text)`, else `lenient(text)`; empty text is an error, and a failure names both reasons."""
    if text is None or not text.strip():
        return Parsed(error="empty output")
    first = strict(text)
    if first.ok:
        return first
    second = lenient(text)
    if second.ok:
        return second
    return Parsed(error=f"{what}: strict: {first.error}; lenient: {second.error}; text {_short(text)!r}")


# ---------------------------------------------------------------- judge


def parse_judge_strict(text: str) -> Parsed:
    """The whole output (optionally in a ``` fence) is `{"score": x}` with x a number in [0, 1]."""
    obj, failed = _json_body(text)
    if failed is not None:
        return failed
    if not isinstance(obj, dict):
        return Parsed(error=f"JSON {type(obj).__name__}, expected an object")
    if set(obj) != {"score"}:
        return Parsed(error=f"JSON keys {sorted(obj)}, expected exactly ['score']")
    score = _score_value(obj["score"])
    if score is None:
        return Parsed(error=f"score {obj['score']!r} is not a number in [0, 1]")
    return Parsed(value=score, method="strict")


def parse_judge_lenient(text: str) -> Parsed:
    """A JSON object with a valid `score` anywhere in the text, else the first plain number if in [0, 1].

    Numbers that are part of a fraction (`7/10`), a percentage (`80%`) or a range (`0-1`)
    are skipped as not being a score; the first remaining number decides (it is not
    replaced by a later one when out of range, so turn numbers or ratings never leak in).
    """
    text = text or ""
    for obj in _json_objects(text):
        if isinstance(obj, dict) and "score" in obj:
            score = _score_value(obj["score"])
            if score is not None:
                return Parsed(value=score, method="lenient")
    for match in _NUMBER.finditer(text):
        after = text[match.end():match.end() + 2]
        before = text[max(0, match.start() - 2):match.start()]
        if (after[:1] in ("/", "%") or (after[:1] == "-" and after[1:2].isdigit())
                or before[-1:] == "/" or (before[-1:] == "-" and before[:1].isdigit())):
            continue
        try:
            score = _score_value(float(match.group(0)))
        except ValueError:
            score = None
        if score is None:
            return Parsed(error=f"first number {match.group(0)!r} is not in [0, 1]")
        return Parsed(value=score, method="lenient")
    return Parsed(error="no number in the output")


def parse_judge(text: str | None) -> Parsed:
    """Strict, then lenient; the error names both reasons and a snippet of the text."""
    return _strict_then_lenient(text, parse_judge_strict, parse_judge_lenient, "unparseable judge output")


# ---------------------------------------------------------------- summarize


@dataclass
class Bullet:
    """One parsed summary bullet with evidence resolved to the session's turn ids."""

    text: str
    evidence: list[str]
    speaker: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"speaker": self.speaker, "text": self.text, "evidence": self.evidence}


def resolve_evidence(refs: Any, labels: Mapping[str, str]) -> tuple[list[str], int]:
    """Map evidence references (T3, t3, 3 or a real turn id) to turn ids; count the ones that do not exist."""
    if refs is None:
        return [], 0
    if isinstance(refs, (str, int)) and not isinstance(refs, bool):
        refs = [refs]
    if not isinstance(refs, list):
        return [], 1
    by_id = set(labels.values())
    out: list[str] = []
    dropped = 0
    for ref in refs:
        turn = None
        if isinstance(ref, bool):
            turn = None
        elif isinstance(ref, int):
            turn = labels.get(f"T{ref}")
        elif isinstance(ref, str):
            key = ref.strip()
            if key in by_id:
                turn = key
            else:
                match = re.fullmatch(r"[Tt]?\s*(\d+)", key)
                turn = labels.get(f"T{int(match.group(1))}") if match else None
        if turn is None:
            dropped += 1
        elif turn not in out:
            out.append(turn)
    return out, dropped


def _bullets_from_items(items: list[Any], labels: Mapping[str, str], speakers: set[str] | None,
                        strict: bool) -> Parsed:
    bullets: list[Bullet] = []
    notes = {"evidence_dropped": 0, "bullets_dropped": 0, "speakers_unknown": 0}
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            if strict:
                return Parsed(error=f"bullets[{i}] is {type(item).__name__}, expected an object")
            notes["bullets_dropped"] += 1
            continue
        if strict and set(item) != {"speaker", "text", "evidence"}:
            return Parsed(error=f"bullets[{i}] keys {sorted(item)}, expected ['evidence', 'speaker', 'text']")
        text = item.get("text")
        if strict and not isinstance(text, str):
            return Parsed(error=f"bullets[{i}].text is not a string")
        if strict and not (isinstance(item.get("evidence"), list)
                           and all(isinstance(e, str) for e in item["evidence"])):
            return Parsed(error=f"bullets[{i}].evidence is not a list of strings")
        if not isinstance(text, str) or len(text.strip()) < MIN_BULLET_CHARS:
            notes["bullets_dropped"] += 1
            continue
        evidence, dropped = resolve_evidence(item.get("evidence"), labels)
        notes["evidence_dropped"] += dropped
        speaker = item.get("speaker")
        speaker = speaker.strip() if isinstance(speaker, str) and speaker.strip() else None
        if speaker is not None and speakers and speaker not in speakers:
            notes["speakers_unknown"] += 1
            speaker = None
        bullets.append(Bullet(text=" ".join(text.split()), evidence=evidence, speaker=speaker))
    return Parsed(value=bullets, method="strict" if strict else "lenient", notes=notes)


def parse_summary_strict(text: str, labels: Mapping[str, str], speakers: set[str] | None = None) -> Parsed:
    """The whole output (optionally fenced) is `{"bullets": [{"speaker", "text", "evidence"}]}`."""
    obj, failed = _json_body(text)
    if failed is not None:
        return failed
    if not isinstance(obj, dict) or set(obj) != {"bullets"} or not isinstance(obj["bullets"], list):
        return Parsed(error="expected exactly {\"bullets\": [...]}")
    return _bullets_from_items(obj["bullets"], labels, speakers, strict=True)


def parse_summary_lenient(text: str, labels: Mapping[str, str], speakers: set[str] | None = None) -> Parsed:
    """An embedded `{"bullets": [...]}` object or bullet list, else Markdown list lines citing T-labels."""
    text = text or ""
    for obj in _json_objects(text):
        items = obj.get("bullets") if isinstance(obj, dict) else obj
        if isinstance(items, list) and any(isinstance(x, dict) and "text" in x for x in items):
            parsed = _bullets_from_items(items, labels, speakers, strict=False)
            if parsed.value:
                return parsed
    items = []
    for line in text.splitlines():
        match = _BULLET_LINE.match(line)
        if not match:
            continue
        body = match.group(1)
        refs = [f"T{n}" for n in _LABEL.findall(body)]
        clean = re.sub(r"[\[(]\s*(?:[Tt]\d+[\s,;]*)+[\])]", "", body)
        clean = _LABEL.sub("", clean).strip(" -:;,")
        items.append({"text": clean, "evidence": refs})
    parsed = _bullets_from_items(items, labels, speakers, strict=False)
    if parsed.value:
        return parsed
    return Parsed(error="no JSON bullets and no list lines")


def parse_summary(text: str | None, labels: Mapping[str, str], speakers: set[str] | None = None) -> Parsed:
    """Strict, then lenient. A strict empty list is a valid (empty) summary."""
    return _strict_then_lenient(text, lambda t: parse_summary_strict(t, labels, speakers),
                                lambda t: parse_summary_lenient(t, labels, speakers), "unparseable summary")


# ---------------------------------------------------------------- reply

_TAGGED = re.compile(r"<(turn|reply|utterance|response)\b[^>]*>(.*?)</\1\s*>", re.DOTALL | re.IGNORECASE)
_ANY_TAG = re.compile(r"</?(?:turn|reply|utterance|response|dialogue|memory|note|target)\b[^>]*>", re.IGNORECASE)
_ROLE_PREFIX = re.compile(r"^\s*(?:assistant|reply|response|answer|utterance)\s*:\s*", re.IGNORECASE)
_QUOTES = {('"', '"'), ("'", "'"), ("\u201c", "\u201d"), ("\u2018", "\u2019")}
_WORD = re.compile(r"[^\W_]", re.UNICODE)


def _speaker_prefix(line: str, speakers: list[str]) -> tuple[str | None, str]:
    """(the speaker named at the start of `line` as `Name:`, the rest), or (None, line)."""
    stripped = line.lstrip()
    for name in sorted(speakers, key=len, reverse=True):
        if stripped[:len(name)].casefold() == name.casefold() and stripped[len(name):].lstrip().startswith(":"):
            return name, stripped[len(name):].lstrip()[1:].lstrip()
    return None, line


def parse_reply(text: str | None, target_speaker: str | None = None, speakers: set[str] | list[str] | None = None
                ) -> Parsed:
    """A generated utterance: strict when the output is already just the text, else cleaned leniently.

    Lenient cleaning (in order): a ``` fence is removed; the content of a first `<turn>`/`<reply>`
    element is taken (HTML-unescaped); a leading `Name:` of the target speaker or a role word
    (`Assistant:`, `Reply:`) is removed; the text is cut where the model goes on with a
    `Name:` line of any known speaker (it continued the dialogue); wrapping quotes are removed.
    Whitespace is collapsed to single spaces. Empty output, or output without a single letter
    or digit after cleaning, is an error (the caller retries, then makes an error row).
    """
    import html

    if text is None or not text.strip():
        return Parsed(error="empty output")
    names = sorted({s for s in (speakers or []) if isinstance(s, str) and s.strip()}
                   | ({target_speaker} if target_speaker else set()))
    clean = _strip_fence(text)
    tagged = _TAGGED.search(clean)
    if tagged:
        clean = html.unescape(tagged.group(2))
    clean = _ANY_TAG.sub(" ", clean).strip()
    clean = _ROLE_PREFIX.sub("", clean)
    lines = clean.splitlines()
    if lines:
        who, rest = _speaker_prefix(lines[0], names)
        if who is not None and (target_speaker is None or who.casefold() == target_speaker.casefold()):
            lines[0] = rest
        kept = [lines[0]]
        for line in lines[1:]:
            if _speaker_prefix(line, names)[0] is not None:
                break  # the model went on writing the next turns of the dialogue
            kept.append(line)
        clean = "\n".join(kept)
    clean = clean.strip()
    while len(clean) >= 2 and (clean[0], clean[-1]) in _QUOTES:
        clean = clean[1:-1].strip()
    clean = " ".join(clean.split())
    if not clean:
        return Parsed(error=f"no reply text after cleaning; text {_short(text)!r}")
    if not _WORD.search(clean):
        return Parsed(error=f"reply has no letter or digit; text {_short(text)!r}")
    method = "strict" if clean == " ".join(text.split()) else "lenient"
    return Parsed(value=clean, method=method)


# ---------------------------------------------------------------- answer (qa-eval)


def parse_answer(text: str | None) -> Parsed:
    """A generated answer: the reply cleaning without speakers (fence, tags, `Answer:` prefix, quotes, spaces).

    An abstention ("No information available") is a valid answer; scoring decides what it is worth.
    """
    return parse_reply(text)


# ---------------------------------------------------------------- qa_judge (qa-eval)

_VERDICT_WORD = re.compile(r"\b(CORRECT|INCORRECT|WRONG)\b", re.IGNORECASE)


def _one_choice(text: str, key: str, choices: tuple[str, ...]) -> Parsed:
    """The whole output (optionally fenced) is `{key: one of choices}`; the value is the choice."""
    obj, failed = _json_body(text)
    if failed is not None:
        return failed
    if not isinstance(obj, dict) or set(obj) != {key}:
        return Parsed(error=f"expected exactly {{\"{key}\": ...}}")
    if obj[key] not in choices:
        return Parsed(error=f"{key} {obj[key]!r} is not one of {list(choices)}")
    return Parsed(value=obj[key], method="strict")


def parse_qa_judge_strict(text: str) -> Parsed:
    """The whole output (optionally fenced) is `{"verdict": "CORRECT"}` or `{"verdict": "WRONG"}`."""
    return _one_choice(text, "verdict", VERDICTS)


def parse_qa_judge_lenient(text: str) -> Parsed:
    """A JSON object with `verdict` (or `label`) anywhere, else the first word CORRECT/WRONG/INCORRECT (any case).

    INCORRECT counts as WRONG; the first such word decides, so a later restatement cannot flip it.
    """
    text = text or ""
    for obj in _json_objects(text):
        if isinstance(obj, dict):
            for key in ("verdict", "label"):
                value = obj.get(key)
                if isinstance(value, str) and value.strip().upper() in VERDICTS + ("INCORRECT",):
                    return Parsed(value="CORRECT" if value.strip().upper() == "CORRECT" else "WRONG", method="lenient")
    match = _VERDICT_WORD.search(text)
    if match is None:
        return Parsed(error="no CORRECT/WRONG verdict in the output")
    return Parsed(value="CORRECT" if match.group(1).upper() == "CORRECT" else "WRONG", method="lenient")


def parse_qa_judge(text: str | None) -> Parsed:
    """Strict, then lenient; the error names both reasons and a snippet of the text."""
    return _strict_then_lenient(text, parse_qa_judge_strict, parse_qa_judge_lenient, "unparseable verdict")


# ---------------------------------------------------------------- update (supersession's llm judge)

_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_update_strict(text: str) -> Parsed:
    """The whole output (optionally fenced) is `{"update": "yes"}` or `{"update": "no"}` -> True / False."""
    parsed = _one_choice(text, "update", ("yes", "no"))
    return Parsed(value=parsed.value == "yes", method="strict") if parsed.ok else parsed


def parse_update_lenient(text: str) -> Parsed:
    """A JSON object whose `update` is yes/no or a boolean anywhere, else the first word yes/no (any case)."""
    text = text or ""
    for obj in _json_objects(text):
        value = obj.get("update") if isinstance(obj, dict) else None
        if isinstance(value, bool):
            return Parsed(value=value, method="lenient")
        if isinstance(value, str) and value.strip().lower() in ("yes", "no"):
            return Parsed(value=value.strip().lower() == "yes", method="lenient")
    match = _YES_NO.search(text)
    if match is None:
        return Parsed(error="no yes/no in the output")
    return Parsed(value=match.group(1).lower() == "yes", method="lenient")


def parse_update(text: str | None) -> Parsed:
    """Strict, then lenient; the error names both reasons and a snippet of the text."""
    return _strict_then_lenient(text, parse_update_strict, parse_update_lenient, "unparseable update verdict")
