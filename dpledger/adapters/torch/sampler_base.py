"""What every recorded batch sampler shares: its generator and the bookkeeping of its draws.

A DP step records the sampling event of the draw that produced its records, so every step is
tied to a draw of the sampler. The sampler keeps the draws (their sizes and events) that no step
has claimed yet (a data loader may draw a few ahead to prefetch); the optimizer claims the oldest
at each step (:meth:`RecordedBatchSampler.claim_draw`), which returns the
:class:`~dpledger.ledger.SamplingEvent` to record, and refuses the step, before anything is
recorded, when the sampler drew nothing (the training loop iterates another loader, e.g. the
user's own ``shuffle=True`` DataLoader) or drew a batch of another size. A new pass over the
sampler forgets the unclaimed draws of an abandoned one (they were prefetched, never trained on).

Epoch-based samplers (balls-in-bins, shuffle: one pass is one epoch, whose allocation or
permutation is drawn when the pass starts) mark the event of the first step *recorded* in each
pass with ``epoch_start=True``: when the pass's first batch is skipped or refused, the mark moves
to the next claimed batch, so the ledger never joins two epochs' steps into one. Their
:meth:`~RecordedBatchSampler.state_dict` also holds the position in the current epoch, so that a
run resumed from a checkpoint continues the same epoch with the same permutation.

What does not need torch lives in :mod:`dpledger.sampling`: each sampler holds its scheme
(:attr:`RecordedBatchSampler.scheme`: checked parameters, q, denominator, epoch layout, events),
which draws the record indices on the host in NumPy (:meth:`~dpledger.sampling.BatchScheme.draw`,
the same draws as the ``tf.data`` samplers'), and keeps its draws in a
:class:`~dpledger.sampling.draws.PendingDraws`. The classes here seed each draw from a
``torch.Generator`` (:meth:`RecordedBatchSampler.host_rng`), whose state the checkpoints keep,
and hand the indices to ``torch.utils.data`` as lists.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from dpledger.errors import InvalidParameterError
from dpledger.ledger import SamplingEvent
from dpledger.ledger.provenance import seeding_of
from dpledger.sampling.draws import Draw, PendingDraws
from dpledger.sampling.index_draws import host_generator
from dpledger.sampling.schemes import BatchScheme
from dpledger.sampling.validation import check_population_size

__all__ = ["EpochBatchSampler", "RecordedBatchSampler"]

_log = logging.getLogger(__name__)


def _check_generator(generator: Any) -> torch.Generator | None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InvalidParameterError("generator", generator, "a torch.Generator or None")
    if generator is not None and generator.device.type != "cpu":
        raise InvalidParameterError(
            "generator", f"<torch.Generator on {generator.device}>", "a CPU torch.Generator"
        )
    return generator


def _make_generator(generator: Any, seed: Any) -> torch.Generator:
    generator = _check_generator(generator)
    if generator is not None and seed is not None:
        raise InvalidParameterError("seed", seed, "None when a generator is given")
    if generator is not None:
        return generator
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidParameterError("seed", seed, "an integer or None")
        generator.manual_seed(seed)
    return generator


class RecordedBatchSampler(Sampler[list[int]], abc.ABC):
    """Base of the batch samplers whose draws DP steps claim and record.

    Subclasses draw index batches from :attr:`generator` and say which sampling event a draw is
    (:meth:`sampling_event`). The base keeps the unclaimed draws and the generator's state.

    Args:
        population_size: n, the number of records (``len(dataset)``).
        generator: the CPU random generator to draw from; iterating again continues its stream.
        seed: a seed for a new generator when ``generator`` is not given; None seeds it from
            OS entropy (not reproducible).

    Raises:
        InvalidParameterError: n < 1, a generator that is not a CPU ``torch.Generator``, or
            both ``generator`` and ``seed`` given.
    """

    def __init__(
        self,
        *,
        population_size: int,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        self._n = check_population_size(population_size)
        self._generator = _make_generator(generator, seed)
        self._seeding = seeding_of(generator=generator, seed=seed)
        self._draws = PendingDraws()

    # ------------------------------------------------------------------ subclass hooks
    @abc.abstractmethod
    def sampling_event(self, *, epoch_start: bool = False) -> SamplingEvent:
        """The sampling event a step on one of this sampler's draws records.

        ``epoch_start`` matters for the epoch-based schemes only (the first recorded step of
        an epoch); other samplers ignore it.
        """

    @abc.abstractmethod
    def __len__(self) -> int:
        """Batches per iteration over the sampler."""

    # ------------------------------------------------------------------ properties
    _scheme: BatchScheme | None = None

    @property
    def scheme(self) -> BatchScheme | None:
        """The framework-neutral description of the sampler's scheme (parameters, q, denominator,
        epoch layout, events; :mod:`dpledger.sampling`); None for a sampler that has none."""
        return self._scheme

    @property
    def population_size(self) -> int:
        """n, the number of records each batch is drawn from."""
        return self._n

    @property
    def generator(self) -> torch.Generator:
        """The generator the batches are drawn from."""
        return self._generator

    @property
    def denominator(self) -> float:
        """The fixed denominator of DP-SGD's average for this scheme (the event's
        ``average_denominator``: q·n for Poisson, b for fixed-size and shuffled batches, n / k
        for balls-in-bins)."""
        value = self.sampling_event().average_denominator
        assert value is not None  # every sampler knows n
        return value

    # ------------------------------------------------------------------ draws
    def host_rng(self) -> np.random.Generator:
        """A NumPy generator for one draw, seeded from two words of :attr:`generator` (which
        advances, so that the next draw differs and a checkpoint of it resumes the stream)."""
        words = torch.randint(0, 1 << 62, (2,), generator=self._generator, dtype=torch.int64)
        return host_generator(words.tolist())

    def _note_draw(self, num_records: int, epoch: int | None = None, index: int = 0) -> None:
        self._draws.note(num_records, epoch, index)

    def _consumed(self, draw: Draw) -> None:
        """A draw left the queue (claimed, refused or discarded)."""

    def _event_of(self, draw: Draw) -> SamplingEvent:
        return self.sampling_event()

    @property
    def unclaimed_draws(self) -> int:
        """The number of batches drawn that no step has claimed yet."""
        return len(self._draws)

    def claim_draw(self, num_records: int) -> SamplingEvent:
        """Tie a step of ``num_records`` records to the oldest unclaimed draw of this sampler.

        Returns:
            The sampling event the step must record for that draw.

        Raises:
            SamplerMismatchError: no draw is waiting (the step's records did not come from this
                sampler), or the oldest draw has another number of records. The draw is
                consumed either way.
        """
        draw = self._draws.claim(num_records, describe_sampler=self._describe)
        self._consumed(draw)
        PendingDraws.check_size(draw, num_records)
        return self._event_of(draw)

    def _describe(self) -> str:
        return f"{type(self).__name__}, {self.sampling_event().describe()}"

    def discard_draw(self) -> None:
        """Forget the oldest unclaimed draw (its batch was skipped, not trained on)."""
        draw = self._draws.pop_oldest()
        if draw is not None:
            self._consumed(draw)

    def _new_pass(self) -> None:
        self._draws.clear()  # an abandoned pass's prefetched draws were not used

    # ------------------------------------------------------------------ checkpoints
    @property
    def seeding(self) -> str:
        """How the generator was seeded: ``"os_entropy"``, ``"caller_seed"`` or
        ``"caller_generator"`` (:data:`~dpledger.ledger.provenance.SEEDINGS`)."""
        return self._seeding

    def state_dict(self, *, include_generator_state: bool = False) -> dict[str, Any]:
        """The sampler's state for a checkpoint.

        By default it holds no generator state (``"generator_state": None``): which records
        were drawn must stay secret for amplification by subsampling to hold, and whoever has
        the state can replay the draws. ``include_generator_state=True`` keeps it, for a
        bit-for-bit resume (the optimizer's opt-in,
        :meth:`~dpledger.adapters.torch.checkpoint.OptimizerCheckpoint.enable_bit_for_bit_resume`).
        """
        if not include_generator_state:
            return {"generator_state": None}
        return {"generator_state": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`; one without a generator state continues
        from a fresh state drawn from OS entropy (and says so in the log)."""
        if state.get("generator_state") is None:
            self._fresh_state()
            return
        self._generator.set_state(state["generator_state"])

    def _fresh_state(self) -> None:
        _log.info(
            "%s: the checkpoint holds no generator state; drawing a fresh one from OS entropy",
            type(self).__name__,
        )
        self._generator.seed()
        self._seeding = "os_entropy"

    def reseed(self, seed: int) -> None:
        """Continue from a fresh generator state (a resumed run that must not repeat draws)."""
        self._generator.manual_seed(seed)


