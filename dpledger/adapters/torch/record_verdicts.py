"""The record-independence probe's verdicts: which module or parameter moved another record.

The probe (:mod:`~dpledger.adapters.torch.record_probe`) runs the model on a few records and again
with record 0 changed; these functions compare the two runs and raise
:class:`~dpledger.errors.RecordDependenceError`. Rows ``j >= 1`` of a module output, or record
``j``'s per-example gradient, count as moved beyond ``1024·ε_dtype`` relative to their size: an
unaffected record's result is normally reproduced bit for bit, and the tolerance only admits
kernels whose reduction order depends on the other rows.
"""

from __future__ import annotations

import torch
from torch import nn

from dpledger.errors import RecordDependenceError

__all__ = ["refuse_mixing_forward", "refuse_moved_gradients"]

_ULPS = 1024.0


def _moved_rows(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether rows 1.. of ``a`` and ``b`` differ beyond rounding (None: not comparable)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return None
    a, b = a[1:], b[1:]
    if torch.equal(a, b):
        return False
    if not a.is_floating_point():
        return True
    eps = torch.finfo(a.dtype).eps
    a64 = a.double().reshape(a.shape[0], -1)
    b64 = b.double().reshape(b.shape[0], -1)
    same = (a64 == b64) | (a64.isnan() & b64.isnan())
    diff = torch.where(same, torch.zeros_like(a64), a64 - b64)
    if not bool(diff.isfinite().all()):
        return True
    size = torch.where(same, torch.zeros_like(a64), a64.abs() + b64.abs())
    tol = _ULPS * eps * size.norm(dim=1) + torch.finfo(torch.float64).tiny
    return bool((diff.norm(dim=1) > tol).any())


def _any_moved(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool | None:
    if len(xs) != len(ys):
        return None
    verdicts = [_moved_rows(a, b) for a, b in zip(xs, ys, strict=True)]
    if any(v is None for v in verdicts):
        return None
    return any(verdicts)


def _label(name: str, module: nn.Module) -> str:
    return f"'{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


def refuse_mixing_forward(calls_a: dict, calls_b: dict, m: int) -> None:
    """Refuse the first module whose output rows j >= 1 moved while its inputs' did not."""
    for key, (module, ins_a, outs_a) in calls_a.items():
        other = calls_b.get(key)
        if other is None:
            continue
        _, ins_b, outs_b = other
        if _any_moved(ins_a, ins_b) is not False:
            continue
        if not _any_moved(outs_a, outs_b):
            continue
        name = key[0]
        where = _label(name, module)
        hint = ""
        prefix = f"{name}." if name else ""
        for child_key, (cmod, cin_a, _) in calls_a.items():
            child = child_key[0]
            if (
                child.startswith(prefix)
                and child != name
                and child_key in calls_b
                and _any_moved(cin_a, calls_b[child_key][1])
            ):
                hint = (
                    f" The mixing happens in its own forward code: {_label(child, cmod)} "
                    "already receives mixed inputs."
                )
                break
        raise RecordDependenceError(
            f"module {where} mixes the records of a batch: changing record 0 of a {m}-record "
            "probe batch changed its output for the other records while its inputs for them "
            f"were unchanged.{hint} One record then moves every other record's clipped "
            "gradient, so the sum's sensitivity exceeds the clip norm and the ledger's epsilon "
            "would be wrong. Compute statistics per record (nn.GroupNorm, nn.LayerNorm, "
            "pooling over positions rather than the batch), keep the records along dimension 0 "
            "(batch_first=True for attention), or freeze batch statistics (eval mode with "
            "running statistics).",
            layer_name=name,
            layer_type=type(module).__name__,
        )


def refuse_moved_gradients(
    grads_a: dict[str, torch.Tensor], grads_b: dict[str, torch.Tensor], m: int
) -> None:
    diff2 = torch.zeros(m - 1, dtype=torch.float64)
    size = torch.zeros(m - 1, dtype=torch.float64)
    eps = 0.0
    per_param: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, ga in grads_a.items():
        gb = grads_b[name]
        eps = max(eps, torch.finfo(ga.dtype).eps)
        a = ga[1:].double().reshape(m - 1, -1).cpu()
        b = gb[1:].double().reshape(m - 1, -1).cpu()
        d = (a - b).norm(dim=1)
        s = a.norm(dim=1) + b.norm(dim=1)
        per_param[name] = (d, s)
        diff2 += d * d
        size += s * s
    tol = _ULPS * eps * size.sqrt() + torch.finfo(torch.float64).tiny
    moved = (diff2.sqrt() > tol) | ~diff2.isfinite()
    if not bool(moved.any()):
        return
    names = tuple(
        n for n, (d, s) in per_param.items() if bool(((d > _ULPS * eps * s) | ~d.isfinite()).any())
    )
    record = int(moved.nonzero()[0, 0]) + 1
    raise RecordDependenceError(
        f"changing record 0 of a {m}-record probe batch changed the per-example gradient of "
        f"record {record} (parameters {list(names)}), although no module's output for the "
        "other records changed: the backward mixes records (a custom autograd function, or a "
        "loss-like term inside the model). One record then moves every other record's clipped "
        "gradient, so the sum's sensitivity exceeds the clip norm and the ledger's epsilon "
        "would be wrong.",
        layer_name=None,
        layer_type=None,
        parameters=names,
    )
