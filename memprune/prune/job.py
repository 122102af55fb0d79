"""The prune job on Ray Data: a datasource of planned blocks -> scoring actors -> decide -> Parquet.

Contiguous groups (the usual store) stream: read -> score + decide (actor pool) -> write, no
shuffle, output in input order. Otherwise (e.g. `group_by: speaker`, whose rows interleave
across sessions) the job falls back to one full shuffle: read -> score -> `Dataset.sort(group
keys)` -> decide per block -> write; the sort's range partitioning puts every group in one
block (checked at run time: a group seen in two blocks is an error, not a silent mistake).
Up to `sort_in_memory` rows the scored rows are gathered on the driver instead and decided there
as one block (the sort's fixed cost of tasks and stages dominates a small input).
"""

from __future__ import annotations

import platform
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memprune.decision import Bullets, Decision, PruneError, PruneRule, unify_equal_texts
from memprune.encoders import EncoderActor
from memprune.precision import Precision
from memprune.prune.config import PruneConfig
from memprune.prune.inputs import Lives
from memprune.prune.scoring import (
    EMB,
    ROW,
    SORTKEY,
    TOKENS,
    check_scores,
    group_keys_of,
    score_and_embed,
    with_outputs,
)
from memprune.prune.stats import block_stats, empty_stats, merge_stats, stable_hash
from memprune.prune.store import Plan, read_rows
from memprune.runtime import ActorResources, user_error
from memprune.storage import Location, canonical
from memprune.timing import busy_seconds, now, underused_seconds, window_split
from memprune.tokens import token_counter


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
            for a, b in blocks:
                yield _planned_block(files, a, b, schema, add_row, sortkey)
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


def _planned_block(files: Sequence[Any], a: int, b: int, schema: pa.Schema, add_row: bool,
                   sortkey: tuple[str, ...] | None) -> pa.Table:
    """Store rows [a, b) with the shuffle path's helper columns (input position, sort key) where asked."""
    t = read_rows(files, a, b, schema)
    if add_row:
        t = t.append_column(ROW, pa.array(np.arange(a, b, dtype=np.int64)))
    if sortkey:
        t = t.append_column(SORTKEY, _sort_key(t, sortkey))
    return t


def _sort_key(table: pa.Table, keys: Sequence[str]) -> pa.Array:
    """One string sort key per row for the shuffle path (nulls -> empty; grouping itself uses the real keys)."""
    parts = []
    for k in keys:
        col = table.column(k)
        if pa.types.is_integer(col.type):
            col = pc.utf8_lpad(pc.cast(pc.add(pc.cast(col, pa.int64()), 2**62), pa.string()), 20, "0")
        parts.append(pc.fill_null(pc.cast(col, pa.string()), ""))
    return parts[0].combine_chunks() if len(parts) == 1 else pc.binary_join_element_wise(*parts, "\x1f").combine_chunks()


_DRIVER_TALLY = threading.Lock()  # the driver's scoring threads share one `_Tally`


def _tell(tally: Any, method: str, *args: Any) -> Any:
    """Call a `_Tally` method: on the Ray actor (and wait for it), or on the driver's own `_Tally`."""
    fn = getattr(tally, method)
    if hasattr(fn, "remote"):
        import ray

        return ray.get(fn.remote(*args))
    with _DRIVER_TALLY:
        return fn(*args)


