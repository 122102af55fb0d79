"""`memprune label`: pseudo labels for bullets from a judge over bullet x next-session turn pairs.

Step 2 of the method (DESIGN.md). Reads `DATA/sessions.parquet` and `DATA/bullets.parquet`
(written by `memprune ingest` or `memprune summarize`), builds the pairs
(`memprune.pairs`), judges them (`memprune.judge`) and writes into `OUT`:

- `pairs.parquet`   bullet_id, turn_id, score, judge, error (+ horizon), sorted by (bullet_id, turn_id);
- `labels.parquet`  bullet_id, label, n_pairs, aggregation, sorted by bullet_id;
- `unlabelled.jsonl` every bullet without a label and why;
- `label.json` / `label.md` counts that reconcile, error rate, pairs/s, tokens.

Label rule: a pair whose turn lies h sessions ahead has weight decay ** (h - 1); the label
is the max (default) or the mean of score * weight over the bullet's scored pairs.
Errored pairs are left out of the aggregation; a bullet whose pairs all errored gets no
label (`all_pairs_failed`), never a default.

Label sources (`source`): `judge` (the above, default), `qa` (QA-evidence labels of a corpus
with a `qa` table) and `usage` (a usage log of a live chatbot); see `memprune.sources`.
Every labels row records its source in the `source` column.

Resumable: the work is cut into deterministic shards, each written atomically under
`OUT/.work/<fingerprint>/` (the fingerprint hashes the inputs and every option that changes
the judged values). A rerun of the same command reuses finished shards, redoes the rest
and assembles byte-identical tables.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, model_validator

from memprune.config import load_config
from memprune.io import JsonlSink, atomic_path, read_table, write_json, write_table
from memprune.raysession import ensure_ray
from memprune.judge import SimilarityJudge
from memprune.pairs import (
    NO_NEXT_SESSION,
    NO_SPEAKER,
    NO_TARGET_TURNS,
    PairOptions,
    PairPlan,
    build_pairs,
    shard_bounds,
)
from memprune.rejects import Ledger
from memprune.schema import LABELS, PAIRS

WORK_VERSION = 1
ALL_PAIRS_FAILED = "all_pairs_failed"
UNLABELLED_REASONS = (NO_NEXT_SESSION, NO_SPEAKER, NO_TARGET_TURNS, ALL_PAIRS_FAILED)
DEFAULT_SHARD_SIZE = {"similarity": 4096, "llm": 4096}

# pairs.parquet: the PAIRS contract plus the horizon, so labels can be recomputed from it alone.
PAIRS_OUT = PAIRS.append(pa.field("horizon", pa.int32(), nullable=False))

# One finished LLM shard under .work (`pos` indexes the judging order of the plan).
LLM_SHARD = pa.schema(
    [
        pa.field("pos", pa.int64(), nullable=False),
        pa.field("bullet_id", pa.string(), nullable=False),
        pa.field("turn_id", pa.string(), nullable=False),
        pa.field("score", pa.float64()),
        pa.field("error", pa.string()),
        pa.field("attempts", pa.int32()),
        pa.field("tokens_in", pa.int64()),
        pa.field("tokens_out", pa.int64()),
        pa.field("raw", pa.string()),
    ]
)


class SimilarityOptions(BaseModel):
    """Settings of the similarity (encoder proxy) judge."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Encoder path or hub id; default: local all-MiniLM-L6-v2.")
    batch_size: int = Field(128, ge=1)
    max_length: int = Field(128, ge=8)
    mapping: Literal["clip", "affine"] = "clip"
    device: str = "cpu"
    executor: Literal["local", "ray"] = Field("local", description="Encode shards in-process or on a Ray Data actor pool.")
    actors: int = Field(2, ge=1, description="Actor pool size for executor=ray.")


class QALabelSettings(BaseModel):
    """source=qa: how QA evidence becomes labels (see `memprune.sources.qa_labels`)."""

    model_config = ConfigDict(extra="forbid")

    grading: Literal["binary", "graded"] = Field("binary", description="binary: cited at all; graded: by citing questions")
    grade_cap: int = Field(3, ge=1, description="graded: label = min(1, n_citing / grade_cap)")
    later_only: bool = Field(False, description="count only questions whose evidence reaches a later session")
    categories: list[int] | None = Field(None, description="only QA items of these categories (None = all)")


