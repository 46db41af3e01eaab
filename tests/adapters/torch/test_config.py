"""The PyTorch adapter from a DPConfig: same training as the keywords."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils.data import TensorDataset

from dpledger import DPConfig, PrivacyLedger
from dpledger.adapters.torch import DPOptimizer, make_private
from dpledger.errors import InvalidParameterError
from tests.adapters.torch.dp_helpers import batch, params_of, small_cnn

Q, N = 0.05, 200

SETTINGS = {
    "l2_norm_bound": 0.7,
    "noise_multiplier": 1.3,
    "clipping": "automatic",
    "groups": {
        "features": ["conv.weight", "conv.bias", "norm.weight", "norm.bias"],
        "head": ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
    },
    "clip_split": "dimension",
    "noise_allocation": "dimension",
    "scales": {"fc2.weight": 2.0},
    "strategy": "per_example",
    "clip_margin": 0.01,
}


def train(steps: int = 2, **privacy):
    """Params and ledger events after ``steps`` noisy steps of a seeded model and seeded noise."""
    model = small_cnn(seed=0)
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.3),
        model=model,
        sampling_probability=Q,
        population_size=N,
        ledger=PrivacyLedger(),
        seed=11,
        **privacy,
    )
    for step in range(steps):
        x, y = batch(9, seed=step)
        dp.zero_grad()
        F.cross_entropy(model(x), y).backward()
        dp.step()
    return params_of(model), list(dp.ledger.events())


def assert_same_run(a, b):
    (params_a, events_a), (params_b, events_b) = a, b
    assert events_a == events_b
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name


def test_config_trains_exactly_as_the_keywords():
    by_keywords = train(**SETTINGS)
    by_config = train(config=DPConfig(**SETTINGS))
    assert_same_run(by_keywords, by_config)
    labels = {e.label for e in by_config[1] if hasattr(e, "label")}
    assert labels == {"features", "head"}


def test_defaults_are_the_config_defaults():
    assert_same_run(
        train(l2_norm_bound=1.0, noise_multiplier=1.0),
        train(config=DPConfig(l2_norm_bound=1.0, noise_multiplier=1.0)),
    )


def test_a_missing_bound_is_named():
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    common = {"model": model, "sampling_probability": Q, "population_size": N}
    with pytest.raises(InvalidParameterError) as info:
        DPOptimizer(opt, noise_multiplier=1.0, **common)
    assert info.value.parameter == "l2_norm_bound"


@pytest.mark.parametrize(
    "keyword",
    [
        {"l2_norm_bound": 1.0},
        {"noise_multiplier": 1.0},
        {"clipping": "flat"},
        {"groups": "all"},
        {"clip_split": "equal"},
        {"noise_allocation": "proportional"},
        {"scales": {"fc1.weight": 1.0}},
        {"strategy": "auto"},
        {"clip_margin": 0.0},
    ],
)
def test_config_with_a_field_it_covers_is_refused(keyword):
    model = small_cnn()
    config = DPConfig(l2_norm_bound=1.0, noise_multiplier=1.0)
    with pytest.raises(InvalidParameterError, match="config") as info:
        DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            config=config,
            sampling_probability=Q,
            population_size=N,
            **keyword,
        )
    assert info.value.parameter == next(iter(keyword))


def test_bad_config_and_target_epsilon_are_refused():
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    common = {"model": model, "sampling_probability": Q, "population_size": N}
    with pytest.raises(InvalidParameterError) as info:
        DPOptimizer(opt, config={"l2_norm_bound": 1.0}, **common)
    assert info.value.parameter == "config"
    target = DPConfig(l2_norm_bound=1.0, target_epsilon=8.0, delta=1e-5)
    with pytest.raises(InvalidParameterError, match="make_private") as info:
        DPOptimizer(opt, config=target, **common)
    assert info.value.parameter == "target_epsilon"


def test_config_checks_the_names_against_the_model():
    model = small_cnn()
    with pytest.raises(InvalidParameterError) as info:
        DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            config=DPConfig(l2_norm_bound=1.0, noise_multiplier=1.0, groups={"a": ["nope"]}),
            sampling_probability=Q,
            population_size=N,
        )
    assert info.value.parameter == "groups['a']"


def _make_private_run(**privacy):
    model = small_cnn(seed=0)
    x, y = batch(40, seed=3)
    model, dp, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.3),
        TensorDataset(x, y),
        sampling_probability=0.25,
        seed=5,
        **privacy,
    )
    for step, (xb, yb) in enumerate(loader):
        if step == 2:
            break
        dp.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        dp.step()
    return params_of(model), list(dp.ledger.events())


def test_make_private_config_trains_exactly_as_the_keywords():
    keywords = {"l2_norm_bound": 0.8, "noise_multiplier": 0.9, "groups": "per_layer"}
    assert_same_run(_make_private_run(**keywords), _make_private_run(config=DPConfig(**keywords)))


def test_make_private_calibrates_a_config_target():
    target = {"target_epsilon": 4.0, "delta": 1e-5, "epochs": 2}
    by_keywords = _make_private_run(l2_norm_bound=1.0, **target)
    config = DPConfig(l2_norm_bound=1.0, target_epsilon=4.0, delta=1e-5)
    by_config = _make_private_run(config=config, epochs=2)
    assert_same_run(by_keywords, by_config)
    with pytest.raises(InvalidParameterError) as info:
        _make_private_run(config=config, epochs=2, clipping="global")
    assert info.value.parameter == "clipping"
    with pytest.raises(InvalidParameterError) as info:
        _make_private_run(config=config, epochs=2, delta=1e-6)
    assert info.value.parameter == "delta"
