"""Privatised gradients for a custom training loop: :class:`PrivateGradients`.

Each call is one DP step (:class:`~dpledger.adapters.tensorflow.dp_step.KerasDPStep`, shared with
Keras ``fit``; its module docstring states the stages and their precision). Its sampling events
are :class:`~dpledger.mechanisms.step.StepEvents`; the constructors' checks are in
``construction_checks``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from dpledger.adapters.tensorflow.construction_checks import (
    generator_of,
)
from dpledger.adapters.tensorflow.correlated_model import (
    ledger_for_release,
    no_sampling_event,
    stream_of,
)
from dpledger.adapters.tensorflow.correlated_step import CorrelatedDPStep
from dpledger.adapters.tensorflow.dp_step import KerasDPStep, variable_layout
from dpledger.adapters.tensorflow.engine import PerExampleGradientEngine, check_built
from dpledger.adapters.tensorflow.record_probe import (
    check_probe_switch,
    probe_record_independence,
)
from dpledger.diagnostics.bias import ClippingBiasCallback
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger, SamplingEvent
from dpledger.mechanisms import DPConfig, GaussianSumQuery
from dpledger.mechanisms.clipping import ClippingStrategy
from dpledger.mechanisms.construction_checks import check_bias_callback, step_ledger
from dpledger.mechanisms.gradient_queries import GradientQueries, settings_of_arguments
from dpledger.mechanisms.step import step_events_of

__all__ = ["PrivateGradients"]

_log = logging.getLogger(__name__)


class PrivateGradients:
    """Privatised gradients of a Keras model for a custom ``tf.GradientTape``-style loop.

    Each call is one DP step on a batch drawn by the sampler: it records the batch's sampling
    event and the step's sum-query events in ``ledger`` and returns the noised, clipped gradient
    sum Σ_i clip(g_i) + N(0, σ̃² I) divided by the event's fixed denominator (q·n, b or n/k),
    one tensor per trainable variable (see the module docstring for the stages).

    Example::

        sampler = PoissonDatasetSampler(population_size=n, sampling_probability=q, seed=1)
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
        l2_norm_bound: S* > 0 (see :func:`~dpledger.adapters.tensorflow.dp_step.gradient_queries`).
        noise_multiplier: z ≥ 0.
        sampler: the sampler whose batches are passed (a
            :class:`~dpledger.adapters.tensorflow.PoissonDatasetSampler`,
            ``FixedSizeDatasetSampler``, ``TruncatedPoissonDatasetSampler``,
            ``BallsInBinsDatasetSampler`` or ``ShuffleDatasetSampler``), for its sampling event; or
            give a Poisson sample's ``sampling_probability`` and ``population_size``.
        sampling_probability: q in (0, 1].
        population_size: n ≥ 1.
        ledger: where the events go (default: a new in-memory ledger, add/remove unless the
            scheme is analysed under replace-one only; see :attr:`ledger`). Its neighbouring
            relation must be one the sampler's scheme is analysed under (fixed-size and shuffled
            batches: ``neighboring="replace_one"``).
        generator: the noise ``tf.random.Generator``; or ``seed`` (None: OS entropy).
        seed: seed of the noise generator.
        clipping: the queries' clipping strategy, as in
            :func:`~dpledger.adapters.tensorflow.dp_step.gradient_queries` (None: the default,
            or the value of ``config``); the same holds for the next five.
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
        noise: ``"independent"`` (default) or a
            :class:`~dpledger.mechanisms.correlated.CorrelatedNoiseSpec` with a
            :class:`~dpledger.adapters.tensorflow.CyclicDatasetSampler` as ``sampler``: one
            correlated-noise release (as for ``DPKerasModel(noise=spec)``), each call one step
            of its stream; ``step_in_epoch`` (the batch's position in its pass) is required.

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
        noise: Any = "independent",
    ) -> None:
        check_probe_switch(check_record_independence)
        self._probed = not check_record_independence
        settings = settings_of_arguments(locals())
        engine = PerExampleGradientEngine(model, loss, strategy=settings.strategy)
        check_built(model)
        self._compiled: Callable[..., Any] | None = None
        self._last_position: int | None = None  # the last eager step_in_epoch that stepped
        queries = settings.queries_for(**variable_layout(engine.trainable_variables))
        stream = stream_of(
            noise, sampler, queries, model, settings.config, generator, seed, bias_callback
        )
        self._correlated = stream is not None
        if stream is not None:
            self._step = CorrelatedDPStep(
                engine,
                queries,
                stream=stream,
                ledger=ledger_for_release(ledger, stream, settings.config),
                clip_margin=settings.clip_margin,
            )
            return
        events = step_events_of(sampler, sampling_probability, population_size)
        self._step = KerasDPStep(
            engine,
            queries=queries,
            events=events,
            ledger=step_ledger(ledger, events.event),
            generator=generator_of(generator, seed),
            clip_margin=settings.clip_margin,
            bias_callback=check_bias_callback(bias_callback),
        )

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
        """The sampling event recorded with every step (``epoch_start`` aside); correlated
        noise records none (:class:`~dpledger.errors.InvalidParameterError`)."""
        if isinstance(self._step, CorrelatedDPStep):
            raise no_sampling_event(self._step.stream)
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
            step_in_epoch: for an epoch-based sampler (balls-in-bins, shuffle) or correlated
                noise, required: the
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
        if step_in_epoch is None and (self._correlated or self._step.events.epoch_based):
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
        if step_in_epoch is None or self._correlated or not self._step.events.epoch_based:
            return None
        events = self._step.events
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
