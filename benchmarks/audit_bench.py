"""Time a black-box privacy audit of the PyTorch adapter: 1,000 training runs on the digits.

The audit is the one of ``examples/audit_digits.py`` (``dpledger.audit.torch_audit``): multinomial
logistic regression on the 1797 digits (plus the canary in half of the runs), 30 DP-SGD steps with
Poisson sampling at q = 0.1 (expected batch ≈ 180), z calibrated to ε = 2 (RDP) at δ = 1e-5,
scored by the loss on an out-of-distribution canary. ``run_distinguishing_game`` runs the 1,000
runs (500 per side) in ``--workers`` spawned processes, each with one torch thread, and the
Clopper–Pearson bound (held-out split) is compared with the ledger's PRV ε. The same is done for
the optimizer with the batch-size noise bug.

Then, to show what limits the audit, one training run is timed inline (medians over interleaved
repeats) three ways on the same Poisson batches:

* ``dpledger``: the audit's run (``DPOptimizer`` around ``torch.optim.SGD``: per-example norms,
  clipping, float64 noise, the ledger's events, the fixed-denominator average);
* ``non-private``: the same loop with plain SGD (forward, backward, step): the floor;
* ``opacus``: Opacus's ``GradSampleModule`` and ``DPOptimizer`` (hooks mode, Poisson batches given
  to it, ``expected_batch_size`` = q·n), when Opacus is installed;

and the run is split into its fixed cost (building the model, sampler and optimizer) and its cost
per step (from runs of 1 and of 30 steps); the start-up of the worker processes (spawn, importing
torch and dpledger) is timed separately.

Then the white-box audit at a claim of ε = 4 (PRV; 4 full-batch steps, a Dirac gradient canary,
``dpledger.audit.torch_audit.WhiteBoxDigitsAudit``) is run twice with the same master seed: on the
local process pool and on a Dask ``LocalCluster`` of as many single-threaded worker processes
(``distributed.Client(...).get_executor()``), reporting runs/s on each and checking that the
scores are identical. Its Clopper–Pearson and Gaussian-DP bounds are set beside the two one-run
bounds (Steinke et al. 2023 and the f-DP bound of Mahloujifar et al. 2024) computed from as many
training runs of the one-run white-box audit (``dpledger.audit.torch_one_run``, m canaries per
run, pooled across runs: each canary is in exactly one run, so the pooled runs are one mechanism
over all their canaries), i.e. at equal compute. Last, the last-iterate audit
(``dpledger.audit.torch_last_iterate``: a crafted gradient canary, only the final model scored)
is run at q = 1 and q = 0.1 for the correct and the under-noised optimizer, against the ledger's
PRV claim.

With ``--samplers`` only the sampler section runs instead: the white-box gradient canary trained
with shuffled fixed-size batches and with Poisson batches at the same q = b/N and z
(``dpledger.audit.torch_sampler_audit``), both observations (last iterate, every step), the
audited Clopper–Pearson and Gaussian-DP bounds beside each run ledger's claim (Poisson: PRV upper
bound; shuffled: PRV refuses, the no-amplification RDP bound, the Poisson ε it would be reported
with, Chua et al.'s lower bound), the exact ε of the shuffled last iterate (μ-GDP), and what
``--sampler-reach-runs`` runs per side of the every-step shuffled audit could reach at best
(closed-form scores, no training: the largest log((TPR − δ)/max(FPR, 3/R)) over thresholds).

Run: ``PYTHONPATH=. python benchmarks/audit_bench.py`` (``--help`` for options; ``--quick`` is a
smoke run of a few runs of each section).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import logging
import multiprocessing
import os
import platform
import statistics
import subprocess
import time
import warnings
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger.accountants import make_accountant
from dpledger.audit import HeldOutSplit, audit_verdict, run_distinguishing_game
from dpledger.audit.privacy_bounds import BoundMethod
from dpledger.audit.threshold_selection import one_run_epsilon_bound_from_scores
from dpledger.audit.torch_audit import (
    BlackBoxDigitsAudit,
    WhiteBoxDigitsAudit,
    representative_ledger,
    run_black_box_digits,
    train_black_box_digits,
    train_white_box_digits,
)
from dpledger.audit.torch_last_iterate import LastIterateDigitsAudit, train_last_iterate_digits
from dpledger.audit.torch_one_run import WhiteBoxOneRunAudit, run_white_box_one_run
from dpledger.audit.torch_sampler_audit import SamplerAudit, run_sampler_audit

DELTA = 1e-5
CONFIDENCE = 0.95


def machine() -> str:
    try:
        model = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.split(
            "Model name:"
        )[1]
        model = model.splitlines()[0].strip()
    except (OSError, IndexError):
        model = platform.processor() or platform.machine()
    try:
        import opacus

        peer = f"opacus {opacus.__version__}"
    except ImportError:  # pragma: no cover - depends on the environment
        peer = "opacus not installed"
    return (
        f"{model}, nproc {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}; "
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"numpy {np.__version__}, {peer}"
    )


# ---------------------------------------------------------------------------------- the audit
def audit(config: BlackBoxDigitsAudit, *, runs: int, workers: int, seed: int) -> dict[str, Any]:
    """Run the game with ``runs`` runs in all; time it and bound it."""
    start = time.perf_counter()
    game = run_distinguishing_game(
        functools.partial(train_black_box_digits, config=config),
        runs_per_side=runs // 2,
        seed=seed,
        workers=workers,
        chunk_size=10,
        progress=False,
    )
    wall = time.perf_counter() - start
    bound = game.epsilon_lower_bound(
        delta=DELTA, confidence=CONFIDENCE, selection=HeldOutSplit(seed=seed)
    )
    verdict = audit_verdict(bound, representative_ledger(config), accountant="prv")
    run_seconds = [r.seconds for r in (*game.runs_with_canary, *game.runs_without_canary)]
    return {
        "wall": wall,
        "median_run": statistics.median(run_seconds),
        "total_run": sum(run_seconds),
        "verdict": verdict,
        "counts": bound.counts,
    }


def _start_worker(_: int) -> float:
    """What a spawned worker does before its first run: import, load the digits."""
    start = time.perf_counter()
    from dpledger.audit import torch_audit

    torch_audit.digits_records()
    return time.perf_counter() - start


def worker_start_up(workers: int) -> float:
    """Seconds from creating a spawn pool to every worker having imported the audit code."""
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        list(pool.map(_start_worker, range(workers)))
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------- executors
def _white_box_game(config: WhiteBoxDigitsAudit, runs_per_side: int, seed: int, **how: Any):
    start = time.perf_counter()
    game = run_distinguishing_game(
        functools.partial(train_white_box_digits, config=config),
        runs_per_side=runs_per_side,
        seed=seed,
        chunk_size=10,
        progress=False,
        **how,
    )
    return game, time.perf_counter() - start


def executors(config: WhiteBoxDigitsAudit, *, runs_per_side: int, workers: int, seed: int):
    """The same white-box game on the local process pool and on a Dask LocalCluster."""
    print(f"\n## Runs/s: local process pool vs Dask LocalCluster ({workers} workers each)")
    print(f"{'executor':34s} {'runs':>6s} {'wall s':>8s} {'runs/s':>8s}")
    pool_game, wall = _white_box_game(config, runs_per_side, seed, workers=workers)
    print(f"{'ProcessPoolExecutor (spawn)':34s} {2 * runs_per_side:6d} {wall:8.1f} "
          f"{2 * runs_per_side / wall:8.1f}")  # fmt: skip
    try:
        import distributed
    except ImportError:  # pragma: no cover - Dask is the optional extra dpledger[dask]
        print("Dask not installed (pip install 'dpledger[dask]'): skipped")
        return pool_game
    start = time.perf_counter()
    cluster = distributed.LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        silence_logs=logging.WARNING,
    )
    client = distributed.Client(cluster)
    client.run(_start_worker, 0)  # import torch, dpledger and the digits in every worker
    started = time.perf_counter() - start
    try:
        dask_game, wall = _white_box_game(
            config, runs_per_side, seed, executor=client.get_executor()
        )
    finally:
        client.close()
        cluster.close()
    print(f"{'Dask LocalCluster get_executor()':34s} {2 * runs_per_side:6d} {wall:8.1f} "
          f"{2 * runs_per_side / wall:8.1f}")  # fmt: skip
    same = np.array_equal(pool_game.scores_with_canary, dask_game.scores_with_canary) and (
        np.array_equal(pool_game.scores_without_canary, dask_game.scores_without_canary)
    )
    print(f"Dask cluster start-up (and worker imports): {started:.1f} s; "
          f"scores identical on both executors: {same}")  # fmt: skip
    return pool_game


# ---------------------------------------------------------------------------------- white box
def _one_run_scores(config: WhiteBoxOneRunAudit, seed: int) -> tuple[np.ndarray, np.ndarray]:
    torch.set_num_threads(1)
    res = run_white_box_one_run(config, seed=seed)
    return res.scores, res.included


def white_box_bounds(config: WhiteBoxDigitsAudit, game: Any, *, canaries: int, workers: int):
    """CP and GDP from the game beside both one-run bounds from as many one-run runs."""
    claim = make_accountant("prv").epsilon(config.claimed_ledger(), delta=DELTA).epsilon
    runs = 2 * game.runs_per_side
    print(
        f"\n## White box at claim ε = {claim:.3f} (PRV, δ = {DELTA:g}): {runs} training runs each"
    )
    selection = config.preregistered_thresholds()
    rows = []
    for method in (BoundMethod.CLOPPER_PEARSON, BoundMethod.GAUSSIAN_DP):
        b = game.epsilon_lower_bound(
            delta=DELTA, confidence=CONFIDENCE, selection=selection, method=method
        )
        rows.append((f"game, {method.value}", b.epsilon, b.counts))
    one = WhiteBoxOneRunAudit(
        noise_multiplier=config.noise_multiplier, steps=config.steps, num_canaries=canaries
    )
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        outs = list(pool.map(functools.partial(_one_run_scores, one), range(runs)))
    wall = time.perf_counter() - start
    scores = np.concatenate([o[0] for o in outs])
    included = np.concatenate([o[1] for o in outs])
    m = scores.size
    guesses = [(max(1, round(f * m)), 0) for f in (0.01, 0.02, 0.05, 0.1)]
    for method in (BoundMethod.ONE_RUN, BoundMethod.FDP_ONE_RUN):
        b = one_run_epsilon_bound_from_scores(
            scores, included, guess_counts=guesses, delta=DELTA, confidence=CONFIDENCE,
            method=method,
        )  # fmt: skip
        rows.append((f"one run × {runs}, {method.value}", b.epsilon, b.counts))
    print(f"(one-run runs: {canaries} canaries each, {m} in all, {wall:.1f} s on {workers} "
          f"workers; guesses: top 1/2/5/10% of the canaries, Bonferroni over 4)")  # fmt: skip
    print(f"{'audit':34s} {'ε lower bound':>14s} {'claim/bound':>12s}  counts")
    for name, eps, counts in rows:
        ratio = f"{claim / eps:12.2f}" if eps > 0 else f"{'∞':>12s}"
        print(f"{name:34s} {eps:14.3f} {ratio}  {counts}")


def last_iterate(*, runs_per_side: int, workers: int, seed: int) -> None:
    """Last-iterate audits (final model only) against the ledger's claim, q = 1 and q = 0.1."""
    print(
        f"\n## Last iterate: crafted gradient canary, final model only ({runs_per_side} runs per "
        f"side, claim ε = 2 by RDP at δ = {DELTA:g}, Clopper–Pearson at {CONFIDENCE:.0%})"
    )
    print(f"{'setting':30s} {'optimizer':16s} {'claim (PRV)':>12s} {'bound':>8s}  verdict")
    for q, steps in ((1.0, 4), (0.1, 30)):
        config = LastIterateDigitsAudit.for_target_epsilon(
            target_epsilon=2.0, delta=DELTA, sampling_probability=q, steps=steps
        )
        claim = make_accountant("prv").epsilon(config.claimed_ledger(), delta=DELTA).epsilon
        for implementation in ("correct", "batch_size_bug"):
            audited = attrs.evolve(config, implementation=implementation)
            game = run_distinguishing_game(
                functools.partial(train_last_iterate_digits, config=audited),
                runs_per_side=runs_per_side,
                seed=seed,
                workers=workers,
                chunk_size=10,
                progress=False,
            )
            b = game.epsilon_lower_bound(
                delta=DELTA, confidence=CONFIDENCE, selection=audited.preregistered_thresholds()
            )
            verdict = "refuted" if b.epsilon > claim else "consistent"
            setting = f"q = {q:g}, T = {steps}, z = {config.noise_multiplier:.3f}"
            print(f"{setting:30s} {implementation:16s} {claim:12.3f} {b.epsilon:8.3f}  {verdict}")


