"""The LoCoMo adapter: conversations, observations (as bullets) and QA from the LoCoMo JSON file.

The source file is a JSON list of conversations. Each has a `sample_id`, a `conversation`
object (`speaker_a`, `speaker_b`, `session_N` turn lists and `session_N_date_time`
strings), an `observation` object (`session_N_observation`: speaker -> list of
`[fact_text, evidence]`), a `qa` list (`{question, answer, evidence, category}`) and
`session_summary` / `event_summary` (not used: they have no turn evidence).

Evidence in the real file comes in many shapes (a dia id string, a list, joined
strings, zero-padded or malformed ids, ids of turns that do not exist). Every single
evidence id is counted as an item of kind `evidence`: an id that resolves to a kept
turn is written (as the canonical turn id), any other is rejected with its reason. A
bullet or QA item keeps the ids that resolve; when ids were given and none resolves the
item itself is rejected. See docs/locomo.md for the full rule set.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memprune import schema
from memprune.adapters import Adapter, Conversation, IngestError, first_text_problem, json_type, register, text_problem
from memprune.adapters.locomo_items import (
    DATE_KEY,
    SESSION_KEY,
    SPEAKER_KEYS,
    Ctx,
    DiaIndex,
    ItemReader,
    canonical_dia_id,
    conversation_id,
    is_int,
    parse_dia_id,
)
from memprune.rejects import Ledger

class _Reader(ItemReader):
    """Reads one LoCoMo file into conversations, reporting every item to the ledger."""

    def __init__(self, source: Path, ledger: Ledger) -> None:
        self.source = source
        self.src = str(source)
        self.ledger = ledger
        self.sample_ids: set[str] = set()

    # ------------------------------------------------------------ helpers

    def reject(self, record: str, field: str, kind: str, reason: str, value: Any = None, lost: dict[str, int] | None = None) -> None:
        """Report one rejected item to the ledger."""
        self.ledger.reject(source=self.src, record=record, field=field, kind=kind, reason=reason, value=value, lost=lost)

    def load(self) -> list[Any]:
        """Decode the file; anything that is not a UTF-8 JSON list raises `IngestError`."""
        try:
            data = self.source.read_bytes()
        except OSError as exc:
            raise IngestError(f"{self.src}: cannot read: {exc}") from exc
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise IngestError(f"{self.src}: not UTF-8 text: byte offset {exc.start}: {exc.reason}") from exc
        try:
            top = json.loads(text)
        except json.JSONDecodeError as exc:
            raise IngestError(
                f"{self.src}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from exc
        except (ValueError, RecursionError) as exc:  # e.g. a 5000-digit number, absurd nesting
            raise IngestError(f"{self.src}: not readable as JSON: {exc}") from exc
        if not isinstance(top, list):
            raise IngestError(f"{self.src}: top level is {json_type(top)}, expected a list of LoCoMo conversations")
        return top

    @staticmethod
    def contents(raw: Any) -> dict[str, int]:
        """Lenient count of the sessions, turns, bullets and qa items inside a raw conversation."""
        out = {"session": 0, "turn": 0, "bullet": 0, "qa": 0}
        if not isinstance(raw, dict):
            return out
        conv = raw.get("conversation")
        if isinstance(conv, dict):
            sessions = set()
            for key, value in conv.items():
                m = SESSION_KEY.fullmatch(key) or DATE_KEY.fullmatch(key)
                if m:
                    sessions.add(int(m.group(1)))
                    if SESSION_KEY.fullmatch(key) and isinstance(value, list):
                        out["turn"] += len(value)
                elif key.startswith("session_") and isinstance(value, list):
                    out["session"] += 1
                    out["turn"] += len(value)
            out["session"] += len(sessions)
        obs = raw.get("observation")
        if isinstance(obs, dict):
            for value in obs.values():
                out["bullet"] += _Reader.count_facts(value)
        qa = raw.get("qa")
        if isinstance(qa, list):
            out["qa"] = len(qa)
        return {k: v for k, v in out.items() if v}

    @staticmethod
    def count_facts(value: Any) -> int:
        """Number of observation items in a session's observation block (an unusable block counts 1)."""
        if isinstance(value, dict):
            return sum(len(v) if isinstance(v, list) else 1 for v in value.values())
        if isinstance(value, list):
            return len(value)
        return 1

    # ------------------------------------------------------------ conversations

    def conversations(self) -> Iterator[Conversation]:
        """Yield every usable conversation of the file in source order."""
        for i, raw in enumerate(self.load()):
            conv = self.conversation(i, raw)
            if conv is not None:
                yield conv

    def conversation(self, i: int, raw: Any) -> Conversation | None:
        """One conversation, or None when it is rejected as a whole."""
        self.ledger.saw("conversation")
        record = f"conversation[#{i}]"
        if not isinstance(raw, dict):
            self.reject(record, f"[{i}]", "conversation", f"not a JSON object but {json_type(raw)}", raw)
            return None

        def drop(field: str, reason: str, value: Any = None) -> None:
            lost = self.contents(raw)
            for kind, n in lost.items():
                self.ledger.saw(kind, n)
            self.reject(record, field, "conversation", reason, value, lost=lost)

        sample_id = raw.get("sample_id")
        if is_int(sample_id):
            sample_id = str(sample_id)
            self.ledger.note("sample_id: number read as string")
        if problem := text_problem("sample_id", sample_id):
            drop(f"[{i}].sample_id", problem, sample_id)
            return None
        record = f"sample_id={sample_id}"
        if sample_id in self.sample_ids:
            drop(f"[{i}].sample_id", "duplicate sample_id (an earlier conversation has it)", sample_id)
            return None
        self.sample_ids.add(sample_id)

        body = raw.get("conversation")
        if not isinstance(body, dict):
            drop(f"[{i}].conversation", f"'conversation' is {'missing' if body is None else json_type(body)}, expected an object")
            return None
        speakers = [body.get(k) for k in SPEAKER_KEYS]
        for key, value in zip(SPEAKER_KEYS, speakers):
            if problem := text_problem(key, value):
                drop(f"[{i}].conversation.{key}", problem, value)
                return None
        for key in ("observation", "qa"):
            value = raw.get(key)
            expected = dict if key == "observation" else list
            if value is not None and not isinstance(value, expected):
                drop(f"[{i}].{key}", f"'{key}' is {json_type(value)}, expected {'an object' if expected is dict else 'an array'}", value)
                return None

        cid = conversation_id(sample_id)
        out = Conversation(conversation_id=cid)
        ctx = Ctx(i=i, record=record, cid=cid, speakers=speakers)
        index, session_state = self.sessions(ctx, body, out)

        obs = raw.get("observation")
        if obs is None:
            self.ledger.note("conversation without observation")
        else:
            self.observations(ctx, obs, index, session_state, out)
        qa = raw.get("qa")
        if qa is None:
            self.ledger.note("conversation without qa")
        else:
            self.qa(ctx, qa, index, out)
        return out

    # ------------------------------------------------------------ sessions and turns

    def sessions(self, ctx: "Ctx", body: dict[str, Any], out: Conversation) -> tuple[DiaIndex, dict[int, str]]:
        """Fill `out.sessions`; return the dia-id index and, per session number, 'ok' or why it was rejected."""
        turns_of: dict[int, Any] = {}
        dates: dict[int, Any] = {}
        for key, value in body.items():
            if key in SPEAKER_KEYS:
                continue
            if m := SESSION_KEY.fullmatch(key):
                turns_of[int(m.group(1))] = value
            elif m := DATE_KEY.fullmatch(key):
                dates[int(m.group(1))] = value
            elif key.startswith("session_") and isinstance(value, list):
                self.ledger.saw("session")
                self.ledger.saw("turn", len(value))
                self.reject(f"{ctx.record} {key}", f"[{ctx.i}].conversation.{key}", "session",
                            "unrecognised session key (expected session_<N> without zero padding)", key,
                            lost={"turn": len(value)} if value else None)
            else:
                self.ledger.note("conversation: unknown key ignored")

        index = DiaIndex(kept={}, rejected=set(), ambiguous=set())
        state: dict[int, str] = {}
        for n in sorted(set(turns_of) | set(dates)):
            self.ledger.saw("session")
            rec = f"{ctx.record} session_{n}"
            path = f"[{ctx.i}].conversation.session_{n}"
            raw_turns = turns_of.get(n)
            time = dates.get(n)
            if n >= 2**31:
                self.ledger.saw("turn", len(raw_turns) if isinstance(raw_turns, list) else 0)
                state[n] = "session number out of the int32 range"
                self.reject(rec, path, "session", state[n], n,
                            lost={"turn": len(raw_turns)} if isinstance(raw_turns, list) and raw_turns else None)
                continue
            if raw_turns is not None and not isinstance(raw_turns, list):
                state[n] = f"turns are {json_type(raw_turns)}, expected an array"
                self.reject(rec, path, "session", state[n], raw_turns)
                continue
            n_raw = len(raw_turns or [])
            if time is not None and (problem := text_problem("date_time", time, allow_empty=True)):
                self.ledger.saw("turn", n_raw)
                state[n] = problem
                self.reject(rec, path + "_date_time", "session", state[n], time, lost={"turn": n_raw} if n_raw else None)
                continue
            if not raw_turns:
                state[n] = "no turns"
                self.reject(rec, path, "session", "no turns", time)
                continue
            turns = []
            for t, raw_turn in enumerate(raw_turns):
                turn = self.turn(ctx, n, t, raw_turn, index)
                if turn is not None:
                    turns.append(turn)
            if not turns:
                state[n] = "no usable turns (all rejected)"
                self.reject(rec, path, "session", state[n], time)
                continue
            state[n] = "ok"
            if time is None:
                self.ledger.note("session without date_time")
            out.sessions.append(
                {"conversation_id": ctx.cid, "session_index": n, "speakers": list(ctx.speakers), "turns": turns, "time": time}
            )
        for dia in index.ambiguous:
            index.kept.pop(dia, None)
        return index, state

    def turn(self, ctx: "Ctx", n: int, t: int, raw: Any, index: DiaIndex) -> dict[str, str] | None:
        """One turn as {turn_id, speaker, text}, or None when rejected; indexes its dia id."""
        self.ledger.saw("turn")
        rec = f"{ctx.record} session_{n} turn #{t}"
        path = f"[{ctx.i}].conversation.session_{n}[{t}]"
        if not isinstance(raw, dict):
            self.reject(rec, path, "turn", f"not a JSON object but {json_type(raw)}", raw)
            return None
        dia = None
        raw_dia = raw.get("dia_id")
        if isinstance(raw_dia, str) and (parsed := parse_dia_id(raw_dia)) is not None:
            dia = canonical_dia_id(*parsed)
            if dia != raw_dia:
                self.ledger.note("turn dia_id: zero padding removed")
            if parsed[0] != n:
                self.ledger.note("turn dia_id names another session")
        else:
            self.ledger.note("turn without a usable dia_id (cannot be cited)")
        text, speaker = raw.get("text"), raw.get("speaker")
        problem = first_text_problem(("text", "text", text), ("speaker", "speaker", speaker))
        if problem is not None:
            field, reason, value = problem
            self.reject(rec + (f" ({dia})" if dia else ""), f"{path}.{field}", "turn", reason, value)
            if dia is not None:
                if dia in index.kept or dia in index.rejected:
                    index.ambiguous.add(dia)
                index.rejected.add(dia)
            return None
        tid = schema.turn_id(ctx.cid, n, t)
        if speaker not in ctx.speakers:
            self.ledger.note("turn speaker is neither speaker_a nor speaker_b")
        if dia is not None:
            if dia in index.kept or dia in index.rejected:
                index.ambiguous.add(dia)
            index.kept[dia] = tid
        return {"turn_id": tid, "speaker": speaker, "text": text}

    # ------------------------------------------------------------ evidence


def resolve_input(path: Path) -> Path:
    """The LoCoMo JSON file: `path` itself, or the only `.json` file in the directory `path`."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".json")
        if len(found) == 1:
            return found[0]
        if not found:
            raise IngestError(f"{path}: no .json file in this directory (expected the LoCoMo file, e.g. locomo10.json)")
        names = ", ".join(p.name for p in found)
        raise IngestError(f"{path}: {len(found)} .json files, expected exactly one; pass one of: {names}")
    raise IngestError(f"{path}: no such file or directory")


@register
class LocomoAdapter(Adapter):
    """LoCoMo (`locomo10.json`): sessions with turns, observations as bullets, and QA."""

    name = "locomo"
    has_qa = True

    def read(self, path: Path, ledger: Ledger, split: str | None = None) -> Iterator[Conversation]:
        """Yield the file's conversations one at a time; IngestError if the file is unusable as a whole."""
        if split is not None:
            raise IngestError(f"locomo has no splits; got --split {split!r}")
        source = resolve_input(Path(path))
        yield from _Reader(source, ledger).conversations()
