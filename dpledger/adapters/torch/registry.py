"""The registry of per-layer gradient samplers, keyed by module type.

A *layer rule* tells the engine how to get per-example quantities of one layer type from what
the engine stores during a step: the layer's positional forward arguments (its *activations*,
records along dimension 0) and the gradient of the loss with respect to its output (the
*backprops*, already rescaled so that the loss is the sum of the per-example losses). With
g_i the gradient of example i's loss with respect to one of the layer's parameters, a sampler
provides any of

* ``norm_fn(module, activations, backprops) -> {name: ‖g_i‖² of shape (B,)}``,
* ``clipped_sum_fn(module, activations, backprops, factors) -> {name: Σ_i f_i g_i}``, with
  ``factors[name]`` the per-example factors f of shape (B,),
* ``per_example_fn(module, activations, backprops) -> {name: g of shape (B, *param.shape)}``,

keyed by the parameter names local to the module (``"weight"``, ``"bias"``). The first two
together are the fast path (norms without materialising g_i, Li et al. 2022; Bu et al. 2023); the
third materialises g_i, which is cheaper for some shapes and needed when a parameter is used more
than once in a step. ``prefer_per_example(module, activations, backprops) -> bool`` lets a
sampler choose between the two by cost for the shapes at hand. A sampler must provide either
both fast-path functions or ``per_example_fn`` (or all three).

Two optional functions extend this protocol:

* ``output_record_dims(module, activations) -> tuple[int, ...]``, one entry per leaf of the
  module's flattened output (``torch.utils._pytree.tree_flatten``), saying along which dimension
  that output holds the records. With it the module may return several tensors (a recurrent
  layer returns ``(output, h_n)``, whose h_n has its records along dimension 1), and the engine
  passes ``backprops`` as a *tuple* with one entry per output leaf: the gradient with respect to
  that output with its records moved to dimension 0, or None where the output received no
  gradient. The activations are passed as the module received them (the sampler knows their
  layout). Such a sampler must provide ``per_example_fn``.
* ``check_fn(module, activations)`` raises
  :class:`~dpledger.errors.UnsupportedLayerError` for a configuration or an input
  the sampler cannot handle. The engine calls it with ``activations=None`` when it is created
  (the module's configuration alone) and with the positional forward arguments before every
  forward it records, so that nothing is recorded for a refused call.

Lookups use the exact type: a subclass of ``nn.Linear`` with its own ``forward`` is not a
``nn.Linear`` for the engine until it is registered. Unregistered modules that own trainable
parameters are handled by the generic path (``torch.func``), so registering is an optimisation,
never a requirement for correctness.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from dpledger.errors import InvalidParameterError

__all__ = [
    "AppliesFn",
    "CheckFn",
    "ClippedSumFn",
    "CrossTermFn",
    "LayerRule",
    "NormFn",
    "OutputRecordDimsFn",
    "PerExampleFn",
    "PreferPerExampleFn",
    "get_cross_term",
    "layer_rule",
    "register_cross_term",
    "register_layer_rule",
    "register_rule_resolver",
    "registered_layer_types",
    "unregister_layer_rule",
]

NormFn = Callable[[nn.Module, tuple, torch.Tensor], dict[str, torch.Tensor]]
ClippedSumFn = Callable[
    [nn.Module, tuple, torch.Tensor, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]
]
PerExampleFn = Callable[[nn.Module, tuple, torch.Tensor], dict[str, torch.Tensor]]
PreferPerExampleFn = Callable[[nn.Module, tuple, torch.Tensor], bool]
OutputRecordDimsFn = Callable[[nn.Module, tuple], tuple[int, ...]]
CheckFn = Callable[[nn.Module, tuple | None], None]
AppliesFn = Callable[[nn.Module], bool]


@dataclass(frozen=True)
class LayerRule:
    """The per-layer functions registered for one module type (see the module docstring).

    Attributes:
        norm_fn: per-example squared gradient norms of each parameter, or None.
        clipped_sum_fn: Σ_i f_i g_i for each parameter, or None.
        per_example_fn: the per-example gradients g_i themselves, or None.
        prefer_per_example: chooses materialising over the fast path for given shapes, or None
            (then the fast path is used whenever it exists).
        output_record_dims: the record dimension of each output leaf, or None for a module that
            returns one tensor with its records along dimension 0.
        check_fn: refuses configurations or inputs the sampler cannot handle, or None.
        applies_fn: False for a module of the type that the sampler does not reproduce exactly
            (its configuration), which then takes the generic path; None: every module.
    """

    norm_fn: NormFn | None = None
    clipped_sum_fn: ClippedSumFn | None = None
    per_example_fn: PerExampleFn | None = None
    prefer_per_example: PreferPerExampleFn | None = None
    output_record_dims: OutputRecordDimsFn | None = None
    check_fn: CheckFn | None = None
    applies_fn: AppliesFn | None = None

    @property
    def has_fast_path(self) -> bool:
        """True when norms and clipped sums can be computed without materialising g_i."""
        return self.norm_fn is not None and self.clipped_sum_fn is not None


_REGISTRY: dict[type[nn.Module], LayerRule] = {}
_LOCK = threading.Lock()


def _check_callable(name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise InvalidParameterError(name, value, "a callable or None")


def register_layer_rule(
    module_type: type[nn.Module],
    *,
    norm_fn: NormFn | None = None,
    clipped_sum_fn: ClippedSumFn | None = None,
    per_example_fn: PerExampleFn | None = None,
    prefer_per_example: PreferPerExampleFn | None = None,
    output_record_dims: OutputRecordDimsFn | None = None,
    check_fn: CheckFn | None = None,
    applies_fn: AppliesFn | None = None,
    replace: bool = False,
) -> LayerRule:
    """Register how the engine computes per-example quantities for ``module_type``.

    Args:
        module_type: an ``nn.Module`` subclass; matched exactly (not its subclasses).
        norm_fn: ``(module, activations, backprops) -> {name: (B,) tensor}`` of ‖g_i‖².
        clipped_sum_fn: ``(module, activations, backprops, factors) -> {name: Σ_i f_i g_i}``.
        per_example_fn: ``(module, activations, backprops) -> {name: (B, *shape) tensor}``.
        prefer_per_example: ``(module, activations, backprops) -> bool``, True to materialise.
        output_record_dims: ``(module, activations) -> tuple[int, ...]``, the record dimension
            of each output leaf; given, ``backprops`` is a tuple (see the module docstring).
        check_fn: ``(module, activations or None) -> None``, raising
            :class:`~dpledger.errors.UnsupportedLayerError` for what the sampler
            does not support.
        applies_fn: ``(module) -> bool``, False for a module whose configuration the sampler
            does not reproduce exactly; the engine then gives that module the generic path
            (unlike ``check_fn``, which refuses).
        replace: allow replacing an existing registration (the built-in ones included).

    Returns:
        The registered :class:`LayerRule`.

    Raises:
        InvalidParameterError: ``module_type`` is not an ``nn.Module`` subclass, a function is
            not callable, neither the fast-path pair nor ``per_example_fn`` is given,
            ``output_record_dims`` is given without ``per_example_fn``, or the type is already
            registered and ``replace`` is False.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise InvalidParameterError("module_type", module_type, "a subclass of torch.nn.Module")
    for name, fn in (
        ("norm_fn", norm_fn),
        ("clipped_sum_fn", clipped_sum_fn),
        ("per_example_fn", per_example_fn),
        ("prefer_per_example", prefer_per_example),
        ("output_record_dims", output_record_dims),
        ("check_fn", check_fn),
        ("applies_fn", applies_fn),
    ):
        _check_callable(name, fn)
    if (norm_fn is None) != (clipped_sum_fn is None):
        raise InvalidParameterError(
            "norm_fn" if norm_fn is None else "clipped_sum_fn",
            None,
            "norm_fn and clipped_sum_fn given together (the fast path needs both)",
        )
    if norm_fn is None and per_example_fn is None:
        raise InvalidParameterError(
            "per_example_fn", None, "a callable when norm_fn and clipped_sum_fn are not given"
        )
    if output_record_dims is not None and per_example_fn is None:
        raise InvalidParameterError(
            "per_example_fn",
            None,
            "a callable when output_record_dims is given (several outputs are never passed to "
            "the generic path)",
        )
    sampler = LayerRule(
        norm_fn=norm_fn,
        clipped_sum_fn=clipped_sum_fn,
        per_example_fn=per_example_fn,
        prefer_per_example=prefer_per_example,
        output_record_dims=output_record_dims,
        check_fn=check_fn,
        applies_fn=applies_fn,
    )
    with _LOCK:
        if module_type in _REGISTRY and not replace:
            raise InvalidParameterError(
                "module_type",
                module_type,
                "a type without a registered layer rule (pass replace=True to override)",
            )
        _REGISTRY[module_type] = sampler
    return sampler


