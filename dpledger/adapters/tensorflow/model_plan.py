"""The engine's analysis of a Keras model: which layers mix records (refused), and which
layers the fast path covers with a registered rule (its plan), or why it cannot serve the model.

Used by :class:`~dpledger.adapters.tensorflow.engine.PerExampleGradientEngine`; the rules are
in :mod:`~dpledger.adapters.tensorflow.registry`.
"""

from __future__ import annotations

from typing import Any

import attrs
import keras

from dpledger.adapters.tensorflow.recurrent_rules import refuse_unsupported_recurrent
from dpledger.adapters.tensorflow.registry import LayerRule, layer_rule
from dpledger.errors import RecordMixingLayerError

__all__ = [
    "ModelAnalysis",
    "PlanEntry",
    "all_layers",
    "fast_path_plan",
    "refuse_batch_axis_normalization",
    "refuse_record_mixing",
]


@attrs.frozen
class PlanEntry:
    """One layer the fast path taps: its rule, the rule's variables and their positions."""

    layer: keras.layers.Layer
    rule: LayerRule
    variables: tuple[Any, ...]
    # position of each rule variable in the engine's trainable variables, or None if frozen
    slots: tuple[int | None, ...]


@attrs.frozen
class ModelAnalysis:
    """The engine's plan for one list of trainable variables (``key``: their ids)."""

    key: tuple[int, ...]
    variables: tuple[Any, ...]
    entries: tuple[PlanEntry, ...] | None
    fast_unsupported: str | None


def child_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The direct sub-layers of ``layer``."""
    flatten = getattr(layer, "_flatten_layers", None)
    if flatten is None:  # pragma: no cover - every Keras 3 layer has it
        return list(getattr(layer, "layers", []))
    return list(flatten(include_self=False, recursive=False))


def all_layers(model: keras.layers.Layer) -> list[keras.layers.Layer]:
    """Every layer inside ``model``, recursively."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def refuse_record_mixing(model: keras.Model) -> None:
    """Refuse a model with a layer that mixes the records of a batch (BatchNormalization in
    training mode, LayerNormalization over the batch axis, a stateful RNN) or a recurrent layer
    the fast path does not support.

    Raises:
        RecordMixingLayerError: naming the layer and the fix.
        UnsupportedLayerError: a recurrent layer with ``recurrent_dropout``.
    """
    for layer in all_layers(model):
        refuse_unsupported_recurrent(layer)
        if isinstance(layer, keras.layers.LayerNormalization):
            refuse_batch_axis_normalization(layer)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise RecordMixingLayerError(
                f"layer {layer.name!r} (BatchNormalization) normalises each example with the "
                "statistics of the whole batch in training mode, so per-example gradients "
                "are not defined and clipping them would not bound any record's influence. "
                "Replace it with keras.layers.GroupNormalization or "
                "keras.layers.LayerNormalization, or freeze it (layer.trainable = False "
                "runs it in inference mode with its moving statistics).",
                layer_name=layer.name,
                layer_type=type(layer).__name__,
            )


def refuse_batch_axis_normalization(layer: keras.layers.Layer) -> None:
    """Refuse a LayerNormalization that normalises over axis 0 (the batch)."""
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    try:
        rank: int | None = len(layer.input.shape)
    except (AttributeError, ValueError):  # not a functional layer: checked when traced
        rank = None
    if any(a == 0 or (rank is not None and a % rank == 0) for a in axes):
        raise RecordMixingLayerError(
            f"layer {layer.name!r} (LayerNormalization) normalises over axis 0, the batch, "
            "so it mixes the records of a batch; normalise over the feature axes (axis=-1)",
            layer_name=layer.name,
            layer_type=type(layer).__name__,
        )


def fast_path_plan(
    model: keras.Model, variables: tuple[Any, ...], *, strategy: str
) -> tuple[tuple[PlanEntry, ...] | None, str | None]:
    """The fast path's plan for ``model``: one entry per layer with a rule and trainable
    variables (the rule, its variables and their positions in ``variables``), or None and the
    reason the fast path cannot serve the model."""
    if strategy == "generic":
        return None, "strategy='generic' was requested"
    slot_of = {id(v): i for i, v in enumerate(variables)}
    entries: list[PlanEntry] = []
    covered: dict[int, str] = {}
    problems: list[str] = []
    stack = list(reversed(child_layers(model)))
    while stack:
        layer = stack.pop()
        rule = layer_rule(type(layer))
        has_trainable = bool(layer.trainable_variables)
        if rule is None or not has_trainable:
            stack.extend(reversed(child_layers(layer)))
            continue
        reason = rule.unsupported_reason(layer)
        if reason is not None:
            problems.append(f"layer {layer.name!r} ({type(layer).__name__}): {reason}")
            continue
        rule_vars = tuple(rule.variables(layer))
        for v in rule_vars:
            if id(v) in covered:
                problems.append(
                    f"variable {v.path!r} is shared by layers {covered[id(v)]!r} and {layer.name!r}"
                )
            covered[id(v)] = layer.name
        entries.append(
            PlanEntry(
                layer=layer,
                rule=rule,
                variables=rule_vars,
                slots=tuple(slot_of.get(id(v)) for v in rule_vars),
            )
        )
    missing = [v for v in variables if id(v) not in covered]
    if missing:
        problems.append(
            "no fast-path rule covers the trainable variable(s) "
            + ", ".join(repr(v.path) for v in missing)
            + " (register a LayerRule for their layer type)"
        )
    if problems:
        return None, "; ".join(problems)
    return tuple(e for e in entries if any(s is not None for s in e.slots)), None
