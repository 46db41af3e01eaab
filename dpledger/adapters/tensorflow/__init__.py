"""TensorFlow / Keras 3 adapter: per-example gradients, fast clipping and Poisson sampling.

Importing this package imports TensorFlow and Keras; ``import dpledger`` and
``import dpledger.adapters`` do not.
"""

from dpledger.adapters.tensorflow.engine import (
    ClippedGradients,
    PerExampleGradientEngine,
    PerExampleNorms,
)
from dpledger.adapters.tensorflow.errors import (
    PerExampleLossError,
    RecordMixingLayerError,
    UnsupportedLayerError,
)
from dpledger.adapters.tensorflow.layer_rules import (
    Conv2DRule,
    DenseRule,
    EinsumDenseRule,
    EmbeddingRule,
    LayerNormalizationRule,
)
from dpledger.adapters.tensorflow.losses import PerExampleLoss, per_example_loss
from dpledger.adapters.tensorflow.registry import (
    LayerCall,
    LayerGradientRule,
    layer_rule,
    register_layer_rule,
    registered_layer_types,
    unregister_layer_rule,
)
from dpledger.adapters.tensorflow.sampling import PoissonSampler

__all__ = [
    "ClippedGradients",
    "Conv2DRule",
    "DenseRule",
    "EinsumDenseRule",
    "EmbeddingRule",
    "LayerCall",
    "LayerGradientRule",
    "LayerNormalizationRule",
    "PerExampleGradientEngine",
    "PerExampleLoss",
    "PerExampleLossError",
    "PerExampleNorms",
    "PoissonSampler",
    "RecordMixingLayerError",
    "UnsupportedLayerError",
    "layer_rule",
    "per_example_loss",
    "register_layer_rule",
    "registered_layer_types",
    "unregister_layer_rule",
]
