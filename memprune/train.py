"""`memprune train`: the scorer's stages (vanilla, stage 1, stage 2) over seeds, on Ray Train.

Pipeline (DESIGN step 3):

1. Join `DATA/bullets.parquet` with `LABELS/labels.parquet`. Bullets without a label are
   counted (`n_unlabeled`), labels that are unusable (NaN, outside [0, 1], unknown
   bullet) go to `OUT/rejects.jsonl` with the reason.
2. Split by conversation (`memprune.splits`), deterministic from `split.seed`.
3. Stage 1 and vanilla use frozen encoder embeddings: computed once for every labelled
   bullet by Ray Data batch inference (an actor pool) and cached in `OUT/cache/`.
4. `vanilla`: pretrained encoder + head initialised from the seed, untrained.
   `stage1`: the same head, trained on the cached embeddings (an epoch costs only the head).
   `stage2`: starts from the stage-1 head of the same seed and trains LoRA adapters on
   the encoder together with the head.
   Each trained (stage, seed) is one `TorchTrainer`: Ray Datasets in, one checkpoint per
   epoch (safetensors), retention by validation loss, `FailureConfig` retries resume from
   the latest checkpoint, early stopping on validation loss. Seeds run concurrently (one
   Ray task per seed drives its stage1 -> stage2 chain) as far as the cluster allows.
5. Artifacts: `OUT/<stage>/seed<k>/` with the scorer (`memprune.scorer` format),
   `predictions.parquet` (valid and test) and `train.json`; `OUT/run.json` and `OUT/train.md`.

Several label tables (`labels: [DIR, ...]`) can be mixed: every row's loss weight is the
weight of its source (`label_weights`, by the `source` column: judge, qa, usage; 1 when
not given), and a bullet labelled by several tables keeps the row of the highest-weight
source (ties: the table listed first); the rows it supersedes are counted and written to
the rejects. `folds: K` trains K times, each time holding out one fold of conversations
as the test split (`run_folds`), into OUT/fold<i>/; `memprune evaluate` pools them.

The objective is (weighted) MSE plus, optionally, a within-session listwise term (KL divergence
between the softmax of the labels and the softmax of the predicted logits of each
session in a batch; `loss.rank_weight`, 0 = off). Batches are built from whole sessions
so that term sees every session completely.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import tempfile
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from rich.console import Console

from memprune.io import JsonlSink, atomic_path, read_table, write_json, write_table
from memprune.raysession import ensure_ray
from memprune.rejects import Ledger
from memprune.scorer import (
    DEFAULT_ENCODER,
    HeadSettings,
    LoraSettings,
    ScorerConfig,
    canonical_encoder,
    head_input_dim,
    save_artifact,
)
from memprune.splits import UNUSED, SplitConfig, split_conversations

STAGES = ("vanilla", "stage1", "stage2")
Stage = Literal["vanilla", "stage1", "stage2"]
TRAIN_FORMAT = 1
console = Console(stderr=True)

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


class TrainError(ValueError):
    """The training inputs or settings cannot be used; the message names the file or key."""


# =================================================================== configuration


class OptimConfig(BaseModel):
    """Optimisation of one trained stage: AdamW, epochs with early stopping on validation loss."""

    model_config = ConfigDict(extra="forbid")

    epochs: int = Field(ge=1)
    lr: float = Field(gt=0)
    batch_size: int = Field(ge=1)
    patience: int = Field(ge=1, description="stop after this many epochs without a validation improvement")
    weight_decay: float = Field(0.01, ge=0)
    min_delta: float = Field(0.0, ge=0, description="an improvement must lower val_loss by more than this")


class Stage2Config(OptimConfig):
    """Stage 2: LoRA adapters on the encoder, trained with the head."""

    lora: LoraSettings = Field(default_factory=LoraSettings)


class LossConfig(BaseModel):
    """MSE plus an optional within-session listwise ranking term (off by default)."""

    model_config = ConfigDict(extra="forbid")

    rank_weight: float = Field(0.0, ge=0)
    rank_temperature: float = Field(0.1, gt=0, description="softmax temperature applied to the labels")


class RayTrainSettings(BaseModel):
    """How the trainers run: workers per trainer (0 = local mode, in-process), GPUs, fault tolerance."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(None, description="ray.init address; None = RAY_ADDRESS or a local instance")
    num_workers: int = Field(1, ge=0)
    use_gpu: bool | Literal["auto"] = "auto"
    cpus_per_worker: float = Field(1.0, gt=0)
    max_concurrent: int | None = Field(None, ge=1, description="trainers at once; None = what the cluster fits")
    max_failures: int = Field(2, ge=-1)
    num_to_keep: int = Field(2, ge=1, description="checkpoints kept by validation loss (the latest is always kept)")
    storage_path: str | None = Field(None, description="Ray Train storage (shared on clusters); default OUT/ray")