# ---------------------------------------------------------------------------------- samplers
SAMPLER_SETTINGS = ((10, 1, 1.0), (10, 2, 0.8), (5, 1, 0.6))
"""(b, E, z) on N = 100 records: q = b/N, T = E·N/b steps."""


def _gdp_epsilon(mu: float) -> float:
    from scipy.optimize import brentq
    from scipy.stats import norm

    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - np.exp(eps) * norm.cdf(-eps / mu - mu / 2) - DELTA

    return 0.0 if excess(0.0) <= 0 else float(brentq(excess, 0.0, 200.0))


def every_step_reach(config: SamplerAudit, runs: int, samples: int, seed: int) -> float:
    """The best CP-style bound R = ``runs`` runs per side could reach on closed-form scores."""
    rng = np.random.default_rng(seed)
    z, shape = config.noise_multiplier, (config.epochs, config.batches_per_epoch)
    null = np.array([config.score(rng.normal(0.0, z, shape).ravel()) for _ in range(samples)])
    alt = []
    for _ in range(samples):
        w = rng.normal(0.0, z, shape)
        w[np.arange(config.epochs), rng.integers(shape[1], size=config.epochs)] += 1.0
        alt.append(config.score(w.ravel()))
    alt_scores = np.asarray(alt)
    best = 0.0
    for k in (3, 5, 10, 20, 40, 80):
        t = float(np.quantile(null, 1.0 - k / runs))
        tpr = float((alt_scores >= t).mean())
        fpr = max(float((null >= t).mean()), 3.0 / runs)
        if tpr > DELTA:
            best = max(best, float(np.log((tpr - DELTA) / fpr)))
    return best


