"""How a model's trainable variables become Gaussian sum queries: groups, bounds, noise.

McMahan & Andrew, sections 2–4. The per-example gradient g_i of a step is split into groups of
trainable variables; every group is one Gaussian sum query with its own privacy tuple
(S_g, σ̃_g), and the step's G queries on one sample are, for accounting, one query with
z_eff = (Σ_g (S_g/σ̃_g)²)^(-1/2) (paper Eq. 1). :func:`gradient_queries` builds them with the
mechanisms' helpers:

* ``groups="all"`` (the default): one group, flat clipping of the whole gradient to S* with
  σ̃ = z·S*;
* ``groups="per_layer"`` (variables grouped by owning layer), ``"per_parameter"`` (one group per
  variable) or an explicit mapping ``{label: [variable paths]}`` (the paths of Keras 3,
  ``variable.path``, e.g. ``"dense_1/kernel"``; a variable's ``name`` where it is unique; the
  labels are the ledger's labels): the clip bound S* is split over the m groups equally
  (S_g = S*/√m, :func:`~dpledger.mechanisms.split_clip_equally`) or by dimension
  (S_g = S*·√(d_g/D), :func:`~dpledger.mechanisms.split_clip_by_dimension`), and the noise is
  allocated proportionally (σ̃_g = z·√G·S_g) or dimension-adjusted (σ̃_g = z·√(D/d_g)·S_g), both
  giving z_eff = z;
* ``scales``: joint scaled clipping within each group (:class:`ScaledGaussianSumQuery`: block j
  scaled by 1/α_j, clipped jointly, noise α_j·σ̃_g on block j);
* ``queries``: explicit queries, one per group, for anything else.

Every strategy of :mod:`dpledger.mechanisms.clipping` can be used within the groups (flat, global,
automatic).

The vocabulary is the PyTorch adapter's and :class:`~dpledger.mechanisms.DPConfig`'s.
``groups=None`` means "not given": one group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms import (
    ClippingStrategy,
    DPConfig,
    GaussianSumQuery,
    GroupedSumQuery,
    ScaledGaussianSumQuery,
    allocate,
)
from dpledger.mechanisms.clipping import check_clip_margin
from dpledger.mechanisms.config import FLAT_LABEL, check_groups, check_strategy
from dpledger.validation import check_non_negative_finite, check_positive_finite

__all__ = ["GradientQueries", "gradient_queries"]

_STRATEGIES = ("auto", "ghost", "generic")


def engine_strategy(strategy: str | None) -> str:
    """The engine's ``strategy`` (``"auto"``, ``"ghost"``, ``"generic"``; None: ``"auto"``).

    Raises:
        InvalidParameterError: a value outside the strategies (``"per_example"`` has no
            TensorFlow engine).
    """
    strategy = check_strategy("strategy", "auto" if strategy is None else strategy)
    if strategy not in _STRATEGIES:
        raise InvalidParameterError(
            "strategy",
            strategy,
            "'auto', 'ghost' or 'generic' with TensorFlow ('generic' materialises the "
            "per-example gradients of any model)",
        )
    return strategy


@attrs.frozen
class AdapterSettings:
    """What a Keras adapter was asked for (see :func:`adapter_settings`).

    Attributes:
        config: the step's config; None with explicit ``queries`` (which take none).
        groups: the groups, in the shared vocabulary.
        strategy: the engine's strategy (``"auto"``, ``"ghost"``, ``"generic"``).
        clip_margin: ρ, or None (by dtype).
        explicit: with explicit ``queries``, the keywords of :func:`gradient_queries`.
    """

    config: DPConfig | None
    groups: Any
    strategy: str
    clip_margin: float | None
    explicit: Mapping[str, Any] | None = None

    def queries_for(self, variables: Sequence[Any]) -> GradientQueries:
        """The step's queries over ``variables``."""
        if self.config is None:
            return gradient_queries(variables, groups=self.groups, **(self.explicit or {}))
        return queries_of(variables, self.config)


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
    """The settings of a Keras adapter from ``config=`` or its keyword arguments (the fields of
    :class:`~dpledger.mechanisms.DPConfig`, None for "not given").

    Raises:
        InvalidParameterError: a bad argument, or ``config`` with a field it covers (or with
            ``queries``).
    """
    if queries is not None:
        if config is not None:
            raise InvalidParameterError(
                "queries", "<explicit queries>", "None with config= (the config sets them)"
            )
        return AdapterSettings(
            config=None,
            groups="all" if groups is None else groups,
            strategy=engine_strategy(strategy),
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
    config = DPConfig.resolve(config, **fields)
    if config.noise_multiplier is None:
        raise InvalidParameterError(
            "target_epsilon",
            config.target_epsilon,
            "None: the Keras adapters take noise_multiplier= (calibrate z for a target with "
            "dpledger.accountants.calibrate_noise_multiplier)",
        )
    return AdapterSettings(
        config=config,
        groups=config.groups,
        strategy=engine_strategy(config.strategy),
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
    given = {name: arguments[name] for name in SETTING_KEYWORDS}
    return adapter_settings(**given)


def queries_of(variables: Sequence[Any], config: DPConfig) -> GradientQueries:
    """The queries of ``config`` over ``variables`` (see :func:`gradient_queries`)."""
    return gradient_queries(variables, **config.query_arguments())


def _path(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", repr(variable)))


def _size(variable: Any) -> int:
    return int(math.prod(int(d) for d in variable.shape))


@attrs.frozen
class GradientQueries:
    """The sum queries of a step and the trainable variables each one covers.

    Attributes:
        grouped: the :class:`GroupedSumQuery` (one query per group, events in this order).
        members: for each group, the positions of its variables in the trainable variables.
        group_of: for each trainable variable, the index of its group.
    """

    grouped: GroupedSumQuery
    members: tuple[tuple[int, ...], ...]
    group_of: tuple[int, ...]

    @property
    def queries(self) -> tuple[GaussianSumQuery, ...]:
        """The queries, one per group."""
        return self.grouped.queries

    @property
    def effective_noise_multiplier(self) -> float:
        """z_eff of paper Eq. 1 for the step's queries."""
        return self.grouped.effective_noise_multiplier


def _group_members(variables: Sequence[Any], groups: Any) -> tuple[list[list[int]], list[str]]:
    count = len(variables)
    groups = check_groups("groups", "all" if groups is None else groups)
    if groups == "all":
        return [list(range(count))], [FLAT_LABEL]
    if groups == "per_parameter":
        return [[j] for j in range(count)], [_path(v) for v in variables]
    if groups == "per_layer":
        order: dict[str, list[int]] = {}
        for j, v in enumerate(variables):
            order.setdefault(_path(v).rpartition("/")[0] or _path(v), []).append(j)
        return list(order.values()), list(order.keys())
    by_path = {_path(v): j for j, v in enumerate(variables)}
    by_name = {str(getattr(v, "name", "")): j for j, v in enumerate(variables)}
    members: list[list[int]] = []
    seen: dict[int, str] = {}
    for g, group in groups.items():
        indices = []
        for name in group:
            j = by_path.get(name, by_name.get(name))
            if j is None:
                raise InvalidParameterError(
                    f"groups[{g!r}]",
                    name,
                    "the path of a trainable variable (one of "
                    + ", ".join(repr(p) for p in by_path)
                    + ")",
                )
            if j in seen:
                raise InvalidParameterError(
                    f"groups[{g!r}]",
                    name,
                    f"a variable in no other group (also in group {seen[j]!r})",
                )
            seen[j] = g
            indices.append(j)
        members.append(indices)
    missing = [_path(v) for j, v in enumerate(variables) if j not in seen]
    if missing:
        raise InvalidParameterError(
            "groups", f"groups missing {missing}", "every trainable variable in exactly one group"
        )
    return members, list(groups)


def gradient_queries(
    variables: Sequence[Any],
    *,
    l2_norm_bound: float | None = None,
    noise_multiplier: float | None = None,
    clipping: ClippingStrategy | str = "flat",
    groups: Any = "all",
    clip_split: str = "equal",
    noise_allocation: str = "proportional",
    scales: Mapping[str, float] | None = None,
    queries: Sequence[GaussianSumQuery] | None = None,
) -> GradientQueries:
    """Build the Gaussian sum queries of a DP step over ``variables``.

    Args:
        variables: the trainable variables (Keras or TensorFlow variables), in the order of the
            gradients.
        l2_norm_bound: S* > 0, the bound on each example's whole (scaled) gradient; with several
            groups it is split by ``clip_split``.
        noise_multiplier: z ≥ 0; the step's z_eff (paper Eq. 1) equals z. z = 0 adds no noise
            and is recorded as such (ε = ∞).
        clipping: the clipping strategy of every group (``"flat"``, ``"global"``,
            ``"automatic"`` or a :class:`ClippingStrategy`).
        groups: ``"all"`` (default; None too), ``"per_layer"``, ``"per_parameter"`` or
            ``{label: [variable paths]}``.
        clip_split: ``"equal"`` (S_g = S*/√m) or ``"dimension"`` (S_g = S*·√(d_g/D)).
        noise_allocation: ``"proportional"`` (σ̃_g = z·√G·S_g) or ``"dimension"``
            (σ̃_g = z·√(D/d_g)·S_g).
        scales: joint scaled clipping: α_j > 0 per variable path (others get α = 1).
        queries: explicit queries, one per group (then ``l2_norm_bound``, ``noise_multiplier``,
            ``clipping``, ``clip_split``, ``noise_allocation`` and ``scales`` must be left unset).

    Returns:
        The :class:`GradientQueries`.

    Raises:
        InvalidParameterError: for any bad argument, naming it.
    """
    variables = tuple(variables)
    if not variables:
        raise InvalidParameterError("variables", variables, "at least one trainable variable")
    members, labels = _group_members(variables, groups)
    if queries is not None:
        if l2_norm_bound is not None or noise_multiplier is not None or scales is not None:
            raise InvalidParameterError(
                "queries",
                "given with l2_norm_bound/noise_multiplier/scales",
                "either explicit queries or l2_norm_bound and noise_multiplier, not both",
            )
        if isinstance(queries, GaussianSumQuery):
            queries = [queries]
        query_list = list(queries)
        if len(query_list) != len(members):
            raise InvalidParameterError(
                "queries", f"{len(query_list)} queries", f"one per group ({len(members)})"
            )
        for g, (q, m) in enumerate(zip(query_list, members, strict=True)):
            if isinstance(q, ScaledGaussianSumQuery) and len(q.scales) != len(m):
                raise InvalidParameterError(
                    f"queries[{g}].scales", q.scales, f"one scale per variable of group {g}"
                )
        grouped = GroupedSumQuery(query_list)
    else:
        if l2_norm_bound is None:
            raise InvalidParameterError("l2_norm_bound", None, "a clip bound S > 0")
        if noise_multiplier is None:
            raise InvalidParameterError("noise_multiplier", None, "a noise multiplier z >= 0")
        total = check_positive_finite("l2_norm_bound", l2_norm_bound)
        z = check_non_negative_finite("noise_multiplier", noise_multiplier)
        strategy = ClippingStrategy.parse(clipping)
        allocation = allocate(
            l2_norm_bound=total,
            noise_multiplier=z,
            dimensions=[sum(_size(variables[j]) for j in m) for m in members],
            clip_split=clip_split,
            noise_allocation=noise_allocation,
        )
        bounds, stddevs = allocation.l2_norm_bounds, allocation.noise_stddevs
        alpha = _scales(variables, scales)
        query_list = []
        for m, label, s, sigma in zip(members, labels, bounds, stddevs, strict=True):
            if alpha is None:
                query_list.append(
                    GaussianSumQuery(
                        l2_norm_bound=s, noise_stddev=sigma, clipping=strategy, label=label
                    )
                )
            else:
                query_list.append(
                    ScaledGaussianSumQuery(
                        l2_norm_bound=s,
                        noise_stddev=sigma,
                        clipping=strategy,
                        label=label,
                        scales=[alpha[j] for j in m],
                    )
                )
        grouped = GroupedSumQuery(query_list)
    group_of = [0] * len(variables)
    for g, m in enumerate(members):
        for j in m:
            group_of[j] = g
    return GradientQueries(
        grouped=grouped,
        members=tuple(tuple(m) for m in members),
        group_of=tuple(group_of),
    )


def _scales(variables: Sequence[Any], scales: Mapping[str, float] | None) -> list[float] | None:
    if scales is None:
        return None
    if not isinstance(scales, Mapping):
        raise InvalidParameterError("scales", scales, "a mapping from variable path to α > 0")
    paths = {_path(v): j for j, v in enumerate(variables)}
    out = [1.0] * len(variables)
    for name, value in scales.items():
        if name not in paths:
            raise InvalidParameterError(
                "scales", name, "the path of a trainable variable (one of " + ", ".join(paths) + ")"
            )
        out[paths[name]] = check_positive_finite(f"scales[{name!r}]", value)
    return out
