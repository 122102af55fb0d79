"""`memprune prune --input KIND:LOCATION` and `memprune score`: the prune job on an external store.

`run_prune(cfg)` reads the store (`export`), runs memprune's own prune job (`memprune.prune`) on
it with the groups the store defines, writes the decision (`OUT/decision.parquet`: id, group,
time, text, hash, score, keep, reason), `OUT/prune.json` + `prune.md` and `OUT/rejects.jsonl` (with
`--emit split` also `OUT/kept/` and the `OUT/dropped/` archive, as a bullets prune does), and
with `store.apply` changes the store (`memprune.stores.apply`). OUT may be a directory or a URI: the
work files then live under `OUT/.work/` on the bucket and the outputs are committed there
(`OutputSet`). An `--apply` on an OUT that already holds a decision for the same store, scorer and
rule applies that decision (after the changed-store check) instead of deciding again: dry run first, look, then apply.
`run_score(cfg)` adds scores to a store without deciding anything.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune import prune
from memprune.io import check_committed, write_jsonl, write_summary
from memprune.outputs import OutputSet, check_out_location, check_out_outside
from memprune.prune.report import render_markdown
from memprune.review import PAGE
from memprune.prune.split import write_split
from memprune.prune.store import read_parquet
from memprune.raysession import ensure_ray
from memprune.scorer import check_scorer
from memprune.storage import Location, canonical
from memprune.stores.apply import apply_decision
from memprune.stores.base import Store, chunks, open_store, split_input
from memprune.stores.config import ScoreConfig, StoreError, StoreOptions, StorePruneConfig
from memprune.stores.export import HASH, PIN, STAGED, TIME, Export, export
from memprune.stores.report import render_score, store_section
from memprune.usagelog import read_usage

WORK = ".work"
BULLET_MAP = {"id": "bullet_id", "text": "text", "group": "conversation_id"}
SAME_STORE = ("kind", "location", "map")  # what makes a decision in OUT one for this store


def _open(input: str, options: StoreOptions) -> Store:
    split = split_input(input)
    if split is None:  # memprune's own bullets table, read as a table store
        return open_store("table", input, {**BULLET_MAP, **options.map})
    return open_store(split[0], split[1], options.map)


def job_rule(config: Any, store: Store) -> dict[str, Any]:
    """The rule the prune job runs on an exported store: groups are the store's, pins its `--map pin=` column."""
    rule = config.rule.model_dump(mode="json") | {"group_by": "conversation"}
    return rule | {"pin_field": PIN} if "pin" in store.fields else rule


def _same_decision(summary: dict[str, Any], config: Any, store: Store) -> str | None:
    """Why the decision in OUT is not the one `config` would make (None when it is)."""
    old = summary.get("store", {})
    if {k: old.get(k) for k in SAME_STORE} != {k: store.describe()[k] for k in SAME_STORE}:
        return f"it was made for store {old.get('kind')}:{old.get('location')} with map {old.get('map')}"
    if summary.get("scorer", {}).get("path") != canonical(config.scorer):
        return f"it was made with scorer {summary.get('scorer', {}).get('path')}"
    rule, want = summary.get("rule", {}), job_rule(config, store)
    changed = sorted(k for k in want if rule.get(k) != want[k])
    if changed:
        return "it was made with another rule (" + ", ".join(f"{k} {rule.get(k)}" for k in changed) + ")"
    if summary.get("score", {}).get("requested") != config.score:
        return f"it was made with score {summary.get('score', {}).get('requested')}"
    return None


def _check_request(config: Any, out: Location) -> None:
    """`--apply` changes a user's store: only with a policy the user named, and a decision they could read first."""
    if config.rule.group_by != "conversation" and "group_by" in config.rule.model_fields_set:
        raise StoreError(f"rule.group_by {config.rule.group_by}: an external store's groups are its `--map group=` "
                         "column; leave --group-by unset")
    if config.rule.pin_field is not None:
        raise StoreError(f"--pin-field {config.rule.pin_field}: an external store's pins are a column (Mem0: a "
                         f"metadata key) in its map: use --map pin={config.rule.pin_field} (with your other --map "
                         "fields); nothing was changed")
    if config.store.apply == "none":
        return
    if "policy" not in config.rule.model_fields_set:  # neither a policy nor one of its settings was given
        raise StoreError("--apply changes the store, so it does not run on the default policy: name it (--top-k K, "
                         "--threshold T, --budget-tokens B or --fraction q; a group of hundreds of memories is not a "
                         "session of 7); nothing was changed")
    if not (out / "decision.parquet").is_file():
        raise StoreError(f"{out}: no decision to apply yet; run the same command without --apply first (it writes the "
                         "decision and its counts per group to prune.md), read it, then add --apply; nothing was changed")


