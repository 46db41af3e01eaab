"""The ``random_allocation`` accountant: a certified ε for balls-in-bins ledgers WITH amplification.

The RDP and PLD accountants certify balls-in-bins ledgers without amplification (each epoch as
one Gaussian mechanism); the ``balls_in_bins`` accountant estimates the amplified ε by Monte
Carlo, which is not a certificate. This accountant certifies the amplified ε: every epoch of a
balls-in-bins sampler with k batches is one random allocation of each record into one of k
Gaussian steps, whose privacy loss distribution is bounded by
:func:`~dpledger.accountants.random_allocation.random_allocation_pld` (Feldman & Shenfeld's
dominating pair, put on a grid by mean-preserving spreads only, so the result is an upper bound
on δ(ε) for both directions of add/remove). Epochs are independent allocations and compose.

Which ledgers: the costly steps must all be balls-in-bins steps (any number of samplers and
noise multipliers); each epoch is analysed at the smallest z_eff of its steps, and an epoch cut
short counts as a whole one (its outputs are a prefix of the whole epoch's outputs), as in
:meth:`~dpledger.ledger.steps.CompressedLedger.epoch_view`. Add/remove only: the pair is the
add/remove pair. Epochs with the same (k, z) are built once and self-composed. The answer is the
smaller of that bound and the no-amplification one (each epoch one Gaussian mechanism, μ-GDP in
closed form), both valid; the latter alone, with a warning, where the grid would be too large
(z below about 0.01).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, ClassVar

from dpledger.accountants.base import Accountant, Answer, ResultKind
from dpledger.accountants.gdp import gdp_delta, gdp_epsilon
from dpledger.accountants.random_allocation import DEFAULT_GRID_STEP, random_allocation_pld
from dpledger.errors import ComputationBudgetError, InvalidParameterError
from dpledger.ledger.events import SamplingScheme
from dpledger.ledger.steps import CompressedLedger, EpochSegment
from dpledger.validation import check_positive_finite

__all__ = ["RandomAllocationAccountant"]

_METHOD = (
    "random allocation (Feldman & Shenfeld 2025): dominating pair of each balls-in-bins epoch, "
    "mean-preserving spreads on a log grid, composed by dp-accounting's PLD"
)


class RandomAllocationAccountant(Accountant):
    """Certified ε of balls-in-bins ledgers with the amplification of random allocation.

    Args:
        grid_step: the log-spacing h of the grid, in [1e-4, 0.1] (default 0.01). The bound's
            excess over the exact ε of the dominating pair is of order h² (about 3e-3 at
            ε ≈ 2.4 for h = 0.01, about 3.4 times less for h = 0.005, which costs about 2× the
            time).
    """

    name = "random_allocation"
    default_kind = ResultKind.UPPER_BOUND
    supports_replace_one = False
    supported_schemes = frozenset({SamplingScheme.BALLS_IN_BINS})
    scheme_notes: ClassVar[dict[SamplingScheme, str]] = {
        SamplingScheme.POISSON: "it analyses balls-in-bins steps only (use prv or pld)",
        SamplingScheme.FULL: "it analyses balls-in-bins steps only (use prv or pld)",
    }

    def __init__(self, *, grid_step: float = DEFAULT_GRID_STEP) -> None:
        step = check_positive_finite("grid_step", grid_step)
        if not 1e-4 <= step <= 0.1:
            raise InvalidParameterError("grid_step", grid_step, "a log-spacing in [1e-4, 0.1]")
        self.grid_step = step
        self._epoch_plds: dict[tuple[int, float], Any] = {}  # one epoch's PLD per (k, z)

    def settings(self) -> dict[str, Any]:
        """The grid step."""
        return {"grid_step": self.grid_step}

    def _epochs(self, ledger: CompressedLedger) -> Counter[tuple[int, float]]:
        """Epochs per (batches per epoch k, noise multiplier z) of the ledger's costly steps."""
        out: Counter[tuple[int, float]] = Counter()
        for item in ledger.epoch_view():
            if not isinstance(item, EpochSegment) or math.isinf(item.noise_multiplier):
                continue
            k = item.sampling.num_batches
            assert k is not None
            out[(k, item.noise_multiplier)] += item.epochs
        return out

    def _pld(self, ledger: CompressedLedger) -> Any:
        """The composed PLD of the ledger's epochs; each (k, z)'s one-epoch PLD is built once
        per accountant (an ε curve then only composes)."""
        from dpledger.accountants.pld_composition import self_compose

        pld = None
        for (k, z), epochs in sorted(self._epochs(ledger).items()):
            if (k, z) not in self._epoch_plds:
                self._epoch_plds[(k, z)] = random_allocation_pld(
                    noise_multiplier=z, num_steps=k, grid_step=self.grid_step
                )
            part = self._epoch_plds[(k, z)]
            if epochs > 1:
                part = self_compose(part, epochs)[0]
            pld = part if pld is None else pld.compose(part)
        assert pld is not None  # the base class calls only with a costly step
        return pld

    def _details(self, ledger: CompressedLedger) -> dict[str, Any]:
        epochs = self._epochs(ledger)
        return {
            "method": _METHOD,
            "grid_step": self.grid_step,
            "epochs": sum(epochs.values()),
            "num_batches": sorted({k for k, _ in epochs}),
        }

    def _plain_mu(self, ledger: CompressedLedger) -> float:
        """μ of the no-amplification bound: each epoch one Gaussian mechanism of noise z."""
        return math.hypot(*(math.sqrt(e) / z for (_, z), e in self._epochs(ledger).items()))

    def _answer(self, ledger: CompressedLedger, amplified: Any, plain: float) -> Answer:
        """The smaller of the amplified and the no-amplification bound (both valid)."""
        details = self._details(ledger)
        warnings: tuple[str, ...] = ()
        try:
            value = amplified(self._pld(ledger))
        except ComputationBudgetError as exc:
            value = plain
            warnings = (f"the no-amplification bound: {exc}",)
        details["no_amplification"] = plain
        return Answer(
            min(value, plain), kind=ResultKind.UPPER_BOUND, warnings=warnings, details=details
        )

    def _epsilon(self, ledger: CompressedLedger, delta: float) -> Answer:
        plain = gdp_epsilon(self._plain_mu(ledger), delta)
        return self._answer(
            ledger, lambda pld: max(float(pld.get_epsilon_for_delta(delta)), 0.0), plain
        )

    def _delta(self, ledger: CompressedLedger, epsilon: float) -> Answer:
        plain = gdp_delta(self._plain_mu(ledger), epsilon)
        return self._answer(
            ledger, lambda pld: min(max(float(pld.get_delta_for_epsilon(epsilon)), 0.0), 1.0), plain
        )
