"""Training defects and the test gaps around them: calibration on one validation conversation (k-fold), which
rows calibration is fitted and cross-fitted on, stage 1 in Ray Train's local mode by default, a failure as one
line, and a failed or killed `train` over an earlier run's outputs."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from memprune.calibration import Calibration, fit_calibration, read_calibration, write_calibration
from memprune.cli import app
from memprune.io import MARKER, check_committed, write_table
from memprune.train.calibrate import calibrate_predictions
from memprune.train.config import CalibrationSettings, TrainConfig, TrainSettings
from memprune.train.stages import STAGE_SPECS

REPO = Path(__file__).resolve().parents[1]
squeeze = lambda text: "".join(text.split())  # noqa: E731 - rich wraps long lines


def _predictions(splits: dict[str, tuple[list[str], np.ndarray, np.ndarray]]) -> pa.Table:
    """A predictions table (the columns calibration reads) from split -> (conversation ids, scores, labels)."""
    cols: dict[str, list[Any]] = {"split": [], "conversation_id": [], "score": [], "label": []}
    for split, (convs, scores, labels) in splits.items():
        cols["split"] += [split] * len(convs)
        cols["conversation_id"] += list(convs)
        cols["score"] += [float(s) for s in scores]
        cols["label"] += [float(y) for y in labels]
    return pa.table(cols)


def _rows(n_convs: int, per_conv: int, rng: np.random.Generator, prefix: str, rising: bool = True
          ) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Rows of `n_convs` conversations with distinct scores; labels follow the score (or its reverse), noisily."""
    n = n_convs * per_conv
    convs = [f"{prefix}{i // per_conv}" for i in range(n)]
    scores = rng.permutation(np.linspace(0.05, 0.95, n))
    p = scores if rising else 1.0 - scores
    return convs, scores, (rng.uniform(size=n) < p).astype(float)


# ----------------------------------------------------------------- defect: one validation conversation


def test_one_validation_conversation_skips_calibration_with_the_reason(tmp_path: Path) -> None:
    """A k-fold run with split.valid=1 validates on one conversation: cross-fitting by conversation has no
    training fold. Before, numpy raised on the empty fold; now the record says why and no map is kept."""
    rng = np.random.default_rng(0)
    convs, scores, labels = _rows(4, 20, rng, "x")
    write_calibration(tmp_path, fit_calibration(scores, labels, groups=convs))  # earlier weights' map: must go
    pred = _predictions({"valid": _rows(1, 60, rng, "v"), "test": _rows(2, 30, rng, "t")})
    record = calibrate_predictions(CalibrationSettings(min_rows=10), tmp_path, pred)
    assert set(record) == {"skipped"}
    assert "1 conversation" in record["skipped"] and "split.valid" in record["skipped"]
    assert read_calibration(tmp_path) is None


# ----------------------------------------------------------------- gaps: which rows calibration sees


def test_calibration_is_fitted_on_the_validation_rows_only(tmp_path: Path) -> None:
    """The test rows follow the reverse score -> label relation and outnumber the validation rows: the stored
    map is exactly the fit on the validation rows, and it rises with the score."""
    rng = np.random.default_rng(1)
    valid, test = _rows(6, 20, rng, "v"), _rows(5, 40, rng, "t", rising=False)
    cfg = CalibrationSettings(min_rows=10)
    record = calibrate_predictions(cfg, tmp_path, _predictions({"test": test, "valid": valid}))
    cal = read_calibration(tmp_path)
    expected = fit_calibration(valid[1], valid[2], cfg.relevance_threshold, groups=valid[0], methods=cfg.methods,
                               cv_folds=cfg.cv_folds, bins=cfg.bins, min_rows=cfg.min_rows, select=cfg.select)
    assert record["n_valid"] == cal.validation["n"] == len(valid[0])
    assert cal == Calibration.from_json(json.loads(json.dumps(expected.to_json())), "expected")
    low, high = cal.apply([0.1, 0.9])
    assert high > low + 0.3


