"""What the PyTorch audits share: the digits data, the planted noise bug and one DP-SGD run.

Used by :mod:`dpledger.audit.torch_audit` (the distinguishing-game audits) and
:mod:`dpledger.audit.torch_one_run` (the one-run white-box audit); imports torch.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, TypeVar, cast

import attrs
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger.accountants import calibrate_noise_multiplier
from dpledger.adapters.torch.backend import TorchBackend
from dpledger.adapters.torch.optimizer import DPOptimizer
from dpledger.adapters.torch.poisson import PoissonBatchSampler
from dpledger.adapters.torch.sampler_base import RecordedBatchSampler
from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.steps import CompressedLedger
from dpledger.validation import check_positive_finite, check_positive_int, check_probability

__all__ = ["IMPLEMENTATIONS", "CalibratedAuditConfig", "UndernoisedDPOptimizer", "digits_records"]

IMPLEMENTATIONS = ("correct", "batch_size_bug")
"""``"correct"``: :class:`DPOptimizer`; ``"batch_size_bug"``: :class:`UndernoisedDPOptimizer`."""

_NUM_CLASSES = 10
_NUM_FEATURES = 64


# ---------------------------------------------------------------------------------- the bug
class UndernoisedDPOptimizer(DPOptimizer):
    """A deliberately broken :class:`DPOptimizer`: noise σ̃/B drawn, σ̃ recorded. Audits only.

    This is the bug Tramèr et al. (2022, §4) found in a published implementation: the sensitivity
    of the *averaged* gradient was taken to be C/B although each record's clipped gradient already
    has norm up to C, so the noise was B times too small. Here every Gaussian sum query draws
    N(0, (σ̃/B)² I) while the ledger records (S, σ̃) exactly as the correct optimizer does, so its
    ledger claims the same ε. A privacy audit must refute that claim. The bug is planted through
    the optimizer's documented override point :meth:`DPOptimizer.add_noise`.

    Args:
        optimizer: the optimizer to wrap (as for :class:`DPOptimizer`).
        noise_divisor: B; None uses the expected batch size q·n.
        **kwargs: the keyword arguments of :class:`DPOptimizer`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_divisor: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(optimizer, **kwargs)
        divisor = (
            self.expected_batch_size
            if noise_divisor is None
            else check_positive_finite("noise_divisor", noise_divisor)
        )
        self.noise_divisor = float(divisor)
        self._plain_noise = TorchBackend()

    def add_noise(
        self, sums: list[torch.Tensor], *, stddevs: list[float], generator: torch.Generator
    ) -> list[torch.Tensor]:
        """The bug: each array + N(0, (σ̃/B)² I), one draw per array, while σ̃ is recorded."""
        return [
            self._plain_noise.add_gaussian_noise(
                x, stddev=sd / self.noise_divisor, generator=generator
            )
            for x, sd in zip(sums, stddevs, strict=True)
        ]


# ---------------------------------------------------------------------------------- data
@functools.lru_cache(maxsize=8)
def _digits(num_records: int | None) -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - scikit-learn is in the test extra
        raise ImportError(
            "the digits audits need scikit-learn (pip install 'dpledger[examples]')"
        ) from err
    data = load_digits()
    x = np.asarray(data.data, dtype=np.float64) / 16.0
    y = np.asarray(data.target, dtype=np.int64)
    if num_records is not None:
        x, y = x[:num_records], y[:num_records]
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


