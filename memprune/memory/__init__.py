"""One floor for the memory-condition evaluations (dialogue-eval, qa-eval): what both read, build and report.

    from memprune.memory import bullets_by_session, load_keep, memory_pool
    keep, info = load_keep("runs/msc-pruned")            # bullet id -> kept, files, counts, rule
    pool = memory_pool(bullets_by_session(bullets), "conv-1", 3)   # the bullets before session 3

- `store`: the pruned store (`load_keep`, `missing_from_store`, `PrunedStoreError`).
- `conditions`: the memory a condition draws from: `Bullet`, `bullets_by_session`, `memory_pool`,
  `rank_key` (stable hash sampling), `top_k` (retrieval): pure, no Ray, no model.
- `config`: `MemoryEvalConfig` (the settings both evaluations share) and `BootstrapSettings`.
- `bootstrap`: paired percentile intervals and the differences between conditions.
- `cost`: memory notes and tokens per condition (`token_stats`, `cost_table`).
- `report`: the Markdown cells of a value or a paired difference with its interval.

`memprune.dialogue` and `memprune.qa` import these as siblings and never each other; prompt tokens are
counted by `memprune.llm.tokens.PromptTokens`.
"""

from __future__ import annotations

from memprune.memory.bootstrap import (
    bootstrap_indices,
    comparison_pairs,
    comparisons,
    mean_bootstrap,
    paired_difference,
    percentile_ci,
    with_interval,
)
from memprune.memory.conditions import Bullet, bullets_by_session, memory_pool, rank_key, top_k
from memprune.memory.config import BootstrapSettings, MemoryEvalConfig
from memprune.memory.cost import cost_table, token_stats
from memprune.memory.report import delta_cell, value_cell
from memprune.memory.store import PrunedStoreError, load_keep, missing_from_store, pruned_files

__all__ = [
    "BootstrapSettings",
    "Bullet",
    "MemoryEvalConfig",
    "PrunedStoreError",
    "bootstrap_indices",
    "bullets_by_session",
    "comparison_pairs",
    "comparisons",
    "cost_table",
    "delta_cell",
    "load_keep",
    "mean_bootstrap",
    "memory_pool",
    "missing_from_store",
    "paired_difference",
    "percentile_ci",
    "pruned_files",
    "rank_key",
    "token_stats",
    "top_k",
    "value_cell",
    "with_interval",
]
