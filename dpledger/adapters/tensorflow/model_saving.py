"""What a saved :class:`~dpledger.adapters.tensorflow.DPKerasModel` keeps of its DP set-up, as
JSON for Keras's ``get_config`` / ``from_config``.

Saved: the step's :class:`~dpledger.mechanisms.DPConfig` (clip bound, noise multiplier, δ,
clipping strategy, groups, clip split, noise allocation, scales, strategy, clip margin) and the
sampling event every step records (its scheme, q, n and the scheme's parameters). Not saved: the
ledger (a file the user owns: a loaded model records nothing until it is given one, see
:meth:`~dpledger.adapters.tensorflow.DPKerasModel.attach_ledger`), the sampler and its generator
state, and the noise generator (a loaded model draws fresh noise).

A model trained with a correlated-noise release (``noise=spec``) saves instead of the sampling
event the spec, its :class:`~dpledger.adapters.tensorflow.CyclicDatasetSampler`'s parameters and the
noise stream's state (generator, step, float64 buffers, whether the release is recorded;
:func:`~dpledger.adapters.tensorflow.correlated_model.correlated_to_json`): once given the
ledger that holds its release, the loaded model continues the stream where it was saved and
never records the release again.

The sampling event is restored as a :class:`RecordedSampling`, which gives the loaded model the
events of its steps (``epoch_start`` on the first step of an epoch for the epoch-based schemes)
until the sampler that really draws the batches is attached.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import attrs
import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.construction_checks import generator_of, ledger_with_intent
from dpledger.adapters.tensorflow.correlated_model import (
    attach_release,
    correlated_from_json,
    correlated_to_json,
    ledger_for_release,
)
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger, SamplingEvent, SamplingScheme
from dpledger.ledger.provenance import NoiseProvenance, note_noise_provenance, seeding_of
from dpledger.mechanisms import DPConfig
from dpledger.mechanisms.clipping import (
    AutomaticClipping,
    ClippingStrategy,
    FlatClipping,
    GlobalClipping,
)
from dpledger.mechanisms.step import StepEvents, step_events_of
from dpledger.sampling.schemes import BallsInBinsScheme, BatchScheme, ShuffleScheme

__all__ = [
    "RecordedSampling",
    "SavedDPModel",
    "config_from_json",
    "config_to_json",
    "event_from_json",
    "event_to_json",
    "note_keras_provenance",
]

_log = logging.getLogger("dpledger.adapters.tensorflow.keras_model")

_CLIPPINGS: dict[str, type[ClippingStrategy]] = {
    cls.name: cls for cls in (FlatClipping, GlobalClipping, AutomaticClipping)
}


def config_to_json(config: DPConfig) -> dict[str, Any]:
    """``config`` as JSON values (the fields a Keras adapter uses).

    Raises:
        InvalidParameterError: a clipping strategy other than flat, global or automatic (its
            class cannot be restored by name).
    """
    clipping = config.clipping
    if type(clipping) not in _CLIPPINGS.values():
        raise InvalidParameterError(
            "clipping",
            clipping,
            "flat, global or automatic clipping for a DPKerasModel that is saved (a custom "
            "ClippingStrategy cannot be restored from the saved file)",
        )
    groups = config.groups
    return {
        "l2_norm_bound": config.l2_norm_bound,
        "noise_multiplier": config.noise_multiplier,
        "delta": config.delta,
        "clipping": {"name": clipping.name, **attrs.asdict(clipping)},
        "groups": groups if isinstance(groups, str) else {k: list(v) for k, v in groups.items()},
        "clip_split": config.clip_split,
        "noise_allocation": config.noise_allocation,
        "scales": None if config.scales is None else dict(config.scales),
        "strategy": config.strategy,
        "clip_margin": config.clip_margin,
    }


def config_from_json(values: dict[str, Any]) -> DPConfig:
    """The :class:`~dpledger.mechanisms.DPConfig` that :func:`config_to_json` saved.

    Raises:
        InvalidParameterError: a field that is not valid (naming it).
    """
    fields = dict(values)
    clipping = dict(fields.pop("clipping"))
    name = clipping.pop("name")
    if name not in _CLIPPINGS:
        raise InvalidParameterError("clipping", name, f"one of {sorted(_CLIPPINGS)}")
    return DPConfig(clipping=_CLIPPINGS[name](**clipping), **fields)


def event_to_json(event: SamplingEvent) -> dict[str, Any]:
    """The sampling event as JSON values (its attrs fields; enums by value)."""
    return {
        key: value.value if isinstance(value, enum.Enum) else value
        for key, value in attrs.asdict(event, recurse=False).items()
    }


def event_from_json(values: dict[str, Any]) -> SamplingEvent:
    """The :class:`~dpledger.ledger.SamplingEvent` that :func:`event_to_json` saved (validated
    by the event's own converters).

    Raises:
        InvalidParameterError: a field that is not valid.
    """
    return SamplingEvent(**values)


def _epoch_scheme(event: SamplingEvent) -> BatchScheme | None:
    n = event.population_size
    assert n is not None
    if event.scheme is SamplingScheme.BALLS_IN_BINS:
        assert event.num_batches is not None
        return BallsInBinsScheme(population_size=n, num_batches=event.num_batches)
    if event.scheme is SamplingScheme.SHUFFLE:
        assert event.batch_size is not None
        return ShuffleScheme(population_size=n, batch_size=event.batch_size)
    return None


class RecordedSampling:
    """The sampling a saved model recorded, standing in for its sampler after loading.

    It has what the step needs of a sampler (the event, and for the epoch-based schemes the
    event of each position in an epoch) and no ``drew``: the data cannot be checked against
    it, which is why a loaded model of a scheme other than record-level Poisson must be given
    the real sampler again (:meth:`~dpledger.adapters.tensorflow.DPKerasModel.attach_ledger`).

    Args:
        event: the saved event (``epoch_start=False``).
    """

    def __init__(self, event: SamplingEvent) -> None:
        self.sampling_event = attrs.evolve(event, epoch_start=False)
        self._scheme = _epoch_scheme(self.sampling_event)
        self.epoch_based = self._scheme is not None
        self.steps_per_epoch = None if self._scheme is None else self._scheme.steps_per_epoch

    def event_for_step(self, step: int) -> SamplingEvent:
        """The event of the step at position ``step`` of an epoch."""
        if self._scheme is None:
            return self.sampling_event
        return self._scheme.event_for_step(step)

    def __repr__(self) -> str:
        return f"RecordedSampling({self.sampling_event.describe()})"


class SavedDPModel:
    """The saving part of :class:`~dpledger.adapters.tensorflow.DPKerasModel` (which inherits
    it): :meth:`get_config`, :meth:`from_config` and :meth:`attach_ledger`."""

    # set by DPKerasModel.__init__
    name: str
    model: keras.Model
    train_function: Any
    _dp_config: DPConfig | None
    _dp_events: StepEvents
    _dp_ledger: PrivacyLedger | None
    _dp_sampler: Any
    _dp_generator: tf.random.Generator
    _dp_step: Any
    _dp_check_record_independence: bool
    _dp_stream: Any
    _dp_noise: Any

    @staticmethod
    def _refuse_secure_noise(config: Any) -> None:
        """Refuse ``DPConfig(secure_noise=True)``: the Keras adapter does not draw secure
        noise yet (InvalidParameterError)."""
        if config is not None and config.secure_noise:
            raise InvalidParameterError(
                "config.secure_noise",
                True,
                "False: the Keras adapter does not draw secure noise yet (the PyTorch adapter "
                "and the NumPy mechanisms do)",
            )

    def get_compile_config(self) -> dict[str, Any]:
        """Keras's record of :meth:`compile`'s arguments (the optimizer, the loss as given,
        the metrics), saved with the model."""
        return super().get_compile_config()  # type: ignore[misc]

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Compile a loaded model as it was compiled, through its own ``compile`` (so that the
        loss is per-example again), and build the optimizer so its saved state can load."""
        self.compile(**keras.saving.deserialize_keras_object(config))  # type: ignore[attr-defined]
        if getattr(self, "built", False):
            self.optimizer.build(self.trainable_variables)  # type: ignore[attr-defined]

    def get_config(self) -> dict[str, Any]:
        """The configuration ``model.save`` stores: the wrapped model, the step's
        :class:`~dpledger.mechanisms.DPConfig` and the sampling event every step records (see
        :mod:`~dpledger.adapters.tensorflow.model_saving`). The ledger, the sampler and the
        noise generator are not stored: a loaded model trains only after
        :meth:`attach_ledger`.

        Raises:
            InvalidParameterError: the model was given explicit ``queries`` or a custom
                clipping strategy, which cannot be restored from a file.
        """
        if self._dp_config is None:
            raise InvalidParameterError(
                "queries",
                "<explicit queries>",
                "a DPKerasModel built from DPConfig fields (config= or l2_norm_bound=, "
                "noise_multiplier=, ...) to be saved: explicit queries cannot be restored",
            )
        stream = self._dp_stream
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.model),
            "dp_config": config_to_json(self._dp_config),
            "sampling_event": None if stream else event_to_json(self._dp_events.event),
            "check_record_independence": self._dp_check_record_independence,
            **({"correlated": correlated_to_json(self._dp_noise, stream)} if stream else {}),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        """The model :meth:`get_config` described, without a ledger (see :meth:`attach_ledger`).

        Called by ``keras.models.load_model``; the weights (and the compiled loss, metrics
        and optimizer) are then restored by Keras.
        """
        model = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        if "correlated" in config:  # a correlated-noise release: its stream continues
            spec, sampler, state = correlated_from_json(config["correlated"])
            restored = cls(
                model,
                config=config_from_json(config["dp_config"]),
                sampler=sampler,
                noise=spec,
                seed=state["seed"],
                check_record_independence=config["check_record_independence"],
                name=config["name"],
            )
            restored._dp_stream.load_state(state)
        else:
            event = event_from_json(config["sampling_event"])
            restored = cls(
                model,
                config=config_from_json(config["dp_config"]),
                sampler=RecordedSampling(event),
                check_record_independence=config["check_record_independence"],
                name=config["name"],
            )
            restored._dp_sampler = None
        restored._dp_ledger = None  # the ledger is the user's file: attach_ledger gives it back
        _log.warning(
            "DPKerasModel %r was loaded without a ledger: it records nothing and does not "
            "train until attach_ledger(ledger) is called (PrivacyLedger(path, resume=True) "
            "continues the saved run's ledger file)",
            restored.name,
        )
        return restored

    def attach_ledger(
        self,
        ledger: PrivacyLedger,
        *,
        sampler: Any = None,
        generator: tf.random.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        """Give a model loaded with ``keras.models.load_model`` the ledger its steps go to.

        The saved file holds no ledger: to continue the saved run's account, reopen its file
        with ``PrivacyLedger(path, resume=True)``; a new ledger starts a new account that does
        not hold the steps taken before the save (its ε is not the run's).

        Args:
            ledger: the ledger to record into; its neighbouring relation must be one the saved
                sampling scheme is analysed under. With a correlated-noise release already
                recorded, the ledger that holds it (``PrivacyLedger(path, resume=True)``).
            sampler: the sampler that draws the batches from now on; its sampling event must
                be the saved one. Needed unless the saved sampling is record-level Poisson.
                With correlated noise: None (the saved CyclicDatasetSampler) or one drawing the same
                batches; the stream continues at its saved step (the end of a pass).
            generator: the noise ``tf.random.Generator``; or ``seed`` (None: OS entropy). The
                saved model's noise generator is not restored.
            seed: seed of the noise generator (None with correlated noise, whose saved
                stream continues).

        Raises:
            InvalidParameterError: the model already has its ledger, ``ledger`` is not a
                :class:`~dpledger.ledger.PrivacyLedger` or has a relation the scheme is not
                analysed under, or ``sampler`` is missing or records another event.
            NoiseStreamRollbackError: with correlated noise, the ledger records more steps of
                the release than the saved stream took (training went on past this save:
                continuing would reuse their noise); load the latest save, or start a new
                release.
            LedgerStateError: with correlated noise, the ledger records fewer steps of the
                release than the saved stream took (it is not the run's ledger).
        """
        if self._dp_ledger is not None:
            raise InvalidParameterError(
                "ledger",
                ledger,
                "no other ledger: this model already records into its own (attach_ledger is "
                "for a model loaded from a file)",
            )
        if not isinstance(ledger, PrivacyLedger):
            raise InvalidParameterError("ledger", ledger, "a dpledger.PrivacyLedger")
        if self._dp_stream is not None:
            if generator is not None or seed is not None:
                raise InvalidParameterError(
                    "seed", seed, "None: the saved correlated-noise stream continues"
                )
            self._dp_sampler = attach_release(self._dp_stream, ledger, sampler)
            self._dp_ledger = ledger_for_release(ledger, self._dp_stream, self._dp_config)
            self._dp_step, self.train_function = None, None
            note_keras_provenance(self)
            return
        saved = self._dp_events.event
        if sampler is None:
            if saved.scheme is not SamplingScheme.POISSON or saved.unit.value != "record":
                raise InvalidParameterError(
                    "sampler",
                    None,
                    f"the sampler that draws the batches, recording the saved {saved.describe()}",
                )
            events = StepEvents(saved)
        else:
            events = step_events_of(sampler, None, None)
            if events.event != saved:
                raise InvalidParameterError(
                    "sampler",
                    sampler,
                    f"a sampler recording the saved sampling {saved.describe()}, not "
                    f"{events.event.describe()}",
                )
        noise = generator_of(generator, seed)
        self._dp_ledger = ledger_with_intent(ledger, events, self._dp_config, None)
        self._dp_events, self._dp_sampler, self._dp_generator = events, sampler, noise
        note_keras_provenance(self, seeding_of(generator=generator, seed=seed))
        self._dp_step = None
        self.train_function = None


def note_keras_provenance(model: Any, seeding: str | None = None) -> None:
    """Record where a :class:`~dpledger.adapters.tensorflow.DPKerasModel`'s noise comes from
    in its ledger (:class:`~dpledger.ledger.provenance.NoiseProvenance`; nothing without one).

    A saved model carries no noise generator and no sampler state (see the module docstring),
    so its checkpoints exclude them; a correlated-noise model's save carries its stream's seed
    and state, so that the stream can continue, and says so.
    """
    if seeding is not None:  # a new noise generator: how it was seeded
        model._dp_noise_seeding = seeding
    ledger = getattr(model, "_dp_ledger", None)
    if ledger is None:
        return
    sampler = getattr(model, "_dp_sampler", None)
    sampler_seeding = getattr(sampler, "seeding", None)
    stream = getattr(model, "_dp_stream", None)
    if stream is not None:
        record = NoiseProvenance(
            entry_point="keras.DPKerasModel(correlated)",
            generator="numpy.random.Generator(PCG64)",
            seeding="os_entropy" if getattr(stream, "fresh_seed", False) else "caller_seed",
            sampler_seeding=sampler_seeding,
            state_location="the training process's memory and every model.save",
            checkpoint="included",
        )
    else:
        record = NoiseProvenance(
            entry_point="keras.DPKerasModel",
            generator="tf.random.Generator(philox)",
            seeding=getattr(model, "_dp_noise_seeding", "os_entropy"),
            sampler_seeding=sampler_seeding,
            state_location="the training process's memory (a tf.Variable)",
            checkpoint="excluded",
        )
    note_noise_provenance(ledger, record)
