"""The pruning decision, memprune's product, as a floor package: numpy and pydantic, no Ray, no files.

    from memprune.decision import Bullets, PruneRule, decide
    d = decide(Bullets.of(scores, groups, texts=texts, embeddings=emb), PruneRule.of(policy="budget", budget_tokens=120))
    d.keep, d.reason, d.duplicate_of

- `bullets`: `Bullets`, the one input (scores, groups, order, tokens, texts, embeddings, times, pins, recalls, the
  supersession scope and subject).
- `rule`: `PruneRule` (a policy and its settings, dedup, floor, min-keep, group, pins, retention, supersession; what
  it needs: `needs_tokens`, `needs_embeddings`, `needs_times`, `needs_life`), `GROUP_KEYS`, `PruneError`.
- `policies`: `POLICIES` (rule, budget, fraction; `register_policy`), `Ranking` (what a policy decides on).
- `retention`: `Retention` (forgetting, expiry), `retention_factor`, `standing`.
- `duplicates`: `find_duplicates`, `normalize_text`, `unify_equal_texts`.
- `supersede` and `updates`: `Supersede`, `find_superseded`, `UPDATE_JUDGES` (slot, llm; `register`).
- `decide`: `Decision`, `decide`, `sweep`, `prepare` / `apply` (the shared and the per-rule steps), `reasons`.
- `ranking`: `group_codes`, `rank_within_groups`, `setting_name`.
"""

from __future__ import annotations

from memprune.decision.bullets import Bullets
from memprune.decision.decide import REASONS, Decision, Found, apply, decide, prepare, reasons, sweep
from memprune.decision.duplicates import find_duplicates, normalize_text, unify_equal_texts
from memprune.decision.policies import POLICIES, Policy, Ranking, register_policy
from memprune.decision.ranking import group_codes, rank_within_groups
from memprune.decision.retention import Retention, retention_factor, standing
from memprune.decision.rule import DEDUP_THRESHOLD, GROUP_KEYS, PruneError, PruneRule, rule_label
from memprune.decision.supersede import Supersede
from memprune.decision.updates import UPDATE_JUDGES

__all__ = [
    "DEDUP_THRESHOLD", "GROUP_KEYS", "POLICIES", "REASONS", "UPDATE_JUDGES", "Bullets", "Decision", "Found", "Policy",
    "PruneError", "PruneRule", "Ranking", "Retention", "Supersede", "apply", "decide", "find_duplicates",
    "group_codes", "normalize_text", "prepare", "rank_within_groups", "reasons", "register_policy",
    "retention_factor", "rule_label", "standing", "sweep", "unify_equal_texts",
]
