"""`memprune summarize` and jobs/summarize.py: sessions -> bullets with evidence, resumable, errors counted.

The LLM is the `http` engine against a local OpenAI-compatible server whose replies are
scripted per session, so evidence dropping, lenient parsing, retries and error rows are
all exercised through the real Ray Data pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from helpers import summary_reply, summary_sessions
from tiny_llm import TinyOpenAIServer
from typer.testing import CliRunner

from memprune.cli import app
from memprune.io import read_table, write_table
from memprune.summarize import SummarizeConfig, SummarizeError, bullet_rows, summarize

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tiny_llm):
    with TinyOpenAIServer(tiny_llm, responder=summary_reply, idle_timeout=300) as srv:
        yield srv


@pytest.fixture()
def corpus(tmp_path) -> Path:
    data = tmp_path / "data"
    write_table(summary_sessions(), data / "sessions.parquet", "sessions")
    return data


def _llm_yaml(path: Path, server: TinyOpenAIServer) -> Path:
    path.write_text(yaml.safe_dump({"engine": "http", "model": "tiny", "base_url": server.base_url, "batch_size": 2,
                                    "stage_num_cpus": 0.25, "max_retries": 1, "http_retries": 0}))
    return path


def test_bullet_rows_and_config_validation(tmp_path):
    rows = bullet_rows({"conversation_id": "c", "session_index": 2, "bullets": [
        {"speaker": "A", "text": "x y z", "evidence": ["c:s2:t0"]}, {"speaker": None, "text": "u v w", "evidence": []}]})
    assert [r["bullet_id"] for r in rows] == ["c:s2:b0", "c:s2:b1"] and rows[1]["speaker"] is None
    assert bullet_rows({"conversation_id": "c", "session_index": 0, "bullets": None}) == []
    with pytest.raises(ValueError, match="exactly one"):
        SummarizeConfig(data="d", out="o")
    with pytest.raises(ValueError, match="exactly one"):
        SummarizeConfig(data="d", out="o", llm={"engine": "hf", "model": "m"}, llm_config="x.yaml")
    cfg = SummarizeConfig(data="d", out="o", llm={"engine": "hf", "model": "m"}, llm_overrides=["max_retries=0"])
    assert cfg.llm_settings().max_retries == 0
    with pytest.raises(SummarizeError, match="no sessions.parquet"):
        summarize(tmp_path / "nope", tmp_path / "out", cfg.llm_settings())


@pytest.mark.slow
def test_cli_summarize_counts_evidence_errors_and_resumes(ray_local, server, corpus, tmp_path):
    llm = _llm_yaml(tmp_path / "llm.yaml", server)
    out = tmp_path / "out"
    args = ["summarize", "--data", str(corpus), "--out", str(out), "--llm-config", str(llm), "--chunk-sessions", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "summarized 2/4 sessions into 4 bullets" in result.output

    bullets = read_table(out / "bullets.parquet", "bullets").to_pylist()
    by_id = {b["bullet_id"]: b for b in bullets}
    assert by_id["conv0:s0:b0"] == {"bullet_id": "conv0:s0:b0", "conversation_id": "conv0", "session_index": 0,
                                    "speaker": "A", "text": "A adopted a cat last week.", "evidence": ["conv0:s0:t0"]}
    assert by_id["conv0:s0:b1"]["evidence"] == ["conv0:s0:t2"]
    assert by_id["conv1:s0:b0"]["text"] == "A adopted a chess set" and by_id["conv1:s0:b1"]["evidence"] == ["conv1:s0:t1"]
    assert set(by_id) == {"conv0:s0:b0", "conv0:s0:b1", "conv1:s0:b0", "conv1:s0:b1"}

    summaries = {(r["conversation_id"]): r for r in pq.read_table(out / "summaries.parquet").to_pylist()}
    assert summaries["conv0"]["evidence_dropped"] == 1 and summaries["conv0"]["parse"] == "strict"
    assert summaries["conv1"]["attempts"] == 2 and summaries["conv1"]["parse"] == "lenient"
    assert summaries["conv1"]["evidence_dropped"] == 1  # T4 does not exist in a 3-turn session
    assert summaries["conv2"]["error"] and summaries["conv2"]["raw"] == "no idea" and summaries["conv2"]["attempts"] == 2
    assert summaries["conv3"]["error"] and "expected exactly" in summaries["conv3"]["error"]  # "{}" is not a summary

    report = json.loads((out / "summarize.json").read_text())
    c = report["counts"]
    assert (c["sessions"], c["sessions_ok"], c["sessions_error"], c["bullets"]) == (4, 2, 2, 4)
    assert c["evidence_dropped"] == 2 and c["evidence_kept"] == 4 and c["rejects"] == 2
    assert report["llm_outcome"]["retried_rows"] == 3 and report["chunks"] == {**report["chunks"], "total": 2,
                                                                                "reused": 0}
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert {r["record"] for r in rejects} == {"conv2:s0", "conv3:s0"} and rejects[0]["kind"] == "session"
    assert (out / "summarize.md").read_text().startswith("# memprune summarize")
    assert read_table(out / "sessions.parquet", "sessions").num_rows == 4  # OUT is a complete corpus for `label`

    # rerun: every chunk is reused, nothing is sent again
    sent = len(server.requests)
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert len(server.requests) == sent
    assert json.loads((out / "summarize.json").read_text())["chunks"]["reused"] == 2
    assert read_table(out / "bullets.parquet", "bullets").to_pylist() == bullets


def test_cli_summarize_bad_inputs_exit_2(tmp_path):
    result = CliRunner().invoke(app, ["summarize", "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                                      "--llm-config", str(REPO / "configs" / "llm" / "hf-tiny-cpu.yaml")])
    assert result.exit_code == 2 and "no sessions.parquet" in " ".join(result.output.split())
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: hf\nmodel: m\nsampling: {tempreature: 1}\n")
    result = CliRunner().invoke(app, ["summarize", "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                                      "--llm-config", str(bad)])
    assert result.exit_code == 2 and "sampling.tempreature" in " ".join(result.output.split())


@pytest.mark.slow
def test_job_entrypoint(ray_local, server, corpus, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("memprune_job_summarize", REPO / "jobs" / "summarize.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    from memprune.runtime import run_job

    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"data": str(corpus), "out": str(tmp_path / "job-out"),
                                   "llm": {"engine": "http", "model": "tiny", "base_url": server.base_url},
                                   "llm_overrides": ["max_retries=0"], "limit": 1}))
    assert job.SummarizeConfig is SummarizeConfig
    assert run_job("summarize", job.SummarizeConfig, job.run, [str(cfg), "block_rows=1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["counts"]["sessions"] == 1 and summary["counts"]["bullets"] == 2
    assert summary["settings"]["block_rows"] == 1 and summary["settings"]["llm"]["max_retries"] == 0
    assert run_job("summarize", job.SummarizeConfig, job.run, [str(cfg), "chunk_sessions=0"]) == 2
