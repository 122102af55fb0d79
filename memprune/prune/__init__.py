"""Pruning (DESIGN step 5): merge duplicates, then keep what the policy (rule, budget, fraction) says, with reasons.

    from memprune.prune import MemoryPruner, PruneConfig, PruneRule, run
    MemoryPruner("runs/train/stage2/seed0", threshold=0.5, top_k=5).prune(["Alice has a cat.", "It rained."])
    run(PruneConfig(scorer="runs/train/stage2/seed0", input="runs/msc", out="runs/msc-pruned"))

- `config`: `PruneRule` (threshold, top-k, group-by) and `PruneConfig`, validated once.
- `rule`: the paper's rule as pure numpy functions (shared with `memprune evaluate`).
- `policy`: the whole decision, pure: duplicates, expiry, floor, policy (rule/budget/fraction), min-keep, pins, reasons.
- `lifecycle`: keeping memory current, pure: pins, retention (forgetting curve), expiry, durations, the usage log.
- `split`: `--emit split` (kept/ store + dropped/ archive) and the `bullets` restorer of `memprune restore`.
- `scoring`: scoring helpers and `MemoryPruner` (in-process, no Ray).
- `stats`: per-group counters and the before/after summary.
- `store`: the Parquet store, its block plan, the atomic swap of the output.
- `job`: the Ray Data job (datasource, scoring actors, shuffle fallback), and the same work on the driver.
- `stage`: `run(cfg)`; `report`: prune.md.
"""

from __future__ import annotations

from memprune.prune.config import (
    GROUP_KEYS,
    PruneConfig,
    PruneError,
    PruneRule,
    PruneSettings,
)
from memprune.prune.lifecycle import Retention, Usage, parse_duration, read_usage, retention_factor
from memprune.prune.policy import REASONS, Decision, apply_policy, decide_policy, find_duplicates, normalize_text
from memprune.prune.rule import (
    group_codes,
    prune_mask,
    rank_within_groups,
    setting_name,
)
from memprune.prune.scoring import KeptBullet, MemoryPruner, group_keys_of, score_and_embed, score_texts
from memprune.prune.split import restore_bullets, write_split
from memprune.prune.store import list_store_files, open_store, plan_store, read_pruned

_STAGE = {"run": "run", "run_prune": "run", "check_scorer": "check_scorer"}


def __getattr__(name: str):  # the stage (and the torch it loads) only when asked for: Ray Data's read, decide
    if name in _STAGE:          # and write tasks import this package and need none of it
        from memprune.prune import stage

        return getattr(stage, _STAGE[name])
    raise AttributeError(f"module 'memprune.prune' has no attribute {name!r}")

__all__ = [
    "GROUP_KEYS",
    "check_scorer",
    "REASONS",
    "Decision",
    "Retention",
    "Usage",
    "parse_duration",
    "read_usage",
    "retention_factor",
    "apply_policy",
    "decide_policy",
    "find_duplicates",
    "normalize_text",
    "restore_bullets",
    "score_and_embed",
    "write_split",
    "KeptBullet",
    "MemoryPruner",
    "PruneConfig",
    "PruneError",
    "PruneRule",
    "PruneSettings",
    "group_codes",
    "group_keys_of",
    "list_store_files",
    "open_store",
    "plan_store",
    "prune_mask",
    "rank_within_groups",
    "read_pruned",
    "run",
    "run_prune",
    "score_texts",
    "setting_name",
]
