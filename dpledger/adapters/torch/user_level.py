"""User-level sampling: Poisson samples of users, each contributing at most k records.

The privacy unit is a user, who may own many records. Each step,
:class:`UserPoissonBatchSampler` includes every user independently with probability q and takes
at most k of each sampled user's records (a uniformly random subset of k when the user has more).
:class:`~dpledger.adapters.torch.optimizer.DPOptimizer` recognises the sampler: it adds up (or
averages) the per-example gradients of each sampled user's records, clips each user's vector to
C as one, sums the clipped vectors over the users and adds the usual Gaussian noise, so the
released sum changes by at most C when one user's records are added or removed. Each step
records ``SamplingEvent.poisson(q, num_users, unit="user")`` and averages over q·num_users;
the accountants then report ε per user (and refuse a ledger that mixes units).

The cap k is what bounds the work of one step, not the privacy: clipping the user's whole
gradient bounds a user's contribution whatever the number of their records.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch

from dpledger.adapters.torch.sampler_base import StepwiseBatchSampler
from dpledger.errors import InvalidParameterError
from dpledger.ledger import SamplingEvent
from dpledger.sampling import UserPoissonScheme
from dpledger.sampling.draws import Draw
from dpledger.sampling.index_draws import UserRecords

__all__ = ["UserBatch", "UserPoissonBatchSampler"]


class UserBatch(NamedTuple):
    """Which user each record of a drawn batch belongs to.

    Attributes:
        user_index: a CPU int64 tensor of shape (B,): for each position of the batch, the index
            of its user among the batch's users (0 .. num_users − 1, in batch order; the records
            of one user are consecutive).
        num_users: the number of users in the batch.
        users: the users' labels (from ``user_ids``), one per batch user.
    """

    user_index: torch.Tensor
    num_users: int
    users: tuple[Hashable, ...]


def _labels(user_ids: Any) -> list[Hashable]:
    if isinstance(user_ids, torch.Tensor):
        if user_ids.dim() != 1 or user_ids.is_floating_point() or user_ids.is_complex():
            raise InvalidParameterError(
                "user_ids",
                f"<tensor of shape {tuple(user_ids.shape)}, {user_ids.dtype}>",
                "a 1-D integer tensor (one user label per record)",
            )
        return user_ids.tolist()
    if isinstance(user_ids, (str, bytes)) or not isinstance(user_ids, Sequence):
        raise InvalidParameterError(
            "user_ids", type(user_ids).__name__, "a sequence with one user label per record"
        )
    labels = list(user_ids)
    for label in labels:
        if not isinstance(label, Hashable):
            raise InvalidParameterError("user_ids", label, "hashable user labels")
    return labels


class UserPoissonBatchSampler(StepwiseBatchSampler):
    """Each step, a Poisson sample of users with rate q, at most k records of each.

    Every distinct label of ``user_ids`` is a user. Each step includes every user independently
    with probability q; of a sampled user with more than k records a uniformly random subset of
    k is taken, otherwise all of them. A batch lists the chosen record indices grouped by user
    (users in the order of their first record in ``user_ids``, each user's records in
    increasing order) and may be empty. :meth:`claim_users` tells the optimizer which user each
    position of a batch belongs to.

    A step records ``SamplingEvent.poisson(q, num_users, unit="user")`` (``scheme="full"`` when
    q = 1) and averages over q·num_users. :attr:`population_size` is the number of *records*
    (``len(dataset)``, what :func:`~dpledger.adapters.torch.private_data_loader` checks);
    :attr:`num_users` is the population the event records.

    Whether a user's vector is the sum or the mean of their records' gradients is chosen on the
    optimizer (``DPOptimizer(user_gradient=...)``).

    Args:
        user_ids: the user of every record, a sequence of hashable labels or a 1-D integer
            tensor with one entry per record of the data set.
        sampling_probability: q in (0, 1], the probability that a user is in a batch.
        max_records_per_user: k ≥ 1, the most records of one user in a batch.
        generator: the CPU generator to draw from.
        seed: a seed for a new generator when ``generator`` is not given.
        steps: batches per iteration over the sampler; default round(1/q).

    Raises:
        InvalidParameterError: empty or malformed ``user_ids``, q outside (0, 1], k < 1,
            steps < 1, a bad generator or seed.
    """

    def __init__(
        self,
        user_ids: Sequence[Hashable] | torch.Tensor,
        sampling_probability: float,
        max_records_per_user: int,
        *,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        steps: int | None = None,
    ) -> None:
        labels = _labels(user_ids)
        if not labels:
            raise InvalidParameterError("user_ids", "<empty>", "at least one record")
        slot_of: dict[Hashable, int] = {}
        slots = [slot_of.setdefault(label, len(slot_of)) for label in labels]
        scheme = UserPoissonScheme(
            num_users=len(slot_of),
            sampling_probability=sampling_probability,
            max_records_per_user=max_records_per_user,
            steps=steps,
        )
        super().__init__(population_size=len(labels), generator=generator, seed=seed)
        self._use_scheme(scheme)
        self._q = scheme.sampling_probability
        self._k = scheme.max_records_per_user
        self._users: tuple[Hashable, ...] = tuple(slot_of)
        self._records = UserRecords(slots)
        self._groups: deque[torch.Tensor] = deque()  # the user slots of each unclaimed draw
        self._claimed: torch.Tensor | None = None

    # ------------------------------------------------------------------ properties
    @property
    def sampling_probability(self) -> float:
        """q, the probability that a given user is in a given batch."""
        return self._q

    @property
    def max_records_per_user(self) -> int:
        """k, the most records of one user in a batch."""
        return self._k

    @property
    def num_users(self) -> int:
        """The number of distinct users (the population the sampling event records)."""
        return len(self._users)

    @property
    def users(self) -> tuple[Hashable, ...]:
        """The user labels, in the order of their first record."""
        return self._users

    @property
    def records_per_user(self) -> torch.Tensor:
        """The number of records of each user (in the order of :attr:`users`)."""
        return torch.from_numpy(self._records.records_per_user)

    @property
    def expected_num_users(self) -> float:
        """q·num_users, the mean number of users per batch (the average's denominator)."""
        return self._q * len(self._users)

    # ------------------------------------------------------------------ draws
    def sample(self) -> list[int]:
        """Draw one batch (:meth:`~dpledger.sampling.index_draws.UserRecords.draw`); its size
        and its records' users are kept until a step claims it."""
        records, users = self._records.draw(
            self.host_rng(), sampling_probability=self._q, max_records_per_user=self._k
        )
        batch = records.tolist()
        self._note_draw(len(batch))
        self._groups.append(torch.from_numpy(users))
        return batch

    def _new_pass(self) -> None:
        super()._new_pass()
        self._groups.clear()

    def _consumed(self, draw: Draw) -> None:
        self._claimed = self._groups.popleft() if self._groups else None

    def claim_users(self, num_records: int) -> tuple[SamplingEvent, UserBatch]:
        """:meth:`claim_draw`, with the users of the claimed batch's records.

        Raises:
            SamplerMismatchError: as :meth:`claim_draw` (the draw is consumed either way).
        """
        event = self.claim_draw(num_records)
        slots = self._claimed
        assert slots is not None and len(slots) == num_records
        self._claimed = None
        if len(slots):
            distinct, user_index = torch.unique_consecutive(slots, return_inverse=True)
        else:
            distinct, user_index = slots, slots
        users = tuple(self._users[s] for s in distinct.tolist())
        return event, UserBatch(user_index, len(users), users)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, *, include_generator_state: bool = False) -> dict[str, Any]:
        """The number of users and records, with the generator's state only when
        ``include_generator_state`` (see the base class)."""
        state = super().state_dict(include_generator_state=include_generator_state)
        state["num_users"] = len(self._users)
        state["num_records"] = self._n
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` of a sampler over the same users."""
        expected = (len(self._users), self._n)
        found = (state.get("num_users", expected[0]), state.get("num_records", expected[1]))
        if found != expected:
            raise InvalidParameterError(
                "state",
                f"<sampler state for {found[0]} users and {found[1]} records>",
                f"the state of a sampler over {expected[0]} users and {expected[1]} records",
            )
        super().load_state_dict(state)
