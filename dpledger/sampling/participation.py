"""Participation schemas: how often, and how far apart, one record may enter the stream.

A batch selection's participation pattern: the sampling concept that a correlated-noise release
(:mod:`dpledger.mechanisms.correlated`) is analysed under and that a cyclic draw
(:class:`~dpledger.sampling.CyclicScheme`) produces.

The sensitivity of a matrix mechanism (``docs/correlated-noise.md``) is a maximum over the
*participation patterns* a schema allows: the sets Π ⊂ {0, …, T−1} of steps in which one record
contributes. Three schemas (Choquette-Choo et al. 2023, "Multi-Epoch Matrix Factorization
Mechanisms for Private Machine Learning", section 2):

* ``single``: every record participates at most once (one pass, no sampling);
* ``min_separation`` ("b-min-sep"): at most k times, any two participations at least b steps
  apart;
* ``cyclic``: every epoch, at a fixed offset: Π = {i, i + b, i + 2b, …} ∩ [0, T) for one
  offset i < b (the data cut into b fixed batches, visited in the same order every epoch).
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_allocation, check_enum, check_positive_int

__all__ = ["ParticipationKind", "ParticipationSchema", "count_patterns"]


class ParticipationKind(str, enum.Enum):
    """Which participation patterns a schema allows (module docstring)."""

    SINGLE = "single"
    MIN_SEPARATION = "min_separation"
    CYCLIC = "cyclic"


def _kind(value: Any) -> ParticipationKind:
    return check_enum("kind", value, ParticipationKind)


@attrs.frozen
class ParticipationSchema:
    """The participation patterns of one record over a stream of ``num_steps`` steps.

    Args:
        kind: ``"single"``, ``"min_separation"`` or ``"cyclic"``.
        num_steps: T, the length of the stream.
        max_participations: k, the most steps one record enters (1 for ``single``; for
            ``cyclic`` it must be ⌈T / b⌉, the participations of offset 0).
        min_separation: b, the least distance between two participations (``min_separation``)
            or the period (``cyclic``); 1 for ``single``.

    Raises:
        InvalidParameterError: a value out of range, or parameters that contradict the kind.
    """

    kind: ParticipationKind = attrs.field(converter=_kind)
    num_steps: int = attrs.field(converter=lambda v: check_positive_int("num_steps", v))
    max_participations: int = attrs.field(
        converter=lambda v: check_positive_int("max_participations", v)
    )
    min_separation: int = attrs.field(converter=lambda v: check_positive_int("min_separation", v))

    def __attrs_post_init__(self) -> None:
        t, k, b = self.num_steps, self.max_participations, self.min_separation
        if self.kind is ParticipationKind.SINGLE:
            if k != 1:
                raise InvalidParameterError("max_participations", k, "1 for kind='single'")
            if b != 1:
                raise InvalidParameterError("min_separation", b, "1 for kind='single'")
        if b > t:
            raise InvalidParameterError("min_separation", b, f"at most num_steps={t}")
        if (k - 1) * b >= t:
            raise InvalidParameterError(
                "max_participations",
                k,
                f"a number of participations that fits: (k - 1) * {b} < num_steps={t}",
            )
        if self.kind is ParticipationKind.CYCLIC and k != -(-t // b):
            raise InvalidParameterError(
                "max_participations", k, f"ceil(num_steps / min_separation) = {-(-t // b)}"
            )

    @classmethod
    def single(cls, *, num_steps: int) -> ParticipationSchema:
        """Every record participates at most once in ``num_steps`` steps."""
        return cls(ParticipationKind.SINGLE, num_steps, 1, 1)

    @classmethod
    def min_separation_schema(
        cls, *, num_steps: int, max_participations: int, min_separation: int
    ) -> ParticipationSchema:
        """At most ``max_participations`` times, at least ``min_separation`` steps apart."""
        return cls(ParticipationKind.MIN_SEPARATION, num_steps, max_participations, min_separation)

    @classmethod
    def cyclic(cls, *, num_steps: int, period: int) -> ParticipationSchema:
        """Every ``period`` steps at a fixed offset (one pass over b fixed batches per epoch)."""
        return cls(ParticipationKind.CYCLIC, num_steps, -(-num_steps // period), period)

    def patterns(self) -> list[tuple[int, ...]]:
        """Every maximal pattern for ``cyclic`` and ``single`` (T and b of them); for
        ``min_separation`` every pattern of exactly min(k, fit) steps — exponentially many, meant
        for small T (exact searches and tests).

        Raises:
            ComputationBudgetError: the patterns would exceed
                :data:`~.strategies.MAX_MATRIX_BYTES` (refused before they are listed).
        """
        t, k, b = self.num_steps, self.max_participations, self.min_separation
        count = count_patterns(self)
        steps = k * count if self.kind is ParticipationKind.MIN_SEPARATION else t
        # a pointer and an int object per step, a tuple header per pattern
        advice = "the patterns are listed one by one (for small T): use fewer steps"
        check_allocation("num_steps", t, 40 * steps + 64 * count, advice)
        if self.kind is ParticipationKind.SINGLE:
            return [(i,) for i in range(t)]
        if self.kind is ParticipationKind.CYCLIC:
            return [tuple(range(i, t, b)) for i in range(b)]
        out: list[tuple[int, ...]] = []

        def extend(prefix: tuple[int, ...], start: int) -> None:
            if len(prefix) == k or start >= t:
                out.append(prefix)
                return
            for j in range(start, t):
                extend((*prefix, j), j + b)

        extend((), 0)
        return out


def count_patterns(schema: ParticipationSchema) -> int:
    """The number of maximal participation patterns (what an exhaustive search visits).

    Raises:
        ComputationBudgetError: for ``min_separation``, T so large that the two tables of
            counts (T + b Python integers each) would exceed
            :data:`~dpledger.validation.MAX_MATRIX_BYTES`.
    """
    t, k, b = schema.num_steps, schema.max_participations, schema.min_separation
    if schema.kind is ParticipationKind.SINGLE:
        return t
    if schema.kind is ParticipationKind.CYCLIC:
        return b
    check_allocation("num_steps", t, 2 * 40 * (t + b + 1), "the counts are tabulated per step")
    # ways[c][i]: maximal patterns of ≤ c more steps starting at or after step i
    prev = [1] * (t + b + 1)
    for _ in range(k):
        cur = [1] * (t + b + 1)
        cur[t] = 0
        for i in range(t - 1, -1, -1):
            cur[i] = cur[i + 1] + prev[i + b]
        cur[t] = 1
        prev = cur
    return prev[0]
