"""RDP of the Gaussian sum query on a sample drawn without replacement (replace-one relation).

References checked here:

* dp-accounting's ``_compute_rdp_sample_wor_gaussian``. Its base mechanism is
  ``func(x) = x / (2σ²)`` with σ its ``noise_multiplier`` (read in
  ``dp_accounting/rdp/rdp_privacy_accountant.py``, ``_compute_rdp_sample_wor_gaussian_int``), the
  RDP of a Gaussian of sensitivity 1. Ours is ε(j) = j·(2S)²/(2σ̃²) = 2j/z² (sensitivity 2S under
  replace-one), which is its ``func`` at σ = z/2. For α > 256 it evaluates exactly Theorem 9's sum
  (its "Stirling" branch: the j = 2 term with min{4(e^{ε(2)} − 1), 2e^{ε(2)}} and
  2·γ^j C(α, j) e^{(j−1)ε(j)} for j ≥ 3); for α ≤ 256 each term is the smaller of that and a
  Gaussian-specific forward-difference term (Theorem 27), so there it can only be below Theorem 9;
  a fractional order interpolates log A between the integer orders around it. dpledger's public
  value does the same and so equals it, rounded up.
* The exact Rényi divergence of the two mixtures of Gaussians a tiny population produces
  (every subset of b of n scalar records, one record replaced), by mpmath quadrature.
"""

from __future__ import annotations

import itertools
import logging
import math

import mpmath as mp
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp

from dpledger.accountants.without_replacement import (
    GAUSSIAN_TERMS_MAX_ORDER,
    MAX_ORDER,
    _log_central_moments,
    _theorem_log_excess,
    rdp_without_replacement,
)
from dpledger.errors import InvalidParameterError

logging.getLogger("absl").setLevel(logging.ERROR)

U = float(np.finfo(np.float64).eps)
GRID_GAMMA = (1e-6, 1e-4, 0.01, 0.1, 0.5, 0.9, 0.999)
GRID_Z = (0.3, 0.5, 1.0, 2.0, 5.0, 20.0)


def _theorem(gamma: float, z: float, alpha: int) -> float:
    """Our Theorem 9 value alone (without the minimum with 2α/z²), as ε(α)."""
    return float(np.logaddexp(0.0, _theorem_log_excess(gamma, z, alpha))) / (alpha - 1)


def _rounding(gamma: float, z: float, alpha: float) -> float:
    """A bound on the relative rounding margin the module adds (module docstring): 8u times the
    magnitudes a term's logarithm is computed from (three log-Gamma values, α·|log γ|, three times
    the largest exponent (α − 1)·2α/z², a few constants), plus the summation's (α + 4)·u and the
    last few roundings. Two float64 evaluations of the same sum (ours, dp-accounting's) differ by
    at most about twice this."""
    a = math.ceil(alpha)
    weight = 3.0 * math.lgamma(a + 1.0) + a * abs(math.log(gamma)) + 6.0 * a * (a - 1) / z**2
    return 8.0 * U * (weight + 20.0) + (a + 20.0) * U


# --------------------------------------------------------------------------- dp-accounting
@pytest.mark.parametrize("gamma", GRID_GAMMA)
def test_equals_dp_accounting_where_it_evaluates_theorem_9(gamma: float) -> None:
    for z, alpha in itertools.product(GRID_Z, (257, 300, 512, 1024)):
        theirs = float(dp_rdp._compute_rdp_sample_wor_gaussian(gamma, z / 2.0, [alpha])[0])
        ours = _theorem(gamma, z, alpha)
        tol = _rounding(gamma, z, alpha)
        # never below (up to their own rounding), and equal up to our added margin
        assert ours >= theirs * (1.0 - tol), (gamma, z, alpha, ours, theirs)
        assert ours <= theirs * (1.0 + 2.0 * tol), (gamma, z, alpha, ours, theirs)
        # the public function is the smaller of this and the unamplified Gaussian
        public = float(rdp_without_replacement(gamma, z, [alpha])[0])
        gaussian = 2.0 * alpha / z**2
        assert public == pytest.approx(min(ours, gaussian), rel=2.0 * tol)
        assert public >= min(theirs, gaussian) * (1.0 - tol)


