"""One (stage, seed): train it on Ray Train (when the stage trains), then write its artifact and predictions.

`OUT/<stage>/seed<k>/` receives the scorer artifact (`memprune.scorer` format), `predictions.parquet`
(validation and test rows) and `train.json`, written last: a finished (stage, seed) with the same
fingerprint (data, settings, seed) is reused on a rerun instead of being trained again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memprune.io import write_json, write_table
from memprune.runtime import use_gpu
from memprune.scorer import head_input_dim, save_artifact
from memprune.train.config import TrainConfig, TrainError
from memprune.train.embed import embeddings_to_numpy
from memprune.train.loop import LoopConfig, train_loop_per_worker
from memprune.train.stages import STAGE_SPECS, TRAIN_FORMAT, StageSpec
from memprune.work import finished

PREDICTIONS = pa.schema(
    [
        pa.field("bullet_id", pa.string(), nullable=False),
        pa.field("conversation_id", pa.string(), nullable=False),
        pa.field("session_index", pa.int32(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("label", pa.float64(), nullable=False),
        pa.field("score", pa.float64(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("seed", pa.int32(), nullable=False),
    ]
)
DONE_NEEDS = ("predictions.parquet", "scorer.json")


@dataclass
class Inputs:
    """The per-split tables (with embeddings where computed) shared by all (stage, seed) runs."""

    tables: dict[str, pa.Table]
    embedding_dim: int | None
    fingerprint: str
    counts: dict[str, Any]


def artifact_dir(out: Path, stage: str, seed: int) -> Path:
    return out / stage / f"seed{seed}"


def predictions_table(table: pa.Table, scores: np.ndarray, stage: str, seed: int) -> pa.Table:
    """The predictions of one (stage, seed) on the validation and test rows."""
    n = table.num_rows
    return pa.table(
        {
            "bullet_id": table.column("bullet_id"),
            "conversation_id": table.column("conversation_id"),
            "session_index": table.column("session_index"),
            "split": table.column("split"),
            "label": table.column("label").cast(pa.float64()),
            "score": pa.array(np.asarray(scores, dtype=np.float64)),
            "stage": pa.array([stage] * n, pa.string()),
            "seed": pa.array([seed] * n, pa.int32()),
        },
        schema=PREDICTIONS,
    )


def _valid(pred: pa.Table) -> pa.Table:
    return pred.filter(pc.equal(pred.column("split"), "valid"))


def val_mse(pred: pa.Table) -> float | None:
    valid = _valid(pred)
    if valid.num_rows == 0:
        return None
    diff = valid.column("score").to_numpy() - valid.column("label").to_numpy()
    return float(np.mean(diff**2))


def val_spearman(pred: pa.Table) -> float | None:
    from scipy.stats import spearmanr

    valid = _valid(pred)
    if valid.num_rows < 2:
        return None
    rho = spearmanr(valid.column("label").to_numpy(), valid.column("score").to_numpy()).statistic
    return None if rho is None or not math.isfinite(rho) else float(rho)


def storage_path(cfg: TrainConfig) -> str:
    """Ray Train storage: `ray.storage_path` (a local path or a URI such as s3://...) or OUT/ray."""
    if not cfg.ray.storage_path:
        return str(cfg.out / "ray")
    if "://" in cfg.ray.storage_path:
        return cfg.ray.storage_path
    return str(Path(cfg.ray.storage_path).expanduser().resolve())


def _dataset(table: pa.Table) -> Any:
    """A Ray Dataset of `table` in a few blocks (one block would serialise every consumer)."""
    import ray

    n_blocks = max(1, min(8, table.num_rows // 2048))
    step = math.ceil(table.num_rows / n_blocks) if table.num_rows else 1
    ds = ray.data.from_arrow([table.slice(i, step) for i in range(0, max(1, table.num_rows), step)])
    ds.context.enable_progress_bars = False  # read once per worker; the bars would only repeat on the driver
    return ds


def _fit(cfg: TrainConfig, inputs: Inputs, spec: StageSpec, seed: int, fp: str
         ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One TorchTrainer for a trained (stage, seed): (best weights, loop state, Ray facts for train.json)."""
    import torch
    from ray.train import (
        CheckpointConfig,
        DataConfig,
        FailureConfig,
        RunConfig,
        ScalingConfig,
    )
    from ray.train.torch import TorchTrainer

    from memprune.train import checkpoint

    init_dir = None
    if spec.init_from is not None:
        init_dir = artifact_dir(cfg.out, spec.init_from, seed)
        init_fp = STAGE_SPECS[spec.init_from].fingerprint(cfg, seed, inputs.fingerprint)
        if finished(init_dir / "train.json", init_fp, DONE_NEEDS) is None:
            raise TrainError(
                f"{spec.name} seed {seed} starts from the {spec.init_from} artifact of the same seed, but {init_dir} "
                f"holds no finished {spec.init_from} run for these data and settings: include {spec.init_from} in --stages"
            )
    storage = storage_path(cfg)
    name = f"{spec.name}-seed{seed}-{fp[:12]}"
    local_mode = cfg.ray.num_workers == 0
    gpu = not local_mode and use_gpu(cfg.ray.use_gpu)
    if local_mode:
        scaling = ScalingConfig(num_workers=0)
    else:
        scaling = ScalingConfig(num_workers=cfg.ray.num_workers, use_gpu=gpu,
                                resources_per_worker={"CPU": cfg.ray.cpus_per_worker, **({"GPU": 1} if gpu else {})})
    loop = LoopConfig(
        stage=spec.name, seed=seed, scorer=cfg.scorer_config(spec.name, seed), optim=spec.optim(cfg), loss=cfg.loss,
        init_dir=str(init_dir) if init_dir else None, embedding_dim=inputs.embedding_dim, threads=spec.threads(cfg),
        local_mode=local_mode, local_checkpoint_dir=str(cfg.out / "ray" / name / "local"), fault=cfg.fault,
    )
    datasets = {s: _dataset(inputs.tables[s].select(spec.columns())) for s in ("train", "valid")}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop.model_dump(mode="json"),
        scaling_config=scaling,
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=cfg.ray.max_failures),
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.ray.num_to_keep, checkpoint_score_attribute="val_loss", checkpoint_score_order="min"
            ),
        ),
        datasets=datasets,
        dataset_config=DataConfig(datasets_to_split=[]),
    )
    threads = torch.get_num_threads()
    try:
        result = trainer.fit()
    finally:
        torch.set_num_threads(threads)  # local mode trains in this process
    if result.checkpoint is None:
        raise TrainError(f"{spec.name} seed {seed}: training reported no checkpoint")
    with result.checkpoint.as_directory() as d:
        best, state = checkpoint.read_result(Path(d))
    retained = [{"path": ckpt.path, "epoch": m.get("epoch"), "val_loss": m.get("val_loss")}
                for ckpt, m in result.best_checkpoints or []]
    extra = {
        "ray": {"run_name": name, "storage": storage, "num_workers": cfg.ray.num_workers, "use_gpu": gpu,
                "local_mode": local_mode, "checkpoints_retained": retained},
        "init_dir": str(init_dir) if init_dir else None,
    }
    return best, state, extra


def run_stage(cfg: TrainConfig, inputs: Inputs, stage: str, seed: int) -> dict[str, Any]:
    """Train (or build, for vanilla) one (stage, seed); write its artifact, predictions and train.json."""
    from memprune.scorer import build_head

    spec = STAGE_SPECS[stage]
    started = time.perf_counter()
    out_dir = artifact_dir(cfg.out, stage, seed)
    fp = spec.fingerprint(cfg, seed, inputs.fingerprint)
    done = finished(out_dir / "train.json", fp, DONE_NEEDS)
    if done is not None:
        return {**done, "reused": True}
    if spec.trained:
        best, state, extra = _fit(cfg, inputs, spec, seed, fp)
        head_state = {k[5:]: v for k, v in best.items() if k.startswith("head.")}
        adapter_state = {k[8:]: v for k, v in best.items() if k.startswith("adapter.")}
        dim = head_input_dim(head_state)
    else:  # the untrained baseline: the pretrained encoder + a head initialised from the seed
        if inputs.embedding_dim is None:
            raise TrainError(f"{stage} needs the encoder embeddings")
        dim = inputs.embedding_dim
        head_state = {k: v.detach().clone() for k, v in build_head(dim, cfg.head, seed).state_dict().items()}
        adapter_state, state, extra = {}, None, None
    save_artifact(out_dir, cfg.scorer_config(stage, seed).model_copy(update={"embedding_dim": dim}), head_state,
                  adapter_state or None)
    table = pa.concat_tables([inputs.tables["valid"], inputs.tables["test"]])
    embeddings = embeddings_to_numpy(table.column("embedding")) if "embedding" in table.column_names else None
    scores = spec.predict(cfg, out_dir, head_state, dim, table.column("text").to_pylist(), embeddings)
    pred = predictions_table(table, scores, stage, seed)
    write_table(pred, out_dir / "predictions.parquet")
    summary = _summary(cfg, inputs, spec, seed, fp, state, started, pred, extra)
    write_json(out_dir / "train.json", summary)
    return summary


def _summary(cfg: TrainConfig, inputs: Inputs, spec: StageSpec, seed: int, fp: str, state: dict[str, Any] | None,
             started: float, pred: pa.Table, extra: dict[str, Any] | None) -> dict[str, Any]:
    """train.json of one (stage, seed)."""
    optim = spec.optim(cfg)
    history = (state or {}).get("history", [])
    return {
        "format": TRAIN_FORMAT,
        "stage": spec.name,
        "seed": seed,
        "fingerprint": fp,
        "encoder": cfg.encoder,
        "epochs": history,
        "train_loss": [h["train_loss"] for h in history],
        "val_loss": [h["val_loss"] for h in history],
        "best_epoch": (state or {}).get("best_epoch"),
        "best_val_loss": (state or {}).get("best_val_loss"),
        "epochs_run": len(history),
        "stopped_early": bool(optim is not None and history and len(history) < optim.epochs),
        "attempt_start_epochs": (state or {}).get("starts", []),
        "val_mse": val_mse(pred),
        "val_spearman": val_spearman(pred),
        "wall_s": round(time.perf_counter() - started, 3),
        "n_bullets": {s: inputs.tables[s].num_rows for s in ("train", "valid", "test")},
        "n_unlabeled": inputs.counts["unlabeled_bullets"],
        "optim": optim.model_dump(mode="json") if optim is not None else None,
        "loss": cfg.loss.model_dump(mode="json") if optim is not None else None,
        "reused": False,
        **(extra or {}),
    }
