"""A DP wrapper for the optimizer a user already has.

``DPOptimizer`` wraps any ``torch.optim.Optimizer`` (SGD, Adam, AdamW, a custom one) so that the
ordinary training loop ::

    for x, y in loader:                       # Poisson batches (PoissonBatchSampler)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)   # the declared loss_reduction ("mean" here)
        loss.backward()                       # or optimizer.backward(loss): faster, see below
        optimizer.step()

takes one DP-SGD step per ``step()`` (Abadi et al. 2016; McMahan & Andrew 2018, sections 1–3):

1. per-example gradients g_i of the sample R (their squared norms by ghost norms where the layers
   allow, :class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine`);
2. per group of parameters g (one group, per layer, per parameter or custom; see
   :mod:`~dpledger.adapters.torch.gradient_queries`) clip factors f_ig from the group norms with
   the chosen strategy (flat, global, automatic; joint scaled clipping with scales α_j), on the
   parameters' device in float64 (never copied to the host), and the clipped sums Σ_i f_ig g_ig
   formed on the device without materialising g_i where possible (book-keeping);
3. one sampling event — the event of the sampler's draw the batch is (Poisson (q, n) by
   default; fixed-size, truncated Poisson, balls-in-bins or shuffle with the samplers of
   :mod:`~dpledger.adapters.torch.batch_samplers`) — and, per group,
   Gaussian noise N(0, σ̃_g² I) drawn in float64 on the parameters' device from a seedable
   ``torch.Generator`` with one sum-query event (S_g, σ̃_g, label) each, in the ledger, through
   :class:`~dpledger.mechanisms.GroupedSumQuery` (with its sensitivity check, which reads the
   norms of all groups' sums back to the host in one copy — the step's only host
   synchronisation — before the sampling event is recorded; the noise of all groups is one
   float64 draw over their concatenation);
4. the fixed-denominator average (noisy sum)/(q·n) (the event's denominator: b for fixed-size and
   shuffled batches, n / k for balls-in-bins), written to ``p.grad``, and the wrapped
   optimizer's own ``step()``.

Step semantics (every case has a defined, tested outcome):

* ``step()`` needs a backward since the last step: otherwise :class:`EngineStateError` and
  nothing is recorded (a second ``step()`` after one backward is this case).
* A second forward with gradients enabled after a backward and before ``step()`` raises
  :class:`EngineStateError` at that forward (the first batch's per-example gradients would be
  lost silently otherwise); gradient accumulation is done with virtual batches instead.
* ``zero_grad()`` after a backward without ``step()`` *skips* the batch: its per-example
  gradients are discarded, nothing is released and nothing is recorded (a warning is logged:
  if the decision to skip depended on the batch's data, that decision is not covered by the
  ledger's guarantee).
* An empty batch (Poisson, truncated Poisson or balls-in-bins) is still a step: run the forward
  and backward on the empty batch (the engine handles B = 0) or call
  :meth:`DPOptimizer.empty_step`; the sample is recorded and the released sum is pure noise.
* Virtual batches: :meth:`DPOptimizer.virtual_step` after each physical chunk's backward
  accumulates the chunk's clipped sum; the ``step()`` after the last chunk releases the logical
  step once, with one sampling event of the logical q
  (:func:`~dpledger.adapters.torch.virtual_batches.virtual_batches` does this for a loader).

``optimizer.backward(loss)`` asks autograd only for the gradients with respect to the layers'
outputs, skipping the batch gradient of every weight (which the DP step replaces anyway); it is
the fast path of the benchmarks. With ``loss_fn`` given, the optimizer instead computes
per-example gradients functionally (``torch.func``) in :meth:`DPOptimizer.compute_gradients`,
which also provides Bias-Aware Minimisation's per-example ascent (``bam_radius``).

Distributed training: see :mod:`~dpledger.adapters.torch.distributed` (rank 0 draws the noise
and writes the ledger).

Bias metrics (``bias_callback``): after each step, the callback receives
:class:`~dpledger.diagnostics.bias.ClippingBias` computed from the step's norms and its clipped and
unclipped sums (one extra book-keeping pass per step). **They are not differentially private**:
they are computed from the raw per-example gradients; never release them or let them influence
training in a run whose ε you intend to report. With no callback nothing extra is computed.
The metrics are computed with NumPy on the host; NumPy's OpenBLAS threads keep spinning after a
call and can slow the next torch operations on a machine with few cores
(``OPENBLAS_NUM_THREADS=1`` avoids it, see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from dpledger.adapters.torch.backend import TorchBackend, check_generator_device
from dpledger.adapters.torch.bam import per_example_gradients_and_losses
from dpledger.adapters.torch.distributed import (
    DistributedPoissonBatchSampler,
    _common_seed,
    broadcast_tensors,
    distributed_world,
    reduce_tensors,
    sum_counts,
)
from dpledger.adapters.torch.engine import LossReduction, PerExampleGradientEngine, Strategy
from dpledger.adapters.torch.errors import EngineStateError
from dpledger.adapters.torch.factors import expand_factors, strategy_factors
from dpledger.adapters.torch.functional_gradients import clipped_sum_of, squared_norms_of
from dpledger.adapters.torch.gradient_queries import GradientQueries, Grouping
from dpledger.adapters.torch.module_checks import check_module_configuration
from dpledger.adapters.torch.record_probe import (
    model_fingerprint,
    probe_record_independence,
    records_in,
)
from dpledger.adapters.torch.sampler_base import RecordedBatchSampler
from dpledger.adapters.torch.user_level import UserBatch, UserPoissonBatchSampler
from dpledger.errors import InvalidParameterError, LedgerStateError, SamplerMismatchError
from dpledger.ledger import PrivacyLedger, SamplingEvent
from dpledger.mechanisms import ClippingStrategy, ScaledGaussianSumQuery, open_step
from dpledger.mechanisms.clipping import rounding_clip_margin
from dpledger.mechanisms.config import DPConfig, deprecated_alias
from dpledger.sampling.relations import check_ledger_relation, default_relation
from dpledger.sampling.validation import check_sampling_probability
from dpledger.validation import (
    check_non_negative_finite,
    check_positive_finite,
    check_positive_int,
)

__all__ = ["BiasCallback", "DPOptimizer"]

logger = logging.getLogger(__name__)

BiasCallback = Callable[[int, Any], None]
"""``callback(step_index, ClippingBias)``; see
:data:`dpledger.diagnostics.bias.ClippingBiasCallback`."""

_STATE_VERSION = 1
_CLIPPED_TOLERANCE = 1e-9


class _Materialised:
    """Per-example gradients computed functionally, with the engine's interface."""

    def __init__(self, grads: dict[str, torch.Tensor], names: tuple[str, ...]) -> None:
        self.grads = grads
        self.names = names
        self.batch_size = next(iter(grads.values())).shape[0]

    def squared_norms(self) -> dict[str, torch.Tensor]:
        return squared_norms_of(self.grads)

    def clipped_sum(self, factors: Any) -> dict[str, torch.Tensor]:
        return clipped_sum_of(
            self.grads, expand_factors(factors, names=self.names, batch_size=self.batch_size)
        )