class UsageLabelSettings(BaseModel):
    """source=usage: the usage log and how its events become labels (see `memprune.sources.usage_labels`)."""

    model_config = ConfigDict(extra="forbid")

    log: Path | None = Field(None, description="usage log: a .parquet/.jsonl file or a directory of them")
    aggregation: Literal["max", "mean"] = Field("max", description="label = max or mean of the event values")
    missing: Literal["unlabelled", "zero"] = Field("unlabelled", description="bullets without events")
    since: datetime | None = Field(None, description="count only events at or after this time")
    until: datetime | None = Field(None, description="count only events at or before this time")


class LabelConfig(BaseModel):
    """Everything `memprune label` needs; the same keys in YAML for `jobs/label.py`."""

    model_config = ConfigDict(extra="forbid")

    data: Path
    out: Path
    source: Literal["judge", "qa", "usage"] = Field("judge", description="judge (LLM/similarity), qa or usage")
    qa: QALabelSettings = Field(default_factory=QALabelSettings)
    usage: UsageLabelSettings = Field(default_factory=UsageLabelSettings)
    judge: Literal["llm", "similarity"] = "similarity"
    speaker: Literal["all", "same", "other"] = "all"
    context_turns: int = Field(4, ge=0)
    horizon: int = Field(1, ge=1)
    decay: float = Field(0.5, gt=0.0, le=1.0)
    aggregation: Literal["max", "mean"] = "max"
    order: Literal["target", "bullet"] = "target"
    shard_size: int | None = Field(None, ge=1, description="Texts (similarity) or pairs (llm) per shard.")
    similarity: SimilarityOptions = Field(default_factory=SimilarityOptions)
    llm_config: Path | None = Field(None, description="A YAML file of memprune.llm.LLMConfig fields.")
    llm: dict[str, Any] | None = Field(None, description="LLMConfig fields set inline (merged over llm_config).")
    llm_overrides: list[str] = Field(default_factory=list, description="key=value LLMConfig overrides, applied last.")
    llm_block_rows: int = Field(64, ge=1, description="Rows per Ray Data block fed to the LLM judge.")
    progress: bool = True

    @model_validator(mode="after")
    def _judge_settings(self) -> "LabelConfig":
        if self.source == "usage" and self.usage.log is None:
            raise ValueError("source=usage needs the usage log: set `usage.log` (CLI: --usage-log)")
        if self.source == "judge" and self.judge == "llm" and self.llm is None and self.llm_config is None:
            raise ValueError("judge=llm needs an LLM config: set `llm_config` (a YAML file) or an inline `llm` section")
        return self

    def pair_options(self) -> PairOptions:
        return PairOptions(speaker=self.speaker, context_turns=self.context_turns, horizon=self.horizon,
                           decay=self.decay, order=self.order)

    def effective_shard_size(self) -> int:
        return self.shard_size or DEFAULT_SHARD_SIZE[self.judge]


class LabelError(ValueError):
    """The labeling stage cannot run with these inputs or settings (the message says why)."""


# ------------------------------------------------------------------ config loading


def load_label_config(
    path: str | os.PathLike[str] | None,
    overrides: list[str] | None = None,
    values: dict[str, Any] | None = None,
) -> LabelConfig:
    """A `LabelConfig` from a YAML file (optional), `key=value` overrides, then dotted-key typed `values`."""
    return load_config(path, overrides, LabelConfig, values)


def _llm_config(cfg: LabelConfig) -> Any:
    """The `memprune.llm.LLMConfig`: the `llm_config` file, then the inline `llm` section, then `llm_overrides`."""
    from memprune.llm import LLMConfig

    return LLMConfig.resolve(cfg.llm_config, cfg.llm, cfg.llm_overrides)


# ------------------------------------------------------------------ aggregation (pure)