class StepwiseBatchSampler(RecordedBatchSampler):
    """Base of the samplers that draw every batch afresh (Poisson, fixed size, truncated
    Poisson, users): one pass over the sampler is ``steps`` independent draws, and every step
    records the same event.

    Subclasses call :meth:`_use_scheme` in their constructor; :meth:`sample` draws the scheme's
    batch (:meth:`~dpledger.sampling.BatchScheme.draw`) and notes it.
    """

    _steps: int
    _event: SamplingEvent

    def _use_scheme(self, scheme: BatchScheme) -> None:
        """Take the steps of a pass and the event of every step from ``scheme``."""
        self._scheme = scheme
        self._steps = scheme.steps_per_epoch
        self._event = scheme.event()

    def sample(self) -> list[int]:
        """Draw one batch of the scheme (indices in increasing order); kept until a step claims
        it (:meth:`claim_draw`)."""
        assert self._scheme is not None
        batch = self._select(self._scheme.draw(self.host_rng()).tolist())
        self._note_draw(len(batch))
        return batch

    def _select(self, indices: list[int]) -> list[int]:
        """The part of a drawn batch that this process trains on (all of it here)."""
        return indices

    @property
    def steps(self) -> int:
        """Batches per iteration over the sampler."""
        return self._steps

    def sampling_event(self, *, epoch_start: bool = False) -> SamplingEvent:
        """The event of every step (``epoch_start`` does not apply)."""
        return self._event

    def __len__(self) -> int:
        return self._steps

    def __iter__(self) -> Iterator[list[int]]:
        self._new_pass()
        for _ in range(self._steps):
            yield self.sample()


