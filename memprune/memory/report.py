"""The Markdown cells both memory reports (dialogue.md, qa.md) print: a value with its interval, a paired
difference with its interval and P>0, written the same way in both so the two reports read alike."""

from __future__ import annotations

from typing import Any


def value_cell(entry: dict[str, Any] | None, digits: int) -> str:
    """`value [lo, hi]` of a `{value, ci}` entry, `n/a` when there is no value."""
    if not entry or entry.get("value") is None:
        return "n/a"
    text = f"{entry['value']:.{digits}f}"
    if entry.get("ci"):
        lo, hi = entry["ci"]
        text += f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    return text


def delta_cell(entry: dict[str, Any] | None, digits: int) -> str:
    """`+delta [lo, hi] (P>0 p)` of a paired difference, `n/a` when there is none."""
    if not entry:
        return "n/a"
    text = f"{entry['delta']:+.{digits}f}"
    if entry.get("ci"):
        lo, hi = entry["ci"]
        text += f" [{lo:+.{digits}f}, {hi:+.{digits}f}]"
    if entry.get("p_better") is not None:
        text += f" (P>0 {entry['p_better']:.2f})"
    return text
