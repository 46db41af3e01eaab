"""Our PRV accountant behind dp-accounting's ``PrivacyAccountant`` interface.

A dp-accounting user composes DpEvents as usual and gets our certified PRV upper bound::

    accountant = PrvDpAccountant()
    accountant.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps
    )
    epsilon = accountant.get_epsilon(1e-5)

Supported events: ``GaussianDpEvent`` (a full-batch step), ``PoissonSampledDpEvent`` of a
``GaussianDpEvent``, ``SelfComposedDpEvent``, ``ComposedDpEvent``, ``NoOpDpEvent`` and
``NonPrivateDpEvent`` (ε = ∞); anything else makes ``compose`` raise dp-accounting's
``UnsupportedEventError``. A ``GaussianDpEvent``'s noise multiplier is σ/C for a per-record bound
C; under ``REPLACE_ONE`` the sensitivity of the clipped sum is 2C, which this accountant accounts
for (unlike dp-accounting's RDP accountant, google/differential-privacy issue 378).
``REPLACE_SPECIAL`` (replacement by a zero record) has the add/remove pair.
"""

from __future__ import annotations

import math
from typing import Any

import dp_accounting
from dp_accounting import dp_event

from dpledger.accountants.prv.accountant import PrvAccountant
from dpledger.errors import InvalidParameterError
from dpledger.ledger.steps import CompressedLedger

__all__ = ["PrvDpAccountant"]

_Relation = dp_accounting.NeighboringRelation
_RELATIONS = {
    _Relation.ADD_OR_REMOVE_ONE: "add_remove",
    _Relation.REPLACE_SPECIAL: "add_remove",
    _Relation.REPLACE_ONE: "replace_one",
}


class PrvDpAccountant(dp_accounting.PrivacyAccountant):
    """dp-accounting ``PrivacyAccountant`` backed by :class:`PrvAccountant`.

    Args:
        neighboring_relation: dp-accounting's neighbouring relation.
        **settings: keyword settings of :class:`PrvAccountant` (``eps_error``,
            ``delta_error``, ``bucketing``, ``max_points``); the reported numbers are always the
            certified upper bounds.
    """

    def __init__(
        self,
        neighboring_relation: dp_accounting.NeighboringRelation = _Relation.ADD_OR_REMOVE_ONE,
        **settings: Any,
    ) -> None:
        if neighboring_relation not in _RELATIONS:
            raise InvalidParameterError(
                "neighboring_relation",
                neighboring_relation,
                "ADD_OR_REMOVE_ONE, REPLACE_ONE or REPLACE_SPECIAL",
            )
        if "report" in settings:
            raise InvalidParameterError(
                "report", settings["report"], "no value: get_epsilon reports the upper bound"
            )
        super().__init__(neighboring_relation)
        self.prv = PrvAccountant(**settings)
        self._runs: list[tuple[float, float, int]] = []
        self._non_private = False

    def _maybe_compose(
        self, event: dp_event.DpEvent, count: int, do_compose: bool
    ) -> dp_accounting.PrivacyAccountant.CompositionErrorDetails | None:
        if isinstance(event, dp_event.NoOpDpEvent):
            return None
        if isinstance(event, dp_event.NonPrivateDpEvent):
            if do_compose and count > 0:
                self._non_private = True
            return None
        if isinstance(event, dp_event.SelfComposedDpEvent):
            return self._maybe_compose(event.event, event.count * count, do_compose)
        if isinstance(event, dp_event.ComposedDpEvent):
            for inner in event.events:
                error = self._maybe_compose(inner, count, do_compose)
                if error is not None:
                    return error
            return None
        if isinstance(event, dp_event.GaussianDpEvent):
            if do_compose:
                self._add(1.0, event.noise_multiplier, count)
            return None
        if isinstance(event, dp_event.PoissonSampledDpEvent):
            if isinstance(event.event, dp_event.GaussianDpEvent):
                if do_compose:
                    self._add(event.sampling_probability, event.event.noise_multiplier, count)
                return None
            return self.CompositionErrorDetails(
                invalid_event=event,
                error_message="PoissonSampledDpEvent is supported only around a GaussianDpEvent",
            )
        return self.CompositionErrorDetails(
            invalid_event=event,
            error_message=f"the PRV accountant does not support {type(event).__name__}",
        )

    def _add(self, q: float, z: float, count: int) -> None:
        if count <= 0 or q == 0.0:
            return
        if z == 0.0:
            self._non_private = True
            return
        self._runs.append((q, z, count))

    def ledger_view(self) -> CompressedLedger:
        """The composed events as a dpledger compressed ledger."""
        return CompressedLedger.from_runs(
            self._runs, neighboring=_RELATIONS[self.neighboring_relation]
        )

    def get_epsilon(self, target_delta: float) -> float:
        """The certified PRV upper bound on ε at ``target_delta``."""
        if self._non_private:
            return math.inf
        result = self.prv.epsilon(self.ledger_view(), delta=target_delta)
        return float(result.upper if result.upper is not None else result.epsilon)

    def get_delta(self, target_epsilon: float) -> float:
        """The certified PRV upper bound on δ at ``target_epsilon``."""
        if self._non_private:
            return 1.0
        result = self.prv.delta(self.ledger_view(), epsilon=target_epsilon)
        return float(result.upper if result.upper is not None else result.delta)
