"""Strategy matrices: factorizations of the prefix-sum workload, their errors, their caching.

References: A = B·C checked against an explicit lower-triangular matrix of ones; the inverse of
C by ``numpy.linalg.inv``; the Honaker root estimate against the generalised-least-squares
(BLUE) variance 1ᵀ(CᵀC)⁻¹1 of the full-tree sum (Honaker 2015); the BandMF objective against
explicit matrix products.
"""

from __future__ import annotations

import numpy as np
import pytest

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.correlated import optimize_banded_toeplitz, tree_factorization
from dpledger.mechanisms.correlated.strategies import (
    _optimized,
    banded_toeplitz_factorization,
    blt_factorization,
    inverse_toeplitz_coefficients,
    matrix_hash,
    prefix_error,
    prefix_sum_workload,
    tree_nodes,
)


@pytest.mark.parametrize("num_steps", [1, 2, 7, 16, 21])
def test_every_factorization_reproduces_prefix_sums(num_steps: int) -> None:
    """Reference: np.tril(ones) as A; B·C = A to rounding for every strategy."""
    a = np.tril(np.ones((num_steps, num_steps)))
    facts = [
        tree_factorization(num_steps),
        tree_factorization(num_steps, honaker=True),
        banded_toeplitz_factorization(num_steps, [1.0, 0.5, 0.25]),
        blt_factorization(num_steps, omega=[-0.4, -0.1], theta=[0.3, 0.8]),
        optimize_banded_toeplitz(num_steps=num_steps, bands=min(3, num_steps)),
    ]
    for f in facts:
        np.testing.assert_allclose(f.decoder @ f.strategy, a, atol=1e-12)
    np.testing.assert_array_equal(prefix_sum_workload(num_steps), a)


def test_tree_nodes_are_the_complete_dyadic_intervals() -> None:
    """Reference: for T = 2^L − 1 … the count of complete dyadic intervals is Σ_h ⌊T / 2^h⌋."""
    for t in range(1, 40):
        nodes = tree_nodes(t)
        assert len(nodes) == sum(t >> h for h in range(t.bit_length()))
        assert all(start + (1 << h) <= t for h, start in nodes)


def test_honaker_lowers_variance_and_matches_blue_at_the_root() -> None:
    """Reference: Honaker (2015): the bottom-up inverse-variance estimate of a complete subtree's
    sum is its best linear unbiased estimate, with variance 1ᵀ(CᵀC)⁻¹1 (GLS on the subtree's
    nodes). Every prefix's variance is at most the standard tree's."""
    t = 16
    std = tree_factorization(t)
    hon = tree_factorization(t, honaker=True)
    v_std = np.diag(std.noise_covariance())
    v_hon = np.diag(hon.noise_covariance())
    assert np.all(v_hon <= v_std + 1e-12)
    assert np.any(v_hon < v_std - 1e-3)
    c = hon.strategy
    ones = np.ones(t)
    blue = float(ones @ np.linalg.inv(c.T @ c) @ ones)
    assert v_hon[t - 1] == pytest.approx(blue, rel=1e-12)


def test_inverse_toeplitz_coefficients() -> None:
    """Reference: numpy.linalg.inv of the explicit Toeplitz matrix."""
    f = banded_toeplitz_factorization(12, [2.0, 0.7, -0.3, 0.1])
    inv = np.linalg.inv(f.strategy)
    np.testing.assert_allclose(
        inverse_toeplitz_coefficients([2.0, 0.7, -0.3, 0.1], 12), inv[:, 0], atol=1e-14
    )


def test_prefix_error_matches_explicit_products() -> None:
    """Reference: ‖A·C⁻¹‖_F² · max_j ‖C_j‖² from explicit matrices."""
    coeffs = [1.0, 0.6, 0.45, 0.3]
    f = banded_toeplitz_factorization(30, coeffs)
    a = prefix_sum_workload(30)
    explicit = np.linalg.norm(a @ np.linalg.inv(f.strategy)) ** 2 * max(
        np.linalg.norm(f.strategy, axis=0) ** 2
    )
    assert prefix_error(coeffs, 30) == pytest.approx(float(explicit), rel=1e-12)


def test_bandmf_optimisation_improves_on_independent_noise_and_is_cached() -> None:
    """Reference: b = 1 is DP-SGD (C = I), error Σ_t (t + 1) = T(T + 1)/2 in closed form; the
    optimum is at least as good as its starting point, the series of 1/√(1 − x) truncated to b
    bands (coefficients binom(2m, m)/4^m), and below DP-SGD's error."""
    import math

    t = 128
    assert prefix_error(
        optimize_banded_toeplitz(num_steps=t, bands=1).params["coefficients"], t
    ) == (pytest.approx(t * (t + 1) / 2, rel=1e-15))
    for b in (2, 4, 8):
        got = prefix_error(optimize_banded_toeplitz(num_steps=t, bands=b).params["coefficients"], t)
        start = [math.comb(2 * m, m) / 4**m for m in range(b)]
        assert got <= prefix_error(start, t)
        assert got < t * (t + 1) / 2
    before = _optimized.cache_info().hits
    optimize_banded_toeplitz(num_steps=t, bands=8)
    assert _optimized.cache_info().hits == before + 1


def test_matrix_hash_names_the_matrix() -> None:
    """Reference: hashlib over the documented byte layout (shape as int64, entries as float64)."""
    import hashlib

    c = banded_toeplitz_factorization(5, [1.0, 0.5]).strategy
    h = hashlib.sha256(np.asarray(c.shape, dtype="<i8").tobytes() + c.astype("<f8").tobytes())
    assert matrix_hash(c) == h.hexdigest()
    assert matrix_hash(c) != matrix_hash(banded_toeplitz_factorization(5, [1.0, 0.5001]).strategy)


