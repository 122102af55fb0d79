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
