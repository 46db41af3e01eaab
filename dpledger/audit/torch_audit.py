"""Training functions for auditing the PyTorch adapter on scikit-learn's digits.

Each function trains a small model with :class:`~dpledger.adapters.torch.DPOptimizer` and Poisson
sampling (:class:`~dpledger.adapters.torch.PoissonBatchSampler`) on the 1797 bundled 8×8 digits,
with or without a canary record, and returns the score that
:func:`~dpledger.audit.audit_game.run_distinguishing_game` expects. They are module-level and
their configurations are frozen attrs classes, so ``functools.partial(train_…, config=…)`` is
picklable for worker processes started with ``"spawn"``, and its ``repr`` names the
configuration in the game's results file.

* :func:`train_black_box_digits` (configured by :class:`BlackBoxDigitsAudit`): multinomial
  logistic regression (``nn.Linear(64, 10)``, zero initialisation) trained with DP-SGD on D or on
  D ∪ {canary}, where the canary is an out-of-distribution record that lights only the pixels
  blank in every digit (:func:`~dpledger.audit.canaries.out_of_distribution_canary`); the score
  is the negative loss of the final model on the canary (black box).
* :func:`train_white_box_digits` (configured by :class:`WhiteBoxDigitsAudit`): the same data,
  full batches (q = 1), a linear model without bias, and a *gradient* canary: a record x_c =
  M·e_k on an always-blank pixel k whose per-example loss is −o_y (its logit for class y) instead
  of the cross-entropy. Its gradient with respect to the weights is −M·e_y e_kᵀ at every θ — a
  Dirac canary (:func:`~dpledger.audit.canaries.dirac_gradient_canary`) that clipping maps to
  exactly C on weight (y, k), which no digit touches. The score is the final model's movement
  along the canary in units of η·C/n (white box), N(T, T·z²) with the canary and N(0, T·z²)
  without (up to the factor n/(n + 1) with the canary: the average divides by the population
  size): the two Gaussians of μ-GDP with μ = √T/z.

Both take ``implementation="batch_size_bug"`` to train with :class:`UndernoisedDPOptimizer`,
the bug of Tramèr et al. (2022, §4): the noise is drawn B = q·n times too small while the ledger
records the correct σ̃, so the ledger claims the same ε as a correct run.

Every run checks that its ledger records exactly the steps its configuration claims
(:meth:`BlackBoxDigitsAudit.claimed_ledger`): T steps of sampling probability q and noise
multiplier z. So every run of an audit claims the same ε, the ε of the ledger of any one of them
(:func:`representative_ledger`), which is what the verdict compares the lower bound with.

Runs set PyTorch's intra-op threads to ``torch_threads`` (default 1): the models are far too small
to gain from threads, parallel audits run one process per core, and a fixed thread count keeps a
run's floating-point result the same inline and in a worker. Scores depend only on the
configuration and the seed.
"""

from __future__ import annotations

import logging
import math

import attrs
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger.audit.canaries import (
    GradientCanary,
    InputCanary,
    dirac_gradient_canary,
    loss_score,
    out_of_distribution_canary,
)
from dpledger.audit.threshold_selection import BonferroniThresholds
from dpledger.audit.torch_audit_common import (
    _NUM_CLASSES,
    _NUM_FEATURES,
    IMPLEMENTATIONS,
    CalibratedAuditConfig,
    UndernoisedDPOptimizer,
    _blank_feature,
    _check_canary_norm,
    _check_claim,
    _class_label,
    _digits_tensors,
    _implementation,
    _noise,
    _optional_records,
    _optional_threads,
    _positive,
    _positive_int,
    _sampling_probability,
    _set_threads,
    _train,
    _train_with_canaries,
    _zero_linear,
    digits_records,
)
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.steps import CompressedLedger
from dpledger.validation import check_positive_finite, check_positive_int

