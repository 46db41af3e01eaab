"""The run's intent: what a training run set out to guarantee, kept in the ledger's metadata.

The events of a ledger say what was used (q, n, S, σ̃ of every step); they do not say what the
run was planned for. A training adapter that creates a ledger stores that plan under the
metadata key :data:`INTENT_KEY` of the header (given a ledger the user created, it records it
in a ``note`` line: :func:`note_intent`): the target ε and δ (when the noise was
calibrated), the accountant that calibrated it, the population size, the unit of privacy and the
library versions. The intent is informational: no accountant reads it, and it never changes
what the events record.
"""

from __future__ import annotations

import logging
from typing import Any

from dpledger._version import __version__
from dpledger.errors import LedgerStateError

__all__ = ["INTENT_KEY", "intent_of", "note_intent", "run_intent"]

INTENT_KEY = "intent"
"""The header metadata key under which the run's intent is stored."""

_log = logging.getLogger(__name__)


def run_intent(
    *,
    framework: str,
    framework_version: str,
    population_size: int | None,
    unit: str = "record",
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    delta: float | None = None,
    accountant: str | None = None,
    sampling: str | None = None,
    sampling_probability: float | None = None,
    steps: int | None = None,
) -> dict[str, Any]:
    """The intent of a run as a JSON-ready dict (keys whose value is None are left out).

    Args:
        framework: ``"torch"`` or ``"tensorflow"``.
        framework_version: that framework's version.
        population_size: n, the number of records (users, for ``unit="user"``) protected.
        unit: the unit of privacy (``"record"`` or ``"user"``).
        noise_multiplier: z of the steps as configured (calibrated or given).
        target_epsilon: the ε the noise was calibrated for (None: z was given).
        delta: δ of the target (or the δ the run was configured with).
        accountant: the name of the accountant that calibrated z.
        sampling: the sampling scheme of the run's batches.
        sampling_probability: q of a Poisson scheme.
        steps: the planned number of steps of the calibration.
    """
    intent: dict[str, Any] = {
        "target_epsilon": target_epsilon,
        "delta": delta,
        "calibrated_by": accountant,
        "noise_multiplier": noise_multiplier,
        "planned_steps": steps,
        "sampling": sampling,
        "sampling_probability": sampling_probability,
        "population_size": population_size,
        "unit": unit,
        "versions": {"dpledger": __version__, framework: framework_version},
    }
    return {k: v for k, v in intent.items() if v is not None}


def intent_of(metadata: Any) -> dict[str, Any] | None:
    """The intent stored in a ledger header's metadata, or None."""
    if isinstance(metadata, dict):
        value = metadata.get(INTENT_KEY)
        if isinstance(value, dict):
            return value
    return None


def note_intent(ledger: Any, intent: dict[str, Any]) -> None:
    """Record the intent of a run whose ledger does not hold one yet, as a note.

    A ledger's header is written when the ledger is created, so an adapter given a ledger the
    user created records the intent in a ``note`` line (``{"intent": {...}}``,
    :meth:`~dpledger.ledger.ledger.PrivacyLedger.record_note`), which ``dpledger info`` shows as
    the ledger's intent. A ledger that already holds an intent (in its header or a note) is
    left alone; one that cannot take a note (read-only, closed, a format-version-1 file) gets
    the intent logged at INFO instead.
    """
    if getattr(ledger, "intent", None) is not None:
        return
    try:
        ledger.record_note({INTENT_KEY: intent})
    except LedgerStateError as exc:
        _log.info(
            "the run's intent could not be recorded in the ledger (%s): %s (create the ledger "
            "with PrivacyLedger(path, metadata={%r: ...}) to keep it)",
            exc,
            intent,
            INTENT_KEY,
        )
