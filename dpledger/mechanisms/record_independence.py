"""The record-independence probe's verdicts, written once for every adapter.

Per-example clipping bounds the sensitivity of the clipped sum by the clip norm only if each
record's clipped contribution depends on that record alone (``docs/architecture.md``,
"Soundness rules", rule 7). The adapters' probes (``adapters/torch/record_probe.py``,
``adapters/tensorflow/record_probe.py``) run a model twice on the first ``m`` records of a real
batch (2 to :data:`PROBE_RECORDS`), the second time with record 0 replaced by a copy of another
record, and hand the two runs' results here as NumPy arrays with the records along axis 0. This
module decides:

* which record replaces record 0 (:func:`other_record`);
* whether rows j ≥ 1 of two results moved (:func:`rows_moved`): beyond
  ``1024·ε_dtype·‖|a_j| + |b_j|‖`` over the entries that differ. An unaffected record's result is
  computed by the same operations on the same values and is normally reproduced bit for bit;
  the tolerance only admits kernels whose reduction order depends on the other rows, while
  mixing over at most four records moves a record's result by a fraction of itself;
* which layer mixes the records (:func:`first_mixing_call`: the first call whose inputs are
  unchanged at rows j ≥ 1 but whose outputs moved), and whether a record's per-example gradient
  moved (:func:`refuse_moved_gradients`);
* the typed errors: :class:`~dpledger.errors.RecordDependenceError` for a dependence found,
  :class:`~dpledger.errors.RecordProbeError` for a model that fails on a probe batch
  (:func:`run_probe_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from dpledger.errors import (
    DPLedgerError,
    InvalidParameterError,
    RecordDependenceError,
    RecordProbeError,
    record_probe_failure,
)

__all__ = [
    "PROBE_RECORDS",
    "first_mixing_call",
    "other_record",
    "probe_size",
    "refuse_mixing",
    "refuse_moved_gradients",
    "rows_moved",
    "run_probe_step",
]

PROBE_RECORDS = 4
"""The most records the probe uses (the first ones of the batch)."""

ULPS = 1024.0
"""The tolerance in units of the dtype's ε, relative to the size of the compared rows."""

_TINY = float(np.finfo(np.float64).tiny)

_T = TypeVar("_T")

_CONSEQUENCE = (
    "One record then moves every other record's clipped gradient, so the sum's sensitivity "
    "exceeds the clip norm and the ledger's epsilon would be wrong."
)


def probe_size(batch: int | None, max_records: Any) -> int | None:
    """m, the records the probe uses: the first ``min(batch, max_records)``; None when the batch
    has fewer than two records (a batch of one cannot mix records: probe a later one).

    Raises:
        InvalidParameterError: ``max_records`` is not an integer >= 2.
    """
    if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 2:
        raise InvalidParameterError("max_records", max_records, "an integer >= 2")
    if batch is None or batch < 2:
        return None
    return min(batch, max_records)


def other_record(rows: Sequence[npt.NDArray[Any]], m: int) -> int | None:
    """The record k that replaces record 0: the first k >= 1 whose rows differ from record 0's
    in some leaf (None when all m records are equal; record 0's values are then permuted).

    Replacing record 0 by a whole other record of the batch keeps every value one the inputs
    already take, so a model that turns floats into indices stays in range.

    Args:
        rows: the batch's leaves that hold the records along axis 0 (at least m rows each).
        m: the probe's records.
    """
    return next((k for k in range(1, m) if any(not np.array_equal(v[k], v[0]) for v in rows)), None)


