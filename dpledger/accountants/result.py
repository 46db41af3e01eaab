"""What an accountant answers: :class:`PrivacyResult`, what kind of number it holds
(:class:`ResultKind`), and the :class:`Answer` a subclass of
:class:`~dpledger.accountants.base.Accountant` computes before the base class turns it into a
result.

Every number says what it is (``docs/architecture.md``, "Soundness rules", rule 4): a valid upper
bound, an estimate, or an approximation with no guarantee. The names are re-exported from
:mod:`dpledger.accountants.base`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError

__all__ = ["Answer", "PrivacyResult", "ResultKind"]


class ResultKind(str, enum.Enum):
    """What a reported number is.

    UPPER_BOUND: a valid DP guarantee: the true ε (or δ) is at most this value.
    ESTIMATE: a numerical estimate of the true value with no one-sided guarantee by itself
        (e.g. the PRV estimate, whose result carries certified lower and upper bounds, or the
        ``balls_in_bins`` Monte-Carlo estimate, whose result carries an upper *confidence*
        bound in ``upper_confidence`` and no ``upper``).
    APPROXIMATION: an approximation with no guarantee at all (e.g. GDP through the central
        limit theorem). Never sign off an ε of this kind.
    """

    UPPER_BOUND = "upper_bound"
    ESTIMATE = "estimate"
    APPROXIMATION = "approximation"


def _frozen_mapping(value: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(value or {})


def _warnings_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _check_confidence_bound(
    kind: ResultKind | None, upper_confidence: float | None, confidence: float | None
) -> None:
    """A confidence bound comes with its confidence and never under kind ``upper_bound``."""
    if (upper_confidence is None) != (confidence is None):
        raise InvalidParameterError(
            "confidence", confidence, "a probability exactly when upper_confidence is given"
        )
    if upper_confidence is not None and kind is ResultKind.UPPER_BOUND:
        raise InvalidParameterError(
            "kind",
            kind,
            "not upper_bound for a result whose bound holds only with a confidence "
            "(a Monte-Carlo bound is not certified)",
        )


@attrs.frozen
class PrivacyResult:
    """One accountant's answer.

    Attributes:
        accountant: the accountant's name (``"rdp"``, ``"prv"``, …).
        quantity: ``"epsilon"`` when ε was computed for a given δ, ``"delta"`` when δ was
            computed for a given ε.
        epsilon: ε (computed, or given).
        delta: δ (given, or computed).
        kind: what the computed number is (see :class:`ResultKind`).
        lower: a certified lower bound on the computed quantity, when the method has one.
        upper: a certified upper bound on the computed quantity, when the method has one.
        upper_confidence: a Monte-Carlo upper *confidence* bound on the computed quantity: it
            holds with probability ``confidence`` over the method's random draws and is NOT
            certified, so it is never given as ``upper`` nor with kind ``upper_bound``.
        confidence: the probability ``upper_confidence`` holds with (None without one).
        num_steps: number of ledger steps the answer covers.
        settings: the accountant's settings that produced the answer.
        seconds: wall time of the computation.
        warnings: plain-language warnings (e.g. an approximation below a certified lower bound).
        details: method-specific extras (e.g. the optimal RDP order).
    """

    accountant: str
    quantity: str
    epsilon: float
    delta: float
    kind: ResultKind
    lower: float | None = None
    upper: float | None = None
    upper_confidence: float | None = None
    confidence: float | None = None
    num_steps: int = 0
    settings: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)
    seconds: float = 0.0
    warnings: tuple[str, ...] = attrs.field(default=(), converter=_warnings_tuple)
    details: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)

    def __attrs_post_init__(self) -> None:
        _check_confidence_bound(self.kind, self.upper_confidence, self.confidence)

    @property
    def value(self) -> float:
        """The computed number: ε for an ε query, δ for a δ query."""
        return self.epsilon if self.quantity == "epsilon" else self.delta

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (∞ as the string ``"inf"``)."""

        def clean(x: Any) -> Any:
            if isinstance(x, float) and not math.isfinite(x):
                return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
            if isinstance(x, enum.Enum):
                return x.value
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [clean(v) for v in x]
            return x

        return clean(attrs.asdict(self, recurse=False))


@attrs.frozen
class Answer:
    """What a subclass computes; the base class turns it into a :class:`PrivacyResult`.

    Attributes:
        value: the computed ε (or δ).
        lower: certified lower bound on the value, if any.
        upper: certified upper bound on the value, if any.
        upper_confidence: a Monte-Carlo upper confidence bound (not certified), if any.
        confidence: the probability ``upper_confidence`` holds with.
        kind: overrides the accountant's default kind when set.
        warnings: warnings to attach.
        details: method-specific extras.
    """

    value: float
    lower: float | None = None
    upper: float | None = None
    upper_confidence: float | None = None
    confidence: float | None = None
    kind: ResultKind | None = None
    warnings: tuple[str, ...] = attrs.field(default=(), converter=_warnings_tuple)
    details: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)

    def __attrs_post_init__(self) -> None:
        _check_confidence_bound(self.kind, self.upper_confidence, self.confidence)
