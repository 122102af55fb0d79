"""`memprune tune`: a Ray Tune search over the stage-1 and stage-2 settings, selected on validation session Spearman.

`run(cfg)`: the train step's own preparation (labels joined to bullets, split by conversation, frozen
embeddings cached) -> optionally a stable subset of the train conversations (validation stays whole)
-> the stage-1 search (FIFO, each trial a stage-1 run: seconds of training) -> the chosen
stage 1 trained once for the trial seed -> the stage-2 search (ASHA on each epoch's validation session
Spearman, forwarded from the Ray Train workers; each trial a normal stage-2 run on Ray Train started
from that stage-1 artifact, or from its own stage 1 when it changes the loss) -> tune.json, tune.md,
tune.png and the best settings as a ready train config (train-tuned.yaml). A trial's artifacts live in
OUT/trials/<stage>-<digest of its settings>/, so a rerun reuses every finished trial.
"""

from __future__ import annotations

import math
import os
import re
import time
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console

from memprune.encoders import check_encoder
from memprune.io import jsonable, write_json, write_text
from memprune.outputs import OutputSet, check_out
from memprune.storage import location
from memprune.train.config import TrainSettings
from memprune.train.stages import STAGE_SPECS, trained_chain
from memprune.train.trainer import Inputs, artifact_dir, run_stage
from memprune.tune.config import METRIC, TuneConfig, TuneError, apply_point
from memprune.tune.report import render_report, render_train_yaml, write_figure
from memprune.tune.space import base_point, encode, max_epochs, param_space, session_spearman_of
from memprune.work import digest, in_working_copy

console = Console(stderr=True)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its error headers


def subsample_train(inputs: Inputs, fraction: float, seed: int) -> Inputs:
    """`inputs` with a stable `fraction` of the train conversations (at least one); validation and test untouched."""
    if fraction >= 1.0:
        return inputs
    train = inputs.tables["train"]
    convs = sorted(set(train.column("conversation_id").to_pylist()))
    keep = [c for c in convs if zlib.crc32(f"{seed}:{c}".encode()) / 2**32 < fraction] or convs[:1]
    tables = {**inputs.tables, "train": train.filter(pc.is_in(train.column("conversation_id"), pa.array(keep)))}
    counts = {**inputs.counts, "tune_train_conversations": {"kept": len(keep), "of": len(convs)}}
    return Inputs(tables, inputs.embedding_dim, digest([inputs.fingerprint, "train_fraction", fraction, seed]), counts)


def _trial_out(root: Path, stage: str, point: dict[str, Any]) -> Path:
    return root / f"{stage}-{digest(jsonable(point))[:12]}"


def run_trial(point: dict[str, Any], *, stage: str, cfg: TuneConfig, base: TrainSettings, inputs: Inputs,
              shared_stage1: str | None) -> None:
    """One Tune trial: a normal `stage` run of `base` with `point` applied, for the trial seed; reports the metric.

    Both train on Ray Train workers (Ray Train's local mode cannot run inside a Tune trial), whose per-epoch
    reports reach Tune (and the stage-2 scheduler) through Tune's report callback on that
    stage's Ray Train run.
    """
    from ray import tune

    started = time.perf_counter()
    settings = apply_point(base, point)
    out = _trial_out(cfg.out / "trials", stage, point)
    tcfg = cfg.train_config(out, settings)
    stage1_s = 0.0
    start = STAGE_SPECS[stage].init_from  # a stage that starts from another's artifact (stage 2 from stage 1)
    if start is not None:
        link = artifact_dir(out, start, cfg.seed)
        if shared_stage1 is not None and settings.loss == base.loss and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(shared_stage1, link, target_is_directory=True)
        elif not link.exists():  # its loss differs from the shared stage 1's: a stage 1 of its own, as `train` would
            t0 = time.perf_counter()
            run_stage(tcfg, inputs, start, [cfg.seed])
            stage1_s = time.perf_counter() - t0
    from ray.tune.integration.ray_train import TuneReportCallback

    # only the searched stage's epochs reach Tune (a trial's own stage 1 must not feed the scheduler)
    [summary] = run_stage(tcfg, inputs, stage, [cfg.seed], callbacks=[TuneReportCallback()])
    metric, n_sessions = session_spearman_of(artifact_dir(out, stage, cfg.seed) / "predictions.parquet")
    tune.report({
        "epoch": int(summary["epochs_run"] or 0), METRIC: metric, "final": True, "n_sessions": n_sessions,
        "val_mse": summary["val_mse"], "best_epoch": summary["best_epoch"], "epochs_run": summary["epochs_run"],
        "patience_stopped": bool(summary.get("stopped_early")), "train_s": summary["wall_s"],
        "stage1_s": round(stage1_s, 3), "dir": str(out),
        # a reused trial costs what its first run did (train.json), not the seconds of finding it again
        "cost_s": round(summary["wall_s"] if summary.get("reused") else time.perf_counter() - started, 3),
        "reused": bool(summary.get("reused")),
    })