def test_cross_fitting_keeps_each_conversation_in_one_fold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every map fitted while choosing the method is trained on whole conversations (and so predicts whole
    held-out ones): a conversation's bullets are never split between a training and a held-out fold."""
    import memprune.calibration as C

    fitted: list[np.ndarray] = []
    for method, fit in list(C._FIT.items()):
        monkeypatch.setitem(C._FIT, method, lambda s, y, fit=fit: (fitted.append(np.array(s)), fit(s, y))[1])
    rng = np.random.default_rng(2)
    convs, scores, labels = _rows(8, 15, rng, "v")
    labels[::15], labels[1::15] = 0.0, 1.0  # both classes in every conversation: every fold is fitted
    record = calibrate_predictions(CalibrationSettings(min_rows=10, cv_folds=4), tmp_path,
                                   _predictions({"valid": (convs, scores, labels)}))
    assert "method" in record
    conv_of = dict(zip(scores.tolist(), convs))
    size = {c: convs.count(c) for c in set(convs)}
    cross = [s for s in fitted if len(s) < len(convs)]  # the last fit, on every row, is the kept map
    assert len(cross) == 4 * len(C.METHODS) and len(fitted) == len(cross) + 1
    for train in cross:
        inside = {conv_of[v] for v in train.tolist()}
        assert sum(size[c] for c in inside) == len(train), sorted(inside)  # only whole conversations
        assert 0 < len(inside) < len(size)


# ----------------------------------------------------------------- gap: stage 1 in local mode


def test_stage1_defaults_to_ray_train_local_mode() -> None:
    """`ray.stage1_workers` is 0 by default and stage 1 sizes its runs by it (stage 2 by `ray.num_workers`)."""
    cfg = TrainSettings()
    assert cfg.ray.stage1_workers == 0 and STAGE_SPECS["stage1"].workers(cfg) == 0
    assert STAGE_SPECS["stage2"].workers(cfg) == cfg.ray.num_workers == 1
    assert STAGE_SPECS["stage1"].workers(TrainSettings(ray={"stage1_workers": 2, "num_workers": 0})) == 2


# ----------------------------------------------------------------- a failure is one line


def test_train_cli_reports_an_unexpected_failure_as_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug inside training is one `error:` line, exit 1, its traceback in a log file; never a rich traceback."""
    import memprune.train

    def broken(cfg: TrainConfig) -> dict[str, Any]:
        raise ValueError("zero-size array to reduction operation minimum which has no identity")

    monkeypatch.setattr(memprune.train, "run", broken)
    monkeypatch.setenv("MEMPRUNE_LOG_DIR", str(tmp_path / "logs"))
    res = CliRunner().invoke(app, ["train", "--data", str(tmp_path / "d"), "--labels", str(tmp_path / "l"),
                                   "--out", str(tmp_path / "o"), "--no-eval"])
    assert res.exit_code == 1 and not isinstance(res.exception, ValueError), res.output
    assert "Traceback" not in res.output and squeeze(res.output).startswith("error:trainfailed:ValueError:zero-size")
    logs = list((tmp_path / "logs").glob("train-error-*.log"))
    assert len(logs) == 1 and "ValueError: zero-size" in logs[0].read_text()
    assert squeeze(str(logs[0])) in squeeze(res.output)


# ----------------------------------------------------------------- slow: real training runs


def _labels_for(bullets: pa.Table, seed: int = 0) -> pa.Table:
    """Judge-like labels: recurring facts high, one-off remarks low, plus noise; the last session unlabelled."""
    rng = np.random.default_rng(seed)
    recurs = np.asarray(bullets.column("recurs").to_pylist(), dtype=float)
    last = np.asarray(bullets.column("session_index").to_pylist()) == max(bullets.column("session_index").to_pylist())
    y = np.clip(0.15 + 0.6 * recurs + rng.normal(0, 0.1, len(recurs)), 0, 1)
    ids = bullets.column("bullet_id").filter(pa.array(~last))
    return pa.table({"bullet_id": ids, "label": pa.array(y[~last]), "n_pairs": pa.array(np.ones(len(ids), np.int32)),
                     "aggregation": pa.array(["max"] * len(ids))})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from memprune.synth import generate

    root = tmp_path_factory.mktemp("defects-corpus")
    generate(conversations=8, sessions=3, out=root / "data", seed=5)
    write_table(_labels_for(pq.read_table(root / "data" / "bullets.parquet")), root / "labels" / "labels.parquet",
                "labels")
    return root / "data", root / "labels"


def _train_config(data: Path, labels: Path, out: Path, **extra: Any) -> TrainConfig:
    """A small run; `ray` left at its defaults unless given (stage 1 then runs in local mode)."""
    base: dict[str, Any] = {"data": data, "labels": labels, "out": out, "seeds": [0], "max_length": 24,
                            "split": {"valid": 3, "test": 2}, "head": {"hidden": 16},
                            "stage1": {"epochs": 2, "lr": 3e-3, "batch_size": 32, "patience": 2},
                            "embed": {"batch_size": 64, "actors": 1}, "calibration": {"min_rows": 10}}
    return TrainConfig.model_validate({**base, **extra})


@pytest.mark.slow
def test_stage1_trains_in_this_process_by_default_and_calibrates_on_validation(
        ray_local: Any, corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the default `ray` settings stage 1's training loop runs in this very process (Ray Train's local
    mode), and its calibration.json is the fit on the validation rows of its predictions, not the test rows."""
    from memprune.train import run_training, trainer

    pids: list[int] = []
    real = trainer.train_loop_per_worker

    def loop(config: dict[str, Any]) -> None:
        pids.append(os.getpid())  # in a Ray Train worker this appends to the worker's copy, not to ours
        real(config)

    monkeypatch.setattr(trainer, "train_loop_per_worker", loop)
    cfg = _train_config(*corpus, tmp_path / "out", stages=["stage1"])
    assert cfg.ray.model_fields_set == set()  # nothing set: the defaults decide
    run_training(cfg)
    assert pids == [os.getpid()]
    art = tmp_path / "out" / "stage1" / "seed0"
    train = json.loads((art / "train.json").read_text())
    assert train["ray"]["local_mode"] and train["ray"]["num_workers"] == 0

    pred = pq.read_table(art / "predictions.parquet").to_pandas()
    c = cfg.calibration
    fits = {split: fit_calibration(rows["score"].to_numpy(), rows["label"].to_numpy(), c.relevance_threshold,
                                   groups=rows["conversation_id"].to_numpy().astype(str), methods=c.methods,
                                   cv_folds=c.cv_folds, bins=c.bins, min_rows=c.min_rows, select=c.select)
            for split, rows in pred.groupby("split")}
    stored = read_calibration(art)
    as_stored = {s: Calibration.from_json(json.loads(json.dumps(f.to_json())), s) for s, f in fits.items()}
    assert stored == as_stored["valid"] and stored != as_stored["test"]
    assert train["calibration"]["n_valid"] == int((pred["split"] == "valid").sum())


