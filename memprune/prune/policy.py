"""The pruning decision as pure numpy: duplicates, expiry, the retention-weighted policy, min-keep; pins.

One implementation for the Ray batch job (`memprune prune`) and `MemoryPruner`, so both give the same
decisions and reasons on the same data. Within each group (session), in this order:

1. **Duplicates** (`find_duplicates`): bullets whose normalised texts are equal, or whose encoder
   embeddings have cosine similarity >= `dedup_threshold`, form clusters (transitively); one bullet
   represents a cluster (a pinned one first, then one that has not expired, then the highest
   effective score, then the earliest), the others go with reason `duplicate`.
2. **Supersession** (`rule.supersede`, `memprune.prune.supersede`): within the supersession scope (the
   conversation by default, not the group), a later representative of the same subject that the update judge
   says updates an earlier one supersedes it (`superseded`, `superseded_by`); never a pinned one, never on
   equal or unknown times. The superseding bullet then ranks with at least the effective score of each bullet
   it supersedes (`inherit`, transitively): the fact's usefulness moves to its current value.
3. **Expiry** (`retention.max_age`): representatives older than max_age go (`expired`).
4. **Floor** and **policy** over the remaining bullets, ranked by the *effective* score (the score x
   retention when `retention.half_life` is set, else the score; ties: earlier first): `below_floor`,
   then the rule's `policy.keep` (`memprune.prune.policies`: `rule` keeps score >= threshold, then the
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

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from memprune.prune.lifecycle import Life, Standing, standing
from memprune.prune.policies import POLICIES
from memprune.prune.rule import rank_within_groups
from memprune.prune.supersede import SUPERSEDED, find_superseded

if TYPE_CHECKING:
    from memprune.prune.config import PruneRule

DUPLICATE, EXPIRED, BELOW_FLOOR = "duplicate", "expired", "below_floor"


def reasons() -> tuple[str, ...]:
    """Every reason a bullet can go for: duplicates, supersession, expiry, the floor, then each registered
    policy's own."""
    own = (r for p in POLICIES.values() for r in p.reasons)
    return tuple(dict.fromkeys((DUPLICATE, SUPERSEDED, EXPIRED, BELOW_FLOOR, *own)))


REASONS = reasons()  # the built-in policies' (a policy registered later adds its own to `reasons()`)
_PUNCT = re.compile(r"[^\w\s]+")
_SPACE = re.compile(r"\s+")


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


def normalize_text(text: str) -> str:
    """The text compared for exact duplicates: NFKC, case-folded, punctuation dropped, spaces collapsed."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return _SPACE.sub(" ", _PUNCT.sub(" ", text)).strip()


def _order(n: int, order: np.ndarray | None) -> np.ndarray:
    return np.arange(n) if order is None else np.asarray(order)


def unify_equal_texts(
    scores: np.ndarray, codes: np.ndarray, texts: Sequence[str], embeddings: np.ndarray | None = None,
    order: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Give equal texts of a group the score (and embedding) of their earliest copy.

    In-process and inside one block equal texts already score exactly equal (each distinct text is
    scored once); the batch job's shuffle path scores a group's rows in different blocks, where
    batch padding moves the last bits. Unifying makes ties, and so the decision, the same everywhere.
    """
    n = len(scores)
    if n < 2:
        return scores, embeddings
    ordr = _order(n, order)
    first: dict[tuple[int, str], int] = {}
    for i in np.argsort(ordr, kind="stable"):
        first.setdefault((int(codes[i]), texts[i]), int(i))
    src = np.fromiter((first[(int(c), t)] for c, t in zip(codes, texts)), dtype=np.int64, count=n)
    if (src == np.arange(n)).all():
        return scores, embeddings
    return np.asarray(scores)[src], None if embeddings is None else np.asarray(embeddings)[src]


# Similarity cells computed at once (a row chunk x its group) and links held before they are merged: they bound the
# memory of a duplicate search whatever the group's size (2x10^4 near-identical bullets in one group: 204 MB at peak).
SIM_CELLS = 1 << 20
PENDING_LINKS = 1 << 20


