"""The function :class:`~dpledger.adapters.tensorflow.DPKerasModel`'s ``fit`` and
``train_on_batch`` call per execution: up to ``steps_per_execution`` DP steps.

Each step is one call of a compiled ``tf.function`` (retraced only for new batch signatures)
that runs the DP step of :mod:`~dpledger.adapters.tensorflow.dp_step` under the model's
distribution strategy: every replica clips its own records, the clipped sums (and, with a bias
callback, the unclipped sums and norms) are summed over the replicas, the release adds one noise
draw of the full variance and records the step, and the optimizer applies the privatised
gradients once. The ledger is written when the step executes, never when it is traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.dp_step import KerasDPStep

__all__ = ["dp_train_function", "replica_logs"]


def replica_logs(
    model: keras.Model, x: Any, y: Any, sample_weight: Any, out: dict[str, Any]
) -> Any:
    """The logs of one replica's part of a step: the mean per-example loss (0 for an empty
    batch) and the compiled metrics, from the training data (NOT private)."""
    losses = out["losses"]
    count = tf.cast(tf.shape(losses)[0], losses.dtype)
    mean = tf.math.divide_no_nan(tf.reduce_sum(losses), count)
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is not None:
        tracker.update_state(mean, sample_weight=count)
    return model.compute_metrics(x, y, out["predictions"], sample_weight=sample_weight)


def dp_train_function(
    model: keras.Model, step: KerasDPStep, position_of: Callable[[Any], tf.Tensor]
) -> Callable[[Any], Any]:
    """The train function of ``model`` (a compiled DPKerasModel) for its DP ``step``.

    Args:
        model: the DPKerasModel (its optimizer, distribution strategy, metrics and
            ``steps_per_execution``).
        step: the DP step (engine, queries, events, ledger, noise generator).
        position_of: the position in its epoch of the next step drawn from an iterator.

    Returns:
        ``train_function(iterator)``: runs up to ``steps_per_execution`` steps and returns the
        last step's logs; raises ``StopIteration`` when the iterator is exhausted at once.
    """
    strategy = model.distribute_strategy
    with strategy.scope():
        if not model.optimizer.built:
            model.optimizer.build(list(step.variables))
    bias = step.bias_callback is not None

    def replica(data: Any) -> tuple[dict[str, Any], Any]:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        out = step.clip_replica(x, y, sample_weight)
        logs = replica_logs(model, x, y, sample_weight, out)
        kept = {k: v for k, v in out.items() if k not in ("losses", "predictions")}
        return kept, logs

    def sum_over_replicas(value: Any) -> Any:
        return strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)

    @tf.autograph.experimental.do_not_convert
    def one_step(data: Any, position: tf.Tensor) -> Any:
        out, logs = strategy.run(replica, args=(data,))
        sums = [sum_over_replicas(s) for s in out["sums"]]
        count = sum_over_replicas(out["num_records"])
        extras: dict[str, Any] = {}
        if bias:
            extras["unclipped"] = [sum_over_replicas(s) for s in out["unclipped"]]
            extras["norms"] = tf.concat(strategy.experimental_local_results(out["norms"]), 0)
            extras["num_clipped"] = sum_over_replicas(out["num_clipped"])
        grads = step.release(sums, count, position=position, **extras)
        model.optimizer.apply(grads, list(step.variables))
        return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], logs)

    compiled = tf.function(one_step, autograph=False, reduce_retracing=True)

    def train_function(iterator: Any) -> Any:
        logs = None
        for _ in range(model.steps_per_execution):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if logs is None:
                    raise StopIteration from None
                break
            try:
                logs = compiled(data, position_of(iterator))
            except tf.errors.OpError as exc:
                step.reraise(exc)
        return logs

    return train_function