class _Tally:
    """Ray actor (or, scoring on the driver, a plain object) collecting per-block counters and timings; fails when one group reaches it from two blocks."""

    def __init__(self, settings: list[PruneRule]) -> None:
        self.stats = empty_stats(settings)
        self.hashes: list[np.ndarray] = []
        self.blocks = 0
        self.times: dict[str, float] = {}
        self.spans: dict[str, list[tuple[float, float]]] = {}  # per scoring actor (or "decide": the shuffle's tasks)
        self.actors: dict[str, tuple[float, float]] = {}  # scoring actor -> (created, model loaded)
        self.precisions: set[str] = set()
        self.nodes: set[str] = set()

    def add_actor(self, precision: str, node: str, actor: str, loading: tuple[float, float]) -> None:
        """A scoring actor started: the precision its scorer runs at (resolved on its device), its Ray node, and
        when it was created and when its model was loaded (wall-clock stamps)."""
        self.precisions.add(precision)
        self.nodes.add(node)
        self.actors[actor] = loading
        self.add_time({"actor_load_s": loading[1] - loading[0], "actors_started": 1})

    def add_time(self, times: dict[str, float], span: tuple[float, float] | None = None, worker: str = "decide") -> None:
        """Add seconds per kind of work, and the wall-clock interval of a block's compute by `worker`."""
        for k, v in times.items():
            self.times[k] = self.times.get(k, 0.0) + v
        if span is not None:
            self.spans.setdefault(worker, []).append(span)

    def add(self, stats: dict[str, Any]) -> None:
        stats = dict(stats)
        self.hashes.append(np.asarray(stats.pop("group_hashes", ()), dtype=np.int64))
        self.stats = merge_stats(self.stats, stats)
        self.blocks += 1

    def result(self) -> dict[str, Any]:
        hashes = np.concatenate(self.hashes) if self.hashes else np.zeros(0, dtype=np.int64)
        return {**self.stats, "split_groups": int(len(hashes) - len(np.unique(hashes))), "blocks": self.blocks,
                "times": self.times, "spans": self.spans, "actor_loading": self.actors,
                "precision": ",".join(sorted(self.precisions)), "nodes": sorted(self.nodes)}


@dataclass(frozen=True)
class ScoreSettings:
    """What a scoring actor needs: the scorer, how to batch, the token unit, the rule settings (the rule written
    first, then the settings prune.json reports beside it), the tally."""

    scorer_path: str
    batch_size: int
    sort_by_length: bool
    precision: Precision
    tokenizer: str
    keys: list[str]
    settings: list[PruneRule]
    decide_here: bool
    tally: Any
    calibrated: bool = False  # map raw scores through the artifact's calibration.json
    lives: Lives | None = None  # the usage log and session times (pins, ages, recalls, supersession)
    worker: str = "driver"  # the scorer's name in the tally when it is not a Ray actor

    @property
    def rule(self) -> PruneRule:
        """The rule whose decision is written."""
        return self.settings[0]


class ScoreActor(EncoderActor):
    """Ray Data actor: holds the scorer; scores a block and (contiguous mode) decides its `keep` column."""

    REQUIRED_COLUMNS = ("bullet_id", "text")

    def setup(self, settings: ScoreSettings, device: str) -> None:
        from memprune.scorer import Scorer

        self.s = settings
        self.scorer = Scorer.load(settings.scorer_path, device=device, precision=settings.precision)
        self.count_tokens, _ = token_counter(settings.tokenizer, tokenizer=self.scorer.tokenizer)
        ray = sys.modules.get("ray")  # not imported when scoring on the driver without Ray
        context = ray.get_runtime_context() if ray is not None and ray.is_initialized() else None
        self.name = (context and context.get_actor_id()) or settings.worker
        node = context.get_node_id() if context else platform.node()
        _tell(settings.tally, "add_actor", self.scorer.precision, node, self.name, (self.created, now()))

    def __call__(self, block: pa.Table) -> pa.Table:
        s = self.s
        started, t0, tokenizing = now(), time.perf_counter(), self.scorer.tokenize_s
        texts = block.column("text").to_pylist()
        scores, emb = score_and_embed(self.scorer, texts, s.batch_size, s.sort_by_length,
                                      embed=s.rule.needs_embeddings)
        check_scores(scores, block.column("bullet_id").to_pylist(), "prune")
        t1 = time.perf_counter()
        times = {"score_s": t1 - t0, "tokenize_s": self.scorer.tokenize_s - tokenizing}
        if s.calibrated:
            scores = self.scorer.calibrate(scores)
            times["calibrate_s"] = time.perf_counter() - t1
            t1 = time.perf_counter()
        tokens = self.count_tokens(texts)
        t2 = time.perf_counter()
        times["tokens_s"] = t2 - t1
        if not s.decide_here:
            _tell(s.tally, "add_time", times, (started, now()), self.name)
            block = block.append_column("score", pa.array(scores, pa.float64())).append_column(TOKENS, pa.array(tokens))
            if emb is not None:  # carried through the sort to the decision
                block = block.append_column(EMB, pa.FixedSizeListArray.from_arrays(emb.reshape(-1), emb.shape[1]))
            return block
        groups = group_keys_of(block, s.keys)
        bullets = Bullets.of(scores, groups, tokens=tokens, texts=texts, embeddings=emb,
                             encode=lambda t: self.scorer.embed(t, batch_size=s.batch_size))
        stats, decision = _decide(bullets, groups, block, s)
        out = with_outputs(block, scores, decision)
        times["decide_s"] = time.perf_counter() - t2
        _tell(s.tally, "add_time", times, (started, now()), self.name)
        _tell(s.tally, "add", stats)
        return out


