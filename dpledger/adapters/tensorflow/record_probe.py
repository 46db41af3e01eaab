"""The record-independence probe for Keras models (see the PyTorch adapter's ``record_probe``).

A layer without variables that mixes the records of a batch (``keras.layers.Lambda(lambda x: x -
ops.mean(x, axis=0))``, a softmax over axis 0, attention over the batch axis) passes every
structural check, yet one record then moves every other record's clipped gradient and the
ledger's ε is wrong (docs/guarantees.md). Before the first step the probe evaluates the
model eagerly on the first ``m`` (2 to :data:`PROBE_RECORDS`) records of a real batch, and again
with record 0 changed (replaced, in every input and target, by a copy of another record of the
batch, so every value is one the inputs already take), and refuses the model with
:class:`~dpledger.errors.RecordDependenceError` when, for any record j ≥ 1,

* the model's outputs (and, for functional and sequential models, any layer's outputs: the first
  such layer is named) change beyond 1024 units in the last place of their dtype, relative to
  their size; or
* the engine's per-example squared gradient norms ‖g_j‖² (the quantities clipping uses) change
  beyond the same tolerance.

Both runs start from the same values of every model variable (Keras keeps the state of dropout's
seed generators in variables), which are restored afterwards, so the probe neither changes the
dropout masks of training nor records anything in a ledger. The cost is two forwards and two
per-example backwards of at most four records, run eagerly. Limits: a dependence that record 0's
change does not excite, or on the number of records alone, is not seen. A forward that fails on
a probe batch is reported as a :class:`~dpledger.errors.RecordProbeError` naming the probe and
``check_record_independence=False``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from dpledger.mechanisms import record_independence as verdicts
from dpledger.mechanisms.construction_checks import check_switch
from dpledger.mechanisms.record_independence import PROBE_RECORDS, probe_size

__all__ = [
    "PROBE_RECORDS",
    "check_probe_switch",
    "probe_record_independence",
    "record_probe_off_warning",
]

_log = logging.getLogger(__name__)


def _records(structure: Any) -> int | None:
    for t in tf.nest.flatten(structure):
        shape = getattr(t, "shape", None)
        if shape is not None and len(shape) > 0:
            return int(shape[0])
    return None


def _cut(structure: Any, batch: int, m: int) -> Any:
    def cut(t: Any) -> Any:
        if t is None:
            return None
        t = tf.convert_to_tensor(t)
        return t[:m] if len(t.shape) > 0 and int(t.shape[0]) == batch else t

    return tf.nest.map_structure(cut, structure)


def _changed_record_zero(structure: Any, m: int) -> tuple[Any, int | None]:
    """A copy whose record 0 is a copy of another record ``k`` of the batch, and ``k``.

    ``k`` is the first record >= 1 that differs from record 0 in some leaf, copied into every
    leaf, so every value is one the inputs already take (a model that turns floats into indices
    stays in range). When all records are equal, record 0's values are permuted (``k`` None).
    """

    def records(t: Any) -> bool:
        return t is not None and len(t.shape) > 0 and int(t.shape[0]) == m

    leaves = [np.asarray(t) for t in tf.nest.flatten(structure) if records(t)]
    other = verdicts.other_record(leaves, m)

    def change(t: Any) -> Any:
        if not records(t):
            return t
        values = np.array(t.numpy())
        if other is not None:
            values[0] = values[other]
        elif values[0].size > 1:
            values[0] = np.roll(values[0].reshape(-1), 1).reshape(values[0].shape)
        return tf.convert_to_tensor(values, dtype=t.dtype)

    return tf.nest.map_structure(change, structure), other


def _moved(a: Any, b: Any) -> bool | None:
    """:func:`~dpledger.mechanisms.record_independence.rows_moved` of two arrays."""
    a = np.asarray(a)
    eps = float(np.finfo(a.dtype).eps) if np.issubdtype(a.dtype, np.floating) else None
    return verdicts.rows_moved(a, np.asarray(b), eps=eps)


def _layer_outputs(model: keras.Model) -> tuple[list[keras.layers.Layer], keras.Model] | None:
    """A model returning every top-level layer's output (functional and sequential models)."""
    try:
        layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
        outputs = [layer.output for layer in layers]
        return layers, keras.Model(model.inputs, outputs)
    except Exception:  # subclassed models, layers with several outputs: only the model is named
        return None


