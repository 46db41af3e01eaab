"""Audit of the sampler: shuffled fixed-size batches versus Poisson batches, same q and z.

The ledger certifies Poisson-sampled DP-SGD with amplification by subsampling but refuses to
credit shuffled batches (each record in exactly one batch per epoch, a fresh permutation per
epoch) with it; for them it gives the *lower* bound of Chua et al. (ICML 2024, NeurIPS 2024;
:mod:`dpledger.accountants.shuffle_bound`). Annamalai et al. (2024, "To Shuffle or not to
Shuffle: Auditing DP-SGD with Shuffling") audit shuffled training empirically. This module runs
the distinguishing game (:func:`~dpledger.audit.audit_game.run_distinguishing_game`) for both
samplers on the white-box gradient canary of :mod:`dpledger.audit.torch_last_iterate` and sets
the audited lower bounds beside what the ledger claims for each run.

The setting (:class:`SamplerAudit`): N = n + 1 records, the first n digits and a last record
that is the canary (x = M·e_k, loss −o_y, gradient −M·e_y e_kᵀ at every θ, clipped to C) or,
in the other world, a blank record with the same loss and x = 0, whose gradient is 0. This is the
zero-out pair of Chua et al.: the batch structure is the same in both worlds (N = b·T_e, T_e
batches per epoch), which the shuffled sampler needs; it is a replace-one pair and, with a
zero-gradient record and the fixed denominator of the average, an add/remove pair for Poisson.
Both samplers run E epochs of T_e = N/b steps at q = b/N and z, and every step's average
divides by b (= q·N). In units of η·C/b the update of the canary's weight at step t is

    w_t = 1{the canary is in batch t} + N(0, z²)

(no digit touches the weight: pixel k is blank in every digit). With shuffling the canary is in
exactly one batch per epoch; with Poisson in each batch independently with probability q.

Two observations (``observation``):

* ``"last_iterate"``: only the final model, score Σ_t w_t. Shuffled: N(E, T·z²) with the
  canary and N(0, T·z²) without (T = E·T_e; exactly, up to the float32 rounding of the
  weights), i.e. μ-GDP with μ = E/(z√T) = √(E·q)/z. Poisson: K + N(0, T·z²),
  K ~ Binomial(T, q), a mixture that separates worse.
* ``"every_step"``: every update (the threat model the ledger's ε covers: DP-SGD releases every
  noisy gradient), scored by the log-likelihood ratio of the canary's presence, fixed by the
  configuration before any run: Σ_e log((1/T_e) Σ_t exp((w_{e,t} − ½)/z²)) for shuffled epochs
  and Σ_t log(1 − q + q·exp((w_t − ½)/z²)) for Poisson steps (the Neyman–Pearson tests of the
  two mechanisms' zero-out pairs).

What the game can show. Per epoch the χ² divergence of the shuffled pair is (e^{1/z²} − 1)/T_e
and that of the Poisson pair (1 + (e^{1/z²} − 1)/T_e²)^{T_e} − 1, the same to first order, so
the bulk of their score distributions, which a game of R runs per side sees, is nearly the
same: the shuffled mechanism is less private in the *tails*, at probabilities of order δ, and a
Clopper–Pearson bound reaches at most about log(R/3). The shuffled last iterate's exact ε
(μ-GDP above) lies below the Poisson ledger's ε at every q, E and z we tried, and in the
benchmark's settings at δ = 1e-5 so does the best bound that an every-step audit of 10⁴ runs per
side could reach (``benchmarks/RESULTS.md``): the gap is shown by Chua et al.'s analytic lower
bound, which the ledger reports, not by the game.

:func:`run_sampler_audit` returns the Clopper–Pearson and Gaussian-DP bounds (the latter assumes
a Gaussian trade-off curve, exact only for the shuffled last iterate) with the run ledger's
claim (:class:`LedgerClaim`). Shuffled runs record into a replace-one ledger, the relation the
torch adapter analyses shuffling under.
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import Executor
from typing import Any

import attrs
import numpy as np
import torch
from scipy.special import logsumexp

from dpledger.adapters.torch.batch_samplers import ShuffleBatchSampler
from dpledger.adapters.torch.poisson import PoissonBatchSampler
from dpledger.audit.audit_game import GameScores, run_distinguishing_game
from dpledger.audit.privacy_bounds import BoundMethod, EpsilonLowerBound
from dpledger.audit.sampler_claims import LedgerClaim, ledger_claim
from dpledger.audit.threshold_selection import BonferroniThresholds
from dpledger.audit.torch_audit_common import (
    _NUM_FEATURES,
    _digits_tensors,
    _set_threads,
    _train_with_canaries,
    _zero_linear,
)
from dpledger.audit.torch_last_iterate import LastIterateDigitsAudit
from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.events import SamplingScheme
from dpledger.validation import check_positive_finite, check_positive_int

__all__ = [
    "OBSERVATIONS",
    "SAMPLERS",
    "LedgerClaim",
    "SamplerAudit",
    "SamplerAuditResult",
    "SamplerAuditRun",
    "ledger_claim",
    "run_sampler_audit",
    "run_sampler_digits",
    "train_sampler_digits",
]

SAMPLERS = ("poisson", "shuffle")
"""``"poisson"``: :class:`PoissonBatchSampler`; ``"shuffle"``: :class:`ShuffleBatchSampler`."""
OBSERVATIONS = ("last_iterate", "every_step")
"""What the adversary sees: the final model only, or every update."""


def _sampler(value: Any) -> str:
    if value not in SAMPLERS:
        raise InvalidParameterError("sampler", value, f"one of {SAMPLERS}")
    return str(value)


def _observation(value: Any) -> str:
    if value not in OBSERVATIONS:
        raise InvalidParameterError("observation", value, f"one of {OBSERVATIONS}")
    return str(value)


@attrs.frozen(kw_only=True)
class SamplerAudit:
    """Configuration of :func:`train_sampler_digits` (see the module docstring).

    Attributes:
        sampler: ``"poisson"`` or ``"shuffle"``.
        noise_multiplier: z = σ̃/C of every step (> 0).
        batch_size: b; q = b/N with N = ``num_records`` + 1, which b must divide.
        epochs: E ≥ 1 (T = E·N/b steps).
        num_records: n, the digits used (the canary or the blank record is the (n + 1)-th).
        observation: ``"last_iterate"`` or ``"every_step"``.
        l2_norm_bound: C.
        learning_rate: η (scores are in units of η·C/b, so η does not change them).
        canary_norm: M ≥ C.
        canary_label: y.
        implementation: ``"correct"`` or ``"batch_size_bug"``.
        torch_threads: PyTorch intra-op threads (None leaves them alone).

    Raises:
        InvalidParameterError: a value outside the ranges above, or b not dividing N.
    """

    sampler: str = attrs.field(converter=_sampler)
    noise_multiplier: float = attrs.field(
        converter=lambda v: check_positive_finite("noise_multiplier", v)
    )
    batch_size: int = attrs.field(
        default=10, converter=lambda v: check_positive_int("batch_size", v)
    )
    epochs: int = attrs.field(default=1, converter=lambda v: check_positive_int("epochs", v))
    num_records: int = attrs.field(
        default=99, converter=lambda v: check_positive_int("num_records", v)
    )
    observation: str = attrs.field(default="last_iterate", converter=_observation)
    l2_norm_bound: float = 1.0
    learning_rate: float = 1.0
    canary_norm: float = 10.0
    canary_label: int = 0
    implementation: str = "correct"
    torch_threads: int | None = 1

    def __attrs_post_init__(self) -> None:
        n = self.population_size
        if self.batch_size > n or n % self.batch_size:
            raise InvalidParameterError(
                "batch_size", self.batch_size, f"a divisor of N = num_records + 1 = {n}"
            )
        self.canary_audit()  # checks the remaining attributes

    @property
    def population_size(self) -> int:
        """N = n + 1: the digits and the canary (or the blank record)."""
        return self.num_records + 1

    @property
    def batches_per_epoch(self) -> int:
        """T_e = N / b."""
        return self.population_size // self.batch_size

    @property
    def sampling_probability(self) -> float:
        """The nominal q = b / N of both samplers."""
        return self.batch_size / self.population_size

    @property
    def steps(self) -> int:
        """T = E·T_e."""
        return self.epochs * self.batches_per_epoch

    @property
    def neighboring(self) -> str:
        """The run's ledger relation: add/remove for Poisson, replace-one for shuffling."""
        return "add_remove" if self.sampler == "poisson" else "replace_one"

    def canary_audit(self) -> LastIterateDigitsAudit:
        """The last-iterate audit whose canary (pixel, label, norm, gradient) this one uses."""
        return LastIterateDigitsAudit(
            noise_multiplier=self.noise_multiplier,
            sampling_probability=self.sampling_probability,
            steps=self.steps,
            l2_norm_bound=self.l2_norm_bound,
            learning_rate=self.learning_rate,
            canary_norm=self.canary_norm,
            canary_label=self.canary_label,
            num_records=self.num_records,
            implementation=self.implementation,
            torch_threads=self.torch_threads,
        )

    def score_unit(self) -> float:
        """η·C/b: how far one clipped canary gradient moves its weight in one step."""
        return self.learning_rate * self.l2_norm_bound / self.batch_size

    def shuffled_last_iterate_mu(self) -> float:
        """μ = E/(z√T): the shuffled last iterate is exactly μ-GDP (see the module docstring)."""
        return self.epochs / (self.noise_multiplier * math.sqrt(self.steps))

    def score(self, updates: np.ndarray) -> float:
        """The run's score from its per-step updates w_t of the canary's weight (units η·C/b)."""
        w = np.asarray(updates, dtype=np.float64)
        if self.observation == "last_iterate":
            return float(w.sum())
        z2 = self.noise_multiplier**2
        if self.sampler == "shuffle":
            per_epoch = w.reshape(self.epochs, self.batches_per_epoch)
            return float(
                np.sum(logsumexp((per_epoch - 0.5) / z2, axis=1) - math.log(per_epoch.shape[1]))
            )
        q = self.sampling_probability
        log_keep = math.log1p(-q) if q < 1.0 else -math.inf
        return float(np.sum(np.logaddexp(log_keep, math.log(q) + (w - 0.5) / z2)))

    def preregistered_thresholds(self, *, count: int = 16) -> BonferroniThresholds:
        """Thresholds fixed by the configuration before any run.

        Last iterate: those of :meth:`LastIterateDigitsAudit.preregistered_thresholds` (½ and
        k/4 of the null standard deviation √T·z). Every step: log-likelihood ratios k/2,
        k = 0..count − 1.
        """
        if self.observation == "last_iterate":
            return self.canary_audit().preregistered_thresholds(count=count)
        count = check_positive_int("count", count)
        return BonferroniThresholds([0.5 * k for k in range(count)])


