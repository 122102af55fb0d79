"""`memprune.calibration`: isotonic and Platt fits, Brier, ECE, model choice, calibration.json, score modes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memprune.calibration import (
    CALIBRATION_FILE,
    Calibration,
    CalibrationError,
    apply_isotonic,
    apply_platt,
    brier,
    ece,
    fit_calibration,
    fit_isotonic,
    fit_platt,
    read_calibration,
    reliability_bins,
    resolve_score_mode,
    write_calibration,
)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def test_isotonic_is_monotone_and_pools_violators() -> None:
    rng = np.random.default_rng(0)
    s = rng.uniform(0.3, 0.6, 3000)
    y = (rng.uniform(size=3000) < (s - 0.3) / 0.3).astype(float)
    params = fit_isotonic(s, y)
    x, v = np.asarray(params["x"]), np.asarray(params["y"])
    assert (np.diff(x) > 0).all() and (np.diff(v) > 0).all()  # strictly increasing knots: PAV pooled every tie
    grid = np.linspace(0.0, 1.0, 2001)
    out = apply_isotonic(params, grid)
    assert (np.diff(out) >= 0).all() and out.min() >= 0 and out.max() <= 1
    assert out[0] == v[0] and out[-1] == v[-1]  # flat outside the knots
    # a hand-made violator is pooled into the mean of the two points
    small = fit_isotonic(np.array([0.1, 0.2, 0.3]), np.array([0.0, 1.0, 0.0]))
    assert small == {"x": [0.1, 0.25], "y": [0.0, 0.5]}
    # the block values are the PAV solution: sklearn's isotonic regression has the same distinct values
    sklearn = pytest.importorskip("sklearn.isotonic")
    ref = sklearn.IsotonicRegression().fit(s, y)
    np.testing.assert_allclose(np.unique(ref.predict(s)), v, atol=1e-9)


def test_platt_recovers_a_known_logistic_map() -> None:
    rng = np.random.default_rng(1)
    s = rng.uniform(0.05, 0.95, 40_000)
    z = np.log(s / (1 - s))
    y = (rng.uniform(size=len(s)) < _sigmoid(2.5 * z - 0.7)).astype(float)
    params = fit_platt(s, y)
    assert params["a"] == pytest.approx(2.5, abs=0.12) and params["b"] == pytest.approx(-0.7, abs=0.08)
    p = apply_platt(params, s)
    assert ece(p, y) < 0.02 and (np.diff(apply_platt(params, np.sort(s))) >= 0).all()


def test_ece_and_brier() -> None:
    rng = np.random.default_rng(2)
    p = rng.uniform(size=200_000)
    y = (rng.uniform(size=len(p)) < p).astype(float)
    assert ece(p, y) < 0.005  # perfectly calibrated: ~0 up to sampling noise
    assert ece(p**3, y) > 0.15  # a distorted one is not
    assert brier(p, y) == pytest.approx(1 / 6, abs=0.003)  # E[p(1-p)] for uniform p
    assert brier(np.array([1.0, 0.0]), np.array([1.0, 0.0])) == 0.0
    bins = reliability_bins(np.array([0.05, 0.07, 0.95]), np.array([0.0, 1.0, 1.0]), bins=10)
    assert [(b["lo"], b["n"], b["rate"]) for b in bins] == [(0.0, 2, 0.5), (0.9, 1, 1.0)]
    assert ece(np.array([0.05, 0.07, 0.95]), np.array([0.0, 1.0, 1.0])) == pytest.approx((2 * 0.44 + 0.05) / 3)


def test_the_kept_method_has_the_lower_cross_fitted_brier() -> None:
    rng = np.random.default_rng(3)
    n = 3000
    groups = np.repeat(np.arange(n // 10), 10)
    # a step up to a plateau at 0.7: a logistic in logit(s) must run on to 1, isotonic stays on the plateau
    s = rng.uniform(0.3, 0.6, n)
    labels = (rng.uniform(size=n) < np.where(s > 0.4, 0.7, 0.1)).astype(float)
    step = fit_calibration(s, labels, groups=groups)
    c = step.validation["candidates"]
    assert step.method == "isotonic" and c["isotonic"]["cv_brier"] < c["platt"]["cv_brier"]
    # squeezed raw scores with a logistic truth: Platt is the better (and kept) map
    z = rng.normal(0, 1, n)
    s2 = _sigmoid(0.15 * z - 0.3)  # raw scores in a narrow band around 0.43
    y2 = (rng.uniform(size=n) < _sigmoid(2.0 * z - 0.5)).astype(float)
    logistic = fit_calibration(s2, y2, groups=groups)
    c2 = logistic.validation["candidates"]
    assert logistic.method == min(c2, key=lambda m: c2[m]["cv_brier"]) == "platt"
    v = logistic.validation
    assert v["raw"]["ece"] > 0.1 and v["calibrated"]["ece"] < 0.03 and v["calibrated"]["brier"] < v["raw"]["brier"]
    assert logistic.validation["grouped"] and logistic.relevance_threshold == 0.5
    only = fit_calibration(s2, y2, methods=["isotonic"], min_rows=10)
    assert only.method == "isotonic" and set(only.validation["candidates"]) == {"isotonic"}


def test_one_standard_error_rule_prefers_platt_within_the_noise() -> None:
    rng = np.random.default_rng(1)
    s = rng.uniform(0.3, 0.6, 400)
    y = (rng.uniform(size=400) < (s - 0.3) / 0.3 * 0.8 + 0.1).astype(float)  # linear truth: both maps are close
    lowest, one_se = fit_calibration(s, y, select="lowest"), fit_calibration(s, y, select="one_se")
    c = one_se.validation["candidates"]
    assert lowest.method == one_se.validation["lowest_cv_brier"] == "isotonic"  # isotonic is lower ...
    assert c["platt"]["cv_brier"] - c["isotonic"]["cv_brier"] < c["platt"]["se_vs_lowest"]  # ... within one SE
    assert one_se.method == "platt" and one_se.settings["select"] == "one_se"
    # a clear isotonic win (the plateau above) survives the rule
    s2 = rng.uniform(0.3, 0.6, 3000)
    y2 = (rng.uniform(size=3000) < np.where(s2 > 0.4, 0.7, 0.1)).astype(float)
    assert fit_calibration(s2, y2, select="one_se").method == "isotonic"


def test_fit_refuses_rows_that_cannot_calibrate() -> None:
    s = np.linspace(0.2, 0.8, 100)
    with pytest.raises(CalibrationError, match="one side of the relevance threshold"):
        fit_calibration(s, np.full(100, 0.2))
    with pytest.raises(CalibrationError, match="fewer than calibration.min_rows=50"):
        fit_calibration(s[:20], np.linspace(0, 1, 20))
    with pytest.raises(CalibrationError, match="non-finite"):
        fit_calibration(np.append(s, np.nan), np.append(np.linspace(0, 1, 100), 0.5))
    with pytest.raises(CalibrationError, match="unknown calibration method"):
        fit_calibration(s, np.linspace(0, 1, 100), methods=["beta"])
    with pytest.raises(CalibrationError, match="1 conversation"):  # no training fold to cross-fit on
        fit_calibration(s, np.linspace(0, 1, 100), groups=["c1"] * 100)
    assert fit_calibration(s, np.linspace(0, 1, 100), groups=["c1", "c2"] * 50).validation["cv_folds"] == 2


def test_calibration_json_roundtrip_and_errors(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    s = rng.uniform(size=500)
    cal = fit_calibration(s, (rng.uniform(size=500) < s).astype(float))
    assert read_calibration(tmp_path) is None
    write_calibration(tmp_path, cal)
    back = read_calibration(tmp_path)
    assert back is not None and back.method == cal.method
    np.testing.assert_allclose(back.apply(s), cal.apply(s))
    write_calibration(tmp_path, None)
    assert not (tmp_path / CALIBRATION_FILE).exists()
    path = tmp_path / CALIBRATION_FILE
    for doc, message in [
        ("{", "not readable JSON"),
        (json.dumps({"format": 1, "method": "beta", "relevance_threshold": 0.5, "params": {}}), "field 'method'"),
        (json.dumps({"format": 1, "method": "platt", "relevance_threshold": 0.5, "params": {"a": 1}}), "'a' and 'b'"),
        (json.dumps({"format": 1, "method": "isotonic", "relevance_threshold": 0.5,
                     "params": {"x": [0.1, 0.2], "y": [0.6, 0.4]}}), "knots must increase"),
        (json.dumps({"format": 1, "method": "platt", "relevance_threshold": 2, "params": {"a": 1, "b": 0}}),
         "relevance_threshold"),
        (json.dumps({"format": 9}), "format 9"),
    ]:
        path.write_text(doc)
        with pytest.raises(CalibrationError, match=message) as err:
            read_calibration(tmp_path)
        assert str(path) in str(err.value)


def test_score_modes() -> None:
    assert resolve_score_mode("raw", True, "art") == (False, None)
    assert resolve_score_mode("auto", True, "art") == (True, None)
    assert resolve_score_mode("calibrated", True, "art") == (True, None)
    used, note = resolve_score_mode("auto", False, "art")
    assert not used and note == "art has no calibration.json: pruned on raw scores"
    with pytest.raises(CalibrationError, match="art: score 'calibrated' asked for"):
        resolve_score_mode("calibrated", False, "art")
    cal = Calibration("platt", 0.5, {"a": 1.0, "b": 0.0})
    np.testing.assert_allclose(cal.apply([0.2, 0.7]), [0.2, 0.7])  # a=1, b=0 is the identity