def rows_moved(a: npt.NDArray[Any], b: npt.NDArray[Any], *, eps: float | None) -> bool | None:
    """Whether rows 1.. of ``a`` and ``b`` differ beyond rounding.

    Entries equal in both (NaN with NaN, ±inf with itself included) count as unmoved; the
    others are compared in float64, row by row: ‖a_j − b_j‖ > 1024·ε·‖|a_j| + |b_j|‖. A
    difference that is not finite has moved.

    Args:
        a, b: the two runs' results, records along axis 0.
        eps: the machine epsilon of the results' dtype; None for exact values (integers,
            booleans), which move when they differ at all.

    Returns:
        None when the shapes differ (not comparable), else whether some row j >= 1 moved.
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim == 0:
        return None
    a, b = a[1:], b[1:]
    if np.array_equal(a, b):
        return False
    if eps is None:
        return True
    a64 = a.astype(np.float64).reshape(a.shape[0], -1)
    b64 = b.astype(np.float64).reshape(b.shape[0], -1)
    same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(same, 0.0, a64 - b64)
        if not np.all(np.isfinite(diff)):
            return True
        size = np.where(same, 0.0, np.abs(a64) + np.abs(b64))
        tol = ULPS * eps * np.linalg.norm(size, axis=1) + _TINY
        return bool(np.any(np.linalg.norm(diff, axis=1) > tol))


def _any_moved(
    xs: Sequence[npt.NDArray[Any]],
    ys: Sequence[npt.NDArray[Any]],
    moved: Callable[[Any, Any], bool | None],
) -> bool | None:
    if len(xs) != len(ys):
        return None
    verdicts = [moved(a, b) for a, b in zip(xs, ys, strict=True)]
    if any(v is None for v in verdicts):
        return None
    return any(verdicts)


_Call = tuple[Sequence[Any], Sequence[Any]]


def first_mixing_call(
    calls_a: Mapping[_T, _Call],
    calls_b: Mapping[_T, _Call],
    *,
    moved: Callable[[Any, Any], bool | None],
    name_of: Callable[[_T], str],
) -> tuple[_T, _T | None] | None:
    """The first call (in order) whose inputs are unchanged at rows j >= 1 but whose outputs
    moved, with the first of its children already receiving moved inputs (None when the
    mixing is in the call's own code between its children); None when no call mixes.

    Args:
        calls_a, calls_b: per call (a key naming the layer and its call), the inputs and the
            outputs that hold the records along axis 0, of the original and the changed run.
        moved: :func:`rows_moved` for the adapter's values (None: not comparable).
        name_of: the layer's dotted name of a key ("" for the model itself); a child's name
            starts with its parent's name and a dot.
    """
    for key, (ins_a, outs_a) in calls_a.items():
        other = calls_b.get(key)
        if other is None:
            continue
        ins_b, outs_b = other
        if _any_moved(ins_a, ins_b, moved) is not False:
            continue
        if not _any_moved(outs_a, outs_b, moved):
            continue
        name = name_of(key)
        prefix = f"{name}." if name else ""
        for child_key, (child_in_a, _) in calls_a.items():
            child = name_of(child_key)
            if (
                child.startswith(prefix)
                and child != name
                and child_key in calls_b
                and _any_moved(child_in_a, calls_b[child_key][0], moved)
            ):
                return key, child_key
        return key, None
    return None


def refuse_mixing(
    *,
    kind: str,
    name: str | None,
    layer_type: str,
    m: int,
    what: str,
    advice: str,
) -> RecordDependenceError:
    """The :class:`~dpledger.errors.RecordDependenceError` for a layer that mixes records.

    Args:
        kind: what the framework calls a layer ("module", "layer").
        name: its name (None or "" for the model itself).
        layer_type: its class name.
        m: the probe's records.
        what: what changed, e.g. "changed its output for the other records while its inputs
            for them were unchanged".
        advice: what to use instead, in the framework's terms.
    """
    where = f"'{name}' ({layer_type})" if name else f"the model ({layer_type})"
    return RecordDependenceError(
        f"{kind} {where} mixes the records of a batch: changing record 0 of a {m}-record "
        f"probe batch {what} {_CONSEQUENCE} {advice}",
        layer_name=name or "",
        layer_type=layer_type,
    )


def refuse_moved_gradients(
    grads_a: Mapping[str, npt.NDArray[np.float64]],
    grads_b: Mapping[str, npt.NDArray[np.float64]],
    *,
    m: int,
    eps: float,
) -> None:
    """Refuse when a record j >= 1's per-example gradient moved although no layer's output did.

    Record j's gradient g_j (all parameters) moved when ‖g_j^A − g_j^B‖ > 1024·ε·√Σ_p(‖g_jp^A‖
    + ‖g_jp^B‖)²; the parameters named are those whose own rows moved by the same rule.

    Args:
        grads_a, grads_b: per parameter, the per-example gradients of the two runs (float64,
            records along axis 0).
        m: the probe's records.
        eps: the largest machine epsilon of the gradients' dtypes.

    Raises:
        RecordDependenceError: some record's gradient moved (the backward mixes records).
    """
    diff2 = np.zeros(m - 1)
    size2 = np.zeros(m - 1)
    per_param: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]] = {}
    with np.errstate(invalid="ignore", over="ignore"):
        for name, ga in grads_a.items():
            a = np.asarray(ga, dtype=np.float64)[1:].reshape(m - 1, -1)
            b = np.asarray(grads_b[name], dtype=np.float64)[1:].reshape(m - 1, -1)
            d = np.linalg.norm(a - b, axis=1)
            s = np.linalg.norm(a, axis=1) + np.linalg.norm(b, axis=1)
            per_param[name] = (d, s)
            diff2 += d * d
            size2 += s * s
        tol = ULPS * eps * np.sqrt(size2) + _TINY
        moved = (np.sqrt(diff2) > tol) | ~np.isfinite(diff2)
        if not moved.any():
            return
        names = tuple(
            n
            for n, (d, s) in per_param.items()
            if bool(((d > ULPS * eps * s) | ~np.isfinite(d)).any())
        )
    record = int(np.flatnonzero(moved)[0]) + 1
    raise RecordDependenceError(
        f"changing record 0 of a {m}-record probe batch changed the per-example gradient of "
        f"record {record} (parameters {list(names)}), although no module's output for the "
        "other records changed: the backward mixes records (a custom autograd function, or a "
        f"loss-like term inside the model). {_CONSEQUENCE}",
        layer_name=None,
        layer_type=None,
        parameters=names,
    )


def run_probe_step(what: Callable[[], _T], *, m: int, run: str, other: int | None) -> _T:
    """``what()`` (a forward or backward of a probe batch); a failure of the model, not of
    dpledger, is raised as a :class:`~dpledger.errors.RecordProbeError` naming the probe and
    ``check_record_independence=False`` (the original exception chained).

    Args:
        what: the call.
        m: the probe's records.
        run: ``"original"`` or ``"changed"``.
        other: the record that replaced record 0 (None: permuted).
    """
    try:
        return what()
    except DPLedgerError:
        raise
    except Exception as exc:
        raise RecordProbeError(
            record_probe_failure(exc, m=m, run=run, other=other), run=run
        ) from exc
