"""summarize, qa-eval, dialogue-eval and `label --plan` on object storage (a real S3 server on loopback: moto's
standalone server, the `bucket` fixture): inputs read from `s3://`, outputs committed there as one output set
(marker `done` last), the same files and content as the same run with local paths; a URI that cannot be used is
one line and nothing is written. (label, train, evaluate, ingest, synth and prune: tests/test_object_storage.py; tune: on two nodes in
tests/test_cluster_two_nodes.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from conftest import upload
from helpers import committed, remote_files, summary_reply, summary_sessions
from test_dialogue import corpus_and_store  # noqa: F401  (fixture: a synthetic corpus and its pruned store)
from test_qa_eval import locomo, store  # noqa: F401  (fixtures: the LoCoMo fixture ingested, its pruned store)
from tiny_llm import TinyOpenAIServer
from typer.testing import CliRunner

from memprune.storage import Location, location


def _cli(*args: str) -> Any:
    from memprune.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _local_files(root: Path) -> set[str]:
    """The files of a local output directory, without the hidden ones (marker, `.work/`)."""
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)}


def _table(where: Path | Location) -> list[dict[str, Any]]:
    if isinstance(where, Location):
        return pq.read_table(where.path, filesystem=where.fs).to_pylist()
    return pq.read_table(where).to_pylist()


def _reply(body: dict) -> str:
    """The summarize replies of tests/test_summarize.py; one fixed answer to every other prompt (qa, dialogue)."""
    if "adopted a" in body["messages"][-1]["content"]:
        return summary_reply(body)
    return "Alice went hiking in May."


@pytest.fixture(scope="module")
def server(tiny_llm):
    with TinyOpenAIServer(tiny_llm, responder=_reply, idle_timeout=300) as srv:
        yield srv


def _llm_yaml(path: Path, server: TinyOpenAIServer) -> Path:
    path.write_text(json.dumps({"engine": "http", "model": "tiny", "base_url": server.base_url, "batch_size": 8,
                                "stage_num_cpus": 0.25, "max_retries": 1, "http_retries": 0}))
    return path


@pytest.mark.slow  # about 30 s: two summarize runs on the tiny LLM
def test_summarize_reads_sessions_from_s3_commits_there_as_locally_and_resumes_on_another_node(
        ray_local, server, bucket: str, tmp_path: Path, monkeypatch) -> None:
    from memprune.io import write_table

    write_table(summary_sessions(), tmp_path / "data" / "sessions.parquet", "sessions")
    args = ["--llm-config", _llm_yaml(tmp_path / "llm.yaml", server), "--chunk-sessions", "2"]
    res = _cli("summarize", "--data", tmp_path / "data", "--out", tmp_path / "local", *args)
    assert res.exit_code == 0, res.output
    data, out = upload(tmp_path / "data", f"{bucket}/data"), f"{bucket}/summarized"
    monkeypatch.setenv("MEMPRUNE_CACHE_DIR", str(tmp_path / "node-a"))
    res = _cli("summarize", "--data", data, "--out", out, *args)
    assert res.exit_code == 0, res.output
    assert f"-> {out}" in " ".join(res.output.split())
    root, local = location(out), tmp_path / "local"
    assert set(committed(out, "summarize")["files"]) == remote_files(out) == _local_files(local)
    for name in ("bullets.parquet", "summaries.parquet", "sessions.parquet"):
        assert (root / name).read_bytes() == (local / name).read_bytes(), name
    rejects = [json.loads(line) for line in (root / "rejects.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rejects] == [f"{data}/sessions.parquet"] * 2
    assert [{**r, "source": None} for r in rejects] == [
        {**json.loads(line), "source": None} for line in (local / "rejects.jsonl").read_text().splitlines()]
    got, want = json.loads((root / "summarize.json").read_text()), json.loads((local / "summarize.json").read_text())
    assert got["counts"] == want["counts"] and got["llm_outcome"] == want["llm_outcome"]
    assert got["out"] == out and got["data"] == data and str(tmp_path / "node-a") not in json.dumps(got)

    # a rerun on a node with an empty cache finds every chunk under OUT/.work on the bucket: nothing is sent again
    monkeypatch.setenv("MEMPRUNE_CACHE_DIR", str(tmp_path / "node-b"))
    sent = len(server.requests)
    res = _cli("summarize", "--data", data, "--out", out, *args)
    assert res.exit_code == 0, res.output
    again = json.loads((root / "summarize.json").read_text())["chunks"]
    assert (again["total"], again["reused"]) == (2, 2) and again["work"].startswith(f"{out}/.work/")
    assert len(server.requests) == sent
    assert (root / "bullets.parquet").read_bytes() == (local / "bullets.parquet").read_bytes()


def _locally_and_on_s3(step: str, data: Path, pruned: Path, bucket: str, tmp_path: Path, args: list[str]
                       ) -> tuple[Location, Path, tuple[str, str, str]]:
    """`step` on local `data` and `pruned` into TMP/local, then on their copies in `bucket` into BUCKET/STEP; checks
    both succeed and the committed set has the local run's files. (root of the out URI, the local dir, (data, pruned,
    out) URIs)."""
    res = _cli(step, "--data", data, "--pruned", pruned, "--out", tmp_path / "local", *args)
    assert res.exit_code == 0, res.output
    out = f"{bucket}/{step}"
    uris = upload(data, f"{bucket}/data"), upload(pruned, f"{bucket}/pruned"), out
    res = _cli(step, "--data", uris[0], "--pruned", uris[1], "--out", out, *args)
    assert res.exit_code == 0, res.output
    assert set(committed(out, step)["files"]) == remote_files(out) == _local_files(tmp_path / "local")
    return location(out), tmp_path / "local", uris


@pytest.mark.slow  # about 15 s: a prune and two QA evaluations
def test_qa_eval_reads_corpus_and_pruned_store_from_s3_and_commits_there_as_locally(
        ray_local, server, bucket: str, locomo: Path, store: Path, tmp_path: Path) -> None:  # noqa: F811
    args = ["--llm-config", _llm_yaml(tmp_path / "llm.yaml", server), "--conditions", "none,all,pruned",
            "--set", "bootstrap.samples=0", "--set", "figures=false", "--set", "progress=false"]
    root, local, (_, pruned, out) = _locally_and_on_s3("qa-eval", locomo, store, bucket, tmp_path, args)
    assert _table(root / "answers.parquet") == _table(local / "answers.parquet")
    got, want = json.loads((root / "qa.json").read_text()), json.loads((local / "qa.json").read_text())
    assert got["metrics"] == want["metrics"] and got["accounting"] == want["accounting"]
    assert {k: v for k, v in got["pruned"].items() if k not in ("path", "files")} == {
        k: v for k, v in want["pruned"].items() if k not in ("path", "files")}
    assert got["pruned"]["files"] == [f"{pruned}/pruned/part-00000.parquet"] and got["pruned"]["rule"]["top_k"] == 2
    assert got["out"] == out and got["outputs"]["answers"] == f"{out}/answers.parquet"
    assert got["chunks"]["answers"]["work"].startswith(f"{out}/.work/")


def test_dialogue_eval_reads_corpus_and_pruned_store_from_s3_and_commits_there_as_locally(
        ray_local, server, bucket: str, corpus_and_store: tuple[Path, Path], tmp_path: Path) -> None:  # noqa: F811
    corpus, store_dir = corpus_and_store
    args = ["--llm-config", _llm_yaml(tmp_path / "llm.yaml", server), "--turns", "4", "--conditions",
            "none,all,pruned", *(x for s in ("bertscore.enabled=false", "mauve.enabled=false", "bootstrap.samples=0",
                                             "progress=false") for x in ("--set", s))]
    root, local, (data, _, out) = _locally_and_on_s3("dialogue-eval", corpus, store_dir, bucket, tmp_path, args)
    assert _table(root / "generations.parquet") == _table(local / "generations.parquet")
    got, want = json.loads((root / "dialogue.json").read_text()), json.loads((local / "dialogue.json").read_text())
    assert got["metrics"] == want["metrics"] and got["targets"] == want["targets"] and got["cost"] == want["cost"]
    assert got["pruned"]["kept"] == want["pruned"]["kept"] and got["out"] == out and got["data"] == data


def test_label_plan_on_s3_is_its_own_output_set_and_a_label_run_elsewhere_is_unaffected(
        bucket: str, msc_small: Path, tmp_path: Path) -> None:
    args = ["--plan", "--judge", "llm", "--judge-mode", "listwise", "--throughput", "2500"]
    res = _cli("label", "--data", msc_small, "--out", tmp_path / "plan", *args)
    assert res.exit_code == 0, res.output
    data, plan = upload(msc_small, f"{bucket}/data"), f"{bucket}/plan"
    res = _cli("label", "--data", data, "--out", plan, *args)
    assert res.exit_code == 0, res.output
    assert set(committed(plan, "label-plan")["files"]) == remote_files(plan) == {"plan.json", "plan.md"}
    assert _local_files(tmp_path / "plan") == {"plan.json", "plan.md"}
    got = json.loads((location(plan) / "plan.json").read_text())
    want = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert got["modes"] == want["modes"] and got["pairs"] == want["pairs"] and got["inputs"] == want["inputs"]
    res = _cli("label", "--data", data, "--out", plan, *args)  # the prefix is a memprune output: planned again
    assert res.exit_code == 0, res.output

    labels = f"{bucket}/labels"
    res = _cli("label", "--data", data, "--out", labels, "--shard-size", "48", "--no-progress")
    assert res.exit_code == 0, res.output
    assert {"labels.parquet", "label.json"} <= set(committed(labels, "label")["files"])
    assert not {"plan.json", "plan.md"} & remote_files(labels)
    assert set(committed(plan, "label-plan")["files"]) == remote_files(plan) == {"plan.json", "plan.md"}


def test_uris_these_steps_cannot_use_are_one_line_and_nothing_is_written(bucket: str, msc_small: Path,
                                                                         tmp_path: Path) -> None:
    llm = tmp_path / "llm.yaml"
    llm.write_text(json.dumps({"engine": "http", "model": "tiny", "base_url": "http://127.0.0.1:9"}))
    location(f"{bucket}/theirs/notes.txt").write_text("someone else's")
    data = upload(msc_small, f"{bucket}/data")
    cases = [
        (["summarize", "--data", "nope://b/x", "--out", f"{bucket}/s", "--llm-config", llm],
         "unknown storage scheme 'nope'"),
        (["summarize", "--data", data, "--out", "s3:/b/x", "--llm-config", llm], "looks like a URI with one slash"),
        (["qa-eval", "--data", data, "--out", f"{bucket}/q", "--llm-config", llm, "--conditions", "none"],
         "no qa.parquet here"),
        (["qa-eval", "--data", "s3://no-such-bucket-memprune/d", "--out", f"{bucket}/q", "--llm-config", llm,
          "--conditions", "none"], "bucket 'no-such-bucket-memprune' does not exist"),
        (["dialogue-eval", "--data", data, "--pruned", f"{bucket}/nothing", "--out", f"{bucket}/d", "--llm-config",
          llm, "--conditions", "none,pruned"], "pruned store not found"),
        (["dialogue-eval", "--data", data, "--out", f"{bucket}/theirs", "--llm-config", llm, "--conditions", "none"],
         "not a memprune output"),
        (["tune", "--data", data, "--labels", data, "--out", "s3://no-such-bucket-memprune/t"],
         "bucket 'no-such-bucket-memprune' does not exist"),
        (["label", "--data", data, "--out", f"{bucket}/theirs", "--plan"], "not a memprune output"),
    ]
    for args, message in cases:
        res = _cli(*args)
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and message in text and text.count("error:") == 1, (args, res.output)
        assert "Traceback" not in res.output, res.output
    assert remote_files(bucket) == {f"data/{n}" for n in remote_files(data)} | {"theirs/notes.txt"}
