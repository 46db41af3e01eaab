"""The interface every accountant implements, and the result object every answer comes in.

An accountant replays a ledger (a :class:`~dpledger.ledger.PrivacyLedger` or its
:class:`~dpledger.ledger.steps.CompressedLedger`) and answers three questions:

* :meth:`Accountant.epsilon` — the ε of the whole ledger at a given δ;
* :meth:`Accountant.delta` — the δ of the whole ledger at a given ε;
* :meth:`Accountant.epsilon_curve` — ε at δ after each of several step counts.

Every answer is a :class:`PrivacyResult` that says what kind of number it is
(``docs/architecture.md``, "Soundness rules", rule 4); the result types are in
:mod:`dpledger.accountants.result`, and this module re-exports them.
This base class does what is common to all accountants, in this order, before any computation:
validate δ or ε, turn the input into a compressed ledger, refuse a ledger the accountant cannot
analyse (:class:`~dpledger.errors.UnsupportedLedgerError`), answer the trivial cases (an empty
ledger spends ε = 0; a step with σ̃ = 0 and q > 0 makes ε = ∞), and time the computation.
Subclasses implement :meth:`Accountant._epsilon` and :meth:`Accountant._delta` on ledgers that
have at least one private step and no non-private one.

This module is over 500 lines because it is one concept, the :class:`Accountant` base class:
the checks its public methods run in the order above, the incremental ε curve, the trivial
answers and the conversion of failures into typed errors all share the class's state, and the
tables a refusal quotes (``SCHEME_ADVICE``, ``RELATION_ADVICE``) and the registry that finds an
accountant by name stay beside it, since adding an accountant or a sampling scheme edits them
together with the class (``docs/architecture.md``, "Extension points"). The result types, which
do not depend on it, are in :mod:`dpledger.accountants.result`.

Guarantees of every public method, for every legal input (however extreme):

* it returns a result or raises a :class:`~dpledger.errors.DPLedgerError`: the computation runs
  with numpy's overflow, division and invalid-operation checks raising (so the answer does not
  depend on the caller's warning filters), and any floating-point, memory or library failure
  becomes an :class:`~dpledger.errors.AccountingNumericalError` naming the accountant and the
  inputs; accountants refuse work beyond their memory budget up front with a
  :class:`~dpledger.errors.ComputationBudgetError`;
* a reported ε or δ is never NaN; ε ≥ 0 and 0 ≤ δ ≤ 1;
* :meth:`Accountant.epsilon_curve` takes at most ``max_curve_points`` points
  (:data:`DEFAULT_MAX_CURVE_POINTS` = 10,000 by default), checked before any work;
* ``KeyboardInterrupt`` is never caught.
"""

from __future__ import annotations

import abc
import importlib
import itertools
import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import attrs
import numpy as np

from dpledger.accountants.correlated import expand_correlated, refuse_correlated_curve
from dpledger.accountants.result import (
    Answer,
    PrivacyResult,
    ResultKind,
)
from dpledger.errors import (
    AccountingNumericalError,
    DPLedgerError,
    InvalidParameterError,
    UnsupportedLedgerError,
    UnsupportedSamplingError,
    describe_value,
)
from dpledger.ledger.events import SCHEME_RELATIONS, NeighboringRelation, SamplingScheme
from dpledger.ledger.ledger import PrivacyLedger
from dpledger.ledger.provenance import provenance_of
from dpledger.ledger.steps import CompressedLedger, StepRun
from dpledger.validation import check_delta, warn_if_delta_too_large

__all__ = [
    "ACCOUNTANT_MODULES",
    "DEFAULT_MAX_CURVE_POINTS",
    "Accountant",
    "Answer",
    "LedgerLike",
    "PrivacyResult",
    "ResultKind",
    "as_compressed",
    "make_accountant",
]

LedgerLike = PrivacyLedger | CompressedLedger

DEFAULT_MAX_CURVE_POINTS = 10_000
"""The most step counts one :meth:`Accountant.epsilon_curve` call accepts by default."""

_T = TypeVar("_T")

