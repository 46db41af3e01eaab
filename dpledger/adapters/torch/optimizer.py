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
   :mod:`~dpledger.mechanisms.gradient_queries`) clip factors f_ig from the group norms with
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

The class holds what the step needs and nothing shares its state (docs/architecture.md,
"Package map"): the per-example gradients come from a
:class:`~dpledger.adapters.torch.gradient_source.GradientSource` (the engine with the forward
guard and the record-independence probe, or the functional path); the step's sequence (claim the
draw → clip factors → sensitivity check → record → noise → average) is the core's
:class:`~dpledger.mechanisms.dp_step.DPStep`, which the optimizer drives over its torch backend;
the torch halves of the clipping and the release are
:mod:`~dpledger.adapters.torch.accumulation` (factors on the device, user-level sums, bias sums)
and :mod:`~dpledger.adapters.torch.release` (grouping the sums, the noise backend). Checkpoints
are :mod:`~dpledger.adapters.torch.checkpoint`, correlated noise
:mod:`~dpledger.adapters.torch.correlated_stream`, the constructor's checks
:mod:`~dpledger.adapters.torch.construction_checks`.

This module is over 500 lines because it holds one class, ``DPOptimizer``, whose construction
documents every argument and whose step (its override points, the accumulation of the clipped
sums over virtual batches, the release on rank 0 and the broadcast) reads and writes the same
state: split by line count, the class was six mixins sharing thirty private attributes.

