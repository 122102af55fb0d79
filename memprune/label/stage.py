"""`memprune label`: pseudo labels for bullets from a judge over bullet x next-session turn pairs (DESIGN step 2).

Reads `DATA/sessions.parquet` and `DATA/bullets.parquet` (written by `memprune ingest` or
`memprune summarize`), builds the pairs (`memprune.label.pairs`), judges them (similarity proxy,
LLM judge pairwise or listwise, likelihood-gain judge; one judge or a consensus of several),
aggregates them into labels (`memprune.label.aggregate`, `memprune.label.consensus`) and writes
into `OUT`:

- `pairs.parquet`   bullet_id, turn_id, score, judge, error, horizon, judge_mode (+ list_position,
  list_size for listwise; gain for likelihood; n_judges, spread for a consensus), sorted by
  (bullet_id, turn_id);
- `labels.parquet`  bullet_id, label, n_pairs, aggregation, source (+ n_judges, spread, agreement
  for a consensus), sorted by bullet_id;
- `pairs_by_judge.parquet` (consensus) every judge's score of every pair;
- `unlabelled.jsonl` every bullet without a label and why;
- `label.json` / `label.md` counts that reconcile, error rate, pairs/s, cost (calls, tokens),
  judge agreement.

`--plan` (`run_plan`) only counts what each judge mode would cost (`plan.json`, `plan.md`).
Other label sources (`source: qa | usage`, the `SOURCES` of `memprune.label.sources`) skip the judge.

Resumable: the work is cut into deterministic shards, each written atomically under
`OUT/.work/<fingerprint>/` (the fingerprint hashes the inputs and every option that changes
the judged values, not decay or aggregation). A rerun of the same command reuses finished
shards, redoes the rest and assembles byte-identical tables.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from rich.console import Console

from memprune.io import read_table, write_jsonl, write_summary, write_table
from memprune.outputs import OutputSet, check_out_location
from memprune.label.aggregate import aggregate
from memprune.label.config import LabelConfig, LabelError
from memprune.label.pairs import PairPlan, build_pairs
from memprune.label.report import render_markdown, render_plan, render_source_markdown
from memprune.label.sources import SOURCES
from memprune.label.summary import judge_summary
from memprune.schema import PAIRS
from memprune.storage import Location, canonical, directory
from memprune.work import file_digest

console = Console(stderr=True)

# pairs.parquet: the PAIRS contract plus the horizon (labels can be recomputed from it alone) and the
# judge mode of each row (pairwise, listwise, likelihood, similarity; a consensus of several: mixed).
PAIRS_OUT = PAIRS.append(pa.field("horizon", pa.int32(), nullable=False)).append(
    pa.field("judge_mode", pa.string(), nullable=False))


def _out_dir(cfg: LabelConfig) -> Location:
    """`cfg.out` (a directory or a storage URI), refused up front when it is a file or the corpus itself: the label
    step's outputs and its manifest (`.memprune.json`) would replace the corpus's own, and the corpus would no
    longer be one."""
    out = check_out_location(cfg.out, "label")
    if canonical(out) == canonical(cfg.data):
        raise LabelError(f"{out}: the label output directory (--out) must differ from the data directory (--data)")
    return out


def _data(cfg: LabelConfig) -> Path | Location:
    """The corpus directory: a Path, or the `Location` of a URI (read through its filesystem)."""
    return directory(cfg.data, "--data")


def _inputs(cfg: LabelConfig) -> tuple[pa.Table, pa.Table, dict[str, str]]:
    data = _data(cfg)
    sessions_path, bullets_path = data / "sessions.parquet", data / "bullets.parquet"
    sessions = read_table(sessions_path, "sessions")
    bullets = read_table(bullets_path, "bullets")
    return sessions, bullets, {"sessions": file_digest(sessions_path), "bullets": file_digest(bullets_path)}


def _pairs_table(plan: PairPlan, scores: np.ndarray, errors: list[str | None], judge_values: list[str],
                 modes: list[str], extras: dict[str, Any]) -> pa.Table:
    """pairs.parquet: one row per pair, sorted by (bullet_id, turn_id); `score` null iff `error` is set."""
    n = plan.pairs.num_rows
    score = pa.array([None if (e is not None or np.isnan(v)) else float(v) for v, e in zip(scores, errors)],
                     type=pa.float64()) if n else pa.array([], type=pa.float64())
    columns = {
        "bullet_id": plan.pairs.column("bullet_id"),
        "turn_id": plan.pairs.column("turn_id"),
        "score": score,
        "judge": pa.array(judge_values, type=pa.string()),
        "error": pa.array(errors, type=pa.string()),
        "horizon": plan.pairs.column("horizon"),
        "judge_mode": pa.array(modes, type=pa.string()),
    }
    schema = PAIRS_OUT
    for name, values in extras.items():
        arr = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(values)
        columns[name] = arr
        schema = schema.append(pa.field(name, arr.type))
    table = pa.table(columns, schema=schema)
    return table.sort_by([("bullet_id", "ascending"), ("turn_id", "ascending")]).combine_chunks()


def _consensus_modes(judged: Any) -> list[str]:
    """Per pair, the judge mode shared by every instance, else `mixed`."""
    out = []
    for modes in zip(*judged.modes):
        first = modes[0]
        out.append(first if all(m == first for m in modes) else "mixed")
    return out


def _check_models(cfg: LabelConfig, entry: Any) -> None:
    """A model judge's model that is not there fails here, before Ray starts an engine."""
    if entry.needs_llm:
        from memprune.label.consensus import judge_specs

        for spec in judge_specs(cfg):
            spec.llm.check_model()


