"""The Gaussian sum queries one DP step runs on a model's gradient: groups, bounds, noise.

McMahan & Andrew, sections 2–4. A record's gradient is split into G *groups* of parameters (of a
PyTorch model) or trainable variables (of a Keras model); each group is one Gaussian sum query
with its own clip bound S_g and noise σ̃_g (separate clipping), or, with scales α_j per
parameter, a joint scaled query (the group's parameters scaled by 1/α_j are clipped together to
S_g, and block j receives noise α_j σ̃_g). For accounting the step is one Gaussian query with

    z_eff = (Σ_g (S_g/σ̃_g)²)^(-1/2)                                     (paper Eq. 1),

and the groups are chosen so that z_eff equals the requested noise multiplier z:

* ``groups="all"`` (flat clipping): one group, labelled
  :data:`~dpledger.mechanisms.config.FLAT_LABEL`, S = C, σ̃ = z·C.
* ``groups="per_layer"``: one group per owning layer (the adapter says which layer owns each
  parameter: the PyTorch module path, the Keras layer path), ``"per_parameter"``: one group per
  parameter, or a mapping ``{label: [names]}``. With G > 1 groups the total bound C is split
  (``clip_split="equal"``: S_g = C/√G; ``"dimension"``: S_g = C·√(d_g/D)) and the noise
  allocated (``noise_allocation="proportional"``: σ̃_g = z·√G·S_g; ``"dimension"``:
  σ̃_g = z·√(D/d_g)·S_g), both of which give z_eff = z and Σ_g S_g² = C², so every record's
  whole gradient is still within C.
* ``queries``: explicit queries, one per group, for anything else.

The clipping *strategy* of every group (flat min(1, S/‖v‖), global 1{‖v‖ ≤ S} of Bu et al., or
automatic S/(‖v‖ + γ)) changes how records are bounded, never the bound: the privacy tuple
(S_g, σ̃_g) and hence the ledger are the same for all three.

Both adapters build their queries here from the ordered ``{name: number of elements}`` of the
model's trainable parameters (PyTorch: ``model.named_parameters()``; Keras: the variable paths of
``model.trainable_variables``). :class:`AdapterSettings` holds what an adapter was asked for
(a :class:`~dpledger.mechanisms.DPConfig`, or explicit queries).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.allocation import allocate, check_allocation_methods
from dpledger.mechanisms.clipping import ClippingStrategy, check_clip_margin
from dpledger.mechanisms.config import FLAT_LABEL, DPConfig, check_groups, check_strategy
from dpledger.mechanisms.construction_checks import config_with_noise
from dpledger.mechanisms.grouped import GroupedSumQuery
from dpledger.mechanisms.sum_query import GaussianSumQuery, ScaledGaussianSumQuery
from dpledger.validation import check_non_negative_finite, check_positive_finite

__all__ = [
    "SETTING_KEYWORDS",
    "AdapterSettings",
    "GradientQueries",
    "adapter_settings",
    "settings_of_arguments",
]


def _positions(
    names: Sequence[str],
    groups: Any,
    layers: Mapping[str, str] | None,
    aliases: Mapping[str, str],
) -> tuple[list[str], list[list[int]]]:
    """Labels and member positions of each group, validated against the names."""
    groups = check_groups("groups", "all" if groups is None else groups)
    if groups == "all":
        return [FLAT_LABEL], [list(range(len(names)))]
    if groups == "per_parameter":
        return list(names), [[j] for j in range(len(names))]
    if groups == "per_layer":
        if layers is None or any(n not in layers for n in names):
            raise InvalidParameterError(
                "layers", layers, "the owning layer of every parameter, with groups='per_layer'"
            )
        by_layer: dict[str, list[int]] = {}
        for j, n in enumerate(names):
            by_layer.setdefault(layers[n], []).append(j)
        return list(by_layer), list(by_layer.values())
    assert isinstance(groups, Mapping)
    position = {n: j for j, n in enumerate(names)}
    position.update((a, position[n]) for a, n in aliases.items() if n in position)
    members: list[list[int]] = []
    seen: dict[int, str] = {}
    for label, group in groups.items():
        indices = []
        for name in group:
            if name not in position:
                raise InvalidParameterError(
                    f"groups[{label!r}]",
                    name,
                    f"the name of a trainable parameter or variable (one of {list(names)})",
                )
            j = position[name]
            if j in seen:
                raise InvalidParameterError(
                    f"groups[{label!r}]",
                    name,
                    f"a parameter in no other group (also in group {seen[j]!r})",
                )
            seen[j] = label
            indices.append(j)
        members.append(indices)
    missing = [n for j, n in enumerate(names) if j not in seen]
    if missing:
        raise InvalidParameterError(
            "groups", f"<mapping without {missing}>", "every trainable parameter in one group"
        )
    return list(groups), members


def _check_queries(queries: Any, positions: list[list[int]]) -> list[GaussianSumQuery]:
    if isinstance(queries, GaussianSumQuery):
        queries = [queries]
    if isinstance(queries, (str, bytes)) or not isinstance(queries, Sequence):
        raise InvalidParameterError("queries", queries, "a sequence of GaussianSumQuery")
    query_list = list(queries)
    if len(query_list) != len(positions):
        raise InvalidParameterError(
            "queries", f"{len(query_list)} queries", f"one per group ({len(positions)})"
        )
    for g, (q, m) in enumerate(zip(query_list, positions, strict=True)):
        if isinstance(q, ScaledGaussianSumQuery) and len(q.scales) != len(m):
            raise InvalidParameterError(
                f"queries[{g}].scales", q.scales, f"one scale per parameter of group {g}"
            )
    return query_list


class GradientQueries:
    """The groups of a model's parameters and the Gaussian sum query of each group.

    Args:
        sizes: ``{name: number of elements}`` for every trainable parameter (or variable), in
            the order of the gradients.
        l2_norm_bound: C > 0, the L2 bound of a record's whole gradient (split over groups).
        noise_multiplier: z ≥ 0, the step's effective noise multiplier (Eq. 1); z = 0 adds no
            noise and is recorded as such (ε = ∞).
        clipping: the clipping strategy of every group: ``"flat"``, ``"global"``, ``"automatic"``
            or a :class:`~dpledger.mechanisms.clipping.ClippingStrategy`.
        groups: ``"all"`` (None too), ``"per_layer"``, ``"per_parameter"`` or
            ``{label: [names]}`` (the labels are the ledger's labels).
        clip_split: ``"equal"`` or ``"dimension"`` (only with several groups).
        noise_allocation: ``"proportional"`` or ``"dimension"`` (only with several groups).
        scales: optional ``{name: α > 0}`` for joint scaled clipping: given, every group is a
            :class:`~dpledger.mechanisms.ScaledGaussianSumQuery` (parameters not named have
            α = 1).
        queries: explicit queries, one per group, instead of ``l2_norm_bound``,
            ``noise_multiplier`` and ``scales`` (which must then be None).
        layers: ``{name: key of its owning layer}``, required by ``groups="per_layer"`` (each
            layer key is its group's label).
        aliases: other names accepted for a parameter in a ``groups`` mapping
            (``{alias: name}``: a Keras variable's ``name`` where it is unique).

    Attributes:
        labels: the groups' labels, in the order their events are recorded.
        members: for each group, the names of its parameters.
        positions: for each group, the positions of its parameters in ``sizes``.
        group_of: for each parameter (by position), the index of its group.
        grouped: the :class:`~dpledger.mechanisms.GroupedSumQuery`.
        l2_norm_bound: C (None with explicit ``queries``).
        noise_multiplier: z (None with explicit ``queries``).
        scales: the α of the parameters given in ``scales``.

    Raises:
        InvalidParameterError: naming the bad argument.
    """

    def __init__(
        self,
        sizes: Mapping[str, int],
        *,
        l2_norm_bound: float | None = None,
        noise_multiplier: float | None = None,
        clipping: ClippingStrategy | str = "flat",
        groups: Any = "all",
        clip_split: str = "equal",
        noise_allocation: str = "proportional",
        scales: Mapping[str, float] | None = None,
        queries: Sequence[GaussianSumQuery] | None = None,
        layers: Mapping[str, str] | None = None,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        self._sizes = dict(sizes)
        names = tuple(self._sizes)
        if not names:
            raise InvalidParameterError("model", "<no trainable parameters>", "a trainable model")
        self._layers, self._aliases = layers, dict(aliases or {})
        self._groups_spec = groups
        labels, positions = _positions(names, groups, layers, self._aliases)
        self.labels = tuple(labels)
        self.positions = tuple(tuple(m) for m in positions)
        self.members = tuple(tuple(names[j] for j in m) for m in positions)
        group_of = [0] * len(names)
        for g, m in enumerate(positions):
            for j in m:
                group_of[j] = g
        self.group_of = tuple(group_of)
        self.clipping = ClippingStrategy.parse(clipping)
        self.clip_split, self.noise_allocation = clip_split, noise_allocation
        self.l2_norm_bound: float | None = None
        self.noise_multiplier: float | None = None
        self.scales: dict[str, float] = {}
        self._scaled = scales is not None
        if queries is not None:
            if l2_norm_bound is not None or noise_multiplier is not None or scales is not None:
                raise InvalidParameterError(
                    "queries",
                    "given with l2_norm_bound/noise_multiplier/scales",
                    "either explicit queries or l2_norm_bound and noise_multiplier, not both",
                )
            self.grouped = GroupedSumQuery(_check_queries(queries, positions))
            return
        if l2_norm_bound is None:
            raise InvalidParameterError("l2_norm_bound", None, "a clip bound S > 0")
        if noise_multiplier is None:
            raise InvalidParameterError("noise_multiplier", None, "a noise multiplier z >= 0")
        self.l2_norm_bound = check_positive_finite("l2_norm_bound", l2_norm_bound)
        self.noise_multiplier = check_non_negative_finite("noise_multiplier", noise_multiplier)
        check_allocation_methods(clip_split=clip_split, noise_allocation=noise_allocation)
        if scales is not None:
            if not isinstance(scales, Mapping):
                raise InvalidParameterError("scales", scales, "a mapping {name: α > 0}")
            for n, a in scales.items():
                if n not in self._sizes:
                    raise InvalidParameterError("scales", n, f"names among {list(names)}")
                self.scales[n] = check_positive_finite(f"scales[{n!r}]", a)
        self.grouped = GroupedSumQuery(self._build())

    def _build(self) -> list[GaussianSumQuery]:
        assert self.l2_norm_bound is not None and self.noise_multiplier is not None
        allocation = allocate(
            l2_norm_bound=self.l2_norm_bound,
            noise_multiplier=self.noise_multiplier,
            dimensions=[sum(self._sizes[n] for n in m) for m in self.members],
            clip_split=self.clip_split,
            noise_allocation=self.noise_allocation,
        )
        queries: list[GaussianSumQuery] = []
        for label, members, s, sigma in zip(
            self.labels,
            self.members,
            allocation.l2_norm_bounds,
            allocation.noise_stddevs,
            strict=True,
        ):
            if self._scaled:
                alphas = [self.scales.get(n, 1.0) for n in members]
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

    @classmethod
    def of_config(
        cls,
        sizes: Mapping[str, int],
        config: DPConfig,
        *,
        layers: Mapping[str, str] | None = None,
        aliases: Mapping[str, str] | None = None,
    ) -> GradientQueries:
        """The queries of ``config`` (its :meth:`~dpledger.mechanisms.DPConfig.query_arguments`)
        over the parameters of ``sizes``."""
        return cls(sizes, **config.query_arguments(), layers=layers, aliases=aliases)

    def with_values(self, *, l2_norm_bound: float, noise_multiplier: float) -> GradientQueries:
        """The same groups and strategy with another C and z.

        Raises:
            InvalidParameterError: these queries were given explicitly (they have no C and z).
        """
        if self.l2_norm_bound is None:
            raise InvalidParameterError(
                "queries", "<explicit queries>", "queries built from l2_norm_bound and z"
            )
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
            scales=self.scales if self._scaled else None,
            layers=self._layers,
            aliases=self._aliases,
        )

    @property
    def queries(self) -> tuple[GaussianSumQuery, ...]:
        """One query per group, in the order their events are recorded."""
        return self.grouped.queries

    @property
    def effective_noise_multiplier(self) -> float:
        """z_eff of Eq. 1 for these queries (the requested z up to rounding)."""
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


@attrs.frozen
class AdapterSettings:
    """What an adapter was asked for (see :func:`adapter_settings`).

    Attributes:
        config: the step's config; None with explicit ``queries`` (which take none).
        groups: the groups, in the shared vocabulary.
        strategy: the engine's strategy (one of :data:`~dpledger.mechanisms.config.STRATEGIES`).
        clip_margin: ρ, or None (by dtype).
        explicit: with explicit ``queries``, the keywords of :class:`GradientQueries`.
    """

    config: DPConfig | None
    groups: Any
    strategy: str
    clip_margin: float | None
    explicit: Mapping[str, Any] | None = None

    def queries_for(self, sizes: Mapping[str, int], **where: Any) -> GradientQueries:
        """The step's queries over the parameters of ``sizes`` (``where``: the ``layers`` and
        ``aliases`` of :class:`GradientQueries`)."""
        if self.config is None:
            return GradientQueries(sizes, groups=self.groups, **(self.explicit or {}), **where)
        return GradientQueries.of_config(sizes, self.config, **where)


def adapter_settings(
    *,
    config: DPConfig | None,
    queries: Any,
    l2_norm_bound: Any,
    groups: Any,
    strategy: Any,
    clip_margin: Any,
    **fields: Any,
) -> AdapterSettings:
    """The settings of an adapter from ``config=``, its keyword arguments (the fields of
    :class:`~dpledger.mechanisms.DPConfig`, None for "not given") or explicit ``queries``.

    Raises:
        InvalidParameterError: a bad argument, ``config`` with a field it covers (or with
            ``queries``), or a config with a target ε instead of a noise multiplier.
    """
    if queries is not None:
        if config is not None:
            raise InvalidParameterError(
                "queries", "<explicit queries>", "None with config= (the config sets them)"
            )
        return AdapterSettings(
            config=None,
            groups="all" if groups is None else groups,
            strategy=check_strategy("strategy", "auto" if strategy is None else strategy),
            clip_margin=check_clip_margin("clip_margin", clip_margin),
            explicit={
                "queries": queries,
                "l2_norm_bound": l2_norm_bound,
                "noise_multiplier": fields.get("noise_multiplier"),
                "scales": fields.get("scales"),
            },
        )
    fields.update(
        l2_norm_bound=l2_norm_bound, groups=groups, strategy=strategy, clip_margin=clip_margin
    )
    config = config_with_noise(
        config,
        calibrate="the Keras adapters take noise_multiplier= (calibrate z for a target with "
        "dpledger.accountants.calibrate_noise_multiplier)",
        **fields,
    )
    return AdapterSettings(
        config=config,
        groups=config.groups,
        strategy=config.strategy,
        clip_margin=config.clip_margin,
    )


SETTING_KEYWORDS = (
    "config",
    "queries",
    "l2_norm_bound",
    "groups",
    "strategy",
    "clip_margin",
    "noise_multiplier",
    "clipping",
    "clip_split",
    "noise_allocation",
    "scales",
)
"""The keyword arguments of the Keras adapters' constructors that make their settings."""


def settings_of_arguments(arguments: Mapping[str, Any]) -> AdapterSettings:
    """:func:`adapter_settings` of a constructor's arguments: the one place where
    :class:`~dpledger.adapters.tensorflow.DPKerasModel` and
    :class:`~dpledger.adapters.tensorflow.PrivateGradients` forward their
    :class:`~dpledger.mechanisms.DPConfig` keywords (:data:`SETTING_KEYWORDS`).

    Args:
        arguments: the constructor's arguments by name (``locals()``; other names are ignored).

    Raises:
        InvalidParameterError: as :func:`adapter_settings`.
    """
    return adapter_settings(**{name: arguments[name] for name in SETTING_KEYWORDS})
