"""The white-box one-run audit of the PyTorch adapter: m gradient canaries in one DP-SGD run.

The one-run audits (Steinke, Nasr & Jagielski 2023; Mahloujifar, Melis & Chaudhuri 2024) need
m canaries in a single training run, each included independently with probability ½. This module
builds the white-box setting of :func:`~dpledger.audit.torch_audit.run_white_box_digits` with many
canaries at once: the digits get K = ⌈m/10⌉ extra input features that are zero in every digit,
and canary j is the record x_j = M·e_{64 + ⌊j/10⌋} with label y_j = j mod 10 whose loss is
−o_{y_j} (its logit for its label). Its gradient is −M·e_{y_j} e_{64+⌊j/10⌋}ᵀ at every θ: a Dirac
canary on a weight that no digit and no other canary touches, which clipping maps to exactly C.
With full batches (q = 1) and T steps the movement of that weight, in units of η·C/n, is
N(T·n/N, T·z²·(n/N)²) when the canary was included and N(0, T·z²·(n/N)²) when not (N = n + the
number of canaries included), independently across canaries: each canary sees exactly the
μ-GDP mechanism μ = √T/z that the ledger claims.

:func:`run_white_box_one_run` trains once and returns the m scores and inclusions;
:func:`white_box_one_run_bounds` guesses "included" for the highest scores (guess counts fixed in
advance) and reports the (ε, δ) one-run bound and the f-DP one-run bound on the same guesses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from dpledger.audit.privacy_bounds import BoundMethod, EpsilonLowerBound
from dpledger.audit.threshold_selection import one_run_epsilon_bound_from_scores
from dpledger.audit.torch_audit_common import (
    _NUM_CLASSES,
    _NUM_FEATURES,
    CalibratedAuditConfig,
    _check_canary_norm,
    _check_claim,
    _digits_tensors,
    _implementation,
    _noise,
    _optional_records,
    _optional_threads,
    _positive,
    _positive_int,
    _set_threads,
    _train_with_canaries,
    _zero_linear,
)
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.steps import CompressedLedger
from dpledger.validation import check_positive_int

__all__ = [
    "OneRunResult",
    "WhiteBoxOneRunAudit",
    "run_white_box_one_run",
    "white_box_one_run_bounds",
]


@attrs.frozen(kw_only=True)
class WhiteBoxOneRunAudit(CalibratedAuditConfig):
    """Configuration of :func:`run_white_box_one_run` (full batches: q = 1).

    Attributes:
        noise_multiplier: z = σ̃/C of every step (> 0).
        num_canaries: m, each included with probability ½.
        steps: T full-batch DP-SGD steps.
        l2_norm_bound: C.
        learning_rate: η (the scores are in units of η·C/n, so η does not change them).
        canary_norm: M ≥ C, the norm of each canary's gradient.
        num_records: train on the first n digits (None: all 1797).
        implementation: ``"correct"`` or ``"batch_size_bug"``
            (:class:`~dpledger.audit.torch_audit.UndernoisedDPOptimizer`).
        torch_threads: PyTorch intra-op threads (None leaves them alone).
    """

    noise_multiplier: float = attrs.field(converter=_noise)
    num_canaries: int = _positive_int("num_canaries", 1000)
    steps: int = _positive_int("steps", 1)
    l2_norm_bound: float = _positive("l2_norm_bound", 1.0)
    learning_rate: float = _positive("learning_rate", 1.0)
    canary_norm: float = _positive("canary_norm", 10.0)
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
    def extra_features(self) -> int:
        """K = ⌈m/10⌉ input features added to the digits, zero in every digit."""
        return -(-self.num_canaries // _NUM_CLASSES)

    def claimed_ledger(self) -> CompressedLedger:
        """What the run records: T steps of (q = 1, z). Its ε is the claim under audit."""
        return CompressedLedger.from_runs([(1.0, self.noise_multiplier, self.steps)])

    def claimed_mu(self) -> float:
        """μ = √T/z: each canary sees exactly a μ-GDP mechanism."""
        return math.sqrt(self.steps) / self.noise_multiplier


@attrs.frozen
class OneRunResult:
    """The outcome of one white-box one-run training run.

    Attributes:
        scores: each canary's movement along its gradient, in units of η·C/n (float64, length m).
        included: whether each canary was in the training set (bool, length m).
        ledger: the run's ledger.
    """

    scores: np.ndarray = attrs.field(eq=False)
    included: np.ndarray = attrs.field(eq=False)
    ledger: PrivacyLedger = attrs.field(eq=False)


def _inclusion(seed: int, m: int) -> tuple[np.ndarray, int]:
    """Each canary's inclusion (probability ½) and the training seed, both from ``seed``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidParameterError("seed", seed, "an integer >= 0")
    inclusion, training = np.random.SeedSequence(seed).spawn(2)
    included = np.random.default_rng(inclusion).random(m) < 0.5
    return included, int(training.generate_state(1, np.uint64)[0] >> np.uint64(1))