@pytest.mark.parametrize("gamma", GRID_GAMMA)
def test_at_most_as_tight_as_dp_accounting_below_order_256(gamma: float) -> None:
    # dp-accounting takes, term by term, the smaller of Theorem 9's term and a Gaussian-specific
    # one, so Theorem 9 alone is never below it; where the Gaussian-specific term is never the
    # smaller (small z) the two are equal.
    for z, alpha in itertools.product(GRID_Z, (2, 3, 4, 8, 32, 64, 256)):
        theirs = float(dp_rdp._compute_rdp_sample_wor_gaussian(gamma, z / 2.0, [alpha])[0])
        ours = _theorem(gamma, z, alpha)
        assert ours >= theirs * (1.0 - _rounding(gamma, z, alpha)), (gamma, z, alpha)


def test_equals_dp_accounting_at_small_noise_for_every_order() -> None:
    # with z = 0.3 the last term dominates and the forward-difference alternative is never taken
    for alpha in (2, 3, 8, 64, 256):
        theirs = float(dp_rdp._compute_rdp_sample_wor_gaussian(0.01, 0.15, [alpha])[0])
        ours = _theorem(0.01, 0.3, alpha)
        assert ours == pytest.approx(theirs, rel=2.0 * _rounding(0.01, 0.3, alpha))


@pytest.mark.parametrize("gamma", GRID_GAMMA)
def test_equals_dp_accounting_up_to_order_256_fractional_orders_included(gamma: float) -> None:
    # the public value takes Theorem 27's Gaussian-specific terms and interpolates fractional
    # orders as dp-accounting does. Both evaluate the central moments' alternating sums, which
    # for z ≤ 5 and these orders cancel by at most about 10⁴, so each is exact to about
    # 10⁴·(its rounding margin) ≈ 1e-10: equal to rtol 1e-9. (At z = 20 the sums cancel by up
    # to 10¹⁰⁰ and neither float64 evaluation is exact: the moments' own test covers it.)
    orders = [1.001, 1.5, 2, 2.5, 3, 4, 7.5, 8, 32, 63.2, 64, GAUSSIAN_TERMS_MAX_ORDER]
    for z in (0.3, 0.5, 1.0, 2.0, 5.0):
        theirs = dp_rdp._compute_rdp_sample_wor_gaussian(gamma, z / 2.0, orders)
        # ours is also capped by 2α/z² and by the bounds at higher requested orders
        capped = np.minimum(theirs, 2.0 * np.array(orders) / z**2)
        want = np.minimum.accumulate(capped[::-1])[::-1]
        ours = rdp_without_replacement(gamma, z, orders)
        np.testing.assert_allclose(ours, want, rtol=1e-9, err_msg=f"{gamma}, {z}")


def _old_theorem_9(gamma: float, z: float, orders: list[float]) -> np.ndarray:
    """The bound before Theorem 27's terms: Theorem 9 at ⌈α⌉, capped by 2⌈α⌉/z², and the
    smallest over the requested orders ≥ α."""
    at = [min(_theorem(gamma, z, math.ceil(a)), 2.0 * math.ceil(a) / z**2) for a in orders]
    return np.minimum.accumulate(np.array(at)[::-1])[::-1]


@settings(max_examples=60, deadline=None)
@given(st.floats(1e-6, 1.0), st.floats(0.1, 100.0))
def test_never_above_theorem_9_alone(gamma: float, z: float) -> None:
    orders = [1.5, 2, 2.5, 3, 4, 5.5, 8, 16, 31.7, 64, 256, 300.5]
    new = rdp_without_replacement(gamma, z, orders)
    old = _old_theorem_9(gamma, z, orders)
    slack = 2.0 * max(_rounding(gamma, z, a) for a in orders)
    assert np.all(new <= old * (1.0 + slack)), (gamma, z, new, old)


