"""The sampling schemes, described without a framework: parameters, q, denominator, epochs, events.

A scheme object holds a sampler's validated parameters and answers everything about the scheme
that does not depend on how the batches are drawn: the rate q recorded with each step, the fixed
denominator of DP-SGD's average, the batches of one pass over the sampler (an *epoch*), whether
the epoch's batches are drawn together, the unit of privacy, and the
:class:`~dpledger.ledger.SamplingEvent` that a step on a given batch records; and it draws the
record indices of its batches on the host in NumPy (:meth:`BatchScheme.draw`,
:meth:`BatchScheme.draw_epoch`, with :mod:`~dpledger.sampling.index_draws`). The PyTorch and
``tf.data`` samplers hold one and only turn its index draws into their framework's batches.

=================================  ======================================  =================
scheme                             event (denominator)                     batches per epoch
=================================  ======================================  =================
:class:`PoissonScheme`             ``poisson(q, n)`` (q·n)                 ``steps``
:class:`FixedSizeScheme`           ``fixed_size(b, n)`` (b)                ``steps``
:class:`TruncatedPoissonScheme`    ``truncated_poisson(q, n, m)`` (q·n)    ``steps``
:class:`BallsInBinsScheme`         ``balls_in_bins(k, n)`` (n / k)         k
:class:`ShuffleScheme`             ``shuffle(b, n)`` (b)                   ⌈n / b⌉ (⌊n / b⌋)
:class:`UserPoissonScheme`         ``poisson(q, users, unit="user")``      ``steps``
                                   (q·users)
=================================  ======================================  =================

The epoch-based schemes (balls-in-bins, shuffle) record ``epoch_start=True`` on the first step
of each epoch: that step's draw made the epoch's allocation or permutation.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from dpledger.ledger import PrivacyUnit, SamplingEvent
from dpledger.sampling import index_draws
from dpledger.sampling.index_draws import Indices
from dpledger.sampling.validation import (
    check_drop_last,
    check_population_size,
    check_sampling_probability,
    check_size_within_population,
    check_step_position,
    check_steps,
    default_steps,
)
from dpledger.validation import check_positive_int

__all__ = [
    "BallsInBinsScheme",
    "BatchScheme",
    "FixedSizeScheme",
    "PoissonScheme",
    "ShuffleScheme",
    "TruncatedPoissonScheme",
    "UserPoissonScheme",
]


class BatchScheme(abc.ABC):
    """A sampling scheme with its parameters: what every sampler of the scheme shares.

    Subclasses set ``_n``, ``_steps`` and ``_events`` (the event of a step, keyed by
    ``epoch_start``) in their constructor.
    """

    __slots__ = ("_events", "_n", "_steps")

    _n: int
    _steps: int
    _events: dict[bool, SamplingEvent]

    #: True when an epoch's batches are drawn together, at the start of the epoch.
    epoch_based: bool = False

    @property
    def population_size(self) -> int:
        """n, the number of units (records, or users for user-level schemes) sampled from."""
        return self._n

    @property
    def unit(self) -> PrivacyUnit:
        """The unit of privacy a batch samples (records, or users)."""
        return PrivacyUnit.RECORD

    @property
    def steps_per_epoch(self) -> int:
        """The batches of one pass over a sampler of the scheme."""
        return self._steps

    @property
    def sampling_probability(self) -> float:
        """q recorded with each step: the Poisson rate, b / n or 1 / k."""
        return self._events[False].sampling_probability

    @property
    def average_denominator(self) -> float:
        """The fixed denominator of DP-SGD's average: q·n for (truncated) Poisson, b for
        fixed-size and shuffled batches, n / k for balls-in-bins."""
        value = self._events[False].average_denominator
        assert value is not None  # every scheme knows n
        return value

    def event(self, *, epoch_start: bool = False) -> SamplingEvent:
        """The sampling event a step on one of the scheme's batches records.

        Args:
            epoch_start: the step is the first recorded step of an epoch (epoch-based schemes
                only; the other schemes ignore it).
        """
        return self._events[bool(epoch_start) and self.epoch_based]

    def event_for_step(self, step: int) -> SamplingEvent:
        """The sampling event of the batch at position ``step`` (0-based) of a pass that yields
        all :attr:`steps_per_epoch` batches of a fresh epoch: ``epoch_start=True`` on batch 0
        of an epoch-based scheme, the same event for every batch otherwise.

        Raises:
            InvalidParameterError: ``step`` is not an integer in [0, steps_per_epoch).
        """
        position = check_step_position(step, steps_per_epoch=self._steps)
        return self.event(epoch_start=position == 0)

    def describe(self) -> str:
        """The scheme with its parameters, e.g. ``shuffle(b=256, n=60000)``."""
        return self._events[False].describe()

    def draw(self, rng: np.random.Generator) -> Indices:
        """The record indices of one batch of a scheme that draws every step afresh, in
        increasing order.

        Raises:
            TypeError: an epoch-based scheme (use :meth:`draw_epoch`) or a user-level one
                (use :meth:`~dpledger.sampling.index_draws.UserRecords.draw`).
        """
        raise TypeError(
            f"{type(self).__name__} has no per-step draw of its own (epoch-based schemes draw "
            "with draw_epoch, user-level ones with UserRecords.draw)"
        )

    def draw_epoch(self, rng: np.random.Generator) -> list[Indices]:
        """The record indices of the :attr:`steps_per_epoch` batches of one pass, in order
        (for a scheme that draws every step afresh, that many :meth:`draw` calls)."""
        return [self.draw(rng) for _ in range(self._steps)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()}, steps_per_epoch={self._steps})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, BatchScheme)
        return self._events == other._events and self._steps == other._steps

    def __hash__(self) -> int:
        return hash((type(self), self._events[False], self._steps))


def _stepwise_steps(
    steps: Any, batches_per_epoch: float, *, steps_parameter: str, round_half_up: bool
) -> int:
    default = default_steps(batches_per_epoch, round_half_up=round_half_up)
    return check_steps(steps_parameter, steps, default=default)


class PoissonScheme(BatchScheme):
    """Poisson sampling: each step, each of the n records is in the batch independently with
    probability q (batch sizes Binomial(n, q), possibly 0).

    Args:
        population_size: n ≥ 1.
        sampling_probability: q in (0, 1].
        steps: batches of one pass; default 1/q rounded (see ``round_half_up``).
        steps_parameter: the name the sampler gives ``steps`` (for its error).
        round_half_up: round 1/q halves up rather than to even.

    Raises:
        InvalidParameterError: naming the bad parameter.
    """

    __slots__ = ("_q",)

    def __init__(
        self,
        *,
        population_size: int,
        sampling_probability: float,
        steps: int | None = None,
        steps_parameter: str = "steps",
        round_half_up: bool = False,
    ) -> None:
        self._n = check_population_size(population_size)
        self._q = check_sampling_probability(sampling_probability)
        self._steps = _stepwise_steps(
            steps, 1.0 / self._q, steps_parameter=steps_parameter, round_half_up=round_half_up
        )
        event = SamplingEvent.poisson(self._q, self._n)
        self._events = {False: event, True: event}

    @property
    def expected_batch_size(self) -> float:
        """q·n, the mean batch size."""
        return self._q * self._n

    def draw(self, rng: np.random.Generator) -> Indices:
        """Each record with probability q (:func:`~dpledger.sampling.index_draws.poisson`)."""
        return index_draws.poisson(rng, self._n, self._q)


class FixedSizeScheme(BatchScheme):
    """Each step, b distinct records drawn uniformly without replacement, independently of the
    other steps.

    Args:
        population_size: n ≥ 1.
        batch_size: b in [1, n].
        steps: batches of one pass; default n / b rounded (see ``round_half_up``).
        steps_parameter: the name the sampler gives ``steps`` (for its error).
        round_half_up: round n / b halves up rather than to even.

    Raises:
        InvalidParameterError: naming the bad parameter.
    """

    __slots__ = ("_b",)

    def __init__(
        self,
        *,
        population_size: int,
        batch_size: int,
        steps: int | None = None,
        steps_parameter: str = "steps",
        round_half_up: bool = False,
    ) -> None:
        self._n = check_population_size(population_size)
        self._b = check_size_within_population(
            "batch_size", batch_size, population_size=self._n, what="a batch size"
        )
        self._steps = _stepwise_steps(
            steps, self._n / self._b, steps_parameter=steps_parameter, round_half_up=round_half_up
        )
        event = SamplingEvent.fixed_size(self._b, self._n)
        self._events = {False: event, True: event}

    @property
    def batch_size(self) -> int:
        """b, the size of every batch."""
        return self._b

    def draw(self, rng: np.random.Generator) -> Indices:
        """b distinct records (:func:`~dpledger.sampling.index_draws.fixed_size`)."""
        return index_draws.fixed_size(rng, self._n, self._b)


class TruncatedPoissonScheme(BatchScheme):
    """A Poisson draw of rate q cut to a uniformly random subset of m = ``max_batch_size``
    records when it has more.

    Args:
        population_size: n ≥ 1.
        sampling_probability: q in (0, 1].
        max_batch_size: m ≥ 1 (and ≤ n when ``cap_within_population``).
        steps: batches of one pass; default 1/q rounded (see ``round_half_up``).
        steps_parameter: the name the sampler gives ``steps`` (for its error).
        round_half_up: round 1/q halves up rather than to even.
        cap_within_population: also refuse m > n (a cap that can never bind).

    Raises:
        InvalidParameterError: naming the bad parameter.
    """

    __slots__ = ("_m", "_q")

    def __init__(
        self,
        *,
        population_size: int,
        sampling_probability: float,
        max_batch_size: int,
        steps: int | None = None,
        steps_parameter: str = "steps",
        round_half_up: bool = False,
        cap_within_population: bool = False,
    ) -> None:
        self._n = check_population_size(population_size)
        self._q = check_sampling_probability(sampling_probability)
        if cap_within_population:
            self._m = check_size_within_population(
                "max_batch_size", max_batch_size, population_size=self._n, what="a cap"
            )
        else:
            self._m = check_positive_int("max_batch_size", max_batch_size)
        self._steps = _stepwise_steps(
            steps, 1.0 / self._q, steps_parameter=steps_parameter, round_half_up=round_half_up
        )
        event = SamplingEvent.truncated_poisson(self._q, self._n, self._m)
        self._events = {False: event, True: event}

    @property
    def max_batch_size(self) -> int:
        """m, the cap on a batch's size."""
        return self._m

    def draw(self, rng: np.random.Generator) -> Indices:
        """A capped Poisson draw (:func:`~dpledger.sampling.index_draws.truncated_poisson`)."""
        return index_draws.truncated_poisson(rng, self._n, self._q, self._m)


