"""The pieces of the PRV accountant: the dominating pairs, the discretisation, the composition."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import scipy.optimize
import scipy.stats

from dpledger.accountants.prv.composition import compose
from dpledger.accountants.prv.discretisation import conditional_bias, discretise, discretise_steps
from dpledger.accountants.prv.pairs import StepPair

norm = scipy.stats.norm


def exact_deltas(q: float, z: float, replace_one: bool, eps: float) -> tuple[float, float]:
    """(δ_remove(ε), δ_add(ε)) of one step, from Gaussian CDFs and a root of L(x) = ±ε.

    L(x) = log(P(x)/Q(x)) is increasing; δ_remove(ε) = P[L > ε] − e^ε·Q[L > ε] and
    δ_add(ε) = Q[L < −ε] − e^ε·P[L < −ε].
    """

    def loss(x: float) -> float:
        lp = np.logaddexp(math.log1p(-q), math.log(q) + (2 * x - 1) / (2 * z * z))
        if not replace_one:
            return float(lp)
        lq = np.logaddexp(math.log1p(-q), math.log(q) + (-2 * x - 1) / (2 * z * z))
        return float(lp - lq)

    def p_gt(x: float) -> float:
        return (1 - q) * norm.sf(x / z) + q * norm.sf((x - 1) / z)

    def q_gt(x: float) -> float:
        if replace_one:
            return (1 - q) * norm.sf(x / z) + q * norm.sf((x + 1) / z)
        return float(norm.sf(x / z))

    def root(level: float) -> float:
        if not replace_one and level <= math.log1p(-q):
            return -math.inf
        return scipy.optimize.brentq(lambda x: loss(x) - level, -60, 60, xtol=1e-14)

    x_hi, x_lo = root(eps), root(-eps)
    remove = p_gt(x_hi) - math.exp(eps) * q_gt(x_hi)
    add = (1 - q_gt(x_lo)) - math.exp(eps) * (1 - p_gt(x_lo)) if x_lo > -math.inf else 0.0
    return max(remove, 0.0), max(add, 0.0)


PAIRS = [(0.01, 0.7, False), (0.3, 2.0, False), (0.05, 1.0, True), (0.9, 0.6, False)]


@pytest.mark.parametrize("q, z, replace_one", PAIRS)
@pytest.mark.parametrize("h", [1e-2, 1e-3])
def test_one_discretised_step_dominates_and_is_close(
    q: float, z: float, replace_one: bool, h: float
) -> None:
    """Connect-the-dots: δ̃(ε) ≥ δ(ε) for every ε (the discrete pair dominates), and
    δ̃(ε) ≤ δ(ε − w) for the widest bin w (it interpolates the privacy curve between the bin
    end points)."""
    steps = 10_000  # many steps keep the bins h wide where the loss has its mass
    remove, add = discretise(
        StepPair(q, z, replace_one),
        h=h,
        out_mass=1e-14,
        steps=steps,
        shift_lambda=math.sqrt(8 * 20 / steps) / h,
    )
    widest = h * max(int(np.diff(remove.positions).max()), 1)
    for eps in [0.0, 0.013, 0.2, 0.77, 1.5, 3.1]:
        exact = exact_deltas(q, z, replace_one, eps)
        below = exact_deltas(q, z, replace_one, max(eps - widest, 0.0))
        sides = [(remove, exact[0], below[0])]
        if add is not None:
            sides.append((add, exact[1], below[1]))
        for prv, true, looser in sides:
            value = prv.delta(eps)
            assert value >= true - 1e-13
            assert value <= looser + prv.out_mass + 1e-13
        if replace_one:  # symmetric pair: the add side equals the remove side
            assert exact[1] == pytest.approx(exact[0], rel=1e-9, abs=1e-15)


def test_discretisation_keeps_both_masses() -> None:
    """Each bin keeps its P-mass and Q-mass, so Σ p = P(range) and Σ p·e^{−x} = Q(range)."""
    remove, add = discretise(
        StepPair(0.01, 0.8), h=1e-3, out_mass=1e-12, steps=100, shift_lambda=50
    )
    x = remove.positions * remove.h
    assert remove.masses.sum() + remove.out_mass == pytest.approx(1.0, abs=1e-12)
    assert (remove.masses * np.exp(-x)).sum() + add.out_mass == pytest.approx(1.0, abs=1e-12)
    assert add.masses.sum() + add.out_mass == pytest.approx(1.0, abs=1e-12)


def test_wide_bins_only_in_the_tails() -> None:
    remove, _ = discretise(
        StepPair(0.004, 0.8), h=1e-5, out_mass=1e-14, steps=10**5, shift_lambda=4e3
    )
    gaps = np.diff(remove.positions)
    dense = slice(remove.dense_start, remove.dense_stop)
    assert np.all(np.diff(remove.positions[dense]) == 1)
    assert remove.masses[dense].sum() > 0.9
    assert gaps.max() > 1 and remove.positions.size < 20_000


def test_conditional_bias() -> None:
    """c(r) = max over the position u in the bin of E[Ỹ − Y | u] = r·(1−e^{−ur})/(1−e^{−r}) − ur."""
    for r in [1e-6, 1e-3, 0.1, 1.0, 5.0]:
        u = np.linspace(0, 1, 200_001)
        brute = np.max(r * -np.expm1(-u * r) / -np.expm1(-r) - u * r)
        assert conditional_bias(r) == pytest.approx(brute, rel=1e-6, abs=1e-18)
    assert conditional_bias(1e-3) == pytest.approx(1e-6 / 8, rel=1e-3)


@pytest.mark.parametrize(
    "runs",
    [
        [(256 / 60000, 1.1, 3000)],
        [(0.01, 0.7, 400), (0.05, 2.0, 100), (0.002, 1.0, 5000)],
    ],
)
def test_band_limited_and_full_spectra_agree(runs: list[tuple[float, float, int]]) -> None:
    """Dropping the certified-negligible frequencies moves δ by no more than the bound says."""
    k = sum(c for _, _, c in runs)
    h = 2e-4
    remove, _ = discretise_steps(
        [StepPair(q, z) for q, z, _ in runs],
        [c for _, _, c in runs],
        h=h,
        out_mass=1e-13,
        shift_lambda=math.sqrt(8 * 20 / k) / h,
    )
    counts = np.array([c for _, _, c in runs])
    kw = {"gaussian_mu": 0.0, "eta_wrap": 1e-11, "eta_band": 1e-11, "eta_shift": 1e-9}
    band = compose(remove, counts, max_points=1 << 24, **kw)
    full = compose(remove, counts, max_points=1 << 24, method="full", **kw)
    assert band.method == "band" and full.method == "full" and band.band < band.size // 8
    for eps in [0.0, 0.3, 0.8, 1.5, 2.5]:
        allowed = band.band_error + band.float_error + full.float_error
        assert abs(band.delta(eps) - full.delta(eps)) <= allowed


@pytest.mark.slow
def test_add_direction_matches_dp_accounting() -> None:
    """The composed add side (law of −L under Q) against dp-accounting's add PMF."""
    q, z, k, h = 0.05, 0.9, 200, 1e-4
    _, add = discretise_steps(
        [StepPair(q, z)], [k], h=h, out_mass=1e-14, shift_lambda=math.sqrt(8 * 20 / k) / h
    )
    kw = {"gaussian_mu": 0.0, "eta_wrap": 1e-13, "eta_band": 1e-13, "eta_shift": 1e-11}
    ours = compose(add, np.array([k]), max_points=1 << 24, **kw)
    pld = dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
        z, sampling_prob=q, value_discretization_interval=1e-4
    ).self_compose(k)
    for eps in [0.0, 0.5, 1.0, 2.0]:
        theirs = pld._pmf_add.get_delta_for_epsilon(eps)  # the add side alone
        assert ours.delta(eps) <= ours.delta(eps) + ours.upper_slack
        assert theirs == pytest.approx(ours.delta(eps), rel=2e-3, abs=1e-12)


