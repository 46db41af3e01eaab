"""The same flat-clipping run writes the same ledger from PyTorch and from Keras.

One small MLP, the same initial weights (copied from the torch model into the Keras one), the same
batches, q, n, clip bound and noise multiplier: the two adapters must record the same events
(sampling events, and sum queries with the same bound, standard deviation and label). With σ = 0
the two updates are the same SGD step too (float32 rounding aside).
"""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")

import dpledger.adapters.tensorflow as dp_keras  # noqa: E402
import dpledger.adapters.torch as dp_torch  # noqa: E402
from dpledger import PrivacyLedger, errors  # noqa: E402
from dpledger.ledger import SamplingEvent, SumQueryEvent  # noqa: E402
from dpledger.ledger import correlated as ledger_correlated  # noqa: E402
from dpledger.mechanisms.config import FLAT_LABEL  # noqa: E402

Q, N, BOUND, LR, MARGIN = 0.1, 80, 1.0, 0.5, 1e-3
IN, HIDDEN, OUT, BATCH, STEPS = 5, 7, 3, 8, 3


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(BATCH, IN)).astype(np.float32), rng.integers(0, OUT, BATCH))
        for _ in range(STEPS)
    ]


def _torch_run(z: float) -> tuple[list, list[np.ndarray], torch.nn.Module]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    )
    # Keras order: kernel (in, out) then bias, per layer.
    initial = [
        t.detach().numpy().copy()
        for layer in (model[0], model[2])
        for t in (layer.weight.T, layer.bias)
    ]
    ledger = PrivacyLedger()
    dp = dp_torch.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model=model,
        l2_norm_bound=BOUND,
        noise_multiplier=z,
        sampling_probability=Q,
        population_size=N,
        clip_margin=MARGIN,
        ledger=ledger,
        seed=0,
    )
    for x, y in _batches():
        dp.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.as_tensor(x)), torch.as_tensor(y)).backward()
        dp.step()
    return list(ledger.events()), initial, model


def _keras_run(z: float, initial: list[np.ndarray]) -> tuple[list, keras.Model]:
    model = keras.Sequential(
        [keras.Input((IN,)), keras.layers.Dense(HIDDEN, activation="tanh"), keras.layers.Dense(OUT)]
    )
    model.set_weights(initial)
    ledger = PrivacyLedger()
    dp = dp_keras.DPKerasModel(
        model,
        l2_norm_bound=BOUND,
        noise_multiplier=z,
        sampling_probability=Q,
        population_size=N,
        clip_margin=MARGIN,
        ledger=ledger,
        seed=0,
    )
    dp.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    for x, y in _batches():
        dp.train_on_batch(x, y.astype(np.int32))
    return list(ledger.events()), model


@pytest.mark.slow
@pytest.mark.parametrize("z", [0.0, 1.1])
def test_one_flat_clipping_run_writes_one_ledger_from_torch_and_keras(z: float) -> None:
    torch_events, initial, torch_model = _torch_run(z)
    keras_events, keras_model = _keras_run(z, initial)
    expected = [SamplingEvent(Q, N), SumQueryEvent(BOUND, z * BOUND, FLAT_LABEL)] * STEPS
    assert torch_events == expected
    assert keras_events == torch_events
    if z == 0.0:  # no noise: the same clipped, averaged SGD step in both frameworks
        torch_after = [
            t.detach().numpy()
            for layer in (torch_model[0], torch_model[2])
            for t in (layer.weight.T, layer.bias)
        ]
        for got, want, before in zip(keras_model.get_weights(), torch_after, initial, strict=True):
            assert not np.array_equal(want, before)  # the step moved the weights
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_both_adapters_use_one_error_set_and_one_layer_rule_vocabulary() -> None:
    # the errors users catch live in dpledger.errors (the ledger's own in dpledger.ledger);
    # an adapter module that names one holds that very class, never a copy
    homes = (errors, ledger_correlated)
    for adapter in (dp_torch, dp_keras):
        modules = [adapter] + [
            importlib.import_module(info.name)
            for info in pkgutil.walk_packages(adapter.__path__, adapter.__name__ + ".")
        ]
        for module in modules:
            for name, value in vars(module).items():
                for home in homes:
                    if isinstance(value, type) and hasattr(home, name):
                        assert value is getattr(home, name), (module.__name__, name)
        assert {"LayerRule", "register_layer_rule"} <= set(adapter.__all__)
        registry = importlib.import_module(adapter.__name__ + ".registry")
        assert adapter.register_layer_rule is registry.register_layer_rule
        assert adapter.LayerRule is registry.LayerRule
        assert callable(registry.unregister_layer_rule)
    assert issubclass(errors.RecordDependenceError, errors.RecordMixingLayerError)
    assert issubclass(errors.NoiseStreamEndError, errors.DPLedgerError)
    assert issubclass(errors.UnsupportedLayerError, ValueError)
