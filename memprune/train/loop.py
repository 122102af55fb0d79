"""The Ray Train worker loop of the trained stages (stage 1 and stage 2), also run in-process in local mode.

One run trains one or several seeds in turn (stage 1: every seed in one run, the heads are tiny and
the embeddings cached; stage 2: one seed per run, so seeds spread over GPUs). Per seed,
`_setup_seed` builds the model and optimizer and resumes it from the run's checkpoint, then each
epoch is `_train_epoch`, `_validate`, `_end_epoch` (early stopping) and `_report` (one checkpoint
holding every seed, through `memprune.train.checkpoint`). Each seed keeps its own generator, data
order and early stopping, and each epoch reseeds from (seed, epoch), so a seed trained with others,
alone, or resumed after a kill gives the same result. Batches hold whole sessions, so the listwise
term always sees complete sessions; with several workers each takes whole sessions by a stable hash
and every worker runs the same number of optimizer steps.
"""

from __future__ import annotations

import base64
import os
import signal
import tempfile
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from memprune.config import ConfigModel
from memprune.precision import Precision, grad_scaler
from memprune.scorer import ScorerConfig
from memprune.timing import now
from memprune.train import checkpoint
from memprune.train.checkpoint import LoopState
from memprune.train.config import FaultInjection, LossConfig, OptimConfig, TrainError
from memprune.train.embed import embeddings_to_numpy
from memprune.train.loss import batch_loss, combine_parts
from memprune.train.stages import STAGE_SPECS

TABLES = "tables"  # the key of the train loop config that carries the train and validation tables


class LoopConfig(ConfigModel):
    """What one training worker needs; passed as `train_loop_config` (plain JSON, beside `TABLES`)."""

    stage: str
    seeds: list[int]
    scorer: ScorerConfig  # of the first seed; `seed_scorer` gives each seed's
    optim: OptimConfig
    loss: LossConfig
    # seed -> the head this stage starts from (stage 2: the seed's stage-1 head), safetensors bytes in base64: data,
    # not a path, so a worker on a node without the driver's disk reads it
    init_heads: dict[str, str] = {}
    embedding_dim: int | None = None
    threads: int = 1
    precision: Precision  # of the encoder's passes (stage 2); the weights stay fp32
    local_mode: bool = False  # num_workers == 0: in-process, checkpoints kept under local_checkpoint_dir
    local_checkpoint_dir: str
    fault: FaultInjection | None = None
    train_head: bool = True  # stage 2: false freezes the stage-1 head (only the adapters train)


def session_batches(groups: np.ndarray, batch_size: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    """Row indices cut into batches of whole sessions (a session larger than a batch stays whole).

    With `rng`, the session order is shuffled (training); without, it is sorted (evaluation).
    """
    if len(groups) == 0:
        return []
    uniq, inverse = np.unique(groups, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(inverse, minlength=len(uniq)))])
    session_order = rng.permutation(len(uniq)) if rng is not None else np.arange(len(uniq))
    batches: list[np.ndarray] = []
    current: list[np.ndarray] = []
    size = 0
    for g in session_order:
        members = order[bounds[g] : bounds[g + 1]]
        current.append(members)
        size += len(members)
        if size >= batch_size:
            batches.append(np.concatenate(current))
            current, size = [], 0
    if current:
        batches.append(np.concatenate(current))
    return batches


def read_rows(table: pa.Table, columns: list[str], rank: int, world: int) -> dict[str, Any]:
    """This worker's rows of a whole table: whole sessions chosen by a stable hash, sorted by id."""
    table = table.select(columns)
    if table.num_rows == 0:
        return {"n": 0}
    table = table.sort_by("bullet_id")
    if world > 1:
        mine = [zlib.crc32(g.encode("utf-8")) % world == rank for g in table.column("group").to_pylist()]
        table = table.filter(pa.array(mine))
    rows: dict[str, Any] = {"n": table.num_rows, "group": np.asarray(table.column("group").to_pylist(), dtype=object)}
    rows["label"] = table.column("label").to_numpy().astype(np.float32)
    if "weight" in columns:
        rows["weight"] = table.column("weight").to_numpy().astype(np.float32)
    rows["group_code"] = np.unique(rows["group"], return_inverse=True)[1].astype(np.int64) if table.num_rows else None
    if "embedding" in columns:
        rows["embedding"] = embeddings_to_numpy(table.column("embedding"))
    if "text" in columns:
        rows["text"] = table.column("text").to_pylist()
    return rows


