"""Privatised gradients for a custom training loop, and the DP step shared with Keras ``fit``.

One DP step on a Poisson sample R of the n records (McMahan & Andrew, sections 1–3):

1. per-example squared norms of every trainable variable's gradient (the engine, in the graph);
2. on the host, in float64: each group's norm ‖g_i‖_g and clip factors f_{i,g} by the group's
   :class:`~dpledger.mechanisms.GaussianSumQuery` and its clipping strategy (flat, global,
   automatic; joint scaled clipping through :class:`~dpledger.mechanisms.ScaledGaussianSumQuery`);
3. the clipped sums Σ_i f_{i,g} g_{i,j} (the engine's book-keeping, in the graph);
4. on the host: the step's sampling event (the sampler's, see :class:`StepEvents`) is recorded,
   then the mechanisms' release runs — the
   sensitivity check ‖clipped sum‖ ≤ |R|·S_g and one sum-query event (S_g, σ̃_g, label) per
   group — and returns the noise standard deviation of every variable (σ̃_g, or α_j·σ̃_g under
   joint scaling);
5. in the graph: Gaussian noise of exactly those standard deviations, drawn in float64 on the
   sums' device (the standard normals are drawn before stage 4, overlapping it), is added and
   the result rounded once (:class:`~dpledger.adapters.tensorflow.TensorFlowBackend`), and
   the fixed-denominator average is returned (:func:`fixed_denominator_average`): sum/(q·n)
   for Poisson and truncated Poisson, sum/b for fixed-size and shuffled batches, sum/(n/k) for
   balls-in-bins (the event's ``average_denominator``).

The host stages run in ``tf.numpy_function`` callbacks, so the whole step is one
``tf.function`` and the ledger is written when the step *executes* — exactly once per executed
step, never at trace time, whatever the retracing, the epochs or ``steps_per_execution``. The
release in stage 4 is the mechanisms' own code (:meth:`SampledStep.release` of a
:class:`~dpledger.mechanisms.GroupedSumQuery`), run on summaries of the sums (their float64 norms,
shapes and dtypes) instead of the tensors; the standard deviations it draws with are what the
graph then uses, so the ledger records exactly the (S_g, σ̃_g) applied. Under
``tf.distribute`` stage 1–3 run per replica (each replica clips its own records); the clipped sums
are summed across replicas and stages 4–5 run once, so there is one noise draw of the full
variance and one sampling event per step.

**Float32 rounding.** The norms come from float32 reductions for float32 models, the factors
are rounded to float32 and multiplied in float32. To keep every record's contribution at or
below S_g despite that, the factors are computed for the slightly smaller bound S_g·(1 − ρ),
while S_g is what is recorded (and what the sensitivity check enforces). The default margin is
ρ = min(0.05, 2¹³·eps) of the variables' dtype (9.8·10⁻⁴ for float32, 1.8·10⁻¹² for float64): it
covers the worst-case relative error γ_d ≈ d·eps of a float sum of d ≤ 8,000 squares plus the
roundings of the factor and the product (Higham, *Accuracy and Stability of Numerical
Algorithms*, §3–4), and in practice far larger d, since TensorFlow reduces in blocks and trees
(error growing like log d). A ghost norm computed from Gram matrices (long sequences, large
convolutions) can lose more to cancellation; train in float64 where a proof is needed.

**Mixed precision.** Under Keras's ``mixed_float16`` / ``mixed_bfloat16`` policies the forward
and backward passes run in the compute dtype, but the variables are float32, and everything from
the output gradients on is computed in the variables' dtype: per-example norms (float32
reductions of the float16 output gradients cast to float32), factors (float64 on the host, with
float32's margin ρ), the clipped sums, and the noise (float64, rounded once to float32). The
norm and the clipped contribution come from the same output gradients, so ‖f_i g_i‖ ≤ S_g
holds as for float32 models. Without loss scaling, float16 output gradients can underflow to 0;
that loses utility, never privacy.

**Bias metrics** (``bias_callback``): the clipping bias of Knolle et al. (Σ g_i and Σ clip(g_i)
before noise, the per-example norms) via
:func:`dpledger.diagnostics.bias.clipping_bias_from_sums`. They are **not private**: for debugging
on data you may look at. With no callback nothing extra is traced or computed.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from dpledger.adapters.tensorflow.backend import TensorFlowBackend, make_generator
from dpledger.adapters.tensorflow.engine import PerExampleGradientEngine, check_built
from dpledger.adapters.tensorflow.gradient_queries import GradientQueries, adapter_settings
from dpledger.adapters.tensorflow.record_probe import (
    check_probe_switch,
    probe_record_independence,
)
from dpledger.diagnostics.bias import ClippingBiasCallback, clipping_bias_from_sums
from dpledger.errors import InvalidParameterError
from dpledger.ledger import NeighboringRelation, PrivacyLedger, SamplingEvent
from dpledger.mechanisms import (
    ClippingStrategy,
    DPConfig,
    GaussianSumQuery,
    fixed_denominator_average,
)
from dpledger.mechanisms.clipping import rounding_clip_margin
from dpledger.mechanisms.step import open_step
from dpledger.sampling.relations import check_ledger_relation, default_relation
from dpledger.sampling.validation import check_population_size, check_sampling_probability

__all__ = ["PrivateGradients", "default_clip_margin"]

_log = logging.getLogger(__name__)


def default_clip_margin(dtype: Any) -> float:
    """ρ = min(0.05, 2¹³·eps) for a floating dtype: the factors clip to S·(1 − ρ).

    Args:
        dtype: a TensorFlow, NumPy or Keras floating dtype (or its name).
    """
    return rounding_clip_margin(float(np.finfo(tf.as_dtype(dtype).as_numpy_dtype).eps))


# --------------------------------------------------------------------------- host release
class _SumSummary:
    """What the release needs of a clipped sum: its float64 norm, its shape, its dtype's eps."""

    __slots__ = ("eps", "norm", "shape", "tiny")

    def __init__(self, *, norm: float, shape: tuple[int, ...], eps: float, tiny: float) -> None:
        self.norm, self.shape, self.eps, self.tiny = norm, shape, eps, tiny


