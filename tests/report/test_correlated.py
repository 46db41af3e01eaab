"""The report of a ledger with correlated-noise releases: its attacker view counts every release
(never a bound from part of the ledger), and a curve that cannot be drawn over a release's
stream does not turn an accountant's ε into a refusal.

References: the closed-form trade-off of μ-GDP, TPR(α) = Φ(Φ⁻¹(α) + μ) (Dong, Roth & Su 2022,
Cor. 2.13), for an unamplified release (one Gaussian mechanism with μ = sens(C)·S/σ); and
dp-accounting's own PLD accountant on the ledger's ``to_dp_event()`` (a
``MixtureOfGaussiansDpEvent`` for an amplified BandMF release).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from scipy.special import ndtr, ndtri

from dpledger.accountants.base import make_accountant
from dpledger.accountants.pld import PldAccountant
from dpledger.cli import main
from dpledger.ledger import PrivacyLedger
from dpledger.mechanisms.correlated import (
    ParticipationSchema,
    optimize_banded_toeplitz,
    tree_factorization,
)
from dpledger.mechanisms.correlated.release import release_event
from dpledger.report import build_report, render_markdown, tradeoff
from tests.report.conftest import DELTA

H = PldAccountant().value_discretization_interval


def _tree(num_steps: int = 100, sigma: float = 4.0, clip: float = 1.0):  # type: ignore[no-untyped-def]
    return release_event(
        tree_factorization(num_steps, honaker=True),
        ParticipationSchema.single(num_steps=num_steps),
        l2_norm_bound=clip,
        noise_stddev=sigma,
    )


def _write(path: Path, *releases, steps: int = 0) -> Path:  # type: ignore[no-untyped-def]
    with PrivacyLedger(path) as ledger:
        for event in releases:
            ledger.record_correlated_release(event)
        for _ in range(steps):
            ledger.record_sample(sampling_probability=0.01, population_size=60_000)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    return path


def _gaussian_tpr(mu: float, alpha: float) -> float:
    return float(ndtr(ndtri(alpha) + mu))


@pytest.mark.slow
def test_a_tree_release_has_the_gaussian_tradeoff(tmp_path: Path) -> None:
    """One tree release is one Gaussian mechanism: TPR(α) = Φ(Φ⁻¹(α) + μ), within the PLD's
    pessimistic rounding of one loss by at most h (as for a full-batch step)."""
    event = _tree(100, sigma=2.0, clip=1.0)
    path = _write(tmp_path / "tree.dpl", event)
    report = build_report(path, delta=DELTA, accountants=["pld"], curve_points=2)
    view = report.tradeoff
    assert view is not None and view.accountant == "pld" and view.unavailable is None
    assert "1 correlated-noise release(s)" in view.basis
    mu = event.gaussian_mu
    for alpha, tpr in view.tpr_at_fpr:
        exact = _gaussian_tpr(mu, alpha)
        ceiling = _gaussian_tpr(mu, alpha * math.exp(H)) + 1e-15
        assert exact - 1e-15 <= tpr <= ceiling + 1e-15
    assert "no step releases anything" not in render_markdown(report)


def _dp_accounting_tpr(event: dp_accounting.DpEvent, alphas: list[float]) -> np.ndarray:
    """TPR at each α from dp-accounting's pessimistic PLD of ``event`` (an upper bound)."""
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=H)
    acc.compose(event)

    def delta_of(eps: np.ndarray) -> np.ndarray:
        return np.array([acc.get_delta(float(e)) for e in np.ravel(eps)])

    grid = tradeoff.epsilon_grid(4.0 * acc.get_epsilon(DELTA), points=201)
    return tradeoff.true_positive_rate(delta_of, alphas, grid, deltas=delta_of(grid))


@pytest.mark.slow
def test_a_bandmf_release_counts_in_the_tradeoff(tmp_path: Path) -> None:
    """An amplified BandMF release (Poisson sampling within b bands, k participations) is k
    Poisson-subsampled Gaussians with z = σ/(S·max_j ‖C_j‖) (Choquette-Choo et al. 2023,
    "Amplified Banded Matrix Factorization", section 4), here composed by dp-accounting's PLD
    accountant. Both are pessimistic PLDs on a grid of spacing h, each overstating δ(ε) by at
    most δ(ε − k·h) of the exact profile, so the report's TPR at α lies between
    dp-accounting's at α·e^(−k·h) and at α·e^(k·h)."""
    fact = optimize_banded_toeplitz(num_steps=48, bands=4)
    schema = ParticipationSchema.cyclic(num_steps=48, period=6)
    q, sigma, clip = 0.2, 1.0, 1.0
    event = release_event(
        fact, schema, l2_norm_bound=clip, noise_stddev=sigma, sampling_probability=q
    )
    path = _write(tmp_path / "bandmf.dpl", event)
    report = build_report(path, delta=DELTA, accountants=["pld"], curve_points=2)
    view = report.tradeoff
    assert view is not None and view.accountant == "pld" and view.unavailable is None
    k = event.max_participations
    z = sigma / (clip * event.max_column_norm)
    oracle = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), k
    )
    alphas = [a for a, _ in view.tpr_at_fpr]
    low = _dp_accounting_tpr(oracle, [a * math.exp(-k * H) for a in alphas])
    high = _dp_accounting_tpr(oracle, [a * math.exp(k * H) for a in alphas])
    for (alpha, tpr), lo, hi in zip(view.tpr_at_fpr, low, high, strict=True):
        assert lo - 1e-12 <= tpr <= hi + 1e-12
        assert tpr > 1.5 * alpha  # the release is not ignored


@pytest.mark.slow
def test_steps_and_a_release_count_together_and_the_curve_refusal_is_no_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """10 Poisson steps and a tree release: every accountant answers with its own ε (a curve
    over steps is not defined for a release, and says so), the command succeeds, and the TPR
    bound covers the whole ledger: at least the tree's alone (an attacker may ignore the
    steps, Φ(Φ⁻¹(α) + μ)), at most e^ε α + δ with the PLD accountant's ε."""
    event = _tree(100, sigma=2.0)
    path = _write(tmp_path / "mixed.dpl", event, steps=10)
    out = tmp_path / "out"
    code = main(["report", str(path), "--delta", str(DELTA), "--accountant", "pld,rdp",
                 "--curve", "2", "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0 and "every accountant refused" not in err
    data = json.loads((out / "report.json").read_text())
    ledger = PrivacyLedger.load(path)
    for row in data["accountants"]:
        assert row["refused"] is None and row["curve"] == []
        own = make_accountant(row["accountant"]).epsilon(ledger, delta=DELTA)
        assert row["epsilon"] == own.epsilon
        assert "correlated-noise release" in row["curve_unavailable"]
    text = (out / "report.md").read_text()
    assert "refused because" not in text and "pld: no curve: the ledger holds 1" in text
    view = data["tradeoff"]
    assert view["accountant"] == "pld" and view["unavailable"] is None
    pld_eps = next(r["epsilon"] for r in data["accountants"] if r["accountant"] == "pld")
    for alpha, tpr in view["tpr_at_fpr"]:
        assert _gaussian_tpr(event.gaussian_mu, alpha) - 1e-15 <= tpr
        assert tpr <= math.exp(pld_eps) * alpha + DELTA
