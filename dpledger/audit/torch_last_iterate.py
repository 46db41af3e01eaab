"""Last-iterate audit of the PyTorch adapter: a crafted gradient canary, only the final model seen.

The hidden-state threat model (Cebere et al. 2025, "Tighter Privacy Auditing of DP-SGD in the
Hidden State Threat Model"; Steinke et al. 2024, "The Last Iterate Advantage"): the adversary
crafts a record whose gradient is the same vector g at every θ and puts it in the training set
(so, with Poisson sampling, it is in each step's sample with probability q), but observes only
the final model θ_T, never the intermediate ones. Here g is a Dirac canary on a weight no digit
touches (input M·e_k on an always-blank pixel k, loss −logit_y, as in
:func:`~dpledger.audit.torch_audit.run_white_box_digits`), so in units of η·C/(q·n) the final
model's movement along the canary is

    K + N(0, T·z²) with the canary (K ~ Binomial(T, q), the steps that sampled it),
    N(0, T·z²) without,

up to the factor n/(n + 1) with the canary (the average divides by the expected batch q·N of the
population N). With q = 1 this is the white-box audit (exactly μ-GDP, μ = √T/z); with q < 1 it is
a mixture whose trade-off curve is not Gaussian, so only the Clopper–Pearson bound (no curve
assumption) is sound against the subsampled ledger's claim, and the claim it is compared with is
the accountant's ε of the whole run, which accounts for all intermediate models. The gap between
the two is the "last iterate advantage": what hiding the intermediate models might buy beyond the
ledger's claim.

:class:`LastIterateDigitsAudit` configures it; ``functools.partial(train_last_iterate_digits,
config=…)`` is the harness's picklable training function.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from dpledger.audit.canaries import GradientCanary, dirac_gradient_canary
from dpledger.audit.threshold_selection import BonferroniThresholds
from dpledger.audit.torch_audit_common import (
    _NUM_CLASSES,
    _NUM_FEATURES,
    CalibratedAuditConfig,
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
    _train_with_canaries,
    _zero_linear,
    digits_records,
)
from dpledger.errors import InvalidParameterError
from dpledger.ledger.steps import CompressedLedger
from dpledger.validation import check_positive_finite, check_positive_int

__all__ = ["LastIterateDigitsAudit", "run_last_iterate_digits", "train_last_iterate_digits"]


@attrs.frozen(kw_only=True)
class LastIterateDigitsAudit(CalibratedAuditConfig):
    """Configuration of :func:`train_last_iterate_digits`.

    Attributes:
        noise_multiplier: z = σ̃/C of every step (> 0).
        sampling_probability: q of the Poisson sampler, in (0, 1] (1: full batches).
        steps: T.
        l2_norm_bound: C.
        learning_rate: η (the score is in units of η·C/(q·n), so η does not change it).
        canary_norm: M ≥ C, the norm of the canary's gradient.
        canary_label: y, the class whose weight the canary moves.
        num_records: train on the first n digits (None: all 1797).
        implementation: ``"correct"`` or ``"batch_size_bug"``.
        torch_threads: PyTorch intra-op threads (None leaves them alone).
    """

    noise_multiplier: float = attrs.field(converter=_noise)
    sampling_probability: float = attrs.field(default=0.1, converter=_sampling_probability)
    steps: int = _positive_int("steps", 10)
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
    def canary_feature(self) -> int:
        """k: the first pixel that is blank in every training digit."""
        return _blank_feature(self.num_records)

    def gradient_canary(self) -> GradientCanary:
        """The canary's gradient over the weight (10 × 64, row-major): −M on (y, k)."""
        return dirac_gradient_canary(
            num_parameters=_NUM_CLASSES * _NUM_FEATURES,
            index=self.canary_label * _NUM_FEATURES + self.canary_feature,
            norm=self.canary_norm,
            sign=-1.0,
        )

    def score_unit(self) -> float:
        """η·C/(q·n): how far one sampled canary gradient moves the weights."""
        n = int(digits_records(self.num_records)[0].shape[0])
        return self.learning_rate * self.l2_norm_bound / (self.sampling_probability * n)

    def claimed_ledger(self) -> CompressedLedger:
        """What every run records: T steps of (q, z). Its ε is the claim under audit."""
        return CompressedLedger.from_runs(
            [(self.sampling_probability, self.noise_multiplier, self.steps)]
        )

    def claimed_score_stddev(self) -> float:
        """√T·z: the score's standard deviation without the canary."""
        return math.sqrt(self.steps) * self.noise_multiplier

    def preregistered_thresholds(
        self, *, count: int = 16, spacing: float = 0.25
    ) -> BonferroniThresholds:
        """½ and k·spacing·√T·z, k = 1..count, fixed by the configuration before any run.

        ½ is "the canary was sampled at least once" when the noise is negligible (the threshold
        that catches an under-noised run); the others span the claimed noise as in the
        white-box audit.
        """
        count = check_positive_int("count", count)
        spacing = check_positive_finite("spacing", spacing)
        scale = self.claimed_score_stddev()
        return BonferroniThresholds([0.5] + [k * spacing * scale for k in range(1, count + 1)])


def run_last_iterate_digits(
    config: LastIterateDigitsAudit, *, include_canary: bool, seed: int
) -> tuple[float, Any]:
    """Train once; return (the final model's movement along the canary, the run's ledger).

    Raises:
        LedgerStateError: the run's ledger does not record the claimed steps.
    """
    if not isinstance(config, LastIterateDigitsAudit):
        raise InvalidParameterError("config", config, "a LastIterateDigitsAudit")
    _set_threads(config.torch_threads)
    x, y = _digits_tensors(config.num_records)
    n = int(y.shape[0])
    if include_canary:
        xc = torch.zeros((1, _NUM_FEATURES), dtype=torch.float32)
        xc[0, config.canary_feature] = float(config.canary_norm)
        x = torch.cat([x, xc])
        y = torch.cat([y, torch.tensor([config.canary_label], dtype=torch.int64)])
    is_canary = torch.arange(int(y.shape[0])) >= n
    model = _zero_linear()
    initial = model.weight.detach().double().reshape(-1).numpy().copy()
    ledger = _train_with_canaries(
        config,
        model,
        x=x,
        y=y,
        is_canary=is_canary,
        sampling_probability=config.sampling_probability,
        seed=seed,
    )
    _check_claim(ledger, config.claimed_ledger(), seed)
    final = model.weight.detach().double().reshape(-1).numpy()
    score = config.gradient_canary().score(initial, final, unit=config.score_unit())
    return score, ledger


def train_last_iterate_digits(
    include_canary: bool, seed: int, *, config: LastIterateDigitsAudit
) -> float:
    """The harness's ``train(include_canary, seed) -> score`` for a last-iterate audit.

    Use ``functools.partial(train_last_iterate_digits, config=...)``; see
    :func:`run_last_iterate_digits`.
    """
    return run_last_iterate_digits(config, include_canary=include_canary, seed=seed)[0]
