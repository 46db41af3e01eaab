"""DP training of a Keras 3 model through ordinary ``compile`` / ``fit``, with any optimizer.

:class:`DPKerasModel` wraps a built ``keras.Model``; compiled with whatever
``keras.optimizers.Optimizer`` the user chooses (SGD, Adam, AdamW, a custom one) and a loss, its
``fit`` runs DP steps: each step clips per-example gradients (the fast ghost-norm path or the
vectorised one), adds Gaussian noise, averages with the fixed denominator of the sampling scheme
(q·n, b or n/k) and hands the privatised gradient to the optimizer, recording the step's sampling
event and sum-query events in the ledger (see
:mod:`~dpledger.adapters.tensorflow.dp_step` for the stages and their precision). The
optimizer only post-processes privatised gradients, so its choice never changes the accounting.

Why not ``train_step``: Keras runs ``train_step`` inside a ``tf.function`` (and a loop of
``steps_per_execution`` steps inside one graph), where Python code runs only while tracing.
:class:`DPKerasModel` overrides :meth:`make_train_function` instead, with a Python loop over
``steps_per_execution`` calls of one compiled DP step; the ledger is written by host callbacks
when the step executes, so the ledger has exactly one sampling event per executed step (tests
check this across retracing, epochs and ``steps_per_execution`` > 1).

Per-example losses are required: a Keras loss passed to :meth:`compile` is used with
``reduction="none"`` (a copy is made); a callable must return one value per example. The loss
reported in the logs is the mean per-example loss of the step's batch (0 for an empty batch); it
and the compiled metrics are computed from the training data and are NOT private.

Saving: ``dp_model.save(path)`` and ``keras.models.load_model(path)`` give back a
:class:`DPKerasModel` (a registered serializable class) with the wrapped model, its weights, the
compiled loss and optimizer, and the DP configuration (:attr:`DPKerasModel.dp_config`, the
sampling event); see :mod:`~dpledger.adapters.tensorflow.model_saving`. The ledger is a file the
user owns and is not saved: the loaded model raises
:class:`~dpledger.errors.LedgerNotAttachedError` on training until
:meth:`DPKerasModel.attach_ledger` gives it one (``PrivacyLedger(path, resume=True)`` continues
the run's file), so it never starts a new ledger that would pass for the old one.

Training the wrapped model itself (its ``fit``, ``train_on_batch`` or ``train_step``) after
wrapping warns with :class:`~dpledger.errors.UnrecordedTrainingWarning`
(:mod:`~dpledger.adapters.tensorflow.inner_training`): such steps are neither private nor
recorded.

Under ``tf.distribute.MirroredStrategy`` (create the model and :class:`DPKerasModel` inside
``strategy.scope()``), each replica clips its own records, the clipped sums are summed across
replicas, one noise draw of the full variance is added and the update is applied once to the
mirrored variables; there is one ledger and one sampling event per step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.construction_checks import (
    generator_of,
    ledger_with_intent,
)
from dpledger.adapters.tensorflow.correlated_model import (
    correlated_batches,
    fit_window,
    ledger_for_release,
    no_sampling_event,
    refuse_query_changes,
    stream_of,
)
from dpledger.adapters.tensorflow.correlated_step import CorrelatedDatasetStream, CorrelatedDPStep
from dpledger.adapters.tensorflow.dp_step import KerasDPStep, gradient_queries, variable_layout
from dpledger.adapters.tensorflow.engine import PerExampleGradientEngine, check_built
from dpledger.adapters.tensorflow.fit_data import (
    BATCH_SOURCES,
    check_sampled_batches,
    poisson_batches,
    refuse_regularizers,
)
from dpledger.adapters.tensorflow.inner_training import (
    check_wrapper_compiled,
    warn_on_direct_training,
)
from dpledger.adapters.tensorflow.losses import per_example_loss
from dpledger.adapters.tensorflow.model_saving import SavedDPModel, note_keras_provenance
from dpledger.adapters.tensorflow.record_probe import (
    check_probe_switch,
    probe_record_independence,
)
from dpledger.adapters.tensorflow.train_function import dp_train_function
from dpledger.diagnostics.bias import ClippingBiasCallback
from dpledger.errors import InvalidParameterError, LedgerNotAttachedError, PerExampleLossError
from dpledger.ledger import PrivacyLedger, SamplingEvent
from dpledger.ledger.provenance import seeding_of
from dpledger.mechanisms import DPConfig, GaussianSumQuery
from dpledger.mechanisms.clipping import ClippingStrategy
from dpledger.mechanisms.construction_checks import check_bias_callback
from dpledger.mechanisms.gradient_queries import GradientQueries, settings_of_arguments
from dpledger.mechanisms.step import StepEvents, step_events_of

__all__ = ["DPKerasModel", "make_private"]

_log = logging.getLogger(__name__)

# The arguments of update_queries that are DPConfig fields (the config follows them).
_QUERY_FIELDS = frozenset(
    ("l2_norm_bound", "noise_multiplier", "clipping", "clip_split", "noise_allocation", "scales")
)


@keras.saving.register_keras_serializable(package="dpledger")
class DPKerasModel(SavedDPModel, keras.Model):
    """A Keras model whose ``fit`` trains with DP-SGD (or DP-Adam, …), recording a ledger.

    Example::

        sampler = PoissonDatasetSampler(population_size=len(x), sampling_probability=256 / len(x),
                                 seed=0)
        dp_model = DPKerasModel(model, l2_norm_bound=1.0, noise_multiplier=1.1,
                                sampler=sampler, ledger=PrivacyLedger("run.ledger"), seed=1)
        dp_model.compile(optimizer=keras.optimizers.Adam(1e-3),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         metrics=["accuracy"])
        dp_model.fit(sampler.sample((x, y)), epochs=10)
        dp_model.ledger  # replay with any accountant

    Args:
        model: the built ``keras.Model`` to train (its weights are the ones trained).
        config: the step's :class:`~dpledger.mechanisms.DPConfig` (clip bound, noise, clipping,
            groups, clip split, noise allocation, scales, strategy, clip margin), instead of the
            keyword arguments of those fields; giving both (or ``queries``) is an
            :class:`~dpledger.errors.InvalidParameterError`. Its ``noise_multiplier`` is needed.
        l2_norm_bound: S* > 0, the bound on each example's gradient (split over groups).
        noise_multiplier: z ≥ 0 (the step's z_eff; 0 is recorded and means ε = ∞).
        sampler: the sampler that makes the training batches (a
            :class:`~dpledger.adapters.tensorflow.PoissonDatasetSampler`,
            ``FixedSizeDatasetSampler``, ``TruncatedPoissonDatasetSampler``,
            ``BallsInBinsDatasetSampler`` or ``ShuffleDatasetSampler``); each step records the event
            of its batch (:meth:`RecordedDatasetSampler.event_for_step` of the batch's position in
            its iteration over the sampler's dataset, so ``epoch_start`` marks the first batch of
            each iteration); or give ``sampling_probability`` and ``population_size`` of the Poisson
            pipeline you use.
        sampling_probability: q in (0, 1].
        population_size: n ≥ 1.
        ledger: the ledger to record into (default: a new in-memory ledger, add/remove unless
            the scheme is analysed under replace-one only). Its neighbouring relation must be
            one the sampler's scheme is analysed under (fixed-size and shuffled batches:
            ``neighboring="replace_one"``).
        generator: the noise ``tf.random.Generator``; or ``seed``.
        seed: seed of the noise generator (None: OS entropy); for tests and research only.
        clipping: ``"flat"`` (default), ``"global"``, ``"automatic"`` or a
            :class:`ClippingStrategy`.
        groups: ``"all"`` (one group, default), ``"per_layer"``, ``"per_parameter"`` (one group
            per variable) or ``{label: [variable paths]}`` (Keras 3 ``variable.path``).
        clip_split: ``"equal"`` (default) or ``"dimension"``: how S* is split over groups.
        noise_allocation: ``"proportional"`` (default) or ``"dimension"``.
        scales: joint scaled clipping, α per variable path.
        queries: explicit :class:`GaussianSumQuery` per group instead of the above.
        strategy: the per-example gradients: ``"auto"`` (default), ``"ghost"`` (the fast
            ghost-norm path only) or ``"generic"`` (vectorised per-example maps, any model).
        clip_margin: ρ in [0, 0.5) (default by dtype; see
            :func:`~dpledger.adapters.tensorflow.default_clip_margin`).
        bias_callback: ``callback(step, ClippingBias)`` after each step; NOT private.
        check_record_independence: before the first ``fit`` runs, take the first batch of
            the data set and run the record-independence probe on it
            (:mod:`~dpledger.adapters.tensorflow.record_probe`; nothing is recorded). False
            switches it off and logs a warning.
        name: the wrapper's name.
        noise: ``"independent"`` (DP-SGD, default) or a
            :class:`~dpledger.mechanisms.correlated.CorrelatedNoiseSpec`: one correlated-noise
            release over the spec's T steps, with σ = z·S, drawn from a
            :class:`~dpledger.adapters.tensorflow.CyclicDatasetSampler` given as ``sampler``
            (:mod:`~dpledger.adapters.tensorflow.correlated_model`; one group, no ``generator``).

    The fields of :class:`~dpledger.mechanisms.DPConfig` given as None take the defaults above,
    or the values of ``config``.

    Raises:
        InvalidParameterError: a bad argument (naming it), or a ledger whose neighbouring
            relation the sampler's scheme has no analysis under.
        RecordMixingLayerError: a BatchNormalization layer in training mode, or a stateful RNN.
        UnsupportedLayerError: a layer with a regulariser (use the optimizer's weight decay), or
            a recurrent layer with ``recurrent_dropout`` (use ``dropout=``).
    """

    def __init__(
        self,
        model: keras.Model,
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
        name: str | None = None,
        noise: Any = "independent",
    ) -> None:
        if not isinstance(model, keras.Model):
            raise InvalidParameterError("model", model, "a keras.Model")
        check_built(model)
        settings = settings_of_arguments(locals())
        check_probe_switch(check_record_independence)
        super().__init__(name=name or f"dp_{model.name}")
        refuse_regularizers(model)
        self._refuse_secure_noise(settings.config)
        # Built here so that bad clipping arguments fail now, not at the first fit.
        self._dp_queries = settings.queries_for(**variable_layout(model.trainable_variables))
        self._dp_sampler, self._dp_noise = sampler, noise
        checks = (generator, seed, bias_callback)  # the stream is gated: steps only in fit()
        self._dp_stream: CorrelatedDatasetStream | None = stream_of(
            noise, sampler, self._dp_queries, model, settings.config, *checks, gated=True
        )
        events = None
        if self._dp_stream is None:
            events = step_events_of(sampler, sampling_probability, population_size)
        # The engine refuses record-mixing layers now; it gets the loss at compile time.
        PerExampleGradientEngine(
            model, lambda y, p: tf.zeros(tf.shape(p)[:1]), strategy=settings.strategy
        )
        self.model = model
        self._dp_groups = settings.groups
        self._dp_events: StepEvents = events  # type: ignore[assignment]  # None: correlated
        self._dp_config = settings.config
        self._dp_ledger: PrivacyLedger | None = (
            ledger_with_intent(ledger, events, settings.config, settings.explicit)
            if self._dp_stream is None
            else ledger_for_release(ledger, self._dp_stream, settings.config)
        )
        self._dp_iterator: Any = None  # the iterator of the current epoch, and the next
        self._dp_position = 0  # step's position in it
        self._dp_generator = generator_of(generator, seed)
        note_keras_provenance(self, seeding_of(generator=generator, seed=seed))
        self._dp_strategy = settings.strategy
        self._dp_margin = settings.clip_margin
        self._dp_bias_callback = check_bias_callback(bias_callback)
        self._dp_loss: Any = None
        self._dp_step: KerasDPStep | None = None
        self._dp_probed = not check_record_independence
        self._dp_check_record_independence = check_record_independence
        self.built = True
        warn_on_direct_training(model, wrapper_name=self.name)

    # ------------------------------------------------------------------ Keras API
    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """The wrapped model's forward pass."""
        return self.model(inputs, training=training)

    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, **kwargs: Any) -> None:
        """``keras.Model.compile`` with a per-example loss (switched to ``reduction="none"``).

        Raises:
            PerExampleLossError: no loss, or a loss that cannot give per-example values.
        """
        if loss is None:
            raise PerExampleLossError(
                "DPKerasModel.compile needs a loss: DP training clips each example's gradient "
                "of it, e.g. loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)"
            )
        if isinstance(loss, (dict, list, tuple)):
            raise PerExampleLossError(
                f"loss={loss!r}: one loss per output is not supported; pass one callable "
                "loss(y_true, y_pred) returning the per-example total, shape (batch,)"
            )
        self._dp_loss = per_example_loss(loss)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        self._dp_step = None
        self.train_function = None

    def fit(self, x: Any = None, y: Any = None, batch_size: Any = None, **kwargs: Any) -> Any:
        """``keras.Model.fit`` on batches that the data pipeline has already sampled.

        ``x`` yields the batches (a ``tf.data.Dataset`` such as a sampler's
        :meth:`~dpledger.adapters.tensorflow.RecordedDatasetSampler.sample`, a
        ``keras.utils.PyDataset`` or an iterator). Arrays or tensors are accepted when the model
        records record-level Poisson sampling of their n = len(x) records: the batches are then
        drawn by a :class:`~dpledger.adapters.tensorflow.PoissonDatasetSampler` with the recorded q
        (the model's own sampler when it has one), round(1/q) per epoch, and the q is logged; a
        ``batch_size`` must then give that q as batch_size / len(x) (Poisson batches vary in size
        around it). Keras's own batches of arrays (shuffled, fixed-size) are never used: they are
        not the samples that the ledger records.

        ``shuffle`` defaults to False (Keras cannot shuffle a dataset's batches anyway).

        When the model was given its ``sampler``, ``x`` must be that sampler's
        :meth:`~dpledger.adapters.tensorflow.RecordedDatasetSampler.sample` dataset (optionally
        prefetched): every step is then one of its draws. A pipeline such as
        ``dataset.shuffle(n).batch(b)`` is refused; ``ShuffleDatasetSampler(population_size=n,
        batch_size=b).sample(...)`` draws the same kind of batches and records them as such.

        Raises:
            InvalidParameterError: ``x`` is arrays or tensors of another population or for a
                model whose sampling is not Poisson, ``batch_size`` / len(x) is not the recorded
                q, or ``batch_size`` is given with a dataset.
            SamplerMismatchError: the model has a sampler and ``x`` is not its draws.
            LedgerNotAttachedError: the model was loaded from a file and has no ledger yet
                (:meth:`attach_ledger`).
            NotCompiledError: the DPKerasModel was not compiled (the inner model may have been).
        """
        check_wrapper_compiled(self, self.model, "fit")
        self._attached_ledger()
        if self._dp_stream is not None:
            x, y = correlated_batches(x, y, batch_size, kwargs, stream=self._dp_stream), None
        else:
            if not isinstance(x, BATCH_SOURCES):
                x = poisson_batches(
                    x, y, batch_size, kwargs, events=self._dp_events, sampler=self._dp_sampler
                )
                y, batch_size = None, None
            check_sampled_batches(x, batch_size, events=self._dp_events, sampler=self._dp_sampler)
        kwargs.setdefault("shuffle", False)  # the batches are already sampled
        if not self._dp_probed and self._dp_loss is not None:
            self._probe_first_batch(x)
        try:
            with fit_window(self._dp_stream):
                return super().fit(x, y, **kwargs)
        finally:
            self._dp_iterator = None

    def _probe_first_batch(self, x: Any) -> None:
        if isinstance(x, tf.data.Dataset):
            # Peeking draws a batch: the sampler's generator is restored afterwards, so that the
            # probe leaves the batches of training exactly as they would have been.
            preserved = getattr(self._dp_sampler, "preserved_state", contextlib.nullcontext)
            with preserved():
                first = next(iter(x.take(1)), None)
        elif isinstance(x, keras.utils.PyDataset):
            first = x[0] if len(x) else None  # type: ignore[arg-type]
        else:
            _log.warning(
                "the record-independence probe needs to look at the first batch, which an "
                "iterator cannot show without consuming it: pass a tf.data.Dataset or a "
                "PyDataset, or check with PrivateGradients.probe on a batch"
            )
            self._dp_probed = True
            return
        if first is None:
            return
        inputs, targets, weights = keras.utils.unpack_x_y_sample_weight(first)
        engine = PerExampleGradientEngine(self.model, self._dp_loss, strategy=self._dp_strategy)
        if probe_record_independence(
            self.model, engine=engine, inputs=inputs, targets=targets, sample_weight=weights
        ):
            self._dp_probed = True

    def update_queries(self, **query_arguments: Any) -> GradientQueries:
        """Change the privacy parameters from the next executed step on (no retracing).

        Takes the arguments of :func:`~dpledger.adapters.tensorflow.dp_step.gradient_queries`
        (``l2_norm_bound``, ``noise_multiplier``, ``clipping``, ``clip_split``,
        ``noise_allocation``, ``scales`` or ``queries``) with the groups fixed at construction;
        the ledger records the new (S_g, σ̃_g) of every later step (e.g. a noise schedule), and
        :attr:`dp_config` (which a saved model stores) follows them.

        Raises:
            InvalidParameterError: for a bad argument, or ``groups`` (fixed).
        """
        refuse_query_changes(self._dp_stream, self._dp_noise)
        if "groups" in query_arguments:
            raise InvalidParameterError(
                "groups", query_arguments["groups"], "unchanged: groups are fixed"
            )
        queries = gradient_queries(
            self.model.trainable_variables, groups=self._dp_groups, **query_arguments
        )
        if self._dp_step is not None:
            self._dp_step.set_queries(queries)
        self._dp_queries = queries
        if self._dp_config is not None and set(query_arguments) <= _QUERY_FIELDS:
            self._dp_config = attrs.evolve(self._dp_config, **query_arguments)
        else:  # explicit queries: no DPConfig describes them
            self._dp_config = None
        return queries

    @property
    def ledger(self) -> PrivacyLedger:
        """The ledger the training steps are recorded in.

        Raises:
            LedgerNotAttachedError: the model was loaded from a file and has not been given its
                ledger (:meth:`attach_ledger`).
        """
        return self._attached_ledger()

    @property
    def dp_config(self) -> DPConfig | None:
        """The step's :class:`~dpledger.mechanisms.DPConfig` (with the changes of
        :meth:`update_queries`); None when the model was given explicit ``queries``."""
        return self._dp_config

    def _attached_ledger(self) -> PrivacyLedger:
        if self._dp_ledger is None:
            raise LedgerNotAttachedError(
                f"DPKerasModel {self.name!r} was loaded from a file, which does not hold its "
                "ledger (a file you own): nothing is recorded, and it does not train, until "
                "you give it one with model.attach_ledger(ledger). To continue the saved run's "
                "account, reopen its file: attach_ledger(PrivacyLedger(path, resume=True)); a "
                "new ledger starts a new account that does not hold the steps taken before "
                "the save"
            )
        return self._dp_ledger

    @property
    def queries(self) -> GradientQueries:
        """The sum queries of every step and the variables each covers."""
        return self._dp_queries

    @property
    def sampling_event(self) -> SamplingEvent:
        """The sampling event recorded with every step (``epoch_start`` aside); correlated
        noise records none (:class:`~dpledger.errors.InvalidParameterError`)."""
        if self._dp_stream is not None:
            raise no_sampling_event(self._dp_stream)
        return self._dp_events.event

    @property
    def sampling_probability(self) -> float:
        """q of every step; with correlated noise the release's (q within a group, or 1.0)."""
        stream = self._dp_stream
        return (self._dp_events.event if stream is None else stream.event).sampling_probability

    @property
    def population_size(self) -> int:
        """n of every step; with correlated noise the cyclic sampler's."""
        stream = self._dp_stream
        n = (self._dp_events.event if stream is None else stream.sampler).population_size
        assert n is not None
        return int(n)

    @property
    def dp_step(self) -> KerasDPStep | None:
        """The compiled DP step (after the first ``fit`` / ``train_on_batch``), or None."""
        return self._dp_step

    def _make_dp_step(self) -> KerasDPStep:
        ledger = self._attached_ledger()
        if self._dp_loss is None:
            raise PerExampleLossError("compile the DPKerasModel with a loss before fit")
        engine = PerExampleGradientEngine(self.model, self._dp_loss, strategy=self._dp_strategy)
        variables = engine.trainable_variables
        expected = [id(v) for v in variables]
        queries = self._dp_queries
        if len(queries.group_of) != len(expected):
            raise InvalidParameterError(
                "model",
                self.model.name,
                "the same trainable variables as when the DPKerasModel was created",
            )
        if self._dp_stream is not None:
            return CorrelatedDPStep(
                engine, queries, stream=self._dp_stream, ledger=ledger, clip_margin=self._dp_margin
            )
        return KerasDPStep(
            engine,
            queries=queries,
            events=self._dp_events,
            ledger=ledger,
            generator=self._dp_generator,
            clip_margin=self._dp_margin,
            bias_callback=self._dp_bias_callback,
        )

    def make_train_function(self, force: bool = False) -> Callable[[Any], Any]:
        """The function ``fit`` calls per execution: up to ``steps_per_execution`` DP steps.

        Each step is one call of a compiled ``tf.function`` (retraced only for new batch
        signatures); the ledger is written when it executes.
        """
        if self.train_function is not None and not force:
            return self.train_function
        step = self._make_dp_step()
        self._dp_step = step
        train_function = dp_train_function(self, step, self._position_of)
        self.train_function = train_function
        return train_function

    def _position_of(self, iterator: Any) -> tf.Tensor:
        """The position of the next step in its epoch: each iteration over a sampler's dataset
        draws a new epoch, so a new iterator starts at 0 (Keras makes one per epoch, or keeps
        one across epochs with ``steps_per_epoch``)."""
        if iterator is not self._dp_iterator:
            self._dp_iterator, self._dp_position = iterator, 0
        position = self._dp_position
        self._dp_position += 1
        return tf.constant(position, tf.int64)


def make_private(model: keras.Model, **privacy: Any) -> DPKerasModel:
    """Wrap ``model`` for DP training: ``DPKerasModel(model, **privacy)``; compile and fit it."""
    return DPKerasModel(model, **privacy)
