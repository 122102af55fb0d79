"""Prompt templates (versioned text files in `memprune/prompts`) and the chat messages built from them.

A template file holds chat messages: a line `=== system ===` or `=== user ===` starts one;
`#` lines before the first message are comments. `{{name}}` placeholders are filled in a
single pass, so a placeholder-looking string inside the dialogue is never expanded.
Untrusted dialogue text is HTML-escaped and enclosed in tags (`<turn>`, `<bullet>`, ...):
it cannot close a tag or masquerade as instructions, and it only ever appears as data.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from memprune.errors import MemPruneError

PROMPTS_DIR = Path(__file__).resolve().parents[1] / "prompts"
_SECTION = re.compile(r"^===\s*(system|user|assistant)\s*===\s*$")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")

NO_MEMORY = "(no memory notes)"


class PromptError(MemPruneError):
    """A prompt template is missing or malformed; the message names the file."""


@dataclass(frozen=True)
class PromptTemplate:
    """A parsed template: its name (file stem, e.g. `judge_v1`), path and (role, text) messages."""

    name: str
    path: str
    messages: tuple[tuple[str, str], ...]

    @property
    def placeholders(self) -> frozenset[str]:
        return frozenset(m for _, text in self.messages for m in _PLACEHOLDER.findall(text))

    def render(self, values: Mapping[str, str]) -> list[dict[str, str]]:
        """Chat messages with every placeholder replaced once by `values[name]` (already escaped)."""
        missing = self.placeholders - set(values)
        if missing:
            raise PromptError(f"{self.path}: no value for placeholder(s) {sorted(missing)}")
        return [{"role": role, "content": _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)}
                for role, text in self.messages]


def parse_template(text: str, name: str, path: str) -> PromptTemplate:
    """Parse template text into messages; errors name `path` and the line."""
    messages: list[tuple[str, list[str]]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        match = _SECTION.match(line)
        if match:
            messages.append((match.group(1), []))
        elif messages:
            messages[-1][1].append(line)
        elif line.strip() and not line.startswith("#"):
            raise PromptError(f"{path}:{lineno}: text before the first '=== role ===' line")
    if not messages:
        raise PromptError(f"{path}: no '=== system ===' / '=== user ===' sections")
    out = tuple((role, "\n".join(lines).strip("\n")) for role, lines in messages)
    if out[-1][0] != "user":
        raise PromptError(f"{path}: the last message must be a user message")
    return PromptTemplate(name=name, path=path, messages=out)


@lru_cache(maxsize=32)
def read_template(name_or_path: str, placeholders: frozenset[str] | None = None, what: str = "a") -> PromptTemplate:
    """Load a template by name (`judge_v1` -> memprune/prompts/judge_v1.txt) or path; with `placeholders`, check it
    uses exactly those (`memprune.llm.tasks.load_template` gives a task's)."""
    candidate = Path(name_or_path).expanduser()
    path = candidate if candidate.suffix and candidate.exists() else PROMPTS_DIR / f"{name_or_path}.txt"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROMPTS_DIR.glob("*.txt")))
        raise PromptError(f"prompt template {name_or_path!r} not found (not a file; known names: {known})")
    template = parse_template(path.read_text(encoding="utf-8"), path.stem, str(path))
    if placeholders is not None and template.placeholders != placeholders:
        raise PromptError(f"{path}: {what} template must use exactly the placeholders {sorted(placeholders)}; "
                          f"it uses {sorted(template.placeholders)}")
    return template


def escape(text: Any) -> str:
    """Untrusted text as inert data: HTML-escaped (so it cannot open or close a tag), never None."""
    return html.escape("" if text is None else str(text), quote=True)


def render_turn(speaker: Any, text: Any, turn_label: str | None = None) -> str:
    """One dialogue turn as a `<turn>` element (optionally with its id)."""
    ident = f' id="{escape(turn_label)}"' if turn_label is not None else ""
    return f'<turn{ident} speaker="{escape(speaker)}">{escape(text)}</turn>'


def render_context(row: Mapping[str, Any]) -> list[str]:
    """The row's `context` (list of {speaker, text}) as `<turn>` lines; a malformed context is a `PromptError`."""
    context = row.get("context") or []
    if not isinstance(context, Sequence) or isinstance(context, str):
        raise PromptError(f"field 'context' must be a list of {{speaker, text}}, got {type(context).__name__}")
    lines = []
    for i, turn in enumerate(context):
        if not isinstance(turn, Mapping) or "text" not in turn:
            raise PromptError(f"field 'context' item {i} must be a {{speaker, text}} mapping, got {turn!r}")
        lines.append(render_turn(turn.get("speaker"), turn.get("text")))
    return lines


def _judged_dialogue(row: Mapping[str, Any]) -> dict[str, str]:
    """The placeholders every judge prompt shares: the context before the target, the target and its speaker."""
    target = _required_text(row, "target")
    lines = render_context(row)
    return {
        "context": "\n".join(lines) if lines else "(no earlier turns in this session)",
        "target_speaker": escape(row.get("target_speaker")),
        "target": target,
    }


def judge_messages(row: Mapping[str, Any], template: PromptTemplate) -> list[dict[str, str]]:
    """The judge prompt for one (bullet, context, target) row."""
    bullet = _required_text(row, "bullet")
    return template.render({**_judged_dialogue(row), "bullet": bullet})


