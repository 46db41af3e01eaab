"""The Gaussian sum queries one DP step runs on a model's gradients.

McMahan & Andrew, sections 2–4. A record's gradient is split into G *groups* of parameters; each
group is one Gaussian sum query with its own clip bound S_g and noise σ̃_g (separate clipping),
or, with scales α_j per parameter, a joint scaled query (the group's parameters scaled by 1/α_j
are clipped together to S_g, and block j receives noise α_j σ̃_g). For accounting the step is one
Gaussian query with

    z_eff = (Σ_g (S_g/σ̃_g)²)^(-1/2)                                     (paper Eq. 1),

and the groups are chosen so that z_eff equals the requested noise multiplier z:

* ``groups="all"`` (flat clipping): one group, S = C, σ̃ = z·C.
* ``groups="per_layer"``: one group per module (the parameters named ``<module>.<name>``),
  ``"per_parameter"``: one group per parameter, or a mapping ``{label: [parameter names]}``.
  With G > 1 groups the total bound C is split (``clip_split="equal"``: S_g = C/√G;
  ``"dimension"``: S_g = C·√(d_g/D)) and the noise allocated (``noise_allocation=
  "proportional"``: σ̃_g = z·√G·S_g; ``"dimension"``: σ̃_g = z·√(D/d_g)·S_g), both of which give
  z_eff = z and Σ_g S_g² = C², so every record's whole gradient is still within C.

The clipping *strategy* of every group (flat min(1, S/‖v‖), global 1{‖v‖ ≤ S} of Bu et al., or
automatic S/(‖v‖ + γ)) changes how records are bounded, never the bound: the privacy tuple
(S_g, σ̃_g) and hence the ledger are the same for all three.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms import (
    ClippingStrategy,
    GaussianSumQuery,
    GroupedSumQuery,
    ScaledGaussianSumQuery,
    allocate,
)
from dpledger.mechanisms.allocation import check_allocation_methods
from dpledger.mechanisms.config import FLAT_LABEL
from dpledger.validation import check_non_negative_finite, check_positive_finite

__all__ = ["GradientQueries", "Grouping"]

Grouping = Literal["all", "per_layer", "per_parameter"] | Mapping[str, Sequence[str]]
ROOT_LABEL = "<model>"


def _group_members(
    names: Sequence[str], groups: Any
) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """Labels and member names of each group, validated against the parameter names."""
    if isinstance(groups, str):
        if groups == "all":
            return (FLAT_LABEL,), (tuple(names),)
        if groups == "per_parameter":
            return tuple(names), tuple((n,) for n in names)
        if groups == "per_layer":
            by_module: dict[str, list[str]] = {}
            for n in names:
                module = n.rpartition(".")[0] or ROOT_LABEL
                by_module.setdefault(module, []).append(n)
            return tuple(by_module), tuple(tuple(v) for v in by_module.values())
        raise InvalidParameterError(
            "groups",
            groups,
            "'all', 'per_layer', 'per_parameter' or a mapping {label: [parameter names]}",
        )
    if not isinstance(groups, Mapping) or len(groups) == 0:
        raise InvalidParameterError(
            "groups", groups, "'all', 'per_layer', 'per_parameter' or a non-empty mapping"
        )
    known = set(names)
    seen: dict[str, str] = {}
    labels, members = [], []
    for label, group in groups.items():
        if not isinstance(label, str):
            raise InvalidParameterError("groups", f"<label {label!r}>", "string labels")
        if isinstance(group, str) or not isinstance(group, Sequence) or len(group) == 0:
            raise InvalidParameterError(
                f"groups[{label!r}]", group, "a non-empty sequence of parameter names"
            )
        for n in group:
            if n not in known:
                raise InvalidParameterError(
                    f"groups[{label!r}]", n, f"names of trainable parameters: {list(names)}"
                )
            if n in seen:
                raise InvalidParameterError(
                    f"groups[{label!r}]", n, f"a parameter not already in group {seen[n]!r}"
                )
            seen[n] = label
        labels.append(label)
        members.append(tuple(group))
    missing = [n for n in names if n not in seen]
    if missing:
        raise InvalidParameterError(
            "groups", f"<mapping without {missing}>", "every trainable parameter in one group"
        )
    return tuple(labels), tuple(members)


class GradientQueries:
    """The groups of a model's parameters and the Gaussian sum query of each group.

    Args:
        sizes: ``{parameter name: number of elements}`` for every trainable parameter, in order.
        l2_norm_bound: C > 0, the L2 bound of a record's whole gradient (split over groups).
        noise_multiplier: z ≥ 0, the step's effective noise multiplier (Eq. 1).
        clipping: the clipping strategy of every group: ``"flat"``, ``"global"``, ``"automatic"``
            or a :class:`~dpledger.mechanisms.ClippingStrategy`.
        groups: ``"all"``, ``"per_layer"``, ``"per_parameter"`` or ``{label: [names]}``.
        clip_split: ``"equal"`` or ``"dimension"`` (only with several groups).
        noise_allocation: ``"proportional"`` or ``"dimension"`` (only with several groups).
        scales: optional ``{parameter name: α > 0}`` for joint scaled clipping inside each group
            (parameters not named have α = 1).

    Attributes:
        l2_norm_bound: C.

    Raises:
        InvalidParameterError: naming the bad argument.
    """

    def __init__(
        self,
        sizes: Mapping[str, int],
        *,
        l2_norm_bound: float,
        noise_multiplier: float,
        clipping: ClippingStrategy | str = "flat",
        groups: Grouping = "all",
        clip_split: Literal["equal", "dimension"] = "equal",
        noise_allocation: Literal["proportional", "dimension"] = "proportional",
        scales: Mapping[str, float] | None = None,
    ) -> None:
        self._sizes = dict(sizes)
        names = tuple(self._sizes)
        if not names:
            raise InvalidParameterError("model", "<no trainable parameters>", "a trainable model")
        self.l2_norm_bound = check_positive_finite("l2_norm_bound", l2_norm_bound)
        self.noise_multiplier = check_non_negative_finite("noise_multiplier", noise_multiplier)
        self.clipping = ClippingStrategy.parse(clipping)
        check_allocation_methods(clip_split=clip_split, noise_allocation=noise_allocation)
        self.clip_split = clip_split
        self.noise_allocation = noise_allocation
        self.labels, self.members = _group_members(names, groups)
        self._groups_spec = groups
        alpha: dict[str, float] = {}
        if scales is not None:
            if not isinstance(scales, Mapping):
                raise InvalidParameterError("scales", scales, "a mapping {parameter name: α > 0}")
            for n, a in scales.items():
                if n not in self._sizes:
                    raise InvalidParameterError("scales", n, f"names among {list(names)}")
                alpha[n] = check_positive_finite(f"scales[{n!r}]", a)
        self.scales = alpha
        self.grouped = GroupedSumQuery(self._build())

    def _build(self) -> list[GaussianSumQuery]:
        allocation = allocate(
            l2_norm_bound=self.l2_norm_bound,
            noise_multiplier=self.noise_multiplier,
            dimensions=[sum(self._sizes[n] for n in m) for m in self.members],
            clip_split=self.clip_split,
            noise_allocation=self.noise_allocation,
        )
        bounds, stddevs = allocation.l2_norm_bounds, allocation.noise_stddevs
        queries: list[GaussianSumQuery] = []
        for label, members, s, sigma in zip(
            self.labels, self.members, bounds, stddevs, strict=True
        ):
            alphas = [self.scales.get(n, 1.0) for n in members]
            if any(a != 1.0 for a in alphas):
                queries.append(
                    ScaledGaussianSumQuery(
                        l2_norm_bound=s,
                        noise_stddev=sigma,
                        clipping=self.clipping,
                        label=label,
                        scales=alphas,
                    )
                )
            else:
                queries.append(
                    GaussianSumQuery(
                        l2_norm_bound=s, noise_stddev=sigma, clipping=self.clipping, label=label
                    )
                )
        return queries

    def with_values(self, *, l2_norm_bound: float, noise_multiplier: float) -> GradientQueries:
        """The same grouping and strategy with another C and z."""
        if l2_norm_bound == self.l2_norm_bound and noise_multiplier == self.noise_multiplier:
            return self
        return GradientQueries(
            self._sizes,
            l2_norm_bound=l2_norm_bound,
            noise_multiplier=noise_multiplier,
            clipping=self.clipping,
            groups=self._groups_spec,
            clip_split=self.clip_split,
            noise_allocation=self.noise_allocation,
            scales=self.scales or None,
        )

    @property
    def queries(self) -> tuple[GaussianSumQuery, ...]:
        """One query per group, in the order their events are recorded."""
        return self.grouped.queries

    @property
    def effective_noise_multiplier(self) -> float:
        """z_eff of Eq. 1 for these queries (the requested z up to rounding)."""
        if self.noise_multiplier == 0.0:
            return 0.0
        return self.grouped.effective_noise_multiplier

    @property
    def dimension(self) -> int:
        """D, the number of gradient coordinates."""
        return sum(self._sizes.values())

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{q.label}: S={q.l2_norm_bound:.4g}, σ̃={q.noise_stddev:.4g}" for q in self.queries
        )
        return f"GradientQueries({self.clipping.name}; {parts})"
