"""The groups and Gaussian sum queries of a step over a model's parameters, shared by both
adapters (:mod:`dpledger.mechanisms.gradient_queries`)."""

from __future__ import annotations

import math

import attrs
import pytest

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms import DPConfig, GaussianSumQuery, ScaledGaussianSumQuery
from dpledger.mechanisms.config import FLAT_LABEL
from dpledger.mechanisms.gradient_queries import (
    SETTING_KEYWORDS,
    GradientQueries,
    settings_of_arguments,
)

# A small CNN's trainable variables (Conv2D 3×3×1→3, Dense 48→5, Dense 5→3), by Keras path.
CNN = {
    "conv2d/kernel": 27,
    "conv2d/bias": 3,
    "dense/kernel": 240,
    "dense/bias": 5,
    "dense_1/kernel": 15,
    "dense_1/bias": 3,
}
LAYERS = {name: name.rpartition("/")[0] for name in CNN}


def test_gradient_queries_take_the_core_name():
    sizes = {"w": 3, "b": 1}
    new = GradientQueries(sizes, l2_norm_bound=2.0, noise_multiplier=1.0, groups="per_parameter")
    assert new.l2_norm_bound == 2.0
    evolved = attrs.evolve(DPConfig(l2_norm_bound=2.0, noise_multiplier=1.0), groups="per_layer")
    assert evolved.groups == "per_layer"


def test_groups_and_explicit_queries():
    names = list(CNN)
    mapping = {"group0": names[:2], "group1": names[2:]}
    explicit = GradientQueries(CNN, groups=mapping, l2_norm_bound=2.0, noise_multiplier=1.5)
    assert explicit.positions == ((0, 1), (2, 3, 4, 5))
    assert explicit.members == (tuple(names[:2]), tuple(names[2:]))
    assert explicit.group_of == (0, 0, 1, 1, 1, 1)
    assert explicit.effective_noise_multiplier == pytest.approx(1.5, rel=1e-12)
    per_parameter = GradientQueries(
        CNN, groups="per_parameter", l2_norm_bound=2.0, noise_multiplier=1.5
    )
    assert len(per_parameter.queries) == len(CNN)
    reused = GradientQueries(CNN, queries=list(explicit.queries), groups=mapping)
    assert reused.queries == explicit.queries
    assert reused.l2_norm_bound is None and reused.noise_multiplier is None
    with pytest.raises(InvalidParameterError, match="groups"):
        GradientQueries(CNN, groups={"group0": [names[0]]}, l2_norm_bound=1.0, noise_multiplier=1.0)
    with pytest.raises(InvalidParameterError, match="queries"):
        GradientQueries(CNN, queries=list(explicit.queries), l2_norm_bound=1.0)
    with pytest.raises(InvalidParameterError) as info:
        GradientQueries(CNN, queries=list(explicit.queries[:1]), groups=mapping)
    assert info.value.parameter == "queries"
    with pytest.raises(InvalidParameterError) as info:
        reused.with_values(l2_norm_bound=1.0, noise_multiplier=1.0)
    assert info.value.parameter == "queries"


def test_one_group_has_the_flat_label():
    default = GradientQueries(CNN, l2_norm_bound=1.0, noise_multiplier=1.0)
    (query,) = default.queries
    assert query.label == FLAT_LABEL == "gradient"
    assert (query.l2_norm_bound, query.noise_stddev) == (1.0, 1.0)
    assert GradientQueries(CNN, l2_norm_bound=1.0, noise_multiplier=1.0, groups=None).queries == (
        default.queries
    )


@pytest.mark.parametrize("clip_split", ["equal", "dimension"])
@pytest.mark.parametrize("noise_allocation", ["proportional", "dimension"])
def test_per_layer_groups_follow_the_owning_layer(clip_split, noise_allocation):
    queries = GradientQueries(
        CNN,
        l2_norm_bound=2.0,
        noise_multiplier=1.3,
        groups="per_layer",
        clip_split=clip_split,
        noise_allocation=noise_allocation,
        layers=LAYERS,
    )
    assert queries.labels == ("conv2d", "dense", "dense_1")
    assert queries.positions == ((0, 1), (2, 3), (4, 5))
    bounds = [q.l2_norm_bound for q in queries.queries]
    assert math.fsum(s * s for s in bounds) == pytest.approx(4.0, rel=1e-12)
    z_eff = math.fsum((q.l2_norm_bound / q.noise_stddev) ** 2 for q in queries.queries) ** -0.5
    assert z_eff == pytest.approx(1.3, rel=1e-12)
    if clip_split == "dimension":
        assert bounds[1] == pytest.approx(2.0 * math.sqrt(245 / sum(CNN.values())), rel=1e-12)
    with pytest.raises(InvalidParameterError) as info:
        GradientQueries(CNN, l2_norm_bound=2.0, noise_multiplier=1.3, groups="per_layer")
    assert info.value.parameter == "layers"


