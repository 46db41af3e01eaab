"""The two event kinds of a privacy ledger (McMahan & Andrew, section 5).

A ledger is a sequence of *sampling events*, each followed by the *sum-query events* that were
computed on that sample. A sampling event together with the sum queries after it is one *step*.

This module is a little over 500 lines because it is the two event types and their enums, most
of it :class:`SamplingEvent`'s per-scheme constructors and checks; splitting them apart would
split one type.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.validation import (
    check_bool,
    check_enum,
    check_non_negative_finite,
    check_optional_str,
    check_positive_finite,
    check_positive_int,
    check_probability,
)

__all__ = [
    "SCHEME_RELATIONS",
    "NeighboringRelation",
    "PrivacyUnit",
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
    FIXED_SIZE: ``fixed_size_without_replacement(b, n)``: a uniformly random subset of exactly b of
        the n records, drawn afresh (independently) for every step.
    TRUNCATED_POISSON: ``truncated_poisson(q, n, max_batch_size)``: a Poisson sample with rate q,
        cut to a uniformly random subset of ``max_batch_size`` records when it is larger (a cap
        that keeps a step within memory).
    BALLS_IN_BINS: ``balls_in_bins(num_batches, n)`` ("random allocation"): at the start of an
        epoch every record is put into one of k batches, uniformly and independently; the epoch
        then runs those k batches (batch sizes vary). The epoch is the unit of analysis.
    SHUFFLE: ``shuffle(batch_size, n)``: at the start of an epoch the n records are permuted
        uniformly at random and cut into ⌈n / b⌉ consecutive batches of b (the last one smaller
        when b does not divide n); what every default ``DataLoader(shuffle=True)`` and
        ``tf.data`` shuffle-and-batch pipeline does. No accountant credits it with
        amplification (see :mod:`dpledger.accountants`).
    """

    POISSON = "poisson"
    FULL = "full"
    FIXED_SIZE = "fixed_size_without_replacement"
    TRUNCATED_POISSON = "truncated_poisson"
    BALLS_IN_BINS = "balls_in_bins"
    SHUFFLE = "shuffle"

    @classmethod
    def parse(cls, value: Any, *, parameter: str = "scheme") -> SamplingScheme:
        """Return the scheme named by ``value`` (an instance or its string value)."""
        return check_enum(parameter, value, cls)

    @property
    def is_epoch_based(self) -> bool:
        """True for the schemes whose draws are made per epoch (balls-in-bins, shuffle)."""
        return self in (SamplingScheme.BALLS_IN_BINS, SamplingScheme.SHUFFLE)


class PrivacyUnit(str, enum.Enum):
    """What one neighbouring data set differs by: one record, or all the records of one user.

    RECORD: record-level DP (the default): the guarantee protects each record (example).
    USER: user-level DP: the sampler drew users, each contributing a bounded number of records
        whose summed (or averaged) gradient was clipped as one; the guarantee protects each user
        and the population size counts users.
    """

    RECORD = "record"
    USER = "user"

    @classmethod
    def parse(cls, value: Any, *, parameter: str = "unit") -> PrivacyUnit:
        """Return the unit named by ``value`` (an instance or its string value)."""
        return check_enum(parameter, value, cls)


# The neighbouring relations under which dpledger analyses each sampling scheme: an accountant
# refuses a ledger whose relation is not listed for one of its (costly) steps' schemes.
# (Poisson sampling under replace-one is analysed by the PRV accountant only; the others refuse
# it themselves.)
# Fixed-size sampling without replacement is analysed under replace-one only (Wang, Balle &
# Kasiviswanathan 2019 define it there: the population size is public and one record is
# swapped). Shuffling has a valid upper bound (no amplification: each record is in one batch
# per epoch) only under replace-one, where the permutation can be coupled position by position.
# Truncated Poisson is analysed under add/remove only, like Poisson sampling itself (dpledger
# has no replace-one analysis of subsampled steps that it can cite and test).
SCHEME_RELATIONS: dict[SamplingScheme, tuple[NeighboringRelation, ...]] = {
    SamplingScheme.POISSON: (NeighboringRelation.ADD_REMOVE, NeighboringRelation.REPLACE_ONE),
    SamplingScheme.FULL: (NeighboringRelation.ADD_REMOVE, NeighboringRelation.REPLACE_ONE),
    SamplingScheme.FIXED_SIZE: (NeighboringRelation.REPLACE_ONE,),
    SamplingScheme.TRUNCATED_POISSON: (NeighboringRelation.ADD_REMOVE,),
    SamplingScheme.BALLS_IN_BINS: (
        NeighboringRelation.ADD_REMOVE,
        NeighboringRelation.REPLACE_ONE,
    ),
    SamplingScheme.SHUFFLE: (NeighboringRelation.REPLACE_ONE,),
}


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


