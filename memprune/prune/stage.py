"""`memprune prune`: score a bullets store with a trained scorer and prune it (DESIGN step 5), on Ray Data.

`run(cfg)` checks everything it can on the driver (rule, token unit, scorer artifact, every
input file's schema), plans the blocks (`memprune.prune.store`), runs the Ray Data job
(`memprune.prune.job`), swaps the written store into `OUT/pruned/` (rows in = rows out) and
writes `OUT/prune.json` and `OUT/prune.md`: bullets and tokens per group before and after.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from memprune.archive import ArchiveError, read_ids
from memprune.calibration import CalibrationError, resolve_score_mode
from memprune.decision import PruneError, PruneRule
from memprune.decision.supersede import JUDGED
from memprune.io import write_jsonl, write_summary
from memprune.outputs import OutputSet, check_out_location, check_out_outside
from memprune.prune.config import PruneConfig
from memprune.prune.inputs import SESSION_TIME, TIME, Lives, corpus_session_times
from memprune.prune.decided import decided, shown_session_times, write_run_review
from memprune.prune.job import DECISION_DIR, Job, decision_block, preview_block
from memprune.prune.report import render_markdown
from memprune.prune.split import write_split
from memprune.prune.stats import empty_stats, summarize_stats
from memprune.prune.store import (
    STORE_DIR,
    block_rows_for,
    bytes_per_row,
    finalize_files,
    list_store_files,
    open_store,
    parquet_file,
    plan_store,
    read_parquet,
    store_ids,
)
from memprune.raysession import ensure_ray
from memprune.review import PAGE
from memprune.runtime import ActorResources, check_paths_visible, plan_actors, use_gpu
from memprune.scorer import ScorerError, check_scorer
from memprune.storage import location
from memprune.times import epoch_seconds, format_duration
from memprune.timing import time_split
from memprune.tokens import check_unit, unit_name
from memprune.usagelog import read_usage, usage_files
from memprune.work import digest, file_digest

PRUNE_FORMAT = 1
BLOCKS_PER_ACTOR = 8  # the least blocks per scoring actor (smaller blocks where the store is small)
# On the driver a block is one length-sorted scoring window and one step of the progress bar: this many blocks (at
# least `block_rows` each). Windows of 40+ batches pad little; 2048 rows (16 batches of 128) ran ~18% slower.
DRIVER_BLOCKS = 4
# ... scored by this many threads on a CPU, each with its own scorer and a share of the torch threads: on 2 cores two
# single-thread streams scored 583-602 bullets/s where one two-thread stream scored 464-547.
DRIVER_STREAMS = 2
console = Console(stderr=True)


def score_mode(config: PruneConfig, scorer_info: dict[str, Any]) -> dict[str, Any]:
    """Which scores the rule sees (prune.json `score`): requested, used, and a note when auto fell back to raw."""
    cal = scorer_info.get("calibration")
    try:
        calibrated, note = resolve_score_mode(config.score, cal is not None, scorer_info["path"])
    except CalibrationError as exc:
        raise PruneError(str(exc)) from exc
    return {"requested": config.score, "used": "calibrated" if calibrated else "raw", "calibration": cal, "note": note}


def output_types(rule: PruneRule) -> dict[str, pa.DataType]:
    """The columns the job adds, in order: score, (with forgetting) effective_score and retention, keep, reason,
    duplicate_of."""
    extra = {"effective_score": pa.float64(), "retention": pa.float64()} if rule.retention.forgets else {}
    return {"score": pa.float64(), **extra, "keep": pa.bool_(), "reason": pa.string(), "duplicate_of": pa.string()}


def run_fingerprint(config: PruneConfig, scorer_info: dict[str, Any], files: list[Any],
                    keep: frozenset[str] | None) -> str:
    """What the decision depends on (rule, scorer, input files' sizes and times, token unit; with retention its
    resolved `now` and the usage log; the ids kept (`keep`, read from `--keep-ids`); the LLM update judge's config),
    as 16 hex digits."""
    payload = {"rule": config.rule.model_dump(mode="json"), "score": config.score, "scorer": scorer_info,
               "tokenizer": config.tokenizer,
               "limit_rows": config.limit_rows, "columns": config.columns,
               "input": [(f.path, f.num_rows, *location(f.path).stamp()) for f in files]}
    if config.usage_log is not None:
        payload["usage_log"] = [(str(f), file_digest(f)) for f in usage_files(config.usage_log)]
    if config.keep_ids is not None:  # the ids themselves: the same file edited is another decision
        payload["keep_ids"] = sorted(keep or ())
    sup = config.rule.supersede
    if sup.llm_config is not None or sup.llm is not None:  # the LLM update judge: its config's contents, not its path
        payload["update_llm"] = sup.llm_settings().model_dump(mode="json")
    return digest(payload)[:16]


def carried_columns(config: PruneConfig, files: list[Any]) -> list[str] | None:
    """`columns` plus the ones the decision reads (the pin field, `time`, `session_time`) where the store has them."""
    if config.columns is None:
        return None
    try:
        names = parquet_file(files[0]).schema_arrow.names
    except (pa.ArrowInvalid, OSError):
        return config.columns  # open_store names the file
    wanted = [config.rule.pin_field, *((TIME, SESSION_TIME) if config.rule.needs_times else ())]
    return [*config.columns, *(c for c in wanted if c and c in names and c not in config.columns)]


def check_keep_ids(config: PruneConfig, known: set[str]) -> tuple[frozenset[str] | None, dict[str, Any]]:
    """The `--keep-ids` file (one id per line, `#` comments: the review page's export) read and checked against
    the store's ids `known` (an id it lacks is an error naming it); with what prune.json records."""
    if config.keep_ids is None:
        return None, {}
    try:
        keep = frozenset(read_ids(config.keep_ids))
    except ArchiveError as exc:
        raise PruneError(f"--keep-ids: {exc}") from None
    unknown = sorted(keep - known)
    if unknown:
        raise PruneError(f"--keep-ids {config.keep_ids}: {len(unknown)} id(s) not in the store "
                         f"({', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''}); nothing was decided")
    return keep, {"keep_ids": {"file": config.keep_ids, "ids": len(keep)}}


def check_lives(config: PruneConfig, files: list[Any], schema: pa.Schema,
                now_given: bool) -> tuple[Any, dict[str, Any] | None]:
    """Before any work: the pin field is a boolean column, every `time` is a time, the usage log and the kept ids
    name only bullets of the store; read the log and the corpus's session times for the actors. (None, None) when
    the rule has neither pins nor retention and no ids are kept; else what the actors need and what prune.json
    records."""
    rule = config.rule
    # the store's ids, read once for what names bullets from outside it (the kept ids, the usage log)
    known = set(store_ids(files).to_pylist()) if config.keep_ids or (config.usage_log and rule.needs_times) else set()
    keep, kept_info = check_keep_ids(config, known)
    if not rule.needs_life:
        return (Lives(keep=keep), kept_info) if keep is not None else (None, None)
    if rule.pin_field is not None:
        if rule.pin_field not in schema.names:
            raise PruneError(f"--pin-field {rule.pin_field}: the store has no column {rule.pin_field!r} "
                             f"({files[0].path}; columns: {', '.join(schema.names)})")
        got = schema.field(rule.pin_field).type
        if not pa.types.is_boolean(got):
            raise PruneError(f"--pin-field {rule.pin_field}: column {rule.pin_field!r} has type {got}, expected bool "
                             f"({files[0].path})")
    info: dict[str, Any] = {"pin_field": rule.pin_field, **kept_info}
    if rule.supersede.on:
        missing = [c for c in (*rule.supersede.keys, rule.supersede.subject) if c not in schema.names]
        if missing:
            raise PruneError(f"--supersede: the store has no column {missing[0]!r} for the supersession "
                             f"{'subject' if missing[0] == rule.supersede.subject else 'scope'} "
                             f"({files[0].path}; columns: {', '.join(schema.names)})")
        info["supersede"] = rule.supersede.model_dump(mode="json")
    if not rule.needs_times:
        return Lives(keep=keep), info
    try:
        for name in (TIME, SESSION_TIME):  # parse once here, so that a bad time is one line before any work
            if name in schema.names:
                for f in files:
                    t = read_parquet(f.path, columns=["bullet_id", name])
                    try:
                        epoch_seconds(t.column(name), name, t.column("bullet_id").to_pylist())
                    except ValueError as exc:
                        raise PruneError(f"{f.path}: {exc}") from None
        session_times = None
        if SESSION_TIME not in schema.names:
            session_times = corpus_session_times([f.path for f in files])
        usage = None
        if config.usage_log is not None:
            usage = read_usage(config.usage_log, known)
    except ValueError as exc:
        raise PruneError(str(exc)) from exc
    r = rule.retention
    info |= {"half_life": None if r.half_life is None else format_duration(r.half_life), "recall_boost": r.recall_boost,
             "max_age": None if r.max_age is None else format_duration(r.max_age),
             "now": r.now.isoformat() if r.now else None, "now_given": now_given,
             "time_columns": [n for n in (TIME, SESSION_TIME) if n in schema.names],
             "session_times": len(session_times or {}), "usage_log": config.usage_log,
             "usage_events": usage.events if usage else 0, "recalled_bullets": len(usage.recalls) if usage else 0}
    return Lives(usage, session_times or None, keep), info


def write_preview(path: Path, preview: pa.Table | None, keys: list[str]) -> int:
    """preview.jsonl: one line per bullet of the sampled groups (group, bullet, score (and with forgetting the
    effective score), kept or why it goes, and with supersession what superseded it)."""
    rows = [] if preview is None else preview.to_pylist()
    return write_jsonl(path, ({"group": {k: r[k] for k in keys}, "bullet_id": r["bullet_id"], "text": r["text"],
                               "score": r["score"], "kept": r["keep"], "reason": r["reason"],
                               "duplicate_of": r["duplicate_of"],
                               **({"effective_score": r["effective_score"]} if "effective_score" in r else {}),
                               **({"superseded_by": r["superseded_by"]} if "superseded_by" in r else {})}
                              for r in rows))


def where_to_score(config: PruneConfig, rows: int) -> str:
    """Where the bullets are scored (`config.execution`): auto = on the driver for up to `driver_rows` rows when
    no cluster is named or connected and the device asked for is here, else on Ray."""
    if config.execution != "auto":
        return config.execution
    ray = sys.modules.get("ray")
    if (rows > config.driver_rows or config.ray_address or os.environ.get("RAY_ADDRESS")
            or (ray is not None and ray.is_initialized() and sum(n["Alive"] for n in ray.nodes()) > 1)):
        return "ray"
    if config.use_gpu is True and not driver_devices()["GPU"]:
        return "ray"
    return "driver"


def driver_devices() -> dict[str, float]:
    """This process's devices in the form `use_gpu` reads (a Ray cluster's resources)."""
    import torch

    return {"GPU": float(torch.cuda.device_count()) if torch.cuda.is_available() else 0.0}


def driver_resources(config: PruneConfig, blocks: int) -> ActorResources:
    """How the driver scores `blocks` blocks: on a CPU up to `DRIVER_STREAMS` threads (no more than the blocks), each
    with its own scorer and its share of this process's torch threads; on a GPU one."""
    import torch

    device, threads = "cuda" if use_gpu(config.use_gpu, driver_devices()) else "cpu", torch.get_num_threads()
    streams = max(1, min(DRIVER_STREAMS, threads, blocks)) if device == "cpu" else 1
    return ActorResources(streams, device, max(1, threads // streams), 0.0, 0)


def timing_of(started: float, finishing: float, parts: dict[str, float], pipeline: dict[str, Any],
              stats: dict[str, Any], plan: Any) -> dict[str, Any]:
    """prune.json `timing`: wall, compute and overhead (`memprune.timing.time_split`), and `parts`, the wall time cut
    into the job's steps in order (they add up to `wall_s`; `other_s` is what no step claims). Compute is scoring,
    token counting and the rule in the actors, parallel actors counted once."""
    wall = time.perf_counter() - started
    steps = {**parts, "actor_start_s": pipeline.get("actor_start_s", 0.0), "compute_s": stats.get("compute_s", 0.0),
             "stall_s": pipeline.get("stall_s", 0.0), "drain_s": pipeline.get("drain_s", 0.0),
             "finish_s": time.perf_counter() - finishing}
    steps["other_s"] = wall - sum(steps.values())
    pipeline_s = pipeline.get("pipeline_s")
    return time_split(
        wall, stats.get("compute_s", 0.0), parts={k: round(v, 3) for k, v in steps.items()},
        pipeline_s=None if pipeline_s is None else round(pipeline_s, 3), scan_s=round(plan.scan_s, 3),
        underused_s=round(pipeline.get("underused_s", 0.0), 3), actors=pipeline.get("actors", []),
        # Summed over actors/tasks: model loading, forward passes (tokenizing included), token counting, the rule.
        work={k: round(v, 3) for k, v in sorted(stats.get("times", {}).items())},
        # Throughput of the Ray Data pipeline (actor start-up included, Ray start-up excluded).
        bullets_per_s=round(plan.rows / pipeline_s, 1) if pipeline_s else None,
    )


def run(config: PruneConfig) -> dict[str, Any]:
    """Score and prune the store of `config.input` into `config.out`; return the prune.json summary."""
    started = time.perf_counter()
    given_rule = config.rule
    # ages are measured at one `now` for the whole run: the rule's, else the wall clock at the run's start
    config = config.model_copy(update={"rule": config.rule.at(dt.datetime.now(dt.timezone.utc))})
    out = check_out_location(config.out, "prune")
    if out.local and location(config.input).local and not (Path(config.input) / "bullets.parquet").is_file():
        check_out_outside(out.as_path(), config.input, "input store")  # a dir read whole (not a corpus dir's one file)
    check_unit(config.tokenizer)
    try:
        scorer_info = check_scorer(config.scorer)
    except ScorerError as exc:
        raise PruneError(str(exc)) from exc
    scores_used = score_mode(config, scorer_info)
    rule = config.rule
    store_files = list_store_files(config.input)
    files, schema, notes = open_store(store_files, carried_columns(config, store_files))
    lives, life_info = check_lives(config, files, schema, given_rule.retention.now is not None)
    rows_wanted = min(sum(f.num_rows for f in files), config.limit_rows or math.inf)
    res: ActorResources | None = None
    parts = {"checks_s": time.perf_counter() - started}  # prune.json timing.parts: where the wall time went
    block_rows = config.block_rows
    on_driver = where_to_score(config, rows_wanted) == "driver"
    if rows_wanted and on_driver:
        block_rows = max(block_rows, math.ceil(rows_wanted / DRIVER_BLOCKS))
    elif rows_wanted:
        t0 = time.perf_counter()
        ensure_ray(config.ray_address)
        import ray
        from ray.data import DataContext

        parts["ray_init_s"] = time.perf_counter() - t0
        check_paths_visible({"--input": config.input, "--scorer": config.scorer, "--out": config.out})
        res = plan_actors(ray.cluster_resources(), config.use_gpu, config.actors, config.actor_cpus,
                          reserve_cpus=2 * config.io_cpus)
        block_rows = block_rows_for(block_rows, bytes_per_row(files, schema.names),
                                    DataContext.get_current().target_max_block_size or 2**27)
        # At least ~8 blocks per actor, so that no actor idles long while another finishes the last block (actors
        # start seconds apart; prune.json timing.underused_s measures what is left).
        block_rows = max(1, min(block_rows, math.ceil(rows_wanted / (BLOCKS_PER_ACTOR * res.actors))))
    plan = plan_store(files, rule.unit_keys, block_rows, config.grouping, config.limit_rows)
    if rows_wanted and on_driver:
        res = driver_resources(config, len(plan.blocks))
    parts["plan_s"] = time.perf_counter() - started - sum(parts.values())
    if scores_used["note"]:  # after every input check, so that a bad input stays one error line
        console.print(f"[yellow]note:[/] {scores_used['note']}", highlight=False, soft_wrap=True)
    console.print(f"prune: {plan.rows} bullets in {len(files)} file(s), {plan.runs} group runs; "
                  f"{plan.mode} mode ({plan.reason}); {len(plan.blocks)} blocks; "
                  f"{'scored on the driver' if on_driver else 'on Ray'}", highlight=False)
    run = Run(Job(config, res, plan, schema, scores_used["used"] == "calibrated", lives) if res else None,
              config, plan, schema, files, notes, scorer_info, scores_used, given_rule, life_info, on_driver, block_rows,
              parts, started)
    with OutputSet(out, "prune") as outputs:
        summary = _run_into(run, outputs)
    where = "dry run, no store written" if config.dry_run else str(out / STORE_DIR)
    console.print(f"prune: kept {summary['result']['bullets_total_after']} of {plan.rows} bullets "
                  f"({summary['result']['bullet_reduction_pct'] or 0:.1f}% fewer) -> {where}", highlight=False)
    return summary


@dataclass(frozen=True)
class Run:
    """One `memprune prune` run as `run` checked and planned it: the job (None: nothing to score), the config (its
    rule's `now` resolved) and the rule as given, the plan, input schema and files, notes, the scorer and which
    scores the rule sees, what the lifecycle steps read, where the scoring ran, and the timing so far."""

    job: Job | None
    config: PruneConfig
    plan: Any
    schema: pa.Schema
    files: list[Any]
    notes: list[str]
    scorer_info: dict[str, Any]
    scores_used: dict[str, Any]
    given_rule: PruneRule
    life_info: dict[str, Any] | None
    on_driver: bool
    block_rows: int
    parts: dict[str, float]
    started: float


def _run_into(run: Run, outputs: OutputSet) -> dict[str, Any]:
    """Run the job into the output set's staging dir: the store, then prune.json and prune.md."""
    from memprune.prune.job import run_on_driver, run_pipeline

    config, plan, schema, files, scorer_info = run.config, run.plan, run.schema, run.files, run.scorer_info
    res = None if run.job is None else run.job.res
    settings = config.settings()
    rule = config.rule
    store = outputs.target(DECISION_DIR if config.dry_run else STORE_DIR)  # a dry run writes the decision alone
    out_schema = pa.schema([*schema, *(pa.field(n, t) for n, t in output_types(rule).items())])
    if plan.rows == 0 or run.job is None:
        stats = empty_stats(settings) | {"split_groups": 0, "blocks": 0}
        timing: dict[str, Any] = {}
        empty = out_schema.empty_table()
        store.fs.create_dir(store.path, recursive=True)
        pq.write_table(decision_block(empty, config.decision_carry) if config.dry_run else empty,
                       (store / "part-00000.parquet").path, filesystem=store.fs)
    else:
        stats, timing = (run_on_driver if run.on_driver else run_pipeline)(run.job, store)
    finishing = time.perf_counter()
    written = finalize_files(store)
    rows_out = sum(parquet_file(p).metadata.num_rows for p in written)
    if not (plan.rows == stats["rows"] == rows_out):
        raise PruneError(f"row count mismatch: {plan.rows} read, {stats['rows']} scored, {rows_out} written")
    if stats["split_groups"]:
        raise PruneError(f"{stats['split_groups']} group(s) reached the decision in two blocks; the result would be wrong")
    final_store = outputs.final(STORE_DIR)
    per_setting = summarize_stats(stats, settings)
    lives = run.job.lives if run.job else None
    fingerprint = run_fingerprint(config, scorer_info, files, lives.keep if lives else None)
    emitted: dict[str, Any] = {}
    paged = plan.rows <= config.review_rows
    table = decided(written, out_schema.names, config) if paged or config.dry_run else None
    review = table if paged else None
    if config.dry_run:
        rate = min(1.0, config.preview_groups / max(plan.runs, 1))
        sample = preview_block(table, list(rule.keys), rate)
        emitted["decision"] = {"path": outputs.final(DECISION_DIR), "rows": rows_out}
        emitted["preview"] = {"path": outputs.final("preview.jsonl"),
                              "rows": write_preview(outputs.path("preview.jsonl"), sample, list(rule.keys))}
    elif config.emit == "split":
        pruned = pa.concat_tables([read_parquet(p) for p in written])
        input_ids = store_ids(files)[:plan.rows]
        emitted |= write_split(pruned, input_ids, schema.names, outputs.staging, outputs.loc, fingerprint,
                               {"input": str(config.input), "pruned": str(final_store)})
    summary = {
        "format": PRUNE_FORMAT,
        "input": {"path": str(config.input), "files": [f.path for f in files], "rows": plan.rows,
                  "rows_in_files": sum(f.num_rows for f in files), "limit_rows": config.limit_rows},
        "dry_run": config.dry_run,
        "fingerprint": fingerprint,
        "output": None if config.dry_run else {
            "store": final_store, "files": [p.name for p in written], "rows": rows_out,
            "columns": out_schema.names, "emit": config.emit},
        "emitted": emitted,
        "scorer": scorer_info,
        "score": run.scores_used,
        # the rule as given (a `now` left unset stays unset; the one used is in `lifecycle`)
        "rule": {**run.given_rule.model_dump(mode="json"), "name": rule.name, "label": rule.label,
                 "description": rule.describe(), "keys": list(rule.keys),
                 "ties": "higher score first, then earlier input position"},
        "duplicates": stats.get("duplicates", 0),
        "lifecycle": None if run.life_info is None else {**run.life_info, "pinned": stats.get("pinned", 0),
                                                     "age_unknown": stats.get("age_unknown", 0),
                                                     **{k: stats.get(k, 0) for k in JUDGED if rule.supersede.on}},
        "grouping": {"mode": plan.mode, "contiguous": plan.contiguous, "reason": plan.reason, "groups": stats["groups"],
                     "sort": stats.get("sort"),
                     "blocks": len(plan.blocks), "scan_s": round(plan.scan_s, 3)},
        "tokenizer": unit_name(config.tokenizer, scorer_info["encoder"]),
        "groups": stats["groups"],
        "result": per_setting[rule.name],
        "settings": per_setting,
        "scores": {"mean": stats["score_sum"] / stats["rows"] if stats["rows"] else None, "min": stats["score_min"],
                   "max": stats["score_max"]},
        "resources": None if res is None else {"execution": "driver" if run.on_driver else "ray",
                                                "actors": res.actors, "device": res.device, "threads_per_actor": res.threads,
                                                "actor_cpu_request": res.cpus, "batch_size": config.batch_size,
                                                "block_rows": run.block_rows,
                                                # what the actors ran at, resolved on their device; and the request
                                                "precision": stats.get("precision") or None,
                                                "nodes": len(stats.get("nodes") or ()),  # that ran scoring actors
                                                "precision_requested": config.precision},
        "timing": timing_of(run.started, finishing, run.parts, timing, stats, plan),
        "notes": run.notes,
        "config": config.model_dump(mode="json"),
    }
    if review is not None:
        emitted["review"] = {"path": outputs.final(PAGE), "records": review.num_rows}
        write_run_review(outputs.staging, review, summary, config,
                         (lives.session_times if lives else None) or shown_session_times([f.path for f in files]),
                         str(config.out))
    else:
        run.notes.append(f"no review.html: {plan.rows} bullets, more than review_rows {config.review_rows}")
    write_summary(outputs.staging, "prune", summary, render_markdown(summary))
    return summary
