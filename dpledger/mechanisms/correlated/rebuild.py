"""C rebuilt from what the ledger records of a factorization: its kind and parameters.

A ``correlated_release`` line records the strategy's kind and parameters
(:attr:`~dpledger.mechanisms.correlated.MatrixFactorization.params`), which determine C.
:func:`strategy_matrix` rebuilds C from them alone, with the constructors' own code
(:mod:`.strategies`), so that the numbers a release derives from C can be recomputed when it is
replayed (:mod:`.verification`), and
:func:`~dpledger.mechanisms.correlated.release.release_event` can refuse a factorization whose
parameters do not determine its C.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.correlated.strategies import (
    _blt_inverse_coefficients,
    _check_blt,
    _check_coefficients,
    _check_size,
    _toeplitz,
    _tree_strategy,
    inverse_toeplitz_coefficients,
    tree_nodes,
)
from dpledger.validation import check_positive_int

__all__ = ["strategy_matrix"]

Matrix = npt.NDArray[np.float64]


def _numbers(name: str, value: Any) -> list[float]:
    """A JSON list of numbers (no booleans), as floats."""
    if not isinstance(value, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in value
    ):
        raise InvalidParameterError(name, value, "a list of numbers")
    try:
        return [float(x) for x in value]
    except OverflowError:
        raise InvalidParameterError(name, value, "a list of finite numbers") from None


_PARAM_KEYS = {
    "tree": {"num_steps"},
    "tree_honaker": {"num_steps"},
    "banded_toeplitz": {"num_steps", "coefficients"},
    "blt": {"num_steps", "omega", "theta"},
}


def strategy_matrix(kind: str, params: dict[str, Any]) -> Matrix:
    """C rebuilt from a factorization's ``kind`` and ``params`` alone (what the ledger records).

    The same code as the factorization's constructor builds C (B is not built), so C has the
    same entries, and :func:`matrix_hash` of it is the recorded hash, wherever the entries do
    not depend on the platform's floating-point functions (exact for the tree and banded
    Toeplitz C, whose entries are 0/1 or the recorded coefficients; BLT's C is computed with
    powers and a filter, equal to rounding). Refuses, before allocating, a C beyond
    :data:`MAX_MATRIX_BYTES` as the constructors do.

    Args:
        kind: ``"tree"``, ``"tree_honaker"``, ``"banded_toeplitz"`` or ``"blt"``.
        params: exactly the parameters the constructor records (``MatrixFactorization.params``).

    Raises:
        InvalidParameterError: an unknown kind, or parameters that are missing, extra or out of
            range.
        ComputationBudgetError: C would exceed :data:`MAX_MATRIX_BYTES`.
    """
    keys = _PARAM_KEYS.get(kind)
    if keys is None:
        raise InvalidParameterError("kind", kind, f"one of {', '.join(map(repr, _PARAM_KEYS))}")
    if not isinstance(params, dict) or set(params) != keys:
        raise InvalidParameterError(
            "params", params, f"a dict with exactly the keys {sorted(keys)}"
        )
    t = check_positive_int("num_steps", params["num_steps"])
    if kind in ("tree", "tree_honaker"):
        _check_size(t, 2 * t)
        return _tree_strategy(tree_nodes(t), t)
    if kind == "banded_toeplitz":
        c = _check_coefficients(_numbers("coefficients", params["coefficients"]))
        _check_size(t, t)
        return _toeplitz(c, t)
    w, th = _check_blt(_numbers("omega", params["omega"]), _numbers("theta", params["theta"]))
    _check_size(t, t)
    return _toeplitz(inverse_toeplitz_coefficients(_blt_inverse_coefficients(w, th, t), t), t)
