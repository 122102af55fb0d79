"""`memprune train`: the scorer's stages (vanilla, stage 1, stage 2) over seeds, on Ray Train (DESIGN step 3).

`run(cfg)`: one split by conversation (or K folds, each holding one fold out as its test split)
-> `prepare_inputs` (`train/prepare.py`: labels joined to bullets, split, frozen embeddings computed once and cached) ->
vanilla per seed -> `_run_seed_chains` (stage 1 then stage 2 of each seed; seeds concurrently as
far as the cluster allows) -> `_write_run` (OUT/run.json, OUT/train.md). Finished (stage, seed)
runs are reused on a rerun. Evaluation is a separate step (`memprune evaluate`), chained by the
CLI and the pipeline.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from memprune.encoders import check_encoder
from memprune.io import JsonlSink, read_table, write_json, write_text
from memprune.outputs import OutputSet, check_out
from memprune.markdown import time_line
from memprune.rejects import Ledger
from memprune.timing import busy_seconds, time_split
from memprune import stages as registry
from memprune.train.config import TrainConfig
from memprune.train.data import load_labels
from memprune.train.prepare import chains_at_once, prepare_inputs
from memprune.train.report import render_fold_report, render_report
from memprune.train.splits import FOLD_MANIFEST, fold_assignment, fold_split
from memprune.train.stages import STAGE_SPECS, TRAIN_FORMAT
from memprune.train.trainer import Inputs, artifact_dir, run_stage
from memprune.work import in_working_copy

console = Console(stderr=True)


def _print(summary: dict[str, Any]) -> None:
    """One line per (stage, seed) on the driver's terminal."""
    loss, mse = summary["best_val_loss"], summary["val_mse"]
    what = (f"best epoch {summary['best_epoch']} of {summary['epochs_run']}, val_loss "
            f"{'-' if loss is None else f'{loss:.4f}'}" if summary.get("optim") else
            f"val_mse {'-' if mse is None else f'{mse:.4f}'}")
    console.print(f"{summary['stage']} seed {summary['seed']}: {what}, {summary['wall_s']:.1f} s"
                  + (" (reused)" if summary.get("reused") else ""), highlight=False)


def _run_chain(cfg: TrainConfig, inputs: Inputs, seed: int, stages: list[str]) -> list[dict[str, Any]]:
    """The per-seed stages of one seed in order; in-process or as a Ray task."""
    return [r for stage in stages for r in run_stage(cfg, inputs, stage, [seed])]


def _run_seed_chains(cfg: TrainConfig, inputs: Inputs, chain: list[str]) -> list[dict[str, Any]]:
    """Every seed's chain of per-seed stages (stage 2), as many at once as the cluster fits."""
    import ray

    width = chains_at_once(cfg, len(cfg.seeds))
    if width == 1:
        runs = []
        for seed in cfg.seeds:
            for summary in _run_chain(cfg, inputs, seed, chain):
                _print(summary)
                runs.append(summary)
        return runs
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cpus = cfg.ray.cpus_per_worker if cfg.ray.num_workers == 0 else 0
    # on the driver's node: a chain writes its artifacts under --out, which other nodes may not see (a local-mode
    # chain needs CPUs, which the driver's node may lack: there only preferred)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=cpus > 0)
    task = ray.remote(num_cpus=cpus, max_retries=0, scheduling_strategy=here)(_run_chain)
    inputs_ref = ray.put(inputs)
    pending, running, runs = list(cfg.seeds), {}, []
    while pending or running:
        while pending and len(running) < width:
            seed = pending.pop(0)
            running[task.remote(cfg, inputs_ref, seed, chain)] = seed
        ready, _ = ray.wait(list(running), num_returns=1)
        for ref in ready:
            running.pop(ref)
            for summary in ray.get(ref):
                _print(summary)
                runs.append(summary)
    return runs


def _train_split(cfg: TrainConfig, assignment: dict[str, str] | None, cache_dir: Path) -> dict[str, Any]:
    """Every requested (stage, seed) on one split; writes OUT/<stage>/seed<k>/, OUT/run.json and OUT/train.md."""
    check_out(cfg.out, "train")
    check_encoder(cfg.encoder)
    with OutputSet(cfg.out, "train") as outputs:
        return _train_split_into(cfg, assignment, cache_dir, outputs)


