"""`memprune evaluate` end to end on synthetic runs, the pruning view and the QA retention by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from memprune.evaluate import (
    EvalSettings,
    EvaluationError,
    discover_run,
    evaluate_run,
    expected_random_share,
    paired_seed_test,
    wilcoxon_sessions,
)
from memprune.evaluate import metrics as M
from memprune.io import write_table
from memprune.schema import BULLETS, QA, SESSIONS, SchemaError


def write_predictions(run: Path, stage: str, seed: int, df: pd.DataFrame) -> None:
    """One predictions.parquet in the layout the training stage writes."""
    path = run / stage / f"seed{seed}"
    path.mkdir(parents=True, exist_ok=True)
    df.assign(stage=stage, seed=seed).to_parquet(path / "predictions.parquet", index=False)


def synthetic_run(run: Path, seeds=(0, 1, 2), n_conv: int = 12) -> pd.DataFrame:
    """Vanilla = random scores; Stage 1 / Stage 2 = labels plus less and less noise."""
    rng = np.random.default_rng(0)
    rows = []
    for c in range(n_conv):
        for s in range(3):
            for b in range(int(rng.integers(1, 8))):
                rows.append({"bullet_id": f"c{c}:s{s}:b{b}", "conversation_id": f"c{c}", "session_index": s,
                             "split": "test" if c < 9 else "validation", "label": float(rng.beta(0.7, 1.5))})
    base = pd.DataFrame(rows)
    for i, (stage, noise) in enumerate((("stage2", 0.1), ("vanilla", None), ("stage1", 0.3))):  # any order
        for seed in seeds:
            r = np.random.default_rng(100 * seed + i)
            score = r.random(len(base)) if noise is None else np.clip(base["label"] + r.normal(0, noise, len(base)), 0, 1)
            write_predictions(run, stage, seed, base.assign(score=score))
    return base


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    base = synthetic_run(root / "run")
    result = evaluate_run(root / "run", root / "out", splits=("test", "validation"))
    return root, base, result


def test_outputs_and_strict_json(evaluated):
    root, _, result = evaluated
    out = root / "out"
    for name in ("metrics.json", "report.md", "session_metrics.parquet", "rejects.jsonl",
                 "ranking_vs_k.png", "reduction_vs_threshold.png", "score_histogram.png", "calibration.png"):
        assert (out / name).is_file(), name
    text = (out / "metrics.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert (out / "ranking_vs_k.png").read_bytes()[:4] == b"\x89PNG"
    assert result["splits"]["test"]["stages"] == ["vanilla", "stage1", "stage2"]
    assert set(result["splits"]) == {"test", "valid"}


def test_per_seed_numbers_match_a_direct_computation(evaluated):
    root, _, result = evaluated
    df = pd.read_parquet(root / "run" / "stage1" / "seed1" / "predictions.parquet")
    test = df[df["split"] == "test"]
    got = result["splits"]["test"]["per_seed"]["stage1"]["1"]
    assert got["regression"]["mse"] == pytest.approx(M.mse(test["label"], test["score"]))
    assert got["regression"]["spearman"] == pytest.approx(M.spearman(test["label"], test["score"]))
    groups = test["conversation_id"] + "#" + test["session_index"].astype(str)
    frame = M.per_session_metrics(test["label"].to_numpy(), test["score"].to_numpy(), groups.to_numpy())
    assert got["ranking"]["ndcg@3"]["mean"] == pytest.approx(frame["ndcg@3"].mean())
    assert got["ranking"]["hit@1"]["n_sessions"] == int(frame["hit@1"].notna().sum())
    agg = result["splits"]["test"]["aggregate"]["stage1"]["regression"]["mse"]
    vals = [result["splits"]["test"]["per_seed"]["stage1"][s]["regression"]["mse"] for s in ("0", "1", "2")]
    assert agg["mean"] == pytest.approx(np.mean(vals)) and agg["std"] == pytest.approx(np.std(vals, ddof=1))


def test_significance_and_report(evaluated):
    root, _, result = evaluated
    sig = result["splits"]["test"]["significance"]
    assert set(sig) == {"stage1_vs_vanilla", "stage2_vs_vanilla", "stage2_vs_stage1"}
    spear = sig["stage2_vs_vanilla"]["ranking"]["spearman"]
    assert spear["diff"] > 0.4 and spear["wilcoxon"]["p"] < 0.001 and spear["seed_ttest"]["n_seeds"] == 3
    assert sig["stage1_vs_vanilla"]["regression"]["pearson"]["wilcoxon"] is None  # global only: seed test
    assert sig["stage1_vs_vanilla"]["regression"]["pearson"]["seed_ttest"]["p"] < 0.05
    report = (root / "out" / "report.md").read_text()
    for needle in ("| Metric | Vanilla (n=3) | Stage 1 (n=3) | Stage 2 (n=3) |", "### Significance",
                   "p Wilcoxon (sessions)", "the paper’s Table 4", "### Sensitivity", "## Validation split",
                   "![ranking vs k](ranking_vs_k.png)", "Sessions used per ranking metric"):
        assert needle in report, needle
    row = next(line for line in report.splitlines() if line.startswith("| Spearman (session) |"))
    assert "***" in row.split("|")[-2]  # Stage 2 against Vanilla is marked


def test_pruning_grid_is_complete(evaluated):
    _, _, result = evaluated
    pr = result["splits"]["test"]["aggregate"]["stage2"]["pruning"]
    for name in ("t0.5_k1", "t0.5_k3", "t0.5_k5", "t0.5_kall", "t0.1_k5", "t0.9_kall"):
        assert name in pr
    reductions = [pr[f"t{t:g}_k5"]["bullet_reduction_pct"]["mean"] for t in EvalSettings().thresholds]
    assert reductions == sorted(reductions)  # a higher threshold never keeps more


# ---------------------------------------------------------------- hand-checked pruning and QA retention


def tiny_corpus(data: Path) -> None:
    """Two sessions: A (c0, s1) with bullets of 3, 2, 1 words; B (c0, s2) with 4 and 1; two QA items."""
    turns = lambda s, n: [{"turn_id": f"c0:s{s}:t{i}", "speaker": "u", "text": "x"} for i in range(n)]
    sessions = pa.Table.from_pylist(
        [{"conversation_id": "c0", "session_index": 1, "speakers": ["u"], "turns": turns(1, 3), "time": None},
         {"conversation_id": "c0", "session_index": 2, "speakers": ["u"], "turns": turns(2, 2), "time": None}],
        schema=SESSIONS,
    )
    write_table(sessions, data / "sessions.parquet", "sessions")
    bullets = [("c0:s1:b0", 1, "a b c", ["c0:s1:t0"]), ("c0:s1:b1", 1, "a b", ["c0:s1:t2"]),
               ("c0:s1:b2", 1, "a", ["c0:s1:t1"]), ("c0:s2:b0", 2, "x y z w", ["c0:s2:t0"]),
               ("c0:s2:b1", 2, "x", ["c0:s2:t1"])]
    write_table(pa.Table.from_pylist(
        [{"bullet_id": b, "conversation_id": "c0", "session_index": s, "speaker": "u", "text": t, "evidence": e}
         for b, s, t, e in bullets], schema=BULLETS), data / "bullets.parquet", "bullets")
    write_table(pa.Table.from_pylist(
        [{"qa_id": "c0:q0", "conversation_id": "c0", "question": "?", "answer": "!", "evidence": ["c0:s1:t2"],
          "category": 1},
         {"qa_id": "c0:q1", "conversation_id": "c0", "question": "?", "answer": None, "evidence": ["c0:s2:t0"],
          "category": 2}], schema=QA), data / "qa.parquet", "qa")


def tiny_predictions() -> pd.DataFrame:
    return pd.DataFrame({
        "bullet_id": ["c0:s1:b0", "c0:s1:b1", "c0:s1:b2", "c0:s2:b0", "c0:s2:b1"],
        "conversation_id": "c0", "session_index": [1, 1, 1, 2, 2], "split": "test",
        "label": [1.0, 0.0, 0.5, 0.0, 1.0], "score": [0.9, 0.6, 0.2, 0.4, 0.8],
    })


def test_pruning_view_and_qa_retention_by_hand(tmp_path):
    tiny_corpus(tmp_path / "data")
    pred = tiny_predictions()
    write_predictions(tmp_path / "run", "stage1", 0, pred)
    write_predictions(tmp_path / "run", "vanilla", 0, pred.assign(score=[0.5, 0.5, 0.5, 0.5, 0.5]))
    result = evaluate_run(tmp_path / "run", tmp_path / "out", data_dir=tmp_path / "data", tokenizer="whitespace",
                          qa_draws=400, figures=False)
    split = result["splits"]["test"]
    assert result["tokenizer"] == "whitespace words"
    p = split["per_seed"]["stage1"]["0"]["pruning"]
    # threshold 0.5, top-1: A keeps b0 (3 words), B keeps b1 (1 word)
    k1 = p["t0.5_k1"]
    assert (k1["bullets_before"], k1["bullets_after"], k1["bullet_reduction_pct"]) == pytest.approx((2.5, 1.0, 60.0))
    assert (k1["tokens_before"], k1["tokens_after"]) == pytest.approx((5.5, 2.0))
    assert k1["token_reduction_pct"] == pytest.approx(100 * (1 - 4 / 11))
    assert k1["relevant_kept_pct"] == pytest.approx(200 / 3)  # relevant: A b0, A b2, B b1
    assert k1["label_mass_kept_pct"] == pytest.approx(80.0)
    assert k1["sessions_emptied_pct"] == 0.0
    # cited (an evidence turn is QA evidence): A b1 and B b0
    q1 = k1["qa"]
    assert q1["n_cited"] == 2 and q1["model_pct"] == 0.0
    assert q1["random_expected_pct"] == pytest.approx(100 * (1 / 3 + 1 / 2) / 2)
    assert q1["random_mean_pct"] == pytest.approx(q1["random_expected_pct"], abs=5.0)
    assert q1["recency_pct"] == pytest.approx(50.0)  # A keeps b1 (latest turn t2), B keeps b1 (t1)
    qall = p["t0.5_kall"]["qa"]  # A keeps b0, b1; B keeps b1
    assert p["t0.5_kall"]["bullet_reduction_pct"] == pytest.approx(40.0)
    assert qall["model_pct"] == pytest.approx(50.0)
    assert qall["random_expected_pct"] == pytest.approx(100 * (2 / 3 + 1 / 2) / 2)
    assert qall["recency_pct"] == pytest.approx(50.0)  # A: b1 and b2 most recent; B: b1
    # the heuristics keep as many per session: longest A b0 b1, B b0; first in session (evidence t0, t1) A b0 b2, B b0;
    # newest A b1 b2, B b1; most digits (none: position order) A b0 b1, B b0
    assert (qall["longest_pct"], qall["first_in_session_pct"], qall["newest_pct"], qall["most_digits_pct"]) == \
        pytest.approx((100.0, 50.0, 50.0, 100.0))
    assert (qall["best_heuristic_pct"], qall["lift_over_best_heuristic_pp"]) == pytest.approx((100.0, -50.0))
    assert split["qa"]["n_cited_bullets"] == 2 and split["qa"]["n_qa"] == 2
    # vanilla ties everywhere: top-1 keeps the first bullet of each session (position order)
    assert split["per_seed"]["vanilla"]["0"]["pruning"]["t0.5_k1"]["qa"]["model_pct"] == pytest.approx(50.0)
    # one seed per stage: no std, no seed test, but a session test
    sig = split["significance"]["stage1_vs_vanilla"]["ranking"]["spearman"]
    assert sig["seed_ttest"]["p"] is None and sig["seed_ttest"]["note"] == "needs >= 2 common seeds"
    assert split["aggregate"]["stage1"]["regression"]["mse"]["std"] is None
    report = (tmp_path / "out" / "report.md").read_text()
    assert "### QA-evidence retention (external check)" in report
    assert "tokens/session before" in report


def test_a_budget_or_fraction_rule_is_evaluated_by_the_prune_decision(tmp_path):
    """The evaluation decides with `apply_policy`, as `memprune prune` does, so any policy gets its table."""
    tiny_corpus(tmp_path / "data")
    write_predictions(tmp_path / "run", "stage1", 0, tiny_predictions())
    common = dict(data_dir=tmp_path / "data", tokenizer="whitespace", qa_draws=50, figures=False)
    # budget 3 words per session: A keeps b0 (3 words; b1 would make 5), B keeps b1 (1 word; then b0's 4 > 3)
    result = evaluate_run(tmp_path / "run", tmp_path / "budget", rule={"budget_tokens": 3}, **common)
    p = result["splits"]["test"]["per_seed"]["stage1"]["0"]["pruning"]
    assert list(p) == ["budget3"] and p["budget3"]["setting"]["policy"] == "budget"
    assert (p["budget3"]["bullets_after"], p["budget3"]["tokens_after"]) == pytest.approx((1.0, 2.0))
    report = (tmp_path / "budget" / "report.md").read_text()
    assert "### Pruning: budget 3 tokens" in report and "| Stage 1 | budget 3 tokens |" in report
    # fraction 0.5: ceil(1.5) = 2 of A, ceil(1) = 1 of B
    result = evaluate_run(tmp_path / "run", tmp_path / "fraction", rule={"fraction": 0.5}, **common)
    assert result["splits"]["test"]["per_seed"]["stage1"]["0"]["pruning"]["fraction0.5"]["bullets_after"] == 1.5
    # a budget needs token counts: without the corpus it is one clear error
    with pytest.raises(EvaluationError, match="needs token counts"):
        evaluate_run(tmp_path / "run", tmp_path / "nodata", rule={"budget_tokens": 3}, figures=False)


def test_random_share_formula():
    codes = np.array([0, 0, 0, 1, 1])
    cited = np.array([False, True, False, True, False])
    assert expected_random_share(codes, cited, np.array([1, 1])) == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert math.isnan(expected_random_share(codes, np.zeros(5, bool), np.array([1, 1])))


# ---------------------------------------------------------------- bad input


def test_bad_rows_are_rejected_with_reasons(tmp_path):
    pred = tiny_predictions()
    bad = pd.concat([pred, pd.DataFrame({
        "bullet_id": ["c0:s1:b0", "c0:s1:b9", "c0:s1:b8"], "conversation_id": "c0", "session_index": 1,
        "split": "test", "label": [0.5, 1.5, 0.2], "score": [0.1, 0.5, float("nan")]})], ignore_index=True)
    write_predictions(tmp_path / "run", "stage1", 0, bad)
    result = evaluate_run(tmp_path / "run", tmp_path / "out", figures=False)
    assert result["predictions"]["rejected"] == {"prediction": 3}
    assert result["predictions"]["conservation"] == "ok"
    rejects = [json.loads(l) for l in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert sorted(r["reason"] for r in rejects) == ["duplicate (split, bullet_id)", "label outside [0, 1]",
                                                    "score is null or not finite"]
    assert all(r["source"].endswith("predictions.parquet") for r in rejects)
    assert result["splits"]["test"]["n_bullets"] == 5
    # no baseline stage: no comparison, said so in the report
    assert result["splits"]["test"]["significance"] == {}
    assert "no baseline stage" in (tmp_path / "out" / "report.md").read_text()


def test_missing_column_names_file_and_column(tmp_path):
    write_predictions(tmp_path / "run", "stage1", 0, tiny_predictions().drop(columns="score"))
    with pytest.raises(SchemaError, match=r"stage1/seed0/predictions.parquet.*'score'"):
        evaluate_run(tmp_path / "run", tmp_path / "out")


def test_missing_run_and_empty_test_split(tmp_path):
    with pytest.raises(EvaluationError, match="run directory not found"):
        discover_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvaluationError, match="no <stage>/seed<k>/predictions.parquet"):
        discover_run(tmp_path / "empty")
    write_predictions(tmp_path / "run", "stage1", 0, tiny_predictions().assign(split="validation"))
    with pytest.raises(EvaluationError, match="no usable rows with split == 'test'"):
        evaluate_run(tmp_path / "run", tmp_path / "out")


def test_wrong_data_dir_is_an_error(tmp_path):
    tiny_corpus(tmp_path / "data")
    write_predictions(tmp_path / "run", "stage1", 0, tiny_predictions().assign(bullet_id=lambda d: "z" + d["bullet_id"]))
    with pytest.raises(EvaluationError, match="wrong --data"):
        evaluate_run(tmp_path / "run", tmp_path / "out", data_dir=tmp_path / "data", tokenizer="whitespace")


def test_valid_split_alias_and_notes(tmp_path):
    tiny_corpus(tmp_path / "data")
    pred = tiny_predictions()
    extra = pred.assign(bullet_id=pred["bullet_id"] + "x", split="valid")  # the train stage writes "valid"
    extra.loc[0, "bullet_id"] = "c0:s1:b0"  # same id in another split is fine
    write_predictions(tmp_path / "run", "stage1", 0, pd.concat([pred, extra], ignore_index=True))
    result = evaluate_run(tmp_path / "run", tmp_path / "out", data_dir=tmp_path / "data", tokenizer="whitespace",
                          splits=("test", "validation"), figures=False)
    assert result["splits"]["valid"]["n_bullets"] == 5
    assert "not in the corpus bullets.parquet" in " ".join(result["splits"]["valid"]["notes"])
    assert result["splits"]["valid"]["per_seed"]["stage1"]["0"]["n_bullets_without_text"] == 4
    write_predictions(tmp_path / "run2", "stage1", 0, pred)
    result = evaluate_run(tmp_path / "run2", tmp_path / "out2", splits=("test", "validation"), figures=False)
    assert result["notes"] == ["no prediction rows with split 'valid': split skipped"]
    assert "split skipped" in (tmp_path / "out2" / "report.md").read_text()


# ---------------------------------------------------------------- helpers


@pytest.mark.parametrize("diff", [
    [1.0, 1.0, -2.0, 0.0, 3.0, 3.0],                                      # ties and a zero
    [0.5, -0.5, 0.5, 1.5, 2.5, -2.5, 0.0, 0.0, 4.0],                      # tied |d| of both signs, zeros
    [0.1, 0.2, -0.3, 0.4, 0.5, 0.6, -0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 0.0],   # n = 13, one zero
    [2.0, 2.0, 2.0, 2.0],                                                 # every |d| tied
])
def test_small_samples_with_ties_or_zeros_get_scipys_exact_permutation_p(diff):
    """For n <= 13 with ties or zeros scipy runs a permutation test over every sign flip, one Python call per flip;
    memprune counts the same flips at once and must give scipy's p exactly."""
    from scipy import stats

    d = np.array(diff)
    ref = stats.wilcoxon(d, zero_method="wilcox", alternative="two-sided")
    got = wilcoxon_sessions(pd.Series(d), pd.Series(np.zeros(len(d))))
    assert got["p"] == ref.pvalue and got["statistic"] == ref.statistic



