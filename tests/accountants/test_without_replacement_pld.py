"""The PLD accountant on fixed-size batches (sampling without replacement, replace-one).

References (each test names its own):

* Brute force: a population of n = 4 scalar records, batches of b = 2, every dataset with values
  in {−1, 0, 1} and every replacement of record 0; the mechanism's exact output densities (a
  mixture over the 6 batches of N(sum, z²), one or two independent steps) and their
  hockey-stick divergence by quadrature on a grid. The accountant's δ(ε) must never be below it.
* A lower bound: the neighbours "every other record +1, record 0 is −1 in x and +1 in x′" release
  the remove pair of a Poisson-subsampled Gaussian (q = b/n, noise z/2) at every step;
  dp-accounting's optimistic PLD of that pair (losses rounded down) lower-bounds its ε, so the
  accountant's ε must be at least that.
* The RDP bound of Wang, Balle & Kasiviswanathan (dpledger's rdp accountant): the PLD bound is
  an independent certificate, and tighter at these settings.
"""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy.stats import norm

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.accountants import make_accountant
from dpledger.accountants.pld import PldAccountant
from dpledger.accountants.without_replacement_pld import without_replacement_pld
from dpledger.errors import InvalidParameterError


def _ledger(b: int, n: int, z: float, steps: int):
    led = PrivacyLedger(neighboring="replace_one")
    for _ in range(steps):
        led.record_sample(event=SamplingEvent.fixed_size(b, n))
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=z)
    return led.compressed()


def _batch_sums(values: tuple[float, ...], b: int) -> np.ndarray:
    return np.array(
        [sum(values[i] for i in s) for s in itertools.combinations(range(len(values)), b)]
    )


def _density(x: np.ndarray, sums: np.ndarray, z: float) -> np.ndarray:
    return norm.pdf(x[..., None], loc=sums, scale=z).mean(axis=-1)


def _exact_delta(n: int, b: int, z: float, epsilon: float, steps: int) -> float:
    """max over datasets in {−1, 0, 1}^n and replacements of record 0 of the steps-fold
    hockey-stick divergence, by the trapezoid rule on a grid (steps ∈ {1, 2}). The batch sums'
    distribution depends on the other records only as a multiset, so multisets suffice."""
    grid = np.linspace(-b - 8.0 * z, b + 8.0 * z, 4001 if steps == 1 else 801)
    h = grid[1] - grid[0]
    best = 0.0
    for others in itertools.combinations_with_replacement((-1.0, 0.0, 1.0), n - 1):
        for v, w in itertools.permutations((-1.0, 0.0, 1.0), 2):
            p = _density(grid, _batch_sums((v, *others), b), z)
            q = _density(grid, _batch_sums((w, *others), b), z)
            if steps == 2:
                p, q = np.outer(p, p), np.outer(q, q)
            gap = np.maximum(p - math.exp(epsilon) * q, 0.0)
            best = max(best, float(gap.sum()) * h**steps)
    return best


@pytest.mark.parametrize("steps", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("epsilon", [0.0, 0.5, 1.5])
def test_never_below_the_brute_force_of_a_tiny_population(steps: int, epsilon: float) -> None:
    """Brute force (module docstring), n = 4, b = 2, z = 1: the accountant's δ(ε) is at least
    the exact δ(ε) of every dataset pair, beyond the quadrature's error (1e-6 here)."""
    exact = _exact_delta(4, 2, 1.0, epsilon, steps)
    ours = PldAccountant(value_discretization_interval=1e-3).delta(
        _ledger(2, 4, 1.0, steps), epsilon=epsilon
    )
    assert ours.kind.value == "upper_bound"
    assert ours.delta >= exact - 1e-6
    assert ours.delta <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize(("b", "n", "z", "steps"), [(10, 100, 1.0, 20), (32, 1000, 0.8, 100)])
def test_between_the_realised_lower_bound_and_the_rdp_bound(b, n, z, steps) -> None:
    """The realised pair's optimistic PLD (a lower bound) ≤ the accountant's ε ≤ the RDP bound."""
    delta = 1e-5
    led = _ledger(b, n, z, steps)
    ours = PldAccountant(value_discretization_interval=1e-3).epsilon(led, delta=delta).epsilon
    rdp = make_accountant("rdp").epsilon(led, delta=delta).epsilon
    logging.disable(logging.WARNING)  # dp-accounting notes the optimistic construction
    try:
        lower = pld_lib.from_gaussian_mechanism(
            z / 2.0,
            sampling_prob=b / n,
            pessimistic_estimate=False,
            use_connect_dots=False,
            value_discretization_interval=1e-3,
        ).self_compose(steps)
    finally:
        logging.disable(logging.NOTSET)
    assert float(lower.get_epsilon_for_delta(delta)) <= ours < rdp


def test_pair_is_the_product_of_the_two_directions() -> None:
    """The PLD is symmetric and its δ(ε) exceeds both directions of the Poisson pair at z/2
    (dropping a coordinate of the product is a post-processing)."""
    pair = without_replacement_pld(0.05, 1.2, value_discretization_interval=1e-3)
    half = pld_lib.from_gaussian_mechanism(
        0.6, sampling_prob=0.05, value_discretization_interval=1e-3
    )
    for eps in (0.0, 0.3, 1.0):
        assert pair.get_delta_for_epsilon(eps) >= half.get_delta_for_epsilon(eps)


@pytest.mark.slow
def test_mnist_setting_is_tighter_than_rdp_and_above_the_lower_bound() -> None:
    """b = 256, n = 60,000, z = 1.1, T = 2000, δ = 1e-5: RDP gives 10.91; the pair realised by
    two datasets has ε ≥ 6.26 (benchmarks/bounds_bench.py); the PLD bound lies between."""
    led = _ledger(256, 60_000, 1.1, 2000)
    ours = make_accountant("pld").epsilon(led, delta=1e-5)
    rdp = make_accountant("rdp").epsilon(led, delta=1e-5)
    assert ours.kind.value == "upper_bound"
    assert 6.26 <= ours.epsilon < rdp.epsilon
    assert rdp.epsilon / ours.epsilon > 1.5


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"sampling_ratio": 0.0}, "sampling_ratio"),
        ({"sampling_ratio": 1.5}, "sampling_ratio"),
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"noise_multiplier": math.inf}, "noise_multiplier"),
    ],
)
def test_bad_input_is_refused(kwargs: dict, name: str) -> None:
    args = {"sampling_ratio": 0.1, "noise_multiplier": 1.0, **kwargs}
    with pytest.raises(InvalidParameterError, match=name):
        without_replacement_pld(
            args["sampling_ratio"], args["noise_multiplier"], value_discretization_interval=1e-3
        )