class _NoiseOrder:
    """The release's request: add N(0, stddev² I) to this sum (carried out in the graph)."""

    __slots__ = ("stddev", "summary")

    def __init__(self, summary: _SumSummary, stddev: float) -> None:
        self.summary, self.stddev = summary, float(stddev)


class _SummaryBackend:
    """An :class:`~dpledger.mechanisms.ArrayBackend` over :class:`_SumSummary` values.

    It lets the mechanisms' release validate, sensitivity-check and record a step whose sums
    stay on the device: the noise draw is returned as a :class:`_NoiseOrder`, which the graph
    executes with :class:`TensorFlowBackend`.
    """

    name = "tensorflow-host"

    def shape(self, x: Any) -> tuple[int, ...]:
        return x.shape

    def float_info(self, x: Any) -> tuple[float, float]:
        return x.eps, x.tiny

    def record_norms(self, x: Any) -> np.ndarray:
        raise NotImplementedError("the host release has no records")  # pragma: no cover

    def norm(self, x: Any) -> float:
        return x.norm

    def weighted_sum(self, x: Any, factors: np.ndarray) -> Any:
        raise NotImplementedError("the host release has no records")  # pragma: no cover

    def scale_records(self, x: Any, factors: np.ndarray) -> Any:
        raise NotImplementedError("the host release has no records")  # pragma: no cover

    def scale(self, x: Any, factor: float) -> Any:
        raise NotImplementedError("averaging happens in the graph")  # pragma: no cover

    def add_gaussian_noise(self, x: Any, *, stddev: float, generator: Any) -> Any:
        return _NoiseOrder(x, stddev)

    def to_host(self, x: Any) -> np.ndarray:
        raise NotImplementedError("the host release has no arrays")  # pragma: no cover

    def from_host(self, values: np.ndarray, *, like: Any | None) -> Any:
        raise NotImplementedError("the host release has no arrays")  # pragma: no cover


def _unwrap_variable(v: Any) -> Any:
    value = getattr(v, "value", None)
    return value if isinstance(value, tf.Variable) else v


