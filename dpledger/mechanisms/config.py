"""One configuration of a DP training step, shared by the PyTorch and TensorFlow adapters.

:class:`DPConfig` holds what decides the privacy of a step and how records are bounded: the
clip bound, the noise (or the target it is calibrated to), the clipping strategy, the groups of
parameters, how the bound and the noise are split over them, and the options of the
per-example gradient engine that both adapters have. It is validated once, here: every field is
checked when the config is made, and a bad value raises
:class:`~dpledger.errors.InvalidParameterError` naming the field and the value. The adapters
build one from their keyword arguments (or take one with ``config=``), so both speak the same
vocabulary::

    config = DPConfig(l2_norm_bound=1.0, noise_multiplier=1.1, groups="per_layer")
    DPOptimizer(torch_optimizer, model=model, config=config, sampler=loader)   # PyTorch
    DPKerasModel(keras_model, config=config, sampler=sampler)                  # Keras

Names of parameters and variables in ``groups`` and ``scales``: in PyTorch, the names of
``model.named_parameters()`` (``"fc1.weight"``); in TensorFlow, the Keras 3 variable paths of
``model.trainable_variables`` (``[v.path for v in model.trainable_variables]``, e.g.
``"dense_1/kernel"``; a variable's ``name`` is accepted where it is unique).

It imports neither framework.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.allocation import CLIP_SPLITS, NOISE_ALLOCATIONS
from dpledger.mechanisms.clipping import ClippingStrategy, FlatClipping, check_clip_margin
from dpledger.validation import (
    check_delta,
    check_non_negative_finite,
    check_positive_finite,
)

__all__ = [
    "FLAT_LABEL",
    "GROUPINGS",
    "STRATEGIES",
    "DPConfig",
    "Grouping",
    "Strategy",
    "check_groups",
    "check_strategy",
]

Grouping = Literal["all", "per_layer", "per_parameter"] | Mapping[str, Sequence[str]]
"""The groups of a step: ``"all"``, ``"per_layer"``, ``"per_parameter"`` or
``{label: [parameter or variable names]}``."""

Strategy = Literal["auto", "ghost", "per_example", "generic"]
"""The per-example gradient engine's strategy (see :attr:`DPConfig.strategy`)."""

GROUPINGS = ("all", "per_layer", "per_parameter")
"""The named groupings; a mapping ``{label: [names]}`` is the explicit one."""

FLAT_LABEL = "gradient"
"""The ledger label of the one group of ``groups="all"`` (the record's whole gradient, clipped as
one vector), the same from PyTorch and from Keras."""

STRATEGIES = ("auto", "ghost", "per_example", "generic")
"""The values of :attr:`DPConfig.strategy`."""

_GROUPS_EXPECTED = (
    "'all', 'per_layer', 'per_parameter' or a non-empty mapping "
    "{label: [parameter or variable names]}"
)


def _convert(check: Callable[[str, Any], Any], name: str, default: Any, value: Any) -> Any:
    """Check a field's value; None stands for the field's default (None stays None)."""
    if value is None:
        value = default
    return None if value is None else check(name, value)


def check_groups(name: str, value: Any) -> str | Mapping[str, tuple[str, ...]]:
    """``value`` as a grouping: a name of :data:`GROUPINGS`, or a read-only copy of a mapping
    ``{label: (names, ...)}`` whose labels and names are strings, whose groups are non-empty and
    in which no name is in two groups (whether the names exist is checked against the model by
    the adapter).

    Raises:
        InvalidParameterError: naming ``name`` (or ``name[label]``) and the bad value.
    """
    if isinstance(value, str):
        if value in GROUPINGS:
            return value
        raise InvalidParameterError(name, value, _GROUPS_EXPECTED)
    if not isinstance(value, Mapping) or len(value) == 0:
        raise InvalidParameterError(name, value, _GROUPS_EXPECTED)
    seen: dict[str, str] = {}
    groups: dict[str, tuple[str, ...]] = {}
    for label, members in value.items():
        if not isinstance(label, str):
            raise InvalidParameterError(name, f"<label {label!r}>", "string labels")
        where = f"{name}[{label!r}]"
        if isinstance(members, (str, bytes)) or not isinstance(members, Sequence) or not members:
            raise InvalidParameterError(
                where, members, "a non-empty sequence of parameter or variable names"
            )
        for member in members:
            if not isinstance(member, str):
                raise InvalidParameterError(where, member, "parameter or variable names (strings)")
            if member in seen:
                raise InvalidParameterError(
                    where, member, f"a parameter not already in group {seen[member]!r}"
                )
            seen[member] = label
        groups[label] = tuple(members)
    return MappingProxyType(groups)


