"""One call from a model, an optimizer and a data set to a DP training setup.

:func:`make_private` returns the model (with the per-example gradient engine attached), the
:class:`~dpledger.adapters.torch.optimizer.DPOptimizer` wrapping the given optimizer, and a
data loader whose batch sampler's events are the ones the optimizer records (Poisson by default;
fixed-size, truncated Poisson, balls-in-bins or shuffled batches with ``sampling=``), so that an
existing loop over ``data_loader`` with ``loss.backward(); optimizer.step()`` trains with DP and
leaves a ledger. A DataLoader given to it is never accounted by its own batches: see
:func:`make_private` for what happens to each kind of loader.

The noise multiplier is given, or chosen for a target (ε, δ) by
:func:`~dpledger.accountants.calibrate_noise_multiplier`: the smallest z whose ε after the
planned number of steps is at most the target. An *epoch* is round(1/q) steps (n records in
expectation), the Poisson data loader's default length.

:func:`make_private`'s data side (what a DataLoader given to it is turned into, the recorded
batch sampler it builds) is :mod:`~dpledger.adapters.torch.private_loader`.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from typing import Any, NamedTuple

import attrs
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpledger.accountants import Accountant, CalibrationResult, calibrate_noise_multiplier
from dpledger.adapters.torch.batch_samplers import CyclicBatchSampler, private_data_loader
from dpledger.adapters.torch.correlated_stream import check_noise
from dpledger.adapters.torch.distributed import distributed_world
from dpledger.adapters.torch.optimizer import DPOptimizer
from dpledger.adapters.torch.private_loader import _batch_sampler, _loader_settings, _VirtualLoader
from dpledger.adapters.torch.sampler_base import RecordedBatchSampler
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.intent import INTENT_KEY, note_intent, run_intent
from dpledger.mechanisms.config import DPConfig
from dpledger.mechanisms.correlated.spec import CorrelatedNoiseSpec
from dpledger.sampling.relations import default_relation
from dpledger.sampling.validation import check_sampling_probability
from dpledger.validation import (
    check_positive_int,
    warn_if_batch_size_differs,
    warn_if_delta_too_large,
)

__all__ = [
    "SAMPLING_SCHEMES",
    "PrivateTraining",
    "make_private",
]


_log = logging.getLogger(__name__)


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
    noise: Any = "independent",
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
            ``batch_size`` argument or the DataLoader's). Given both, when the mean batch q·n
            and that batch size differ by more than a factor of 2, a ``UserWarning`` says so:
            the batches are q's, not the loader's.
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
        noise_multiplier: z ≥ 0; or, for Poisson or balls-in-bins sampling (amplified), give
            ``target_epsilon``, ``delta``, ``epochs`` or ``steps`` to calibrate it.
        target_epsilon: ε to meet at ``delta`` after the planned run.
        delta: δ of the target.
        epochs: planned epochs (round(1/q) steps each; k for balls-in-bins), for calibration.
        steps: planned steps, instead of ``epochs``.
        ledger: the ledger to record into (None: in memory, ``optimizer.ledger``). Under
            ``torch.distributed`` pass it on rank 0 only.
        accountant: the accountant of the calibration (None: ``"prv"``, its certified upper
            bound); it is written into the ledger's metadata.
        seed: seeds sampling and noise (two streams), for tests and research: the ledger
            records ``caller_seed``, flagged by the CLI (ε holds only while it stays secret).
            None (default): both from OS entropy (rank 0 shares the sampling seed).
            With ``noise=`` a spec, a checkpoint loaded later brings its own scheme and noise.
        max_physical_batch_size: split each logical batch into chunks of at most this many
            records (virtual batches; the loop stays the same).
        loss_reduction: ``"mean"`` or ``"sum"``, how the loop's loss combines examples.
        noise: ``"independent"`` (default, DP-SGD) or a
            :class:`~dpledger.mechanisms.correlated.CorrelatedNoiseSpec`: the returned loader
            is then a :class:`~dpledger.adapters.torch.CyclicBatchSampler`'s (the spec's
            ``period`` groups, whole or Poisson-sampled; ``sampling``,
            ``sampling_probability``, ``batch_size``, ``max_batch_size``, ``num_batches``,
            ``target_epsilon`` and ``max_physical_batch_size`` are refused) and the optimizer
            records one correlated-noise release for the spec's ``num_steps`` steps.
        **options: further keyword arguments of :class:`DPOptimizer` (``clipping``,
            ``groups``, ``scales``, ``strategy``, ``loss_fn``, ``bam_radius``,
            ``bias_callback``, …).

    Returns:
        ``PrivateTraining(model, optimizer, data_loader)``.

    Raises:
        InvalidParameterError: a bad argument, a loader whose sampling cannot be reproduced
            (above), a scheme other than Poisson under ``torch.distributed`` (or other than
            Poisson and balls-in-bins with ``target_epsilon``), a ledger of another relation.
    """
    spec = check_noise(noise)
    if spec is not None:
        _check_correlated_arguments(
            sampling=sampling,
            sampling_probability=sampling_probability,
            batch_size=batch_size,
            max_batch_size=max_batch_size,
            num_batches=num_batches,
            target_epsilon=target_epsilon,
            max_physical_batch_size=max_physical_batch_size,
            config=config,
        )
    uses_q = _check_sampling_arguments(sampling, sampling_probability, max_physical_batch_size)
    config = _resolve_config(
        config,
        options,
        l2_norm_bound=l2_norm_bound,
        noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon,
        delta=delta,
        accountant=accountant,
    )
    settings = _loader_settings(data)
    dataset, loader_kwargs = settings.dataset, settings.kwargs
    n = len(dataset)  # type: ignore[arg-type]
    if config.delta is not None:
        warn_if_delta_too_large(delta=config.delta, population_size=n)
    if spec is not None:
        return _make_correlated(
            model, optimizer, dataset, loader_kwargs, spec, config, ledger, seed, options
        )
    b = settings.batch_size if batch_size is None else batch_size
    q = _sampling_probability(sampling, sampling_probability, b, n)
    k = num_batches  # balls-in-bins: k, or as the sampler derives it from the batch size
    if sampling == "balls_in_bins" and k is None and b is not None:
        k = -(-n // check_positive_int("batch_size", b))
    config, calibration = _calibrated(config, sampling, q, steps, epochs, k, n)
    sampling_seed, noise_seed = _seeds(seed)
    rank, world = distributed_world(options.get("process_group"))
    distributed = world > 1 if options.get("distributed") is None else options["distributed"]
    batch_sampler = _batch_sampler(
        sampling,
        n,
        q=q,
        batch_size=b,
        drop_last=settings.drop_last,
        max_batch_size=max_batch_size,
        num_batches=num_batches,
        seed=sampling_seed,
        distributed=distributed,
        process_group=options.get("process_group"),
    )
    loader = private_data_loader(dataset, sampler=batch_sampler, **loader_kwargs)
    if rank == 0:
        intended_q = q if uses_q else None
        ledger = _ledger_with_intent(
            ledger, batch_sampler, config, calibration, n, sampling, intended_q
        )
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


def _check_correlated_arguments(*, config: DPConfig | None, **given: Any) -> None:
    """Refuse the sampling and calibration arguments that ``noise=`` a spec replaces."""
    defaults = {"sampling": "poisson"}
    for name, value in given.items():
        if value is not None and value != defaults.get(name):
            raise InvalidParameterError(
                name,
                value,
                "not given with noise= a CorrelatedNoiseSpec (the spec's cyclic sampler draws "
                "the batches; calibrate its noise multiplier on its release, "
                "docs/correlated-noise.md)",
            )
    if config is not None and config.target_epsilon is not None:
        raise InvalidParameterError(
            "config.target_epsilon",
            config.target_epsilon,
            "None with noise= a CorrelatedNoiseSpec: give noise_multiplier=",
        )


def _make_correlated(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: Dataset,
    loader_kwargs: dict[str, Any],
    spec: CorrelatedNoiseSpec,
    config: DPConfig,
    ledger: PrivacyLedger | None,
    seed: int | None,
    options: dict[str, Any],
) -> PrivateTraining:
    """make_private with ``noise=`` a spec: the spec's cyclic loader and the optimizer."""
    n = len(dataset)  # type: ignore[arg-type]
    sampling_seed, noise_seed = _seeds(seed)
    if sampling_seed is None:
        sampling_seed = secrets.randbits(62)
    sampler = CyclicBatchSampler.for_spec(spec, population_size=n, seed=sampling_seed)
    if seed is None:
        sampler._seeding = "os_entropy"  # the seed above came from the OS, not the caller
    loader = private_data_loader(dataset, sampler=sampler, **loader_kwargs)
    dp_optimizer = DPOptimizer(
        optimizer,
        model=model,
        config=config,
        ledger=ledger,
        sampler=loader,
        seed=noise_seed,
        noise=spec,
        **options,
    )
    return PrivateTraining(model, dp_optimizer, loader)


def _check_sampling_arguments(
    sampling: str, sampling_probability: float | None, max_physical_batch_size: int | None
) -> bool:
    """Refuse an unknown scheme, a q the scheme does not use and a bad chunk size; returns
    whether the scheme samples with a rate q (Poisson and truncated Poisson)."""
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
    return uses_q


def _resolve_config(
    config: DPConfig | None,
    options: dict[str, Any],
    *,
    l2_norm_bound: float | None,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    delta: float | None,
    accountant: str | Accountant | None,
) -> DPConfig:
    """The steps' DPConfig, from ``config`` or from the arguments and the DPConfig fields among
    ``options`` (which are taken out of it); refuses the DPOptimizer arguments that
    make_private sets itself."""
    config = DPConfig.resolve(
        config,
        l2_norm_bound=l2_norm_bound,
        noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon,
        delta=delta,
        accountant=accountant,
        **{name: options.pop(name) for name in _CONFIG_OPTIONS if name in options},
    )
    for key in ("sampler", "sampling_probability", "population_size", "seed", "generator"):
        if key in options:
            raise InvalidParameterError(key, options[key], "not given: make_private sets it")
    return config


def _sampling_probability(
    sampling: str, sampling_probability: float | None, b: int | None, n: int
) -> float | None:
    """q as given or, for a scheme with a rate, batch_size / n (logged); None otherwise."""
    uses_q = sampling in ("poisson", "truncated_poisson")
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
    elif uses_q and q is not None and b is not None:
        warn_if_batch_size_differs(sampling_probability=q, batch_size=b, population_size=n)
    return q


def _calibrated(
    config: DPConfig,
    sampling: str,
    q: float | None,
    steps: int | None,
    epochs: float | None,
    num_batches: int | None,
    population_size: int,
) -> tuple[DPConfig, CalibrationResult | None]:
    """``config`` with z calibrated for its ``target_epsilon`` (Poisson, or balls-in-bins with
    ``num_batches``), and the calibration; ``config`` unchanged and None without a target."""
    calibration: CalibrationResult | None = None
    if config.target_epsilon is not None:
        if sampling not in ("poisson", "balls_in_bins"):
            raise InvalidParameterError(
                "target_epsilon",
                config.target_epsilon,
                f"None for sampling={sampling!r}: give noise_multiplier= (the calibration "
                "plans Poisson or balls-in-bins steps only)",
            )
        assert config.delta is not None
        bins = sampling == "balls_in_bins"
        if bins and num_batches is None:
            raise InvalidParameterError("num_batches", None, "k (or batch_size=) to calibrate")
        calibration = calibrate_noise_multiplier(  # prv has no analysis of balls-in-bins
            target_epsilon=config.target_epsilon,
            delta=config.delta,
            sampling_probability=None if bins else q,
            num_batches=num_batches if bins else None,
            population_size=population_size if bins else None,
            steps=steps,
            epochs=epochs,
            accountant=None if bins and config.accountant == "prv" else config.accountant,
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
    return config, calibration


def _ledger_with_intent(
    ledger: PrivacyLedger | None,
    batch_sampler: RecordedBatchSampler,
    config: DPConfig,
    calibration: CalibrationResult | None,
    population_size: int,
    sampling: str,
    sampling_probability: float | None,
) -> PrivacyLedger:
    """The ledger to record into (a new in-memory one for None), with the run's intent in its
    metadata (rank 0 only)."""
    intent = run_intent(
        framework="torch",
        framework_version=torch.__version__,
        population_size=population_size,
        unit=batch_sampler.sampling_event().unit.value,
        noise_multiplier=config.noise_multiplier,
        target_epsilon=None if calibration is None else calibration.target_epsilon,
        delta=config.delta,
        accountant=None if calibration is None else calibration.accountant,
        sampling=sampling,
        sampling_probability=sampling_probability,
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
    return ledger