def probe_record_independence(
    model: keras.Model,
    *,
    engine: Any,
    inputs: Any,
    targets: Any = None,
    sample_weight: Any = None,
    max_records: int = PROBE_RECORDS,
) -> bool:
    """Check on a real batch that no record changes another record's outputs or gradient norms.

    Args:
        model: the built Keras model the engine differentiates.
        engine: its :class:`~dpledger.adapters.tensorflow.PerExampleGradientEngine`.
        inputs: the model's inputs for a batch (records along axis 0).
        targets: the loss's ``y_true`` for the batch.
        sample_weight: optional per-example weights.
        max_records: how many of the first records to use (at least 2).

    Returns:
        True when the probe ran, False when the batch has fewer than two records.

    Raises:
        RecordDependenceError: a layer's or the model's outputs, or a record's per-example
            gradient norms, moved when record 0 changed.
        RecordProbeError: the model's forward (or the loss) failed on a probe batch (the
            original exception is chained).
        InvalidParameterError: ``max_records`` < 2.
    """
    batch = _records(inputs)
    m = probe_size(batch, max_records)
    if batch is None or m is None:
        return False
    a = _cut((inputs, targets, sample_weight), batch, m)
    b, other = _changed_record_zero(a[:2], m)
    b = (b[0], b[1], a[2])  # the same weights: a record's weight is not its data
    state = [(v, v.numpy()) for v in model.variables]

    def restore() -> None:
        for v, value in state:
            v.assign(value)

    probe_model = _layer_outputs(model)
    results = []
    try:
        for run, (x, y, w) in (("original", a), ("changed", b)):
            restore()
            forward = probe_model[1] if probe_model is not None else model
            outs = verdicts.run_probe_step(
                functools.partial(forward, x, training=True), m=m, run=run, other=other
            )
            outs = [o.numpy() for o in tf.nest.flatten(outs)]
            restore()
            norms = verdicts.run_probe_step(
                functools.partial(engine.norms, x, y, sample_weight=w), m=m, run=run, other=other
            )
            results.append((outs, [n.numpy() for n in norms.squared_norms]))
    finally:
        restore()
    (outs_a, norms_a), (outs_b, norms_b) = results
    for k, (oa, ob) in enumerate(zip(outs_a, outs_b, strict=True)):
        if _moved(oa, ob):
            layer = probe_model[0][k] if probe_model is not None else model
            _refuse(layer, m, "changed its outputs for the other records")
    variables = engine.trainable_variables
    moved = [
        v.path if hasattr(v, "path") else v.name
        for v, na, nb in zip(variables, norms_a, norms_b, strict=True)
        if _moved(na, nb)
    ]
    if moved:
        _refuse(model, m, f"changed the per-example gradient norms of {moved} for other records")
    _log.debug("record-independence probe passed on %d records", m)
    return True


def record_probe_off_warning() -> str:
    """The warning logged when the probe is switched off."""
    return (
        "check_record_independence=False: the record-independence probe is off. A model whose "
        "layers mix the records of a batch lets one record move every other record's clipped "
        "gradient, and the ledger's epsilon is then wrong"
    )


def check_probe_switch(check_record_independence: Any) -> bool:
    """The ``check_record_independence`` argument of the Keras wrappers, checked.

    Logs :func:`record_probe_off_warning` when the probe is switched off.

    Raises:
        InvalidParameterError: the value is not a bool.
    """
    if not check_switch("check_record_independence", check_record_independence):
        _log.warning(record_probe_off_warning())
    return check_record_independence


def _refuse(layer: keras.layers.Layer, m: int, what: str) -> None:
    raise verdicts.refuse_mixing(
        kind="layer",
        name=layer.name,
        layer_type=type(layer).__name__,
        m=m,
        what=f"{what}.",
        advice="Compute statistics per record (LayerNormalization, GroupNormalization), never "
        "over axis 0.",
    )
