"""Suite-wide test configuration.

The README's test command installs every optional dependency, so a test skipped because a module
could not be imported means the environment is incomplete and the suite did not run what it
claims. Such skips fail unless ``DPLEDGER_ALLOW_MISSING_DEPS=1`` is set (for a partial local
install).

Property-based tests run derandomized (the same examples on every run, so a CI result is
reproducible); ``HYPOTHESIS_PROFILE=explore`` draws fresh random examples to hunt for new failures.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

_MISSING_DEPENDENCY_MARKERS = ("could not import", "is not installed", "No module named")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or os.environ.get("DPLEDGER_ALLOW_MISSING_DEPS") == "1":
        return
    reason = (
        str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    )
    if any(marker in reason for marker in _MISSING_DEPENDENCY_MARKERS):
        report.outcome = "failed"
        report.longrepr = (
            f"skipped for a missing dependency ({reason}); the test command installs every "
            "optional dependency — set DPLEDGER_ALLOW_MISSING_DEPS=1 to allow this locally"
        )