@attrs.frozen
class SamplerAuditRun:
    """One training run of a sampler audit.

    Attributes:
        score: the run's score (higher: canary more likely in).
        updates: w_t, the per-step updates of the canary's weight in units of η·C/b.
        canary_steps_per_epoch: per epoch, the steps whose batch held record N − 1 (the canary
            or the blank record).
        ledger: the run's ledger.
    """

    score: float
    updates: np.ndarray
    canary_steps_per_epoch: tuple[int, ...]
    ledger: PrivacyLedger


def _make_sampler(config: SamplerAudit, sampling_seed: int) -> Any:
    if config.sampler == "shuffle":
        return ShuffleBatchSampler(
            population_size=config.population_size,
            batch_size=config.batch_size,
            seed=sampling_seed,
        )
    return PoissonBatchSampler(
        population_size=config.population_size,
        sampling_probability=config.sampling_probability,
        steps=config.batches_per_epoch,
        seed=sampling_seed,
    )


def _check_ledger(config: SamplerAudit, ledger: PrivacyLedger, seed: int) -> None:
    """Raise unless the ledger records T steps of the configured sampler at z."""
    runs = ledger.compressed().runs
    want = SamplingScheme.SHUFFLE if config.sampler == "shuffle" else SamplingScheme.POISSON
    ok = (
        sum(r.count for r in runs) == config.steps
        and all(r.scheme is want for r in runs)
        and all(
            math.isclose(r.noise_multiplier, config.noise_multiplier, rel_tol=1e-12) for r in runs
        )
        and ledger.neighboring.value == config.neighboring
    )
    if not ok:
        raise LedgerStateError(
            f"the run with seed {seed} recorded {[(r.scheme.value, r.count) for r in runs]} "
            f"under {ledger.neighboring.value}, not {config.steps} {want.value} steps at "
            f"z = {config.noise_multiplier:g} under {config.neighboring}"
        )


