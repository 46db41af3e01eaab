"""Flat vs global vs automatic clipping vs BAM on scikit-learn's digits, at the same ledger ε.

The study behind docs/clipping-study.md. Every DP method trains the same small MLP with DP-SGD
through :class:`~dpledger.adapters.torch.DPOptimizer` on the same Poisson samples (rate q over
the training split), for the same number of steps, with the same noise multiplier z — calibrated
once for ε = 4 at δ = 1e-5 with :func:`~dpledger.accountants.calibrate_noise_multiplier` and the
PRV accountant — so every run's ledger replays to the same ε; the script checks this by replaying
each run's ledger with the PRV accountant's upper bound and asserting equality across methods.
The methods differ only in how each per-example gradient g_i is bounded by S, the L2 bound the
ledger records:

* ``flat`` (local clipping, Abadi et al.): g_i·min(1, C/‖g_i‖), S = C;
* ``global`` (Bu et al., "On the convergence and calibration of deep learning with DP",
  Algorithm 1, option 2): g_i·1{‖g_i‖ ≤ R}, S = R. The paper takes R far above the flat bound
  (R = 210 against C = 1 on MNIST, 75 against 1.5 on CIFAR-10) so that almost no gradient is
  dropped, adds noise σ·R (the same noise multiplier), and shrinks the learning rate so that η·R
  stays about the same (0.0007·210 ≈ 0.15·1). The grid below follows that: it is over R and
  η·R;
* ``automatic`` (Bu et al. 2022): g_i·S/(‖g_i‖ + γ), S = 1, so that η is the step scale and the
  stability constant γ the second hyperparameter;
* ``bam`` (Knolle et al., "Bias-Aware Minimisation", Algorithm 2): flat clipping to C of the
  gradient at the per-example ascent point θ + λ·∇ℓ_i/‖∇ℓ_i‖, S = C (the ledger is DP-SGD's).

A non-private reference (plain SGD on the same Poisson batches, no clipping, no noise) is trained
alongside; it has no ε.

Model: an MLP 64 → 64 (ReLU) → 10 (4,810 parameters) on the 8×8 images flattened and scaled to
[0, 1]. The images are too small for convolutions to pay for themselves, and an MLP run of 600 steps
with per-example gradients takes about 1.6 s on average over the methods (167 s for the 102
tuning runs, benchmarks/RESULTS.md), which is what lets five seeds per method and a twelve-point
grid per method run in a few minutes.

Data: the 1,797 digits split once, stratified with ``random_state=0``: 20% test (360), then 20% of
the rest validation (288), the other 1,149 training records (n of the ledger). Hyperparameters are
chosen on the validation split only (mean validation accuracy over two tuning seeds, ties broken
by the lower validation NLL); the test split is used only for the final runs, five seeds per
method, paired across methods (seed s fixes the initialisation, the Poisson samples and the noise
seed). The configurations the validation NLL would have chosen are also run on the test split, to
show how much the selection criterion matters. The tuning runs' own privacy cost is not accounted
for (each final run's ledger covers that run only).

Metrics on the test split: accuracy, NLL, ECE and MCE with 15 equal-width confidence bins
(:func:`~dpledger.diagnostics.model_calibration_torch.predict_probabilities` into
:func:`~dpledger.diagnostics.model_calibration.model_calibration_metrics`), and the mean over
steps of the clipping-bias metrics from the optimizer's ``bias_callback`` (a
:class:`~dpledger.diagnostics.bias.ClippingBiasRecorder`: ‖ĝ_clip − ĝ‖, the magnitude error a and
the norm of the directional error c of ĝ_clip = a·ĝ + c, cos(ĝ_clip, ĝ), the fraction of records
clipped, the mean per-example gradient norm), as mean ± standard deviation across seeds, with
paired differences to flat clipping and their 95% t-intervals. **The bias metrics are computed
from the raw per-example gradients and are NOT differentially private**: they are for debugging
and research on data one may look at. For BAM,
whose per-example gradients are taken at the perturbed points, the callback compares ĝ_clip with
the mean of those gradients; the script also measures ĝ_clip against the plain mini-batch
gradient ∇L(θ) (``--no-bam-reference`` skips it).

Run (about 5 minutes on 2 shared cores)::

    PYTHONPATH=. python benchmarks/clipping_study.py --out-dir docs/img --results study.json
    PYTHONPATH=. python benchmarks/clipping_study.py --quick      # a smoke test, seconds
"""

from __future__ import annotations

import os

