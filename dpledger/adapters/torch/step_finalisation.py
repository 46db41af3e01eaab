"""The engine's step results: the batch, each unit's norms or per-example gradients, the sums.

:class:`StepFinalisation` is the part of
:class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine` that turns what the hooks
stored for a step into its results, once per step (:meth:`StepFinalisation._finalize`): the
batch size B (the records along dimension 0 of every unit's output gradients), then per unit
called in the step either its squared per-example norms on the fast path (the layer rule's
ghost norms, the capture kept for the clipped sum: book-keeping) or its materialised per-example
gradients (the sampler's, or the generic ``torch.func`` path; the capture is released); the
norms of tied parameters from their per-use norms and a registered cross term; zeros for
parameters the step did not use; and the 1/B of a mean loss undone. On the first
``check_steps`` steps Σ_i g_i is compared with autograd's batch gradient. The clipped sum
Σ_i f_i g_i is formed from the same stored tensors (:meth:`StepFinalisation._clipped_sum`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from dpledger.adapters.torch.engine_state import (
    _aligned,
    _Capture,
    _outside_use_error,
    _StepState,
    _takes,
    _tied_dtype,
    _Unit,
)
from dpledger.adapters.torch.functional_gradients import (
    clipped_sum_of,
    module_per_example_gradients,
    squared_norms_of,
)
from dpledger.adapters.torch.registry import get_cross_term
from dpledger.errors import (
    DPLedgerError,
    EngineStateError,
    UnsupportedLayerError,
    UnsupportedParameterUseError,
)
from dpledger.mechanisms.clipping import rounding_clip_margin

__all__: list[str] = []  # internal to the engine


class StepFinalisation:
    """The per-step results of the engine (a base class of
    :class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine`; see the module
    docstring)."""

    def _batch_size(self) -> int:
        batch = None
        for unit in self._units:
            for c in unit.captures:
                for g in c.grads:
                    if g is None:
                        continue
                    b = g.shape[0] if g.dim() > 0 else -1
                    if batch is None:
                        batch = b
                    elif b != batch:
                        raise EngineStateError(
                            f"{unit.label} has an output gradient with {b} records along "
                            f"dimension 0 where other modules have {batch}; the engine needs "
                            "the records along dimension 0 of every module's input and output"
                        )
        if batch is None:
            if any(u.captures for u in self._units):
                raise EngineStateError(
                    "no gradient reached the model's parameters yet: call loss.backward() (or "
                    "engine.backward(loss)) after the forward"
                )
            if self._grad_seen:  # parameters got gradient, but no unit's forward was seen
                seen = [n for n in self._params if n in self._grad_seen]
                raise _outside_use_error(self._model, self._units, seen)
            raise EngineStateError(
                "no forward of the model with gradients enabled since the last step"
            )
        if batch < 0:
            raise EngineStateError("a module output is a scalar: records must be along dim 0")
        if self._input_records and batch not in self._input_records:
            # Every unit sees the same leading size, but no input of the model has it (e.g.
            # a (B, T, d) input transposed to (T, B, d)): its positions would be clipped as
            # records, and one record would contribute several clipped gradients.
            raise EngineStateError(
                f"the modules' inputs and outputs have {batch} entries along dimension 0 but "
                f"the model's inputs have {sorted(self._input_records)}; the engine needs the "
                "records along dimension 0 of every module's input and output"
            )
        return batch

    def _adoptions(self) -> dict[int, dict[str, str]]:
        """The parameters each generic unit differentiates for units not called in this step.

        A unit that was not called in the step but lies inside a generic unit that was has its
        parameters used (if at all) directly by an enclosing module: the nearest enclosing
        generic unit that was called differentiates them with its own. Returns, per adopting
        unit (by id), its local names of those parameters mapped to their global names.
        """
        called = {id(u) for u in self._units if any(c.has_grad for c in u.captures)}
        out: dict[int, dict[str, str]] = {}
        for unit in self._units:
            if id(unit) in called:
                continue
            adopter = unit.adopter
            while adopter is not None and id(adopter) not in called:
                adopter = adopter.adopter
            if adopter is None:
                continue
            local_of = {g: n for n, g in adopter.subtree.items()}
            out.setdefault(id(adopter), {}).update(
                {local_of[g]: g for g in unit.local_to_global.values()}
            )
        return out

    def _tied_pairs(self) -> list[tuple[_Unit, _Unit, list[tuple[str, str, str]]]]:
        """Pairs of units sharing parameters that keep the fast path through a cross term.

        Both units were called once in this step with a fast path, every parameter either
        shares it shares with the other one only, and a cross term is registered for their
        types (:func:`~dpledger.adapters.torch.registry.register_cross_term`). Returns each pair
        with its shared parameters as (local name in the first, in the second, global name).
        """
        if self._strategy in ("per_example", "generic"):
            return []
        owners: dict[str, list[_Unit]] = {}
        for unit in self._units:
            for g in unit.local_to_global.values():
                if self._owners[g] > 1:
                    owners.setdefault(g, []).append(unit)
        pairs: dict[tuple[int, int], tuple[_Unit, _Unit, list[tuple[str, str, str]]]] = {}
        refused: set[tuple[int, int]] = set()
        for g, units in owners.items():
            if len(units) != 2:
                for u in units:
                    refused.update((id(u), id(v)) for v in units)
                continue
            a, b = units
            key = (id(a), id(b))
            local_a = {v: n for n, v in a.local_to_global.items()}[g]
            local_b = {v: n for n, v in b.local_to_global.items()}[g]
            pairs.setdefault(key, (a, b, []))[2].append((local_a, local_b, g))
        out = []
        partner: dict[int, int] = {}
        for key, (a, b, shared) in pairs.items():
            if key in refused or id(a) in partner or id(b) in partner:
                continue
            if not all(self._can_tie(u) for u in (a, b)):
                continue
            if get_cross_term(type(a.module), type(b.module)) is None:
                continue
            partner[id(a)], partner[id(b)] = id(b), id(a)
            out.append((a, b, shared))
        # A unit sharing parameters with a third unit as well is not tied at all.
        return [
            (a, b, shared)
            for a, b, shared in out
            if all(
                {id(o) for o in owners[g]} <= {id(a), id(b)}
                for u in (a, b)
                for g in u.local_to_global.values()
                if g in owners
            )
        ]

    def _can_tie(self, unit: _Unit) -> bool:
        captures = [c for c in unit.captures if c.has_grad]
        sampler = unit.sampler
        return (
            len(captures) == 1
            and sampler is not None
            and sampler.has_fast_path
            and _takes(sampler, captures[0])
            and captures[0].record_dims is None
        )

    def _unit_per_example(
        self, unit: _Unit, capture: _Capture, names: Mapping[str, str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Per-example gradients of ``names`` (local -> global; default the unit's own)."""
        names = unit.local_to_global if names is None else names
        sampler = unit.sampler
        if sampler is not None and sampler.per_example_fn is not None and _takes(sampler, capture):
            out = sampler.per_example_fn(unit.module, *_aligned(capture))
        else:
            self._recomputing = True
            try:
                out = module_per_example_gradients(
                    unit.module,
                    capture.args,
                    capture.kwargs,
                    capture.output_grads(),
                    batch_size=self._state_batch,
                    chunk_size=self._generic_chunk_size,
                    names=tuple(names),
                    rng_state=capture.rng_state,
                    masks=capture.masks,
                )
            except DPLedgerError:
                raise
            except Exception as exc:
                raise UnsupportedLayerError(
                    f"the per-example gradients of module '{unit.name}' "
                    f"({type(unit.module).__name__}) could not be computed on the generic path, "
                    f"which runs its forward on one record at a time (torch.func.vmap): "
                    f"{type(exc).__name__}: {exc}. A forward that needs the other records of "
                    "the batch (batch statistics such as F.batch_norm(..., training=True), "
                    "attention or pooling over dimension 0) mixes records and cannot be "
                    "trained with per-example clipping; compute its statistics per record"
                ) from exc
            finally:
                self._recomputing = False
        return self._checked(unit, out, "per-example gradient", names)

    def _checked(
        self,
        unit: _Unit,
        out: Mapping[str, torch.Tensor],
        what: str,
        names: Mapping[str, str] | None = None,
    ) -> dict:
        names = unit.local_to_global if names is None else names
        missing = [n for n in names if n not in out]
        if missing:
            raise UnsupportedLayerError(
                f"the layer rule of {unit.label} returned no {what} for {missing}"
            )
        return {n: out[n] for n in names}

    def _use_fast_path(self, unit: _Unit, capture: _Capture) -> bool:
        sampler = unit.sampler
        if sampler is None or not sampler.has_fast_path or not _takes(sampler, capture):
            return False
        if self._strategy == "per_example" and sampler.per_example_fn is not None:
            return False
        if self._strategy == "ghost" or sampler.per_example_fn is None:
            return True
        if sampler.prefer_per_example is None:
            return True
        return not sampler.prefer_per_example(unit.module, *_aligned(capture))

    def _exact(self) -> contextlib.ExitStack:
        """No autograd recording and no autocast for the engine's own computations."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        for device_type in self._device_types:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        return stack

    def _finalize(self) -> _StepState:
        with self._exact():
            return self._finalize_step()

    def _finalize_step(self) -> _StepState:
        if self._stale:
            raise EngineStateError(
                "the model ran forward or backward again after this step's per-example "
                "quantities were computed; start the next step with a forward of the model "
                "(or call engine.clear())"
            )
        if self._state is not None:
            return self._state
        batch = self._batch_size()
        self._state_batch = batch
        scale = float(batch) if (self._loss_reduction == "mean" and batch > 0) else 1.0
        grad_eps = self._least_precise_grad_eps()
        tied = self._tied_pairs()
        norms, ghost, per_example, tied_parts = self._unit_results(tied)
        self._add_tied_norms(tied, tied_parts, norms)
        norms.update(squared_norms_of(per_example))
        for n, p in self._params.items():
            if n not in norms:
                norms[n] = p.new_zeros(batch)
        if scale != 1.0:
            norms = {n: v * (scale * scale) for n, v in norms.items()}
        self._state = _StepState(
            batch_size=batch,
            scale=scale,
            norms={n: norms[n] for n in self._params},
            ghost=ghost,
            per_example=per_example,
            grad_eps=grad_eps,
        )
        if self._checks_remaining > 0 and batch > 0 and self._grad_seen:
            self._consistency_check(self._state)
            self._checks_remaining -= 1
        return self._state

    def _least_precise_grad_eps(self) -> float:
        """The machine epsilon of the least precise output gradient (autocast); 0 for none."""
        return max(
            (
                torch.finfo(g.dtype).eps
                for u in self._units
                for c in u.captures
                for g in c.grads
                if g is not None and g.is_floating_point()
            ),
            default=0.0,
        )

    def _unit_results(
        self, tied: list[tuple[_Unit, _Unit, list[tuple[str, str, str]]]]
    ) -> tuple[
        dict[str, torch.Tensor],
        list[tuple[_Unit, _Capture]],
        dict[str, torch.Tensor],
        dict[str, list[torch.Tensor]],
    ]:
        """What each unit called in the step contributes: fast-path squared norms or
        materialised per-example gradients.

        Returns the squared norms of the fast-path units' own parameters, those units with their
        capture (kept for the clipped sum), the materialised per-example gradients (their
        captures released), and the fast-path norms of each tied parameter, one per use.

        Raises:
            UnsupportedParameterUseError: a parameter received gradient without any observed
                use.
        """
        norms: dict[str, torch.Tensor] = {}
        ghost: list[tuple[_Unit, _Capture]] = []
        per_example: dict[str, torch.Tensor] = {}
        tied_parts: dict[str, list[torch.Tensor]] = {}
        adopted = self._adoptions()
        tied_units = {id(u) for pair in tied for u in pair[:2]}
        used: set[str] = set()
        for unit in self._units:
            captures = [c for c in unit.captures if c.has_grad]
            if not captures:
                continue
            names = {**unit.local_to_global, **adopted.get(id(unit), {})}
            used.update(names.values())
            shared = any(self._owners[g] > 1 for g in unit.local_to_global.values())
            if id(unit) in tied_units or (
                len(captures) == 1 and not shared and self._use_fast_path(unit, captures[0])
            ):
                self._fast_path_norms(unit, captures[0], norms, tied_parts)
                ghost.append((unit, captures[0]))
                continue
            for c in captures:
                for n, g in self._unit_per_example(unit, c, names).items():
                    key = names[n]
                    per_example[key] = g if key not in per_example else per_example[key] + g
            for c in captures:  # the materialised gradients replace the stored tensors
                c.release()
            unit.captures.clear()
        self._refuse_unseen(used)
        return norms, ghost, per_example, tied_parts

    def _fast_path_norms(
        self,
        unit: _Unit,
        c: _Capture,
        norms: dict[str, torch.Tensor],
        tied_parts: dict[str, list[torch.Tensor]],
    ) -> None:
        """The unit's squared norms from its sampler's norm function, into ``norms`` (or, for a
        tied parameter, into its list of per-use norms)."""
        assert unit.sampler is not None and unit.sampler.norm_fn is not None
        local = self._checked(unit, unit.sampler.norm_fn(unit.module, *_aligned(c)), "norm")
        for n, v in local.items():
            g = unit.local_to_global[n]
            if self._owners[g] > 1:
                tied_parts.setdefault(g, []).append(v)
            else:
                norms[g] = v

    def _refuse_unseen(self, used: set[str]) -> None:
        """Refuse parameters that received gradient but whose use no unit observed."""
        unseen = sorted(self._grad_seen - used)
        if unseen:
            raise UnsupportedParameterUseError(
                f"parameter(s) {self._owned(unseen)} received gradient in the backward but were "
                "not used in "
                "the forward of a module the engine observed (e.g. a child's weight used "
                "directly by its parent's forward, or a model that is not the one the engine "
                "was attached to). Use the parameter only through its module's forward, or "
                "register a layer rule for the parent module type."
            )

    def _add_tied_norms(
        self,
        tied: list[tuple[_Unit, _Unit, list[tuple[str, str, str]]]],
        tied_parts: dict[str, list[torch.Tensor]],
        norms: dict[str, torch.Tensor],
    ) -> None:
        """‖g_a + g_b‖² of each tied parameter from its two per-use norms and the cross term."""
        for a, b, shared_names in tied:
            ca, cb = a.captures[0], b.captures[0]
            cross_term = get_cross_term(type(a.module), type(b.module))
            assert cross_term is not None
            for local_a, local_b, g in shared_names:
                cross = cross_term(
                    a.module, *_aligned(ca), local_a, b.module, *_aligned(cb), local_b
                )
                parts = [v.to(torch.float64) for v in tied_parts.pop(g)]
                own = parts[0] + parts[1]
                # ‖g_a + g_b‖² = ‖g_a‖² + ‖g_b‖² + 2⟨g_a, g_b⟩. Rounding in the two norms is
                # relative to them, not to the (possibly much smaller) total: add the margin
                # of their dtype, relative to them, so that the total is never understated.
                margin = rounding_clip_margin(torch.finfo(_tied_dtype(ca, cb)).eps)
                norms[g] = (own + 2.0 * cross.to(own.device) + margin * own).clamp_min(0.0)

    def _consistency_check(self, state: _StepState) -> None:
        """Raise unless Σ_i g_i equals autograd's batch gradient (times B for a mean loss)."""
        ones = torch.ones(state.batch_size)  # moved to each layer's device and dtype
        with torch.no_grad():
            ours = self._clipped_sum(state, dict.fromkeys(self._params, ones))
            # Rounding in a sum of B terms is relative to the terms (Σ_i ‖g_i‖), not to the
            # result; a parameter whose true gradient vanishes (a key bias under softmax) keeps
            # only rounding noise, so an absolute floor relative to the whole gradient is added.
            device = next(iter(state.norms.values())).device
            total = torch.zeros(state.batch_size, device=device)
            for v in state.norms.values():
                total += v.float().to(device)
            whole = float(total.clamp_min(0).sqrt().sum())
            bad = []
            for n, p in self._params.items():
                ref = self._autograd_grads.get(n)
                ref = torch.zeros_like(p) if ref is None else ref * state.scale
                o = ours[n].to(dtype=ref.dtype)
                rtol = max(1e-3, 10 * torch.finfo(ref.dtype).eps, 10 * state.grad_eps)
                size = float(state.norms[n].clamp_min(0).sqrt().sum()) + float(ref.norm())
                tol = rtol * size + 1e-4 * rtol * whole + 1e-30
                diff = float((o - ref).norm())
                if diff > tol:
                    bad.append(
                        f"{self._owned([n])[0]} (|difference|={diff:.3g}, "
                        f"|autograd|={float(ref.norm()):.3g})"
                    )
        if bad:
            raise UnsupportedParameterUseError(
                "the sum of per-example gradients differs from autograd's batch gradient for "
                f"{', '.join(bad)}. These parameters receive gradient from computations outside "
                "the forward of the module that owns them (a tied weight used directly by a "
                "parent module, a regulariser added to the loss, or a loss that is not a sum or "
                "mean of per-example terms). Use each parameter only through its module's "
                "forward and put weight decay in the optimizer."
            )

    def _owned(self, names: list[str]) -> list[str]:
        """Each parameter name with the module that owns it, for error messages."""
        out = []
        for n in names:
            owner_name, _, _ = n.rpartition(".")
            try:
                owner = self._model.get_submodule(owner_name)
            except AttributeError:
                out.append(n)
                continue
            out.append(f"{n} of module '{owner_name}' ({type(owner).__name__})")
        return out

    def _clipped_sum(
        self, state: _StepState, factors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for unit, c in state.ghost:
            args, g = _aligned(c)
            ref = g if isinstance(g, torch.Tensor) else next(t for t in g if t is not None)
            assert unit.sampler is not None and unit.sampler.clipped_sum_fn is not None
            local = {
                n: factors[gname].to(device=ref.device, dtype=ref.dtype) * state.scale
                for n, gname in unit.local_to_global.items()
            }
            res = self._checked(
                unit, unit.sampler.clipped_sum_fn(unit.module, args, g, local), "clipped sum"
            )
            for n, v in res.items():
                g = unit.local_to_global[n]
                out[g] = out[g] + v if g in out else v  # tied: the sum over both layers
        if state.per_example:
            scaled = {
                n: factors[n].to(device=g.device, dtype=g.dtype) * state.scale
                for n, g in state.per_example.items()
            }
            out.update(clipped_sum_of(state.per_example, scaled))
        return {n: out[n] if n in out else torch.zeros_like(p) for n, p in self._params.items()}
