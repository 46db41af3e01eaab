"""Deprecated: the per-layer gradient rules are in :mod:`dpledger.adapters.torch.layer_rules`.

This module is the former name of that package, kept for one release. Importing it warns; its
submodules (``dpledger.adapters.torch.samplers.linear``, …) are the ``layer_rules`` ones.
"""

import sys
import warnings

from dpledger.adapters.torch import layer_rules
from dpledger.adapters.torch.layer_rules import (
    conv,
    embedding,
    hugging_face,
    linear,
    normalization,
    recurrent,
)

__all__ = ["conv", "embedding", "hugging_face", "linear", "normalization", "recurrent"]

warnings.warn(
    "dpledger.adapters.torch.samplers was renamed dpledger.adapters.torch.layer_rules "
    "(per-layer gradient rules; the batch samplers are in dpledger.adapters.torch)",
    DeprecationWarning,
    stacklevel=2,
)

for _name in __all__:
    sys.modules[f"{__name__}.{_name}"] = getattr(layer_rules, _name)
