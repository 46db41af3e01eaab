"""One call from a model, an optimizer and a data set to a DP training setup.

:func:`make_private` returns the model (with the per-example gradient engine attached), the
:class:`~dpledger.adapters.torch.optimizer.DPOptimizer` wrapping the given optimizer, and a
data loader whose batch sampler's events are the ones the optimizer records (Poisson by default;
fixed-size, truncated Poisson, balls-in-bins or shuffled batches with ``sampling=``), so that an
existing loop over ``data_loader`` with ``loss.backward(); optimizer.step()`` trains with DP and
leaves a ledger. A DataLoader given to it is never accounted by its own batches: see
:func:`make_private` for what happens to each kind of loader.

The noise multiplier is given, or chosen for a target (ε, δ) by
:func:`calibrated_noise_multiplier`, which asks
:func:`~dpledger.accountants.calibrate_noise_multiplier` for the smallest z whose ε after the
planned number of steps is at most the target. An *epoch* is round(1/q) steps (n records in
expectation), the Poisson data loader's default length.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

import attrs
import numpy as np
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from dpledger.accountants import Accountant, CalibrationResult, calibrate_noise_multiplier
from dpledger.adapters.torch.batch_samplers import (
    BallsInBinsBatchSampler,
    FixedSizeBatchSampler,
    ShuffleBatchSampler,
    TruncatedPoissonBatchSampler,
    private_data_loader,
)
from dpledger.adapters.torch.distributed import DistributedPoissonBatchSampler, distributed_world
from dpledger.adapters.torch.optimizer import DPOptimizer
from dpledger.adapters.torch.poisson import EmptyBatchCollate, PoissonBatchSampler
from dpledger.adapters.torch.sampler_base import RecordedBatchSampler
from dpledger.adapters.torch.user_level import UserPoissonBatchSampler
from dpledger.adapters.torch.virtual_batches import virtual_batches
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.intent import INTENT_KEY, note_intent, run_intent
from dpledger.mechanisms.config import DPConfig, l2_norm_bound_alias
from dpledger.sampling.relations import default_relation
from dpledger.sampling.validation import check_sampling_probability, default_steps
from dpledger.validation import (
    check_positive_finite,
    check_positive_int,
    warn_if_delta_too_large,
)

__all__ = [
    "SAMPLING_SCHEMES",
    "PrivateTraining",
    "calibrated_noise_multiplier",
    "make_private",
    "steps_per_epoch",
]


_log = logging.getLogger(__name__)


def steps_per_epoch(sampling_probability: float) -> int:
    """round(1/q) (at least 1): the steps in which Poisson sampling sees n records on average."""
    return default_steps(1.0 / check_sampling_probability(sampling_probability))


def _planned_steps(sampling_probability: float, steps: int | None, epochs: float | None) -> int:
    if (steps is None) == (epochs is None):
        raise InvalidParameterError(
            "steps", steps, "exactly one of steps= and epochs= (the length of the run)"
        )
    if steps is not None:
        return check_positive_int("steps", steps)
    e = check_positive_finite("epochs", epochs)
    return max(1, round(e * steps_per_epoch(sampling_probability)))


def calibrated_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sampling_probability: float,
    steps: int | None = None,
    epochs: float | None = None,
    accountant: str | Accountant = "prv",
) -> float:
    """The smallest noise multiplier z (to 0.1%) whose ε at δ after the run is ≤ the target.

    Args:
        target_epsilon: ε to meet.
        delta: δ in (0, 1).
        sampling_probability: q of every step.
        steps: T, the number of steps; or
        epochs: the number of epochs (T = epochs·round(1/q)).
        accountant: the accountant that decides (default ``"prv"``: its certified upper
            bound, the tightest valid one).

    Raises:
        InvalidParameterError: bad arguments, or a target no z ≤ 10⁴ reaches.
    """
    return float(
        _calibration(
            target_epsilon=target_epsilon,
            delta=delta,
            sampling_probability=sampling_probability,
            steps=steps,
            epochs=epochs,
            accountant=accountant,
        ).value
    )


def _calibration(
    *,
    target_epsilon: float,
    delta: float,
    sampling_probability: float,
    steps: int | None,
    epochs: float | None,
    accountant: str | Accountant,
) -> CalibrationResult:
    q = check_sampling_probability(sampling_probability)
    t = _planned_steps(q, steps, epochs)
    return calibrate_noise_multiplier(
        target_epsilon=target_epsilon,
        delta=delta,
        sampling_probability=q,
        steps=t,
        accountant=accountant,
    )


class PrivateTraining(NamedTuple):
    """What :func:`make_private` returns."""

    model: nn.Module
    optimizer: DPOptimizer
    data_loader: Iterable[Any]


def _seeds(seed: int | None) -> tuple[int | None, int | None]:
    if seed is None:
        return None, None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidParameterError("seed", seed, "an integer or None")
    sampling, noise = np.random.SeedSequence(seed).spawn(2)
    return int(sampling.generate_state(1, np.uint64)[0] >> 1), int(
        noise.generate_state(1, np.uint64)[0] >> 1
    )


_CONFIG_OPTIONS = (
    "clipping",
    "groups",
    "clip_split",
    "noise_allocation",
    "scales",
    "strategy",
    "clip_margin",
)
"""The DPOptimizer keyword arguments among ``options`` that are :class:`DPConfig` fields."""

SAMPLING_SCHEMES = ("poisson", "fixed_size", "truncated_poisson", "balls_in_bins", "shuffle")
"""The values of :func:`make_private`'s ``sampling``."""

