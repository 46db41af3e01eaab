"""The record-independence probe: a dynamic check that no record moves another record's result.

Per-example clipping bounds the sensitivity of the clipped sum by the clip norm C only if each
record's clipped contribution depends on that record alone (docs/guarantees.md). The
module checks (:mod:`~dpledger.adapters.torch.module_checks`) refuse the known offenders by type
(BatchNorm with batch statistics, ``scale_grad_by_freq``), but a forward function can mix records
without any parameter or module type to see: ``x - x.mean(0)``, ``F.batch_norm(x, None, None,
training=True)``, ``torch.cdist(x, x)``, a softmax over dimension 0, attention or pooling over the
batch (``nn.MultiheadAttention(batch_first=False)`` fed batch-first data). One record then moves
every other record's clipped gradient, the sum's sensitivity exceeds C, and the ledger's ε is
wrong.

The probe runs the model twice on the first ``m`` (at most :data:`PROBE_RECORDS`, at least 2)
records of a real batch, the second time with record 0 changed: replaced by a copy of another
record of the batch (every input leaf, floating or integer), so every value is one the inputs
already take and a model that turns floats into indices stays in range, and its synthetic target
redrawn. A forward that fails on either probe batch is reported as a
:class:`~dpledger.errors.RecordProbeError` that names the probe and
``check_record_independence=False``. Each run differentiates the synthetic per-record loss
Σ_j ⟨v_j, y_j⟩ + ½‖y_j‖² of the model outputs y_j (targets v_j drawn from a private, fixed-seed
generator; the quadratic term makes the output gradient depend on the output) with the engine's
own per-example gradients, i.e. exactly the vectors that training clips. It then checks
(:mod:`~dpledger.mechanisms.record_independence`, on the runs' results as float64 arrays), for
every record j ≥ 1,

* that every module's output rows j are unchanged (forward hooks, in the order the calls end): the
  first module whose inputs are unchanged at rows j ≥ 1 but whose output is not is named in the
  :class:`~dpledger.errors.RecordDependenceError` (the model itself when the mixing
  happens in its own forward between its children);
* that record j's per-example gradient g_j is unchanged: ‖g_j^A − g_j^B‖ ≤ 1024·ε_dtype·(‖g_j^A‖ +
  ‖g_j^B‖). An unaffected record's result is computed by the same operations on the same values
  and is normally reproduced bit for bit; the tolerance only admits kernels whose reduction order
  depends on the other rows (a few hundred roundings), while mixing over a batch of at most four
  records moves a record's gradient by a fraction of itself.

Both runs start from the same random-number state (``torch.random.fork_rng``), so dropout draws
the same masks in both and the user's generators are left exactly as they were; buffers are
restored after each run; parameters' ``.grad`` is not touched (the backward stops at the layers'
outputs) and nothing is recorded in any ledger. The cost is two forwards and two backwards of at
most four records.

What it cannot see: a dependence that the probe's perturbation happens not to excite (a max over
the batch that record 0 does not win; a batch whose first records are all equal), a dependence on
the number of records alone (the probe changes a record, it does not remove one), and mixing that
only happens for other inputs than the probed batch (data-dependent control flow). These are
documented limits, not guarantees.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpledger.adapters.torch.registry import layer_rule
from dpledger.errors import DPLedgerError, UnsupportedLayerError
from dpledger.mechanisms import record_independence as verdicts
from dpledger.mechanisms.record_independence import PROBE_RECORDS, probe_size

__all__ = ["PROBE_RECORDS", "model_fingerprint", "probe_record_independence", "records_in"]

logger = logging.getLogger(__name__)

_SEED = 0x5EED_0F_D9


def records_in(args: tuple, kwargs: dict | None = None) -> int | None:
    """The number of records of a forward's inputs: dim 0 of its first tensor leaf (None: none)."""
    leaves, _ = tree_flatten((args, kwargs or {}))
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def model_fingerprint(model: nn.Module) -> tuple:
    """What makes a model the same model for the probe: its modules, their types and modes.

    A module replaced, added or removed, a forward overridden on an instance, or a switch between
    training and evaluation mode changes the fingerprint (and the probe runs again).
    """
    return tuple(
        (name, id(m), type(m), id(m.__dict__.get("forward")), m.training)
        for name, m in model.named_modules(remove_duplicate=False)
    )