def aggregate(pairs: pa.Table, decay: float, how: str = "max") -> tuple[pa.Table, list[dict[str, Any]]]:
    """Labels from judged pairs, and the bullets whose pairs all errored.

    `pairs` holds bullet_id, score (null = error) and horizon. Each score is multiplied by
    decay ** (horizon - 1), then reduced per bullet by `how` (max or mean). Returns the
    `labels` table sorted by bullet_id and, sorted likewise, one dict per failed bullet.
    """
    if how not in ("max", "mean"):
        raise ValueError(f"aggregation must be max or mean, got {how!r}")
    t = pairs.select(["bullet_id", "score", "horizon"]).sort_by([("bullet_id", "ascending")])
    ids = t.column("bullet_id").to_pylist()
    score = t.column("score").to_numpy(zero_copy_only=False).astype(np.float64)  # null -> nan
    horizon = t.column("horizon").to_numpy(zero_copy_only=False).astype(np.int64)
    ok = ~np.isnan(score)
    weighted = score * np.power(float(decay), horizon - 1)
    labels: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    start = 0
    n = len(ids)
    while start < n:
        stop = start
        while stop < n and ids[stop] == ids[start]:
            stop += 1
        seg_ok = ok[start:stop]
        k = int(seg_ok.sum())
        if k == 0:
            failed.append({"bullet_id": ids[start], "reason": ALL_PAIRS_FAILED, "n_pairs": stop - start,
                           "n_errors": stop - start})
        else:
            vals = weighted[start:stop][seg_ok]
            value = float(vals.max()) if how == "max" else float(vals.sum() / k)
            labels.append({"bullet_id": ids[start], "label": value, "n_pairs": k, "aggregation": how,
                           "source": "judge"})
        start = stop
    return pa.Table.from_pylist(labels, schema=LABELS), failed


