"""Every metric against a hand-computed value, including the edge cases (ties, tiny sessions, no relevant)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import ndcg_score

from memprune.evaluate import metrics as M

# ---------------------------------------------------------------- global regression

# errors y - y_hat = (-0.25, 0, 0.25, 0.5)
Y = [0.0, 0.5, 1.0, 0.5]
S = [0.25, 0.5, 0.75, 0.0]


def test_regression_hand_values():
    assert M.mse(Y, S) == pytest.approx((0.0625 + 0 + 0.0625 + 0.25) / 4)  # 0.09375
    assert M.mae(Y, S) == pytest.approx((0.25 + 0 + 0.25 + 0.5) / 4)  # 0.25
    assert M.rmse(Y, S) == pytest.approx(math.sqrt(0.09375))
    # Pearson: cov = 0.25, sum dy^2 = 0.5, sum ds^2 = 0.3125 -> 0.25 / sqrt(0.15625) = sqrt(0.4)
    assert M.pearson(Y, S) == pytest.approx(math.sqrt(0.4))
    # Spearman on average ranks y (1, 2.5, 4, 2.5), s (2, 3, 4, 1): 3 / sqrt(4.5 * 5) = sqrt(0.4)
    assert M.spearman(Y, S) == pytest.approx(math.sqrt(0.4))
    assert M.regression_metrics(Y, S) == pytest.approx(
        {"mse": 0.09375, "mae": 0.25, "rmse": math.sqrt(0.09375), "pearson": math.sqrt(0.4), "spearman": math.sqrt(0.4)}
    )


def test_regression_edge_cases():
    assert math.isnan(M.mse([], []))
    assert math.isnan(M.rmse([], []))
    assert math.isnan(M.pearson([0.5], [0.5]))  # fewer than 2 bullets
    assert math.isnan(M.pearson([0.1, 0.9], [0.3, 0.3]))  # constant scores
    assert math.isnan(M.spearman([0.4, 0.4, 0.4], [0.1, 0.2, 0.3]))  # constant labels
    assert M.mse([1.0], [0.0]) == 1.0
    with pytest.raises(ValueError, match="differ in length"):
        M.mse([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="finite"):
        M.mae([0.1, float("nan")], [0.1, 0.2])


# ---------------------------------------------------------------- one session, no ties

# labels (1.0, 0.5, 0.0), scores (0.2, 0.9, 0.5): predicted order b1, b2, b0
LA = [1.0, 0.5, 0.0]
SA = [0.2, 0.9, 0.5]
LOG3 = math.log2(3)


def test_session_metrics_hand_values():
    # ranks y (3, 2, 1), s (1, 3, 2): cov -1, variances 2 -> -0.5
    assert M.session_spearman(LA, SA) == pytest.approx(-0.5)
    assert M.ndcg_at_k(LA, SA, 1) == pytest.approx(0.5)  # gain of b1 / gain of b0
    # DCG@3 = 0.5 + 0/log2(3) + 1/log2(4) = 1.0; IDCG@3 = 1 + 0.5/log2(3)
    assert M.ndcg_at_k(LA, SA, 3) == pytest.approx(1.0 / (1 + 0.5 / LOG3))
    assert M.ndcg_at_k(LA, SA, 5) == pytest.approx(M.ndcg_at_k(LA, SA, 3))  # k >= n: whole session
    assert M.hit_at_k(LA, SA, 1) == 0.0
    assert M.hit_at_k(LA, SA, 2) == 0.0
    assert M.hit_at_k(LA, SA, 3) == 1.0
    # relevant (>= 0.5): b0, b1
    assert M.precision_at_k(LA, SA, 1) == 1.0
    assert M.precision_at_k(LA, SA, 3) == pytest.approx(2 / 3)
    assert M.precision_at_k(LA, SA, 5) == pytest.approx(2 / 3)  # divided by min(k, n) = 3
    assert M.recall_at_k(LA, SA, 1) == pytest.approx(0.5)
    assert M.recall_at_k(LA, SA, 3) == 1.0
    assert M.precision_at_k(LA, SA, 1, threshold=0.9) == 0.0  # only b0 is relevant now
    assert M.recall_at_k(LA, SA, 3, threshold=0.9) == 1.0


# ---------------------------------------------------------------- ties in the scores

# labels (1, 0, 0, 0.5), scores (0.5, 0.5, 0.5, 0.1): b0..b2 tied at the top
LT = [1.0, 0.0, 0.0, 0.5]
ST = [0.5, 0.5, 0.5, 0.1]


def test_ties_are_an_expectation_over_random_order():
    # Hit@1: one of 3 tied slots is the top bullet -> 1 - C(2,1)/C(3,1) = 1/3; Hit@2: 1 - C(2,2)/C(3,2) = 2/3
    assert M.hit_at_k(LT, ST, 1) == pytest.approx(1 / 3)
    assert M.hit_at_k(LT, ST, 2) == pytest.approx(2 / 3)
    assert M.hit_at_k(LT, ST, 3) == 1.0
    # relevant: b0 (tied) and b3 (last). E[rel in top 1] = 1/3, in top 2 = 2/3
    assert M.precision_at_k(LT, ST, 1) == pytest.approx(1 / 3)
    assert M.precision_at_k(LT, ST, 2) == pytest.approx(1 / 3)
    assert M.recall_at_k(LT, ST, 2) == pytest.approx(1 / 3)
    assert M.precision_at_k(LT, ST, 4) == pytest.approx(0.5)
    assert M.expected_in_top_k([True, False, False, True], ST, 2) == pytest.approx(2 / 3)
    # NDCG: the tied group shows its mean gain 1/3 on every position it spans
    assert M.ndcg_at_k(LT, ST, 1) == pytest.approx(1 / 3)
    assert M.ndcg_at_k(LT, ST, 2) == pytest.approx((1 / 3) * (1 + 1 / LOG3) / (1 + 0.5 / LOG3))
    # Spearman with average ranks: y (4, 1.5, 1.5, 3), s (3, 3, 3, 1) -> -1 / sqrt(4.5 * 3)
    assert M.session_spearman(LT, ST) == pytest.approx(-1 / math.sqrt(13.5))


def test_results_do_not_depend_on_bullet_order():
    perm = [3, 1, 0, 2]
    lt, st = np.array(LT)[perm], np.array(ST)[perm]
    for k in (1, 2, 3):
        assert M.hit_at_k(lt, st, k) == pytest.approx(M.hit_at_k(LT, ST, k))
        assert M.ndcg_at_k(lt, st, k) == pytest.approx(M.ndcg_at_k(LT, ST, k))
        assert M.precision_at_k(lt, st, k) == pytest.approx(M.precision_at_k(LT, ST, k))


def test_label_ties_all_count_as_top():
    # two bullets share the maximum label; the model ranks one of them first
    assert M.hit_at_k([1.0, 1.0, 0.0], [0.1, 0.9, 0.5], 1) == 1.0
    assert M.hit_at_k([1.0, 1.0, 0.0], [0.1, 0.2, 0.5], 1) == 0.0


# ---------------------------------------------------------------- undefined sessions


def test_single_bullet_session_is_undefined_for_every_ranking_metric():
    for f in (M.session_spearman, lambda y, s: M.ndcg_at_k(y, s, 1), lambda y, s: M.hit_at_k(y, s, 1),
              lambda y, s: M.precision_at_k(y, s, 1), lambda y, s: M.recall_at_k(y, s, 1)):
        assert math.isnan(f([0.9], [0.3]))


def test_constant_labels_and_all_zero_labels():
    y, s = [0.3, 0.3, 0.3], [0.1, 0.5, 0.9]
    assert math.isnan(M.session_spearman(y, s))
    assert math.isnan(M.hit_at_k(y, s, 1))
    assert M.ndcg_at_k(y, s, 2) == pytest.approx(1.0)  # every order is ideal; gains are non-zero
    assert math.isnan(M.ndcg_at_k([0.0, 0.0], [0.2, 0.1], 1))  # IDCG = 0


def test_constant_scores_give_zero_spearman():
    assert M.session_spearman([0.1, 0.9, 0.5], [0.4, 0.4, 0.4]) == 0.0


def test_no_relevant_bullet_leaves_precision_and_recall_undefined():
    y, s = [0.1, 0.3, 0.2], [0.3, 0.2, 0.1]
    assert math.isnan(M.precision_at_k(y, s, 1))
    assert math.isnan(M.recall_at_k(y, s, 3))
    assert M.precision_at_k(y, s, 1, threshold=0.3) == 0.0  # b1 relevant at 0.3 but ranked second
    assert M.recall_at_k(y, s, 2, threshold=0.3) == 1.0


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="non-negative"):
        M.ndcg_at_k([-0.1, 0.5], [0.1, 0.2], 1)
    with pytest.raises(ValueError, match="k must be"):
        M.ndcg_at_k([0.1, 0.5], [0.1, 0.2], 0)


# ---------------------------------------------------------------- library equivalence


def test_ndcg_equals_scikit_learn_with_ties():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(300):
        n = int(rng.integers(2, 9))
        y = rng.integers(0, 3, n) / 2
        s = rng.integers(0, 4, n) / 3  # many ties
        k = int(rng.integers(1, 7))
        if y.sum() == 0:
            continue
        assert M.ndcg_at_k(y, s, k) == pytest.approx(ndcg_score([y], [s], k=k), abs=1e-12)
        checked += 1
    assert checked > 200


def test_batched_spearman_equals_scipy():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, (50, 5)) / 2
    s = rng.integers(0, 4, (50, 5)) / 3
    rows = M.session_spearman_rows(y, s)
    for i in range(50):
        expected = M.session_spearman(y[i], s[i])
        if math.isnan(expected):
            assert math.isnan(rows[i])
        else:
            assert rows[i] == pytest.approx(expected)
            if len(set(s[i])) > 1:
                assert rows[i] == pytest.approx(stats.spearmanr(y[i], s[i]).statistic)


# ---------------------------------------------------------------- many sessions


def test_per_session_and_summary_counts():
    labels = [*LA, *LT, 0.9, 0.3, 0.3, 0.1, 0.2]
    scores = [*SA, *ST, 0.5, 0.1, 0.2, 0.2, 0.1]
    groups = ["A"] * 3 + ["B"] * 4 + ["C"] + ["D"] * 2 + ["E"] * 2
    # C: one bullet; D: constant labels 0.3 (none relevant); E: labels (0.1, 0.2), none relevant
    frame = M.per_session_metrics(labels, scores, groups, ks=(1, 3))
    assert list(frame.index) == ["A", "B", "C", "D", "E"]
    assert frame.loc["A", "spearman"] == pytest.approx(-0.5)
    assert frame.loc["B", "hit@1"] == pytest.approx(1 / 3)
    assert frame.loc["A", "mse"] == pytest.approx(np.mean((np.array(LA) - np.array(SA)) ** 2))
    assert math.isnan(frame.loc["C", "ndcg@1"]) and frame.loc["C", "mse"] == pytest.approx(0.16)
    summary = M.summarize_sessions(frame, ks=(1, 3))
    assert summary["spearman"]["n_sessions"] == 3  # A, B, E
    assert summary["spearman"]["excluded_by"] == {"fewer_than_2_bullets": 1, "constant_labels": 1}
    assert summary["spearman"]["mean"] == pytest.approx((-0.5 - 1 / math.sqrt(13.5) - 1.0) / 3)  # E: rho = -1
    assert summary["ndcg@1"]["n_sessions"] == 4
    assert summary["precision@1"]["n_sessions"] == 2
    assert summary["precision@1"]["excluded_by"] == {"fewer_than_2_bullets": 1, "no_relevant_bullet": 2}
    assert summary["precision@1"]["mean"] == pytest.approx((1.0 + 1 / 3) / 2)


def test_interleaved_groups_and_empty_input():
    frame = M.per_session_metrics([1.0, 0.0, 0.0, 1.0], [0.9, 0.3, 0.8, 0.2], ["x", "y", "x", "y"], ks=(1,))
    assert frame.loc["x", "hit@1"] == 1.0 and frame.loc["y", "hit@1"] == 0.0
    empty = M.per_session_metrics([], [], [], ks=(1,))
    assert empty.empty and "hit@1" in empty.columns
    assert M.summarize_sessions(empty, ks=(1,))["hit@1"]["n_sessions"] == 0
