"""The work budget holds at extreme lengths: refuse (or answer) within the memory budget.

Each case runs in a child process whose address space is capped (``RLIMIT_AS``, so an
accountant that allocates first dies there instead of exhausting the machine) and whose peak
Python-visible allocation (numpy arrays included) is measured with ``tracemalloc``. The answer
must be an answer or a typed refusal, and the peak must stay within the default memory budget
(256 MiB): the estimate comes before the allocation. The subprocess timeout only guards against
a hang; no wall-clock time is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpledger.accountants.budget import DEFAULT_MEMORY_BUDGET

REPO = Path(__file__).resolve().parents[2]
_ADDRESS_SPACE = 3 * 2**30

_CHILD = textwrap.dedent(
    """
    import json, resource, sys, tracemalloc
    resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
    from dpledger import DPLedgerError
    from dpledger.ledger.steps import CompressedLedger
    from dpledger.accountants import GdpAccountant, PrvAccountant, calibrate_noise_multiplier

    def ledger(q, z, steps):
        return CompressedLedger.from_runs([(q, z, steps)])

    CASES = {{
        "prv_epsilon": lambda: PrvAccountant().epsilon(ledger(0.5, 16.0, 10**12), delta=1e-5),
        "prv_delta": lambda: PrvAccountant().delta(ledger(0.5, 16.0, 10**12), epsilon=1.0),
        "gdp_epsilon": lambda: GdpAccountant().epsilon(ledger(0.01, 16.0, 10**15), delta=1e-5),
        "calibrate_2_63": lambda: calibrate_noise_multiplier(
            target_epsilon=1.0, delta=1e-5, sampling_probability=0.01, steps=2**63
        ),
        "calibrate_1e15": lambda: calibrate_noise_multiplier(
            target_epsilon=1.0, delta=1e-5, sampling_probability=0.01, steps=10**15
        ),
    }}
    tracemalloc.start()
    try:
        result = CASES[sys.argv[1]]()
        outcome = type(result).__name__
    except DPLedgerError as exc:
        outcome = "refused: " + type(exc).__name__
    print(json.dumps({{"outcome": outcome, "peak": tracemalloc.get_traced_memory()[1]}}))
    """
).format(cap=_ADDRESS_SPACE)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["prv_epsilon", "prv_delta", "gdp_epsilon", "calibrate_2_63", "calibrate_1e15"]
)
def test_extreme_lengths_are_answered_or_refused_within_the_memory_budget(case: str) -> None:
    """Before: PRV at (0.5, 16, 10¹²) needed 8.8 GiB, GDP at 10¹⁵ steps 5.5 GiB (its PRV lower
    bound), calibration over 2⁶³ steps 7.8 GB before a typed error."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, case],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,  # a hang guard only
    )
    assert child.returncode == 0, child.stderr[-2000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["outcome"] in {"PrivacyResult", "CalibrationResult"} or report[
        "outcome"
    ].startswith("refused: "), report
    assert report["peak"] <= DEFAULT_MEMORY_BUDGET, report
