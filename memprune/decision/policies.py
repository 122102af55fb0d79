"""The pruning policies: one settings model per policy, each owning its decision, its name and its words.

A policy decides which of a group's distinct bullets stay, given their ranking (best first). Every
entry of `POLICIES` is a small pydantic model (its own settings, validated once) with:

- `keep(ranking, reason)`: the kept mask of a `Ranking` (effective scores, active, rank, groups, tokens), writing
  the reason of each bullet it drops;
- `key` (`t0.5_k5`, `budget120`, `fraction0.4`): the stable name of a setting in prune.json/metrics.json;
- `label`: the short words a downstream report shows ("t=0.5, k=5", "budget 120 tokens");
- `describe(unit)`: the decision in a sentence (prune.md);
- `sweep(top_ks)`: the settings reported beside it (the paper's rule: its top-k sweep);
- `needs_tokens`: whether it needs every bullet's token count.

Adding a policy is one subclass decorated with `@register_policy`: the rule (`PruneRule`), the decision, the batch
job, `MemoryPruner`, `memprune evaluate`, prune.json and prune.md take it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from pydantic import ConfigDict, Field

from memprune.config import ConfigModel
from memprune.decision.ranking import setting_name
from memprune.registry import Registry

BELOW_THRESHOLD, OVER_TOP_K, OVER_BUDGET = "below_threshold", "over_top_k", "over_budget"


@dataclass(frozen=True)
class Ranking:
    """What a policy decides on, per bullet: the effective score, whether it still competes (`active`: not a
    duplicate, superseded, expired, below the floor or pinned), its rank among its group's active bullets (0 =
    best), the group codes, and the token counts (None unless the policy `needs_tokens`)."""

    scores: np.ndarray
    active: np.ndarray
    rank: np.ndarray
    codes: np.ndarray
    tokens: np.ndarray | None


class Policy(ConfigModel):
    """What one policy keeps of each group; subclasses add their settings and `keep`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    name: ClassVar[str]
    needs_tokens: ClassVar[bool] = False
    reasons: ClassVar[tuple[str, ...]] = ()  # the reasons `keep` writes

    def keep(self, ranking: Ranking, reason: np.ndarray) -> np.ndarray:
        """The kept mask among the ranking's active bullets; the reason of each bullet it drops goes into `reason`."""
        raise NotImplementedError

    @property
    def key(self) -> str:
        raise NotImplementedError

    @property
    def label(self) -> str:
        raise NotImplementedError

    def describe(self, unit: str) -> str:
        raise NotImplementedError

    def sweep(self, top_ks: list[int]) -> list["Policy"]:
        """The settings prune.json reports: this one first."""
        return [self]

    def groups_over(self, kept_tokens: np.ndarray) -> int:
        """Groups whose kept tokens exceed this policy's limit (only min-keep can do that); 0 without a limit."""
        return 0

    def evaluation(self, ks: tuple[int, ...], thresholds: tuple[float, ...]) -> dict[str, list["Policy"]]:
        """The settings `memprune evaluate` decides with: `table` (its main table), `sweep` (its sensitivity
        table), and lists named `sweep*` are also plotted against their threshold."""
        return {"table": [self], "sweep": []}


