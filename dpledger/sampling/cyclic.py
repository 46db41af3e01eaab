"""Cyclic batches: the batch selection a correlated-noise release is analysed under.

A matrix-mechanism release (``docs/correlated-noise.md``) is accounted under a participation
schema (:class:`~dpledger.sampling.participation.ParticipationSchema`); the training data must be
drawn so that every record's steps are one of the schema's patterns. :class:`CyclicScheme` is
that draw (Choquette-Choo et al. 2023, "Multi-Epoch Matrix Factorization Mechanisms for Private
Machine Learning", section 2, and "Amplified Banded Matrix Factorization", section 3):

* the n records are assigned **once** to ``period`` fixed groups, each record to a group drawn
  uniformly and independently of the others (seeded; the group sizes are Binomial(n, 1/period),
  so a group can be empty when n is small). Independent assignment, not an equal split, is what
  makes the analysis hold under add/remove as well as replace-one: adding or removing a record
  leaves the distribution of every other record's group unchanged, whereas with equal-size
  groups a record added to one group shifts the boundaries and moves other records between
  groups, so the neighbouring runs would differ in more than the one record's participations
  (JAX Privacy refuses its equal split under add/remove for the same reason);
* step t (0 ≤ t < T) uses group t mod period, either **whole** (participation ``cyclic``: a
  record of group g takes part in exactly the steps g, g + period, …, k = ⌈T / period⌉ times at
  most, exactly ``period`` steps apart), or **Poisson-sampled** with rate q within the group
  (each appearance an independent Bernoulli(q) draw: "Poisson sampling within cyclic bands",
  the amplified BandMF setting).

:meth:`CyclicScheme.participation` builds the schema (and q) a release of this draw records,
from the scheme itself, so that an adapter cannot record one schema and sample another.

Every draw is a pure function of (seed, step): a run resumed from a checkpoint, or another
process of a data-parallel run, draws the same batch for the same step.

Example:
    >>> from dpledger.sampling import CyclicScheme
    >>> scheme = CyclicScheme(population_size=10, period=2, num_steps=5, seed=0)
    >>> sorted(scheme.draw(0).tolist() + scheme.draw(1).tolist())
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    >>> bool((scheme.draw(2) == scheme.draw(0)).all())
    True
    >>> schema, q = scheme.participation()
    >>> schema.kind.value, schema.max_participations, schema.min_separation, q
    ('cyclic', 3, 2, None)
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from dpledger.errors import InvalidParameterError
from dpledger.sampling.participation import ParticipationSchema
from dpledger.sampling.validation import (
    MAX_POPULATION,
    check_population_size,
    check_sampling_probability,
)
from dpledger.validation import check_non_negative_int, check_positive_int

__all__ = ["CyclicParticipation", "CyclicPasses", "CyclicScheme"]

_PARTITION, _POISSON = 0, 1  # the two independent streams spawned from the seed
_STATE_KEYS = frozenset({"population_size", "period", "num_steps", "sampling_probability", "seed"})


class CyclicParticipation(NamedTuple):
    """What a correlated-noise release of a cyclic draw records about its participation.

    Attributes:
        schema: ``ParticipationSchema.cyclic(num_steps=T, period=period)``.
        sampling_probability: q for Poisson sampling within the groups; None when every
            step uses its whole group.
    """

    schema: ParticipationSchema
    sampling_probability: float | None


class CyclicScheme:
    """``period`` fixed groups of records, visited in turn for ``num_steps`` steps.

    Args:
        population_size: n, the number of records; at least ``period``, at most
            ``MAX_POPULATION`` (2**33: one group is drawn per record).
        period: the number of groups; step t uses group t mod period. At most ``num_steps``.
        num_steps: T, the length of the stream; a step beyond it is refused.
        sampling_probability: q in (0, 1] to Poisson-sample each step's group (each record of
            the group independently with probability q); None to use the whole group.
        seed: a non-negative integer; the groups and every Poisson draw derive from it.

    Raises:
        InvalidParameterError: a value out of range (naming the parameter).
    """

    __slots__ = ("_group_of", "_groups", "_n", "_period", "_q", "_seed", "_steps")

    def __init__(
        self,
        *,
        population_size: int,
        period: int,
        num_steps: int,
        sampling_probability: float | None = None,
        seed: int,
    ) -> None:
        # one group is drawn per record, as the Poisson sampler draws one uniform per record
        self._n = check_population_size(population_size, maximum=MAX_POPULATION)
        self._period = check_positive_int("period", period)
        self._steps = check_positive_int("num_steps", num_steps)
        if self._period > self._steps:
            raise InvalidParameterError("period", period, f"at most num_steps={self._steps}")
        if self._period > self._n:
            raise InvalidParameterError("period", period, f"at most population_size={self._n}")
        self._q = (
            None
            if sampling_probability is None
            else check_sampling_probability(sampling_probability)
        )
        self._seed = check_non_negative_int("seed", seed)
        # each record's group uniform and independent of the others' (see the module docstring)
        rng = np.random.default_rng(np.random.SeedSequence([self._seed, _PARTITION]))
        self._group_of = rng.integers(0, self._period, size=self._n, dtype=np.int64)
        self._groups = tuple(
            np.flatnonzero(self._group_of == g).astype(np.int64) for g in range(self._period)
        )

    # ------------------------------------------------------------------ parameters
    @property
    def population_size(self) -> int:
        """n."""
        return self._n

    @property
    def period(self) -> int:
        """The number of groups, and the distance between two participations of a record."""
        return self._period

    @property
    def num_steps(self) -> int:
        """T, the steps of the stream."""
        return self._steps

    @property
    def sampling_probability(self) -> float | None:
        """q within a group, or None (whole groups)."""
        return self._q

    @property
    def seed(self) -> int:
        """The seed of the partition and of the Poisson draws."""
        return self._seed

    @property
    def average_denominator(self) -> float:
        """The fixed denominator of DP-SGD's average: the expected batch size, (n / period)·q
        (q = 1 for whole groups)."""
        return self._n / self._period * (1.0 if self._q is None else self._q)

    @property
    def group_of(self) -> npt.NDArray[np.int64]:
        """The group of every record (shape (n,); a copy)."""
        return self._group_of.copy()

    def group(self, index: int) -> npt.NDArray[np.int64]:
        """The sorted records of group ``index`` (0 ≤ index < period; a copy)."""
        g = check_non_negative_int("index", index)
        if g >= self._period:
            raise InvalidParameterError("index", index, f"a group in [0, {self._period})")
        return self._groups[g].copy()

    # ------------------------------------------------------------------ draws
    def check_step(self, step: Any) -> int:
        """``step`` as an int in [0, T).

        Raises:
            InvalidParameterError: ``step`` is not an integer in [0, num_steps).
        """
        t = check_non_negative_int("step", step)
        if t >= self._steps:
            raise InvalidParameterError(
                "step", step, f"a step of the stream, in [0, num_steps={self._steps})"
            )
        return t

    def draw(self, step: int) -> npt.NDArray[np.int64]:
        """The sorted record indices of step ``step``: group step mod period, whole or
        Poisson-sampled with rate q (a draw that depends only on the seed and the step).

        Raises:
            InvalidParameterError: ``step`` is not in [0, num_steps).
        """
        t = self.check_step(step)
        members = self._groups[t % self._period]
        if self._q is None or self._q == 1.0:
            return members.copy()
        rng = np.random.default_rng(np.random.SeedSequence([self._seed, _POISSON, t]))
        return members[rng.random(members.shape[0]) < self._q]

    # ------------------------------------------------------------------ what a release records
    def participation(self) -> CyclicParticipation:
        """The participation schema and q that a release of this scheme's draws records."""
        return CyclicParticipation(
            ParticipationSchema.cyclic(num_steps=self._steps, period=self._period), self._q
        )

    def state(self) -> dict[str, Any]:
        """The scheme's parameters, its seed included, as a dict of plain values: everything its
        draws depend on (what a sampler's checkpoint keeps; :meth:`from_state` rebuilds it)."""
        return {
            "population_size": self._n,
            "period": self._period,
            "num_steps": self._steps,
            "sampling_probability": self._q,
            "seed": self._seed,
        }

    @classmethod
    def from_state(cls, saved: Any, *, like: CyclicScheme, name: str = "state") -> CyclicScheme:
        """The scheme of a :meth:`state`, checked to be ``like`` up to its seed.

        Only the seed may differ: a sampler built without one drew a partition of its own, and
        the saved scheme (the partition and the Poisson draws of the run's earlier steps) takes
        over.

        Args:
            saved: a :meth:`state`.
            like: the scheme the saved one must match but for its seed.
            name: how the error names ``saved``.

        Raises:
            InvalidParameterError: not a state, or a scheme with another n, period, T or q.
        """
        if not isinstance(saved, dict) or set(saved) != _STATE_KEYS:
            raise InvalidParameterError(name, saved, "the state() of a CyclicScheme")
        scheme = cls(**saved)
        if scheme._key()[:4] != like._key()[:4]:
            raise InvalidParameterError(
                name, scheme.describe(), f"the scheme {like.describe()} (only its seed may differ)"
            )
        return scheme

    def describe(self) -> str:
        """The scheme with its parameters, e.g. ``cyclic(period=4, T=16, n=100, q=0.5)``."""
        q = "" if self._q is None else f", q={self._q!r}"
        return f"cyclic(period={self._period}, T={self._steps}, n={self._n}{q})"

    def __repr__(self) -> str:
        return (
            f"CyclicScheme(population_size={self._n!r}, period={self._period!r}, "
            f"num_steps={self._steps!r}, sampling_probability={self._q!r}, seed={self._seed!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CyclicScheme):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[Any, ...]:
        return (self._n, self._period, self._steps, self._q, self._seed)


class CyclicPasses:
    """Which stream steps the passes over a cyclic sampler's batches draw (thread-safe).

    One pass is ``period`` batches, for the steps [s, s + period) from the pass's first step s
    (:attr:`next_step`). On its own, s moves on by ``period`` at the start of every pass. Once a
    model drives the passes (:meth:`drive`), s moves on only when the model has released the last
    step of a pass (:meth:`released`): a pass that is started and abandoned (a peek, an iterator
    a distribution strategy makes) takes no step of the stream. A step drawn after the model
    released it, from a pass started before the previous one ended, would repeat that step's
    Poisson draw instead of making a fresh one: such draws are noted (:meth:`take_stale_draws`)
    so that the model refuses its next step.

    Args:
        scheme: the cyclic scheme; its T must be a multiple of its period (every pass visits
            every group once).

    Raises:
        InvalidParameterError: T is not a multiple of the period (``num_steps``).
    """

    def __init__(self, scheme: CyclicScheme) -> None:
        if scheme.num_steps % scheme.period:
            raise InvalidParameterError(
                "num_steps",
                scheme.num_steps,
                f"a multiple of period={scheme.period} (each pass over the dataset visits "
                "every group once)",
            )
        self._period, self._steps = scheme.period, scheme.num_steps
        self._next_step = 0
        self._released = 0  # stream steps released by the driving model
        self._stale: list[int] = []  # steps drawn after they were released
        self._driven = False
        self._lock = threading.Lock()

    @property
    def next_step(self) -> int:
        """The stream step of the first batch of the next pass."""
        with self._lock:
            return self._next_step

    def seek(self, step: Any) -> None:
        """Start the next pass at stream step ``step`` (a run resumed from a save).

        Raises:
            InvalidParameterError: ``step`` is not a multiple of the period in [0, T].
        """
        t = check_non_negative_int("step", step)
        if t % self._period or t > self._steps:
            raise InvalidParameterError(
                "step", step, f"a multiple of period={self._period} in [0, {self._steps}]"
            )
        with self._lock:
            self._next_step = t
            self._released = t
            self._stale.clear()

    def restore(self, step: int) -> None:
        """Put :attr:`next_step` back to ``step`` (after a peek that started passes)."""
        with self._lock:
            self._next_step = step

    def drive(self) -> None:
        """Let a model move the passes on (:meth:`released`) instead of every pass started."""
        with self._lock:
            self._driven = True

    def start_pass(self) -> int:
        """The first step of a pass that starts now (moving on by a period unless driven)."""
        with self._lock:
            start = self._next_step
            if not self._driven:
                self._next_step = start + self._period
        return start

    def drawn(self, step: int) -> None:
        """A pass drew the batch of ``step``: noted as stale when the model released it."""
        with self._lock:
            if self._driven and step < self._released:
                self._stale.append(step)

    def released(self, step: int) -> None:
        """The driving model released stream step ``step``: after the last step of a pass, the
        next pass starts at ``step + 1``."""
        with self._lock:
            self._released = max(self._released, step + 1)
            if self._driven and (step + 1) % self._period == 0:
                self._next_step = step + 1

    def take_stale_draws(self) -> list[int]:
        """The stream steps drawn (since the last call) after the driving model had released
        them, emptied."""
        with self._lock:
            stale, self._stale = self._stale, []
        return stale
