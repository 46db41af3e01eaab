"""The ``torch.optim.Optimizer`` surface of :class:`~dpledger.adapters.torch.optimizer.DPOptimizer`.

:class:`OptimizerSurface` is the part of ``DPOptimizer`` that other code reads: the wrapped
optimizer's ``param_groups``, ``state`` and ``defaults`` (delegated, so that learning-rate
schedulers work unchanged), and the optimizer's own properties: the sampling it records (q, n,
the event, the denominator), the ledger, the engine, the noise generator, and the clip bound and
noise multiplier of the next step (settable; the ledger records each step's).

The state it reads is set up by ``DPOptimizer.__init__``: ``_opt``, ``_model``, ``_engine``,
``_ledger``, ``_q``, ``_n``, ``_denominator``, ``_event``, ``_sampler``, ``_generator``,
``_device``, ``_queries``, ``_query_cache`` and ``_steps_taken``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpledger.adapters.torch.backend import check_generator_device
from dpledger.adapters.torch.engine import PerExampleGradientEngine
from dpledger.adapters.torch.sampler_base import RecordedBatchSampler
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger, SamplingEvent
from dpledger.mechanisms.gradient_queries import GradientQueries
from dpledger.validation import check_non_negative_finite, check_positive_finite

__all__ = ["OptimizerSurface"]


class OptimizerSurface:
    """The optimizer surface and properties of
    :class:`~dpledger.adapters.torch.optimizer.DPOptimizer` (a base class of it; see the module
    docstring)."""

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
        self._noise_seeding = "caller_generator"
        self._note_provenance()

    @property
    def l2_norm_bound(self) -> float:
        """C, the clip bound of the next step (settable; the ledger records each step's)."""
        return self._queries.l2_norm_bound

    @l2_norm_bound.setter
    def l2_norm_bound(self, value: float) -> None:
        self._set_queries(value, self._queries.noise_multiplier)

    def _set_queries(self, l2_norm_bound: float, noise_multiplier: float) -> None:
        key = (
            check_positive_finite("l2_norm_bound", l2_norm_bound),
            check_non_negative_finite("noise_multiplier", noise_multiplier),
        )
        queries = self._query_cache.get(key)
        if queries is None:
            queries = self._queries.with_values(
                l2_norm_bound=l2_norm_bound, noise_multiplier=noise_multiplier
            )
            if len(self._query_cache) >= 16:
                self._query_cache.pop(next(iter(self._query_cache)))
            self._query_cache[(queries.l2_norm_bound, queries.noise_multiplier)] = queries
        self._queries = queries

    @property
    def noise_multiplier(self) -> float:
        """z of the next step (settable; the ledger records each step's σ̃)."""
        return self._queries.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self._set_queries(self._queries.l2_norm_bound, value)

    @property
    def queries(self) -> GradientQueries:
        """The groups and their Gaussian sum queries (S_g, σ̃_g) used by the next step."""
        return self._queries

    @property
    def steps_taken(self) -> int:
        """Number of DP steps released by this optimizer (including resumed ones)."""
        return self._steps_taken
