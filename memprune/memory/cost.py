"""What a memory condition costs: memory notes and tokens per evaluated row, and the engine's own counts.

Rows are one evaluated item (target turn, question) under one condition, with `n_memory`,
`prompt_tokens`, `memory_tokens` (counted by `memprune.llm.tokens.PromptTokens`) and the engine's
`tokens_in` / `tokens_out`; the change against `all` is what pruning saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa


def token_stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, 95th percentile (linear interpolation) and total of per-row counts."""
    if not len(values):
        return {"mean": None, "median": None, "p95": None, "total": 0}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p95": float(np.percentile(arr, 95)),
            "total": float(arr.sum())}


def cost_table(gen: pa.Table, conditions: Sequence[str], unit: str = "targets", notes: str = "bullets"
               ) -> dict[str, dict[str, Any]]:
    """Per condition: rows (`unit`), memory notes (`notes`), prompt and memory tokens per row (mean, median, p95,
    total), the engine's own token counts, and the change of the totals against `all` in percent."""
    rows = gen.select(["condition", "n_memory", "prompt_tokens", "memory_tokens", "tokens_in", "tokens_out"]).to_pylist()
    out: dict[str, dict[str, Any]] = {}
    for c in conditions:
        mine = [r for r in rows if r["condition"] == c]
        out[c] = {
            unit: len(mine),
            notes: token_stats([r["n_memory"] for r in mine]),
            "prompt_tokens": token_stats([r["prompt_tokens"] for r in mine]),
            "memory_tokens": token_stats([r["memory_tokens"] for r in mine]),
            "engine_tokens_in": sum(r["tokens_in"] or 0 for r in mine),
            "engine_tokens_out": sum(r["tokens_out"] or 0 for r in mine),
        }
    if "all" in out:
        base = out["all"]
        for c, entry in out.items():
            for key in ("prompt_tokens", "memory_tokens", notes):
                b, v = base[key]["total"], entry[key]["total"]
                entry[f"{key}_vs_all_pct"] = 100.0 * (v - b) / b if b else None
    return out
