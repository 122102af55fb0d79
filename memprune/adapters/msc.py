"""Adapter for the ParlAI Multi-Session Chat persona-summary layout.

Layout: `DIR/session_K/<split>.txt`, one JSON object per line; the K-th session of an
episode is the line with the same `initial_data_id` in `session_K`. Each turn's
`persona_text` (when present) is the fact extracted from that turn, so it becomes a
bullet whose evidence is that turn.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memprune.adapters import Adapter, Conversation, IngestError, first_text_problem, json_type, register, text_problem
from memprune.rejects import Ledger
from memprune.schema import bullet_id, turn_id

SESSION_DIR = re.compile(r"^session_(\d+)$")


def find_session_files(path: Path, split: str) -> list[tuple[int, Path]]:
    """The `(K, session_K/<split>.txt)` files under `path` (or its `msc_personasummary/`), by K."""
    if not path.exists():
        raise IngestError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise IngestError(f"{path}: the msc format expects a directory holding session_K/{split}.txt")
    root = path
    if not any(SESSION_DIR.match(p.name) for p in root.iterdir()) and (path / "msc_personasummary").is_dir():
        root = path / "msc_personasummary"
    found = sorted(
        (int(m.group(1)), d / f"{split}.txt")
        for d in root.iterdir()
        if d.is_dir() and (m := SESSION_DIR.match(d.name))
    )
    files = [(k, f) for k, f in found if f.is_file()]
    if not files:
        raise IngestError(f"{root}: no session_K/{split}.txt files (is this the msc_personasummary directory?)")
    return files


@register
class MscAdapter(Adapter):
    """MSC persona-summary layout -> sessions and persona_text bullets (no QA)."""

    name = "msc"
    default_split = "valid"

    def read(self, path: Path, ledger: Ledger, split: str | None = None) -> Iterator[Conversation]:
        split = split or self.default_split
        files = find_session_files(Path(path), split)
        # Episodes are linked across files, so the whole split is grouped before yielding;
        # MSC splits are small (thousands of episodes), so holding parsed rows is fine.
        conversations: OrderedDict[str, Conversation] = OrderedDict()
        for k, file in files:
            for lineno, record in _read_jsonl(file, ledger):
                source, where = str(file), f"line {lineno}"
                for kind, n in _contents(record).items():
                    ledger.saw(kind, n)
                cid = record.get("initial_data_id")
                problem = text_problem("initial_data_id", cid)
                if problem is not None:
                    ledger.reject(
                        source=source, record=where, field="initial_data_id", kind="session",
                        reason=problem, value=cid, lost=_contents(record),
                    )
                    continue
                if cid not in conversations:
                    ledger.saw("conversation")
                    conversations[cid] = Conversation(conversation_id=cid)
                conv = conversations[cid]
                if any(s["session_index"] == k for s in conv.sessions):
                    ledger.reject(
                        source=source, record=f"{where} ({cid})", field="initial_data_id", kind="session",
                        reason="duplicate episode id in this session file", value=cid, lost=_contents(record),
                    )
                    continue
                session = _session(record, cid, k, source, where, ledger)
                if session is not None:
                    conv.sessions.append(session[0])
                    conv.bullets.extend(session[1])
        for cid, conv in conversations.items():
            if not conv.sessions:
                ledger.reject(
                    source=str(path), record=cid, field="", kind="conversation",
                    reason="no usable session",
                )
                continue
            yield conv


def _read_jsonl(file: Path, ledger: Ledger) -> Iterator[tuple[int, dict[str, Any]]]:
    """Parsed objects of a JSON-lines file; undecodable or non-object lines are rejected as sessions."""
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise IngestError(f"{file}: cannot read: {exc}") from exc
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        ledger.saw("session")
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            reason = f"not valid UTF-8 ({exc.reason} at byte {exc.start})"
            ledger.reject(source=str(file), record=f"line {lineno}", field="", kind="session", reason=reason,
                          value=line[:80].decode("utf-8", "replace"))
            continue
        except json.JSONDecodeError as exc:
            ledger.reject(source=str(file), record=f"line {lineno}", field="", kind="session",
                          reason=f"invalid JSON: {exc.msg} (column {exc.colno})", value=line[:80].decode())
            continue
        if not isinstance(obj, dict):
            ledger.reject(source=str(file), record=f"line {lineno}", field="", kind="session",
                          reason=f"a line must be a JSON object, got {json_type(obj)}", value=obj)
            continue
        yield lineno, obj


def _contents(record: dict[str, Any]) -> dict[str, int]:
    """Turns and bullets inside a record rejected whole (counted as seen and lost with it)."""
    dialog = record.get("dialog")
    turns = dialog if isinstance(dialog, list) else []
    return {"turn": len(turns), "bullet": sum(1 for t in turns if isinstance(t, dict) and t.get("persona_text"))}


def _session(
    record: dict[str, Any], cid: str, k: int, source: str, where: str, ledger: Ledger
) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """One session row and its bullets from an MSC record; bad turns/bullets are rejected one by one."""
    dialog = record.get("dialog")
    counts = _contents(record)
    where = f"{where} ({cid} session {k})"
    if not isinstance(dialog, list) or not dialog:
        ledger.reject(source=source, record=where, field="dialog", kind="session",
                      reason="missing or empty dialog" if not dialog else f"dialog is {json_type(dialog)}, expected an array",
                      value=dialog, lost=counts)
        return None
    turns: list[dict[str, Any]] = []
    bullets: list[dict[str, Any]] = []
    speakers: list[str] = []
    for i, turn in enumerate(dialog):
        field = f"dialog[{i}]"
        if not isinstance(turn, dict):
            ledger.reject(source=source, record=where, field=field, kind="turn",
                          reason=f"turn is {json_type(turn)}, expected an object", value=turn)
            continue
        persona = turn.get("persona_text")
        speaker, text = turn.get("id"), turn.get("text")
        problem = first_text_problem(("id", "speaker id", speaker), ("text", "text", text))
        if problem is not None:
            ledger.reject(source=source, record=where, field=f"{field}.{problem[0]}", kind="turn",
                          reason=problem[1], value=problem[2], lost={"bullet": 1} if persona else None)
            continue
        tid = turn_id(cid, k, i)
        turns.append({"turn_id": tid, "speaker": speaker, "text": text})
        if speaker not in speakers:
            speakers.append(speaker)
        if not persona:
            continue
        if reason := text_problem("persona_text", persona):
            ledger.reject(source=source, record=where, field=f"{field}.persona_text", kind="bullet",
                          reason=reason, value=persona)
            continue
        ledger.saw("evidence")
        bullets.append({
            "bullet_id": bullet_id(cid, k, i),  # one bullet per turn: the turn's position is its index
            "conversation_id": cid,
            "session_index": k,
            "speaker": speaker,
            "text": persona.strip(),
            "evidence": [tid],
        })
    if not turns:
        ledger.reject(source=source, record=where, field="dialog", kind="session", reason="no usable turn")
        return None
    return {"conversation_id": cid, "session_index": k, "speakers": speakers, "turns": turns, "time": None}, bullets