def digits_records(num_records: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The first ``num_records`` of scikit-learn's 1797 digits (all when None), pixels in [0, 1].

    Returns:
        (features, labels): read-only arrays of shapes (n, 64) and (n,), cached per process.
    """
    if num_records is not None:
        num_records = check_positive_int("num_records", num_records)
        if num_records > 1797:
            raise InvalidParameterError("num_records", num_records, "at most 1797 (or None)")
    return _digits(num_records)


@functools.lru_cache(maxsize=8)
def _digits_tensors(num_records: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = digits_records(num_records)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)


# ---------------------------------------------------------------------------------- configs
def _implementation(value: Any) -> str:
    if value not in IMPLEMENTATIONS:
        raise InvalidParameterError("implementation", value, f"one of {IMPLEMENTATIONS}")
    return str(value)


def _optional_records(value: Any) -> int | None:
    if value is None:
        return None
    n = check_positive_int("num_records", value)
    if n > 1797:
        raise InvalidParameterError("num_records", value, "at most 1797 (or None)")
    return n


def _optional_threads(value: Any) -> int | None:
    return None if value is None else check_positive_int("torch_threads", value)


def _class_label(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidParameterError("canary_label", value, "a class index in [0, 10)")
    if not 0 <= value < _NUM_CLASSES:
        raise InvalidParameterError("canary_label", value, "a class index in [0, 10)")
    return int(value)


def _sampling_probability(value: Any) -> float:
    q = check_probability("sampling_probability", value)
    if q == 0.0:
        raise InvalidParameterError("sampling_probability", value, "a probability in (0, 1]")
    return q


def _noise(value: Any) -> float:
    return check_positive_finite("noise_multiplier", value)


def _positive(name: str, default: float) -> Any:
    """An attrs field of a positive finite number, refused under ``name`` otherwise."""
    return attrs.field(default=default, converter=functools.partial(check_positive_finite, name))


def _positive_int(name: str, default: int) -> Any:
    """An attrs field of a positive integer, refused under ``name`` otherwise."""
    return attrs.field(default=default, converter=functools.partial(check_positive_int, name))


def _check_canary_norm(config: Any) -> None:
    """Refuse a gradient canary of norm M < C: clipping must leave exactly C of it."""
    if config.canary_norm < config.l2_norm_bound:
        raise InvalidParameterError(
            "canary_norm",
            config.canary_norm,
            f"at least l2_norm_bound = {config.l2_norm_bound:g} (so that clipping leaves "
            "exactly C)",
        )


# ---------------------------------------------------------------------------------- runs
def _set_threads(threads: int | None) -> None:
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _seeds(seed: Any) -> tuple[int, int]:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise InvalidParameterError("seed", seed, "an integer >= 0")
    sampling, noise = np.random.SeedSequence(int(seed)).spawn(2)
    return (
        int(sampling.generate_state(1, np.uint64)[0] >> np.uint64(1)),
        int(noise.generate_state(1, np.uint64)[0] >> np.uint64(1)),
    )


def _check_claim(ledger: PrivacyLedger, claimed: CompressedLedger, seed: int) -> None:
    """Raise unless the run's ledger records the claimed steps (same q, z up to rounding, T)."""
    got = ledger.compressed().runs
    want = claimed.runs
    same = len(got) == len(want) and all(
        g.sampling_probability == w.sampling_probability
        and g.count == w.count
        and math.isclose(g.noise_multiplier, w.noise_multiplier, rel_tol=1e-12)
        for g, w in zip(got, want, strict=False)
    )
    if not same:
        raise LedgerStateError(
            f"the run with seed {seed} recorded the steps {[attrs.astuple(r) for r in got]} "
            f"(q, z, count), not the audited claim {[attrs.astuple(r) for r in want]}: every run "
            "of an audit must claim the same ε"
        )


def _optimizer_class(implementation: str) -> type[DPOptimizer]:
    return UndernoisedDPOptimizer if implementation == "batch_size_bug" else DPOptimizer


def _train(
    *,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_of: Any,
    sampling_probability: float,
    steps: int,
    noise_multiplier: float,
    l2_norm_bound: float,
    learning_rate: float,
    implementation: str,
    seed: int,
    make_sampler: Callable[[int], RecordedBatchSampler] | None = None,
    passes: int = 1,
    neighboring: str = "add_remove",
    on_step: Callable[[list[int]], None] | None = None,
) -> PrivacyLedger:
    """DP-SGD steps on (x, y); returns the run's ledger.

    By default T steps on Poisson samples (one pass of a ``PoissonBatchSampler`` with q and T).
    ``make_sampler(sampling_seed)`` builds another recorded sampler instead, iterated ``passes``
    times (epochs) into a ledger of relation ``neighboring``; ``on_step(batch)`` is called after
    every step (empty ones too).
    """
    sampling_seed, noise_seed = _seeds(seed)
    sampler = (
        PoissonBatchSampler(
            population_size=int(y.shape[0]),
            sampling_probability=sampling_probability,
            steps=steps,
            seed=sampling_seed,
        )
        if make_sampler is None
        else make_sampler(sampling_seed)
    )
    ledger = PrivacyLedger(neighboring=neighboring)
    optimizer = _optimizer_class(implementation)(
        torch.optim.SGD(model.parameters(), lr=learning_rate),
        model=model,
        l2_norm_bound=l2_norm_bound,
        noise_multiplier=noise_multiplier,
        sampler=sampler,
        ledger=ledger,
        seed=noise_seed,
    )
    for indices in (i for _ in range(passes) for i in sampler):
        optimizer.zero_grad()
        if not indices:
            optimizer.empty_step()
        else:
            batch = torch.tensor(indices, dtype=torch.int64)
            optimizer.backward(loss_of(model(x[batch]), batch))
            optimizer.step()
        if on_step is not None:
            on_step(indices)
    optimizer.detach()
    return ledger


def _zero_linear(width: int = _NUM_FEATURES) -> nn.Linear:
    """The audits' model: a linear map of ``width`` features to the 10 classes, no bias, all
    weights zero (so the final weights are the sum of the updates)."""
    model = nn.Linear(width, _NUM_CLASSES, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


def _canary_loss(
    labels: torch.Tensor, is_canary: torch.Tensor
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The audits' loss of a batch (record indices): cross-entropy for the data, and for a
    gradient canary minus its label's logit, whose gradient is the canary's input in its
    label's row whatever the weights (the crafted gradient of the white-box audits)."""

    def loss_of(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        target = labels[batch]
        ce = F.cross_entropy(output, target, reduction="none")
        canary_loss = -output.gather(1, target.unsqueeze(1)).squeeze(1)
        return torch.where(is_canary[batch], canary_loss, ce).mean()

    return loss_of


def _train_with_canaries(
    config: Any,
    model: nn.Module,
    *,
    x: torch.Tensor,
    y: torch.Tensor,
    is_canary: torch.Tensor,
    sampling_probability: float,
    seed: int,
    **options: Any,
) -> PrivacyLedger:
    """:func:`_train` with the :func:`_canary_loss` and the audit configuration's noise
    multiplier, clip bound, learning rate, implementation and (unless ``options`` give
    ``steps``) steps; ``options`` are passed on."""
    options.setdefault("steps", config.steps)
    return _train(
        model=model,
        x=x,
        y=y,
        loss_of=_canary_loss(y, is_canary),
        sampling_probability=sampling_probability,
        noise_multiplier=config.noise_multiplier,
        l2_norm_bound=config.l2_norm_bound,
        learning_rate=config.learning_rate,
        implementation=config.implementation,
        seed=seed,
        **options,
    )


_Config = TypeVar("_Config", bound="CalibratedAuditConfig")


class CalibratedAuditConfig:
    """Base of the digits audits' configurations: :meth:`for_target_epsilon`.

    A subclass is an attrs class with a ``noise_multiplier`` field, ``steps`` and
    ``sampling_probability`` (a property returning 1.0 for full batches).
    """

    @classmethod
    def for_target_epsilon(
        cls: type[_Config],
        *,
        target_epsilon: float,
        delta: float,
        accountant: str = "rdp",
        **settings: Any,
    ) -> _Config:
        """The configuration whose z is the smallest that keeps the run within (ε, δ).

        z comes from :func:`~dpledger.accountants.calibrate_noise_multiplier` for the
        configuration's q and T; ``settings`` are the other attributes.

        Raises:
            InvalidParameterError: ``settings`` hold a ``noise_multiplier``.
        """
        if "noise_multiplier" in settings:
            raise InvalidParameterError(
                "noise_multiplier", settings["noise_multiplier"], "not given with target_epsilon"
            )
        probe: Any = cls(noise_multiplier=1.0, **settings)  # type: ignore[call-arg]
        z = float(
            calibrate_noise_multiplier(
                target_epsilon=target_epsilon,
                delta=delta,
                sampling_probability=probe.sampling_probability,
                steps=probe.steps,
                accountant=accountant,
            ).value
        )
        return cast(_Config, attrs.evolve(probe, noise_multiplier=z))


def _blank_feature(num_records: int | None) -> int:
    """k: the first pixel that is blank in every one of the first ``num_records`` digits."""
    x, _ = digits_records(num_records)
    dead = np.flatnonzero(np.all(x == 0.0, axis=0))
    if dead.size == 0:  # pragma: no cover - pixel 0 is blank in every digit
        raise InvalidParameterError("num_records", num_records, "digits with an always-blank pixel")
    return int(dead[0])
