"""Audit the PyTorch adapter's privacy on scikit-learn's digits, and catch the batch-size bug.

An accountant's ε is an upper bound; an audit measures a lower bound that holds with a stated
confidence (Tramèr et al. 2022, "Debugging Differential Privacy"). The script runs the
distinguishing game — train on D and on D ∪ {canary} many times with fresh seeds, score every
model — and compares the bound with the ε that the runs' ledger claims:

1. **Black box.** Logistic regression trained with ``DPOptimizer`` and Poisson sampling; the
   canary lights only the always-blank pixels; the score is −(loss on the canary). The correct
   optimizer is audited, then one with the case study's bug (noise B = q·n times too small while
   the ledger records the correct σ̃, so it claims the same ε). Clopper–Pearson bound with the
   threshold chosen on a held-out half of the runs. Expected: "consistent", then "claim refuted".
2. **White box.** Full-batch DP-SGD with a gradient canary (a record whose gradient is a fixed
   direction on a weight no digit touches); the score is the final model's movement along it.
   Thresholds are fixed from the claim before any run; Clopper–Pearson and Gaussian-DP bounds
   are compared with the claim, as a ratio.

Runs go to JSON Lines files in ``--out`` as they finish: interrupt the script and start it again
with the same arguments, and it continues where it stopped. Figures are written there too.

    python examples/audit_digits.py [--runs 250] [--white-box-runs 2000] [--workers 2]
    python examples/audit_digits.py --quick       # 100 and 500 runs per side (43 s, 2-core x86_64)
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from pathlib import Path
from typing import Any

import attrs

from dpledger.accountants import make_accountant
from dpledger.audit import (
    HeldOutSplit,
    audit_verdict,
    plot_bound_versus_runs,
    plot_score_distributions,
    run_distinguishing_game,
)
from dpledger.audit.torch_audit import (
    BlackBoxDigitsAudit,
    WhiteBoxDigitsAudit,
    representative_ledger,
    train_black_box_digits,
    train_white_box_digits,
)

DELTA = 1e-5
CONFIDENCE = 0.95
CLAIM_ACCOUNTANT = "prv"  # a certified upper bound, the tightest claim the ledger supports


def _run_counts(total: int) -> list[int]:
    """Prefix sizes for the bound-against-runs curve: roughly doubling up to ``total``."""
    counts, n = [], 20
    while n < total:
        counts.append(n)
        n *= 2
    return [*counts, total]


def _finish_bound_axes(ax: Any, claim: float, title: str) -> None:
    """The claimed ε as a line, y from 0 to above every curve, a legend and a title."""
    ax.axhline(claim, color="red", linestyle="--", label=f"claimed ε = {claim:.3g} (PRV)")
    top = max(max(line.get_ydata()) for line in ax.lines)
    ax.set_ylim(0.0, 1.1 * top)
    ax.set_title(title)
    ax.legend()


def _claims(ledger: Any) -> dict[str, float]:
    return {
        name: make_accountant(name).epsilon(ledger, delta=DELTA).epsilon for name in ("prv", "rdp")
    }


def black_box(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The black-box audit of the correct optimizer and of the buggy one."""
    import matplotlib.pyplot as plt

    config = BlackBoxDigitsAudit.for_target_epsilon(target_epsilon=2.0, delta=DELTA)
    ledger = representative_ledger(config)
    claims = _claims(ledger)
    print(
        f"Black box: {config.steps} steps, q = {config.sampling_probability}, "
        f"z = {config.noise_multiplier:.4f}; the ledger claims ε = {claims['prv']:.3f} (PRV) / "
        f"{claims['rdp']:.3f} (RDP) at δ = {DELTA:g}"
    )
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    results = {}
    for k, implementation in enumerate(("correct", "batch_size_bug")):
        audited = attrs.evolve(config, implementation=implementation)
        start = time.perf_counter()
        game = run_distinguishing_game(
            functools.partial(train_black_box_digits, config=audited),
            runs_per_side=args.runs,
            seed=args.seed + k,
            results_path=out / f"black_box_{implementation}.jsonl",
            workers=args.workers,
            chunk_size=10,
            progress=True,
        )
        seconds = time.perf_counter() - start
        selection = HeldOutSplit(seed=args.seed)
        bound = game.epsilon_lower_bound(delta=DELTA, confidence=CONFIDENCE, selection=selection)
        verdict = audit_verdict(bound, ledger, accountant=CLAIM_ACCOUNTANT)
        print(f"  {implementation}: {2 * args.runs} runs in {seconds:.1f} s; counts {bound.counts}")
        print(f"    {verdict}")
        results[implementation] = verdict
        plot_score_distributions(
            game.scores_with_canary,
            game.scores_without_canary,
            threshold=bound.threshold,
            ax=axes[k],
        )
        axes[k].set_title(f"black box, {implementation}: −loss on the canary")
        curve = game.bound_versus_runs(
            _run_counts(args.runs), delta=DELTA, confidence=CONFIDENCE, selection=selection
        )
        plot_bound_versus_runs(curve, ax=axes[2])
        axes[2].lines[-1].set_label(f"{implementation}: Clopper–Pearson, held-out split")
    _finish_bound_axes(axes[2], claims["prv"], "black box: lower bound against runs")
    fig.tight_layout()
    fig.savefig(out / "black_box.png", dpi=110)
    plt.close(fig)
    return results