Override points (subclass ``DPOptimizer``; each method's docstring states its contract and what
the ledger records): :meth:`DPOptimizer.clip` (per-example factors → the batch's clipped sums),
:meth:`DPOptimizer.add_noise` (the noise on the clipped sums, with the σ̃ the ledger records)
and :meth:`DPOptimizer.release` (the whole noisy release: clipped sums → averaged gradients).

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
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from dpledger.adapters.torch.accumulation import (
    BiasSums,
    DeviceFactors,
    refuse_virtual_batches,
    user_gradients,
)
from dpledger.adapters.torch.backend import check_generator_device, noise_source
from dpledger.adapters.torch.checkpoint import OptimizerCheckpoint
from dpledger.adapters.torch.construction_checks import (
    check_optimizer_and_model,
    check_step_arguments,
    check_user_level,
    default_clip_margin,
    distributed_setting,
    noise_generator,
    resolve_config,
    sampling_of,
    trainable_parameters,
)
from dpledger.adapters.torch.correlated_stream import CorrelatedNoiseSetup
from dpledger.adapters.torch.distributed import broadcast_tensors, reduce_tensors, sum_counts
from dpledger.adapters.torch.engine import LossReduction, PerExampleGradientEngine, Strategy
from dpledger.adapters.torch.gradient_source import GradientSource
from dpledger.adapters.torch.module_checks import check_module_configuration
from dpledger.adapters.torch.release import (
    OptimizerNoiseBackend,
    grouped_sums,
    poison_sums,
    ungroup,
)
from dpledger.adapters.torch.sampler_base import RecordedBatchSampler
from dpledger.adapters.torch.sharding import (
    check_sharded_model,
    check_sharded_parameters,
    local_gradient,
    replicated_tensors,
)
from dpledger.adapters.torch.user_level import UserPoissonBatchSampler
from dpledger.errors import (
    EngineStateError,
    InvalidParameterError,
    LedgerStateError,
    NoiseStreamEndError,
    SamplerMismatchError,
)
from dpledger.ledger import PrivacyLedger, SamplingEvent
from dpledger.ledger.provenance import seeding_of
from dpledger.mechanisms.backend import add_noise_to_all
from dpledger.mechanisms.clipping import ClippingStrategy
from dpledger.mechanisms.config import DPConfig, Grouping
from dpledger.mechanisms.construction_checks import ledger_location, step_ledger
from dpledger.mechanisms.correlated.spec import CorrelatedNoiseSpec
from dpledger.mechanisms.dp_step import DPStep
from dpledger.mechanisms.gradient_queries import GradientQueries

__all__ = ["BiasCallback", "DPOptimizer"]

logger = logging.getLogger(__name__)

BiasCallback = Callable[[int, Any], None]
"""``callback(step_index, ClippingBias)``; see
:data:`dpledger.diagnostics.bias.ClippingBiasCallback`."""


class DPOptimizer(CorrelatedNoiseSetup, OptimizerCheckpoint, torch.optim.Optimizer):
    """Differentially private steps with any ``torch.optim.Optimizer``.

    See the module docstring for the step and its semantics, and :meth:`clip`,
    :meth:`add_noise` and :meth:`release` for the points a subclass may override.

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
            ``"automatic"`` (S/(‖v‖ + γ)) or a
            :class:`~dpledger.mechanisms.clipping.ClippingStrategy`.
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
        seed: a seed for a new noise generator (when ``generator`` is None), for tests and
            research (recorded as ``caller_seed``); None seeds from OS entropy.
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
            :class:`~dpledger.errors.RecordDependenceError` if another record's
            module outputs or per-example gradient move. False switches it off (a warning is
            logged: a model that mixes records makes the ledger's ε wrong). The functional path
            (``loss_fn``) needs no probe: it evaluates each example alone.
        distributed: use ``torch.distributed`` (None: when a process group with more than one
            rank is initialised).
        process_group: the process group (None: the default group).
        noise: ``"independent"`` (default, DP-SGD) or a ``CorrelatedNoiseSpec``: correlated
            noise (:mod:`~dpledger.adapters.torch.correlated_stream`).

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
        RecordMixingLayerError: the model has BatchNorm using batch statistics.
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
        bias_callback: BiasCallback | None = None,
        clip_margin: float | None = None,
        user_gradient: Literal["sum", "mean"] = "sum",
        check_steps: int = 1,
        check_record_independence: bool = True,
        distributed: bool | None = None,
        process_group: Any = None,
        noise: str | CorrelatedNoiseSpec = "independent",
    ) -> None:
        # ---- arguments that need no model (construction_checks, in this order)
        check_optimizer_and_model(optimizer, model, wrapper=DPOptimizer)
        config = resolve_config(
            config,
            l2_norm_bound=l2_norm_bound,
            noise_multiplier=noise_multiplier,
            clipping=clipping,
            groups=groups,
            clip_split=clip_split,
            noise_allocation=noise_allocation,
            scales=scales,
            strategy=strategy,
            clip_margin=clip_margin,
        )
        radius = check_step_arguments(
            loss_reduction=loss_reduction,
            loss_fn=loss_fn,
            bam_radius=bam_radius,
            check_record_independence=check_record_independence,
            bias_callback=bias_callback,
        )
        self._distributed, self._rank, self._world = distributed_setting(distributed, process_group)
        self._group = process_group

        # ---- sampling: q and n of the sampler actually used; the ledger (rank 0 only)
        given = (sampler, sampling_probability, population_size)
        if not self._init_stream(noise, *given, ledger, seed):
            self._init_sampler(*given)
            self._init_ledger(ledger)
        check_user_level(self._user_level, user_gradient, bam_radius, bias_callback)
        self._user_gradient = user_gradient

        # ---- model and optimizer must agree on the parameters
        self._init_parameters(model, optimizer, config.clip_margin)
        self._init_queries(config)
        self._check_stream_queries(config)
        self._init_noise(generator, seed, secure=config.secure_noise)
        self._gradients = GradientSource(
            model,
            names=self._names,
            loss_fn=loss_fn,
            bam_radius=radius,
            loss_reduction=loss_reduction,
            strategy=config.strategy,
            check_steps=check_steps,
            sharding=(self._sharded, self._group),
        )
        self._init_engine(check_record_independence)
        self._bias_callback = bias_callback
        self._init_steps()

    def _init_steps(self) -> None:
        """The step being assembled (several chunks with virtual batches) and the step count;
        under ``torch.distributed`` every rank starts from rank 0's model."""
        self._reset()
        self._final_chunk: bool | None = None
        self._steps_taken = 0
        if self._distributed:
            self._sync_model()

    # ------------------------------------------------------------------ construction
    def _init_sampler(
        self,
        sampler: RecordedBatchSampler | DataLoader | None,
        sampling_probability: float | None,
        population_size: int | None,
    ) -> None:
        """The sampler actually used, the event its draws record, and its q and n."""
        self._sampler, self._event = sampling_of(
            sampler,
            sampling_probability,
            population_size,
            distributed=self._distributed,
            world=self._world,
        )
        self._q = self._event.sampling_probability
        self._n = self._event.population_size
        self._user_level = isinstance(self._sampler, UserPoissonBatchSampler)

    def _init_ledger(self, ledger: PrivacyLedger | None) -> None:
        """The average's fixed denominator (the event's) and the ledger (rank 0 only)."""
        denominator = self._event.average_denominator
        assert self._n is not None and denominator is not None
        self._denominator = denominator
        self._ledger = step_ledger(ledger, self._event, rank=self._rank)

    def _init_parameters(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, margin: float | None
    ) -> None:
        """The model, the wrapped optimizer, their trainable parameters and the clip margin."""
        check_module_configuration(model)
        self._opt = optimizer
        self._model = model
        self._params, self._device = trainable_parameters(model, optimizer)
        self._names = tuple(self._params)
        self._sharded = check_sharded_parameters(self._params, world_size=self._world)  # FSDP2
        self._clip_margin = default_clip_margin(self._params) if margin is None else margin

    def _init_noise(
        self, generator: torch.Generator | None, seed: int | None, *, secure: bool = False
    ) -> None:
        """The noise generator on the parameters' device, and the noise source of ``add_noise``
        (the secure sampler's with ``secure``: the queries then record S + γ√d)."""
        self._generator = noise_generator(generator, seed, self._device)
        self._noise_seeding = seeding_of(generator=generator, seed=seed)
        self._backend = OptimizerNoiseBackend(self.add_noise)
        self._noise_source = noise_source(self._backend, secure, self._stream is not None)
        self._note_provenance()

    def _init_queries(self, config: DPConfig) -> None:
        """The groups and their sum queries, in the core step, and the factors on the device."""
        queries = GradientQueries.of_config(
            {n: p.numel() for n, p in self._params.items()},
            config,
            # per_layer: one group per module, the parameters named "<module>.<name>"
            layers={n: n.rpartition(".")[0] or "<model>" for n in self._params},
        )
        self._dp_step = DPStep(queries, ledger=self._ledger, margins=self._clip_margin)
        tiny = max(torch.finfo(p.dtype).tiny for p in self._params.values())
        self._factors = DeviceFactors(
            self._dp_step, names=self._names, device=self._device, tiny=tiny
        )

    def _init_engine(self, check_record_independence: bool) -> None:
        """The engine the gradient source holds, with its forward hooks (the hook path)."""
        self._engine: PerExampleGradientEngine | None = self._gradients.engine
        if self._sharded:  # FSDP2: what needs the full weights after the backward (sharding.py)
            check_sharded_model(self._model, self._engine)
        if self._engine is not None:
            self._gradients.install_hooks(check_record_independence)

    def _sync_model(self) -> None:
        import torch.distributed as dist

        from dpledger.adapters.torch.distributed import _global_rank

        src = _global_rank(0, self._group)
        with torch.no_grad():
            for t in replicated_tensors(self._model):  # FSDP2's shards stay where they are
                dist.broadcast(t.data, src=src, group=self._group)

    # ------------------------------------------------------------------ optimizer surface
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
        self._noise_seeding = "caller_generator"
        self._note_provenance()

    @property
    def _queries(self) -> GradientQueries:
        return self._dp_step.queries

    @property
    def queries(self) -> GradientQueries:
        """The groups and their Gaussian sum queries (S_g, σ̃_g) used by the next step."""
        return self._dp_step.queries

    @property
    def l2_norm_bound(self) -> float:
        """C, the clip bound of the next step (settable; the ledger records each step's)."""
        return self._dp_step.queries.l2_norm_bound

    @l2_norm_bound.setter
    def l2_norm_bound(self, value: float) -> None:
        self._dp_step.set_values(l2_norm_bound=value, noise_multiplier=self.noise_multiplier)

    @property
    def noise_multiplier(self) -> float:
        """z of the next step (settable; the ledger records each step's σ̃)."""
        return self._dp_step.queries.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self._dp_step.set_values(l2_norm_bound=self.l2_norm_bound, noise_multiplier=value)

    @property
    def steps_taken(self) -> int:
        """Number of DP steps released by this optimizer (including resumed ones)."""
        return self._steps_taken

    # ------------------------------------------------------------------ per-example gradients
    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` to the layers' outputs only (a faster ``loss.backward()``).

        Parameters' ``.grad`` is not touched; ``step()`` writes the private gradient.
        """
        self._gradients.backward(loss)

    def compute_gradients(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Functional path: per-example gradients of ``loss_fn`` on a batch (BAM if set).

        Replaces the forward and backward when the optimizer was created with ``loss_fn``.

        Returns:
            The batch's mean loss at the current parameters (detached, for logging; NaN for an
            empty batch).
        """
        return self._gradients.compute_gradients(inputs, targets)

    def detach(self) -> None:
        """Remove the hooks from the model (the optimizer cannot step afterwards)."""
        self._gradients.detach()

    def _pending(self) -> bool:
        return self._gradients.pending

    def _discard_pending(self) -> None:
        self._gradients.discard()

    # ------------------------------------------------------------------ override points
    def clip(
        self, source: Any, factors: dict[tuple[str, ...], torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The clipped sums Σ_i f_ig·g_ig of a batch, per parameter (an override point).

        Called once per batch (once per chunk with virtual batches) after the clip factors
        were computed from the records' group norms with the chosen clipping strategy, on the
        parameters' device in float64, and before the sums are added to the step's. The
        default forms the sums on the device without materialising g_i where the engine can
        (book-keeping).

        Contract: the result holds, for every trainable parameter name, a tensor of the
        parameter's shape, and record i's contribution to group g, Σ_{p in g} f_ig·g_ip, has L2
        norm at most S_g (the clip bound ``queries`` gives the group). The ledger records S_g
        as the sensitivity of each group's sum-query event whatever this method does: the
        release's sensitivity check only bounds the whole sum by |R|·S_g, so an override that
        lets one record contribute more than S_g makes the recorded ε wrong.

        Args:
            source: the batch's per-example gradients: the
                :class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine` (hook path) or
                a :class:`~dpledger.adapters.torch.accumulation.MaterialisedGradients`
                (functional path, user-level vectors), with ``squared_norms()``,
                ``clipped_sum(factors)`` and ``batch_size``.
            factors: ``{group's parameter names: factors of shape (B,)}``, float64 on the
                parameters' device; zero for a record with a non-finite norm.

        Returns:
            ``{parameter name: Σ_i f_ig·g_ip}`` in at least float32, on the parameters' device.
        """
        return source.clipped_sum(factors)

    def release(
        self, sums: list[torch.Tensor], *, num_records: int, event: SamplingEvent
    ) -> list[torch.Tensor]:
        """The whole noisy release of one step: clipped sums in, averaged noisy gradients out
        (an override point).

        The default, on rank 0, is the core's :meth:`~dpledger.mechanisms.dp_step.DPStep.release`:
        each group's sums are validated and sensitivity-checked against |R|·S_g (one read-back
        of their norms), then ``event`` is recorded, then every group's noise is drawn by
        :meth:`add_noise` and one sum-query event (S_g, σ̃_g, label) per group is recorded,
        then each noisy sum is divided by the event's fixed denominator (:attr:`denominator`).
        Under ``torch.distributed`` the other ranks receive rank 0's averages (a broadcast).

        Contract: the ledger holds, once this returns, the sampling event and one sum-query
        event per group whose S_g and σ̃_g are the bound every record's contribution was held
        to and the standard deviation the noise was drawn with; a step refused here (a failed
        sensitivity check, a non-finite sum) raises *before* ``event`` is recorded and leaves
        the ledger unchanged. An override that records anything else makes the ledger's ε wrong.

        Args:
            sums: the step's clipped sums, one per trainable parameter (in the order of the
                model's named parameters), summed over the ranks under ``torch.distributed``.
            num_records: |R|, the records (users with user-level sampling) in the sums.
            event: the sampling event of the draw the step claimed.

        Returns:
            The averaged noisy gradients, one per parameter in the order of ``sums``; the
            optimizer writes them to ``p.grad`` (in the parameter's dtype).
        """
        if self._rank == 0:
            averaged = self._release_on_rank_zero(sums, num_records, event)
        else:
            averaged = [torch.empty_like(s) for s in sums]
        if self._distributed:
            averaged = broadcast_tensors(averaged, process_group=self._group)
        return averaged

    def add_noise(
        self, sums: list[torch.Tensor], *, stddevs: list[float], generator: torch.Generator
    ) -> list[torch.Tensor]:
        """sums_j + N(0, σ̃_j² I) for every array of the step's groups (an override point).

        Called by :meth:`release` through the sum queries, after the sampling event was
        recorded and just before the sum-query events are: ``stddevs`` are the σ̃_g the ledger
        records for those events, whatever this method draws. The default draws the standard
        normals of all arrays in one float64 call on the parameters' device from ``generator``
        (the optimizer's seedable noise generator).

        Contract: return new tensors (``sums`` must not be modified), each ``sums[j]`` plus
        Gaussian noise of standard deviation exactly ``stddevs[j]`` per coordinate, drawn from
        ``generator``. An override that draws less noise than ``stddevs`` says releases more
        than the ledger records: exactly the kind of bug a privacy audit must catch
        (:class:`~dpledger.audit.torch_audit.UndernoisedDPOptimizer` plants one this way).

        Args:
            sums: the arrays to noise: the clipped sums, one flat array per group under
                separate clipping, one per parameter in joint scaled groups.
            stddevs: σ̃ of each array's group, as recorded.
            generator: the noise generator.

        Returns:
            The noisy arrays, in the order of ``sums``.
        """
        return add_noise_to_all(self._noise_source, sums, stddevs=stddevs, generator=generator)

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
        if self._bias is not None:
            self._bias.zeros(self._params)
        self._release_and_update()

    def _check_ledger_open(self) -> None:
        """Refuse a step whose events could not be recorded, before anything is released.

        The ledger can be closed under a running optimizer by its other owner (a second copy of
        the training loop that resumed the same file, a checkpoint routine, a ``with`` block that
        ended); the step would otherwise draw its noise and fail half-way.
        """
        if self._ledger is not None and self._ledger.closed:
            raise LedgerStateError(
                f"the ledger {ledger_location(self._ledger)} was closed while this optimizer was "
                "still recording into it (by another writer, or a with-block that ended): "
                "nothing was released or recorded for this step and the parameters are "
                "unchanged. Call optimizer.zero_grad() to drop the batch, or resume the file "
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

    def virtual_step(self) -> None:
        """Accumulate this chunk's clipped sum into the open logical step (no release)."""
        if self._user_level:
            refuse_virtual_batches()
        self._check_foreign_gradients()
        if not self._pending():
            raise EngineStateError(
                "virtual_step() without a backward since the last step: run the chunk's "
                "forward and loss.backward() first"
            )
        self._absorb_or_drop()

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

    # ------------------------------------------------------------------ clip and accumulate
    def _reset(self) -> None:
        """Forget the step being assembled."""
        self._acc: dict[str, torch.Tensor] | None = None
        self._acc_count = 0
        self._acc_bad: torch.Tensor | None = None
        self._claimed_event: SamplingEvent | None = None
        self._bias = BiasSums() if self._bias_callback is not None else None

    def _absorb_or_drop(self) -> None:
        """Clip the pending batch into the step's sums; on any error (out of memory, a
        module's own error) drop the step.

        Nothing has been released or recorded at this point, so dropping is free of privacy
        cost: the batch's stored activations, per-example results and the chunks of an open
        virtual step are let go (the memory a retry at a smaller batch needs), the batch's draw
        is discarded as by ``zero_grad()``, and the error is raised with a note saying so.
        """
        try:
            self._gradients.run_deferred_probe()  # a compiled forward's probe, before any use
            if self._user_level:
                self._absorb_users()
            else:
                source = self._gradients.current()
                self._clip_and_add(source)
                self._acc_count += source.batch_size
                self._discard_pending()
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

    def _absorb_users(self) -> None:
        """User-level: claim the batch's draw, sum (or average) the per-example gradients of
        each user, clip each user's vector as one and add the clipped sum to the step's sums."""
        assert isinstance(self._sampler, UserPoissonBatchSampler)
        if self._final_chunk is not None or self._acc is not None:
            refuse_virtual_batches()
        source = self._gradients.current()
        try:
            event, users = self._sampler.claim_users(source.batch_size)
        except SamplerMismatchError:
            self._discard_pending()
            self._reset()
            raise
        per_user = user_gradients(
            source,
            users,
            names=self._names,
            device=self._device,
            mean=self._user_gradient == "mean",
        )
        self._clip_and_add(per_user)
        self._acc_count = users.num_users  # the sum query's sample: users, not records
        self._claimed_event = event
        self._discard_pending()

    def _clip_and_add(self, source: Any) -> None:
        """Clip the vectors of ``source`` per group and add their sum to the step's.

        The group norms and clip factors stay on the parameters' device, in float64: no copy to
        the host and no synchronisation. A record whose group norm is not finite (or whose
        squared norm is negative) is counted on the device; the release refuses a step with
        such a record before anything is recorded.
        """
        factors, norms, stacked, bad = self._factors(source.squared_norms())
        self._acc_bad = bad if self._acc_bad is None else self._acc_bad + bad
        members = self._dp_step.queries.members
        mapping = {group: factors[g] for g, group in enumerate(members)}
        with torch.no_grad():
            sums = self.clip(source, mapping)
            if self._acc is None:
                self._acc = {n: sums[n] for n in self._names}
            else:
                torch._foreach_add_(
                    [self._acc[n] for n in self._names], [sums[n] for n in self._names]
                )
            if self._bias is not None:
                self._bias.add(
                    source, names=self._names, stacked=stacked, norms=norms, factors=factors
                )

    # ------------------------------------------------------------------ release
    def _claim_draw(self) -> tuple[str | None, SamplingEvent]:
        """Tie this step to the sampler's draw (see :mod:`~dpledger.adapters.torch.sampler_base`),
        before anything is released or recorded; the step is dropped when refused.

        In one process a mismatch raises :class:`~dpledger.errors.SamplerMismatchError` here.
        Under torch.distributed it is returned instead (the message, or None): every rank must
        learn of any rank's refusal through the step's count collective and raise together,
        or the others would wait in the step's collectives for ever. The event to record is
        returned with it.
        """
        if self._stream is not None:  # a correlated-noise stream: the draw of its next step
            (query,) = self._queries.queries
            try:
                self._stream.check_open()
                self._stream.check_values(
                    l2_norm_bound=query.l2_norm_bound, noise_stddev=query.noise_stddev
                )
                self._sampler.claim_step(self._acc_count, step=self._stream.step)
            except (NoiseStreamEndError, InvalidParameterError, SamplerMismatchError):
                self._reset()
                raise
            return None, self._event
        if self._sampler is None:
            return None, self._event
        if self._claimed_event is not None:
            return None, self._claimed_event
        try:
            event = self._dp_step.claim(self._acc_count, sampler=self._sampler)
        except SamplerMismatchError as exc:
            if not self._distributed:
                self._reset()
                raise
            return str(exc), self._event
        return None, event

    def _release_and_update(self) -> None:
        """Release the step's accumulated sums, write ``p.grad`` and step the wrapped optimizer."""
        assert self._acc is not None
        problem, event = self._claim_draw()
        names = self._names
        sums = [self._acc[n] for n in names]
        count = self._acc_count
        bias = self._bias
        unclipped = None
        if bias is not None and bias.unclipped is not None:
            unclipped = [bias.unclipped[n] for n in names]
        clipped = 0 if bias is None else bias.clipped
        if self._acc_bad is not None:
            poison_sums(sums, self._acc_bad)
        if self._distributed:
            sums, unclipped, count, clipped = self._reduce_over_ranks(
                sums, unclipped, count, clipped, problem
            )
        averaged = self.release(sums, num_records=count, event=event)
        for n, avg in zip(names, averaged, strict=True):
            p = self._params[n]
            p.grad = local_gradient(p, avg)  # this rank's shard under FSDP2
        self._opt.step()
        if bias is not None and self._rank == 0 and count > 0:
            self._report_bias(sums, unclipped, count, clipped, bias)
        self._reset()
        self._steps_taken += 1

    def _reduce_over_ranks(
        self,
        sums: list[torch.Tensor],
        unclipped: list[torch.Tensor] | None,
        count: int,
        clipped: int,
        problem: str | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, int, int]:
        """The counts and the sums (with the unclipped sums of the bias metrics) over the ranks.

        Counts first, on every rank: a rank whose records were not its sampler's draw stops
        every rank before the gradients are reduced or anything is recorded.
        """
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
        sums = reduced[: len(self._names)]
        if unclipped is not None:
            unclipped = reduced[len(self._names) :]
        return sums, unclipped, count, clipped

    def _bad_records(self) -> int:
        """The records of the step whose norm was not finite; a step with any is dropped."""
        bad = 0 if self._acc_bad is None else int(self._acc_bad)
        if bad > 0:
            self._reset()
        return bad

    def _release_on_rank_zero(
        self, sums: list[torch.Tensor], count: int, event: SamplingEvent
    ) -> list[torch.Tensor]:
        """:meth:`release` on the rank that holds the ledger: the core step's release."""
        assert self._ledger is not None
        queries = self._queries
        by_name = dict(zip(self._names, sums, strict=True))
        grouped = grouped_sums(queries, by_name)
        if self._stream is not None:
            return self._release_correlated(queries, by_name, grouped, count)
        averaged = self._dp_step.release(
            grouped,
            num_records=count,
            event=event,
            backend=self._backend,
            generator=self._generator,
            bad_records=self._bad_records,
        )
        return ungroup(queries, by_name, grouped, averaged, self._names)

    def _release_correlated(
        self,
        queries: GradientQueries,
        by_name: dict[str, torch.Tensor],
        grouped: list[list[torch.Tensor]],
        count: int,
    ) -> list[torch.Tensor]:
        """The release of one step of a correlated-noise stream (one group, one vector).

        The sensitivity check of the clipped sum (against |R|·S, as for independent noise)
        comes first; the stream's release is recorded on its first step, after the check and
        before any noise is added; then w_t (float64) is added to the sum in float64 and the
        result, in the sum's dtype, divided by the fixed denominator.
        """
        assert self._stream is not None and self._ledger is not None
        try:
            queries.grouped.prepare(grouped, num_records=count, backend=self._backend)
        except InvalidParameterError:
            bad = self._bad_records()
            if bad > 0:
                raise InvalidParameterError(
                    "per-example gradients",
                    f"{bad} record(s) with a NaN, infinite or negative squared norm",
                    "finite per-example gradients: nothing was released or recorded",
                ) from None
            raise
        (query,) = queries.queries
        ((flat,),) = grouped
        self._stream.record(
            self._ledger,
            l2_norm_bound=query.l2_norm_bound,
            noise_stddev=query.noise_stddev,
            dim=flat.numel(),
            label=query.label,
        )
        t = flat.detach()
        step = self._stream.step
        noisy = self._stream.next_noise(t).add_(t)
        self._sampler.step_released(step)
        noisy = noisy if t.dtype == torch.float64 else noisy.to(t.dtype)
        averaged = noisy * (1.0 / self._denominator)
        return ungroup(queries, by_name, grouped, [averaged], self._names)

    def _report_bias(
        self,
        sums: list[torch.Tensor],
        unclipped: list[torch.Tensor] | None,
        count: int,
        clipped: int,
        bias: BiasSums,
    ) -> None:
        from dpledger.diagnostics.bias import clipping_bias_from_sums

        assert unclipped is not None and self._bias_callback is not None
        norms = None
        if not self._distributed and bias.norms:
            norms = np.concatenate(bias.norms)  # other ranks' norms stay on their ranks
        metrics = clipping_bias_from_sums(
            unclipped_sum=[self._backend.to_host(t).ravel() for t in unclipped],
            clipped_sum=[self._backend.to_host(t).ravel() for t in sums],
            num_examples=count,
            per_example_norms=norms,
            num_clipped=clipped,
            denominator=self._denominator,
        )
        self._bias_callback(self._steps_taken, metrics)

    def __repr__(self) -> str:
        sampling = self._describe_sampling()
        return f"DPOptimizer({type(self._opt).__name__}, {sampling}, {self._queries!r})"
