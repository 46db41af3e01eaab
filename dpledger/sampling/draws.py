"""The bookkeeping that ties each DP step to a draw of the sampler whose event it records.

A sampler notes every batch it draws (:meth:`PendingDraws.note`); a step claims the oldest draw
no step has claimed yet (:meth:`PendingDraws.claim`) and is refused, before anything is
recorded, when the sampler drew nothing for it (the records came from another loader) or drew a
batch of another size (a batch filtered or cut after sampling). A data loader may draw a few
batches ahead to prefetch, hence a queue; a new pass over the sampler forgets the unclaimed
draws of an abandoned one (:meth:`PendingDraws.clear`).

For the epoch-based schemes, :meth:`PendingDraws.starts_epoch` says whether a claimed draw is
the first *recorded* step of its epoch: when an epoch's first batch is skipped or refused, the
mark moves to the next claimed batch, so the ledger never joins two epochs' steps into one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from dpledger.errors import SamplerMismatchError

__all__ = ["Draw", "PendingDraws"]


class Draw(NamedTuple):
    """One batch a sampler drew.

    Attributes:
        num_records: the batch's size.
        epoch: the pass of an epoch-based sampler; None for per-step draws.
        position: the batch's position in its epoch.
    """

    num_records: int
    epoch: int | None
    position: int


class PendingDraws:
    """The draws of one sampler that no step has claimed yet, oldest first."""

    __slots__ = ("_queue", "_recorded_epoch")

    def __init__(self) -> None:
        self._queue: deque[Draw] = deque()
        self._recorded_epoch: int | None = None  # the epoch of the last claimed draw

    def __len__(self) -> int:
        return len(self._queue)

    def note(self, num_records: int, epoch: int | None = None, position: int = 0) -> None:
        """Keep a fresh draw until a step claims it."""
        self._queue.append(Draw(num_records, epoch, position))

    def clear(self) -> None:
        """Forget every unclaimed draw (a new pass: the old one's prefetched draws were unused)."""
        self._queue.clear()

    def pop_oldest(self) -> Draw | None:
        """Remove and return the oldest unclaimed draw (None when there is none)."""
        return self._queue.popleft() if self._queue else None

    def claim(self, num_records: int, *, describe_sampler: Callable[[], str]) -> Draw:
        """Remove and return the oldest unclaimed draw, for a step of ``num_records`` records.

        Check the step's size against it with :meth:`check_size` (after any bookkeeping the
        sampler does on a draw leaving the queue).

        Args:
            num_records: the step's number of records.
            describe_sampler: the sampler's name, scheme and parameters, for the message (called
                only when no draw is waiting).

        Raises:
            SamplerMismatchError: no draw is waiting: the step's records did not come from this
                sampler.
        """
        if not self._queue:
            raise SamplerMismatchError(
                f"a step of {num_records} records, but the recorded sampler "
                f"({describe_sampler()}) drew no batch for "
                "it: the records did not come from the sampler whose sampling event the ledger "
                "would record. Iterate the loader that make_private returned (or a DataLoader "
                "with batch_sampler= this sampler), not your own DataLoader; nothing was recorded"
            )
        return self._queue.popleft()

    def claim_step(
        self, num_records: int, *, step: int, describe_sampler: Callable[[], str]
    ) -> Draw:
        """:meth:`claim` for step ``step`` of a stream whose draws note their step as their
        position (a cyclic sampler's): the oldest draw must be that step's, of ``num_records``.

        Raises:
            SamplerMismatchError: no draw is waiting, the oldest draw is of another step (a
                batch was skipped or trained out of order), or it has another number of
                records. The draw is consumed either way.
        """
        draw = self.claim(num_records, describe_sampler=describe_sampler)
        if draw.position != step:
            raise SamplerMismatchError(
                f"step {step} of the correlated-noise stream, but the oldest batch the cyclic "
                f"sampler drew is step {draw.position}'s: a batch was skipped or trained out of "
                "order, and the release's participation pattern would not describe the run; "
                "every step of the stream must train on its own batch. Nothing was recorded"
            )
        self.check_size(draw, num_records)
        return draw

    @staticmethod
    def check_size(draw: Draw, num_records: int) -> None:
        """Refuse a step whose number of records is not the claimed draw's.

        Raises:
            SamplerMismatchError: ``draw`` has another number of records.
        """
        if draw.num_records != num_records:
            raise SamplerMismatchError(
                f"a step of {num_records} records, but the recorded sampler drew a batch of "
                f"{draw.num_records}: the step's records are not the sampler's draw (another "
                "loader, a batch filtered or cut after sampling, or a skipped virtual chunk), "
                "and the ledger's sampling event would not describe them; nothing was recorded"
            )

    def starts_epoch(self, draw: Draw) -> bool:
        """Whether a claimed draw of an epoch-based sampler is the first recorded step of its
        epoch (and remember its epoch as recorded)."""
        start = draw.epoch != self._recorded_epoch
        self._recorded_epoch = draw.epoch
        return start

    def epoch_recorded(self, epoch: int) -> bool:
        """Whether a step of ``epoch`` was recorded."""
        return self._recorded_epoch == epoch

    def set_recorded_epoch(self, epoch: int | None) -> None:
        """Mark ``epoch`` as the epoch of the last recorded step (None: no epoch's start was
        recorded, e.g. after a checkpoint was loaded)."""
        self._recorded_epoch = epoch