def run_judge(cfg: LabelConfig) -> dict[str, Any]:
    """Run the labeling stage described by `cfg`; return the `label.json` summary."""
    started = time.perf_counter()
    out = _out_dir(cfg)
    sessions, bullets, inputs = _inputs(cfg)
    entry = cfg.judge_entry()
    _check_models(cfg, entry)
    plan = build_pairs(sessions, bullets, cfg.pair_options(), with_context=entry.context)
    by_judge: pa.Table | None = None
    assert entry.judge_all is not None, entry.kind
    judged = entry.judge_all(cfg, plan, inputs)
    stats, work_dirs = judged.stats, judged.work_dirs
    extra: dict[str, Any] = {"judged": judged}
    if len(judged.names) == 1:
        judge_name = judged.names[0]
        pairs = _pairs_table(plan, judged.scores[0], judged.errors[0], judged.judge_values[0], judged.modes[0],
                             judged.extras[0])
        labels, failed = aggregate(pairs, cfg.decay, cfg.aggregation)
    else:
        from memprune.label.consensus import combine_pairs, consensus_agreement, consensus_labels

        judge_name = f"consensus:{'|'.join(judged.names)}"
        c = combine_pairs(judged.scores, judged.errors)
        pairs = _pairs_table(plan, c["score"], c["error"], [judge_name] * plan.pairs.num_rows,
                             _consensus_modes(judged), {"n_judges": pa.array(c["n_judges"], pa.int32()),
                                                        "spread": pa.array(c["spread"], pa.float64())})
        ordered = plan.pairs.select(["bullet_id", "horizon"])
        labels, failed, matrix, _ = consensus_labels(ordered, judged.scores, cfg.decay, cfg.aggregation)
        extra["agreement"] = consensus_agreement(judged.scores, matrix, judged.names)
        by_judge = _by_judge(plan, judged)

    unlabelled = sorted(
        [{"bullet_id": b, "reason": r, "n_pairs": 0, "n_errors": 0} for b, r in plan.unpaired] + failed,
        key=lambda d: d["bullet_id"],
    )
    summary = judge_summary(cfg, plan, pairs, labels, unlabelled, judge_name, inputs, work_dirs, stats,
                            time.perf_counter() - started, extra)
    with OutputSet(out, "label") as outputs:  # every output committed together
        write_table(pairs, outputs.path("pairs.parquet"), "pairs")
        write_table(labels, outputs.path("labels.parquet"), "labels")
        if by_judge is not None:
            write_table(by_judge, outputs.path("pairs_by_judge.parquet"))
        write_jsonl(outputs.path("unlabelled.jsonl"), unlabelled)
        write_summary(outputs.staging, "label", summary, render_markdown(summary))
    return summary