def test_significance_helpers_edge_cases():
    a = pd.Series([0.1, 0.2, 0.3], index=["x", "y", "z"])
    assert wilcoxon_sessions(a, a)["p"] == 1.0
    assert wilcoxon_sessions(a, a.rename(index={"x": "q", "y": "r", "z": "s"}))["n_sessions"] == 0
    w = wilcoxon_sessions(pd.Series(np.arange(20.0) + 1), pd.Series(np.zeros(20)))
    assert w["p"] < 0.001 and w["n_sessions"] == 20
    assert math.isnan(paired_seed_test({0: 0.5}, {0: 0.4})["p"])
    assert paired_seed_test({0: 0.5, 1: 0.6}, {0: 0.5, 1: 0.6})["p"] == 1.0
    assert math.isnan(paired_seed_test({0: 0.5, 1: 0.6}, {0: 0.4, 1: 0.5})["p"])  # constant non-zero difference
    t = paired_seed_test({0: 0.5, 1: 0.7, 2: 0.6}, {0: 0.1, 1: 0.2, 2: 0.25, 7: 0.0})
    assert t["n_seeds"] == 3 and 0 < t["p"] < 0.05


def test_cli_evaluate(tmp_path):
    from typer.testing import CliRunner

    from memprune.cli import app

    write_predictions(tmp_path / "run", "vanilla", 0, tiny_predictions())
    runner = CliRunner()
    ok = runner.invoke(app, ["evaluate", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
                             "--no-figures", "--top-k", "0"])
    assert ok.exit_code == 0, ok.output
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["config"]["rule"]["top_k"] is None
    bad = runner.invoke(app, ["evaluate", "--run", str(tmp_path / "missing"), "--out", str(tmp_path / "o2")])
    assert bad.exit_code == 2 and "run directory" in bad.output and "not found" in bad.output