# ------------------------------------------------------------------ work directory


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(payload: dict[str, Any]) -> str:
    """Hex digest of a JSON-able payload (key order independent)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _fingerprint_payload(cfg: LabelConfig, inputs: dict[str, str], judge_settings: dict[str, Any]) -> dict[str, Any]:
    """What the shards depend on: inputs, pair set, judge settings, sharding. Not decay/aggregation."""
    payload: dict[str, Any] = {
        "version": WORK_VERSION,
        "inputs": inputs,
        "judge": cfg.judge,
        "speaker": cfg.speaker,
        "horizon": cfg.horizon,
        "order": cfg.order,
        "shard_size": cfg.effective_shard_size(),
        "judge_settings": judge_settings,
    }
    if cfg.judge == "llm":
        payload["context_turns"] = cfg.context_turns
    return payload


class WorkDir:
    """`OUT/.work/<fingerprint>/`: a manifest plus one atomically written file per finished shard."""

    def __init__(self, out: Path, payload: dict[str, Any]) -> None:
        self.fingerprint = fingerprint(payload)
        self.path = out / ".work" / self.fingerprint[:16]
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = self.path / "manifest.json"
        if manifest.exists():
            old = json.loads(manifest.read_text(encoding="utf-8"))
            if old.get("fingerprint") != self.fingerprint:
                raise LabelError(f"{manifest}: belongs to another run (fingerprint prefix clash); delete {self.path}")
        else:
            write_json(manifest, {"fingerprint": self.fingerprint, "payload": payload})

    def shard_path(self, kind: str, i: int, ext: str) -> Path:
        return self.path / f"{kind}-{i:05d}.{ext}"


# ------------------------------------------------------------------ similarity judge


def _similarity_vocab(plan: PairPlan) -> list[str]:
    """The distinct texts of the plan (bullets and targets), sorted by (length, text) for low padding."""
    texts = set(plan.pairs.column("bullet").to_pylist()) | set(plan.pairs.column("target").to_pylist())
    return sorted(texts, key=lambda s: (len(s), s))


def _load_embedding(path: Path, rows: int) -> np.ndarray | None:
    """A finished embedding shard, or None if it is absent or does not have `rows` rows."""
    if not path.exists():
        return None
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return arr if arr.ndim == 2 and arr.shape[0] == rows and arr.dtype == np.float32 else None


def _save_embedding(path: Path, emb: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.save(fh, np.ascontiguousarray(emb, dtype=np.float32), allow_pickle=False)


def _judge_similarity(cfg: LabelConfig, plan: PairPlan, work: WorkDir, judge: SimilarityJudge,
                      stats: dict[str, Any]) -> tuple[np.ndarray, list[str | None]]:
    """Encode every distinct text once (sharded, resumable), then score all pairs."""
    from tqdm import tqdm

    vocab = _similarity_vocab(plan)
    bounds = shard_bounds(len(vocab), cfg.effective_shard_size())
    pending = [i for i, (a, b) in enumerate(bounds) if _load_embedding(work.shard_path("emb", i, "npy"), b - a) is None]
    stats.update(shards_total=len(bounds), shards_reused=len(bounds) - len(pending), texts=len(vocab))
    t0 = time.perf_counter()
    if pending:
        bar = tqdm(total=len(pending), desc="label: encode shards", unit="shard", disable=not cfg.progress)
        if cfg.similarity.executor == "ray":
            _encode_with_ray(cfg, vocab, bounds, pending, work, judge, bar)
        else:
            for i in pending:
                a, b = bounds[i]
                _save_embedding(work.shard_path("emb", i, "npy"), judge.encode(vocab[a:b]))
                bar.update(1)
        bar.close()
    parts = [_load_embedding(work.shard_path("emb", i, "npy"), b - a) for i, (a, b) in enumerate(bounds)]
    missing = [i for i, p in enumerate(parts) if p is None]
    if missing:
        raise RuntimeError(f"{work.path}: embedding shards {missing} are missing after encoding")
    dim = parts[0].shape[1] if parts else 1
    emb = np.concatenate(parts, axis=0) if parts else np.zeros((0, dim), dtype=np.float32)
    index = {t: i for i, t in enumerate(vocab)}
    b_idx = np.fromiter((index[t] for t in plan.pairs.column("bullet").to_pylist()), dtype=np.int64,
                        count=plan.pairs.num_rows)
    t_idx = np.fromiter((index[t] for t in plan.pairs.column("target").to_pylist()), dtype=np.int64,
                        count=plan.pairs.num_rows)
    scores = judge.score_indices(emb, b_idx, t_idx)
    stats["judge_s"] = time.perf_counter() - t0
    stats["pairs_judged"] = plan.pairs.num_rows if pending else 0
    return scores, [None] * plan.pairs.num_rows


def _encode_with_ray(cfg: LabelConfig, vocab: list[str], bounds: list[tuple[int, int]], pending: list[int],
                     work: WorkDir, judge: SimilarityJudge, bar: Any) -> None:
    """Encode the pending shards on a Ray Data actor pool; the driver writes each shard as it arrives."""
    import ray
    from ray.data import ActorPoolStrategy

    from memprune.judge import SimilarityEncoder

    ensure_ray()
    items = [{"shard": i, "texts": vocab[bounds[i][0]:bounds[i][1]]} for i in pending]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ds = ds.map_batches(
        SimilarityEncoder,
        fn_constructor_kwargs={"model": judge.model_name, "batch_size": judge.batch_size,
                               "max_length": judge.max_length, "device": judge.device},
        batch_size=1,
        compute=ActorPoolStrategy(size=min(cfg.similarity.actors, len(items))),
        num_cpus=1,
    )
    for batch in ds.iter_batches(batch_size=1, batch_format="numpy"):
        for shard, blob, dim in zip(batch["shard"], batch["emb"], batch["dim"]):
            emb = np.frombuffer(blob, dtype=np.float32).reshape(-1, int(dim))
            _save_embedding(work.shard_path("emb", int(shard), "npy"), emb)
            bar.update(1)


# ------------------------------------------------------------------ LLM judge


def _check_score(score: Any, error: Any) -> tuple[float | None, str | None]:
    """A judged score in [0, 1] or an error: out-of-range or non-numeric scores become errors."""
    if error:
        return None, str(error)
    if score is None:
        return None, "judge returned no score"
    try:
        value = float(score)
    except (TypeError, ValueError):
        return None, f"score is not a number: {score!r}"
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        return None, f"score out of range [0, 1]: {score!r}"
    return value, None


def _load_llm_shard(path: Path, start: int, stop: int) -> pa.Table | None:
    """A finished LLM shard holding exactly the positions [start, stop), or None."""
    if not path.exists():
        return None
    try:
        t = pq.read_table(path)
    except (pa.ArrowInvalid, OSError):
        return None
    if t.num_rows != stop - start or not t.schema.equals(LLM_SHARD):
        return None
    if t.column("pos").to_pylist() != list(range(start, stop)):
        return None
    return t


def _judge_llm(cfg: LabelConfig, plan: PairPlan, work: WorkDir, judge: Any,
               stats: dict[str, Any]) -> tuple[np.ndarray, list[str | None]]:
    """Judge the pending shards through Ray Data, one `run_llm` pass per shard, each written when done.

    `run_llm` materializes its retry passes, so a shard is the unit of progress: a kill loses
    at most the shard in flight. Large shards amortise the engine start-up (vLLM) per pass.
    """
    import ray
    from tqdm import tqdm

    n = plan.pairs.num_rows
    bounds = shard_bounds(n, cfg.effective_shard_size())
    paths = [work.shard_path("pairs", i, "parquet") for i in range(len(bounds))]
    pending = [i for i, (a, b) in enumerate(bounds) if _load_llm_shard(paths[i], a, b) is None]
    stats.update(shards_total=len(bounds), shards_reused=len(bounds) - len(pending))
    t0 = time.perf_counter()
    judged = 0
    if pending:
        ensure_ray()
        base = plan.pairs.select(["bullet_id", "turn_id", "bullet", "context", "target", "target_speaker"])
        base = base.append_column("pos", pa.array(np.arange(n, dtype=np.int64)))
        bar = tqdm(total=sum(bounds[i][1] - bounds[i][0] for i in pending), desc="label: judge pairs",
                   unit="pair", disable=not cfg.progress)
        for i in pending:
            a, b = bounds[i]
            # several blocks per shard, in judging order, so every engine replica gets work
            blocks = [base.slice(s, min(cfg.llm_block_rows, b - s)) for s in range(a, b, cfg.llm_block_rows)]
            out = judge.judge(ray.data.from_arrow(blocks))
            got: dict[int, dict[str, Any]] = {}
            for batch in out.iter_batches(batch_size=None, batch_format="pyarrow"):
                for row in batch.select([c for c in LLM_SHARD.names if c in batch.column_names]).to_pylist():
                    score, error = _check_score(row.get("score"), row.get("error"))
                    row.update(score=score, error=error)
                    got[int(row["pos"])] = row
            missing = [p for p in range(a, b) if p not in got]
            if missing or len(got) != b - a:
                raise RuntimeError(f"the LLM judge returned {len(got)} rows for the {b - a} pairs of shard {i} "
                                   f"({len(missing)} missing); finished shards are kept, rerun to retry")
            write_table_plain(pa.Table.from_pylist([got[p] for p in range(a, b)], schema=LLM_SHARD), paths[i])
            judged += b - a
            bar.update(b - a)
        bar.close()
    stats["judge_s"] = time.perf_counter() - t0
    stats["pairs_judged"] = judged
    tables = []
    for i, (a, b) in enumerate(bounds):
        t = _load_llm_shard(paths[i], a, b)
        if t is None:
            raise RuntimeError(f"{paths[i]}: shard missing or inconsistent after judging")
        tables.append(t)
    if not tables:
        return np.zeros(0), []
    allt = pa.concat_tables(tables)
    stats["tokens_in"] = pc.sum(allt.column("tokens_in")).as_py()
    stats["tokens_out"] = pc.sum(allt.column("tokens_out")).as_py()
    stats["attempts"] = pc.sum(allt.column("attempts")).as_py()
    scores = allt.column("score").to_numpy(zero_copy_only=False).astype(np.float64)
    return scores, allt.column("error").to_pylist()


def write_table_plain(table: pa.Table, path: Path) -> None:
    """Write a work table atomically (no stage-schema validation)."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


