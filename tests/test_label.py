"""The labeling stage: labels from the similarity judge on real MSC data, aggregation rules,
resume after a real SIGKILL (byte-identical tables), the CLI and the job entrypoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from memprune import schema
from memprune.cli import app
from memprune.config import load_config
from memprune.io import read_table
from memprune.label import ALL_PAIRS_FAILED, LabelConfig, aggregate, run_label
from memprune.label.similarity import SimilarityJudge, cosine_to_score
from memprune.runtime import run_job

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_msc(msc_small: Path) -> Path:
    """The first conversations of the real MSC validation split, as ingested tables (tests/conftest.py)."""
    return msc_small


@pytest.fixture(scope="module")
def labelled(small_msc: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list[str]]:
    """One similarity run over the small corpus, recording every text the encoder was given."""
    out = tmp_path_factory.mktemp("labels")
    seen: list[str] = []
    original = SimilarityJudge.encode

    def counting(self, texts):
        seen.extend(texts)
        return original(self, texts)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SimilarityJudge, "encode", counting)
        summary = run_label(LabelConfig(data=small_msc, out=out, shard_size=48, progress=False))
    return out, summary, seen


def test_similarity_labels_every_bullet_of_sessions_1_to_3(small_msc: Path, labelled: tuple[Path, dict, list[str]]):
    out, summary, _ = labelled
    bullets = read_table(small_msc / "bullets.parquet", "bullets")
    sessions = read_table(small_msc / "sessions.parquet", "sessions")
    labels = read_table(out / "labels.parquet", "labels")
    pairs = read_table(out / "pairs.parquet", "pairs")

    early = {b["bullet_id"] for b in bullets.to_pylist() if b["session_index"] in (1, 2, 3)}
    last = {b["bullet_id"] for b in bullets.to_pylist() if b["session_index"] == 4}
    assert early and last
    assert set(labels.column("bullet_id").to_pylist()) == early
    values = labels.column("label").to_numpy()
    assert not np.isnan(values).any() and values.min() >= 0.0 and values.max() <= 1.0
    assert values.std() > 0.01  # real scores, not a constant
    assert set(labels.column("aggregation").to_pylist()) == {"max"}

    # one pair per (bullet of session t, turn of session t+1)
    n_turns = {(s["conversation_id"], s["session_index"]): len(s["turns"]) for s in sessions.to_pylist()}
    expected = sum(n_turns[(b["conversation_id"], b["session_index"] + 1)]
                   for b in bullets.to_pylist() if b["bullet_id"] in early)
    assert pairs.num_rows == expected
    assert pairs.column("error").null_count == pairs.num_rows
    assert pairs.column("judge")[0].as_py().startswith("similarity:")
    keys = list(zip(pairs.column("bullet_id").to_pylist(), pairs.column("turn_id").to_pylist()))
    assert keys == sorted(keys)
    # the label is the max of the bullet's pair scores
    best: dict[str, float] = {}
    for b, s in zip(pairs.column("bullet_id").to_pylist(), pairs.column("score").to_pylist()):
        best[b] = max(best.get(b, 0.0), s)
    assert dict(zip(labels.column("bullet_id").to_pylist(), values.tolist())) == pytest.approx(best)

    c = summary["counts"]
    assert summary["reconciles"] is True and summary["proxy"] is True
    assert c["bullets"] == bullets.num_rows == c["bullets_labelled"] + c["bullets_unlabelled"]
    assert c["bullets_labelled"] == len(early) and c["unlabelled_no_next_session"] == len(last)
    assert c["pairs"] == expected == c["pairs_scored"] and c["pairs_error"] == 0
    assert summary["error_rate"] == 0.0
    unl = [json.loads(line) for line in (out / "unlabelled.jsonl").read_text().splitlines()]
    assert {u["bullet_id"] for u in unl} == last and {u["reason"] for u in unl} == {"no_next_session"}
    assert json.loads((out / "label.json").read_text())["counts"] == c
    assert "proxy" in (out / "label.md").read_text()


def test_every_distinct_text_is_encoded_once(small_msc: Path, labelled: tuple[Path, dict, list[str]]):
    out, summary, seen = labelled
    bullets = {b["bullet_id"]: b["text"] for b in read_table(small_msc / "bullets.parquet", "bullets").to_pylist()}
    turns = {t["turn_id"]: t["text"] for s in read_table(small_msc / "sessions.parquet", "sessions").to_pylist()
             for t in s["turns"]}
    pairs = read_table(out / "pairs.parquet", "pairs")
    pairs_texts: set[str] = set()
    for b, t in zip(pairs.column("bullet_id").to_pylist(), pairs.column("turn_id").to_pylist()):
        pairs_texts.update((bullets[b], turns[t]))
    assert len(seen) == len(set(seen)) == len(pairs_texts) == summary["throughput"]["texts_encoded"]
    assert set(seen) == pairs_texts


def test_similarity_judge_matches_sentence_transformers(minilm_path: str):
    from sentence_transformers import SentenceTransformer

    texts = ["I have two dogs.", "My dogs love the park.", "I work as a nurse at night.", "Quantum chromodynamics."]
    judge = SimilarityJudge(minilm_path, batch_size=3)
    ours = judge.encode(texts)
    ref = SentenceTransformer(minilm_path, device="cpu").encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    s = judge.score(["I have two dogs.", "I have two dogs.", "I have two dogs."],
                    ["I have two dogs.", "My dogs love the park.", "Quantum chromodynamics."])
    assert s[0] == pytest.approx(1.0, abs=1e-5) and s[1] > s[2] >= 0.0
    assert cosine_to_score(np.array([-0.4, 0.3]), "clip").tolist() == [0.0, pytest.approx(0.3)]
    assert cosine_to_score(np.array([-1.0, 1.0]), "affine").tolist() == [0.0, 1.0]


def test_aggregate_max_mean_decay_and_failed_bullets():
    pairs = pa.table({
        "bullet_id": ["a", "a", "a", "b", "b", "c"],
        "score": [0.2, 0.8, None, 0.6, 0.9, None],
        "horizon": pa.array([1, 2, 1, 1, 3, 1], type=pa.int32()),
    })
    labels, failed = aggregate(pairs, decay=0.5, how="max")
    got = {r["bullet_id"]: (r["label"], r["n_pairs"]) for r in labels.to_pylist()}
    # a: max(0.2, 0.8 * 0.5) = 0.4 from 2 scored pairs; b: max(0.6, 0.9 * 0.25)
    assert got == {"a": (pytest.approx(0.4), 2), "b": (pytest.approx(0.6), 2)}
    assert failed == [{"bullet_id": "c", "reason": ALL_PAIRS_FAILED, "n_pairs": 1, "n_errors": 1}]
    labels, _ = aggregate(pairs, decay=0.5, how="mean")
    got = {r["bullet_id"]: r["label"] for r in labels.to_pylist()}
    assert got == {"a": pytest.approx((0.2 + 0.4) / 2), "b": pytest.approx((0.6 + 0.225) / 2)}
    schema.validate_table(labels, "labels")
    with pytest.raises(ValueError):
        aggregate(pairs, 0.5, how="median")


def test_resume_reuses_finished_shards_and_options_that_need_no_rejudging(
    small_msc: Path, labelled: tuple[Path, dict, list[str]], tmp_path: Path
):
    first_out, first, _ = labelled
    out = tmp_path / "resume"
    shutil.copytree(first_out, out)
    ref = {n: (out / n).read_bytes() for n in ("pairs.parquet", "labels.parquet")}
    work = out / ".work" / Path(first["work_dir"]).name
    shards = sorted(work.glob("emb-*.npy"))
    assert len(shards) == first["throughput"]["shards_total"] > 2
    shards[1].unlink()
    again = run_label(LabelConfig(data=small_msc, out=out, shard_size=48, progress=False))
    assert again["throughput"]["shards_reused"] == len(shards) - 1 and shards[1].exists()
    assert {n: (out / n).read_bytes() for n in ref} == ref
    # aggregation and decay are applied after judging: everything is reused
    mean = run_label(LabelConfig(data=small_msc, out=out, shard_size=48, aggregation="mean", progress=False))
    assert mean["throughput"]["shards_reused"] == len(shards) and Path(mean["work_dir"]) == work
    assert mean["labels"]["mean"] < first["labels"]["mean"]
    # a different pair set is a different fingerprint
    same = run_label(LabelConfig(data=small_msc, out=out, shard_size=48, speaker="same", progress=False))
    assert Path(same["work_dir"]).name != work.name and same["throughput"]["shards_reused"] == 0
    c = same["counts"]
    assert c["pairs"] < first["counts"]["pairs"] and same["reconciles"]
    assert c["bullets_labelled"] + c["bullets_unlabelled"] == c["bullets"]


def _label_cmd(data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "memprune.cli", "label", "--data", str(data), "--out", str(out),
            "--judge", "similarity", "--shard-size", "16", "--no-progress"]


@pytest.mark.slow
def test_sigkill_midway_then_rerun_is_byte_identical(small_msc: Path, tmp_path: Path, ray_address: str):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RAY_ADDRESS": ray_address}
    # uninterrupted reference, through the Ray job entrypoint with the same settings
    ref = tmp_path / "ref"
    subprocess.run([sys.executable, str(REPO / "jobs" / "label.py"), str(REPO / "configs" / "label-similarity.yaml"),
                    f"data={small_msc}", f"out={ref}", "shard_size=16", "progress=false"],
                   check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, timeout=120)

    out = tmp_path / "killed"
    with open(tmp_path / "killed.log", "wb") as log:
        proc = subprocess.Popen(_label_cmd(small_msc, out), env=env, cwd=REPO, stdout=log, stderr=log)
        deadline = time.monotonic() + 120
        done = 0
        while time.monotonic() < deadline and proc.poll() is None:
            done = len(list(out.glob(".work/*/emb-*.npy")))
            if done >= 2:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
    assert not (out / "pairs.parquet").exists() and not (out / "labels.parquet").exists()

    subprocess.run(_label_cmd(small_msc, out), check=True, env=env, cwd=REPO, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((out / "label.json").read_text())
    t = summary["throughput"]
    assert 2 <= t["shards_reused"] < t["shards_total"]  # it resumed, and the kill was really midway
    for name in ("pairs.parquet", "labels.parquet"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert (out / "unlabelled.jsonl").read_bytes() == (ref / "unlabelled.jsonl").read_bytes()
    assert summary["counts"] == json.loads((ref / "label.json").read_text())["counts"]


def test_job_entrypoint_config_and_overrides(
    small_msc: Path, labelled: tuple[Path, dict, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    shutil.copytree(labelled[0], tmp_path, dirs_exist_ok=True)  # same fingerprint: no re-encoding needed
    rc = run_job("label", LabelConfig, run_label,
                 argv=[str(REPO / "configs" / "label-similarity.yaml"), f"data={small_msc}", f"out={tmp_path}",
                       "aggregation=mean", "similarity.batch_size=32", "shard_size=48", "progress=false"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["config"]["aggregation"] == "mean" and summary["config"]["similarity"]["batch_size"] == 32
    assert summary["throughput"]["shards_reused"] == summary["throughput"]["shards_total"]
    assert set(pq.read_table(tmp_path / "labels.parquet").column("aggregation").to_pylist()) == {"mean"}
    assert run_job("label", LabelConfig, run_label, argv=[f"data={small_msc}", f"out={tmp_path}", "horizon=0"]) == 2
    assert "horizon" in capsys.readouterr().err


def test_cli_reports_bad_input_clearly(tmp_path: Path, small_msc: Path):
    def run(*args: str) -> tuple[int, str]:
        res = CliRunner().invoke(app, ["label", *args])
        return res.exit_code, res.output.replace("\n", "")  # rich wraps long lines

    code, output = run("--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert code == 2 and str(tmp_path / "nope" / "sessions.parquet") in output
    code, output = run("--data", str(small_msc), "--out", str(tmp_path / "o"), "--judge", "llm")
    assert code == 2 and "llm_config" in output
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "sessions.parquet").write_bytes((small_msc / "sessions.parquet").read_bytes())
    pq.write_table(pa.table({"bullet_id": ["x"]}), bad / "bullets.parquet")
    code, output = run("--data", str(bad), "--out", str(tmp_path / "o"))
    assert code == 2 and "bullets.parquet" in output and "'text': missing" in output
    code, output = run("--data", str(small_msc), "--out", str(tmp_path / "o"), "--speaker", "both")
    assert code == 2 and "speaker" in output
    with pytest.raises(Exception, match="decay"):
        load_config(None, [f"data={small_msc}", "out=x", "decay=2"], LabelConfig)


# ---------------------------------------------------------------- the LLM judge (http engine, scripted server)

SCRIPT = {  # (bullet, target) -> reply of the scripted judge server
    ("fact one", "alpha"): '{"score": 0.2}', ("fact one", "beta"): '{"score": 0.6}', ("fact one", "gamma"): '{"score": 0.4}',
    ("fact two", "alpha"): '{"score": 0.9}', ("fact two", "beta"): "no idea", ("fact two", "gamma"): '{"score": 0.1}',
}


def _scripted(body: dict) -> str:
    import re

    user = body["messages"][-1]["content"]
    bullet = re.search(r"<bullet>(.*?)</bullet>", user, re.S).group(1).strip()
    target = re.search(r"<target[^>]*>(.*?)</target>", user, re.S).group(1).strip()
    return SCRIPT.get((bullet, target), "nope")  # "fact zero" never gets a score


def _llm_corpus(root: Path) -> Path:
    from tiny_llm import two_session_corpus

    return two_session_corpus(root, ["fact zero", "fact one", "fact two"], ["alpha", "beta", "gamma"])


@pytest.mark.slow
def test_llm_judge_labels_errors_and_resume(ray_local, tiny_llm: str, tmp_path: Path):
    from tiny_llm import TinyOpenAIServer

    data = _llm_corpus(tmp_path / "data")
    out = tmp_path / "out"
    with TinyOpenAIServer(tiny_llm, responder=_scripted, idle_timeout=120) as server:
        llm = {"engine": "http", "model": "tiny", "base_url": server.base_url, "qps": 50, "http_retries": 1,
               "batch_size": 4, "stage_num_cpus": 0.25, "max_retries": 1, "response_format": "json_object"}
        cfg = LabelConfig(data=data, out=out, judge="llm", llm=llm, shard_size=4, context_turns=1, progress=False)
        summary = run_label(cfg)
        first_requests = len(server.requests)
        ref = {n: (out / n).read_bytes() for n in ("pairs.parquet", "labels.parquet", "unlabelled.jsonl")}

        # resume: lose one finished shard; only its pairs are sent again
        work = Path(summary["work_dir"])
        (work / "pairs-00001.parquet").unlink()
        again = run_label(cfg)
        resent = [r["body"] for r in server.requests[first_requests:]]
    assert again["throughput"]["shards_reused"] == 2 and again["throughput"]["pairs_judged_this_run"] == 4
    assert {n: (out / n).read_bytes() for n in ref} == ref
    assert 4 <= len(resent) < first_requests

    labels = {r["bullet_id"]: r for r in read_table(out / "labels.parquet", "labels").to_pylist()}
    assert set(labels) == {"c:s1:b1", "c:s1:b2"}
    assert labels["c:s1:b1"]["label"] == pytest.approx(0.6) and labels["c:s1:b1"]["n_pairs"] == 3
    assert labels["c:s1:b2"]["label"] == pytest.approx(0.9) and labels["c:s1:b2"]["n_pairs"] == 2
    pairs = read_table(out / "pairs.parquet", "pairs").to_pylist()
    assert len(pairs) == 9 and all(p["judge"] == "llm:http:tiny:judge_v1" for p in pairs)
    failed = [p for p in pairs if p["error"] is not None]
    assert len(failed) == 4 and all(p["score"] is None for p in failed)
    unl = {u["bullet_id"]: u for u in map(json.loads, (out / "unlabelled.jsonl").read_text().splitlines())}
    assert unl["c:s1:b0"] == {"bullet_id": "c:s1:b0", "reason": "all_pairs_failed", "n_pairs": 3, "n_errors": 3}
    assert unl["c:s2:b0"]["reason"] == "no_next_session"

    c = summary["counts"]
    assert summary["reconciles"] and not summary["proxy"]
    assert (c["bullets"], c["bullets_labelled"], c["unlabelled_all_pairs_failed"], c["unlabelled_no_next_session"]) == (4, 2, 1, 1)
    assert (c["pairs"], c["pairs_scored"], c["pairs_error"], c["bullets_partially_failed"]) == (9, 5, 4, 1)
    assert summary["error_rate"] == pytest.approx(4 / 9)
    assert summary["tokens"]["in"] > 0 and summary["tokens"]["out"] > 0
    # judge prompts went out with the context window of one turn before the target
    beta = [b for b in resent if "<bullet>fact one</bullet>" in b["messages"][-1]["content"]
            and '<target speaker="B">beta</target>' in b["messages"][-1]["content"]]
    assert beta and all("alpha" in b["messages"][-1]["content"] and "hello" not in b["messages"][-1]["content"]
                        for b in beta)


@pytest.mark.slow
def test_similarity_on_a_ray_actor_pool_matches_in_process(
    ray_local, small_msc: Path, labelled: tuple[Path, dict, list[str]], tmp_path: Path
):
    cfg = LabelConfig(data=small_msc, out=tmp_path, shard_size=48, progress=False,
                      similarity={"executor": "ray", "actors": 2})
    summary = run_label(cfg)
    assert summary["throughput"]["executor"] == "ray" and summary["counts"] == labelled[1]["counts"]
    ours = read_table(tmp_path / "labels.parquet", "labels")
    ref = read_table(labelled[0] / "labels.parquet", "labels")
    assert ours.column("bullet_id").equals(ref.column("bullet_id"))
    np.testing.assert_allclose(ours.column("label").to_numpy(), ref.column("label").to_numpy(), atol=1e-5)


def test_llm_label_config_layers_file_inline_and_overrides(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(REPO / "configs" / "label-llm.yaml",
                      ["data=d", "out=o", "llm.model=/models/judge", "llm_overrides=[batch_size=8]"], LabelConfig)
    llm = cfg.llm_settings()
    assert (cfg.judge, llm.engine, llm.model, llm.accelerator, llm.batch_size) == ("llm", "vllm", "/models/judge", "gpu", 8)
    assert llm.enable_prefix_caching
    with pytest.raises(Exception, match="llm.engine"):
        load_config(None, ["data=d", "out=o", "judge=llm", "llm.engine=gpt"], LabelConfig).llm_settings()
