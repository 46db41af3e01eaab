"""The sampler audit: shuffled fixed-size batches versus Poisson batches at the same q and z.

References: the closed form of the shuffled run's last iterate (in units of η·C/b the score is
N(E, T·z²) with the canary and N(0, T·z²) without, i.e. μ-GDP with μ = E/(z√T); the exact ε(δ)
of μ-GDP from Dong, Roth & Su 2019, Corollary 2.13, computed here with scipy), the Poisson
ledger's ε recomputed by the PRV accountant from an independently built ledger, Chua et al.'s
lower bound (:func:`~dpledger.accountants.shuffle_bound.shuffle_epsilon_lower_bound`), and the
binomial law of the number of audits (each valid with probability ≥ 95%) whose bound exceeds
the true ε.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from scipy.stats import binom, norm

pytest.importorskip("torch", reason="the PyTorch audits need the torch extra")
pytest.importorskip("sklearn", reason="the digits audits need scikit-learn")

from dpledger.accountants import make_accountant
from dpledger.accountants.shuffle_bound import shuffle_epsilon_lower_bound
from dpledger.audit import run_distinguishing_game
from dpledger.audit.torch_sampler_audit import (
    SamplerAudit,
    ledger_claim,
    run_sampler_audit,
    run_sampler_digits,
    train_sampler_digits,
)
from dpledger.errors import InvalidParameterError
from dpledger.ledger.events import SamplingScheme
from dpledger.ledger.steps import CompressedLedger
from tests.gdp_oracle import gaussian_epsilon

CONFIDENCE = 0.95


def test_shuffled_runs_hold_the_canary_in_exactly_one_batch_per_epoch():
    """Record N − 1 (canary or blank) is in one batch of every shuffled epoch, in both worlds;
    in Poisson runs its count per epoch varies (Binomial(T_e, q): with T_e = 10, q = 0.1 the
    chance that 8 epochs all hold it exactly once is 0.387⁸ < 1e-3)."""
    for include in (True, False):
        for seed in range(3):
            config = SamplerAudit(sampler="shuffle", noise_multiplier=1.0, epochs=3)
            run = run_sampler_digits(config, include_canary=include, seed=seed)
            assert run.canary_steps_per_epoch == (1, 1, 1)
            assert run.updates.shape == (config.steps,)
    poisson = SamplerAudit(sampler="poisson", noise_multiplier=1.0, epochs=8)
    counts = run_sampler_digits(poisson, include_canary=True, seed=0).canary_steps_per_epoch
    assert len(counts) == 8 and set(counts) != {1}


def test_ledgers_record_the_sampler_and_the_claims_follow():
    """Poisson runs record Poisson steps (add/remove) and are certified by PRV at the ε of an
    independently built ledger; shuffled runs record shuffle steps with one epoch start per
    epoch (replace-one), PRV refuses them, and the claim carries Chua et al.'s bound and the
    no-amplification RDP bound, which is at least the exact ε of E replace-one Gaussian
    mechanisms (μ = 2√E/z)."""
    delta = 1e-5
    poisson = SamplerAudit(sampler="poisson", noise_multiplier=1.0, epochs=2)
    ledger = run_sampler_digits(poisson, include_canary=True, seed=0).ledger
    assert ledger.neighboring.value == "add_remove"
    assert {r.scheme for r in ledger.compressed().runs} == {SamplingScheme.POISSON}
    claim = ledger_claim(ledger, delta=delta)
    reference = CompressedLedger.from_runs([(0.1, 1.0, 20)])
    assert claim.epsilon == make_accountant("prv").epsilon(reference, delta=delta).epsilon
    assert claim.refusal is None and claim.gap is None

    shuffle = SamplerAudit(sampler="shuffle", noise_multiplier=1.0, epochs=2)
    ledger = run_sampler_digits(shuffle, include_canary=False, seed=0).ledger
    assert ledger.neighboring.value == "replace_one"
    runs = ledger.compressed().runs
    assert {r.scheme for r in runs} == {SamplingScheme.SHUFFLE}
    assert sum(r.count for r in runs) == 20
    assert sum(bool(r.sampling.epoch_start) for r in runs for _ in range(r.count)) == 2
    claim = ledger_claim(ledger, delta=delta)
    assert claim.epsilon is None and claim.refusal
    assert claim.gap is not None
    assert claim.gap.lower_bound is not None
    assert claim.gap.lower_bound.epsilon == shuffle_epsilon_lower_bound(
        batches_per_epoch=10, epochs=2, noise_multiplier=1.0, delta=delta, neighboring="replace_one"
    )
    assert claim.no_amplification_epsilon >= gaussian_epsilon(2 * math.sqrt(2) / 1.0, delta)
    assert "PRV refuses" in claim.describe()


@pytest.mark.slow
@pytest.mark.statistical
def test_shuffled_last_iterate_is_the_closed_form_gaussian_and_its_bounds_are_valid():
    """Tiny setting: N = 20, b = 10 (T_e = 2), E = 1, z = 0.5, so μ = E/(z√T) = √2 and the true
    ε at δ = 1e-2 is that of √2-GDP (3.71). Ten audits of 30 runs per side (master seeds 0..9):
    the scores' means and variances match N(1, 2z²) and N(0, 2z²) within four standard errors,
    and the number of audits whose Clopper–Pearson bound exceeds 3.71 is at most the 99.9%
    quantile of Binomial(10, 0.05) (each audit is wrong with probability ≤ 5%)."""
    delta = 1e-2
    config = SamplerAudit(sampler="shuffle", noise_multiplier=0.5, batch_size=10, num_records=19)
    mu = config.shuffled_last_iterate_mu()
    assert mu == pytest.approx(math.sqrt(2))
    true_eps = gaussian_epsilon(mu, delta)
    var = config.steps * config.noise_multiplier**2
    audits, with_canary, without = 10, [], []
    exceed = 0
    for seed in range(audits):
        game = run_distinguishing_game(
            functools.partial(train_sampler_digits, config=config), runs_per_side=30, seed=seed
        )
        with_canary.append(game.scores_with_canary)
        without.append(game.scores_without_canary)
        bound = game.epsilon_lower_bound(
            delta=delta, confidence=CONFIDENCE, selection=config.preregistered_thresholds()
        )
        exceed += bound.epsilon > true_eps
    for scores, mean in ((np.concatenate(with_canary), 1.0), (np.concatenate(without), 0.0)):
        k = scores.size
        assert abs(scores.mean() - mean) < 4 * math.sqrt(var / k)
        assert abs(scores.var(ddof=1) - var) < 4 * var * math.sqrt(2 / (k - 1))
    assert exceed <= binom.ppf(0.999, audits, 1 - CONFIDENCE)


@pytest.mark.slow
def test_the_last_iterate_cannot_show_the_shuffle_gap_but_the_ledger_does():
    """Few epochs, small z (q = 0.1, E = 1, z = 1): Chua et al.'s lower bound (4.34, add/remove)
    exceeds the Poisson PRV ε (≈ 2.85), but the exact ε of the shuffled last iterate
    (μ = √(E·q)/z = 0.316: ≈ 1.2) is below it, so no audit of the last iterate can show the gap.
    The audits of both samplers (40 runs per side, fixed seed) stay below their runs' claims."""
    delta = 1e-5
    results = {
        s: run_sampler_audit(
            SamplerAudit(sampler=s, noise_multiplier=1.0), runs_per_side=40, seed=0, delta=delta
        )
        for s in ("poisson", "shuffle")
    }
    poisson_eps = results["poisson"].claim.epsilon
    shuffle = results["shuffle"]
    chua = shuffle_epsilon_lower_bound(
        batches_per_epoch=10, epochs=1, noise_multiplier=1.0, delta=delta
    )
    assert chua > poisson_eps > gaussian_epsilon(shuffle.config.shuffled_last_iterate_mu(), delta)
    gap = shuffle.claim.gap
    assert gap.lower_bound.epsilon >= chua  # replace-one is at least add/remove's bound
    # the gap compares like with like: the shuffled (replace-one) ledger's Poisson ε is the
    # replace-one one, above the add/remove ε of the Poisson run
    assert gap.relation.value == "replace_one" and gap.poisson_epsilon.epsilon > poisson_eps
    assert results["poisson"].clopper_pearson.epsilon <= poisson_eps
    assert shuffle.clopper_pearson.epsilon <= shuffle.claim.no_amplification_epsilon
    assert shuffle.gaussian_dp.assumption is not None