def run_sampler_digits(config: SamplerAudit, *, include_canary: bool, seed: int) -> SamplerAuditRun:
    """Train once with the configured sampler; score the canary's weight's updates.

    The model is ``nn.Linear(64, 10, bias=False)`` initialised to zero; digits have the
    cross-entropy loss, record N − 1 the loss −o_y (the canary x = M·e_k, or the blank x = 0).
    Training is the DP-SGD loop of the other digits audits
    (:mod:`dpledger.audit.torch_audit_common`) with the configured sampler, E passes.

    Raises:
        InvalidParameterError: ``config`` is not a :class:`SamplerAudit`.
        LedgerStateError: the run's ledger does not record the configured steps.
    """
    if not isinstance(config, SamplerAudit):
        raise InvalidParameterError("config", config, "a SamplerAudit")
    _set_threads(config.torch_threads)
    canary = config.canary_audit()
    x, y = _digits_tensors(config.num_records)
    last = torch.zeros((1, _NUM_FEATURES), dtype=torch.float32)
    if include_canary:
        last[0, canary.canary_feature] = float(config.canary_norm)
    x = torch.cat([x, last])
    y = torch.cat([y, torch.tensor([config.canary_label], dtype=torch.int64)])
    special = config.population_size - 1
    is_special = torch.arange(config.population_size) == special
    model = _zero_linear()
    gradient = canary.gradient_canary()
    unit = config.score_unit()
    previous = [model.weight.detach().double().reshape(-1).numpy().copy()]
    updates: list[float] = []
    hits: list[int] = []

    def on_step(batch: list[int]) -> None:
        current = model.weight.detach().double().reshape(-1).numpy().copy()
        updates.append(gradient.score(previous[0], current, unit=unit))
        previous[0] = current
        hits.append(int(special in batch))

    ledger = _train_with_canaries(
        config,
        model,
        x=x,
        y=y,
        is_canary=is_special,
        sampling_probability=config.sampling_probability,
        seed=seed,
        steps=config.batches_per_epoch,
        make_sampler=functools.partial(_make_sampler, config),
        passes=config.epochs,
        neighboring=config.neighboring,
        on_step=on_step,
    )
    _check_ledger(config, ledger, seed)
    w = np.asarray(updates, dtype=np.float64)
    per_epoch = np.asarray(hits).reshape(config.epochs, config.batches_per_epoch).sum(axis=1)
    return SamplerAuditRun(
        score=config.score(w),
        updates=w,
        canary_steps_per_epoch=tuple(int(v) for v in per_epoch),
        ledger=ledger,
    )