# What a numerical computation may raise on legal but extreme inputs (Warning: a numpy or scipy
# warning turned into an error by the caller's warning filters).
_NUMERICAL_FAILURES = (
    ArithmeticError,
    MemoryError,
    RecursionError,
    IndexError,
    ValueError,
    Warning,
)


def as_compressed(ledger: LedgerLike) -> CompressedLedger:
    """The compressed view of a ledger (a compressed ledger is returned as it is), with any
    correlated-noise release replaced by the runs it is equivalent to
    (:mod:`dpledger.accountants.correlated`)."""
    if isinstance(ledger, CompressedLedger):
        return expand_correlated(ledger)
    if isinstance(ledger, PrivacyLedger):
        return expand_correlated(ledger.compressed())
    raise InvalidParameterError("ledger", ledger, "a PrivacyLedger or a CompressedLedger")


def _check_epsilon(value: Any) -> float:
    expected = "a number >= 0 (inf allowed)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError("epsilon", value, expected)
    try:
        x = float(value)
    except OverflowError:  # an int beyond the float range: ε = ∞
        if value > 0:
            return math.inf
        raise InvalidParameterError("epsilon", value, expected) from None
    if not x >= 0.0:
        raise InvalidParameterError("epsilon", value, expected)
    return x + 0.0


def describe_ledger(comp: CompressedLedger, *, limit: int = 3) -> str:
    """A short description of a ledger's runs for error messages: (q, z, count) of the first
    ``limit`` runs, all numbers in repr form (a nonzero value never prints as 0)."""
    runs = comp.runs
    shown = ", ".join(
        f"(q={r.sampling_probability!r}, z={r.noise_multiplier!r}, count={describe_value(r.count)})"
        for r in runs[:limit]
    )
    more = f" and {len(runs) - limit} more runs" if len(runs) > limit else ""
    return f"{comp.neighboring.value} ledger with runs {shown}{more}"


def _largest_population(ledger: Any, comp: CompressedLedger) -> int | None:
    """The largest population size n the ledger records (None when it records none)."""
    sizes = {int(n) for n in getattr(ledger, "population_sizes", ()) or () if isinstance(n, int)}
    sizes.update(
        r.sampling.population_size
        for r in comp.runs
        if r.sampling is not None and r.sampling.population_size is not None
    )
    return max(sizes) if sizes else None


def _is_costly(run: StepRun) -> bool:
    return not run.releases_nothing


