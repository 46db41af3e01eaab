"""A NumPy Gaussian mechanism with a canary record, for auditing tests.

The mechanism releases one noisy sum of clipped values: Σ clip(x_i, −C, C) + N(0, σ²). The canary
is a record of value C, so the L2 sensitivity (add/remove) is C and the mechanism is μ-GDP with
μ = C/σ. Functions live at module level so worker processes can import them.
"""

from __future__ import annotations

import numpy as np
from scipy import optimize, stats

CLIP = 1.0
DATA = np.random.default_rng(123).uniform(-2.0, 2.0, size=20)
CORRECT_NOISE = 2.0  # σ of the correct mechanism: z = σ/C = 2
BUGGY_NOISE = CORRECT_NOISE / 10  # the bug: noise 10× too small, same claimed ε


def noisy_sum(include_canary: bool, seed: int, noise_stddev: float = CORRECT_NOISE) -> float:
    """Release Σ clip(x) (+ the canary C) + N(0, σ²); higher means "canary included"."""
    rng = np.random.default_rng(seed)
    total = float(np.clip(DATA, -CLIP, CLIP).sum())
    if include_canary:
        total += CLIP
    return total + float(rng.normal(0.0, noise_stddev))


def buggy_noisy_sum(include_canary: bool, seed: int) -> float:
    """The same mechanism with the noise 10× too small."""
    return noisy_sum(include_canary, seed, noise_stddev=BUGGY_NOISE)


def true_epsilon(*, noise_stddev: float, delta: float) -> float:
    """Exact ε(δ) of the Gaussian mechanism with sensitivity CLIP (Balle & Wang 2018, Thm. 8)."""
    s = noise_stddev / CLIP

    def delta_of(eps: float) -> float:
        return stats.norm.cdf(1 / (2 * s) - eps * s) - np.exp(eps) * stats.norm.cdf(
            -1 / (2 * s) - eps * s
        )

    return optimize.brentq(lambda e: delta_of(e) - delta, 0.0, 200.0, xtol=1e-12)


# ---- helpers for the resume tests (run inline, so module state is visible) ----
CALLS: list[tuple[bool, int]] = []
FAIL_ON_SEED: dict[str, int | None] = {"seed": None}


class InterruptedRunError(Exception):
    """Stands in for a crash or Ctrl-C in the middle of an audit."""


def logged_noisy_sum(include_canary: bool, seed: int) -> float:
    """noisy_sum that logs its calls and fails on one chosen seed."""
    if seed == FAIL_ON_SEED["seed"]:
        raise InterruptedRunError(f"interrupted at seed {seed}")
    CALLS.append((include_canary, seed))
    return noisy_sum(include_canary, seed)


def nan_score(include_canary: bool, seed: int) -> float:
    """A broken training function."""
    return float("nan")


def failing(include_canary: bool, seed: int) -> float:
    """A training function that always fails."""
    raise RuntimeError("training failed")
