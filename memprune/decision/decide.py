"""The pruning decision as pure numpy: `decide(bullets, rule) -> Decision` and `sweep(bullets, rules)`.

One implementation for the Ray batch job (`memprune prune`), `MemoryPruner`, every store, the service and the
evaluations, so all give the same decisions and reasons on the same `Bullets`. The steps every rule of a sweep
shares (the time steps' standing, duplicates, supersession: `prepare` -> `Found`) run once; each rule's own steps
(`apply`) after. Within each group (session), in this order:

1. **Duplicates** (`find_duplicates`): bullets whose normalised texts are equal, or whose encoder
   embeddings have cosine similarity >= `dedup_threshold`, form clusters (transitively); one bullet
   represents a cluster (a pinned one first, then one that has not expired, then the highest
   effective score, then the earliest), the others go with reason `duplicate`.
2. **Supersession** (`rule.supersede`, `memprune.decision.supersede`): within the supersession scope (the
   conversation by default, not the group), a later representative of the same subject that the update judge
   says updates an earlier one supersedes it (`superseded`, `superseded_by`); never a pinned one, never on
   equal or unknown times. The superseding bullet then ranks with at least the effective score of each bullet
   it supersedes (`inherit`, transitively): the fact's usefulness moves to its current value.
3. **Expiry** (`retention.max_age`): representatives older than max_age go (`expired`).
4. **Floor** and **policy** over the remaining bullets, ranked by the *effective* score (the score x
   retention when `retention.half_life` is set, else the score; ties: earlier first): `below_floor`,
   then the rule's `policy.keep` (`memprune.decision.policies`: `rule` keeps score >= threshold, then the
   top-k (`below_threshold`, `over_top_k`); `budget` keeps the best while the group's kept tokens stay
   <= B (`over_budget`); `fraction` keeps the top ceil(q * n) of the group's n distinct bullets).
5. **Min-keep**: a group left with fewer than m kept non-pinned bullets gets its best non-duplicate,
   non-superseded, non-expired, non-pinned bullets back (whatever the floor, threshold or budget said), up to m.

**Pins** (`PruneRule.pin_field`) override every drop: a pinned bullet is kept whatever any step says,
with reason null. Pinned bullets stand outside the competition: they take no top-k slot, no budget
tokens, no share of a fraction, and do not count towards min-keep, so the other bullets are decided
exactly as if the pinned ones were absent (except that a pinned bullet represents its duplicates).
`Decision.protected` marks the pinned bullets that a step would have dropped had they not been pinned.

Every step keeps a prefix of the group's ranking of its non-pinned bullets, so the result is
deterministic and the kept set of a group is its pinned bullets plus its best distinct ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from memprune.decision.bullets import Bullets
from memprune.decision.duplicates import DUPLICATE, find_duplicates
from memprune.decision.policies import POLICIES, Ranking
from memprune.decision.ranking import rank_within_groups
from memprune.decision.retention import Standing, standing
from memprune.decision.rule import PruneRule
from memprune.decision.supersede import SUPERSEDED, find_superseded

EXPIRED, BELOW_FLOOR = "expired", "below_floor"


def reasons() -> tuple[str, ...]:
    """Every reason a bullet can go for: duplicates, supersession, expiry, the floor, then each registered
    policy's own."""
    own = (r for p in POLICIES.values() for r in p.reasons)
    return tuple(dict.fromkeys((DUPLICATE, SUPERSEDED, EXPIRED, BELOW_FLOOR, *own)))


REASONS = reasons()  # the built-in policies' (a policy registered later adds its own to `reasons()`)


@dataclass(frozen=True)
class Decision:
    """Per bullet: kept?, the reason it goes (None when kept), its cluster's representative (-1: none),
    kept only by min-keep (`rescued`); pinned, and pinned bullets a step would have dropped (`protected`);
    with retention, the effective score (score x retention) and the retention factor; with supersession the
    index of the bullet that supersedes each (-1: none) and the update judge's counts."""

    keep: np.ndarray
    reason: np.ndarray
    duplicate_of: np.ndarray
    rescued: np.ndarray
    pinned: np.ndarray | None = None
    protected: np.ndarray | None = None
    effective: np.ndarray | None = None
    retention: np.ndarray | None = None
    superseded_by: np.ndarray | None = None
    judged: dict[str, int] | None = None  # with supersession: the update judge's counts (`supersede.JUDGED`)

    def reason_counts(self) -> dict[str, int]:
        """How many bullets go for each reason (every reason listed, zeros included)."""
        return {r: int((self.reason == r).sum()) for r in reasons()}

    def pin_counts(self) -> dict[str, int]:
        """Pinned bullets (all kept) and those of them a step would have dropped (`kept_by_pin`)."""
        return {"pinned": 0 if self.pinned is None else int(self.pinned.sum()),
                "kept_by_pin": 0 if self.protected is None else int(self.protected.sum())}


@dataclass(frozen=True)
class Found:
    """What the steps every rule of a sweep shares found (the rule's pins, retention, dedup and supersession):
    the standing, each bullet's duplicate representative and superseding bullet (-1: none; None: the step is
    off), and the update judge's counts."""

    standing: Standing
    duplicate_of: np.ndarray | None = None
    superseded_by: np.ndarray | None = None
    judged: dict[str, int] | None = None


