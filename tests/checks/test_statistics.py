"""The slope test of the checks against the textbook t-test and numpy's least squares."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st

from dpledger.checks.statistics import slope_test
from dpledger.errors import InvalidParameterError


def test_slope_test_matches_the_textbook_t_test():
    rng = np.random.default_rng(0)
    x = np.linspace(0, 1, 12)
    y = 0.3 * x + rng.normal(0, 0.1, x.size)
    res = slope_test(x, y)
    n = x.size
    xc = x - x.mean()
    b = float(np.sum(xc * (y - y.mean())) / np.sum(xc**2))
    resid = y - (y.mean() + b * xc)
    se = math.sqrt(np.sum(resid**2) / (n - 2) / np.sum(xc**2))
    t = b / se
    p = 2 * scipy.stats.t.sf(abs(t), n - 2)
    assert res.slope == pytest.approx(b) and res.stderr == pytest.approx(se)
    assert res.t_statistic == pytest.approx(t) and res.p_value == pytest.approx(p)
    assert res.intercept == pytest.approx(y.mean() - b * x.mean()) and res.n == n


@given(st.lists(st.floats(-1e3, 1e3), min_size=3, max_size=20), st.floats(-5, 5))
def test_slope_test_p_value_is_a_probability_and_slope_matches_polyfit(ys, shift):
    x = np.arange(len(ys), dtype=float)
    y = np.asarray(ys) + shift * x
    res = slope_test(x, y)
    assert 0.0 <= res.p_value <= 1.0
    if np.ptp(y) > 0:
        assert res.slope == pytest.approx(np.polyfit(x, y, 1)[0], rel=1e-6, abs=1e-6)


def test_slope_test_degenerate_cases():
    flat = slope_test([1, 2, 3], [5, 5, 5])
    assert (flat.slope, flat.p_value, flat.t_statistic) == (0.0, 1.0, 0.0)
    perfect = slope_test([1, 2, 3, 4], [2, 4, 6, 8])
    assert perfect.slope == pytest.approx(2.0) and perfect.p_value == 0.0
    for x, y in (([1, 2], [1, 2]), ([1, 1, 1], [1, 2, 3]), ([1, 2, 3], [1, math.nan, 3])):
        with pytest.raises(InvalidParameterError):
            slope_test(x, y)
