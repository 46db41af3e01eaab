"""False-alarm rate, detection rate and cost of the DP-SGD implementation-bug checks.

For each seed the full set of checks runs on a *correct* DP-SGD step (a small PyTorch MLP and a
NumPy linear model); any FAIL is a false alarm. The seed changes the model initialisation, the
synthetic data and every noise draw. The same is done for each deliberately buggy step to measure
how often the targeted check catches it. The calibration of the noise-magnitude test is shown by
the fraction of its KS and χ² p-values below 0.05 and 0.01 (≈ 5 % and 1 % for a valid test).

Cost: the checks drive the step as a black box, so their cost is reported as the ratio of one
full run of the checks to one DP step of the same function on the same machine (medians over
repeats), next to the absolute time. There is no peer implementation of these checks to compare
with.

    PYTHONPATH=. python benchmarks/checks_false_alarms.py          # 30 torch, 20 Adam, 200 numpy
    PYTHONPATH=. python benchmarks/checks_false_alarms.py --quick  # a few seeds each
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import scipy

from dpledger.checks import Verdict, run_checks
from dpledger.checks.checker import CHECK_NAMES
from tests.checks.numpy_steps import NumpyLinearHarness

TORCH_BUGS = {
    "no_clip": "clipping_applied",
    "clip_mean": "per_example_clipping",
    "uncalibrated": "noise_calibrated",
    "noise_over_batch": "noise_magnitude",
}
NUMPY_BUGS = {**TORCH_BUGS, "clip_sum": "per_example_clipping"}
#: the checks allowed to fail for each bug (noise N(0, σ²) also has the wrong magnitude)
ALLOWED_FAILURES = {bug: {target} for bug, target in NUMPY_BUGS.items()}
ALLOWED_FAILURES["uncalibrated"].add("noise_magnitude")


def bug_entry(reports: list[Any], bug: str, target: str) -> dict[str, Any]:
    caught = sum(r[target].verdict is Verdict.FAIL for r in reports)
    unexpected = sum(bool(set(r.failed) - ALLOWED_FAILURES[bug]) for r in reports)
    return {
        "target": target,
        "caught": caught,
        "runs": len(reports),
        "runs_with_an_unexpected_fail": unexpected,
    }


def machine() -> dict[str, Any]:
    try:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            (ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if "Model name" in ln), "?"
        )
    except OSError:
        model = "?"
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
    info = {
        "nproc": nproc,
        "cpu": model,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def tally(reports: list[Any]) -> dict[str, Any]:
    counts = {name: collections.Counter() for name in CHECK_NAMES}
    any_fail = 0
    ks, chi2 = [], []
    for report in reports:
        any_fail += bool(report.failed)
        for result in report.results:
            counts[result.name][result.verdict.value] += 1
            if result.name == "noise_magnitude" and result.verdict is not Verdict.SKIPPED:
                ks.append(result.details["ks_p_value"])
                chi2.append(result.details["chi2_p_value"])
    out: dict[str, Any] = {
        "runs": len(reports),
        "runs_with_a_fail": any_fail,
        "verdicts": {k: dict(v) for k, v in counts.items()},
    }
    if ks:
        for name, ps in (("ks", np.asarray(ks)), ("chi2", np.asarray(chi2))):
            out[f"{name}_p_below_0.05"] = float(np.mean(ps < 0.05))
            out[f"{name}_p_below_0.01"] = float(np.mean(ps < 0.01))
    return out


def numpy_runs(seeds: int, bug: str | None) -> list[Any]:
    return [
        run_checks(
            NumpyLinearHarness(lr=0.01, seed=s, bug=bug),
            input_shape=(5,),
            loss="mse",
            learning_rate=0.01,
            seed=s,
        )
        for s in range(seeds)
    ]


def torch_runs(seeds: int, bug: str | None, loss: str) -> tuple[list[Any], list[float]]:
    from dpledger.checks.torch_step import check_dp_sgd
    from tests.checks.torch_steps import make_dp_sgd_step, mlp

    reports, seconds = [], []
    for s in range(seeds):
        start = time.perf_counter()
        reports.append(
            check_dp_sgd(
                make_dp_sgd_step(loss=loss, bug=bug),
                lambda: mlp(10, 3),
                loss=loss,
                input_shape=(10,),
                seed=1000 + s,
            )
        )
        seconds.append(time.perf_counter() - start)
    return reports, seconds


def adam_runs(seeds: int) -> tuple[list[Any], list[float]]:
    from dpledger.checks.torch_step import check_dp_optimizer
    from tests.checks.torch_steps import make_adam_step, mlp

    reports, seconds = [], []
    for s in range(seeds):
        start = time.perf_counter()
        reports.append(
            check_dp_optimizer(
                make_adam_step(loss="mse"),
                lambda: mlp(10, 3),
                loss="mse",
                input_shape=(10,),
                lr=1e-3,
                seed=2000 + s,
            )
        )
        seconds.append(time.perf_counter() - start)
    return reports, seconds


def one_step_seconds(loss: str, repeats: int = 50) -> float:
    import torch

    from dpledger.checks.synthetic_data import ordinary_batch
    from tests.checks.torch_steps import make_dp_sgd_step, mlp

    step = make_dp_sgd_step(loss=loss)
    model = mlp(10, 3).double()
    x, y = ordinary_batch(
        input_shape=(10,), num_outputs=3, batch_size=16, loss=loss, rng=np.random.default_rng(0)
    )
    xt = torch.as_tensor(x)
    yt = torch.as_tensor(y)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        step(
            model,
            xt,
            yt,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            lr=0.01,
            generator=torch.Generator().manual_seed(i),
        )
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-seeds", type=int, default=30)
    parser.add_argument("--numpy-seeds", type=int, default=200)
    parser.add_argument("--bug-seeds", type=int, default=10, help="torch seeds per buggy step")
    parser.add_argument("--adam-seeds", type=int, default=20, help="seeds for DP-Adam")
    parser.add_argument("--quick", action="store_true", help="5 torch and 20 numpy seeds")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.torch_seeds, args.numpy_seeds, args.bug_seeds, args.adam_seeds = 5, 20, 2, 2
    results: dict[str, Any] = {"machine": machine()}
    print(json.dumps(results["machine"]))

    results["numpy_correct"] = tally(numpy_runs(args.numpy_seeds, None))
    print("numpy linear regression, correct step:", json.dumps(results["numpy_correct"]))
    results["numpy_bugs"] = {}
    for bug, target in NUMPY_BUGS.items():
        entry = bug_entry(numpy_runs(args.numpy_seeds, bug), bug, target)
        results["numpy_bugs"][bug] = entry
        print(f"numpy {bug}:", json.dumps(entry))

    try:
        import torch
    except ImportError:
        print("torch not installed: skipping the MLP runs")
    else:
        torch.set_num_threads(1)  # tiny model: threads only add overhead on a shared machine
        results["torch_threads"] = 1
        for loss in ("mse", "cross_entropy"):
            reps, secs = torch_runs(args.torch_seeds, None, loss)
            step = one_step_seconds(loss)
            steps_run = statistics.median(r.settings["steps_run"] for r in reps)
            entry = tally(reps)
            entry.update(
                median_seconds=statistics.median(secs),
                max_seconds=max(secs),
                median_one_step_seconds=step,
                cost_in_steps=statistics.median(secs) / step,
                steps_run=steps_run,
            )
            results[f"torch_{loss}_correct"] = entry
            print(f"torch MLP ({loss}), correct step:", json.dumps(entry))
        reps, secs = adam_runs(args.adam_seeds)
        entry = tally(reps)
        entry.update(median_seconds=statistics.median(secs), max_seconds=max(secs))
        results["torch_adam_correct"] = entry
        print("torch MLP, DP-Adam (5 warm-up steps), correct step:", json.dumps(entry))
        results["torch_bugs"] = {}
        for bug, target in TORCH_BUGS.items():
            reps, _ = torch_runs(args.bug_seeds, bug, "mse")
            entry = bug_entry(reps, bug, target)
            results["torch_bugs"][bug] = entry
            print(f"torch MLP {bug}:", json.dumps(entry))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
