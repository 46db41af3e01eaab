"""Turning noised sums into averages.

The default is the paper's fixed-denominator estimate (McMahan & Andrew, section 1, step 3)

    x̂ = (Σ_{i∈R} π_S(x_i) + N(0, σ̃² I)) / (q·n),

unbiased for the population average of the clipped records because E|R| = q·n under Poisson
sampling. Its denominator is public, so x̂ is post-processing of the Gaussian sum query and
costs nothing beyond the query's own accounting.

Dividing by the realised sample size |R| instead (:func:`realised_batch_average`) makes the
output depend on |R|, which itself depends on whether a given record was sampled; the Gaussian
sum query's accounting does not cover that release. It is offered only as an explicit opt-in and
warns with :class:`UnaccountedReleaseWarning` every time it is used.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.backend import Array, ArrayBackend, resolve_backend, scale_all
from dpledger.mechanisms.sum_query import as_members
from dpledger.validation import (
    FLOAT_INT_MAX,
    check_non_negative_int,
    check_positive_finite,
    check_positive_int,
    check_probability,
)

__all__ = [
    "UnaccountedReleaseWarning",
    "fixed_denominator_average",
    "realised_batch_average",
]


class UnaccountedReleaseWarning(UserWarning):
    """A value was released that the ledger's Gaussian sum queries do not account for."""


def fixed_denominator_average(
    noised_sums: Array | Sequence[Array],
    *,
    sampling_probability: float | None = None,
    population_size: int | None = None,
    denominator: float | None = None,
    backend: ArrayBackend | None = None,
) -> list[Array]:
    """noised sum / (q·n) for every array: the unbiased fixed-denominator average.

    Give q and n (Poisson: the expected sample size q·n), or ``denominator``, the public
    constant of the step's sampling scheme (b for fixed-size and shuffled batches, n / k for
    balls-in-bins; see :attr:`dpledger.ledger.SamplingEvent.average_denominator`).

    Args:
        noised_sums: the output of a sum query's release (one array or a sequence).
        sampling_probability: q > 0 of the step's sample.
        population_size: n, the number of records sampled from.
        denominator: a public denominator > 0, instead of q and n.
        backend: the array backend (default NumPy).

    Raises:
        InvalidParameterError: q not in (0, 1], n not an integer ≥ 1 within the float64 range, a
            denominator that is not a finite number > 0, a denominator (or q·n) so small that
            its reciprocal overflows, or both forms given.
    """
    be = resolve_backend(backend)
    if denominator is not None:
        if sampling_probability is not None or population_size is not None:
            raise InvalidParameterError(
                "denominator", denominator, "None when sampling_probability= is given"
            )
        d = check_positive_finite("denominator", denominator)
        factor = _reciprocal("denominator", denominator, d)
    else:
        q = check_probability("sampling_probability", sampling_probability)
        if q == 0.0:
            raise InvalidParameterError(
                "sampling_probability", sampling_probability, "q > 0 (the denominator is q·n)"
            )
        n = check_positive_int("population_size", population_size, maximum=FLOAT_INT_MAX)
        factor = _reciprocal("sampling_probability", sampling_probability, q * n)
    return scale_all(be, as_members(noised_sums, parameter="noised_sums"), factor)


def _reciprocal(name: str, value: object, denominator: float) -> float:
    """1 / denominator, refused when it overflows float64 (a denominator below 2**-1024,
    whose average would be ∞ or NaN)."""
    factor = 1.0 / denominator
    if not math.isfinite(factor):
        raise InvalidParameterError(
            name,
            value,
            f"a value whose denominator ({denominator!r}) has a finite reciprocal "
            "(at least about 5.6e-309)",
        )
    return factor


def realised_batch_average(
    noised_sums: Array | Sequence[Array],
    *,
    batch_size: int,
    backend: ArrayBackend | None = None,
) -> list[Array]:
    """noised sum / max(|R|, 1) — NOT covered by the Gaussian sum query's accounting.

    The realised sample size |R| is a function of the private data (under add/remove it changes
    by one with the record whose privacy is at stake), and this estimate releases it in
    combination with the sum. Use it only if |R| is accounted for separately (for example by
    releasing a noised count as its own sum query) or the guarantee does not need to cover it.
    Warns with :class:`UnaccountedReleaseWarning`.

    Args:
        noised_sums: the output of a sum query's release (one array or a sequence).
        batch_size: |R| ≥ 0, the number of records in the sample (0 divides by 1), within the
            float64 range.
        backend: the array backend (default NumPy).

    Raises:
        InvalidParameterError: ``batch_size`` is not such an integer.
    """
    size = check_non_negative_int("batch_size", batch_size, maximum=FLOAT_INT_MAX)
    warnings.warn(
        "dividing by the realised batch size releases a function of |R|, which the Gaussian "
        "sum query's accounting does not cover; use the fixed denominator q·n to stay within "
        "the ledger's guarantee",
        UnaccountedReleaseWarning,
        stacklevel=2,
    )
    be = resolve_backend(backend)
    factor = 1.0 / max(size, 1)
    return [be.scale(s, factor) for s in as_members(noised_sums, parameter="noised_sums")]