class BallsInBinsScheme(BatchScheme):
    """Each epoch, every record is put into one of k batches uniformly at random; the epoch's k
    steps are the batches in order (sizes Binomial(n, 1/k)).

    Args:
        population_size: n ≥ 1.
        num_batches: k in [1, n].

    Raises:
        InvalidParameterError: naming the bad parameter.
    """

    __slots__ = ("_k",)

    epoch_based = True

    def __init__(self, *, population_size: int, num_batches: int) -> None:
        self._n = check_population_size(population_size)
        self._k = check_size_within_population(
            "num_batches", num_batches, population_size=self._n, what="a number of batches"
        )
        self._steps = self._k
        self._events = {
            flag: SamplingEvent.balls_in_bins(self._k, self._n, epoch_start=flag)
            for flag in (False, True)
        }

    @property
    def num_batches(self) -> int:
        """k, the batches of an epoch."""
        return self._k

    def draw_epoch(self, rng: np.random.Generator) -> list[Indices]:
        """The k batches of one epoch (:func:`~dpledger.sampling.index_draws.balls_in_bins`)."""
        return index_draws.balls_in_bins(rng, self._n, self._k)


class ShuffleScheme(BatchScheme):
    """Each epoch, a uniformly random permutation of the n records cut into consecutive batches
    of b, the last one smaller when b does not divide n.

    Args:
        population_size: n ≥ 1.
        batch_size: b in [1, n].
        drop_last: leave out the last, smaller batch of each epoch; only when b divides n
            (where it changes nothing).

    Raises:
        InvalidParameterError: naming the bad parameter.
    """

    __slots__ = ("_b", "_drop_last")

    epoch_based = True

    def __init__(self, *, population_size: int, batch_size: int, drop_last: bool = False) -> None:
        self._n = check_population_size(population_size)
        self._b = check_size_within_population(
            "batch_size", batch_size, population_size=self._n, what="a batch size"
        )
        self._drop_last = check_drop_last(drop_last, batch_size=self._b, population_size=self._n)
        full, rest = divmod(self._n, self._b)
        self._steps = full + (1 if rest and not self._drop_last else 0)
        self._events = {
            flag: SamplingEvent.shuffle(self._b, self._n, epoch_start=flag)
            for flag in (False, True)
        }

    @property
    def batch_size(self) -> int:
        """b, the size of every batch (but the last of an epoch when b does not divide n)."""
        return self._b

    @property
    def drop_last(self) -> bool:
        """Whether the last, smaller batch of each epoch is left out."""
        return self._drop_last

    def draw_epoch(self, rng: np.random.Generator) -> list[Indices]:
        """The batches of one epoch, pieces of a uniform permutation in its order
        (:func:`~dpledger.sampling.index_draws.shuffle`)."""
        return index_draws.shuffle(rng, self._n, self._b, self._steps)


