"""LoCoMo's observations, QA and evidence ids (the items of a conversation), for `memprune.adapters.locomo`.

Evidence comes in many shapes (a dia id string, a list, joined strings, zero-padded or malformed ids, ids of turns
that do not exist): every single id is counted as an item of kind `evidence` and either resolves to a kept turn or is
rejected with its reason (docs/locomo.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from memprune import schema
from memprune.adapters import Conversation, json_type, text_problem

ID_PREFIX = "locomo:"

DIA = re.compile(r"D([0-9]+):([0-9]+)")
SPLIT = re.compile(r"[,;\s]+")
NUM = r"(0|[1-9][0-9]*)"
SESSION_KEY = re.compile(rf"session_{NUM}")
DATE_KEY = re.compile(rf"session_{NUM}_date_time")
OBS_KEY = re.compile(rf"session_{NUM}_observation")
SPEAKER_KEYS = ("speaker_a", "speaker_b")


def conversation_id(sample_id: str) -> str:
    """Stable conversation id of a LoCoMo sample: `locomo:<sample_id>`."""
    return f"{ID_PREFIX}{sample_id}"


def parse_dia_id(text: str) -> tuple[int, int] | None:
    """(session, turn) of a dia id `D<session>:<turn>` (zero padding allowed), else None."""
    m = DIA.fullmatch(text.strip())
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2))


def canonical_dia_id(session: int, turn: int) -> str:
    """The unpadded form of a dia id, e.g. `D30:5`."""
    return f"D{session}:{turn}"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class DiaIndex:
    """Dia id -> canonical turn id of one conversation, plus what cannot be cited and why."""

    kept: dict[str, str]
    rejected: set[str]
    ambiguous: set[str]


@dataclass(frozen=True)
class Ctx:
    """Where we are: the conversation's list position, its record label, id and speakers."""

    i: int
    record: str
    cid: str
    speakers: list[str]