def check_strategy(name: str, value: Any) -> str:
    """``value`` if it is one of :data:`STRATEGIES`.

    Raises:
        InvalidParameterError: naming ``name`` and the value.
    """
    if not isinstance(value, str) or value not in STRATEGIES:
        raise InvalidParameterError(name, value, f"one of {STRATEGIES}")
    return value


def _check_scales(name: str, value: Any) -> Mapping[str, float]:
    if not isinstance(value, Mapping):
        raise InvalidParameterError(name, value, "a mapping {parameter or variable name: α > 0}")
    scales: dict[str, float] = {}
    for key, alpha in value.items():
        if not isinstance(key, str):
            raise InvalidParameterError(name, key, "parameter or variable names (strings)")
        scales[key] = check_positive_finite(f"{name}[{key!r}]", alpha)
    return MappingProxyType(scales)


def _check_choice(choices: tuple[str, ...], expected: str) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise InvalidParameterError(name, value, expected)
        return value

    return check


def _check_accountant(name: str, value: Any) -> Any:
    if isinstance(value, str):
        if not value:
            raise InvalidParameterError(name, value, "an accountant's name ('rdp', 'prv', …)")
        return value
    if not callable(getattr(value, "epsilon", None)):
        raise InvalidParameterError(
            name, value, "an accountant's name ('rdp', 'prv', …) or a dpledger Accountant"
        )
    return value


def _check_clipping(name: str, value: Any) -> ClippingStrategy:
    return ClippingStrategy.parse(value, parameter=name)


def _to_l2_norm_bound(value: Any) -> Any:
    """The checked ``l2_norm_bound`` (None: its default)."""
    return _convert(check_positive_finite, "l2_norm_bound", None, value)


def _to_noise_multiplier(value: Any) -> Any:
    """The checked ``noise_multiplier`` (None: its default)."""
    return _convert(check_non_negative_finite, "noise_multiplier", None, value)


def _to_target_epsilon(value: Any) -> Any:
    """The checked ``target_epsilon`` (None: its default)."""
    return _convert(check_positive_finite, "target_epsilon", None, value)


def _to_delta(value: Any) -> Any:
    """The checked ``delta`` (None: its default)."""
    return _convert(check_delta, "delta", None, value)


def _to_accountant(value: Any) -> Any:
    """The checked ``accountant`` (None: its default)."""
    return _convert(_check_accountant, "accountant", "prv", value)


def _to_clipping(value: Any) -> Any:
    """The checked ``clipping`` (None: its default)."""
    return _convert(_check_clipping, "clipping", "flat", value)


def _to_groups(value: Any) -> Any:
    """The checked ``groups`` (None: its default)."""
    return _convert(check_groups, "groups", "all", value)


def _to_clip_split(value: Any) -> Any:
    """The checked ``clip_split`` (None: its default)."""
    return _convert(
        _check_choice(CLIP_SPLITS, "'equal' or 'dimension'"), "clip_split", "equal", value
    )


def _to_noise_allocation(value: Any) -> Any:
    """The checked ``noise_allocation`` (None: its default)."""
    return _convert(
        _check_choice(NOISE_ALLOCATIONS, "'proportional' or 'dimension'"),
        "noise_allocation",
        "proportional",
        value,
    )


def _to_scales(value: Any) -> Any:
    """The checked ``scales`` (None: its default)."""
    return _convert(_check_scales, "scales", None, value)


def _to_strategy(value: Any) -> Any:
    """The checked ``strategy`` (None: its default)."""
    return _convert(check_strategy, "strategy", "auto", value)