@pytest.mark.slow
@pytest.mark.statistical
def test_every_step_shuffled_audits_stay_below_the_deterministic_batch_bound():
    """Every step observed, N = 20, b = 10, E = 2, z = 0.5: with the canary in one batch per
    epoch the zero-out pair is at most E Gaussian mechanisms of sensitivity C (adaptive
    composition, Dong et al. 2019), μ = √E/z = 2√2, ε = 7.84 at δ = 1e-2. Five audits of 40 runs
    per side: the number whose Clopper–Pearson bound exceeds it is at most the 99.9% quantile of
    Binomial(5, 0.05); the likelihood-ratio scores are higher with the canary on average."""
    delta = 1e-2
    config = SamplerAudit(
        sampler="shuffle", noise_multiplier=0.5, num_records=19, epochs=2,
        observation="every_step",
    )  # fmt: skip
    ceiling = gaussian_epsilon(math.sqrt(config.epochs) / config.noise_multiplier, delta)
    exceed = 0
    for seed in range(5):
        game = run_distinguishing_game(
            functools.partial(train_sampler_digits, config=config), runs_per_side=40, seed=seed
        )
        bound = game.epsilon_lower_bound(
            delta=delta, confidence=CONFIDENCE, selection=config.preregistered_thresholds()
        )
        exceed += bound.epsilon > ceiling
        assert game.scores_with_canary.mean() > game.scores_without_canary.mean()
    assert exceed <= binom.ppf(0.999, 5, 1 - CONFIDENCE)