def _optional_count(name: str) -> Any:
    def convert(value: Any) -> int | None:
        if value is None:
            return None
        expected = "an integer in [1, 2**128], or None"
        try:
            k = check_positive_int(name, value)
        except InvalidParameterError:
            raise InvalidParameterError(name, value, expected) from None
        if k > MAX_POPULATION_SIZE:
            raise InvalidParameterError(name, value, expected)
        return k

    return convert


def _batch_size(value: Any) -> int | None:
    return _optional_count("batch_size")(value)


def _max_batch_size(value: Any) -> int | None:
    return _optional_count("max_batch_size")(value)


def _num_batches(value: Any) -> int | None:
    return _optional_count("num_batches")(value)


def _scheme(value: Any) -> SamplingScheme:
    return SamplingScheme.parse(value)


def _unit(value: Any) -> PrivacyUnit:
    return PrivacyUnit.parse(value)


def _default_scheme(inst: SamplingEvent) -> SamplingScheme:
    return SamplingScheme.FULL if inst.sampling_probability == 1.0 else SamplingScheme.POISSON


def full_scheme_expectation(sampling_probability: float) -> str:
    """What the error for scheme='full' with q < 1 says is valid."""
    return (
        f"'poisson' when sampling_probability={sampling_probability!r} "
        "('full' uses the whole population, so it needs sampling_probability=1.0)"
    )


# Which of the optional fields each scheme takes (the others must be None / False).
_SCHEME_FIELDS: dict[SamplingScheme, frozenset[str]] = {
    SamplingScheme.POISSON: frozenset(),
    SamplingScheme.FULL: frozenset(),
    SamplingScheme.FIXED_SIZE: frozenset({"batch_size"}),
    SamplingScheme.TRUNCATED_POISSON: frozenset({"max_batch_size"}),
    SamplingScheme.BALLS_IN_BINS: frozenset({"num_batches", "epoch_start"}),
    SamplingScheme.SHUFFLE: frozenset({"batch_size", "epoch_start"}),
}
_OPTIONAL_FIELDS = ("batch_size", "max_batch_size", "num_batches", "epoch_start")