# ------------------------------------------------------------------ the stage


def run_label(cfg: LabelConfig) -> dict[str, Any]:
    """Run the labeling stage described by `cfg`; return the `label.json` summary."""
    if cfg.source != "judge":
        return run_source_label(cfg)
    started = time.perf_counter()
    data, out = Path(cfg.data), Path(cfg.out)
    sessions_path, bullets_path = data / "sessions.parquet", data / "bullets.parquet"
    sessions = read_table(sessions_path, "sessions")
    bullets = read_table(bullets_path, "bullets")
    inputs = {"sessions": _sha256_file(sessions_path), "bullets": _sha256_file(bullets_path)}
    options = cfg.pair_options()

    if cfg.judge == "similarity":
        sim = cfg.similarity
        judge: Any = SimilarityJudge(sim.model, batch_size=sim.batch_size, max_length=sim.max_length,
                                     mapping=sim.mapping, device=sim.device)
        # The shards hold embeddings: the cosine -> score mapping is applied afterwards, on every run.
        settings = {"model": judge.model_name, "max_length": sim.max_length}
    else:
        from memprune.judge import LLMJudge

        llm_config = _llm_config(cfg)
        judge = LLMJudge(llm_config)
        settings = {"llm": llm_config.model_dump(mode="json")}

    plan = build_pairs(sessions, bullets, options, with_context=cfg.judge == "llm")
    out.mkdir(parents=True, exist_ok=True)
    work = WorkDir(out, _fingerprint_payload(cfg, inputs, settings))
    stats: dict[str, Any] = {}
    if cfg.judge == "similarity":
        scores, errors = _judge_similarity(cfg, plan, work, judge, stats)
    else:
        scores, errors = _judge_llm(cfg, plan, work, judge, stats)

    n = plan.pairs.num_rows
    score_arr = pa.array([None if (e is not None or np.isnan(s)) else float(s) for s, e in zip(scores, errors)],
                         type=pa.float64()) if n else pa.array([], type=pa.float64())
    pairs = pa.table(
        {
            "bullet_id": plan.pairs.column("bullet_id"),
            "turn_id": plan.pairs.column("turn_id"),
            "score": score_arr,
            "judge": pa.array([judge.name] * n, type=pa.string()),
            "error": pa.array(errors, type=pa.string()),
            "horizon": plan.pairs.column("horizon"),
        },
        schema=PAIRS_OUT,
    ).sort_by([("bullet_id", "ascending"), ("turn_id", "ascending")]).combine_chunks()
    labels, failed = aggregate(pairs, cfg.decay, cfg.aggregation)

    write_table(pairs, out / "pairs.parquet", "pairs")
    write_table(labels, out / "labels.parquet", "labels")
    unlabelled = sorted(
        [{"bullet_id": b, "reason": r, "n_pairs": 0, "n_errors": 0} for b, r in plan.unpaired] + failed,
        key=lambda d: d["bullet_id"],
    )
    sink = JsonlSink(out / "unlabelled.jsonl")
    try:
        for row in unlabelled:
            sink.write(row)
    except BaseException:
        sink.abort()
        raise
    sink.close()

    summary = _summary(cfg, plan, pairs, labels, unlabelled, judge.name, inputs, work, stats,
                       time.perf_counter() - started)
    write_json(out / "label.json", summary)
    with atomic_path(out / "label.md") as tmp:
        tmp.write_text(_markdown(summary), encoding="utf-8")
    return summary


