"""The paper's rule through the decision: threshold, then top-k per session, with deterministic tie-breaking."""

from __future__ import annotations

import numpy as np
import pytest

from memprune.decision import Bullets, PruneError, PruneRule, decide, group_codes, rank_within_groups

SCORES = [0.9, 0.4, 0.7, 0.7, 0.6]
GROUPS = ["a", "a", "a", "a", "b"]


def keep(scores, groups, threshold=0.5, top_k=5, order=None) -> list[bool]:
    """The paper's rule alone (no min-keep, no duplicate merging)."""
    rule = PruneRule.of(threshold=threshold, top_k=top_k, min_keep=0, dedup=False)
    return decide(Bullets.of(scores, groups, order=order), rule).keep.tolist()


def test_threshold_then_top_k_with_ties_by_position():
    # a: 0.9 and the tied 0.7s pass the threshold; top-2 takes 0.9 and the earlier 0.7
    assert keep(SCORES, GROUPS, 0.5, 2) == [True, False, True, False, True]


def test_ties_follow_order_when_given():
    assert keep(SCORES, GROUPS, 0.5, 2, order=np.array([0, 1, 5, 4, 0])) == [True, False, False, True, True]


def test_threshold_only_top_k_only_and_neither():
    assert keep(SCORES, GROUPS, 0.65, None) == [True, False, True, True, False]
    assert keep(SCORES, GROUPS, None, 1) == [True, False, False, False, True]
    assert all(keep(SCORES, GROUPS, None, None))
    assert keep(SCORES, GROUPS, 0.7, None) == [True, False, True, True, False]  # >= keeps 0.7


def test_composite_and_interleaved_groups():
    groups = [("c1", 1), ("c1", 2), ("c1", 1), ("c1", 2)]
    assert keep([0.6, 0.8, 0.9, 0.7], groups, 0.5, 1) == [False, True, True, False]
    assert group_codes(groups).tolist() == [0, 1, 0, 1]
    assert group_codes(np.array([3, 1, 3])).tolist() == [1, 0, 1]


def test_rank_within_groups():
    ranks = rank_within_groups(np.array([0.2, 0.5, 0.5, 0.1]), np.array([0, 0, 0, 1]))
    assert ranks.tolist() == [2, 0, 1, 0]


def test_bad_input_raises():
    with pytest.raises(ValueError, match="NaN"):
        keep([0.5, float("nan")], ["a", "a"])
    with pytest.raises(ValueError, match="differ in length"):
        Bullets.of([0.5, 0.6], ["a"])
    with pytest.raises(PruneError, match="top_k"):
        keep([0.5], ["a"], top_k=0)


def test_empty_input():
    assert keep([], [], 0.5, 5) == []
