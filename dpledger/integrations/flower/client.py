"""The client's side of client-side clipping: clip the model update before it is sent.

With ``UserLevelDPStrategy(..., clipping="client")`` the server sends each round's bound S in
the train message's config under :data:`CLIP_NORM_KEY`; the client trains, clips its update
Δ = w_local − w_global to L2 norm ≤ S with :func:`clip_client_update`, sends w_global + Δ·min(1,
S/‖Δ‖) and reports ‖Δ‖ (before clipping) in its metrics under :data:`UPDATE_NORM_KEY`. The
server checks every update's norm against S and refuses the round if one is over it
(:class:`~dpledger.errors.UpdateOverBoundError`); the reported norm only feeds adaptive
clipping's count, whose sensitivity does not depend on it.

This module imports neither Flower nor a deep-learning framework: a client of any framework
calls it on NumPy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_finite

__all__ = ["CLIP_NORM_KEY", "UPDATE_NORM_KEY", "clip_client_update", "update_norm"]

CLIP_NORM_KEY = "dpledger-clip-norm"
"""The config key of the round's clipping bound S in a train message."""

UPDATE_NORM_KEY = "dpledger-update-norm"
"""The metrics key of a client's unclipped update norm ‖Δ‖ in its reply."""


def _deltas(
    local: Sequence[np.ndarray], reference: Sequence[np.ndarray], parameter: str
) -> list[np.ndarray]:
    if len(local) != len(reference):
        raise InvalidParameterError(
            parameter, f"{len(local)} arrays", f"{len(reference)} arrays, one per model array"
        )
    deltas = []
    for j, (a, b) in enumerate(zip(local, reference, strict=True)):
        a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a64.shape != b64.shape:
            raise InvalidParameterError(
                f"{parameter}[{j}]", f"an array of shape {a64.shape}", f"shape {b64.shape}"
            )
        delta = a64 - b64
        if not np.all(np.isfinite(delta)):
            raise InvalidParameterError(f"{parameter}[{j}]", "an update with NaN or inf", "finite")
        deltas.append(delta)
    return deltas


def update_norm(local: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """‖w_local − w_global‖₂ over all arrays together, in float64.

    Raises:
        InvalidParameterError: different numbers or shapes of arrays, or a non-finite update.
    """
    deltas = _deltas(local, reference, "local")
    return float(np.sqrt(sum(float(np.vdot(d, d)) for d in deltas)))


def clip_client_update(
    local: Sequence[np.ndarray], reference: Sequence[np.ndarray], *, l2_norm_bound: float
) -> tuple[list[np.ndarray], float]:
    """The model to send: w_global + Δ·min(1, S/‖Δ‖), and ‖Δ‖ before clipping.

    Args:
        local: the client's model arrays after local training.
        reference: the global model arrays the round started from.
        l2_norm_bound: S > 0, the round's bound (``config[CLIP_NORM_KEY]``).

    Returns:
        The clipped model arrays (in each array's own dtype) and ‖Δ‖ (float64).

    Raises:
        InvalidParameterError: S not finite > 0, or arrays that do not match.
    """
    bound = check_positive_finite("l2_norm_bound", l2_norm_bound)
    deltas = _deltas(local, reference, "local")
    norm = float(np.sqrt(sum(float(np.vdot(d, d)) for d in deltas)))
    # a little under S, so that rounding the model to its dtype cannot push ‖Δ‖ over S
    factor = min(1.0, bound * (1.0 - 1e-6) / norm) if norm > 0.0 else 1.0
    clipped = [
        (np.asarray(b, dtype=np.float64) + factor * d).astype(np.asarray(b).dtype)
        for b, d in zip(reference, deltas, strict=True)
    ]
    return clipped, norm
