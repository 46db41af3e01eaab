"""Built-in grad samplers, registered on import.

nn.Linear, nn.Conv1d, nn.Conv2d and nn.Embedding have the fast path (ghost norms and
book-keeping clipped sums) and can also materialise per-example gradients; the normalisation
layers (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, and nn.BatchNorm1d/2d/3d frozen in evaluation
mode) materialise their small per-example affine gradients.
"""

from dpledger.adapters.torch.samplers import conv, embedding, linear, normalization

__all__ = ["conv", "embedding", "linear", "normalization"]
