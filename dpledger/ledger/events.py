"""The two event kinds of a privacy ledger (McMahan & Andrew, section 5).

A ledger is a sequence of *sampling events*, each followed by the *sum-query events* that were
computed on that sample. A sampling event together with the sum queries after it is one *step*.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.validation import (
    check_enum,
    check_non_negative_finite,
    check_positive_finite,
    check_positive_int,
    check_probability,
)

__all__ = [
    "NeighboringRelation",
    "SamplingEvent",
    "SamplingScheme",
    "SumQueryEvent",
    "full_scheme_expectation",
    "inverse_square_term",
]


class NeighboringRelation(str, enum.Enum):
    """Which pairs of data sets count as neighbours for the (ε, δ) guarantee.

    ADD_REMOVE: D' is D with one record added or removed (the usual DP-SGD setting).
    REPLACE_ONE: D' is D with one record replaced by another. The L2 sensitivity of a sum query
    clipped to S is then 2S, not S, and accountants must account for that (or refuse the ledger).
    """

    ADD_REMOVE = "add_remove"
    REPLACE_ONE = "replace_one"

    @classmethod
    def parse(cls, value: Any, *, parameter: str = "neighboring") -> NeighboringRelation:
        """Return the relation named by ``value`` (an instance or its string value)."""
        return check_enum(parameter, value, cls)


class SamplingScheme(str, enum.Enum):
    """How the records of a step's sample were drawn from the population.

    POISSON: each of the n records is included independently with probability q; the sample size
    is random (Binomial(n, q)) and may be zero.
    FULL: every record is used (q = 1); the deterministic full-batch case of POISSON.
    """

    POISSON = "poisson"
    FULL = "full"

    @classmethod
    def parse(cls, value: Any, *, parameter: str = "scheme") -> SamplingScheme:
        """Return the scheme named by ``value`` (an instance or its string value)."""
        return check_enum(parameter, value, cls)


def _probability(value: Any) -> float:
    return check_probability("sampling_probability", value)


MAX_POPULATION_SIZE = 2**128
"""The largest population a sampling event may name: far beyond any data set, small enough that
every population size prints and converts to a finite float."""


def _population_size(value: Any) -> int | None:
    if value is None:
        return None
    expected = "an integer in [1, 2**128], or None if unknown"
    try:
        n = check_positive_int("population_size", value)
    except InvalidParameterError:
        raise InvalidParameterError("population_size", value, expected) from None
    if n > MAX_POPULATION_SIZE:
        raise InvalidParameterError("population_size", value, expected)
    return n


def _default_scheme(inst: SamplingEvent) -> SamplingScheme:
    return SamplingScheme.FULL if inst.sampling_probability == 1.0 else SamplingScheme.POISSON


def _scheme_matches(inst: SamplingEvent, _attribute: attrs.Attribute, value: Any) -> None:
    if value is SamplingScheme.FULL and inst.sampling_probability != 1.0:
        raise InvalidParameterError(
            "scheme", value.value, full_scheme_expectation(inst.sampling_probability)
        )


def full_scheme_expectation(sampling_probability: float) -> str:
    """What the error for scheme='full' with q < 1 says is valid."""
    return (
        f"'poisson' when sampling_probability={sampling_probability!r} "
        "('full' uses the whole population, so it needs sampling_probability=1.0)"
    )


@attrs.frozen(slots=True)
class SamplingEvent:
    """A sample of records was drawn; it opens a new step.

    Attributes:
        sampling_probability: q in [0, 1]. Under ``POISSON`` each record of the population is in
            the sample independently with probability q. This must be the probability of the
            sampler actually used, not 1 / (number of batches).
        population_size: n, the number of records in the population the sample is drawn from,
            or None when it is not known. Accounting does not use n (the privacy of Poisson
            sampling depends on q only); n is kept for the fixed-denominator average q·n and
            for the record.
        scheme: how the sample was drawn: ``POISSON``, or ``FULL`` (only with q = 1). The
            default is ``FULL`` when q = 1 and ``POISSON`` otherwise.
    """

    sampling_probability: float = attrs.field(converter=_probability)
    population_size: int | None = attrs.field(default=None, converter=_population_size)
    scheme: SamplingScheme = attrs.field(
        default=attrs.Factory(_default_scheme, takes_self=True),
        converter=SamplingScheme.parse,
        validator=_scheme_matches,
    )


def _norm_bound(value: Any) -> float:
    return check_positive_finite("l2_norm_bound", value)


def _noise_stddev(value: Any) -> float:
    return check_non_negative_finite("noise_stddev", value)


def _label(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidParameterError(attribute.name, value, "a string or None")


def inverse_square_term(l2_norm_bound: float, noise_stddev: float) -> float:
    """(S / σ̃)², one query's term in paper Eq. 1; ∞ when σ̃ = 0.

    Computed as a product, so a ratio beyond 1e154 gives ∞ (the step is then treated as not
    private, which is conservative) instead of raising ``OverflowError`` as ``** 2`` would.
    """
    if noise_stddev == 0.0:
        return math.inf
    ratio = l2_norm_bound / noise_stddev
    return ratio * ratio


@attrs.frozen(slots=True)
class SumQueryEvent:
    """A Gaussian sum query was computed on the current step's sample.

    The query clipped each sampled record's vector (for this group of arrays) to L2 norm at most
    ``l2_norm_bound``, summed the clipped vectors over the sample and added independent
    N(0, noise_stddev²) noise to every coordinate of the sum. Its privacy tuple is
    (S, σ̃) = (l2_norm_bound, noise_stddev) and its noise multiplier is z = σ̃ / S.

    Attributes:
        l2_norm_bound: S > 0, the L2 bound every record's contribution to the sum was clipped to
            (the add/remove sensitivity of the sum).
        noise_stddev: σ̃ ≥ 0, the standard deviation of the Gaussian noise added to each coordinate
            of the *sum* (not of the average). σ̃ = 0 is legal to record but makes the step
            non-private: accountants report ε = ∞ for it.
        label: an optional name for what was queried (a layer, a metric, a count).
    """

    l2_norm_bound: float = attrs.field(converter=_norm_bound)
    noise_stddev: float = attrs.field(converter=_noise_stddev)
    label: str | None = attrs.field(default=None, validator=_label)

    @property
    def noise_multiplier(self) -> float:
        """z = σ̃ / S (0 when σ̃ = 0)."""
        return self.noise_stddev / self.l2_norm_bound

    @property
    def inverse_square_multiplier(self) -> float:
        """(S / σ̃)², this query's term in paper Eq. 1 (∞ when σ̃ = 0)."""
        return inverse_square_term(self.l2_norm_bound, self.noise_stddev)