def all_reduce(values: dict[str, float], op: str = "sum") -> dict[str, float]:
    """Sum (or max) a dict of numbers over the workers; the identity with one worker."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


@dataclass
class Worker:
    """The state of one seed's training on this worker between epochs."""

    lc: LoopConfig
    seed: int
    model: Any  # HeadModel | LoraModel
    net: Any  # the module, DDP-wrapped with several workers
    optimizer: Any
    scaler: Any  # fp16 loss scaling, else None
    state: LoopState
    best: dict[str, Any]
    device: Any
    rank: int
    world: int
    train_rows: dict[str, Any]
    valid_rows: dict[str, Any]
    valid_batches: list[np.ndarray]

    @property
    def done(self) -> bool:
        return self.state.epoch >= self.lc.optim.epochs or self.state.bad_epochs >= self.lc.optim.patience


def _resumed(lc: LoopConfig) -> Any:
    """The checkpoint this attempt starts from: Ray Train's, or in local mode the newest one on disk."""
    import ray.train
    from ray.train import Checkpoint

    resumed = ray.train.get_checkpoint()
    if resumed is None and lc.local_mode:
        latest = checkpoint.latest_local(Path(lc.local_checkpoint_dir))
        resumed = Checkpoint.from_directory(str(latest)) if latest is not None else None
    return resumed


