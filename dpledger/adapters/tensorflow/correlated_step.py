"""Correlated noise in the Keras DP step: the release recorded once, each step's w_t added to the
clipped sum (``docs/correlated-noise.md``, "Keras").

:class:`CorrelatedDatasetStream` is the host side, the core
:class:`~dpledger.mechanisms.correlated.stream.CorrelatedStream` tied to the batches of a
:class:`~dpledger.adapters.tensorflow.CyclicDatasetSampler`: at every executed step, in a
``tf.numpy_function`` (so at execution, never at trace time), it checks that the stream has a
step left, that the batch is the one the sampler drew for the stream's step, runs the
sensitivity check on the clipped sum (‖Σ clipped‖ ≤ |R|·S), records the ``correlated_release``
event on the first step, then ``stream_step t`` (both before any noisy output of the step) and
returns the step's float64 noise w_t from the core generator
(:func:`~dpledger.mechanisms.correlated.noise_for`). :class:`CorrelatedDPStep` adds w_t to the
clipped sums in float64 and rounds once to the variables' dtype, as the independent path does
(:mod:`~dpledger.adapters.tensorflow.dp_step`), then averages by the sampler's fixed denominator.
Under ``tf.distribute`` the release runs once, in cross-replica context, on the sum over the
replicas.

One group, isotropic noise: the release records one clip bound S for a record's whole gradient
and one σ = z·S for every coordinate of Z, so the model's clipping must be one group (the
default ``groups="all"``) without joint scales.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import tensorflow as tf

from dpledger.adapters.tensorflow.backend import TensorFlowBackend
from dpledger.adapters.tensorflow.cyclic_sampler import CyclicDatasetSampler
from dpledger.adapters.tensorflow.dp_step import KerasDPStep
from dpledger.adapters.tensorflow.engine import PerExampleGradientEngine
from dpledger.errors import InvalidParameterError, SamplerMismatchError
from dpledger.ledger import PrivacyLedger
from dpledger.mechanisms.averaging import fixed_denominator_average
from dpledger.mechanisms.correlated.spec import CorrelatedNoiseSpec
from dpledger.mechanisms.correlated.stream import CorrelatedStream as CoreStream
from dpledger.mechanisms.gradient_queries import GradientQueries
from dpledger.mechanisms.sum_query_checks import check_sensitivity

__all__ = ["CorrelatedDPStep", "CorrelatedDatasetStream"]


class CorrelatedDatasetStream(CoreStream):
    """The core stream of a Keras run, tied to the batches of its :class:`CyclicDatasetSampler`
    (module docstring).

    Args:
        spec: the mechanism asked for.
        sampler: the :class:`CyclicDatasetSampler` that draws the batches; its participation
            schema and q are what the release records.
        l2_norm_bound: S, the clip bound of a record's whole gradient.
        noise_multiplier: z ≥ 0; σ = z·S.
        dim: d, the number of trainable parameters.
        seed: the seed of the core noise generator.
        label: the release's label in the ledger.
        gated: steps are taken only while :attr:`open` (``DPKerasModel`` opens it during a
            ``fit`` whose data it checked, so ``train_on_batch`` on other data is refused).
        fresh_seed: whether ``seed`` was drawn from the operating system's entropy in this
            process (as the core stream's).

    Raises:
        InvalidParameterError: the sampler does not draw what the spec asks for, or a bad
            argument.
    """

    def __init__(
        self,
        spec: CorrelatedNoiseSpec,
        sampler: CyclicDatasetSampler,
        *,
        l2_norm_bound: float,
        noise_multiplier: float,
        dim: int,
        seed: int,
        label: str | None = None,
        gated: bool = False,
        fresh_seed: bool = False,
    ) -> None:
        self.open = not gated
        if not isinstance(sampler, CyclicDatasetSampler):
            raise InvalidParameterError(
                "sampler",
                sampler,
                "a CyclicDatasetSampler: correlated noise is analysed under the cyclic batches it "
                "draws",
            )
        super().__init__(spec, scheme=sampler.cyclic_scheme, seed=seed, fresh_seed=fresh_seed)
        s = float(l2_norm_bound)
        self.start(l2_norm_bound=s, noise_stddev=float(noise_multiplier) * s, dim=dim, label=label)
        self.sampler = sampler
        self._lock = threading.Lock()
        sampler.drive()

    def step_noise(
        self, ledger: PrivacyLedger, *, num_records: int, position: int, norm: float, eps: float
    ) -> np.ndarray:
        """One step: the checks, the release (first step only) and the stream step, then w_t
        (float64, (d,)).

        Args:
            ledger: the run's ledger.
            num_records: |R|, the records summed.
            position: the batch's position in its pass over the sampler's dataset.
            norm: the float64 L2 norm of the clipped sum (all variables).
            eps: machine epsilon of the sums' dtype.

        Raises:
            NoiseStreamEndError: step T + 1.
            SamplerMismatchError: the batch was not drawn for the stream's step.
            SensitivityCheckError: the clipped sum is longer than |R|·S.
        """
        with self._lock:
            self.check_open()
            if not self.open:
                raise SamplerMismatchError(
                    "a DPKerasModel with correlated noise takes its steps only in fit(), on the "
                    "batches of its CyclicDatasetSampler (train_on_batch and other entry points "
                    "are refused); nothing was released"
                )
            t = self.step
            stale = self.sampler.take_stale_draws()
            if stale:
                raise SamplerMismatchError(
                    f"the CyclicDatasetSampler drew stream steps {stale} again after they were "
                    "released (a pass over its dataset started before the previous one ended): "
                    "such a batch repeats an earlier draw instead of the fresh one the release's "
                    f"analysis assumes; step {t} was not released. Iterate the sampler's dataset "
                    "one pass at a time, as fit does"
                )
            start = self.sampler.next_step
            if start + position != t:
                raise SamplerMismatchError(
                    f"the batch at position {position} of a pass starting at stream step "
                    f"{start} is not the batch of the stream's step {t} (group "
                    f"{t % self.sampler.period} of {self.sampler!r}); nothing was released for it"
                )
            assert self.noise is not None and self.event is not None
            check_sensitivity(
                norm,
                num_records=num_records,
                bound=self.event.l2_norm_bound,
                eps=eps,
                size=self.noise.dim,
            )
            self.record_step(ledger)
            noise = self.next_noise()
            self.sampler.released(t)
            return noise

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (the release is not recorded again when it was);
        the ledger is checked when it is attached (:meth:`resume`)."""
        if int(state["seed"]) != self.seed:
            raise InvalidParameterError("state['seed']", state["seed"], f"the seed {self.seed}")
        self.load_state_dict(state, ledger=None)


class CorrelatedDPStep(KerasDPStep):
    """The DP step with a correlated-noise release instead of independent noise.

    Not constructed by users: :class:`~dpledger.adapters.tensorflow.DPKerasModel` builds it for
    ``noise=`` a correlated spec. Stages 1–3 (per-example norms, clip factors, clipped sums) are
    :class:`KerasDPStep`'s; stage 4 is :meth:`CorrelatedDatasetStream.step_noise` and stage 5
    adds w_t.
    """

    def __init__(
        self,
        engine: PerExampleGradientEngine,
        queries: GradientQueries,
        *,
        stream: CorrelatedDatasetStream,
        ledger: PrivacyLedger,
        clip_margin: float | None,
    ) -> None:
        self.engine = engine
        self.stream = stream
        self.ledger = ledger
        self.denominator = stream.sampler.average_denominator
        self.bias_callback = None
        self.backend = TensorFlowBackend()
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self.variables = engine.trainable_variables
        self._dtypes = [tf.as_dtype(v.dtype) for v in self.variables]
        self._shapes = [tuple(int(d) for d in v.shape) for v in self.variables]
        self._sizes = [int(np.prod(s, dtype=np.int64)) for s in self._shapes]
        self._clip_margin = clip_margin
        self.set_queries(queries)

    def set_queries(self, queries: GradientQueries) -> None:
        """As :meth:`KerasDPStep.set_queries`; the release's S is fixed, so the group's bound must
        stay the recorded one."""
        bound = queries.queries[0].l2_norm_bound if len(queries.queries) == 1 else None
        if bound != self.stream.event.l2_norm_bound:
            raise InvalidParameterError(
                "queries",
                queries,
                f"one group with the recorded l2_norm_bound={self.stream.event.l2_norm_bound} "
                "(a correlated-noise release has one S for its whole stream)",
            )
        super().set_queries(queries)

    def _host_stream(
        self, num_records: np.ndarray, position: np.ndarray, *squared: np.ndarray
    ) -> np.ndarray:
        try:
            eps = max(float(np.finfo(d.as_numpy_dtype).eps) for d in self._dtypes)
            return self.stream.step_noise(
                self.ledger,
                num_records=int(num_records),
                position=int(position),
                norm=math.sqrt(math.fsum(float(s) for s in squared)),
                eps=eps,
            )
        except BaseException as exc:
            self._fail(exc)
            raise

    def release(
        self,
        sums: Any,
        num_records: tf.Tensor,
        *,
        unclipped: Any = None,
        norms: Any = None,
        num_clipped: Any = None,
        position: Any = None,
    ) -> list[tf.Tensor]:
        """Stages 4–5 (once per step, in cross-replica context): check, record, add w_t,
        average by the sampler's fixed denominator (``position`` is required)."""
        if position is None:
            raise InvalidParameterError(
                "position", None, "the batch's position in its pass over the sampler's dataset"
            )
        squared = [tf.reduce_sum(tf.square(tf.cast(s, tf.float64))) for s in sums]
        flat = tf.numpy_function(
            self._host_stream,
            [tf.cast(num_records, tf.int64), tf.cast(position, tf.int64), *squared],
            tf.float64,
            stateful=True,
            name="dp_correlated_release",
        )
        flat.set_shape([sum(self._sizes)])
        pieces = tf.split(flat, self._sizes)
        noised = [
            self.backend.add_scaled_noise(s, tf.reshape(w, shape), stddev=1.0)
            for s, w, shape in zip(sums, pieces, self._shapes, strict=True)
        ]
        return fixed_denominator_average(noised, denominator=self.denominator, backend=self.backend)