_ANALYSED = (
    "pass the data set itself (or a DataLoader with shuffle=True or shuffle=False) and choose "
    "an analysed scheme with sampling= ('poisson': PoissonBatchSampler; 'fixed_size': "
    "FixedSizeBatchSampler; 'truncated_poisson': TruncatedPoissonBatchSampler; "
    "'balls_in_bins': BallsInBinsBatchSampler; 'shuffle': ShuffleBatchSampler)"
)


class _LoaderSettings(NamedTuple):
    dataset: Dataset
    kwargs: dict[str, Any]
    batch_size: int | None
    drop_last: bool


def _check_loader_sampler(sampler: Any) -> None:
    """Refuse a loader's sampler that make_private cannot replace by an analysed scheme without
    changing what the user asked for, naming the sampler to use instead."""
    if type(sampler) is SequentialSampler:
        return
    if type(sampler) is RandomSampler:
        if sampler.replacement:
            raise InvalidParameterError(
                "data",
                "<DataLoader with RandomSampler(replacement=True)>",
                "a loader without replacement: a batch drawn with replacement (a record may be "
                "in it twice) is not a scheme any accountant analyses; use sampling="
                "'fixed_size' (FixedSizeBatchSampler: b distinct records per step) or "
                "sampling='poisson' (PoissonBatchSampler), and pass the data set itself",
            )
        if sampler._num_samples is not None:
            raise InvalidParameterError(
                "data",
                f"<DataLoader with RandomSampler(num_samples={sampler._num_samples})>",
                "a loader whose epoch is one permutation of the whole data set (no num_samples)"
                f"; {_ANALYSED}",
            )
        return
    if isinstance(sampler, WeightedRandomSampler):
        raise InvalidParameterError(
            "data",
            "<DataLoader with WeightedRandomSampler>",
            "a loader with equal-probability sampling: records drawn with unequal weights "
            "(and with replacement) are not a scheme any accountant analyses, and make_private "
            f"cannot keep the weights; {_ANALYSED}",
        )
    if isinstance(sampler, DistributedSampler):
        raise InvalidParameterError(
            "data",
            "<DataLoader with DistributedSampler>",
            "the data set (or a non-distributed loader): one rank's shard of a DistributedSampler "
            "is not a sample of the whole data set; under torch.distributed make_private "
            "builds a DistributedPoissonBatchSampler, which splits one global Poisson sample "
            "over the ranks",
        )
    raise InvalidParameterError(
        "data",
        f"<DataLoader with sampler {type(sampler).__name__}>",
        f"a loader whose sampling make_private can reproduce; the draws of a "
        f"{type(sampler).__name__} have no recorded scheme. Either {_ANALYSED}, or build the "
        "loader with private_data_loader(dataset, sampler=...) and give it to "
        "DPOptimizer(sampler=...)",
    )


