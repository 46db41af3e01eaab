"""The checks of the Keras adapters' constructors: the bias callback, the noise generator and
the ledger (:class:`~dpledger.adapters.tensorflow.DPKerasModel` and
:class:`~dpledger.adapters.tensorflow.PrivateGradients`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from dpledger.adapters.tensorflow.backend import make_generator
from dpledger.adapters.tensorflow.step_events import StepEvents, check_relation
from dpledger.diagnostics.bias import ClippingBiasCallback
from dpledger.errors import InvalidParameterError
from dpledger.ledger import NeighboringRelation, PrivacyLedger
from dpledger.sampling.relations import default_relation

__all__ = ["check_bias_callback", "generator_of", "ledger_of"]


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