def _by_judge(plan: PairPlan, judged: Any) -> pa.Table:
    """pairs_by_judge.parquet (consensus runs): every judge instance's score of every pair."""
    n = plan.pairs.num_rows
    parts = []
    for name, scores, errors, modes in zip(judged.names, judged.scores, judged.errors, judged.modes):
        parts.append(pa.table({
            "bullet_id": plan.pairs.column("bullet_id"), "turn_id": plan.pairs.column("turn_id"),
            "judge": pa.array([name] * n, pa.string()), "judge_mode": pa.array(modes, pa.string()),
            "score": pa.array([None if np.isnan(v) else float(v) for v in scores], pa.float64()),
            "error": pa.array(errors, pa.string())}))
    table = pa.concat_tables(parts) if parts else pa.table({})
    return table.sort_by([("bullet_id", "ascending"), ("turn_id", "ascending"), ("judge", "ascending")])


def run_plan(cfg: LabelConfig) -> dict[str, Any]:
    """`--plan`: calls, prompt and generated tokens, prefix-cache reuse and GPU-hours of each judge mode; no model run.

    Writes `OUT/plan.json` and `OUT/plan.md`. The token counts use the judge model's tokenizer
    when its directory is local (from the LLM config), else the named fallback (`cost.tokenizer`).
    """
    from memprune.label.cost import PromptCounter, plan_mode
    from memprune.label.judges import JUDGES, plan_modes

    started = time.perf_counter()
    out = _out_dir(cfg)
    sessions, bullets, inputs = _inputs(cfg)
    plan = build_pairs(sessions, bullets, cfg.pair_options(), with_context=True)
    has_llm = bool(cfg.llm or cfg.llm_config or cfg.judge_set)
    llms = cfg.judge_llm_settings() if has_llm else [None]
    llm = llms[0]
    counter = PromptCounter(llm.model if llm else None, cfg.cost.tokenizer, bool(llm and llm.trust_remote_code))
    modes = {}
    for mode in plan_modes():
        instances = len(llms) * (cfg.judge_samples if JUDGES[mode].samples else 1)
        modes[mode] = plan_mode(mode, plan, counter, llm, cfg.listwise, cfg.cost, instances)
    extra: dict[str, Any] = {}
    for mode in modes:
        summarize = JUDGES[mode].plan_summary
        if summarize is not None:
            extra.update(summarize(modes))
    chosen = cfg.judge_entry()
    if cfg.cost.measure:
        # the pairs as the judge gets them: the plan's own, with their context turns, unless the judge takes none
        judge_plan = plan if chosen.context else build_pairs(sessions, bullets, cfg.pair_options(), with_context=False)
        extra["measured"] = _measured(cfg, chosen, judge_plan, inputs, modes, cfg.cost.measure)
    summary = {
        "stage": "label-plan",
        "tokenizer": counter.name,
        "model": llm.model if llm else None,
        "chosen": chosen.kind,
        "pairs": plan.pairs.num_rows,
        "bullets": plan.n_bullets,
        "target_turns": len({t for t in plan.pairs.column("turn_id").to_pylist()}),
        "throughput_tokens_per_s": cfg.cost.throughput,
        "decode_throughput_tokens_per_s": cfg.cost.decode_throughput or cfg.cost.throughput,
        "block_size": cfg.cost.block_size,
        "modes": modes,
        **extra,
        "config": json.loads(cfg.model_dump_json()),
        "inputs": {"sessions.parquet": inputs["sessions"], "bullets.parquet": inputs["bullets"]},
        "wall_s": round(time.perf_counter() - started, 3),
    }
    with OutputSet(out, "label-plan") as outputs:  # its own step: a later label run's outputs are not the plan's
        write_summary(outputs.staging, "plan", summary, render_plan(summary))
    return summary