def _hockey_stick(q: float, z: float, x: np.ndarray, y: np.ndarray, gamma: float) -> float:
    """H_γ(P‖Q) for P = (1−q)N(0, z²I) + qN(x, z²I), Q = (1−q)N(0, z²I) + qN(y, z²I) in 2-D."""
    grid = np.linspace(-7 * z - 1.5, 7 * z + 1.5, 1001)
    step = grid[1] - grid[0]
    u, v = np.meshgrid(grid, grid, indexing="ij")

    def density(mean: np.ndarray) -> np.ndarray:
        return norm.pdf(u, mean[0], z) * norm.pdf(v, mean[1], z)

    zero = density(np.zeros(2))
    p = (1 - q) * zero + q * density(x)
    qq = (1 - q) * zero + q * density(y)
    return float(np.maximum(p - gamma * qq, 0.0).sum() * step * step)


@pytest.mark.slow
@pytest.mark.parametrize("q, z, eps", [(0.1, 1.0, 0.5), (0.3, 0.7, 1.0)])
def test_replace_one_antipodal_pair_is_the_worst_case(q: float, z: float, eps: float) -> None:
    """Replacing record x by x' (‖x‖, ‖x'‖ ≤ 1): the hockey-stick divergence of the
    Poisson-subsampled Gaussian is largest for x' = −x with ‖x‖ = 1, the pair the accountant
    uses; checked against other angles, shorter records, and removal (x' = 0)."""
    gamma = math.exp(eps)
    unit = np.array([1.0, 0.0])
    worst = _hockey_stick(q, z, unit, -unit, gamma)
    others = [np.array([math.cos(a), math.sin(a)]) for a in (0.5, 1.5, 2.5, 3.0)]
    others += [-0.6 * unit, np.zeros(2)]
    for y in others:
        assert _hockey_stick(q, z, unit, y, gamma) <= worst + 1e-7
    assert _hockey_stick(q, z, 0.7 * unit, -0.7 * unit, gamma) <= worst + 1e-7
    # and the 1-D pair of the accountant gives the same number
    exact = exact_deltas(q, z, True, eps)[0]
    assert worst == pytest.approx(exact, abs=1e-5)  # the quadrature is accurate to ~1e-6
