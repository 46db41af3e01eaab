"""The index draws of every sampling scheme, on the host in NumPy: written once for every framework.

Each function draws the record indices of one batch (or of one epoch's batches) from a
``numpy.random.Generator``. The schemes (:mod:`~dpledger.sampling.schemes`) call them from
:meth:`~dpledger.sampling.BatchScheme.draw` and :meth:`~dpledger.sampling.BatchScheme.draw_epoch`;
the PyTorch batch samplers and the ``tf.data`` samplers only turn these index arrays into their
framework's batches, so the same generator state draws the same records whatever the framework.

A framework sampler keeps its own generator (a ``torch.Generator``, a ``tf.random.Generator``),
whose state its checkpoints hold, and takes a fresh NumPy generator for every draw from two
words of that generator (:func:`host_generator`).

========================  ============================================================
draw                      the batch
========================  ============================================================
:func:`poisson`           each of n records independently with probability q
:func:`fixed_size`        b distinct records, uniformly without replacement
:func:`truncated_poisson` a Poisson draw cut to a uniformly random m of its records
:func:`balls_in_bins`     an epoch: every record in one of k batches, uniformly
:func:`shuffle`           an epoch: a uniform permutation cut into batches of b
:class:`UserRecords`      users with probability q, at most k records of each
========================  ============================================================

Every batch is an int64 array of distinct indices, in increasing order except the batches of
:func:`shuffle` (pieces of the permutation, in its order).

Example:
    >>> import numpy as np
    >>> rng = host_generator([1, 2])
    >>> batch = fixed_size(rng, 10, 4)
    >>> len(batch), bool((np.diff(batch) > 0).all())
    (4, True)
    >>> sorted(np.concatenate(balls_in_bins(rng, 10, 3)).tolist()) == list(range(10))
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = [
    "UserRecords",
    "balls_in_bins",
    "fixed_size",
    "host_generator",
    "poisson",
    "shuffle",
    "truncated_poisson",
]

Indices = npt.NDArray[np.int64]

_CHUNK = 1 << 22  # uniform draws per chunk when sampling a large population
_WORD = (1 << 64) - 1


def host_generator(words: Sequence[int] | npt.NDArray[np.integer]) -> np.random.Generator:
    """A NumPy generator for one draw, seeded from integer words of a framework's generator.

    Args:
        words: integers (any sign; each is taken modulo 2**64), e.g. two int64 draws of a
            ``torch.Generator`` or the seed pair a ``tf.random.Generator`` makes.
    """
    values = words.reshape(-1).tolist() if isinstance(words, np.ndarray) else list(words)
    entropy = [int(w) & _WORD for w in values]
    return np.random.default_rng(np.random.SeedSequence(entropy))


def poisson(rng: np.random.Generator, n: int, q: float) -> Indices:
    """The indices i with U_i < q for fresh uniforms U_0..U_{n-1} (all n when q = 1, drawing
    nothing), in increasing order.

    For n beyond 2**22 the uniforms are drawn in chunks (the same numbers as one call of
    ``rng.random(n)``): memory grows with the chunk and the sample, not with n.
    """
    if q == 1.0:
        return np.arange(n, dtype=np.int64)
    if n <= _CHUNK:
        return np.flatnonzero(rng.random(n) < q).astype(np.int64)
    parts = [
        np.flatnonzero(rng.random(min(_CHUNK, n - start)) < q) + start
        for start in range(0, n, _CHUNK)
    ]
    return np.concatenate(parts).astype(np.int64)


def fixed_size(rng: np.random.Generator, n: int, b: int) -> Indices:
    """b distinct indices of [0, n), a uniformly random subset (all n when b = n, drawing
    nothing), in increasing order."""
    if b == n:
        return np.arange(n, dtype=np.int64)
    return np.sort(rng.choice(n, size=b, replace=False, shuffle=False)).astype(np.int64)


def truncated_poisson(rng: np.random.Generator, n: int, q: float, m: int) -> Indices:
    """A :func:`poisson` draw, cut to a uniformly random subset of m of its records when it has
    more, in increasing order."""
    drawn = poisson(rng, n, q)
    if drawn.size <= m:
        return drawn
    return drawn[fixed_size(rng, drawn.size, m)]


def balls_in_bins(rng: np.random.Generator, n: int, k: int) -> list[Indices]:
    """One epoch: every record put into one of k batches uniformly and independently; the k
    batches in order, each in increasing order (sizes Binomial(n, 1/k), possibly 0)."""
    bins = rng.integers(0, k, size=n)
    order = np.argsort(bins, kind="stable").astype(np.int64)  # grouped by bin, increasing
    bounds = np.cumsum(np.bincount(bins, minlength=k))[:-1]
    return list(np.split(order, bounds))


def shuffle(rng: np.random.Generator, n: int, b: int, steps: int) -> list[Indices]:
    """One epoch: a uniformly random permutation of the n records cut into consecutive pieces
    of b (the last one smaller when b does not divide n), the first ``steps`` of them."""
    perm = rng.permutation(n).astype(np.int64)
    return [perm[j * b : (j + 1) * b] for j in range(steps)]


class UserRecords:
    """The records of a data set grouped by their user, for user-level draws.

    Args:
        slots: the user of every record, as integers 0..U−1 (U users, each with a record).
    """

    __slots__ = ("_counts", "_order", "_slot_sorted")

    def __init__(self, slots: Sequence[int] | npt.NDArray[np.integer]) -> None:
        slot = np.asarray(slots, dtype=np.int64)
        # the records sorted by user (stably: each user's records stay in increasing order)
        self._order = np.argsort(slot, kind="stable").astype(np.int64)
        self._slot_sorted = slot[self._order]
        self._counts = np.bincount(slot).astype(np.int64)

    @property
    def num_users(self) -> int:
        """U."""
        return int(self._counts.size)

    @property
    def records_per_user(self) -> Indices:
        """The number of records of each user (a copy)."""
        return self._counts.copy()

    def draw(
        self, rng: np.random.Generator, *, sampling_probability: float, max_records_per_user: int
    ) -> tuple[Indices, Indices]:
        """Each user with probability q, at most k of their records (a uniformly random subset
        of k when they have more).

        Returns:
            The records' indices, grouped by user (users in increasing order, each user's
            records in increasing order), and the user of each.
        """
        q, k = sampling_probability, max_records_per_user
        if q == 1.0:
            chosen = np.ones(self._counts.size, dtype=bool)
        else:
            chosen = rng.random(self._counts.size) < q
        positions = np.flatnonzero(chosen[self._slot_sorted])  # into self._order
        counts = self._counts[chosen]
        if positions.size and int(counts.max()) > k:
            # a uniformly random order within each user (a random permutation, then a stable
            # sort by user), of which each user's first k are kept
            shuffled = positions[rng.permutation(positions.size)]
            shuffled = shuffled[np.argsort(self._slot_sorted[shuffled], kind="stable")]
            starts = np.cumsum(counts) - counts
            rank = np.arange(shuffled.size) - np.repeat(starts, counts)
            positions = np.sort(shuffled[rank < k])
        return self._order[positions], self._slot_sorted[positions]