# --------------------------------------------------------------------------- the DP step
class DPStep:
    """The DP step's stages, shared by :class:`PrivateGradients` and the Keras model.

    Not constructed by users; see the module docstring for the stages.
    """

    def __init__(
        self,
        engine: PerExampleGradientEngine,
        *,
        queries: GradientQueries,
        events: StepEvents,
        ledger: PrivacyLedger,
        generator: tf.random.Generator,
        clip_margin: float | None,
        bias_callback: ClippingBiasCallback | None,
    ) -> None:
        self.engine = engine
        self.queries = queries
        self.events = events
        self.sampling_probability = events.event.sampling_probability
        self.population_size = events.event.population_size
        self.denominator = events.denominator
        self.ledger = ledger
        self._next_position = 0
        self.generator = generator
        self.bias_callback = bias_callback
        self.backend = TensorFlowBackend()
        self._host_backend = _SummaryBackend()
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        variables = engine.trainable_variables
        self.variables = variables
        self._dtypes = [tf.as_dtype(v.dtype) for v in variables]
        self._shapes = [tuple(int(d) for d in v.shape) for v in variables]
        self._clip_margin = clip_margin
        self.set_queries(queries)

    def set_queries(self, queries: GradientQueries) -> None:
        """Use ``queries`` from the next executed step on (the graph does not depend on them:
        factors and noise scales come from the host stages)."""
        if len(queries.group_of) != len(self.variables):
            raise InvalidParameterError(
                "queries",
                f"queries over {len(queries.group_of)} variables",
                f"queries over the {len(self.variables)} trainable variables",
            )
        if self._clip_margin is None:
            margins = tuple(
                max(default_clip_margin(self._dtypes[j]) for j in members)
                for members in queries.members
            )
        else:
            margins = (float(self._clip_margin),) * len(queries.members)
        if len(queries.members) != len(getattr(self, "queries", queries).members):
            raise InvalidParameterError(
                "queries", "a different number of groups", "the same groups as before"
            )
        with self._lock:
            self.queries, self.margins = queries, margins

    # ------------------------------------------------------------------ host callbacks
    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._errors.append(exc)

    def take_error(self) -> BaseException | None:
        """The first exception a host stage raised since the last call (and forget them)."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors[0] if errors else None

    def _host_factors(self, *squared: np.ndarray) -> tuple[np.ndarray, ...]:
        try:
            vectors = [np.asarray(s, dtype=np.float64) for s in squared]
            with self._lock:
                queries, margins = self.queries, self.margins
            out = []
            for query, members, margin in zip(
                queries.queries, queries.members, margins, strict=True
            ):
                norms = query.group_norms(squared_norms=[vectors[j] for j in members])
                out.append(query.clip_factors(norms, margin=margin))
            return tuple(out)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _host_release(
        self, num_records: np.ndarray, position: np.ndarray, *squared_sum_norms: np.ndarray
    ) -> np.ndarray:
        try:
            with self._lock:
                queries = self.queries
                at = int(position)
                if at < 0:  # no position given: count the executed steps
                    at = self._next_position
                self._next_position = at + 1
            event = self.events.at(at)
            summaries = []
            for j, sq in enumerate(squared_sum_norms):
                info = np.finfo(self._dtypes[j].as_numpy_dtype)
                summaries.append(
                    _SumSummary(
                        norm=math.sqrt(float(sq)),
                        shape=self._shapes[j],
                        eps=float(info.eps),
                        tiny=float(info.tiny),
                    )
                )
            step = open_step(self.ledger, event=event, backend=self._host_backend)
            try:
                released = step.release(
                    queries.grouped,
                    [[summaries[j] for j in members] for members in queries.members],
                    num_records=int(num_records),
                )
            finally:
                step.end()
            stddevs = np.zeros(len(summaries), dtype=np.float64)
            for members, orders in zip(queries.members, released, strict=True):
                for j, order in zip(members, orders, strict=True):
                    stddevs[j] = order.stddev
            return stddevs
        except BaseException as exc:
            self._fail(exc)
            raise

    def _host_bias(
        self,
        num_records: np.ndarray,
        norms: np.ndarray,
        num_clipped: np.ndarray,
        *sums: np.ndarray,
    ) -> np.int64:
        try:
            count = int(num_records)
            if count > 0 and self.bias_callback is not None:
                half = len(sums) // 2
                metrics = clipping_bias_from_sums(
                    unclipped_sum=[np.ravel(s) for s in sums[:half]],
                    clipped_sum=[np.ravel(s) for s in sums[half:]],
                    num_examples=count,
                    per_example_norms=np.asarray(norms, np.float64),
                    num_clipped=int(num_clipped),
                    denominator=self.denominator,
                )
                self.bias_callback(self.ledger.num_steps - 1, metrics)
            return np.int64(0)
        except BaseException as exc:
            self._fail(exc)
            raise

    # ------------------------------------------------------------------ graph stages
    def _cast_factors(self, f: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        out = tf.cast(f, dtype)
        tiny = np.finfo(dtype.as_numpy_dtype).tiny  # a subnormal factor counts as 0
        return tf.where(out < tiny, tf.zeros_like(out), out)

    def clip_replica(self, inputs: Any, targets: Any, sample_weight: Any = None) -> dict[str, Any]:
        """Stages 1–3 on this replica's records: clipped sums, counts, losses, predictions."""
        norms = self.engine.norms(inputs, targets, sample_weight=sample_weight)
        squared = list(norms.squared_norms)
        count = len(self.queries.members)
        factors = tf.numpy_function(
            self._host_factors, squared, [tf.float64] * count, stateful=True, name="dp_factors"
        )
        if not isinstance(factors, (list, tuple)):
            factors = [factors]
        batch = tf.shape(norms.losses)[0]
        for f in factors:
            f.set_shape(norms.losses.shape)
        per_variable = [
            self._cast_factors(factors[g], self._dtypes[j])
            for j, g in enumerate(self.queries.group_of)
        ]
        sums = self.engine.clipped_sum(norms, factors=per_variable)
        out: dict[str, Any] = {
            "sums": tuple(sums),
            "num_records": batch,
            "losses": norms.losses,
            "predictions": norms.predictions,
        }
        if self.bias_callback is not None:
            ones = [tf.ones_like(f) for f in per_variable]
            out["unclipped"] = tuple(self.engine.clipped_sum(norms, factors=ones))
            total = tf.add_n([tf.cast(s, tf.float64) for s in squared])
            out["norms"] = tf.sqrt(tf.maximum(total, 0.0))
            clipped = tf.reduce_any(tf.stack([f < 1.0 for f in factors]), axis=0)
            out["num_clipped"] = tf.reduce_sum(tf.cast(clipped, tf.int32))
        return out

    def release(
        self,
        sums: Sequence[tf.Tensor],
        num_records: tf.Tensor,
        *,
        unclipped: Sequence[tf.Tensor] | None = None,
        norms: tf.Tensor | None = None,
        num_clipped: tf.Tensor | None = None,
        position: Any = None,
    ) -> list[tf.Tensor]:
        """Stages 4–5 (once per step, in cross-replica context): noise, record, average.

        ``position`` is the step's 0-based position in its epoch (an int64 scalar), which
        decides its sampling event (:meth:`StepEvents.at`); None counts the executed steps.
        """
        where = tf.constant(-1, tf.int64) if position is None else tf.cast(position, tf.int64)
        # The standard normals do not depend on the release, so they are drawn first and can
        # overlap with the host stage; the release's standard deviations scale them after.
        normals = [self.backend.standard_normal(s, generator=self.generator) for s in sums]
        squared = [tf.reduce_sum(tf.square(tf.cast(s, tf.float64))) for s in sums]
        stddevs = tf.numpy_function(
            self._host_release,
            [tf.cast(num_records, tf.int64), where, *squared],
            tf.float64,
            stateful=True,
            name="dp_release",
        )
        stddevs.set_shape([len(sums)])
        dependencies = [stddevs]
        if self.bias_callback is not None:
            with tf.control_dependencies([stddevs]):
                token = tf.numpy_function(
                    self._host_bias,
                    [
                        tf.cast(num_records, tf.int64),
                        norms,
                        num_clipped,
                        *unclipped,
                        *sums,
                    ],
                    tf.int64,
                    stateful=True,
                    name="dp_bias_metrics",
                )
            dependencies.append(token)
        with tf.control_dependencies(dependencies):
            noised = [
                self.backend.add_scaled_noise(s, normals[j], stddev=stddevs[j])
                for j, s in enumerate(sums)
            ]
        if self.events.event.is_classic:
            return fixed_denominator_average(
                noised,
                sampling_probability=self.sampling_probability,
                population_size=self.population_size,
                backend=self.backend,
            )
        return fixed_denominator_average(noised, denominator=self.denominator, backend=self.backend)

    def gradients(
        self, inputs: Any, targets: Any, sample_weight: Any = None, position: Any = None
    ) -> tuple[list[tf.Tensor], dict[str, Any]]:
        """Stages 1–5 for one replica (no ``tf.distribute``): the averaged noised gradients."""
        out = self.clip_replica(inputs, targets, sample_weight)
        grads = self.release(
            out["sums"],
            out["num_records"],
            unclipped=out.get("unclipped"),
            norms=out.get("norms"),
            num_clipped=out.get("num_clipped"),
            position=position,
        )
        return grads, out

    def reraise(self, exc: BaseException) -> None:
        """Raise the typed error a host stage stored, from the TensorFlow error ``exc``."""
        stored = self.take_error()
        if stored is not None:
            raise stored from exc
        raise exc


