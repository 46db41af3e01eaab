"""Self-composition of dp-accounting PLDs that stays fast for any step count.

dp-accounting's ``PrivacyLossDistribution.self_compose(k)`` is an FFT power for a dense PMF, but
for a *sparse* PMF (at most 1,000 loss values, e.g. a step whose privacy loss is tiny against the
discretisation interval) it first computes ``size ** k`` as a Python integer and then composes
the PMF with itself k − 1 times in a Python loop: for k = 10¹² that never finishes. For a sparse
PMF and k above :data:`SPARSE_LOOP_LIMIT` we compose by repeated squaring instead (about
2·log₂ k compositions, each through dp-accounting's public ``compose``, which switches to a
dense FFT as soon as the result grows). Every composition moves at most its
``tail_mass_truncation`` of probability to an infinite loss (pessimistic), so the result is
still an upper bound; the number of compositions is returned so callers can bound that mass.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SPARSE_LOOP_LIMIT", "self_compose"]

SPARSE_LOOP_LIMIT = 1024
_TAIL_MASS = 1e-15  # dp-accounting's default tail_mass_truncation


def _is_sparse(pld: Any) -> bool:
    # dp-accounting keeps the PMFs in private attributes; a PMF class named Sparse… loops
    pmfs = (getattr(pld, "_pmf_remove", None), getattr(pld, "_pmf_add", None))
    return any(type(p).__name__.startswith("Sparse") for p in pmfs if p is not None)


def self_compose(
    pld: Any, count: int, *, tail_mass_truncation: float = _TAIL_MASS
) -> tuple[Any, int]:
    """(``pld`` composed ``count`` times with itself, the number of compositions performed).

    dp-accounting's own self-composition (one operation) unless the PMF is sparse and
    ``count`` exceeds :data:`SPARSE_LOOP_LIMIT`; then repeated squaring.
    """
    if count <= SPARSE_LOOP_LIMIT or not _is_sparse(pld):
        return pld.self_compose(count, tail_mass_truncation=tail_mass_truncation), 1
    result, base, n, operations = None, pld, count, 0
    while n:
        if n & 1:
            if result is None:
                result = base
            else:
                result = result.compose(base, tail_mass_truncation=tail_mass_truncation)
                operations += 1
        n >>= 1
        if n:
            base = base.compose(base, tail_mass_truncation=tail_mass_truncation)
            operations += 1
    return result, operations
