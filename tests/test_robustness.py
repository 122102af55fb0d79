"""The defects of a hostile new user's session, each pinned: reproduction -> exit 2 (or a reject), one line,
nothing half-written. See also tests/test_bad_inputs.py (the CLI fuzz over every command)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from memprune.cli import app
from memprune.errors import MemPruneError
from memprune.ingest import ingest
from memprune.io import MARKER, check_committed, read_table, write_json
from memprune.outputs import OutputSet
from memprune.schema import SchemaError

REPO = Path(__file__).resolve().parents[1]


def _line(cid: str, **session: object) -> str:
    base = {"turns": [{"speaker": "a", "text": "I have a cat.", "id": f"{cid}-t"}],
            "bullets": [{"text": "a has a cat.", "evidence": [0]}]}
    return json.dumps({"conversation_id": cid, "sessions": [{**base, **session}]})


def _ledger_balances(out: Path) -> dict:
    summary = json.loads((out / "ingest.json").read_text())
    assert summary["ledger"]["conservation"] == "ok"
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    return {"summary": summary, "rejects": rejects}


def test_out_of_range_integers_and_deep_json_are_rejects_not_crashes(tmp_path: Path) -> None:
    """Defect 1: an int32 overflow raised inside the sink's close; 100,000 nested arrays raised RecursionError."""
    src = tmp_path / "in.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    src.write_text("\n".join([
        _line("ok"),
        _line("big-index", session_index=2147483648),
        json.dumps({"conversation_id": "big-category", "sessions": [json.loads(_line("x"))["sessions"][0]],
                    "qa": [{"question": "q?", "answer": "a", "evidence": ["x-t"], "category": 2147483648}]}),
        deep,
    ]) + "\n")
    out = tmp_path / "corpus"
    ingest("jsonl", src, out)
    got = _ledger_balances(out)
    reasons = {r["reason"] for r in got["rejects"]}
    assert any("0..2147483647" in r for r in reasons) and any("int32" in r for r in reasons)
    assert "JSON nested too deeply to be a conversation" in reasons
    assert read_table(out / "sessions.parquet", "sessions").num_rows == 2


def test_a_failed_ingest_into_an_old_corpus_leaves_the_old_corpus(tmp_path: Path, monkeypatch) -> None:
    """Defect 1: tables were committed one by one, so a failure mixed two inputs that stats/label accepted."""
    src = tmp_path / "in.jsonl"
    src.write_text(_line("c1") + "\n")
    out = tmp_path / "corpus"
    ingest("jsonl", src, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    src.write_text(_line("c2") + "\n" + _line("c3") + "\n")

    from memprune import io

    real = io.TableSink.close
    calls = {"n": 0}

    def fail_second_close(self):  # the bullets table fails to close after the sessions table closed
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full (simulated)")
        return real(self)

    monkeypatch.setattr(io.TableSink, "close", fail_second_close)
    with pytest.raises(OSError, match="disk full"):
        ingest("jsonl", src, out)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing replaced
    assert not [p for p in out.iterdir() if p.name.startswith(".staging")]


def test_a_crash_while_committing_is_refused_by_every_reader(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "step"
    with OutputSet(out, "demo") as outputs:
        pq.write_table(pa.table({"x": [1]}), outputs.path("a.parquet"))
        write_json(outputs.path("b.json"), {"ok": True})
    assert json.loads((out / MARKER).read_text())["state"] == "done"
    check_committed(out / "a.parquet")

    real = os.replace
    moved = {"n": 0}

    def die_after_first_move(src, dst):
        moved["n"] += 1
        if moved["n"] == 3:  # marker written (1), first file moved (2), then the "kill"
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", die_after_first_move)
    with pytest.raises(KeyboardInterrupt):
        with OutputSet(out, "demo") as outputs:
            pq.write_table(pa.table({"x": [2, 3]}), outputs.path("a.parquet"))
            write_json(outputs.path("b.json"), {"ok": False})
    monkeypatch.undo()
    with pytest.raises(SchemaError, match="did not finish"):
        check_committed(out / "a.parquet")
    result = CliRunner().invoke(app, ["stats", str(out)])
    assert result.exit_code == 2


def test_outputs_follow_the_umask_and_stale_temp_files_are_cleaned(tmp_path: Path) -> None:
    """Defect 8: outputs were 0600 regardless of the umask; temp files of killed runs stayed forever."""
    stale = tmp_path / "step" / ".a.parquet.tmp-999999999-0123abcd"
    stale.parent.mkdir()
    stale.write_text("left by a killed run")
    old = os.umask(0o022)
    try:
        with OutputSet(tmp_path / "step", "demo") as outputs:
            write_json(outputs.path("b.json"), {})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "step" / "b.json").stat().st_mode) == 0o644
    assert not stale.exists()