class UserPoissonScheme(BatchScheme):
    """User-level Poisson sampling: each step, each of the users is in the batch independently
    with probability q, with at most k of their records.

    The privacy unit is the user: :attr:`population_size` counts users and the event is
    ``SamplingEvent.poisson(q, num_users, unit="user")``; the average divides by q·num_users.

    Args:
        num_users: the number of distinct users (≥ 1).
        sampling_probability: q in (0, 1].
        max_records_per_user: k ≥ 1.
        steps: batches of one pass; default round(1/q).

    Raises:
        InvalidParameterError: naming the bad parameter.
    """

    __slots__ = ("_k", "_q")

    def __init__(
        self,
        *,
        num_users: int,
        sampling_probability: float,
        max_records_per_user: int,
        steps: int | None = None,
    ) -> None:
        self._n = check_positive_int("num_users", num_users)
        self._q = check_sampling_probability(sampling_probability)
        self._k = check_positive_int("max_records_per_user", max_records_per_user)
        self._steps = _stepwise_steps(
            steps, 1.0 / self._q, steps_parameter="steps", round_half_up=False
        )
        event = SamplingEvent.poisson(self._q, self._n, unit=PrivacyUnit.USER)
        self._events = {False: event, True: event}

    @property
    def unit(self) -> PrivacyUnit:
        """``PrivacyUnit.USER``."""
        return PrivacyUnit.USER

    @property
    def num_users(self) -> int:
        """The number of users sampled from (the event's population)."""
        return self._n

    @property
    def max_records_per_user(self) -> int:
        """k, the most records of one user in a batch."""
        return self._k

    @property
    def expected_num_users(self) -> float:
        """q·num_users, the mean number of users per batch."""
        return self._q * self._n
