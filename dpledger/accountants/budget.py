"""Memory and time budgets: accountants estimate their work up front and refuse what is too big.

A discretised accountant's cost is set by its grid: a Gaussian step with noise multiplier z has
privacy losses spread over a range of width about (2·t·z + 1)/z² (t ≈ 10 standard deviations,
where dp-accounting truncates), so at z = 10⁻⁶ and a grid spacing of 10⁻⁴ one step needs
~10¹⁶ points (35 PiB). Every discretised accountant (the PLD bridge, the PRV accountant, the GDP
accountant's PLD lower bound) therefore estimates the number of grid points and the seconds its
computation needs *before* allocating anything, and raises
:class:`~dpledger.errors.ComputationBudgetError` — naming the setting that drives the cost and
the value of it that would fit, or another accountant — when the estimate exceeds

* the memory budget: :data:`DEFAULT_MEMORY_BUDGET` = 256 MiB unless the accountant's
  ``memory_budget`` keyword says otherwise (peak bytes are estimated as
  :data:`BYTES_PER_POINT` = 64 bytes per grid point: the float64 grid, its complex FFT and
  the temporaries of one composition); or
* the time budget: :data:`DEFAULT_TIME_BUDGET_S` = 60 s unless ``time_budget_s`` says
  otherwise, estimated from the grid sizes at rates measured on a 2-core Xeon
  (:data:`SECONDS_PER_BUILT_POINT` to build a point of a single step's distribution,
  :data:`SECONDS_PER_COMPOSED_POINT` to compose one).

The estimates are deliberately generous (up to a few times the real cost for strongly
subsampled steps), so a computation that is accepted fits; one that is refused by a small
margin may pass with a slightly larger budget.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from dpledger.errors import ComputationBudgetError, InvalidParameterError

__all__ = [
    "BYTES_PER_POINT",
    "DEFAULT_MEMORY_BUDGET",
    "DEFAULT_TIME_BUDGET_S",
    "SECONDS_PER_BUILT_POINT",
    "SECONDS_PER_COMPOSED_POINT",
    "check_memory_budget",
    "check_time_budget",
    "gaussian_loss_width",
    "refuse_if_over",
    "subsampled_loss_width",
]

DEFAULT_MEMORY_BUDGET = 256 * 2**20
"""Default peak-memory budget of one accountant computation, in bytes (256 MiB)."""

DEFAULT_TIME_BUDGET_S = 60.0
"""Default estimated-time budget of one accountant computation, in seconds."""

BYTES_PER_POINT = 64.0
SECONDS_PER_BUILT_POINT = 4e-6
SECONDS_PER_COMPOSED_POINT = 1e-6

# dp-accounting truncates each Gaussian at a tail mass of e^-50: t standard deviations
_TAIL_SDS = math.sqrt(2 * 50.0)
# a composition keeps about this many standard deviations of the composed loss on each side
_COMPOSED_SDS = 8.5


def check_memory_budget(value: Any, *, parameter: str = "memory_budget") -> int:
    """A memory budget in bytes: an integer ≥ 1 MiB (``float("inf")`` is not accepted)."""
    expected = "an integer number of bytes >= 1048576 (1 MiB)"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 2**20:
        raise InvalidParameterError(parameter, value, expected)
    return int(value)


def check_time_budget(value: Any, *, parameter: str = "time_budget_s") -> float:
    """A time budget in seconds: a finite number > 0."""
    expected = "a finite number of seconds > 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(parameter, value, expected)
    try:
        x = float(value)
    except OverflowError:
        raise InvalidParameterError(parameter, value, expected) from None
    if not (0.0 < x < math.inf):
        raise InvalidParameterError(parameter, value, expected)
    return x


def gaussian_loss_width(mu: float) -> float:
    """Width of the privacy-loss range of a μ-GDP Gaussian (sensitivity 1, z = 1/μ) within
    ``_TAIL_SDS`` standard deviations of the noise: (2·t·z + 1)/z² = 2·t·μ + μ²."""
    return 2.0 * _TAIL_SDS * mu + mu * mu


def subsampled_loss_width(q: float, z: float) -> float:
    """Width of the privacy-loss range of the Poisson-subsampled Gaussian (q, z), both
    directions, within ``_TAIL_SDS`` noise standard deviations: the Gaussian loss ℓ ∈ [−a, a]
    with a = (t·z + 1/2)/z² becomes log(1 − q + q·e^ℓ) (computed with logaddexp, so it never
    overflows)."""
    if z == 0.0:
        return math.inf
    a = (_TAIL_SDS * z + 0.5) / z / z
    if q >= 1.0:
        return 2.0 * a
    log_q, log_1mq = math.log(q), math.log1p(-q)

    def mix(loss: float) -> float:
        hi, lo = max(log_1mq, log_q + loss), min(log_1mq, log_q + loss)
        return hi + math.log1p(math.exp(lo - hi))

    return mix(a) - mix(-a)


def composed_points(q: float, z: float, count: float, interval: float) -> tuple[float, float]:
    """(points of one step's grid, points of its ``count``-fold composition) for the
    subsampled Gaussian (q, z) on a grid of spacing ``interval``.

    The composed range is at most ``count`` single ranges, and at most the mean plus
    ``_COMPOSED_SDS`` standard deviations of the composed loss either side, with the per-step
    mean and variance bounded by min(χ², μ²) (χ² = q²(e^{1/z²} − 1), μ = 1/z).
    """
    width = subsampled_loss_width(q, z)
    single = width / interval + 1.0
    if z == 0.0:
        return math.inf, math.inf
    mu_sq = 1.0 / z / z if z > 1e-150 else math.inf
    try:
        chi_sq = q * q * math.expm1(mu_sq)
    except OverflowError:
        chi_sq = math.inf
    var = min(mu_sq, chi_sq)
    spread = count * var / 2.0 + 2.0 * _COMPOSED_SDS * math.sqrt(count * var) + width
    composed = min(count * width, spread) / interval + 1.0
    return single, max(single, composed)


def refuse_if_over(
    *,
    accountant: str,
    points: float,
    seconds: float,
    memory_budget: int,
    time_budget_s: float,
    parameter: str,
    value: Any,
    suggestion: str,
) -> None:
    """Raise :class:`ComputationBudgetError` if ``points`` grid points (at
    :data:`BYTES_PER_POINT` each) exceed the memory budget or ``seconds`` the time budget."""
    need = points * BYTES_PER_POINT
    over_memory = not need <= memory_budget  # also NaN
    if over_memory or not seconds <= time_budget_s:
        # the time estimate is named only when time, not memory, is what does not fit
        timing = (
            {} if over_memory else {"estimated_seconds": seconds, "budget_seconds": time_budget_s}
        )
        raise ComputationBudgetError(
            parameter=parameter,
            value=value,
            estimated_bytes=need,
            budget_bytes=memory_budget,
            suggestion=suggestion,
            accountant=accountant,
            **timing,
        )