def test_claims_of_compressed_ledgers_and_bad_inputs():
    """ledger_claim takes a compressed ledger too (PRV on the same ledger as reference);
    run_sampler_audit refuses what is not a SamplerAudit."""
    ledger = CompressedLedger.from_runs([(0.1, 1.0, 10)])
    claim = ledger_claim(ledger, delta=1e-5)
    assert claim.epsilon == make_accountant("prv").epsilon(ledger, delta=1e-5).epsilon
    assert claim.describe().startswith("ε ≤ ")
    with pytest.raises(InvalidParameterError):
        run_sampler_audit("config", runs_per_side=1, seed=0)  # type: ignore[arg-type]


def test_every_step_scores_are_the_likelihood_ratios():
    """The every-step score is the log-likelihood ratio of the canary's presence given the
    per-step updates (shuffle: a mixture over the epoch's batches; Poisson: per step)."""
    w = np.array([0.3, -0.2, 1.1, 0.4])
    z, t = 0.8, 2
    shuffle = SamplerAudit(
        sampler="shuffle", noise_multiplier=z, batch_size=2, num_records=3, epochs=2,
        observation="every_step",
    )  # fmt: skip
    ratio = lambda v: norm.pdf(v, 1.0, z) / norm.pdf(v, 0.0, z)  # noqa: E731
    expected = sum(math.log(np.mean([ratio(v) for v in w[e * t : (e + 1) * t]])) for e in (0, 1))
    assert shuffle.score(w) == pytest.approx(expected, rel=1e-12)
    poisson = SamplerAudit(
        sampler="poisson", noise_multiplier=z, batch_size=2, num_records=3, epochs=2,
        observation="every_step",
    )  # fmt: skip
    expected = sum(math.log(0.5 + 0.5 * ratio(v)) for v in w)
    assert poisson.score(w) == pytest.approx(expected, rel=1e-12)


def test_configuration_checks():
    with pytest.raises(InvalidParameterError):
        SamplerAudit(sampler="fixed", noise_multiplier=1.0)
    with pytest.raises(InvalidParameterError):
        SamplerAudit(sampler="shuffle", noise_multiplier=1.0, batch_size=7)  # 7 ∤ 100
    with pytest.raises(InvalidParameterError):
        SamplerAudit(sampler="shuffle", noise_multiplier=0.0)
    with pytest.raises(InvalidParameterError):
        SamplerAudit(sampler="shuffle", noise_multiplier=1.0, observation="all")
    with pytest.raises(InvalidParameterError):
        SamplerAudit(sampler="shuffle", noise_multiplier=1.0, canary_norm=0.5)
    with pytest.raises(InvalidParameterError):
        run_sampler_digits("config", include_canary=True, seed=0)  # type: ignore[arg-type]
    config = SamplerAudit(sampler="poisson", noise_multiplier=1.0, epochs=3)
    assert (config.sampling_probability, config.steps, config.score_unit()) == (0.1, 30, 0.1)


@pytest.mark.slow
def test_the_claims_module_is_framework_free():
    """dpledger.audit.sampler_claims imports neither torch nor tensorflow (docs/architecture.md,
    "Soundness rules", rule 2)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    code = (
        "import sys, dpledger.audit.sampler_claims\n"
        "print(sorted(m for m in ('torch', 'tensorflow') if m in sys.modules))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
