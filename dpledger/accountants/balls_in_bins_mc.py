"""The ``balls_in_bins`` accountant: a Monte-Carlo ESTIMATE of a balls-in-bins run's ε with the
amplification of random allocation credited.

The RDP and PLD accountants certify balls-in-bins ledgers without amplification (each epoch as
one Gaussian mechanism), which is valid but far above the run's true ε. Chua et al. (2025)
show that balls-in-bins sampling is about as private as Poisson sampling of the same rate; the
only computation of that available here is the Monte-Carlo estimate of
:mod:`dpledger.accountants.balls_in_bins`. This accountant reports it as what it is: kind
``estimate``, with the ε at which a Chernoff–Hoeffding upper confidence bound on δ meets the
target as ``upper_confidence`` (with ``confidence``: a bound that holds with probability
``confidence`` over the draws, NOT a certified one, so ``upper``, the certified bound of the
other accountants, stays None and the kind is never ``upper_bound``) and the settings (samples,
seed, confidence) that reproduce it.

It handles ledgers whose costly steps are balls-in-bins steps of one sampler (one k, one n) at
one noise multiplier, under add/remove (the relation of the analysed pair), and refuses others.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from dpledger.accountants.balls_in_bins import balls_in_bins_epsilon
from dpledger.accountants.base import Accountant, Answer, ResultKind
from dpledger.accountants.budget import DEFAULT_TIME_BUDGET_S, check_time_budget
from dpledger.errors import ComputationBudgetError, InvalidParameterError, UnsupportedLedgerError
from dpledger.ledger.events import SamplingScheme
from dpledger.ledger.steps import CompressedLedger, EpochSegment
from dpledger.validation import check_non_negative_int, check_positive_int

__all__ = ["BallsInBinsAccountant"]

SECONDS_PER_DRAW = 3e-8
"""Measured cost of one normal draw with its share of the loss computation (26 ns on the
reference machine), for the up-front time estimate."""


class BallsInBinsAccountant(Accountant):
    """Monte-Carlo estimate of ε for balls-in-bins ledgers (see the module docstring).

    Args:
        samples: draws per direction (default 200,000). The standard error of δ is about
            √(δ / samples): a δ of 1e-5 needs millions of samples before the upper confidence
            bound comes down to it (until then ``upper_confidence`` is ∞).
        seed: the seed of the draws (the same seed gives the same result).
        confidence: the probability with which ``upper_confidence`` holds (default 0.99).
        time_budget_s: the most seconds one estimate may take by the up-front estimate (default
            60); beyond it :class:`~dpledger.errors.ComputationBudgetError` names the sample
            count that would fit.
    """

    name = "balls_in_bins"
    default_kind = ResultKind.ESTIMATE
    supports_replace_one = False
    supported_schemes = frozenset({SamplingScheme.BALLS_IN_BINS})
    scheme_notes: ClassVar[dict[SamplingScheme, str]] = {}

    def __init__(
        self,
        *,
        samples: int = 200_000,
        seed: int = 0,
        confidence: float = 0.99,
        time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    ) -> None:
        self.samples = check_positive_int("samples", samples)
        self.seed = check_non_negative_int("seed", seed)
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)):
            raise InvalidParameterError("confidence", confidence, "a probability in (0, 1)")
        if not 0.0 < confidence < 1.0:
            raise InvalidParameterError("confidence", confidence, "a probability in (0, 1)")
        self.confidence = float(confidence)
        self.time_budget_s = check_time_budget(time_budget_s)

    def settings(self) -> dict[str, Any]:
        """The sample count, seed, confidence and time budget."""
        return {
            "samples": self.samples,
            "seed": self.seed,
            "confidence": self.confidence,
            "time_budget_s": self.time_budget_s,
        }

    def _parameters(self, ledger: CompressedLedger) -> tuple[int, int, float]:
        """(k, epochs, z) of a ledger of one balls-in-bins sampler at one noise multiplier."""
        segments = [item for item in ledger.epoch_view() if isinstance(item, EpochSegment)]
        costly = [seg for seg in segments if not math.isinf(seg.noise_multiplier)]
        samplers = {seg.sampling for seg in costly}
        zs = {
            r.noise_multiplier
            for r in ledger.runs
            if not r.releases_nothing and r.scheme is SamplingScheme.BALLS_IN_BINS
        }
        if len(samplers) != 1 or len(zs) != 1:
            raise UnsupportedLedgerError(
                "the balls_in_bins accountant estimates ledgers of one balls-in-bins sampler at "
                f"one noise multiplier; this one has {len(samplers)} samplers and {len(zs)} "
                "noise multipliers (the rdp and pld accountants certify it without "
                "amplification)"
            )
        k = samplers.pop().num_batches
        assert k is not None
        return k, sum(seg.epochs for seg in costly), zs.pop()

    def _check_cost(self, k: int, epochs: int) -> None:
        seconds = 2.0 * self.samples * k * epochs * SECONDS_PER_DRAW
        if seconds > self.time_budget_s:
            fits = max(1, int(self.time_budget_s / (2.0 * k * epochs * SECONDS_PER_DRAW)))
            raise ComputationBudgetError(
                parameter="samples",
                value=self.samples,
                estimated_bytes=0.0,
                budget_bytes=1,
                suggestion=f"use samples={fits} or fewer, or a larger time_budget_s",
                accountant=self.name,
                estimated_seconds=seconds,
                budget_seconds=self.time_budget_s,
            )

    def _estimate(self, ledger: CompressedLedger, quantity: str, target: float) -> Answer:
        """The Monte-Carlo ε at δ = ``target`` (``quantity="epsilon"``) or δ at ε = ``target``."""
        from dpledger.accountants.balls_in_bins import balls_in_bins_delta

        k, epochs, z = self._parameters(ledger)
        self._check_cost(k, epochs)
        estimator = balls_in_bins_epsilon if quantity == "epsilon" else balls_in_bins_delta
        result = estimator(
            target,
            z,
            k,
            epochs=epochs,
            samples=self.samples,
            seed=self.seed,
            confidence=self.confidence,
        )
        warnings: tuple[str, ...] = ()
        if quantity == "epsilon" and math.isinf(result.upper_confidence):
            warnings = (
                f"with {self.samples} samples the upper confidence bound on δ does not come down "
                f"to {target!r}: only the estimate is available; use more samples",
            )
        return Answer(
            result.estimate,
            upper_confidence=result.upper_confidence,
            confidence=self.confidence,
            kind=ResultKind.ESTIMATE,
            warnings=warnings,
            details={
                "method": "Monte Carlo on the balls-and-bins pair of Chua et al. (2025)",
                "confidence": self.confidence,
                "standard_error_of_delta": result.standard_error,
                "epochs": epochs,
                "num_batches": k,
            },
        )

    def _epsilon(self, ledger: CompressedLedger, delta: float) -> Answer:
        return self._estimate(ledger, "epsilon", delta)

    def _delta(self, ledger: CompressedLedger, epsilon: float) -> Answer:
        return self._estimate(ledger, "delta", epsilon)