def _rows(lc: LoopConfig, tables: dict[str, Any], rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """This worker's train and validation rows (read once, shared by the seeds) of `tables`: the driver's tables
    (local mode) or their object refs."""
    import ray

    columns = STAGE_SPECS[lc.stage].columns()
    train_rows, valid_rows = (read_rows(ray.get(t) if isinstance(t, ray.ObjectRef) else t, columns, rank, world)
                              for t in (tables["train"], tables["valid"]))
    for name, rows in (("train", train_rows), ("valid", valid_rows)):
        if rows["n"] == 0:
            raise TrainError(f"{lc.stage}: worker {rank} of {world} got no {name} sessions; "
                             "use fewer workers or more data")
    return train_rows, valid_rows


def _setup_seed(lc: LoopConfig, seed: int, resumed: Path | None, device: Any, rank: int, world: int,
                rows: tuple[dict[str, Any], dict[str, Any]]) -> Worker:
    """Build one seed's model and optimizer and resume them from the run's checkpoint (`resumed`)."""
    import ray.train.torch
    import torch

    spec = STAGE_SPECS[lc.stage]
    assert spec.model is not None, f"{lc.stage} is not a trained stage"
    torch.manual_seed(seed)
    scorer = lc.scorer.model_copy(update={"seed": seed})
    init = lc.init_heads.get(str(seed))
    model = spec.model(scorer, seed, lc.embedding_dim, base64.b64decode(init) if init else None, lc.precision, device)
    # on `device` before the optimizer and its restored state
    if not lc.train_head and hasattr(model.module, "head"):
        model.module.head.requires_grad_(False)
    params = [p for p in model.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lc.optim.lr, weight_decay=lc.optim.weight_decay)
    state, best = LoopState(), model.trainable_state()
    saved = resumed / f"seed{seed}" if resumed is not None else None
    if saved is not None and (saved / "weights.safetensors").exists():
        weights, best, state = checkpoint.restore(saved, optimizer)
        model.load_trainable(weights)
    elif saved is not None and (saved / "state.json").exists():  # finished before the restart: its result only
        best, state_json = checkpoint.read_result(saved)
        state = LoopState.from_json(state_json)
    w = Worker(lc, seed, model, model.module, optimizer, grad_scaler(lc.precision, device), state, best, device, rank,
               world, rows[0], rows[1], [])
    if w.done:  # finished before a restart: kept as it was, never trained again
        return w
    state.starts.append(state.epoch)
    w.net = ray.train.torch.prepare_model(model.module, move_to_device=False) if world > 1 else model.module
    w.valid_batches = session_batches(rows[1]["group"], lc.optim.batch_size, None)
    return w


def _batch_parts(w: Worker, net: Any, rows: dict[str, Any], idx: np.ndarray) -> tuple[Any, dict[str, float]]:
    import torch

    logits = w.model.logits(net, rows, idx, w.device)
    labels = torch.as_tensor(rows["label"][idx], device=w.device)
    groups = torch.as_tensor(rows["group_code"][idx], device=w.device)
    weights = torch.as_tensor(rows["weight"][idx], device=w.device)
    return batch_loss(logits, labels, groups, w.lc.loss, weights)


def _train_epoch(w: Worker, batches: list[np.ndarray], steps: int, epoch: int) -> dict[str, float]:
    """`steps` optimizer steps (equal on every worker: short shards wrap around, counted once); summed parts."""
    totals = {"sse": 0.0, "n": 0.0, "kl": 0.0, "groups": 0.0}
    w.net.train(True)
    for step in range(steps):
        loss_value, parts = _batch_parts(w, w.net, w.train_rows, batches[step % len(batches)])
        w.optimizer.zero_grad(set_to_none=True)
        if w.scaler is None:
            loss_value.backward()
            w.optimizer.step()
        else:
            w.scaler.scale(loss_value).backward()
            w.scaler.step(w.optimizer)
            w.scaler.update()
        _maybe_die(w, epoch, step)
        if step < len(batches):
            for k in totals:
                totals[k] += parts[k]
    return totals


def _validate(w: Worker) -> dict[str, float]:
    """Validation sums over this worker's sessions (the unwrapped module: no DDP collectives), with the sum and
    count of per-session Spearman rhos (the ranking metric Tune selects on; batches hold whole sessions)."""
    import torch

    from memprune.evaluate.metrics import session_spearman

    totals = {"sse": 0.0, "n": 0.0, "kl": 0.0, "groups": 0.0, "rho_sum": 0.0, "rho_n": 0.0}
    w.model.module.eval()
    with torch.no_grad():
        for idx in w.valid_batches:
            logits = w.model.logits(w.model.module, w.valid_rows, idx, w.device)
            labels = torch.as_tensor(w.valid_rows["label"][idx], device=w.device)
            groups = torch.as_tensor(w.valid_rows["group_code"][idx], device=w.device)
            weights = torch.as_tensor(w.valid_rows["weight"][idx], device=w.device)
            _, parts = batch_loss(logits, labels, groups, w.lc.loss, weights)
            for k in ("sse", "n", "kl", "groups"):
                totals[k] += parts[k]
            scores, codes = logits.float().cpu().numpy(), w.valid_rows["group_code"][idx]
            for g in np.unique(codes):
                rho = session_spearman(w.valid_rows["label"][idx][codes == g], scores[codes == g])
                if np.isfinite(rho):
                    totals["rho_sum"], totals["rho_n"] = totals["rho_sum"] + rho, totals["rho_n"] + 1
    return totals


def session_rho(sums: dict[str, float]) -> float:
    """Mean per-session Spearman from summed `rho_sum` / `rho_n` (NaN when no session has varying labels)."""
    return sums["rho_sum"] / sums["rho_n"] if sums.get("rho_n") else float("nan")


def _maybe_die(w: Worker, epoch: int, step: int) -> None:
    """Testing aid (`fault`): SIGKILL rank 0 once, at the first step of the epoch after `after_epoch`."""
    import ray.train

    fault, lc = w.lc.fault, w.lc
    if not (fault is not None and fault.stage == lc.stage and fault.seed in (None, w.seed)
            and epoch == fault.after_epoch + 1 and step == 0
            and w.rank == 0 and not lc.local_mode and not Path(fault.marker).exists()):
        return
    # wait until the controller has registered the last checkpoint, then die without cleanup;
    # O_EXCL makes the kill happen once even when several trainers reach this point together
    ray.train.get_all_reported_checkpoints(timeout_s=60)
    try:
        fd = os.open(fault.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, f"killed pid {os.getpid()} in {lc.stage} seed {w.seed} epoch {epoch}\n".encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def _end_epoch(w: Worker, epoch: int, tr: dict[str, float], va: dict[str, float], started: float,
               steps: int) -> dict[str, Any]:
    """Early-stopping bookkeeping after an epoch; returns the metrics to report."""
    improved = va["loss"] < w.state.best_val_loss - w.lc.optim.min_delta
    w.state.epoch = epoch
    if improved:
        w.state.best_val_loss, w.state.best_epoch, w.state.bad_epochs = va["loss"], epoch, 0
        w.best = w.model.trainable_state()
    else:
        w.state.bad_epochs += 1
    metrics = {"epoch": epoch, "train_loss": tr["loss"], "train_mse": tr["mse"], "val_loss": va["loss"],
               "val_mse": va["mse"], "val_rank": va["rank"], "val_session_spearman": va["session_spearman"], "epoch_s": round(now() - started, 4),
               "span": [started, now()], "steps": steps, "precision": w.model.precision}
    w.state.history.append(metrics)
    return {**metrics, "best_epoch": w.state.best_epoch, "best_val_loss": w.state.best_val_loss}


def _save_all(directory: Path, workers: list[Worker]) -> None:
    """One checkpoint of the run: the seed in training in full, the finished seeds' results (best weights, state)."""
    for w in workers:
        meta = {"stage": w.lc.stage, "seed": w.seed}
        if w.state.epoch == 0:  # not started: a restart starts it afresh, as this run will
            continue
        if w.done:
            checkpoint.save_result(directory / f"seed{w.seed}", w.best, w.state, meta)
        else:
            checkpoint.save(directory / f"seed{w.seed}", w.model.trainable_state(), w.best, w.optimizer, w.state, meta)


def _report(workers: list[Worker], report: dict[str, Any], step: int) -> None:
    """Report a (seed, epoch) with a checkpoint of the run: local mode keeps it on disk, rank 0 hands it to Ray."""
    import ray.train
    from ray.train import Checkpoint

    w = workers[-1]
    name = f"step_{step:05d}"
    if w.lc.local_mode:
        target = checkpoint.save_local(Path(w.lc.local_checkpoint_dir), name, lambda d: _save_all(d, workers))
        ray.train.report(report, checkpoint=Checkpoint.from_directory(str(target)))
    elif w.rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            _save_all(Path(tmp), workers)
            ray.train.report(report, checkpoint=Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
    else:
        ray.train.report(report, checkpoint=None)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The Ray Train worker function of the trained stages (`config` is a `LoopConfig` as JSON, and under `TABLES`
    the train and validation tables)."""
    import ray.train
    import ray.train.torch
    import torch

    lc = LoopConfig.model_validate({k: v for k, v in config.items() if k != TABLES})
    torch.set_num_threads(max(1, lc.threads))
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = torch.device("cpu") if lc.local_mode else ray.train.torch.get_device()
    resumed = _resumed(lc)
    rows = _rows(lc, config[TABLES], rank, world)
    workers: list[Worker] = []
    reported = False
    with (resumed.as_directory() if resumed is not None else nullcontext(None)) as d:
        for seed in lc.seeds:
            workers.append(_setup_seed(lc, seed, Path(d) if d else None, device, rank, world, rows))
    step = sum(w.state.epoch for w in workers)
    for w in workers:
        while not w.done:
            epoch = w.state.epoch + 1
            started = now()
            torch.manual_seed(w.seed * 100_003 + epoch)
            rng = np.random.default_rng([w.seed, epoch])
            train_batches = session_batches(w.train_rows["group"], lc.optim.batch_size, rng)
            steps = int(all_reduce({"steps": float(len(train_batches))}, op="max")["steps"])
            tr = combine_parts(all_reduce(_train_epoch(w, train_batches, steps, epoch)), lc.loss)
            va_sums = all_reduce(_validate(w))
            va = {**combine_parts(va_sums, lc.loss), "session_spearman": session_rho(va_sums)}
            step += 1
            _report(workers, {"seed": w.seed, **_end_epoch(w, epoch, tr, va, started, steps)}, step)
            reported = True
    if lc.local_mode and not reported and resumed is not None:
        # a finished run resumed in local mode: hand its last checkpoint back as the result
        ray.train.report({"seeds": lc.seeds}, checkpoint=resumed)