def _decide(bullets: Bullets, groups: list[Any], block: pa.Table, s: "ScoreSettings | BlockSettings",
            ) -> tuple[dict[str, Any], Decision]:
    """Counters and the written setting's decision of a block of whole groups (and scopes), its pins, times and
    scopes read from the block's columns; user errors as `PruneError`."""
    try:
        bullets = bullets.with_(**(s.lives or Lives()).of_table(block, s.rule))
        return block_stats(bullets, groups, s.settings)
    except ValueError as exc:
        raise PruneError(str(exc)) from exc


_ENCODERS: dict[str, Any] = {}  # the shuffle path's decide tasks: the scorer, loaded once per worker process


def _encoder(scorer_path: str) -> Callable[[list[str]], np.ndarray]:
    """The scorer's encoder for an update judge that needs one (shuffle path: loaded on first use, on the CPU)."""
    def encode(texts: list[str]) -> np.ndarray:
        if scorer_path not in _ENCODERS:
            from memprune.scorer import Scorer

            _ENCODERS[scorer_path] = Scorer.load(scorer_path, device="cpu")
        return _ENCODERS[scorer_path].embed(texts)
    return encode


@dataclass(frozen=True)
class BlockSettings:
    """What the shuffle path's decide tasks need: the group keys, the rule settings (the written rule first), the
    usage log and session times, the scorer (whose encoder an update judge may need), the tally."""

    keys: list[str]
    settings: list[PruneRule]
    tally: Any
    lives: Lives | None = None
    scorer: str | None = None

    @property
    def rule(self) -> PruneRule:
        """The rule whose decision is written."""
        return self.settings[0]


def decide_sorted_block(block: pa.Table, s: BlockSettings) -> pa.Table:
    """Shuffle path: a block of whole groups (whole scopes) after the sort; order rows by (group, input position)
    and decide."""
    if block.num_rows == 0:
        empty = np.zeros(0, dtype=np.int64)
        forgets = np.zeros(0) if s.rule.retention.forgets else None  # the same columns as every other block
        return with_outputs(block, np.zeros(0), Decision(
            empty.astype(bool), empty.astype(object), empty, empty.astype(bool), effective=forgets, retention=forgets,
            superseded_by=empty if s.rule.supersede.on else None))
    block = block.sort_by([(SORTKEY, "ascending"), (ROW, "ascending")])
    emb = None
    if EMB in block.column_names:
        col = block.column(EMB).combine_chunks()
        emb = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
    groups = group_keys_of(block, s.keys)
    started = now()
    bullets = unify_equal_texts(Bullets.of(
        block.column("score").to_numpy(), groups, order=block.column(ROW).to_numpy(),
        tokens=block.column(TOKENS).to_numpy(), texts=block.column("text").to_pylist(), embeddings=emb,
        encode=_encoder(s.scorer) if s.scorer else None))
    stats, decision = _decide(bullets, groups, block, s)
    out = with_outputs(block, bullets.scores, decision)
    _tell(s.tally, "add_time", {"decide_s": now() - started}, (started, now()))
    _tell(s.tally, "add", stats)
    return out


PREVIEW_COLUMNS = ("bullet_id", "text", "score", "keep", "reason", "duplicate_of", "superseded_by")
DECISION_COLUMNS = (*PREVIEW_COLUMNS, "effective_score", "retention")  # a dry run's decision/: these, keys, pins
DECISION_DIR = "decision"


def decision_block(block: pa.Table, carry: list[str]) -> pa.Table:
    """A decided block's decision: the `DECISION_COLUMNS` it has and the input columns in `carry` (group keys, pin
    and time columns): what a dry run writes instead of the store, and what the review page shows."""
    wanted = [*carry, *DECISION_COLUMNS]
    return block.select(list(dict.fromkeys(c for c in wanted if c in block.column_names)))