def listwise_messages(row: Mapping[str, Any], template: PromptTemplate) -> list[dict[str, str]]:
    """The listwise judge prompt for one (bullets, context, target) row; bullets are numbered 1..k in row order."""
    bullets = row.get("bullets")
    if not isinstance(bullets, Sequence) or isinstance(bullets, str) or not bullets:
        raise PromptError(f"field 'bullets' must be a non-empty list of strings, got {bullets!r}")
    for i, b in enumerate(bullets):
        if not isinstance(b, str) or not b.strip():
            raise PromptError(f"field 'bullets' item {i} must be a non-empty string, got {b!r}")
    listed = "\n".join(f'<bullet id="{i}">{escape(b)}</bullet>' for i, b in enumerate(bullets, 1))
    return template.render({**_judged_dialogue(row), "bullets": listed})


def turn_labels(turns: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Short prompt labels (T1, T2, ...) of a session's turns -> their turn ids."""
    return {f"T{i + 1}": str(turn["turn_id"]) for i, turn in enumerate(turns)}


def summarize_messages(row: Mapping[str, Any], template: PromptTemplate, max_bullets: int) -> list[dict[str, str]]:
    """The summarizer prompt for one sessions row; turns are labelled T1..Tn (see `turn_labels`)."""
    turns = row.get("turns")
    if not isinstance(turns, Sequence) or isinstance(turns, str) or not turns:
        raise PromptError(f"field 'turns' must be a non-empty list of turns, got {turns!r}")
    lines = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or not {"turn_id", "speaker", "text"} <= set(turn):
            raise PromptError(f"field 'turns' item {i} must have turn_id, speaker and text, got {turn!r}")
        lines.append(render_turn(turn["speaker"], turn["text"], f"T{i + 1}"))
    speakers = row.get("speakers") or sorted({str(t["speaker"]) for t in turns})
    values = {
        "speakers": escape(", ".join(str(s) for s in speakers)),
        "time": escape(row.get("time") or "unknown"),
        "turns": "\n".join(lines),
        "max_bullets": str(int(max_bullets)),
    }
    return template.render(values)


def render_note(note: Any, index: int) -> str:
    """One memory note as a `<note>` element; `note` is a string or a mapping with `text`
    (+ `session_index`, `time` (the session's date, when known) and `speaker`)."""
    if isinstance(note, str):
        text, speaker, session, time = note, None, None, None
    elif isinstance(note, Mapping) and isinstance(note.get("text"), str):
        text, speaker, session, time = note["text"], note.get("speaker"), note.get("session_index"), note.get("time")
    else:
        raise PromptError(f"field 'memory' item {index} must be a string or a {{text, speaker}} mapping, got {note!r}")
    attrs = (f' session="{escape(session)}"' if session is not None else "") + \
            (f' time="{escape(time)}"' if time is not None else "") + \
            (f' speaker="{escape(speaker)}"' if speaker is not None else "")
    return f"<note{attrs}>{escape(text)}</note>"


def render_memory(memory: Any) -> str:
    """The `memory` field (a list of notes, or None) as `<note>` lines, or `NO_MEMORY` when empty."""
    if memory is None:
        memory = []
    if not isinstance(memory, Sequence) or isinstance(memory, str):
        raise PromptError(f"field 'memory' must be a list of notes, got {type(memory).__name__}")
    notes = [render_note(note, i) for i, note in enumerate(memory)]
    return "\n".join(notes) if notes else NO_MEMORY


def reply_messages(row: Mapping[str, Any], template: PromptTemplate) -> list[dict[str, str]]:
    """The reply prompt for one row: the dialogue before the target, the memory notes, the speaker to answer as."""
    speaker = row.get("target_speaker")
    if not isinstance(speaker, str) or not speaker.strip():
        raise PromptError(f"field 'target_speaker' must be a non-empty string, got {speaker!r}")
    lines = render_context(row)
    values = {
        "context": "\n".join(lines) if lines else "(no earlier turns in this session)",
        "memory": render_memory(row.get("memory")),
        "target_speaker": escape(speaker),
    }
    return template.render(values)


def _required_text(row: Mapping[str, Any], key: str) -> str:
    """`row[key]` escaped, or a `PromptError` when it is not a non-empty string."""
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise PromptError(f"field {key!r} must be a non-empty string, got {value!r}")
    return escape(value)


def answer_messages(row: Mapping[str, Any], template: PromptTemplate) -> list[dict[str, str]]:
    """The answer prompt of qa-eval for one row: the memory notes, then the question."""
    question = _required_text(row, "question")
    return template.render({"memory": render_memory(row.get("memory")), "question": question})


def qa_judge_messages(row: Mapping[str, Any], template: PromptTemplate) -> list[dict[str, str]]:
    """The CORRECT/WRONG verdict prompt for one (question, gold answer, generated answer) row."""
    values = {"question": _required_text(row, "question"), "gold": _required_text(row, "gold"),
              "answer": _required_text(row, "prediction")}
    return template.render(values)


def update_messages(row: Mapping[str, Any], template: PromptTemplate) -> list[dict[str, str]]:
    """The "does the later note replace the earlier one?" prompt for one (earlier, later) row."""
    return template.render({"earlier": _required_text(row, "earlier"), "later": _required_text(row, "later")})