# The bias callback's NumPy dot products would otherwise start OpenBLAS threads that keep
# spinning and slow torch down on a machine with few cores (see benchmarks/RESULTS.md).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from scipy import stats
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from dpledger import PrivacyLedger
from dpledger.accountants import PrvAccountant, calibrate_noise_multiplier
from dpledger.adapters.torch import DPOptimizer, PoissonBatchSampler
from dpledger.adapters.torch.bam import per_example_gradients_and_losses
from dpledger.diagnostics.bias import ClippingBias, ClippingBiasRecorder, clipping_bias
from dpledger.diagnostics.model_calibration import (
    ModelCalibrationMetrics,
    model_calibration_metrics,
    plot_reliability_diagram,
)
from dpledger.diagnostics.model_calibration_torch import predict_probabilities
from dpledger.mechanisms.clipping import AutomaticClipping, ClippingStrategy

DELTA = 1e-5
TARGET_EPSILON = 4.0
SAMPLING_PROBABILITY = 0.05
STEPS = 600  # 30 epochs of round(1/q) = 20 steps
NUM_BINS = 15  # equal-width confidence bins for ECE, MCE and the reliability diagrams
SEEDS = (0, 1, 2, 3, 4)
TUNING_SEEDS = (1000, 1001)
DP_METHODS = ("flat", "global", "automatic", "bam")
REFERENCE = "non-private"
METHODS = (*DP_METHODS, REFERENCE)

# The grids: twelve configurations per DP method, its two key hyperparameters: the bound-like
# one (three values) and the step scale η·S (four values, shared). The update is
# η·(noisy clipped sum)/(q·n), so η·S fixes the size of the noise in the update for every method.
STEP_SCALES = (0.125, 0.25, 0.5, 1.0)
FLAT_BOUNDS = (0.3, 1.0, 3.0)  # C; per-example gradient norms are about 2-5 here
GLOBAL_BOUNDS = (10.0, 20.0, 50.0)  # R: from dropping a small fraction of records to none
AUTOMATIC_STABILITIES = (0.01, 0.1, 1.0)  # γ (S = 1)
BAM_RADII = (0.03, 0.1, 0.3)  # λ; BAM uses the C chosen for flat clipping (as Knolle et al. do)
REFERENCE_LEARNING_RATES = (0.1, 0.3, 1.0)  # the non-private reference: three values


@dataclass(frozen=True)
class Config:
    """One method's hyperparameters.

    Attributes:
        method: one of :data:`METHODS`.
        lr: the SGD learning rate η.
        bound: S, the L2 bound the ledger records (None for the non-private reference).
        bam_radius: λ of BAM.
        stability: γ of automatic clipping.
    """

    method: str
    lr: float
    bound: float | None = None
    bam_radius: float | None = None
    stability: float | None = None

    def describe(self) -> str:
        """The hyperparameters in the notation of the docs."""
        parts = []
        if self.method == "flat":
            parts.append(f"C = {self.bound:g}")
        elif self.method == "global":
            parts.append(f"R = {self.bound:g}")
        elif self.method == "automatic":
            parts.append(f"γ = {self.stability:g}")
        elif self.method == "bam":
            parts += [f"C = {self.bound:g}", f"λ = {self.bam_radius:g}"]
        parts.append(f"η = {self.lr:g}")
        if self.bound is not None:
            parts.append(f"η·S = {self.lr * self.bound:g}")
        return ", ".join(parts)


def grid(method: str, *, flat_bound: float = 1.0) -> list[Config]:
    """The configurations tried for ``method`` (BAM's C is the one chosen for flat clipping)."""
    if method == "flat":
        return [Config("flat", s / c, bound=c) for c in FLAT_BOUNDS for s in STEP_SCALES]
    if method == "global":
        return [Config("global", s / r, bound=r) for r in GLOBAL_BOUNDS for s in STEP_SCALES]
    if method == "automatic":
        return [
            Config("automatic", s, bound=1.0, stability=g)
            for g in AUTOMATIC_STABILITIES
            for s in STEP_SCALES
        ]
    if method == "bam":
        return [
            Config("bam", s / flat_bound, bound=flat_bound, bam_radius=lam)
            for lam in BAM_RADII
            for s in STEP_SCALES
        ]
    if method == REFERENCE:
        return [Config(REFERENCE, lr) for lr in REFERENCE_LEARNING_RATES]
    raise ValueError(f"unknown method {method!r}")


def quick_grid(method: str, *, flat_bound: float = 1.0) -> list[Config]:
    """One configuration per method (the middle of its grid), for ``--quick``."""
    full = grid(method, flat_bound=flat_bound)
    return [full[len(full) // 2]]


@dataclass(frozen=True)
class Split:
    """The fixed train/validation/test split of the digits (float32 features, int64 labels)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def digits_split() -> Split:
    """1,797 digits → 1,149 train, 288 validation, 360 test (stratified, ``random_state=0``)."""
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    x_rest, x_test, y_rest, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y
    )
    x_train, x_val, y_train, y_val = train_test_split(
        x_rest, y_rest, test_size=0.2, random_state=0, stratify=y_rest
    )
    t = torch.from_numpy
    return Split(t(x_train), t(y_train), t(x_val), t(y_val), t(x_test), t(y_test))


class DigitsMLP(nn.Module):
    """64 → 64 (ReLU) → 10: 4,810 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.hidden(x)))