def _to_secure_noise(value: Any) -> bool:
    """The checked ``secure_noise`` (None: False)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidParameterError("secure_noise", value, "True or False")
    return value


def _to_clip_margin(value: Any) -> Any:
    """The checked ``clip_margin`` (None: its default)."""
    return _convert(check_clip_margin, "clip_margin", None, value)


@attrs.frozen(kw_only=True)
class DPConfig:
    """The configuration of a DP step that both framework adapters take (``config=``).

    Every field is validated when the config is made (and by :func:`attrs.evolve`); a config is
    immutable and may be shared between runs. Mappings given for ``groups`` and ``scales`` are
    copied into read-only mappings. None given for a field with a default means the default.

    Args:
        l2_norm_bound: C > 0 (finite), the L2 bound of each record's whole gradient (in
            user-level DP, each user's); with several groups it is split over them by
            ``clip_split``. The ledger's sum-query events record the bounds S_g of the groups
            (Σ_g S_g² = C²). Required.
        noise_multiplier: z ≥ 0, the step's effective noise multiplier (σ̃ = z·C with one
            group; with several, the σ̃_g give z_eff = z, McMahan & Andrew Eq. 1). z = 0 is
            allowed, recorded, and not private. Exactly one of ``noise_multiplier`` and
            ``target_epsilon`` is given.
        target_epsilon: ε > 0 to meet at ``delta`` after the planned run, instead of
            ``noise_multiplier``: the smallest z that meets it is chosen by ``accountant``
            (PyTorch's ``make_private``, which knows the run's sampling rate and length; the
            optimizer and the Keras adapters need ``noise_multiplier``).
        delta: δ in (0, 1) of ``target_epsilon`` (required with it; otherwise informational).
        accountant: the accountant that calibrates ``target_epsilon``: a name (``"prv"``,
            default: its certified upper bound, the tightest valid one; ``"rdp"``, ``"gdp"``,
            ``"pld"``) or a dpledger ``Accountant``.
        clipping: the clipping strategy of every group: ``"flat"`` (min(1, S/‖v‖), default),
            ``"global"`` (1{‖v‖ ≤ S}, Bu et al.), ``"automatic"`` (S/(‖v‖ + γ)) or a
            :class:`~dpledger.mechanisms.clipping.ClippingStrategy`; stored as the strategy. It
            changes how records are bounded, never the bound: the ledger is the same for all three.
        groups: the groups of parameters (PyTorch) or variables (TensorFlow), each one Gaussian
            sum query with its own (S_g, σ̃_g): ``"all"`` (one group, flat clipping; default),
            ``"per_layer"`` (one group per module or layer), ``"per_parameter"`` (one group per
            parameter or variable) or ``{label: [names]}`` (every trainable parameter in exactly
            one group; the labels are the ledger's labels). Names are PyTorch parameter names
            (``model.named_parameters()``) or Keras 3 variable paths (``variable.path``, e.g.
            ``"dense_1/kernel"``).
        clip_split: how C is split over several groups: ``"equal"`` (S_g = C/√G, default) or
            ``"dimension"`` (S_g = C·√(d_g/D)).
        noise_allocation: how the noise is allocated over several groups: ``"proportional"``
            (σ̃_g = z·√G·S_g, default) or ``"dimension"`` (σ̃_g = z·√(D/d_g)·S_g).
        scales: ``{name: α > 0}`` for joint scaled clipping within each group (parameters or
            variables not named have α = 1); None (default) for none.
        strategy: how the per-example gradients are computed: ``"auto"`` (default: the fast
            path where the layers allow, else a general one), ``"ghost"`` (ghost norms and
            book-keeping), ``"per_example"`` (PyTorch only: the registered layers materialise
            per-example gradients) or ``"generic"`` (every layer by vectorised per-example maps:
            ``torch.func``, or TensorFlow's vectorised map). It never changes what is recorded.
        clip_margin: ρ in [0, 0.5): factors clip to S·(1 − ρ) while the ledger records S, so
            that rounding cannot push a record's contribution above S; None (default) chooses ρ
            by the parameters' dtype.
        secure_noise: draw the noise from the secure sampler
            (:mod:`~dpledger.mechanisms.secure_noise`: a ChaCha20 keystream keyed from the OS,
            the discrete Gaussian on a power-of-two grid γℤ, each sum rounded to the grid) and
            record each group's sensitivity after rounding, S_g + γ√d_g. The PyTorch adapter
            draws it on the host and copies it to the parameters' device; the Keras adapter
            refuses it for now. Default False (floating-point Gaussian noise from the
            framework's generator).

    Raises:
        InvalidParameterError: a bad field, named with its value and what would be valid.
    """

    l2_norm_bound: float | None = attrs.field(default=None, converter=_to_l2_norm_bound)
    noise_multiplier: float | None = attrs.field(default=None, converter=_to_noise_multiplier)
    target_epsilon: float | None = attrs.field(default=None, converter=_to_target_epsilon)
    delta: float | None = attrs.field(default=None, converter=_to_delta)
    accountant: Any = attrs.field(default="prv", converter=_to_accountant, hash=False)
    clipping: ClippingStrategy = attrs.field(
        default=attrs.Factory(FlatClipping), converter=_to_clipping
    )
    groups: Grouping = attrs.field(default="all", converter=_to_groups, hash=False)
    clip_split: Literal["equal", "dimension"] = attrs.field(
        default="equal",
        converter=_to_clip_split,
    )
    noise_allocation: Literal["proportional", "dimension"] = attrs.field(
        default="proportional",
        converter=_to_noise_allocation,
    )
    scales: Mapping[str, float] | None = attrs.field(default=None, converter=_to_scales, hash=False)
    strategy: Strategy = attrs.field(default="auto", converter=_to_strategy)
    clip_margin: float | None = attrs.field(default=None, converter=_to_clip_margin)
    secure_noise: bool = attrs.field(default=False, converter=_to_secure_noise)

    def __attrs_post_init__(self) -> None:
        if self.l2_norm_bound is None:
            raise InvalidParameterError(
                "l2_norm_bound", None, "C > 0, the L2 bound of each record's gradient"
            )
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise InvalidParameterError(
                "noise_multiplier",
                self.noise_multiplier,
                "exactly one of noise_multiplier= and target_epsilon= (with delta=)",
            )
        if self.target_epsilon is not None and self.delta is None:
            raise InvalidParameterError("delta", None, "δ in (0, 1) with target_epsilon=")

    def query_arguments(self) -> dict[str, Any]:
        """The fields that define the step's sum queries over a model's parameters, as the
        keyword arguments of the adapters' ``GradientQueries`` / ``gradient_queries``:
        ``l2_norm_bound``, ``noise_multiplier``, ``clipping``, ``groups``, ``clip_split``,
        ``noise_allocation`` and ``scales``."""
        return {
            "l2_norm_bound": self.l2_norm_bound,
            "noise_multiplier": self.noise_multiplier,
            "clipping": self.clipping,
            "groups": self.groups,
            "clip_split": self.clip_split,
            "noise_allocation": self.noise_allocation,
            "scales": self.scales,
        }

    @classmethod
    def resolve(cls, config: DPConfig | None, **given: Any) -> DPConfig:
        """The config of an adapter call: ``config``, or one made from the keyword arguments.

        Args:
            config: the ``config=`` argument (None: not given).
            **given: the adapter's keyword arguments for the fields, None for "not given".

        Returns:
            ``config`` when it is given and no field is; otherwise ``DPConfig(**given)`` (the
            fields not given take their defaults).

        Raises:
            InvalidParameterError: ``config`` is not a DPConfig, ``config`` and a field it
                covers are both given, or a field is bad (named).
        """
        values = {name: value for name, value in given.items() if value is not None}
        if config is not None:
            if not isinstance(config, DPConfig):
                raise InvalidParameterError("config", config, "a dpledger DPConfig or None")
            for name, value in values.items():
                raise InvalidParameterError(
                    name,
                    value,
                    f"not given with config= (config.{name} sets it; to change it, give "
                    f"config=attrs.evolve(config, {name}=...))",
                )
            return config
        return cls(**values)
