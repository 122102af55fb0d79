"""One (stage, seed): train it on Ray Train (when the stage trains), then write its artifact and predictions.

`OUT/<stage>/seed<k>/` receives the scorer artifact (`memprune.scorer` format), `predictions.parquet`
(validation and test rows), for a trained stage `calibration.json` (fitted on the validation rows,
`memprune.train.calibrate`) and `train.json`, written last: a finished (stage, seed) with the same
fingerprint (data, settings, seed) is reused on a rerun instead of being trained again.
"""

from __future__ import annotations

import base64
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memprune.io import write_json, write_table
from memprune.runtime import use_gpu, worker_error
from memprune.scorer import head_input_dim, save_artifact
from memprune.timing import now
from memprune.train.calibrate import calibrate_predictions, ensure_calibration
from memprune.train.config import TrainConfig, TrainError
from memprune.train.embed import embeddings_to_numpy
from memprune.train.loop import TABLES, LoopConfig, train_loop_per_worker
from memprune.train.stages import STAGE_SPECS, TRAIN_FORMAT, StageSpec
from memprune.work import digest, finished

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


def _fit(cfg: TrainConfig, inputs: Inputs, spec: StageSpec, seeds: list[int], fps: dict[int, str],
         callbacks: list[Any] | None = None) -> tuple[dict[int, tuple[dict[str, Any], dict[str, Any]]], dict[str, Any]]:
    """One TorchTrainer for a trained stage and `seeds` (trained in turn): per seed (best weights, loop state),
    and the Ray facts for train.json. `callbacks`: extra Ray Train callbacks (`memprune tune` forwards epochs)."""
    import torch
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchTrainer

    from memprune.train import checkpoint

    init_heads: dict[str, str] = {}
    if spec.init_from is not None:
        for seed in seeds:
            init_dir = artifact_dir(cfg.out, spec.init_from, seed)
            init_fp = STAGE_SPECS[spec.init_from].fingerprint(cfg, seed, inputs.fingerprint)
            if finished(init_dir / "train.json", init_fp, DONE_NEEDS) is None:
                raise TrainError(
                    f"{spec.name} seed {seed} starts from the {spec.init_from} artifact of the same seed, but {init_dir} "
                    f"holds no finished {spec.init_from} run for these data and settings: include {spec.init_from} "
                    "in --stages")
            init_heads[str(seed)] = base64.b64encode((init_dir / "head.safetensors").read_bytes()).decode("ascii")
    elif spec.needs_embeddings and (start := cfg.init_head()) is not None:  # `--init`: a head stage starts there
        init_heads = {str(seed): base64.b64encode(start).decode("ascii") for seed in seeds}
    storage = storage_path(cfg)
    name = f"{spec.name}-seed{'-'.join(map(str, seeds))}-{digest(sorted(fps.values()))[:12]}"
    workers = spec.workers(cfg)
    local_mode = workers == 0
    gpu = not local_mode and use_gpu(cfg.ray.use_gpu)
    if local_mode:
        scaling = ScalingConfig(num_workers=0)
    else:
        scaling = ScalingConfig(num_workers=workers, use_gpu=gpu, label_selector=cfg.ray.label_selector,
                                resources_per_worker={"CPU": cfg.ray.cpus_per_worker, **({"GPU": 1} if gpu else {})})
    loop = LoopConfig(
        stage=spec.name, seeds=seeds, scorer=cfg.scorer_config(spec.name, seeds[0]), optim=spec.optim(cfg),
        loss=cfg.loss, init_heads=init_heads, embedding_dim=inputs.embedding_dim, threads=spec.threads(cfg),
        precision=spec.precision(cfg),
        local_mode=local_mode, local_checkpoint_dir=str(cfg.out / "ray" / name / "local"), fault=cfg.fault,
        train_head=bool(getattr(spec.optim(cfg), "train_head", True)),
    )
    # every checkpoint holds each seed's best weights: keep the latest; keep the best by val_loss only for one seed
    by_loss = {"checkpoint_score_attribute": "val_loss", "checkpoint_score_order": "min"} if len(seeds) == 1 else {}
    # every worker reads the whole train and validation tables (it keeps its sessions): one object each in the
    # object store, which any node fetches, and in local mode the tables themselves
    tables = {s: inputs.tables[s].select(spec.columns()) for s in ("train", "valid")}
    if not local_mode:
        import ray

        tables = {s: ray.put(table) for s, table in tables.items()}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={**loop.model_dump(mode="json"), TABLES: tables},
        scaling_config=scaling,
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=cfg.ray.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.ray.num_to_keep, **by_loss),
            callbacks=list(callbacks or []),
        ),
    )
    threads = torch.get_num_threads()
    # a worker's report waits for the controller's next poll, which reads this from the driver's environment
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(cfg.ray.poll_interval_s)
    try:
        result = trainer.fit()
    except TrainingFailedError as exc:  # a worker's failure (on any node): one line, its traceback in the log
        raise worker_error(exc, f"{spec.name} seeds {seeds}: a Ray Train worker failed", "train") from exc
    finally:
        torch.set_num_threads(threads)  # local mode trains in this process
    if result.checkpoint is None:
        raise TrainError(f"{spec.name} seeds {seeds}: training reported no checkpoint")
    with result.checkpoint.as_directory() as d:
        results = {seed: checkpoint.read_result(Path(d) / f"seed{seed}") for seed in seeds}
    retained = [{"path": ckpt.path, "seed": m.get("seed"), "epoch": m.get("epoch"), "val_loss": m.get("val_loss")}
                for ckpt, m in result.best_checkpoints or []]
    facts = {"run_name": name, "storage": storage, "num_workers": workers, "use_gpu": gpu,
             "local_mode": local_mode, "seeds_in_run": seeds, "checkpoints_retained": retained}
    return results, facts


