"""The noise multiplier of a planned run for a target (ε, δ), as :func:`make_private` uses it.

:func:`calibrated_noise_multiplier` asks :func:`~dpledger.accountants.calibrate_noise_multiplier`
for the smallest z whose ε after the planned number of Poisson-sampled steps is at most the
target. An *epoch* is round(1/q) steps (:func:`steps_per_epoch`: n records in expectation), the
Poisson data loader's default length.
"""

from __future__ import annotations

from dpledger.accountants import Accountant, CalibrationResult, calibrate_noise_multiplier
from dpledger.errors import InvalidParameterError
from dpledger.sampling.validation import check_sampling_probability, default_steps
from dpledger.validation import check_positive_finite, check_positive_int

__all__ = ["calibrated_noise_multiplier", "steps_per_epoch"]


def steps_per_epoch(sampling_probability: float) -> int:
    """round(1/q) (at least 1): the steps in which Poisson sampling sees n records on average."""
    return default_steps(1.0 / check_sampling_probability(sampling_probability))


def _planned_steps(sampling_probability: float, steps: int | None, epochs: float | None) -> int:
    if (steps is None) == (epochs is None):
        raise InvalidParameterError(
            "steps", steps, "exactly one of steps= and epochs= (the length of the run)"
        )
    if steps is not None:
        return check_positive_int("steps", steps)
    e = check_positive_finite("epochs", epochs)
    return max(1, round(e * steps_per_epoch(sampling_probability)))


def calibrated_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sampling_probability: float,
    steps: int | None = None,
    epochs: float | None = None,
    accountant: str | Accountant = "prv",
) -> float:
    """The smallest noise multiplier z (to 0.1%) whose ε at δ after the run is ≤ the target.

    Args:
        target_epsilon: ε to meet.
        delta: δ in (0, 1).
        sampling_probability: q of every step.
        steps: T, the number of steps; or
        epochs: the number of epochs (T = epochs·round(1/q)).
        accountant: the accountant that decides (default ``"prv"``: its certified upper
            bound, the tightest valid one).

    Raises:
        InvalidParameterError: bad arguments, or a target no z ≤ 10⁴ reaches.
    """
    return float(
        _calibration(
            target_epsilon=target_epsilon,
            delta=delta,
            sampling_probability=sampling_probability,
            steps=steps,
            epochs=epochs,
            accountant=accountant,
        ).value
    )


def _calibration(
    *,
    target_epsilon: float,
    delta: float,
    sampling_probability: float,
    steps: int | None,
    epochs: float | None,
    accountant: str | Accountant,
) -> CalibrationResult:
    q = check_sampling_probability(sampling_probability)
    t = _planned_steps(q, steps, epochs)
    return calibrate_noise_multiplier(
        target_epsilon=target_epsilon,
        delta=delta,
        sampling_probability=q,
        steps=t,
        accountant=accountant,
    )
