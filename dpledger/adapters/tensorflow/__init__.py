"""TensorFlow / Keras 3 adapter: DP training with ``model.fit``, privatised gradients for custom
loops, per-example gradients, fast clipping (recurrent layers included), ``tf.data`` samplers of
every scheme (Poisson, fixed size, truncated Poisson, balls-in-bins, shuffle) and a TensorFlow
array backend.

Importing this package imports TensorFlow and Keras; ``import dpledger`` and
``import dpledger.adapters`` do not.
"""

import keras  # noqa: F401  (a missing TensorFlow or Keras fails here, by name)
import tensorflow  # noqa: F401

from dpledger.adapters.tensorflow import recurrent_rules as _recurrent_rules  # noqa: F401 (registers)
from dpledger.adapters.tensorflow.cyclic_sampler import CyclicDatasetSampler
from dpledger.adapters.tensorflow.engine import PerExampleGradientEngine
from dpledger.adapters.tensorflow.keras_model import DPKerasModel, make_private
from dpledger.adapters.tensorflow.losses import per_example_loss
from dpledger.adapters.tensorflow.private_gradients import PrivateGradients
from dpledger.adapters.tensorflow.registry import LayerRule, register_layer_rule
from dpledger.adapters.tensorflow.sampling import (
    BallsInBinsDatasetSampler,
    FixedSizeDatasetSampler,
    PoissonDatasetSampler,
    ShuffleDatasetSampler,
    TruncatedPoissonDatasetSampler,
)

__all__ = [
    "BallsInBinsDatasetSampler",
    "CyclicDatasetSampler",
    "DPKerasModel",
    "FixedSizeDatasetSampler",
    "LayerRule",
    "PerExampleGradientEngine",
    "PoissonDatasetSampler",
    "PrivateGradients",
    "ShuffleDatasetSampler",
    "TruncatedPoissonDatasetSampler",
    "make_private",
    "per_example_loss",
    "register_layer_rule",
]
