"""The pieces every Markdown report is made of: one number formatter, mean ± std, p-values, tables.

Reports are rendered from their JSON summaries alone, so they can be regenerated from a saved
summary; undefined values (None, NaN) print as an em dash everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MISSING = "—"


def fmt(value: Any, digits: int = 4) -> str:
    """A number for a table cell: ints as they are, floats with `digits` decimals, missing as —."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return MISSING
    if isinstance(value, bool) or isinstance(value, int) or isinstance(value, str):
        return str(value)
    return f"{value:.{digits}f}"


def fmt_p(p: Any) -> str:
    """A p-value: 3 significant digits, scientific below 0.001."""
    if p is None or (isinstance(p, float) and not math.isfinite(p)):
        return MISSING
    return f"{p:.2e}" if p < 1e-3 else f"{p:.3f}"


def mean_std(entry: dict[str, Any] | None, digits: int = 4) -> str:
    """'mean ± std' of an aggregated entry ('mean' alone without a std)."""
    if not entry:
        return MISSING
    if entry.get("std") is None:
        return fmt(entry.get("mean"), digits)
    return f"{fmt(entry['mean'], digits)} ± {fmt(entry['std'], digits)}"


def stars(p: Any) -> str:
    """'***' p < 0.001, '**' p < 0.01, '*' p < 0.05, '' otherwise."""
    if p is None:
        return ""
    return "***" if p < 1e-3 else "**" if p < 1e-2 else "*" if p < 0.05 else ""


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table as lines; cells are used as they are (format them first)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return lines


def key_values(rows: Sequence[tuple[str, Any]]) -> list[str]:
    """A two-column `| what | value |` table (numbers through `fmt`)."""
    return table(["what", "value"], [(k, v if isinstance(v, str) else fmt(v)) for k, v in rows])


def time_line(timing: dict[str, Any]) -> str:
    """One line from a `memprune.timing.time_split` block: compute versus overhead."""
    share = timing.get("overhead_share")
    return (f"compute {timing['compute_s']:.1f} s, overhead {timing['overhead_s']:.1f} s"
            + (f" ({share:.0%} of the wall time)" if share is not None else ""))