def _summary(cfg: LabelConfig, plan: PairPlan, pairs: pa.Table, labels: pa.Table, unlabelled: list[dict[str, Any]],
             judge_name: str, inputs: dict[str, str], work: WorkDir, stats: dict[str, Any],
             wall_s: float) -> dict[str, Any]:
    """The `label.json` content: counts that reconcile, error rate, throughput, tokens."""
    n_pairs = pairs.num_rows
    n_err = n_pairs - pairs.column("error").null_count
    reasons = Counter(u["reason"] for u in unlabelled)
    label_vals = labels.column("label").to_numpy() if labels.num_rows else np.zeros(0)
    errors_by_message = Counter(e for e in pairs.column("error").to_pylist() if e is not None)
    partially = 0
    if n_err:
        per_bullet = Counter(b for b, e in zip(pairs.column("bullet_id").to_pylist(),
                                               pairs.column("error").to_pylist()) if e is not None)
        labelled_ids = set(labels.column("bullet_id").to_pylist())
        partially = sum(1 for b in per_bullet if b in labelled_ids)
    counts = {
        "bullets": plan.n_bullets,
        "bullets_labelled": labels.num_rows,
        "bullets_unlabelled": len(unlabelled),
        **{f"unlabelled_{r}": reasons.get(r, 0) for r in UNLABELLED_REASONS},
        "bullets_partially_failed": partially,
        "pairs": n_pairs,
        "pairs_scored": n_pairs - n_err,
        "pairs_error": n_err,
        "pairs_by_horizon": {str(h): c for h, c in sorted(Counter(pairs.column("horizon").to_pylist()).items())},
    }
    reconciles = (
        counts["bullets"] == counts["bullets_labelled"] + counts["bullets_unlabelled"]
        and counts["pairs"] == counts["pairs_scored"] + counts["pairs_error"]
        and int(pc.sum(labels.column("n_pairs")).as_py() or 0) == counts["pairs_scored"]
    )
    judge_s = stats.get("judge_s") or 0.0
    judged = stats.get("pairs_judged", 0)
    return {
        "stage": "label",
        "source": "judge",
        "judge": judge_name,
        "proxy": cfg.judge == "similarity",
        "config": json.loads(cfg.model_dump_json()),
        "inputs": {"sessions.parquet": inputs["sessions"], "bullets.parquet": inputs["bullets"]},
        "counts": counts,
        "reconciles": reconciles,
        "error_rate": (n_err / n_pairs) if n_pairs else 0.0,
        "errors_by_message": dict(errors_by_message.most_common(10)),
        "labels": {
            "aggregation": cfg.aggregation,
            "decay": cfg.decay,
            "mean": float(label_vals.mean()) if label_vals.size else None,
            "std": float(label_vals.std()) if label_vals.size else None,
            "min": float(label_vals.min()) if label_vals.size else None,
            "max": float(label_vals.max()) if label_vals.size else None,
            "at_least_0.5": int((label_vals >= 0.5).sum()),
        },
        "throughput": {
            "pairs_judged_this_run": judged,
            "judge_s": round(judge_s, 3),
            "pairs_per_s": round(judged / judge_s, 1) if judged and judge_s > 0 else None,
            "wall_s": round(wall_s, 3),
            "texts_encoded": stats.get("texts"),
            "shards_total": stats.get("shards_total", 0),
            "shards_reused": stats.get("shards_reused", 0),
            "executor": cfg.similarity.executor if cfg.judge == "similarity" else "ray",
        },
        "tokens": {"in": stats.get("tokens_in"), "out": stats.get("tokens_out"), "attempts": stats.get("attempts")},
        "work_dir": str(work.path),
        "outputs": ["pairs.parquet", "labels.parquet", "unlabelled.jsonl", "label.json", "label.md"],
    }


