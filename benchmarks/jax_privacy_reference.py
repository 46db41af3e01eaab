"""Reference ε of (amplified) BandMF from JAX Privacy's own accounting, for dpledger's tests.

Writes ``tests/accountants/data/jax_privacy_bandmf.json``, which
``tests/accountants/test_correlated_jax_privacy.py`` compares with dpledger's accountants (the
test needs neither JAX nor JAX Privacy). Run it in a separate environment, never in dpledger's
own (JAX Privacy pins its own JAX and NumPy):

    python3.11 -m venv /tmp/jaxp
    /tmp/jaxp/bin/pip install jax-privacy          # CPU JAX is enough; 2.0.0 wrote the file
    /tmp/jaxp/bin/python benchmarks/jax_privacy_reference.py [--out PATH]

(about a minute on a 2-core CPU, most of it optimising the strategies). What JAX Privacy
computes, read from its source (``jax_privacy/experimental/execution_plan.py`` and
``jax_privacy/experimental/accounting.py``, version 2.0.0):

* ``BandMFExecutionPlanConfig(iterations=T, strategy=c, noise_multiplier=z,
  sampling_prob=q, l2_clip_norm=S)``: C is the T × T lower-triangular Toeplitz matrix of the
  coefficients c (b = len(c) bands); the records are split into b groups (``cycle_length=b``)
  and step t Poisson-samples group t mod b with probability q (``CyclicPoissonSampling``); the
  noise Z has standard deviation ``z · sens · ‖c‖₂`` with ``sens`` the clipped sum's sensitivity
  (S under zero-out and add-or-remove) and ``‖c‖₂`` C's largest column norm (its first
  column). So z is the noise multiplier of C normalised to unit largest column norm.
* Its ``dp_event`` (``amplified_bandmf_event``) is ``SelfComposedDpEvent(
  PoissonSampledDpEvent(q, GaussianDpEvent(z)), ceil(T / b))``: each record takes part in at
  most ⌈T / b⌉ steps, each a Poisson-subsampled Gaussian (Choquette-Choo et al. 2023,
  "Amplified Banded Matrix Factorization", section 4). With q = 1 (its default) the same
  event is ⌈T / b⌉ full-batch Gaussians: BandMF over cyclic fixed batches, no amplification.
* Its default accountant is dp-accounting's ``PLDAccountant(REPLACE_SPECIAL)`` (zero-out),
  value discretisation interval 1e-4, pessimistic; ε is read at δ = 1e-5. The script also
  reads ε of the same event under ``ADD_OR_REMOVE_ONE`` (dpledger's add/remove relation): for
  Gaussians dp-accounting builds the same PLD for both relations, and the file records both.

dpledger's terms for the same release: ``banded_toeplitz_factorization(T, c)``,
``ParticipationSchema.cyclic(num_steps=T, period=b)``, S = 1, σ = z·S·‖c‖₂ and
``sampling_probability=q`` (amplified) or none (q = 1).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from importlib import metadata
from pathlib import Path

import dp_accounting
import numpy as np
from jax_privacy.experimental import execution_plan
from jax_privacy.matrix_factorization import toeplitz

DELTA = 1e-5
GRID = 1e-4  # dp-accounting's default value_discretization_interval, JAX Privacy's default
OUT = Path(__file__).resolve().parents[1] / "tests/accountants/data/jax_privacy_bandmf.json"

# (T, b, q, z): amplified BandMF (q < 1), b = 1 being DP-SGD; q = 1 is cyclic fixed batches.
AMPLIFIED = [
    (64, 1, 0.1, 1.0),
    (64, 4, 0.25, 1.5),
    (64, 8, 0.5, 2.0),
    (256, 1, 0.05, 1.1),
    (256, 4, 0.2, 1.5),
    (256, 8, 0.4, 2.5),
    (1000, 1, 0.01, 0.9),
    (1000, 4, 0.04, 1.2),
    (1000, 8, 0.08, 1.5),
    (1000, 3, 0.03, 1.2),  # T not a multiple of b: ⌈1000 / 3⌉ = 334 participations
]
UNAMPLIFIED = [
    (64, 4, 1.0, 4.0),
    (256, 8, 1.0, 6.0),
    (1000, 1, 1.0, 30.0),
    (1000, 8, 1.0, 10.0),
    (1000, 3, 1.0, 10.0),  # T not a multiple of b: C's last column is cut short
]
# JAX Privacy calibrates z itself for a target (ε, δ): (T, b, q, target ε)
CALIBRATED = [(1000, 4, 0.04, 2.0), (256, 8, 1.0, 8.0)]
# the same strategies rescaled to c_0 = 1 (largest column norm ‖c‖₂ > 1): JAX Privacy's ε does
# not change (its noise scales with ‖c‖₂), and dpledger must divide σ by the same norm
RESCALED = [(256, 4, 0.2, 1.5), (1000, 3, 1.0, 10.0)]


def _epsilon(event: dp_accounting.DpEvent, relation: dp_accounting.NeighboringRelation) -> float:
    acc = dp_accounting.pld.PLDAccountant(relation, value_discretization_interval=GRID)
    return float(acc.compose(event).get_epsilon(DELTA))


def _case(
    t: int,
    b: int,
    q: float,
    *,
    z: float | None = None,
    target: float | None = None,
    first_to_one: bool = False,
) -> dict[str, object]:
    strategy = np.asarray(toeplitz.optimize_banded_toeplitz(n=t, bands=b), dtype=np.float64)
    if first_to_one:
        strategy = strategy / strategy[0]
    if z is not None:
        config = execution_plan.BandMFExecutionPlanConfig(
            iterations=t,
            strategy=strategy,
            epsilon=None,
            delta=None,
            noise_multiplier=z,
            sampling_prob=q,
        )
    else:
        config = execution_plan.BandMFExecutionPlanConfig(
            iterations=t, strategy=strategy, epsilon=target, delta=DELTA, sampling_prob=q
        )
    plan = config.plan
    event = plan.dp_event
    # the noise multiplier the plan used (its own when calibrated), read back from its event
    z_used = float(event.event.event.noise_multiplier)
    assert event.count == math.ceil(t / b)
    assert event.event.sampling_probability == q
    add_remove = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    return {
        "iterations": t,
        "num_bands": b,
        "sampling_prob": q,
        "noise_multiplier": z_used,
        "target_epsilon": target,
        "strategy": [float(x) for x in strategy],
        "max_column_norm": float(np.linalg.norm(strategy)),
        "participations": event.count,
        "dp_event": str(event),
        "epsilon_pld_replace_special": _epsilon(event, config.accountant.neighboring_relation),
        "epsilon_pld_add_or_remove_one": _epsilon(event, add_remove),
    }


def _add_or_remove_with_equal_split() -> str:
    """JAX Privacy's answer to its default partition (EQUAL_SPLIT) under add-or-remove."""
    try:
        execution_plan.BandMFExecutionPlanConfig(
            iterations=8,
            strategy=np.ones(2),
            epsilon=None,
            delta=None,
            noise_multiplier=1.0,
            sampling_prob=0.5,
            accountant=dp_accounting.pld.PLDAccountant(
                dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
            ),
        )
    except ValueError as err:
        # pydantic's message: the validator's line, without the echoed (address-bearing) input
        lines = [line.strip() for line in str(err).splitlines()]
        reason = next(line for line in lines if "neighboring_relation" in line)
        return "refused: " + reason.split(" [type=")[0]
    return "accepted"


