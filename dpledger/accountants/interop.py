"""Bridges to peer libraries: dp-accounting's ``PrivacyAccountant`` interface and Opacus histories.

* :class:`GdpPrivacyAccountant` is a ``dp_accounting.PrivacyAccountant`` backed by dpledger's
  :class:`~dpledger.accountants.gdp.GdpAccountant`, so a dp-accounting user can compose
  ``DpEvent`` s and ask for ε or δ. Supported events: ``GaussianDpEvent``,
  ``PoissonSampledDpEvent`` of a ``GaussianDpEvent``, ``SelfComposedDpEvent``,
  ``ComposedDpEvent``, ``NoOpDpEvent`` and ``NonPrivateDpEvent`` (ε = ∞); anything else raises
  ``dp_accounting.UnsupportedEventError`` on ``compose``. The composed events become a ledger of
  (q, z) steps, so the answer is the same as :class:`GdpAccountant`'s on that ledger — including
  its kind: ``last_result`` holds the full :class:`~dpledger.accountants.base.PrivacyResult`
  (an ``approximation`` whenever subsampled steps are present).
* :func:`ledger_from_opacus_history` turns an Opacus accountant's ``history`` — a list of
  (noise_multiplier, sample_rate, steps) — into a compressed ledger (note the field order differs
  from :meth:`CompressedLedger.from_runs`, which takes (q, z, count)).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import dp_accounting

from dpledger.accountants.base import Accountant, PrivacyResult
from dpledger.accountants.gdp import GdpAccountant
from dpledger.errors import InvalidParameterError
from dpledger.ledger.events import NeighboringRelation
from dpledger.ledger.steps import CompressedLedger, StepRun
from dpledger.validation import check_probability

__all__ = ["GdpPrivacyAccountant", "LedgerBackedPrivacyAccountant", "ledger_from_opacus_history"]

_NeighborRel = dp_accounting.NeighboringRelation
_RELATIONS = {
    _NeighborRel.ADD_OR_REMOVE_ONE: NeighboringRelation.ADD_REMOVE,
    _NeighborRel.REPLACE_ONE: NeighboringRelation.REPLACE_ONE,
}


def _event_noise_multiplier(event: Any) -> float:
    """A GaussianDpEvent's noise multiplier as a float ≥ 0 (dp-accounting events have no
    validators, so a huge int or a string would otherwise fail later, untyped)."""
    value = event.noise_multiplier
    expected = "a noise multiplier >= 0 (a real number)"
    if isinstance(value, bool):
        raise InvalidParameterError("noise_multiplier", value, expected)
    try:
        z = float(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidParameterError("noise_multiplier", value, expected) from None
    if not z >= 0.0:
        raise InvalidParameterError("noise_multiplier", value, expected)
    return z + 0.0


class LedgerBackedPrivacyAccountant(dp_accounting.PrivacyAccountant):
    """A ``dp_accounting.PrivacyAccountant`` that turns DpEvents into a ledger for a dpledger
    accountant.

    Args:
        accountant: the dpledger accountant that computes ε and δ.
        neighboring_relation: ``ADD_OR_REMOVE_ONE`` or ``REPLACE_ONE``.
    """

    def __init__(
        self,
        accountant: Accountant,
        neighboring_relation: dp_accounting.NeighboringRelation = _NeighborRel.ADD_OR_REMOVE_ONE,
    ) -> None:
        if neighboring_relation not in _RELATIONS:
            raise InvalidParameterError(
                "neighboring_relation", neighboring_relation, "ADD_OR_REMOVE_ONE or REPLACE_ONE"
            )
        if not isinstance(accountant, Accountant):
            raise InvalidParameterError("accountant", accountant, "a dpledger Accountant")
        super().__init__(neighboring_relation)
        self._accountant = accountant
        self._runs: list[StepRun] = []
        self.last_result: PrivacyResult | None = None

    def _maybe_compose(
        self, event: dp_accounting.DpEvent, count: int, do_compose: bool
    ) -> dp_accounting.PrivacyAccountant.CompositionErrorDetails | None:
        steps = self._steps(event, count)
        if isinstance(steps, dp_accounting.PrivacyAccountant.CompositionErrorDetails):
            return steps
        if do_compose:
            self._runs.extend(StepRun(q, z, c) for q, z, c in steps if c > 0)
        return None

    def _steps(
        self, event: dp_accounting.DpEvent, count: int
    ) -> list[tuple[float, float, int]] | dp_accounting.PrivacyAccountant.CompositionErrorDetails:
        details = dp_accounting.PrivacyAccountant.CompositionErrorDetails
        if isinstance(event, dp_accounting.NoOpDpEvent):
            return []
        if isinstance(event, dp_accounting.NonPrivateDpEvent):
            return [(1.0, 0.0, count)]
        if isinstance(event, dp_accounting.GaussianDpEvent):
            return [(1.0, _event_noise_multiplier(event), count)]
        if isinstance(event, dp_accounting.PoissonSampledDpEvent):
            if not isinstance(event.event, dp_accounting.GaussianDpEvent):
                return details(event, "PoissonSampledDpEvent must wrap a GaussianDpEvent")
            q = check_probability("sampling_probability", event.sampling_probability)
            z = _event_noise_multiplier(event.event)
            if 0.0 < q < 1.0 and self.neighboring_relation is _NeighborRel.REPLACE_ONE:
                return details(event, "Poisson sampling is supported only under ADD_OR_REMOVE_ONE")
            return [(q, z, count)]
        if isinstance(event, dp_accounting.SelfComposedDpEvent):
            return self._steps(event.event, count * event.count)
        if isinstance(event, dp_accounting.ComposedDpEvent):
            out: list[tuple[float, float, int]] = []
            for sub in event.events:
                steps = self._steps(sub, count)
                if isinstance(steps, details):
                    return steps
                out.extend(steps)
            return out
        return details(event, f"unsupported event for the {self._accountant.name} accountant")

    def ledger_view(self) -> CompressedLedger:
        """The composed events as a compressed ledger."""
        return CompressedLedger(
            neighboring=_RELATIONS[self.neighboring_relation], runs=tuple(self._runs)
        )

    def get_epsilon(self, target_delta: float) -> float:
        """ε at ``target_delta`` of everything composed so far (see ``last_result``)."""
        self.last_result = self._accountant.epsilon(self.ledger_view(), delta=target_delta)
        return float(self.last_result.epsilon)

    def get_delta(self, target_epsilon: float) -> float:
        """δ at ``target_epsilon`` of everything composed so far (see ``last_result``)."""
        self.last_result = self._accountant.delta(self.ledger_view(), epsilon=target_epsilon)
        return float(self.last_result.delta)


class GdpPrivacyAccountant(LedgerBackedPrivacyAccountant):
    """dp-accounting ``PrivacyAccountant`` interface to :class:`GdpAccountant`.

    Args:
        neighboring_relation: ``ADD_OR_REMOVE_ONE`` (default) or ``REPLACE_ONE`` (full-batch
            Gaussians only).
        **settings: keyword settings of :class:`GdpAccountant` (e.g. ``lower_bound=False``).
    """

    def __init__(
        self,
        neighboring_relation: dp_accounting.NeighboringRelation = _NeighborRel.ADD_OR_REMOVE_ONE,
        **settings: Any,
    ) -> None:
        super().__init__(GdpAccountant(**settings), neighboring_relation)


def ledger_from_opacus_history(
    history: Iterable[Sequence[float]],
    *,
    neighboring: NeighboringRelation | str = NeighboringRelation.ADD_REMOVE,
) -> CompressedLedger:
    """A compressed ledger from an Opacus accountant's history.

    Args:
        history: (noise_multiplier, sample_rate, steps) triples, in training order (the format of
            ``opacus.accountants.RDPAccountant().history`` and its siblings).
        neighboring: the neighboring relation the training run used.

    Returns:
        The ledger with one run of ``steps`` steps (q = sample_rate, z = noise_multiplier) per
        entry, consecutive equal entries merged.

    Raises:
        InvalidParameterError: an entry that is not a triple, or has an invalid value.
    """
    runs = []
    try:
        entries = iter(history)
    except TypeError:
        raise InvalidParameterError(
            "history", history, "an iterable of (noise_multiplier, sample_rate, steps) triples"
        ) from None
    for i, entry in enumerate(entries):
        try:
            noise_multiplier, sample_rate, steps = entry
        except (TypeError, ValueError):
            raise InvalidParameterError(
                f"history[{i}]", entry, "a (noise_multiplier, sample_rate, steps) triple"
            ) from None
        if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
            steps = int(steps)
        runs.append(StepRun(sample_rate, noise_multiplier, steps))
    return CompressedLedger.from_runs(runs, neighboring=neighboring)