def _measured(cfg: LabelConfig, entry: Any, plan: PairPlan, inputs: dict[str, str], modes: dict[str, Any],
              n: int) -> dict[str, Any]:
    """`--measure N`: the chosen judge on N real pairs of `plan` (the pairs it judges), the run planned from it; each
    mode's hours at the measured effective tokens/s (`hours_at_measured`)."""
    from memprune.label.measure import measure

    _check_models(cfg, entry)
    console.print(f"measuring the {entry.kind} judge on the first {min(n, plan.pairs.num_rows)} pairs (whole target "
                  "turns)", highlight=False)
    m = measure(cfg, plan, inputs, n)
    own = modes.get(entry.kind)
    if own is not None and m["pairs_per_s"] and own["pairs"]:
        tokens_per_s = own["effective_tokens"] / own["pairs"] * m["pairs_per_s"]  # effective tokens the judge did
        m["effective_tokens_per_s"] = tokens_per_s
        for mode in modes.values():
            mode["hours_at_measured"] = mode["effective_tokens"] / tokens_per_s / 3600
        own["hours_at_measured"] = m["planned_hours"]  # its own plan counts its passes' start-ups too
    return m


def run_source(cfg: LabelConfig) -> dict[str, Any]:
    """Labels from a source's `run` (`qa`, `usage`; no judge); write labels.parquet, unlabelled.jsonl, label.json/md.

    One pass over the inputs, cheap next to judging: a rerun recomputes everything and
    writes the same tables (every output is written atomically). Usage events that cannot
    be used are written to `OUT/rejects.jsonl` with file, record, field and reason.
    """
    started = time.perf_counter()
    data, out = _data(cfg), _out_dir(cfg)
    bullets_path = data / "bullets.parquet"
    bullets = read_table(bullets_path, "bullets")
    inputs: dict[str, str] = {"bullets.parquet": file_digest(bullets_path)}
    with OutputSet(out, "label") as outputs:
        return _run_source(cfg, data, bullets, inputs, outputs, started)


def _run_source(cfg: LabelConfig, data: Path | Location, bullets: pa.Table, inputs: dict[str, str], outputs: OutputSet,
                started: float) -> dict[str, Any]:
    source = SOURCES[cfg.source]
    assert source.run is not None, cfg.source
    ran = source.run(cfg, data, bullets, inputs, outputs)
    result, rule, ledger_summary = ran.result, ran.rule, ran.ledger

    write_table(result.labels, outputs.path("labels.parquet"), "labels")
    write_jsonl(outputs.path("unlabelled.jsonl"), result.unlabelled)

    c = result.counts
    reconciles = c["bullets"] == c["bullets_labelled"] + c["bullets_unlabelled"]
    if ledger_summary is not None:
        reconciles = reconciles and ledger_summary["conservation"] == "ok" and (
            c["events"] == c["events_counted"] + c["events_outside_window"] + c["events_rejected"])
    vals = result.labels.column("label").to_numpy() if result.labels.num_rows else np.zeros(0)
    files = ["labels.parquet", "unlabelled.jsonl", "label.json", "label.md"]
    if ledger_summary is not None:
        files.insert(2, "rejects.jsonl")
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
        "outputs": files,
    }
    if ledger_summary is not None:
        summary["ledger"] = ledger_summary
    write_summary(outputs.staging, "label", summary, render_source_markdown(summary))
    return summary


def run(cfg: LabelConfig) -> dict[str, Any]:
    """Run the labeling stage described by `cfg` (judge, qa or usage source; or only `--plan` it); return its summary."""
    if cfg.plan:
        return run_plan(cfg)
    return run_judge(cfg) if SOURCES[cfg.source].judged else run_source(cfg)