def run(config: StorePruneConfig) -> dict[str, Any]:
    """`memprune prune`: a bullets path goes straight to the prune stage; `KIND:LOCATION` to `run_prune`."""
    if split_input(config.input) is not None:
        return run_prune(config)
    if config.store.apply != "none" or config.store.map:
        raise StoreError(f"{config.input}: --apply and --map are for external stores (table:, lance:, mem0: inputs)")
    return prune.run(config.bullets_config())


def run_prune(config: StorePruneConfig) -> dict[str, Any]:
    """Decide on the store of `config.input` and write the decision; or apply the decision in OUT."""
    out = check_out_location(config.out, "prune")
    store = _open(config.input, config.store)
    try:
        check_out_outside(out, store.location, f"{store.kind} store")
        _check_request(config, out)
        if config.store.apply == "none":
            return _decide(store, config, out)
        decision = out / "decision.parquet"
        check_committed(decision)
        summary = json.loads((out / "prune.json").read_text())
        why = _same_decision(summary, config, store)
        if why is not None:
            raise StoreError(f"{out}: holds another decision ({why}); use a new --out; nothing was changed")
        summary["apply"] = apply_decision(store, out, summary, config.store)
        write_store_review(out, pq.read_table((out / "decision.parquet").path, filesystem=out.fs), summary, str(out))
        return summary
    finally:
        store.close()


def _job(store: Store, config: StorePruneConfig | ScoreConfig, out: Location,
         **fields: Any) -> tuple[Export, dict[str, Any], pa.Table]:
    """Export the store and run the prune stage on it (its config from `config.bullets_config`, with `fields`);
    (export, the stage's summary, its output table)."""
    check_scorer(config.scorer)
    usage_log = getattr(config, "usage_log", None)
    if usage_log is not None:  # a missing or malformed log is one line before Ray and the export (ids: after it)
        try:
            read_usage(usage_log)
        except ValueError as exc:
            raise StoreError(str(exc)) from None
    ensure_ray(config.ray_address)
    work = out / WORK / "store"
    rule = getattr(config, "rule", None)
    exp = export(store, work / "export", config.io_cpus,
                 check_times=rule is not None and rule.needs_times)
    job = prune.run(config.bullets_config(input=str(exp.bullets), out=str(work / "prune"), **fields))
    return exp, job, prune.read_pruned(str(work / "prune"))


def _decide(store: Store, config: Any, out: Location) -> dict[str, Any]:
    started = time.perf_counter()
    # The inner job writes its table even for --dry-run: that table is the decision, and a store prune without
    # --apply changes nothing anyway.
    exp, job, pruned = _job(store, config, out, rule=job_rule(config, store), emit="keep", dry_run=False,
                            review_rows=0)
    if job.get("lifecycle") and "pin" in store.fields:  # prune.md/json name the store's pin column, not the staged one
        job = {**job, "lifecycle": {**job["lifecycle"], "pin_field": f"{store.fields['pin']} (store)"}}
    cols = {"id": pruned.column("bullet_id"), "group": pruned.column("conversation_id"), "time": pruned.column(TIME),
            "text": pruned.column("text"), "hash": pruned.column(HASH), "score": pruned.column("score"),
            "keep": pruned.column("keep"), "reason": pruned.column("reason").cast(pa.string()),
            "duplicate_of": pruned.column("duplicate_of").cast(pa.string())}
    for name in ("superseded_by", "effective_score", PIN):  # with supersession, retention, pins
        if name in pruned.column_names:
            cols[name] = pruned.column(name)
    decision = pa.table(cols)
    rejected = [r for r in exp.rejects if r["id"]]
    if rejected:  # never decided, never touched: kept, with the reason
        n = len(rejected)
        extra = {"id": [r["id"] for r in rejected], "group": [r["group"] for r in rejected],
                 "keep": [True] * n, "reason": [f"rejected: {r['reason']}" for r in rejected]}
        extra = {c: extra.get(c, pa.nulls(n, decision.schema.field(c).type)) for c in decision.column_names}
        decision = pa.concat_tables([decision, pa.table(extra, schema=decision.schema)])
    kept = int(pc.sum(pruned.column("keep")).as_py() or 0)
    summary = dict(job)
    summary["input"] = {"path": config.input, "rows": exp.records}
    summary["output"] = {"decision": str(out / "decision.parquet"), "rows": decision.num_rows,
                         "columns": decision.column_names}
    summary["store"] = {**store.describe(), "fingerprint": exp.fingerprint, "records": exp.records,
                        "usable": exp.usable, "rejected": len(exp.rejects), "rejected_without_id": exp.rejected_without_id,
                        "export_timing": {k: round(v, 3) for k, v in exp.timing.items()}}
    summary["decision"] = {"decided": pruned.num_rows, "kept": kept, "dropped": pruned.num_rows - kept,
                           "untouched_rejects": len(rejected), "groups": group_counts(pruned),
                           "seconds": round(time.perf_counter() - started, 3)}
    summary["config"] = config.model_dump(mode="json")
    with OutputSet(out, "prune") as outputs:
        pq.write_table(decision, outputs.path("decision.parquet"))
        write_jsonl(outputs.path("rejects.jsonl"), exp.rejects)
        if config.emit == "split":  # kept/ and the dropped/ archive of the exported records, into OUT
            input_ids = pa.concat_tables([read_parquet(exp.bullets / n, columns=["bullet_id"])
                                          for n in sorted(exp.bullets.files())]).column(0)
            summary["emitted"] = write_split(pruned, input_ids, STAGED.names, outputs.staging, outputs.loc,
                                             job["fingerprint"], {"input": config.input,
                                                                  "decision": summary["output"]["decision"]})
        write_store_review(outputs.staging, decision, summary, str(out))
        summary["emitted"] = {**summary["emitted"], "review": {"path": str(out / PAGE), "records": decision.num_rows}}
        shown = {**job, "emitted": summary["emitted"],
                 "output": {**job["output"], "store": str(out / "decision.parquet")}}
        write_summary(outputs.staging, "prune", summary, render_markdown(shown) + store_section(summary))
    _clean(out)
    return summary