def _inner(model: nn.Module) -> nn.Module:
    """The module to run: DistributedDataParallel's module (the probe needs no communication)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    return model


def _cut(tree: Any, batch: int, m: int) -> Any:
    leaves, spec = tree_flatten(tree)
    out = []
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
            part = t[:m].detach().clone()
            if t.requires_grad:
                part.requires_grad_(True)
            t = part
        out.append(t)
    return tree_unflatten(out, spec)


def _is_record(t: Any, m: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == m and not t.is_complex()


def _changed_record_zero(tree: Any, m: int) -> tuple[Any, int | None]:
    """A copy of ``tree`` whose record 0 is another record of the batch, and that record's index.

    Every record leaf takes record ``k``'s row at row 0, for the first ``k`` >= 1 whose rows differ
    from record 0's in some leaf: one whole record of the batch, so every value is one the input
    already takes (a model that turns floats into indices, or offsets into positions, stays in
    range). When all records are equal, record 0's values are permuted among themselves (index
    None).
    """
    leaves, spec = tree_flatten(tree)
    rows = [_host(t) for t in leaves if _is_record(t, m)]
    other = verdicts.other_record(rows, m)
    out = []
    for t in leaves:
        if _is_record(t, m):
            new = t.detach().clone()
            if other is not None:
                new[0] = new[other]
            elif new[0].numel() > 1:
                new[0] = new[0].flatten().roll(1).view_as(new[0])
            if t.requires_grad:
                new.requires_grad_(True)
            t = new
        out.append(t)
    return tree_unflatten(out, spec), other


def _host(t: torch.Tensor) -> Any:
    """A tensor's values as a NumPy array (float64 for floating dtypes: exact)."""
    t = t.detach()
    return (t.double() if t.is_floating_point() else t).cpu().numpy()


