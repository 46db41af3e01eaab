"""PyTorch adapter: per-example gradients, Poisson sampling and record-mixing checks.

Importing this package imports torch; ``import dpledger`` and ``import dpledger.adapters`` do not.

* :class:`PerExampleGradientEngine`: per-example squared gradient norms and clipped sums
  Σ_i f_i g_i from an ordinary forward and ``loss.backward()``, by ghost norms and book-keeping
  where a layer allows (nn.Linear, nn.Conv1d/2d, nn.Embedding, normalisation layers) and
  ``torch.func`` elsewhere.
* :func:`per_example_gradients` and :class:`FunctionalPerExampleEngine`: the generic path for any
  differentiable model, from a per-example loss function.
* :func:`register_layer_rule`: teach the engine a new layer type; the built-in per-layer
  rules are in :mod:`~dpledger.adapters.torch.layer_rules`.
* :class:`PoissonBatchSampler` and :func:`poisson_data_loader`: Poisson sampling with rate q;
  :class:`FixedSizeBatchSampler`, :class:`TruncatedPoissonBatchSampler`,
  :class:`BallsInBinsBatchSampler`, :class:`ShuffleBatchSampler` and
  :func:`private_data_loader`: the other sampling schemes, each recording its own event
  (:class:`RecordedBatchSampler` is their base).
* :class:`UserPoissonBatchSampler`: user-level DP, a Poisson sample of users with at most k
  records each; :class:`DPOptimizer` clips each user's summed (or mean) gradient as one.
* :class:`DPOptimizer`: DP steps with any ``torch.optim.Optimizer`` (clipping strategies, groups,
  noise on the parameters' device, the ledger's events, virtual batches, distributed training,
  checkpoints, BAM, bias metrics; override points :meth:`DPOptimizer.clip`,
  :meth:`DPOptimizer.add_noise` and :meth:`DPOptimizer.release`); :func:`make_private` builds
  model, optimizer and loader in one call, calibrating z for a target ε
  (:func:`~dpledger.accountants.calibrate_noise_multiplier`).
* :func:`probe_record_independence`: the dynamic check, run by :class:`DPOptimizer` before the
  first step, that no record moves another record's outputs or per-example gradient.
* :class:`TorchBackend`: the mechanisms' array backend on tensors.

Importing this package imports torch (the adapter cannot work without it); ``import dpledger``
does not.
"""

import torch  # noqa: F401  (a missing torch fails here, by name)

from dpledger.adapters.torch import layer_rules as _layer_rules  # noqa: F401 (registers)
from dpledger.adapters.torch.batch_samplers import (
    BallsInBinsBatchSampler,
    CyclicBatchSampler,
    FixedSizeBatchSampler,
    ShuffleBatchSampler,
    TruncatedPoissonBatchSampler,
    private_data_loader,
)
from dpledger.adapters.torch.distributed import DistributedPoissonBatchSampler
from dpledger.adapters.torch.engine import PerExampleGradientEngine
from dpledger.adapters.torch.functional_gradients import per_example_gradients
from dpledger.adapters.torch.optimizer import DPOptimizer
from dpledger.adapters.torch.poisson import PoissonBatchSampler, poisson_data_loader
from dpledger.adapters.torch.private import (
    PrivateTraining,
    make_private,
)
from dpledger.adapters.torch.record_probe import probe_record_independence
from dpledger.adapters.torch.registry import LayerRule, register_layer_rule
from dpledger.adapters.torch.user_level import UserPoissonBatchSampler

__all__ = [
    "BallsInBinsBatchSampler",
    "CyclicBatchSampler",
    "DPOptimizer",
    "DistributedPoissonBatchSampler",
    "FixedSizeBatchSampler",
    "LayerRule",
    "PerExampleGradientEngine",
    "PoissonBatchSampler",
    "PrivateTraining",
    "ShuffleBatchSampler",
    "TruncatedPoissonBatchSampler",
    "UserPoissonBatchSampler",
    "make_private",
    "per_example_gradients",
    "poisson_data_loader",
    "private_data_loader",
    "probe_record_independence",
    "register_layer_rule",
]
