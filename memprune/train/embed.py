"""Frozen-encoder embeddings of the labelled bullets, computed once with Ray Data and cached.

Vanilla and stage 1 only need the pretrained encoder's embeddings: an actor pool computes them
once per corpus and encoder, and `OUT/cache/embeddings-<key>.parquet` keeps them for every
stage, seed and fold (and for a rerun).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memprune.encoders import EncoderActor
from memprune.io import write_table
from memprune.precision import Precision
from memprune.runtime import plan_actors
from memprune.scorer import ScorerConfig
from memprune.timing import busy_seconds, now
from memprune.train.config import EmbedSettings
from memprune.work import digest


@dataclass(frozen=True)
class EmbedJob:
    """What an embedding actor needs: the encoder settings and the precision of its passes."""

    scorer: ScorerConfig
    precision: Precision


class EmbedActor(EncoderActor):
    """Ray Data actor: loads the frozen encoder once, maps text batches to mean-pooled embeddings."""

    REQUIRED_COLUMNS = ("bullet_id", "text")

    def setup(self, settings: EmbedJob, device: str) -> None:
        from memprune.scorer import Scorer

        self.scorer = Scorer.build(settings.scorer, seed=0, device=device, precision=settings.precision)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        started = now()
        texts = [str(t) for t in batch["text"]]
        emb = self.scorer.embed(texts, batch_size=max(1, len(texts)))
        span = np.array([[started, now()]] * len(texts))  # the batch's compute interval, on each of its rows
        return {"bullet_id": batch["bullet_id"], "embedding": emb, "span": span,
                "precision": np.array([self.scorer.precision] * len(texts))}  # what ran on this actor's device


def embedding_column(emb: np.ndarray) -> pa.FixedSizeListArray:
    """A float32 [n, d] array as a fixed-size-list column."""
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), emb.shape[1])


def embeddings_to_numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A fixed-size-list float column as a float32 [n, d] array."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    dim = arr.type.list_size
    return arr.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, dim)


def compute_embeddings(
    table: pa.Table, scorer_config: ScorerConfig, settings: EmbedSettings, cache_dir: Path, precision: Precision
) -> tuple[np.ndarray, dict[str, Any]]:
    """Frozen-encoder embeddings of `table` rows (bullet_id, text), in row order, cached on disk.

    The cache key covers the encoder, pooling settings and every (bullet_id, text): a rerun
    with the same inputs reads the cache instead of running the encoder again. The info records the
    requested precision and the one the actors ran at (kept in the cache file's metadata for a rerun).
    """
    import ray

    enc_cfg = scorer_config.model_copy(update={"lora": None, "stage": None, "seed": None})
    rows = hashlib.sha256(b"".join(
        b.encode("utf-8") + b"\x00" + t.encode("utf-8") + b"\x01"
        for b, t in zip(table.column("bullet_id").to_pylist(), table.column("text").to_pylist())
    )).hexdigest()
    res = plan_actors(ray.cluster_resources(), settings.use_gpu, settings.actors, settings.cpus_per_actor)
    key = digest({"encoder": enc_cfg.encoder, "max_length": enc_cfg.max_length, "normalize": enc_cfg.normalize,
                  "prefix": enc_cfg.text_prefix, "rows": rows,
                  **({} if precision == "fp32" or res.device == "cpu" and precision == "auto" else
                     {"precision": precision, "device": res.device})})[:20]
    cache = cache_dir / f"embeddings-{key}.parquet"
    info: dict[str, Any] = {"cache": str(cache), "rows": table.num_rows, "precision": {"requested": precision}}
    if cache.exists():
        cached = pq.read_table(cache)
        if cached.column("bullet_id").to_pylist() == table.column("bullet_id").to_pylist():
            ran = (cached.schema.metadata or {}).get(b"precision")
            info["precision"]["resolved"] = ran.decode() if ran is not None else None  # None: cached before it was kept
            info.update(reused=True, seconds=0.0, compute_s=0.0)
            return embeddings_to_numpy(cached.column("embedding")), info
    started = time.perf_counter()
    source = table.select(["bullet_id", "text"])
    n_blocks = max(1, min(res.actors * 4, math.ceil(source.num_rows / settings.batch_size)))
    step = math.ceil(source.num_rows / n_blocks)
    blocks = [source.slice(i, step) for i in range(0, source.num_rows, step)]
    ds = ray.data.from_arrow(blocks).map_batches(
        **EmbedActor.map_kwargs(EmbedJob(enc_cfg, precision), res, batch_size=settings.batch_size, blocks=len(blocks)))
    ids: list[str] = []
    parts: list[np.ndarray] = []
    spans: set[tuple[float, float]] = set()
    ran: set[str] = set()
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        ran.update(str(p) for p in batch["precision"])
        ids.extend(str(b) for b in batch["bullet_id"])
        emb = batch["embedding"]
        parts.append(np.stack(emb) if emb.dtype == object else np.asarray(emb))
        spans.update((float(a), float(b)) for a, b in np.asarray(batch["span"]).reshape(-1, 2))
    emb = np.concatenate(parts).astype(np.float32)
    position = {b: i for i, b in enumerate(ids)}
    emb = emb[np.array([position[b] for b in table.column("bullet_id").to_pylist()], dtype=np.int64)]
    info.update(reused=False, seconds=round(time.perf_counter() - started, 3),
                compute_s=round(busy_seconds(spans), 3), actors=min(res.actors, len(blocks)),
                gpu=res.device == "cuda")
    info["precision"]["resolved"] = ",".join(sorted(ran))  # one value unless the actors' devices differ
    out = pa.table({"bullet_id": table.column("bullet_id"), "embedding": embedding_column(emb)})
    write_table(out.replace_schema_metadata({"precision": info["precision"]["resolved"]}), cache)
    return emb, info