def _example_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


@dataclass
class Run:
    """One training run and what was measured.

    Attributes:
        config: the hyperparameters.
        seed: the seed of the initialisation, the Poisson samples and the noise.
        probabilities: predicted class probabilities on the evaluation split (None: diverged).
        metrics: calibration metrics on the evaluation split (None: diverged).
        bias: mean over steps of the bias callback's scalars (NOT private; None if not recorded).
        bias_curves: per-step values of :data:`CURVES` from the bias callback (NOT private).
        bam_reference: for BAM, the mean over steps of the bias of ĝ_clip against the plain
            mini-batch gradient ∇L(θ) (NOT private).
        ledger: the run's ledger (None for the non-private reference).
        epsilon: ε at δ replayed from the ledger with the PRV upper bound (final runs only).
        seconds: wall time of the training.
    """

    config: Config
    seed: int
    probabilities: np.ndarray | None
    metrics: ModelCalibrationMetrics | None
    bias: dict[str, float] | None = None
    bias_curves: dict[str, np.ndarray] | None = None
    bam_reference: dict[str, float] | None = None
    ledger: PrivacyLedger | None = None
    epsilon: float | None = None
    seconds: float = 0.0

    @property
    def diverged(self) -> bool:
        return self.metrics is None


CURVES = ("bias_norm", "cosine", "mean_example_norm")
"""The bias metrics kept per step for the plots."""


def _clipping(config: Config) -> ClippingStrategy | str:
    if config.method == "automatic":
        return AutomaticClipping(stability=config.stability)
    return "global" if config.method == "global" else "flat"


def _flatten(grads: dict[str, torch.Tensor], batch: int) -> np.ndarray:
    return torch.cat([g.reshape(batch, -1) for g in grads.values()], 1).double().numpy()


def bam_bias_against_plain_gradient(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    bam_radius: float,
    bound: float,
    denominator: float,
) -> ClippingBias:
    """Bias of BAM's clipped gradient against the plain mini-batch gradient ∇L(θ) (NOT private).

    ĝ_clip = (1/l) Σ clip_C(∇ℓ_i(θ_i)) with θ_i BAM's ascent point, against ĝ = (1/l) Σ ∇ℓ_i(θ).
    """
    plain, _ = per_example_gradients_and_losses(model, _example_loss, x, y)
    moved, _ = per_example_gradients_and_losses(model, _example_loss, x, y, bam_radius=bam_radius)
    batch = x.shape[0]
    g, g_bam = _flatten(plain, batch), _flatten(moved, batch)
    factors = ClippingStrategy.parse("flat").factors(
        np.linalg.norm(g_bam, axis=1), l2_norm_bound=bound
    )
    return clipping_bias(g, clipped_gradients=g_bam * factors[:, None], denominator=denominator)


def train(
    config: Config,
    *,
    seed: int,
    split: Split,
    evaluate_on: str,
    noise_multiplier: float,
    steps: int = STEPS,
    sampling_probability: float = SAMPLING_PROBABILITY,
    record_bias: bool = False,
    bam_reference: bool = False,
) -> Run:
    """Train one configuration on the training split and evaluate it on ``evaluate_on``.

    Args:
        config: the hyperparameters.
        seed: seeds the initialisation, the Poisson samples and the noise.
        split: the data.
        evaluate_on: ``"val"`` or ``"test"``.
        noise_multiplier: z of every step.
        steps: T.
        sampling_probability: q.
        record_bias: record the bias metrics (NOT private) every step.
        bam_reference: for BAM, also measure the bias against ∇L(θ) every step (NOT private).
    """
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = DigitsMLP()
    x_all, y_all = split.x_train, split.y_train
    n = len(y_all)
    sampler = PoissonBatchSampler(
        population_size=n, sampling_probability=sampling_probability, steps=steps, seed=seed
    )
    base = torch.optim.SGD(model.parameters(), lr=config.lr)
    ledger = recorder = None
    reference: list[ClippingBias] = []
    if config.method == REFERENCE:
        for idx in sampler:
            if len(idx) == 0:
                continue
            base.zero_grad()
            F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
            base.step()
    else:
        ledger = PrivacyLedger()
        recorder = ClippingBiasRecorder() if record_bias else None
        optimizer = DPOptimizer(
            base,
            model=model,
            l2_norm_bound=config.bound,
            noise_multiplier=noise_multiplier,
            ledger=ledger,
            sampler=sampler,
            clipping=_clipping(config),
            loss_fn=_example_loss,
            bam_radius=config.bam_radius,
            seed=seed + 1_000_003,
            bias_callback=recorder,
        )
        for idx in sampler:
            x, y = x_all[idx], y_all[idx]
            if bam_reference and config.method == "bam" and len(idx) > 0:
                reference.append(
                    bam_bias_against_plain_gradient(
                        model,
                        x,
                        y,
                        bam_radius=config.bam_radius,
                        bound=config.bound,
                        denominator=optimizer.expected_batch_size,
                    )
                )
            optimizer.compute_gradients(x, y)
            optimizer.step()
        optimizer.detach()
    seconds = time.perf_counter() - start
    if evaluate_on == "val":
        x_eval, y_eval = split.x_val, split.y_val
    else:
        x_eval, y_eval = split.x_test, split.y_test
    probabilities = metrics = None
    if all(torch.isfinite(p).all() for p in model.parameters()):
        probabilities = predict_probabilities(model, x_eval)
        if np.all(np.isfinite(probabilities)):
            metrics = model_calibration_metrics(probabilities, y_eval.numpy(), num_bins=NUM_BINS)
        else:
            probabilities = None
    run = Run(config, seed, probabilities, metrics, ledger=ledger, seconds=seconds)
    if recorder is not None and len(recorder):
        run.bias = recorder.means()
        run.bias_curves = {k: recorder.values(k) for k in CURVES}
    if reference:
        keys = (*BIAS_NAMES, "mean_example_norm")
        run.bam_reference = {k: float(np.mean([r.scalars()[k] for r in reference])) for k in keys}
    return run