def samplers(*, runs_per_side: int, workers: int, seed: int, reach_runs: int, samples: int):
    """Shuffled vs Poisson batches, same q and z: audited bounds beside the ledgers' claims."""
    from dpledger.accountants.shuffle_bound import shuffle_epsilon_lower_bound

    print(
        f"\n## Samplers: shuffled vs Poisson batches, white-box gradient canary, N = 100 "
        f"({runs_per_side} runs per side, δ = {DELTA:g}, {CONFIDENCE:.0%} confidence)"
    )
    print(f"{'setting':26s} {'observed':12s} {'sampler':8s} {'CP':>6s} {'GDP':>6s} {'runs/s':>7s}"
          "  the run ledger's claim")  # fmt: skip
    for b, epochs, z in SAMPLER_SETTINGS:
        setting = f"q = {b / 100:g}, E = {epochs}, z = {z:g}"
        for observation in ("last_iterate", "every_step"):
            for sampler in ("poisson", "shuffle"):
                config = SamplerAudit(
                    sampler=sampler, noise_multiplier=z, batch_size=b, epochs=epochs,
                    observation=observation,
                )  # fmt: skip
                start = time.perf_counter()
                r = run_sampler_audit(
                    config, runs_per_side=runs_per_side, seed=seed, delta=DELTA,
                    confidence=CONFIDENCE, workers=workers,
                )  # fmt: skip
                rate = 2 * runs_per_side / (time.perf_counter() - start)
                print(f"{setting:26s} {observation:12s} {sampler:8s} "
                      f"{r.clopper_pearson.epsilon:6.3f} {r.gaussian_dp.epsilon:6.3f} "
                      f"{rate:7.1f}  {r.claim.describe()}")  # fmt: skip
        shuffled = attrs.evolve(config, observation="every_step")
        exact = _gdp_epsilon(shuffled.shuffled_last_iterate_mu())
        chua = shuffle_epsilon_lower_bound(
            batches_per_epoch=shuffled.batches_per_epoch, epochs=epochs, noise_multiplier=z,
            delta=DELTA,
        )  # fmt: skip
        reach = every_step_reach(shuffled, reach_runs, samples, seed)
        print(f"{setting:26s} shuffled: last iterate exactly ε = {exact:.3f} "
              f"(μ = {shuffled.shuffled_last_iterate_mu():.3f}); Chua et al. ε ≥ {chua:.3f} "
              f"(add/remove); every-step audit with {reach_runs} runs per side reaches at "
              f"best ε ≈ {reach:.3f}")  # fmt: skip