def _loader_settings(data: Any) -> _LoaderSettings:
    """The data set and the settings make_private reuses from ``data``, with the batch size and
    drop_last of a DataLoader; refuses a loader whose sampling it cannot reproduce."""
    if not isinstance(data, DataLoader):
        if isinstance(data, Dataset) and not isinstance(data, IterableDataset):
            return _LoaderSettings(data, {}, None, False)
        raise InvalidParameterError(
            "data", type(data).__name__, "a map-style Dataset or a DataLoader over one"
        )
    if isinstance(data.dataset, IterableDataset):
        raise InvalidParameterError(
            "data",
            f"<DataLoader over {type(data.dataset).__name__}>",
            "a DataLoader over a map-style data set (records that can be drawn by index)",
        )
    inner = data.batch_sampler
    batch_size: int | None = None
    drop_last = False
    if isinstance(inner, UserPoissonBatchSampler):
        raise InvalidParameterError(
            "data",
            "<DataLoader with batch_sampler UserPoissonBatchSampler>",
            "a record-level loader: make_private builds a record-level sampler and would drop "
            "the user-level sampling; for user-level DP give the loader to "
            "DPOptimizer(sampler=...) directly",
        )
    if isinstance(inner, RecordedBatchSampler):
        batch_size = getattr(inner, "batch_size", None)
        drop_last = bool(getattr(inner, "drop_last", False))
    elif inner is None:  # batch_size=None: one record at a time
        _check_loader_sampler(data.sampler)
    elif type(inner) is BatchSampler:
        _check_loader_sampler(inner.sampler)
        batch_size, drop_last = inner.batch_size, inner.drop_last
    else:
        raise InvalidParameterError(
            "data",
            f"<DataLoader with batch_sampler {type(inner).__name__}>",
            f"a loader whose batching make_private can reproduce; the batches of a "
            f"{type(inner).__name__} have no recorded scheme. Either {_ANALYSED}, or build the "
            "loader with private_data_loader(dataset, sampler=...) and give it to "
            "DPOptimizer(sampler=...)",
        )
    collate = data.collate_fn
    if isinstance(collate, EmptyBatchCollate):
        collate = collate._collate_fn
    kwargs = {"num_workers": data.num_workers, "pin_memory": data.pin_memory, "collate_fn": collate}
    return _LoaderSettings(data.dataset, kwargs, batch_size, drop_last)