def _require(condition: bool, message: str) -> None:
    """An assertion that ``python -O`` does not remove."""
    if not condition:
        raise AssertionError(message)


def check_ledger(
    run: Run,
    *,
    noise_multiplier: float,
    steps: int,
    population: int,
    sampling_probability: float = SAMPLING_PROBABILITY,
) -> None:
    """The ledger holds the run as planned, with S the bound the clipping enforced."""
    ledger = run.ledger
    _require(ledger is not None and ledger.num_steps == steps, "one ledger step per DP step")
    bound = run.config.bound
    for step in ledger.steps():
        _require(step.sampling.sampling_probability == sampling_probability, f"q of {step}")
        _require(step.sampling.population_size == population, f"n of {step}")
        _require(len(step.queries) == 1, f"one sum query in {step}")
        (query,) = step.queries
        # The clipping enforces ‖f_i·g_i‖ ≤ S with S = C (flat, BAM), R (global) or S (automatic);
        # the sum query's sensitivity check verified the clipped sum on every release.
        _require(query.l2_norm_bound == bound, f"S = {query.l2_norm_bound}, bound {bound}")
        _require(
            math.isclose(query.noise_stddev, noise_multiplier * bound, rel_tol=1e-12),
            f"σ̃ = {query.noise_stddev}, z·S = {noise_multiplier * bound}",
        )


def _by_config(runs: Sequence[Run]) -> dict[Config, list[Run]]:
    out: dict[Config, list[Run]] = {}
    for r in runs:
        out.setdefault(r.config, []).append(r)
    return out


def select(runs: Sequence[Run], *, criterion: str = "accuracy") -> Config:
    """The configuration with the best mean validation ``criterion`` over the tuning seeds.

    ``"accuracy"`` (the study's choice): highest accuracy, ties broken by the lower NLL;
    ``"nll"``: lowest NLL. A configuration that diverged on some seed is never chosen.
    """

    def score(item: tuple[Config, list[Run]]) -> tuple[float, float]:
        rs = item[1]
        if any(r.diverged for r in rs):
            return (-math.inf, -math.inf)
        acc = statistics.fmean(r.metrics.accuracy for r in rs)
        nll = statistics.fmean(r.metrics.nll for r in rs)
        return (round(acc, 9), -nll) if criterion == "accuracy" else (-nll, acc)

    return max(_by_config(runs).items(), key=score)[0]


METRIC_NAMES = (
    "accuracy",
    "nll",
    "ece",
    "mce",
    "bias_norm",
    "magnitude_error",
    "directional_error_norm",
    "cosine",
    "fraction_clipped",
    "mean_example_norm",
)
BIAS_NAMES = ("bias_norm", "magnitude_error", "directional_error_norm", "cosine")


def _values(run: Run) -> dict[str, float]:
    out = dict.fromkeys(METRIC_NAMES, math.nan)
    if run.metrics is not None:
        out.update({k: v for k, v in run.metrics.scalars().items() if k in out})
    if run.bias is not None:
        out.update({k: v for k, v in run.bias.items() if k in out})
    if run.bam_reference is not None:
        out.update({f"vs_plain_{k}": v for k, v in run.bam_reference.items()})
    return out


@dataclass(frozen=True)
class Summary:
    """Mean and standard deviation (ddof = 1) across seeds of each metric of one method.

    ``vs_plain_*`` entries (BAM only) are the bias against the plain gradient ∇L(θ).
    """

    method: str
    config: Config
    mean: dict[str, float]
    std: dict[str, float]
    epsilon: float | None
    diverged: int