def _moved(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """:func:`~dpledger.mechanisms.record_independence.rows_moved` of two tensors (None: not
    comparable: another shape, dtype or device)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return None
    if torch.equal(a[1:], b[1:]):
        return False
    eps = torch.finfo(a.dtype).eps if a.is_floating_point() else None
    return verdicts.rows_moved(_host(a), _host(b), eps=eps)


def _label(name: str, module: nn.Module) -> str:
    return f"'{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


def refuse_mixing_forward(calls_a: dict, calls_b: dict, m: int) -> None:
    """Refuse the first module whose output rows j >= 1 moved while its inputs' did not
    (:func:`~dpledger.mechanisms.record_independence.first_mixing_call`)."""
    found = verdicts.first_mixing_call(
        {k: (ins, outs) for k, (_, ins, outs) in calls_a.items()},
        {k: (ins, outs) for k, (_, ins, outs) in calls_b.items()},
        moved=_moved,
        name_of=lambda key: key[0],
    )
    if found is None:
        return
    key, child = found
    module = calls_a[key][0]
    hint = ""
    if child is not None:
        hint = (
            f" The mixing happens in its own forward code: {_label(child[0], calls_a[child][0])} "
            "already receives mixed inputs."
        )
    raise verdicts.refuse_mixing(
        kind="module",
        name=key[0],
        layer_type=type(module).__name__,
        m=m,
        what=f"changed its output for the other records while its inputs for them were "
        f"unchanged.{hint}",
        advice="Compute statistics per record (nn.GroupNorm, nn.LayerNorm, pooling over "
        "positions rather than the batch), keep the records along dimension 0 "
        "(batch_first=True for attention), or freeze batch statistics (eval mode with "
        "running statistics).",
    )


def refuse_moved_gradients(
    grads_a: dict[str, torch.Tensor], grads_b: dict[str, torch.Tensor], m: int
) -> None:
    """:func:`~dpledger.mechanisms.record_independence.refuse_moved_gradients` of the runs'
    per-example gradients."""
    eps = max((torch.finfo(g.dtype).eps for g in grads_a.values()), default=0.0)
    verdicts.refuse_moved_gradients(
        {n: _host(g) for n, g in grads_a.items()},
        {n: _host(g) for n, g in grads_b.items()},
        m=m,
        eps=eps,
    )


def _record_rows(tree: Any, m: int) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [
        t.detach().clone()
        for t in leaves
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == m and not t.is_complex()
    ]


def _records_first(module: nn.Module, args: tuple, out: Any, m: int) -> Any:
    """The module's output leaves with their records along dim 0, as its layer rule declares.

    A recurrent layer's h_n (and its output when ``batch_first=False``) holds the records along
    dimension 1; compared along dimension 0, a change of record 0 would look like mixing. A
    declared dimension that does not hold the probe's m records (a time-major layer fed
    batch-first data, which then mixes the records) is not moved, so the output is compared
    along the model's own record dimension and the layer is named.
    """
    sampler = layer_rule(type(module))
    if sampler is None or sampler.output_record_dims is None:
        return out
    leaves, _ = tree_flatten(out)
    dims = sampler.output_record_dims(module, args)
    return [
        t.movedim(d, 0)
        if isinstance(t, torch.Tensor) and 0 < d < t.dim() and t.shape[d] == m
        else t
        for t, d in zip(leaves, dims, strict=False)
    ]


class _Recorder:
    """Forward hooks on every module: inputs and outputs (record rows) of each call, in order."""

    def __init__(self, model: nn.Module, m: int, names: dict[int, str]) -> None:
        self.m = m
        self.calls: list[tuple[str, nn.Module, list[torch.Tensor], list[torch.Tensor]]] = []
        self._open: dict[int, list[list[torch.Tensor]]] = {}
        self._handles: list[Any] = []
        for module in model.modules():
            name = names.get(id(module), "")
            self._handles.append(
                module.register_forward_pre_hook(
                    functools.partial(self._pre, module), with_kwargs=True
                )
            )
            self._handles.append(
                module.register_forward_hook(
                    functools.partial(self._post, name, module), with_kwargs=True
                )
            )

    def _pre(self, module: nn.Module, _mod: nn.Module, args: tuple, kwargs: dict) -> None:
        self._open.setdefault(id(module), []).append(_record_rows((args, kwargs), self.m))

    def _post(
        self, name: str, module: nn.Module, _mod: nn.Module, args: tuple, kwargs: dict, out: Any
    ) -> None:
        stack = self._open.get(id(module))
        inputs = stack.pop() if stack else []
        self.calls.append(
            (name, module, inputs, _record_rows(_records_first(module, args, out, self.m), self.m))
        )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def keyed(self) -> dict[tuple[str, int], tuple[nn.Module, list, list]]:
        seen: dict[str, int] = {}
        out = {}
        for name, module, ins, outs in self.calls:
            k = seen.get(name, 0)
            seen[name] = k + 1
            out[(name, k)] = (module, ins, outs)
        return out


def _rng_devices(model: nn.Module) -> list[int]:
    return sorted(
        {
            t.device.index or 0
            for t in [*model.parameters(), *model.buffers()]
            if t.device.type == "cuda"
        }
    )


@contextlib.contextmanager
def _same_randomness(devices: list[int]) -> Iterator[Any]:
    """Fork the global generators; ``reset()`` puts them back to the state at entry."""
    with torch.random.fork_rng(devices=devices):
        cpu = torch.get_rng_state()
        cuda = [torch.cuda.get_rng_state(d) for d in devices]

        def reset() -> None:
            torch.set_rng_state(cpu)
            for d, s in zip(devices, cuda, strict=True):
                torch.cuda.set_rng_state(s, d)

        yield reset


def probe_record_independence(
    model: nn.Module,
    *,
    engine: Any,
    args: tuple,
    kwargs: dict | None = None,
    max_records: int = PROBE_RECORDS,
) -> bool:
    """Check on a real batch that no record changes another record's outputs or gradients.

    See the module docstring for the method, its tolerance and its limits.

    Args:
        model: the model the engine is attached to (a DistributedDataParallel wrapper is run
            through its ``module``, without communication).
        engine: its :class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine`; its
            stored step is cleared.
        args: the positional inputs of a forward of the model (records along dim 0).
        kwargs: its keyword inputs.
        max_records: how many of the first records to use (2 to :data:`PROBE_RECORDS` is
            plenty: mixing over fewer records is stronger).

    Returns:
        True when the probe ran; False when the batch has fewer than two records (a batch of
        one cannot mix records; the probe should run on a later batch).

    Raises:
        RecordDependenceError: a module's output, or a record's per-example gradient, moved
            when record 0 changed.
        RecordProbeError: the model's forward failed on a probe batch (the original exception
            is chained).
        UnsupportedLayerError: the engine cannot give the probe batch per-example gradients.
        InvalidParameterError: ``max_records`` < 2.
    """
    kwargs = dict(kwargs or {})
    batch = records_in(args, kwargs)
    m = probe_size(batch, max_records)
    if batch is None or m is None:
        return False
    inner = _inner(model)
    names = {id(mod): name for name, mod in model.named_modules()}  # as the user names them
    generator = torch.Generator().manual_seed(_SEED)
    inputs_a = _cut((args, kwargs), batch, m)
    inputs_b, other = _changed_record_zero(inputs_a, m)
    buffers = [(b, b.detach().clone()) for b in inner.buffers()]

    def restore_buffers() -> None:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)

    runs = _probe_runs(
        inner, engine, (inputs_a, inputs_b), (m, other), names, generator, restore_buffers
    )
    refuse_mixing_forward(runs[0]["calls"], runs[1]["calls"], m)
    for run in runs:
        if run["error"] is not None:
            exc = run["error"]
            if isinstance(exc, DPLedgerError):
                raise exc
            raise UnsupportedLayerError(
                "dpledger's record-independence probe could not compute per-example gradients "
                f"of the first {m} records: {type(exc).__name__}: {exc}"
            ) from exc
    if runs[0]["grads"] is not None and runs[1]["grads"] is not None:
        refuse_moved_gradients(runs[0]["grads"], runs[1]["grads"], m)
    logger.debug("record-independence probe passed on %d records", m)
    return True


def _probe_runs(
    inner: nn.Module,
    engine: Any,
    inputs: tuple[Any, Any],
    records: tuple[int, int | None],
    names: dict[int, str],
    generator: torch.Generator,
    restore_buffers: Callable[[], None],
) -> list[dict[str, Any]]:
    """Run A (the first m records) and run B (record 0 changed) with the same randomness:
    each run's module calls, and the per-example gradients of a loss whose output gradients
    differ between the runs in record 0 only (or the error that stopped them)."""
    inputs_a, inputs_b = inputs
    m, other = records
    runs: list[dict[str, Any]] = []
    engine.clear()
    try:
        with _same_randomness(_rng_devices(inner)) as reset, torch.enable_grad():
            targets: list[torch.Tensor] | None = None
            for which, (a, kw) in (("A", inputs_a), ("B", inputs_b)):
                reset()
                restore_buffers()
                engine.clear()
                recorder = _Recorder(inner, m, names)
                try:
                    out = verdicts.run_probe_step(
                        functools.partial(inner, *a, **kw),
                        m=m,
                        run="original" if which == "A" else "changed",
                        other=other,
                    )
                finally:
                    recorder.remove()
                leaves = [
                    t
                    for t in tree_flatten(out)[0]
                    if isinstance(t, torch.Tensor)
                    and t.is_floating_point()
                    and t.requires_grad
                    and t.dim() > 0
                    and t.shape[0] == m
                ]
                if targets is None:
                    targets = [
                        torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t)
                        for t in leaves
                    ]
                run: dict[str, Any] = {"calls": recorder.keyed(), "grads": None, "error": None}
                if leaves and len(leaves) == len(targets):
                    vs = targets
                    if which == "B":
                        vs = [v.clone() for v in targets]
                        for v in vs:
                            fresh = torch.randn(
                                v[0].shape, generator=generator, dtype=torch.float64
                            )
                            v[0] = fresh.to(v)
                    loss = sum(
                        ((v * t) + 0.5 * t * t).sum() for v, t in zip(vs, leaves, strict=True)
                    )
                    try:
                        engine._backward_to_outputs(loss)
                        run["grads"] = engine.per_example_gradients()
                    except Exception as exc:  # reported after the forward check
                        run["error"] = exc
                runs.append(run)
                del out, leaves
                engine.clear()
    finally:
        restore_buffers()
        engine.clear()

    return runs