def _where(ledger: PrivacyLedger) -> str:
    return repr(str(ledger.path)) if ledger.path is not None else "(in memory)"


_SAMPLERS = (
    "a PoissonBatchSampler, FixedSizeBatchSampler, TruncatedPoissonBatchSampler, "
    "BallsInBinsBatchSampler, ShuffleBatchSampler or UserPoissonBatchSampler"
)


def _sampling_source(sampler: Any) -> RecordedBatchSampler:
    if isinstance(sampler, DataLoader):
        inner = sampler.batch_sampler
        if not isinstance(inner, RecordedBatchSampler):
            raise InvalidParameterError(
                "sampler",
                f"a DataLoader with batch_sampler {type(inner).__name__}",
                "a data loader whose batches are the draws of a recorded sampler "
                "(poisson_data_loader, private_data_loader, or a DataLoader with batch_sampler= "
                f"{_SAMPLERS}); the sampling probability of other loaders is not "
                "q = 1/len(loader), and their scheme is not known. For your own Poisson "
                "sampler, give sampling_probability= and population_size= instead",
            )
        return inner
    if isinstance(sampler, RecordedBatchSampler):
        return sampler
    raise InvalidParameterError("sampler", sampler, f"{_SAMPLERS}, or a DataLoader using one")


def _refuse_virtual_batches() -> None:
    raise InvalidParameterError(
        "sampler",
        "UserPoissonBatchSampler",
        "a record-level sampler for virtual batches: with user-level sampling a user's records "
        "split over chunks would be clipped chunk by chunk, not as one vector; step on the "
        "whole batch",
    )


