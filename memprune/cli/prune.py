"""The pruning door of the command line: `memprune prune` (bullets stores and external stores),
`memprune restore` (undo a prune from its archive) and `memprune score` (scores without a decision)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import typer

from memprune.cli.common import CONFIG, SET, _top_k, app, console, fail, run_stage, user_errors


# the supersession options of `prune` (their defaults are memprune.decision.supersede.Supersede's)
SUPERSEDE = typer.Option(None, "--supersede", help="Supersede outdated facts: a later bullet of the same subject that "
                         "the update JUDGE (slot, or llm with --supersede-llm) says updates an earlier one drops it "
                         "(reason superseded, column superseded_by).")
SUPERSEDE_SCOPE = typer.Option(None, "--supersede-scope", help="conversation (a store's user) or session [default: "
                               "conversation].")
SUPERSEDE_SUBJECT = typer.Option(None, "--supersede-subject", help="Column of whom a fact is about [default: speaker].")
SUPERSEDE_BAND = typer.Option(None, "--supersede-band", help="LOW:HIGH cosine of candidate pairs, below the dedup "
                              "threshold [default: 0.3:dedup threshold].")
SUPERSEDE_LLM = typer.Option(None, "--supersede-llm", help="--supersede llm: YAML file of the judging LLM "
                             "(configs/llm/).")


@app.command()
def prune(
    scorer: Optional[str] = typer.Option(None, "--scorer", help="A shipped scorer by name (`memprune scorers`), or an "
                                                                  "artifact directory or URI (s3://...) [default: default]."),
    input: Optional[str] = typer.Option(None, "--input", "-i", help="Bullets store: Parquet file, dir of Parquet files, or "
                                                                     "corpus dir; or an external store KIND:LOCATION."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output dir or URI (s3://...): pruned/ (store + score, keep, reason), prune.json, prune.md."),
    policy: Optional[str] = typer.Option(None, "--policy", help="rule (threshold then top-k, the paper's), budget or "
                                                                 "fraction [default: rule]."),
    threshold: Optional[float] = typer.Option(None, "--threshold", help="rule: drop bullets scored below this [default: 0.5]."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="rule: keep at most k per group, 0 = no cap [default: 5]."),
    budget_tokens: Optional[int] = typer.Option(None, "--budget-tokens", help="budget: kept tokens per group never exceed B "
                                                                              "(implies --policy budget)."),
    fraction: Optional[float] = typer.Option(None, "--fraction", help="fraction: keep the top ceil(q*n) of each group "
                                                                       "(implies --policy fraction)."),
    min_keep: Optional[int] = typer.Option(None, "--min-keep", help="Never leave a group with fewer than m bullets; 0 lets "
                                                                     "a group be emptied [default: 1]."),
    floor: Optional[float] = typer.Option(None, "--floor", help="Any policy: drop bullets scored below this."),
    dedup_threshold: Optional[float] = typer.Option(None, "--dedup-threshold", help="Cosine of the scorer's embeddings at "
                                                    "which bullets of a group are near-duplicates (merged first)."),
    no_dedup: bool = typer.Option(False, "--no-dedup", help="Do not merge duplicate bullets before deciding."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Decide and report (prune.json, prune.md, preview.jsonl); "
                                                          "write no store."),
    emit: Optional[str] = typer.Option(None, "--emit", help="keep (pruned/ with keep) or split (also kept/ and the "
                                                            "dropped/ archive) [default: keep]."),
    group_by: Optional[str] = typer.Option(None, "--group-by", help="session, conversation or speaker [default: session]."),
    score: Optional[str] = typer.Option(None, "--score", help="auto (calibrated where the scorer has calibration.json), raw or calibrated [default: auto]."),
    pin_field: Optional[str] = typer.Option(None, "--pin-field", help="Boolean column of pinned bullets: never dropped, "
                                                                      "outside the policy and min-keep."),
    half_life: Optional[str] = typer.Option(None, "--half-life", help="Forget by age: the policy ranks score x "
                                            "exp(-age/S), S = half-life/ln2 x (1 + recall-boost x recalls); e.g. 30d, P2W."),
    recall_boost: Optional[float] = typer.Option(None, "--recall-boost", help="Strength added per recall (with "
                                                 "--half-life) [default: 1]."),
    max_age: Optional[str] = typer.Option(None, "--max-age", help="Expire bullets older than this (reason expired; "
                                          "never a pinned one), e.g. 90d."),
    now: Optional[str] = typer.Option(None, "--now", help="The time ages are measured at (ISO 8601) [default: the "
                                      "run's start, recorded in prune.json]."),
    usage_log: Optional[str] = typer.Option(None, "--usage-log", help="Usage log (the `usage` label source's format): "
                                            "recalls and last access per bullet."),
    supersede: Optional[str] = SUPERSEDE,
    supersede_scope: Optional[str] = SUPERSEDE_SCOPE,
    supersede_subject: Optional[str] = SUPERSEDE_SUBJECT,
    supersede_band: Optional[str] = SUPERSEDE_BAND,
    supersede_llm: Optional[Path] = SUPERSEDE_LLM,
    map_: Optional[str] = typer.Option(None, "--map", help="External store columns: id=COL,text=COL,group=COL,time=COL."),
    apply: bool = typer.Option(False, "--apply", help="External store: archive, then delete the dropped records of the "
                                                      "decision in --out (decide without --apply first; name the policy)."),
    keep_ids: Optional[Path] = typer.Option(None, "--keep-ids", help="A file of ids to keep whatever the decision "
                                            "says (one per line: the review page's export), as if pinned."),
    apply_flag: bool = typer.Option(False, "--apply-flag", help="External store: set memprune_keep/memprune_score instead."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Score a bullets store with a scorer (the shipped `default` unless --scorer) on Ray Data and prune it:
    duplicates merged, then a policy.

    --input also takes an external store, KIND:LOCATION: table:PATH (Parquet/JSONL/CSV), lance:PATH, mem0:CONFIG.
    """
    from memprune.prune.report import emptied_warning
    from memprune.stores import StorePruneConfig, run

    values = {"scorer": scorer, "input": input, "out": out, "rule.threshold": threshold, "rule.group_by": group_by,
              "rule.policy": policy, "rule.budget_tokens": budget_tokens, "rule.fraction": fraction,
              "rule.min_keep": min_keep, "rule.floor": floor, "rule.dedup_threshold": dedup_threshold,
              "rule.dedup": False if no_dedup else None, "dry_run": True if dry_run else None, "emit": emit, "score": score,
              "keep_ids": None if keep_ids is None else str(keep_ids)}
    values |= _store_values(map_, "flag" if apply_flag else "delete" if apply else None)
    values |= _lifecycle_values(pin_field, half_life, recall_boost, max_age, now, usage_log)
    values |= _supersede_values(supersede, supersede_scope, supersede_subject, supersede_band, supersede_llm)
    cfg, summary = run_stage(StorePruneConfig, run, config, set_, values | _top_k(top_k))
    r = summary["result"]
    console.print(f"{'would keep' if cfg.dry_run else 'kept'} {r['bullets_after']:.2f} of {r['bullets_before']:.2f} "
                  f"bullets per {cfg.rule.group_by} (-{r['bullet_reduction_pct'] or 0:.1f}% bullets, "
                  f"-{r['token_reduction_pct'] or 0:.1f}% tokens; {summary['duplicates']} duplicates) -> {cfg.out}",
                  highlight=False)
    review = (summary.get("emitted") or {}).get("review")
    if review:
        console.print(f"review: {review['path']} (a page for any browser; `memprune review {cfg.out} --open` serves "
                      "it on 127.0.0.1)", highlight=False, soft_wrap=True)
    warning = emptied_warning(summary)
    if warning:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    store = summary.get("store") or {}
    if store.get("rejected"):
        console.print(f"[bold yellow]warning:[/] {store['rejected']} of {store['records']} records rejected (kept "
                      f"untouched; each with its reason in {cfg.out}/rejects.jsonl)", highlight=False)
    if "apply" in summary:
        a = summary["apply"]
        done = (f"deleted {a['deleted']} (archived in {a['archive']}; {a['already_deleted']} already gone)"
                if a["mode"] == "delete" else f"flagged {a['flagged']} ({a['flagged_drop']} memprune_keep=false)")
        console.print(f"applied to {cfg.input}: {done}", highlight=False)
    elif "decision" in summary:
        from memprune.stores.report import group_lines

        for line in group_lines(summary):
            console.print(line, highlight=False)
        console.print(f"the store is unchanged; read {cfg.out}/prune.md, then rerun with --apply (or --apply-flag)",
                      highlight=False)


