"""`memprune tune`: one search through the CLI over stage 1 (a trial killed) and stage 2 (ASHA stopping a bad trial)
on a tiny corpus, then `jobs/tune.py` reusing the finished trials."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml
from helpers import labels_for, tune_config

from memprune.io import write_table
from memprune.train import TrainConfig
from memprune.tune import TuneConfig
from memprune.tune.config import apply_point
from memprune.tune.stage import _trial_out

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from memprune.synth import generate

    root = tmp_path_factory.mktemp("tune-corpus")
    generate(conversations=12, sessions=3, out=root / "data", seed=3)
    write_table(labels_for(pq.read_table(root / "data" / "bullets.parquet")), root / "labels" / "labels.parquet",
                "labels")
    return root / "data", root / "labels"


def test_tune_config_refuses_bad_spaces(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stage2.optimizer"):
        tune_config(*corpus, tmp_path, stage2_space={"stage2.optimizer": ["sgd"]})
    with pytest.raises(ValueError, match="stage2.lora.r"):
        tune_config(*corpus, tmp_path, stage2_space={"stage2.lora.r": [0, 4]})
    with pytest.raises(ValueError, match="num_workers"):
        tune_config(*corpus, tmp_path, train={"ray": {"num_workers": 0}})
    base = tune_config(*corpus, tmp_path).train
    for value in (["query", "dense"], '["query", "dense"]'):  # as given, and as Tune carries it (JSON)
        assert apply_point(base, {"stage2.lora.target_modules": value}).stage2.lora.target_modules == ["query", "dense"]


def test_a_failed_trial_is_recorded_as_its_cause_in_one_line() -> None:
    """Tune hands back a trial's exception wrapped by Ray: its first line is a coloured header naming no cause."""
    import traceback

    from ray.exceptions import RayTaskError

    from memprune.train.config import TrainError
    from memprune.tune.stage import error_line

    def wrapped(exc: Exception) -> BaseException:
        try:
            raise exc
        except Exception as raised:
            return RayTaskError("ImplicitFunc.train", traceback.format_exc(), raised, proctitle="ray::ImplicitFunc.train()",
                                pid=1, ip="192.0.2.2", actor_repr="run_trial", actor_id="ab12").as_instanceof_cause()

    worker = wrapped(RuntimeError("Training failed due to worker errors:\n[Rank 0 Error Snippet]:\nhealth check failed"))
    assert str(worker).startswith("\x1b[36mray::")  # what the record held before
    assert error_line(worker) == ("RuntimeError: Training failed due to worker errors: [Rank 0 Error Snippet]: "
                                  "health check failed")
    assert error_line(wrapped(TrainError("stage1: worker 0 of 1 got no train sessions"))) == \
        "stage1: worker 0 of 1 got no train sessions"  # a memprune error: its own message
    assert len(error_line(wrapped(ValueError("x" * 1000)))) == 300


def _search_yaml(data: Path, labels: Path, out: Path, marker: Path, tuned: Path) -> str:
    """Both searches: two stage-1 trials, the first to reach its second epoch SIGKILLed there, and its Ray Train
    run may not retry (`ray.max_failures: 0`), so that trial fails as a trial does when a node dies; then three
    stage-2 trials: the base settings, a ranking-loss trial (its own stage 1) and a destructive step size."""
    cfg = tune_config(data, labels, out, tuned_config=tuned,
                  stage1_space={"stage1.lr": {"low": 1e-3, "high": 3e-2, "log": True}}, stage1_trials=2)
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    raw["train"]["stage1"]["epochs"] = 2
    raw["train"]["ray"]["max_failures"] = 0
    raw["train"]["fault"] = {"stage": "stage1", "after_epoch": 1, "marker": str(marker)}
    return yaml.safe_dump(raw)


