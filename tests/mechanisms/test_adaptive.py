"""Adaptive clipping (Andrew et al. 2021): convergence to the target quantile, and its ledger."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpledger import PrivacyLedger
from dpledger.errors import InvalidParameterError
from dpledger.ledger import SumQueryEvent
from dpledger.mechanisms import AdaptiveClipping, sampled_step
from dpledger.mechanisms.adaptive import adaptive_noise_multiplier
from dpledger.mechanisms.backend import NumpyBackend

BE = NumpyBackend()


def make(**overrides: object) -> AdaptiveClipping:
    kwargs: dict = {
        "initial_l2_norm_bound": 1.0,
        "target_unclipped_quantile": 0.5,
        "noise_multiplier": 1.0,
        "count_noise_stddev": 10.0,
        "expected_batch_size": 100.0,
    }
    kwargs.update(overrides)
    return AdaptiveClipping(**kwargs)


def test_main_noise_multiplier_leaves_the_step_at_the_target_z() -> None:
    z, sigma_b = 1.1, 5.0
    z_delta = adaptive_noise_multiplier(noise_multiplier=z, count_noise_stddev=sigma_b)
    assert z_delta == pytest.approx((z**-2 - (2 * sigma_b) ** -2) ** -0.5, rel=1e-15)
    assert z_delta > z
    adaptive = make(noise_multiplier=z, count_noise_stddev=sigma_b)
    assert adaptive.main_noise_multiplier == z_delta
    assert adaptive.effective_noise_multiplier == pytest.approx(z, rel=1e-14)


def test_a_step_records_the_main_query_and_the_count_query() -> None:
    ledger = PrivacyLedger()
    rng = np.random.default_rng(0)
    adaptive = make(label="grads", expected_batch_size=20.0)
    bounds = []
    for _ in range(3):
        with sampled_step(
            ledger, sampling_probability=0.2, population_size=100, generator=rng
        ) as step:
            bounds.append(adaptive.l2_norm_bound)
            step.run(adaptive, [rng.normal(size=(20, 5)), rng.normal(size=(20,))])
    for step_events, bound in zip(ledger.steps(), bounds, strict=True):
        main, count = step_events.queries
        assert main == SumQueryEvent(bound, adaptive.main_noise_multiplier * bound, "grads")
        assert count == SumQueryEvent(0.5, 10.0, "unclipped_count")
        assert step_events.noise_multiplier == pytest.approx(1.0, rel=1e-14)
    assert len(set(bounds)) == 3  # the bound moved every step


def test_staged_release_is_bit_identical_to_run() -> None:
    rng = np.random.default_rng(1)
    records = [rng.normal(size=(30, 4)) * 3, rng.normal(size=(30, 2))]
    outputs, final_bounds, ledgers = [], [], []
    for staged in (False, True):
        ledger = PrivacyLedger()
        ledger.record_sample(sampling_probability=0.3, population_size=100)
        adaptive = make(expected_batch_size=30.0)
        gen = np.random.default_rng(2)
        if staged:
            q = adaptive.query
            norms = q.group_norms(norms=[BE.record_norms(x) for x in records])
            factors = q.clip_factors(norms)
            sums = [BE.weighted_sum(x, factors) for x in records]
            out = adaptive.release(sums, norms=norms, ledger=ledger, generator=gen)
        else:
            out = adaptive.run(records, ledger=ledger, generator=gen)
        outputs.append(out)
        final_bounds.append(adaptive.l2_norm_bound)
        ledgers.append(list(ledger.events()))
    for a, b in zip(*outputs, strict=True):
        np.testing.assert_array_equal(a, b)
    assert final_bounds[0] == final_bounds[1] and ledgers[0] == ledgers[1]


def test_update_is_geometric() -> None:
    adaptive = make(initial_l2_norm_bound=2.0, target_unclipped_quantile=0.7, learning_rate=0.5)
    assert adaptive.update(0.7) == 2.0
    assert adaptive.update(0.2) == pytest.approx(2.0 * math.exp(0.25))
    assert adaptive.query.l2_norm_bound == adaptive.l2_norm_bound
    assert adaptive.update(1.0) == pytest.approx(2.0 * math.exp(0.25 - 0.15))


def test_release_count_is_the_noised_centred_count() -> None:
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.1)
    adaptive = make(initial_l2_norm_bound=1.0, expected_batch_size=8.0)
    norms = np.array([0.5, 1.0, 1.5, 2.0, 0.1, 3.0, 0.9, 4.0])  # 4 of 8 within the bound
    assert adaptive.unclipped_count(norms) == 4
    got = adaptive.release_count(norms, ledger=ledger, generator=np.random.default_rng(3))
    noise = 10.0 * np.random.default_rng(3).standard_normal()
    assert got == pytest.approx(min(1.0, max(0.0, (4 - 4 + noise) / 8.0 + 0.5)))
    assert next(iter(ledger.steps())).queries == (SumQueryEvent(0.5, 10.0, "unclipped_count"),)
    assert adaptive.l2_norm_bound == 1.0  # release_count alone does not update


@pytest.mark.statistical
def test_converges_to_the_target_quantile_of_log_normal_norms() -> None:
    """The bound settles at the γ-quantile of the norms, within its stationary fluctuation."""
    rng = np.random.default_rng(4)
    gamma, eta, batch, sigma_b, log_sd, steps = 0.7, 0.2, 1000, 10.0, 1.0, 300
    adaptive = make(
        initial_l2_norm_bound=0.01,  # five log-units below the target
        target_unclipped_quantile=gamma,
        learning_rate=eta,
        count_noise_stddev=sigma_b,
        expected_batch_size=float(batch),
    )
    ledger = PrivacyLedger()
    pooled = []
    for _ in range(steps):
        norms = np.exp(rng.normal(0.0, log_sd, size=batch))
        pooled.append(norms)
        ledger.record_sample(sampling_probability=0.1, population_size=10 * batch)
        fraction = adaptive.release_count(norms, ledger=ledger, generator=rng)
        adaptive.update(fraction)
    late = np.concatenate(pooled[steps // 2 :])
    target = float(np.quantile(late, gamma))
    # Linearised dynamics of u_t = log C_t − log c*: u_{t+1} = ρ u_t + e_t with
    # ρ = 1 − η·g (g = density of log-norm at the quantile) and sd(e) = η·sd(b̄_t).
    g = stats.norm.pdf(stats.norm.ppf(gamma)) / log_sd
    rho = 1.0 - eta * g
    step_sd = eta * math.sqrt(gamma * (1 - gamma) / batch + (sigma_b / batch) ** 2)
    stationary_sd = step_sd / math.sqrt(1.0 - rho**2)
    deviation = abs(math.log(adaptive.l2_norm_bound) - math.log(target))
    assert deviation <= 5 * stationary_sd
    unclipped = float(np.mean(late <= adaptive.l2_norm_bound))
    assert abs(unclipped - gamma) <= 5 * stationary_sd * g + 5 * math.sqrt(
        gamma * (1 - gamma) / late.size
    )
    # every step's count query is in the ledger
    assert all(
        s.queries == (SumQueryEvent(0.5, sigma_b, "unclipped_count"),) for s in ledger.steps()
    )
    assert ledger.num_steps == steps


@pytest.mark.parametrize(
    ("overrides", "parameter"),
    [
        ({"initial_l2_norm_bound": 0.0}, "initial_l2_norm_bound"),
        ({"target_unclipped_quantile": 1.5}, "target_unclipped_quantile"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"count_noise_stddev": 0.5, "noise_multiplier": 1.0}, "count_noise_stddev"),
        ({"count_noise_stddev": math.nan}, "count_noise_stddev"),
        ({"expected_batch_size": 0.0}, "expected_batch_size"),
        ({"label": "c", "count_label": "c"}, "count_label"),
        ({"count_label": None}, "count_label"),
        ({"clipping": "local"}, "clipping"),
    ],
)
def test_bad_adaptive_parameters(overrides: dict, parameter: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        make(**overrides)
    assert err.value.parameter == parameter


def test_bad_update_and_norms() -> None:
    adaptive = make()
    with pytest.raises(InvalidParameterError, match="unclipped_fraction"):
        adaptive.update(1.2)
    with pytest.raises(InvalidParameterError, match="norms"):
        adaptive.unclipped_count([1.0, math.nan])
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.1)
    with pytest.raises(InvalidParameterError, match="norms"):
        adaptive.release(
            [np.zeros(2)], norms=[-1.0], ledger=ledger, generator=np.random.default_rng()
        )
    assert ledger.num_events == 1 and adaptive.l2_norm_bound == 1.0
    assert "AdaptiveClipping" in repr(adaptive)
