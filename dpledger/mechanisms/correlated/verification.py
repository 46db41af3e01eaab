"""Replaying a recorded release: its derived numbers are recomputed from its parameters.

A ``correlated_release`` line (:class:`~dpledger.ledger.CorrelatedReleaseEvent`) records the
strategy's kind and parameters, which determine C, and beside them numbers derived from C: the
sensitivity sens(C) under the participation schema, max_j ‖C_j‖, the number of bands of C (for
amplification) and C's hash. The accountants compute ε from the derived numbers, so a ledger
written by a version with a bug in them, or edited and re-hashed, would carry a wrong (too
small) sensitivity into ε. Before any accountant uses a release, :func:`verified_release`
rebuilds C from the parameters (:func:`~dpledger.mechanisms.correlated.rebuild.strategy_matrix`, the
constructors' own code), recomputes every derived number with the code that computed it when
the release was made (:func:`~dpledger.mechanisms.correlated.sensitivity`,
:func:`~dpledger.mechanisms.correlated.release.count_bands`), and refuses the release with
:class:`~dpledger.ledger.correlated.ReleaseMismatchError` when a recorded number differs from its
recomputation beyond floating-point rounding (:data:`RELATIVE_TOLERANCE`).

Cost: rebuilding C and its Gram matrix is what recording the release cost, O(T²) memory; a
release whose C would exceed :data:`~dpledger.mechanisms.correlated.MAX_MATRIX_BYTES` (which no
constructor builds) is refused up front with :class:`~dpledger.errors.ComputationBudgetError`,
before anything is allocated, rather than trusted. Recomputations are cached by event, so
replaying the same ledger with several accountants rebuilds C once.
"""

from __future__ import annotations

import functools
import math

import attrs

from dpledger.errors import ComputationBudgetError, InvalidParameterError, UnsupportedLedgerError
from dpledger.ledger.correlated import CorrelatedReleaseEvent, ReleaseMismatchError
from dpledger.mechanisms.correlated.rebuild import strategy_matrix
from dpledger.mechanisms.correlated.release import count_bands
from dpledger.mechanisms.correlated.sensitivity import sensitivity
from dpledger.mechanisms.correlated.strategies import matrix_hash
from dpledger.sampling.participation import ParticipationSchema

__all__ = ["RELATIVE_TOLERANCE", "RecomputedRelease", "recompute_release", "verified_release"]

RELATIVE_TOLERANCE = 1e-9
"""How far a recorded sensitivity or column norm may be from its recomputation, relative.

Both are square roots of sums of at most T² products of entries of C (T ≤ a few thousand,
:data:`~dpledger.mechanisms.correlated.MAX_MATRIX_BYTES`): summation in another order (another
BLAS, another machine) moves them by about T·2⁻⁵³ ≈ 10⁻¹² relative; 10⁻⁹ leaves a margin of
1000 and is far below any difference that matters to ε."""

_EXACT_KINDS = ("tree", "tree_honaker", "banded_toeplitz")
"""Kinds whose C has entries that do not depend on floating-point functions (0/1, or the
recorded coefficients), so its hash is reproducible everywhere and is compared."""


@attrs.frozen
class RecomputedRelease:
    """The numbers a release derives from C, recomputed from the recorded parameters.

    Attributes:
        sensitivity: sens(C) per unit clip under the recorded participation schema.
        sensitivity_exact: whether ``sensitivity`` is the maximum (not an upper bound).
        max_column_norm: max_j ‖C_j‖.
        bands: the number of bands of C for an amplified release; None otherwise.
        strategy_hash: :func:`~dpledger.mechanisms.correlated.strategies.matrix_hash` of the
            rebuilt C.
    """

    sensitivity: float
    sensitivity_exact: bool
    max_column_norm: float
    bands: int | None
    strategy_hash: str


def _schema(event: CorrelatedReleaseEvent) -> ParticipationSchema:
    return ParticipationSchema(
        event.participation, event.num_steps, event.max_participations, event.min_separation
    )