__all__ = [
    "IMPLEMENTATIONS",
    "AuditRun",
    "BlackBoxDigitsAudit",
    "UndernoisedDPOptimizer",
    "WhiteBoxDigitsAudit",
    "digits_records",
    "representative_ledger",
    "run_black_box_digits",
    "run_white_box_digits",
    "train_black_box_digits",
    "train_white_box_digits",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- configs
@attrs.frozen(kw_only=True)
class BlackBoxDigitsAudit(CalibratedAuditConfig):
    """Configuration of :func:`train_black_box_digits`.

    Attributes:
        noise_multiplier: z = σ̃/C of every step (> 0); or build with
            :meth:`for_target_epsilon`.
        sampling_probability: q of the Poisson sampler, in (0, 1].
        steps: T, the number of DP-SGD steps.
        l2_norm_bound: C.
        learning_rate: η of the wrapped ``torch.optim.SGD``.
        canary_magnitude: the value of the canary's pixels (the always-blank ones; real pixels
            lie in [0, 1]).
        canary_label: the canary's class.
        num_records: train on the first n digits (None: all 1797).
        implementation: ``"correct"`` or ``"batch_size_bug"`` (see the module docstring).
        torch_threads: PyTorch intra-op threads set by each run (None leaves them alone).
    """

    noise_multiplier: float = attrs.field(converter=_noise)
    sampling_probability: float = attrs.field(default=0.1, converter=_sampling_probability)
    steps: int = _positive_int("steps", 30)
    l2_norm_bound: float = _positive("l2_norm_bound", 1.0)
    learning_rate: float = _positive("learning_rate", 2.0)
    canary_magnitude: float = _positive("canary_magnitude", 8.0)
    canary_label: int = attrs.field(default=0, converter=_class_label)
    num_records: int | None = attrs.field(default=None, converter=_optional_records)
    implementation: str = attrs.field(default="correct", converter=_implementation)
    torch_threads: int | None = attrs.field(default=1, converter=_optional_threads)

    def canary(self) -> InputCanary:
        """The out-of-distribution canary: the always-blank pixels set to ``canary_magnitude``."""
        x, _ = digits_records(self.num_records)
        return out_of_distribution_canary(
            x, label=self.canary_label, magnitude=self.canary_magnitude
        )

    def claimed_ledger(self) -> CompressedLedger:
        """What every run records: T steps of (q, z). Its ε is the claim under audit."""
        return CompressedLedger.from_runs(
            [(self.sampling_probability, self.noise_multiplier, self.steps)]
        )


@attrs.frozen(kw_only=True)
class WhiteBoxDigitsAudit(CalibratedAuditConfig):
    """Configuration of :func:`train_white_box_digits` (full batches: q = 1).

    Attributes:
        noise_multiplier: z = σ̃/C of every step (> 0).
        steps: T, the number of full-batch DP-SGD steps.
        l2_norm_bound: C.
        learning_rate: η of the wrapped ``torch.optim.SGD`` (the score is in units of η·C/n, so
            η does not change it).
        canary_norm: M = ‖canary gradient‖, at least C (clipping then leaves exactly C).
        canary_label: y, the class whose weight the canary moves.
        num_records: train on the first n digits (None: all 1797).
        implementation: ``"correct"`` or ``"batch_size_bug"``.
        torch_threads: PyTorch intra-op threads set by each run (None leaves them alone).
    """

    noise_multiplier: float = attrs.field(converter=_noise)
    steps: int = _positive_int("steps", 1)
    l2_norm_bound: float = _positive("l2_norm_bound", 1.0)
    learning_rate: float = _positive("learning_rate", 1.0)
    canary_norm: float = _positive("canary_norm", 10.0)
    canary_label: int = attrs.field(default=0, converter=_class_label)
    num_records: int | None = attrs.field(default=None, converter=_optional_records)
    implementation: str = attrs.field(default="correct", converter=_implementation)
    torch_threads: int | None = attrs.field(default=1, converter=_optional_threads)

    def __attrs_post_init__(self) -> None:
        _check_canary_norm(self)

    @property
    def sampling_probability(self) -> float:
        """q = 1: every step uses every record."""
        return 1.0

    @property
    def canary_feature(self) -> int:
        """k: the first pixel that is blank in every training digit."""
        return _blank_feature(self.num_records)

    def canary_input(self) -> np.ndarray:
        """x_c = M·e_k."""
        x = np.zeros(_NUM_FEATURES)
        x[self.canary_feature] = self.canary_norm
        return x

    def gradient_canary(self) -> GradientCanary:
        """The canary's per-example gradient over the model's weight (10 × 64, row-major).

        The canary's loss is −o_y = −⟨w_y, x_c⟩, so its gradient is −M·e_y e_kᵀ at every θ: a
        Dirac canary of norm M and sign −1 on coordinate y·64 + k.
        """
        return dirac_gradient_canary(
            num_parameters=_NUM_CLASSES * _NUM_FEATURES,
            index=self.canary_label * _NUM_FEATURES + self.canary_feature,
            norm=self.canary_norm,
            sign=-1.0,
        )

    @property
    def base_population_size(self) -> int:
        """n = |D|, the number of digits without the canary."""
        return int(digits_records(self.num_records)[0].shape[0])

    def score_unit(self) -> float:
        """η·C/n: how far one clipped canary gradient moves the weights (n = |D| on both sides,
        so the unit does not depend on whether the canary was included)."""
        return self.learning_rate * self.l2_norm_bound / self.base_population_size

    def claimed_ledger(self) -> CompressedLedger:
        """What every run records: T steps of (q = 1, z). Its ε is the claim under audit."""
        return CompressedLedger.from_runs([(1.0, self.noise_multiplier, self.steps)])

    def claimed_mu(self) -> float:
        """μ = √T/z: the mechanism is exactly μ-GDP (T full-batch Gaussian steps)."""
        return math.sqrt(self.steps) / self.noise_multiplier

    def claimed_score_stddev(self) -> float:
        """√T·z: the standard deviation of the score (in units of η·C/n) that the claim implies."""
        return math.sqrt(self.steps) * self.noise_multiplier

    def preregistered_thresholds(
        self, *, count: int = 16, spacing: float = 0.25
    ) -> BonferroniThresholds:
        """Thresholds k·spacing·√T·z, k = 1..count, fixed by the claim before any run.

        They depend on the configuration only (not on any score), so the Bonferroni-corrected
        bound over them is valid (:class:`~dpledger.audit.threshold_selection.
        BonferroniThresholds`). The defaults span 0.25 to 4 claimed standard deviations: the
        middle suits the Gaussian-DP bound (whose μ estimate is most precise between the two
        means), the upper end the Clopper–Pearson bound (which needs a small FPR).
        """
        count = check_positive_int("count", count)
        spacing = check_positive_finite("spacing", spacing)
        scale = self.claimed_score_stddev()
        return BonferroniThresholds([k * spacing * scale for k in range(1, count + 1)])


# ---------------------------------------------------------------------------------- runs
@attrs.frozen
class AuditRun:
    """One training run of an audit.

    Attributes:
        score: the run's score (higher = canary more likely included).
        ledger: the run's ledger (in memory).
    """

    score: float
    ledger: PrivacyLedger


def run_black_box_digits(
    config: BlackBoxDigitsAudit, *, include_canary: bool, seed: int
) -> AuditRun:
    """Train the black-box audit's model once; score it by −(its loss on the canary).

    D is the digits (``config.num_records`` of them); D' = D ∪ {canary}, the canary last. The
    model is ``nn.Linear(64, 10)`` initialised to zero, trained for T steps of DP-SGD (plain SGD,
    cross-entropy, Poisson samples with rate q, clip C, noise z·C).

    Raises:
        LedgerStateError: the run's ledger does not record the claimed steps.
    """
    if not isinstance(config, BlackBoxDigitsAudit):
        raise InvalidParameterError("config", config, "a BlackBoxDigitsAudit")
    _set_threads(config.torch_threads)
    x, y = _digits_tensors(config.num_records)
    canary = config.canary()
    xc = torch.tensor(canary.features, dtype=torch.float32).unsqueeze(0)
    yc = torch.tensor([canary.label], dtype=torch.int64)
    if include_canary:
        x, y = torch.cat([x, xc]), torch.cat([y, yc])
    model = nn.Linear(_NUM_FEATURES, _NUM_CLASSES)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    labels = y

    def loss_of(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, labels[batch])

    ledger = _train(
        model=model,
        x=x,
        y=y,
        loss_of=loss_of,
        sampling_probability=config.sampling_probability,
        steps=config.steps,
        noise_multiplier=config.noise_multiplier,
        l2_norm_bound=config.l2_norm_bound,
        learning_rate=config.learning_rate,
        implementation=config.implementation,
        seed=seed,
    )
    _check_claim(ledger, config.claimed_ledger(), seed)
    with torch.no_grad():
        loss = F.cross_entropy(model(xc), yc)
    return AuditRun(score=loss_score(float(loss)), ledger=ledger)


def run_white_box_digits(
    config: WhiteBoxDigitsAudit, *, include_canary: bool, seed: int
) -> AuditRun:
    """Train the white-box audit's model once; score it by its movement along the canary.

    The model is ``nn.Linear(64, 10, bias=False)`` initialised to zero, trained with T full-batch
    DP-SGD steps. Digits have the cross-entropy loss; the canary x_c = M·e_k has the loss −o_y,
    whose gradient is the fixed −M·e_y e_kᵀ. The score is
    :meth:`~dpledger.audit.canaries.GradientCanary.score` in units of η·C/n.

    Raises:
        LedgerStateError: the run's ledger does not record the claimed steps.
    """
    if not isinstance(config, WhiteBoxDigitsAudit):
        raise InvalidParameterError("config", config, "a WhiteBoxDigitsAudit")
    _set_threads(config.torch_threads)
    x, y = _digits_tensors(config.num_records)
    n = int(y.shape[0])
    if include_canary:
        xc = torch.tensor(config.canary_input(), dtype=torch.float32).unsqueeze(0)
        x = torch.cat([x, xc])
        y = torch.cat([y, torch.tensor([config.canary_label], dtype=torch.int64)])
    is_canary = torch.arange(int(y.shape[0])) >= n
    model = _zero_linear()
    initial = model.weight.detach().double().reshape(-1).numpy().copy()
    ledger = _train_with_canaries(
        config, model, x=x, y=y, is_canary=is_canary, sampling_probability=1.0, seed=seed
    )
    _check_claim(ledger, config.claimed_ledger(), seed)
    final = model.weight.detach().double().reshape(-1).numpy()
    score = config.gradient_canary().score(initial, final, unit=config.score_unit())
    return AuditRun(score=score, ledger=ledger)


def train_black_box_digits(
    include_canary: bool, seed: int, *, config: BlackBoxDigitsAudit
) -> float:
    """The harness's ``train(include_canary, seed) -> score`` for a black-box audit.

    Use ``functools.partial(train_black_box_digits, config=...)``; see
    :func:`run_black_box_digits`.
    """
    return run_black_box_digits(config, include_canary=include_canary, seed=seed).score


def train_white_box_digits(
    include_canary: bool, seed: int, *, config: WhiteBoxDigitsAudit
) -> float:
    """The harness's ``train(include_canary, seed) -> score`` for a white-box audit.

    Use ``functools.partial(train_white_box_digits, config=...)``; see
    :func:`run_white_box_digits`.
    """
    return run_white_box_digits(config, include_canary=include_canary, seed=seed).score


def representative_ledger(
    config: BlackBoxDigitsAudit | WhiteBoxDigitsAudit, *, seed: int = 0
) -> PrivacyLedger:
    """The ledger of one run with the canary: the claim every run of the audit makes.

    Every run checks that its ledger records the same steps (:meth:`claimed_ledger`), so any
    accountant gives every run the ε of this ledger.
    """
    if isinstance(config, BlackBoxDigitsAudit):
        return run_black_box_digits(config, include_canary=True, seed=seed).ledger
    if isinstance(config, WhiteBoxDigitsAudit):
        return run_white_box_digits(config, include_canary=True, seed=seed).ledger
    raise InvalidParameterError("config", config, "a BlackBoxDigitsAudit or WhiteBoxDigitsAudit")
