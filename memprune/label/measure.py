"""`label --plan --measure N`: judge N real pairs with the chosen judge on this hardware, then plan the run from that.

The first whole target turns of the judging order, at least N pairs, are judged by the configured
judge in a throw-away work dir, in two passes of different sizes (each pass of a model judge starts
its engine, as each shard of the real run does). A straight line through (items, seconds) of the
passes separates the engine start-up of a pass from the steady items/s; the whole run is then
planned as `passes x start-up + items / (items/s)`, with as many passes as the run has shards. Where
the passes do not separate (one pass, or a line with a negative start-up) the rate is the measured
items over the measured seconds, start-up included, and the plan says so.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from memprune.label.pairs import PairPlan, target_groups


def head_plan(plan: PairPlan, n: int) -> PairPlan:
    """The plan's first whole target turns holding at least `n` pairs (all of it when it has fewer)."""
    stop = 0
    for _, b in target_groups(plan):
        stop = b
        if stop >= n:
            break
    pairs = plan.pairs.slice(0, stop)
    return PairPlan(pairs, [], len(set(pairs.column("bullet_id").to_pylist())))


def fit_passes(passes: list[list[float]]) -> tuple[float | None, float]:
    """(start-up seconds per pass or None, items/s) from the passes' (items, seconds)."""
    x = np.array([p[0] for p in passes], float)
    y = np.array([p[1] for p in passes], float)
    if len(passes) >= 2 and np.ptp(x) > 0:
        slope, intercept = np.polyfit(x, y, 1)
        if slope > 0 and intercept >= 0:
            return float(intercept), float(1.0 / slope)
    return None, float(x.sum() / y.sum()) if y.sum() > 0 else 0.0


def measure(cfg: Any, plan: PairPlan, inputs: dict[str, str], n: int) -> dict[str, Any]:
    """Judge the first `n` pairs of `plan` with `cfg`'s judge; the measured figures and the run planned from them."""
    entry = cfg.judge_entry()
    sub = head_plan(plan, n)
    shard = max(1, math.ceil(0.7 * sub.pairs.num_rows))  # two passes of different sizes: start-up vs rate
    with tempfile.TemporaryDirectory(prefix="memprune-measure-") as tmp:
        mcfg = cfg.model_copy(update={"out": Path(tmp), "plan": False, "shard_size": shard})
        t0 = time.perf_counter()
        judged = entry.judge_all(mcfg, sub, inputs)
        wall = time.perf_counter() - t0
    stats = judged.stats
    passes = stats.get("passes") or [[sub.pairs.num_rows * max(1, len(judged.names)), stats.get("judge_s") or wall]]
    startup, rate = fit_passes(passes)
    counters = stats.get("counters", {})
    errors = sum(e is not None for row in judged.errors for e in row)
    items_per_pair = sum(p[0] for p in passes) / sub.pairs.num_rows  # judge instances x samples
    steady_s = sum(p[1] for p in passes) - (startup or 0.0) * len(passes)
    total_items = plan.pairs.num_rows * items_per_pair
    runs = max(1, len(judged.specs))  # judge instances that each run their own passes
    full_passes = runs * math.ceil(plan.pairs.num_rows / cfg.effective_shard_size())
    seconds = (full_passes * (startup or 0.0) + total_items / rate) if rate > 0 else None
    return {
        "judge": entry.kind,
        "pairs": sub.pairs.num_rows,
        "wall_s": round(wall, 3),
        "passes": [[int(a), round(float(b), 3)] for a, b in passes],
        "startup_s_per_pass": startup,
        "items_per_s": rate,
        "pairs_per_s": round(rate / items_per_pair, 3) if items_per_pair else None,
        "rate_includes_startup": startup is None,
        "error_rate": errors / max(1, sum(len(row) for row in judged.errors)),
        "prompt_tokens_per_s": round(counters["tokens_in"] / steady_s, 1) if counters.get("tokens_in") and steady_s > 0 else None,
        "generated_tokens_per_s": (round(counters["tokens_out"] / steady_s, 1)
                                   if counters.get("tokens_out") and steady_s > 0 else None),
        "planned_passes": full_passes,
        "planned_hours": None if seconds is None else seconds / 3600,
    }