def preview_block(block: pa.Table, keys: list[str], rate: float) -> pa.Table:
    """The rows of a hash sample of the block's groups (each group in or out whole), with the preview's columns."""
    cols = [*keys, *(c for c in (*PREVIEW_COLUMNS, "effective_score") if c not in keys and c in block.column_names)]
    if block.num_rows == 0 or rate <= 0:
        return block.select(cols).slice(0, 0)
    groups = group_keys_of(block, keys)
    chosen = {g: (stable_hash(g) & 0xFFFFFFFF) < rate * 2**32 for g in dict.fromkeys(groups)}
    return block.select(cols).filter(pa.array([chosen[g] for g in groups], pa.bool_()))


def pipeline_timing(start: float, end: float, stats: dict[str, Any]) -> dict[str, Any]:
    """Where the pipeline's wall time went: actor start-up (worker start, imports, model load, the first read)
    until the first block is scored, compute (`stats["compute_s"]`: scoring, token counting and the rule, parallel
    actors counted once), stalls (no actor computing between blocks: scheduling, block transfer) and the drain
    after the last block (the last writes); plus what the compute lost to actors idling beside a busy one, and
    per actor (from the pipeline start) when it was created and when its model was ready, its load time (imports
    and weights), blocks and busy seconds."""
    spans = stats.pop("spans")
    loading = stats.pop("actor_loading")
    window = window_split(start, end, [span for worker in spans.values() for span in worker])
    stats["compute_s"] = window["compute_s"]
    actors = [{"created_s": round(began - start, 3), "ready_s": round(ready - start, 3), "load_s": round(ready - began, 3),
               "blocks": len(spans.get(name, ())), "busy_s": round(busy_seconds(spans.get(name, ())), 3)}
              for name, (began, ready) in sorted(loading.items(), key=lambda item: item[1])]
    return {"pipeline_s": end - start, "actor_start_s": window["startup_s"], "stall_s": window["stall_s"],
            "drain_s": window["drain_s"], "underused_s": underused_seconds([spans.get(a, []) for a in loading]),
            "actors": actors}


@dataclass(frozen=True)
class Job:
    """One prune job as the driver planned it: the config (its rule's `now` resolved), where the scorers run, the
    block plan and the input schema, whether the scores are calibrated, and the usage log and session times."""

    config: PruneConfig
    res: ActorResources
    plan: Plan
    schema: pa.Schema
    calibrated: bool = False
    lives: Lives | None = None

    def score_settings(self, tally: Any) -> "ScoreSettings":
        c, shuffle = self.config, self.plan.mode == "shuffle"
        return ScoreSettings(canonical(c.scorer), c.batch_size, c.sort_by_length, c.precision, c.tokenizer,
                             list(c.rule.keys), c.settings(), not shuffle, tally, calibrated=self.calibrated,
                             lives=self.lives)

    def block_settings(self, tally: Any) -> BlockSettings:
        """The shuffle path's decide settings (the scorer only where an update judge may need its encoder)."""
        c = self.config
        return BlockSettings(list(c.rule.keys), c.settings(), tally, self.lives,
                             canonical(c.scorer) if c.rule.supersede.on else None)