def test_central_moments_are_upper_bounds_on_the_exact_forward_differences() -> None:
    # E_q[(p/q − 1)^m] = Σ_k C(m, k)(−1)^{m−k} e^{2k(k−1)/z²}, exactly in 200-digit mpmath; the
    # margin added is a small multiple of 8u times the magnitudes the terms' logarithms are
    # computed from (log-Gamma values, the largest exponent 2m(m − 1)/z²) of the terms' sum
    mp.mp.dps = 200
    for z in (0.5, 2.0, 5.0, 20.0, 100.0):
        ours = _log_central_moments(z, 40)
        for m in range(2, 41, 2):
            terms = [
                mp.binomial(m, k)
                * (-1) ** (m - k)
                * mp.exp(mp.mpf(2 * k * (k - 1)) / mp.mpf(z) ** 2)
                for k in range(m + 1)
            ]
            exact, size = mp.fsum(terms), mp.fsum(abs(t) for t in terms)
            assert exact > 0
            assert mp.mpf(ours[m]) >= mp.log(exact), (z, m)
            weight = 3.0 * math.lgamma(m + 1.0) + 8.0 * m * (m - 1) / z**2 + 10.0
            margin = mp.mpf(4.0 * 8.0 * U * weight + 2.0 * (m + 4) * U)
            assert mp.exp(mp.mpf(ours[m])) <= exact + margin * size, (z, m)
        # m = 2 is taken in closed form: the moment to 1e-12 whatever z
        assert float(ours[2] - mp.log(mp.expm1(mp.mpf(4) / mp.mpf(z) ** 2))) <= 1e-12


# the two tiny populations and noise levels where Theorem 27's terms are below Theorem 9's
TIGHTER = [(3, 1, 5.0), (4, 2, 4.0)]


@pytest.mark.parametrize(("n", "b", "z"), TIGHTER)
def test_tighter_bound_is_above_the_exact_divergence_of_tiny_populations(
    n: int, b: int, z: float
) -> None:
    # every population of n scalar records (the replaced one +1 → −1, the others in {−1, 0, 1}),
    # both directions, in float64 with the quadrature's error estimate added (see below)
    orders = [2.5, 3, 4.5, 6]
    bound = rdp_without_replacement(b / n, z, orders)
    assert np.all(bound < _old_theorem_9(b / n, z, orders))  # the new terms are in play
    others = list(itertools.combinations_with_replacement((-1.0, 0.0, 1.0), n - 1))
    for alpha, value in zip(orders, bound, strict=True):
        worst = 0.0
        for rest in others:
            p, q = _subset_sums((1.0, *rest), b), _subset_sums((-1.0, *rest), b)
            worst = max(worst, _float_rdp(p, q, z, alpha), _float_rdp(q, p, z, alpha))
        assert value >= worst, (n, b, z, alpha, value, worst)


# --------------------------------------------------------------------------- exact divergence
def _exact_rdp(means_p: list[float], means_q: list[float], z: float, alpha: float) -> mp.mpf:
    """D_α(P‖Q) for equal-weight mixtures of N(m, z²) (scalar), by 20-digit mpmath quadrature."""
    mp.mp.dps = 20
    sigma = mp.mpf(z)
    norm = 1 / (sigma * mp.sqrt(2 * mp.pi))
    mps, mqs = [mp.mpf(m) for m in means_p], [mp.mpf(m) for m in means_q]

    def density(x: mp.mpf, means: list[mp.mpf]) -> mp.mpf:
        return norm * mp.fsum(mp.exp(-((x - m) ** 2) / (2 * sigma**2)) for m in means) / len(means)

    def integrand(x: mp.mpf) -> mp.mpf:
        return density(x, mps) ** alpha * density(x, mqs) ** (1 - alpha)

    # the integrand is a sum of Gaussians centred within α·(spread of the means) of the means:
    # break the line there so that each piece is smooth on the scale of z
    lo = min(means_p + means_q) - (alpha + 12) * z - 2 * alpha
    hi = max(means_p + means_q) + (alpha + 12) * z + 2 * alpha
    return mp.log(mp.quad(integrand, [-mp.inf, *mp.linspace(lo, hi, 8), mp.inf])) / (alpha - 1)


def _float_rdp(means_p: list[float], means_q: list[float], z: float, alpha: float) -> float:
    """The same divergence in float64, to find the worst population for mpmath: the trapezoid
    rule on a grid of spacing z/64 (for an integrand analytic in a strip and decaying like a
    Gaussian its error falls exponentially with 1/spacing), with the difference from spacing
    z/32 added as the error."""
    lo = min(means_p + means_q) - (alpha + 12) * z - 2 * alpha
    hi = max(means_p + means_q) + (alpha + 12) * z + 2 * alpha
    x = np.linspace(lo, hi, 2 * math.ceil(32 * (hi - lo) / z) + 1)

    def log_density(means: list[float]) -> np.ndarray:
        m = np.asarray(means)[:, None]
        return logsumexp(-((x - m) ** 2) / (2 * z * z), axis=0) - math.log(m.shape[0])

    # both densities' normalising constants cancel but one: α − (α − 1) = 1
    f = np.exp(alpha * log_density(means_p) + (1 - alpha) * log_density(means_q))
    f /= z * math.sqrt(2 * math.pi)
    fine = np.trapezoid(f, x)
    coarse = np.trapezoid(f[::2], x[::2])
    return math.log(fine + abs(fine - coarse)) / (alpha - 1)