class EmbedSettings(BaseModel):
    """Ray Data batch inference of the frozen-encoder embeddings."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(128, ge=1)
    actors: int | None = Field(None, ge=1, description="actor pool size; None = one per GPU, else one per CPU")
    cpus_per_actor: float = Field(1.0, gt=0)
    use_gpu: bool | Literal["auto"] = "auto"


class FaultInjection(BaseModel):
    """Testing aid: SIGKILL the rank-0 worker once, mid-epoch, to exercise FailureConfig resume."""

    model_config = ConfigDict(extra="forbid")

    stage: Literal["stage1", "stage2"] = "stage1"
    seed: int | None = Field(None, description="only this seed's trainer (None: whichever gets there first)")
    after_epoch: int = Field(1, ge=1, description="kill during the epoch after this one")
    marker: str = Field(description="file created before the kill; the kill happens only if it is absent")


class TrainConfig(BaseModel):
    """Everything `memprune train` needs; YAML configs and CLI flags validate into this."""

    model_config = ConfigDict(extra="forbid")

    data: Path
    labels: list[Path] = Field(min_length=1, description="label dirs (labels.parquet); several are mixed")
    out: Path
    label_weights: dict[str, float] = Field(
        default_factory=dict, description="loss weight per label source (judge, qa, usage); 1 when not given")
    folds: int | None = Field(None, ge=2, description="k-fold by conversation: train K times, each fold held out once")
    stages: list[Stage] = Field(default_factory=lambda: list(STAGES))
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    encoder: str = DEFAULT_ENCODER
    max_length: int = Field(64, ge=8)
    normalize: bool = False
    text_prefix: str = ""
    head: HeadSettings = Field(default_factory=HeadSettings)
    split: SplitConfig = Field(default_factory=SplitConfig)
    stage1: OptimConfig = Field(
        default_factory=lambda: OptimConfig(epochs=60, lr=1e-3, batch_size=64, patience=6)
    )
    stage2: Stage2Config = Field(
        default_factory=lambda: Stage2Config(epochs=3, lr=3e-4, batch_size=32, patience=1)
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    ray: RayTrainSettings = Field(default_factory=RayTrainSettings)
    embed: EmbedSettings = Field(default_factory=EmbedSettings)
    predict_batch_size: int = Field(64, ge=1)
    evaluate: bool = Field(True, description="end by running `memprune evaluate` on this run into OUT/eval")
    fault: FaultInjection | None = None

    @field_validator("labels", mode="before")
    @classmethod
    def _labels_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, (str, os.PathLike)) else v

    @field_validator("label_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        from memprune.sources import SOURCES

        for source, w in v.items():
            if source not in SOURCES:
                raise ValueError(f"label_weights: unknown source {source!r}; known: {', '.join(SOURCES)}")
            if not (math.isfinite(w) and w > 0):
                raise ValueError(f"label_weights.{source}: weight must be a positive number, got {w}")
        return v

    def weight_of(self, source: str) -> float:
        """The loss weight of a label row from `source`."""
        return float(self.label_weights.get(source, 1.0))

    @field_validator("stages")
    @classmethod
    def _stages(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one stage is needed")
        return [s for s in STAGES if s in set(v)]

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("at least one seed is needed")
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate seeds in {v}")
        return v

    @model_validator(mode="after")
    def _paths(self) -> "TrainConfig":
        self.data, self.out = (Path(p).expanduser().resolve() for p in (self.data, self.out))
        self.labels = [Path(p).expanduser().resolve() for p in self.labels]
        self.encoder = canonical_encoder(self.encoder)
        return self

    def scorer_config(self, stage: str | None = None, seed: int | None = None) -> ScorerConfig:
        """The `ScorerConfig` of a (stage, seed) artifact (LoRA settings only for stage 2)."""
        return ScorerConfig(
            encoder=self.encoder,
            max_length=self.max_length,
            normalize=self.normalize,
            text_prefix=self.text_prefix,
            head=self.head,
            lora=self.stage2.lora if stage == "stage2" else None,
            stage=stage,
            seed=seed,
        )


def load_train_config(
    path: str | os.PathLike[str] | None, overrides: list[str] | None = None, values: dict[str, Any] | None = None
) -> TrainConfig:
    """A `TrainConfig` from a YAML file (optional), `key=value` overrides, then dotted-key typed `values`."""
    from memprune.config import load_config

    return load_config(path, overrides, TrainConfig, values)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()


# =================================================================== data


def load_labels(cfg: TrainConfig, known: set[str], ledger: Ledger) -> tuple[pa.Table, dict[str, Any]]:
    """Read every label table of `cfg.labels`, reject unusable rows, resolve bullets labelled twice.

    Each row gets the loss weight of its source (`cfg.label_weights`; a table without a
    `source` column is `judge`). Conflict rule: a bullet labelled by several rows keeps the
    row whose source has the highest weight; on a tie, the row of the table listed first.
    Superseded rows are rejected with the winner named (so seen = written + rejected holds).
    Returns (bullet_id, label, weight, source) sorted by bullet_id, and the counts.
    """
    best: dict[str, tuple[float, int, float, str, str]] = {}  # bullet -> (weight, -table, label, source, path)
    n_rows = n_invalid = n_superseded = 0
    by_source: dict[str, int] = {}
    for t_index, label_dir in enumerate(cfg.labels):
        labels_path = label_dir / "labels.parquet"
        table = read_table(labels_path, "labels")
        n = table.num_rows
        n_rows += n
        ledger.saw("label", n)
        sources = table.column("source").to_pylist() if "source" in table.column_names else ["judge"] * n
        for bid, y, src in zip(table.column("bullet_id").to_pylist(), table.column("label").to_pylist(), sources):
            reason = None
            if bid not in known:
                reason = "label for a bullet_id that is not in bullets.parquet"
            elif y is None or not math.isfinite(y):
                reason = "label is not a finite number"
            elif not 0.0 <= y <= 1.0:
                reason = "label outside [0, 1]"
            if reason is not None:
                n_invalid += 1
                ledger.reject(source=str(labels_path), record=str(bid), field="label", kind="label", reason=reason,
                              value=y)
                continue
            row = (cfg.weight_of(src), -t_index, float(y), src, str(labels_path))
            cur = best.get(bid)
            if cur is None or row[:2] > cur[:2]:
                best[bid] = row
                loser = cur
            else:
                loser = row
            if loser is not None:
                winner = best[bid]
                n_superseded += 1
                ledger.reject(source=loser[4], record=str(bid), field="label", kind="label",
                              reason=f"superseded: the bullet is also labelled by source {winner[3]!r} "
                                     f"(weight {winner[0]:g}) in {winner[4]}", value=loser[2])
    ledger.wrote("label", len(best))
    ids = sorted(best)
    for bid in ids:
        by_source[best[bid][3]] = by_source.get(best[bid][3], 0) + 1
    resolved = pa.table({
        "bullet_id": pa.array(ids, pa.string()),
        "label": pa.array([best[b][2] for b in ids], pa.float64()),
        "weight": pa.array([best[b][0] for b in ids], pa.float64()),
        "source": pa.array([best[b][3] for b in ids], pa.string()),
    })
    counts = {"labels": n_rows, "labels_rejected": n_invalid, "labels_superseded": n_superseded,
              "labels_by_source": dict(sorted(by_source.items()))}
    return resolved, counts


def prepare_data(cfg: TrainConfig, ledger: Ledger,
                 assignment: dict[str, str] | None = None) -> tuple[pa.Table, dict[str, Any]]:
    """Join bullets with labels, reject unusable labels, split by conversation.

    Returns the labelled table (bullet_id, conversation_id, session_index, group, text,
    label, weight, source, split; sorted by bullet_id, 'unused' conversations dropped) and
    the counts. `assignment` (conversation -> split, e.g. one fold of `run_folds`) replaces
    the split of `cfg.split`; conversations it does not name are unused.
    """
    bullets_path = cfg.data / "bullets.parquet"
    bullets = read_table(bullets_path, "bullets").select(["bullet_id", "conversation_id", "session_index", "text"])
    labels, label_counts = load_labels(cfg, set(bullets.column("bullet_id").to_pylist()), ledger)

    joined = bullets.join(labels, "bullet_id", join_type="inner")
    n_unlabeled = bullets.num_rows - joined.num_rows
    if joined.num_rows == 0:
        where = ", ".join(str(d / "labels.parquet") for d in cfg.labels)
        raise TrainError(f"{where}: no usable label matches a bullet of {bullets_path}")
    joined = joined.sort_by("bullet_id")
    group = pc.binary_join_element_wise(
        joined.column("conversation_id"), pc.cast(joined.column("session_index"), pa.string()), "\x1fs"
    )
    conv_ids = joined.column("conversation_id").to_pylist()
    if assignment is None:
        conv_split = split_conversations(conv_ids, cfg.split)
    else:
        conv_split = {c: assignment.get(c, UNUSED) for c in sorted(set(conv_ids))}
    split = pa.array([conv_split[c] for c in conv_ids], pa.string())
    table = joined.append_column("group", group).append_column("split", split)
    table = table.filter(pc.not_equal(table.column("split"), UNUSED))
    table = table.select(["bullet_id", "conversation_id", "session_index", "group", "text", "label", "weight",
                          "source", "split"])

    split_names = ("train", "valid", "test", UNUSED)
    conv_counts = {s: sum(1 for v in conv_split.values() if v == s) for s in split_names}
    bullet_counts = {s: int(pc.sum(pc.equal(split, s)).as_py() or 0) for s in split_names}
    counts = {
        "bullets": bullets.num_rows,
        **label_counts,
        "labeled_bullets": joined.num_rows,
        "unlabeled_bullets": n_unlabeled,
        "conversations": conv_counts,
        "bullets_per_split": bullet_counts,
    }
    return table, counts


def data_fingerprint(table: pa.Table) -> str:
    """Content hash of the training inputs (ids, texts, labels, splits): checkpoints are keyed by it."""
    h = hashlib.sha256()
    cols = ["bullet_id", "text", "label", "split"]
    if "weight" in table.column_names and pc.any(pc.not_equal(table.column("weight"), 1.0)).as_py():
        cols.append("weight")
    for col in cols:
        for chunk in table.column(col).chunks:
            for buf in chunk.buffers():
                if buf is not None:
                    h.update(buf)
    return h.hexdigest()


# =================================================================== embeddings (Ray Data)


class EmbedActor:
    """Ray Data actor: loads the frozen encoder once, maps text batches to mean-pooled embeddings."""

    def __init__(self, scorer_config: dict[str, Any], threads: int, device: str) -> None:
        import torch

        from memprune.scorer import Scorer

        torch.set_num_threads(max(1, threads))
        self.scorer = Scorer.build(ScorerConfig.model_validate(scorer_config), seed=0).to(device)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [str(t) for t in batch["text"]]
        emb = self.scorer.embed(texts, batch_size=max(1, len(texts)))
        return {"bullet_id": batch["bullet_id"], "embedding": emb}


def _embedding_column(emb: np.ndarray) -> pa.FixedSizeListArray:
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), emb.shape[1])


def embeddings_to_numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A fixed-size-list float column as a float32 [n, d] array."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    dim = arr.type.list_size
    return arr.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, dim)


def _gpu_available(setting: bool | str) -> bool:
    import ray

    if setting == "auto":
        return ray.cluster_resources().get("GPU", 0) >= 1
    return bool(setting)


def compute_embeddings(
    table: pa.Table, scorer_config: ScorerConfig, settings: EmbedSettings, cache_dir: Path
) -> tuple[np.ndarray, dict[str, Any]]:
    """Frozen-encoder embeddings of `table` rows (bullet_id, text), in row order, cached on disk.

    The cache key covers the encoder, pooling settings and every (bullet_id, text): a rerun
    with the same inputs reads the cache instead of running the encoder again.
    """
    import ray
    from ray.data import ActorPoolStrategy

    enc_cfg = scorer_config.model_copy(update={"lora": None, "stage": None, "seed": None})
    key = _digest(
        {
            "encoder": enc_cfg.encoder,
            "max_length": enc_cfg.max_length,
            "normalize": enc_cfg.normalize,
            "prefix": enc_cfg.text_prefix,
            "rows": hashlib.sha256(
                b"".join(
                    b.encode("utf-8") + b"\x00" + t.encode("utf-8") + b"\x01"
                    for b, t in zip(table.column("bullet_id").to_pylist(), table.column("text").to_pylist())
                )
            ).hexdigest(),
        }
    )[:20]
    cache = cache_dir / f"embeddings-{key}.parquet"
    info: dict[str, Any] = {"cache": str(cache), "rows": table.num_rows}
    if cache.exists():
        cached = pq.read_table(cache)
        if cached.column("bullet_id").to_pylist() == table.column("bullet_id").to_pylist():
            info.update(reused=True, seconds=0.0)
            return embeddings_to_numpy(cached.column("embedding")), info
    started = time.perf_counter()
    use_gpu = _gpu_available(settings.use_gpu)
    if settings.actors is not None:
        actors = settings.actors
    elif use_gpu:
        actors = int(ray.cluster_resources().get("GPU", 1))
    else:
        actors = max(1, int(ray.cluster_resources().get("CPU", 1) // settings.cpus_per_actor))
    source = table.select(["bullet_id", "text"])
    n_blocks = max(1, min(actors * 4, math.ceil(source.num_rows / settings.batch_size)))
    step = math.ceil(source.num_rows / n_blocks)
    blocks = [source.slice(i, step) for i in range(0, source.num_rows, step)]
    ds = ray.data.from_arrow(blocks).map_batches(
        EmbedActor,
        fn_constructor_kwargs={
            "scorer_config": enc_cfg.model_dump(mode="json"),
            "threads": int(max(1, settings.cpus_per_actor)),
            "device": "cuda" if use_gpu else "cpu",
        },
        batch_size=settings.batch_size,
        batch_format="numpy",
        compute=ActorPoolStrategy(size=min(actors, len(blocks))),
        num_cpus=settings.cpus_per_actor,
        num_gpus=1 if use_gpu else 0,
    )
    ids: list[str] = []
    parts: list[np.ndarray] = []
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        ids.extend(str(b) for b in batch["bullet_id"])
        emb = batch["embedding"]
        parts.append(np.stack(emb) if emb.dtype == object else np.asarray(emb))
    emb = np.concatenate(parts).astype(np.float32)
    position = {b: i for i, b in enumerate(ids)}
    order = np.array([position[b] for b in table.column("bullet_id").to_pylist()], dtype=np.int64)
    emb = emb[order]
    info.update(
        reused=False, seconds=round(time.perf_counter() - started, 3), actors=min(actors, len(blocks)), gpu=use_gpu
    )
    write_table(pa.table({"bullet_id": table.column("bullet_id"), "embedding": _embedding_column(emb)}), cache)
    return emb, info


# =================================================================== pure training pieces


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


def listwise_kl(logits: "Any", labels: "Any", groups: "Any", temperature: float) -> tuple["Any", int]:
    """Sum over sessions of KL(softmax(labels / T) || softmax(logits)), and the number of sessions used.

    Only sessions with at least two bullets and non-constant labels take part; the term
    is 0 exactly when the predicted logits order and space the bullets like the labels.
    """
    import torch

    total = logits.new_zeros(())
    used = 0
    for g in torch.unique(groups):
        idx = (groups == g).nonzero(as_tuple=True)[0]
        if idx.numel() < 2:
            continue
        y = labels[idx]
        if bool((y.max() - y.min()) <= 1e-12):
            continue
        target = torch.softmax(y / temperature, dim=0)
        log_q = torch.log_softmax(logits[idx], dim=0)
        total = total + torch.sum(target * (torch.log(target.clamp_min(1e-12)) - log_q))
        used += 1
    return total, used


def batch_loss(
    logits: "Any", labels: "Any", groups: "Any", loss: LossConfig, weights: "Any" = None
) -> tuple["Any", dict[str, float]]:
    """The training objective of one batch: (weighted) mean MSE (+ rank_weight x mean session KL); and its parts.

    With per-row `weights` (label-source weights) the MSE is sum(w * err^2) / sum(w);
    without, every row weighs 1 (the plain mean).
    """
    import torch

    scores = torch.sigmoid(logits)
    if weights is None:
        sse = torch.sum((scores - labels) ** 2)
        n = float(labels.numel())
    else:
        sse = torch.sum(weights * (scores - labels) ** 2)
        n = float(weights.sum())
    value = sse / max(1e-12, n) if n else sse
    parts = {"sse": float(sse.detach()), "n": n, "kl": 0.0, "groups": 0.0}
    if loss.rank_weight > 0:
        kl, used = listwise_kl(logits, labels, groups, loss.rank_temperature)
        if used:
            value = value + loss.rank_weight * kl / used
        parts["kl"], parts["groups"] = float(kl.detach()), float(used)
    return value, parts


def combine_parts(parts: dict[str, float], loss: LossConfig) -> dict[str, float]:
    """Summed batch parts -> mse, rank term and the objective (mse + rank_weight x rank)."""
    mse = parts["sse"] / parts["n"] if parts["n"] > 0 else 0.0
    rank = parts["kl"] / parts["groups"] if parts["groups"] else 0.0
    return {"mse": mse, "rank": rank, "loss": mse + (loss.rank_weight * rank if loss.rank_weight > 0 else 0.0)}


def optimizer_tensors(optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """An optimizer state dict split into safetensors-able tensors and JSON metadata (no pickle)."""
    import torch

    sd = optimizer.state_dict()
    tensors: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_state(tensors: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Rebuild an optimizer state dict from `optimizer_tensors` output."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in list(tensors.items()) + list(meta.get("scalars", {}).items()):
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


# =================================================================== the train loop (runs on each worker)


class LoopConfig(BaseModel):
    """What one training worker needs; passed as `train_loop_config` (plain JSON)."""

    model_config = ConfigDict(extra="forbid")

    stage: Literal["stage1", "stage2"]
    seed: int
    scorer: dict[str, Any]
    optim: dict[str, Any]
    loss: LossConfig
    init_dir: str | None = None
    embedding_dim: int | None = None
    threads: int = 1
    local_checkpoint_dir: str
    fault: FaultInjection | None = None


@dataclass
class _State:
    epoch: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    best_epoch: int | None = None
    best_val_loss: float = math.inf
    bad_epochs: int = 0
    starts: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "history": self.history,
            "best_epoch": self.best_epoch,
            "best_val_loss": self.best_val_loss if math.isfinite(self.best_val_loss) else None,
            "bad_epochs": self.bad_epochs,
            "starts": self.starts,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "_State":
        best = d.get("best_val_loss")
        return cls(
            epoch=int(d["epoch"]),
            history=list(d["history"]),
            best_epoch=d.get("best_epoch"),
            best_val_loss=math.inf if best is None else float(best),
            bad_epochs=int(d["bad_epochs"]),
            starts=list(d.get("starts", [])),
        )


def _read_rows(shard: Any, columns: list[str], rank: int, world: int) -> dict[str, Any]:
    """This worker's rows of a (non-split) Ray Dataset: whole sessions chosen by a stable hash, sorted by id."""
    tables = [pa.Table.from_batches([b]) if isinstance(b, pa.RecordBatch) else b
              for b in shard.iter_batches(batch_size=4096, batch_format="pyarrow")]
    table = pa.concat_tables(tables).select(columns) if tables else None
    if table is None or table.num_rows == 0:
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


