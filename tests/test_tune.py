"""`memprune tune`: Ray Tune over stage 1 and stage 2 on a tiny corpus, ASHA stopping a bad stage-2 trial."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml
from test_train import _labels_for

from memprune.io import write_table
from memprune.train import TrainConfig
from memprune.tune import TuneConfig, run_tune
from memprune.tune.config import apply_point
from memprune.tune.stage import _trial_out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from memprune.synth import generate

    root = tmp_path_factory.mktemp("tune-corpus")
    generate(conversations=12, sessions=3, out=root / "data", seed=3)
    write_table(_labels_for(pq.read_table(root / "data" / "bullets.parquet")), root / "labels" / "labels.parquet",
                "labels")
    return root / "data", root / "labels"


def _config(data: Path, labels: Path, out: Path, **extra: Any) -> TuneConfig:
    train = {
        "max_length": 24, "split": {"valid": 3, "test": 2}, "head": {"hidden": 16},
        "stage1": {"epochs": 3, "lr": 3e-3, "batch_size": 32, "patience": 3},
        "stage2": {"epochs": 2, "lr": 3e-3, "batch_size": 32, "patience": 2,
                   "lora": {"r": 2, "alpha": 4, "dropout": 0.0}},
        "embed": {"batch_size": 64, "actors": 1}, "ray": {"num_workers": 1, "use_gpu": False},
    }
    base: dict[str, Any] = {
        "data": data, "labels": labels, "out": out, "train": train, "max_concurrent": 1,
        "stage1_space": {"stage1.lr": [3e-3, 1e-2]}, "stage1_trials": 1,
        "stage2_space": {"stage2.lr": [3e-3], "loss.rank_weight": [0.0, 0.5],
                         "stage2.lora.target_modules": [["query", "value"]]}, "stage2_trials": 3,
        # the base settings, then a ranking-loss trial (its own stage 1), then a destructive step size
        "points": [{"loss.rank_weight": 0.5}, {"stage2.lr": 3.0}],
        "scheduler": {"grace_period": 1, "reduction_factor": 2},
    }
    base.update(extra)
    return TuneConfig.model_validate(base)


def test_tune_searches_both_stages_and_stops_a_bad_trial(corpus: tuple[Path, Path], tmp_path: Path,
                                                         ray_local: Any) -> None:
    out = tmp_path / "tune"
    tuned = tmp_path / "configs" / "train-tuned.yaml"
    summary = run_tune(_config(*corpus, out, tuned_config=tuned))
    written = json.loads((out / "tune.json").read_text())
    assert written["stage2_gain_valid"] == summary["stage2_gain_valid"]
    s1, s2 = written["stage1_trials"], written["stage2_trials"]
    # stage 1: the base settings (a one-trial search here, to keep the test short)
    assert len(s1) == 1 and s1[0]["status"] == "completed" and s1[0]["metric"] is not None
    assert s1[0]["settings"]["stage1.lr"] == 3e-3 and s1[0]["history"]  # its epochs reached Tune too
    assert len(s2) == 3 and all(r["cost_s"] > 0 for r in s2)
    stopped = [r for r in s2 if r["status"] == "stopped early"]
    assert stopped, [(r["settings"], r["status"], r["history"]) for r in s2]  # ASHA cut a trial at its first rung
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
    assert cfg.stage1.lr == 3e-3 and cfg.stage2.lora.r == 2
    md = (out / "tune.md").read_text()
    assert "stopped early (ASHA)" in md and "## Stage 2" in md
    assert (out / "tune.png").stat().st_size > 1000


def test_tune_config_refuses_bad_spaces(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stage2.optimizer"):
        _config(*corpus, tmp_path, stage2_space={"stage2.optimizer": ["sgd"]})
    with pytest.raises(ValueError, match="stage2.lora.r"):
        _config(*corpus, tmp_path, stage2_space={"stage2.lora.r": [0, 4]})
    with pytest.raises(ValueError, match="num_workers"):
        _config(*corpus, tmp_path, train={"ray": {"num_workers": 0}})
    base = _config(*corpus, tmp_path).train
    for value in (["query", "dense"], '["query", "dense"]'):  # as given, and as Tune carries it (JSON)
        assert apply_point(base, {"stage2.lora.target_modules": value}).stage2.lora.target_modules == ["query", "dense"]