@pytest.mark.slow
def test_tune_cli_searches_both_stages_records_a_killed_trial_asha_stops_a_bad_one_and_a_job_rerun_reuses(
        corpus: tuple[Path, Path], tmp_path: Path, ray_local: Any) -> None:
    from typer.testing import CliRunner

    from memprune.cli import app

    out, marker, tuned = tmp_path / "tune", tmp_path / "killed.txt", tmp_path / "configs" / "train-tuned.yaml"
    config = tmp_path / "tune.yaml"
    config.write_text(_search_yaml(*corpus, out, marker, tuned))
    res = CliRunner().invoke(app, ["tune", "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert marker.is_file()  # the fault fired: one trial's worker was killed
    written = json.loads((out / "tune.json").read_text())
    s1, s2 = written["stage1_trials"], written["stage2_trials"]

    # stage 1: the killed trial is one clear recorded error, and the search went on
    assert len(s1) == 2 and len({r["settings"]["stage1.lr"] for r in s1}) == 2
    failed = [r for r in s1 if r["status"] == "error"]
    done = [r for r in s1 if r["status"] == "completed"]
    assert len(failed) == 1 and len(done) == 1, [(r["status"], r["error"]) for r in s1]
    err = failed[0]["error"]  # the cause, in one line: not Ray's coloured wrapper header
    assert re.search(r"\b\w+(Error|Exception): \S", err) and "\n" not in err and "\x1b" not in err and "ray::" not in err
    assert done[0]["metric"] is not None and not done[0]["reused"] and done[0]["history"]  # its epochs reached Tune
    assert written["stage1_chosen"]["metric"] is not None  # the failed trial's last epoch reported too: never chosen

    # stage 2 from the chosen stage 1: ASHA cut a trial at its first rung
    assert len(s2) == 3 and all(r["cost_s"] > 0 for r in s2)
    stopped = [r for r in s2 if r["status"] == "stopped early"]
    assert stopped, [(r["settings"], r["status"], r["history"]) for r in s2]
    assert all(r["epochs_run"] < 2 for r in stopped) and written["stopped_early"] == len(stopped)
    completed = [r for r in s2 if r["status"] == "completed"]
    assert completed and all(len(r["history"]) == r["epochs_run"] for r in completed)  # each epoch reached Tune
    best = written["best_stage2"]
    assert best["metric"] == max(r["metric"] for r in completed)
    # trials with the chosen stage 1's loss start from its one artifact; the ranking-loss trial trained its own
    # stage 1 (the loss is shared by both stages, as in `memprune train`)
    for r in s2:
        start = _trial_out(out / "trials", "stage2", r["settings"]) / "stage1" / "seed0"
        assert start.is_symlink() == (r["settings"]["loss.rank_weight"] == 0.0), r["settings"]
        assert (start / "train.json").is_file() or r["status"] == "stopped early"
    # the best settings are a ready train config, also written where asked
    assert tuned.read_text() == (out / "train-tuned.yaml").read_text()
    cfg = TrainConfig.model_validate(yaml.safe_load(tuned.read_text()))
    assert cfg.stage2.lr == best["settings"]["stage2.lr"] and cfg.loss.rank_weight == best["settings"]["loss.rank_weight"]
    assert cfg.stage1.lr == pytest.approx(done[0]["settings"]["stage1.lr"]) and cfg.stage2.lora.r == 2
    md = (out / "tune.md").read_text()
    assert "stopped early (ASHA)" in md and "## Stage 2" in md and "| error |" in md
    assert (out / "tune.png").stat().st_size > 1000

    # the stage-1 search again through the Ray job's entrypoint (`jobs/tune.py` calls exactly this; in this process,
    # on the session's Ray): the finished trial is read back, not retrained; the failed one runs again, and (the
    # fault fired once) finishes now
    from memprune.runtime import run_job
    from memprune.tune import run

    assert "run_job(\"tune\", TuneConfig, run)" in (REPO / "jobs" / "tune.py").read_text()  # what the job runs
    assert run_job("tune", TuneConfig, run, argv=[str(config), "stage2_trials=0"]) == 0
    again = json.loads((out / "tune.json").read_text())
    by_lr = {r["settings"]["stage1.lr"]: r for r in again["stage1_trials"]}
    assert set(by_lr) == {r["settings"]["stage1.lr"] for r in s1}  # the same seeded samples
    reused = by_lr[done[0]["settings"]["stage1.lr"]]
    assert reused["status"] == "completed" and reused["reused"] and reused["metric"] == done[0]["metric"]
    assert reused["cost_s"] == pytest.approx(done[0]["train_s"], abs=1e-3)  # what its first run cost, not the lookup
    retried = by_lr[failed[0]["settings"]["stage1.lr"]]
    assert retried["status"] == "completed" and not retried["reused"] and retried["error"] is None


def test_the_searched_stages_come_from_the_stage_registry():
    from memprune.train.stages import STAGE_SPECS, trained_chain
    from memprune.tune.config import TuneSettings

    first, second = trained_chain()
    assert first.init_from is None and second.init_from == first.name and first.trained and second.trained
    assert [s.name for s in STAGE_SPECS.values() if s.baseline] == ["vanilla"]
    t = TuneSettings()
    assert t.space(first.name) == t.stage1_space and t.trials(second.name) == t.stage2_trials