# ---------------------------------------------------------------------------------- one run, 3 ways
def _batches(config: BlackBoxDigitsAudit, seed: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    from dpledger.audit.torch_audit import _digits_tensors

    x, y = _digits_tensors(config.num_records)
    generator = torch.Generator().manual_seed(seed)
    batches = [
        (torch.rand(len(y), generator=generator) < config.sampling_probability).nonzero().view(-1)
        for _ in range(config.steps)
    ]
    return x, y, batches


def non_private_run(config: BlackBoxDigitsAudit, seed: int) -> None:
    x, y, batches = _batches(config, seed)
    model = nn.Linear(64, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    for b in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x[b]), y[b]).backward()
        optimizer.step()


def opacus_run(config: BlackBoxDigitsAudit, seed: int) -> None:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer as OpacusDPOptimizer

    x, y, batches = _batches(config, seed)
    model = GradSampleModule(nn.Linear(64, 10))
    optimizer = OpacusDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=config.learning_rate),
        noise_multiplier=config.noise_multiplier,
        max_grad_norm=config.l2_norm_bound,
        expected_batch_size=round(config.sampling_probability * len(y)),
    )
    for b in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x[b]), y[b]).backward()
        optimizer.step()


def dpledger_run(config: BlackBoxDigitsAudit, seed: int) -> None:
    run_black_box_digits(config, include_canary=True, seed=seed)


