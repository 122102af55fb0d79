"""Pruning a store (DESIGN step 5), the batch step: read a bullets store, score it on Ray Data (or on the driver),
decide with `memprune.decision`, write the pruned store and report. `MemoryPruner` is the same decision in-process.

    from memprune.prune import MemoryPruner, PruneConfig, run
    MemoryPruner("runs/train/stage2/seed0", threshold=0.5, top_k=5).prune(["Alice has a cat.", "It rained."])
    run(PruneConfig(scorer="runs/train/stage2/seed0", input="runs/msc", out="runs/msc-pruned"))

- `config`: `ScoringRuntime`, `PruneSettings` (the rule, `memprune.decision.PruneRule`, plus scoring and output) and
  `PruneConfig`, validated once.
- `inputs`: pins, times, recalls and scopes of the bullets, from a table's columns or mappings (`Lives`).
- `scoring`: scoring helpers and `MemoryPruner` (in-process, no Ray).
- `stats`: per-group counters and the before/after summary.
- `store`: the Parquet store, its block plan, the atomic swap of the output.
- `job`: the Ray Data job (datasource, scoring actors, shuffle fallback), and the same work on the driver.
- `split`: `--emit split` (kept/ store + dropped/ archive) and the `bullets` restorer of `memprune restore`.
- `stage`: `run(cfg)`; `report`: prune.md.

The decision's names (`PruneRule`, `PruneError`, `GROUP_KEYS`) are re-exported here for code written against the
step; new code imports them from `memprune.decision`.
"""

from __future__ import annotations

from memprune.decision import GROUP_KEYS, PruneError, PruneRule
from memprune.prune.config import PruneConfig, PruneSettings, ScoringRuntime
from memprune.prune.inputs import Lives, session_times_of
from memprune.prune.scoring import KeptBullet, MemoryPruner, group_keys_of, score_and_embed, score_texts
from memprune.prune.split import restore_bullets, write_split
from memprune.prune.store import list_store_files, open_store, plan_store, read_pruned

_STAGE = {"run": "run", "run_prune": "run"}


def __getattr__(name: str):  # the stage (and the torch it loads) only when asked for: Ray Data's read, decide
    if name in _STAGE:          # and write tasks import this package and need none of it
        from memprune.prune import stage

        return getattr(stage, _STAGE[name])
    raise AttributeError(f"module 'memprune.prune' has no attribute {name!r}")


__all__ = [
    "GROUP_KEYS",
    "KeptBullet",
    "Lives",
    "MemoryPruner",
    "PruneConfig",
    "PruneError",
    "PruneRule",
    "PruneSettings",
    "ScoringRuntime",
    "group_keys_of",
    "list_store_files",
    "open_store",
    "plan_store",
    "read_pruned",
    "restore_bullets",
    "run",
    "run_prune",
    "score_and_embed",
    "score_texts",
    "session_times_of",
    "write_split",
]
