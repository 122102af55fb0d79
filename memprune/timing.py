"""Where a job's time goes: compute (model forward/backward passes) versus everything else.

Jobs time their compute where it happens (inside Ray actors and training workers) as wall-clock
intervals; `busy_seconds` merges the intervals of parallel workers so compute is never counted
twice, and `time_split` gives the JSON block every job reports: `compute_s`, `overhead_s`
(start-up, scheduling, reading and writing) and the overhead's share of the whole.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any


def now() -> float:
    """A wall-clock stamp comparable across the processes of one machine (and NTP-synced hosts)."""
    return time.time()


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of [start, end] intervals: seconds in which at least one worker computed."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def time_split(wall_s: float, compute_s: float, **parts: Any) -> dict[str, Any]:
    """A job's timing block: wall time, compute time, the rest as overhead, and the overhead's share."""
    compute = max(0.0, min(compute_s, wall_s))
    overhead = wall_s - compute
    return {
        "wall_s": round(wall_s, 3),
        "compute_s": round(compute, 3),
        "overhead_s": round(overhead, 3),
        "overhead_share": round(overhead / wall_s, 3) if wall_s > 0 else None,
        **parts,
    }


def window_split(start: float, end: float, spans: Iterable[tuple[float, float]]) -> dict[str, float]:
    """Cut the window [start, end] by the workers' compute intervals (all clipped to it): `startup_s` before the
    first interval, `compute_s` (their union), `stall_s` (gaps between them: no worker computing) and `drain_s`
    after the last. The four add up to `end - start`."""
    clipped = [(max(a, start), min(b, end)) for a, b in spans if b > start and a < end]
    if not clipped:
        return {"startup_s": end - start, "compute_s": 0.0, "stall_s": 0.0, "drain_s": 0.0}
    first, last = min(a for a, _ in clipped), max(b for _, b in clipped)
    busy = busy_seconds(clipped)
    return {"startup_s": first - start, "compute_s": busy, "stall_s": (last - first) - busy, "drain_s": end - last}


def underused_seconds(spans_by_worker: list[list[tuple[float, float]]]) -> float:
    """Of the compute time (the union of all workers' intervals), the seconds lost to workers idling beside a busy
    one (start-up skew, the last blocks): the union minus the mean of each worker's own busy time."""
    if not spans_by_worker:
        return 0.0
    union = busy_seconds(span for spans in spans_by_worker for span in spans)
    return union - sum(busy_seconds(spans) for spans in spans_by_worker) / len(spans_by_worker)