class _LogitModel:
    """Builds the trainable module of a stage and maps row batches to logits."""

    def __init__(self, lc: LoopConfig) -> None:
        import torch
        from safetensors.torch import load_file

        from memprune.scorer import Scorer, build_head

        self.lc = lc
        scfg = ScorerConfig.model_validate(lc.scorer)
        if lc.stage == "stage1":
            if lc.embedding_dim is None:
                raise TrainError("stage1 needs embedding_dim")
            self.module: torch.nn.Module = build_head(lc.embedding_dim, scfg.head, lc.seed)
            self.scorer = None
        else:
            base = scfg.model_copy(update={"lora": None})
            scorer = Scorer.build(base, seed=lc.seed)
            if lc.init_dir is None:
                raise TrainError("stage2 needs the stage-1 artifact of the same seed (init_dir)")
            scorer.head.load_state_dict(load_file(str(Path(lc.init_dir) / "head.safetensors")))
            if scfg.lora is None:
                raise TrainError("stage2 needs LoRA settings")
            scorer.add_lora(scfg.lora, seed=lc.seed)
            scorer.freeze_encoder()
            self.module = scorer
            self.scorer = scorer

    def trainable_state(self) -> dict[str, Any]:
        """Head weights as `head.*`, LoRA adapter weights as `adapter.*` (CPU copies)."""
        if self.scorer is None:
            return {f"head.{k}": v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        out = {f"head.{k}": v.clone() for k, v in self.scorer.head_state().items()}
        out.update({f"adapter.{k}": v.clone() for k, v in self.scorer.adapter_state().items()})
        return out

    def load_trainable(self, state: dict[str, Any]) -> None:
        head = {k[5:]: v for k, v in state.items() if k.startswith("head.")}
        if self.scorer is None:
            self.module.load_state_dict(head)
        else:
            self.scorer.head.load_state_dict(head)
            self.scorer.load_adapter_state({k[8:]: v for k, v in state.items() if k.startswith("adapter.")})

    def logits(self, model: Any, rows: dict[str, Any], idx: np.ndarray, device: Any) -> Any:
        """Logits of rows `idx` through `model` (the module, or its DDP wrapper)."""
        import torch

        if self.scorer is None:
            return model(torch.as_tensor(rows["embedding"][idx], device=device))
        tokens = self.scorer.tokenize([rows["text"][i] for i in idx], device)
        return _forward_logits(model, tokens)


def _forward_logits(model: Any, tokens: dict[str, Any]) -> Any:
    """Scorer logits through a possibly DDP-wrapped scorer (DDP hooks need `model(...)`)."""
    import torch

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model(**tokens, return_logits=True)
    return model.logits(**tokens)


def _all_reduce(values: dict[str, float], op: str = "sum") -> dict[str, float]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def _save_checkpoint(directory: Path, model: _LogitModel, best: dict[str, Any], optimizer: Any, state: _State,
                     meta: dict[str, Any]) -> None:
    """Write a checkpoint directory: current and best weights, optimizer state, loop state (all safetensors/JSON)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(model.trainable_state(), str(directory / "weights.safetensors"))
    save_file(best, str(directory / "best.safetensors"))
    tensors, opt_meta = optimizer_tensors(optimizer)
    save_file(tensors, str(directory / "optimizer.safetensors"))
    (directory / "optimizer.json").write_text(json.dumps(opt_meta), encoding="utf-8")
    (directory / "state.json").write_text(json.dumps({**state.to_json(), **meta}), encoding="utf-8")


def _latest_local_checkpoint(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("epoch_*") if (p / "state.json").exists()) if root.exists() else []
    return done[-1] if done else None


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The Ray Train worker function of stage 1 and stage 2 (also run in-process in local mode).

    Resumes from `ray.train.get_checkpoint()` (or, in local mode, the newest local
    checkpoint); each epoch reseeds from (seed, epoch), so a resumed run repeats exactly
    what an uninterrupted one would have done.
    """
    import ray.train
    import ray.train.torch
    import torch
    from ray.train import Checkpoint
    from safetensors.torch import load_file

    lc = LoopConfig.model_validate(config)
    torch.set_num_threads(max(1, lc.threads))
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    try:
        from ray.train.v2._internal.execution.train_fn_utils import LocalTrainFnUtils, get_train_fn_utils

        local_mode = isinstance(get_train_fn_utils(), LocalTrainFnUtils)
    except ImportError:  # pragma: no cover - older Ray
        local_mode = False
    device = ray.train.torch.get_device() if not local_mode else torch.device("cpu")
    optim = OptimConfig.model_validate({k: v for k, v in lc.optim.items() if k in OptimConfig.model_fields})

    torch.manual_seed(lc.seed)
    model = _LogitModel(lc)
    model.module.to(device)  # before the optimizer and its restored state
    params = [p for p in model.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay)
    state = _State()
    best = model.trainable_state()

    checkpoint = ray.train.get_checkpoint()
    local_root = Path(lc.local_checkpoint_dir)
    if checkpoint is None and local_mode:
        latest = _latest_local_checkpoint(local_root)
        checkpoint = Checkpoint.from_directory(str(latest)) if latest is not None else None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            d = Path(d)
            model.load_trainable(load_file(str(d / "weights.safetensors")))
            best = load_file(str(d / "best.safetensors"))
            optimizer.load_state_dict(
                optimizer_state(load_file(str(d / "optimizer.safetensors")),
                                json.loads((d / "optimizer.json").read_text(encoding="utf-8")))
            )
            state = _State.from_json(json.loads((d / "state.json").read_text(encoding="utf-8")))
    state.starts.append(state.epoch)
    reported = False

    net: Any = model.module
    if world > 1:
        net = ray.train.torch.prepare_model(model.module, move_to_device=False)

    columns = ["bullet_id", "group", "label", "weight"] + (["embedding"] if lc.stage == "stage1" else ["text"])
    train_rows = _read_rows(ray.train.get_dataset_shard("train"), columns, rank, world)
    valid_rows = _read_rows(ray.train.get_dataset_shard("valid"), columns, rank, world)

    for name, rows in (("train", train_rows), ("valid", valid_rows)):
        if rows["n"] == 0:
            raise TrainError(
                f"{lc.stage} seed {lc.seed}: worker {rank} of {world} got no {name} sessions; "
                "use fewer workers or more data"
            )
    inner: Any = model.module

    def train_epoch(batches: list[np.ndarray], steps: int, epoch: int) -> dict[str, float]:
        """`steps` optimizer steps (equal on every worker: short shards wrap around, counted once)."""
        totals = {"sse": 0.0, "n": 0.0, "kl": 0.0, "groups": 0.0}
        net.train(True)
        for step in range(steps):
            idx = batches[step % len(batches)]
            logits = model.logits(net, train_rows, idx, device)
            labels = torch.as_tensor(train_rows["label"][idx], device=device)
            groups = torch.as_tensor(train_rows["group_code"][idx], device=device)
            weights = torch.as_tensor(train_rows["weight"][idx], device=device)
            loss_value, parts = batch_loss(logits, labels, groups, lc.loss, weights)
            optimizer.zero_grad(set_to_none=True)
            loss_value.backward()
            optimizer.step()
            fault = lc.fault
            if (fault is not None and fault.stage == lc.stage and fault.seed in (None, lc.seed)
                    and epoch == fault.after_epoch + 1 and step == 0
                    and rank == 0 and not local_mode and not Path(fault.marker).exists()):
                # wait until the controller has registered the last checkpoint, then die without cleanup;
                # O_EXCL makes the kill happen once even when several trainers reach this point together
                ray.train.get_all_reported_checkpoints(timeout_s=60)
                try:
                    fd = os.open(fault.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    fd = None
                if fd is not None:
                    os.write(fd, f"killed pid {os.getpid()} in {lc.stage} seed {lc.seed} epoch {epoch}\n".encode())
                    os.close(fd)
                    os.kill(os.getpid(), signal.SIGKILL)
            if step < len(batches):
                for k in totals:
                    totals[k] += parts[k]
        return totals

    @torch.no_grad()
    def evaluate(batches: list[np.ndarray]) -> dict[str, float]:
        """Validation sums over this worker's sessions (the unwrapped module: no DDP collectives)."""
        totals = {"sse": 0.0, "n": 0.0, "kl": 0.0, "groups": 0.0}
        inner.eval()
        for idx in batches:
            logits = model.logits(inner, valid_rows, idx, device)
            labels = torch.as_tensor(valid_rows["label"][idx], device=device)
            groups = torch.as_tensor(valid_rows["group_code"][idx], device=device)
            weights = torch.as_tensor(valid_rows["weight"][idx], device=device)
            _, parts = batch_loss(logits, labels, groups, lc.loss, weights)
            for k in totals:
                totals[k] += parts[k]
        return totals

    valid_batches = session_batches(valid_rows["group"], optim.batch_size, None)
    while state.epoch < optim.epochs and state.bad_epochs < optim.patience:
        epoch = state.epoch + 1
        started = time.perf_counter()
        torch.manual_seed(lc.seed * 100_003 + epoch)
        rng = np.random.default_rng([lc.seed, epoch])
        train_batches = session_batches(train_rows["group"], optim.batch_size, rng)
        steps = int(_all_reduce({"steps": float(len(train_batches))}, op="max")["steps"])
        train_parts = _all_reduce(train_epoch(train_batches, steps, epoch))
        valid_parts = _all_reduce(evaluate(valid_batches))
        tr, va = combine_parts(train_parts, lc.loss), combine_parts(valid_parts, lc.loss)
        improved = va["loss"] < state.best_val_loss - optim.min_delta
        state.epoch = epoch
        if improved:
            state.best_val_loss, state.best_epoch, state.bad_epochs = va["loss"], epoch, 0
            best = model.trainable_state()
        else:
            state.bad_epochs += 1
        metrics = {
            "epoch": epoch,
            "train_loss": tr["loss"],
            "train_mse": tr["mse"],
            "val_loss": va["loss"],
            "val_mse": va["mse"],
            "val_rank": va["rank"],
            "epoch_s": round(time.perf_counter() - started, 4),
            "steps": steps,
        }
        state.history.append(metrics)
        report = {**metrics, "best_epoch": state.best_epoch, "best_val_loss": state.best_val_loss}
        meta = {"stage": lc.stage, "seed": lc.seed}
        if local_mode:
            target = local_root / f"epoch_{epoch:04d}"
            tmp = local_root / f".epoch_{epoch:04d}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            _save_checkpoint(tmp, model, best, optimizer, state, meta)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
            for old in local_root.glob("epoch_*"):
                if old != target:
                    shutil.rmtree(old, ignore_errors=True)
            ray.train.report(report, checkpoint=Checkpoint.from_directory(str(target)))
        elif rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                _save_checkpoint(Path(tmp), model, best, optimizer, state, meta)
                ray.train.report(report, checkpoint=Checkpoint.from_directory(tmp),
                                 checkpoint_dir_name=f"epoch_{epoch:04d}")
        else:
            ray.train.report(report, checkpoint=None)
        reported = True
    if local_mode and not reported and checkpoint is not None and state.history:
        # a finished run resumed in local mode: hand its last checkpoint back as the result
        ray.train.report({**state.history[-1], "best_epoch": state.best_epoch,
                          "best_val_loss": state.best_val_loss}, checkpoint=checkpoint)


# =================================================================== driver side: one (stage, seed)


@dataclass
class _Inputs:
    """The per-split tables (with embeddings where computed) shared by all (stage, seed) runs."""

    tables: dict[str, pa.Table]
    embedding_dim: int | None
    fingerprint: str
    counts: dict[str, Any]


def _artifact_dir(out: Path, stage: str, seed: int) -> Path:
    return out / stage / f"seed{seed}"


def _stage_fingerprint(cfg: TrainConfig, stage: str, seed: int, data_fp: str) -> str:
    payload: dict[str, Any] = {
        "format": TRAIN_FORMAT,
        "stage": stage,
        "seed": seed,
        "data": data_fp,
        "scorer": cfg.scorer_config(stage, seed).model_dump(mode="json"),
        "split": cfg.split.model_dump(mode="json"),
    }
    if stage in ("stage1", "stage2"):
        payload["stage1"] = cfg.stage1.model_dump(mode="json")
        payload["loss"] = cfg.loss.model_dump(mode="json")
        payload["workers"] = cfg.ray.num_workers
    if stage == "stage2":
        payload["stage2"] = cfg.stage2.model_dump(mode="json")
    return _digest(payload)


def _reusable(out_dir: Path, fingerprint: str) -> dict[str, Any] | None:
    """The finished `train.json` of a (stage, seed) with the same fingerprint, if complete."""
    path = out_dir / "train.json"
    if not (path.exists() and (out_dir / "predictions.parquet").exists() and (out_dir / "scorer.json").exists()):
        return None
    try:
        done = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return None
    return done if done.get("fingerprint") == fingerprint else None


def _predictions(table: pa.Table, scores: np.ndarray, stage: str, seed: int) -> pa.Table:
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


def _eval_table(inputs: _Inputs) -> pa.Table:
    return pa.concat_tables([inputs.tables["valid"], inputs.tables["test"]])


def _head_scores(head_state: dict[str, Any], cfg: TrainConfig, dim: int, embeddings: np.ndarray) -> np.ndarray:
    import torch

    from memprune.scorer import Head

    head = Head(dim, cfg.head)
    head.load_state_dict(head_state)
    head.eval()
    with torch.no_grad():
        return torch.sigmoid(head(torch.from_numpy(np.array(embeddings, dtype=np.float32)))).double().numpy()


def _val_mse(pred: pa.Table) -> float | None:
    valid = pred.filter(pc.equal(pred.column("split"), "valid"))
    if valid.num_rows == 0:
        return None
    diff = valid.column("score").to_numpy() - valid.column("label").to_numpy()
    return float(np.mean(diff**2))


def _val_spearman(pred: pa.Table) -> float | None:
    from scipy.stats import spearmanr

    valid = pred.filter(pc.equal(pred.column("split"), "valid"))
    if valid.num_rows < 2:
        return None
    rho = spearmanr(valid.column("label").to_numpy(), valid.column("score").to_numpy()).statistic
    return None if rho is None or not math.isfinite(rho) else float(rho)


def run_vanilla(cfg: TrainConfig, inputs: _Inputs, seed: int) -> dict[str, Any]:
    """The baseline: pretrained encoder + head initialised from `seed`, untrained; writes its artifact."""
    from memprune.scorer import build_head

    started = time.perf_counter()
    out_dir = _artifact_dir(cfg.out, "vanilla", seed)
    fp = _stage_fingerprint(cfg, "vanilla", seed, inputs.fingerprint)
    done = _reusable(out_dir, fp)
    if done is not None:
        return {**done, "reused": True}
    if inputs.embedding_dim is None:
        raise TrainError("vanilla needs the encoder embeddings")
    head = build_head(inputs.embedding_dim, cfg.head, seed)
    head_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    scfg = cfg.scorer_config("vanilla", seed).model_copy(update={"embedding_dim": inputs.embedding_dim})
    save_artifact(out_dir, scfg, head_state)
    table = _eval_table(inputs)
    scores = _head_scores(head_state, cfg, inputs.embedding_dim, embeddings_to_numpy(table.column("embedding")))
    pred = _predictions(table, scores, "vanilla", seed)
    write_table(pred, out_dir / "predictions.parquet")
    summary = _train_summary(cfg, inputs, "vanilla", seed, fp, None, started, pred)
    write_json(out_dir / "train.json", summary)
    return summary


def _train_summary(cfg: TrainConfig, inputs: _Inputs, stage: str, seed: int, fp: str,
                   state: dict[str, Any] | None, started: float, pred: pa.Table,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    optim = {"stage1": cfg.stage1, "stage2": cfg.stage2}.get(stage)
    history = (state or {}).get("history", [])
    return {
        "format": TRAIN_FORMAT,
        "stage": stage,
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
        "val_mse": _val_mse(pred),
        "val_spearman": _val_spearman(pred),
        "wall_s": round(time.perf_counter() - started, 3),
        "n_bullets": {s: inputs.tables[s].num_rows for s in ("train", "valid", "test")},
        "n_unlabeled": inputs.counts["unlabeled_bullets"],
        "optim": optim.model_dump(mode="json") if optim is not None else None,
        "loss": cfg.loss.model_dump(mode="json") if optim is not None else None,
        "reused": False,
        **(extra or {}),
    }


def _scaling(cfg: TrainConfig) -> tuple[Any, bool]:
    from ray.train import ScalingConfig

    use_gpu = cfg.ray.num_workers > 0 and _gpu_available(cfg.ray.use_gpu)
    resources: dict[str, float] = {"CPU": cfg.ray.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1
    if cfg.ray.num_workers == 0:
        return ScalingConfig(num_workers=0), False
    return ScalingConfig(num_workers=cfg.ray.num_workers, use_gpu=use_gpu, resources_per_worker=resources), use_gpu


def run_trained_stage(cfg: TrainConfig, inputs: _Inputs, stage: str, seed: int) -> dict[str, Any]:
    """One TorchTrainer for (stage, seed): train, then write the artifact, predictions and train.json."""
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer
    from safetensors.torch import load_file

    started = time.perf_counter()
    out_dir = _artifact_dir(cfg.out, stage, seed)
    fp = _stage_fingerprint(cfg, stage, seed, inputs.fingerprint)
    done = _reusable(out_dir, fp)
    if done is not None:
        return {**done, "reused": True}
    init_dir = None
    if stage == "stage2":
        init_dir = _artifact_dir(cfg.out, "stage1", seed)
        if _reusable(init_dir, _stage_fingerprint(cfg, "stage1", seed, inputs.fingerprint)) is None:
            raise TrainError(
                f"stage2 seed {seed} starts from the stage-1 head of the same seed, but {init_dir} holds no "
                "finished stage-1 run for these data and settings: include stage1 in --stages"
            )
    storage = _storage(cfg)
    name = f"{stage}-seed{seed}-{fp[:12]}"
    scaling, use_gpu = _scaling(cfg)
    optim = cfg.stage1 if stage == "stage1" else cfg.stage2
    # stage 1 only multiplies [batch, d] by the head: one thread is fastest (more threads only spin)
    threads = 1 if stage == "stage1" else max(1, int(cfg.ray.cpus_per_worker))
    loop = LoopConfig(
        stage=stage,  # type: ignore[arg-type]
        seed=seed,
        scorer=cfg.scorer_config(stage, seed).model_dump(mode="json"),
        optim=optim.model_dump(mode="json"),
        loss=cfg.loss,
        init_dir=str(init_dir) if init_dir else None,
        embedding_dim=inputs.embedding_dim,
        threads=threads,
        local_checkpoint_dir=str(cfg.out / "ray" / name / "local"),
        fault=cfg.fault,
    )
    columns = ["bullet_id", "group", "label", "weight"] + (["embedding"] if stage == "stage1" else ["text"])
    datasets = {s: _dataset(inputs.tables[s].select(columns)) for s in ("train", "valid")}
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
    import torch

    threads = torch.get_num_threads()
    try:
        result = trainer.fit()
    finally:
        torch.set_num_threads(threads)  # local mode trains in this process
    if result.checkpoint is None:
        raise TrainError(f"{stage} seed {seed}: training reported no checkpoint")
    with result.checkpoint.as_directory() as d:
        state = json.loads((Path(d) / "state.json").read_text(encoding="utf-8"))
        best = load_file(str(Path(d) / "best.safetensors"))
    head_state = {k[5:]: v for k, v in best.items() if k.startswith("head.")}
    adapter_state = {k[8:]: v for k, v in best.items() if k.startswith("adapter.")}
    dim = head_input_dim(head_state)
    scfg = cfg.scorer_config(stage, seed).model_copy(update={"embedding_dim": dim})
    save_artifact(out_dir, scfg, head_state, adapter_state or None)
    table = _eval_table(inputs)
    if stage == "stage1":
        scores = _head_scores(head_state, cfg, dim, embeddings_to_numpy(table.column("embedding")))
    else:
        from memprune.scorer import Scorer

        import torch

        device = "cuda" if torch.cuda.is_available() else None
        scores = Scorer.load(out_dir, device=device).score(table.column("text").to_pylist(),
                                                           batch_size=cfg.predict_batch_size)
    pred = _predictions(table, scores, stage, seed)
    write_table(pred, out_dir / "predictions.parquet")
    retained = []
    for ckpt, metrics in result.best_checkpoints or []:
        retained.append({"path": ckpt.path, "epoch": metrics.get("epoch"), "val_loss": metrics.get("val_loss")})
    extra = {
        "ray": {
            "run_name": name,
            "storage": storage,
            "num_workers": cfg.ray.num_workers,
            "use_gpu": use_gpu,
            "local_mode": cfg.ray.num_workers == 0,
            "checkpoints_retained": retained,
        },
        "init_dir": str(init_dir) if init_dir else None,
    }
    summary = _train_summary(cfg, inputs, stage, seed, fp, state, started, pred, extra)
    write_json(out_dir / "train.json", summary)
    return summary


def _storage(cfg: TrainConfig) -> str:
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


def _run_chain(cfg_json: dict[str, Any], inputs: _Inputs, seed: int, stages: list[str]) -> list[dict[str, Any]]:
    """Run the trained stages of one seed in order (stage1 before stage2); used in-process or as a Ray task."""
    cfg = TrainConfig.model_validate(cfg_json)
    results = []
    for stage in stages:
        summary = run_trained_stage(cfg, inputs, stage, seed)
        console.print(
            f"{stage} seed {seed}: best epoch {summary['best_epoch']} of {summary['epochs_run']}, "
            f"val_loss {_fmt(summary['best_val_loss'])}, {summary['wall_s']:.1f} s"
            + (" (reused)" if summary.get("reused") else ""),
            highlight=False,
        )
        results.append(summary)
    return results


def _fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _concurrency(cfg: TrainConfig, n_chains: int) -> int:
    """How many seed chains can train at once on this cluster."""
    import ray

    if cfg.ray.max_concurrent is not None:
        return max(1, min(cfg.ray.max_concurrent, n_chains))
    res = ray.cluster_resources()
    per_cpu = cfg.ray.cpus_per_worker * max(1, cfg.ray.num_workers)
    fits = int(res.get("CPU", 1) // per_cpu)
    if cfg.ray.num_workers > 0 and _gpu_available(cfg.ray.use_gpu):
        fits = min(fits, int(res.get("GPU", 0) // cfg.ray.num_workers))
    return max(1, min(fits, n_chains))


def run_training(cfg: TrainConfig, assignment: dict[str, str] | None = None,
                 cache_dir: Path | None = None) -> dict[str, Any]:
    """Train every requested (stage, seed) and write OUT/<stage>/seed<k>/, OUT/run.json and OUT/train.md.

    With `cfg.folds` the run is k-fold (`run_folds`). `assignment` (conversation -> split)
    replaces `cfg.split`, and `cache_dir` the embedding cache dir (both used by `run_folds`).
    """
    import ray

    if cfg.folds is not None and assignment is None:
        return run_folds(cfg)
    started = time.perf_counter()
    ensure_ray(cfg.ray.address)
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    rejects = JsonlSink(out / "rejects.jsonl")
    ledger = Ledger(rejects)
    try:
        table, counts = prepare_data(cfg, ledger, assignment)
    except BaseException:
        rejects.abort()
        raise
    rejects.close()
    write_table(
        table.group_by(["conversation_id", "split"]).aggregate([]).sort_by("conversation_id"), out / "splits.parquet"
    )
    if counts["bullets_per_split"]["test"] == 0:
        console.print("[yellow]warning:[/] the test split is empty", highlight=False)

    embed_info: dict[str, Any] | None = None
    dim: int | None = None
    if "vanilla" in cfg.stages or "stage1" in cfg.stages:
        console.print(f"embedding {table.num_rows} labelled bullets with {cfg.encoder} (Ray Data)", highlight=False)
        emb, embed_info = compute_embeddings(table, cfg.scorer_config(), cfg.embed, cache_dir or out / "cache")
        dim = int(emb.shape[1])
        table = table.append_column("embedding", _embedding_column(emb))
    tables = {s: table.filter(pc.equal(table.column("split"), s)) for s in ("train", "valid", "test")}
    inputs = _Inputs(tables, dim, data_fingerprint(table), counts)

    runs: list[dict[str, Any]] = []
    if "vanilla" in cfg.stages:
        for seed in cfg.seeds:
            summary = run_vanilla(cfg, inputs, seed)
            console.print(f"vanilla seed {seed}: val_mse {_fmt(summary['val_mse'])}", highlight=False)
            runs.append(summary)
    chain = [s for s in ("stage1", "stage2") if s in cfg.stages]
    if chain:
        width = _concurrency(cfg, len(cfg.seeds))
        cfg_json = cfg.model_dump(mode="json")
        if width == 1:
            for seed in cfg.seeds:
                runs.extend(_run_chain(cfg_json, inputs, seed, chain))
        else:
            cpus = cfg.ray.cpus_per_worker if cfg.ray.num_workers == 0 else 0
            task = ray.remote(num_cpus=cpus, max_retries=0)(_run_chain)
            inputs_ref = ray.put(inputs)
            pending = list(cfg.seeds)
            running: dict[Any, int] = {}
            while pending or running:
                while pending and len(running) < width:
                    seed = pending.pop(0)
                    running[task.remote(cfg_json, inputs_ref, seed, chain)] = seed
                ready, _ = ray.wait(list(running), num_returns=1)
                for ref in ready:
                    running.pop(ref)
                    runs.extend(ray.get(ref))

    order = {s: i for i, s in enumerate(STAGES)}
    runs.sort(key=lambda r: (order[r["stage"]], r["seed"]))
    summary = {
        "format": TRAIN_FORMAT,
        "data": str(cfg.data),
        "labels": [str(p) for p in cfg.labels],
        "label_weights": cfg.label_weights,
        "out": str(out),
        "stages": cfg.stages,
        "seeds": cfg.seeds,
        "encoder": cfg.encoder,
        "split": {**cfg.split.model_dump(mode="json"), **counts},
        "rejects": {"file": str(out / "rejects.jsonl"), **ledger.summary()},
        "embeddings": embed_info,
        "runs": [
            {k: r.get(k) for k in ("stage", "seed", "best_epoch", "best_val_loss", "epochs_run", "val_mse",
                                   "val_spearman", "wall_s", "reused")}
            | {"dir": str(_artifact_dir(out, r["stage"], r["seed"]))}
            for r in runs
        ],
        "stage_summary": _stage_summary(runs),
        "wall_s": round(time.perf_counter() - started, 3),
        "config": cfg.model_dump(mode="json"),
    }
    write_json(out / "run.json", summary)
    with atomic_path(out / "train.md") as tmp:
        tmp.write_text(render_report(summary), encoding="utf-8")
    if cfg.evaluate:
        from memprune.evaluate import evaluate_run

        console.print(f"evaluating the run -> {out / 'eval'}", highlight=False)
        evaluate_run(out, out / "eval", data_dir=cfg.data)
        summary["evaluation"] = str(out / "eval" / "report.md")
    return summary


# =================================================================== k-fold by conversation

FOLD_MANIFEST = "fold.json"


def fold_assignment(conversation_ids: Iterable[str], k: int, seed: int) -> dict[str, int]:
    """Conversation -> fold in 0..k-1: ids ordered by a seeded SHA-256 and dealt round-robin (sizes differ by <= 1).

    Depends only on the set of ids, `k` and `seed`, not on the input order.
    """
    ids = sorted(set(conversation_ids))
    if len(ids) < k:
        raise TrainError(f"folds={k} needs at least {k} labelled conversations; the labels cover {len(ids)}")
    ordered = sorted(ids, key=lambda c: (hashlib.sha256(f"fold\x00{seed}\x00{c}".encode("utf-8")).hexdigest(), c))
    return {c: i % k for i, c in enumerate(ordered)}


def fold_split(fold_of: dict[str, int], fold: int, split: SplitConfig) -> dict[str, str]:
    """The splits of one fold: its conversations are the test split, the other folds' conversations are cut
    into train and valid by `split_conversations` (`split.valid`, `split.seed`; `split.test` is not used)."""
    rest = [c for c, f in fold_of.items() if f != fold]
    out = dict(split_conversations(rest, SplitConfig(train=None, valid=split.valid, test=0, seed=split.seed)))
    out.update({c: "test" for c, f in fold_of.items() if f == fold})
    return out


def run_folds(cfg: TrainConfig) -> dict[str, Any]:
    """k-fold training by conversation: K runs into OUT/fold<i>/, each testing on the conversations it never saw.

    The labelled conversations are dealt into K folds (`fold_assignment`); run i holds out
    fold i as its test split and trains/validates on the others (`fold_split`), so no
    conversation's own labels are ever used to predict it. Each fold dir gets a `fold.json`
    manifest (its train/valid/test conversations) that `memprune evaluate` checks before it
    pools the K test splits into one out-of-fold prediction set. Embeddings are cached once
    in OUT/cache and shared by the folds; finished (stage, seed) runs are reused on a rerun.
    """
    started = time.perf_counter()
    k = int(cfg.folds or 0)
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    bullets = read_table(cfg.data / "bullets.parquet", "bullets").select(["bullet_id", "conversation_id"])
    rejects = JsonlSink(out / "rejects.jsonl")
    ledger = Ledger(rejects)
    try:
        labels, label_counts = load_labels(cfg, set(bullets.column("bullet_id").to_pylist()), ledger)
    except BaseException:
        rejects.abort()
        raise
    rejects.close()
    labelled = bullets.join(labels.select(["bullet_id"]), "bullet_id", join_type="inner")
    fold_of = fold_assignment(labelled.column("conversation_id").to_pylist(), k, cfg.split.seed)

    runs: list[dict[str, Any]] = []
    per_fold: list[dict[str, Any]] = []
    for i in range(k):
        assignment = fold_split(fold_of, i, cfg.split)
        convs = {s: sorted(c for c, v in assignment.items() if v == s) for s in ("train", "valid", "test")}
        if set(convs["test"]) & (set(convs["train"]) | set(convs["valid"])):  # impossible by construction
            raise TrainError(f"fold {i}: a conversation is both held out and trained on")
        fold_dir = out / f"fold{i}"
        fold_dir.mkdir(parents=True, exist_ok=True)
        write_json(fold_dir / FOLD_MANIFEST, {"fold": i, "k": k, "seed": cfg.split.seed, "conversations": convs})
        console.print(f"fold {i + 1}/{k}: test {len(convs['test'])}, train {len(convs['train'])}, "
                      f"valid {len(convs['valid'])} conversations", highlight=False)
        sub = cfg.model_copy(update={"out": fold_dir, "folds": None, "evaluate": False})
        summary = run_training(sub, assignment=assignment, cache_dir=out / "cache")
        runs.extend({**r, "fold": i} for r in summary["runs"])
        per_fold.append({"fold": i, "dir": str(fold_dir), "conversations": {s: len(v) for s, v in convs.items()},
                         "bullets_per_split": summary["split"]["bullets_per_split"], "wall_s": summary["wall_s"]})

    stage_summary = _stage_summary(runs)
    for entry in stage_summary.values():
        entry["seeds"] = sorted(set(entry["seeds"]))
        entry["folds"] = k
    result: dict[str, Any] = {
        "format": TRAIN_FORMAT,
        "folds": k,
        "data": str(cfg.data),
        "labels": [str(p) for p in cfg.labels],
        "label_weights": cfg.label_weights,
        "out": str(out),
        "stages": cfg.stages,
        "seeds": cfg.seeds,
        "encoder": cfg.encoder,
        "labels_counts": label_counts,
        "rejects": {"file": str(out / "rejects.jsonl"), **ledger.summary()},
        "fold_of": dict(sorted(fold_of.items())),
        "per_fold": per_fold,
        "runs": runs,
        "stage_summary": stage_summary,
        "wall_s": round(time.perf_counter() - started, 3),
        "config": cfg.model_dump(mode="json"),
    }
    write_json(out / "run.json", result)
    lines = ["# memprune train (k-fold by conversation)", "",
             f"- {k} folds over {len(fold_of)} labelled conversations (seed {cfg.split.seed}); each fold is the test "
             "split of one run and never in its training or validation data",
             f"- labels: {', '.join(f'`{x}`' for x in result['labels'])}; by source {label_counts['labels_by_source']}; "
             f"{label_counts['labels_superseded']} superseded, {label_counts['labels_rejected']} rejected",
             f"- total wall time: {result['wall_s']:.1f} s", "",
             "| fold | test / train / valid conversations | test bullets | wall s |", "|---|---|---|---|"]
    for f in per_fold:
        c = f["conversations"]
        lines.append(f"| {f['fold']} | {c['test']} / {c['train']} / {c['valid']} | {f['bullets_per_split']['test']} | "
                     f"{f['wall_s']:.1f} |")
    lines += ["", "Pooled evaluation of the out-of-fold predictions: `memprune evaluate --run OUT`.", ""]
    with atomic_path(out / "train.md") as tmp:
        tmp.write_text("\n".join(lines), encoding="utf-8")
    if cfg.evaluate:
        from memprune.evaluate import evaluate_run

        console.print(f"evaluating the pooled out-of-fold predictions -> {out / 'eval'}", highlight=False)
        evaluate_run(out, out / "eval", data_dir=cfg.data)
        result["evaluation"] = str(out / "eval" / "report.md")
    return result


def _stage_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in STAGES:
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


def render_report(summary: dict[str, Any]) -> str:
    """The Markdown summary of a training run (OUT/train.md)."""
    split = summary["split"]
    lines = [
        "# memprune train",
        "",
        f"- data: `{summary['data']}`, labels: {', '.join(f'`{x}`' for x in summary['labels'])}"
        + (f" (source weights {summary['label_weights']}; labels by source {split.get('labels_by_source')}, "
           f"{split.get('labels_superseded', 0)} superseded)" if len(summary["labels"]) > 1 or summary.get("label_weights")
           else ""),
        f"- encoder: `{summary['encoder']}`; stages {', '.join(summary['stages'])}; seeds {summary['seeds']}",
        f"- bullets: {split['bullets']} ({split['labeled_bullets']} labelled, {split['unlabeled_bullets']} unlabelled); "
        f"label rows rejected: {split['labels_rejected']}",
        f"- conversations train/valid/test: {split['conversations']['train']}/{split['conversations']['valid']}/"
        f"{split['conversations']['test']}; bullets {split['bullets_per_split']['train']}/"
        f"{split['bullets_per_split']['valid']}/{split['bullets_per_split']['test']}",
        f"- total wall time: {summary['wall_s']:.1f} s",
        "",
        "| stage | seeds | val MSE (mean ± std) | val Spearman (mean ± std) | wall s (sum) |",
        "|---|---|---|---|---|",
    ]
    for stage, e in summary["stage_summary"].items():
        def ms(key: str) -> str:
            v = e.get(key)
            return "-" if v is None else f"{v['mean']:.4f} ± {v['std']:.4f}"

        lines.append(f"| {stage} | {len(e['seeds'])} | {ms('val_mse')} | {ms('val_spearman')} | {e['wall_s']:.1f} |")
    lines += ["", "| stage | seed | best epoch | epochs run | best val loss | wall s |", "|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        lines.append(
            f"| {r['stage']} | {r['seed']} | {r['best_epoch'] if r['best_epoch'] is not None else '-'} | "
            f"{r['epochs_run']} | {_fmt(r['best_val_loss'])} | {r['wall_s']:.1f} |"
        )
    lines.append("")
    return "\n".join(lines)

