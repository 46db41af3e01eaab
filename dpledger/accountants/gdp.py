"""Gaussian-DP (μ-GDP) accountant: exact for full-batch steps, a CLT approximation otherwise.

The math
--------
Dong, Roth & Su (2019, "Gaussian Differential Privacy") call a mechanism μ-GDP when telling
neighbouring data sets apart from its output is at least as hard as telling N(0, 1) from
N(μ, 1). A Gaussian sum query with noise multiplier z (sensitivity S, noise N(0, (zS)²)) is exactly
(1/z)-GDP, and μ_t-GDP mechanisms compose exactly to √(Σ μ_t²)-GDP. So a ledger of full-batch
steps (q = 1) is exactly μ-GDP with

    μ = √(Σ_t 1 / z_t²),

and this accountant's answer for it is an upper bound (in fact tight).

For Poisson-subsampled steps there is no exact μ. Bu, Dong, Long & Su (2019, "Deep Learning with
Gaussian Differential Privacy") use the central limit theorem of Dong et al.: as T → ∞ with
q_t √T bounded, the composition tends to μ-GDP with

    μ² = Σ_t q_t² (e^{1/z_t²} − 1).

That limit is an approximation with no guarantee for a finite ledger, and it *understates* ε,
sometimes several-fold, for few steps, large q or small z. So results that use it have kind
``approximation``. Full-batch steps in a mixed ledger contribute their exact 1/z² to μ².

ε from μ at δ (Dong et al., Cor. 2.13): μ-GDP is (ε, δ(ε))-DP for all ε ≥ 0 with

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2);

ε(δ) solves δ(ε) = δ, rounded up so that δ(ε) ≤ δ holds after floating-point error too (the
enclosure of :mod:`dpledger.accountants.gaussian_profile`).

Certified lower bound
---------------------
When the CLT is used, the accountant (by default) also computes a *certified lower bound* on the
true ε of the same ledger and reports it as the result's ``lower``; when the GDP ε falls below
it, the result carries a warning saying so and by what factor. ``lower_bound=False`` turns it off.

The bound comes first from the PRV accountant (:mod:`dpledger.accountants.prv`), whose ``lower``
is certified by the error analysis of Gopi, Lee & Wutschitz (2021) and costs milliseconds. It
runs on a copy of the ledger with q rounded *down* and z rounded *up* onto a fine grid
(:func:`~dpledger.accountants.bucketing.optimistic_buckets`, relative precision 1e-3): a less
costly ledger, since the privacy curve of a subsampled Gaussian is monotone in q and z, so a lower
bound for it is one for the original, and it collapses ledgers with very many distinct steps.

If the PRV accountant cannot certify a bound (a failed numerical check), the bound falls back to
dp-accounting's PLD accountant machinery in its optimistic mode (``pessimistic_estimate=False``,
privacy-buckets discretisation): dp-accounting documents that mode as rounding every privacy loss
*down* to the grid, so its hockey-stick divergence δ_opt(ε) ≤ δ_true(ε) for every ε, hence
ε_opt(δ) ≤ ε_true(δ) — except that each (self-)composition still moves up to 10⁻¹⁵ of tail mass to
an infinite loss, which adds at most that much to δ_opt(ε) everywhere. So ε is read off at δ plus
that truncated mass M, and the bound is skipped when δ < 10·M (there the FFT round-off of the
composition is not small against δ either). It runs on a copy of the ledger
bucketed optimistically onto a coarse grid (``lower_bound_bucketing``), with a discretisation
interval chosen so that the rounding loss (less than the interval per composed step) stays near
10% of the GDP ε, but no finer than 10⁻³. Where that loss could exceed a quarter of the GDP ε,
or more than 16 distinct steps remain, or some z < 0.2, this fallback is skipped and the details
say why.

Replace-one: a full-batch step's sum changes by up to 2S, so it is exactly (2/z)-GDP and handled.
The CLT above is derived for add/remove, so subsampled steps under replace-one are refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpledger.accountants.base import Accountant, Answer, ResultKind
from dpledger.accountants.bucketing import check_bucketing, maybe_bucket, optimistic_buckets
from dpledger.accountants.budget import (
    BYTES_PER_POINT,
    DEFAULT_MEMORY_BUDGET,
    DEFAULT_TIME_BUDGET_S,
    SECONDS_PER_BUILT_POINT,
    SECONDS_PER_COMPOSED_POINT,
    check_memory_budget,
    check_time_budget,
    composed_points,
    gaussian_loss_width,
)
from dpledger.accountants.gaussian_profile import gaussian_delta_bounds, gaussian_epsilon_bounds
from dpledger.accountants.gdp_lower_bound import (
    _PLD_DELTA_FLOOR_FACTOR,
    _optimistic_pld,
    _prv_lower_bound,
)
from dpledger.errors import (
    DPLedgerError,
    InvalidParameterError,
    UnsupportedLedgerError,
)
from dpledger.ledger.events import NeighboringRelation
from dpledger.ledger.steps import CompressedLedger

__all__ = ["GdpAccountant", "gdp_delta", "gdp_epsilon", "gdp_mu"]

_MIN_INTERVAL = 1e-3
_MAX_INTERVAL = 1e-2
_MAX_LOWER_BOUND_RUNS = 16
_MIN_LOWER_BOUND_Z = 0.2


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) of a μ-GDP mechanism (0 for μ = 0, 1 for ∞),
    rounded up after floating-point error: the upper end of an enclosure of the closed form
    (:func:`~dpledger.accountants.gaussian_profile.gaussian_delta_bounds`), never below the exact
    value although its two terms cancel for small μ, and above it by less than the relative
    margin stated there."""
    if mu == 0.0:
        return 0.0
    if math.isinf(mu) or math.isnan(mu):
        return 1.0
    if math.isinf(epsilon):
        return 0.0
    return gaussian_delta_bounds(mu, epsilon)[1]


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ δ for a μ-GDP mechanism (∞ for μ = ∞), rounded up after
    floating-point error: δ(ε) ≤ δ is proven for the returned ε by an enclosure of the closed
    form (:func:`~dpledger.accountants.gaussian_profile.gaussian_epsilon_bounds`), not merely
    computed (the two terms of δ(ε) cancel for small μ)."""
    if mu == 0.0:
        return 0.0
    if math.isinf(mu) or math.isnan(mu):
        return math.inf
    return gaussian_epsilon_bounds(mu, delta)[1]


def _float_count(count: int) -> float:
    """A step count as a float (∞ beyond the float range: μ is then infinite anyway)."""
    try:
        return float(count)
    except OverflowError:
        return math.inf


def _mu_squared_parts(ledger: CompressedLedger) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per run: μ² contribution of one step, whether it is exact (full batch), step count.

    Counts are floats (a ledger may hold more steps than an int64 counts). The CLT term
    q²(e^{1/z²} − 1) is evaluated as exp(2 log q + log expm1(1/z²)), so a tiny q with a tiny z
    gives the right (possibly huge) number instead of 0 · ∞.
    """
    factor = 2.0 if ledger.neighboring is NeighboringRelation.REPLACE_ONE else 1.0
    runs = ledger.runs
    n = len(runs)
    q = np.fromiter((r.sampling_probability for r in runs), np.float64, n)
    z = np.fromiter((r.noise_multiplier for r in runs), np.float64, n)
    counts = np.fromiter((_float_count(r.count) for r in runs), np.float64, n)
    free = (q == 0.0) | np.isinf(z)
    full = (q == 1.0) & ~free
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv_sq = 1.0 / (z * z)
        # log(e^x − 1) = x + log1p(−e^{−x}), exact enough for x > 1 and never overflowing
        log_expm1 = np.where(
            inv_sq > 1.0, inv_sq + np.log1p(-np.exp(-inv_sq)), np.log(np.expm1(inv_sq))
        )
        clt = np.exp(2.0 * np.log(q) + log_expm1)
        per_step = np.where(full, factor * factor * inv_sq, clt)
    per_step = np.where(free, 0.0, per_step)
    return per_step, full | free, counts