def _train_split_into(cfg: TrainConfig, assignment: dict[str, str] | None, cache_dir: Path,
                      outputs: OutputSet) -> dict[str, Any]:
    started = time.perf_counter()
    inputs, ledger, embed_info = prepare_inputs(cfg, assignment, cache_dir, outputs)
    runs: list[dict[str, Any]] = []
    for stage in (s for s in cfg.stages if not STAGE_SPECS[s].per_seed_run):  # every seed in one go
        for summary in run_stage(cfg, inputs, stage, cfg.seeds):
            _print(summary)
            runs.append(summary)
    chain = [s for s in cfg.stages if STAGE_SPECS[s].per_seed_run]
    if chain:
        runs.extend(_run_seed_chains(cfg, inputs, chain))
    order = {s: i for i, s in enumerate(registry.stage_names())}
    runs.sort(key=lambda r: (order[r["stage"]], r["seed"]))
    summary = {
        **_common(cfg),
        "split": {**cfg.split.model_dump(mode="json"), **inputs.counts},
        "rejects": {"file": str(cfg.out / "rejects.jsonl"), **ledger.summary()},
        "embeddings": embed_info,
        "runs": [
            {k: r.get(k) for k in ("stage", "seed", "best_epoch", "best_val_loss", "epochs_run", "val_mse",
                                   "val_spearman", "wall_s", "reused", "calibration", "precision")}
            | {k: (r.get("timing") or {}).get(k) for k in ("setup_s", "epochs_s", "predict_s")}
            | {"dir": str(artifact_dir(cfg.out, r["stage"], r["seed"]))}
            for r in runs
        ],
        "stage_summary": stage_summary(runs),
        "wall_s": round(time.perf_counter() - started, 3),
        "timing": run_timing(time.perf_counter() - started, embed_info, runs),
        "config": cfg.model_dump(mode="json"),
    }
    write_json(outputs.path("run.json"), summary)
    write_text(outputs.path("train.md"), render_report(summary))
    console.print(f"train: {summary['wall_s']:.1f} s; {time_line(summary['timing'])}", highlight=False)
    return summary


def _common(cfg: TrainConfig) -> dict[str, Any]:
    return {"format": TRAIN_FORMAT, "data": str(cfg.data), "labels": [str(p) for p in cfg.labels],
            "label_weights": cfg.label_weights, "out": str(cfg.out), "stages": cfg.stages, "seeds": cfg.seeds,
            "encoder": cfg.encoder}


def _run_folds(cfg: TrainConfig) -> dict[str, Any]:
    """k-fold training by conversation: K runs into OUT/fold<i>/, each testing on the conversations it never saw.

    The labelled conversations are dealt into K folds (`fold_assignment`); run i holds out
    fold i as its test split and trains/validates on the others (`fold_split`), so no
    conversation's own labels are ever used to predict it. Each fold dir gets a `fold.json`
    manifest (its train/valid/test conversations) that `memprune evaluate` checks before it
    pools the K test splits into one out-of-fold prediction set. Embeddings are cached once
    in OUT/cache and shared by the folds; finished (stage, seed) runs are reused on a rerun.
    """
    k = int(cfg.folds or 0)
    check_out(cfg.out, "train")
    check_encoder(cfg.encoder)
    with OutputSet(cfg.out, "train") as outputs:
        return _run_folds_into(cfg, k, outputs)


