"""What a training run asks for when it trains with correlated noise instead of DP-SGD's.

A :class:`CorrelatedNoiseSpec` names the strategy (tree aggregation, its Honaker variant,
BandMF, BLT), its size (bands, buffers), the stream's length T, the period of the cyclic batches
(``dpledger.sampling.CyclicScheme``) and whether each step Poisson-samples its group
(amplification, BandMF only). The adapters (``noise=`` of the PyTorch ``DPOptimizer`` and
``make_private``, and of ``DPKerasModel``) take one and build from it:

* the factorization A = B·C (:meth:`CorrelatedNoiseSpec.factorization`);
* the cyclic batch selection (:meth:`CorrelatedNoiseSpec.scheme`), whose own
  :meth:`~dpledger.sampling.CyclicScheme.participation` gives the schema and q the release
  records — never the spec's, so what is recorded is what was drawn.

Example:
    >>> from dpledger.mechanisms.correlated import CorrelatedNoiseSpec
    >>> spec = CorrelatedNoiseSpec(strategy="bandmf", num_steps=16, period=4, bands=4,
    ...                            amplified=True, sampling_probability=0.5)
    >>> spec.factorization().kind
    'banded_toeplitz'
    >>> schema, q = spec.scheme(population_size=100, seed=0).participation()
    >>> schema.min_separation, schema.max_participations, q
    (4, 4, 0.5)
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.correlated.strategies import (
    MatrixFactorization,
    optimize_banded_toeplitz,
    optimize_blt,
    tree_factorization,
)
from dpledger.sampling.cyclic import CyclicScheme
from dpledger.sampling.participation import ParticipationSchema
from dpledger.validation import check_enum, check_positive_int, check_probability

__all__ = ["CorrelatedNoiseSpec", "NoiseStrategy"]


class NoiseStrategy(str, enum.Enum):
    """The correlated-noise strategies a run can train with (``docs/correlated-noise.md``)."""

    TREE = "tree"
    TREE_HONAKER = "tree_honaker"
    BANDMF = "bandmf"
    BLT = "blt"


def _bands(value: Any) -> int | None:
    return None if value is None else check_positive_int("bands", value)


def _buffers(value: Any) -> int | None:
    return None if value is None else check_positive_int("buffers", value)


def _strict_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidParameterError("amplified", value, "True or False")
    return value


@attrs.frozen
class CorrelatedNoiseSpec:
    """A correlated-noise mechanism for a training run of ``num_steps`` steps.

    Args:
        strategy: ``"tree"`` (binary-tree aggregation, DP-FTRL), ``"tree_honaker"`` (with
            Honaker's variance reduction), ``"bandmf"`` (the optimised banded Toeplitz C) or
            ``"blt"`` (buffered linear Toeplitz).
        num_steps: T, the steps of the stream (the release covers them all; a step beyond T is
            refused).
        period: the number of fixed groups the records are split into; step t uses group
            t mod period, so a record takes part at most ⌈T / period⌉ times, ``period`` steps
            apart. 1 ≤ period ≤ T.
        bands: b, the bands of C for ``"bandmf"`` (1 ≤ b ≤ T; b ≤ period when amplified);
            None for the other strategies.
        buffers: the buffers of ``"blt"``; None for the other strategies.
        amplified: Poisson-sample each step's group with rate ``sampling_probability``
            (Choquette-Choo et al. 2023, "Amplified Banded Matrix Factorization"); ``"bandmf"``
            only.
        sampling_probability: q in (0, 1] when ``amplified``; None otherwise.

    Raises:
        InvalidParameterError: a value out of range, or a parameter that does not belong to the
            strategy.
    """

    strategy: NoiseStrategy = attrs.field(
        converter=lambda v: check_enum("strategy", v, NoiseStrategy)
    )
    num_steps: int = attrs.field(converter=lambda v: check_positive_int("num_steps", v))
    period: int = attrs.field(converter=lambda v: check_positive_int("period", v))
    bands: int | None = attrs.field(default=None, converter=_bands)
    buffers: int | None = attrs.field(default=None, converter=_buffers)
    amplified: bool = attrs.field(default=False, converter=_strict_bool)
    sampling_probability: float | None = attrs.field(
        default=None,
        converter=lambda v: None if v is None else check_probability("sampling_probability", v),
    )

    def __attrs_post_init__(self) -> None:
        t = self.num_steps
        if self.period > t:
            raise InvalidParameterError("period", self.period, f"at most num_steps={t}")
        banded = self.strategy is NoiseStrategy.BANDMF
        if banded and self.bands is None:
            raise InvalidParameterError("bands", None, "a number of bands for strategy='bandmf'")
        if not banded and self.bands is not None:
            raise InvalidParameterError(
                "bands", self.bands, f"None for strategy={self.strategy.value!r}"
            )
        if self.bands is not None and self.bands > t:
            raise InvalidParameterError("bands", self.bands, f"at most num_steps={t}")
        blt = self.strategy is NoiseStrategy.BLT
        if blt and self.buffers is None:
            raise InvalidParameterError("buffers", None, "a number of buffers for strategy='blt'")
        if not blt and self.buffers is not None:
            raise InvalidParameterError(
                "buffers", self.buffers, f"None for strategy={self.strategy.value!r}"
            )
        if self.amplified:
            if not banded:
                raise InvalidParameterError(
                    "amplified",
                    True,
                    f"False for strategy={self.strategy.value!r} (amplification by sampling "
                    "within cyclic bands holds for BandMF with bands <= period)",
                )
            assert self.bands is not None
            if self.bands > self.period:
                raise InvalidParameterError(
                    "bands", self.bands, f"at most period={self.period} when amplified"
                )
            if self.sampling_probability is None or self.sampling_probability == 0.0:
                raise InvalidParameterError(
                    "sampling_probability",
                    self.sampling_probability,
                    "a probability in (0, 1] when amplified",
                )
        elif self.sampling_probability is not None:
            raise InvalidParameterError(
                "sampling_probability",
                self.sampling_probability,
                "None unless amplified=True",
            )

    def factorization(self) -> MatrixFactorization:
        """The factorization A = B·C of the strategy (optimised ones are cached by size)."""
        if self.strategy is NoiseStrategy.TREE:
            return tree_factorization(self.num_steps)
        if self.strategy is NoiseStrategy.TREE_HONAKER:
            return tree_factorization(self.num_steps, honaker=True)
        if self.strategy is NoiseStrategy.BANDMF:
            assert self.bands is not None
            return optimize_banded_toeplitz(num_steps=self.num_steps, bands=self.bands)
        assert self.buffers is not None
        return optimize_blt(num_steps=self.num_steps, buffers=self.buffers)

    def schema(self) -> ParticipationSchema:
        """The cyclic participation schema of the spec (what its scheme's draws satisfy)."""
        return ParticipationSchema.cyclic(num_steps=self.num_steps, period=self.period)

    def scheme(self, *, population_size: int, seed: int) -> CyclicScheme:
        """The cyclic batch selection of the spec over ``population_size`` records.

        Args:
            population_size: n, at least ``period``.
            seed: the seed of the partition and of the Poisson draws.
        """
        return CyclicScheme(
            population_size=population_size,
            period=self.period,
            num_steps=self.num_steps,
            sampling_probability=self.sampling_probability if self.amplified else None,
            seed=seed,
        )

    def matches(self, scheme: CyclicScheme) -> bool:
        """Whether ``scheme`` draws what this spec asks for (period, T and q)."""
        q = self.sampling_probability if self.amplified else None
        return (scheme.period, scheme.num_steps, scheme.sampling_probability) == (
            self.period,
            self.num_steps,
            q,
        )

    def describe(self) -> str:
        """The spec in one line, e.g. ``bandmf(bands=4, T=16, period=4, q=0.5)``."""
        size = (
            f"bands={self.bands}, "
            if self.bands is not None
            else f"buffers={self.buffers}, "
            if self.buffers is not None
            else ""
        )
        q = f", q={self.sampling_probability!r}" if self.amplified else ""
        return f"{self.strategy.value}({size}T={self.num_steps}, period={self.period}{q})"