def _locomo3(fixtures_dir: Path, path: Path) -> Path:
    """The LoCoMo fixture with a third conversation (a copy of the first under another id): 3 folds of 1."""
    items = json.loads((fixtures_dir / "locomo_mini.json").read_text())
    extra = copy.deepcopy(items[0])
    extra["sample_id"] = "mini-3"
    path.write_text(json.dumps([*items, extra]))
    return path


@pytest.mark.slow
def test_kfold_train_on_one_validation_conversation_records_the_skipped_calibration(
        ray_local: Any, fixtures_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`label --source qa`, then `train --folds 3 --set split.valid=1`: each fold validates on one conversation,
    so calibration cannot be cross-fitted. Before, the run died in a traceback (an empty training fold)."""
    from memprune.ingest import ingest

    monkeypatch.setenv("MEMPRUNE_LOG_DIR", str(tmp_path / "logs"))
    data, labels, out = tmp_path / "L", tmp_path / "Q", tmp_path / "R"
    ingest("locomo", _locomo3(fixtures_dir, tmp_path / "locomo3.json"), data)
    runner = CliRunner()
    res = runner.invoke(app, ["label", "--data", str(data), "--out", str(labels), "--source", "qa"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["train", "--data", str(data), "--labels", str(labels), "--out", str(out), "--folds", "3",
                              "--stages", "vanilla,stage1", "--seeds", "0", "--set", "split.valid=1",
                              "--set", "calibration.min_rows=2", "--set", "max_length=16", "--set", "head.hidden=8",
                              "--set", "stage1={epochs: 1, lr: 0.003, batch_size: 32, patience: 1}", "--no-eval"])
    assert res.exit_code == 0, res.output
    run = json.loads((out / "run.json").read_text())
    stage1 = [r for r in run["runs"] if r["stage"] == "stage1"]
    assert sorted(r["fold"] for r in stage1) == [0, 1, 2]
    for r in stage1:
        reason = r["calibration"]["skipped"]
        assert set(r["calibration"]) == {"skipped"} and "1 conversation" in reason, reason
        art = out / f"fold{r['fold']}" / "stage1" / "seed0"
        assert json.loads((art / "train.json").read_text())["calibration"] == r["calibration"]
        assert read_calibration(art) is None and (art / "predictions.parquet").is_file()
    assert "none: " in (out / "fold0" / "train.md").read_text()


# ----------------------------------------------------------------- slow: failed / killed train over a run


def _snapshot(out: Path) -> dict[str, bytes]:
    """The bytes of a train run's committed outputs and of its (stage, seed) artifact files."""
    names = ["run.json", "train.md", "rejects.jsonl", "splits.parquet", MARKER]
    files = [out / n for n in names] + sorted(p for p in (out / "vanilla").rglob("*") if p.is_file())
    return {str(p.relative_to(out)): p.read_bytes() for p in files}


def _assert_intact(out: Path, before: dict[str, bytes]) -> None:
    """The earlier run's outputs are unchanged and pass the readers' commit check."""
    assert _snapshot(out) == before
    assert json.loads((out / MARKER).read_text())["state"] == "done"
    for name in ("run.json", "splits.parquet", "rejects.jsonl"):
        check_committed(out / name)
    convs = json.loads((out / "run.json").read_text())["split"]["conversations"]
    assert pq.read_table(out / "splits.parquet").num_rows == sum(convs[s] for s in ("train", "valid", "test"))


def _staging(out: Path) -> list[Path]:
    return list(out.glob(".staging.tmp-*"))


@pytest.mark.slow
def test_failed_or_killed_train_keeps_the_earlier_run_and_a_rerun_completes(
        ray_address: str, corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run A completes. Run B (other labels, split and seed) over the same --out fails inside training, then
    is SIGKILLed after preparing its tables: A's run.json, train.md, rejects, splits and artifacts stay byte
    for byte and readable. Rerun, B completes and leaves no staging directory behind."""
    from memprune.train import recipe, run_training

    data, labels = corpus
    table = pq.read_table(labels / "labels.parquet")
    bad = table.slice(0, 1).set_column(1, "label", pa.array([1.5]))
    write_table(pa.concat_tables([table.slice(1), bad]), tmp_path / "labels-a" / "labels.parquet", "labels")
    out = tmp_path / "out"
    run_training(_train_config(data, tmp_path / "labels-a", out, stages=["vanilla"]))  # A: one rejected label
    before = _snapshot(out)
    assert json.loads((out / "run.json").read_text())["rejects"]["rejected"]["label"] == 1

    b = {"labels": labels, "split": {"valid": 3, "test": 2, "seed": 1}, "seeds": [1], "stages": ["vanilla"]}

    def broken(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        raise RuntimeError("injected failure inside training")

    with monkeypatch.context() as m:
        m.setattr(recipe, "run_stage", broken)
        with pytest.raises(RuntimeError, match="injected"):
            run_training(_train_config(data, out=out, **b))
    _assert_intact(out, before)
    assert not _staging(out)

    args = [sys.executable, "-m", "memprune.cli", "train", "--data", str(data), "--labels", str(labels), "--out",
            str(out), "--stages", "vanilla", "--seeds", "1", "--no-eval", "--set", "max_length=24",
            "--set", "split={valid: 3, test: 2, seed: 1}", "--set", "head.hidden=16", "--set", "embed.actors=1"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MEMPRUNE_LOG_DIR": str(tmp_path / "logs"),
           "RAY_ADDRESS": ray_address}  # it joins the session's Ray, which ends the killed driver's workers
    with open(tmp_path / "killed.log", "wb") as log:
        proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=log, stderr=log, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and proc.poll() is None:  # kill once its tables are prepared
                if b"embedding " in (tmp_path / "killed.log").read_bytes() or any(
                        (s / "splits.parquet").exists() for s in _staging(out)):
                    break
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and whatever it started
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    assert _staging(out)  # killed midway: its uncommitted tables are still there ...
    _assert_intact(out, before)  # ... and the earlier run is untouched

    res = CliRunner().invoke(app, args[3:])
    assert res.exit_code == 0, res.output
    assert not _staging(out)  # the killed run's staging directory was cleaned up
    run = json.loads((out / "run.json").read_text())
    assert run["seeds"] == [1] and run["split"]["seed"] == 1 and run["rejects"]["rejected"].get("label", 0) == 0
    assert json.loads((out / MARKER).read_text())["state"] == "done"
    check_committed(out / "splits.parquet")
    assert {k: v for k, v in _snapshot(out).items() if k.startswith("vanilla/seed0")} == \
        {k: v for k, v in before.items() if k.startswith("vanilla/seed0")}  # A's artifact: not B's to touch
