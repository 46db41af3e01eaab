"""The shuffled-batch lower bound: soundness against exact oracles, Monte Carlo, monotonicity.

References used as oracles (each test names its own):

* Balle & Wang (2018), "Improving the Gaussian Mechanism for Differential Privacy", Theorem 8:
  the exact δ(ε) of a Gaussian mechanism, δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), with
  μ = √E · sensitivity / σ for E compositions. With one batch per epoch the shuffled mechanism *is*
  that mechanism; with any number of batches, deterministic batching (each record in one batch per
  epoch, no amplification) is an upper bound on the shuffled mechanism's ε.
* Direct quadrature of the two-epoch hockey-stick divergence of the per-epoch maxima
  (Chua et al. 2024, arXiv:2411.04205, Theorem 3.8, with the densities written out below).
* Monte Carlo sampling of the one-epoch pair of Chua et al. (ICML 2024, arXiv:2403.17673).
* dp-accounting's RDP and PLD accountants for the Poisson-subsampled Gaussian.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from dpledger.accountants.shuffle_bound import (
    _threshold_caps,
    _threshold_delta,
    _threshold_masses,
    shuffle_delta_lower_bound,
    shuffle_epsilon_lower_bound,
)
from dpledger.errors import InvalidParameterError
from tests.gdp_oracle import gaussian_delta, gaussian_epsilon

_SENSITIVITY = {"add_remove": 1.0, "replace_one": 2.0}


# --------------------------------------------------------------------------- Gaussian limits
@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
@pytest.mark.parametrize("z", [0.3, 1.0, 4.0])
@pytest.mark.parametrize("epsilon", [0.0, 0.5, 2.0])
def test_one_batch_one_epoch_is_the_gaussian_mechanism(
    neighboring: str, z: float, epsilon: float
) -> None:
    """Balle & Wang (2018), Thm 8. T = 1, E = 1: the pair is N(2, z²) vs N(1, z²) (add/remove) or
    N(0, z²) (replace-one), for which the threshold sets are the Neyman–Pearson tests: the bound
    equals the exact δ up to the search over C, and never exceeds it."""
    exact = gaussian_delta(_SENSITIVITY[neighboring] / z, epsilon)
    ours = shuffle_delta_lower_bound(
        batches_per_epoch=1, epochs=1, noise_multiplier=z, epsilon=epsilon, neighboring=neighboring
    )
    assert ours <= exact
    assert ours == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
@pytest.mark.parametrize(("z", "epochs"), [(1.0, 4), (2.0, 9), (0.7, 3)])
def test_one_batch_many_epochs_is_below_and_near_the_composed_gaussian(
    neighboring: str, z: float, epochs: int
) -> None:
    """Balle & Wang (2018), Thm 8 with μ = √E·sensitivity/z. T = 1: E epochs are E Gaussian
    mechanisms. The composed bound (per-epoch maxima, here the outputs themselves, on loss bins of
    width 0.005) must not exceed the exact ε and must lose little: at most one bin per epoch."""
    mu = math.sqrt(epochs) * _SENSITIVITY[neighboring] / z
    for delta in (1e-3, 1e-6):
        exact = gaussian_epsilon(mu, delta)
        ours = shuffle_epsilon_lower_bound(
            batches_per_epoch=1, epochs=epochs, noise_multiplier=z, delta=delta,
            neighboring=neighboring,
        )  # fmt: skip
        assert ours <= exact
        assert ours >= exact - 0.005 * epochs
    for epsilon in (0.5, 2.0):
        exact_delta = gaussian_delta(mu, epsilon)
        ours_delta = shuffle_delta_lower_bound(
            batches_per_epoch=1, epochs=epochs, noise_multiplier=z, epsilon=epsilon,
            neighboring=neighboring,
        )  # fmt: skip
        assert ours_delta <= exact_delta


@pytest.mark.parametrize("neighboring", ["add_remove", "replace_one"])
@pytest.mark.parametrize(
    ("batches", "epochs", "z"), [(2, 1, 0.5), (10, 1, 0.8), (1000, 1, 0.35), (10, 3, 0.7),
                                 (234, 15, 1.1), (50, 6, 2.0)]
)  # fmt: skip
def test_never_above_deterministic_batching(
    neighboring: str, batches: int, epochs: int, z: float
) -> None:
    """Balle & Wang (2018), Thm 8. With every record in exactly one batch per epoch, the shuffled
    mechanism is a post-processing mixture of E Gaussian mechanisms of sensitivity S (add/remove)
    or 2S (replace-one), so that Gaussian ε is a valid upper bound and the lower bound is below."""
    mu = math.sqrt(epochs) * _SENSITIVITY[neighboring] / z
    for delta in (1e-2, 1e-5, 1e-9):
        ours = shuffle_epsilon_lower_bound(
            batches_per_epoch=batches, epochs=epochs, noise_multiplier=z, delta=delta,
            neighboring=neighboring,
        )  # fmt: skip
        assert 0.0 <= ours <= gaussian_epsilon(mu, delta)


# --------------------------------------------------------------------------- Monte Carlo
@pytest.mark.parametrize(("batches", "z", "epsilon"), [(4, 0.8, 1.0), (2, 0.5, 2.0)])
def test_threshold_delta_matches_monte_carlo(batches: int, z: float, epsilon: float) -> None:
    """Chua et al. (ICML 2024): one epoch of the shuffled mechanism on their pair of data sets is
    P = (1/T) Σ_t N(2e_t, z²I) vs Q = (1/T) Σ_t N(e_t, z²I). Sample both (fixed seed), estimate
    P(max > C) − e^ε Q(max > C) at the best threshold C of the grid, and compare with the closed
    form within 5 standard errors; the public bound (maximised over C) must be at least it."""
    caps = _threshold_caps(z, batches, 1.0)
    values = _threshold_delta(caps, epsilon, z, batches, 1.0)
    cap = float(caps[int(np.argmax(values))])
    p_closed, q_closed = _threshold_masses(np.array([cap]), z, batches, 1.0)
    closed = float(p_closed[0] - math.exp(epsilon) * q_closed[0])

    rng = np.random.default_rng(20240326)
    n = 400_000

    def exceed(mean: float) -> np.ndarray:
        w = rng.normal(0.0, z, size=(n, batches))
        w[np.arange(n), rng.integers(0, batches, size=n)] += mean
        return (w.max(axis=1) > cap).astype(float)

    p_hits, q_hits = exceed(2.0), exceed(1.0)
    estimate = p_hits.mean() - math.exp(epsilon) * q_hits.mean()
    se = math.sqrt(p_hits.var() / n + math.exp(2 * epsilon) * q_hits.var() / n)
    assert abs(estimate - closed) <= 5 * se
    public = shuffle_delta_lower_bound(
        batches_per_epoch=batches, epochs=1, noise_multiplier=z, epsilon=epsilon
    )
    assert public >= closed * (1 - 1e-12)


# --------------------------------------------------------------------------- two epochs
def _max_density(c: np.ndarray, mean: float, z: float, batches: int) -> np.ndarray:
    """Density of max_t w_t under (1/T) Σ_t N(mean·e_t, z²I): d/dc Φ((c − m)/z)·Φ(c/z)^{T−1}."""
    shifted, other = (c - mean) / z, c / z
    return (
        norm.pdf(shifted) / z * norm.cdf(other) ** (batches - 1)
        + (batches - 1) * norm.cdf(shifted) * norm.cdf(other) ** (batches - 2) * norm.pdf(other) / z
    )


@pytest.mark.slow
@pytest.mark.parametrize(("batches", "z", "epsilon"), [(2, 0.8, 0.5), (5, 0.6, 1.0)])
def test_two_epochs_against_quadrature_of_the_maxima(
    batches: int, z: float, epsilon: float
) -> None:
    """Chua et al. (NeurIPS 2024), Theorem 3.8: for E = 2 the bound is the hockey-stick divergence
    of the products of the per-epoch maxima' distributions. Integrate (f_P(m₁)f_P(m₂) −
    e^ε f_Q(m₁)f_Q(m₂))_+ on a fine grid (midpoint rule, spacing 0.002·z). The composed bound is a
    post-processing of that pair, so it is below (up to the quadrature error, < 1e-6 here) and,
    being fine, close to it."""
    h = 0.002 * z
    grid = np.arange(-6 * z, 2 + 9 * z, h) + h / 2
    fp, fq = _max_density(grid, 2.0, z, batches), _max_density(grid, 1.0, z, batches)
    integrand = np.outer(fp, fp) - math.exp(epsilon) * np.outer(fq, fq)
    oracle = float(np.sum(np.maximum(integrand, 0.0)) * h * h)
    ours = shuffle_delta_lower_bound(
        batches_per_epoch=batches, epochs=2, noise_multiplier=z, epsilon=epsilon
    )
    assert ours <= oracle + 1e-6
    assert ours >= oracle * (1 - 2e-3)


# --------------------------------------------------------------------------- Poisson comparison
def test_mnist_setting_exceeds_the_poisson_epsilon() -> None:
    """q = 256/60000 (T = 234 batches per epoch), z = 1.1, 15 epochs, δ = 1e-5 (the setting of
    TensorFlow Privacy's MNIST tutorial). The Poisson ε from dp-accounting (RDP and PLD, 15·234
    compositions of PoissonSampledDpEvent(q, GaussianDpEvent(z))) is 1.28 (RDP), 1.14 (PLD); the
    shuffled lower bound is 6.01, so the Poisson ε reported for a shuffled run is no guarantee."""
    from dp_accounting import dp_event
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    q, z, batches, epochs, delta = 256 / 60000, 1.1, 234, 15, 1e-5
    event = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), epochs * batches
    )
    rdp_eps = RdpAccountant().compose(event).get_epsilon(delta)
    pld_eps = PLDAccountant(value_discretization_interval=1e-3).compose(event).get_epsilon(delta)
    lower = shuffle_epsilon_lower_bound(
        batches_per_epoch=batches, epochs=epochs, noise_multiplier=z, delta=delta
    )
    assert 1.0 < pld_eps <= rdp_eps < 1.5
    assert lower > 4 * rdp_eps
    assert lower <= gaussian_epsilon(math.sqrt(epochs) / z, delta)


# --------------------------------------------------------------------------- monotonicity
@settings(max_examples=25, deadline=None)
@given(
    batches=st.integers(1, 60),
    epochs=st.integers(1, 3),
    z=st.floats(0.3, 3.0),
    factor=st.floats(1.0, 2.0),
    delta=st.sampled_from([1e-2, 1e-4, 1e-7]),
)
def test_epsilon_is_non_increasing_in_the_noise(
    batches: int, epochs: int, z: float, factor: float, delta: float
) -> None:
    """More noise is a post-processing (add independent noise to every batch sum), so the true
    ε is non-increasing in z; the bound must be too."""
    kwargs = {"batches_per_epoch": batches, "epochs": epochs, "delta": delta}
    low_noise = shuffle_epsilon_lower_bound(noise_multiplier=z, **kwargs)
    high_noise = shuffle_epsilon_lower_bound(noise_multiplier=z * factor, **kwargs)
    assert high_noise <= low_noise + 1e-9


@settings(max_examples=25, deadline=None)
@given(
    batches=st.integers(1, 60),
    epochs=st.integers(1, 3),
    extra=st.integers(1, 2),
    z=st.floats(0.3, 3.0),
    delta=st.sampled_from([1e-2, 1e-4, 1e-7]),
)
def test_epsilon_is_non_decreasing_in_the_epochs(
    batches: int, epochs: int, extra: int, z: float, delta: float
) -> None:
    """Dropping the last epochs is a post-processing, so the true ε is non-decreasing in E; the
    bound must be too."""
    kwargs = {"batches_per_epoch": batches, "noise_multiplier": z, "delta": delta}
    fewer = shuffle_epsilon_lower_bound(epochs=epochs, **kwargs)
    more = shuffle_epsilon_lower_bound(epochs=epochs + extra, **kwargs)
    assert more >= fewer - 1e-9


def test_delta_and_epsilon_agree() -> None:
    """ε_lower(δ) is the largest ε with δ_lower(ε) ≥ δ, rounded down: δ_lower at it is ≥ δ and a
    little above it is < δ."""
    for epochs in (1, 4):
        kwargs = {"batches_per_epoch": 20, "epochs": epochs, "noise_multiplier": 0.9}
        eps = shuffle_epsilon_lower_bound(delta=1e-4, **kwargs)
        assert shuffle_delta_lower_bound(epsilon=eps, **kwargs) >= 1e-4
        assert shuffle_delta_lower_bound(epsilon=eps + 1e-6, **kwargs) < 1e-4


def test_nothing_proven_gives_zero() -> None:
    """With huge noise the construction proves nothing at δ = 0.5: ε = 0 (trivially true)."""
    assert (
        shuffle_epsilon_lower_bound(
            batches_per_epoch=100, epochs=1, noise_multiplier=50.0, delta=0.5
        )
        == 0.0
    )


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("batches_per_epoch", 0),
        ("batches_per_epoch", 2.0),
        ("batches_per_epoch", True),
        ("epochs", 0),
        ("noise_multiplier", 0.0),
        ("noise_multiplier", math.inf),
        ("noise_multiplier", math.nan),
        ("delta", 0.0),
        ("delta", 1.0),
        ("neighboring", "substitution"),
    ],
)
def test_invalid_arguments_are_refused(name: str, value: object) -> None:
    kwargs: dict[str, object] = {
        "batches_per_epoch": 10,
        "epochs": 1,
        "noise_multiplier": 1.0,
        "delta": 1e-5,
    }
    kwargs[name] = value
    with pytest.raises(InvalidParameterError) as info:
        shuffle_epsilon_lower_bound(**kwargs)  # type: ignore[arg-type]
    assert info.value.parameter == name


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan, "1"])
def test_invalid_epsilon_is_refused(value: object) -> None:
    with pytest.raises(InvalidParameterError) as info:
        shuffle_delta_lower_bound(
            batches_per_epoch=10, epochs=1, noise_multiplier=1.0,
            epsilon=value,  # type: ignore[arg-type]
        )  # fmt: skip
    assert info.value.parameter == "epsilon"