def test_with_values_keeps_the_groups_and_the_layers():
    queries = GradientQueries(
        CNN, l2_norm_bound=1.0, noise_multiplier=1.0, groups="per_layer", layers=LAYERS
    )
    assert queries.with_values(l2_norm_bound=1.0, noise_multiplier=1.0) is queries
    other = queries.with_values(l2_norm_bound=3.0, noise_multiplier=0.5)
    assert other.labels == queries.labels and other.l2_norm_bound == 3.0
    assert other.effective_noise_multiplier == pytest.approx(0.5, rel=1e-12)
    silent = queries.with_values(l2_norm_bound=1.0, noise_multiplier=0.0)
    assert silent.effective_noise_multiplier == 0.0


def test_aliases_name_a_parameter_in_a_mapping():
    aliases = {"kernel": "conv2d/kernel"}
    queries = GradientQueries(
        CNN,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        groups={"a": ["kernel", "conv2d/bias"], "b": list(CNN)[2:]},
        aliases=aliases,
    )
    assert queries.members[0] == ("conv2d/kernel", "conv2d/bias")
    with pytest.raises(InvalidParameterError) as info:
        GradientQueries(
            CNN,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            groups={"a": ["kernel"], "b": list(CNN)},
            aliases=aliases,
        )
    assert info.value.parameter == "groups['b']"
    with pytest.raises(InvalidParameterError) as info:
        GradientQueries(
            CNN, l2_norm_bound=1.0, noise_multiplier=1.0, groups={"a": ["kernel", *list(CNN)]}
        )
    assert info.value.parameter == "groups['a']"


def test_scales_make_joint_scaled_queries():
    queries = GradientQueries(
        CNN,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        groups="per_layer",
        layers=LAYERS,
        scales={"dense/bias": 4.0},
    )
    conv, dense, head = queries.queries
    assert all(isinstance(q, ScaledGaussianSumQuery) for q in queries.queries)
    assert tuple(dense.scales) == (1.0, 4.0) and tuple(conv.scales) == tuple(head.scales)
    assert tuple(conv.scales) == (1.0, 1.0)
    plain = GradientQueries(CNN, l2_norm_bound=1.0, noise_multiplier=1.0)
    assert type(plain.queries[0]) is GaussianSumQuery
    for bad, parameter in [
        ({"nope": 1.0}, "scales"),
        ({"dense/bias": 0.0}, "scales['dense/bias']"),
    ]:
        with pytest.raises(InvalidParameterError) as info:
            GradientQueries(CNN, l2_norm_bound=1.0, noise_multiplier=1.0, scales=bad)
        assert info.value.parameter == parameter


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"l2_norm_bound": None, "noise_multiplier": 1.0}, "l2_norm_bound"),
        ({"l2_norm_bound": -1.0, "noise_multiplier": 1.0}, "l2_norm_bound"),
        ({"l2_norm_bound": 1.0, "noise_multiplier": None}, "noise_multiplier"),
        ({"l2_norm_bound": 1.0, "noise_multiplier": math.nan}, "noise_multiplier"),
        ({"l2_norm_bound": 1.0, "noise_multiplier": 1.0, "groups": "per_record"}, "groups"),
        ({"l2_norm_bound": 1.0, "noise_multiplier": 1.0, "clip_split": "x"}, "clip_split"),
    ],
)
def test_bad_arguments_are_named(kwargs, parameter):
    with pytest.raises(InvalidParameterError) as info:
        GradientQueries(CNN, **kwargs)
    assert info.value.parameter == parameter
    with pytest.raises(InvalidParameterError) as info:
        GradientQueries({}, l2_norm_bound=1.0, noise_multiplier=1.0)
    assert info.value.parameter == "model"


def _arguments(**given):
    return {name: given.get(name) for name in SETTING_KEYWORDS}


def test_adapter_settings_from_keywords_config_or_queries():
    by_keywords = settings_of_arguments(_arguments(l2_norm_bound=1.0, noise_multiplier=1.1))
    config = DPConfig(l2_norm_bound=1.0, noise_multiplier=1.1)
    assert by_keywords.config == config and by_keywords.strategy == "auto"
    assert settings_of_arguments(_arguments(config=config)).config is config
    queries = by_keywords.queries_for(CNN)
    assert queries.queries == GradientQueries.of_config(CNN, config).queries
    explicit = settings_of_arguments(_arguments(queries=list(queries.queries)))
    assert explicit.config is None and explicit.queries_for(CNN).queries == queries.queries
    with pytest.raises(InvalidParameterError) as info:
        settings_of_arguments(_arguments(config=config, queries=list(queries.queries)))
    assert info.value.parameter == "queries"
    target = DPConfig(l2_norm_bound=1.0, target_epsilon=2.0, delta=1e-5)
    with pytest.raises(InvalidParameterError) as info:
        settings_of_arguments(_arguments(config=target))
    assert info.value.parameter == "target_epsilon"
    with pytest.raises(InvalidParameterError) as info:
        settings_of_arguments(_arguments(queries=list(queries.queries), strategy="fast"))
    assert info.value.parameter == "strategy"
