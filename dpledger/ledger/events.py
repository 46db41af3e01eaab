"""The two event kinds of a privacy ledger (McMahan & Andrew, section 5).

A ledger is a sequence of *sampling events*, each followed by the *sum-query events* that were
computed on that sample. A sampling event together with the sum queries after it is one *step*.
"""

from __future__ import annotations

import enum
import math
import numbers
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.validation import (
    check_non_negative_finite,
    check_positive_finite,
    check_probability,
)

__all__ = [
    "NeighboringRelation",
    "SamplingEvent",
    "SamplingScheme",
    "SumQueryEvent",
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
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(repr(m.value) for m in cls)
            raise InvalidParameterError(parameter, value, f"one of {valid}") from None


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
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(repr(m.value) for m in cls)
            raise InvalidParameterError(parameter, value, f"one of {valid}") from None


def _probability(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_probability(attribute.name, value)


def _population_size(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidParameterError(attribute.name, value, "an integer >= 1, or None if unknown")


def _scheme_matches(inst: SamplingEvent, _attribute: attrs.Attribute, value: Any) -> None:
    if value is SamplingScheme.FULL and inst.sampling_probability != 1.0:
        raise InvalidParameterError(
            "sampling_probability",
            inst.sampling_probability,
            "1.0 when scheme='full' (the full population is used every step)",
        )


def _to_int_or_none(value: Any) -> Any:
    # numpy integers are stored as plain ints; anything else is left for the validator to judge.
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def _to_float(value: Any) -> Any:
    # numpy floats and ints are stored as plain floats; strings, bools etc. reach the validator.
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


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
        scheme: how the sample was drawn (``POISSON``, or ``FULL`` for q = 1).
    """

    sampling_probability: float = attrs.field(converter=_to_float, validator=_probability)
    population_size: int | None = attrs.field(
        default=None, converter=_to_int_or_none, validator=_population_size
    )
    scheme: SamplingScheme = attrs.field(
        default=SamplingScheme.POISSON,
        converter=SamplingScheme.parse,
        validator=_scheme_matches,
    )


def _norm_bound(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_positive_finite(attribute.name, value)


def _noise_stddev(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_non_negative_finite(attribute.name, value)


def _label(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidParameterError(attribute.name, value, "a string or None")


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

    l2_norm_bound: float = attrs.field(converter=_to_float, validator=_norm_bound)
    noise_stddev: float = attrs.field(converter=_to_float, validator=_noise_stddev)
    label: str | None = attrs.field(default=None, validator=_label)

    @property
    def noise_multiplier(self) -> float:
        """z = σ̃ / S (0 when σ̃ = 0)."""
        return self.noise_stddev / self.l2_norm_bound

    @property
    def inverse_square_multiplier(self) -> float:
        """(S / σ̃)², this query's term in paper Eq. 1 (∞ when σ̃ = 0)."""
        if self.noise_stddev == 0.0:
            return math.inf
        return (self.l2_norm_bound / self.noise_stddev) ** 2
