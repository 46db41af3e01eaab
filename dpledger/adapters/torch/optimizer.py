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

The step is split along its data flow (``DPOptimizer`` inherits each part; docs/architecture.md,
"Package map"): :mod:`~dpledger.adapters.torch.gradient_source` (the engine with the
forward guard and the record-independence probe, or the functional path),
:mod:`~dpledger.adapters.torch.accumulation` (clipping, virtual batches, user-level sums),
:mod:`~dpledger.adapters.torch.release` (the noisy release and the ledger's events),
:mod:`~dpledger.adapters.torch.checkpoint`, :mod:`~dpledger.adapters.torch.optimizer_surface`
(``param_groups``, ``state``, ``defaults`` and the properties) and
:mod:`~dpledger.adapters.torch.construction_checks`. This module holds the construction (with
the documentation of every argument), ``step``, ``empty_step`` and ``zero_grad``.

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

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpledger.adapters.torch.accumulation import ClippedSumAccumulation
from dpledger.adapters.torch.backend import noise_source
from dpledger.adapters.torch.checkpoint import OptimizerCheckpoint
from dpledger.adapters.torch.construction_checks import (
    check_optimizer_and_model,
    check_step_arguments,
    check_user_level,
    default_clip_margin,
    distributed_setting,
    noise_generator,
    resolve_config,
    resolve_ledger,
    sampling_of,
    trainable_parameters,
)
from dpledger.adapters.torch.correlated_stream import CorrelatedNoiseSetup
from dpledger.adapters.torch.engine import LossReduction, Strategy
from dpledger.adapters.torch.gradient_source import GradientSource
from dpledger.adapters.torch.module_checks import check_module_configuration
from dpledger.adapters.torch.optimizer_surface import OptimizerSurface
from dpledger.adapters.torch.release import NoisyRelease, OptimizerNoiseBackend
from dpledger.adapters.torch.sampler_base import RecordedBatchSampler
from dpledger.adapters.torch.user_level import UserPoissonBatchSampler
from dpledger.errors import EngineStateError, LedgerStateError
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.provenance import seeding_of
from dpledger.mechanisms.clipping import ClippingStrategy
from dpledger.mechanisms.config import DPConfig, Grouping
from dpledger.mechanisms.construction_checks import ledger_location
from dpledger.mechanisms.correlated.spec import CorrelatedNoiseSpec
from dpledger.mechanisms.gradient_queries import GradientQueries

__all__ = ["BiasCallback", "DPOptimizer"]

logger = logging.getLogger(__name__)

BiasCallback = Callable[[int, Any], None]
"""``callback(step_index, ClippingBias)``; see
:data:`dpledger.diagnostics.bias.ClippingBiasCallback`."""


class DPOptimizer(
    CorrelatedNoiseSetup,
    OptimizerSurface,
    GradientSource,
    ClippedSumAccumulation,
    NoisyRelease,
    OptimizerCheckpoint,
    torch.optim.Optimizer,
):
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
        self._init_gradients(model, config, loss_fn, radius, loss_reduction, check_steps)
        if self._engine is not None:
            self._install_hooks(model, check_record_independence)
        self._bias_callback = bias_callback

        # ---- the step being assembled (several chunks with virtual batches)
        self._reset()
        self._final_chunk: bool | None = None
        self._steps_taken = 0
        if self._distributed:
            self._sync_model()

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
        self._ledger = resolve_ledger(ledger, self._event, rank=self._rank)

    def _init_parameters(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, margin: float | None
    ) -> None:
        """The model, the wrapped optimizer, their trainable parameters and the clip margin."""
        check_module_configuration(model)
        self._opt = optimizer
        self._model = model
        self._params, self._device = trainable_parameters(model, optimizer)
        self._tiny = max(torch.finfo(p.dtype).tiny for p in self._params.values())
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
        """The groups and their sum queries, with the layout cache of the clipping."""
        self._queries = GradientQueries.of_config(
            {n: p.numel() for n, p in self._params.items()},
            config,
            # per_layer: one group per module, the parameters named "<module>.<name>"
            layers={n: n.rpartition(".")[0] or "<model>" for n in self._params},
        )
        self._query_cache = {
            (self._queries.l2_norm_bound, self._queries.noise_multiplier): self._queries
        }
        self._names = tuple(self._params)
        self._index_of = {n: i for i, n in enumerate(self._names)}
        self._layouts: dict[int, tuple[GradientQueries, torch.Tensor, torch.Tensor, bool]] = {}

    def _sync_model(self) -> None:
        import torch.distributed as dist

        from dpledger.adapters.torch.distributed import _global_rank

        src = _global_rank(0, self._group)
        with torch.no_grad():
            for t in [*self._model.parameters(), *self._model.buffers()]:
                dist.broadcast(t.data, src=src, group=self._group)

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

    def __repr__(self) -> str:
        sampling = self._describe_sampling()
        return f"DPOptimizer({type(self._opt).__name__}, {sampling}, {self._queries!r})"