def _run_folds_into(cfg: TrainConfig, k: int, outputs: OutputSet) -> dict[str, Any]:
    started = time.perf_counter()
    out = cfg.out
    bullets = read_table(f"{cfg.data}/bullets.parquet", "bullets").select(["bullet_id", "conversation_id"])
    with JsonlSink(outputs.path("rejects.jsonl")) as rejects:
        ledger = Ledger(rejects)
        labels, label_counts = load_labels(cfg, set(bullets.column("bullet_id").to_pylist()), ledger)
    labelled = bullets.join(labels.select(["bullet_id"]), "bullet_id", join_type="inner")
    fold_of = fold_assignment(labelled.column("conversation_id").to_pylist(), k, cfg.split.seed)

    runs: list[dict[str, Any]] = []
    per_fold: list[dict[str, Any]] = []
    for i in range(k):
        assignment = fold_split(fold_of, i, cfg.split)
        convs = {s: sorted(c for c, v in assignment.items() if v == s) for s in ("train", "valid", "test")}
        fold_dir = out / f"fold{i}"
        fold_dir.mkdir(parents=True, exist_ok=True)
        write_json(fold_dir / FOLD_MANIFEST, {"fold": i, "k": k, "seed": cfg.split.seed, "conversations": convs})
        console.print(f"fold {i + 1}/{k}: test {len(convs['test'])}, train {len(convs['train'])}, "
                      f"valid {len(convs['valid'])} conversations", highlight=False)
        summary = _train_split(cfg.model_copy(update={"out": fold_dir}), assignment, out / "cache")
        runs.extend({**r, "fold": i} for r in summary["runs"])
        per_fold.append({"fold": i, "dir": str(fold_dir), "conversations": {s: len(v) for s, v in convs.items()},
                         "bullets_per_split": summary["split"]["bullets_per_split"], "wall_s": summary["wall_s"],
                         "compute_s": summary["timing"]["compute_s"]})

    by_stage = stage_summary(runs)
    for entry in by_stage.values():
        entry["seeds"] = sorted(set(entry["seeds"]))
        entry["folds"] = k
    result: dict[str, Any] = {
        **_common(cfg),
        "folds": k,
        "labels_counts": label_counts,
        "rejects": {"file": str(out / "rejects.jsonl"), **ledger.summary()},
        "fold_of": dict(sorted(fold_of.items())),
        "per_fold": per_fold,
        "runs": runs,
        "stage_summary": by_stage,
        "wall_s": round(time.perf_counter() - started, 3),
        "timing": time_split(time.perf_counter() - started, sum(f["compute_s"] for f in per_fold)),
        "config": cfg.model_dump(mode="json"),
    }
    write_json(outputs.path("run.json"), result)
    write_text(outputs.path("train.md"), render_fold_report(result))
    return result


def run_timing(wall_s: float, embed_info: dict[str, Any] | None, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the run's wall time went: compute (embedding pass, epochs, prediction; concurrent seeds counted
    once) versus set-up (Ray start, trainers, worker groups, datasets) and I/O. Reused runs did no work."""
    fresh = [r for r in runs if not r.get("reused")]
    spans = [tuple(e["span"]) for r in fresh for e in r.get("epochs") or [] if "span" in e]
    spans += [tuple(r["timing"]["predict_span"]) for r in fresh if "predict_span" in (r.get("timing") or {})]
    embed_s = float((embed_info or {}).get("compute_s") or 0.0)
    stages: dict[str, dict[str, float]] = {}
    for r in fresh:
        entry = stages.setdefault(r["stage"], {"setup_s": 0.0, "epochs_s": 0.0, "predict_s": 0.0})
        for key in entry:
            entry[key] = round(entry[key] + (r.get("timing") or {}).get(key, 0.0), 3)
    return time_split(wall_s, embed_s + busy_seconds(spans), embed_s=round(embed_s, 3),
                      epochs_s=round(sum(e["epochs_s"] for e in stages.values()), 3),
                      predict_s=round(sum(e["predict_s"] for e in stages.values()), 3), stages=stages)


def stage_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage: its seeds, summed wall time, and mean ± std of the validation numbers over seeds."""
    out: dict[str, Any] = {}
    for stage in registry.stage_names():
        rs = [r for r in runs if r["stage"] == stage]
        if not rs:
            continue
        entry: dict[str, Any] = {"seeds": [r["seed"] for r in rs], "wall_s": round(sum(r["wall_s"] for r in rs), 3)}
        for key in ("val_mse", "val_spearman", "best_val_loss"):
            vals = [r[key] for r in rs if r.get(key) is not None]
            if vals:
                entry[key] = {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0}
        out[stage] = entry
    return out


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train every requested (stage, seed): K folds when `cfg.folds` is set, else one split; `cfg.out` may be a
    storage URI (`_run_to_uri`)."""
    if isinstance(cfg.out, str):
        return _run_to_uri(cfg, cfg.out)
    return _run_folds(cfg) if cfg.folds else _train_split(cfg, None, cfg.out / "cache")


def _run_to_uri(cfg: TrainConfig, uri: str) -> dict[str, Any]:
    """Train into this node's working copy of the URI `out` and commit the whole run there as one output set
    (`memprune.work.in_working_copy`: a rerun on any node reuses the finished (stage, seed) runs committed there).

    Ray Train's storage defaults to `<out>/ray`, and a stage that starts from another gets that stage's head from the
    driver in its loop config, so no Ray Train worker reads this node's disk. Reports name the URI, not the working
    copy."""
    ray = cfg.ray.model_copy(update={"storage_path": cfg.ray.storage_path or f"{uri.rstrip('/')}/ray"})
    return in_working_copy(uri, "train", lambda work: run(cfg.model_copy(update={"out": work, "ray": ray})),
                           leave=("cache", "ray"))