def summarise(method: str, runs: Sequence[Run]) -> Summary:
    """Mean ± standard deviation across the seeds' runs of one method (diverged runs left out)."""
    values = [_values(r) for r in runs if not r.diverged]
    keys = dict.fromkeys(k for v in values for k in v)
    mean, std = {}, {}
    for k in keys:
        v = np.array([x.get(k, math.nan) for x in values])
        v = v[np.isfinite(v)]
        mean[k] = float(v.mean()) if len(v) else math.nan
        std[k] = float(v.std(ddof=1)) if len(v) > 1 else math.nan
    epsilons = [r.epsilon for r in runs if r.epsilon is not None]
    return Summary(
        method,
        runs[0].config,
        mean,
        std,
        epsilons[0] if epsilons else None,
        sum(r.diverged for r in runs),
    )


@dataclass(frozen=True)
class Difference:
    """Mean paired difference (method − flat, same seed) with a 95% t-interval.

    ``seeds_to_resolve`` ≈ (1.96·s_d/|d̄|)²: the number of seeds at which an interval of the
    observed spread s_d around the observed mean d̄ would exclude 0.
    """

    method: str
    metric: str
    mean: float
    low: float
    high: float
    seeds_to_resolve: int | None


def paired_differences(
    method: str,
    runs: Sequence[Run],
    baseline: Sequence[Run],
    metrics: Sequence[tuple[str, str]],
) -> list[Difference]:
    """Differences ``metric_a(run) − metric_b(baseline run)`` paired by seed, for each pair
    ``(metric_a, metric_b)`` of ``metrics``, with 95% t-intervals."""
    base = {r.seed: _values(r) for r in baseline}
    out = []
    for a, b in metrics:
        d = np.array(
            [_values(r).get(a, math.nan) - base[r.seed][b] for r in runs if r.seed in base]
        )
        d = d[np.isfinite(d)]
        label = a if a == b else f"{a} − flat {b}"
        if len(d) < 2:
            out.append(Difference(method, label, math.nan, math.nan, math.nan, None))
            continue
        mean, sd = float(d.mean()), float(d.std(ddof=1))
        half = float(stats.t.ppf(0.975, len(d) - 1)) * sd / math.sqrt(len(d))
        need = None if mean == 0 else max(2, math.ceil((1.96 * sd / abs(mean)) ** 2))
        out.append(Difference(method, label, mean, mean - half, mean + half, need))
    return out


@dataclass
class StudyResult:
    """What :func:`run_study` returns.

    Attributes:
        noise_multiplier: z of every DP step.
        steps: T.
        chosen: the configuration chosen for each method (validation accuracy).
        chosen_by_nll: the configuration the validation NLL would have chosen.
        tuning: the validation runs of each method.
        final: the test runs of each method, one per seed.
        final_by_nll: the test runs of the NLL-chosen configurations.
        summaries: mean ± standard deviation across seeds of ``final``.
        summaries_by_nll: the same for ``final_by_nll``.
        epsilons: ε replayed from every DP run's ledger (PRV upper bound), per method.
        differences: paired differences to flat clipping.
        seconds: wall times.
    """

    noise_multiplier: float
    steps: int
    chosen: dict[str, Config]
    chosen_by_nll: dict[str, Config]
    tuning: dict[str, list[Run]]
    final: dict[str, list[Run]]
    final_by_nll: dict[str, list[Run]]
    summaries: dict[str, Summary]
    summaries_by_nll: dict[str, Summary]
    epsilons: dict[str, list[float]]
    differences: list[Difference]
    seconds: dict[str, float] = field(default_factory=dict)


