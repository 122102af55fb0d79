"""Stage-2 epochs on MSC-valid-sized synthetic data, bf16 and fp32, then seeds at once on one GPU:
seconds per epoch, GPU utilisation and peak memory (nvidia-smi samples)."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from pydantic import NonNegativeInt, PositiveInt

from .shared import REPO, Child, Precision, Sizes, Some, gpu_sampled, has_cuda, keep_partial, progress, table


class TrainSizes(Sizes):
    """The synthetic corpus (`conversations` x `sessions`), the precisions of one-seed runs, stage 2's epochs and
    how many seeds run at once (in the first precision)."""

    conversations: PositiveInt = 500
    sessions: PositiveInt = 4
    precisions: Some[Precision] = ["bf16", "fp32"]
    epochs: PositiveInt = 2
    seeds: PositiveInt = 3

    @classmethod
    def tiny(cls, bf16: bool) -> TrainSizes:  # one precision: bf16 where the CPU has its kernels
        return cls(conversations=4, sessions=3, precisions=["bf16" if bf16 else "fp32"], epochs=1, seeds=2)


class TrainRun(Sizes):
    """One `run_training` of the check (stage 1 one epoch, stage 2 `epochs`): also a `train_seed` child's sizes."""

    data: str
    labels: str
    epochs: PositiveInt
    precision: Precision
    seeds: list[NonNegativeInt]
    cpus: int


def train_once(job: TrainRun, out: Path) -> dict[str, Any]:
    """`job` through `run_training` into `out`: stage-2 seconds per epoch (the median over its seeds' epochs)."""
    import torch

    from memprune.train import TrainConfig, run_training

    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig.model_validate({
        "data": job.data, "labels": job.labels, "out": out, "stages": ["stage1", "stage2"], "seeds": job.seeds,
        "precision": job.precision, "calibration": {"enabled": False},
        "stage1": {"epochs": 1, "lr": 1e-3, "batch_size": 64, "patience": 1},
        "stage2": {"epochs": job.epochs, "lr": 3e-4, "batch_size": 32, "patience": job.epochs},
        "ray": {"num_workers": 1 if torch.cuda.is_available() else 0, "cpus_per_worker": job.cpus},
        "embed": {"actors": 1, "cpus_per_actor": job.cpus}})
    t0 = time.perf_counter()
    run_training(cfg)
    wall = time.perf_counter() - t0
    epochs = {s: [e["epoch_s"] for e in json.loads((out / "stage2" / f"seed{s}" / "train.json").read_text())["epochs"]]
              for s in job.seeds}
    median = statistics.median(x for v in epochs.values() for x in v)
    return {"precision": job.precision, "stage2_epoch_s": round(median, 3), "epochs": sum(map(len, epochs.values())),
            "wall_s": round(wall, 1)}


def local_ray(cpus: int) -> None:
    """A fresh local Ray instance of `cpus` CPUs (never another process's cluster)."""
    from memprune.raysession import init_local_ray

    init_local_ray(num_cpus=cpus, configure_logging=False, log_to_driver=False)


def run_seed(job: TrainRun, out: Path) -> dict[str, Any]:
    """One seed's training in its own process and Ray instance (seeds at once on one GPU)."""
    local_ray(job.cpus)
    return train_once(job, out)


SEED = Child("train_seed", TrainRun, run_seed)


def run(sizes: TrainSizes, out: Path) -> dict[str, Any]:
    import pyarrow.parquet as pq
    import ray
    from common import child_env
    from train_bench import synthetic

    work = out / "train"
    shutil.rmtree(work, ignore_errors=True)
    data, labels = synthetic(work, sizes.conversations, sizes.sessions)
    cpus = os.cpu_count() or 1

    def job(precision: Precision, seeds: list[int], cpus: int) -> TrainRun:
        return TrainRun(data=str(data), labels=str(labels), epochs=sizes.epochs, precision=precision, seeds=seeds,
                        cpus=cpus)

    local_ray(cpus)
    runs = []
    for precision in sizes.precisions:
        with gpu_sampled({}) as rec:
            rec.update(train_once(job(precision, [0], cpus), work / precision))
        runs.append(rec)
        progress(f"train {precision}: stage-2 epoch {runs[-1]['stage2_epoch_s']} s")
        keep_partial(out, "train", {"conversations": sizes.conversations, "sessions": sizes.sessions, "runs": runs})
    n, precision = sizes.seeds, sizes.precisions[0]
    with gpu_sampled({}) as gpu:
        if has_cuda():  # memprune gives each stage-2 trainer a whole GPU: one process (own Ray) per seed shares it
            ray.shutdown()
            procs = [subprocess.Popen(SEED.command(job(precision, [s], cpus // n), work / f"seed{s}"), stdout=fh,
                                      stderr=subprocess.STDOUT, env=child_env(), cwd=REPO)
                     for s in range(n) for fh in [open(work / f"seed{s}.log", "w")]]
            if any(codes := [p.wait() for p in procs]):
                raise RuntimeError(f"concurrent seed runs exited {codes}; logs: {work}/seed*.log")
            together = statistics.median(json.loads((work / f"seed{s}" / f"{SEED.name}.json").read_text())
                                         ["stage2_epoch_s"] for s in range(n))
        else:  # CPU: memprune's own concurrent seed chains (local mode, one Ray task per seed)
            together = train_once(job(precision, list(range(n)), max(1, cpus // n)), work / "concurrent")[
                "stage2_epoch_s"]
    alone = next(r["stage2_epoch_s"] for r in runs if r["precision"] == precision)
    how = ("one process with its own Ray per seed (memprune gives each stage-2 trainer a whole GPU, so its own seeds "
           "run one after another on one GPU)" if has_cuda() else "memprune's concurrent seed chains (local mode)")
    concurrent = {"seeds": n, "precision": precision, "stage2_epoch_s": round(together, 3), "how": how,
                  "throughput_vs_one_at_a_time": round(n * alone / together, 3), **gpu}
    progress(f"train {n} seeds at once: stage-2 epoch {together:.3f} s each")
    bullets = pq.read_table(data / "bullets.parquet", columns=["bullet_id"]).num_rows
    return {"bullets": bullets, "conversations": sizes.conversations, "sessions": sizes.sessions, "runs": runs,
            "concurrent": concurrent, "device": "cuda" if has_cuda() else "cpu"}


def headline(r: dict[str, Any]) -> str:
    c = r["concurrent"]
    return (", ".join(f"{x['precision']} {x['stage2_epoch_s']} s/epoch" for x in r["runs"])
            + f"; {c['seeds']} seeds at once {c['stage2_epoch_s']} s/epoch each")


def markdown(r: dict[str, Any]) -> list[str]:
    c = r["concurrent"]
    return [f"{r['bullets']} synthetic bullets ({r['conversations']} conversations x {r['sessions']} sessions) "
            f"on {r['device']}. GPU figures: nvidia-smi samples of the whole device (training runs in a Ray "
            "Train worker, so torch.cuda.max_memory_allocated is not visible here). Seeds at once: "
            f"{c['how']}; throughput x{c['throughput_vs_one_at_a_time']} against one seed at a time.", "",
            *table([*({"run": f"{x['precision']}, 1 seed", **x} for x in r["runs"]),
                    {"run": f"{c['precision']}, {c['seeds']} seeds at once", **c}],
                   ["run", "stage2_epoch_s", "gpu_util_mean_pct", "gpu_util_max_pct", "gpu_mem_peak_mib"])]