@attrs.frozen(slots=True)
class SamplingEvent:
    """A sample of records was drawn; it opens a new step.

    Build events of the newer schemes with the class methods (:meth:`fixed_size`,
    :meth:`truncated_poisson`, :meth:`balls_in_bins`, :meth:`shuffle`), which derive q.

    Attributes:
        sampling_probability: q in [0, 1]. Under ``POISSON`` (and ``TRUNCATED_POISSON`` before the
            cap) each record of the population is in the sample independently with probability
            q. This must be the probability of the sampler actually used, not
            1 / (number of batches). For the other schemes it is the nominal rate each record
            is used at, derived from the scheme's parameters: b / n for ``FIXED_SIZE`` and
            ``SHUFFLE``, 1 / k for ``BALLS_IN_BINS``.
        population_size: n, the number of records (users, for ``unit="user"``) in the population
            the sample is drawn from, or None when it is not known (``POISSON`` and ``FULL``
            only: the other schemes' analyses need n).
        scheme: how the sample was drawn (see :class:`SamplingScheme`). The default is ``FULL``
            when q = 1 and ``POISSON`` otherwise.
        batch_size: b, for ``FIXED_SIZE`` and ``SHUFFLE`` (1 ≤ b ≤ n).
        max_batch_size: the cap of ``TRUNCATED_POISSON``.
        num_batches: k, the batches per epoch of ``BALLS_IN_BINS``.
        epoch_start: for the epoch-based schemes, True on the first step of an epoch (the step
            whose draw made the epoch's allocation or permutation).
        unit: the unit of privacy, ``RECORD`` or ``USER`` (see :class:`PrivacyUnit`).
    """

    sampling_probability: float = attrs.field(converter=_probability)
    population_size: int | None = attrs.field(default=None, converter=_population_size)
    scheme: SamplingScheme = attrs.field(
        default=attrs.Factory(_default_scheme, takes_self=True), converter=_scheme
    )
    batch_size: int | None = attrs.field(default=None, converter=_batch_size, kw_only=True)
    max_batch_size: int | None = attrs.field(default=None, converter=_max_batch_size, kw_only=True)
    num_batches: int | None = attrs.field(default=None, converter=_num_batches, kw_only=True)
    epoch_start: bool = attrs.field(
        default=False, converter=lambda v: check_bool("epoch_start", v), kw_only=True
    )
    unit: PrivacyUnit = attrs.field(default=PrivacyUnit.RECORD, converter=_unit, kw_only=True)

    def __attrs_post_init__(self) -> None:
        scheme, q, n = self.scheme, self.sampling_probability, self.population_size
        if scheme is SamplingScheme.FULL and q != 1.0:
            raise InvalidParameterError("scheme", scheme.value, full_scheme_expectation(q))
        allowed = _SCHEME_FIELDS[scheme]
        for name in _OPTIONAL_FIELDS:
            value = getattr(self, name)
            given = value is not None and value is not False
            if given and name not in allowed:
                raise InvalidParameterError(
                    name, value, f"None (scheme {scheme.value!r} takes no {name})"
                )
            if name in allowed and name != "epoch_start" and value is None:
                raise InvalidParameterError(
                    name, value, f"an integer >= 1 (scheme {scheme.value!r} needs it)"
                )
        if scheme in (SamplingScheme.POISSON, SamplingScheme.FULL):
            return
        if n is None:
            raise InvalidParameterError(
                "population_size", n, f"an integer >= 1 (scheme {scheme.value!r} needs n)"
            )
        if scheme in (SamplingScheme.FIXED_SIZE, SamplingScheme.SHUFFLE):
            b = self.batch_size
            assert b is not None
            if b > n:
                raise InvalidParameterError(
                    "batch_size", b, f"at most the population size {n} (scheme {scheme.value!r})"
                )
            expected_q = b / n
        elif scheme is SamplingScheme.BALLS_IN_BINS:
            k = self.num_batches
            assert k is not None
            if k > n:
                raise InvalidParameterError(
                    "num_batches",
                    k,
                    f"at most the population size {n} (every batch can be filled)",
                )
            expected_q = 1.0 / k
        else:  # TRUNCATED_POISSON
            if not q > 0.0:
                raise InvalidParameterError(
                    "sampling_probability", q, "q > 0 for a truncated Poisson sample"
                )
            return
        if q != expected_q:
            raise InvalidParameterError(
                "sampling_probability",
                q,
                f"{expected_q!r}, the rate scheme {scheme.value!r} derives from its parameters "
                "(build the event with SamplingEvent.fixed_size/shuffle/balls_in_bins)",
            )

    # ------------------------------------------------------------------ builders
    @classmethod
    def poisson(
        cls,
        sampling_probability: float,
        population_size: int | None = None,
        *,
        unit: PrivacyUnit | str = PrivacyUnit.RECORD,
    ) -> SamplingEvent:
        """A Poisson sample with rate q (``FULL`` when q = 1)."""
        return cls(sampling_probability, population_size, unit=unit)

    @classmethod
    def fixed_size(
        cls, batch_size: int, population_size: int, *, unit: PrivacyUnit | str = PrivacyUnit.RECORD
    ) -> SamplingEvent:
        """``fixed_size_without_replacement(b, n)``: q = b / n."""
        b, n = _batch_and_population(batch_size, population_size)
        return cls(_ratio(b, n), n, SamplingScheme.FIXED_SIZE, batch_size=b, unit=unit)

    @classmethod
    def truncated_poisson(
        cls,
        sampling_probability: float,
        population_size: int,
        max_batch_size: int,
        *,
        unit: PrivacyUnit | str = PrivacyUnit.RECORD,
    ) -> SamplingEvent:
        """``truncated_poisson(q, n, max_batch_size)``."""
        return cls(
            sampling_probability,
            population_size,
            SamplingScheme.TRUNCATED_POISSON,
            max_batch_size=max_batch_size,
            unit=unit,
        )

    @classmethod
    def balls_in_bins(
        cls,
        num_batches: int,
        population_size: int,
        *,
        epoch_start: bool = False,
        unit: PrivacyUnit | str = PrivacyUnit.RECORD,
    ) -> SamplingEvent:
        """``balls_in_bins(k, n)``: q = 1 / k; ``epoch_start`` on an epoch's first step."""
        k = _optional_count("num_batches")(num_batches)
        if k is None:
            raise InvalidParameterError("num_batches", num_batches, "an integer >= 1")
        return cls(
            1.0 / k,
            population_size,
            SamplingScheme.BALLS_IN_BINS,
            num_batches=k,
            epoch_start=epoch_start,
            unit=unit,
        )

    @classmethod
    def shuffle(
        cls,
        batch_size: int,
        population_size: int,
        *,
        epoch_start: bool = False,
        unit: PrivacyUnit | str = PrivacyUnit.RECORD,
    ) -> SamplingEvent:
        """``shuffle(b, n)``: q = b / n; ``epoch_start`` on an epoch's first step."""
        b, n = _batch_and_population(batch_size, population_size)
        return cls(
            _ratio(b, n),
            n,
            SamplingScheme.SHUFFLE,
            batch_size=b,
            epoch_start=epoch_start,
            unit=unit,
        )

    # ------------------------------------------------------------------ views
    @property
    def is_classic(self) -> bool:
        """True for a record-level Poisson or full-batch event (the format-1 events)."""
        return (
            self.scheme in (SamplingScheme.POISSON, SamplingScheme.FULL)
            and self.unit is PrivacyUnit.RECORD
        )

    @property
    def relations(self) -> tuple[NeighboringRelation, ...]:
        """The neighbouring relations under which dpledger can analyse this event's scheme."""
        return SCHEME_RELATIONS[self.scheme]

    @property
    def batches_per_epoch(self) -> int | None:
        """For the epoch-based schemes, the steps of one epoch: k, or ⌈n / b⌉ for a shuffle."""
        if self.scheme is SamplingScheme.BALLS_IN_BINS:
            return self.num_batches
        if self.scheme is SamplingScheme.SHUFFLE:
            assert self.batch_size is not None and self.population_size is not None
            return -(-self.population_size // self.batch_size)
        return None

    @property
    def average_denominator(self) -> float | None:
        """The fixed denominator of the average that matches the scheme (None if n unknown).

        q·n for Poisson and truncated Poisson (the expected size before the cap), n for a full
        batch, b for fixed-size and shuffled batches, n / k for balls-in-bins (the expected
        batch size). A fixed denominator keeps the average's sensitivity S / denominator.
        """
        n = self.population_size
        if n is None:
            return None
        if self.scheme in (SamplingScheme.FIXED_SIZE, SamplingScheme.SHUFFLE):
            return float(self.batch_size)  # type: ignore[arg-type]
        if self.scheme is SamplingScheme.BALLS_IN_BINS:
            return n / self.num_batches  # type: ignore[operator]
        return self.sampling_probability * n

    def describe(self) -> str:
        """A short human-readable name with the parameters, e.g. ``shuffle(b=256, n=60000)``."""
        s = self.scheme
        n = "?" if self.population_size is None else str(self.population_size)
        if s is SamplingScheme.POISSON:
            text = f"poisson(q={self.sampling_probability!r}, n={n})"
        elif s is SamplingScheme.FULL:
            text = f"full_batch(n={n})"
        elif s is SamplingScheme.FIXED_SIZE:
            text = f"fixed_size_without_replacement(b={self.batch_size}, n={n})"
        elif s is SamplingScheme.TRUNCATED_POISSON:
            text = (
                f"truncated_poisson(q={self.sampling_probability!r}, n={n}, "
                f"max_batch_size={self.max_batch_size})"
            )
        elif s is SamplingScheme.BALLS_IN_BINS:
            text = f"balls_in_bins(num_batches={self.num_batches}, n={n})"
        else:
            text = f"shuffle(b={self.batch_size}, n={n})"
        return text if self.unit is PrivacyUnit.RECORD else f"{text}, unit=user"


def _batch_and_population(batch_size: Any, population_size: Any) -> tuple[int, int]:
    """(b, n) checked for the fixed-size and shuffle builders: integers with 1 ≤ b ≤ n."""
    b = _optional_count("batch_size")(batch_size)
    n = _population_size(population_size)
    if b is None or n is None:
        raise InvalidParameterError(
            "batch_size" if b is None else "population_size",
            batch_size if b is None else population_size,
            "an integer >= 1",
        )
    if b > n:
        raise InvalidParameterError("batch_size", b, f"at most the population size {n}")
    return b, n


def _ratio(b: int, n: int) -> float:
    """b / n as the float nearest the exact ratio (true division of ints rounds correctly)."""
    return b / n


def _norm_bound(value: Any) -> float:
    return check_positive_finite("l2_norm_bound", value)


def _noise_stddev(value: Any) -> float:
    return check_non_negative_finite("noise_stddev", value)


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
    label: str | None = attrs.field(
        default=None, converter=lambda v: check_optional_str("label", v)
    )

    @property
    def noise_multiplier(self) -> float:
        """z = σ̃ / S (0 when σ̃ = 0)."""
        return self.noise_stddev / self.l2_norm_bound

    @property
    def inverse_square_multiplier(self) -> float:
        """(S / σ̃)², this query's term in paper Eq. 1 (∞ when σ̃ = 0)."""
        return inverse_square_term(self.l2_norm_bound, self.noise_stddev)