@app.command()
def review(
    out: str = typer.Argument(..., help="The --out of a `memprune prune` run (a directory or a URI)."),
    open_: bool = typer.Option(False, "--open", help="Serve the page on 127.0.0.1 and print its address (Ctrl-C "
                                                     "stops)."),
    port: int = typer.Option(0, "--port", help="--open: the port [default: a free one]."),
) -> None:
    """Write OUT/review.html again from the decision in OUT: every record, why it goes, what replaced it."""
    from memprune.stores.review import review_output, serve_page

    with user_errors("review"):
        page = review_output(out)
    console.print(f"review: {page}", highlight=False, soft_wrap=True)
    if open_:
        with user_errors("review"):
            server, url = serve_page(out, port)
        print(url, flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            server.shutdown()


@app.command()
def restore(
    archive: Optional[str] = typer.Option(None, "--archive", help="An archive directory or URI (`memprune prune --emit "
                                                                   "split`: OUT/dropped; `--apply` on a store: OUT/archive)."),
    ids: Optional[Path] = typer.Option(None, "--ids", help="File of ids to restore, one per line."),
    all_: bool = typer.Option(False, "--all", help="Restore every archived record."),
    into: Optional[str] = typer.Option(None, "--into", help="The store to restore into [default: the store the "
                                                             "archive's run kept, e.g. OUT/kept]."),
) -> None:
    """Put archived (pruned) records back into their store, so a prune can be undone."""
    from memprune.archive import read_ids
    from memprune.archive import restore as restore_archive

    if archive is None:
        fail("give --archive DIR (an archive a prune wrote) and one of --ids FILE or --all")
    if (ids is None) == (not all_):
        fail("give exactly one of --ids FILE or --all")
    with user_errors("restore"):
        load_restorers()
        summary = restore_archive(archive, None if all_ else read_ids(ids), **({"into": str(into)} if into else {}))
    json.dump(summary, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def load_restorers() -> None:
    """Import the packages that register archive restorers (archives written before manifests named their provider)."""
    import importlib

    for name in ("memprune.prune", "memprune.stores"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise


def _lifecycle_values(pin_field: Optional[str], half_life: Optional[str], recall_boost: Optional[float],
                      max_age: Optional[str], now: Optional[str], usage_log: Optional[str]) -> dict[str, Any]:
    """Pins, forgetting and expiry as config values; a duration or time that does not parse is one error line."""
    from memprune.times import parse_duration, parse_time

    for option, text in (("--half-life", half_life), ("--max-age", max_age)):
        if text is not None:
            try:
                parse_duration(text)
            except ValueError as exc:
                fail(f"{option}: {exc}")
    if now is not None:
        try:
            parse_time(now)
        except (ValueError, OverflowError, OSError):
            fail(f"--now: {now!r} is not a time; use ISO 8601, e.g. 2024-05-01T12:00:00Z")
    return {"rule.pin_field": pin_field, "rule.retention.half_life": half_life,
            "rule.retention.recall_boost": recall_boost, "rule.retention.max_age": max_age,
            "rule.retention.now": now, "usage_log": usage_log}


def _supersede_values(judge: Optional[str], scope: Optional[str], subject: Optional[str],
                      band: Optional[str], llm: Optional[Path] = None) -> dict[str, Any]:
    """The supersession options as config values; a band that is not LOW:HIGH is one error line."""
    low = high = None
    if band is not None:
        try:
            lo, _, hi = band.partition(":")
            low, high = float(lo), (float(hi) if hi else None)
        except ValueError:
            fail(f"--supersede-band: {band!r} is not LOW:HIGH (cosines, e.g. 0.5:0.85)")
    if judge is None and any(v is not None for v in (scope, subject, band, llm)):
        fail("--supersede-scope/--supersede-subject/--supersede-band/--supersede-llm need --supersede JUDGE "
             "(e.g. slot)")
    return {"rule.supersede.judge": judge, "rule.supersede.scope": scope, "rule.supersede.subject": subject,
            "rule.supersede.low": low, "rule.supersede.high": high,
            "rule.supersede.llm_config": None if llm is None else str(llm)}


def _store_values(map_: Optional[str], apply: Optional[str]) -> dict[str, Any]:
    """`--map` and `--apply` as config values (a bad --map is one error line)."""
    from memprune.stores.config import StoreError, parse_map

    values: dict[str, Any] = {"store.apply": apply}
    if map_ is not None:
        try:
            values["store.map"] = parse_map(map_)
        except StoreError as exc:
            fail(str(exc))
    return values


@app.command()
def score(
    scorer: Optional[str] = typer.Option(None, "--scorer", help="A shipped scorer by name (`memprune scorers`), or an artifact "
                                                                  "directory or URI (s3://...) [default: default]."),
    input: Optional[str] = typer.Option(None, "--input", "-i", help="KIND:LOCATION (table:, lance:, mem0:) or a bullets Parquet path."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output dir or URI (s3://...): scores.parquet, "
                                                                 "score.json, score.md."),
    map_: Optional[str] = typer.Option(None, "--map", help="Store columns: id=COL,text=COL,group=COL,time=COL."),
    write: Optional[bool] = typer.Option(None, "--write/--no-write", help="Write memprune_score into the store [default: write]."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Add the scorer's score (and calibrated score, where the scorer has one) to a store, deciding nothing."""
    from memprune.stores.config import ScoreConfig
    from memprune.stores import run_score

    values = {"scorer": scorer, "input": input, "out": out, "write": write} | _store_values(map_, None)
    values.pop("store.apply")
    cfg, summary = run_stage(ScoreConfig, run_score, config, set_, values)
    console.print(f"scored {summary['scored']} records of {cfg.input}; wrote {summary['written_to_store']} to the store "
                  f"-> {cfg.out}", highlight=False)
