"""The LoCoMo adapter: the hand-written fixture read exactly, and corrupted inputs never lose items."""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memprune import schema
from memprune.adapters import Conversation, IngestError
from memprune.adapters.locomo import LocomoAdapter, conversation_id, parse_dia_id
from memprune.rejects import Ledger

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "locomo_mini.json"
FIXTURE_OBJ = json.loads(FIXTURE.read_text(encoding="utf-8"))


class ListSink:
    """Collects reject rows in memory (stands in for the JSONL sink)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def write(self, obj: dict[str, Any]) -> None:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")  # what the JSONL sink must be able to write
        self.rows.append(dict(obj))


def read_all(path: Path) -> tuple[list[Conversation], Ledger, list[dict[str, Any]]]:
    """Read `path` like ingest does: every yielded row counts as written."""
    sink = ListSink()
    ledger = Ledger(sink)  # type: ignore[arg-type]
    convs = list(LocomoAdapter().read(path, ledger))
    for conv in convs:
        for kind, n in conv.counts().items():
            ledger.wrote(kind, n)
    return convs, ledger, sink.rows


def tables(convs: list[Conversation]) -> dict[str, pa.Table]:
    """The three corpus tables built from the rows, validated against their schemas."""
    out = {}
    for name, attr in (("sessions", "sessions"), ("bullets", "bullets"), ("qa", "qa")):
        rows = [row for conv in convs for row in getattr(conv, attr)]
        table = pa.Table.from_pylist(rows, schema=schema.TABLES[name])
        out[name] = schema.validate_table(table, name, source=f"locomo {name}")
    return out


def check_integrity(convs: list[Conversation]) -> None:
    """Every evidence id names a written turn of the same conversation; ids follow the schema helpers."""
    for conv in convs:
        turn_ids = {t["turn_id"] for s in conv.sessions for t in s["turns"]}
        for s in conv.sessions:
            for t in s["turns"]:
                assert t["turn_id"].startswith(f"{conv.conversation_id}:s{s['session_index']}:t")
        for row in conv.bullets:
            assert row["evidence"], row  # a bullet is always tied to at least one turn
        for row in conv.bullets + conv.qa:
            assert set(row["evidence"]) <= turn_ids, row
            assert len(set(row["evidence"])) == len(row["evidence"])


def rejects_of(rows: list[dict[str, Any]], record: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["record"] == record or r["record"].startswith(record + " evidence")]


# ------------------------------------------------------------------ the fixture, exactly


def test_fixture_counts_and_conservation() -> None:
    convs, ledger, rejects = read_all(FIXTURE)
    assert ledger.imbalance() == {}
    assert dict(ledger.seen) == {"conversation": 2, "session": 6, "turn": 12, "bullet": 16, "qa": 10, "evidence": 30}
    assert dict(ledger.written) == {"conversation": 2, "session": 4, "turn": 11, "bullet": 11, "qa": 8, "evidence": 24}
    assert dict(ledger.rejected) == {"session": 2, "turn": 1, "bullet": 5, "qa": 2, "evidence": 6}
    assert len(rejects) == sum(ledger.rejected.values())
    assert all(r["source"] == str(FIXTURE) for r in rejects)
    t = tables(convs)
    assert (t["sessions"].num_rows, t["bullets"].num_rows, t["qa"].num_rows) == (4, 11, 8)
    check_integrity(convs)


def test_fixture_sessions_and_turns() -> None:
    convs, _, rejects = read_all(FIXTURE)
    assert [c.conversation_id for c in convs] == ["locomo:mini-1", "locomo:mini-2"]
    assert conversation_id("mini-1") == "locomo:mini-1"
    s1, s2 = convs[0].sessions
    assert s1["session_index"] == 1 and s1["speakers"] == ["Alice", "Bob"]
    assert s1["time"] == "1:56 pm on 8 May, 2023"
    assert [t["turn_id"] for t in s1["turns"]] == [schema.turn_id("locomo:mini-1", 1, i) for i in range(4)]
    assert s1["turns"][2] == {
        "turn_id": "locomo:mini-1:s1:t2",
        "speaker": "Alice",
        "text": "Nice. Work at the hospital is busy, but I still go hiking.",
    }
    # the turn without text is rejected; the position of the others is kept in their ids
    assert [t["turn_id"] for t in s2["turns"]] == ["locomo:mini-1:s2:t0", "locomo:mini-1:s2:t2"]
    (bad_turn,) = [r for r in rejects if r["kind"] == "turn"]
    assert bad_turn["record"] == "sample_id=mini-1 session_2 turn #1 (D2:2)"
    assert bad_turn["field"] == "[0].conversation.session_2[1].text" and bad_turn["reason"] == "missing text"
    # date but no turns: session_3 key absent (mini-1) and session_3 == [] (mini-2)
    no_turns = [r for r in rejects if r["kind"] == "session"]
    assert [(r["record"], r["reason"], r["value"]) for r in no_turns] == [
        ("sample_id=mini-1 session_3", "no turns", "10:02 am on 2 June, 2023"),
        ("sample_id=mini-2 session_3", "no turns", "8:00 pm on 1 April, 2023"),
    ]
    assert [s["session_index"] for s in convs[1].sessions] == [1, 2]


def test_fixture_observation_evidence_forms() -> None:
    convs, ledger, rejects = read_all(FIXTURE)
    ev = {b["bullet_id"]: b["evidence"] for c in convs for b in c.bullets}
    t = "locomo:mini-1:s1:t{}".format
    u = "locomo:mini-1:s2:t{}".format
    assert ev["locomo:mini-1:s1:b0"] == [t(0)]  # plain string
    assert ev["locomo:mini-1:s1:b1"] == [t(2)]  # list
    assert ev["locomo:mini-1:s1:b2"] == [t(0), t(2)]  # comma-joined
    assert ev["locomo:mini-1:s1:b3"] == [t(1), t(3)]  # semicolon-joined
    assert ev["locomo:mini-1:s1:b4"] == [t(1), t(3)]  # space-joined + zero-padded "D1:02"
    assert "locomo:mini-1:s1:b5" not in ev  # "D": malformed, nothing left
    assert "locomo:mini-1:s2:b0" not in ev  # "D:2:1": malformed
    assert ev["locomo:mini-1:s2:b1"] == [u(0)]  # ["D2:1", "D2:9"]: the missing turn is dropped
    assert "locomo:mini-1:s2:b2" not in ev  # cites the rejected turn only
    assert ev["locomo:mini-1:s2:b3"] == [u(2)]  # zero-padded "D2:03"
    assert "locomo:mini-1:s3:b0" not in ev  # session without turns
    assert ev["locomo:mini-2:s1:b1"] == ["locomo:mini-2:s1:t1", "locomo:mini-2:s1:t2"]  # "D1:2,D1:3"
    bullets = {b["bullet_id"]: b for c in convs for b in c.bullets}
    assert bullets["locomo:mini-1:s2:b3"]["speaker"] == "Bob"
    assert bullets["locomo:mini-1:s2:b3"]["text"] == "Bob ran 30 km on Sunday."
    assert bullets["locomo:mini-1:s2:b3"]["session_index"] == 2

    def reasons(record: str) -> list[tuple[str, str]]:
        return [(r["kind"], r["reason"]) for r in rejects_of(rejects, record)]

    assert reasons("sample_id=mini-1 session_1 observation[Bob] #2") == [
        ("evidence", "malformed dia id (expected D<session>:<turn>)"),
        ("bullet", "no evidence id resolves to a kept turn"),
    ]
    assert reasons("sample_id=mini-1 session_2 observation[Alice] #0")[0][1].startswith("malformed dia id")
    assert reasons("sample_id=mini-1 session_2 observation[Alice] #1") == [("evidence", "no such turn in this conversation")]
    assert reasons("sample_id=mini-1 session_2 observation[Alice] #2") == [
        ("evidence", "refers to a rejected turn"),
        ("bullet", "no evidence id resolves to a kept turn"),
    ]
    assert reasons("sample_id=mini-1 session_3 observation[Alice] #0") == [("bullet", "session rejected: no turns")]
    assert reasons("sample_id=mini-2 session_3 observation[Carol] #0") == [("bullet", "session rejected: no turns")]
    assert ledger.normalised["evidence: zero padding removed"] == 3  # D1:02, D2:03, D30:05
    assert ledger.normalised["evidence: joined string split into ids"] == 5


def test_fixture_qa() -> None:
    convs, ledger, rejects = read_all(FIXTURE)
    qa = {q["qa_id"]: q for c in convs for q in c.qa}
    assert sorted(qa) == [
        "locomo:mini-1:q0", "locomo:mini-1:q1", "locomo:mini-1:q2", "locomo:mini-1:q3", "locomo:mini-1:q5",
        "locomo:mini-2:q0", "locomo:mini-2:q1", "locomo:mini-2:q2",
    ]
    assert qa["locomo:mini-1:q0"] == {
        "qa_id": "locomo:mini-1:q0",
        "conversation_id": "locomo:mini-1",
        "question": "What is the name of Alice's cat?",
        "answer": "Miso",
        "evidence": ["locomo:mini-1:s1:t0"],
        "category": 1,
    }
    assert qa["locomo:mini-1:q1"]["answer"] == "2023"  # a number in the source
    assert qa["locomo:mini-1:q2"]["answer"] is None and qa["locomo:mini-1:q2"]["category"] == 5
    assert qa["locomo:mini-1:q3"]["evidence"] == ["locomo:mini-1:s1:t2"]  # "D8:6; D1:3": D8:6 dropped
    assert qa["locomo:mini-1:q5"]["evidence"] == ["locomo:mini-1:s2:t0"]  # a string instead of a list
    assert qa["locomo:mini-2:q1"]["evidence"] == ["locomo:mini-2:s2:t0", "locomo:mini-2:s1:t1"]
    assert qa["locomo:mini-2:q2"]["evidence"] == [] and qa["locomo:mini-2:q2"]["answer"] is None
    assert [(r["kind"], r["reason"], r["value"]) for r in rejects_of(rejects, "sample_id=mini-1 qa #4")] == [
        ("evidence", "no such turn in this conversation", "D30:05"),
        ("qa", "no evidence id resolves to a kept turn", "['D30:05']"),
    ]
    (missing,) = rejects_of(rejects, "sample_id=mini-1 qa #6")
    assert missing["field"] == "[0].qa[6].answer" and missing["reason"].startswith("missing answer")
    assert ledger.normalised["qa: category 5 without answer (kept, answer null)"] == 2
    assert ledger.normalised["qa answer: number read as string"] == 1
    assert tables(convs)["qa"].column("category").to_pylist() == [1, 2, 5, 4, 1, 1, 3, 5]


def test_reread_is_identical_and_directory_input(tmp_path: Path) -> None:
    first, _, _ = read_all(FIXTURE)
    (tmp_path / "locomo10.json").write_bytes(FIXTURE.read_bytes())
    (tmp_path / "notes.txt").write_text("not data")
    second, ledger, _ = read_all(tmp_path)
    assert [c.__dict__ for c in first] == [c.__dict__ for c in second]
    assert ledger.imbalance() == {}


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(IngestError, match="no .json file"):
        read_all(tmp_path)
    (tmp_path / "a.json").write_text("[]")
    (tmp_path / "b.json").write_text("[]")
    with pytest.raises(IngestError, match=r"2 \.json files.*a\.json, b\.json"):
        read_all(tmp_path)
    with pytest.raises(IngestError, match="no such file"):
        read_all(tmp_path / "missing.json")
    with pytest.raises(IngestError, match="no splits"):
        list(LocomoAdapter().read(FIXTURE, Ledger(), split="valid"))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (FIXTURE.read_bytes()[:500], "not valid JSON"),
        (b"\xff\xfe" + FIXTURE.read_bytes(), "not UTF-8"),
        (FIXTURE.read_bytes().replace(b"Miso", b"Mis\xe9", 1), "not UTF-8"),
        (json.dumps(FIXTURE_OBJ[0]).encode(), "top level is an object"),
        (b"", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not readable as JSON"),
        (b'[{"sample_id": ' + b"9" * 5000 + b"}]", "not readable as JSON"),
    ],
)
def test_unreadable_file_names_the_file(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "locomo.json"
    path.write_bytes(data)
    with pytest.raises(IngestError) as info:
        read_all(path)
    assert str(path) in str(info.value) and message in str(info.value)


def write(tmp_path: Path, obj: Any) -> Path:
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def test_duplicate_sample_id_rejects_the_later_with_its_contents(tmp_path: Path) -> None:
    obj = copy.deepcopy(FIXTURE_OBJ)
    obj.append(copy.deepcopy(obj[0]))
    convs, ledger, rejects = read_all(write(tmp_path, obj))
    assert [c.conversation_id for c in convs] == ["locomo:mini-1", "locomo:mini-2"]
    assert ledger.imbalance() == {}
    (dup,) = [r for r in rejects if r["kind"] == "conversation"]
    assert dup["record"] == "sample_id=mini-1" and dup["field"] == "[2].sample_id"
    assert dup["reason"].startswith("duplicate sample_id")
    # the duplicate's 3 sessions, 7 turns, 11 observations and 7 qa items are counted and rejected with it
    assert ledger.rejected["turn"] == 1 + 7 and ledger.rejected["bullet"] == 5 + 11 and ledger.rejected["qa"] == 2 + 7
    assert ledger.rejected["session"] == 2 + 3


def test_structural_rejects(tmp_path: Path) -> None:
    obj = copy.deepcopy(FIXTURE_OBJ)
    del obj[1]["conversation"]["speaker_b"]
    obj.append("not a conversation")
    obj.append({"conversation": {"speaker_a": "X", "speaker_b": "Y"}})
    convs, ledger, rejects = read_all(write(tmp_path, obj))
    assert [c.conversation_id for c in convs] == ["locomo:mini-1"]
    assert ledger.imbalance() == {}
    conv_rejects = [(r["record"], r["field"], r["reason"]) for r in rejects if r["kind"] == "conversation"]
    assert conv_rejects == [
        ("sample_id=mini-2", "[1].conversation.speaker_b", "missing speaker_b"),
        ("conversation[#2]", "[2]", "not a JSON object but a string"),
        ("conversation[#3]", "[3].sample_id", "missing sample_id"),
    ]


def test_turn_dia_ids_zero_padded_and_ambiguous(tmp_path: Path) -> None:
    obj = copy.deepcopy(FIXTURE_OBJ[1:])
    turns = obj[0]["conversation"]["session_1"]
    turns[0]["dia_id"] = "D01:01"  # normalised to D1:1, still citable
    turns[2]["dia_id"] = "D1:2"  # now two turns claim D1:2
    obj[0]["qa"].append({"question": "Which?", "answer": "x", "evidence": ["D1:2", "D1:1"], "category": 1})
    convs, ledger, rejects = read_all(write(tmp_path, obj))
    assert ledger.imbalance() == {}
    assert convs[0].qa[-1]["evidence"] == ["locomo:mini-2:s1:t0"]
    assert ledger.normalised["turn dia_id: zero padding removed"] == 1
    assert "ambiguous dia id (several turns carry it)" in {r["reason"] for r in rejects}


def test_wrong_types_inside_items(tmp_path: Path) -> None:
    obj = copy.deepcopy(FIXTURE_OBJ[1:])
    c = obj[0]
    c["conversation"]["session_2"][0]["text"] = 42
    c["conversation"]["session_1"][1]["text"] = "lone \ud800 surrogate"  # valid JSON escape, not writable UTF-8
    c["observation"]["session_1_observation"]["\udc80"] = [["fact", "D1:1"]]
    c["conversation"]["session_2_date_time"] = 17
    c["observation"]["session_1_observation"]["Dan"] = "Dan travelled to Lisbon."
    c["observation"]["session_1_observation"]["Carol"][0] = ["only text"]
    c["qa"][0]["category"] = "1"
    c["qa"][1]["answer"] = ["Portuguese"]
    c["qa"].append({"question": "Q?", "answer": "A", "evidence": [12, "D1:1", "D1:1"], "category": 1})
    convs, ledger, rejects = read_all(write(tmp_path, obj))
    assert ledger.imbalance() == {}
    tables(convs)
    reasons = {(r["kind"], r["reason"]) for r in rejects}
    assert ("session", "date_time is a number, expected a string") in reasons
    assert ("bullet", "facts of a speaker are a string, expected an array") in reasons
    assert ("bullet", "not a [fact_text, evidence] pair") in reasons
    assert ("qa", "answer is an array, expected a string") in reasons
    assert ("turn", "text is a number, expected a string") not in reasons  # its session went first (bad date)
    assert ("evidence", "evidence id is a number, expected a string") in reasons
    assert ("evidence", "duplicate evidence id in this item") in reasons
    assert ("turn", "text is not valid Unicode (lone surrogate escape)") in reasons
    assert ("bullet", "speaker is not valid Unicode (lone surrogate escape)") in reasons
    assert convs[0].qa[0]["category"] == 1
    assert convs[0].qa[-1]["evidence"] == ["locomo:mini-2:s1:t0"]
    assert [s["session_index"] for s in convs[0].sessions] == [1]


def test_parse_dia_id() -> None:
    assert parse_dia_id("D30:05") == (30, 5)
    assert parse_dia_id(" D1:3 ") == (1, 3)
    for bad in ("D", "D:11:26", "D1", "1:3", "D1:3:4", "d1:3", ""):
        assert parse_dia_id(bad) is None


# ------------------------------------------------------------------ corrupted inputs (hypothesis)


def node_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += node_paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += node_paths(v, prefix + (i,))
    return out


def get_at(node: Any, path: tuple) -> Any:
    for p in path:
        node = node[p]
    return node


ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.just([]),
    st.just({}),
    st.lists(st.text(max_size=4), max_size=3),
    st.sampled_from(["D1:1", "D01:002", "D", "D:1:1", "D1:1 D9:9", "D2:2;D1:3", "", "\ud800 lone", "D\u0661:1", [["x", "D1:1"]]]),
)


@st.composite
def corrupted(draw: st.DrawFn) -> tuple[bytes, str]:
    """The fixture after 1-4 structural mutations, then maybe truncated or given non-UTF-8 bytes."""
    obj = copy.deepcopy(FIXTURE_OBJ)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["drop", "retype", "retype", "empty_session", "duplicate"]))
        if not isinstance(obj, list) or not obj:
            break
        if op in ("drop", "retype"):
            path = draw(st.sampled_from(node_paths(obj)))
            if op == "retype":
                value = copy.deepcopy(draw(ODD_VALUES))  # never mutate the strategy's own lists
                if path:
                    get_at(obj, path[:-1])[path[-1]] = value
                else:
                    obj = value
            elif path:
                parent = get_at(obj, path[:-1])
                del parent[path[-1]]
        elif op == "empty_session":
            conv = draw(st.sampled_from(obj))
            body = conv.get("conversation") if isinstance(conv, dict) else None
            keys = [k for k in body if k.startswith("session_") and not k.endswith("date_time")] if isinstance(body, dict) else []
            if keys:
                body[draw(st.sampled_from(sorted(keys)))] = []
        else:
            obj.append(copy.deepcopy(draw(st.sampled_from(obj))))
    data = json.dumps(obj).encode("utf-8")
    damage = draw(st.sampled_from(["none", "none", "truncate", "non_utf8"]))
    if damage == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "non_utf8":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\x80abc"])) + data[at:]
    return data, damage


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corrupted())
def test_corrupted_inputs_conserve_or_fail_clearly(case: tuple[bytes, str]) -> None:
    data, damage = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "locomo_corrupt.json"
        path.write_bytes(data)
        try:
            convs, ledger, rejects = read_all(path)
        except IngestError as exc:
            assert str(path) in str(exc)
            return
        assert damage == "none", "truncated or non-UTF-8 input must raise IngestError"
        assert ledger.imbalance() == {}
        assert len(rejects) <= sum(ledger.rejected.values()) and (not rejects) == (not ledger.rejected.total())
        assert {r["kind"] for r in rejects} <= {"conversation", "session", "turn", "bullet", "qa", "evidence"}
        assert all(r["source"] == str(path) and r["reason"] and r["field"] for r in rejects)
        tables(convs)  # schema-valid, unique keys across conversations
        check_integrity(convs)


# ------------------------------------------------------------------ through `memprune ingest`


def test_ingest_writes_qa_table_and_summary(tmp_path: Path) -> None:
    from memprune.ingest import ingest
    from memprune.io import read_table

    summary = ingest("locomo", FIXTURE, tmp_path / "out")
    out = tmp_path / "out"
    qa = read_table(out / "qa.parquet", "qa")
    assert qa.num_rows == 8
    assert qa.column("qa_id").to_pylist()[:3] == ["locomo:mini-1:q0", "locomo:mini-1:q1", "locomo:mini-1:q2"]
    assert qa.column("answer").to_pylist()[2] is None
    assert read_table(out / "sessions.parquet", "sessions").num_rows == 4
    assert read_table(out / "bullets.parquet", "bullets").num_rows == 11
    written = json.loads((out / "ingest.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert written["counts"] == {"conversations": 2, "sessions": 4, "turns": 11, "bullets": 11, "qa": 8, "rejects": 16}
    assert written["ledger"]["conservation"] == "ok"
    assert written["ledger"]["seen"]["evidence"] == 30 and written["ledger"]["written"]["evidence"] == 24
    lines = [json.loads(line) for line in (out / "rejects.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 16 and {r["kind"] for r in lines} == {"session", "turn", "bullet", "qa", "evidence"}
