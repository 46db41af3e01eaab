"""Record a small privacy ledger to a file, then read it back.

This stands in for a DP training run: each step draws a Poisson sample (q = 256 / 60000) and
runs two Gaussian sum queries on it (a layer's gradient and its bias, each clipped to its own
bound, with noise allocated proportionally so that z_eff = 1.1), with the noise multiplier
decaying halfway through. The ledger file is what a run leaves next to its checkpoints.

    python examples/ledger_demo.py [PATH]      # default PATH: demo.dpl in the working directory
    dpledger info PATH
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from dpledger import PrivacyLedger

POPULATION = 60_000
BATCH = 256
STEPS = 200


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "demo.dpl")
    if path.exists():
        path.unlink()  # the demo starts over; a real run would pass resume=True instead
    q = BATCH / POPULATION
    bounds = {"dense/kernel": 1.0, "dense/bias": 0.1}
    with PrivacyLedger(path, metadata={"example": "ledger_demo", "batch_size": BATCH}) as ledger:
        for step in range(STEPS):
            z = 1.1 if step < STEPS // 2 else 0.9
            ledger.record_sample(sampling_probability=q, population_size=POPULATION)
            for label, bound in bounds.items():
                # proportional allocation: σ̃_g = z · √G · S_g gives z_eff = z (paper, section 4)
                sigma = z * math.sqrt(len(bounds)) * bound
                ledger.record_sum_query(l2_norm_bound=bound, noise_stddev=sigma, label=label)
    loaded = PrivacyLedger.load(path)
    print(f"wrote {path}: {loaded.num_steps} steps, {loaded.num_events} events")
    for run in loaded.runs():
        print(
            f"  {run.count} steps with q = {run.sampling_probability:.6f}, "
            f"z_eff = {run.noise_multiplier:.6f}"
        )
    print(f"head hash {loaded.head_hash} (publish it to anchor the ledger)")


if __name__ == "__main__":
    main()