@functools.lru_cache(maxsize=64)
def _recompute(event: CorrelatedReleaseEvent) -> RecomputedRelease:
    c = strategy_matrix(event.strategy, event.strategy_params)
    if c.shape[1] != event.num_steps:
        raise InvalidParameterError(
            "strategy_params",
            event.strategy_params,
            f"num_steps={event.num_steps} (the release's T)",
        )
    sens = sensitivity(c, _schema(event))
    return RecomputedRelease(
        sensitivity=sens.value,
        sensitivity_exact=sens.exact,
        max_column_norm=sens.max_column_norm,
        bands=count_bands(c) if event.amplified else None,
        strategy_hash=matrix_hash(c),
    )


def recompute_release(event: CorrelatedReleaseEvent) -> RecomputedRelease:
    """Rebuild C from ``event``'s strategy and parameters and recompute what it derives from C.

    Raises:
        InvalidParameterError: the parameters do not determine a strategy dpledger builds (an
            unknown kind, missing or extra parameters, values out of range, another T).
        ComputationBudgetError: C would exceed ``MAX_MATRIX_BYTES`` (refused before
            allocating).
    """
    if not isinstance(event, CorrelatedReleaseEvent):
        raise InvalidParameterError("event", event, "a CorrelatedReleaseEvent")
    return _recompute(event)


def _close(recorded: float, recomputed: float) -> bool:
    return math.isclose(recorded, recomputed, rel_tol=RELATIVE_TOLERANCE, abs_tol=0.0)


def verified_release(event: CorrelatedReleaseEvent, *, release: int) -> CorrelatedReleaseEvent:
    """``event`` once its derived numbers agree with their recomputation (module docstring).

    The event returned carries the larger of each recorded and recomputed value (they differ by
    rounding at most), so the accounting never uses the smaller of two equally valid numbers.

    Args:
        event: a release read from a ledger.
        release: its 0-based index among the ledger's releases (named in errors).

    Raises:
        ReleaseMismatchError: a recorded sensitivity, column norm, number of bands or hash
            differs from its recomputation.
        UnsupportedLedgerError: the parameters do not determine a strategy dpledger builds, so
            the sensitivity cannot be recomputed (and is not trusted).
        ComputationBudgetError: rebuilding C would exceed ``MAX_MATRIX_BYTES``.
    """
    try:
        again = recompute_release(event)
    except InvalidParameterError as exc:
        raise UnsupportedLedgerError(
            f"correlated-noise release {release} ({event.strategy}"
            f"{'' if event.label is None else ', ' + repr(event.label)}): its strategy "
            f"parameters do not determine a strategy dpledger can rebuild ({exc}), so its "
            "recorded sensitivity cannot be checked; refusing rather than trusting it"
        ) from None
    except ComputationBudgetError as exc:
        raise ComputationBudgetError(
            parameter="num_steps",
            value=event.num_steps,
            estimated_bytes=exc.estimated_bytes,
            budget_bytes=exc.budget_bytes,
            suggestion=(
                f"correlated-noise release {release}'s C is larger than any factorization "
                "dpledger builds (MAX_MATRIX_BYTES), so its recorded sensitivity cannot be "
                "checked; refusing rather than trusting it"
            ),
        ) from None
    checks: list[tuple[str, object, object, bool]] = [
        (
            "sensitivity",
            event.sensitivity,
            again.sensitivity,
            _close(event.sensitivity, again.sensitivity),
        ),
        (
            "max_column_norm",
            event.max_column_norm,
            again.max_column_norm,
            _close(event.max_column_norm, again.max_column_norm),
        ),
        ("bands", event.bands, again.bands, event.bands == again.bands),
    ]
    if event.strategy in _EXACT_KINDS:
        checks.append(
            (
                "strategy_hash",
                event.strategy_hash,
                again.strategy_hash,
                event.strategy_hash == again.strategy_hash,
            )
        )
    for field, recorded, recomputed, agree in checks:
        if not agree:
            raise ReleaseMismatchError(
                release=release,
                label=event.label,
                field=field,
                recorded=recorded,
                recomputed=recomputed,
            )
    return attrs.evolve(
        event,
        sensitivity=max(event.sensitivity, again.sensitivity),
        max_column_norm=max(event.max_column_norm, again.max_column_norm),
    )