def main() -> None:
    """Compute every case and write the JSON file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    cases = [_case(t, b, q, z=z) for t, b, q, z in AMPLIFIED + UNAMPLIFIED]
    cases += [_case(t, b, q, target=eps) for t, b, q, eps in CALIBRATED]
    cases += [_case(t, b, q, z=z, first_to_one=True) for t, b, q, z in RESCALED]
    doc = {
        "reference": "JAX Privacy BandMFExecutionPlanConfig(...).plan.dp_event, epsilon by "
        "dp-accounting's PLDAccountant (pessimistic, value_discretization_interval 1e-4)",
        "produced_by": "benchmarks/jax_privacy_reference.py",
        "versions": {
            "python": platform.python_version(),
            "jax_privacy": metadata.version("jax-privacy"),
            "jax": metadata.version("jax"),
            "dp_accounting": metadata.version("dp-accounting"),
            "numpy": metadata.version("numpy"),
        },
        "delta": DELTA,
        "value_discretization_interval": GRID,
        "definitions": {
            "iterations": "T, the number of steps (rows and columns of C)",
            "num_bands": "b = len(strategy); also the number of groups the records are split "
            "into (CyclicPoissonSampling cycle_length): step t samples group t mod b",
            "strategy": "Toeplitz coefficients c of C, C[t, j] = c[t - j] for 0 <= t - j < b "
            "(jax_privacy.matrix_factorization.toeplitz.optimize_banded_toeplitz(n=T, bands=b), "
            "unit norm; the last cases divided by c[0])",
            "sampling_prob": "q, the Poisson probability of each record of the step's group "
            "(expected batch n*q/b); 1.0 = every record of the group, no amplification",
            "noise_multiplier": "z: the noise Z has stddev z * sens * ||c||_2 (sens = "
            "l2_clip_norm = 1 under zero-out), i.e. z is relative to the clip norm times C's "
            "largest column norm",
            "participations": "ceil(T / b), the SelfComposedDpEvent count",
            "dp_event": "SelfComposed(PoissonSampled(q, Gaussian(z)), ceil(T / b))",
            "partition_type": "EQUAL_SPLIT (JAX Privacy's default, used here): the records "
            "split once into b groups of equal size; its accountant's relation is "
            "REPLACE_SPECIAL (zero-out)",
            "equal_split_under_add_or_remove_one": _add_or_remove_with_equal_split(),
            "target_epsilon": "set for the cases where JAX Privacy calibrated z itself "
            "(dp_accounting.calibrate_dp_mechanism, default tolerances) to (target, delta)",
        },
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