def train_sampler_digits(include_canary: bool, seed: int, *, config: SamplerAudit) -> float:
    """The harness's ``train(include_canary, seed) -> score`` for a sampler audit.

    Use ``functools.partial(train_sampler_digits, config=...)``; see :func:`run_sampler_digits`.
    """
    return run_sampler_digits(config, include_canary=include_canary, seed=seed).score


@attrs.frozen
class SamplerAuditResult:
    """What :func:`run_sampler_audit` found for one sampler.

    Attributes:
        config: the audited configuration.
        game: the game's scores.
        clopper_pearson: the Clopper–Pearson lower bound (no assumption).
        gaussian_dp: the Gaussian-DP lower bound (assumes a Gaussian trade-off curve).
        claim: the ledger's claim for the run.
    """

    config: SamplerAudit
    game: GameScores
    clopper_pearson: EpsilonLowerBound
    gaussian_dp: EpsilonLowerBound
    claim: LedgerClaim


def run_sampler_audit(
    config: SamplerAudit,
    *,
    runs_per_side: int,
    seed: int,
    delta: float = 1e-5,
    confidence: float = 0.95,
    workers: int = 1,
    executor: Executor | None = None,
    progress: bool | None = False,
) -> SamplerAuditResult:
    """Run the game for ``config.sampler``, bound ε, and set the ledger's claim beside it.

    Args:
        config: the audit's configuration.
        runs_per_side: runs with the canary and as many with the blank record.
        seed: the game's master seed.
        delta: δ of the bounds and of the claim.
        confidence: the bounds' confidence.
        workers: local worker processes (1: inline).
        executor: any ``concurrent.futures.Executor`` instead of the local pool.
        progress: show progress (see :func:`run_distinguishing_game`).

    Returns:
        The bounds (Bonferroni over :meth:`SamplerAudit.preregistered_thresholds`) and the claim.
    """
    if not isinstance(config, SamplerAudit):
        raise InvalidParameterError("config", config, "a SamplerAudit")
    game = run_distinguishing_game(
        functools.partial(train_sampler_digits, config=config),
        runs_per_side=runs_per_side,
        seed=seed,
        workers=workers,
        executor=executor,
        chunk_size=10,
        progress=progress,
    )
    selection = config.preregistered_thresholds()
    cp, gdp = (
        game.epsilon_lower_bound(
            delta=delta, confidence=confidence, selection=selection, method=method
        )
        for method in (BoundMethod.CLOPPER_PEARSON, BoundMethod.GAUSSIAN_DP)
    )
    ledger = run_sampler_digits(config, include_canary=True, seed=seed).ledger
    return SamplerAuditResult(
        config=config,
        game=game,
        clopper_pearson=cp,
        gaussian_dp=gdp,
        claim=ledger_claim(ledger, delta=delta),
    )