# ---------------------------------------------------------------- LoCoMo through the real adapter


def test_locomo_fixture_qa_retention(tmp_path, fixtures_dir):
    pytest.importorskip("memprune.adapters.locomo")
    from memprune.ingest import ingest

    ingest("locomo", fixtures_dir / "locomo_mini.json", tmp_path / "data")
    bullets = pd.read_parquet(tmp_path / "data" / "bullets.parquet")
    qa = pd.read_parquet(tmp_path / "data" / "qa.parquet")
    cited_turns = {t for ev in qa["evidence"] for t in ev}
    n_cited = sum(bool(cited_turns & set(ev)) for ev in bullets["evidence"])
    rng = np.random.default_rng(3)
    pred = bullets[["bullet_id", "conversation_id", "session_index"]].assign(
        split="test", label=rng.random(len(bullets)))
    for seed in (0, 1):
        write_predictions(tmp_path / "run", "vanilla", seed, pred.assign(score=rng.random(len(pred))))
        write_predictions(tmp_path / "run", "stage1", seed, pred.assign(score=pred["label"]))
    result = evaluate_run(tmp_path / "run", tmp_path / "out", data_dir=tmp_path / "data", qa_draws=200,
                          figures=False)
    split = result["splits"]["test"]
    assert split["qa"]["n_cited_bullets"] == n_cited > 0
    assert split["qa"]["recency_source"] == "turn order in sessions.parquet"
    assert "MiniLM" in result["tokenizer"]
    q = split["aggregate"]["stage1"]["pruning"]["t0.5_kall"]["qa"]
    assert 0 <= q["model_pct"]["mean"] <= 100 and 0 <= q["random_mean_pct"]["mean"] <= 100
    assert "### QA-evidence retention (external check)" in (tmp_path / "out" / "report.md").read_text()