# --------------------------------------------------------------------------- configuration
class StepEvents:
    """The sampling event of every step of a DP run, from its sampler.

    Not constructed by users: :class:`PrivateGradients` and
    :class:`~dpledger.adapters.tensorflow.DPKerasModel` build it from their ``sampler`` (or
    from ``sampling_probability`` and ``population_size``, a Poisson sample).

    Attributes:
        event: the event of every step, with ``epoch_start=False``.
        epoch_based: whether the first step of each epoch is recorded with ``epoch_start``.
        steps_per_epoch: the sampler's batches per epoch (None without a sampler).
    """

    def __init__(self, event: SamplingEvent, sampler: Any = None) -> None:
        self.event = event
        self._sampler = sampler
        self.epoch_based = bool(getattr(sampler, "epoch_based", False))
        self.steps_per_epoch: int | None = getattr(sampler, "steps_per_epoch", None)

    @property
    def denominator(self) -> float:
        """The fixed denominator of every step's average (the event's; q·n for Poisson)."""
        value = self.event.average_denominator
        assert value is not None  # every event here has its n
        return value

    def at(self, position: int) -> SamplingEvent:
        """The event of the step at 0-based ``position`` in its epoch (taken modulo the
        sampler's steps per epoch): the sampler's
        :meth:`~dpledger.adapters.tensorflow.RecordSampler.event_for_step`."""
        if not self.epoch_based:
            return self.event
        assert self.steps_per_epoch is not None
        return self._sampler.event_for_step(position % self.steps_per_epoch)

    @property
    def relations(self) -> tuple[NeighboringRelation, ...]:
        """The neighbouring relations dpledger can analyse the steps under."""
        return self.event.relations