class ItemReader:
    """The item methods of the LoCoMo reader (observations as bullets, QA, evidence ids); the reader supplies
    `reject(record, field, kind, reason, value, lost)`."""

    def reject(self, record: str, field: str, kind: str, reason: str, value: Any = None,
               lost: dict[str, int] | None = None) -> None:
        raise NotImplementedError

    def evidence(self, ctx: "Ctx", raw: Any, index: DiaIndex, rec: str, path: str) -> tuple[list[str], int]:
        """Resolve raw evidence to canonical turn ids; return (kept ids, number of ids given)."""
        pieces: list[tuple[str | None, Any]] = []
        items = raw if isinstance(raw, list) else [raw]
        for item in items:
            if isinstance(item, str):
                parts = [p for p in SPLIT.split(item.strip()) if p]
                if len(parts) > 1:
                    self.ledger.note("evidence: joined string split into ids")
                pieces.extend((p, p) for p in parts)
            else:
                pieces.append((None, item))
        kept: list[str] = []
        seen: set[str] = set()
        for k, (text, value) in enumerate(pieces):
            self.ledger.saw("evidence")
            erec = f"{rec} evidence #{k}"
            if text is None:
                self.reject(erec, path, "evidence", f"evidence id is {json_type(value)}, expected a string", value)
                continue
            parsed = parse_dia_id(text)
            if parsed is None:
                self.reject(erec, path, "evidence", "malformed dia id (expected D<session>:<turn>)", text)
                continue
            dia = canonical_dia_id(*parsed)
            if dia != text:
                self.ledger.note("evidence: zero padding removed")
            if dia in seen:
                self.reject(erec, path, "evidence", "duplicate evidence id in this item", text)
                continue
            seen.add(dia)
            if dia in index.ambiguous:
                self.reject(erec, path, "evidence", "ambiguous dia id (several turns carry it)", text)
            elif dia in index.kept:
                kept.append(index.kept[dia])
            elif dia in index.rejected:
                self.reject(erec, path, "evidence", "refers to a rejected turn", text)
            else:
                self.reject(erec, path, "evidence", "no such turn in this conversation", text)
        return kept, len(pieces)

    # ------------------------------------------------------------ observations -> bullets

    def observations(self, ctx: "Ctx", obs: dict[str, Any], index: DiaIndex, state: dict[int, str], out: Conversation) -> None:
        """Turn `observation.session_N_observation` facts into bullets of session N."""
        by_session: dict[int, tuple[str, Any]] = {}
        for key, value in obs.items():
            if m := OBS_KEY.fullmatch(key):
                by_session[int(m.group(1))] = (key, value)
            else:
                self.reject_block(f"{ctx.record} observation {key}", f"[{ctx.i}].observation.{key}",
                                  "unrecognised observation key (expected session_<N>_observation)", value)
        for n in sorted(by_session):
            key, block = by_session[n]
            path = f"[{ctx.i}].observation.{key}"
            rec = f"{ctx.record} session_{n}"
            if not isinstance(block, dict):
                self.reject_block(f"{rec} observation", path,
                                  f"observation block is {json_type(block)}, expected an object speaker -> facts", block)
                continue
            b = 0
            for speaker, facts in block.items():
                spath = f"{path}.{speaker}"
                if not isinstance(facts, list):
                    self.ledger.saw("bullet")
                    self.reject(f"{rec} observation[{speaker}]", spath, "bullet",
                                f"facts of a speaker are {json_type(facts)}, expected an array", facts)
                    b += 1
                    continue
                if speaker not in ctx.speakers:
                    self.ledger.note("observation speaker is neither speaker_a nor speaker_b")
                for k, fact in enumerate(facts):
                    self.bullet(ctx, n, b, speaker, fact, f"{rec} observation[{speaker}] #{k}", f"{spath}[{k}]", index, state, out)
                    b += 1

    def reject_block(self, rec: str, path: str, reason: str, block: Any) -> None:
        """Reject an unusable observation block as one bullet reject that takes its facts along."""
        n_facts = self.count_facts(block)
        if n_facts == 0:
            self.ledger.note("empty observation block ignored")
            return
        self.ledger.saw("bullet", n_facts)
        self.reject(rec, path, "bullet", reason, block, lost={"bullet": n_facts - 1} if n_facts > 1 else None)

    def bullet(self, ctx: "Ctx", n: int, b: int, speaker: str, fact: Any, rec: str, path: str,
               index: DiaIndex, state: dict[int, str], out: Conversation) -> None:
        """One `[fact_text, evidence]` item as the bullet with index `b` of session `n`, or a reject."""
        self.ledger.saw("bullet")
        if not isinstance(fact, list) or len(fact) != 2:
            self.reject(rec, path, "bullet", "not a [fact_text, evidence] pair", fact)
            return
        text, raw_ev = fact
        if problem := text_problem("fact text", text) or text_problem("speaker", speaker):
            self.reject(rec, path + "[0]", "bullet", problem, text)
            return
        session = state.get(n)
        if session is None:
            self.reject(rec, path, "bullet", "no such session in this conversation", text)
            return
        if session != "ok":
            self.reject(rec, path, "bullet", f"session rejected: {session}", text)
            return
        kept, given = self.evidence(ctx, raw_ev, index, rec, path + "[1]")
        if not kept:
            reason = "no evidence" if given == 0 else "no evidence id resolves to a kept turn"
            self.reject(rec, path + "[1]", "bullet", reason, raw_ev)
            return
        out.bullets.append(
            {
                "bullet_id": schema.bullet_id(ctx.cid, n, b),
                "conversation_id": ctx.cid,
                "session_index": n,
                "speaker": speaker,
                "text": text,
                "evidence": kept,
            }
        )

    # ------------------------------------------------------------ qa

    def qa(self, ctx: "Ctx", items: list[Any], index: DiaIndex, out: Conversation) -> None:
        """Turn the `qa` list into rows of the QA table."""
        for q, item in enumerate(items):
            self.ledger.saw("qa")
            rec = f"{ctx.record} qa #{q}"
            path = f"[{ctx.i}].qa[{q}]"
            if not isinstance(item, dict):
                self.reject(rec, path, "qa", f"not a JSON object but {json_type(item)}", item)
                continue
            question = item.get("question")
            if problem := text_problem("question", question):
                self.reject(rec, path + ".question", "qa", problem, question)
                continue
            category = item.get("category")
            if category is None:
                self.ledger.note("qa without category")
            elif isinstance(category, str) and re.fullmatch(r"[0-9]+", category.strip()):
                category = int(category)
                self.ledger.note("qa category: string read as integer")
            elif isinstance(category, float) and category.is_integer():
                category = int(category)
                self.ledger.note("qa category: float read as integer")
            elif not is_int(category):
                self.reject(rec, path + ".category", "qa", f"category is {json_type(category)}, expected an integer", category)
                continue
            if category is not None and not -(2**31) <= category < 2**31:
                self.reject(rec, path + ".category", "qa", "category out of the int32 range", category)
                continue
            answer = item.get("answer")
            if answer is None:
                if category != 5:
                    self.reject(rec, path + ".answer", "qa", "missing answer (only category 5 may lack one)", None)
                    continue
                self.ledger.note("qa: category 5 without answer (kept, answer null)")
            elif is_int(answer) or isinstance(answer, float):
                answer = str(answer)
                self.ledger.note("qa answer: number read as string")
            elif problem := text_problem("answer", answer, allow_empty=True):
                self.reject(rec, path + ".answer", "qa", problem, answer)
                continue
            raw_ev = item.get("evidence")
            if isinstance(raw_ev, str):
                self.ledger.note("qa evidence: string instead of array")
            kept, given = self.evidence(ctx, raw_ev, index, rec, path + ".evidence") if raw_ev is not None else ([], 0)
            if given and not kept:
                self.reject(rec, path + ".evidence", "qa", "no evidence id resolves to a kept turn", raw_ev)
                continue
            if not given:
                self.ledger.note("qa without evidence (kept, evidence empty)")
            out.qa.append(
                {
                    "qa_id": schema.qa_id(ctx.cid, q),
                    "conversation_id": ctx.cid,
                    "question": question,
                    "answer": answer,
                    "evidence": kept,
                    "category": category,
                }
            )
