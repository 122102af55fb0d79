"""Listwise, likelihood and consensus judging end to end on real engines: a scripted OpenAI-compatible server
(listwise with malformed lists retried then falling back, orders, resume after a real SIGKILL) and the `hf`
engine on the tiny random model (listwise fallback, likelihood gains checked against transformers, a
consensus of two judges with agreement, resume); and `label --plan`'s prompt tokens, per pair and in total, against
the usage the server reports for the real run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from tiny_llm import TinyOpenAIServer, build_tiny_llm, direct_gain, two_session_corpus

from memprune.io import read_table
from memprune.label import LabelConfig, run_label

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
BULLETS = ["fact zero", "fact one", "fact two"]
TURNS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
LIST_SCORES = {"fact zero": 1, "fact one": 8, "fact two": 4}  # the scripted listwise judge, 0-10
PAIR_SCORES = {"fact zero": 0.3, "fact one": 0.6, "fact two": "not a score"}  # the scripted pairwise judge


def _scripted(body: dict) -> str:
    """Lists: scores by bullet text, except the lists of `gamma` (malformed: retried, then pairwise fallback)."""
    time.sleep(float(os.environ.get("MEMPRUNE_TEST_SCRIPT_DELAY", "0")))
    user = body["messages"][-1]["content"]
    target = re.search(r"<target[^>]*>(.*?)</target>", user, re.S).group(1).strip()
    if "<bullets>" in user:
        if target == "gamma":
            return "These bullets all look relevant to me."
        items = re.findall(r'<bullet id="(\d+)">(.*?)</bullet>', user)
        return json.dumps([{"id": int(i), "score": LIST_SCORES[text]} for i, text in items])
    bullet = re.search(r"<bullet>(.*?)</bullet>", user, re.S).group(1).strip()
    value = PAIR_SCORES[bullet]
    return json.dumps({"score": value}) if isinstance(value, float) else value


@pytest.fixture(scope="module")
def server(tiny_llm: str):
    with TinyOpenAIServer(tiny_llm, responder=_scripted, idle_timeout=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_session_corpus(tmp_path_factory.mktemp("corpus"), BULLETS, TURNS)


def _http_llm(server: TinyOpenAIServer) -> dict:
    return {"engine": "http", "model": "tiny", "base_url": server.base_url, "qps": 50, "http_retries": 1,
            "batch_size": 4, "stage_num_cpus": 0.25, "max_retries": 1, "response_format": "json_object"}


@pytest.fixture(scope="module")
def listwise_run(ray_local, server: TinyOpenAIServer, corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("listwise")
    before = len(server.requests)
    # one shard (fewest passes); the resume test below cuts the same work into 3 shards and must agree byte for byte
    cfg = LabelConfig(data=corpus, out=out, judge="llm", judge_mode="listwise", listwise={"orders": 2},
                      llm=_http_llm(server), shard_size=64, context_turns=1, progress=False)
    summary = run_label(cfg)
    return out, summary, server.requests[before:]


def test_listwise_scores_orders_fallback_and_accounting(listwise_run):
    out, summary, requests = listwise_run
    pairs = {(p["bullet_id"], p["turn_id"]): p for p in read_table(out / "pairs.parquet", "pairs").to_pylist()}
    assert len(pairs) == len(BULLETS) * len(TURNS)
    for (bid, tid), p in pairs.items():
        text = BULLETS[int(bid.rsplit("b", 1)[1])]
        if tid.endswith("t2"):  # gamma: both orders malformed after a retry -> the pairwise judge
            assert p["judge_mode"] == "pairwise" and p["judge"] == "llm:http:tiny:judge_v1"
            assert p["list_position"] is None
            if isinstance(PAIR_SCORES[text], float):
                assert p["score"] == pytest.approx(PAIR_SCORES[text]) and p["error"] is None
            else:
                assert p["score"] is None and "unparseable" in p["error"]
        else:
            assert p["judge_mode"] == "listwise" and p["judge"] == "llm:http:tiny:judge_listwise_v1"
            assert p["score"] == pytest.approx(LIST_SCORES[text] / 10) and p["list_size"] == 3
            assert 0 <= p["list_position"] < 3
    # every list shown the bullets numbered 1..3 in a shuffled order, and the second order reversed
    lists = [r["body"]["messages"][-1]["content"] for r in requests if "<bullets>" in r["body"]["messages"][-1]["content"]]
    shown = [tuple(re.findall(r'<bullet id="\d+">(.*?)</bullet>', u)) for u in lists]
    assert all(sorted(s) == sorted(BULLETS) for s in shown)
    assert len(set(shown)) > 1  # not always the same order
    lw, c = summary["listwise"], summary["counts"]
    assert (lw["lists_sent"], lw["lists_failed"], lw["chunks_fallback"], lw["pairs_fallback"]) == (12, 2, 1, 3)
    assert len(lists) == 10 + 2 * 2  # the two malformed lists were retried once
    assert lw["order_agreement"]["spearman"] == pytest.approx(1.0) and lw["order_agreement"]["pairs"] == 15
    assert set(lw["position_bias"]) == {"0", "1", "2"}
    # every pair accounted once: seen = labelled + error; calls and tokens are the server's
    assert summary["reconciles"] and c["pairs"] == c["pairs_scored"] + c["pairs_error"] == 18
    assert c["pairs_by_mode"] == {"listwise": 15, "pairwise": 3} and c["pairs_error"] == 1
    m = summary["cost"]["measured"]
    assert m["llm_calls"] == len(requests) == 14 + 3 + 1  # 12 lists + 2 retries, 3 fallback pairs + 1 retry
    assert m["prompt_tokens"] > 0 and m["prompt_tokens_per_labelled_pair"] == pytest.approx(m["prompt_tokens"] / 17)
    planned = summary["cost"]["planned"]
    assert planned["calls"] == 12 and 0 < planned["prefix_cache_reusable_share"] < 1
    assert "## Listwise" in (out / "label.md").read_text()


def test_listwise_resume_after_sigkill_is_byte_identical(listwise_run, server: TinyOpenAIServer, corpus: Path,
                                                        tmp_path: Path, ray_address: str):
    ref_out, ref, _ = listwise_run
    llm_yaml = tmp_path / "llm.yaml"
    llm_yaml.write_text(yaml.safe_dump(_http_llm(server)))
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "memprune.cli", "label", "--data", str(corpus), "--out", str(out), "--judge", "llm",
           "--judge-mode", "listwise", "--listwise-orders", "2", "--llm-config", str(llm_yaml), "--shard-size", "6",
           "--context", "1", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MEMPRUNE_TEST_SCRIPT_DELAY": "0.2", "RAY_ADDRESS": ray_address}
    os.environ["MEMPRUNE_TEST_SCRIPT_DELAY"] = "0.2"  # the server runs in this process: slow it down for the kill
    try:
        with open(tmp_path / "killed.log", "wb") as log:
            proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=log)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and proc.poll() is None:
                if list(out.glob(".work/*/lists-*.parquet")):
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.05)
            proc.wait(timeout=30)
    finally:
        os.environ.pop("MEMPRUNE_TEST_SCRIPT_DELAY", None)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
    assert not (out / "pairs.parquet").exists()
    cfg = LabelConfig(data=corpus, out=out, judge="llm", judge_mode="listwise", listwise={"orders": 2},
                      llm_config=llm_yaml, shard_size=6, context_turns=1, progress=False)
    again = run_label(cfg)
    assert 1 <= again["throughput"]["shards_reused"] < again["throughput"]["shards_total"] == 3
    for name in ("pairs.parquet", "labels.parquet", "unlabelled.jsonl"):
        assert (out / name).read_bytes() == (ref_out / name).read_bytes(), name
    assert again["counts"] == ref["counts"] and again["cost"]["measured"] == ref["cost"]["measured"]
    assert again["listwise"] == ref["listwise"]


# ---------------------------------------------------------------- the hf engine on the tiny random model


def _hf_llm(model: str, **kw) -> dict:
    return {"engine": "hf", "model": model, "dtype": "float32", "max_model_len": 2048, "batch_size": 8,
            "stage_num_cpus": 0.25, "max_retries": 1, **kw}


def test_hf_listwise_consensus_of_samples_falls_back_to_pairwise(ray_local, tiny_llm: str, corpus: Path,
                                                                 tmp_path: Path):
    llm = _hf_llm(tiny_llm, max_retries=0, sampling={"max_tokens": {"judge": 6, "listwise": 6}})
    summary = run_label(LabelConfig(data=corpus, out=tmp_path, judge="llm", judge_mode="listwise", judge_samples=2,
                                    llm=llm, listwise={"tokens_per_bullet": 4}, progress=False))
    pairs = read_table(tmp_path / "pairs.parquet", "pairs").to_pylist()
    lw, c = summary["listwise"], summary["counts"]
    # the random model writes noise (hf has no structured output): every list of both samples fails and its
    # bullets go to the pairwise judge, sample by sample
    assert lw["lists_sent"] == 2 * len(TURNS) and lw["lists_failed"] == 2 * len(TURNS)
    assert lw["chunks_fallback"] == 2 * len(TURNS) and lw["pairs_fallback"] == 2 * len(pairs) == 36
    assert {p["judge_mode"] for p in pairs} == {"pairwise"} and c["pairs_by_mode"] == {"pairwise": 18}
    assert summary["reconciles"] and c["pairs"] == c["pairs_scored"] + c["pairs_error"] == 18
    assert summary["cost"]["measured"]["llm_calls"] == 2 * len(TURNS) + 36  # no retries: one call per list and pair
    assert summary["judges"] == [f"{summary['judges'][0].split('#')[0]}#s{k}" for k in range(2)]
    long = pq.read_table(tmp_path / "pairs_by_judge.parquet").to_pylist()
    assert len(long) == 36
    for p in pairs:  # a pair is an error only when both samples failed on it
        mine = [r for r in long if (r["bullet_id"], r["turn_id"]) == (p["bullet_id"], p["turn_id"])]
        scored = [r["score"] for r in mine if r["score"] is not None]
        assert p["n_judges"] == len(scored) and (p["error"] is None) == bool(scored)
        if scored:
            assert p["score"] == pytest.approx(np.mean(scored))


def test_hf_likelihood_consensus_of_two_judges_with_agreement_and_resume(ray_local, tiny_llm: str, corpus: Path,
                                                                        tmp_path: Path):
    other = str(build_tiny_llm(tmp_path / "tiny-seed1", seed=1))
    files = []
    for i, model in enumerate((tiny_llm, other)):
        files.append(tmp_path / f"judge{i}.yaml")
        files[-1].write_text(yaml.safe_dump(_hf_llm(model)))
    out = tmp_path / "out"
    cfg = LabelConfig(data=corpus, out=out, judge="likelihood", judge_set=files, progress=False)
    summary = run_label(cfg)
    n_pairs, n_turns = len(BULLETS) * len(TURNS), len(TURNS)
    c, lk = summary["counts"], summary["likelihood"]
    assert summary["reconciles"] and c["pairs"] == c["pairs_scored"] == n_pairs
    assert lk["baselines"] == 2 * n_turns  # one no-memory baseline per target turn, per judge
    assert summary["cost"]["measured"]["llm_calls"] == 2 * (n_pairs + n_turns)
    assert len(summary["judges"]) == 2 and summary["judge"].startswith("consensus:likelihood:hf:")

    long = pq.read_table(out / "pairs_by_judge.parquet").to_pylist()
    assert len(long) == 2 * n_pairs and {r["judge_mode"] for r in long} == {"likelihood"}
    pairs = {(p["bullet_id"], p["turn_id"]): p for p in read_table(out / "pairs.parquet", "pairs").to_pylist()}
    for (bid, tid), p in pairs.items():
        mine = [r["score"] for r in long if (r["bullet_id"], r["turn_id"]) == (bid, tid)]
        assert p["n_judges"] == 2 and p["score"] == pytest.approx(np.mean(mine))
        assert p["spread"] == pytest.approx(np.std(mine)) and p["judge_mode"] == "likelihood"
    labels = read_table(out / "labels.parquet", "labels").to_pylist()
    assert len(labels) == len(BULLETS) and all(r["n_judges"] == 2 for r in labels)
    assert all(r["agreement"] == pytest.approx(1 - 2 * r["spread"]) for r in labels)
    ag = summary["agreement"]
    assert set(ag) == {"pairs", "labels"} and len(ag["pairs"]["spearman"]) == 1
    assert ag["pairs"]["units_all_judges"] == n_pairs and ag["pairs"]["krippendorff_alpha_interval"] is not None

    # the gain of one pair, recomputed with transformers alone, maps to the judge's score
    from memprune.label.likelihood import gain_to_score

    gain = direct_gain(tiny_llm, corpus, "fact one", target_pos=3)
    first = [r for r in long if r["bullet_id"] == "c:s1:b1" and r["turn_id"] == "c:s2:t3"
             and "#j" not in r["judge"] and r["judge"] == summary["judges"][0]]
    assert first and first[0]["score"] == pytest.approx(float(gain_to_score(np.array([gain]))[0]), abs=1e-6)

    # resume: lose the second judge's work (one shard); only it is redone, and the tables are identical
    ref = {n: (out / n).read_bytes() for n in ("pairs.parquet", "labels.parquet", "pairs_by_judge.parquet")}
    (shard,) = Path(summary["work_dirs"][1]).glob("gains-*.parquet")
    shard.unlink()
    again = run_label(cfg)
    assert again["throughput"]["shards_reused"] == 1 and again["throughput"]["pairs_judged_this_run"] == n_pairs
    assert {n: (out / n).read_bytes() for n in ref} == ref


# ---------------------------------------------------------------- the plan against what the engine counts

PLAN_TURNS = ["hi", "my sister adopted a small dog last spring and now we walk it every single morning before work",
              "ok", "we visited Paris last week and the museums were full of tourists from all over the world", "nice",
              "bye then, talk to you soon after the long weekend at the lake with the whole family"]


def _pair_key(prompt: str) -> tuple[str, str]:
    """(bullet, target) of a pairwise prompt, the user message or the whole rendered chat: which pair it judges
    (the system text names the tags too, without a speaker)."""
    target, bullet = re.search(r'<target speaker="[^"]*">(.*?)</target>\s*<bullet>(.*?)</bullet>', prompt, re.S).groups()
    return bullet.strip(), target.strip()


def test_plan_prompt_tokens_are_what_the_engine_reports(ray_local, tiny_llm: str, tmp_path: Path):
    """`label --plan` counts, per pair and in total, the prompt tokens the engine reports for the real run.

    Targets have contexts of very different lengths, so a plan that rendered a pair around another
    target's context (or any other prompt than the one sent) counts other tokens than the engine.
    """
    from typer.testing import CliRunner

    from memprune.cli import app
    from memprune.label.cost import PromptCounter
    from memprune.label.llm_judge import pairwise_prompts
    from memprune.label.pairs import build_pairs, target_groups
    from memprune.llm import load_template

    corpus = two_session_corpus(tmp_path / "corpus", BULLETS[:2], PLAN_TURNS)
    with TinyOpenAIServer(tiny_llm, responder=lambda body: '{"score": 0.5}', idle_timeout=300) as srv:
        usage: dict[tuple[str, str], int] = {}
        complete = srv.complete

        def counted(body: dict) -> tuple[int, dict]:  # what the engine reports, by the pair each request judges
            status, reply = complete(body)
            usage[_pair_key(body["messages"][-1]["content"])] = reply["usage"]["prompt_tokens"]
            return status, reply

        srv.complete = counted
        llm = {**_http_llm(srv), "model": tiny_llm, "max_retries": 0}  # the model dir: the plan uses its tokenizer
        (tmp_path / "llm.yaml").write_text(yaml.safe_dump(llm))
        res = CliRunner().invoke(app, ["label", "--data", str(corpus), "--out", str(tmp_path / "plan"), "--plan",
                                       "--judge", "llm", "--llm-config", str(tmp_path / "llm.yaml")])
        assert res.exit_code == 0, res.output
        cfg = LabelConfig(data=corpus, out=tmp_path / "run", judge="llm", llm_config=tmp_path / "llm.yaml",
                          progress=False)
        summary = run_label(cfg)
    planned = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert "judge model's tokenizer" in planned["tokenizer"]
    pw, measured = planned["modes"]["pairwise"], summary["cost"]["measured"]
    n = len(BULLETS[:2]) * len(PLAN_TURNS)
    assert summary["counts"]["pairs_scored"] == n == len(usage) and measured["llm_calls"] == pw["calls"] == n
    assert measured["prompt_tokens"] == sum(usage.values())  # the run's accounting is the engine's
    # in total and per pair, the plan's prompt tokens are the engine's: exactly, as this tokenizer merges nothing
    # across a line break (the plan's line-split error is 0)
    assert pw["line_split_error"] == 0
    assert pw["prompt_tokens"] == measured["prompt_tokens"]
    assert pw["prompt_tokens_per_pair"] == pytest.approx(measured["prompt_tokens_per_labelled_pair"])
    assert summary["cost"]["planned"]["prompt_tokens"] == pw["prompt_tokens"]  # the run's own plan is the same
    # per pair: the prompt the plan renders for a pair counts what the engine counted for that pair
    plan = build_pairs(*(read_table(corpus / f"{t}.parquet", t) for t in ("sessions", "bullets")), cfg.pair_options(),
                       with_context=True)
    counter = PromptCounter(tiny_llm)
    texts = list(pairwise_prompts(plan, target_groups(plan), counter, load_template("judge_v1", "judge")))
    counted_by_plan = dict(zip(map(_pair_key, texts), counter.count(texts).tolist()))
    assert counted_by_plan.keys() == usage.keys()  # the plan renders every pair the run sends, around its own target
    off = {k: (counted_by_plan[k], usage[k]) for k in usage if counted_by_plan[k] != usage[k]}
    assert not off, off
    assert len(set(usage.values())) > 2  # the targets' prompts do differ in length (the check has teeth)
    assert pw["prompt_tokens"] == sum(counted_by_plan.values())  # the CLI's plan is these prompts


@pytest.mark.slow  # a Ray Data job of 20 s or more
def test_plan_measure_judges_real_msc_pairs_and_plans_from_the_measured_rate(ray_local, tiny_llm: str,
                                                                             msc_small: Path, tmp_path: Path):
    """`label --plan --measure 200` on MSC valid (its first conversations): the chosen judge runs on 200 real pairs here, and the plan's time
    comes from what it measured (two passes: start-up and rate apart), not from an assumed throughput."""
    from typer.testing import CliRunner

    from memprune.cli import app

    (tmp_path / "llm.yaml").write_text(yaml.safe_dump(_hf_llm(tiny_llm, max_retries=0,
                                                              sampling={"max_tokens": {"judge": 6}})))
    res = CliRunner().invoke(app, ["label", "--data", str(msc_small), "--out", str(tmp_path / "plan"), "--plan",
                                   "--measure", "200", "--judge", "llm", "--llm-config", str(tmp_path / "llm.yaml"),
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    m = plan["measured"]
    assert m["judge"] == "pairwise" and 200 <= m["pairs"] < 260  # whole target turns, from the real corpus
    assert plan["pairs"] > 3 * m["pairs"]  # the plan is of the whole corpus, measured on a sample
    assert [p[0] for p in m["passes"]] and sum(p[0] for p in m["passes"]) == m["pairs"]
    assert len(m["passes"]) == 2 and m["passes"][0][0] != m["passes"][1][0]  # two passes of different sizes
    assert m["pairs_per_s"] > 0 and m["prompt_tokens_per_s"] > 0 and 0 <= m["error_rate"] <= 1
    startup = m["startup_s_per_pass"] or 0.0
    expected = (m["planned_passes"] * startup + plan["pairs"] / m["items_per_s"]) / 3600
    assert m["planned_hours"] == pytest.approx(expected, rel=1e-6)
    assert m["planned_passes"] == -(-plan["pairs"] // 4096)  # the run's own shards, each a pass
    assert plan["modes"]["pairwise"]["hours_at_measured"] == m["planned_hours"]
    listwise = plan["modes"]["listwise"]  # other modes: their effective tokens at the measured tokens/s
    assert listwise["hours_at_measured"] == pytest.approx(
        listwise["effective_tokens"] / m["effective_tokens_per_s"] / 3600)
    assert "Measured on this hardware: the pairwise judge" in res.output and "planned from the measured" in res.output
    assert not (tmp_path / "plan" / "pairs.parquet").exists() and not list((tmp_path / "plan").glob(".work*"))
    with pytest.raises(ValueError, match="give it with --plan"):
        LabelConfig(data=msc_small, out=tmp_path / "x", cost={"measure": 5})