class EpochBatchSampler(RecordedBatchSampler):
    """Base of the epoch-based samplers: one pass over the sampler is one epoch.

    Subclasses set ``self._scheme`` in their constructor; :meth:`_epoch` draws the epoch's
    batches (all of them, :meth:`~dpledger.sampling.BatchScheme.draw_epoch`, when the pass
    starts). See the module docstring for ``epoch_start`` and for the position in the epoch that
    :meth:`state_dict` keeps.
    """

    def __init__(
        self,
        *,
        population_size: int,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(population_size=population_size, generator=generator, seed=seed)
        self._pass_id = 0  # the current pass (epoch); 0 before the first
        self._epoch_state: torch.Tensor | None = None  # generator state before the pass's draw
        self._done = 0  # batches of the current pass consumed (claimed, refused or discarded)
        self._resume: tuple[int, bool] | None = None  # (batches done, start recorded)

    def _epoch(self) -> list[list[int]]:
        """Draw one epoch's batches."""
        assert self._scheme is not None
        return [batch.tolist() for batch in self._scheme.draw_epoch(self.host_rng())]

    def sampling_event(self, *, epoch_start: bool = False) -> SamplingEvent:
        """The scheme's event, ``epoch_start=True`` for the first recorded step of an epoch."""
        assert self._scheme is not None
        return self._scheme.event(epoch_start=epoch_start)

    def __len__(self) -> int:
        assert self._scheme is not None
        return self._scheme.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        self._new_pass()
        self._pass_id += 1
        start = 0
        if self._resume is not None:
            start, recorded = self._resume
            self._resume = None
            if recorded:
                self._draws.set_recorded_epoch(self._pass_id)
        self._epoch_state = self._generator.get_state()
        self._done = start
        epoch = self._pass_id
        batches = self._epoch()
        for index in range(start, len(batches)):
            batch = batches[index]
            self._note_draw(len(batch), epoch, index)
            yield batch

    def _consumed(self, draw: Draw) -> None:
        if draw.epoch == self._pass_id:
            self._done = draw.position + 1

    def _event_of(self, draw: Draw) -> SamplingEvent:
        return self.sampling_event(epoch_start=self._draws.starts_epoch(draw))

    def state_dict(self, *, include_generator_state: bool = False) -> dict[str, Any]:
        """The generator's state and the position in the current epoch (only with
        ``include_generator_state=True``; by default neither, and a resume starts a new epoch
        from a fresh OS-entropy state).

        ``epoch`` holds the generator's state before the current epoch was drawn, the batches of
        the epoch already consumed, and whether a step of the epoch was recorded; None before
        the first epoch. A sampler loaded with it continues that epoch at its next pass.
        """
        state = super().state_dict(include_generator_state=include_generator_state)
        if self._epoch_state is None or not include_generator_state:
            state["epoch"] = None
        else:
            state["epoch"] = {
                "generator_state": self._epoch_state.clone(),
                "batches_done": self._done,
                "start_recorded": self._draws.epoch_recorded(self._pass_id),
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`: the next pass continues its epoch."""
        epoch = state.get("epoch")
        if epoch is None and state.get("generator_state") is None:
            self._fresh_state()
            self._resume = None
        elif epoch is not None and 0 < epoch["batches_done"] < len(self):
            self._generator.set_state(epoch["generator_state"])
            self._resume = (int(epoch["batches_done"]), bool(epoch["start_recorded"]))
        elif epoch is not None and epoch["batches_done"] == 0:
            # the epoch was drawn but none of its batches used: draw it again from its state
            self._generator.set_state(epoch["generator_state"])
            self._resume = None
        else:
            super().load_state_dict(state)
            self._resume = None
        self._draws.set_recorded_epoch(None)

    def reseed(self, seed: int) -> None:
        """Continue from a fresh generator state; the next pass is a new epoch."""
        super().reseed(seed)
        self._resume = None
        self._draws.set_recorded_epoch(None)