def _total(per_step: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Σ count · μ² term, with 0 for steps that cost nothing (never ∞ · 0)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(per_step == 0.0, 0.0, per_step * counts)


def gdp_mu(ledger: CompressedLedger) -> tuple[float, bool]:
    """(μ, exact) of a ledger: exact when every costly step is full batch (see module docs)."""
    per_step, exact, counts = _mu_squared_parts(ledger)
    with np.errstate(over="ignore"):
        mu_sq = float(np.sum(_total(per_step, counts)))
    return math.sqrt(mu_sq), bool(np.all(exact))


class GdpAccountant(Accountant):
    """μ-GDP accountant (see the module docstring for the math and its limits).

    Args:
        lower_bound: compute a certified lower bound on ε (the PRV accountant's lower bound, or
            dp-accounting's optimistic PLD if PRV cannot certify one) when the CLT is used,
            report it as ``lower`` and warn if the GDP ε falls below it.
        lower_bound_interval: PLD discretisation interval for the fallback lower bound; None
            chooses it from the ledger (rounding loss ≈ 10% of the GDP ε, between 1e-3 and 1e-2).
        lower_bound_bucketing: relative grid (q rounded down, z up) applied to the ledger before
            the fallback PLD lower bound, to collapse distinct steps.
        bucketing: None, or a relative precision r: round q up and z down first (conservative).
        memory_budget: bytes each lower-bound computation (PRV, then the PLD fallback) may
            need (default 256 MiB); beyond it the bound is skipped and the details say why.
            The GDP number itself is closed-form.
        time_budget_s: seconds the lower bound may take in all (default 60): the PRV bound
            gets half, the PLD fallback what is left by its up-front estimate.
    """

    name = "gdp"
    default_kind = ResultKind.APPROXIMATION
    supports_replace_one = True

    def __init__(
        self,
        *,
        lower_bound: bool = True,
        lower_bound_interval: float | None = None,
        lower_bound_bucketing: float = 0.02,
        bucketing: float | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    ) -> None:
        if not isinstance(lower_bound, bool):
            raise InvalidParameterError("lower_bound", lower_bound, "True or False")
        if lower_bound_interval is not None and (
            isinstance(lower_bound_interval, bool)
            or not isinstance(lower_bound_interval, (int, float))
            or not 0.0 < lower_bound_interval <= 1.0
        ):
            raise InvalidParameterError(
                "lower_bound_interval",
                lower_bound_interval,
                "None (automatic) or a number in (0, 1]",
            )
        self.lower_bound = lower_bound
        self.lower_bound_interval = (
            None if lower_bound_interval is None else float(lower_bound_interval)
        )
        bucketing_lower = check_bucketing(lower_bound_bucketing, parameter="lower_bound_bucketing")
        if bucketing_lower is None:
            raise InvalidParameterError(
                "lower_bound_bucketing",
                lower_bound_bucketing,
                "a relative precision in (0, 1), e.g. 0.02 (the lower bound is always bucketed)",
            )
        self.lower_bound_bucketing = bucketing_lower
        self.bucketing = check_bucketing(bucketing)
        self.memory_budget = check_memory_budget(memory_budget)
        self.time_budget_s = check_time_budget(time_budget_s)

    def settings(self) -> dict[str, Any]:
        """The lower-bound settings and the bucketing precision."""
        return {
            "lower_bound": self.lower_bound,
            "lower_bound_interval": self.lower_bound_interval,
            "lower_bound_bucketing": self.lower_bound_bucketing,
            "bucketing": self.bucketing,
            "memory_budget": self.memory_budget,
            "time_budget_s": self.time_budget_s,
        }

    def check_supported(self, ledger: CompressedLedger) -> None:
        """Refuse Poisson-subsampled steps (0 < q < 1) under the replace-one relation."""
        super().check_supported(ledger)
        if ledger.neighboring is NeighboringRelation.REPLACE_ONE:
            for run in ledger.runs:
                if not run.releases_nothing and run.sampling_probability < 1.0:
                    raise UnsupportedLedgerError(
                        "the gdp accountant supports the replace-one relation only for full-batch "
                        f"steps (q = 1); this ledger has steps with q = {run.sampling_probability}"
                        " under replace-one, for which the central limit theorem it uses is not "
                        "derived; record the ledger under add_remove or use full batches"
                    )

    # ------------------------------------------------------------------ computation
    def _epsilon(self, ledger: CompressedLedger, delta: float) -> Answer:
        mu, exact = gdp_mu(maybe_bucket(ledger, self.bucketing))
        eps = gdp_epsilon(mu, delta)
        details: dict[str, Any] = {"mu": mu, "exact": exact}
        if exact:
            return Answer(eps, lower=eps, upper=eps, kind=ResultKind.UPPER_BOUND, details=details)
        lower: float | None = None
        warnings: tuple[str, ...] = ()
        if self.lower_bound:
            lower, info = self._lower_bound(ledger, gdp_value=eps, delta=delta)
            details.update(info)
            if lower is not None and eps < lower:
                factor = math.inf if eps == 0.0 else lower / eps
                warnings = (
                    f"the GDP (central limit theorem) ε = {eps:.4g} is below a certified lower "
                    f"bound ε ≥ {lower:.4g} for this ledger: it understates ε by a factor of at "
                    f"least {factor:.3g}; do not report it, use an upper-bound accountant",
                )
        return Answer(
            eps, lower=lower, kind=ResultKind.APPROXIMATION, warnings=warnings, details=details
        )

    def _delta(self, ledger: CompressedLedger, epsilon: float) -> Answer:
        mu, exact = gdp_mu(maybe_bucket(ledger, self.bucketing))
        delta = gdp_delta(mu, epsilon)
        details: dict[str, Any] = {"mu": mu, "exact": exact}
        if exact:
            lower = gaussian_delta_bounds(mu, epsilon)[0] if 0.0 < mu < math.inf else delta
            return Answer(
                delta, lower=lower, upper=delta, kind=ResultKind.UPPER_BOUND, details=details
            )
        return Answer(delta, kind=ResultKind.APPROXIMATION, details=details)

    def _epsilon_curve(
        self, ledger: CompressedLedger, delta: float, steps: Sequence[int]
    ) -> list[Answer]:
        """ε after each step count from cumulative μ² (no lower bound per point)."""
        per_step, exact, counts = _mu_squared_parts(maybe_bucket(ledger, self.bucketing))
        with np.errstate(over="ignore"):
            cum_mu_sq = np.cumsum(_total(per_step, counts))
        cum_steps = np.cumsum(counts)
        not_exact = np.cumsum(~exact & (per_step > 0))
        answers = []
        for t in steps:
            r = int(np.searchsorted(cum_steps, t, side="left"))
            before_steps = float(cum_steps[r - 1]) if r > 0 else 0.0
            before_mu = float(cum_mu_sq[r - 1]) if r > 0 else 0.0
            extra = (_float_count(t) - before_steps) * float(per_step[r]) if per_step[r] else 0.0
            mu = math.sqrt(before_mu + extra)
            is_exact = int(not_exact[r]) == 0
            eps = gdp_epsilon(mu, delta)
            kind = ResultKind.UPPER_BOUND if is_exact else ResultKind.APPROXIMATION
            bound = eps if is_exact else None
            answers.append(
                Answer(
                    eps,
                    lower=bound,
                    upper=bound,
                    kind=kind,
                    details={"mu": mu, "exact": is_exact},
                )
            )
        return answers

    # ------------------------------------------------------------------ lower bound
    def _lower_bound(
        self, ledger: CompressedLedger, *, gdp_value: float, delta: float
    ) -> tuple[float | None, dict[str, Any]]:
        """Certified lower bound on ε(δ): PRV's certified lower bound, else the PLD fallback."""
        if math.isinf(gdp_value):
            return None, {
                "lower_bound_skipped": "the GDP ε is infinite: nothing to certify against"
            }
        start = time.perf_counter()
        lower, info = _prv_lower_bound(
            ledger, delta, memory_budget=self.memory_budget, time_budget_s=self.time_budget_s / 2
        )
        if lower is not None:
            return lower, info
        time_left = self.time_budget_s - (time.perf_counter() - start)
        try:
            fallback, more = self._pld_lower_bound(
                ledger, gdp_value=gdp_value, delta=delta, time_left=time_left
            )
        except DPLedgerError as exc:  # a budget refusal: the bound is optional
            return None, {**info, "lower_bound_skipped": str(exc)}
        except (ArithmeticError, MemoryError, ValueError) as exc:
            return None, {
                **info,
                "lower_bound_skipped": f"the PLD lower bound failed: {type(exc).__name__}: {exc}",
            }
        return fallback, {**info, **more}

    def _pld_lower_bound(
        self,
        ledger: CompressedLedger,
        *,
        gdp_value: float,
        delta: float,
        time_left: float = math.inf,
    ) -> tuple[float | None, dict[str, Any]]:
        """Certified lower bound on ε(δ) (dp-accounting PLD, optimistic), or None if skipped.

        Rounding each step's privacy loss down by less than the interval lowers the composed loss
        by less than c = (subsampled steps) × interval, and then ε_opt(δ) ≥ ε_true(δ) − c. The
        bound is skipped (None, with the reason in the details) when even the finest allowed
        interval would make c exceed a quarter of the GDP ε, or when too many distinct steps
        remain after coarse bucketing — it would cost much and say little.
        """
        start = time.perf_counter()
        factor = 2.0 if ledger.neighboring is NeighboringRelation.REPLACE_ONE else 1.0
        subsampled_steps = sum(
            r.count for r in ledger.runs if not r.releases_nothing and r.sampling_probability < 1
        )
        scale = max(gdp_value, 0.05)
        interval = self.lower_bound_interval
        if interval is None:
            interval = min(_MAX_INTERVAL, max(_MIN_INTERVAL, 0.1 * scale / subsampled_steps))
        info: dict[str, Any] = {
            "lower_bound_method": "dp-accounting PLD, pessimistic_estimate=False",
            "lower_bound_interval": interval,
        }
        if self.lower_bound_interval is None and subsampled_steps * interval > 0.25 * scale:
            info["lower_bound_skipped"] = (
                f"{subsampled_steps} subsampled steps: an optimistic PLD at interval {interval:g} "
                "could lose more than a quarter of the GDP ε; set lower_bound_interval to force it"
            )
            return None, info
        coarse = optimistic_buckets(ledger, relative_precision=self.lower_bound_bucketing)
        costly = {k: c for k, c in coarse.distinct().items() if k[0] > 0.0 and math.isfinite(k[1])}
        info["lower_bound_distinct_runs"] = len(costly)
        smallest_z = min((z for (_q, z) in costly), default=math.inf)
        if smallest_z < _MIN_LOWER_BOUND_Z:
            info["lower_bound_skipped"] = (
                f"noise multiplier {smallest_z:g} < {_MIN_LOWER_BOUND_Z}: its privacy loss "
                "distribution is too wide to build cheaply"
            )
            return None, info
        if len(costly) > _MAX_LOWER_BOUND_RUNS:
            info["lower_bound_skipped"] = (
                f"{len(costly)} distinct steps after bucketing (limit {_MAX_LOWER_BOUND_RUNS}); "
                "raise lower_bound_bucketing to collapse them"
            )
            return None, info
        points, seconds, full_mu_sq = 0.0, 0.0, 0.0
        for (q, z), count in costly.items():
            if q < 1.0:
                single, composed = composed_points(q, z, float(count), interval)
                points = max(points, composed)
                seconds += single * SECONDS_PER_BUILT_POINT + composed * SECONDS_PER_COMPOSED_POINT
            else:
                full_mu_sq += float(count) * (factor / z) ** 2
        if full_mu_sq > 0.0:  # the full-batch steps form one Gaussian PLD
            single = gaussian_loss_width(math.sqrt(full_mu_sq)) / interval + 1.0
            points = max(points, single)
            seconds += single * (SECONDS_PER_BUILT_POINT + SECONDS_PER_COMPOSED_POINT)
        if points * BYTES_PER_POINT > self.memory_budget or seconds > min(
            time_left, self.time_budget_s
        ):
            info["lower_bound_skipped"] = (
                f"the optimistic PLD would need about {points:.3g} grid points and {seconds:.3g} s "
                f"(memory_budget={self.memory_budget}, {max(time_left, 0.0):.3g} s left of "
                f"time_budget_s={self.time_budget_s:g}); "
                "raise lower_bound_interval or the budgets to force it"
            )
            return None, info
        pld, truncated = _optimistic_pld(costly, factor=factor, interval=interval)
        if pld is not None and delta < _PLD_DELTA_FLOOR_FACTOR * truncated:
            info["lower_bound_skipped"] = (
                f"δ = {delta:g} is not large against the {truncated:g} of tail mass that "
                "dp-accounting's compositions move to an infinite loss (and their FFT "
                "round-off), so its optimistic δ(ε) is no lower bound there"
            )
            return None, info
        # Each composition puts up to its truncation mass at an infinite loss, even in the
        # optimistic mode, so δ_true(ε) ≥ δ_pld(ε) − truncated and ε_true(δ) ≥ ε_pld(δ + truncated).
        lower = (
            None
            if pld is None
            else max(0.0, float(pld.get_epsilon_for_delta(min(delta + truncated, 1.0))))
        )
        info["lower_bound_seconds"] = time.perf_counter() - start
        return lower, info
