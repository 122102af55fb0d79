"""source=qa: labels from QA evidence (pure; no Ray, no models).

A corpus annotated with question evidence (LoCoMo's `qa` table). A QA item *cites* a bullet when
one of its evidence turns is among the bullet's evidence turns. The label is 1 when at least one
question cites the bullet, else 0 (`grading: binary`), or min(1, n_citing / grade_cap) (`grading:
graded`). With `later_only`, a citing question counts only when its evidence also names a turn of a
session *after* the bullet's session (the fact was still needed later); bullets of a conversation's
last session then get no label (`no_later_session`).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

from memprune.io import read_table
from memprune.label.errors import LabelError
from memprune.label.sources.common import (
    LabelSource,
    SourceResult,
    SourceRun,
    label_counts,
    labels_table,
    register,
)
from memprune.work import file_digest

# Reasons a bullet gets no label from this source (listed in unlabelled.jsonl).
NO_QA_FOR_CONVERSATION = "no_qa_for_conversation"
NO_LATER_SESSION = "no_later_session"
QA_UNLABELLED_REASONS: tuple[str, ...] = (NO_QA_FOR_CONVERSATION, NO_LATER_SESSION)
_TURN_SESSION = re.compile(r":s(\d+):t\d+$")


@dataclass(frozen=True)
class QAOptions:
    """How QA evidence becomes labels: binary or graded by the number of citing questions."""

    grading: Literal["binary", "graded"] = "binary"
    grade_cap: int = 3
    later_only: bool = False
    categories: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.grading not in ("binary", "graded"):
            raise ValueError(f"qa grading must be binary or graded, got {self.grading!r}")
        if self.grade_cap < 1:
            raise ValueError(f"qa grade_cap must be >= 1, got {self.grade_cap}")

    def rule(self) -> str:
        """The `aggregation` string of the labels rows, e.g. 'qa:binary' or 'qa:graded/3:later'."""
        base = "qa:binary" if self.grading == "binary" else f"qa:graded/{self.grade_cap}"
        return base + (":later" if self.later_only else "")



def turn_sessions(sessions: pa.Table | None) -> dict[str, int]:
    """turn_id -> session_index, from a sessions table (empty when none is given)."""
    out: dict[str, int] = {}
    if sessions is None:
        return out
    for idx, turns in zip(sessions.column("session_index").to_pylist(), sessions.column("turns").to_pylist()):
        for t in turns:
            out[t["turn_id"]] = int(idx)
    return out


def _session_of(turn: str, table: dict[str, int]) -> int | None:
    """The session of a turn: from the sessions table, else the ':s<N>:t<i>' suffix of its id."""
    if turn in table:
        return table[turn]
    if table:
        return None
    m = _TURN_SESSION.search(turn)
    return int(m.group(1)) if m else None


def qa_labels(bullets: pa.Table, qa: pa.Table, sessions: pa.Table | None = None,
              options: QAOptions | None = None) -> SourceResult:
    """Labels from QA evidence: a bullet is positive when questions cite one of its evidence turns.

    `bullets` and `qa` are the corpus tables; `sessions` (optional) gives each turn's session
    and each conversation's last session (used by `later_only`), else the turn-id suffix
    and the bullets' own sessions are used. A conversation without any usable QA item
    (after the `categories` filter, with evidence) gives no labels: its bullets are listed
    as `no_qa_for_conversation`, never labelled 0 by default.
    """
    opt = options or QAOptions()
    t_session = turn_sessions(sessions)
    cats = set(opt.categories) if opt.categories is not None else None

    by_conv: dict[str, list[frozenset[str]]] = defaultdict(list)
    counts: Counter[str] = Counter()
    for cid, ev, cat in zip(qa.column("conversation_id").to_pylist(), qa.column("evidence").to_pylist(),
                            qa.column("category").to_pylist()):
        counts["qa"] += 1
        if cats is not None and cat not in cats:
            counts["qa_other_category"] += 1
            continue
        if not ev:
            counts["qa_without_evidence"] += 1
            continue
        counts["qa_used"] += 1
        by_conv[cid].append(frozenset(ev))
        if t_session:
            counts["qa_evidence_turns_unknown"] += sum(1 for t in ev if t not in t_session)

    last_session: dict[str, int] = {}
    if sessions is not None:
        for cid, idx in zip(sessions.column("conversation_id").to_pylist(), sessions.column("session_index").to_pylist()):
            last_session[cid] = max(last_session.get(cid, idx), idx)
    for cid, idx in zip(bullets.column("conversation_id").to_pylist(), bullets.column("session_index").to_pylist()):
        last_session[cid] = max(last_session.get(cid, idx), idx)

    # turn -> indices of the conversation's QA items that cite it
    index: dict[str, dict[str, list[int]]] = {}
    for cid, items in by_conv.items():
        idx_map: dict[str, list[int]] = defaultdict(list)
        for i, ev in enumerate(items):
            for t in ev:
                idx_map[t].append(i)
        index[cid] = idx_map

    rows: list[dict[str, Any]] = []
    unlabelled: list[dict[str, Any]] = []
    bullet_convs = set()
    for bid, cid, sidx, ev in zip(bullets.column("bullet_id").to_pylist(), bullets.column("conversation_id").to_pylist(),
                                  bullets.column("session_index").to_pylist(), bullets.column("evidence").to_pylist()):
        bullet_convs.add(cid)
        if cid not in index:
            unlabelled.append({"bullet_id": bid, "reason": NO_QA_FOR_CONVERSATION, "n_pairs": 0, "n_errors": 0})
            continue
        if opt.later_only and sidx >= last_session[cid]:
            unlabelled.append({"bullet_id": bid, "reason": NO_LATER_SESSION, "n_pairs": 0, "n_errors": 0})
            continue
        citing = sorted({i for t in ev for i in index[cid].get(t, ())})
        if opt.later_only:
            items = by_conv[cid]
            citing = [i for i in citing
                      if any((s := _session_of(t, t_session)) is not None and s > sidx for t in items[i])]
        n = len(citing)
        label = (1.0 if n else 0.0) if opt.grading == "binary" else min(1.0, n / opt.grade_cap)
        rows.append({"bullet_id": bid, "label": label, "n_pairs": n, "aggregation": opt.rule()})

    labels = labels_table(rows, "qa")
    out_counts: dict[str, Any] = {
        **label_counts(bullets.num_rows, labels, unlabelled, QA_UNLABELLED_REASONS),
        "bullets_cited": sum(1 for r in rows if r["n_pairs"] > 0),
        "qa": counts["qa"],
        "qa_used": counts["qa_used"],
        "qa_without_evidence": counts["qa_without_evidence"],
        "qa_other_category": counts["qa_other_category"],
        "qa_evidence_turns_unknown": counts["qa_evidence_turns_unknown"],
        "qa_conversations_without_bullets": len(set(by_conv) - bullet_convs),
        "conversations_with_qa": len(set(by_conv) & bullet_convs),
    }
    return SourceResult(labels, sorted(unlabelled, key=lambda u: u["bullet_id"]), out_counts)


def run(cfg: Any, data: Path, bullets: pa.Table, inputs: dict[str, str], outputs: Any) -> SourceRun:
    """`memprune label --source qa`: the corpus's qa table (and sessions, for `later_only`) -> labels."""
    qa_path, sessions_path = data / "qa.parquet", data / "sessions.parquet"
    if not qa_path.is_file():
        raise LabelError(f"{qa_path}: no such file; source qa needs a corpus with a qa table "
                         "(e.g. `memprune ingest --format locomo`)")
    qa = read_table(qa_path, "qa")
    sessions = read_table(sessions_path, "sessions") if sessions_path.is_file() else None
    inputs["qa.parquet"] = file_digest(qa_path)
    if sessions is not None:
        inputs["sessions.parquet"] = file_digest(sessions_path)
    q = cfg.qa
    try:
        options = QAOptions(grading=q.grading, grade_cap=q.grade_cap, later_only=q.later_only,
                                    categories=tuple(q.categories) if q.categories is not None else None)
    except ValueError as exc:
        raise LabelError(str(exc)) from exc
    result = qa_labels(bullets, qa, sessions, options)
    rule = options.rule()
    return SourceRun(result, rule)


QA = register(LabelSource(
    name="qa", description="QA evidence: a bullet cited by a question is useful", run=run,
    intro="QA-evidence labels: a bullet is positive when questions cite its evidence turns.",
    rows=lambda c: [("QA items used / total", f"{c['qa_used']} / {c['qa']}"),
                    ("QA items without evidence", c["qa_without_evidence"]), ("bullets cited", c["bullets_cited"])]))
