"""DPConfig: every field validated once, resolution of adapter keywords."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dpledger
from dpledger.errors import InvalidParameterError
from dpledger.mechanisms import AutomaticClipping, DPConfig, FlatClipping, GlobalClipping

OK = {"l2_norm_bound": 1.0, "noise_multiplier": 1.1}


def test_defaults_and_exports():
    config = DPConfig(**OK)
    assert dpledger.DPConfig is DPConfig
    assert config.l2_norm_bound == 1.0 and config.noise_multiplier == 1.1
    assert config.target_epsilon is None and config.delta is None
    assert config.accountant == "prv"
    assert config.clipping == FlatClipping()
    assert config.groups == "all"
    assert (config.clip_split, config.noise_allocation) == ("equal", "proportional")
    assert config.scales is None and config.strategy == "auto" and config.clip_margin is None


def test_frozen_hashable_and_mappings_copied_read_only():
    groups = {"first": ["a", "b"], "second": ["c"]}
    config = DPConfig(**OK, groups=groups, scales={"a": 2})
    groups["first"].append("x")
    assert dict(config.groups) == {"first": ("a", "b"), "second": ("c",)}
    assert dict(config.scales) == {"a": 2.0}
    with pytest.raises(TypeError):
        config.groups["third"] = ("d",)  # type: ignore[index]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.noise_multiplier = 2.0  # type: ignore[misc]
    assert config == DPConfig(**OK, groups={"first": ("a", "b"), "second": ("c",)}, scales={"a": 2})
    assert hash(config) == hash(DPConfig(**OK, groups={"first": ["a", "b"], "second": ["c"]}))


def test_none_means_the_default():
    assert DPConfig(**OK, clipping=None, groups=None, strategy=None) == DPConfig(**OK)


@pytest.mark.parametrize(
    ("clipping", "expected"),
    [("flat", FlatClipping()), ("global", GlobalClipping()), ("automatic", AutomaticClipping())],
)
def test_clipping_by_name_or_instance(clipping, expected):
    assert DPConfig(**OK, clipping=clipping).clipping == expected
    assert DPConfig(**OK, clipping=expected).clipping == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("l2_norm_bound", 0.0),
        ("l2_norm_bound", -1.0),
        ("l2_norm_bound", math.inf),
        ("l2_norm_bound", math.nan),
        ("l2_norm_bound", True),
        ("l2_norm_bound", "1"),
        ("noise_multiplier", -0.5),
        ("noise_multiplier", math.nan),
        ("noise_multiplier", math.inf),
        ("clipping", "clip"),
        ("clipping", 3),
        ("groups", "per_variable"),
        ("groups", [["a"], ["b"]]),
        ("groups", {}),
        ("groups", {1: ["a"]}),
        ("clip_split", "proportional"),
        ("noise_allocation", "equal"),
        ("scales", [("a", 1.0)]),
        ("strategy", "fast"),
        ("strategy", "vectorized"),
        ("clip_margin", 0.5),
        ("clip_margin", -0.1),
        ("accountant", ""),
        ("accountant", 3),
    ],
)
def test_each_bad_field_is_named(field, value):
    with pytest.raises(InvalidParameterError) as info:
        DPConfig(**{**OK, field: value})
    assert info.value.parameter == field
    assert str(info.value).startswith(f"{field}=")


@pytest.mark.parametrize(
    ("groups", "parameter"),
    [
        ({"a": []}, "groups['a']"),
        ({"a": "fc.weight"}, "groups['a']"),
        ({"a": [1]}, "groups['a']"),
        ({"a": ["w"], "b": ["w"]}, "groups['b']"),
    ],
)
def test_bad_groups_name_the_group(groups, parameter):
    with pytest.raises(InvalidParameterError) as info:
        DPConfig(**OK, groups=groups)
    assert info.value.parameter == parameter


def test_bad_scale_names_the_entry():
    with pytest.raises(InvalidParameterError) as info:
        DPConfig(**OK, scales={"w": 0.0})
    assert info.value.parameter == "scales['w']"


def test_noise_multiplier_or_target_epsilon():
    with pytest.raises(InvalidParameterError) as info:
        DPConfig(l2_norm_bound=1.0)
    assert info.value.parameter == "noise_multiplier"
    with pytest.raises(InvalidParameterError) as info:
        DPConfig(**OK, target_epsilon=8.0, delta=1e-5)
    assert info.value.parameter == "noise_multiplier"
    with pytest.raises(InvalidParameterError) as info:
        DPConfig(l2_norm_bound=1.0, target_epsilon=8.0)
    assert info.value.parameter == "delta"
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(InvalidParameterError) as info:
            DPConfig(l2_norm_bound=1.0, target_epsilon=bad, delta=1e-5)
        assert info.value.parameter == "target_epsilon"
    for bad in (0.0, 1.0, -1e-5):
        with pytest.raises(InvalidParameterError) as info:
            DPConfig(l2_norm_bound=1.0, target_epsilon=8.0, delta=bad)
        assert info.value.parameter == "delta"
    config = DPConfig(l2_norm_bound=1.0, target_epsilon=8, delta=1e-5, accountant="prv")
    assert (config.target_epsilon, config.noise_multiplier, config.accountant) == (8.0, None, "prv")


def test_bound_is_required():
    with pytest.raises(InvalidParameterError) as info:
        DPConfig(noise_multiplier=1.0)
    assert info.value.parameter == "l2_norm_bound"


def test_evolve_validates():
    config = DPConfig(**OK)
    assert attrs.evolve(config, noise_multiplier=0.0).noise_multiplier == 0.0
    with pytest.raises(InvalidParameterError) as info:
        attrs.evolve(config, l2_norm_bound=-1.0)
    assert info.value.parameter == "l2_norm_bound"


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_bound_accepts_exactly_the_positive_finite_floats(x):
    if x > 0 and math.isfinite(x):
        assert DPConfig(l2_norm_bound=x, noise_multiplier=1.0).l2_norm_bound == x
    else:
        with pytest.raises(InvalidParameterError) as info:
            DPConfig(l2_norm_bound=x, noise_multiplier=1.0)
        assert info.value.parameter == "l2_norm_bound"


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_noise_multiplier_accepts_exactly_the_non_negative_finite_floats(x):
    if x >= 0 and math.isfinite(x):
        z = DPConfig(l2_norm_bound=1.0, noise_multiplier=x).noise_multiplier
        assert z == x and math.copysign(1.0, z) == 1.0  # -0.0 becomes 0.0
    else:
        with pytest.raises(InvalidParameterError) as info:
            DPConfig(l2_norm_bound=1.0, noise_multiplier=x)
        assert info.value.parameter == "noise_multiplier"


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_clip_margin_accepts_exactly_zero_to_one_half(x):
    if 0.0 <= x < 0.5:
        assert DPConfig(**OK, clip_margin=x).clip_margin == x
    else:
        with pytest.raises(InvalidParameterError) as info:
            DPConfig(**OK, clip_margin=x)
        assert info.value.parameter == "clip_margin"


def test_resolve_from_keywords_or_config():
    assert DPConfig.resolve(None, l2_norm_bound=1.0, noise_multiplier=1.1, clipping=None) == (
        DPConfig(**OK)
    )
    config = DPConfig(**OK, groups="per_layer")
    assert DPConfig.resolve(config, l2_norm_bound=None, groups=None) is config


def test_resolve_refuses_config_with_a_field_it_covers():
    config = DPConfig(**OK)
    for field, value in [("l2_norm_bound", 1.0), ("clipping", "flat"), ("groups", "all")]:
        with pytest.raises(InvalidParameterError, match="config") as info:
            DPConfig.resolve(config, **{field: value})
        assert info.value.parameter == field
    with pytest.raises(InvalidParameterError) as info:
        DPConfig.resolve({"l2_norm_bound": 1.0})  # type: ignore[arg-type]
    assert info.value.parameter == "config"


def test_resolve_names_a_bad_field():
    with pytest.raises(InvalidParameterError) as info:
        DPConfig.resolve(None, l2_norm_bound=-1.0, noise_multiplier=1)
    assert info.value.parameter == "l2_norm_bound"
