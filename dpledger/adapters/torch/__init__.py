"""PyTorch adapter: per-example gradients, Poisson sampling and record-mixing checks.

Importing this package imports torch; ``import dpledger`` and ``import dpledger.adapters`` do not.

* :class:`PerExampleGradientEngine`: per-example squared gradient norms and clipped sums
  Σ_i f_i g_i from an ordinary forward and ``loss.backward()``, by ghost norms and book-keeping
  where a layer allows (nn.Linear, nn.Conv1d/2d, nn.Embedding, normalisation layers) and
  ``torch.func`` elsewhere.
* :func:`per_example_gradients` and :class:`FunctionalPerExampleEngine`: the generic path for any
  differentiable model, from a per-example loss function.
* :func:`register_grad_sampler`: teach the engine a new layer type.
* :class:`PoissonBatchSampler` and :func:`poisson_data_loader`: Poisson sampling with rate q.
"""

from dpledger.adapters.torch import samplers
from dpledger.adapters.torch.engine import LossReduction, PerExampleGradientEngine, Strategy
from dpledger.adapters.torch.errors import (
    EngineStateError,
    RecordMixingModuleError,
    UnsupportedModuleError,
    UnsupportedParameterUseError,
)
from dpledger.adapters.torch.factors import expand_factors
from dpledger.adapters.torch.functional_gradients import (
    FunctionalPerExampleEngine,
    clipped_sum_of,
    module_per_example_gradients,
    per_example_gradients,
    squared_norms_of,
)
from dpledger.adapters.torch.module_checks import (
    check_module_configuration,
    check_no_record_mixing,
)
from dpledger.adapters.torch.poisson import (
    EmptyBatchCollate,
    PoissonBatchSampler,
    poisson_data_loader,
)
from dpledger.adapters.torch.registry import (
    GradSampler,
    get_grad_sampler,
    register_grad_sampler,
    registered_module_types,
    unregister_grad_sampler,
)

__all__ = [
    "EmptyBatchCollate",
    "EngineStateError",
    "FunctionalPerExampleEngine",
    "GradSampler",
    "LossReduction",
    "PerExampleGradientEngine",
    "PoissonBatchSampler",
    "RecordMixingModuleError",
    "Strategy",
    "UnsupportedModuleError",
    "UnsupportedParameterUseError",
    "check_module_configuration",
    "check_no_record_mixing",
    "clipped_sum_of",
    "expand_factors",
    "get_grad_sampler",
    "module_per_example_gradients",
    "per_example_gradients",
    "poisson_data_loader",
    "register_grad_sampler",
    "registered_module_types",
    "samplers",
    "squared_norms_of",
    "unregister_grad_sampler",
]
