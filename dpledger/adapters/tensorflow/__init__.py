"""TensorFlow / Keras 3 adapter: DP training with ``model.fit``, privatised gradients for custom
loops, per-example gradients, fast clipping (recurrent layers included), ``tf.data`` samplers of
every scheme (Poisson, fixed size, truncated Poisson, balls-in-bins, shuffle) and a TensorFlow
array backend.

Importing this package imports TensorFlow and Keras; ``import dpledger`` and
``import dpledger.adapters`` do not.
"""

import keras  # noqa: F401  (a missing TensorFlow or Keras fails here, by name)
import tensorflow  # noqa: F401

from dpledger.adapters.tensorflow.backend import TensorFlowBackend, make_generator
from dpledger.adapters.tensorflow.dp_step import default_clip_margin, gradient_queries
from dpledger.adapters.tensorflow.engine import (
    ClippedGradients,
    PerExampleGradientEngine,
    PerExampleNorms,
)
from dpledger.adapters.tensorflow.keras_model import DPKerasModel, make_private
from dpledger.adapters.tensorflow.layer_rules import (
    Conv2DRule,
    DenseRule,
    EinsumDenseRule,
    EmbeddingRule,
    LayerNormalizationRule,
)
from dpledger.adapters.tensorflow.losses import PerExampleLoss, per_example_loss
from dpledger.adapters.tensorflow.private_gradients import PrivateGradients
from dpledger.adapters.tensorflow.recurrent_rules import GRURule, LSTMRule, SimpleRNNRule
from dpledger.adapters.tensorflow.registry import (
    LayerCall,
    LayerRule,
    layer_rule,
    register_layer_rule,
    registered_layer_types,
    unregister_layer_rule,
)
from dpledger.adapters.tensorflow.sampler_base import RecordedDatasetSampler
from dpledger.adapters.tensorflow.sampling import (
    BallsInBinsDatasetSampler,
    FixedSizeDatasetSampler,
    PoissonDatasetSampler,
    ShuffleDatasetSampler,
    TruncatedPoissonDatasetSampler,
)
from dpledger.errors import (
    LedgerNotAttachedError,
    NoiseStreamEndError,
    NotCompiledError,
    PerExampleLossError,
    RecordMixingLayerError,
    RecordProbeError,
    UnrecordedTrainingWarning,
    UnsupportedLayerError,
)
from dpledger.ledger.correlated import NoiseSeedReuseError, NoiseStreamRollbackError

__all__ = [
    "BallsInBinsDatasetSampler",
    "ClippedGradients",
    "Conv2DRule",
    "CyclicDatasetSampler",
    "DPKerasModel",
    "DenseRule",
    "EinsumDenseRule",
    "EmbeddingRule",
    "FixedSizeDatasetSampler",
    "GRURule",
    "LSTMRule",
    "LayerCall",
    "LayerNormalizationRule",
    "LayerRule",
    "LedgerNotAttachedError",
    "NoiseSeedReuseError",
    "NoiseStreamEndError",
    "NoiseStreamRollbackError",
    "NotCompiledError",
    "PerExampleGradientEngine",
    "PerExampleLoss",
    "PerExampleLossError",
    "PerExampleNorms",
    "PoissonDatasetSampler",
    "PrivateGradients",
    "RecordMixingLayerError",
    "RecordProbeError",
    "RecordedDatasetSampler",
    "ShuffleDatasetSampler",
    "SimpleRNNRule",
    "TensorFlowBackend",
    "TruncatedPoissonDatasetSampler",
    "UnrecordedTrainingWarning",
    "UnsupportedLayerError",
    "default_clip_margin",
    "gradient_queries",
    "layer_rule",
    "make_generator",
    "make_private",
    "per_example_loss",
    "register_layer_rule",
    "registered_layer_types",
    "unregister_layer_rule",
]
