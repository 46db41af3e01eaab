"""The ``tf.data`` sampler of a correlated-noise release: cyclic batches of the core
:class:`~dpledger.sampling.CyclicScheme` (``docs/correlated-noise.md``).

Each of the n records joins one of ``period`` fixed groups once, uniformly and independently
(seeded); step t uses group t mod period, whole or Poisson-sampled with rate q. Every draw is the
scheme's own :meth:`~dpledger.sampling.CyclicScheme.draw` of the stream's step t (a pure
function of the seed and t), run in a ``tf.numpy_function``, so that the batches are exactly the
ones whose participation schema the release records.

One iteration over a dataset made by :meth:`CyclicDatasetSampler.sample` is one pass over the
groups: ``period`` batches, for the steps [s, s + period) from the pass's first step s
(:attr:`CyclicDatasetSampler.next_step`). On its own the sampler moves s on by ``period`` at the
start of every pass. Once a model drives it (:meth:`CyclicDatasetSampler.drive`, done by
``DPKerasModel(noise=spec)``), s moves on only when the model has released the last step of a pass:
an iterator that ``tf.distribute`` or a peek creates and abandons draws batches (pure functions of
the seed and the step) but takes no step of the stream, and the model checks at every step that the
batch's position in its pass is the stream's step's. A step drawn after the model released it (a
pass started before the previous one ended, whose Poisson draws would repeat) is noted, and the
model refuses its next step (:meth:`CyclicDatasetSampler.take_stale_draws`). That bookkeeping is
the core's :class:`~dpledger.sampling.cyclic.CyclicPasses`; this module makes its ``tf.data``
datasets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from dpledger.adapters.tensorflow.sampler_base import RecordedDatasetSampler
from dpledger.errors import InvalidParameterError
from dpledger.sampling import CyclicScheme
from dpledger.sampling.cyclic import CyclicPasses

__all__ = ["CyclicDatasetSampler"]


class CyclicDatasetSampler(RecordedDatasetSampler):
    """Cyclic batches for a correlated-noise release (:class:`~dpledger.sampling.CyclicScheme`).

    Give it to :class:`~dpledger.adapters.tensorflow.DPKerasModel` with ``noise=`` a
    correlated-noise spec: the release records the scheme's participation schema
    (``cyclic``, period b, T steps) and its q (Poisson sampling within the groups, for
    amplified BandMF), and ``fit`` accepts only this sampler's :meth:`sample` datasets.

    Args:
        population_size: n, at least ``period``.
        period: b, the number of fixed groups (batches per pass over the data).
        num_steps: T, the steps of the release; a multiple of ``period`` (every pass over
            the dataset is a whole pass over the groups).
        sampling_probability: q in (0, 1] to Poisson-sample each step's group; None (default)
            uses the whole group.
        seed: the seed of the partition and of the Poisson draws (None: OS entropy).

    Raises:
        InvalidParameterError: a bad argument (naming it).
    """

    _shown = ("population_size", "period", "num_steps", "sampling_probability", "seed")

    def __init__(
        self,
        *,
        population_size: int,
        period: int,
        num_steps: int,
        sampling_probability: float | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(population_size=population_size, seed=seed)
        self._cyclic = CyclicScheme(
            population_size=population_size,
            period=period,
            num_steps=num_steps,
            sampling_probability=sampling_probability,
            seed=self.seed,
        )
        self._passes = CyclicPasses(self._cyclic)

    # ------------------------------------------------------------------ description
    @property
    def cyclic_scheme(self) -> CyclicScheme:
        """The core scheme whose draws this sampler makes (and whose participation a release
        records)."""
        return self._cyclic

    @property
    def period(self) -> int:
        """b, the number of groups."""
        return self._cyclic.period

    @property
    def num_steps(self) -> int:
        """T, the steps of the stream."""
        return self._cyclic.num_steps

    @property
    def sampling_probability(self) -> float | None:  # type: ignore[override]
        """q within a group, or None (whole groups)."""
        return self._cyclic.sampling_probability

    @property
    def steps_per_epoch(self) -> int:
        """Batches per iteration over a dataset made by :meth:`sample`: ``period``."""
        return self._cyclic.period

    @property
    def epoch_based(self) -> bool:
        """False: no step records a sampling event (the release stands for the stream)."""
        return False

    @property
    def sampling_event(self) -> Any:
        """Refused: a correlated-noise release records no per-step sampling event.

        Raises:
            InvalidParameterError: always; use the sampler with ``noise=`` a correlated spec.
        """
        raise InvalidParameterError(
            "sampler",
            self,
            "a per-step sampler (PoissonDatasetSampler, …) for independent noise: a "
            "CyclicDatasetSampler's "
            "steps are recorded as one correlated-noise release (DPKerasModel(noise=spec))",
        )

    @property
    def average_denominator(self) -> float:
        """The fixed denominator of each step's average: (n / period)·q (q = 1 for whole
        groups)."""
        return self._cyclic.average_denominator

    @property
    def next_step(self) -> int:
        """The stream step of the first batch of the next pass over a dataset of
        :meth:`sample` (:class:`~dpledger.sampling.cyclic.CyclicPasses`)."""
        return self._passes.next_step

    def seek(self, step: int) -> None:
        """Start the next pass at stream step ``step`` (a multiple of ``period``): for a run
        resumed from a checkpoint.

        Raises:
            InvalidParameterError: ``step`` is not a multiple of ``period`` in [0, T].
        """
        self._passes.seek(step)

    def drive(self) -> None:
        """Let a model move the passes on (:meth:`released`) instead of every pass started."""
        self._passes.drive()

    def released(self, step: int) -> None:
        """The driving model released stream step ``step``."""
        self._passes.released(step)

    def take_stale_draws(self) -> list[int]:
        """The stream steps drawn after the driving model had released them, emptied."""
        return self._passes.take_stale_draws()

    @contextlib.contextmanager
    def preserved_state(self) -> Iterator[None]:
        """Inside this block, passes started (e.g. peeking at a batch) do not advance the
        sampler."""
        saved = self.next_step
        try:
            yield
        finally:
            self._passes.restore(saved)

    # ------------------------------------------------------------------ batches
    def _start_pass(self) -> np.int64:
        return np.int64(self._passes.start_pass())

    def _draw(self, step: np.ndarray) -> np.ndarray:
        self._passes.drawn(int(step))
        return np.asarray(self._cyclic.draw(int(step)), dtype=np.int64)

    def index_dataset(self) -> tf.data.Dataset:
        """A dataset of ``period`` sorted int64 vectors: the records of the steps of the next
        pass (the scheme's draws). Every iteration is the next pass; a pass beyond T steps
        fails (the scheme refuses the step)."""
        period = self.period

        def one_pass(_: tf.Tensor) -> tf.data.Dataset:
            start = tf.numpy_function(self._start_pass, [], tf.int64, stateful=True)

            def indices(j: tf.Tensor) -> tf.Tensor:
                out = tf.numpy_function(self._draw, [start + j], tf.int64, stateful=False)
                out.set_shape([None])
                return out

            return tf.data.Dataset.range(period).map(indices)

        return tf.data.Dataset.range(1).flat_map(one_pass)
