"""The checks of the Keras adapters' constructors
(:class:`~dpledger.adapters.tensorflow.DPKerasModel` and
:class:`~dpledger.adapters.tensorflow.PrivateGradients`) that need TensorFlow: the noise
generator and the ledger with the run's intent (its framework and version). The framework-free
checks are :mod:`dpledger.mechanisms.construction_checks`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from dpledger.adapters.tensorflow.backend import make_generator
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger, SamplingScheme
from dpledger.ledger.intent import INTENT_KEY, note_intent, run_intent
from dpledger.mechanisms import DPConfig
from dpledger.mechanisms.construction_checks import step_ledger
from dpledger.mechanisms.step import StepEvents
from dpledger.sampling.relations import default_relation
from dpledger.validation import warn_if_delta_too_large

__all__ = ["generator_of", "ledger_with_intent"]


def generator_of(generator: Any, seed: int | None) -> tf.random.Generator:
    """The noise generator: the one given, or a Philox generator from ``seed``."""
    if generator is not None:
        if seed is not None:
            raise InvalidParameterError("seed", seed, "None when a generator is given")
        if not isinstance(generator, tf.random.Generator):
            raise InvalidParameterError("generator", generator, "a tf.random.Generator")
        return generator
    return make_generator(seed)


def ledger_with_intent(
    ledger: PrivacyLedger | None,
    events: StepEvents,
    config: DPConfig | None,
    explicit: dict[str, Any] | None,
) -> PrivacyLedger:
    """The run's ledger: a new one holds the run's intent in its metadata; a given one is
    checked, and the intent it lacks is logged. Warns when the config's δ ≥ 1/n."""
    event = events.event
    n = event.population_size
    delta = None if config is None else config.delta
    if delta is not None:
        warn_if_delta_too_large(delta=delta, population_size=n, stacklevel=3)
    z = config.noise_multiplier if config is not None else (explicit or {}).get("noise_multiplier")
    intent = run_intent(
        framework="tensorflow",
        framework_version=tf.__version__,
        population_size=n,
        unit=event.unit.value,
        noise_multiplier=None if z is None else float(z),
        delta=delta,
        sampling=event.scheme.value,
        sampling_probability=(
            event.sampling_probability if event.scheme is SamplingScheme.POISSON else None
        ),
    )
    if ledger is None:
        relation = default_relation(event)
        return PrivacyLedger(neighboring=relation, metadata={INTENT_KEY: intent})
    checked = step_ledger(ledger, event)
    assert checked is not None  # rank 0 with a ledger given
    note_intent(checked, intent)
    return checked