class DPOptimizer(torch.optim.Optimizer):
    """Differentially private steps with any ``torch.optim.Optimizer``.

    See the module docstring for the step and its semantics.

    Args:
        optimizer: the optimizer to wrap; it must update exactly the model's trainable
            parameters (frozen ones may be in it too).
        model: the model whose forward and backward feed the step (the module the
            per-example gradient engine attaches to; a DistributedDataParallel wrapper is fine).
        config: the step's :class:`~dpledger.mechanisms.DPConfig` (clip bound, noise, clipping,
            groups, clip split, noise allocation, scales, strategy, clip margin), instead of the
            keyword arguments of those fields; giving both is an
            :class:`~dpledger.errors.InvalidParameterError`. Its ``noise_multiplier`` is needed
            (a ``target_epsilon`` is calibrated by :func:`~dpledger.adapters.torch.make_private`).
        l2_norm_bound: C > 0 (finite), the L2 bound of each record's whole gradient (split
            over groups, see ``groups``).
        noise_multiplier: z ≥ 0, the step's effective noise multiplier: σ̃ = z·C with one group
            (z = 0 is allowed, recorded, and not private).
        ledger: the ledger the step's events go to; None creates an in-memory ledger
            (:attr:`ledger`), add/remove unless the sampler's scheme is analysed under
            replace-one only. Under ``torch.distributed`` only rank 0 takes a ledger; the
            others must pass None.
        sampler: where the batches come from: a recorded batch sampler (a DataLoader using one
            is fine): :class:`~dpledger.adapters.torch.PoissonBatchSampler`,
            :class:`~dpledger.adapters.torch.FixedSizeBatchSampler`,
            :class:`~dpledger.adapters.torch.TruncatedPoissonBatchSampler`,
            :class:`~dpledger.adapters.torch.BallsInBinsBatchSampler`,
            :class:`~dpledger.adapters.torch.ShuffleBatchSampler` or, for user-level DP,
            :class:`~dpledger.adapters.torch.UserPoissonBatchSampler`. Every step records the
            sampling event of the draw it claims (see
            :meth:`~dpledger.adapters.torch.sampler_base.RecordedBatchSampler.claim_draw`) and
            averages over that event's denominator (:attr:`denominator`). A ledger whose
            neighbouring relation the sampler's scheme is not analysed under (fixed-size and
            shuffled batches: replace-one only) is refused here, before training. Under
            ``torch.distributed`` only a
            :class:`~dpledger.adapters.torch.DistributedPoissonBatchSampler` is accepted.
        sampling_probability: q in (0, 1] of your own Poisson sampler, with
            ``population_size`` n, instead of ``sampler``.
        population_size: n, the number of records the batches are drawn from.
        loss_reduction: how the loss you backpropagate combines the per-example losses:
            ``"mean"`` ((1/B) Σ_i ℓ_i, ``F.cross_entropy``'s default) or ``"sum"``.
        clipping: ``"flat"`` (min(1, S/‖v‖), default), ``"global"`` (1{‖v‖ ≤ S}, Bu et al.),
            ``"automatic"`` (S/(‖v‖ + γ)) or a :class:`~dpledger.mechanisms.ClippingStrategy`.
        groups: ``"all"`` (flat, default), ``"per_layer"``, ``"per_parameter"`` or
            ``{label: [parameter names]}``.
        clip_split: ``"equal"`` (default) or ``"dimension"``: how C is split over several groups.
        noise_allocation: ``"proportional"`` (default) or ``"dimension"``: the σ̃_g with
            z_eff = z.
        scales: ``{parameter name: α}`` for joint scaled clipping within each group.
        strategy: the engine's per-example strategy: ``"auto"`` (default), ``"ghost"``,
            ``"per_example"`` or ``"generic"`` (torch.func for every layer).
        loss_fn: ``loss_fn(output, target)`` for one example; switches to the functional
            path (:meth:`compute_gradients`) instead of hooks on ``loss.backward()``.
        bam_radius: λ > 0 for Bias-Aware Minimisation's per-example ascent (needs
            ``loss_fn``); None for none.
        generator: the noise generator, a ``torch.Generator`` on the parameters' device.
        seed: a seed for a new noise generator (when ``generator`` is None); None seeds from
            OS entropy.
        backend: the :class:`~dpledger.adapters.torch.backend.TorchBackend` the sum queries
            draw their noise with; None (default) for a plain one. A privacy audit passes a
            subclass that plants a bug; the ledger records what the queries claim either way.
        bias_callback: ``callback(step, ClippingBias)`` after every step (NOT private).
        clip_margin: ρ in [0, 0.5): factors clip to C·(1 − ρ) while the ledger records C, so
            that rounding in the per-example norms and sums (computed in the parameters' dtype)
            cannot push a record's contribution above C. None (default) chooses ρ by dtype
            (:func:`~dpledger.mechanisms.clipping.rounding_clip_margin`: about 9.8e-4 for
            float32, 1.8e-12 for float64).
        user_gradient: with a
            :class:`~dpledger.adapters.torch.UserPoissonBatchSampler` (user-level DP), each
            sampled user's vector is the ``"sum"`` (default) or the ``"mean"`` of the gradients
            of that user's records in the batch; that vector is clipped to C (per group) as one.
            Only ``"sum"`` is accepted with a record-level sampler. See "User-level DP" below.
        check_steps: steps on which the engine compares Σ_i g_i with autograd's gradient.
        check_record_independence: run the record-independence probe
            (:mod:`~dpledger.adapters.torch.record_probe`) at the first forward with at least
            two records, and again whenever the model's modules or their training modes change:
            it changes record 0 of a few-record slice of the batch and refuses the model with
            :class:`~dpledger.adapters.torch.errors.RecordDependenceError` if another record's
            module outputs or per-example gradient move. False switches it off (a warning is
            logged: a model that mixes records makes the ledger's ε wrong). The functional path
            (``loss_fn``) needs no probe: it evaluates each example alone.
        distributed: use ``torch.distributed`` (None: when a process group with more than one
            rank is initialised).
        process_group: the process group (None: the default group).
        max_grad_norm: deprecated name of ``l2_norm_bound`` (a :class:`DeprecationWarning`).

    The fields of :class:`~dpledger.mechanisms.DPConfig` given as None (``clipping``, ``groups``,
    ``clip_split``, ``noise_allocation``, ``scales``, ``strategy``, ``clip_margin``) take the
    defaults above, or the values of ``config``.

    User-level DP: with ``sampler=`` a
    :class:`~dpledger.adapters.torch.UserPoissonBatchSampler` (or a DataLoader using one) the
    privacy unit is a user. The step takes the materialised per-example gradients of the batch
    (``engine.per_example_gradients()``, or the functional path's), adds them up per user (or
    averages them, ``user_gradient="mean"``), computes each user's group norms and clip factors
    with the chosen groups and clipping strategy, and releases Σ_users f_u·G_u with the usual
    noise: one user moves the released sum by at most C, the bound the ledger's sum-query
    events state, and the step records the sampler's ``poisson(q, num_users, unit="user")``
    event and averages over q·num_users. The step's records are tied to the sampler's draw at
    ``step()`` (the draw says which user each record belongs to). Refused with user-level
    sampling: virtual batches (a user split over chunks would be clipped chunk by chunk),
    ``bam_radius`` and ``bias_callback`` (both per record); distributed training needs a
    :class:`~dpledger.adapters.torch.DistributedPoissonBatchSampler` and so is refused too.

    Raises:
        InvalidParameterError: a bad argument, named with its value and what to change.
        RecordMixingModuleError: the model has BatchNorm using batch statistics.
        RecordDependenceError: at a forward, the record-independence probe saw records mix
            (before anything is recorded).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: nn.Module,
        config: DPConfig | None = None,
        l2_norm_bound: float | None = None,
        noise_multiplier: float | None = None,
        ledger: PrivacyLedger | None = None,
        sampler: RecordedBatchSampler | DataLoader | None = None,
        sampling_probability: float | None = None,
        population_size: int | None = None,
        loss_reduction: LossReduction = "mean",
        clipping: ClippingStrategy | str | None = None,
        groups: Grouping | None = None,
        clip_split: Literal["equal", "dimension"] | None = None,
        noise_allocation: Literal["proportional", "dimension"] | None = None,
        scales: Mapping[str, float] | None = None,
        strategy: Strategy | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        bam_radius: float | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        backend: TorchBackend | None = None,
        bias_callback: BiasCallback | None = None,
        clip_margin: float | None = None,
        user_gradient: Literal["sum", "mean"] = "sum",
        check_steps: int = 1,
        check_record_independence: bool = True,
        distributed: bool | None = None,
        process_group: Any = None,
        max_grad_norm: float | None = None,
    ) -> None:
        # ---- arguments that need no model
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, DPOptimizer):
            raise InvalidParameterError(
                "optimizer", optimizer, "a torch.optim.Optimizer that is not already wrapped"
            )
        if not isinstance(model, nn.Module):
            raise InvalidParameterError("model", model, "a torch.nn.Module")
        config = DPConfig.resolve(
            config,
            spelled={"l2_norm_bound": "max_grad_norm"} if max_grad_norm is not None else None,
            l2_norm_bound=deprecated_alias(
                new="l2_norm_bound",
                new_value=l2_norm_bound,
                old="max_grad_norm",
                old_value=max_grad_norm,
            ),
            noise_multiplier=noise_multiplier,
            clipping=clipping,
            groups=groups,
            clip_split=clip_split,
            noise_allocation=noise_allocation,
            scales=scales,
            strategy=strategy,
            clip_margin=clip_margin,
        )
        if config.noise_multiplier is None:
            raise InvalidParameterError(
                "target_epsilon",
                config.target_epsilon,
                "None: DPOptimizer takes noise_multiplier=, since it does not know the run's "
                "length; make_private(..., config=config, epochs=...) calibrates z for a target",
            )
        if loss_reduction not in ("mean", "sum"):
            raise InvalidParameterError(
                "loss_reduction",
                loss_reduction,
                "'mean' (the loss you backpropagate is (1/B)·Σ_i ℓ_i) or 'sum' (Σ_i ℓ_i): a "
                "loss that is not a sum or mean of per-example terms (reduction='none' "
                "reduced some other way, a batch-level term) hides the per-example gradients",
            )
        if loss_fn is not None and not callable(loss_fn):
            raise InvalidParameterError("loss_fn", loss_fn, "a callable (output, target) -> loss")
        radius = None
        if bam_radius is not None:
            radius = check_non_negative_finite("bam_radius", bam_radius)
            if loss_fn is None:
                raise InvalidParameterError(
                    "bam_radius",
                    bam_radius,
                    "None unless loss_fn is given: BAM evaluates each example's loss at its own "
                    "perturbed parameters, which needs the per-example loss function",
                )
        if not isinstance(check_record_independence, bool):
            raise InvalidParameterError(
                "check_record_independence", check_record_independence, "True or False"
            )
        if bias_callback is not None and not callable(bias_callback):
            raise InvalidParameterError("bias_callback", bias_callback, "a callable or None")
        self._rank, self._world = (0, 1)
        if distributed is None:
            distributed = distributed_world(process_group)[1] > 1
        elif not isinstance(distributed, bool):
            raise InvalidParameterError("distributed", distributed, "True, False or None")
        if distributed:
            self._rank, self._world = distributed_world(process_group)
        self._distributed = bool(distributed)
        self._group = process_group

        # ---- sampling: q and n of the sampler actually used
        self._sampler: RecordedBatchSampler | None = None
        if sampler is not None:
            if sampling_probability is not None or population_size is not None:
                raise InvalidParameterError(
                    "sampling_probability",
                    sampling_probability,
                    "None when sampler= is given (q and n are read from the sampler)",
                )
            self._sampler = _sampling_source(sampler)
            if self._distributed and not (
                isinstance(self._sampler, DistributedPoissonBatchSampler)
                and self._sampler.world_size == self._world
            ):
                raise InvalidParameterError(
                    "sampler",
                    type(self._sampler).__name__,
                    f"a DistributedPoissonBatchSampler over {self._world} ranks: independent "
                    "samplers on each rank do not draw one sample of the scheme they would "
                    "record (dpledger has no distributed fixed-size, truncated, balls-in-bins "
                    "or shuffle sampler: each would need every rank to draw one global sample "
                    "and take its share, and only Poisson sampling is implemented that way)",
                )
            self._event = self._sampler.sampling_event()
        else:
            if sampling_probability is None or population_size is None:
                raise InvalidParameterError(
                    "sampler",
                    None,
                    f"{_SAMPLERS} (or its DataLoader), or both sampling_probability= and "
                    "population_size= of the Poisson sampler you use",
                )
            self._event = SamplingEvent.poisson(
                check_sampling_probability(sampling_probability),
                check_positive_int("population_size", population_size),
            )
        self._q = self._event.sampling_probability
        self._n = self._event.population_size
        self._user_level = isinstance(self._sampler, UserPoissonBatchSampler)
        if user_gradient not in ("sum", "mean"):
            raise InvalidParameterError(
                "user_gradient",
                user_gradient,
                "'sum' or 'mean' (each sampled user's vector: the sum or the mean of the "
                "gradients of the user's records in the batch)",
            )
        if user_gradient != "sum" and not self._user_level:
            raise InvalidParameterError(
                "user_gradient",
                user_gradient,
                "'sum' unless sampler= is a UserPoissonBatchSampler (record-level steps clip "
                "each record's own gradient)",
            )
        self._user_gradient = user_gradient
        if self._user_level:
            if bam_radius is not None:
                raise InvalidParameterError(
                    "bam_radius",
                    bam_radius,
                    "None with a UserPoissonBatchSampler: BAM's ascent is per record, and "
                    "dpledger has no user-level version of it",
                )
            if bias_callback is not None:
                raise InvalidParameterError(
                    "bias_callback",
                    "<a callable>",
                    "None with a UserPoissonBatchSampler: the clipping-bias metrics are per "
                    "record, not per user",
                )
        denominator = self._event.average_denominator
        assert self._n is not None and denominator is not None
        self._denominator = denominator

        # ---- the ledger (rank 0 only)
        if ledger is not None and not isinstance(ledger, PrivacyLedger):
            raise InvalidParameterError("ledger", ledger, "a dpledger.PrivacyLedger or None")
        if self._rank != 0:
            if ledger is not None:
                raise InvalidParameterError(
                    "ledger",
                    ledger,
                    f"None on rank {self._rank}: only rank 0 draws the noise and records events",
                )
        elif ledger is None:
            relation = default_relation(self._event)
            ledger = PrivacyLedger(neighboring=relation)
            logger.info(
                "no ledger given: recording to an in-memory %s ledger (optimizer.ledger)",
                relation.value,
            )
        if ledger is not None and ledger.closed:
            raise LedgerStateError(
                f"the ledger {_where(ledger)} is closed; open a new one or resume its file"
            )
        if ledger is not None:
            check_ledger_relation(self._event, ledger.neighboring)
        self._ledger = ledger

        # ---- model and optimizer must agree on the parameters
        check_module_configuration(model)
        self._opt = optimizer
        self._model = model
        self._params: dict[str, nn.Parameter] = {}
        seen: set[int] = set()
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                self._params[name] = p
                seen.add(id(p))
        if not self._params:
            raise InvalidParameterError("model", type(model).__name__, "a trainable parameter")
        in_model = {id(p) for p in model.parameters()}
        in_opt = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [n for n, p in self._params.items() if id(p) not in in_opt]
        if missing:
            raise InvalidParameterError(
                "optimizer",
                f"<optimizer without the model's trainable parameters {missing}>",
                "an optimizer over model.parameters(); or freeze those parameters "
                "(p.requires_grad_(False)) before wrapping",
            )
        foreign = sum(
            1 for group in optimizer.param_groups for p in group["params"] if id(p) not in in_model
        )
        if foreign:
            raise InvalidParameterError(
                "optimizer",
                f"<optimizer with {foreign} tensor(s) that are not parameters of the model>",
                "an optimizer over this model's parameters only: tensors the DP step does not "
                "see would be updated with non-private gradients",
            )
        devices = {p.device for p in self._params.values()}
        if len(devices) != 1:
            raise InvalidParameterError(
                "model", f"<parameters on {sorted(map(str, devices))}>", "parameters on one device"
            )
        self._device = next(iter(devices))
        self._tiny = max(torch.finfo(p.dtype).tiny for p in self._params.values())
        margin = config.clip_margin
        if margin is None:  # the engine computes in the parameters' dtype, at least float32
            margin = rounding_clip_margin(
                max(
                    torch.finfo(torch.promote_types(p.dtype, torch.float32)).eps
                    for p in self._params.values()
                )
            )
        self._clip_margin = margin

        # ---- the queries
        self._queries = GradientQueries(
            {n: p.numel() for n, p in self._params.items()},
            l2_norm_bound=config.l2_norm_bound,
            noise_multiplier=config.noise_multiplier,
            clipping=config.clipping,
            groups=config.groups,
            clip_split=config.clip_split,
            noise_allocation=config.noise_allocation,
            scales=config.scales,
        )
        self._query_cache = {
            (self._queries.max_grad_norm, self._queries.noise_multiplier): self._queries
        }
        self._names = tuple(self._params)
        self._index_of = {n: i for i, n in enumerate(self._names)}
        self._layouts: dict[int, tuple[GradientQueries, torch.Tensor, torch.Tensor, bool]] = {}

        # ---- the noise generator, on the parameters' device
        if generator is not None:
            if seed is not None:
                raise InvalidParameterError("seed", seed, "None when a generator is given")
            check_generator_device(generator, self._device, parameter="generator")
        else:
            generator = torch.Generator(device=self._device)
            if seed is None:
                generator.seed()
            elif isinstance(seed, bool) or not isinstance(seed, int):
                raise InvalidParameterError("seed", seed, "an integer or None")
            else:
                generator.manual_seed(seed)
        self._generator = generator
        if backend is not None and not isinstance(backend, TorchBackend):
            raise InvalidParameterError("backend", backend, "a TorchBackend or None")
        self._backend = TorchBackend() if backend is None else backend

        # ---- per-example gradients
        self._loss_fn = loss_fn
        self._bam_radius = radius
        self._engine: PerExampleGradientEngine | None = None
        self._functional: _Materialised | None = None
        self._handles: list[Any] = []
        self._probing = False
        self._probed: tuple | None = None
        if loss_fn is None:
            self._engine = PerExampleGradientEngine(
                model,
                loss_reduction=loss_reduction,
                strategy=config.strategy,
                check_steps=check_steps,
            )
            if check_record_independence:
                self._handles.append(
                    model.register_forward_pre_hook(
                        self._probe_forward, prepend=True, with_kwargs=True
                    )
                )
            else:
                logger.warning(
                    "check_record_independence=False: the record-independence probe is off. A "
                    "model whose forward mixes the records of a batch (batch statistics, "
                    "attention or pooling over the batch) lets one record move every other "
                    "record's clipped gradient, and the ledger's epsilon is then wrong"
                )
            # the guard runs first: it refuses a forward that would lose a pending step
            self._handles.append(model.register_forward_pre_hook(self._guard_forward, prepend=True))
        self._bias_callback = bias_callback

        # ---- the step being assembled (several chunks with virtual batches)
        self._acc: dict[str, torch.Tensor] | None = None
        self._acc_count = 0
        self._acc_unclipped: dict[str, torch.Tensor] | None = None
        self._acc_norms: list[np.ndarray] = []
        self._acc_clipped = 0
        self._acc_bad: torch.Tensor | None = None  # records with a non-finite norm (device)
        self._claimed_event: SamplingEvent | None = None  # user-level: claimed at step()
        self._final_chunk: bool | None = None
        self._steps_taken = 0

        if self._distributed:
            self._sync_model()

    # ------------------------------------------------------------------ delegation
    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        """The wrapped optimizer's parameter groups (learning rates and so on)."""
        return self._opt.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self._opt.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter state."""
        return self._opt.state

    @state.setter
    def state(self, value: Any) -> None:
        self._opt.state = value

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        """The wrapped optimizer's defaults."""
        return self._opt.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self._opt.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        """Refused: the DP step covers the parameters known when it was created."""
        raise InvalidParameterError(
            "param_group",
            "<a new parameter group>",
            "no new groups after wrapping: build the optimizer with every parameter first",
        )

    # ------------------------------------------------------------------ properties
    @property
    def original_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._opt

    @property
    def model(self) -> nn.Module:
        """The model."""
        return self._model

    @property
    def engine(self) -> PerExampleGradientEngine | None:
        """The per-example gradient engine (None on the functional path)."""
        return self._engine

    @property
    def ledger(self) -> PrivacyLedger | None:
        """The ledger (None on ranks other than 0)."""
        return self._ledger

    @property
    def sampling_probability(self) -> float:
        """q of the sampler, recorded with every step."""
        return self._q

    @property
    def population_size(self) -> int:
        """n, the number of records the batches are drawn from."""
        return self._n

    @property
    def expected_batch_size(self) -> float:
        """q·n: the mean batch size of a Poisson sampler (and the average's denominator for
        one); for the other schemes the nominal rate q times n (see :attr:`denominator`)."""
        return self._q * self._n

    @property
    def denominator(self) -> float:
        """The fixed denominator of every step's average: the sampling event's
        ``average_denominator`` (q·n for Poisson and truncated Poisson, b for fixed-size and
        shuffled batches, n / k for balls-in-bins)."""
        return self._denominator

    @property
    def sampling_event(self) -> SamplingEvent:
        """The sampling event the steps record (``epoch_start=False``; the first step of each
        epoch of an epoch-based sampler records it with ``epoch_start=True``)."""
        return self._event

    @property
    def sampler(self) -> RecordedBatchSampler | None:
        """The batch sampler the events are read from (None when q and n were given)."""
        return self._sampler

    @property
    def generator(self) -> torch.Generator:
        """The noise generator."""
        return self._generator

    @generator.setter
    def generator(self, value: torch.Generator) -> None:
        check_generator_device(value, self._device, parameter="generator")
        self._generator = value

    @property
    def max_grad_norm(self) -> float:
        """C, the clip bound of the next step (settable; the ledger records each step's)."""
        return self._queries.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self._set_queries(value, self._queries.noise_multiplier)

    def _set_queries(self, max_grad_norm: float, noise_multiplier: float) -> None:
        key = (
            check_positive_finite("max_grad_norm", max_grad_norm),
            check_non_negative_finite("noise_multiplier", noise_multiplier),
        )
        queries = self._query_cache.get(key)
        if queries is None:
            queries = self._queries.with_values(
                max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier
            )
            if len(self._query_cache) >= 16:
                self._query_cache.pop(next(iter(self._query_cache)))
            self._query_cache[(queries.max_grad_norm, queries.noise_multiplier)] = queries
        self._queries = queries

    @property
    def noise_multiplier(self) -> float:
        """z of the next step (settable; the ledger records each step's σ̃)."""
        return self._queries.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self._set_queries(self._queries.max_grad_norm, value)

    @property
    def queries(self) -> GradientQueries:
        """The groups and their Gaussian sum queries (S_g, σ̃_g) used by the next step."""
        return self._queries

    @property
    def steps_taken(self) -> int:
        """Number of DP steps released by this optimizer (including resumed ones)."""
        return self._steps_taken

    # ------------------------------------------------------------------ hooks and state
    def _guard_forward(self, module: nn.Module, args: tuple) -> None:
        engine = self._engine
        if engine is None or engine.recomputing or not torch.is_grad_enabled():
            return
        if engine.has_gradients:
            raise EngineStateError(
                "a forward pass with gradients enabled started after loss.backward() and "
                "before optimizer.step(): the previous batch's per-example gradients would be "
                "lost. Call optimizer.step() after each backward (optimizer.virtual_step() for "
                "a chunk of a virtual batch), optimizer.zero_grad() to skip the batch, or run "
                "evaluation forwards under torch.no_grad()"
            )

    def _probe_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        engine = self._engine
        if engine is None or self._probing or engine.recomputing or not torch.is_grad_enabled():
            return
        fingerprint = model_fingerprint(self._model)
        if fingerprint == self._probed or (records_in(args, kwargs) or 0) < 2:
            return  # probed already, or a batch of at most one record (which cannot mix)
        self._probing = True
        try:
            probe_record_independence(self._model, engine=engine, args=args, kwargs=kwargs)
        finally:
            self._probing = False
        self._probed = fingerprint

    def _pending(self) -> bool:
        if self._engine is not None:
            return self._engine.has_gradients
        return self._functional is not None

    def _discard_pending(self) -> None:
        if self._engine is not None:
            self._engine.clear()
        self._functional = None

    def detach(self) -> None:
        """Remove the hooks from the model (the optimizer cannot step afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._engine is not None:
            self._engine.remove()

    def _sync_model(self) -> None:
        import torch.distributed as dist

        from dpledger.adapters.torch.distributed import _global_rank

        src = _global_rank(0, self._group)
        with torch.no_grad():
            for t in [*self._model.parameters(), *self._model.buffers()]:
                dist.broadcast(t.data, src=src, group=self._group)

    # ------------------------------------------------------------------ per-example gradients
    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` to the layers' outputs only (a faster ``loss.backward()``).

        Parameters' ``.grad`` is not touched; ``step()`` writes the private gradient.
        """
        if self._engine is None:
            raise EngineStateError(
                "optimizer.backward(loss) is for the hook path; with loss_fn= call "
                "optimizer.compute_gradients(inputs, targets)"
            )
        self._engine.backward(loss)

    def compute_gradients(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Functional path: per-example gradients of ``loss_fn`` on a batch (BAM if set).

        Replaces the forward and backward when the optimizer was created with ``loss_fn``.

        Returns:
            The batch's mean loss at the current parameters (detached, for logging; NaN for an
            empty batch).
        """
        if self._loss_fn is None:
            raise EngineStateError(
                "compute_gradients needs loss_fn= at construction; on the hook path run the "
                "forward and loss.backward() (or optimizer.backward(loss))"
            )
        if self._functional is not None:
            raise EngineStateError(
                "per-example gradients of the previous batch are waiting: call "
                "optimizer.step() (or virtual_step()) before computing another batch"
            )
        check_module_configuration(self._model)
        grads, losses = per_example_gradients_and_losses(
            self._model,
            self._loss_fn,
            inputs,
            targets,
            bam_radius=self._bam_radius or 0.0,
        )
        self._functional = _Materialised({n: grads[n] for n in self._names}, self._names)
        return losses.mean() if losses.numel() else losses.new_tensor(math.nan)

    def _source(self) -> Any:
        if self._engine is not None:
            return self._engine
        assert self._functional is not None
        return self._functional

    def _absorb(self) -> None:
        """Clip the pending batch's per-example gradients and add them to the step's sums."""
        if self._user_level:
            self._absorb_users()
            return
        source = self._source()
        batch = source.batch_size
        self._clip_and_add(source, batch)
        self._acc_count += batch
        self._discard_pending()

    def _absorb_users(self) -> None:
        """User-level: claim the batch's draw, sum (or average) the per-example gradients of
        each user, clip each user's vector as one and add the clipped sum to the step's sums."""
        assert isinstance(self._sampler, UserPoissonBatchSampler)
        if self._final_chunk is not None or self._acc is not None:
            _refuse_virtual_batches()
        source = self._source()
        batch = source.batch_size
        try:
            event, users = self._sampler.claim_users(batch)
        except SamplerMismatchError:
            self._discard_pending()
            self._reset()
            raise
        per_user = _Materialised(self._user_gradients(source, users), self._names)
        self._clip_and_add(per_user, users.num_users)
        self._acc_count = users.num_users  # the sum query's sample: users, not records
        self._claimed_event = event
        self._discard_pending()

    def _user_gradients(self, source: Any, users: UserBatch) -> dict[str, torch.Tensor]:
        """G_u = Σ_{i of u} g_i (or its mean) for each user of the batch, ``{name: (U, ...)}``,
        from the materialised per-example gradients, in at least float32."""
        if isinstance(source, _Materialised):
            grads = source.grads
        else:
            grads = source.per_example_gradients()
        index = users.user_index.to(self._device)
        counts = None
        if self._user_gradient == "mean":
            counts = torch.bincount(index, minlength=users.num_users)
        out = {}
        with torch.no_grad():
            for n in self._names:
                g = grads[n]
                g = g.to(torch.promote_types(g.dtype, torch.float32))
                total = g.new_zeros((users.num_users, *g.shape[1:])).index_add_(0, index, g)
                if counts is not None:
                    total /= counts.to(total.dtype).view(-1, *([1] * (total.dim() - 1)))
                out[n] = total
        return out

    def _clip_and_add(self, source: Any, batch: int) -> None:
        """Clip the ``batch`` vectors of ``source`` per group and add their sum to the step's.

        The group norms and clip factors stay on the parameters' device, in float64: no copy to
        the host and no synchronisation. A record whose group norm is not finite (or whose
        squared norm is negative) is counted on the device; :meth:`_release_and_update` refuses
        a step with such a record before anything is recorded.
        """
        squared = source.squared_norms()
        queries = self._queries
        reduce, bounds, host_rows = self._layout(queries)
        stacked = torch.stack([squared[n] for n in self._names]).to(torch.float64)
        norms = (reduce @ stacked).sqrt_()  # (G, B): each group's (scaled) record norms
        bad = (~torch.isfinite(norms)).sum() + (stacked < 0).sum()
        self._acc_bad = bad if self._acc_bad is None else self._acc_bad + bad
        factors = strategy_factors(queries.queries[0].clipping, norms, bounds=bounds)
        if factors is None or host_rows:  # a strategy without a device formula: on the host
            factors = self._host_factors(queries, norms, bad)
        factors = torch.where(factors < self._tiny, torch.zeros_like(factors), factors)
        mapping = {members: factors[g] for g, members in enumerate(queries.members)}
        with torch.no_grad():
            sums = source.clipped_sum(mapping)
            if self._acc is None:
                self._acc = {n: sums[n] for n in self._names}
            else:
                torch._foreach_add_(
                    [self._acc[n] for n in self._names], [sums[n] for n in self._names]
                )
            if self._bias_callback is not None:  # not private; host copies are fine here
                total = stacked.sum(0).cpu().numpy()
                host_norms = norms.cpu().numpy()
                self._absorb_metrics(source, total, factors.cpu().numpy(), list(host_norms), batch)

    def _host_factors(
        self, queries: GradientQueries, norms: torch.Tensor, bad: torch.Tensor
    ) -> torch.Tensor:
        """Factors of strategies with no device formula, by the queries on the host."""
        host = norms.cpu().numpy()
        if int(bad) > 0:
            host = np.where(np.isfinite(host), host, 0.0)  # the step is refused at release
        factors = np.stack(
            [
                query.clip_factors(host[g], margin=self._clip_margin)
                for g, query in enumerate(queries.queries)
            ]
        )
        return torch.from_numpy(factors).to(self._device)

    def _layout(self, queries: GradientQueries) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """A weight matrix summing the per-parameter squared norms of each group into one row
        (with weights 1/α_j² for joint scaled groups), the groups' clip bounds S_g·(1 − ρ) as a
        column, and whether the groups' strategies differ (then factors come from the host).
        Cached per set of queries."""
        cached = self._layouts.get(id(queries))
        if cached is not None and cached[0] is queries:
            return cached[1], cached[2], cached[3]
        reduce = torch.zeros(len(queries.queries), len(self._names), dtype=torch.float64)
        for g, (query, members) in enumerate(zip(queries.queries, queries.members, strict=True)):
            scales = query.scales if isinstance(query, ScaledGaussianSumQuery) else None
            for j, n in enumerate(members):
                reduce[g, self._index_of[n]] = 1.0 if scales is None else 1.0 / scales[j] ** 2
        rho = self._clip_margin or 0.0
        bounds = torch.tensor(
            [[q.l2_norm_bound * (1.0 - rho)] for q in queries.queries], dtype=torch.float64
        )
        mixed = len({q.clipping for q in queries.queries}) > 1
        reduce, bounds = reduce.to(self._device), bounds.to(self._device)
        self._layouts = {id(queries): (queries, reduce, bounds, mixed)}
        return reduce, bounds, mixed

    def _absorb_metrics(
        self,
        source: Any,
        total_squared: np.ndarray,
        factors: np.ndarray,
        group_norms: list[np.ndarray],
        batch: int,
    ) -> None:
        ones = torch.ones(batch, dtype=torch.float64, device=self._device)
        unclipped = source.clipped_sum(ones)
        if self._acc_unclipped is None:
            self._acc_unclipped = {n: unclipped[n] for n in self._names}
        else:
            for n in self._names:
                self._acc_unclipped[n].add_(unclipped[n])
        self._acc_norms.append(np.sqrt(total_squared))
        clipped = np.zeros(batch, dtype=bool)
        for g, norms in enumerate(group_norms):
            clipped |= (factors[g] < 1.0 - _CLIPPED_TOLERANCE) & (norms > 0.0)
        self._acc_clipped += int(clipped.sum())

    def _reset(self) -> None:
        self._acc = None
        self._acc_count = 0
        self._acc_unclipped = None
        self._acc_norms = []
        self._acc_clipped = 0
        self._acc_bad = None
        self._claimed_event = None

    # ------------------------------------------------------------------ steps
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients; a batch backpropagated but not stepped is skipped.

        The chunks already accumulated for an open virtual step are kept until ``step()``.
        """
        if self._pending():
            logger.warning(
                "zero_grad() after a backward without step(): the batch is skipped, nothing "
                "was released or recorded for it (a skip that depends on the batch's data is "
                "not covered by the ledger's guarantee)"
            )
            self._discard_pending()
            if self._sampler is not None and self._acc is None:
                self._sampler.discard_draw()  # a whole batch skipped: its draw is not trained on
        self._opt.zero_grad(set_to_none=set_to_none)

    def virtual_step(self) -> None:
        """Accumulate this chunk's clipped sum into the open logical step (no release)."""
        if self._user_level:
            _refuse_virtual_batches()
        self._check_foreign_gradients()
        if not self._pending():
            raise EngineStateError(
                "virtual_step() without a backward since the last step: run the chunk's "
                "forward and loss.backward() first"
            )
        self._absorb_or_drop()

    def _absorb_or_drop(self) -> None:
        """:meth:`_absorb`; on any error (out of memory, a module's own error) drop the step.

        Nothing has been released or recorded at this point, so dropping is free of privacy
        cost: the batch's stored activations, per-example results and the chunks of an open
        virtual step are let go (the memory a retry at a smaller batch needs), the batch's draw
        is discarded as by ``zero_grad()``, and the error is raised with a note saying so.
        """
        try:
            self._absorb()
        except BaseException as exc:
            self._discard_pending()
            self._reset()
            if self._sampler is not None and not self._user_level:
                self._sampler.discard_draw()
            exc.add_note(
                "dpledger: this step was dropped before anything was released or recorded; "
                "its stored activations and per-example gradients were freed, and the next "
                "batch can be stepped (a retry at a smaller batch size works in this process)"
            )
            raise

    def empty_step(self) -> None:
        """The step of an empty sample: record the sample and release pure noise.

        For models that cannot run a forward on zero records; equivalent to ``step()`` after a
        forward and backward of an empty batch.
        """
        self._check_ledger_open()
        if self._pending() or self._acc is not None:
            raise EngineStateError(
                "empty_step() with a backward or virtual chunks waiting: their batch is not "
                "empty; call optimizer.step()"
            )
        self._acc = {n: torch.zeros_like(p) for n, p in self._params.items()}
        if self._bias_callback is not None:
            self._acc_unclipped = {n: torch.zeros_like(p) for n, p in self._params.items()}
        self._release_and_update()

    def _check_ledger_open(self) -> None:
        """Refuse a step whose events could not be recorded, before anything is released.

        The ledger can be closed under a running optimizer by its other owner (a second copy of
        the training loop that resumed the same file, a checkpoint routine, a ``with`` block that
        ended); the step would otherwise draw its noise and fail half-way.
        """
        if self._ledger is not None and self._ledger.closed:
            raise LedgerStateError(
                f"the ledger {_where(self._ledger)} was closed while this optimizer was still "
                "recording into it (by another writer, or a with-block that ended): nothing was "
                "released or recorded for this step and the parameters are unchanged. Call "
                "optimizer.zero_grad() to drop the batch, or resume the file "
                "(PrivacyLedger(path, resume=True)) in a new optimizer loaded from a checkpoint"
            )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One DP step (see the module docstring); returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_ledger_open()
        self._check_foreign_gradients()
        if self._pending():
            self._absorb_or_drop()
        elif self._acc is None:
            raise EngineStateError(
                "optimizer.step() without a backward since the last step: run the forward and "
                "loss.backward() (optimizer.compute_gradients(x, y) with loss_fn=) first. "
                "Nothing was recorded. For an empty batch run them on the empty batch or call "
                "optimizer.empty_step()"
            )
        if self._final_chunk is False:
            return loss  # a chunk of a virtual batch; the last chunk's step releases
        self._release_and_update()
        return loss

    def _check_foreign_gradients(self) -> None:
        managed = {id(p) for p in self._params.values()}
        for group in self._opt.param_groups:
            for p in group["params"]:
                if id(p) not in managed and p.grad is not None:
                    raise EngineStateError(
                        "a parameter that was frozen when the optimizer was wrapped has a "
                        "gradient now; its update would not be private. Freeze it again "
                        "(requires_grad_(False), grad = None) or wrap the optimizer anew"
                    )

    def _claim_draw(self) -> tuple[str | None, SamplingEvent]:
        """Tie this step to the sampler's draw (see :mod:`~dpledger.adapters.torch.sampler_base`),
        before anything is released or recorded; the step is dropped when refused.

        In one process a mismatch raises :class:`~dpledger.errors.SamplerMismatchError` here.
        Under torch.distributed it is returned instead (the message, or None): every rank must
        learn of any rank's refusal through the step's count collective and raise together,
        or the others would wait in the step's collectives for ever. The event to record is
        returned with it.
        """
        if self._sampler is None:
            return None, self._event
        if self._claimed_event is not None:
            return None, self._claimed_event
        try:
            event = self._sampler.claim_draw(self._acc_count)
        except SamplerMismatchError as exc:
            if not self._distributed:
                self._reset()
                raise
            return str(exc), self._event
        return None, event

    def _release_and_update(self) -> None:
        assert self._acc is not None
        problem, event = self._claim_draw()
        names = self._names
        sums = [self._acc[n] for n in names]
        count = self._acc_count
        unclipped = None
        if self._acc_unclipped is not None:
            unclipped = [self._acc_unclipped[n] for n in names]
        clipped = self._acc_clipped
        if self._acc_bad is not None:
            # A record whose norm is not finite makes the clipped sum NaN (on the device, no
            # synchronisation), which the sensitivity check below refuses before anything is
            # recorded; adding 0 leaves every other sum as it is.
            first = next((s for s in sums if s.numel() > 0), None)
            if first is not None:
                poison = torch.where(self._acc_bad > 0, math.nan, 0.0)
                first.view(-1)[:1].add_(poison.to(first.dtype))
        if self._distributed:
            # counts first, on every rank: a rank whose records were not its sampler's draw
            # stops every rank before the gradients are reduced or anything is recorded
            count, clipped, refused = sum_counts(
                [count, clipped, 0 if problem is None else 1],
                device=self._device,
                process_group=self._group,
            )
            if refused:
                self._reset()
                raise SamplerMismatchError(
                    problem
                    or f"{refused} other rank(s) stepped on records their sampler did not draw; "
                    "no rank released or recorded anything for this step"
                )
            reduced = reduce_tensors(sums + (unclipped or []), process_group=self._group)
            sums = reduced[: len(names)]
            if unclipped is not None:
                unclipped = reduced[len(names) :]
        averaged: list[torch.Tensor] = []
        if self._rank == 0:
            assert self._ledger is not None
            queries = self._queries
            by_name = dict(zip(names, sums, strict=True))
            # A group under separate clipping is one concatenated vector (McMahan & Andrew,
            # section 2): its members' sums are released as one flat array — the same norm, the
            # same i.i.d. noise per coordinate — in a few large operations instead of several
            # small ones per parameter. Joint scaled groups keep one array per scale.
            grouped_sums = []
            for query, members in zip(queries.queries, queries.members, strict=True):
                parts = [by_name[n] for n in members]
                if len(parts) > 1 and not isinstance(query, ScaledGaussianSumQuery):
                    parts = [torch.cat([t.reshape(-1) for t in parts])]
                grouped_sums.append(parts)
            # Validation and the sensitivity check of every group (one read-back of the sums'
            # norms) come before the sampling event: a refused step records nothing.
            try:
                prepared = queries.grouped.prepare(
                    grouped_sums, num_records=count, backend=self._backend
                )
            except InvalidParameterError:
                self._refuse_non_finite_records()
                raise
            if event.is_classic:  # Poisson or full batch: the ledger's fast path
                step = open_step(
                    self._ledger,
                    sampling_probability=self._q,
                    population_size=self._n,
                    generator=self._generator,
                    backend=self._backend,
                )
            else:
                step = open_step(
                    self._ledger, event=event, generator=self._generator, backend=self._backend
                )
            try:
                noised = step.commit(prepared)
                averaged_groups = step.average([t for group in noised for t in group])
            finally:
                step.end()
            by_name_avg: dict[str, torch.Tensor] = {}
            released = iter(averaged_groups)
            for members, parts in zip(queries.members, grouped_sums, strict=True):
                if len(parts) == len(members):
                    for n in members:
                        by_name_avg[n] = next(released)
                else:
                    flat = next(released)
                    pieces = flat.split([by_name[n].numel() for n in members])
                    for n, piece in zip(members, pieces, strict=True):
                        by_name_avg[n] = piece.view(by_name[n].shape)
            averaged = [by_name_avg[n] for n in names]
        else:
            averaged = [torch.empty_like(s) for s in sums]
        if self._distributed:
            averaged = broadcast_tensors(averaged, process_group=self._group)
        for n, avg in zip(names, averaged, strict=True):
            p = self._params[n]
            p.grad = avg.to(dtype=p.dtype)
        self._opt.step()
        if self._bias_callback is not None and self._rank == 0 and count > 0:
            self._report_bias(sums, unclipped, count, clipped)
        self._reset()
        self._steps_taken += 1

    def _refuse_non_finite_records(self) -> None:
        """After a refused release: name records whose norm was not finite, if there were any
        (the cause of a NaN sum); the step is dropped."""
        bad = 0 if self._acc_bad is None else int(self._acc_bad)
        if bad > 0:
            self._reset()
            raise InvalidParameterError(
                "per-example gradients",
                f"{bad} record(s) with a NaN, infinite or negative squared norm",
                "finite per-example gradients (a record with a NaN or infinite norm is never "
                "clipped or summed): nothing was released or recorded for this step",
            )

    def _report_bias(
        self,
        sums: list[torch.Tensor],
        unclipped: list[torch.Tensor] | None,
        count: int,
        clipped: int,
    ) -> None:
        from dpledger.diagnostics.bias import clipping_bias_from_sums

        assert unclipped is not None and self._bias_callback is not None
        norms = None
        if not self._distributed and self._acc_norms:
            norms = np.concatenate(self._acc_norms)  # other ranks' norms stay on their ranks
        metrics = clipping_bias_from_sums(
            unclipped_sum=[self._backend.to_host(t).ravel() for t in unclipped],
            clipped_sum=[self._backend.to_host(t).ravel() for t in sums],
            num_examples=count,
            per_example_norms=norms,
            num_clipped=clipped,
            denominator=self._denominator,
        )
        self._bias_callback(self._steps_taken, metrics)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state with the noise generator, the sampler and the ledger
        position, to be saved together with the model's ``state_dict()``.

        The ledger is flushed first, so that the ledger file holds at least every step this
        checkpoint counts.
        """
        if self._pending() or self._acc is not None:
            raise EngineStateError(
                "state_dict() in the middle of a step (a backward or virtual chunks waiting): "
                "checkpoint between steps"
            )
        ledger_position = None
        if self._ledger is not None:
            self._ledger.flush()
            ledger_position = {
                "num_steps": self._ledger.num_steps,
                "num_events": self._ledger.num_events,
                "path": self._ledger.path,
            }
        return {
            "version": _STATE_VERSION,
            "optimizer": self._opt.state_dict(),
            "noise_generator_state": self._generator.get_state(),
            "sampler": None if self._sampler is None else self._sampler.state_dict(),
            "steps_taken": self._steps_taken,
            "ledger": ledger_position,
            "max_grad_norm": self.max_grad_norm,
            "noise_multiplier": self.noise_multiplier,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a checkpoint written by :meth:`state_dict`.

        The ledger must be the run's own ledger continued from its file
        (``PrivacyLedger(path, resume=True)``):

        * it holds exactly the checkpoint's steps: training continues after them;
        * it holds *more* steps (training went on after the checkpoint, then stopped): those
          steps stay in the ledger and count towards ε — their noise was drawn and their
          results may have been seen — and a warning says how many; nothing is ever dropped.
          The noise generator and the sampler are then reseeded from OS entropy instead of
          restored: restoring them would draw those steps' noise and Poisson samples again,
          and two releases with the same noise reveal the difference of their sums without
          noise while the ledger counts them as independent steps;
        * it holds *fewer* steps: :class:`~dpledger.errors.LedgerStateError`, since ε computed
          from it would leave out steps that were taken.

        Raises:
            InvalidParameterError: not a state dict of this class.
            LedgerStateError: the ledger holds fewer steps than the checkpoint.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("version") != _STATE_VERSION:
            raise InvalidParameterError(
                "state_dict", type(state_dict).__name__, "a DPOptimizer.state_dict()"
            )
        position = state_dict.get("ledger")
        self._check_ledger_open()
        behind = False
        if self._ledger is not None and position is not None:
            have, want = self._ledger.num_steps, int(position["num_steps"])
            behind = have > want
            if have < want:
                raise LedgerStateError(
                    f"the ledger holds {have} steps but the checkpoint was taken after {want}: "
                    "continue the run's own ledger file (PrivacyLedger(path, resume=True) with "
                    f"path {position.get('path')!r}); a ledger missing steps would understate ε"
                )
            if have > want:
                logger.warning(
                    "the ledger holds %d steps recorded after this checkpoint (training went on "
                    "past it before stopping); they stay in the ledger and count towards "
                    "epsilon, because their noise was drawn and their results may have been seen",
                    have - want,
                )
        if self._distributed:  # only rank 0 holds the ledger; the ranks must sample alike
            (flag,) = broadcast_tensors(
                [torch.tensor([int(behind)], dtype=torch.int64, device=self._device)],
                process_group=self._group,
            )
            behind = bool(flag.item())
        self._opt.load_state_dict(state_dict["optimizer"])
        if behind:
            logger.warning(
                "reseeding the noise generator and the batch sampler from OS entropy: "
                "restoring the checkpoint's generator states would repeat the noise and the "
                "samples of the steps recorded after it"
            )
            self._generator.seed()
            if self._sampler is not None:
                self._sampler.reseed(
                    _common_seed(self._group) if self._distributed else secrets.randbits(62)
                )
        else:
            self._generator.set_state(state_dict["noise_generator_state"])
            if self._sampler is not None and state_dict.get("sampler") is not None:
                self._sampler.load_state_dict(state_dict["sampler"])
        self._steps_taken = int(state_dict["steps_taken"])
        self._discard_pending()
        self._reset()

    def __repr__(self) -> str:
        if self._event.is_classic:
            sampling = f"q={self._q!r}, n={self._n}"
        else:
            sampling = self._event.describe()
        return f"DPOptimizer({type(self._opt).__name__}, {sampling}, {self._queries!r})"