def run_on_driver(job: Job, tmp: Location) -> tuple[dict[str, Any], dict[str, Any]]:
    """`run_pipeline` without Ray (`execution: driver`): the same blocks, scoring, decision and output files, scored
    in this process on `res.device` by `res.actors` threads, each with its own scorer and `res.threads` torch
    threads; returns what `run_pipeline` returns."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    config, res, plan, schema = job.config, job.res, job.plan, job.schema
    shuffle = plan.mode == "shuffle"
    t1 = now()
    tally = _Tally(config.settings())
    score = job.score_settings(tally)
    torch_threads = torch.get_num_threads()
    free: queue.SimpleQueue[ScoreActor] = queue.SimpleQueue()
    reading = threading.Lock()
    sortkey = config.rule.unit_keys if shuffle else None

    def scored(span: tuple[int, int]) -> pa.Table:
        with reading:
            block = _planned_block(plan.files, *span, schema, shuffle, sortkey)
        scorer = free.get()
        try:
            return scorer(block)
        finally:
            free.put(scorer)

    blocks: list[pa.Table] = []
    try:
        for i in range(res.actors):
            free.put(ScoreActor(replace(score, worker=f"driver-{i}" if res.actors > 1 else "driver"), res.device,
                                res.threads))
        with (Progress(TextColumn("prune: scoring"), BarColumn(), MofNCompleteColumn(), TextColumn("bullets"),
                       TimeElapsedColumn(), console=Console(stderr=True), disable=not config.progress) as progress,
              ThreadPoolExecutor(res.actors, thread_name_prefix="memprune-score") as pool):
            task = progress.add_task("score", total=plan.rows)
            for (a, b), block in zip(plan.blocks, pool.map(scored, plan.blocks)):
                blocks.append(block)
                progress.advance(task, b - a)
    finally:
        torch.set_num_threads(torch_threads)  # the scorers set the process's torch threads to their share
    if shuffle:  # every group whole in one block: the scored rows, decided as one (as `sort_in_memory`)
        blocks = [decide_sorted_block(pa.concat_tables(blocks), job.block_settings(tally))]
    if config.dry_run:
        blocks = [decision_block(b, config.decision_carry) for b in blocks]
    _write_parts(blocks, tmp, config.rows_per_file)
    stats = tally.result()
    stats["sort"] = None if not shuffle else "driver"
    return stats, pipeline_timing(t1, now(), stats)


def _write_parts(blocks: list[pa.Table], tmp: Location, min_rows: int) -> None:
    """The decided blocks, in order, as part-00000.parquet, ... of at least `min_rows` rows each (the last one:
    what is left), as the Ray path's `write_parquet(min_rows_per_file=...)` cuts them."""
    import pyarrow.parquet as pq

    tmp.fs.create_dir(tmp.path, recursive=True)
    pending: list[pa.Table] = []
    written = 0
    for i, block in enumerate(blocks):
        pending.append(block)
        if sum(t.num_rows for t in pending) >= min_rows or i == len(blocks) - 1:
            pq.write_table(pa.concat_tables(pending), (tmp / f"part-{written:05d}.parquet").path, filesystem=tmp.fs)
            pending, written = [], written + 1


def run_pipeline(job: Job, tmp: Location) -> tuple[dict[str, Any], dict[str, Any]]:
    """Assemble and run the Ray Data pipeline; write the store into `tmp` (a dry run: the decision's columns
    alone, `decision_block`); return counters and timing."""
    import ray
    from ray.data import DataContext

    config, res, plan, schema = job.config, job.res, job.plan, job.schema
    unit = config.rule.unit_keys  # what a block holds whole: the groups, and with supersession their scopes
    t1 = now()
    ctx = DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = config.progress
    tally = ray.remote(num_cpus=0)(_Tally).remote(config.settings())
    shuffle = plan.mode == "shuffle"
    try:
        ds = ray.data.read_datasource(
            _make_datasource(plan, schema, add_row=shuffle, sortkey=unit if shuffle else None),
            num_cpus=config.io_cpus,
            override_num_blocks=len(plan.blocks),  # no extra splitting of read outputs (it would cut groups)
        )
        ds = ds.map_batches(**ScoreActor.map_kwargs(job.score_settings(tally), res, batch_size=None,
                                                    batch_format="pyarrow", blocks=len(plan.blocks)))
        decide = {"s": job.block_settings(tally)}
        scored = None
        if shuffle and plan.rows <= config.sort_in_memory:  # small: decided here, no distributed sort
            scored = [b if isinstance(b, pa.Table) else pa.Table.from_batches([b])
                      for b in ds.iter_batches(batch_format="pyarrow", batch_size=None)]
        if scored:
            ds = ray.data.from_arrow(decide_sorted_block(pa.concat_tables(scored), **decide))
        elif shuffle:
            ds = ds.sort(SORTKEY).map_batches(decide_sorted_block, fn_kwargs=decide, batch_size=None,
                                              batch_format="pyarrow", num_cpus=config.io_cpus)
        if config.dry_run:
            ds = ds.map_batches(decision_block, fn_kwargs={"carry": config.decision_carry}, batch_size=None,
                                batch_format="pyarrow", num_cpus=config.io_cpus)
        ds.write_parquet(tmp.path, filesystem=tmp.fs, min_rows_per_file=config.rows_per_file,
                         ray_remote_args={"num_cpus": config.io_cpus})
        stats = ray.get(tally.result.remote())
        stats["sort"] = None if not shuffle else "driver" if scored else "distributed"
        timing = pipeline_timing(t1, now(), stats)
    except Exception as exc:
        user = user_error(exc)  # the memprune error raised inside an actor or task, unwrapped
        if user is not None:
            raise (user if isinstance(user, PruneError) else PruneError(str(user))) from None
        raise
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
        ray.kill(tally)
    return stats, timing
