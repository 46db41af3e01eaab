"""The DP step keeps its per-step work on the device: one float64 noise draw over all groups,
clip factors that never visit the host, and at most one host synchronisation in ``step()`` (the
read-back of the clipped sums' norms for the sensitivity check), with the same guarantees.

Each test runs on every device in ``DEVICES`` (the CPU, and CUDA where torch sees it); the
references stay on the CPU in float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer
from dpledger.errors import InvalidParameterError
from tests.adapters.torch.dp_helpers import batch, clipped_sum, params_of, per_example, small_cnn
from tests.adapters.torch.reference import DEVICES

Q, N, LR = 0.05, 200, 0.3

_READS = {"__float__", "__bool__", "__int__", "__index__", "item", "tolist", "cpu"}


class _HostReads(TorchFunctionMode):
    """Records every read of tensor data into Python (a host synchronisation on a device)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class _DeviceSyncs:
    """The synchronising CUDA operations torch reports (``set_sync_debug_mode("warn")``) while
    the block runs; nothing on the CPU, where there is no device to wait for."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.messages: list[str] = []

    def __enter__(self) -> _DeviceSyncs:
        if self.device == "cuda":
            torch.cuda.synchronize()
            self._caught = warnings.catch_warnings(record=True)
            self._records = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            self._caught.__exit__(*exc)
            self.messages = [
                str(w.message) for w in self._records if "synchroniz" in str(w.message)
            ]


def wrap(model, **kwargs):
    kwargs.setdefault("l2_norm_bound", 2.4)
    kwargs.setdefault("noise_multiplier", 1.3)
    return DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model=model,
        sampling_probability=Q,
        population_size=N,
        ledger=PrivacyLedger(),
        **kwargs,
    )


CONFIGS = {
    "all": {},
    "per_layer_dimension": {
        "groups": "per_layer",
        "clip_split": "dimension",
        "noise_allocation": "dimension",
    },
    "custom_scaled": {
        "groups": {
            "features": ["conv.weight", "conv.bias", "norm.weight", "norm.bias"],
            "head": ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
        },
        "scales": {"conv.weight": 2.0, "fc2.bias": 0.5},
    },
    "automatic": {"clipping": "automatic", "groups": "per_layer"},
    "global": {"clipping": "global"},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_noised_gradient_equals_a_float64_reference_with_the_same_noise(config, device):
    """The update is (Σ_i f_i g_i + noise)/(q·n) with the factors of an explicit float64 loop
    and the noise of ONE standard-normal draw over the released arrays in group order (a
    separately clipped group is one flat array; a scaled group has one array per member, with
    standard deviation α_j·σ̃_g)."""
    kwargs = CONFIGS[config]
    x, y = batch(9)
    model, ref = small_cnn().to(device), small_cnn()
    dp = wrap(model, seed=7, **kwargs)
    before = {n: p.cpu() for n, p in params_of(model).items()}
    grads = per_example(ref, x, y)
    F.cross_entropy(model(x.to(device)), y.to(device)).backward()
    dp.step()
    queries = dp.queries
    groups = list(queries.members)
    bounds = [q.l2_norm_bound for q in queries.queries]
    rule = queries.queries[0].clipping.name
    want = clipped_sum(grads, groups, bounds, rule=rule, scales=kwargs.get("scales"))
    scales = kwargs.get("scales", {})
    arrays: list[list[str]] = []  # the released arrays, in order, as lists of member names
    stddevs: list[float] = []
    for query, members in zip(queries.queries, groups, strict=True):
        if hasattr(query, "scales"):  # a joint scaled group: one array per member
            for n in members:
                arrays.append([n])
                stddevs.append(scales.get(n, 1.0) * query.noise_stddev)
        else:
            arrays.append(list(members))
            stddevs.append(query.noise_stddev)
    sizes = [sum(before[n].numel() for n in names) for names in arrays]
    generator = torch.Generator(device=device).manual_seed(7)
    noise = (
        torch.randn(sum(sizes), generator=generator, dtype=torch.float64, device=device)
        .cpu()
        .split(sizes)
    )
    for names, z, sd in zip(arrays, noise, stddevs, strict=True):
        pieces = z.split([before[n].numel() for n in names])
        for n, piece in zip(names, pieces, strict=True):
            noised = want[n] + sd * piece.view(before[n].shape)
            expected = before[n] - LR * noised / (Q * N)
            got = dict(model.named_parameters())[n].detach().cpu()
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ["all", "per_layer_dimension", "custom_scaled"])
@pytest.mark.parametrize("fast", [False, True])
def test_a_step_reads_tensor_data_back_to_the_host_at_most_once(config, fast, device):
    """Behaviour, not timing: after the first step (the engine's consistency check and the
    record-independence probe run once), ``step()`` reads one small tensor back to the host —
    the norms of all groups' clipped sums for the sensitivity check — and nothing else. On
    CUDA, torch's own synchronisation detector (``torch.cuda.set_sync_debug_mode``) must also
    see exactly one synchronising operation in ``step()``."""
    model = small_cnn(dtype=torch.float32).to(device)
    dp = wrap(model, seed=0, **CONFIGS[config])
    x, y = (t.to(device) for t in batch(8, dtype=torch.float32))
    counts, syncs = [], []
    for _ in range(3):
        dp.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if fast:
            dp.backward(loss)
        else:
            loss.backward()
        with _HostReads() as reads, _DeviceSyncs(device) as device_syncs:
            dp.step()
        counts.append(reads.reads)
        syncs.append(device_syncs.messages)
    assert counts[1] == counts[2] == ["cpu"]
    if device == "cuda":
        assert len(syncs[1]) == len(syncs[2]) == 1, syncs[1:]
    assert dp.ledger.num_steps == 3


@pytest.mark.parametrize("device", DEVICES)
def test_a_record_with_a_non_finite_norm_refuses_the_step_before_anything_is_recorded(device):
    model = small_cnn().to(device)
    dp = wrap(model, seed=0)
    x, y = (t.to(device) for t in batch(6))
    F.cross_entropy(model(x), y).backward()
    dp.step()  # a clean step first (the record-independence probe runs on it)
    events = dp.ledger.num_events
    x[2, 0, 0, 0] = float("nan")
    before = params_of(model)
    dp.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(InvalidParameterError, match="NaN, infinite or negative") as info:
        dp.step()
    assert info.value.parameter == "per-example gradients"
    assert dp.ledger.num_steps == 1 and dp.ledger.num_events == events
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n])
    x, y = (t.to(device) for t in batch(6))  # the optimizer goes on with the next batch
    dp.zero_grad()
    F.cross_entropy(model(x), y).backward()
    dp.step()
    assert dp.ledger.num_steps == 2