def _pm(mean: float, std: float, digits: int) -> str:
    if math.isnan(mean):
        return "–"
    if math.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def results_table(summaries: dict[str, Summary]) -> str:
    """Test accuracy and calibration (mean ± standard deviation across seeds)."""
    lines = [
        "| method | hyperparameters | ε (PRV upper) | test accuracy | NLL | ECE | MCE |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, s in summaries.items():
        m, sd = s.mean, s.std
        eps = "–" if s.epsilon is None else f"{s.epsilon:.4f}"
        cells = [method, s.config.describe(), eps]
        cells += [_pm(m[k], sd[k], 3) for k in ("accuracy", "nll", "ece", "mce")]
        if s.diverged:
            cells[0] += f" ({s.diverged} diverged)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bias_table(summaries: dict[str, Summary]) -> str:
    """Mean over steps of the bias metrics (mean ± standard deviation across seeds; NOT private)."""
    lines = [
        "| method | ‖ĝ_clip − ĝ‖ | a | ‖c‖ | cos(ĝ_clip, ĝ) | fraction clipped | mean ‖g_i‖ |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, s in summaries.items():
        m, sd = s.mean, s.std
        if math.isnan(m.get("bias_norm", math.nan)):
            continue
        keys = (*BIAS_NAMES, "fraction_clipped", "mean_example_norm")
        lines.append("| " + " | ".join([method] + [_pm(m[k], sd[k], 3) for k in keys]) + " |")
        if "vs_plain_bias_norm" in m:
            cells = [f"{method}, against ∇L(θ)"]
            cells += [_pm(m[f"vs_plain_{k}"], sd[f"vs_plain_{k}"], 3) for k in BIAS_NAMES]
            cells += [
                "–",
                _pm(m["vs_plain_mean_example_norm"], sd["vs_plain_mean_example_norm"], 3),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tuning_table(result: StudyResult) -> str:
    """Every configuration tried, with its mean validation accuracy and NLL."""
    lines = [
        "| method | configuration | validation accuracy | validation NLL |",
        "| --- | --- | ---: | ---: |",
    ]
    for method, runs in result.tuning.items():
        for cfg, rs in _by_config(runs).items():
            if any(r.diverged for r in rs):
                acc, nll = "diverged", "–"
            else:
                acc = f"{statistics.fmean(r.metrics.accuracy for r in rs):.3f}"
                nll = f"{statistics.fmean(r.metrics.nll for r in rs):.3f}"
            marks = []
            if cfg == result.chosen[method]:
                marks.append("chosen")
            if cfg == result.chosen_by_nll[method]:
                marks.append("best NLL")
            mark = f" **({', '.join(marks)})**" if marks else ""
            lines.append(f"| {method} | {cfg.describe()}{mark} | {acc} | {nll} |")
    return "\n".join(lines)


def differences_table(differences: Sequence[Difference]) -> str:
    """Paired differences to flat clipping."""
    lines = [
        "| method − flat | metric | mean difference | 95% t-interval | seeds to exclude 0 (≈) |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for d in differences:
        need = "–" if d.seeds_to_resolve is None else str(d.seeds_to_resolve)
        lines.append(
            f"| {d.method} | {d.metric} | {d.mean:+.4f} | [{d.low:+.4f}, {d.high:+.4f}] | {need} |"
        )
    return "\n".join(lines)


def plot_reliability(final: dict[str, list[Run]], labels: np.ndarray, path: Path) -> None:
    """Per method: the reliability diagram of the test predictions of all seeds pooled (top) and
    the number of predictions per confidence bin (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter

    fig, axes = plt.subplots(
        2,
        len(final),
        figsize=(2.7 * len(final), 4.6),
        gridspec_kw={"height_ratios": [3, 1]},
        sharex=True,
        squeeze=False,
    )
    total = sum(
        len(r.probabilities) for r in next(iter(final.values())) if r.probabilities is not None
    )
    for col, (method, runs) in enumerate(final.items()):
        ok = [r for r in runs if r.probabilities is not None]
        pooled = model_calibration_metrics(
            np.concatenate([r.probabilities for r in ok]),
            np.concatenate([labels] * len(ok)),
            num_bins=NUM_BINS,
        )
        ax = axes[0, col]
        plot_reliability_diagram(pooled, ax=ax, title=method)
        ax.set_xlabel("")
        ax.text(
            0.97,
            0.03,
            f"ECE {pooled.ece:.3f}\nMCE {pooled.mce:.3f}",
            ha="right",
            va="bottom",
            fontsize=7,
            transform=ax.transAxes,
            bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0},
        )
        if col == 0:
            ax.legend(loc="upper left", fontsize=6)
        else:
            ax.get_legend().remove()
            ax.set_ylabel("")
        rel = pooled.reliability
        hist = axes[1, col]
        hist.bar(rel.lower, rel.count, width=rel.upper - rel.lower, align="edge", color="gray")
        hist.set_yscale("log")
        hist.set_ylim(0.7, 2 * total)
        hist.yaxis.set_major_locator(LogLocator(base=10, numticks=4))
        hist.yaxis.set_minor_formatter(NullFormatter())
        hist.set_xlabel("confidence", fontsize=8)
        if col == 0:
            hist.set_ylabel("predictions", fontsize=8)
        for a in (ax, hist):
            a.tick_params(labelsize=7)
        ax.title.set_size(9)
        ax.yaxis.label.set_size(8)
    n_seeds = len(next(iter(final.values())))
    fig.suptitle(
        f"Test reliability, {NUM_BINS} equal-width bins, the {n_seeds} seeds' predictions pooled",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_bias(final: dict[str, list[Run]], path: Path) -> None:
    """Per step (mean over seeds, moving average over 20 steps) and DP method: ‖ĝ_clip − ĝ‖,
    cos(ĝ_clip, ĝ) and the mean per-example gradient norm. NOT private."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {
        "bias_norm": "‖ĝ_clip − ĝ‖",
        "cosine": "cos(ĝ_clip, ĝ)",
        "mean_example_norm": "mean ‖g_i‖ (BAM: at its ascent points)",
    }
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.0 * len(CURVES), 2.8))
    for ax, key in zip(axes, CURVES, strict=True):
        for method, runs in final.items():
            curves = [r.bias_curves[key] for r in runs if r.bias_curves is not None]
            if not curves:
                continue
            length = min(len(c) for c in curves)
            mean = np.nanmean([c[:length] for c in curves], axis=0)
            window = min(20, length)
            smooth = np.convolve(mean, np.ones(window) / window, mode="valid")
            ax.plot(np.arange(len(smooth)) + window - 1, smooth, label=method, linewidth=1.2)
        ax.set_title(titles[key], fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(
        "Clipping bias along training (NOT private: raw per-example gradients)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _final_runs(
    config: Config,
    *,
    seeds: Sequence[int],
    split: Split,
    noise_multiplier: float,
    steps: int,
    bam_reference: bool,
    accountant: PrvAccountant,
) -> list[Run]:
    runs = []
    for s in seeds:
        run = train(
            config,
            seed=s,
            split=split,
            evaluate_on="test",
            noise_multiplier=noise_multiplier,
            steps=steps,
            record_bias=config.method != REFERENCE,
            bam_reference=bam_reference,
        )
        if run.ledger is not None:
            check_ledger(
                run, noise_multiplier=noise_multiplier, steps=steps, population=len(split.y_train)
            )
            run.epsilon = accountant.epsilon(run.ledger, delta=DELTA).epsilon
        runs.append(run)
    return runs


def run_study(
    *,
    seeds: Sequence[int] = SEEDS,
    tuning_seeds: Sequence[int] = TUNING_SEEDS,
    steps: int = STEPS,
    quick: bool = False,
    bam_reference: bool = True,
    log: Any = print,
) -> StudyResult:
    """Tune every method on the validation split, then train it with each seed and evaluate.

    Args:
        seeds: the seeds of the final runs (paired across methods: the same initialisation,
            Poisson samples and noise seed for every method).
        tuning_seeds: the seeds of the validation runs.
        steps: T.
        quick: one configuration per method instead of the grid.
        bam_reference: measure BAM's bias against ∇L(θ) in the final runs.
        log: where progress lines go.
    """
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    split = digits_split()
    n = len(split.y_train)
    calibration = calibrate_noise_multiplier(
        target_epsilon=TARGET_EPSILON,
        delta=DELTA,
        sampling_probability=SAMPLING_PROBABILITY,
        steps=steps,
        accountant="prv",
    )
    z = float(calibration.value)
    log(
        f"n = {n}, q = {SAMPLING_PROBABILITY}, T = {steps}, target ε = {TARGET_EPSILON} at "
        f"δ = {DELTA:g}: z = {z:.4f} (PRV upper bound {calibration.epsilon:.4f})"
    )
    make_grid = quick_grid if quick else grid

    tuning: dict[str, list[Run]] = {}
    chosen: dict[str, Config] = {}
    by_nll: dict[str, Config] = {}
    t1 = time.perf_counter()
    for method in ("flat", "global", "automatic", "bam", REFERENCE):
        flat_bound = chosen["flat"].bound if "flat" in chosen else 1.0
        runs = [
            train(cfg, seed=s, split=split, evaluate_on="val", noise_multiplier=z, steps=steps)
            for cfg in make_grid(method, flat_bound=flat_bound)
            for s in tuning_seeds
        ]
        tuning[method] = runs
        chosen[method] = select(runs)
        by_nll[method] = select(runs, criterion="nll")
        log(f"tuned {method:12s} {len(runs):3d} runs: {chosen[method].describe()}")
    tuning = {m: tuning[m] for m in METHODS}
    times["tuning"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    accountant = PrvAccountant()
    common = {
        "seeds": seeds,
        "split": split,
        "noise_multiplier": z,
        "steps": steps,
        "accountant": accountant,
    }
    final: dict[str, list[Run]] = {}
    for method in METHODS:
        final[method] = _final_runs(chosen[method], bam_reference=bam_reference, **common)
        log(f"final {method:12s} {len(seeds)} seeds, {sum(r.seconds for r in final[method]):.1f} s")
    times["final"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    final_by_nll: dict[str, list[Run]] = {}
    for method in METHODS:
        if by_nll[method] == chosen[method]:
            final_by_nll[method] = final[method]
        else:
            final_by_nll[method] = _final_runs(by_nll[method], bam_reference=False, **common)
    times["final, NLL-chosen"] = time.perf_counter() - t3

    epsilons = {
        m: [r.epsilon for r in final[m] + final_by_nll[m] if r.epsilon is not None]
        for m in DP_METHODS
    }
    reference_eps = epsilons["flat"][0]
    for m, values in epsilons.items():
        for e in values:
            # The same (q, z, T) in every ledger: the replayed ε must agree to rounding.
            _require(
                math.isclose(e, reference_eps, rel_tol=1e-9),
                f"{m}: ε = {e!r} replayed, flat clipping's ledger gives {reference_eps!r}",
            )
            _require(e <= TARGET_EPSILON * (1 + 1e-9), f"{m}: ε = {e!r} above the target")

    compared = [(k, k) for k in ("accuracy", "nll", "ece", "mce", "bias_norm", "cosine")]
    differences = []
    for m in ("global", "automatic", "bam"):
        pairs = compared + (
            [
                ("vs_plain_bias_norm", "bias_norm"),
                ("vs_plain_cosine", "cosine"),
                ("vs_plain_mean_example_norm", "mean_example_norm"),
            ]
            if m == "bam"
            else []
        )
        differences += paired_differences(m, final[m], final["flat"], pairs)
    times["total"] = time.perf_counter() - t0
    return StudyResult(
        noise_multiplier=z,
        steps=steps,
        chosen=chosen,
        chosen_by_nll=by_nll,
        tuning=tuning,
        final=final,
        final_by_nll=final_by_nll,
        summaries={m: summarise(m, final[m]) for m in METHODS},
        summaries_by_nll={m: summarise(m, final_by_nll[m]) for m in METHODS},
        epsilons=epsilons,
        differences=differences,
        seconds=times,
    )


def _json(result: StudyResult) -> dict[str, Any]:
    def cfg(c: Config) -> dict[str, Any]:
        return {k: v for k, v in c.__dict__.items() if v is not None}

    def summary(s: Summary) -> dict[str, Any]:
        return {
            "config": cfg(s.config),
            "mean": s.mean,
            "std": s.std,
            "epsilon": s.epsilon,
            "diverged": s.diverged,
        }

    return {
        "delta": DELTA,
        "target_epsilon": TARGET_EPSILON,
        "sampling_probability": SAMPLING_PROBABILITY,
        "steps": result.steps,
        "noise_multiplier": result.noise_multiplier,
        "num_bins": NUM_BINS,
        "summaries": {m: summary(s) for m, s in result.summaries.items()},
        "summaries_by_nll": {m: summary(s) for m, s in result.summaries_by_nll.items()},
        "runs": {
            m: [{"seed": r.seed, "epsilon": r.epsilon, **_values(r)} for r in runs]
            for m, runs in result.final.items()
        },
        "differences_to_flat": [d.__dict__ for d in result.differences],
        "seconds": result.seconds,
    }


def main(argv: list[str] | None = None) -> StudyResult:
    """Run the study, print its tables, write the plots and the JSON results if asked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: 40 steps, 2 seeds, no grid"
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="write the plots (PNG) here")
    parser.add_argument("--results", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--no-bam-reference",
        action="store_true",
        help="skip BAM's bias against the plain gradient ∇L(θ) (three extra passes per step)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; python "
        f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}; "
        f"torch threads {torch.get_num_threads()}"
    )
    options: dict[str, Any] = {"bam_reference": not args.no_bam_reference}
    if args.quick:
        options.update(seeds=(0, 1), tuning_seeds=(1000,), steps=40, quick=True)
    result = run_study(**options)
    n_seeds = len(result.final["flat"])
    print("\nTuning (validation split, mean over the tuning seeds):")
    print(tuning_table(result))
    print(f"\nTest split, {n_seeds} seeds, mean ± standard deviation:")
    print(results_table(result.summaries))
    print("\nClipping bias, mean over steps (NOT private), mean ± standard deviation over seeds:")
    print(bias_table(result.summaries))
    print("\nPaired differences to flat clipping (same seeds):")
    print(differences_table(result.differences))
    print("\nWith the configurations the validation NLL would have chosen:")
    print(results_table(result.summaries_by_nll))
    eps = [e for values in result.epsilons.values() for e in values]
    print(
        f"\nε replayed from each of the {len(eps)} DP runs' ledgers (PRV upper bound, "
        f"δ = {DELTA:g}): {min(eps):.10f} to {max(eps):.10f} (largest relative difference "
        f"{(max(eps) - min(eps)) / min(eps):.1e})"
    )
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        labels = digits_split().y_test.numpy()
        plot_reliability(result.final, labels, args.out_dir / "clipping_study_reliability.png")
        plot_bias(
            {m: result.final[m] for m in DP_METHODS}, args.out_dir / "clipping_study_bias.png"
        )
        print(f"plots written to {args.out_dir}")
    result.seconds["wall"] = time.perf_counter() - start
    if args.results is not None:
        args.results.write_text(json.dumps(_json(result), indent=1, default=float))
    print("\nseconds: " + ", ".join(f"{k} {v:.1f}" for k, v in result.seconds.items()))
    return result


if __name__ == "__main__":
    main()
