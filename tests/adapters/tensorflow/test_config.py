"""The Keras adapters from a DPConfig and in the PyTorch vocabulary."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from dpledger import DPConfig, PrivacyLedger
from dpledger.adapters.tensorflow import DPKerasModel, PoissonDatasetSampler, PrivateGradients
from dpledger.adapters.tensorflow.dp_step import gradient_queries
from dpledger.errors import InvalidParameterError


def _model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="head"),
        ],
        name="net",
    )


def _data(n: int = 24, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)


def _loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _paths(model: keras.Model) -> list[str]:
    return [v.path for v in model.trainable_variables]


def _fit(**privacy):
    """Weights and ledger events after one epoch of fit with seeded model, sampling and noise."""
    x, y = _data()
    sampler = PoissonDatasetSampler(population_size=24, sampling_probability=0.25, seed=4)
    dp = DPKerasModel(_model(), sampler=sampler, ledger=PrivacyLedger(), seed=1, **privacy)
    dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    dp.fit(sampler.sample((x, y)), epochs=1, verbose=0)
    return [np.asarray(w) for w in dp.model.get_weights()], list(dp.ledger.events())


def _private_gradients(**privacy):
    """The privatised gradients of two seeded steps and the ledger events."""
    x, y = _data(8, seed=2)
    private = PrivateGradients(
        _model(),
        _loss(),
        sampling_probability=0.25,
        population_size=32,
        ledger=PrivacyLedger(),
        seed=3,
        **privacy,
    )
    grads = [np.asarray(g) for _ in range(2) for g in private(x, y)]
    return grads, list(private.ledger.events())


def _assert_same_run(a, b):
    (values_a, events_a), (values_b, events_b) = a, b
    assert events_a == events_b
    assert len(values_a) == len(values_b)
    for u, v in zip(values_a, values_b, strict=True):
        np.testing.assert_array_equal(u, v)


def _settings(model: keras.Model) -> dict:
    kernel, bias, head_kernel, head_bias = _paths(model)
    return {
        "l2_norm_bound": 0.6,
        "noise_multiplier": 1.2,
        "clipping": "automatic",
        "groups": {"hidden": [kernel, bias], "head": [head_kernel, head_bias]},
        "clip_split": "dimension",
        "noise_allocation": "dimension",
        "scales": {head_kernel: 2.0},
        "strategy": "ghost",
        "clip_margin": 0.01,
    }


@pytest.mark.slow
def test_keras_model_from_config_fits_exactly_as_the_keywords():
    settings = _settings(_model())
    by_keywords = _fit(**settings)
    by_config = _fit(config=DPConfig(**settings))
    _assert_same_run(by_keywords, by_config)
    assert {e.label for e in by_config[1] if hasattr(e, "label")} == {"hidden", "head"}


@pytest.mark.slow
def test_private_gradients_from_config_are_exactly_the_keywords():
    settings = {**_settings(_model()), "strategy": "generic"}
    _assert_same_run(
        _private_gradients(**settings), _private_gradients(config=DPConfig(**settings))
    )


def test_one_group_keeps_its_label():
    model = _model()
    default = gradient_queries(model.trainable_variables, l2_norm_bound=1.0, noise_multiplier=1.0)
    assert [q.label for q in default.queries] == ["gradient"]
    explicit = gradient_queries(
        model.trainable_variables, l2_norm_bound=1.0, noise_multiplier=1.0, groups="all"
    )
    assert explicit.queries == default.queries


@pytest.mark.parametrize(
    "keyword",
    [
        {"l2_norm_bound": 1.0},
        {"noise_multiplier": 1.0},
        {"clipping": "flat"},
        {"groups": "all"},
        {"clip_split": "equal"},
        {"noise_allocation": "proportional"},
        {"strategy": "auto"},
        {"clip_margin": 0.0},
    ],
)
def test_config_with_a_field_it_covers_is_refused(keyword):
    config = DPConfig(l2_norm_bound=1.0, noise_multiplier=1.0)
    with pytest.raises(InvalidParameterError, match="config") as info:
        DPKerasModel(
            _model(), config=config, sampling_probability=0.1, population_size=10, **keyword
        )
    assert info.value.parameter == next(iter(keyword))


def test_bad_values_are_named_as_given():
    common = {"sampling_probability": 0.1, "population_size": 10, "noise_multiplier": 1.0}
    with pytest.raises(InvalidParameterError) as info:
        DPKerasModel(_model(), l2_norm_bound=1.0, strategy="per_example", **common)
    assert info.value.parameter == "strategy"
    with pytest.raises(InvalidParameterError) as info:
        DPKerasModel(_model(), l2_norm_bound=1.0, strategy="fast", **common)
    assert info.value.parameter == "strategy"
    with pytest.raises(InvalidParameterError) as info:
        DPKerasModel(_model(), l2_norm_bound=-1.0, **common)
    assert info.value.parameter == "l2_norm_bound"
    with pytest.raises(InvalidParameterError) as info:
        DPKerasModel(_model(), l2_norm_bound=1.0, groups={"a": ["nope"]}, **common)
    assert info.value.parameter == "groups['a']"
    target = DPConfig(l2_norm_bound=1.0, target_epsilon=2.0, delta=1e-5)
    with pytest.raises(InvalidParameterError) as info:
        DPKerasModel(_model(), config=target, sampling_probability=0.1, population_size=10)
    assert info.value.parameter == "target_epsilon"