def _merge(labels: np.ndarray, a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """`labels` (a component label per bullet, in 0..n-1) after linking the labels `a[k]` with `b[k]`."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    n = len(labels)
    r, c = np.concatenate(a), np.concatenate(b)
    graph = coo_matrix((np.ones(len(r), dtype=np.int8), (r, c)), shape=(n, n))
    return connected_components(graph, directed=False)[1][labels]


def find_duplicates(
    scores: np.ndarray, codes: np.ndarray, texts: Sequence[str] | None, embeddings: np.ndarray | None,
    threshold: float | None, order: np.ndarray | None = None, priority: np.ndarray | None = None,
) -> np.ndarray:
    """Index of each bullet's cluster representative (-1 for a representative or a singleton).

    Clusters are connected components, within a group, of "same normalised text" (when `texts`
    are given) or "cosine >= threshold" (when `embeddings` and a threshold are given); the
    representative is the member of highest `priority` (`Standing.priority`: pinned, then not
    expired), then highest score, ties broken by `order`/position. The cosines are computed a row chunk at
    a time (`SIM_CELLS`) and their links merged into component labels as they come (`PENDING_LINKS`), so a
    group of near-identical bullets never holds all its pairs.
    """
    n = len(scores)
    dup_of = np.full(n, -1, dtype=np.int64)
    if n < 2 or (texts is None and (embeddings is None or threshold is None)):
        return dup_of
    labels = np.arange(n)
    a: list[np.ndarray] = []
    b: list[np.ndarray] = []
    pending = 0
    if texts is not None:  # exact duplicates: same (group, normalised text) -> link to the first seen
        first: dict[tuple[int, str], int] = {}
        # a text with nothing left after normalisation (e.g. "?!") is only equal to itself
        f = np.fromiter((first.setdefault((int(c), normalize_text(t) or t), i) for i, (c, t) in enumerate(zip(codes, texts))),
                        dtype=np.int64, count=n)
        linked = np.flatnonzero(f != np.arange(n))
        a.append(linked)
        b.append(f[linked])
        pending += len(linked)
    if embeddings is not None and threshold is not None:
        emb = np.asarray(embeddings, dtype=np.float32)
        if emb.shape[0] != n:
            raise ValueError(f"embeddings ({emb.shape[0]}) and scores ({n}) differ in length")
        norms = np.linalg.norm(emb, axis=1, keepdims=True)
        emb = emb / np.maximum(norms, 1e-12)
        by_group = np.argsort(codes, kind="stable")
        bounds = np.flatnonzero(np.diff(codes[by_group])) + 1
        for idx in np.split(by_group, bounds):
            if len(idx) < 2:
                continue
            step = max(1, min(1024, SIM_CELLS // len(idx)))
            for lo in range(0, len(idx), step):
                i, j = np.nonzero(emb[idx[lo:lo + step]] @ emb[idx].T >= threshold)
                la, lb = labels[idx[lo + i]], labels[idx[j]]
                new = la != lb  # only pairs not yet in one component
                a.append(la[new])
                b.append(lb[new])
                pending += int(new.sum())
                if pending > PENDING_LINKS:
                    labels, a, b, pending = _merge(labels, a, b), [], [], 0
    if pending:
        labels = _merge(labels, a, b)
    if (labels == np.arange(n)).all():
        return dup_of
    comp = labels
    prio = np.zeros(n, dtype=np.int64) if priority is None else np.asarray(priority, dtype=np.int64)
    rank = np.lexsort((_order(n, order), -np.asarray(scores, dtype=np.float64), -prio, comp))
    sorted_comp = comp[rank]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_comp)) + 1]
    rep_of_comp = np.empty(comp.max() + 1, dtype=np.int64)
    rep_of_comp[sorted_comp[starts]] = rank[starts]
    rep = rep_of_comp[comp]
    dup_of[rep != np.arange(n)] = rep[rep != np.arange(n)]
    return dup_of


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


def apply_policy(
    scores: np.ndarray, codes: np.ndarray, rule: "PruneRule", tokens: np.ndarray | None = None,
    duplicate_of: np.ndarray | None = None, order: np.ndarray | None = None, stand: Standing | None = None,
    superseded_by: np.ndarray | None = None,
) -> Decision:
    """The decision of `rule` (expiry, floor, policy, min-keep, pins) for bullets whose duplicates (and, with
    supersession, `superseded_by`: `find_superseded`) are known.

    `stand` (`lifecycle.standing`) gives the effective scores, the expired and the pinned bullets;
    without it the scores are ranked as they are and nothing is pinned or expired. Min-keep counts a
    group's kept *non-pinned* bullets: it brings back the best non-duplicate, non-expired, non-pinned ones
    until there are m of them (or none is left); pinned bullets are kept on top of that.
    """
    s = np.asarray(scores, dtype=np.float64)
    n = len(s)
    if np.isnan(s).any():
        raise ValueError(f"{int(np.isnan(s).sum())} NaN score(s): clean the scores before pruning")
    st = stand or Standing(s, None, np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool))
    e, pinned = st.effective, st.pinned
    dup = np.zeros(n, dtype=bool) if duplicate_of is None else np.asarray(duplicate_of) >= 0
    ordr = _order(n, order)
    reason = np.full(n, None, dtype=object)
    reason[dup] = DUPLICATE
    sup = np.zeros(n, dtype=bool) if superseded_by is None else ~dup & ~pinned & (np.asarray(superseded_by) >= 0)
    reason[sup] = SUPERSEDED
    if sup.any():
        e = inherit(e, np.asarray(superseded_by), sup)
    gone = dup | sup  # merged or outdated: never ranked, never rescued
    expired = ~gone & ~pinned & st.expired
    reason[expired] = EXPIRED
    active = ~gone & ~expired & ~pinned
    if rule.floor is not None:
        low = active & (e < rule.floor)
        reason[low] = BELOW_FLOOR
        active &= ~low
    rank = rank_within_groups(np.where(active, e, -np.inf), codes, ordr)
    keep = rule.policy.keep(e, active, rank, codes, tokens, reason)
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
        unpinned = apply_policy(s, codes, rule, tokens, duplicate_of, order, st.unpinned(), superseded_by)
        protected = pinned & ~unpinned.keep
        keep = keep | pinned
        reason[pinned] = None
    dup_kept = dup & ~pinned
    return Decision(keep, reason, np.where(dup_kept, np.asarray(duplicate_of if duplicate_of is not None else -1), -1),
                    rescued, pinned, protected, st.effective if st.retention is not None else None, st.retention,
                    None if superseded_by is None else np.where(sup, superseded_by, -1))


def decide_policy(
    scores: np.ndarray, codes: np.ndarray, rule: "PruneRule", tokens: np.ndarray | None = None,
    texts: Sequence[str] | None = None, embeddings: np.ndarray | None = None, order: np.ndarray | None = None,
    life: Life | None = None, encode: Any = None,
) -> Decision:
    """The whole decision of `rule` for one set of whole groups (whole supersession scopes): the time steps'
    standing (`life`: pins, reference times, recalls; `rule.retention` with its `now` resolved), duplicates (if
    `rule.dedup`), supersession (`superseded`; `encode`: the scorer's encoder, for judges that need it), then
    `apply_policy`."""
    stand = standing(scores, rule.retention, life)
    dup = None
    if rule.dedup:
        dup = find_duplicates(stand.effective, codes, texts, embeddings, rule.dedup_threshold, order, stand.priority)
    sup, judged = superseded(rule, life, stand, texts, embeddings, dup, encode)
    return replace(apply_policy(scores, codes, rule, tokens, dup, order, stand, sup), judged=judged)


def superseded(rule: "PruneRule", life: Life | None, stand: Standing, texts: Sequence[str] | None,
               embeddings: np.ndarray | None, duplicate_of: np.ndarray | None, encode: Any = None
               ) -> tuple[np.ndarray | None, dict[str, int] | None]:
    """`find_superseded` with the rule's settings and `life`'s scope, subject and times: (superseded_by, the judge's
    counts); (None, None) with supersession off."""
    if not rule.supersede.on:
        return None, None
    if life is None or life.scope is None or texts is None:
        raise ValueError("supersession needs each bullet's scope, subject and time (Life) and texts")
    return find_superseded(rule.supersede, rule.supersede.band(rule.dedup_threshold), life.scope, life.subject or [],
                           life.when, life.session, texts, embeddings, duplicate_of, stand.pinned, encode)
