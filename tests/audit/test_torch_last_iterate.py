"""The last-iterate audit of the PyTorch adapter (crafted gradient canary, final model only).

References: the closed form of the mechanism (in units of η·C/(q·n) the score is
(n/N)·(K + N(0, T·z²)) with the canary, K ~ Binomial(T, q) and N = n + 1, and N(0, T·z²) without;
Cebere et al. 2025, Steinke et al. 2024), checked by means and variances with tolerances of four
standard errors; and the ledger's claim replayed by the PRV accountant for the verdicts.
"""

from __future__ import annotations

import functools
import math

import attrs
import numpy as np
import pytest

pytest.importorskip("torch", reason="the PyTorch audits need the torch extra")
pytest.importorskip("sklearn", reason="the digits audits need scikit-learn")

from dpledger.audit import audit_verdict, run_distinguishing_game
from dpledger.audit.torch_last_iterate import (
    LastIterateDigitsAudit,
    run_last_iterate_digits,
    train_last_iterate_digits,
)
from dpledger.errors import InvalidParameterError

DELTA = 1e-5
N = 300  # digits used: small, so that a run is fast


def _config(**kwargs):
    return LastIterateDigitsAudit.for_target_epsilon(
        target_epsilon=2.0, delta=DELTA, sampling_probability=0.2, steps=10, num_records=N, **kwargs
    )


def _game(config, runs):
    return run_distinguishing_game(
        functools.partial(train_last_iterate_digits, config=config), runs_per_side=runs, seed=0
    )


@pytest.mark.slow
@pytest.mark.statistical
def test_scores_follow_the_subsampled_canary_mechanism():
    config = _config()
    game = _game(config, 30)
    t, q, z = config.steps, config.sampling_probability, config.noise_multiplier
    shrink = N / (N + 1)
    cases = (
        (game.scores_with_canary, shrink * t * q, shrink**2 * (t * z * z + t * q * (1 - q))),
        (game.scores_without_canary, 0.0, t * z * z),
    )
    for scores, mean, var in cases:
        k = scores.size
        assert abs(scores.mean() - mean) < 4 * math.sqrt(var / k)
        # var of the sample variance ≈ 2σ⁴/(k − 1) (Gaussian; the Binomial part adds < 1%)
        assert abs(scores.var(ddof=1) - var) < 4 * var * math.sqrt(2 / (k - 1))


@pytest.mark.slow
def test_subsampled_last_iterate_audit_refutes_the_bug_and_not_the_correct_optimizer():
    """60 runs per side, q = 0.2, T = 10, claim ε = 2 (RDP): the under-noised optimizer's
    canary shows whenever it was sampled (P = 1 − 0.8¹⁰ ≈ 0.89), which Clopper–Pearson turns into
    ε ≥ 2.00 (55 of 60 caught, no false positive) against the PRV claim of 1.75; the correct
    optimizer's bound is 0."""
    for implementation, refuted in (("batch_size_bug", True), ("correct", False)):
        config = attrs.evolve(_config(), implementation=implementation)
        game = _game(config, 60)
        bound = game.epsilon_lower_bound(
            delta=DELTA, confidence=0.95, selection=config.preregistered_thresholds()
        )
        _, ledger = run_last_iterate_digits(config, include_canary=True, seed=0)
        verdict = audit_verdict(bound, ledger, accountant="prv")
        assert verdict.refuted is refuted, str(verdict)


def test_configuration_checks():
    with pytest.raises(InvalidParameterError):
        LastIterateDigitsAudit(noise_multiplier=1.0, sampling_probability=0.0)
    with pytest.raises(InvalidParameterError):
        LastIterateDigitsAudit(noise_multiplier=1.0, canary_norm=0.1)
    with pytest.raises(InvalidParameterError):
        run_last_iterate_digits("config", include_canary=True, seed=0)  # type: ignore[arg-type]
    config = _config()
    assert config.claimed_ledger().runs[0].sampling_probability == 0.2
    assert np.isclose(config.score_unit(), 1.0 / (0.2 * N))
