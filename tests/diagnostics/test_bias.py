"""Tests of the clipping-bias metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dpledger.diagnostics.bias import ClippingBias, clipping_bias, clipping_bias_from_sums
from dpledger.errors import InvalidParameterError

# Two per-example gradients with known norms: ‖g1‖ = 5 (clipped to C = 1), ‖g2‖ = 0.5 (not).
G1 = np.array([3.0, 4.0])
G2 = np.array([0.0, 0.5])
C = 1.0


def test_two_gradients_by_hand():
    m = clipping_bias(np.stack([G1, G2]), l2_norm_bound=C)
    # clip(g1) = (0.6, 0.8), clip(g2) = g2.
    g_hat = np.array([1.5, 2.25])  # (g1 + g2)/2
    g_clip = np.array([0.3, 0.65])  # ((0.6, 0.8) + (0, 0.5))/2
    assert m.num_examples == 2
    assert m.fraction_clipped == 0.5
    np.testing.assert_allclose(m.bias, g_clip - g_hat)  # (−1.2, −1.6)
    assert m.bias_norm == pytest.approx(2.0)
    assert m.mean_gradient_norm == pytest.approx(math.hypot(1.5, 2.25))
    assert m.clipped_mean_gradient_norm == pytest.approx(math.hypot(0.3, 0.65))
    # a = (1/l) Σ η_i / M_i (Knolle et al., App. C), η_i = ⟨g_i, ĝ⟩/‖ĝ‖², M_i = max(1, ‖g_i‖/C).
    sq = 1.5**2 + 2.25**2  # 7.3125
    eta1, eta2 = (3 * 1.5 + 4 * 2.25) / sq, (0.5 * 2.25) / sq
    a = (eta1 / 5.0 + eta2 / 1.0) / 2
    assert m.magnitude_error == pytest.approx(a, rel=1e-12)
    assert m.magnitude_error == pytest.approx(1.9125 / 7.3125, rel=1e-12)
    # c = (1/l) Σ τ_i / M_i with τ_i = g_i − η_i ĝ.
    c = ((G1 - eta1 * g_hat) / 5.0 + (G2 - eta2 * g_hat) / 1.0) / 2
    np.testing.assert_allclose(m.directional_error, c, atol=1e-12)
    assert m.directional_error_norm == pytest.approx(np.linalg.norm(c))
    assert m.cosine == pytest.approx(
        float(g_clip @ g_hat) / (np.linalg.norm(g_clip) * np.linalg.norm(g_hat))
    )
    assert m.mean_example_norm == pytest.approx(2.75)
    assert m.max_example_norm == pytest.approx(5.0)


def test_decomposition_identity_and_orthogonality_on_the_example():
    m = clipping_bias(np.stack([G1, G2]), l2_norm_bound=C)
    g_hat = (G1 + G2) / 2
    g_clip = g_hat + m.bias
    np.testing.assert_allclose(m.magnitude_error * g_hat + m.directional_error, g_clip, atol=1e-12)
    assert abs(float(m.directional_error @ g_hat)) < 1e-12


@settings(max_examples=50, deadline=None)
@given(
    g=hnp.arrays(
        np.float64,
        st.tuples(st.integers(1, 6), st.integers(1, 5)),
        elements=st.floats(-10, 10, allow_nan=False, width=64),
    ),
    bound=st.floats(0.01, 20.0),
)
def test_decomposition_identity_holds_for_any_gradients(g, bound):
    m = clipping_bias(g, l2_norm_bound=bound)
    g_hat = g.mean(axis=0)
    norms = np.linalg.norm(g, axis=1)
    g_clip = (g / np.maximum(1.0, norms / bound)[:, None]).mean(axis=0)
    scale = max(1.0, float(np.abs(g).max()))
    np.testing.assert_allclose(g_hat + m.bias, g_clip, atol=1e-12 * scale)
    if np.linalg.norm(g_hat) > 1e-6:
        np.testing.assert_allclose(
            m.magnitude_error * g_hat + m.directional_error, g_clip, atol=1e-9 * scale
        )
        assert abs(float(m.directional_error @ g_hat)) <= 1e-9 * scale * max(
            1.0, float(np.linalg.norm(g_hat))
        )
    assert -1.0 <= m.cosine <= 1.0
    assert m.fraction_clipped == pytest.approx(np.mean(norms > bound))


def test_no_clipping_means_no_bias():
    g = np.array([[0.1, 0.2], [0.3, -0.1], [0.0, 0.05]])
    m = clipping_bias(g, l2_norm_bound=10.0)
    assert m.fraction_clipped == 0.0
    assert m.bias_norm == 0.0
    assert m.magnitude_error == pytest.approx(1.0)
    assert m.directional_error_norm == pytest.approx(0.0, abs=1e-15)
    assert m.cosine == pytest.approx(1.0)


def test_fast_path_equals_full_path():
    rng = np.random.default_rng(0)
    g = rng.normal(size=(8, 5)) * rng.uniform(0.1, 3.0, size=(8, 1))
    full = clipping_bias(g, l2_norm_bound=1.0)
    norms = np.linalg.norm(g, axis=1)
    clipped = g / np.maximum(1.0, norms)[:, None]
    fast = clipping_bias_from_sums(
        unclipped_sum=g.sum(axis=0),
        clipped_sum=clipped.sum(axis=0),
        num_examples=8,
        per_example_norms=norms,
        l2_norm_bound=1.0,
    )
    assert fast.scalars() == pytest.approx(full.scalars())
    np.testing.assert_allclose(fast.directional_error, full.directional_error)
    by_count = clipping_bias_from_sums(
        unclipped_sum=g.sum(axis=0),
        clipped_sum=clipped.sum(axis=0),
        num_examples=8,
        num_clipped=int(np.sum(norms > 1.0)),
    )
    assert by_count.fraction_clipped == full.fraction_clipped
    assert by_count.mean_example_norm is None and "mean_example_norm" not in by_count.scalars()


def test_groups_are_concatenated_per_example():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 3, 2))  # a weight matrix per example
    b = rng.normal(size=(4, 2))  # a bias vector per example
    flat = np.concatenate([w.reshape(4, -1), b], axis=1)
    grouped = clipping_bias([w, b], l2_norm_bound=0.7)
    assert grouped.scalars() == pytest.approx(clipping_bias(flat, l2_norm_bound=0.7).scalars())
    sums = clipping_bias_from_sums(
        unclipped_sum=[w.sum(axis=0), b.sum(axis=0)],
        clipped_sum=[w.sum(axis=0), b.sum(axis=0)],
        num_examples=4,
        num_clipped=0,
    )
    assert sums.bias_norm == 0.0


def test_any_clipping_rule_through_the_clipped_vectors():
    # Automatic clipping g / (‖g‖ + γ) rescales every record: all count as clipped when shortened.
    g = np.stack([G1, G2])
    norms = np.linalg.norm(g, axis=1)
    auto = g / (norms + 0.01)[:, None]
    m = clipping_bias(g, clipped_gradients=auto)
    assert m.fraction_clipped == 0.5  # g2 (norm 0.5) is lengthened to ≈ 0.98, not shortened
    np.testing.assert_allclose(m.bias, auto.mean(axis=0) - g.mean(axis=0))
    # Global clipping drops the records above the bound.
    dropped = np.where((norms <= 1.0)[:, None], g, 0.0)
    m = clipping_bias(g, clipped_gradients=dropped)
    assert m.fraction_clipped == 0.5
    np.testing.assert_allclose(m.bias, [-1.5, -2.0])


def test_denominator_scales_the_vectors_not_the_ratios():
    g = np.stack([G1, G2])
    base = clipping_bias(g, l2_norm_bound=C)
    scaled = clipping_bias(g, l2_norm_bound=C, denominator=4.0)  # e.g. an expected batch size
    assert scaled.denominator == 4.0
    assert scaled.bias_norm == pytest.approx(base.bias_norm / 2)
    assert scaled.magnitude_error == pytest.approx(base.magnitude_error)
    assert scaled.cosine == pytest.approx(base.cosine)


def test_zero_mean_gradient_is_degenerate_but_defined():
    g = np.array([[1.0, 0.0], [-1.0, 0.0]])
    m = clipping_bias(g, l2_norm_bound=0.5)
    assert m.magnitude_error == 0.0 and m.cosine == 0.0
    assert m.bias_norm == 0.0
    assert all(math.isfinite(v) for v in m.scalars().values())


def test_result_type_and_scalars():
    m = clipping_bias(np.stack([G1, G2]), l2_norm_bound=C)
    assert isinstance(m, ClippingBias)
    s = m.scalars()
    assert set(s) >= {"fraction_clipped", "bias_norm", "magnitude_error", "cosine"}
    assert all(isinstance(v, float) for v in s.values())
    with pytest.raises(AttributeError):
        m.bias_norm = 0.0  # type: ignore[misc]


ONES = np.ones((2, 2))


def sums(**kwargs):
    args = {"unclipped_sum": [1.0], "clipped_sum": [1.0], "num_examples": 2, "num_clipped": 0}
    args.update(kwargs)
    return clipping_bias_from_sums(**{k: v for k, v in args.items() if v is not None})


@pytest.mark.parametrize(
    ("call", "parameter"),
    [
        (lambda: clipping_bias(ONES), "l2_norm_bound/clipped_gradients"),
        (
            lambda: clipping_bias(ONES, l2_norm_bound=1.0, clipped_gradients=ONES),
            "l2_norm_bound/clipped_gradients",
        ),
        (lambda: clipping_bias(ONES, l2_norm_bound=0.0), "l2_norm_bound"),
        (lambda: clipping_bias(ONES, l2_norm_bound=float("inf")), "l2_norm_bound"),
        (lambda: clipping_bias(np.ones((0, 2)), l2_norm_bound=1.0), "per_example_gradients"),
        (lambda: clipping_bias([[np.nan, 1.0]], l2_norm_bound=1.0), "per_example_gradients"),
        (lambda: clipping_bias(3.0, l2_norm_bound=1.0), "per_example_gradients"),
        (
            lambda: clipping_bias([ONES, np.ones((3, 2))], l2_norm_bound=1.0),
            "per_example_gradients",
        ),
        (lambda: clipping_bias(ONES, clipped_gradients=np.ones((2, 3))), "clipped_gradients"),
        (lambda: clipping_bias(ONES, l2_norm_bound=1.0, denominator=0), "denominator"),
        (lambda: sums(num_examples=0), "num_examples"),
        (lambda: sums(clipped_sum=[1.0, 2.0]), "clipped_sum"),
        (lambda: sums(num_clipped=3), "num_clipped"),
        (lambda: sums(num_clipped=None), "num_clipped"),
        (
            lambda: sums(num_clipped=None, per_example_norms=[1.0], l2_norm_bound=1.0),
            "per_example_norms",
        ),
    ],
)
def test_bad_inputs_are_refused(call, parameter):
    with pytest.raises(InvalidParameterError) as info:
        call()
    assert info.value.parameter == parameter