def test_tables_from_pandas_and_polars_are_accepted(tmp_path: Path) -> None:
    """Defect 7: large_string (pandas/polars) and int64 columns were refused ("type large_string, expected string")."""
    path = tmp_path / "labels.parquet"
    pq.write_table(pa.table({"bullet_id": pa.array(["b1", "b2"], pa.large_string()),
                             "label": [0.1, 0.9], "n_pairs": pa.array([1, 2], pa.int64()),
                             "aggregation": pa.array(["max", "max"], pa.string_view())}), path)
    table = read_table(path, "labels")
    assert table.schema.field("bullet_id").type == pa.string() and table.schema.field("n_pairs").type == pa.int32()
    pq.write_table(pa.table({"bullet_id": ["b1"], "label": [0.1], "n_pairs": pa.array([2**40], pa.int64()),
                             "aggregation": ["max"]}), path)
    with pytest.raises(SchemaError, match="n_pairs.*not in range"):
        read_table(path, "labels")


def test_evidence_of_later_sessions_nan_answers_and_rejected_containers(tmp_path: Path) -> None:
    """Defect 8: a bullet could cite a later session's turn; a JSON NaN answer became "nan"; the evidence refs
    inside a rejected bullet were not counted, so rejects.jsonl could not be reconciled with ingest.json."""
    line = {"conversation_id": "c", "sessions": [
        {"turns": [{"speaker": "a", "text": "hi", "id": "s1t0"}],
         "bullets": [{"text": "cites the future", "evidence": ["s2t0"]},
                     {"text": "", "evidence": [0, "s1t0"]}]},
        {"turns": [{"speaker": "a", "text": "later", "id": "s2t0"}]}],
        "qa": [{"question": "q?", "answer": float("nan"), "evidence": ["s1t0"]}]}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(line) + "\n")  # json.dumps writes NaN, as careless exporters do
    ingest("jsonl", src, tmp_path / "out")
    got = _ledger_balances(tmp_path / "out")
    by_reason = {r["reason"]: r for r in got["rejects"]}
    assert "refers to a turn of a later session" in by_reason
    assert "answer is not a finite number" in by_reason
    ledger = got["summary"]["ledger"]
    assert ledger["seen"]["evidence"] == 4 and ledger["rejected"]["evidence"] == 4  # 1 later + 2 lost + 1 lost (qa)
    assert read_table(tmp_path / "out" / "qa.parquet", "qa").num_rows == 0


def test_errors_stay_one_line_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    """Defect 8: rich wrapped errors at 80 columns when stderr was a pipe."""
    long_dir = tmp_path / ("x" * 120)
    result = CliRunner().invoke(app, ["stats", str(long_dir)])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and str(long_dir) in lines[0]


def test_every_shipped_config_loads(monkeypatch) -> None:
    """Every YAML in configs/ validates against the model of the job that reads it."""
    from memprune.config import load_config
    from memprune.dialogue import DialogueEvalConfig
    from memprune.evaluate import EvalConfig
    from memprune.ingest import IngestConfig
    from memprune.label import LabelConfig
    from memprune.llm import LLMConfig
    from memprune.pipeline import PipelineConfig
    from memprune.qa import QAEvalConfig
    from memprune.stores import StorePruneConfig
    from memprune.summarize import SummarizeConfig
    from memprune.train import TrainConfig
    from memprune.train.shipped import ShippedRecipe
    from memprune.serve import ServeConfig
    from memprune.tune.config import TuneConfig

    monkeypatch.chdir(REPO)
    models = {"dialogue-eval": DialogueEvalConfig, "evaluate": EvalConfig, "ingest": IngestConfig,
              "label": LabelConfig, "pipeline": PipelineConfig, "prune": StorePruneConfig, "qa-eval": QAEvalConfig,
              "serve": ServeConfig, "summarize": SummarizeConfig, "train": TrainConfig, "tune": TuneConfig,
              "default-scorer": ShippedRecipe}
    files = sorted((REPO / "configs").rglob("*.yaml"))
    assert len(files) >= 15
    for path in files:
        if path.parent.name == "llm":
            LLMConfig.from_yaml(path)
            continue
        model = next(m for job, m in models.items() if path.stem.startswith(job) or path.stem == f"paper-{job}")
        cfg = load_config(path, [], model)
        if isinstance(cfg, LabelConfig) and cfg.judge == "llm":
            cfg.llm_settings()
        if isinstance(cfg, QAEvalConfig):
            cfg.llm_settings()


def test_job_runner_prints_one_line_for_user_errors(capsys) -> None:
    from memprune.runtime import run_job
    from memprune.train import TrainConfig

    def boom(cfg):
        raise MemPruneError("train.data: no bullets.parquet here\n(second line)")

    assert run_job("train", TrainConfig, boom, ["data=d", "labels=l", "out=o"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: train.data: no bullets.parquet here (second line)")
