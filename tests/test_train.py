"""Scorer training: splits, losses, checkpoints; local mode and the real Ray Train path with a killed worker."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import labels_for

from memprune.io import write_table
from memprune.rejects import Ledger
from memprune.scorer import Scorer
from memprune.train import (
    PREDICTIONS,
    LossConfig,
    TrainConfig,
    batch_loss,
    listwise_kl,
    optimizer_state,
    optimizer_tensors,
    prepare_data,
    run_training,
    session_batches,
)
from memprune.train.splits import SplitConfig, SplitError, split_conversations, split_counts

# ----------------------------------------------------------------- pure pieces


def test_split_is_by_conversation_deterministic_and_order_free() -> None:
    ids = [f"c{i}" for i in range(50)]
    cfg = SplitConfig(valid=0.1, test=0.2, seed=7)
    a = split_conversations(ids, cfg)
    assert a == split_conversations(list(reversed(ids)) + ids, cfg)  # order and repeats do not matter
    assert sorted(a) == sorted(ids)
    counts = {s: sum(v == s for v in a.values()) for s in ("train", "valid", "test")}
    assert counts == {"train": 35, "valid": 5, "test": 10}
    assert split_conversations(ids, cfg.model_copy(update={"seed": 8})) != a
    counted = split_counts(50, SplitConfig(train=20, valid=5, test=5))
    assert counted == {"train": 20, "valid": 5, "test": 5, "unused": 20}
    with pytest.raises(SplitError, match="the corpus has 10"):
        split_counts(10, SplitConfig(valid=6, test=6))
    with pytest.raises(ValueError, match="outside"):
        SplitConfig(valid=1.5)


def test_session_batches_keep_sessions_whole() -> None:
    groups = np.array(["a"] * 5 + ["b"] * 2 + ["c"] * 9 + ["d"] * 1, dtype=object)
    for rng in (None, np.random.default_rng(0)):
        batches = session_batches(groups, 4, rng)
        assert sorted(np.concatenate(batches).tolist()) == list(range(len(groups)))
        for b in batches:
            for g in set(groups[b]):
                assert (groups[b] == g).sum() == (groups == g).sum()  # never cut a session
    one = [b.tolist() for b in session_batches(groups, 4, np.random.default_rng(1))]
    assert one == [b.tolist() for b in session_batches(groups, 4, np.random.default_rng(1))]


def test_listwise_term() -> None:
    labels = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.3])
    groups = torch.tensor([0, 0, 0, 1, 1])  # group 1 has constant labels: skipped
    matched = labels / 0.1
    kl, used = listwise_kl(matched, labels, groups, 0.1)
    assert used == 1 and float(kl) == pytest.approx(0.0, abs=1e-6)
    kl_rev, _ = listwise_kl(-matched, labels, groups, 0.1)
    assert float(kl_rev) > 1.0
    plain, parts = batch_loss(matched, labels, groups, LossConfig())
    ranked, _ = batch_loss(-matched, labels, groups, LossConfig(rank_weight=0.5))
    assert parts["groups"] == 0 and float(ranked) > float(plain)


def test_optimizer_state_roundtrips_through_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    tensors, meta = optimizer_tensors(opt)
    save_file(tensors, str(tmp_path / "o.safetensors"))
    (tmp_path / "o.json").write_text(json.dumps(meta))
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh.load_state_dict(optimizer_state(load_file(str(tmp_path / "o.safetensors")), json.loads((tmp_path / "o.json").read_text())))
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(fresh.state_dict()["state"][0][k], v)


# ----------------------------------------------------------------- data


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from memprune.synth import generate

    root = tmp_path_factory.mktemp("train-corpus")
    generate(conversations=14, sessions=3, out=root / "data", seed=3)
    labels = labels_for(pq.read_table(root / "data" / "bullets.parquet"))
    write_table(labels, root / "labels" / "labels.parquet", "labels")
    return root / "data", root / "labels"


def _config(data: Path, labels: Path, out: Path, **extra: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "data": data,
        "labels": labels,
        "out": out,
        "seeds": [0],
        "max_length": 24,
        "split": {"valid": 3, "test": 3},
        "head": {"hidden": 32},
        "stage1": {"epochs": 3, "lr": 3e-3, "batch_size": 32, "patience": 3},
        "stage2": {"epochs": 1, "lr": 1e-3, "batch_size": 32, "patience": 1, "lora": {"r": 2, "alpha": 4}},
        "embed": {"batch_size": 64, "actors": 1},
        "ray": {"num_workers": 0},
        "calibration": {"min_rows": 10},  # the tiny validation split still gets a calibration.json
    }
    for key, value in extra.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return TrainConfig.model_validate(base)


def test_prepare_data_rejects_bad_labels_and_counts_unlabelled(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    data, labels_dir = corpus
    labels = pq.read_table(labels_dir / "labels.parquet")
    n_good = labels.num_rows
    bad = pa.table(
        {
            "bullet_id": ["nope:s0:b0", labels.column("bullet_id")[0].as_py() + "x", "nan-id"],
            "label": [0.5, 1.5, float("nan")],
            "n_pairs": pa.array([1, 1, 1], pa.int32()),
            "aggregation": ["max"] * 3,
        }
    )
    # the NaN row must name a real bullet to be rejected for its value, not its id
    real_unlabelled = set(pq.read_table(data / "bullets.parquet").column("bullet_id").to_pylist()) - set(
        labels.column("bullet_id").to_pylist()
    )
    some = sorted(real_unlabelled)[:2]
    bad = bad.set_column(0, "bullet_id", pa.array(["nope:s0:b0", some[0], some[1]]))
    write_table(pa.concat_tables([labels, bad]), tmp_path / "labels.parquet", "labels")
    cfg = _config(data, tmp_path, tmp_path / "out")
    ledger = Ledger()
    table, counts = prepare_data(cfg, ledger)
    assert table.num_rows == n_good and counts["labels_rejected"] == 3
    assert ledger.rejected["label"] == 3 and not ledger.imbalance()
    assert set(ledger.reasons) == {
        "label for a bullet_id that is not in bullets.parquet",
        "label outside [0, 1]",
        "label is not a finite number",
    }
    assert counts["unlabeled_bullets"] == counts["bullets"] - n_good
    by_split = {}
    for conv, split in zip(table.column("conversation_id").to_pylist(), table.column("split").to_pylist()):
        by_split.setdefault(conv, set()).add(split)
    assert all(len(s) == 1 for s in by_split.values())  # never a conversation in two splits
    assert counts["conversations"]["valid"] == 3 and counts["conversations"]["test"] == 3


# ----------------------------------------------------------------- local mode (in-process TorchTrainer)


@pytest.fixture(scope="module")
def local_run(corpus: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory, ray_local: Any) -> Path:
    out = tmp_path_factory.mktemp("local-run") / "out"
    run_training(_config(*corpus, out))
    return out


@pytest.mark.slow
def test_local_mode_writes_every_artifact(local_run: Path, corpus: tuple[Path, Path]) -> None:
    run = json.loads((local_run / "run.json").read_text())
    assert run["stages"] == ["vanilla", "stage1", "stage2"] and run["seeds"] == [0]
    assert run["split"]["conversations"]["valid"] == 3 and run["split"]["unlabeled_bullets"] > 0
    assert (local_run / "train.md").read_text().startswith("# memprune train")
    for stage in ("vanilla", "stage1", "stage2"):
        d = local_run / stage / "seed0"
        pred = pq.read_table(d / "predictions.parquet")
        assert pred.schema.equals(PREDICTIONS)
        assert set(pred.column("split").to_pylist()) == {"valid", "test"}  # never the train split
        assert set(pred.column("stage").to_pylist()) == {stage}
        scores = pred.column("score").to_numpy()
        assert ((scores >= 0) & (scores <= 1)).all()
        train = json.loads((d / "train.json").read_text())
        assert train["stage"] == stage and train["n_unlabeled"] == run["split"]["unlabeled_bullets"]
        if stage != "vanilla":
            assert train["best_epoch"] is not None and len(train["train_loss"]) == train["epochs_run"] >= 1
            assert train["best_val_loss"] == min(train["val_loss"])
    adapter = local_run / "stage2" / "seed0" / "adapter" / "adapter_model.safetensors"
    assert adapter.exists() and not (local_run / "stage1" / "seed0" / "adapter").exists()
    s1, v = (json.loads((local_run / s / "seed0" / "train.json").read_text()) for s in ("stage1", "vanilla"))
    assert s1["val_mse"] < v["val_mse"]  # training on the labels beats the untrained head


@pytest.mark.slow
def test_trained_stages_write_calibration_and_scorer_loads_it(local_run: Path, corpus: tuple[Path, Path]) -> None:
    from memprune.calibration import METHODS, read_calibration
    from memprune.scorer import ScorerError
    from memprune.train.calibrate import ensure_calibration
    from memprune.train.config import CalibrationSettings

    run = json.loads((local_run / "run.json").read_text())
    bullets = pq.read_table(corpus[0] / "bullets.parquet").to_pandas().set_index("bullet_id")
    for stage in ("stage1", "stage2"):
        d = local_run / stage / "seed0"
        cal = read_calibration(d)
        assert cal is not None and cal.method in METHODS and cal.relevance_threshold == 0.5
        record = json.loads((d / "train.json").read_text())["calibration"]
        assert record["method"] == cal.method and record["n_valid"] == cal.validation["n"] >= 10
        assert set(record["valid_raw"]) == set(record["valid_calibrated"]) == {"brier", "ece"}
        assert next(r for r in run["runs"] if r["stage"] == stage)["calibration"] == record
        pred = pq.read_table(d / "predictions.parquet").slice(0, 8)
        texts = [bullets.loc[b, "text"] for b in pred.column("bullet_id").to_pylist()]
        scorer = Scorer.load(d)
        assert scorer.calibration is not None and scorer.calibration.method == cal.method
        raw = scorer.score(texts)
        np.testing.assert_allclose(scorer.score(texts, calibrated=True), cal.apply(raw))
        # a reused run whose calibration.json went missing is calibrated again from its predictions
        (d / "calibration.json").unlink()
        assert ensure_calibration(CalibrationSettings(min_rows=10), d) == record
        assert read_calibration(d) == cal
    assert "## Calibration (validation split)" in (local_run / "train.md").read_text()
    vanilla = local_run / "vanilla" / "seed0"
    assert read_calibration(vanilla) is None and "calibration" not in json.loads((vanilla / "train.json").read_text())
    with pytest.raises(ScorerError, match="has no calibration.json"):
        Scorer.load(vanilla).score(["a bullet"], calibrated=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["vanilla", "stage1", "stage2"])
def test_scorer_load_reproduces_predictions(local_run: Path, corpus: tuple[Path, Path], stage: str) -> None:
    pred = pq.read_table(local_run / stage / "seed0" / "predictions.parquet").slice(0, 12)
    bullets = pq.read_table(corpus[0] / "bullets.parquet").to_pandas().set_index("bullet_id")
    texts = [bullets.loc[b, "text"] for b in pred.column("bullet_id").to_pylist()]
    scores = Scorer.load(local_run / stage / "seed0").score(texts, batch_size=5)
    # the trainer predicts on CUDA where it exists, this loads on the CPU: equal up to float noise there
    atol = 1e-3 if torch.cuda.is_available() else 1e-5
    assert np.allclose(scores, pred.column("score").to_numpy(), atol=atol)


@pytest.mark.slow
def test_fixed_seed_is_deterministic_and_reruns_are_reused(
    local_run: Path, corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    other = tmp_path / "again"
    run_training(_config(*corpus, other))
    for stage in ("vanilla", "stage1", "stage2"):
        a = pq.read_table(local_run / stage / "seed0" / "predictions.parquet")
        b = pq.read_table(other / stage / "seed0" / "predictions.parquet")
        assert a.equals(b), stage
        ta, tb = (json.loads((d / stage / "seed0" / "train.json").read_text()) for d in (local_run, other))
        assert ta["val_loss"] == tb["val_loss"] and ta["train_loss"] == tb["train_loss"]
    summary = run_training(_config(*corpus, other))  # same inputs and settings: nothing retrains
    assert all(r["reused"] for r in summary["runs"])
    assert summary["embeddings"]["reused"]


# ----------------------------------------------------------------- the real Ray Train path


@pytest.mark.slow
def test_ray_train_runs_every_stage1_seed_in_one_run_and_resumes_after_a_kill(
    local_run: Path, corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "ray"
    shutil.copytree(local_run / "cache", out / "cache")  # same embeddings: skip the encoder pass
    marker = tmp_path / "killed"
    cfg = _config(
        *corpus,
        out,
        stages=["stage1"],
        seeds=[1, 0],  # seed 0 trains after seed 1 in the same process, and is killed there
        # on the CPU like the in-process reference run, so the losses can be compared exactly on a CUDA host too
        ray={"stage1_workers": 1, "num_to_keep": 1, "max_failures": 1, "use_gpu": False},
        fault={"stage": "stage1", "seed": 0, "after_epoch": 1, "marker": str(marker)},
    )
    summary = run_training(cfg)
    assert "stage1 seed 0 epoch 2" in marker.read_text()
    killed = json.loads((out / "stage1" / "seed0" / "train.json").read_text())
    other = json.loads((out / "stage1" / "seed1" / "train.json").read_text())
    assert killed["ray"]["run_name"] == other["ray"]["run_name"] and killed["ray"]["seeds_in_run"] == [1, 0]
    assert killed["attempt_start_epochs"] == [0, 1]  # the retry resumed after epoch 1, not from zero
    assert other["attempt_start_epochs"] == [0]  # finished before the kill: restored, not retrained
    assert [e["epoch"] for e in killed["epochs"]] == [1, 2, 3] and killed["ray"]["num_workers"] == 1
    assert summary["embeddings"]["reused"]
    # a seed trained after another, killed and resumed, repeats exactly what it does alone in-process
    reference = json.loads((local_run / "stage1" / "seed0" / "train.json").read_text())
    assert killed["val_loss"] == reference["val_loss"] and killed["train_loss"] == reference["train_loss"]
    a = pq.read_table(out / "stage1" / "seed0" / "predictions.parquet").column("score")
    b = pq.read_table(local_run / "stage1" / "seed0" / "predictions.parquet").column("score")
    assert a.equals(b)
    # each checkpoint holds every seed: only the latest is kept
    run_dir = Path(killed["ray"]["storage"]) / killed["ray"]["run_name"]
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_00006"]
    for name, t in (("seed0", killed), ("seed1", other)):
        assert t["timing"]["epochs_s"] > 0 and t["timing"]["setup_s"] >= 0, name

    # seed 1 alone gives the same result as seed 1 trained before seed 0
    alone = tmp_path / "alone"
    shutil.copytree(local_run / "cache", alone / "cache")
    run_training(_config(*corpus, alone, stages=["stage1"], seeds=[1]))
    assert json.loads((alone / "stage1" / "seed1" / "train.json").read_text())["val_loss"] == other["val_loss"]
    a = pq.read_table(alone / "stage1" / "seed1" / "predictions.parquet").column("score")
    assert a.equals(pq.read_table(out / "stage1" / "seed1" / "predictions.parquet").column("score"))


@pytest.fixture()
def stage_registry():
    """The stage registries, restored after the test (a toy stage never leaks into another test)."""
    from memprune import stages
    from memprune.train.stages import STAGE_SPECS

    held, specs = dict(stages.BY_NAME), dict(STAGE_SPECS)
    yield
    stages.BY_NAME.clear()
    stages.BY_NAME.update(held)
    stages.STAGES = tuple(held.values())
    STAGE_SPECS.clear()
    STAGE_SPECS.update(specs)


@pytest.mark.slow
def test_a_toy_stage_trains_resumes_and_is_evaluated_against_its_start(stage_registry, local_run: Path,
                                                                      corpus: tuple[Path, Path], tmp_path: Path) -> None:
    """A scorer stage is its facts and its spec, registered at run time (here `refit`: the stage-1 head of the same
    seed trained again with stage 1's optimiser section); `memprune train` trains it after the stages it starts
    from (reusing their finished runs) and `memprune evaluate` compares it with the baseline and with its start."""
    from safetensors.torch import load
    from typer.testing import CliRunner

    from memprune import stages
    from memprune.cli import app
    from memprune.train.stages import HeadModel, StageSpec, _predict_on_embeddings, register_spec

    class RefitHead(HeadModel):
        def __init__(self, scorer, seed, embedding_dim, init_head, precision, device) -> None:
            super().__init__(scorer, seed, embedding_dim, init_head, precision, device)
            self.module.load_state_dict(load(init_head))

    register_spec(StageSpec(stages.StageFacts("refit", "Refit", init_from="stage1"), RefitHead, "embedding",
                            ("stage1",), _predict_on_embeddings, workers_key="stage1_workers", section="stage1"))
    out = tmp_path / "run"
    shutil.copytree(local_run, out)
    run = run_training(_config(*corpus, out, stages=["vanilla", "stage1", "refit"]))
    by_stage = {r["stage"]: r for r in run["runs"]}
    assert list(by_stage) == ["vanilla", "stage1", "refit"] and by_stage["stage1"]["reused"]
    assert not by_stage["refit"]["reused"] and by_stage["refit"]["best_epoch"] is not None
    assert pq.read_table(out / "refit" / "seed0" / "predictions.parquet").column("stage").to_pylist()[0] == "refit"
    result = CliRunner().invoke(app, ["evaluate", "--run", str(out), "--out", str(tmp_path / "eval")])
    assert result.exit_code == 0, result.output
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "Refit against Stage 1" in report, report


@pytest.mark.slow
def test_cli_train_and_its_errors(local_run: Path, corpus: tuple[Path, Path], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from memprune.cli import app

    data, labels = corpus
    out = tmp_path / "cli"
    shutil.copytree(local_run / "cache", out / "cache")
    args = ["train", "--data", str(data), "--labels", str(labels), "--out", str(out), "--stages", "vanilla",
            "--seeds", "4", "--set", "max_length=24", "--set", "split.valid=3", "--set", "split.test=3",
            "--set", "head.hidden=32"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "run.json").read_text())["embeddings"]["reused"]
    assert pq.read_table(out / "vanilla" / "seed4" / "predictions.parquet").num_rows > 0
    missing = CliRunner().invoke(app, args[:4] + [str(tmp_path / "nowhere")] + args[5:])
    squeeze = lambda text: "".join(text.split())  # noqa: E731 - rich wraps long lines
    assert missing.exit_code == 2 and "nowhere/labels.parquet:nosuchfile" in squeeze(missing.output)
    bad = CliRunner().invoke(app, args + ["--set", "stage1.lr=-1"])
    assert bad.exit_code == 2 and "stage1.lr:" in squeeze(bad.output)


@pytest.mark.slow
def test_stage2_learns_under_real_ray_train_workers(local_run: Path, corpus: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    """Stage 2 changes its LoRA adapters (peft initialises lora_B to zero) and lowers the validation loss over
    its epochs on a learnable corpus, run by a real Ray Train worker (not local mode)."""
    from safetensors.torch import load_file

    out = tmp_path / "s2"
    shutil.copytree(local_run / "cache", out / "cache")
    cfg = _config(*corpus, out, stages=["stage1", "stage2"], ray={"num_workers": 1},
                  stage1={"epochs": 1, "lr": 1e-3, "patience": 1},
                  stage2={"epochs": 3, "lr": 3e-3, "patience": 3, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}})
    run_training(cfg)
    train = json.loads((out / "stage2" / "seed0" / "train.json").read_text())
    assert train["ray"]["num_workers"] == 1 and not train["ray"]["local_mode"]
    losses = train["val_loss"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    stage1 = json.loads((out / "stage1" / "seed0" / "train.json").read_text())
    assert train["best_val_loss"] < stage1["best_val_loss"]  # better than the head it started from
    adapter = load_file(str(out / "stage2" / "seed0" / "adapter" / "adapter_model.safetensors"))
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(float(v.abs().max()) > 0 for v in lora_b)


@pytest.mark.slow
def test_a_ray_train_worker_failure_is_one_line_naming_its_cause(
        local_run: Path, corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage-2 worker that cannot read the stage-1 head it is sent fails as one line naming the cause (not
    Ray Train's WorkerGroupError with every worker's traceback); the traceback is in the log file."""
    from memprune.runtime import WorkerError

    monkeypatch.setenv("MEMPRUNE_LOG_DIR", str(tmp_path / "logs"))
    out = tmp_path / "broken"
    for part in ("cache", "stage1"):
        shutil.copytree(local_run / part, out / part)
    (out / "stage1" / "seed0" / "head.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(WorkerError) as failed:
        run_training(_config(*corpus, out, stages=["stage2"], ray={"num_workers": 1, "max_failures": 0}))
    line = str(failed.value)
    assert "\n" not in line and line.startswith("stage2 seeds [0]: a Ray Train worker failed: SafetensorError: ")
    log = Path(line.rsplit("(details: ", 1)[1].rstrip(")"))
    assert "Traceback" in log.read_text() and "WorkerGroupError" not in line
