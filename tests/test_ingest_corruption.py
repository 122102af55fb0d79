"""Corrupted inputs (hypothesis): ingest either fails with one clear error, or accounts for every item.

Valid records are mutated at random paths (deleted keys, wrong types, truncated bytes,
non-UTF-8 bytes, duplicated records, emptied lists) for the msc and jsonl formats.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memprune.adapters import IngestError
from memprune.ingest import ingest
from memprune.schema import validate_table

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

WRONG_VALUES = [None, 7, -1, 2.5, True, "", "x", "\ud800 lone surrogate", [], {}, [1, "a"], {"k": "v"}]


def canonical_conversation(cid: str) -> dict[str, Any]:
    return {
        "conversation_id": cid,
        "sessions": [
            {"session_index": 1, "time": "2024-05-01",
             "turns": [{"speaker": "ann", "text": "I adopted a cat named Tom.", "id": f"{cid}-a"},
                       {"speaker": "bob", "text": "Nice! I run every morning.", "id": f"{cid}-b"}],
             "bullets": [{"speaker": "ann", "text": "Ann has a cat, Tom.", "evidence": [0]},
                         {"speaker": "bob", "text": "Bob runs every morning.", "evidence": [f"{cid}-b"]}]},
            {"session_index": 2,
             "turns": [{"speaker": "bob", "text": "How is Tom?"}, {"speaker": "ann", "text": "Tom is great."}],
             "bullets": [{"speaker": "ann", "text": "Tom is doing well.", "evidence": [1, 0]}]},
        ],
        "qa": [{"question": "What is the cat's name?", "answer": "Tom", "evidence": [f"{cid}-a", [2, 1]],
                "category": 1},
               {"question": "Does Bob swim?", "evidence": [f"{cid}-b"], "category": 5}],
    }


def msc_record(cid: str, k: int) -> dict[str, Any]:
    return {
        "initial_data_id": cid,
        "dialog": [
            {"id": "bot_0", "text": f"hello from {cid} {k}", "persona_text": "I like tea."},
            {"id": "bot_1", "text": "I have two dogs.", "persona_text": "I have two dogs."},
            {"id": "bot_0", "text": "nice"},
        ],
        "followup": "", "newfact": "", "init_personachat": {"init_personas": [[], []]},
    }


def paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys/indices) inside a JSON value."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, prefix + (i,))
    return out


@st.composite
def mutated(draw, obj: Any) -> Any:
    """A copy of `obj` with one to three random mutations (delete, wrong type, empty list)."""
    obj = copy.deepcopy(obj)
    for _ in range(draw(st.integers(1, 3))):
        candidates = [p for p in paths(obj) if p]
        if not candidates:
            break
        path = draw(st.sampled_from(candidates))
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["delete", "wrong", "empty"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "wrong":
            parent[path[-1]] = copy.deepcopy(draw(st.sampled_from(WRONG_VALUES)))
        elif isinstance(parent[path[-1]], list):
            parent[path[-1]] = []
    return obj


@st.composite
def corrupt_lines(draw, records: list[dict[str, Any]]) -> list[bytes]:
    """JSON lines from `records` with structural mutations and byte-level damage."""
    lines = []
    for rec in records:
        if draw(st.booleans()):
            rec = draw(mutated(rec))
        line = json.dumps(rec).encode()
        damage = draw(st.sampled_from(["none", "none", "truncate", "bad_utf8", "duplicate"]))
        if damage == "truncate":
            line = line[: draw(st.integers(1, len(line) - 1))]
        elif damage == "bad_utf8":
            at = draw(st.integers(0, len(line)))
            line = line[:at] + b"\xff\xfe" + line[at:]
        elif damage == "duplicate":
            lines.append(line)
        lines.append(line)
    return lines


def check_accounted(out: Path, has_qa: bool) -> dict[str, Any]:
    """Conservation holds, tables validate, every reject names source, record, field and reason."""
    summary = json.loads((out / "ingest.json").read_text())
    assert summary["ledger"]["conservation"] == "ok"
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == summary["counts"]["rejects"]
    for r in rejects:
        assert r["source"] and r["record"] and r["reason"] and r["kind"]
        assert "field" in r
    names = ["sessions", "bullets"] + (["qa"] if has_qa else [])
    for name in names:
        table = validate_table(pq.read_table(out / f"{name}.parquet"), name, source=name)
        assert table.num_rows == summary["counts"][name if name != "sessions" else "sessions"]
    sessions = pq.read_table(out / "sessions.parquet").to_pylist()
    turn_ids = {t["turn_id"] for s in sessions for t in s["turns"]}
    for b in pq.read_table(out / "bullets.parquet").to_pylist():
        assert b["evidence"] and set(b["evidence"]) <= turn_ids
    return summary


@SETTINGS
@given(data=st.data())
def test_jsonl_corruptions_are_accounted_for(tmp_path_factory, data) -> None:
    records = [canonical_conversation(f"c{i}") for i in range(3)]
    lines = data.draw(corrupt_lines(records))
    tmp = tmp_path_factory.mktemp("jsonl")
    src = tmp / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    ingest("jsonl", src, tmp / "out")
    check_accounted(tmp / "out", has_qa=True)


@SETTINGS
@given(data=st.data())
def test_msc_corruptions_are_accounted_for(tmp_path_factory, data) -> None:
    tmp = tmp_path_factory.mktemp("msc")
    for k in (1, 2):
        records = [msc_record(f"valid_{i}", k) for i in range(3)]
        (tmp / "in" / f"session_{k}").mkdir(parents=True)
        (tmp / "in" / f"session_{k}" / "valid.txt").write_bytes(b"\n".join(data.draw(corrupt_lines(records))))
    ingest("msc", tmp / "in", tmp / "out", split="valid")
    check_accounted(tmp / "out", has_qa=False)


def test_jsonl_clean_fixture_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(canonical_conversation(c)) for c in ("c0", "c1")) + "\n")
    summary = ingest("jsonl", src, tmp_path / "out")
    assert summary["counts"] == {"conversations": 2, "sessions": 4, "turns": 8, "bullets": 6, "qa": 4, "rejects": 0}
    bullets = {b["bullet_id"]: b for b in pq.read_table(tmp_path / "out" / "bullets.parquet").to_pylist()}
    assert bullets["c0:s1:b0"]["evidence"] == ["c0:s1:t0"]
    assert bullets["c0:s1:b1"]["evidence"] == ["c0:s1:t1"]
    assert bullets["c0:s2:b0"]["evidence"] == ["c0:s2:t1", "c0:s2:t0"]
    qa = {q["qa_id"]: q for q in pq.read_table(tmp_path / "out" / "qa.parquet").to_pylist()}
    assert qa["c1:q0"]["evidence"] == ["c1:s1:t0", "c1:s2:t1"]
    assert qa["c1:q1"]["answer"] is None and qa["c1:q1"]["category"] == 5


def test_jsonl_specific_rejects(tmp_path: Path) -> None:
    conv = canonical_conversation("c0")
    conv["sessions"][0]["bullets"][0]["evidence"] = [0, 9, "nope"]   # two dangling refs, one good
    conv["sessions"][1]["bullets"][0]["evidence"] = [42]              # nothing resolves
    conv["sessions"][1]["turns"][0]["text"] = "   "                   # empty turn
    dup = canonical_conversation("c0")
    src = tmp_path / "in.jsonl"
    src.write_bytes(json.dumps(conv).encode() + b"\n" + json.dumps(dup).encode() + b"\n\xff{}\n")
    summary = ingest("jsonl", src, tmp_path / "out")
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    reasons = {(r["kind"], r["field"], r["reason"]) for r in rejects}
    assert ("evidence", "sessions[session_index=1].bullets[0].evidence[1]", "refers to no usable turn") in reasons
    assert ("bullet", "sessions[session_index=2].bullets[0].evidence", "no evidence turn resolves") in reasons
    assert ("turn", "sessions[1].turns[0].text", "empty text") in reasons
    assert ("conversation", "conversation_id", "duplicate conversation_id") in reasons
    assert any(r["kind"] == "conversation" and r["reason"].startswith("not valid UTF-8") and r["record"] == "line 3"
               for r in rejects)
    assert summary["counts"]["conversations"] == 1
    assert summary["ledger"]["conservation"] == "ok"
    # the duplicate conversation took its sessions, turns, bullets and qa with it
    assert summary["ledger"]["rejected"]["session"] == 2 and summary["ledger"]["rejected"]["qa"] == 2


def test_unreadable_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(IngestError, match="no such file or directory"):
        ingest("jsonl", tmp_path / "missing.jsonl", tmp_path / "out")
    with pytest.raises(IngestError, match="expects a directory"):
        (tmp_path / "f.txt").write_text("x")
        ingest("msc", tmp_path / "f.txt", tmp_path / "out")