def _subset_sums(records: tuple[float, ...], b: int) -> list[float]:
    return [float(sum(c)) for c in itertools.combinations(records, b)]


POPULATIONS = [(3, 1), (4, 1), (4, 2), (6, 2), (6, 3)]


@pytest.mark.slow
@pytest.mark.parametrize(("n", "b"), POPULATIONS)
def test_bound_is_above_the_exact_divergence_of_tiny_populations(n: int, b: int) -> None:
    gamma = b / n
    # the replaced record goes from +S to −S (S = 1), the largest change a clipped scalar allows;
    # the others take every combination of −S, 0, +S (their order does not matter). Every
    # population is checked in float64 (with the quadrature's error estimate added) and the
    # worst one, in either direction, again at 20 digits.
    others = list(itertools.combinations_with_replacement((-1.0, 0.0, 1.0), n - 1))
    for z, alpha in itertools.product((0.7, 2.0), (2, 3, 6)):
        bound = float(rdp_without_replacement(gamma, z, [alpha])[0])
        theorem = _theorem(gamma, z, alpha)
        pairs = []
        for rest in others:
            p = _subset_sums((1.0, *rest), b)
            q = _subset_sums((-1.0, *rest), b)
            pairs += [(p, q), (q, p)]
        values = [_float_rdp(p, q, z, alpha) for p, q in pairs]
        assert min(bound, theorem) >= max(values), (n, b, z, alpha, bound, max(values))
        worst = _exact_rdp(*pairs[int(np.argmax(values))], z, alpha)
        # the two quadratures agree (the float one's added error estimate is ~1e-12 relative)
        assert abs(float(worst) - max(values)) <= 1e-9 * float(worst)
        assert mp.mpf(bound) >= worst, (n, b, z, alpha, bound, float(worst))
        assert mp.mpf(theorem) >= worst, (n, b, z, alpha, theorem, float(worst))


def test_exact_divergence_oracle_reproduces_the_gaussian() -> None:
    # one record, b = n = 1: N(1, z²) against N(−1, z²), D_α = α·2²/(2z²) = 2α/z²
    for z, alpha in ((0.7, 3), (2.0, 6)):
        exact = _exact_rdp([1.0], [-1.0], z, alpha)
        assert abs(exact - mp.mpf(2 * alpha) / mp.mpf(z) ** 2) <= mp.mpf(10) ** -15 * exact
        assert _float_rdp([1.0], [-1.0], z, alpha) == pytest.approx(2 * alpha / z**2, rel=1e-9)


# --------------------------------------------------------------------------- edges, properties
def test_edges() -> None:
    orders = [1.5, 2, 3, 10.5, 64]
    np.testing.assert_array_equal(rdp_without_replacement(0.0, 1.0, orders), 0.0)
    # γ = 1: the unamplified Gaussian 2α/z², at fractional orders too
    full = rdp_without_replacement(1.0, 1.3, orders)
    gaussian = 2.0 * np.array(orders) / 1.3**2
    np.testing.assert_allclose(full, gaussian, rtol=16 * U)
    assert np.all(full >= gaussian)
    assert np.all(np.isinf(rdp_without_replacement(0.5, 1e-170, orders)))
    # tiny but positive noise: finite where 2j(j − 1)/z² fits in a float64
    assert np.all(np.isfinite(rdp_without_replacement(0.5, 1e-100, [2, 3])))
    # large orders and tiny γ: positive, finite
    big = rdp_without_replacement(1e-12, 0.8, [2, MAX_ORDER])
    assert np.all((big > 0.0) & np.isfinite(big))


