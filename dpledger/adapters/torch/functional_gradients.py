"""The generic per-example gradient path, built on ``torch.func``.

For any differentiable model, the gradient of example i's loss is computed by running the model
on that example alone (as a batch of one) and differentiating, vectorised over the batch with
``torch.func.vmap`` (``functional_call`` + ``vmap(grad(...))``). This materialises g_i for every
parameter: memory O(B·P) and roughly the cost of B small backward passes, so the hook-based fast
path is preferred wherever the layers allow it. Two entry points:

* :func:`per_example_gradients` / :class:`FunctionalPerExampleEngine`: the whole model, given a
  loss function that scores one example (the caller provides it instead of calling
  ``loss.backward()``).
* :func:`module_per_example_gradients`: one module, from its stored forward arguments and output
  gradients, as g_i = J_θ(module(x_i))ᵀ b_i (``vmap`` of ``torch.func.vjp``); the engine uses it
  for modules without a registered fast path.

Given per-example gradients, :func:`squared_norms_of` returns ‖g_i‖² per parameter and
:func:`clipped_sum_of` returns Σ_i f_i g_i.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.func import functional_call, grad, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpledger.adapters.torch.dropout_replay import replaying
from dpledger.adapters.torch.factors import expand_factors
from dpledger.adapters.torch.module_checks import check_module_configuration
from dpledger.errors import EngineStateError, InvalidParameterError

__all__ = [
    "FunctionalPerExampleEngine",
    "clipped_sum_of",
    "module_per_example_gradients",
    "per_example_gradients",
    "squared_norms_of",
]


def _check_chunk_size(chunk_size: Any) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidParameterError("chunk_size", chunk_size, "an integer >= 1, or None")
    return chunk_size


def _trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def per_example_gradients(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    inputs: Any,
    targets: Any,
    *,
    chunk_size: int | None = None,
    randomness: Literal["different", "same", "error"] = "different",
) -> dict[str, torch.Tensor]:
    """Per-example gradients g_i = ∇_θ loss_fn(model(x_i), y_i) of every trainable parameter.

    Each example is run through the model as a batch of one (its leading dimension kept), so
    ``loss_fn`` sees a (1, ...) output and a (1, ...) target and can be the loss used for
    ordinary training (``F.cross_entropy``): its value for a batch of one is the example's loss.

    Args:
        model: any module whose forward is differentiable with ``torch.func``. Its buffers are
            used as they are; modules that use batch statistics are not meaningful here.
        loss_fn: ``loss_fn(output, target) -> scalar`` for one example.
        inputs: a tensor, or a tuple of tensors passed positionally, records along dim 0.
        targets: a tensor (or pytree of tensors) with records along dim 0.
        chunk_size: evaluate this many examples at a time (``vmap``'s ``chunk_size``) to bound
            memory; None for the whole batch at once.
        randomness: ``vmap``'s treatment of random operations (dropout): "different" draws
            independently per example.

    Returns:
        ``{name: tensor of shape (B, *param.shape)}`` in ``model.named_parameters()`` order.
    """
    chunk_size = _check_chunk_size(chunk_size)
    if randomness not in ("different", "same", "error"):
        raise InvalidParameterError("randomness", randomness, "'different', 'same' or 'error'")
    params = _trainable(model)
    buffers = dict(model.named_buffers())
    args = inputs if isinstance(inputs, tuple) else (inputs,)

    def example_loss(p: dict[str, torch.Tensor], x: tuple, y: Any) -> torch.Tensor:
        xb = tuple(t.unsqueeze(0) for t in x)
        yb = tree_unflatten([t.unsqueeze(0) for t in tree_flatten(y)[0]], tree_flatten(y)[1])
        return loss_fn(functional_call(model, (p, buffers), xb), yb)

    batch = args[0].shape[0]
    if batch == 0:
        return {n: p.new_zeros((0, *p.shape)) for n, p in params.items()}
    return vmap(
        grad(example_loss),
        in_dims=(None, 0, 0),
        randomness=randomness,
        chunk_size=chunk_size,
    )(params, args, targets)


def module_per_example_gradients(
    module: nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any],
    output_grads: Sequence[tuple[int, torch.Tensor]],
    *,
    batch_size: int,
    chunk_size: int | None = None,
    names: Sequence[str] | None = None,
    rng_state: Any = None,
    masks: Sequence[torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-example gradients of ``module``'s trainable parameters from one stored forward call.

    With b_i the gradient of the loss with respect to example i's outputs of the call,
    g_i = J_θ(module(x_i))ᵀ b_i, computed by ``vmap`` over the batch of ``torch.func.vjp`` of the
    module's forward on example i alone. Tensor arguments whose first dimension equals
    ``batch_size`` are split by example; every other argument is shared.

    The forward is re-run in at least float32 and in the parameters' precision (inputs and
    output gradients stored in 16 bits under autocast are promoted), outside autocast.

    Random operations (dropout) draw independently per example (``vmap``'s
    ``randomness="different"``), so each example's gradient depends on that example and on
    draws of its own only, which keeps its sensitivity. Given ``rng_state`` (the generators'
    states when the call began, as the engine captures them), the re-run starts from it, which
    reproduces the call's own draws where the random operations draw one tensor over the
    batch in the same order (dropout on the CPU; not with ``chunk_size``); the generators are
    left as they were.

    Args:
        module: the module that was called.
        args: its positional arguments in that call.
        kwargs: its keyword arguments in that call.
        output_grads: ``(index, gradient)`` pairs, the index into the flattened output
            (``torch.utils._pytree.tree_flatten``) and the gradient of that output tensor.
        batch_size: B, the number of records.
        chunk_size: examples per ``vmap`` chunk; None for all at once.
        names: the local names of the trainable parameters to differentiate (default: every
            trainable parameter of the module's subtree); the others are constants.
        rng_state: ``(cpu_state, {cuda_index: state})`` at the start of the call, or None.
        masks: the scaled masks of the ``nn.Dropout`` calls made inside the call, in call order
            (records along dim 0), which the re-run uses instead of drawing
            (:mod:`~dpledger.adapters.torch.dropout_replay`); None: none kept.

    Returns:
        ``{local parameter name: tensor of shape (B, *param.shape)}``.
    """
    params = _trainable(module)
    if names is not None:
        params = {n: params[n] for n in names}
    if batch_size == 0 or not output_grads:
        return {n: p.new_zeros((batch_size, *p.shape)) for n, p in params.items()}
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in params.values()), torch.float32)

    def promote(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            t = t.detach()
            if t.is_floating_point() and t.dtype != dtype and _is_narrower(t.dtype, dtype):
                t = t.to(dtype)
        return t

    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    batched = [
        i
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch_size
    ]
    leaves = [promote(leaf) for leaf in leaves]
    indices = [i for i, _ in output_grads]

    def example_grads(p, example_leaves, example_out_grads, example_masks):
        local = list(leaves)
        for j, i in enumerate(batched):
            local[i] = example_leaves[j].unsqueeze(0)
        a, kw = tree_unflatten(local, spec)

        def forward(q):
            outs = tree_flatten(functional_call(module, q, a, kw))[0]
            return tuple(outs[i] for i in indices)

        with replaying([m.unsqueeze(0) for m in example_masks] if masks else None):
            _, pullback = vjp(forward, p)
        return pullback(tuple(g.unsqueeze(0).to(dtype) for g in example_out_grads))[0]

    run = vmap(
        example_grads, in_dims=(None, 0, 0, 0), randomness="different", chunk_size=chunk_size
    )
    kept = [m.to(dtype) if m.is_floating_point() else m for m in masks or ()]
    inputs = (params, [leaves[i] for i in batched], [g for _, g in output_grads], kept)
    return _from_rng_state(rng_state, run, *inputs)


def _from_rng_state(rng_state: Any, run: Callable[..., Any], *inputs: Any) -> Any:
    """``run(*inputs)`` started from ``rng_state`` ``(cpu_state, {cuda_index: state})``, the
    generators left as they were; plainly for None."""
    if rng_state is None:
        return run(*inputs)
    cpu_state, cuda_states = rng_state
    with torch.random.fork_rng(devices=list(cuda_states), device_type="cuda"):
        torch.set_rng_state(cpu_state)
        for device, state in cuda_states.items():
            torch.cuda.set_rng_state(state, device)
        return run(*inputs)


def _is_narrower(a: torch.dtype, b: torch.dtype) -> bool:
    return torch.finfo(a).bits < torch.finfo(b).bits or (
        torch.finfo(a).bits == torch.finfo(b).bits and a != b
    )


def squared_norms_of(per_example: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """‖g_i‖² of each parameter, shape (B,), from per-example gradients of shape (B, ...).

    Accumulated in at least float32 (16-bit gradients are promoted).
    """
    return {
        n: torch.linalg.vector_norm(
            g.flatten(1), dim=1, dtype=torch.promote_types(g.dtype, torch.float32)
        ).square()
        for n, g in per_example.items()
    }


def clipped_sum_of(
    per_example: Mapping[str, torch.Tensor], factors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Σ_i f_i g_i of each parameter from per-example gradients and factors of shape (B,).

    Computed in at least float32 (16-bit gradients are promoted).
    """
    out = {}
    for n, g in per_example.items():
        dtype = torch.promote_types(g.dtype, torch.float32)
        f = factors[n].to(device=g.device, dtype=dtype)
        out[n] = f.view(1, -1).mm(g.flatten(1).to(dtype)).view(g.shape[1:])
    return out


class FunctionalPerExampleEngine:
    """The generic path with the interface of the hook-based engine.

    ``compute(inputs, targets)`` replaces the forward and ``loss.backward()``: it materialises the
    per-example gradients of ``loss_fn`` (see :func:`per_example_gradients`); then
    :meth:`squared_norms`, :meth:`clipped_sum` and :meth:`write_clipped_sum` work as in
    :class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine`.

    Args:
        model: the model.
        loss_fn: ``loss_fn(output, target) -> scalar`` for one example (a batch of one).
        chunk_size: examples per ``vmap`` chunk; None for all at once.
        randomness: ``vmap``'s treatment of dropout and other random operations.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        *,
        chunk_size: int | None = None,
        randomness: Literal["different", "same", "error"] = "different",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidParameterError("model", model, "a torch.nn.Module")
        if not callable(loss_fn):
            raise InvalidParameterError("loss_fn", loss_fn, "a callable (output, target) -> loss")

        check_module_configuration(model)
        self._model = model
        self._loss_fn = loss_fn
        self._chunk_size = _check_chunk_size(chunk_size)
        self._randomness = randomness
        self._params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self._grads: dict[str, torch.Tensor] | None = None

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """Names of the trainable parameters, in ``model.named_parameters()`` order."""
        return tuple(self._params)

    @property
    def batch_size(self) -> int:
        """B of the last :meth:`compute`."""
        return next(iter(self._require().values())).shape[0] if self._params else 0

    def compute(self, inputs: Any, targets: Any) -> None:
        """Compute and keep the per-example gradients of a batch."""

        check_module_configuration(self._model)
        self._grads = per_example_gradients(
            self._model,
            self._loss_fn,
            inputs,
            targets,
            chunk_size=self._chunk_size,
            randomness=self._randomness,
        )

    def _require(self) -> dict[str, torch.Tensor]:
        if self._grads is None:
            raise EngineStateError("no per-example gradients yet: call compute(inputs, targets)")
        return self._grads

    def per_example_gradients(self) -> dict[str, torch.Tensor]:
        """The per-example gradients, ``{name: (B, *shape)}``."""
        return dict(self._require())

    def squared_norms(self) -> dict[str, torch.Tensor]:
        """‖g_i‖² per parameter, ``{name: (B,)}``."""
        return squared_norms_of(self._require())

    def clipped_sum(
        self, factors: torch.Tensor | Mapping[str | tuple[str, ...], torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Σ_i f_i g_i per parameter; ``factors`` as in the hook-based engine."""
        grads = self._require()
        return clipped_sum_of(
            grads, expand_factors(factors, names=self.parameter_names, batch_size=self.batch_size)
        )

    def write_clipped_sum(
        self, factors: torch.Tensor | Mapping[str | tuple[str, ...], torch.Tensor]
    ) -> None:
        """Set each trainable parameter's ``.grad`` to Σ_i f_i g_i (replacing what was there)."""
        for n, s in self.clipped_sum(factors).items():
            p = self._params[n]
            p.grad = s.to(dtype=p.dtype)