class Accountant(abc.ABC):
    """Base of every accountant. See the module docstring for the contract.

    Class attributes:
        name: short name used by the CLI and :func:`make_accountant`.
        default_kind: the kind of the numbers this accountant reports.
        supports_replace_one: whether ledgers with the replace-one relation are analysed
            (correctly) or refused with :class:`~dpledger.errors.UnsupportedLedgerError`.
        supported_schemes: the sampling schemes the accountant has a valid analysis of; a
            ledger with a step of another scheme is refused with
            :class:`~dpledger.errors.UnsupportedSamplingError` before any computation. The
            default is Poisson and full batch only: a subclass that lists another scheme must
            handle the runs of that scheme itself (their q is not a Poisson rate).
        scheme_notes: for the schemes an accountant refuses, why (shown in the refusal).
    """

    name: ClassVar[str]
    default_kind: ClassVar[ResultKind] = ResultKind.UPPER_BOUND
    supports_replace_one: ClassVar[bool] = False
    supported_schemes: ClassVar[frozenset[SamplingScheme]] = frozenset(
        {SamplingScheme.POISSON, SamplingScheme.FULL}
    )
    scheme_notes: ClassVar[Mapping[SamplingScheme, str]] = {}

    # ---------------------------------------------------------------- subclass hooks
    @abc.abstractmethod
    def settings(self) -> dict[str, Any]:
        """The accountant's settings, as JSON-ready values."""

    @abc.abstractmethod
    def _epsilon(self, ledger: CompressedLedger, delta: float) -> Answer:
        """ε at δ for a ledger with private steps only (and at least one costly step)."""

    @abc.abstractmethod
    def _delta(self, ledger: CompressedLedger, epsilon: float) -> Answer:
        """δ at ε for a ledger with private steps only (and at least one costly step)."""

    def _epsilon_curve(
        self, ledger: CompressedLedger, delta: float, steps: Sequence[int]
    ) -> list[Answer]:
        """ε at δ after each step count (sorted, all ≥ 1 and costly). Override to be incremental."""
        return [self._epsilon(ledger.prefix(t), delta) for t in steps]

    def check_supported(self, ledger: CompressedLedger) -> None:
        """Raise :class:`UnsupportedLedgerError` if this accountant cannot analyse ``ledger``.

        Subclasses that refuse more (e.g. some sampling probabilities) extend this and call
        ``super().check_supported(ledger)``.
        """
        if ledger.neighboring is NeighboringRelation.REPLACE_ONE and not self.supports_replace_one:
            raise UnsupportedLedgerError(
                f"the {self.name} accountant does not support the replace-one neighboring "
                "relation; use an accountant that does (see the accountants' documentation) "
                "or a ledger recorded under add_remove"
            )
        self._check_sampling(ledger)

    def _check_sampling(self, ledger: CompressedLedger) -> None:
        """Refuse a ledger with a sampling scheme this accountant has no valid analysis of, a
        scheme under a relation it is not analysed under, or a mix of units of privacy."""
        units = ledger.units
        if len(units) > 1:
            raise UnsupportedSamplingError(
                f"the ledger mixes units of privacy ({', '.join(u.value for u in units)}): a "
                "guarantee is stated per record or per user, not for a mix; account each part "
                "in a ledger of its own",
                accountant=self.name,
                scheme=None,
            )
        for scheme in ledger.schemes:
            if scheme not in self.supported_schemes:
                note = self.scheme_notes.get(scheme, "")
                raise UnsupportedSamplingError(
                    f"the {self.name} accountant has no valid analysis of steps sampled by "
                    f"{scheme.value!r}{': ' + note if note else ''}. "
                    f"{SCHEME_ADVICE.get(scheme, '')}".rstrip(),
                    accountant=self.name,
                    scheme=scheme.value,
                )
        for run in ledger.runs:
            scheme = run.scheme
            relations = SCHEME_RELATIONS[scheme]
            if ledger.neighboring not in relations and not run.releases_nothing:
                raise UnsupportedSamplingError(
                    f"steps sampled by {scheme.value!r} are analysed under "
                    f"{' or '.join(r.value for r in relations)} only, and this ledger is "
                    f"{ledger.neighboring.value}. {RELATION_ADVICE.get(scheme, '')}".rstrip(),
                    accountant=self.name,
                    scheme=scheme.value,
                )

    # ---------------------------------------------------------------- public API
    def epsilon(self, ledger: LedgerLike, *, delta: float) -> PrivacyResult:
        """ε such that the ledger's steps are (ε, δ)-DP under the ledger's neighboring relation."""
        delta = check_delta("delta", delta)
        comp = as_compressed(ledger)
        self.check_supported(comp)
        warn_if_delta_too_large(delta=delta, population_size=_largest_population(ledger, comp))
        start = time.perf_counter()
        answer = self._trivial_epsilon(comp)
        if answer is None:
            answer = self._guarded(f"ε at δ={delta!r}", comp, self._epsilon, comp, delta)
        return self._result(
            "epsilon",
            _with_noise_source(_with_sampling(answer, comp), ledger),
            comp.num_steps,
            start,
            epsilon=answer.value,
            delta=delta,
        )

    def delta(self, ledger: LedgerLike, *, epsilon: float) -> PrivacyResult:
        """δ such that the ledger's steps are (ε, δ)-DP under the ledger's neighboring relation."""
        epsilon = _check_epsilon(epsilon)
        comp = as_compressed(ledger)
        self.check_supported(comp)
        start = time.perf_counter()
        answer = self._trivial_delta(comp)
        if answer is None:
            if math.isinf(epsilon):
                answer = Answer(0.0, lower=0.0, upper=0.0)
            else:
                answer = self._guarded(f"δ at ε={epsilon!r}", comp, self._delta, comp, epsilon)
        return self._result(
            "delta",
            _with_noise_source(_with_sampling(answer, comp), ledger),
            comp.num_steps,
            start,
            epsilon=epsilon,
            delta=answer.value,
        )

    def epsilon_curve(
        self,
        ledger: LedgerLike,
        *,
        delta: float,
        steps: Sequence[int],
        max_curve_points: int = DEFAULT_MAX_CURVE_POINTS,
    ) -> tuple[PrivacyResult, ...]:
        """ε at δ after each of ``steps`` steps (in the order given), computed incrementally.

        Step counts are integers in [0, number of steps] (numpy integers are accepted); each
        result's ``seconds`` is the total time divided by the number of points.

        Args:
            ledger: the ledger.
            delta: δ in (0, 1).
            steps: the step counts, at most ``max_curve_points`` of them (checked before any
                work, without materialising a longer iterable).
            max_curve_points: the most points accepted (default
                :data:`DEFAULT_MAX_CURVE_POINTS` = 10,000); each point costs at most one
                accountant evaluation, so this bounds the work of a curve.
        """
        delta = check_delta("delta", delta)
        if (
            isinstance(max_curve_points, bool)
            or not isinstance(max_curve_points, numbers.Integral)
            or max_curve_points < 1
        ):
            raise InvalidParameterError("max_curve_points", max_curve_points, "an integer >= 1")
        if isinstance(ledger, (PrivacyLedger, CompressedLedger)):
            refuse_correlated_curve(ledger)
        comp = as_compressed(ledger)
        self.check_supported(comp)
        warn_if_delta_too_large(delta=delta, population_size=_largest_population(ledger, comp))
        total = comp.num_steps
        too_many = (
            f"at most max_curve_points={max_curve_points} step counts (pass a larger "
            "max_curve_points, or fewer points)"
        )
        try:
            length = len(steps)
        except OverflowError:  # e.g. range(10**21)
            raise InvalidParameterError("steps", steps, too_many) from None
        except TypeError:
            length = None
        if length is not None and length > max_curve_points:
            raise InvalidParameterError("steps", f"<{length} step counts>", too_many)
        try:
            counts = list(itertools.islice(steps, max_curve_points + 1))
        except TypeError:
            raise InvalidParameterError(
                "steps", steps, "a non-empty sequence of step counts"
            ) from None
        if len(counts) > max_curve_points:
            raise InvalidParameterError("steps", steps, too_many)
        if not counts:
            raise InvalidParameterError("steps", steps, "a non-empty sequence of step counts")
        for i, t in enumerate(counts):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t <= total:
                raise InvalidParameterError(
                    "steps", t, f"step counts that are integers in [0, {describe_value(total)}]"
                )
            counts[i] = int(t)
        start = time.perf_counter()
        first_costly, first_not_private = _first_special_steps(comp)

        def trivial(t: int) -> Answer | None:
            if t >= first_not_private:
                return _infinite_epsilon()
            if t < first_costly:
                return Answer(0.0, lower=0.0, upper=0.0, kind=ResultKind.UPPER_BOUND)
            return None

        todo = sorted({t for t in counts if trivial(t) is None})
        computed = dict(
            zip(
                todo,
                self._guarded(
                    f"an ε curve at δ={delta!r}", comp, self._epsilon_curve, comp, delta, todo
                )
                if todo
                else [],
                strict=True,
            )
        )
        seconds_each = (time.perf_counter() - start) / len(counts)
        results = []
        for t in counts:
            answer = _with_noise_source(_with_sampling(trivial(t) or computed[t], comp), ledger)
            results.append(
                self._result(
                    "epsilon",
                    answer,
                    t,
                    None,
                    epsilon=answer.value,
                    delta=delta,
                    seconds=seconds_each,
                )
            )
        return tuple(results)

    # ---------------------------------------------------------------- internals
    def _guarded(self, what: str, comp: CompressedLedger, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` with numpy's floating-point checks raising, and turn any untyped
        numerical failure into an :class:`~dpledger.errors.AccountingNumericalError` that names
        the accountant, the question and the ledger. Typed errors and ``KeyboardInterrupt``
        pass through unchanged."""
        try:
            with np.errstate(over="raise", divide="raise", invalid="raise", under="ignore"):
                return fn(*args)
        except DPLedgerError:
            raise
        except _NUMERICAL_FAILURES as exc:
            detail = str(exc)[:300]
            raise AccountingNumericalError(
                f"the {self.name} accountant could not compute {what} for the "
                f"{describe_ledger(comp)}: {type(exc).__name__}: {detail}; these inputs are "
                "outside what its arithmetic handles: try another accountant (the rdp "
                "accountant handles the widest range) or less extreme settings"
            ) from exc

    def _trivial_epsilon(self, comp: CompressedLedger) -> Answer | None:
        if any(not r.is_private for r in comp.runs):
            return _infinite_epsilon()
        if not any(_is_costly(r) for r in comp.runs):
            return Answer(0.0, lower=0.0, upper=0.0, kind=ResultKind.UPPER_BOUND)
        return None

    def _trivial_delta(self, comp: CompressedLedger) -> Answer | None:
        if any(not r.is_private for r in comp.runs):
            return Answer(
                1.0, lower=None, upper=1.0, kind=ResultKind.UPPER_BOUND, warnings=(_NOT_PRIVATE,)
            )
        if not any(_is_costly(r) for r in comp.runs):
            return Answer(0.0, lower=0.0, upper=0.0, kind=ResultKind.UPPER_BOUND)
        return None

    def _result(
        self,
        quantity: str,
        answer: Answer,
        num_steps: int,
        start: float | None,
        *,
        epsilon: float,
        delta: float,
        seconds: float | None = None,
    ) -> PrivacyResult:
        if seconds is None:
            assert start is not None
            seconds = time.perf_counter() - start
        epsilon, delta = _checked_value("epsilon", epsilon), _checked_value("delta", delta)
        lower = None if answer.lower is None else _checked_value("lower", answer.lower)
        upper = None if answer.upper is None else _checked_value("upper", answer.upper)
        confident = answer.upper_confidence
        confident = None if confident is None else _checked_value("upper_confidence", confident)
        if quantity == "delta":
            delta = min(delta, 1.0)
            upper = None if upper is None else min(upper, 1.0)
            confident = None if confident is None else min(confident, 1.0)
        answer = attrs.evolve(answer, lower=lower, upper=upper, upper_confidence=confident)
        return PrivacyResult(
            accountant=self.name,
            quantity=quantity,
            epsilon=epsilon,
            delta=delta,
            kind=answer.kind or self.default_kind,
            lower=answer.lower,
            upper=answer.upper,
            upper_confidence=answer.upper_confidence,
            confidence=answer.confidence,
            num_steps=num_steps,
            settings=self.settings(),
            seconds=seconds,
            warnings=answer.warnings,
            details=answer.details,
        )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={describe_value(v)}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"


SECURE_NOISE_UNPROVED = (
    "the noise came from the secure sampler (the discrete Gaussian on a grid, "
    "docs/concepts/noise.md): no accountant's analysis is proved for it yet (the continuous "
    "Gaussian's dominance is argued, not proved, and the sampler's approximation term is not "
    "added), so this number is an approximation, not an upper bound"
)


def _with_noise_source(answer: Answer, ledger: LedgerLike) -> Answer:
    """The answer as an approximation without bounds when the ledger's noise provenance says the
    secure sampler drew the noise (:data:`SECURE_NOISE_UNPROVED`); unchanged otherwise."""
    records = provenance_of(getattr(ledger, "notes", ()))
    if not any(r.secure_sampler for r in records):
        return answer
    return attrs.evolve(
        answer,
        kind=ResultKind.APPROXIMATION,
        lower=None,
        upper=None,
        upper_confidence=None,
        confidence=None,
        warnings=(*answer.warnings, SECURE_NOISE_UNPROVED),
    )


def _with_sampling(answer: Answer, comp: CompressedLedger) -> Answer:
    """The answer with the ledger's unit and non-Poisson sampling in its details (unchanged
    for a record-level Poisson ledger)."""
    events = comp.sampling_events()
    if not events:
        return answer
    details = dict(answer.details)
    details["unit"] = comp.units[0].value
    details["sampling"] = [e.describe() for e in events]
    return attrs.evolve(answer, details=details)


def _checked_value(name: str, value: Any) -> float:
    """``value`` as a float ≥ 0 (a negative zero or a negative rounding residue becomes 0.0);
    NaN or a clearly negative number is an accountant bug and raises."""
    x = float(value)
    if math.isnan(x) or x < -1e-9:
        raise AccountingNumericalError(
            f"the accountant produced {name}={x!r}, which is not a valid privacy parameter; "
            "please report this ledger"
        )
    return max(x, 0.0)


def _infinite_epsilon() -> Answer:
    return Answer(
        math.inf,
        lower=math.inf,
        upper=math.inf,
        kind=ResultKind.UPPER_BOUND,
        warnings=(_NOT_PRIVATE,),
    )


def _first_special_steps(comp: CompressedLedger) -> tuple[float, float]:
    """1-based indices of the first costly step and of the first non-private step (∞ if none).

    The prefix of t steps has a costly step iff t ≥ the first, a non-private one iff t ≥ the
    second.
    """
    first_costly = math.inf
    first_not_private = math.inf
    seen = 0
    for r in comp.runs:
        if first_costly == math.inf and _is_costly(r):
            first_costly = seen + 1
        if not r.is_private:
            first_not_private = seen + 1
            break
        seen += r.count
    return first_costly, first_not_private


SCHEME_ADVICE: dict[SamplingScheme, str] = {
    SamplingScheme.FIXED_SIZE: "The rdp accountant (Wang, Balle & Kasiviswanathan 2019) and "
    "the pld accountant (a dominating pair, tighter) certify it under replace-one.",
    SamplingScheme.TRUNCATED_POISSON: "The pld accountant certifies it (dp-accounting's "
    "truncated subsampled Gaussian).",
    SamplingScheme.BALLS_IN_BINS: "The random_allocation accountant certifies it with "
    "amplification; the rdp and pld accountants certify it without (each record is in one "
    "batch per epoch).",
    SamplingScheme.SHUFFLE: "No accountant credits shuffled batches with amplification; the "
    "rdp and pld accountants certify a replace-one ledger without it (each record is in one "
    "batch per epoch), and dpledger.accountants.shuffle_bound gives the ε a shuffled run "
    "provably exceeds.",
}
RELATION_ADVICE: dict[SamplingScheme, str] = {
    SamplingScheme.FIXED_SIZE: "Record the run in a ledger with neighboring='replace_one' "
    "(the natural relation for fixed-size batches), or sample with PoissonBatchSampler.",
    SamplingScheme.SHUFFLE: "Record the run in a ledger with neighboring='replace_one', or "
    "sample with PoissonBatchSampler for an amplified add/remove guarantee.",
}

_NOT_PRIVATE = (
    "the ledger has a sum query with noise_stddev = 0 on a sampled step: the run is not "
    "differentially private (ε = ∞)"
)

ACCOUNTANT_MODULES: dict[str, tuple[str, str]] = {
    "rdp": ("dpledger.accountants.rdp", "RdpAccountant"),
    "prv": ("dpledger.accountants.prv", "PrvAccountant"),
    "gdp": ("dpledger.accountants.gdp", "GdpAccountant"),
    "pld": ("dpledger.accountants.pld", "PldAccountant"),
    "balls_in_bins": ("dpledger.accountants.balls_in_bins_mc", "BallsInBinsAccountant"),
    "random_allocation": (
        "dpledger.accountants.random_allocation_accountant",
        "RandomAllocationAccountant",
    ),
}

SCHEME_SPECIFIC_ACCOUNTANTS: dict[str, SamplingScheme] = {
    "balls_in_bins": SamplingScheme.BALLS_IN_BINS,
    "random_allocation": SamplingScheme.BALLS_IN_BINS,
}
"""Accountants that analyse one sampling scheme only; the CLI's ``--accountant all`` runs them
only on ledgers with steps of that scheme."""


def make_accountant(name: str, **settings: Any) -> Accountant:
    """An accountant by its short name (``"rdp"``, ``"prv"``, ``"gdp"``, ``"pld"``, or
    ``"balls_in_bins"`` for the Monte-Carlo estimate of balls-in-bins ledgers,
    ``"random_allocation"`` for their certified bound with amplification)."""
    try:
        module_name, class_name = ACCOUNTANT_MODULES[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(ACCOUNTANT_MODULES))
        raise InvalidParameterError("accountant", name, f"one of {valid}") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**settings)