def test_fractional_orders_interpolate_log_a_between_integer_orders() -> None:
    # (α − 1)·ε'(α) = log A(α) is convex in α (Hölder), and log A(1) = 0: at α = ⌊α⌋ + t the
    # bound is ((1 − t)·log A(⌊α⌋) + t·log A(⌈α⌉))/(α − 1), below the bound at ⌈α⌉
    gamma, z = 0.01, 1.0
    got = rdp_without_replacement(gamma, z, [1.01, 2.5, 7.2])
    at = {a: float(rdp_without_replacement(gamma, z, [a])[0]) for a in (2, 3, 7, 8)}
    assert got[0] == pytest.approx(at[2], rel=1e-12)
    assert got[1] == pytest.approx((0.5 * at[2] + 0.5 * 2 * at[3]) / 1.5, rel=1e-12)
    assert got[2] == pytest.approx((0.8 * 6 * at[7] + 0.2 * 7 * at[8]) / 6.2, rel=1e-12)
    assert got[1] < at[3] and got[2] < at[8]
    # rounded up, never below the interpolation computed here
    assert got[1] >= (0.5 * at[2] + 0.5 * 2 * at[3]) / 1.5


def test_bounds_at_higher_requested_orders_are_used() -> None:
    # Theorem 9 (alone above order 256) is not monotone in α, and here it is below 2α/z² at both
    # orders: alone, the bound at 300 is above the bound at 600, so asked together the value at
    # 300 is the one at 600
    gamma, z = 0.05, 100.0
    single = [float(rdp_without_replacement(gamma, z, [a])[0]) for a in (300, 600)]
    assert single[0] > single[1]
    assert single[0] < 2.0 * 300 / z**2
    joint = rdp_without_replacement(gamma, z, [600, 300, 64])
    assert joint[0] == joint[1] == single[1]
    assert joint[2] == float(rdp_without_replacement(gamma, z, [64])[0]) <= joint[1]


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"sampling_ratio": -0.1}, "sampling_ratio"),
        ({"sampling_ratio": 1.5}, "sampling_ratio"),
        ({"sampling_ratio": float("nan")}, "sampling_ratio"),
        ({"sampling_ratio": True}, "sampling_ratio"),
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"noise_multiplier": float("inf")}, "noise_multiplier"),
        ({"orders": [1.0]}, "orders"),
        ({"orders": [0.5, 2]}, "orders"),
        ({"orders": []}, "orders"),
        ({"orders": [[2, 3]]}, "orders"),
        ({"orders": [float("inf")]}, "orders"),
        ({"orders": [MAX_ORDER + 1]}, "orders"),
        ({"orders": "23"}, "orders"),
        ({"orders": [True, 2]}, "orders"),
    ],
)
def test_bad_input_is_refused_with_a_typed_error(kwargs: dict, parameter: str) -> None:
    args = {"sampling_ratio": 0.1, "noise_multiplier": 1.0, "orders": [2, 3]} | kwargs
    with pytest.raises(InvalidParameterError) as info:
        rdp_without_replacement(**args)
    assert info.value.parameter == parameter


gammas = st.floats(1e-6, 1.0)
zs = st.floats(0.1, 100.0)
ORDERS = [1.5, 2, 3, 4, 5.5, 8, 16, 32, 64]


def _slack(gamma: float, z: float) -> float:
    """Two computed values each lie between the exact bound and it times (1 + margin), so an
    exact inequality between bounds holds for the computed values up to twice the margin."""
    return 2.0 * max(_rounding(gamma, z, a) for a in ORDERS)


@settings(max_examples=60, deadline=None)
@given(gammas, gammas, zs)
def test_monotone_in_sampling_ratio(g1: float, g2: float, z: float) -> None:
    lo, hi = sorted((g1, g2))
    a, b = rdp_without_replacement(lo, z, ORDERS), rdp_without_replacement(hi, z, ORDERS)
    assert np.all(a <= b * (1.0 + _slack(lo, z)))


@settings(max_examples=60, deadline=None)
@given(gammas, zs, zs)
def test_non_increasing_in_noise(gamma: float, z1: float, z2: float) -> None:
    lo, hi = sorted((z1, z2))
    a, b = rdp_without_replacement(gamma, lo, ORDERS), rdp_without_replacement(gamma, hi, ORDERS)
    assert np.all(b <= a * (1.0 + _slack(gamma, lo)))


@settings(max_examples=60, deadline=None)
@given(gammas, zs)
def test_non_decreasing_in_order(gamma: float, z: float) -> None:
    values = rdp_without_replacement(gamma, z, ORDERS)
    assert np.all(np.diff(values) >= 0.0)
    assert np.all(values > 0.0)
    assert np.all(values <= 2.0 * np.ceil(ORDERS) / z**2 * (1.0 + 16 * U))