def white_box(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The white-box audit with a gradient canary in full-batch DP-SGD."""
    import matplotlib.pyplot as plt

    config = WhiteBoxDigitsAudit.for_target_epsilon(
        target_epsilon=args.white_box_epsilon, delta=DELTA, accountant="prv", steps=4
    )
    ledger = representative_ledger(config)
    claims = _claims(ledger)
    claim = claims["prv"]
    print(
        f"\nWhite box: {config.steps} full-batch steps, z = {config.noise_multiplier:.4f} "
        f"(μ = {config.claimed_mu():.3f}); the ledger claims ε = {claim:.3f} (PRV) / "
        f"{claims['rdp']:.3f} (RDP) at δ = {DELTA:g}"
    )
    selection = config.preregistered_thresholds()
    start = time.perf_counter()
    game = run_distinguishing_game(
        functools.partial(train_white_box_digits, config=config),
        runs_per_side=args.white_box_runs,
        seed=args.seed + 10,
        results_path=out / f"white_box_correct_eps{args.white_box_epsilon:g}.jsonl",
        workers=args.workers,
        chunk_size=100,
        progress=True,
    )
    seconds = time.perf_counter() - start
    print(f"  correct: {2 * args.white_box_runs} runs in {seconds:.1f} s")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    results = {}
    counts = _run_counts(args.white_box_runs)
    for method in ("clopper_pearson", "gaussian_dp"):
        bound = game.epsilon_lower_bound(
            delta=DELTA, confidence=CONFIDENCE, selection=selection, method=method
        )
        verdict = audit_verdict(bound, ledger, accountant=CLAIM_ACCOUNTANT)
        ratio = claim / bound.epsilon if bound.epsilon > 0 else math.inf
        curve = game.bound_versus_runs(
            counts, delta=DELTA, confidence=CONFIDENCE, selection=selection, method=method
        )
        within = [n for n, b in curve if b.epsilon > 0 and claim / b.epsilon <= 2.0]
        reached = f"first within 2× at {within[0]} runs per side" if within else "not within 2×"
        print(
            f"    {method}: ε ≥ {bound.epsilon:.3f}, claim/bound = {ratio:.2f} "
            f"({reached} of the prefixes {counts})"
        )
        print(f"      {verdict}")
        results[method] = (bound, ratio, within[0] if within else None)
        plot_bound_versus_runs(curve, ax=axes[1])
        axes[1].lines[-1].set_label(f"{method.replace('_', ' ')}, thresholds fixed in advance")
    axes[1].axhline(claim / 2, color="grey", linestyle=":", label="claimed ε / 2")
    _finish_bound_axes(axes[1], claim, "white box: lower bound against runs")
    best = results["gaussian_dp"][0]
    plot_score_distributions(
        game.scores_with_canary, game.scores_without_canary, threshold=best.threshold, ax=axes[0]
    )
    axes[0].set_title("white box: movement along the canary (units of η·C/n)")
    fig.tight_layout()
    fig.savefig(out / f"white_box_eps{args.white_box_epsilon:g}.png", dpi=110)
    plt.close(fig)

    # Perfect separation with N runs per side caps Clopper–Pearson near ln(N): refuting a
    # claim of 4 takes a few hundred runs per side even when the bug is blatant.
    buggy = attrs.evolve(config, implementation="batch_size_bug")
    game = run_distinguishing_game(
        functools.partial(train_white_box_digits, config=buggy),
        runs_per_side=600,
        seed=args.seed + 11,
        results_path=out / f"white_box_batch_size_bug_eps{args.white_box_epsilon:g}.jsonl",
        workers=args.workers,
        chunk_size=100,
    )
    bound = game.epsilon_lower_bound(delta=DELTA, confidence=CONFIDENCE, selection=selection)
    verdict = audit_verdict(bound, ledger, accountant=CLAIM_ACCOUNTANT)
    print(f"  batch_size_bug: 1200 runs; counts {bound.counts}")
    print(f"    {verdict}")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=250, help="black-box runs per side")
    parser.add_argument("--white-box-runs", type=int, default=2000, help="white-box runs per side")
    parser.add_argument(
        "--white-box-epsilon", type=float, default=4.0, help="ε the white-box run is calibrated to"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="master seed")
    parser.add_argument("--out", default="audit_digits_out", help="results and figures")
    parser.add_argument("--quick", action="store_true", help="100 and 500 runs per side")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.white_box_runs = 100, 500
    import matplotlib

    matplotlib.use("Agg")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    black_box(args, out)
    white_box(args, out)
    white = out / f"white_box_eps{args.white_box_epsilon:g}.png"
    print(f"\nfigures: {out / 'black_box.png'}, {white}")


if __name__ == "__main__":
    main()