def _markdown(s: dict[str, Any]) -> str:
    """A short human-readable report of `label.json`."""
    c, t, lab = s["counts"], s["throughput"], s["labels"]
    lines = [
        f"# Labels ({s['judge']})",
        "",
        ("> Similarity judge: a cosine-similarity **proxy** of the paper's LLM judge, not the judge itself."
         if s["proxy"] else "> LLM-as-a-judge labels."),
        "",
        "| what | value |",
        "|---|---|",
        f"| bullets | {c['bullets']} |",
        f"| labelled | {c['bullets_labelled']} |",
        f"| unlabelled: no next session | {c['unlabelled_no_next_session']} |",
        f"| unlabelled: no speaker | {c['unlabelled_no_speaker']} |",
        f"| unlabelled: no target turns | {c['unlabelled_no_target_turns']} |",
        f"| unlabelled: all pairs failed | {c['unlabelled_all_pairs_failed']} |",
        f"| pairs | {c['pairs']} |",
        f"| pairs errored | {c['pairs_error']} ({s['error_rate']:.2%}) |",
        f"| label mean / min / max | {_fmt(lab['mean'])} / {_fmt(lab['min'])} / {_fmt(lab['max'])} |",
        f"| labels >= 0.5 | {lab['at_least_0.5']} |",
        f"| pairs/s (this run) | {_fmt(t['pairs_per_s'])} |",
        f"| wall time (s) | {t['wall_s']} |",
        f"| counts reconcile | {s['reconciles']} |",
        "",
    ]
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)


# ------------------------------------------------------------------ the qa and usage sources


