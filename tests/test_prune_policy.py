"""The pruning decision as pure functions: duplicates, floor, the three policies, min-keep and reasons."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memprune.decision import (
    Bullets,
    PruneError,
    PruneRule,
    decide,
    find_duplicates,
    group_codes,
    normalize_text,
    rank_within_groups,
)


def _rule(**kw) -> PruneRule:
    return PruneRule.of(**{"dedup": False, **kw})


def _decide(scores, codes, rule, **given):
    return decide(Bullets.of(scores, codes, **given), rule)


def _dups(scores, codes, texts, emb, threshold):
    return find_duplicates(Bullets.of(scores, codes, texts=texts, embeddings=emb), threshold)


def test_rule_policy_is_the_papers_rule_with_reasons():
    scores = np.array([0.9, 0.2, 0.7, 0.7, 0.6, 0.8, 0.1])
    codes = np.array([0, 0, 0, 0, 0, 1, 1])
    d = _decide(scores, codes, _rule(threshold=0.5, top_k=2))
    assert d.keep.tolist() == [True, False, True, False, False, True, False]
    assert d.reason.tolist() == [None, "below_threshold", None, "over_top_k", "over_top_k", None, "below_threshold"]
    assert d.duplicate_of.tolist() == [-1] * 7 and not d.rescued.any()


def test_fraction_keeps_ceil_q_n_and_floor_comes_first():
    scores = np.array([0.1, 0.5, 0.9, 0.3, 0.8, 0.2, 0.4, 0.6, 0.7, 0.05])
    codes = np.zeros(10, dtype=np.int64)
    d = _decide(scores, codes, _rule(policy="fraction", fraction=0.7))
    assert d.keep.sum() == 7  # ceil(0.7 * 10) is 7, not 8 (float noise)
    assert set(np.flatnonzero(~d.keep)) == {0, 5, 9} and set(d.reason[~d.keep]) == {"over_top_k"}
    d = _decide(scores, codes, _rule(policy="fraction", fraction=0.7, floor=0.35))
    assert d.reason[[0, 3, 5, 9]].tolist() == ["below_floor"] * 4
    assert d.keep.sum() == 5  # ceil(0.7 * 6) of the 6 bullets above the floor


def test_min_keep_rescues_the_best_and_wins_over_threshold_floor_and_budget():
    scores = np.array([0.3, 0.4, 0.1, 0.9, 0.2])
    codes = np.array([0, 0, 0, 1, 1])
    d = _decide(scores, codes, _rule(threshold=0.5, min_keep=1))
    assert d.keep.tolist() == [False, True, False, True, False] and d.rescued.tolist() == [False, True, False, False, False]
    assert d.reason.tolist() == ["below_threshold", None, "below_threshold", None, "below_threshold"]
    d = _decide(scores, codes, _rule(policy="budget", budget_tokens=3, min_keep=2, floor=0.35),
                tokens=np.array([5, 5, 5, 1, 1]))
    assert d.keep.tolist() == [True, True, False, True, True]


def test_budget_prefix_and_reason():
    scores = np.array([0.9, 0.8, 0.7, 0.6])
    d = _decide(scores, np.zeros(4, dtype=np.int64), _rule(policy="budget", budget_tokens=10),
                tokens=np.array([4, 7, 2, 1]))
    # best first while the running total stays within 10: 4 fits, +7 does not, so the group stops there
    assert d.keep.tolist() == [True, False, False, False] and d.reason[1:].tolist() == ["over_budget"] * 3
    # a prefix that fills B exactly is kept whole (the bound is <= B, not < B, nor a fraction of B)
    d = _decide(scores, np.zeros(4, dtype=np.int64), _rule(policy="budget", budget_tokens=10),
                tokens=np.array([4, 6, 1, 0]))
    assert d.keep.tolist() == [True, True, False, False] and d.reason[2:].tolist() == ["over_budget"] * 2
    with pytest.raises(ValueError, match="token count"):
        _decide(scores, np.zeros(4, dtype=np.int64), _rule(policy="budget", budget_tokens=10))


def test_config_names_and_checks():
    assert _rule().name == "t0.5_k5" and _rule(policy="budget", budget_tokens=120).name == "budget120"
    assert _rule(policy="fraction", fraction=0.4).name == "fraction0.4"
    for bad in ({"policy": "budget"}, {"policy": "fraction"}, {"fraction": 1.5}, {"min_keep": -1}, {"floor": 2},
                {"dedup_threshold": 0}, {"policy": "knapsack"}, {"policy": "budget", "budget_tokens": 10, "fraction": 0.5},
                {"policy": "budget", "budget_tokens": 10, "threshold": 0.5}, {"budget_tokens": 10, "top_k": 3},
                {"policy": "rule", "budget_tokens": 10}):
        with pytest.raises(PruneError):
            PruneRule.of(**bad)
    # a policy's own setting names it (the CLI's --budget-tokens and YAML's budget_tokens alike)
    assert PruneRule.of(budget_tokens=10).policy.name == "budget" and PruneRule.of(fraction=0.5).name == "fraction0.5"
    with pytest.raises(PruneError, match="threshold is a setting of policy 'rule', but the policy is 'budget'"):
        PruneRule.of(budget_tokens=10, threshold=0.5)
    # flat in and flat out: the dump validates back to the same rule
    rule = PruneRule.of(policy="budget", budget_tokens=12, min_keep=2)
    assert rule.model_dump()["budget_tokens"] == 12 and PruneRule.of(**rule.model_dump()) == rule
    assert [r.name for r in _rule(top_k=3).variants([1, 3, 5])] == ["t0.5_k3", "t0.5_k1", "t0.5_k5", "t0.5_kall"]
    assert [r.name for r in _rule(policy="budget", budget_tokens=9).variants([1, 3])] == ["budget9"]


def test_duplicates_exact_and_near_transitive_within_groups():
    texts = ["Ann has a cat.", "ann has a CAT!", "Bob likes jazz", "x", "y", "z", "Ann has a cat."]
    codes = np.array([0, 0, 0, 1, 1, 1, 2])
    scores = np.array([0.2, 0.6, 0.5, 0.1, 0.3, 0.2, 0.9])
    emb = np.array([[1, 0, 0], [1, 0, 0], [0, 1, 0], [1, 0, 0], [0.8, 0.6, 0], [0.28, 0.96, 0], [1, 0, 0]], dtype=np.float32)
    assert normalize_text("  Ann  HAS a cat! ") == "ann has a cat"
    # text only: 0 and 1 (same normalised text); 6 is in another group
    assert _dups(scores, codes, texts, None, None).tolist() == [1, -1, -1, -1, -1, -1, -1]
    # cosine 0.9: x~y (0.8), y~z (0.96·0.6+0.28·0.8=0.8): none; at 0.75 x-y-z chain transitively, x-z is only 0.28
    assert _dups(scores, codes, None, emb, 0.75).tolist() == [1, -1, -1, 4, -1, 4, -1]
    d = _decide(scores, codes, PruneRule.of(top_k=None, threshold=None, dedup_threshold=0.75), texts=texts,
                embeddings=emb)
    assert d.reason.tolist() == ["duplicate", None, None, "duplicate", None, "duplicate", None]
    assert _dups(np.array([0.5, 0.4]), np.zeros(2, dtype=np.int64), ["?!", "..."], None, None).tolist() == [-1, -1]
    # ties in score: the earlier bullet represents the cluster
    assert _dups(np.array([0.5, 0.5]), np.zeros(2, dtype=np.int64), ["a", "A"], None, None).tolist() == [-1, 0]


@st.composite
def stores(draw):
    n = draw(st.integers(0, 60))
    codes = np.array(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)), dtype=np.int64)
    scores = np.array(draw(st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.5, 0.75, 0.9, 1.0]), min_size=n, max_size=n)))
    tokens = np.array(draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)), dtype=np.int64)
    dups = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))  # equal texts within a group: duplicates
    texts = [f"t{c}-{d}" if d else f"u{i}" for i, (c, d) in enumerate(zip(codes, dups))]
    return codes, scores, tokens, texts


@settings(max_examples=300, deadline=None)
@given(stores(), st.integers(0, 120), st.integers(0, 3), st.sampled_from([None, 0.3]), st.booleans())
def test_budget_never_exceeds_b_in_any_group(store, budget, min_keep, floor, dedup):
    codes, scores, tokens, texts = store
    rule = PruneRule.of(policy="budget", budget_tokens=budget, min_keep=min_keep, floor=floor, dedup=dedup)
    d = _decide(scores, codes, rule, tokens=tokens, texts=texts)
    n_groups = int(codes.max()) + 1 if len(codes) else 0
    kept = d.keep & ~d.rescued
    spent = np.bincount(codes[kept], weights=tokens[kept], minlength=n_groups)
    assert (spent <= budget).all()  # never over B, except what min-keep alone brought back
    # ... and as much as B allows: the policy kept a prefix of the ranking of the bullets it ranked, and the
    # next-ranked one (gone over budget, or back only through min-keep) would have overflowed B
    ranked = (d.duplicate_of < 0) & (scores >= (-np.inf if floor is None else floor))  # min-keep clears reasons
    policy_rank = rank_within_groups(np.where(ranked, scores, -np.inf), group_codes(codes))
    for g in np.unique(codes):
        mine = codes == g
        passed = np.flatnonzero(mine & ranked & ~kept)
        if not len(passed):
            continue
        assert policy_rank[mine & kept].max(initial=-1) < policy_rank[passed].min()  # a prefix
        nxt = passed[np.argmin(policy_rank[passed])]
        assert spent[g] + tokens[nxt] > budget, (g, spent[g], tokens[nxt], budget)
    rank = rank_within_groups(np.where(d.duplicate_of >= 0, -np.inf, scores), group_codes(codes))
    assert (d.rescued <= (rank < min_keep)).all()
    if min_keep == 0:
        assert not d.rescued.any()
    # every bullet is kept or has exactly one reason; duplicates point at a kept-or-ranked member of their group
    assert ((d.reason == None) == d.keep).all()  # noqa: E711
    dup = d.duplicate_of >= 0
    assert (codes[d.duplicate_of[dup]] == codes[dup]).all() and (d.duplicate_of[d.duplicate_of[dup]] == -1).all()
    # min-keep: no group with bullets ends up with fewer than min(m, its distinct bullets)
    distinct = np.bincount(codes[~dup], minlength=n_groups)
    assert (np.bincount(codes[d.keep], minlength=n_groups) >= np.minimum(min_keep, distinct)).all()


def test_the_duplicate_search_of_a_huge_group_never_holds_all_its_pairs() -> None:
    """Issue 56, item 7: 12,000 near-identical bullets in one group (72 million duplicate pairs, 1.1 GB as two int64
    index arrays) are one cluster, found in bounded memory: cosines a row chunk at a time, links merged as they come."""
    import tracemalloc

    n = 12_000
    rng = np.random.default_rng(0)
    emb = rng.normal(size=384).astype(np.float32) + 0.02 * rng.normal(size=(n, 384)).astype(np.float32)
    scores = rng.random(n)
    tracemalloc.start()
    try:
        dup = _dups(scores, np.zeros(n, dtype=np.int64), None, emb, 0.88)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    best = int(np.argmax(scores))
    assert dup[best] == -1 and (np.delete(dup, best) == best).all()
    assert peak < 256 * 2**20, f"{peak / 2**20:.0f} MB"