def test_relevance_calibration_raw_vs_calibrated(tmp_path):
    """A calibration.json beside a stage's predictions is applied to its test rows: ECE/Brier of both, the diagram."""
    from memprune.calibration import Calibration, brier, ece, relevance, write_calibration

    rng = np.random.default_rng(5)
    n = 600
    base = pd.DataFrame({"bullet_id": [f"c{i // 20}:s{(i // 5) % 4}:b{i % 5}" for i in range(n)],
                         "conversation_id": [f"c{i // 20}" for i in range(n)],
                         "session_index": [(i // 5) % 4 for i in range(n)], "split": "test"})
    z = rng.normal(0, 1, n)
    base["label"] = (rng.uniform(size=n) < 1 / (1 + np.exp(-(2 * z - 0.5)))).astype(float)
    raw = 1 / (1 + np.exp(-(0.2 * z - 0.3)))  # squeezed around 0.43: badly calibrated as a probability
    for seed in (0, 1):
        write_predictions(tmp_path / "run", "vanilla", seed, base.assign(score=rng.random(n)))
        write_predictions(tmp_path / "run", "stage1", seed, base.assign(score=raw))
        # the exact inverse map: a = 2 / 0.2, b = -0.5 + 0.3 * 10
        write_calibration(tmp_path / "run" / "stage1" / f"seed{seed}", Calibration("platt", 0.5, {"a": 10.0, "b": 2.5}))
    result = evaluate_run(tmp_path / "run", tmp_path / "out")
    rc = result["splits"]["test"]["relevance_calibration"]
    s1, v = rc["stages"]["stage1"], rc["stages"]["vanilla"]
    y = relevance(base["label"].to_numpy(), 0.5)
    p = Calibration("platt", 0.5, {"a": 10.0, "b": 2.5}).apply(raw)
    assert s1["per_seed"]["0"]["raw"] == pytest.approx({"brier": brier(raw, y), "ece": ece(raw, y)})
    assert s1["per_seed"]["0"]["calibrated"] == pytest.approx({"brier": brier(p, y), "ece": ece(p, y)})
    assert s1["calibrated"]["ece"]["mean"] < 0.06 < 0.15 < s1["raw"]["ece"]["mean"]
    assert s1["calibrated_seeds"] == 2 and s1["methods"] == ["platt"] and sum(b["n"] for b in s1["reliability_calibrated"]) == 2 * n
    assert v["calibrated_seeds"] == 0 and "calibrated" not in v and "reliability_calibrated" not in v
    report = (tmp_path / "out" / "report.md").read_text()
    assert "### Probability calibration (raw vs calibrated)" in report and "![reliability](reliability.png)" in report
    assert (tmp_path / "out" / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "run" / "stage1" / "seed1" / "calibration.json").write_text("{")
    with pytest.raises(EvaluationError, match=r"seed1/calibration.json: not readable JSON"):
        evaluate_run(tmp_path / "run", tmp_path / "out2")