def time_runs(functions: dict[str, Any], repeats: int) -> dict[str, float]:
    for f in functions.values():
        f(0)
    times: dict[str, list[float]] = {k: [] for k in functions}
    for r in range(repeats):
        for k, f in functions.items():  # interleaved: load drifts hit every row alike
            start = time.perf_counter()
            f(r + 1)
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs in all (half per side)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30, help="repeats of the inline timings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-buggy", action="store_true", help="skip the buggy optimizer's audit")
    parser.add_argument(
        "--white-box-runs", type=int, default=1000, help="white-box runs per side (executors)"
    )
    parser.add_argument("--canaries", type=int, default=1000, help="canaries per one-run run")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: a few runs of every section"
    )
    parser.add_argument(
        "--samplers", action="store_true", help="run only the sampler section (shuffle vs Poisson)"
    )
    parser.add_argument(
        "--sampler-runs", type=int, default=1000, help="runs per side of each sampler audit"
    )
    parser.add_argument(
        "--sampler-reach-runs", type=int, default=10000, help="R of the every-step reach"
    )
    parser.add_argument(
        "--sampler-samples", type=int, default=200000, help="closed-form scores per side (reach)"
    )
    args = parser.parse_args()
    if args.quick:
        args.runs, args.repeats, args.no_buggy, args.white_box_runs = 20, 3, True, 10
        args.sampler_runs, args.sampler_samples = 10, 2000
    torch.set_num_threads(1)
    # Opacus's hooks warn on every backward that the input needs no gradient (it does not).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    print(machine())
    if args.samplers:
        samplers(
            runs_per_side=args.sampler_runs,
            workers=args.workers,
            seed=args.seed,
            reach_runs=args.sampler_reach_runs,
            samples=args.sampler_samples,
        )
        return
    config = BlackBoxDigitsAudit.for_target_epsilon(target_epsilon=2.0, delta=DELTA)
    claim = make_accountant("prv").epsilon(config.claimed_ledger(), delta=DELTA).epsilon
    print(
        f"\n## Black-box audit: {args.runs} runs ({args.runs // 2} per side), "
        f"{args.workers} spawned workers, 1 torch thread each"
    )
    print(
        f"digits logistic regression, q = {config.sampling_probability}, T = {config.steps}, "
        f"z = {config.noise_multiplier:.4f}; claimed ε = {claim:.3f} (PRV) at δ = {DELTA:g}"
    )
    implementations = ["correct"] if args.no_buggy else ["correct", "batch_size_bug"]
    print(f"{'optimizer':16s} {'wall s':>8s} {'ms/run':>8s} {'runs/s':>8s}  bound, verdict")
    for k, implementation in enumerate(implementations):
        audited = attrs.evolve(config, implementation=implementation)
        r = audit(audited, runs=args.runs, workers=args.workers, seed=args.seed + k)
        v = r["verdict"]
        print(
            f"{implementation:16s} {r['wall']:8.1f} {r['median_run'] * 1e3:8.1f} "
            f"{args.runs / r['wall']:8.1f}  ε ≥ {v.lower_bound:.3f} ({r['counts']}): {v.status}"
        )
    print(
        f"worker start-up (spawn, import torch + dpledger, load digits): "
        f"{worker_start_up(args.workers):.1f} s for {args.workers} workers"
    )

    white = WhiteBoxDigitsAudit.for_target_epsilon(
        target_epsilon=4.0, delta=DELTA, accountant="prv", steps=4
    )
    game = executors(white, runs_per_side=args.white_box_runs, workers=args.workers, seed=args.seed)
    white_box_bounds(white, game, canaries=args.canaries, workers=args.workers)
    last_iterate(runs_per_side=args.white_box_runs // 2, workers=args.workers, seed=args.seed)

    print(f"\n## One training run inline (median of {args.repeats} interleaved repeats)")
    functions = {
        "dpledger": functools.partial(dpledger_run, config),
        "non-private": functools.partial(non_private_run, config),
    }
    try:
        import opacus  # noqa: F401

        functions["opacus"] = functools.partial(opacus_run, config)
    except ImportError:  # pragma: no cover - depends on the environment
        pass
    med = time_runs(functions, args.repeats)
    base = med["non-private"]
    print(f"{'run':16s} {'ms/run':>8s} {'x non-private':>14s} {'x opacus':>9s}")
    for name, seconds in med.items():
        rel = f"{seconds / med['opacus']:9.2f}" if "opacus" in med else f"{'-':>9s}"
        print(f"{name:16s} {seconds * 1e3:8.1f} {seconds / base:14.2f} {rel}")
    one = attrs.evolve(config, steps=1)
    split = time_runs(
        {
            "1 step": functools.partial(dpledger_run, one),
            f"{config.steps} steps": functools.partial(dpledger_run, config),
        },
        args.repeats,
    )
    per_step = (split[f"{config.steps} steps"] - split["1 step"]) / (config.steps - 1)
    fixed = split["1 step"] - per_step
    print(
        f"dpledger run = {fixed * 1e3:.1f} ms fixed (model, sampler, optimizer) + "
        f"{config.steps} × {per_step * 1e3:.2f} ms per step"
    )


if __name__ == "__main__":
    main()
