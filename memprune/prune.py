"""`memprune prune`: score a bullets store with a trained scorer and prune it (DESIGN step 5), on Ray Data.

Two ways in, one rule (`memprune.prune_rule.prune_mask`: drop scores below the threshold,
then keep the top-k of each group, ties broken by input position):

- **Batch job** (`run_prune`, `memprune prune`, `jobs/prune.py`): Ray Data reads the store
  (Parquet, only the needed columns), an actor pool (one model per actor, GPU when
  present) scores every bullet, the rule decides `keep`, and the store is written back
  with `score` and `keep` columns under `OUT/pruned/` (rows in = rows out, input order),
  plus `OUT/prune.json` and `OUT/prune.md` (bullets and tokens per group before/after).
- **In-process** (`MemoryPruner`): the same scoring helper and the same rule for one live
  session of a chatbot, no Ray.

How the per-group top-k streams (no shuffle for the usual store). Before anything runs,
the driver scans only the group-key columns of the input (a few MB per million rows,
constant memory besides 16 bytes per group) and checks whether every group's rows are
adjacent (contiguous). `ingest` and `synth` write bullets session by session, so they
are. The scan then cuts the store into blocks of about `block_rows` rows *at group
boundaries*, and a custom Ray Data datasource reads exactly those blocks. Every block
therefore holds whole groups, so one actor call scores a block and decides its `keep`
column locally: read -> score+decide (actor pool) -> write, all streaming, no shuffle,
output in input order. Only when the groups are not contiguous (e.g. `--group-by speaker`,
whose rows interleave across sessions, or a shuffled store) does the job fall back to
the one full shuffle: read -> score (actor pool) -> `Dataset.sort(group keys)` ->
decide per block -> write; the sort's range partitioning puts every group in one block
(checked at run time: a group seen in two blocks is an error, not a silent mistake), and
the output is ordered by group key, then input position. `grouping: contiguous` makes a
non-contiguous input an error instead; `grouping: shuffle` forces the fallback.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from memprune.io import atomic_path, write_json
from memprune.prune_rule import group_codes, prune_mask
from memprune.raysession import ensure_ray
from memprune.tokens import count_words, file_counter, tokenizer_file
from memprune.schema import BULLETS, SchemaError

PRUNE_FORMAT = 1
GROUP_KEYS: dict[str, tuple[str, ...]] = {
    "session": ("conversation_id", "session_index"),
    "conversation": ("conversation_id",),
    "speaker": ("conversation_id", "speaker"),
}
REQUIRED = tuple(f.name for f in BULLETS)
NOT_NULL = tuple(f.name for f in BULLETS if not f.nullable)
OUTPUT_COLUMNS = ("score", "keep")
STORE_DIR = "pruned"
# Helper columns that live only inside the pipeline (never written).
ROW = "__memprune_row"
SORTKEY = "__memprune_sortkey"
TOKENS = "__memprune_tokens"
HELPERS = (ROW, SORTKEY, TOKENS)


class PruneError(ValueError):
    """The store, scorer or config cannot be pruned; the message names the file, column or key."""


# =================================================================== config


class PruneConfig(BaseModel):
    """Config of the prune stage (`jobs/prune.py`, `memprune prune`)."""

    model_config = ConfigDict(extra="forbid")

    scorer: str = Field(description="scorer artifact directory (scorer.json + head.safetensors)")
    input: str = Field(description="bullets store: a Parquet file, or a directory of them (a corpus dir: its bullets.parquet)")
    out: str = Field(description="output directory: pruned/ (the store), prune.json, prune.md")
    threshold: float | None = Field(0.5, description="drop scores below this; null = no threshold")
    top_k: int | None = Field(5, ge=1, description="keep at most k per group; null = no cap")
    group_by: Literal["session", "conversation", "speaker"] = "session"
    grouping: Literal["auto", "contiguous", "shuffle"] = Field(
        "auto", description="auto: stream when groups are contiguous, else shuffle; contiguous: require it; shuffle: always"
    )
    sweep_top_k: list[int] = Field(default_factory=lambda: [1, 3, 5], description="extra top-k values reported in prune.json")
    batch_size: int = Field(128, ge=1, description="encoder forward batch size inside an actor")
    block_rows: int = Field(2048, ge=1, description="rows per Ray Data block (cut at group boundaries)")
    actors: int | None = Field(None, ge=1, description="actor pool size; default: one per GPU, else CPUs / actor_cpus")
    actor_cpus: float = Field(1.0, gt=0, description="torch threads per actor (rounded) and its default CPU request")
    use_gpu: bool | Literal["auto"] = "auto"
    io_cpus: float = Field(0.1, gt=0, description="Ray CPU request of each read/write/decide task")
    rows_per_file: int = Field(100_000, ge=1, description="minimum rows per output Parquet file")
    sort_by_length: bool = Field(True, description="score texts in length order inside a block (less padding)")
    tokenizer: str = Field("encoder", description="token unit: encoder, whitespace, or a tokenizer.json (or its dir)")
    columns: list[str] | None = Field(None, description="extra input columns to carry; null = all")
    limit_rows: int | None = Field(None, ge=1, description="only the first N rows, rounded up to whole groups (trials)")
    ray_address: str | None = None
    progress: bool = True

    @field_validator("sweep_top_k")
    @classmethod
    def _sweep(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):
            raise ValueError(f"sweep_top_k values must be >= 1, got {v}")
        return sorted(set(v))

    @field_validator("threshold")
    @classmethod
    def _threshold(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError(f"threshold must be a finite number or null, got {v}")
        return v


def check_rule(threshold: float | None, top_k: int | None) -> None:
    """Reject a threshold that is not a finite number and a top-k below 1 (None disables either)."""
    if threshold is not None and (isinstance(threshold, bool) or not math.isfinite(float(threshold))):
        raise PruneError(f"threshold must be a finite number or None, got {threshold!r}")
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise PruneError(f"top_k must be an integer >= 1 or None, got {top_k!r}")


def setting_name(threshold: float | None, top_k: int | None) -> str:
    """Stable key of a pruning setting, e.g. 't0.5_k5' or 't0.5_kall' (same as `memprune evaluate`)."""
    t = "none" if threshold is None else f"{threshold:g}"
    return f"t{t}_k{'all' if top_k is None else top_k}"


def settings_of(config: PruneConfig) -> list[tuple[float | None, int | None]]:
    """The main (threshold, top_k) first, then the sweep values and 'no cap' at the same threshold."""
    out = [(config.threshold, config.top_k)]
    for k in [*config.sweep_top_k, None]:
        if (config.threshold, k) not in out:
            out.append((config.threshold, k))
    return out


# =================================================================== scoring and the rule (pure)


def bullet_text(bullet: Any, index: int) -> str:
    """The text of a bullet given as a string or a mapping with a 'text' key."""
    if isinstance(bullet, str):
        return bullet
    if isinstance(bullet, Mapping):
        text = bullet.get("text")
        if isinstance(text, str):
            return text
        raise PruneError(f"bullets[{index}]: field 'text' is {type(text).__name__}, expected str")
    raise PruneError(f"bullets[{index}]: is {type(bullet).__name__}, expected str or a mapping with 'text'")


def score_texts(scorer: Any, texts: Sequence[str], batch_size: int, sort_by_length: bool = True) -> np.ndarray:
    """Scores of `texts` in input order; each distinct text scored once, in length order (less padding).

    Scoring each distinct text once makes equal texts score exactly equal wherever they
    sit in a batch, so ties are broken by position in the batch job and in-process alike.
    """
    if not len(texts):
        return np.zeros(0, dtype=np.float64)
    index: dict[str, int] = {}
    inverse = np.fromiter((index.setdefault(t, len(index)) for t in texts), dtype=np.int64, count=len(texts))
    unique = list(index)
    if sort_by_length:
        order = np.argsort(np.fromiter((len(t) for t in unique), dtype=np.int64, count=len(unique)), kind="stable")
        sorted_scores = np.asarray(scorer.score([unique[i] for i in order], batch_size=batch_size), dtype=np.float64)
        scores = np.empty_like(sorted_scores)
        scores[order] = sorted_scores
    else:
        scores = np.asarray(scorer.score(unique, batch_size=batch_size), dtype=np.float64)
    if scores.shape != (len(unique),):
        raise PruneError(f"the scorer returned {scores.shape} scores for {len(unique)} texts")
    return scores[inverse]


def check_scores(scores: np.ndarray, ids: Sequence[Any], where: str) -> None:
    """Raise `PruneError` on NaN or infinite scores, naming how many and the first bullet."""
    bad = ~np.isfinite(scores)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise PruneError(
            f"{where}: the scorer returned {int(bad.sum())} non-finite score(s) (NaN/inf), "
            f"first for bullet {ids[first]!r}; refusing to prune on them (broken scorer weights?)"
        )


def group_keys_of(table: pa.Table, keys: Sequence[str]) -> list[Any]:
    """Per-row group key (a value, or a tuple for several key columns), nulls kept as None."""
    cols = [table.column(k).to_pylist() for k in keys]
    return cols[0] if len(cols) == 1 else list(zip(*cols))


def decide(
    scores: np.ndarray, groups: Sequence[Any] | np.ndarray, threshold: float | None, top_k: int | None,
    order: np.ndarray | None = None,
) -> np.ndarray:
    """The keep mask of `memprune.prune_rule.prune_mask`, with `PruneError` instead of ValueError."""
    try:
        return prune_mask(scores, groups, threshold, top_k, order=order)
    except ValueError as exc:
        raise PruneError(str(exc)) from exc


def stable_hash(key: Any) -> int:
    """A 64-bit hash of a group key that is the same in every process (Python's str hash is salted)."""
    if isinstance(key, (list, tuple)):
        key = tuple(k.item() if isinstance(k, np.generic) else k for k in key)
    elif isinstance(key, np.generic):
        key = key.item()
    return int.from_bytes(hashlib.blake2b(repr(key).encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def empty_stats(settings: Sequence[tuple[float | None, int | None]]) -> dict[str, Any]:
    """Additive counters of the prune job (merged over blocks by `merge_stats`)."""
    return {
        "rows": 0, "groups": 0, "tokens": 0, "score_sum": 0.0, "score_min": None, "score_max": None,
        "below_threshold": 0,
        "settings": {setting_name(t, k): {"kept": 0, "tokens_kept": 0, "groups_emptied": 0, "kept_hist": {}}
                     for t, k in settings},
    }


def block_stats(
    groups: Sequence[Any], scores: np.ndarray, tokens: np.ndarray,
    settings: Sequence[tuple[float | None, int | None]], order: np.ndarray | None = None,
) -> dict[str, Any]:
    """Counters of one block that holds whole groups: rows, groups, tokens, kept per setting."""
    codes = group_codes(groups)
    n_groups = int(codes.max()) + 1 if len(codes) else 0
    first = np.unique(codes, return_index=True)[1] if len(codes) else np.zeros(0, dtype=np.int64)
    stats = empty_stats(settings)
    stats.update(
        rows=len(scores), groups=n_groups, tokens=int(tokens.sum()), score_sum=float(scores.sum()),
        score_min=float(scores.min()) if len(scores) else None, score_max=float(scores.max()) if len(scores) else None,
        group_hashes=np.fromiter((stable_hash(groups[i]) for i in first), dtype=np.int64, count=len(first)),
    )
    threshold = settings[0][0]
    stats["below_threshold"] = int((scores < threshold).sum()) if threshold is not None else 0
    for t, k in settings:
        keep = decide(scores, codes, t, k, order)
        kept = np.bincount(codes[keep], minlength=n_groups)
        hist = np.bincount(kept)
        stats["settings"][setting_name(t, k)] = {
            "kept": int(keep.sum()), "tokens_kept": int(tokens[keep].sum()),
            "groups_emptied": int((kept == 0).sum()), "kept_hist": {str(i): int(c) for i, c in enumerate(hist) if c},
        }
    return stats


def merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum two counter dicts from `block_stats`/`empty_stats` (min/max combined, histograms added)."""
    out = dict(a)
    for key in ("rows", "groups", "tokens", "score_sum", "below_threshold"):
        out[key] = a[key] + b[key]
    for key, fn in (("score_min", min), ("score_max", max)):
        vals = [v for v in (a[key], b[key]) if v is not None]
        out[key] = fn(vals) if vals else None
    settings = {}
    for name, sa in a["settings"].items():
        sb = b["settings"][name]
        hist = dict(sa["kept_hist"])
        for k, v in sb["kept_hist"].items():
            hist[k] = hist.get(k, 0) + v
        settings[name] = {"kept": sa["kept"] + sb["kept"], "tokens_kept": sa["tokens_kept"] + sb["tokens_kept"],
                          "groups_emptied": sa["groups_emptied"] + sb["groups_emptied"], "kept_hist": hist}
    out["settings"] = settings
    return out


def summarize_stats(stats: dict[str, Any], settings: Sequence[tuple[float | None, int | None]]) -> dict[str, Any]:
    """Per setting: bullets and tokens per group before/after, reductions in percent, groups emptied."""
    rows, groups, tokens = stats["rows"], stats["groups"], stats["tokens"]
    per = max(groups, 1)
    out: dict[str, Any] = {}
    for t, k in settings:
        s = stats["settings"][setting_name(t, k)]
        out[setting_name(t, k)] = {
            "threshold": t, "top_k": k,
            "bullets_before": rows / per, "bullets_after": s["kept"] / per,
            "bullet_reduction_pct": 100.0 * (1 - s["kept"] / rows) if rows else None,
            "tokens_before": tokens / per, "tokens_after": s["tokens_kept"] / per,
            "token_reduction_pct": 100.0 * (1 - s["tokens_kept"] / tokens) if tokens else None,
            "groups_emptied_pct": 100.0 * s["groups_emptied"] / groups if groups else None,
            "bullets_total_before": rows, "bullets_total_after": s["kept"],
            "tokens_total_before": tokens, "tokens_total_after": s["tokens_kept"],
            "kept_per_group_hist": dict(sorted(s["kept_hist"].items(), key=lambda kv: int(kv[0]))),
        }
    return out


# =================================================================== token counting


def make_token_counter(spec: str, scorer: Any | None = None) -> tuple[Callable[[Sequence[str]], np.ndarray], str]:
    """A function texts -> token counts (no special tokens, no truncation) and the unit's name.

    "encoder": the scorer's own tokenizer; "whitespace": words; otherwise a local
    `tokenizer.json` or a directory holding one (never a download).
    """
    if spec == "whitespace":
        return count_words, "whitespace words"
    if spec == "encoder":
        if scorer is None:
            raise PruneError("tokenizer 'encoder' needs the loaded scorer")
        tok = scorer.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer directly: same ids, about 2x faster than tok(...)
            import copy

            backend = copy.deepcopy(backend)
            backend.no_truncation()
            backend.no_padding()

        def count_encoder(texts: Sequence[str]) -> np.ndarray:
            if not len(texts):
                return np.zeros(0, dtype=np.int64)
            if backend is not None:
                enc = backend.encode_batch(list(texts), add_special_tokens=False)
                return np.fromiter((len(e.ids) for e in enc), dtype=np.int64, count=len(enc))
            ids = tok(list(texts), add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
            return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))

        return count_encoder, f"tokens of the scorer's encoder tokenizer ({scorer.config.encoder}, no special tokens)"
    check_tokenizer_spec(spec)
    return file_counter(tokenizer_file(spec)), _tokenizer_name(spec, "")


def check_tokenizer_spec(spec: str) -> None:
    """Fail early (on the driver) for a tokenizer path that does not exist."""
    if spec in ("encoder", "whitespace"):
        return
    file = tokenizer_file(spec)
    if not file.is_file():
        raise PruneError(f"{file}: tokenizer file not found (give 'encoder', 'whitespace', a tokenizer.json or its dir)")


# =================================================================== in-process API


@dataclass(frozen=True)
class KeptBullet:
    """A bullet that survived pruning: its position in the input, text, score and the input item."""

    index: int
    text: str
    score: float
    bullet: Any


class MemoryPruner:
    """Prune the memory of one live session in-process (no Ray), with the batch job's exact rule.

    `MemoryPruner(scorer, threshold=0.5, top_k=5).prune(bullets)` scores the bullets
    (strings, or mappings with a 'text' key), drops scores below `threshold`, keeps the
    `top_k` best (ties: earlier bullet first) and returns the kept ones in input order.
    """

    def __init__(
        self, scorer: Any, threshold: float | None = 0.5, top_k: int | None = 5, batch_size: int = 64,
        sort_by_length: bool = True, device: str | None = None,
    ) -> None:
        from memprune.scorer import Scorer

        check_rule(threshold, top_k)
        if isinstance(scorer, (str, os.PathLike)):
            scorer = Scorer.load(scorer, device=device)
        elif device is not None:
            scorer = scorer.to(device)
        self.scorer = scorer
        self.threshold = threshold
        self.top_k = top_k
        self.batch_size = batch_size
        self.sort_by_length = sort_by_length

    def score(self, bullets: Sequence[Any]) -> np.ndarray:
        """Usefulness scores (float64) of `bullets`, in order; NaN/inf raise `PruneError`."""
        texts = [bullet_text(b, i) for i, b in enumerate(bullets)]
        scores = score_texts(self.scorer, texts, self.batch_size, self.sort_by_length)
        check_scores(scores, [f"bullets[{i}]" for i in range(len(texts))], "MemoryPruner")
        return scores

    def decide(self, bullets: Sequence[Any], groups: Sequence[Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, keep mask) for `bullets`; all one group unless per-bullet `groups` are given."""
        scores = self.score(bullets)
        if groups is None:
            groups = np.zeros(len(scores), dtype=np.int64)
        elif len(groups) != len(scores):
            raise PruneError(f"groups ({len(groups)}) and bullets ({len(scores)}) differ in length")
        return scores, decide(scores, groups, self.threshold, self.top_k)

    def prune(self, bullets: Sequence[Any], groups: Sequence[Any] | None = None) -> list[KeptBullet]:
        """The kept bullets with their scores, in input order."""
        bullets = list(bullets)
        scores, keep = self.decide(bullets, groups)
        return [KeptBullet(int(i), bullet_text(bullets[i], int(i)), float(scores[i]), bullets[i]) for i in np.flatnonzero(keep)]

    def prune_table(self, table: pa.Table, group_by: str = "session") -> pa.Table:
        """A small bullets table with `score` and `keep` columns, decided as the batch job does."""
        keys = _group_keys(group_by)
        missing = [c for c in ("bullet_id", "text", *keys) if c not in table.column_names]
        if missing:
            raise PruneError(f"<table>: column {missing[0]!r} missing")
        scores = score_texts(self.scorer, table.column("text").to_pylist(), self.batch_size, self.sort_by_length)
        check_scores(scores, table.column("bullet_id").to_pylist(), "MemoryPruner.prune_table")
        keep = decide(scores, group_keys_of(table, keys), self.threshold, self.top_k)
        return _with_outputs(table, scores, keep)


def _group_keys(group_by: str) -> tuple[str, ...]:
    if group_by not in GROUP_KEYS:
        raise PruneError(f"group_by must be one of {', '.join(GROUP_KEYS)}, got {group_by!r}")
    return GROUP_KEYS[group_by]


def _with_outputs(table: pa.Table, scores: np.ndarray, keep: np.ndarray) -> pa.Table:
    """`table` without helper/old output columns, plus float64 `score` and bool `keep`."""
    drop = [c for c in (*HELPERS, *OUTPUT_COLUMNS) if c in table.column_names]
    table = table.drop_columns(drop) if drop else table
    return table.append_column("score", pa.array(scores, pa.float64())).append_column("keep", pa.array(keep, pa.bool_()))


# =================================================================== the store: files, schema, plan


@dataclass(frozen=True)
class StoreFile:
    """One Parquet file of the input store: path, rows, first global row, row-group offsets."""

    path: str
    num_rows: int
    offset: int
    row_group_starts: tuple[int, ...]


def list_store_files(input: str | os.PathLike[str]) -> list[Path]:
    """The store's Parquet files: a file; a corpus dir's bullets.parquet; else every *.parquet in the dir, sorted."""
    p = Path(input)
    if p.is_file():
        return [p]
    if not p.exists():
        raise PruneError(f"{p}: no such file or directory")
    if (p / "bullets.parquet").is_file():
        return [p / "bullets.parquet"]
    files = sorted(f for f in p.rglob("*.parquet") if f.is_file() and not any(part.startswith((".", "_")) for part in f.relative_to(p).parts))
    if not files:
        raise PruneError(f"{p}: no Parquet files in this directory")
    return files


def open_store(files: Sequence[Path], columns: list[str] | None) -> tuple[list[StoreFile], pa.Schema, list[str]]:
    """Check every file's footer and schema; return the files, the read schema and notes.

    The BULLETS columns must be present with their exact types; all files must agree on
    the columns that are carried. Errors name the file and the column.
    """
    infos: list[StoreFile] = []
    read_schema: pa.Schema | None = None
    notes: list[str] = []
    offset = 0
    for path in files:
        try:
            pf = pq.ParquetFile(path)
            schema = pf.schema_arrow
        except (pa.ArrowInvalid, OSError) as exc:
            raise PruneError(f"{path}: cannot read as Parquet: {exc}") from exc
        for f in BULLETS:
            if f.name not in schema.names:
                raise PruneError(f"{path}: column {f.name!r} missing (not a bullets table)")
            got = schema.field(f.name).type
            if not got.equals(f.type):
                raise PruneError(f"{path}: column {f.name!r} has type {got}, expected {f.type}")
        wanted = list(REQUIRED) + [
            n for n in schema.names if n not in REQUIRED and n not in OUTPUT_COLUMNS and n not in HELPERS
            and (columns is None or n in columns)
        ]
        if columns is not None:
            absent = [c for c in columns if c not in schema.names]
            if absent:
                raise PruneError(f"{path}: column {absent[0]!r} (named in `columns`) missing")
        replaced = [n for n in OUTPUT_COLUMNS if n in schema.names]
        if replaced and not notes:
            notes.append(f"input already has {', '.join(replaced)}: replaced by this run's values")
        file_schema = pa.schema([schema.field(n) for n in wanted])
        if read_schema is None:
            read_schema = file_schema
        elif [(f.name, f.type) for f in file_schema] != [(f.name, f.type) for f in read_schema]:
            for a in read_schema:
                if a.name not in file_schema.names:
                    raise PruneError(f"{path}: column {a.name!r} missing (present in {files[0]})")
                if not file_schema.field(a.name).type.equals(a.type):
                    raise PruneError(f"{path}: column {a.name!r} has type {file_schema.field(a.name).type}, "
                                     f"but {a.type} in {files[0]}")
            extra = [n for n in file_schema.names if n not in read_schema.names]
            raise PruneError(f"{path}: column {extra[0]!r} is not in {files[0]} (all files must share the columns)")
        md = pf.metadata
        starts, acc = [], 0
        leaf = {md.schema.column(j).path: j for j in range(md.num_columns)}
        for i in range(md.num_row_groups):
            starts.append(acc)
            rg = md.row_group(i)
            for name in NOT_NULL:
                j = leaf.get(name)
                st = rg.column(j).statistics if j is not None else None
                if st is not None and st.has_null_count and st.null_count:
                    raise PruneError(f"{path}: column {name!r} has {st.null_count} null value(s) in rows "
                                     f"{acc}-{acc + rg.num_rows - 1} (a required column)")
            acc += rg.num_rows
        infos.append(StoreFile(str(path), md.num_rows, offset, tuple(starts)))
        offset += md.num_rows
    assert read_schema is not None
    return infos, read_schema, notes


@dataclass
class Plan:
    """Where the blocks of the store start and end, and whether groups are contiguous."""

    files: list[StoreFile]
    keys: tuple[str, ...]
    rows: int
    blocks: list[tuple[int, int]]
    contiguous: bool
    mode: Literal["contiguous", "shuffle"]
    runs: int
    reason: str
    scan_s: float = 0.0


def _key_values(batch: pa.RecordBatch, keys: Sequence[str]) -> list[np.ndarray]:
    return [batch.column(k).to_numpy(zero_copy_only=False) for k in keys]


def plan_store(
    files: Sequence[StoreFile], keys: Sequence[str], block_rows: int,
    grouping: Literal["auto", "contiguous", "shuffle"] = "auto", limit_rows: int | None = None,
) -> Plan:
    """Scan only the key columns (streaming): find group runs, check contiguity, cut blocks at group boundaries.

    A group is contiguous when its rows form one run. Runs are compared by a 64-bit hash
    of the key: a collision can only make the plan fall back to the shuffle (safe), never
    treat a split group as whole.
    """
    started = time.perf_counter()
    total = sum(f.num_rows for f in files)
    limit = total if limit_rows is None else min(limit_rows, total)
    run_starts: list[np.ndarray] = []
    run_hashes: list[np.ndarray] = []
    prev: tuple[Any, ...] | None = None
    end = total  # first row not taken (limit rounded up to the end of a group)
    done = False
    for f in files:
        if done:
            break
        pf = pq.ParquetFile(f.path)
        row = f.offset
        try:
            batches = pf.iter_batches(columns=list(keys), batch_size=65_536)
            for batch in batches:
                vals = _key_values(batch, keys)
                n = batch.num_rows
                change = np.zeros(n, dtype=bool)
                for v in vals:
                    change[1:] |= v[1:] != v[:-1]
                first_key = tuple(v[0] for v in vals) if n else None
                if n:
                    change[0] = prev is None or first_key != prev
                idx = np.flatnonzero(change)
                if limit < total and row + n > limit:
                    beyond = idx[row + idx >= limit]
                    if len(beyond):  # the first run starting at/after the limit ends the plan
                        end = row + int(beyond[0])
                        idx = idx[idx < beyond[0]]
                        done = True
                run_starts.append(row + idx)
                run_hashes.append(np.fromiter((stable_hash(tuple(v[i] for v in vals)) for i in idx), dtype=np.int64, count=len(idx)))
                if n:
                    prev = tuple(v[n - 1] for v in vals)
                row += n
                if done:
                    break
        except (pa.ArrowInvalid, OSError) as exc:
            raise PruneError(f"{f.path}: cannot read the key columns {list(keys)}: {exc}") from exc
    starts = np.concatenate(run_starts) if run_starts else np.zeros(0, dtype=np.int64)
    hashes = np.concatenate(run_hashes) if run_hashes else np.zeros(0, dtype=np.int64)
    rows = end
    n_runs = len(starts)
    uniq, counts = np.unique(hashes, return_counts=True)
    contiguous = len(uniq) == n_runs
    if contiguous:
        reason = f"every group is one run of adjacent rows ({n_runs} groups)"
    else:
        dup = uniq[counts > 1][0]
        at = np.flatnonzero(hashes == dup)[:2]
        a, b = (_locate(files, int(starts[i])) for i in at)
        reason = (f"{len(hashes) - len(uniq)} group(s) are split into several runs, e.g. the group at {a[0]} row {a[1]} "
                  f"appears again at {b[0]} row {b[1]}")
    if grouping == "contiguous" and not contiguous:
        raise PruneError(f"grouping 'contiguous' requested but {reason}; use grouping auto or shuffle")
    mode: Literal["contiguous", "shuffle"] = "contiguous" if contiguous and grouping != "shuffle" else "shuffle"
    if mode == "shuffle" and contiguous:
        reason = "grouping 'shuffle' requested"
    blocks: list[tuple[int, int]] = []
    if rows:
        if mode == "contiguous":
            cut = 0
            for s in starts[1:]:
                if s - cut >= block_rows:
                    blocks.append((cut, int(s)))
                    cut = int(s)
            blocks.append((cut, rows))
        else:
            blocks = [(a, min(a + block_rows, rows)) for a in range(0, rows, block_rows)]
    return Plan(list(files), tuple(keys), rows, blocks, contiguous, mode, n_runs, reason,
                scan_s=time.perf_counter() - started)


def bytes_per_row(files: Sequence[StoreFile], columns: Sequence[str]) -> float:
    """Uncompressed bytes per row of `columns`, from the Parquet footers (no data read)."""
    total, rows = 0, 0
    wanted = set(columns)
    for f in files:
        md = pq.ParquetFile(f.path).metadata
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            rows += rg.num_rows
            for j in range(rg.num_columns):
                col = rg.column(j)
                if col.path_in_schema.split(".")[0] in wanted:
                    total += col.total_uncompressed_size
    return total / rows if rows else 0.0


def block_rows_for(block_rows: int, row_bytes: float, max_block_bytes: int) -> int:
    """`block_rows`, lowered so a block stays well under Ray Data's block size limit (a split would cut groups)."""
    if row_bytes <= 0:
        return block_rows
    return max(1, min(block_rows, int(max_block_bytes / 4 / row_bytes)))


def _locate(files: Sequence[StoreFile], row: int) -> tuple[str, int]:
    """(file path, row within the file) of a global row index."""
    for f in files:
        if f.offset <= row < f.offset + f.num_rows:
            return f.path, row - f.offset
    return files[-1].path, row - files[-1].offset


def read_rows(files: Sequence[StoreFile], start: int, stop: int, schema: pa.Schema) -> pa.Table:
    """Global rows [start, stop) of the store with the columns of `schema`; nulls in required columns raise."""
    parts: list[pa.Table] = []
    for f in files:
        a, b = max(start, f.offset), min(stop, f.offset + f.num_rows)
        if a >= b:
            continue
        la, lb = a - f.offset, b - f.offset
        rgs = [i for i, s in enumerate(f.row_group_starts)
               if s < lb and (f.row_group_starts[i + 1] if i + 1 < len(f.row_group_starts) else f.num_rows) > la]
        try:
            t = pq.ParquetFile(f.path).read_row_groups(rgs, columns=schema.names)
        except (pa.ArrowInvalid, OSError) as exc:
            raise PruneError(f"{f.path}: cannot read rows {la}-{lb - 1}: {exc}".replace("\n", " ")) from exc
        t = t.slice(la - f.row_group_starts[rgs[0]], lb - la)
        for name in NOT_NULL:
            nulls = t.column(name).null_count
            if nulls:
                i = int(np.flatnonzero(t.column(name).is_null().to_numpy(zero_copy_only=False))[0])
                raise PruneError(f"{f.path}: column {name!r} is null at row {la + i} ({nulls} null(s) in rows {la}-{lb - 1})")
        parts.append(t.select(schema.names).cast(schema))
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


# =================================================================== Ray pieces


def _make_datasource(plan: Plan, schema: pa.Schema, add_row: bool, sortkey: tuple[str, ...] | None) -> Any:
    """A Ray Data datasource that reads exactly the plan's blocks (group-aligned in contiguous mode)."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    files = plan.files
    out_schema = schema
    if add_row:
        out_schema = out_schema.append(pa.field(ROW, pa.int64(), nullable=False))
    if sortkey:
        out_schema = out_schema.append(pa.field(SORTKEY, pa.string(), nullable=False))
    # One read task per planned block. Ray Data would merge several blocks of one task into one
    # (harmless: still whole groups) but that costs parallelism; re-reading a row group that
    # several blocks share costs far less than the encoder does.
    task_groups = [[blk] for blk in plan.blocks]

    def make_read_fn(blocks: list[tuple[int, int]]) -> Callable[[], Iterator[pa.Table]]:
        def read_fn() -> Iterator[pa.Table]:
            whole = read_rows(files, blocks[0][0], blocks[-1][1], schema)
            for a, b in blocks:
                t = whole.slice(a - blocks[0][0], b - a)
                if add_row:
                    t = t.append_column(ROW, pa.array(np.arange(a, b, dtype=np.int64)))
                if sortkey:
                    t = t.append_column(SORTKEY, _sort_key(t, sortkey))
                yield t
        return read_fn

    class BulletStore(Datasource):
        """The planned blocks of a bullets store (Parquet), only the needed columns."""

        def get_name(self) -> str:
            return "ReadBulletStore"

        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None) -> list[Any]:
            tasks = []
            for blocks in task_groups:
                rows = blocks[-1][1] - blocks[0][0]
                paths = tuple(f.path for f in files if f.offset < blocks[-1][1] and f.offset + f.num_rows > blocks[0][0])
                meta = BlockMetadata(num_rows=rows, size_bytes=None, exec_stats=None, input_files=paths)
                tasks.append(ReadTask(make_read_fn(blocks), meta, schema=out_schema))
            return tasks

    return BulletStore()


def _sort_key(table: pa.Table, keys: Sequence[str]) -> pa.Array:
    """One string sort key per row for the shuffle path (nulls -> empty; grouping itself uses the real keys)."""
    parts = []
    for k in keys:
        col = table.column(k)
        if pa.types.is_integer(col.type):
            col = pc.utf8_lpad(pc.cast(pc.add(pc.cast(col, pa.int64()), 2**62), pa.string()), 20, "0")
        parts.append(pc.fill_null(pc.cast(col, pa.string()), ""))
    return parts[0].combine_chunks() if len(parts) == 1 else pc.binary_join_element_wise(*parts, "\x1f").combine_chunks()


class _Tally:
    """Ray actor collecting per-block counters; fails when one group reaches it from two blocks."""

    def __init__(self, settings: list[tuple[float | None, int | None]]) -> None:
        self.stats = empty_stats(settings)
        self.hashes: list[np.ndarray] = []
        self.blocks = 0
        self.times: dict[str, float] = {}

    def add_time(self, times: dict[str, float]) -> None:
        for k, v in times.items():
            self.times[k] = self.times.get(k, 0.0) + v

    def add(self, stats: dict[str, Any]) -> None:
        stats = dict(stats)
        self.hashes.append(np.asarray(stats.pop("group_hashes", ()), dtype=np.int64))
        self.stats = merge_stats(self.stats, stats)
        self.blocks += 1

    def result(self) -> dict[str, Any]:
        hashes = np.concatenate(self.hashes) if self.hashes else np.zeros(0, dtype=np.int64)
        return {**self.stats, "split_groups": int(len(hashes) - len(np.unique(hashes))), "blocks": self.blocks,
                "times": self.times}


class ScoreActor:
    """Ray Data actor: holds the scorer; scores a block and (contiguous mode) decides its `keep` column."""

    def __init__(
        self, scorer_path: str, device: str, threads: int, batch_size: int, sort_by_length: bool, tokenizer: str,
        keys: list[str], settings: list[tuple[float | None, int | None]], decide_here: bool, tally: Any,
    ) -> None:
        import ray
        import torch

        from memprune.scorer import Scorer

        t0 = time.perf_counter()
        torch.set_num_threads(max(1, threads))
        self.scorer = Scorer.load(scorer_path, device=device)
        self.count_tokens, _ = make_token_counter(tokenizer, self.scorer)
        self.batch_size, self.sort_by_length = batch_size, sort_by_length
        self.keys, self.settings, self.decide_here, self.tally = keys, settings, decide_here, tally
        ray.get(tally.add_time.remote({"actor_load_s": time.perf_counter() - t0, "actors_started": 1}))

    def __call__(self, block: pa.Table) -> pa.Table:
        import ray

        t0 = time.perf_counter()
        texts = block.column("text").to_pylist()
        scores = score_texts(self.scorer, texts, self.batch_size, self.sort_by_length)
        check_scores(scores, block.column("bullet_id").to_pylist(), "prune")
        t1 = time.perf_counter()
        tokens = self.count_tokens(texts)
        t2 = time.perf_counter()
        times = {"score_s": t1 - t0, "tokens_s": t2 - t1}
        if not self.decide_here:
            ray.get(self.tally.add_time.remote(times))
            return block.append_column("score", pa.array(scores, pa.float64())).append_column(TOKENS, pa.array(tokens))
        groups = group_keys_of(block, self.keys)
        threshold, top_k = self.settings[0]
        keep = decide(scores, groups, threshold, top_k)
        stats = block_stats(groups, scores, tokens, self.settings)
        out = _with_outputs(block, scores, keep)
        times["decide_s"] = time.perf_counter() - t2
        ray.get(self.tally.add_time.remote(times))
        ray.get(self.tally.add.remote(stats))
        return out


def decide_sorted_block(
    block: pa.Table, keys: list[str], settings: list[tuple[float | None, int | None]], tally: Any
) -> pa.Table:
    """Shuffle path: a block of whole groups after the sort; order rows by (group, input position) and decide."""
    import ray

    if block.num_rows == 0:
        return _with_outputs(block, np.zeros(0), np.zeros(0, dtype=bool))
    block = block.sort_by([(SORTKEY, "ascending"), (ROW, "ascending")])
    scores = block.column("score").to_numpy()
    tokens = block.column(TOKENS).to_numpy()
    order = block.column(ROW).to_numpy()
    groups = group_keys_of(block, keys)
    threshold, top_k = settings[0]
    t0 = time.perf_counter()
    keep = decide(scores, groups, threshold, top_k, order=order)
    stats = block_stats(groups, scores, tokens, settings, order=order)
    out = _with_outputs(block, scores, keep)
    ray.get(tally.add_time.remote({"decide_s": time.perf_counter() - t0}))
    ray.get(tally.add.remote(stats))
    return out


_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(PruneError|SchemaError|ScorerError): (.+)$", re.MULTILINE)


def _user_error(exc: BaseException) -> PruneError | None:
    """The PruneError/SchemaError/ScorerError raised inside a Ray task, recovered from the wrapped exception."""
    if isinstance(exc, PruneError):
        return exc
    if isinstance(exc, SchemaError):
        return PruneError(str(exc))
    match = _ERROR_LINE.findall(str(exc))
    return PruneError(match[-1][1].strip()) if match else None




@dataclass
class Resources:
    """How the actor pool is laid out on this cluster."""

    actors: int
    device: str
    threads: int
    actor_cpu_request: float
    gpus_per_actor: int


def plan_resources(config: PruneConfig, cluster: Mapping[str, float]) -> Resources:
    """Actor pool size and per-actor requests; leaves CPU for the read/write tasks so nothing starves."""
    cpus = float(cluster.get("CPU", 1.0))
    gpus = int(cluster.get("GPU", 0))
    use_gpu = gpus >= 1 if config.use_gpu == "auto" else bool(config.use_gpu)
    if use_gpu and gpus < 1:
        raise PruneError("use_gpu is true but the Ray cluster has no GPU")
    threads = max(1, round(config.actor_cpus))
    if use_gpu:
        actors = config.actors or gpus
        request = min(config.actor_cpus, max(0.1, (cpus - 2 * config.io_cpus) / actors))
        return Resources(actors, "cuda", threads, request, 1)
    actors = config.actors or max(1, int(cpus // config.actor_cpus))
    request = min(config.actor_cpus, max(0.05, (cpus - 2 * config.io_cpus) / actors))
    return Resources(actors, "cpu", threads, round(request, 3), 0)


# =================================================================== the job


def run_prune(config: PruneConfig) -> dict[str, Any]:
    """Score and prune the store of `config.input` into `config.out`; return the prune.json summary."""
    started = time.perf_counter()
    check_rule(config.threshold, config.top_k)
    check_tokenizer_spec(config.tokenizer)
    scorer_info = _check_scorer(config.scorer)
    keys = _group_keys(config.group_by)
    settings = settings_of(config)
    out = Path(config.out)
    files, schema, notes = open_store(list_store_files(config.input), config.columns)
    rows_wanted = min(sum(f.num_rows for f in files), config.limit_rows or math.inf)
    res: Resources | None = None
    init_s = 0.0
    block_rows = config.block_rows
    if rows_wanted:
        t0 = time.perf_counter()
        ensure_ray(config.ray_address)
        import ray
        from ray.data import DataContext

        init_s = time.perf_counter() - t0
        res = plan_resources(config, ray.cluster_resources())
        block_rows = block_rows_for(block_rows, bytes_per_row(files, schema.names),
                                    DataContext.get_current().target_max_block_size or 2**27)
        # At least ~4 blocks per actor, so that no actor idles while another finishes the last big block.
        block_rows = max(1, min(block_rows, math.ceil(rows_wanted / (4 * res.actors))))
    plan = plan_store(files, keys, block_rows, config.grouping, config.limit_rows)
    from rich.console import Console

    console = Console(stderr=True)
    console.print(f"prune: {plan.rows} bullets in {len(files)} file(s), {plan.runs} group runs; "
                  f"{plan.mode} mode ({plan.reason}); {len(plan.blocks)} blocks", highlight=False)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{STORE_DIR}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        if plan.rows == 0 or res is None:
            stats = empty_stats(settings) | {"split_groups": 0, "blocks": 0}
            timing: dict[str, float] = {}
            tmp.mkdir(parents=True)
            out_schema = schema.append(pa.field("score", pa.float64())).append(pa.field("keep", pa.bool_()))
            pq.write_table(out_schema.empty_table(), tmp / "part-00000.parquet")
        else:
            stats, timing = _run_pipeline(config, res, plan, schema, keys, settings, tmp)
            timing = {"ray_init_s": init_s, **timing}
        written = _finalize_files(tmp)
        rows_out = sum(pq.ParquetFile(p).metadata.num_rows for p in written)
        if not (plan.rows == stats["rows"] == rows_out):
            raise PruneError(f"row count mismatch: {plan.rows} read, {stats['rows']} scored, {rows_out} written")
        if stats["split_groups"]:
            raise PruneError(f"{stats['split_groups']} group(s) reached the decision in two blocks; the result would be wrong")
        store = _swap_into_place(tmp, out / STORE_DIR)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total_s = time.perf_counter() - started
    summary = {
        "format": PRUNE_FORMAT,
        "input": {"path": str(config.input), "files": [f.path for f in files], "rows": plan.rows,
                  "rows_in_files": sum(f.num_rows for f in files), "limit_rows": config.limit_rows},
        "output": {"store": str(store), "files": [p.name for p in sorted(store.glob("*.parquet"))], "rows": rows_out,
                   "columns": [*schema.names, *OUTPUT_COLUMNS]},
        "scorer": scorer_info,
        "rule": {"threshold": config.threshold, "top_k": config.top_k, "group_by": config.group_by, "keys": list(keys),
                 "ties": "higher score first, then earlier input position"},
        "grouping": {"mode": plan.mode, "contiguous": plan.contiguous, "reason": plan.reason, "groups": stats["groups"],
                     "blocks": len(plan.blocks), "scan_s": round(plan.scan_s, 3)},
        "tokenizer": _tokenizer_name(config.tokenizer, scorer_info["encoder"]),
        "groups": stats["groups"],
        "result": summarize_stats(stats, settings)[setting_name(config.threshold, config.top_k)],
        "settings": summarize_stats(stats, settings),
        "scores": {"mean": stats["score_sum"] / stats["rows"] if stats["rows"] else None, "min": stats["score_min"],
                   "max": stats["score_max"], "below_threshold": stats["below_threshold"]},
        "resources": None if res is None else {"actors": res.actors, "device": res.device, "threads_per_actor": res.threads,
                                                "actor_cpu_request": res.actor_cpu_request, "batch_size": config.batch_size,
                                                "block_rows": block_rows},
        "timing": {
            "total_s": round(total_s, 3), "scan_s": round(plan.scan_s, 3),
            **{k: round(v, 3) for k, v in timing.items()},
            # Summed over actors/tasks: model loading, forward passes, token counting, the rule.
            "work": {k: round(v, 3) for k, v in sorted(stats.get("times", {}).items())},
            # Throughput of the Ray Data pipeline (actor start-up included, Ray start-up excluded).
            "bullets_per_s": round(plan.rows / timing["pipeline_s"], 1) if timing.get("pipeline_s") else None,
        },
        "notes": notes,
        "config": config.model_dump(mode="json"),
    }
    write_json(out / "prune.json", summary)
    with atomic_path(out / "prune.md") as tmp_md:
        tmp_md.write_text(render_markdown(summary), encoding="utf-8")
    console.print(f"prune: kept {summary['result']['bullets_total_after']} of {plan.rows} bullets "
                  f"({summary['result']['bullet_reduction_pct'] or 0:.1f}% fewer) -> {store}", highlight=False)
    return summary


def run(config: PruneConfig) -> dict[str, Any]:
    """Run the prune stage from its config (the `jobs/prune.py` entry point)."""
    return run_prune(config)


def _check_scorer(path: str) -> dict[str, Any]:
    """Validate a scorer artifact cheaply on the driver (config + files); return what prune.json records."""
    from memprune.scorer import ScorerError, read_scorer_config

    p = Path(path)
    try:
        sc = read_scorer_config(p)
    except ScorerError as exc:
        raise PruneError(str(exc).replace("\n", " ")) from exc
    if not (p / "head.safetensors").is_file():
        raise PruneError(f"{p}: missing head.safetensors")
    return {"path": str(p.resolve()), "encoder": sc.encoder, "stage": sc.stage, "seed": sc.seed,
            "lora": sc.lora is not None, "max_length": sc.max_length}


def _tokenizer_name(spec: str, encoder: str) -> str:
    if spec == "encoder":
        return f"tokens of the scorer's encoder tokenizer ({encoder}, no special tokens)"
    if spec == "whitespace":
        return "whitespace words"
    return f"tokens of {tokenizer_file(spec)} (no special tokens)"


def _run_pipeline(
    config: PruneConfig, res: Resources, plan: Plan, schema: pa.Schema, keys: tuple[str, ...],
    settings: list[tuple[float | None, int | None]], tmp: Path,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Assemble and run the Ray Data pipeline; write the store into `tmp`; return counters and timing."""
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    timing: dict[str, float] = {}
    t1 = time.perf_counter()
    ctx = DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = config.progress
    tally = ray.remote(num_cpus=0)(_Tally).remote(settings)
    shuffle = plan.mode == "shuffle"
    try:
        ds = ray.data.read_datasource(
            _make_datasource(plan, schema, add_row=shuffle, sortkey=keys if shuffle else None),
            num_cpus=config.io_cpus,
            override_num_blocks=len(plan.blocks),  # no extra splitting of read outputs (it would cut groups)
        )
        ds = ds.map_batches(
            ScoreActor,
            fn_constructor_kwargs={
                "scorer_path": str(Path(config.scorer).resolve()), "device": res.device, "threads": res.threads,
                "batch_size": config.batch_size, "sort_by_length": config.sort_by_length, "tokenizer": config.tokenizer,
                "keys": list(keys), "settings": settings, "decide_here": not shuffle, "tally": tally,
            },
            batch_size=None,
            batch_format="pyarrow",
            compute=ActorPoolStrategy(size=min(res.actors, len(plan.blocks))),
            num_cpus=res.actor_cpu_request,
            num_gpus=res.gpus_per_actor,
        )
        if shuffle:
            ds = ds.sort(SORTKEY).map_batches(
                decide_sorted_block,
                fn_kwargs={"keys": list(keys), "settings": settings, "tally": tally},
                batch_size=None, batch_format="pyarrow", num_cpus=config.io_cpus,
            )
        ds.write_parquet(str(tmp), min_rows_per_file=config.rows_per_file, ray_remote_args={"num_cpus": config.io_cpus})
        stats = ray.get(tally.result.remote())
        timing["pipeline_s"] = time.perf_counter() - t1
    except Exception as exc:
        user = _user_error(exc)
        if user is not None:
            raise user from None
        raise
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
        ray.kill(tally)
    return stats, timing


def _finalize_files(tmp: Path) -> list[Path]:
    """Rename Ray's output files (sorted = write order = input order) to part-00000.parquet, ..."""
    files = sorted(p for p in tmp.iterdir() if p.suffix == ".parquet")
    out = []
    for i, p in enumerate(files):
        target = tmp / f"part-{i:05d}.parquet"
        p.rename(target)
        out.append(target)
    return out


def _swap_into_place(tmp: Path, target: Path) -> Path:
    """Atomically replace `target` (a directory) by `tmp`; the old store is removed only afterwards."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


def read_pruned(out: str | os.PathLike[str]) -> pa.Table:
    """The pruned store written by `run_prune` into `out` (all part files, in order)."""
    store = Path(out) / STORE_DIR
    files = sorted(store.glob("part-*.parquet"))
    if not files:
        raise PruneError(f"{store}: no pruned store here")
    return pa.concat_tables([pq.read_table(f) for f in files])


# =================================================================== report


def _fmt(x: Any, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def render_markdown(summary: dict[str, Any]) -> str:
    """prune.md: the before/after table per pruning setting, and how the job ran."""
    g = summary["grouping"]
    unit = summary["rule"]["group_by"]
    lines = [
        "# Pruning report",
        "",
        f"Input `{summary['input']['path']}`: {summary['input']['rows']} bullets in {summary['groups']} {unit} groups; "
        f"scorer `{summary['scorer']['path']}` (stage {summary['scorer']['stage'] or 'n/a'}, encoder {summary['scorer']['encoder']}).",
        f"Tokens: {summary['tokenizer']}. Grouping: {g['mode']} ({g['reason']}).",
        "",
        f"| setting | bullets/{unit} before | after | reduction % | tokens/{unit} before | after | reduction % | {unit}s emptied % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ordered = sorted(summary["settings"].items(), key=lambda kv: (kv[1]["top_k"] is None, kv[1]["top_k"] or 0))
    for name, s in ordered:
        mark = " (written)" if name == setting_name(summary["rule"]["threshold"], summary["rule"]["top_k"]) else ""
        lines.append(
            f"| {name}{mark} | {_fmt(s['bullets_before'])} | {_fmt(s['bullets_after'])} | {_fmt(s['bullet_reduction_pct'], 1)} "
            f"| {_fmt(s['tokens_before'], 1)} | {_fmt(s['tokens_after'], 1)} | {_fmt(s['token_reduction_pct'], 1)} "
            f"| {_fmt(s['groups_emptied_pct'], 1)} |"
        )
    t = summary["timing"]
    lines += ["", f"Rows in = rows out = {summary['output']['rows']}; store `{summary['output']['store']}`; "
              f"{t['total_s']} s ({t['bullets_per_s']} bullets/s).", ""]
    return "\n".join(lines)