def run_stage(cfg: TrainConfig, inputs: Inputs, stage: str, seeds: list[int],
              callbacks: list[Any] | None = None) -> list[dict[str, Any]]:
    """Train (or build, for vanilla) a stage for `seeds`, in one Ray Train run; write each seed's artifact,
    predictions and train.json. Seeds already finished with the same fingerprint are reused. `callbacks` go to
    the Ray Train run (`memprune tune` passes Tune's report callback so its scheduler sees every epoch)."""
    from memprune.scorer import build_head

    spec = STAGE_SPECS[stage]
    started = time.perf_counter()
    fps = {seed: spec.fingerprint(cfg, seed, inputs.fingerprint) for seed in seeds}
    summaries: dict[int, dict[str, Any]] = {}
    for seed in seeds:
        done = finished(artifact_dir(cfg.out, stage, seed) / "train.json", fps[seed], DONE_NEEDS)
        if done is not None:
            if spec.trained and cfg.calibration.enabled:
                rec = ensure_calibration(cfg.calibration, artifact_dir(cfg.out, stage, seed))
                if done.get("calibration") != rec:  # calibrated (again) from the saved predictions
                    done = {**done, "calibration": rec}
                    write_json(artifact_dir(cfg.out, stage, seed) / "train.json", done)
            summaries[seed] = {**done, "reused": True}
    pending = [seed for seed in seeds if seed not in summaries]
    results: dict[int, tuple[dict[str, Any], dict[str, Any] | None]] = {}
    facts: dict[str, Any] | None = None
    if pending and spec.trained:
        results, facts = _fit(cfg, inputs, spec, pending, fps, callbacks)
    elif pending:  # the untrained baseline: the pretrained encoder + a head from the seed, or `--init`'s as it is
        if inputs.embedding_dim is None:
            raise TrainError(f"{stage} needs the encoder embeddings")
        start = cfg.init_head()
        if start is not None:
            from safetensors.torch import load

            start = load(start)
        for seed in pending:
            head = build_head(inputs.embedding_dim, cfg.head, seed)
            if start is not None:
                head.load_state_dict(start)
            results[seed] = ({f"head.{k}": v.detach().clone() for k, v in head.state_dict().items()}, None)
    run_s = time.perf_counter() - started
    epochs_s = {seed: sum(h.get("epoch_s", 0.0) for h in (results[seed][1] or {}).get("history", []))
                for seed in pending}
    setup_s = max(0.0, run_s - sum(epochs_s.values())) / max(1, len(pending))  # the run's set-up, shared by its seeds
    table = pa.concat_tables([inputs.tables["valid"], inputs.tables["test"]])
    embeddings = embeddings_to_numpy(table.column("embedding")) if "embedding" in table.column_names else None
    for seed in pending:
        best, state = results[seed]
        head_state = {k[5:]: v for k, v in best.items() if k.startswith("head.")}
        adapter_state = {k[8:]: v for k, v in best.items() if k.startswith("adapter.")}
        dim = head_input_dim(head_state)
        out_dir = artifact_dir(cfg.out, stage, seed)
        save_artifact(out_dir, cfg.scorer_config(stage, seed).model_copy(update={"embedding_dim": dim}), head_state,
                      adapter_state or None)
        t0 = now()
        scores = spec.predict(cfg, out_dir, head_state, dim, table.column("text").to_pylist(), embeddings)
        predict_span = [t0, now()]
        pred = predictions_table(table, scores, stage, seed)
        write_table(pred, out_dir / "predictions.parquet")
        timing = {"setup_s": round(setup_s, 3), "epochs_s": round(epochs_s[seed], 3),
                  "predict_s": round(predict_span[1] - predict_span[0], 3), "predict_span": predict_span}
        extra: dict[str, Any] = {"timing": timing}
        if spec.trained and cfg.calibration.enabled:
            extra["calibration"] = calibrate_predictions(cfg.calibration, out_dir, pred)
        if facts is not None:
            extra.update(ray=facts, init_dir=str(artifact_dir(cfg.out, spec.init_from, seed)) if spec.init_from else None)
        wall_s = setup_s + epochs_s[seed] + timing["predict_s"]
        summaries[seed] = _summary(cfg, inputs, spec, seed, fps[seed], state, wall_s, pred, extra)
        write_json(out_dir / "train.json", summaries[seed])
    return [summaries[seed] for seed in seeds]


def _summary(cfg: TrainConfig, inputs: Inputs, spec: StageSpec, seed: int, fp: str, state: dict[str, Any] | None,
             wall_s: float, pred: pa.Table, extra: dict[str, Any] | None) -> dict[str, Any]:
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
        "wall_s": round(wall_s, 3),
        "n_bullets": {s: inputs.tables[s].num_rows for s in ("train", "valid", "test")},
        "n_unlabeled": inputs.counts["unlabeled_bullets"],
        "optim": optim.model_dump(mode="json") if optim is not None else None,
        "loss": cfg.loss.model_dump(mode="json") if optim is not None else None,
        "reused": False,
        # what the training passes were asked for and what ran on the workers' device (None: not trained)
        "precision": {"requested": spec.precision(cfg), "resolved": history[-1].get("precision") if history else None},
        **(extra or {}),
    }
