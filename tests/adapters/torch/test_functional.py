"""The whole-model generic path (torch.func) and the package's import isolation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger.adapters.torch import per_example_gradients
from dpledger.adapters.torch.functional_gradients import FunctionalPerExampleEngine
from dpledger.errors import EngineStateError, InvalidParameterError
from tests.adapters.torch.reference import (
    assert_close_dicts,
    loop_per_example_grads,
    squared_norms,
    weighted_sum,
)


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)).double()
    x = torch.randn(6, 2, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(0))
    return model, x, y


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_per_example_gradients_match_loop(chunk_size):
    model, x, y = _model()
    want = loop_per_example_grads(model, F.cross_entropy, (x,), y)
    got = per_example_gradients(model, F.cross_entropy, x, y, chunk_size=chunk_size)
    assert_close_dicts(got, want)


def test_functional_engine_interface():
    model, x, y = _model()
    want = loop_per_example_grads(model, F.cross_entropy, (x,), y)
    engine = FunctionalPerExampleEngine(model, F.cross_entropy)
    with pytest.raises(EngineStateError, match="compute"):
        engine.squared_norms()
    engine.compute(x, y)
    assert engine.batch_size == 6
    assert engine.parameter_names == tuple(want)
    f = torch.rand(6, dtype=torch.float64)
    assert_close_dicts(engine.per_example_gradients(), want)
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    engine.write_clipped_sum(f)
    assert_close_dicts({n: p.grad for n, p in model.named_parameters()}, weighted_sum(want, f))


def test_empty_batch():
    model, x, y = _model()
    engine = FunctionalPerExampleEngine(model, F.cross_entropy)
    engine.compute(x[:0], y[:0])
    assert engine.batch_size == 0
    assert all(v.shape == (0,) for v in engine.squared_norms().values())
    sums = engine.clipped_sum(torch.ones(0))
    assert all(not s.any() for s in sums.values())


def test_bad_arguments():
    model, x, y = _model()
    with pytest.raises(InvalidParameterError, match="chunk_size"):
        per_example_gradients(model, F.cross_entropy, x, y, chunk_size=0)
    with pytest.raises(InvalidParameterError, match="randomness"):
        per_example_gradients(model, F.cross_entropy, x, y, randomness="maybe")
    with pytest.raises(InvalidParameterError, match="loss_fn"):
        FunctionalPerExampleEngine(model, "cross_entropy")
    with pytest.raises(InvalidParameterError, match="model"):
        FunctionalPerExampleEngine(None, F.cross_entropy)


def test_import_dpledger_does_not_import_torch():
    code = (
        "import sys, dpledger, dpledger.adapters; "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