POLICIES: Registry[type[Policy]] = Registry("policy")


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy selectable as `rule.policy: NAME` (`--policy NAME`)."""
    return POLICIES.add(cls.name, cls)


def policy_of(name: str) -> type[Policy]:
    return POLICIES.known(name)


def owner_of(field: str) -> str | None:
    """The policy whose setting `field` is (None: no policy's)."""
    return next((n for n, c in POLICIES.items() if field in c.model_fields), None)


@register_policy
class RulePolicy(Policy):
    """The paper's rule (DESIGN step 5): drop scores below `threshold`, then keep the `top_k` best."""

    name: ClassVar[str] = "rule"
    reasons: ClassVar[tuple[str, ...]] = (BELOW_THRESHOLD, OVER_TOP_K)
    threshold: float | None = Field(0.5, ge=0.0, le=1.0,
                                    description="drop bullets scored below this (scores are in [0, 1]); null = no threshold")
    top_k: int | None = Field(5, ge=1, description="keep at most k bullets per group; null = no cap")

    def keep(self, ranking: Ranking, reason: np.ndarray) -> np.ndarray:
        keep = ranking.active.copy()
        if self.threshold is not None:
            low = ranking.active & (ranking.scores < self.threshold)
            reason[low] = BELOW_THRESHOLD
            keep &= ~low
        if self.top_k is not None:
            over = keep & (ranking.rank >= self.top_k)
            reason[over] = OVER_TOP_K
            keep &= ~over
        return keep

    @property
    def key(self) -> str:
        return setting_name(self.threshold, self.top_k)

    @property
    def label(self) -> str:
        t = "no threshold" if self.threshold is None else f"t={self.threshold:g}"
        return f"{t}, {'no cap' if self.top_k is None else f'k={self.top_k}'}"

    def describe(self, unit: str) -> str:
        k = "no cap" if self.top_k is None else f"top {self.top_k}"
        t = "no threshold" if self.threshold is None else f"score >= {self.threshold:g}"
        return f"rule (the paper's): {t}, then {k} per {unit}"

    def evaluation(self, ks: tuple[int, ...], thresholds: tuple[float, ...]) -> dict[str, list[Policy]]:
        """The paper's Table 4 (its threshold, top-k in `ks` and no cap), the threshold sweep at its cap, and
        (for the figure) the sweep without a cap."""
        return {"table": [RulePolicy(threshold=self.threshold, top_k=k) for k in (*ks, None)],
                "sweep": [RulePolicy(threshold=t, top_k=self.top_k) for t in thresholds],
                "sweep_uncapped": [RulePolicy(threshold=t, top_k=None) for t in thresholds]}

    def sweep(self, top_ks: list[int]) -> list[Policy]:
        """This rule, then `top_ks` and 'no cap' at its threshold."""
        ks = [self.top_k]
        for k in [*top_ks, None]:
            if k not in ks:
                ks.append(k)
        return [self, *(RulePolicy(threshold=self.threshold, top_k=k) for k in ks[1:])]


@register_policy
class BudgetPolicy(Policy):
    """Keep the best bullets while the group's kept tokens stay <= `budget_tokens`; the first that does not fit ends it."""

    name: ClassVar[str] = "budget"
    needs_tokens: ClassVar[bool] = True
    reasons: ClassVar[tuple[str, ...]] = (OVER_BUDGET,)
    budget_tokens: int = Field(ge=0, description="kept tokens per group never exceed this (--budget-tokens B)")

    def keep(self, ranking: Ranking, reason: np.ndarray) -> np.ndarray:
        if ranking.tokens is None:
            raise ValueError("policy 'budget' needs the token count of every bullet")
        n, active, codes = len(ranking.scores), ranking.active, ranking.codes
        t = np.where(active, np.asarray(ranking.tokens, dtype=np.int64), 0)
        idx = np.lexsort((ranking.rank, codes))
        cum = np.cumsum(t[idx])
        sc = codes[idx]
        starts = np.r_[0, np.flatnonzero(np.diff(sc)) + 1]
        before = np.repeat(np.r_[0, cum][starts], np.diff(np.r_[starts, n]))
        within = np.empty(n, dtype=bool)
        within[idx] = (cum - before) <= self.budget_tokens
        keep = active & within
        reason[active & ~keep] = OVER_BUDGET
        return keep

    def groups_over(self, kept_tokens: np.ndarray) -> int:
        return int((kept_tokens > self.budget_tokens).sum())

    @property
    def key(self) -> str:
        return f"budget{self.budget_tokens}"

    @property
    def label(self) -> str:
        return f"budget {self.budget_tokens} tokens"

    def describe(self, unit: str) -> str:
        return f"budget: the best bullets while the kept tokens stay <= {self.budget_tokens} per {unit}"


@register_policy
class FractionPolicy(Policy):
    """Keep the top ceil(`fraction` * n) of the group's n distinct bullets."""

    name: ClassVar[str] = "fraction"
    reasons: ClassVar[tuple[str, ...]] = (OVER_TOP_K,)
    fraction: float = Field(gt=0.0, le=1.0, description="keep the top ceil(q * n) of each group (--fraction q)")

    def keep(self, ranking: Ranking, reason: np.ndarray) -> np.ndarray:
        codes, active = ranking.codes, ranking.active
        n_groups = int(codes.max()) + 1 if len(codes) else 0
        distinct = np.bincount(codes[active], minlength=n_groups)
        k = np.ceil(self.fraction * distinct - 1e-9).astype(np.int64)
        keep = active & (ranking.rank < k[codes])
        reason[active & ~keep] = OVER_TOP_K
        return keep

    @property
    def key(self) -> str:
        return f"fraction{self.fraction:g}"

    @property
    def label(self) -> str:
        return f"fraction {self.fraction:g}"

    def describe(self, unit: str) -> str:
        return f"fraction: the top ceil({self.fraction:g} x n) bullets of each {unit}"