def step_events_of(
    sampler: Any, sampling_probability: float | None, population_size: int | None
) -> StepEvents:
    """The steps' events from a sampler or from an explicit Poisson (q, n), validated."""
    if sampler is not None:
        if sampling_probability is not None or population_size is not None:
            raise InvalidParameterError(
                "sampler",
                sampler,
                "either a sampler or sampling_probability and population_size, not both",
            )
        event = getattr(sampler, "sampling_event", None)
        if isinstance(event, SamplingEvent):
            if event.epoch_start or event.population_size is None:
                raise InvalidParameterError(
                    "sampler", sampler, "a sampler whose sampling_event has n and no epoch_start"
                )
            if getattr(sampler, "epoch_based", False) and not callable(
                getattr(sampler, "event_for_step", None)
            ):
                raise InvalidParameterError(
                    "sampler", sampler, "an epoch-based sampler with event_for_step(step)"
                )
            return StepEvents(event, sampler)
        q = getattr(sampler, "sampling_probability", None)
        n = getattr(sampler, "population_size", None)
        if q is None or n is None:
            raise InvalidParameterError(
                "sampler",
                sampler,
                "a sampler of dpledger.adapters.tensorflow (PoissonSampler, FixedSizeSampler, "
                "TruncatedPoissonSampler, BallsInBinsSampler, ShuffleSampler) or one with "
                "sampling_probability and population_size",
            )
        sampling_probability, population_size = q, n
    if sampling_probability is None or population_size is None:
        raise InvalidParameterError(
            "sampling_probability",
            sampling_probability,
            "the sampler's q in (0, 1] and population_size n (or sampler=PoissonSampler(...)); "
            "q must be the probability with which the data pipeline includes each record",
        )
    q = check_sampling_probability(sampling_probability)
    n = check_population_size(population_size)
    return StepEvents(SamplingEvent.poisson(q, n))


def sampling_of(
    sampler: Any, sampling_probability: float | None, population_size: int | None
) -> tuple[float, int]:
    """(q, n) from a sampler or from explicit values, validated."""
    event = step_events_of(sampler, sampling_probability, population_size).event
    assert event.population_size is not None
    return event.sampling_probability, event.population_size