def run_white_box_one_run(config: WhiteBoxOneRunAudit, *, seed: int) -> OneRunResult:
    """Train once with the m gradient canaries (each included with probability ½) and score them.

    Raises:
        LedgerStateError: the run's ledger does not record the claimed steps.
    """
    if not isinstance(config, WhiteBoxOneRunAudit):
        raise InvalidParameterError("config", config, "a WhiteBoxOneRunAudit")
    _set_threads(config.torch_threads)
    m = config.num_canaries
    included, train_seed = _inclusion(seed, m)
    x_digits, y_digits = _digits_tensors(config.num_records)
    n = int(y_digits.shape[0])
    k = config.extra_features
    width = _NUM_FEATURES + k
    canary_ids = np.flatnonzero(included)
    features = _NUM_FEATURES + canary_ids // _NUM_CLASSES
    labels_c = canary_ids % _NUM_CLASSES
    xc = torch.zeros((canary_ids.size, width), dtype=torch.float32)
    xc[torch.arange(canary_ids.size), torch.as_tensor(features)] = float(config.canary_norm)
    x = torch.cat([torch.nn.functional.pad(x_digits, (0, k)), xc])
    y = torch.cat([y_digits, torch.as_tensor(labels_c, dtype=torch.int64)])
    is_canary = torch.arange(int(y.shape[0])) >= n
    model = _zero_linear(width)
    ledger = _train_with_canaries(
        config, model, x=x, y=y, is_canary=is_canary, sampling_probability=1.0, seed=train_seed
    )
    _check_claim(ledger, config.claimed_ledger(), seed)
    weight = model.weight.detach().double().numpy()  # initial weights are zero
    all_ids = np.arange(m)
    moved = weight[all_ids % _NUM_CLASSES, _NUM_FEATURES + all_ids // _NUM_CLASSES]
    unit = config.learning_rate * config.l2_norm_bound / n
    scores = np.asarray(moved / unit, dtype=np.float64)
    return OneRunResult(scores=scores, included=included, ledger=ledger)


def white_box_one_run_bounds(
    result: OneRunResult,
    *,
    guess_counts: Sequence[int],
    delta: float,
    confidence: float,
) -> dict[BoundMethod, EpsilonLowerBound]:
    """The (ε, δ) and the f-DP one-run bounds on the same guesses of one run.

    Args:
        result: a run of :func:`run_white_box_one_run`.
        guess_counts: numbers of "included" guesses (the highest scores) to try, fixed in
            advance; the best is reported, Bonferroni-corrected over them.
        delta: δ in [0, 1).
        confidence: 1 − α in (0, 1).

    Returns:
        ``{BoundMethod.ONE_RUN: …, BoundMethod.FDP_ONE_RUN: …}``.
    """
    if not isinstance(result, OneRunResult):
        raise InvalidParameterError("result", result, "a OneRunResult")
    pairs = [(check_positive_int("guess_counts", k), 0) for k in guess_counts]
    return {
        method: one_run_epsilon_bound_from_scores(
            result.scores,
            result.included,
            guess_counts=pairs,
            delta=delta,
            confidence=confidence,
            method=method,
        )
        for method in (BoundMethod.ONE_RUN, BoundMethod.FDP_ONE_RUN)
    }
