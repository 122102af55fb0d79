"""Adapter for memprune's canonical JSON-lines format: one conversation per line.

```json
{"conversation_id": "c1",
 "sessions": [
   {"session_index": 1, "time": "2024-05-01 10:00",
    "turns": [{"speaker": "alice", "text": "I just adopted a cat.", "id": "a1"}, ...],
    "bullets": [{"speaker": "alice", "text": "Alice has a cat.", "evidence": [0]}, ...]}],
 "qa": [{"question": "Which pet does Alice have?", "answer": "a cat",
         "evidence": ["a1"], "category": 1}]}
```

`session_index` defaults to the position (1-based); `time`, turn `id`, `bullets`, `qa`,
`speaker` of a bullet and `category` are optional. A bullet's evidence item is an integer
(0-based turn position in the same session) or a turn `id` string; a QA evidence item is a
turn `id` string or a `[session_index, turn_position]` pair. Evidence that points to no
turn is dropped and logged (kind `evidence`); an item left without evidence is rejected.
A container field of the wrong type (`qa` or `bullets` not a list) is logged as kind `field`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memprune.adapters import Adapter, Conversation, IngestError, first_text_problem, json_type, register, text_problem
from memprune.rejects import Ledger
from memprune.schema import bullet_id, qa_id, turn_id


@register
class JsonlAdapter(Adapter):
    """Canonical JSON lines -> sessions, bullets and qa."""

    name = "jsonl"
    has_qa = True

    def read(self, path: Path, ledger: Ledger, split: str | None = None) -> Iterator[Conversation]:
        files = _input_files(Path(path))
        seen_ids: set[str] = set()
        for file in files:
            try:
                fh = open(file, "rb")
            except OSError as exc:
                raise IngestError(f"{file}: cannot read: {exc}") from exc
            with fh:
                for lineno, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    reader = _Record(str(file), lineno, ledger)
                    conv = reader.parse(line, seen_ids)
                    if conv is not None:
                        seen_ids.add(conv.conversation_id)
                        yield conv


def _input_files(path: Path) -> list[Path]:
    if not path.exists():
        raise IngestError(f"{path}: no such file or directory")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".jsonl", ".json"))
    if not files:
        raise IngestError(f"{path}: no .jsonl files in this directory")
    return files


INT32_MAX = 2**31 - 1  # session_index and category are int32 columns


class _Record:
    """Parses one line; every rejection names the file, the line and the JSON field."""

    def __init__(self, source: str, lineno: int, ledger: Ledger) -> None:
        self.source, self.lineno, self.ledger = source, lineno, ledger
        self.record = f"line {lineno}"

    def reject(self, field: str, kind: str, reason: str, value: Any = None, lost: dict[str, int] | None = None) -> None:
        self.ledger.reject(source=self.source, record=self.record, field=field, kind=kind,
                           reason=reason, value=value, lost=lost)

    def parse(self, line: bytes, seen_ids: set[str]) -> Conversation | None:
        self.ledger.saw("conversation")
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            self.reject("", "conversation", f"not valid UTF-8 ({exc.reason} at byte {exc.start})",
                        line[:80].decode("utf-8", "replace"))
            return None
        except json.JSONDecodeError as exc:
            self.reject("", "conversation", f"invalid JSON: {exc.msg} (column {exc.colno})",
                        line[:80].decode("utf-8", "replace"))
            return None
        except RecursionError:
            self.reject("", "conversation", "JSON nested too deeply to be a conversation",
                        line[:80].decode("utf-8", "replace"))
            return None
        if not isinstance(obj, dict):
            self.reject("", "conversation", f"a line must be a JSON object, got {json_type(obj)}", obj)
            return None
        lost = _contents(obj)
        for kind, n in lost.items():
            self.ledger.saw(kind, n)
        cid = obj.get("conversation_id")
        if reason := text_problem("conversation_id", cid):
            self.reject("conversation_id", "conversation", reason, cid, lost)
            return None
        self.record = f"line {self.lineno} ({cid})"
        if cid in seen_ids:
            self.reject("conversation_id", "conversation", "duplicate conversation_id", cid, lost)
            return None
        sessions = obj.get("sessions")
        if not isinstance(sessions, list) or not sessions:
            self.reject("sessions", "conversation", "missing, empty or not a list", sessions, lost)
            return None
        conv = Conversation(conversation_id=cid)
        turn_refs: dict[str, str] = {}  # user turn id -> canonical id
        turn_session: dict[str, int] = {}  # canonical turn id -> its session_index
        by_position: dict[tuple[int, int], str] = {}
        pending_bullets: list[tuple[int, int, dict[str, Any], list[dict[str, Any]] | None]] = []
        for s_pos, session in enumerate(sessions):
            self._session(cid, s_pos, session, conv, turn_refs, turn_session, by_position, pending_bullets)
        for k, b_pos, bullet, turns in pending_bullets:
            self._bullet(cid, k, b_pos, bullet, turns, turn_refs, turn_session, conv)
        qa = obj.get("qa", [])
        if not isinstance(qa, list):
            self.ledger.saw("field")
            self.reject("qa", "field", "qa is not a list", qa)
        else:
            for q_pos, item in enumerate(qa):
                self._qa(cid, q_pos, item, turn_refs, by_position, conv)
        if not conv.sessions:
            self.reject("sessions", "conversation", "no usable session")
            return None
        return conv

    def _session(self, cid, s_pos, session, conv, turn_refs, turn_session, by_position, pending_bullets) -> None:
        field = f"sessions[{s_pos}]"
        if not isinstance(session, dict):
            self.reject(field, "session", f"session is {json_type(session)}, expected an object", session)
            return
        n_bullets = len(session["bullets"]) if isinstance(session.get("bullets"), list) else 0
        lost = {"turn": _len(session.get("turns")), "bullet": n_bullets, "evidence": _refs(session.get("bullets"))}
        k = session.get("session_index", s_pos + 1)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= INT32_MAX:
            self.reject(f"{field}.session_index", "session", f"not an integer in 0..{INT32_MAX}", k, lost)
            return
        if any(s["session_index"] == k for s in conv.sessions):
            self.reject(f"{field}.session_index", "session", "duplicate session_index", k, lost)
            return
        time = session.get("time")
        if time is not None and (reason := text_problem("time", time, allow_empty=True)):
            self.reject(f"{field}.time", "session", reason, time, lost)
            return
        turns_in = session.get("turns")
        if not isinstance(turns_in, list) or not turns_in:
            self.reject(f"{field}.turns", "session", "missing, empty or not a list", turns_in, lost)
            return
        turns: list[dict[str, Any]] = []
        speakers: list[str] = []
        positions: list[str | None] = []
        for t_pos, turn in enumerate(turns_in):
            tfield = f"{field}.turns[{t_pos}]"
            positions.append(None)
            if not isinstance(turn, dict):
                self.reject(tfield, "turn", f"turn is {json_type(turn)}, expected an object", turn)
                continue
            speaker, text, user_id = turn.get("speaker"), turn.get("text"), turn.get("id")
            if problem := first_text_problem(("speaker", "speaker", speaker), ("text", "text", text)):
                self.reject(f"{tfield}.{problem[0]}", "turn", problem[1], problem[2])
                continue
            if user_id is not None and (not isinstance(user_id, str) or user_id in turn_refs):
                reason = "duplicate turn id" if isinstance(user_id, str) else "id is not a string"
                self.reject(f"{tfield}.id", "turn", reason, user_id)
                continue
            tid = turn_id(cid, k, t_pos)
            turn_session[tid] = k
            if user_id is not None:
                turn_refs[user_id] = tid
            by_position[(k, t_pos)] = tid
            positions[-1] = tid
            turns.append({"turn_id": tid, "speaker": speaker, "text": text})
            if speaker not in speakers:
                speakers.append(speaker)
        bullets = session.get("bullets", [])
        if not turns:
            self.reject(f"{field}.turns", "session", "no usable turn", lost={"bullet": n_bullets,
                                                                               "evidence": _refs(bullets)})
            return
        conv.sessions.append({"conversation_id": cid, "session_index": k, "speakers": speakers,
                              "turns": turns, "time": time})
        if not isinstance(bullets, list):
            self.ledger.saw("field")
            self.reject(f"{field}.bullets", "field", "bullets is not a list", bullets)
            return
        for b_pos, bullet in enumerate(bullets):
            pending_bullets.append((k, b_pos, bullet, positions))

    def _bullet(self, cid, k, b_pos, bullet, positions, turn_refs, turn_session, conv) -> None:
        field = f"sessions[session_index={k}].bullets[{b_pos}]"
        if not isinstance(bullet, dict):
            self.reject(field, "bullet", f"bullet is {json_type(bullet)}, expected an object", bullet)
            return
        text, speaker = bullet.get("text"), bullet.get("speaker")
        lost = {"evidence": _refs([bullet])}
        if reason := text_problem("text", text):
            self.reject(f"{field}.text", "bullet", reason, text, lost)
            return
        if speaker is not None and (reason := text_problem("speaker", speaker)):
            self.reject(f"{field}.speaker", "bullet", reason, speaker, lost)
            return

        def resolve(ref: Any) -> str | None:
            if isinstance(ref, int) and not isinstance(ref, bool):
                return positions[ref] if 0 <= ref < len(positions) else None
            return turn_refs.get(ref) if isinstance(ref, str) else None

        evidence = self._evidence(f"{field}.evidence", bullet.get("evidence"), resolve,
                                  later=lambda tid: turn_session[tid] > k)
        if evidence is None:
            self.reject(f"{field}.evidence", "bullet", "no evidence turn resolves", bullet.get("evidence"))
            return
        conv.bullets.append({"bullet_id": bullet_id(cid, k, b_pos), "conversation_id": cid, "session_index": k,
                             "speaker": speaker, "text": text.strip(), "evidence": evidence})

    def _qa(self, cid, q_pos, item, turn_refs, by_position, conv) -> None:
        field = f"qa[{q_pos}]"
        if not isinstance(item, dict):
            self.reject(field, "qa", f"qa item is {json_type(item)}, expected an object", item)
            return
        question, answer, category = item.get("question"), item.get("answer"), item.get("category")
        lost = {"evidence": _refs([item])}
        if reason := text_problem("question", question):
            self.reject(f"{field}.question", "qa", reason, question, lost)
            return
        if isinstance(answer, float) and not math.isfinite(answer):
            self.reject(f"{field}.answer", "qa", "answer is not a finite number", answer, lost)
            return
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if answer is not None and (reason := text_problem("answer", answer, allow_empty=True)):
            self.reject(f"{field}.answer", "qa", reason, answer, lost)
            return
        if category is not None and (isinstance(category, bool) or not isinstance(category, int)
                                     or not -INT32_MAX - 1 <= category <= INT32_MAX):
            self.reject(f"{field}.category", "qa", "category is not an integer in the int32 range", category, lost)
            return

        def resolve(ref: Any) -> str | None:
            if isinstance(ref, str):
                return turn_refs.get(ref)
            if (isinstance(ref, list) and len(ref) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in ref)):
                return by_position.get((ref[0], ref[1]))
            return None

        evidence = self._evidence(f"{field}.evidence", item.get("evidence"), resolve)
        if evidence is None:
            self.reject(f"{field}.evidence", "qa", "no evidence turn resolves", item.get("evidence"))
            return
        conv.qa.append({"qa_id": qa_id(cid, q_pos), "conversation_id": cid, "question": question,
                        "answer": answer, "evidence": evidence,
                        "category": category})

    def _evidence(self, field: str, refs: Any, resolve, later=None) -> list[str] | None:
        """Resolve evidence refs to turn ids; drop (and log) the ones that resolve to no turn.

        Every ref was counted as seen with its conversation (`_contents`); here each is written or rejected.
        """
        if not isinstance(refs, list) or not refs:
            return None
        out: list[str] = []
        for i, ref in enumerate(refs):
            tid = resolve(ref)
            if tid is None:
                self.reject(f"{field}[{i}]", "evidence", "refers to no usable turn", ref)
            elif later is not None and later(tid):
                self.reject(f"{field}[{i}]", "evidence", "refers to a turn of a later session", ref)
            elif tid in out:
                self.reject(f"{field}[{i}]", "evidence", "duplicate evidence reference", ref)
            else:
                out.append(tid)
        return out or None


def _len(value: Any) -> int:
    return len(value) if isinstance(value, list) else 0


def _refs(items: Any) -> int:
    """The evidence references of a list of bullets or QA items (what a rejected container takes along)."""
    return sum(_len(i.get("evidence")) for i in items if isinstance(i, dict)) if isinstance(items, list) else 0


def _contents(obj: dict[str, Any]) -> dict[str, int]:
    """Counts of sessions, turns, bullets, qa items and evidence references inside a conversation object."""
    sessions = obj.get("sessions") if isinstance(obj.get("sessions"), list) else []
    dicts = [s for s in sessions if isinstance(s, dict)]
    return {
        "session": len(sessions),
        "turn": sum(_len(s.get("turns")) for s in dicts),
        "bullet": sum(_len(s.get("bullets")) for s in dicts),
        "qa": _len(obj.get("qa")),
        "evidence": sum(_refs(s.get("bullets")) for s in dicts) + _refs(obj.get("qa")),
    }