def _build_sampler(
    sampling: str,
    n: int,
    *,
    q: float | None,
    batch_size: int | None,
    drop_last: bool,
    max_batch_size: int | None,
    num_batches: int | None,
    seed: int | None,
) -> RecordedBatchSampler:
    def need(name: str, value: Any, what: str) -> Any:
        if value is None:
            raise InvalidParameterError(name, None, f"{what} for sampling={sampling!r}")
        return value

    if sampling == "poisson":
        return PoissonBatchSampler(population_size=n, sampling_probability=q, seed=seed)
    if sampling == "truncated_poisson":
        return TruncatedPoissonBatchSampler(
            population_size=n,
            sampling_probability=q,
            max_batch_size=need("max_batch_size", max_batch_size, "the cap m"),
            seed=seed,
        )
    if sampling == "balls_in_bins":
        if num_batches is None and batch_size is not None:
            num_batches = -(-n // check_positive_int("batch_size", batch_size))
        k = need("num_batches", num_batches, "k (or batch_size=, for k = ⌈n / b⌉)")
        return BallsInBinsBatchSampler(population_size=n, num_batches=k, seed=seed)
    b = need("batch_size", batch_size, "b (or a DataLoader with a batch_size)")
    if sampling == "fixed_size":
        return FixedSizeBatchSampler(population_size=n, batch_size=b, seed=seed)
    return ShuffleBatchSampler(population_size=n, batch_size=b, drop_last=drop_last, seed=seed)


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Dataset | DataLoader,
    *,
    config: DPConfig | None = None,
    l2_norm_bound: float | None = None,
    sampling_probability: float | None = None,
    sampling: str = "poisson",
    batch_size: int | None = None,
    max_batch_size: int | None = None,
    num_batches: int | None = None,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    delta: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    ledger: PrivacyLedger | None = None,
    accountant: str | Accountant | None = None,
    seed: int | None = None,
    max_physical_batch_size: int | None = None,
    loss_reduction: str = "mean",
    max_grad_norm: float | None = None,
    **options: Any,
) -> PrivateTraining:
    """Wrap a model, its optimizer and its data for DP training in one call.

    Example::

        model, optimizer, loader = make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5), train_set,
            sampling_probability=0.02, l2_norm_bound=1.0,
            target_epsilon=8.0, delta=1e-5, epochs=10, ledger=PrivacyLedger("run.dpl"))
        for epoch in range(10):
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()

    The returned loader draws its batches with a recorded batch sampler of the scheme
    ``sampling`` names, and every step records that sampler's event; iterating any other loader
    (your own ``DataLoader``) is refused at ``optimizer.step()`` with
    :class:`~dpledger.errors.SamplerMismatchError` before anything is recorded. Given a
    ``DataLoader``, make_private reuses its data set, collate function and worker settings and
    replaces its sampling; it never records the loader's own batches as Poisson:

    * ``shuffle=True`` (``RandomSampler`` without replacement) or ``shuffle=False``
      (``SequentialSampler``), or a loader of a dpledger batch sampler: replaced by the scheme
      ``sampling`` names, with the loader's ``batch_size`` as b (and ``drop_last`` for
      ``"shuffle"``). The default ``"poisson"`` samples with q = ``sampling_probability``, or
      q = batch_size / n when it is not given; ``sampling="shuffle"`` keeps shuffled batches of
      b and records them truthfully as ``shuffle(b, n)`` (replace-one ledgers, no amplification).
    * ``WeightedRandomSampler``, ``RandomSampler(replacement=True)`` or with ``num_samples``,
      ``DistributedSampler``, any other sampler or batch sampler, an iterable data set:
      :class:`~dpledger.errors.InvalidParameterError` naming the sampler to use instead: their
      draws are no scheme dpledger analyses, and replacing them would silently change them.

    Args:
        model: the model (the per-example gradient engine attaches to it).
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        data: a map-style data set, or a DataLoader over one (see above).
        config: the :class:`~dpledger.mechanisms.DPConfig` of the steps (its ``target_epsilon``
            is calibrated as ``target_epsilon=`` is), instead of ``l2_norm_bound``,
            ``noise_multiplier``, ``target_epsilon``, ``delta``, ``accountant`` and the
            DPConfig fields among ``options``; giving both is an
            :class:`~dpledger.errors.InvalidParameterError`.
        l2_norm_bound: C > 0.
        sampling_probability: q in (0, 1] for ``"poisson"`` and ``"truncated_poisson"``: every
            step includes each record with probability q. Default: batch_size / n (the
            ``batch_size`` argument or the DataLoader's).
        sampling: the sampling scheme of the returned loader: ``"poisson"`` (default,
            :class:`PoissonBatchSampler`), ``"fixed_size"`` (:class:`FixedSizeBatchSampler`, b
            distinct records per step), ``"truncated_poisson"``
            (:class:`TruncatedPoissonBatchSampler`, needs ``max_batch_size``),
            ``"balls_in_bins"`` (:class:`BallsInBinsBatchSampler`, k = ``num_batches`` or
            ⌈n / b⌉) or ``"shuffle"`` (:class:`ShuffleBatchSampler`). Schemes analysed under
            replace-one only (fixed-size, shuffle) need a ledger with
            ``neighboring="replace_one"``; with ``ledger=None`` the optimizer creates one.
        batch_size: b for ``"fixed_size"`` and ``"shuffle"`` (default: the DataLoader's), or to
            derive q (Poisson) or k (balls-in-bins).
        max_batch_size: the cap of ``"truncated_poisson"``.
        num_batches: k of ``"balls_in_bins"``.
        noise_multiplier: z ≥ 0; or, for Poisson sampling only, give ``target_epsilon``,
            ``delta`` and ``epochs`` (or ``steps``) to calibrate it
            (:func:`calibrated_noise_multiplier`).
        target_epsilon: ε to meet at ``delta`` after the planned run.
        delta: δ of the target.
        epochs: planned epochs (round(1/q) steps each), for the calibration.
        steps: planned steps, instead of ``epochs``.
        ledger: the ledger to record into (None: in memory, ``optimizer.ledger``). Under
            ``torch.distributed`` pass it on rank 0 only.
        accountant: the accountant of the calibration (None: ``"prv"``, its certified upper
            bound); it is written into the ledger's metadata.
        seed: seeds the sampling and the noise (two independent streams); None draws both
            from OS entropy (the sampling seed is then shared by rank 0 in distributed runs).
        max_physical_batch_size: split each logical batch into chunks of at most this many
            records (virtual batches; the loop stays the same).
        loss_reduction: ``"mean"`` or ``"sum"``, how the loop's loss combines examples.
        max_grad_norm: deprecated name of ``l2_norm_bound`` (a :class:`DeprecationWarning`).
        **options: further keyword arguments of :class:`DPOptimizer` (``clipping``,
            ``groups``, ``scales``, ``strategy``, ``loss_fn``, ``bam_radius``,
            ``bias_callback``, …).

    Returns:
        ``PrivateTraining(model, optimizer, data_loader)``.

    Raises:
        InvalidParameterError: a bad argument, a loader whose sampling cannot be reproduced (see
            above), a scheme other than Poisson under ``torch.distributed`` or with
            ``target_epsilon``, or a ledger whose relation the scheme is not analysed under.
    """
    if sampling not in SAMPLING_SCHEMES:
        raise InvalidParameterError("sampling", sampling, f"one of {SAMPLING_SCHEMES}")
    uses_q = sampling in ("poisson", "truncated_poisson")
    if sampling_probability is not None:
        if not uses_q:
            raise InvalidParameterError(
                "sampling_probability",
                sampling_probability,
                f"None for sampling={sampling!r} (its rate follows from its batch size)",
            )
        check_sampling_probability(sampling_probability)
    if max_physical_batch_size is not None:
        check_positive_int("max_physical_batch_size", max_physical_batch_size)
    bound, spelled = l2_norm_bound_alias(
        l2_norm_bound=l2_norm_bound, old="max_grad_norm", old_value=max_grad_norm
    )
    config = DPConfig.resolve(
        config,
        spelled=spelled,
        l2_norm_bound=bound,
        noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon,
        delta=delta,
        accountant=accountant,
        **{name: options.pop(name) for name in _CONFIG_OPTIONS if name in options},
    )
    for key in ("sampler", "sampling_probability", "population_size", "seed", "generator"):
        if key in options:
            raise InvalidParameterError(key, options[key], "not given: make_private sets it")
    settings = _loader_settings(data)
    dataset, loader_kwargs = settings.dataset, settings.kwargs
    n = len(dataset)  # type: ignore[arg-type]
    if config.delta is not None:
        warn_if_delta_too_large(delta=config.delta, population_size=n)
    b = settings.batch_size if batch_size is None else batch_size
    q = sampling_probability
    if uses_q and q is None:
        if b is None:
            raise InvalidParameterError(
                "sampling_probability",
                None,
                f"q in (0, 1] for sampling={sampling!r} (or batch_size=, for q = batch_size / n)",
            )
        q = check_sampling_probability(check_positive_int("batch_size", b) / n)
        _log.info(
            "sampling_probability not given: q = batch_size / len(dataset) = %d / %d = %r "
            "(each record joins each %s batch with probability q; the batch size varies)",
            b,
            n,
            q,
            sampling.replace("_", " "),
        )
    calibration: CalibrationResult | None = None
    if config.target_epsilon is not None:
        if sampling != "poisson":
            raise InvalidParameterError(
                "target_epsilon",
                config.target_epsilon,
                f"None for sampling={sampling!r}: give noise_multiplier= (the calibration "
                "plans Poisson-sampled steps only)",
            )
        assert q is not None and config.delta is not None
        calibration = _calibration(
            target_epsilon=config.target_epsilon,
            delta=config.delta,
            sampling_probability=q,
            steps=steps,
            epochs=epochs,
            accountant=config.accountant,
        )
        _log.info(
            "noise multiplier %r calibrated by the %s accountant for ε = %g at δ = %g",
            calibration.value,
            calibration.accountant,
            calibration.target_epsilon,
            calibration.delta,
        )
        config = attrs.evolve(
            config, noise_multiplier=float(calibration.value), target_epsilon=None
        )
    sampling_seed, noise_seed = _seeds(seed)
    rank, world = distributed_world(options.get("process_group"))
    distributed = options.get("distributed")
    if distributed is None:
        distributed = world > 1
    batch_sampler: RecordedBatchSampler
    if distributed:
        if sampling != "poisson":
            raise InvalidParameterError(
                "sampling",
                sampling,
                "'poisson' under torch.distributed: only DistributedPoissonBatchSampler draws "
                "one global sample and splits it over the ranks (there is no distributed "
                f"sampler for {sampling!r})",
            )
        batch_sampler = DistributedPoissonBatchSampler(
            population_size=n,
            sampling_probability=q,  # type: ignore[arg-type]
            seed=sampling_seed,
            process_group=options.get("process_group"),
        )
    else:
        batch_sampler = _build_sampler(
            sampling,
            n,
            q=q,
            batch_size=b,
            drop_last=settings.drop_last,
            max_batch_size=max_batch_size,
            num_batches=num_batches,
            seed=sampling_seed,
        )
    loader = private_data_loader(dataset, sampler=batch_sampler, **loader_kwargs)
    if rank == 0:
        intent = run_intent(
            framework="torch",
            framework_version=torch.__version__,
            population_size=n,
            unit=batch_sampler.sampling_event().unit.value,
            noise_multiplier=config.noise_multiplier,
            target_epsilon=None if calibration is None else calibration.target_epsilon,
            delta=config.delta,
            accountant=None if calibration is None else calibration.accountant,
            sampling=sampling,
            sampling_probability=q if uses_q else None,
            steps=None if calibration is None else calibration.steps,
        )
        if ledger is None:
            relation = default_relation(batch_sampler.sampling_event())
            ledger = PrivacyLedger(neighboring=relation, metadata={INTENT_KEY: intent})
            _log.info(
                "no ledger given: recording to an in-memory %s ledger (optimizer.ledger)",
                relation.value,
            )
        else:
            note_intent(ledger, intent)
    dp_optimizer = DPOptimizer(
        optimizer,
        model=model,
        config=config,
        ledger=ledger,
        sampler=loader,
        loss_reduction=loss_reduction,  # type: ignore[arg-type]
        seed=noise_seed,
        **options,
    )
    data_loader: Iterable[Any] = loader
    if max_physical_batch_size is not None:
        data_loader = _VirtualLoader(loader, dp_optimizer, max_physical_batch_size)
    return PrivateTraining(model, dp_optimizer, data_loader)


class _VirtualLoader:
    """A re-iterable view of a loader in physical chunks (see :func:`virtual_batches`)."""

    def __init__(self, loader: DataLoader, optimizer: DPOptimizer, size: int) -> None:
        self.loader = loader
        self.optimizer = optimizer
        self.max_physical_batch_size = check_positive_int("max_physical_batch_size", size)

    @property
    def batch_sampler(self) -> Any:
        """The logical loader's batch sampler."""
        return self.loader.batch_sampler

    def __iter__(self) -> Any:
        return virtual_batches(
            self.loader, self.optimizer, max_physical_batch_size=self.max_physical_batch_size
        )