def check_relation(events: StepEvents, ledger: PrivacyLedger) -> None:
    """Refuse a ledger whose neighbouring relation the steps' scheme has no analysis under.

    Raises:
        InvalidParameterError: naming the relation(s) to create the ledger with.
    """
    check_ledger_relation(events.event, ledger.neighboring)


def check_bias_callback(callback: Any) -> ClippingBiasCallback | None:
    """None or a callable ``callback(step, metrics)``."""
    if callback is not None and not callable(callback):
        raise InvalidParameterError(
            "bias_callback", callback, "None or a callable callback(step, ClippingBias)"
        )
    return callback


def generator_of(generator: Any, seed: int | None) -> tf.random.Generator:
    """The noise generator: the one given, or a Philox generator from ``seed``."""
    if generator is not None:
        if seed is not None:
            raise InvalidParameterError("seed", seed, "None when a generator is given")
        if not isinstance(generator, tf.random.Generator):
            raise InvalidParameterError("generator", generator, "a tf.random.Generator")
        return generator
    return make_generator(seed)


def ledger_of(ledger: Any, events: StepEvents | None = None) -> PrivacyLedger:
    """The ledger given, or a new in-memory one (add/remove, or the relation the steps' scheme
    is analysed under when that is not add/remove); checked against the steps' scheme."""
    if ledger is None:
        if events is None:
            return PrivacyLedger(neighboring=NeighboringRelation.ADD_REMOVE)
        return PrivacyLedger(neighboring=default_relation(events.event))
    if not isinstance(ledger, PrivacyLedger):
        raise InvalidParameterError("ledger", ledger, "a dpledger.PrivacyLedger or None")
    if events is not None:
        check_relation(events, ledger)
    return ledger


