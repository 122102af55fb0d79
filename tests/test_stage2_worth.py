"""The evaluation's 'is stage 2 worth it' table: every ranking metric's difference, p-values, seconds, the verdict."""

from __future__ import annotations

import json
import shutil

from test_evaluate import synthetic_run

from memprune.evaluate import evaluate_run


def _seconds(run, stage, per_seed):
    for seed, wall in per_seed.items():
        (run / stage / f"seed{seed}" / "train.json").write_text(json.dumps({"wall_s": wall}))


def test_stage2_is_recommended_only_when_it_clearly_beats_stage1(tmp_path):
    run = tmp_path / "run"
    synthetic_run(run)  # stage 2: labels + N(0, 0.1); stage 1: labels + N(0, 0.3)
    _seconds(run, "stage1", {0: 10.0, 1: 12.0, 2: 14.0})
    _seconds(run, "stage2", {0: 300.0, 1: 330.0, 2: 360.0})
    (run / "run.json").write_text(json.dumps({"labels": ["/runs/msc-labels-sim"]}))
    result = evaluate_run(run, tmp_path / "out", figures=False)
    worth = result["stage2_vs_stage1"]
    assert worth["recommend"] == "stage2" and worth["gain"] >= 0.02 and worth["p"] < 0.05
    names = [r["metric"] for r in worth["rows"]]
    assert names[0] == "spearman" and "ndcg@5" in names and "recall@1" in names
    sig = result["splits"]["test"]["significance"]["stage2_vs_stage1"]["ranking"]
    assert all(r["diff"] == sig[r["metric"]]["diff"] for r in worth["rows"])
    assert worth["seconds"]["stage2"]["mean"] == 330.0 and worth["seconds"]["stage1"]["per_seed"]["2"] == 14.0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "### Is stage 2 worth it?" in report and "| training s per seed (mean; seeds) | 12.0 (10.0, 12.0, 14.0)" in report
    assert "Recommended for /runs/msc-labels-sim: stage 2." in report
    # a stricter bar turns the same numbers into a stage-1 recommendation
    strict = evaluate_run(run, tmp_path / "out3", figures=False, stage2_min_gain=1.0)["stage2_vs_stage1"]
    assert strict["recommend"] == "stage1" and strict["gain"] == worth["gain"]

    # stage 2 no better than stage 1 (the same predictions): stage 1 is recommended, by the rule
    for seed in (0, 1, 2):
        shutil.copy(run / "stage1" / f"seed{seed}" / "predictions.parquet",
                    run / "stage2" / f"seed{seed}" / "predictions.parquet")
    again = evaluate_run(run, tmp_path / "out2", figures=False)["stage2_vs_stage1"]
    assert again["recommend"] == "stage1" and again["gain"] == 0.0
    assert "Recommended for /runs/msc-labels-sim: stage 1." in (tmp_path / "out2" / "report.md").read_text()


def test_the_verdicts_stages_are_stage_specs_start_chain():
    from memprune import stages
    from memprune.evaluate.significance import STARTS
    from memprune.evaluate.worth import KEY, STAGE, START
    from memprune.train.stages import STAGE_SPECS, trained_chain

    # the verdict: the last trained stage against the one it starts from, as STAGE_SPECS trains them
    assert trained_chain()[-1].name == STAGE and STAGE_SPECS[STAGE].init_from == START and KEY == f"{STAGE}_vs_{START}"
    assert all(STAGE_SPECS[s].init_from == start for s, start in STARTS)
    assert STARTS == tuple((s.name, s.init_from) for s in STAGE_SPECS.values() if s.init_from)
    # one set of facts: STAGE_SPECS takes them from memprune/stages.py, in its order
    assert list(STAGE_SPECS) == list(stages.stage_names())
    assert all(spec.facts is stages.get(name) for name, spec in STAGE_SPECS.items())
    assert [s.name for s in STAGE_SPECS.values() if s.baseline] == [stages.baseline().name]