def _width(cfg: TuneConfig, stage: str, n: int) -> int:
    """Trials at once: `max_concurrent`, else as many trainers as the cluster fits."""
    from memprune.train import chains_at_once

    if cfg.max_concurrent is not None:
        return max(1, min(cfg.max_concurrent, n))
    return chains_at_once(cfg.train_config(cfg.out), n)


def _search(cfg: TuneConfig, stage: str, base: TrainSettings, inputs: Inputs, shared_stage1: str | None
            ) -> list[dict[str, Any]]:
    """Run one search with Ray Tune; every trial's settings, status, metric, epochs and cost."""
    import ray
    from ray import tune
    from ray._raylet import RAY_NODE_ID_KEY
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

    space, n = cfg.space(stage), cfg.trials(stage)
    points = [base_point(base, space)] if cfg.include_base else []
    # the stage that starts from the chosen stage 1 (stage 2): the given points first, epochs cut by ASHA
    from_start = STAGE_SPECS[stage].init_from is not None
    if from_start:
        points += [{**base_point(base, space), **{k: encode(v) for k, v in p.items()}} for p in cfg.points]
    points = points[:n]
    if from_start:
        horizon = max_epochs(base, space, points)
        scheduler: Any = ASHAScheduler(time_attr="epoch", max_t=horizon + 1,  # +1: the final report is never cut
                                       grace_period=cfg.scheduler.grace_period,
                                       reduction_factor=cfg.scheduler.reduction_factor)
    else:
        scheduler = FIFOScheduler()
    width = _width(cfg, stage, n)
    trainable = tune.with_parameters(run_trial, stage=stage, cfg=cfg, base=base, inputs=inputs,
                                     shared_stage1=shared_stage1)
    # a trial only waits on its Ray Train workers, which hold the CPUs: it reserves no CPU (a bundle may not be
    # empty). It runs on this node, where the search's directory is (the workers run anywhere: their checkpoints go
    # to the runs' storage, and a stage 2 gets its stage-1 head in its loop config).
    here = {RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()}
    trial_resources = tune.PlacementGroupFactory([{"memory": 64 * 2**20}], bundle_label_selector=[here])
    tuner = tune.Tuner(
        tune.with_resources(trainable, trial_resources),
        param_space=param_space(space),
        tune_config=tune.TuneConfig(
            metric=METRIC, mode="max", num_samples=n, scheduler=scheduler,
            search_alg=BasicVariantGenerator(points_to_evaluate=points, random_state=cfg.search_seed,
                                             max_concurrent=width),
            trial_dirname_creator=lambda t: f"{stage}-{t.trial_id}", trial_name_creator=lambda t: f"{stage}-{t.trial_id}",
        ),
        run_config=tune.RunConfig(name=f"{stage}-{digest(jsonable([space, points, n, cfg.search_seed]))[:10]}",
                                  storage_path=str(cfg.out / "ray-tune"), verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )
    console.print(f"tune {stage}: {n} trials, {width} at once", highlight=False)
    grid = tuner.fit()
    # Tune's own trial status tells a trial the scheduler stopped (TERMINATED, no final report) from one that was
    # interrupted (Ctrl-C, still RUNNING or PENDING)
    statuses = {t.trial_id: t.status for t in getattr(getattr(grid, "_experiment_analysis", None), "trials", [])}
    records = [_record(stage, r, statuses) for r in grid]
    for r in records:
        console.print(f"{stage} {r['trial_id']}: {r['status']}, {METRIC} {r['metric']}, {r['cost_s']} s",
                      highlight=False)
    return records


def _record(stage: str, result: Any, statuses: dict[str, str]) -> dict[str, Any]:
    """One trial's row: its settings, status (completed, stopped early by the scheduler, error), metric, cost."""
    m = dict(result.metrics or {})
    history: list[dict[str, Any]] = []
    frame = result.metrics_dataframe
    if frame is not None and "val_loss" in frame.columns:
        for _, row in frame[frame["val_loss"].notna()].iterrows():
            history.append({"epoch": int(row["epoch"]), METRIC: _num(row.get(METRIC)), "val_loss": _num(row["val_loss"])})
    trial_id = (result.path or "").rsplit("-", 1)[-1]
    if result.error is not None:
        status = "error"
    elif m.get("final"):
        status = "completed"
    elif statuses.get(trial_id, "TERMINATED") == "TERMINATED":
        status = "stopped early"
    else:
        status = "interrupted"
    return {
        "stage": stage,
        "trial_id": trial_id,
        "settings": dict(result.config or {}),
        "status": status,
        "error": error_line(result.error) if result.error is not None else None,
        "metric": _num(m.get(METRIC)),
        "n_sessions": m.get("n_sessions"),
        "epochs_run": m.get("epochs_run") if status == "completed" else m.get("epoch"),
        "best_epoch": m.get("best_epoch"),
        "patience_stopped": m.get("patience_stopped"),
        "val_mse": _num(m.get("val_mse")),
        "cost_s": round(float(m.get("cost_s") or m.get("time_total_s") or 0.0), 3),
        "train_s": m.get("train_s"),
        "stage1_s": m.get("stage1_s"),
        "reused": m.get("reused"),
        "dir": m.get("dir"),
        "history": history,
    }


def error_line(error: BaseException) -> str:
    """Why a trial failed, in one line of at most 300 characters: the memprune error behind it (raised in a
    trial or a Ray Train worker), else the innermost cause's type and message, never the header of Ray's
    wrapper (`ray::ImplicitFunc.train() (pid=..., actor_id=...)`, in terminal colours), which names no cause."""
    from memprune.errors import MemPruneError
    from memprune.runtime import one_line, user_error

    cause, seen = error, {id(error)}
    while isinstance(getattr(cause, "cause", None), BaseException) and id(cause.cause) not in seen:
        cause = cause.cause  # a RayTaskError is also an instance of its cause's class: unwrap it, do not test it
        seen.add(id(cause))
    mine = cause if isinstance(cause, MemPruneError) else user_error(error)  # else: one named in the wrapped text
    text = one_line(mine) if mine is not None else f"{type(cause).__name__}: {one_line(cause)}"
    return _ANSI.sub("", text)[:300]


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def best_of(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The completed trial with the highest metric (ties: the cheaper one); None when none completed with one."""
    done = [r for r in records if r["status"] == "completed" and r["metric"] is not None]
    return max(done, key=lambda r: (r["metric"], -r["cost_s"])) if done else None


def run(cfg: TuneConfig) -> dict[str, Any]:
    """Search stage 1, then stage 2 from the chosen stage 1; write tune.json, tune.md, tune.png, train-tuned.yaml.

    With a storage URI `out` the trials run in this node's working copy of it, and the search (trials included,
    so a rerun on any node reuses them) is committed there as one output set (`memprune.work.in_working_copy`)."""
    from memprune.train import prepare_inputs

    if isinstance(cfg.out, str):
        # the trials' Ray Train workers may run on any node: their checkpoints go to the bucket, not this disk
        storage = cfg.trial_storage or cfg.train.ray.storage_path or f"{cfg.out.rstrip('/')}/ray"
        summary = in_working_copy(cfg.out, "tune", lambda work: run(cfg.model_copy(
            update={"out": work, "tuned_config": None, "trial_storage": storage})), leave=("cache", "ray-tune"))
        if cfg.tuned_config is not None:  # the committed copy: it names the URI, not the working copy
            write_text(cfg.tuned_config, (location(cfg.out) / "train-tuned.yaml").read_text())
        return summary
    check_out(cfg.out, "tune")
    check_encoder(cfg.train.encoder)
    started = time.perf_counter()
    with OutputSet(cfg.out, "tune") as outputs:
        prep_cfg = cfg.train_config(cfg.out / "base")
        inputs, ledger, embed_info = prepare_inputs(prep_cfg, None, cfg.out / "cache", outputs)
        inputs = subsample_train(inputs, cfg.train_fraction, cfg.train.split.seed)
        settings = cfg.train
        first, second = (spec.name for spec in trained_chain())  # stage 1, then stage 2 from the chosen stage 1
        stage1_records: list[dict[str, Any]] = []
        if cfg.trials(first):
            stage1_records = _search(cfg, first, settings, inputs, None)
            best1 = best_of(stage1_records)
            if best1 is None:
                raise TuneError(f"no stage-1 trial finished with a {METRIC}: see the trials under {cfg.out / 'trials'}")
            settings = apply_point(settings, best1["settings"])
        shared_cfg = cfg.train_config(cfg.out / "stage1-chosen", settings)
        t0 = time.perf_counter()
        [s1] = run_stage(shared_cfg, inputs, first, [cfg.seed])
        s1_dir = artifact_dir(shared_cfg.out, first, cfg.seed)
        s1_metric, s1_sessions = session_spearman_of(s1_dir / "predictions.parquet")
        stage1 = {"metric": _num(s1_metric), "n_sessions": s1_sessions, "val_mse": _num(s1["val_mse"]),
                  "train_s": s1["wall_s"], "cost_s": round(time.perf_counter() - t0, 3), "dir": str(s1_dir)}
        stage2_records: list[dict[str, Any]] = []
        best2 = None
        if cfg.trials(second):
            stage2_records = _search(cfg, second, settings, inputs, str(s1_dir))
            best2 = best_of(stage2_records)
            if best2 is not None:
                settings = apply_point(settings, best2["settings"])
        gain = (best2["metric"] - stage1["metric"]) if best2 is not None and stage1["metric"] is not None else None
        summary = {
            "data": str(cfg.data), "labels": [str(p) for p in cfg.labels], "out": str(cfg.out),
            "metric": METRIC, "seed": cfg.seed, "train_fraction": cfg.train_fraction,
            "split": {**cfg.train.split.model_dump(mode="json"), **inputs.counts},
            "bullets_per_split": {s: t.num_rows for s, t in inputs.tables.items()},
            "rejects": {"file": str(cfg.out / "rejects.jsonl"), **ledger.summary()},
            "embeddings": embed_info,
            "scheduler": {"name": "ASHA", "time_attr": "epoch", **cfg.scheduler.model_dump(mode="json")},
            "stage1_trials": stage1_records, "stage2_trials": stage2_records,
            "stage1_chosen": stage1,
            "best_stage2": best2,
            "stage2_gain_valid": gain,
            "stopped_early": sum(r["status"] == "stopped early" for r in stage2_records),
            "tuned_settings": settings.model_dump(mode="json"),
            "wall_s": round(time.perf_counter() - started, 3),
            "config": cfg.model_dump(mode="json"),
        }
        summary = jsonable(summary)
        yaml_text = render_train_yaml(summary, cfg)
        write_text(outputs.path("train-tuned.yaml"), yaml_text)
        write_figure(summary, outputs.path("tune.png"))
        write_json(outputs.path("tune.json"), summary)
        write_text(outputs.path("tune.md"), render_report(summary))
    if cfg.tuned_config is not None:
        write_text(cfg.tuned_config, yaml_text)
    console.print(f"tune: {summary['wall_s']:.1f} s; best stage 2 {METRIC} "
                  f"{'-' if best2 is None else round(best2['metric'], 4)} vs stage 1 {stage1['metric']}", highlight=False)
    return summary