def write_store_review(directory: Any, decision: pa.Table, summary: dict[str, Any], out: str) -> str:
    """review.html of a store's decision (`decision.parquet`'s rows; after `--apply`, with what was archived)."""
    from memprune.review import Layout, write_review
    from memprune.tokens import token_counter

    pin = PIN if PIN in decision.column_names else None
    count, _ = token_counter(summary["config"]["tokenizer"], summary["scorer"]["encoder"])
    return write_review(directory, decision, Layout("id", ("group",), pin=pin, time="time"), summary, out, count)


def group_counts(pruned: pa.Table, show: int = 20) -> dict[str, Any]:
    """Per group (user, agent, ...): records and kept; the `show` groups that lose the most, for the dry-run review."""
    counts = pruned.group_by("conversation_id").aggregate([("keep", "count"), ("keep", "sum")])
    groups, n, k = (counts.column(c).to_pylist() for c in ("conversation_id", "keep_count", "keep_sum"))
    rows = sorted(({"group": g, "records": a, "kept": b or 0} for g, a, b in zip(groups, n, k)),
                  key=lambda r: (r["kept"] - r["records"], str(r["group"])))
    return {"groups": len(rows), "emptied": sum(1 for r in rows if r["records"] and not r["kept"]),
            "kept_min": min((r["kept"] for r in rows), default=0), "kept_max": max((r["kept"] for r in rows), default=0),
            "most_dropped": rows[:show]}


def _clean(out: Location) -> None:
    """Remove the run's work files (the export and the job's store) once its outputs are committed."""
    (out / WORK / "store").delete()
    work = Path(out.path) / WORK
    if out.local and work.is_dir() and not any(work.iterdir()):
        work.rmdir()


def calibrated_scores(scorer_path: str, scores: np.ndarray) -> np.ndarray | None:
    """The calibrated column: scorer's calibrated scores when its artifact has a calibration, else None.

    Only the artifact's calibration.json is read (no encoder is loaded).
    """
    from memprune.scorer import load_calibration

    calibration = load_calibration(scorer_path)
    return None if calibration is None else np.asarray(calibration.apply(scores), dtype=np.float64)


def run_score(config: ScoreConfig) -> dict[str, Any]:
    """Score every record of a store (no decision) and write the scores into the store and OUT/scores.parquet."""
    started = time.perf_counter()
    out = check_out_location(config.out, "score")
    store = _open(config.input, config.store)
    try:
        check_out_outside(out, store.location, f"{store.kind} store")
        exp, job, pruned = _job(store, config, out)
        scores = pruned.column("score").to_numpy()
        calibrated = calibrated_scores(config.scorer, scores)
        table = pa.table({"id": pruned.column("bullet_id"), "memprune_score": pruned.column("score")})
        if calibrated is not None:
            table = table.append_column("memprune_score_calibrated", pa.array(calibrated, pa.float64()))
        written = 0
        t0 = time.perf_counter()
        if config.write:
            for start in chunks(range(table.num_rows), config.store.batch):
                written += store.set_fields(table.slice(start[0], len(start)))
        summary = {
            "format": 1, "input": config.input, "store": {**store.describe(), "fingerprint": exp.fingerprint,
                                                           "records": exp.records, "rejected": len(exp.rejects)},
            "scorer": job["scorer"], "resources": job["resources"], "scored": table.num_rows, "calibrated": calibrated is not None,
            "written_to_store": written, "columns": table.column_names,
            "scores": job["scores"], "timing": {"export": exp.timing, "job": job["timing"],
                                               "write_s": round(time.perf_counter() - t0, 3),
                                               "total_s": round(time.perf_counter() - started, 3)},
            "config": config.model_dump(mode="json"),
        }
        with OutputSet(out, "score") as outputs:
            pq.write_table(table, outputs.path("scores.parquet"))
            write_jsonl(outputs.path("rejects.jsonl"), exp.rejects)
            write_summary(outputs.staging, "score", summary, render_score(summary))
        _clean(out)
        return summary
    finally:
        store.close()