def run_source_label(cfg: LabelConfig) -> dict[str, Any]:
    """Labels from the `qa` or `usage` source (no judge); write labels.parquet, unlabelled.jsonl, label.json/md.

    One pass over the inputs, cheap next to judging: a rerun recomputes everything and
    writes the same tables (every output is written atomically). Usage events that cannot
    be used are written to `OUT/rejects.jsonl` with file, record, field and reason.
    """
    from memprune import sources

    started = time.perf_counter()
    data, out = Path(cfg.data), Path(cfg.out)
    bullets_path = data / "bullets.parquet"
    bullets = read_table(bullets_path, "bullets")
    inputs: dict[str, str] = {"bullets.parquet": _sha256_file(bullets_path)}
    out.mkdir(parents=True, exist_ok=True)
    ledger_summary: dict[str, Any] | None = None
    if cfg.source == "qa":
        qa_path, sessions_path = data / "qa.parquet", data / "sessions.parquet"
        if not qa_path.is_file():
            raise LabelError(f"{qa_path}: no such file; source qa needs a corpus with a qa table "
                             "(e.g. `memprune ingest --format locomo`)")
        qa = read_table(qa_path, "qa")
        sessions = read_table(sessions_path, "sessions") if sessions_path.is_file() else None
        inputs["qa.parquet"] = _sha256_file(qa_path)
        if sessions is not None:
            inputs["sessions.parquet"] = _sha256_file(sessions_path)
        q = cfg.qa
        try:
            options = sources.QAOptions(grading=q.grading, grade_cap=q.grade_cap, later_only=q.later_only,
                                        categories=tuple(q.categories) if q.categories is not None else None)
        except ValueError as exc:
            raise LabelError(str(exc)) from exc
        result = sources.qa_labels(bullets, qa, sessions, options)
        rule = options.rule()
    else:
        u = cfg.usage
        assert u.log is not None  # checked by the config
        try:
            options_u = sources.UsageOptions(aggregation=u.aggregation, missing=u.missing, since=u.since, until=u.until)
        except ValueError as exc:
            raise LabelError(str(exc)) from exc
        bullet_conv = dict(zip(bullets.column("bullet_id").to_pylist(), bullets.column("conversation_id").to_pylist()))
        sink = JsonlSink(out / "rejects.jsonl")
        ledger = Ledger(sink)
        try:
            files = sources.usage_files(u.log)
            totals, log_counts = sources.read_usage_log(u.log, bullet_conv, ledger, options_u)
        except sources.SourceError as exc:
            sink.abort()
            raise LabelError(str(exc)) from exc
        except BaseException:
            sink.abort()
            raise
        sink.close()
        for f in files:
            inputs[f"usage:{f}"] = _sha256_file(f)
        result = sources.usage_labels(bullets, totals, options_u, log_counts)
        ledger_summary = ledger.summary()
        rule = options_u.rule()

    write_table(result.labels, out / "labels.parquet", "labels")
    sink_u = JsonlSink(out / "unlabelled.jsonl")
    try:
        for row in result.unlabelled:
            sink_u.write(row)
    except BaseException:
        sink_u.abort()
        raise
    sink_u.close()

    c = result.counts
    reconciles = c["bullets"] == c["bullets_labelled"] + c["bullets_unlabelled"]
    if ledger_summary is not None:
        reconciles = reconciles and ledger_summary["conservation"] == "ok" and (
            c["events"] == c["events_counted"] + c["events_outside_window"] + c["events_rejected"])
    vals = result.labels.column("label").to_numpy() if result.labels.num_rows else np.zeros(0)
    outputs = ["labels.parquet", "unlabelled.jsonl", "label.json", "label.md"]
    if ledger_summary is not None:
        outputs.insert(2, "rejects.jsonl")
    summary: dict[str, Any] = {
        "stage": "label",
        "source": cfg.source,
        "judge": None,
        "rule": rule,
        "proxy": False,
        "config": json.loads(cfg.model_dump_json()),
        "inputs": inputs,
        "counts": c,
        "reconciles": bool(reconciles),
        "labels": {
            "aggregation": rule,
            "mean": float(vals.mean()) if vals.size else None,
            "std": float(vals.std()) if vals.size else None,
            "min": float(vals.min()) if vals.size else None,
            "max": float(vals.max()) if vals.size else None,
            "at_least_0.5": int((vals >= 0.5).sum()),
        },
        "throughput": {"wall_s": round(time.perf_counter() - started, 3)},
        "outputs": outputs,
    }
    if ledger_summary is not None:
        summary["ledger"] = ledger_summary
    write_json(out / "label.json", summary)
    with atomic_path(out / "label.md") as tmp:
        tmp.write_text(_source_markdown(summary), encoding="utf-8")
    return summary


def _source_markdown(s: dict[str, Any]) -> str:
    """A short human-readable report of a qa/usage `label.json`."""
    c, lab = s["counts"], s["labels"]
    lines = [
        f"# Labels (source: {s['source']}, rule `{s['rule']}`)",
        "",
        ("> QA-evidence labels: a bullet is positive when questions cite its evidence turns."
         if s["source"] == "qa" else "> Usage labels: from a log of the memory items replies drew on."),
        "",
        "| what | value |",
        "|---|---|",
        f"| bullets | {c['bullets']} |",
        f"| labelled | {c['bullets_labelled']} |",
        *[f"| unlabelled: {k.removeprefix('unlabelled_').replace('_', ' ')} | {v} |"
          for k, v in c.items() if k.startswith("unlabelled_")],
    ]
    if s["source"] == "qa":
        lines += [f"| QA items used / total | {c['qa_used']} / {c['qa']} |",
                  f"| QA items without evidence | {c['qa_without_evidence']} |",
                  f"| bullets cited | {c['bullets_cited']} |"]
    else:
        lines += [f"| events counted / total | {c['events_counted']} / {c['events']} |",
                  f"| events outside the time window | {c['events_outside_window']} |",
                  f"| events rejected (rejects.jsonl) | {c['events_rejected']} |",
                  f"| bullets used | {c['bullets_used']} |"]
    lines += [
        f"| label mean / min / max | {_fmt(lab['mean'])} / {_fmt(lab['min'])} / {_fmt(lab['max'])} |",
        f"| labels >= 0.5 | {lab['at_least_0.5']} |",
        f"| wall time (s) | {s['throughput']['wall_s']} |",
        f"| counts reconcile | {s['reconciles']} |",
        "",
    ]
    return "\n".join(lines)