def prepare(bullets: Bullets, rule: PruneRule) -> Found:
    """The shared steps of `rule`: the time steps' standing (pins, retention with its `now` resolved, expiry),
    duplicates (if `rule.dedup`) and supersession (if on)."""
    if rule.needs_tokens and bullets.tokens is None:
        raise ValueError(f"policy {rule.policy.name!r} needs the token count of every bullet")
    if rule.supersede.on and (bullets.scope is None or bullets.texts is None):
        raise ValueError("supersession needs each bullet's scope, subject and time and its text")
    stand = standing(bullets, rule.retention)
    dup = find_duplicates(bullets, rule.dedup_threshold, stand) if rule.dedup else None
    if not rule.supersede.on:
        return Found(stand, dup)
    sup, judged = find_superseded(bullets, rule.supersede, rule.supersede.band(rule.dedup_threshold), dup,
                                  stand.pinned)
    return Found(stand, dup, sup, judged)


def inherit(e: np.ndarray, superseded_by: np.ndarray, sup: np.ndarray) -> np.ndarray:
    """The ranking scores after supersession: a bullet ranks at least as high as every bullet it supersedes,
    transitively (the fact's usefulness moves to its current value)."""
    e, a = np.array(e, dtype=np.float64), np.flatnonzero(sup)
    b = superseded_by[a]
    while True:
        before = e[b]
        np.maximum.at(e, b, e[a])
        if np.array_equal(e[b], before):
            return e


def apply(bullets: Bullets, rule: PruneRule, found: Found) -> Decision:
    """`rule`'s own steps (expiry, floor, policy, min-keep, pins) on bullets whose shared steps are `found`.

    Min-keep counts a group's kept *non-pinned* bullets: it brings back the best non-duplicate, non-expired,
    non-pinned ones until there are m of them (or none is left); pinned bullets are kept on top of that.
    """
    s, codes, st = bullets.scores, bullets.groups, found.standing
    n = len(s)
    if np.isnan(s).any():
        raise ValueError(f"{int(np.isnan(s).sum())} NaN score(s): clean the scores before pruning")
    e, pinned = st.effective, st.pinned
    dup = np.zeros(n, dtype=bool) if found.duplicate_of is None else found.duplicate_of >= 0
    ordr = np.arange(n) if bullets.order is None else np.asarray(bullets.order)
    reason = np.full(n, None, dtype=object)
    reason[dup] = DUPLICATE
    sup = np.zeros(n, dtype=bool) if found.superseded_by is None else ~dup & ~pinned & (found.superseded_by >= 0)
    reason[sup] = SUPERSEDED
    if sup.any():
        e = inherit(e, found.superseded_by, sup)
    gone = dup | sup  # merged or outdated: never ranked, never rescued
    expired = ~gone & ~pinned & st.expired
    reason[expired] = EXPIRED
    active = ~gone & ~expired & ~pinned
    if rule.floor is not None:
        low = active & (e < rule.floor)
        reason[low] = BELOW_FLOOR
        active &= ~low
    rank = rank_within_groups(np.where(active, e, -np.inf), codes, ordr)
    keep = rule.policy.keep(Ranking(e, active, rank, codes, bullets.tokens), reason)
    rescued = np.zeros(n, dtype=bool)
    if rule.min_keep:
        eligible = ~gone & ~expired & ~pinned
        best = rank_within_groups(np.where(eligible, e, -np.inf), codes, ordr) < rule.min_keep
        rescued = best & eligible & ~keep
        keep |= rescued
        reason[rescued] = None
    protected = None
    if pinned.any():
        # what the decision would have said of each pinned bullet, were it not pinned (same clusters)
        unpinned = apply(bullets, rule, replace(found, standing=st.unpinned()))
        protected = pinned & ~unpinned.keep
        keep = keep | pinned
        reason[pinned] = None
    dup_kept = dup & ~pinned
    duplicate_of = np.where(dup_kept, found.duplicate_of, -1) if found.duplicate_of is not None else np.full(n, -1)
    return Decision(keep, reason, duplicate_of, rescued, pinned, protected,
                    st.effective if st.retention is not None else None, st.retention,
                    None if found.superseded_by is None else np.where(sup, found.superseded_by, -1), found.judged)


def decide(bullets: Bullets, rule: PruneRule) -> Decision:
    """The whole decision of `rule` for `bullets` (whole groups, whole supersession scopes); ValueError naming what
    is missing or wrong. A rule with retention but no `now` must be fixed first (`rule.at(now)`)."""
    return apply(bullets, rule, prepare(bullets, rule))


def sweep(bullets: Bullets, rules: list[PruneRule]) -> list[Decision]:
    """The decision of each of `rules` (the same pins, retention, dedup and supersession as the first, different
    policies, floors or min-keep: what prune.json and `memprune evaluate` report side by side); the shared steps
    run once."""
    found = prepare(bullets, rules[0])
    return [apply(bullets, rule, found) for rule in rules]
