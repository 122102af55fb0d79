"""MSC ingestion on the real validation data: every turn and every persona_text bullet arrives."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from memprune.cli import app
from memprune.ingest import corpus_stats, ingest
from memprune.schema import validate_table


@pytest.fixture(scope="module")
def msc_out(msc_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("msc")
    ingest("msc", msc_dir, out, split="valid")
    return out


def _raw_counts(msc_dir: Path) -> tuple[Counter, Counter, set]:
    """Count the source independently of the adapter: turns and persona_texts per (episode, session)."""
    turns, facts, episodes = Counter(), Counter(), set()
    for k in range(1, 5):
        with open(msc_dir / f"session_{k}" / "valid.txt", encoding="utf-8") as fh:
            for line in fh:
                rec = json.loads(line)
                episodes.add(rec["initial_data_id"])
                turns[(rec["initial_data_id"], k)] = len(rec["dialog"])
                facts[(rec["initial_data_id"], k)] = sum(1 for t in rec["dialog"] if t.get("persona_text"))
    return turns, facts, episodes


def test_msc_valid_counts_match_the_raw_files(msc_dir: Path, msc_out: Path) -> None:
    turns, facts, episodes = _raw_counts(msc_dir)
    summary = json.loads((msc_out / "ingest.json").read_text())
    assert summary["counts"] == {
        "conversations": 500, "sessions": 2000, "turns": sum(turns.values()),
        "bullets": sum(facts.values()), "qa": 0, "rejects": 0,
    }
    assert len(episodes) == 500 and sum(turns.values()) == 25459 and sum(facts.values()) == 16432
    assert summary["ledger"]["conservation"] == "ok"
    assert (msc_out / "rejects.jsonl").read_text() == ""

    sessions = validate_table(pq.read_table(msc_out / "sessions.parquet"), "sessions")
    bullets = validate_table(pq.read_table(msc_out / "bullets.parquet"), "bullets")
    got_turns = Counter({(r["conversation_id"], r["session_index"]): len(r["turns"]) for r in sessions.to_pylist()})
    got_facts = Counter((r["conversation_id"], r["session_index"]) for r in bullets.to_pylist())
    assert got_turns == turns
    assert got_facts == facts


def test_msc_bullets_cite_the_turn_they_came_from(msc_dir: Path, msc_out: Path) -> None:
    sessions = pq.read_table(msc_out / "sessions.parquet").to_pylist()
    turn_text = {t["turn_id"]: t for s in sessions for t in s["turns"]}
    first = json.loads((msc_dir / "session_2" / "valid.txt").open().readline())
    bullets = {b["bullet_id"]: b for b in pq.read_table(msc_out / "bullets.parquet").to_pylist()}
    for i, turn in enumerate(first["dialog"]):
        tid = f"valid_0:s2:t{i}"
        assert turn_text[tid]["text"] == turn["text"]
        assert turn_text[tid]["speaker"] == turn["id"]
        if turn.get("persona_text"):
            b = bullets[f"valid_0:s2:b{i}"]
            assert b["text"] == turn["persona_text"].strip()
            assert b["evidence"] == [tid]
            assert b["speaker"] == turn["id"]


def test_msc_ingest_is_deterministic(msc_dir: Path, msc_out: Path, tmp_path: Path) -> None:
    ingest("msc", msc_dir, tmp_path, split="valid")
    for name in ("sessions.parquet", "bullets.parquet"):
        assert (tmp_path / name).read_bytes() == (msc_out / name).read_bytes()


def test_stats_and_cli(msc_dir: Path, msc_out: Path, tmp_path: Path) -> None:
    stats = corpus_stats(msc_out)
    assert stats["conversations"] == 500 and stats["bullets"] == 16432
    assert stats["bullets_per_session"]["total"] == 16432
    assert set(stats["bullets_per_session_index"]) == {"1", "2", "3", "4"}

    runner = CliRunner()
    result = runner.invoke(app, ["ingest", "--format", "msc", "--input", str(msc_dir.parent), "--out",
                                 str(tmp_path / "o"), "--split", "valid"])
    assert result.exit_code == 0, result.output
    assert "500 conversations" in result.output
    result = runner.invoke(app, ["stats", str(msc_out)])
    assert result.exit_code == 0 and json.loads(result.stdout)["sessions"] == 2000


@pytest.mark.parametrize(
    "args, message",
    [
        (["--format", "nope", "--input", "{msc}"], "unknown format 'nope'"),
        (["--format", "msc", "--input", "/does/not/exist"], "/does/not/exist: no such file or directory"),
        (["--format", "msc", "--input", "{msc}", "--split", "train"], "no session_K/train.txt"),
        (["--format", "jsonl", "--input", "{empty}"], "no .jsonl files"),
    ],
)
def test_cli_errors_are_one_clear_line(msc_dir: Path, tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "empty").mkdir()
    args = [a.format(msc=msc_dir, empty=tmp_path / "empty") for a in args]
    result = CliRunner().invoke(app, ["ingest", *args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output