def unregister_layer_rule(module_type: type[nn.Module]) -> LayerRule | None:
    """Remove the registration of ``module_type``; return it (None if there was none)."""
    with _LOCK:
        return _REGISTRY.pop(module_type, None)


CrossTermFn = Callable[
    [nn.Module, tuple, torch.Tensor, str, nn.Module, tuple, torch.Tensor, str], torch.Tensor
]
_CROSS_TERMS: dict[tuple[type[nn.Module], type[nn.Module]], CrossTermFn] = {}


def register_cross_term(first: type[nn.Module], second: type[nn.Module], fn: CrossTermFn) -> None:
    """Register ⟨g_i^first, g_i^second⟩ for one tensor shared by a ``first`` and a ``second`` layer.

    A parameter used by two layers (a language model's output layer tied to its token
    embedding) has the per-example gradient g_i = g_i^a + g_i^b, and
    ‖g_i‖² = ‖g_i^a‖² + ‖g_i^b‖² + 2⟨g_i^a, g_i^b⟩: with the cross term, both layers keep their
    ghost norms and book-keeping sums instead of materialising (B, *shape) gradients.

    ``fn(module_a, activations_a, backprops_a, name_a, module_b, activations_b, backprops_b,
    name_b)`` returns the (B,) inner products for the parameter called ``name_a`` in
    ``module_a`` and ``name_b`` in ``module_b``; it is registered for both orders.
    """
    for t in (first, second):
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise InvalidParameterError("module_type", t, "a subclass of torch.nn.Module")
    _check_callable("fn", fn)

    def swapped(ma, aa, ba, na, mb, ab, bb, nb):
        return fn(mb, ab, bb, nb, ma, aa, ba, na)

    with _LOCK:
        _CROSS_TERMS[(first, second)] = fn
        if first is not second:
            _CROSS_TERMS[(second, first)] = swapped


