"""DPOptimizer's override points: clip, add_noise and release."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer
from dpledger.ledger import SumQueryEvent

Q, N = 0.05, 200


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _step(cls: type[DPOptimizer], **kwargs) -> tuple[DPOptimizer, nn.Module]:
    model = _model()
    dp = cls(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        l2_norm_bound=1.0,
        sampling_probability=Q,
        population_size=N,
        ledger=PrivacyLedger(),
        **kwargs,
    )
    x, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.arange(6) % 2
    dp.zero_grad()
    F.cross_entropy(model(x), y).backward()
    dp.step()
    return dp, model


def _stddevs(dp: DPOptimizer) -> list[float]:
    return [e.noise_stddev for e in dp.ledger.events() if isinstance(e, SumQueryEvent)]


def test_add_noise_receives_the_recorded_stddevs_and_its_noise_is_released():
    seen = []

    class Noiseless(DPOptimizer):
        def add_noise(self, sums, *, stddevs, generator):
            seen.append(list(stddevs))
            return [s.clone() for s in sums]

    noisy, _ = _step(DPOptimizer, noise_multiplier=2.0, seed=0)
    noiseless, model = _step(Noiseless, noise_multiplier=2.0, seed=0)
    _, ref_model = _step(DPOptimizer, noise_multiplier=0.0, seed=0)
    assert seen == [_stddevs(noiseless)] and _stddevs(noiseless) == _stddevs(noisy)
    assert _stddevs(noiseless)[0] == pytest.approx(2.0)  # the ledger records σ̃, not what was drawn
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_clip_and_release_are_called_once_per_step_with_the_documented_arguments():
    calls = []

    class Watched(DPOptimizer):
        def clip(self, source, factors):
            calls.append(("clip", source.batch_size, sorted(map(len, factors))))
            return super().clip(source, factors)

        def release(self, sums, *, num_records, event):
            calls.append(("release", num_records, event.sampling_probability))
            out = super().release(sums, num_records=num_records, event=event)
            assert [t.shape for t in out] == [t.shape for t in sums]
            return out

    dp, _ = _step(Watched, noise_multiplier=1.0, seed=0)
    assert calls == [("clip", 6, [4]), ("release", 6, Q)]
    assert dp.ledger.num_steps == 1
