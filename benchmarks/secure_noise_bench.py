"""Secure noise against the default: the cost of a ChaCha20-keyed discrete Gaussian.

Run from the repository root (the machine's load makes absolute seconds noisy; the ratios,
measured in the same run, are what to read):

    PYTHONPATH=. python benchmarks/secure_noise_bench.py                 # 10M and 100M
    PYTHONPATH=. python benchmarks/secure_noise_bench.py --sizes 1000000 --repeats 3

For each size d it times, as medians of ``--repeats`` runs:

* default: x + σ·N in float64 from ``numpy.random.default_rng()`` (the NumPy backend's noise);
* secure: :func:`dpledger.mechanisms.secure_noise.secure_noisy_sum` (grid rounding, ChaCha20,
  discrete Gaussian, the ledger's sum query);
* torch: a DPOptimizer step on a linear model with d parameters (per-example clipping, the
  default noise, the ledger), and the estimated step with secure noise drawn on the host
  instead: step − (torch's own noise draw for d) + secure(d), since the adapters do not draw
  secure noise yet.

It prints medians and the ratios secure/default and estimated-secure-step/step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from dpledger import PrivacyLedger
from dpledger.mechanisms.secure_noise import ChaCha20Stream, secure_noisy_sum


def _median(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _noise_times(d: int, repeats: int) -> tuple[float, float]:
    x = np.random.default_rng(1).normal(size=d)  # the clipped sum (data, not noise)
    rng = np.random.default_rng()
    stream = ChaCha20Stream()
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=1.0, scheme="full")

    def default() -> object:
        noise = rng.standard_normal(d)
        noise *= 1.0
        noise += x
        return noise

    def secure() -> object:
        return secure_noisy_sum(
            x, ledger=ledger, l2_norm_bound=1.0, noise_stddev=1.0, stream=stream
        )

    return _median(default, repeats), _median(secure, repeats)


def _torch_times(d: int, repeats: int) -> tuple[float, float] | None:
    try:
        import torch
        import torch.nn.functional as F  # noqa: N812

        from dpledger.adapters.torch import DPOptimizer, PoissonBatchSampler
    except ImportError:
        return None
    model = torch.nn.Linear(d // 8, 8, bias=False)
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=PoissonBatchSampler(population_size=10_000, sampling_probability=0.0016),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=PrivacyLedger(),
    )
    sampler = opt.sampler
    x = torch.randn(64, d // 8)
    y = torch.randint(0, 8, (64,))

    def step() -> object:
        (batch,) = [b for _, b in zip(range(1), sampler, strict=False)]
        idx = torch.as_tensor(batch, dtype=torch.long) % 64
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        return None

    gen = torch.Generator().manual_seed(0)
    noise_only = _median(lambda: torch.randn(d, generator=gen, dtype=torch.float64), repeats)
    return _median(step, repeats), noise_only


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 100_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args(argv)
    print(f"machine: {platform.processor() or platform.machine()}, {platform.platform()}")
    print(f"{'d':>12}  {'default s':>10}  {'secure s':>10}  {'ratio':>7}")
    secure_by_size = {}
    for d in args.sizes:
        default, secure = _noise_times(d, args.repeats if d <= 10**7 else 1)
        secure_by_size[d] = secure
        print(f"{d:>12}  {default:>10.3f}  {secure:>10.3f}  {secure / default:>7.1f}")
    if args.no_torch:
        return
    d = min(args.sizes)
    times = _torch_times(d, args.repeats)
    if times is None:
        print("torch: not installed")
        return
    step, noise = times
    estimate = step - noise + secure_by_size[d]
    print(
        f"torch DP step, d = {d}: {step:.3f} s (its noise draw {noise:.3f} s); with secure "
        f"noise on the host instead (estimate): {estimate:.3f} s, ratio {estimate / step:.1f}"
    )


if __name__ == "__main__":
    main()