def get_cross_term(first: type[nn.Module], second: type[nn.Module]) -> CrossTermFn | None:
    """The cross term registered for a tensor shared by these two exact types, or None."""
    return _CROSS_TERMS.get((first, second))


_RESOLVERS: list[Callable[[type[nn.Module]], LayerRule | None]] = []
_RESOLVED: dict[type[nn.Module], LayerRule | None] = {}  # the resolvers' answers, kept


def register_rule_resolver(resolver: Callable[[type[nn.Module]], LayerRule | None]) -> None:
    """Add a function that supplies a sampler for a type registered nowhere else, or None.

    Resolvers let dpledger support module types of optional libraries (Hugging Face
    ``transformers``) without importing them: they are asked, in order, on the first lookup of
    an unregistered type, and their answer is registered for that type.
    """
    if not callable(resolver):
        raise InvalidParameterError("resolver", resolver, "a callable (module type) -> sampler")
    with _LOCK:
        _RESOLVERS.append(resolver)
        _RESOLVED.clear()


def layer_rule(module_type: type[nn.Module]) -> LayerRule | None:
    """The sampler registered for exactly ``module_type`` (or a resolver's), or None."""
    sampler = _REGISTRY.get(module_type)
    if sampler is not None:
        return sampler
    if module_type in _RESOLVED:
        return _RESOLVED[module_type]
    for resolver in tuple(_RESOLVERS):
        sampler = resolver(module_type)
        if sampler is not None:
            break
    with _LOCK:
        return _RESOLVED.setdefault(module_type, sampler)


def registered_layer_types() -> tuple[type[nn.Module], ...]:
    """Every module type with a registered sampler, in registration order."""
    with _LOCK:
        return tuple(_REGISTRY)