def test_too_large_factorizations_are_refused_before_allocating() -> None:
    """Reference: the documented budget (1 GiB of dense float64 matrices): T = 7000 needs
    8·3·7000² bytes ≈ 1.1 GiB for a square C (C, B, A) and more for the tree."""
    from dpledger.errors import ComputationBudgetError

    for build in (
        lambda: tree_factorization(7000),
        lambda: banded_toeplitz_factorization(7000, [1.0, 0.5]),
        lambda: blt_factorization(7000, omega=[-0.1], theta=[0.5]),
        lambda: optimize_banded_toeplitz(num_steps=7000, bands=2),
    ):
        with pytest.raises(ComputationBudgetError, match="num_steps=7000"):
            build()


def test_bad_inputs() -> None:
    with pytest.raises(InvalidParameterError, match="coefficients"):
        banded_toeplitz_factorization(5, [0.0, 1.0])
    with pytest.raises(InvalidParameterError, match="coefficients"):
        banded_toeplitz_factorization(5, [1.0, float("nan")])
    with pytest.raises(InvalidParameterError, match="theta"):
        blt_factorization(5, omega=[-0.1], theta=[1.0])
    with pytest.raises(InvalidParameterError, match="omega"):
        blt_factorization(5, omega=[-0.1, 0.2], theta=[0.5])
    with pytest.raises(InvalidParameterError, match="bands"):
        optimize_banded_toeplitz(num_steps=4, bands=5)
    with pytest.raises(InvalidParameterError, match="num_steps"):
        tree_factorization(0)


def test_a_decoder_that_is_not_a_factorization_is_refused() -> None:
    """Reference: B·C = A fails when one entry of B is changed (checked on random vectors)."""
    from dpledger.mechanisms.correlated.strategies import MatrixFactorization

    f = tree_factorization(8)
    bad = f.decoder.copy()
    bad[5, 2] += 1e-3
    with pytest.raises(InvalidParameterError, match="decoder"):
        MatrixFactorization("tree", {"num_steps": 8}, f.strategy, bad)
    with pytest.raises(InvalidParameterError, match="decoder"):
        MatrixFactorization("tree", {"num_steps": 8}, f.strategy, bad[:, :3])


def test_blt_optimisation_beats_its_start_and_dp_sgd_and_streams_exactly() -> None:
    """References: the objective at the documented start (θ_i spread towards 1,
    ω_i = −(1 − θ_i)/(2·buffers)) and DP-SGD's error T(T + 1)/2; the objective against explicit
    matrices (‖A·C⁻¹‖_F² · max_j ‖C_j‖²); the stream against ``numpy.linalg.solve(C, Z)``."""
    from dpledger.mechanisms.correlated import noise_for, optimize_blt
    from dpledger.mechanisms.correlated.strategies import blt_prefix_error

    t, n = 128, 3
    fact = optimize_blt(num_steps=t, buffers=n)
    omega, theta = fact.params["omega"], fact.params["theta"]
    got = blt_prefix_error(omega=omega, theta=theta, num_steps=t)
    theta0 = 1.0 - np.geomspace(0.5, 0.5 / t, n)
    start = blt_prefix_error(omega=-(1.0 - theta0) / (2 * n), theta=theta0, num_steps=t)
    assert got <= start and got < t * (t + 1) / 2
    a = prefix_sum_workload(t)
    explicit = np.linalg.norm(a @ np.linalg.inv(fact.strategy)) ** 2 * max(
        np.linalg.norm(fact.strategy, axis=0) ** 2
    )
    assert got == pytest.approx(float(explicit), rel=1e-9)
    assert all(0.0 < th < 1.0 for th in theta)
    gen = noise_for(fact, dim=2, noise_stddev=1.0, seed=1)
    w = np.stack([gen.next() for _ in range(t)])
    z = np.random.default_rng(1).standard_normal((t, 2))
    np.testing.assert_allclose(w, np.linalg.solve(fact.strategy, z), atol=1e-10)
    from dpledger.mechanisms.correlated.strategies import _optimized_blt

    before = _optimized_blt.cache_info().hits
    assert optimize_blt(num_steps=t, buffers=n).params == fact.params
    assert _optimized_blt.cache_info().hits == before + 1


@pytest.mark.parametrize(("t", "n"), [(31, 4), (16, 4), (64, 2)])
def test_blt_optimisation_keeps_every_decay_below_one(t: int, n: int) -> None:
    """Regression: at T = 31 with 4 buffers the optimiser drove a decay's logit so high that the
    logistic rounded to exactly 1.0 and ``blt_factorization`` refused it. Reference: the
    objective at the documented start (the result may not be worse) and θ_i < 1 for every i."""
    from dpledger.mechanisms.correlated import optimize_blt
    from dpledger.mechanisms.correlated.strategies import blt_prefix_error

    fact = optimize_blt(num_steps=t, buffers=n)
    theta = fact.params["theta"]
    assert all(0.0 < th < 1.0 for th in theta)
    theta0 = 1.0 - np.geomspace(0.5, 0.5 / t, n)
    start = blt_prefix_error(omega=-(1.0 - theta0) / (2 * n), theta=theta0, num_steps=t)
    got = blt_prefix_error(omega=fact.params["omega"], theta=theta, num_steps=t)
    assert got <= start
