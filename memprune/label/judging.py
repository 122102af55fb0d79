"""Run the configured model judges (any `JUDGES` entry with `needs_llm`; one or several) over a plan.

Each judge works in its own fingerprinted work dir (`OUT/.work/<fingerprint>/`), so a consensus
run reuses the shards of a judge it shares with an earlier run, and every judging instance (a
judge, or one sample of a sampled judge) comes back as one row of scores aligned with the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from memprune.label.config import LabelConfig
from memprune.label.consensus import JudgeSpec, instance_names, judge_specs
from memprune.label.judges import JUDGES
from memprune.label.pairs import PairPlan
from memprune.label.shards import sample_view
from memprune.work import WorkDir

WORK_VERSION = 2


def work_payload(cfg: LabelConfig, inputs: dict[str, str], judge_settings: dict[str, Any]) -> dict[str, Any]:
    """What the shards depend on: inputs, pair set, judge settings, sharding. Not decay/aggregation/mappings."""
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
    if cfg.judge_entry().context:
        payload["context_turns"] = cfg.context_turns
    return payload


def spec_settings(cfg: LabelConfig, spec: JudgeSpec) -> dict[str, Any]:
    """Everything about one judge that changes its shards."""
    settings: dict[str, Any] = {"llm": spec.llm.model_dump(mode="json"), "mode": spec.mode}
    if spec.samples > 1:
        settings.update(samples=spec.samples, temperature=cfg.judge_temperature)
    extra = JUDGES[spec.mode].settings
    if extra is not None:
        settings.update(extra(cfg))
    return settings


@dataclass
class Judged:
    """Every judging instance's view of the plan: scores (NaN = none), errors, modes and `judge` values per pair."""

    names: list[str]
    scores: np.ndarray
    errors: list[list[str | None]]
    modes: list[list[str]]
    judge_values: list[list[str]]
    extras: list[dict[str, pa.Array]]
    stats: dict[str, Any] = field(default_factory=dict)
    work_dirs: list[str] = field(default_factory=list)
    tables: list[pa.Table] = field(default_factory=list)
    specs: list[JudgeSpec] = field(default_factory=list)  # the model judges that ran (none: similarity)


def _merge(into: dict[str, Any], run: dict[str, Any]) -> None:
    for key in ("shards_total", "shards_reused", "pairs_judged", "judge_s", "lists_planned"):
        if key in run:
            into[key] = into.get(key, 0) + run[key]
    into["passes"] = into.get("passes", []) + run.get("passes", [])
    counters = into.setdefault("counters", {})
    for key, value in run.get("counters", {}).items():
        counters[key] = counters.get(key, 0) + value


def run_spec(cfg: LabelConfig, plan: PairPlan, spec: JudgeSpec, work: WorkDir, stats: dict[str, Any]
             ) -> tuple[pa.Table, Any]:
    """Judge the plan with one judge in its work dir: its `JUDGED` rows (score set) and the judge object."""
    run = JUDGES[spec.mode].run
    assert run is not None, spec.mode
    return run(cfg, plan, spec, work, stats)


def judge_all(cfg: LabelConfig, plan: PairPlan, inputs: dict[str, str]) -> Judged:
    """`JudgeEntry.judge_all` of the model judges: every judge of `judge_specs(cfg)` over `plan`."""
    return run_judges(cfg, plan, judge_specs(cfg), inputs)


def run_judges(cfg: LabelConfig, plan: PairPlan, specs: list[JudgeSpec], inputs: dict[str, str]) -> Judged:
    """Run every judge of `specs` over `plan`; one `Judged` row per judge instance (judge x sample)."""
    n = plan.pairs.num_rows
    out = Judged([], np.zeros((0, n)), [], [], [], [])
    rows, names = [], []
    for spec in specs:
        work = WorkDir(cfg.out, work_payload(cfg, inputs, spec_settings(cfg, spec)))
        stats: dict[str, Any] = {}
        table, judge = run_spec(cfg, plan, spec, work, stats)
        out.work_dirs.append(str(work))
        _merge(out.stats, stats)
        out.stats.setdefault("per_judge", []).append({"judge": getattr(judge, "list_name", judge.name), "work_dir": str(work), **stats})
        list_name = getattr(judge, "list_name", judge.name)
        names.append(list_name)
        for s in range(spec.samples):
            view = sample_view(table, s, n)
            out.tables.append(view)
            rows.append(view.column("score").to_numpy(zero_copy_only=False).astype(np.float64))
            out.errors.append(view.column("error").to_pylist())
            modes = view.column("judge_mode").to_pylist()
            out.modes.append(modes)
            out.judge_values.append([list_name if JUDGES[m].lists else judge.name for m in modes])
            out.extras.append({c: view.column(c).combine_chunks() for c in JUDGES[spec.mode].extras})
    out.scores = np.vstack(rows) if rows else np.zeros((0, n))
    out.names = instance_names(specs, names)
    out.specs = list(specs)
    return out