# --------------------------------------------------------------------------- public helper
class PrivateGradients:
    """Privatised gradients of a Keras model for a custom ``tf.GradientTape``-style loop.

    Each call is one DP step on a batch drawn by the sampler: it records the batch's sampling
    event and the step's sum-query events in ``ledger`` and returns the noised, clipped gradient
    sum Σ_i clip(g_i) + N(0, σ̃² I) divided by the event's fixed denominator (q·n, b or n/k),
    one tensor per trainable variable (see the module docstring for the stages).

    Example::

        sampler = PoissonSampler(population_size=n, sampling_probability=q, seed=1)
        private = PrivateGradients(model, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none"), l2_norm_bound=1.0, noise_multiplier=1.1,
            sampler=sampler, ledger=ledger, seed=2)
        for x, y in sampler.sample((images, labels)):
            grads = private(x, y)
            optimizer.apply(grads, private.variables)

    A call may be made eagerly (the step is compiled into a ``tf.function`` once per batch
    signature) or inside the caller's own ``tf.function``; either way the ledger is written when
    the step executes.

    Args:
        model: a built ``keras.Model``; its trainable variables are privatised.
        loss: the per-example loss ``loss(y_true, y_pred)`` (a Keras loss is switched to
            ``reduction="none"``).
        config: the step's :class:`~dpledger.mechanisms.DPConfig`, instead of the keyword
            arguments of its fields; giving both (or ``queries``) is an
            :class:`~dpledger.errors.InvalidParameterError`. Its ``noise_multiplier`` is needed.
        l2_norm_bound: S* > 0 (see :func:`~dpledger.adapters.tensorflow.gradient_queries`).
        noise_multiplier: z ≥ 0.
        sampler: the sampler whose batches are passed (a
            :class:`~dpledger.adapters.tensorflow.PoissonSampler`, ``FixedSizeSampler``,
            ``TruncatedPoissonSampler``, ``BallsInBinsSampler`` or ``ShuffleSampler``), for its
            sampling event; or give a Poisson sample's ``sampling_probability`` and
            ``population_size``.
        sampling_probability: q in (0, 1].
        population_size: n ≥ 1.
        ledger: where the events go (default: a new in-memory ledger, add/remove unless the
            scheme is analysed under replace-one only; see :attr:`ledger`). Its neighbouring
            relation must be one the sampler's scheme is analysed under (fixed-size and shuffled
            batches: ``neighboring="replace_one"``).
        generator: the noise ``tf.random.Generator``; or ``seed`` (None: OS entropy).
        seed: seed of the noise generator.
        clipping: the queries' clipping strategy, as in
            :func:`~dpledger.adapters.tensorflow.gradient_queries` (None: the default, or the
            value of ``config``); the same holds for the next five.
        groups: the groups of variables.
        clip_split: how S* is split over the groups.
        noise_allocation: how the noise is allocated over the groups.
        scales: joint scaled clipping, α_j per variable path.
        queries: explicit queries, one per group.
        strategy: the engine's path: ``"auto"`` (default), ``"ghost"`` (the fast ghost-norm
            path only) or ``"generic"`` (vectorised per-example maps, any model).
        clip_margin: ρ in [0, 0.5): factors clip to S_g·(1 − ρ) (default by dtype, see
            :func:`default_clip_margin`).
        bias_callback: ``callback(step, ClippingBias)`` after each step (NOT private metrics).
        check_record_independence: run the record-independence probe
            (:mod:`~dpledger.adapters.tensorflow.record_probe`) on the first eager call with at
            least two records; inside your own ``tf.function`` it cannot run, call
            :meth:`probe` once eagerly first. False switches it off and logs a warning.
        l2_norm_clip: deprecated name of ``l2_norm_bound`` (a :class:`DeprecationWarning`).
        method: deprecated name of ``strategy``: ``"auto"``, ``"fast"`` (``strategy="ghost"``)
            or ``"vectorized"`` (``strategy="generic"``).

    Raises:
        InvalidParameterError: for a bad argument (naming it), or a ledger whose neighbouring
            relation the sampler's scheme has no analysis under.
        PerExampleLossError: for a loss without per-example values.
        RecordMixingLayerError: for BatchNormalization in training mode, or a stateful RNN.
        UnsupportedLayerError: for a recurrent layer with ``recurrent_dropout``.
    """

    def __init__(
        self,
        model: Any,
        loss: Any,
        *,
        config: DPConfig | None = None,
        l2_norm_bound: float | None = None,
        noise_multiplier: float | None = None,
        sampler: Any = None,
        sampling_probability: float | None = None,
        population_size: int | None = None,
        ledger: PrivacyLedger | None = None,
        generator: tf.random.Generator | None = None,
        seed: int | None = None,
        clipping: ClippingStrategy | str | None = None,
        groups: Any = None,
        clip_split: str | None = None,
        noise_allocation: str | None = None,
        scales: Any = None,
        queries: Sequence[GaussianSumQuery] | None = None,
        strategy: str | None = None,
        clip_margin: float | None = None,
        bias_callback: ClippingBiasCallback | None = None,
        check_record_independence: bool = True,
        l2_norm_clip: float | None = None,
        method: str | None = None,
    ) -> None:
        events = step_events_of(sampler, sampling_probability, population_size)
        check_probe_switch(check_record_independence)
        self._probed = not check_record_independence
        settings = adapter_settings(
            config=config,
            queries=queries,
            l2_norm_bound=l2_norm_bound,
            l2_norm_clip=l2_norm_clip,
            groups=groups,
            strategy=strategy,
            method=method,
            clip_margin=clip_margin,
            noise_multiplier=noise_multiplier,
            clipping=clipping,
            clip_split=clip_split,
            noise_allocation=noise_allocation,
            scales=scales,
        )
        engine = PerExampleGradientEngine(model, loss, method=settings.method)
        check_built(model)
        self._step = DPStep(
            engine,
            queries=settings.queries_for(engine.trainable_variables),
            events=events,
            ledger=ledger_of(ledger, events),
            generator=generator_of(generator, seed),
            clip_margin=settings.clip_margin,
            bias_callback=check_bias_callback(bias_callback),
        )
        self._compiled: Callable[..., Any] | None = None
        self._last_position: int | None = None  # the last eager step_in_epoch that stepped

    @property
    def variables(self) -> tuple[Any, ...]:
        """The trainable variables, in the order of the returned gradients."""
        return self._step.variables

    @property
    def ledger(self) -> PrivacyLedger:
        """The ledger the steps are recorded in."""
        return self._step.ledger

    @property
    def queries(self) -> GradientQueries:
        """The step's sum queries and the variables each covers."""
        return self._step.queries

    @property
    def engine(self) -> PerExampleGradientEngine:
        """The per-example gradient engine."""
        return self._step.engine

    def probe(self, inputs: Any, targets: Any = None, *, sample_weight: Any = None) -> bool:
        """Run the record-independence probe on a batch (eagerly); nothing is recorded.

        Returns:
            True when it ran (the batch had at least two records).

        Raises:
            RecordMixingLayerError: the model mixes records.
        """
        ran = probe_record_independence(
            self._step.engine.model,
            engine=self._step.engine,
            inputs=inputs,
            targets=targets,
            sample_weight=sample_weight,
        )
        self._probed = self._probed or ran
        return ran

    @property
    def sampling_event(self) -> SamplingEvent:
        """The sampling event recorded with every step (``epoch_start`` aside)."""
        return self._step.events.event

    def _raw(self, inputs: Any, targets: Any, sample_weight: Any, position: Any) -> list[tf.Tensor]:
        grads, _ = self._step.gradients(inputs, targets, sample_weight, position)
        return grads

    def __call__(
        self,
        inputs: Any,
        targets: Any = None,
        *,
        sample_weight: Any = None,
        step_in_epoch: Any = None,
    ) -> list[tf.Tensor]:
        """One DP step on a batch: the privatised gradient average per trainable variable.

        Args:
            inputs: the model's inputs for the batch (B records, B may be 0).
            targets: the loss's ``y_true``.
            sample_weight: optional per-example loss weights (B,).
            step_in_epoch: for an epoch-based sampler (balls-in-bins, shuffle), required: the
                batch's 0-based position in its iteration over the sampler's dataset
                (``enumerate``); position 0 is recorded with ``epoch_start=True``. Counting the
                executed steps instead would merge an epoch the loop left unfinished with the
                next one and understate ε, so it is not done.

        Raises:
            InvalidParameterError: ``step_in_epoch`` missing with an epoch-based sampler, or
                (in eager calls) outside [0, steps per epoch), or a non-zero position not
                after the previous step's: a new epoch must start at 0, or two epochs would be
                recorded as one.
        """
        if step_in_epoch is None and self._step.events.epoch_based:
            raise InvalidParameterError(
                "step_in_epoch",
                None,
                "the batch's 0-based position in its epoch (for i, (x, y) in "
                "enumerate(sampler.sample(data)): private(x, y, step_in_epoch=i)) with an "
                "epoch-based sampler: counting steps would merge an unfinished epoch with the "
                "next and understate ε",
            )
        position = tf.constant(-1, tf.int64) if step_in_epoch is None else step_in_epoch
        given = self._checked_position(step_in_epoch)
        if tf.inside_function():
            if not self._probed:
                _log.warning(
                    "the record-independence probe cannot run inside a tf.function: call "
                    "private.probe(inputs, targets) once eagerly before training"
                )
                self._probed = True
            return self._raw(inputs, targets, sample_weight, position)
        if not self._probed:
            self.probe(inputs, targets, sample_weight=sample_weight)
        if self._compiled is None:
            self._compiled = tf.function(self._raw, autograph=False, reduce_retracing=True)
        try:
            out = self._compiled(inputs, targets, sample_weight, tf.cast(position, tf.int64))
        except tf.errors.OpError as exc:
            self._step.reraise(exc)
            raise  # pragma: no cover - reraise always raises
        if given is not None:
            self._last_position = given
        return out

    def _checked_position(self, step_in_epoch: Any) -> int | None:
        """An eager ``step_in_epoch`` of an epoch-based sampler, checked (None otherwise: no
        position, or a symbolic one inside the caller's tf.function)."""
        events = self._step.events
        if step_in_epoch is None or not events.epoch_based:
            return None
        if tf.is_tensor(step_in_epoch):
            if not tf.executing_eagerly() or tf.inside_function():
                return None
            step_in_epoch = step_in_epoch.numpy()
        per_epoch = events.steps_per_epoch
        assert per_epoch is not None
        try:
            at = int(step_in_epoch)
        except (TypeError, ValueError):
            at = -1
        last = self._last_position
        if not 0 <= at < per_epoch or (at != 0 and last is not None and at <= last):
            raise InvalidParameterError(
                "step_in_epoch",
                step_in_epoch,
                f"the batch's position in its epoch, in [0, {per_epoch}), increasing within an "
                "epoch and 0 on the first batch of a new one (a position that goes back without "
                "0 would record two epochs as one)",
            )
        return at
