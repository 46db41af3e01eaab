"""The verdict of an audit: is the claimed ε consistent with what the audit measured?

An accountant's ε is an *upper* bound: the mechanism is (ε_claim, δ)-DP. An audit's ε is a *lower*
bound at confidence 1 − α: with probability ≥ 1 − α, the mechanism is not (ε', δ)-DP for any
ε' < ε_lower. If ε_lower > ε_claim, both cannot be true, and the claim is refuted at confidence
1 − α (Tramèr et al. 2022, "Debugging Differential Privacy"). Otherwise the audit is consistent with
the claim (which says nothing about the claim being tight).

The claim can be a number, an accountant's :class:`~dpledger.accountants.base.PrivacyResult`, or a
ledger (:class:`~dpledger.ledger.PrivacyLedger` or :class:`~dpledger.ledger.steps.CompressedLedger`)
replayed by an accountant (``dpledger.accountants.base.make_accountant``) at the audit's δ.
Only a valid upper bound can be refuted: an accountant's estimate or approximation is replaced by
its certified upper bound, and one without a certified upper bound is refused.

A Gaussian-DP bound is a lower bound only if the mechanism's trade-off curve is Gaussian. A
ledger whose steps all use the full population (q = 1) claims exactly that: each step is a
Gaussian mechanism and their composition is μ-GDP, so the assumption is part of the claim under
test and the verdict does not repeat it. Otherwise (a subsampled ledger, a bare number, an
accountant's result) the verdict carries the assumption in :attr:`AuditVerdict.assumption`, its
status and its message.

The claim's δ must not exceed the audit's δ: an (ε, δ_c)-DP mechanism with δ_c ≤ δ is also
(ε, δ)-DP, so a refutation at δ refutes the claim at δ_c; the other way round it does not.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

import attrs

from dpledger.audit.privacy_bounds import (
    BoundMethod,
    EpsilonLowerBound,
    _check_audit_delta,
)
from dpledger.errors import InvalidParameterError

if TYPE_CHECKING:
    from dpledger.accountants.base import Accountant, PrivacyResult
    from dpledger.ledger import PrivacyLedger
    from dpledger.ledger.steps import CompressedLedger

__all__ = ["AuditVerdict", "audit_verdict"]

_METHOD_NAMES = {
    BoundMethod.CLOPPER_PEARSON: "Clopper–Pearson",
    BoundMethod.ONE_RUN: "one-run",
    BoundMethod.GAUSSIAN_DP: "Gaussian-DP",
    BoundMethod.FDP_ONE_RUN: "f-DP one-run",
}


@attrs.frozen
class AuditVerdict:
    """The comparison of an audit's lower bound with a claimed ε.

    Attributes:
        refuted: True when the lower bound exceeds the claimed ε.
        lower_bound: the audit's ε lower bound.
        claimed_epsilon: the claimed ε (the upper bound under test).
        delta: δ of the audit's bound.
        claimed_delta: δ of the claim (≤ ``delta``).
        confidence: 1 − α of the lower bound (so of a refutation).
        method: how the lower bound was computed.
        claim_source: where the claimed ε came from (``"value"``, or the accountant's name).
        claim_kind: what the claimed ε is (``"upper_bound"``, ``"estimate"``, …) when known.
        warnings: caveats (a claim that is not a valid upper bound; a bound that rests on an
            assumption).
        message: the verdict in one sentence, with both numbers.
        assumption: what the lower bound (so a refutation) assumes beyond the audit itself, or
            None: the Gaussian-DP bound's Gaussian trade-off curve, unless the claim is a
            full-batch ledger, for which it holds.
    """

    refuted: bool
    lower_bound: float
    claimed_epsilon: float
    delta: float
    claimed_delta: float
    confidence: float
    method: BoundMethod
    claim_source: str
    claim_kind: str | None
    warnings: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    message: str = ""
    assumption: str | None = None

    @property
    def consistent(self) -> bool:
        """True when the audit does not contradict the claim."""
        return not self.refuted

    @property
    def status(self) -> str:
        """``"consistent"`` or ``"claim refuted at confidence 1 − α"`` (with α filled in, and
        ``", assuming …"`` when the refutation rests on an assumption)."""
        if not self.refuted:
            return "consistent"
        text = f"claim refuted at confidence 1 − α = {_fmt_conf(self.confidence)}"
        if self.assumption:
            text += f", assuming {_short_assumption(self.assumption)}"
        return text

    def __str__(self) -> str:
        return self.message


def _fmt_conf(c: float) -> str:
    return f"{c:.10g}"


def _short_assumption(assumption: str) -> str:
    return assumption.split(";", 1)[0]


def _is_full_batch_ledger(claim: Any) -> bool:
    """True for a ledger (or compressed ledger) with at least one step, all with q = 1."""
    from dpledger.ledger import PrivacyLedger
    from dpledger.ledger.steps import CompressedLedger

    if isinstance(claim, PrivacyLedger):
        claim = claim.compressed()
    if not isinstance(claim, CompressedLedger) or not claim.runs:
        return False
    return all(run.sampling_probability == 1.0 for run in claim.runs)


def _fmt_eps(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:.4g}"


def _claim_from(
    claim: Any,
    *,
    delta: float,
    claimed_delta: float | None,
    accountant: str | Accountant,
) -> tuple[float, float, str, str | None]:
    """(ε_claim, δ_claim, source, kind) from a number, a PrivacyResult or a ledger."""
    from dpledger.ledger import PrivacyLedger
    from dpledger.ledger.steps import CompressedLedger

    if isinstance(claim, (PrivacyLedger, CompressedLedger)):
        if claimed_delta is not None and claimed_delta != delta:
            raise InvalidParameterError(
                "claimed_delta",
                claimed_delta,
                f"None (a ledger's ε is computed at the audit's δ = {delta:g})",
            )
        if isinstance(accountant, str):
            from dpledger.accountants.base import make_accountant

            acc = make_accountant(accountant)
        else:
            acc = accountant
        if not hasattr(acc, "epsilon"):
            raise InvalidParameterError(
                "accountant", accountant, "an accountant name or an object with .epsilon()"
            )
        if delta <= 0.0:
            raise InvalidParameterError(
                "delta", delta, "a bound with δ > 0 to compare with a ledger's ε"
            )
        result = acc.epsilon(claim, delta=delta)
        return _claim_from_result(result)
    if _is_privacy_result(claim):
        if claimed_delta is not None and claimed_delta != claim.delta:
            raise InvalidParameterError(
                "claimed_delta", claimed_delta, f"None or the result's δ = {claim.delta:g}"
            )
        return _claim_from_result(claim)
    if isinstance(claim, bool) or not isinstance(claim, numbers.Real) or not claim >= 0:
        raise InvalidParameterError(
            "claim",
            claim,
            "an ε ≥ 0, an accountant's PrivacyResult, or a PrivacyLedger/CompressedLedger",
        )
    if claimed_delta is None:
        raise InvalidParameterError(
            "claimed_delta", claimed_delta, "the δ of the claimed ε (a number in [0, 1))"
        )
    return float(claim), _check_audit_delta(claimed_delta, "claimed_delta"), "value", None


def _is_privacy_result(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("epsilon", "delta", "kind", "accountant", "quantity"))


def _claim_from_result(result: PrivacyResult) -> tuple[float, float, str, str | None]:
    """(ε, δ) of a valid guarantee from an accountant's result, its source and its kind.

    A result of kind ``upper_bound`` is used as it is. For any other kind (an estimate, an
    approximation) the computed number is not a guarantee, so the result's certified upper bound
    on it (``result.upper``) is used instead; without one the result cannot be compared with a
    lower bound at all.
    """
    kind = str(getattr(result.kind, "value", result.kind))
    eps, delta = float(result.epsilon), float(result.delta)
    if kind != "upper_bound":
        upper = getattr(result, "upper", None)
        if upper is None:
            raise InvalidParameterError(
                "claim",
                f"{result.accountant} result of kind {kind!r} without a certified upper bound",
                "a valid upper bound on ε (kind 'upper_bound', or a result with a certified "
                "upper bound): an approximation can make a correct implementation look refuted; "
                "replay the ledger with an upper-bound accountant such as 'rdp' or 'prv'",
            )
        if result.quantity == "epsilon":
            eps = float(upper)
        else:
            delta = float(upper)
    return eps, delta, str(result.accountant), kind


def audit_verdict(
    bound: EpsilonLowerBound,
    claim: float | PrivacyResult | PrivacyLedger | CompressedLedger,
    *,
    claimed_delta: float | None = None,
    accountant: str | Accountant = "rdp",
) -> AuditVerdict:
    """Compare an audit's lower bound with a claimed ε and say "consistent" or "refuted".

    Args:
        bound: the audit's ε lower bound.
        claim: the claimed ε: a number (then ``claimed_delta`` is required), an accountant's
            :class:`~dpledger.accountants.base.PrivacyResult`, or a ledger, whose ε is computed
            at the bound's δ by ``accountant``. A result that is not an upper bound (an
            estimate, an approximation) is compared through its certified upper bound and
            refused without one.
        claimed_delta: δ of a numeric claim; it must be ≤ the bound's δ.
        accountant: the accountant that replays a ledger claim: a name for
            ``make_accountant`` (default ``"rdp"``, a valid upper bound) or an accountant object.

    Returns:
        The verdict; ``str(verdict)`` is a one-sentence summary with both numbers.
    """
    if not isinstance(bound, EpsilonLowerBound):
        raise InvalidParameterError("bound", bound, "an EpsilonLowerBound")
    eps_claim, delta_claim, source, kind = _claim_from(
        claim, delta=bound.delta, claimed_delta=claimed_delta, accountant=accountant
    )
    if delta_claim > bound.delta:
        raise InvalidParameterError(
            "claimed_delta",
            delta_claim,
            f"at most the audit's δ = {bound.delta:g} (a lower bound at a smaller δ cannot refute "
            "a claim at a larger δ); audit at the claim's δ",
        )
    if math.isnan(eps_claim) or eps_claim < 0:
        raise InvalidParameterError("claim", eps_claim, "a claimed ε ≥ 0")
    warnings: list[str] = []
    if kind is not None and kind != "upper_bound":
        warnings.append(
            f"the accountant's ε is a {kind.replace('_', ' ')}, not a valid upper bound: the "
            "verdict compares with its certified upper bound instead"
        )
    assumption = bound.assumption
    gaussian = (BoundMethod.GAUSSIAN_DP, BoundMethod.FDP_ONE_RUN)
    if assumption and bound.method in gaussian and _is_full_batch_ledger(claim):
        assumption = None  # full-batch Gaussian steps compose to exactly μ-GDP
    if assumption:
        warnings.append(f"the lower bound assumes {assumption}")
    refuted = bound.epsilon > eps_claim
    method_name = _METHOD_NAMES.get(bound.method, str(bound.method))
    where = "" if source == "value" else f" ({source} accountant)"
    numbers_text = (
        f"audited lower bound ε ≥ {_fmt_eps(bound.epsilon)} ({method_name}, δ = {bound.delta:g}, "
        f"confidence {_fmt_conf(bound.confidence)}) vs claimed ε = {_fmt_eps(eps_claim)}{where} "
        f"at δ = {delta_claim:g}"
    )
    if refuted:
        assuming = f", assuming {_short_assumption(assumption)}" if assumption else ""
        message = (
            f"claim refuted at confidence 1 − α = {_fmt_conf(bound.confidence)}{assuming}: "
            f"{numbers_text}; the lower bound exceeds the claim"
        )
    else:
        message = f"consistent: {numbers_text}; the lower bound does not exceed the claim"
    return AuditVerdict(
        refuted=refuted,
        lower_bound=bound.epsilon,
        claimed_epsilon=eps_claim,
        delta=bound.delta,
        claimed_delta=delta_claim,
        confidence=bound.confidence,
        method=bound.method,
        claim_source=source,
        claim_kind=kind,
        warnings=tuple(warnings),
        message=message,
        assumption=assumption,
    )
