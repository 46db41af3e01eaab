"""Built-in per-layer gradient rules (layer rules), registered on import.

nn.Linear, nn.Conv1d, nn.Conv2d and nn.Embedding have the fast path (ghost norms and
book-keeping clipped sums) and can also materialise per-example gradients; the normalisation
layers (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, and nn.BatchNorm1d/2d/3d frozen in evaluation
mode) materialise their small per-example affine gradients; nn.RNN, nn.GRU and nn.LSTM recompute
their forward to get the gradients of their gate pre-activations and then use the linear maths;
nn.MultiheadAttention recomputes its projections and attention core alike (:mod:`.attention`).
Hugging Face's GPT-2 ``Conv1D`` and Llama-style RMSNorm layers are recognised by name
(:mod:`.hugging_face`).
"""

import torch  # noqa: F401  (every rule works on torch modules and tensors)

from dpledger.adapters.torch import sharding  # noqa: F401 (FSDP2 classes' rules)
from dpledger.adapters.torch.layer_rules import (  # noqa: F401 (each module registers its rules)
    attention,
    conv,
    embedding,
    hugging_face,
    linear,
    normalization,
    recurrent,
)

__all__: list[str] = []
