"""Per-example gradients of any differentiable Keras model with ``tf.vectorized_map``.

For records x_1..x_B the function ``i ↦ ∇_θ ℓ(f_θ(x_i), y_i)`` (a forward and a backward pass on a
batch of one) is vectorised over i by TensorFlow's ``pfor``: each op of the per-example graph is
rewritten into one op over all B records, so the cost is close to one batched forward and
backward pass plus the memory of the B per-example gradients (B × the number of parameters).

Pitfalls, and what this module does about them:

* An op without a ``pfor`` converter makes ``pfor`` run that op in a ``tf.while_loop``, one
  record at a time (``fallback_to_while_loop``), which is correct but slow. So do converters that
  give up internally: TensorFlow 2.21's converter for ``Conv2DBackpropFilter`` (the kernel
  gradient of every ``Conv2D``) uses a while loop whenever the layer input depends on the record
  — always, for per-example gradients. :func:`per_example_map` replaces that converter, while it
  traces, by a vectorised one (one grouped convolution op for all records), and reports every
  while loop left in the graph so the engine can log it.
* The converter for ``MaxPoolGrad`` emits a bare gradient op that oneDNN builds of TensorFlow
  cannot pair with its forward pooling, so it runs a slow generic kernel (90× slower on the
  benchmark CNN); this module's converter keeps the fast kernel.
* TensorFlow 2.21's oneDNN ``BatchMatMulV2`` crashes the process for some rank-4 × rank-2
  products with a size-1 axis, exactly what ``pfor`` makes of an ``EinsumDense`` projection
  (``keras.layers.MultiHeadAttention``); this module computes record-dependent × fixed-matrix
  products as one flattened 2-D matmul instead.
* ``pfor`` cannot vectorise every graph: gradients through ``tf.cond`` fail (it cannot stack
  their variant-typed intermediates). The map then runs every record in a ``tf.map_fn`` loop —
  correct, slow, and reported like the while loops above.
* ``pfor`` vectorises one graph: eager callers get a ``tf.function`` traced for them.
* ``pfor`` converts the ``tf.while_loop`` of a Keras recurrent layer (``keras.layers.RNN`` and
  its subclasses) into a graph that fails when it runs (``TensorListPushBack``: "incompatible
  shape"), too late for the fallback above. The engine asks for the loop directly
  (``in_loop=True``) when the model has a recurrent layer; LSTM, GRU and SimpleRNN normally
  take the fast path instead (:mod:`~dpledger.adapters.tensorflow.recurrent_rules`).
* Random ops (``Dropout``) inside the loop body draw the same mask for every record (the seed is
  loop invariant). That is still independent of the data, so privacy is unaffected.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from dpledger.adapters.tensorflow.conv_gradients import per_example_conv2d_kernel_gradients

__all__ = ["per_example_map"]

_log = logging.getLogger(__name__)

_WHILE_OPS = frozenset({"While", "StatelessWhile"})


def _pfor_module() -> Any | None:
    try:
        from tensorflow.python.ops.parallel_for import pfor
    except ImportError:  # pragma: no cover - a TensorFlow without pfor internals
        return None
    if not isinstance(getattr(pfor, "_pfor_converter_registry", None), dict):
        return None  # pragma: no cover
    return pfor


def _conv2d_backprop_filter_converter(pfor: Any, original: Callable[[Any], Any]) -> Callable:
    """A ``pfor`` converter for ``Conv2DBackpropFilter`` with a record-dependent input.

    In the per-example map every record is a batch of one, so the L records' kernel gradients
    are the per-example kernel gradients of an L-record batch: one grouped convolution op
    (:func:`~dpledger.adapters.tensorflow.conv_gradients.per_example_conv2d_kernel_gradients`).
    Other cases (loop-invariant input, an inner batch > 1, NCHW, explicit padding, unknown
    shapes) go to TensorFlow's own converter.
    """

    def convert(pfor_input: Any) -> Any:
        filter_sizes = tf.get_static_value(pfor_input.unstacked_input(1))
        _, inputs_stacked, _ = pfor_input.input(0)
        padding = pfor_input.get_attr("padding")
        if (
            filter_sizes is None
            or not inputs_stacked
            or pfor_input.get_attr("data_format") != b"NHWC"
            or padding not in (b"SAME", b"VALID")
        ):
            return original(pfor_input)
        pfor_input.stack_inputs(stack_indices=[0, 2])
        inputs = pfor_input.stacked_input(0)  # (L, 1, H, W, C)
        grads = pfor_input.stacked_input(2)  # (L, 1, H', W', F)
        if inputs.shape[1] != 1 or grads.shape[1] != 1 or not inputs.shape[2:].is_fully_defined():
            return original(pfor_input)
        if not grads.shape[2:].is_fully_defined():
            return original(pfor_input)
        per_example = per_example_conv2d_kernel_gradients(
            tf.squeeze(inputs, 1),
            tf.squeeze(grads, 1),
            kernel_shape=[int(d) for d in filter_sizes],
            strides=list(pfor_input.get_attr("strides"))[1:3],
            dilation_rate=list(pfor_input.get_attr("dilations"))[1:3],
            padding=padding.decode(),
        )
        return pfor.wrap(per_example, True)

    return convert


def _max_pool_grad_converter(pfor: Any, original: Callable[[Any], Any]) -> Callable:
    """A ``pfor`` converter for ``MaxPoolGrad`` that keeps oneDNN's fast kernel.

    TensorFlow's converter flattens the records into the batch and emits a bare ``MaxPoolGrad``.
    On CPU builds with oneDNN, a ``MaxPoolGrad`` is only rewritten to the oneDNN kernel when it
    is paired with its forward ``MaxPool``; the bare op runs Eigen's kernel, measured 90×
    slower. This converter flattens the same way and takes the gradient of a recomputed
    ``max_pool`` instead, which gives the paired ops (the recomputation is one cheap pooling).
    """

    def convert(pfor_input: Any) -> Any:
        data_format = pfor_input.get_attr("data_format")
        padding = pfor_input.get_attr("padding")
        if data_format != b"NHWC" or padding not in (b"SAME", b"VALID"):
            return original(pfor_input)
        pfor_input.stack_inputs(stack_indices=[0, 2])
        x = pfor_input.stacked_input(0)  # (L, b, H, W, C)
        grad = pfor_input.stacked_input(2)
        if not x.shape[2:].is_fully_defined() or not grad.shape[2:].is_fully_defined():
            return original(pfor_input)
        loop_len = tf.shape(x)[0]
        flat_x = tf.reshape(x, tf.concat([[-1], tf.shape(x)[2:]], axis=0))
        flat_grad = tf.reshape(grad, tf.concat([[-1], tf.shape(grad)[2:]], axis=0))
        with tf.GradientTape() as tape:
            tape.watch(flat_x)
            pooled = tf.nn.max_pool2d(
                flat_x,
                ksize=list(pfor_input.get_attr("ksize"))[1:3],
                strides=list(pfor_input.get_attr("strides"))[1:3],
                padding=padding.decode(),
            )
        result = tape.gradient(pooled, flat_x, output_gradients=flat_grad)
        result = tf.reshape(result, tf.concat([[loop_len], tf.shape(x)[1:]], axis=0))
        return pfor.wrap(result, True)

    return convert


def _batch_matmul_converter(pfor: Any, original: Callable[[Any], Any]) -> Callable:
    """A ``pfor`` converter for ``BatchMatMulV2`` of a record-dependent x and a fixed matrix.

    ``x @ W`` with x of shape (…, m, k) and a loop-invariant 2-D W (a Dense or EinsumDense
    kernel) is computed as one 2-D matmul of the flattened x. TensorFlow's converter emits a
    ``BatchMatMulV2`` of a rank-4 x with a size-1 axis (records, 1, m, k), which crashes the
    process (segmentation fault) in TensorFlow 2.21's oneDNN kernel on this benchmark's CPU
    (``keras.layers.MultiHeadAttention`` under ``tf.vectorized_map`` hits it).
    """

    def convert(pfor_input: Any) -> Any:
        x, x_stacked, _ = pfor_input.input(0)
        y, y_stacked, _ = pfor_input.input(1)
        if (
            not x_stacked
            or y_stacked
            or y.shape.rank != 2
            or pfor_input.get_attr("adj_x")
            or x.shape.rank is None
            or x.shape[-1] is None
        ):
            return original(pfor_input)
        adj_y = pfor_input.get_attr("adj_y")
        flat = tf.reshape(x, [-1, x.shape[-1]])
        product = tf.matmul(flat, y, transpose_b=adj_y)
        out_dim = tf.shape(y)[0] if adj_y else tf.shape(y)[1]
        shape = tf.concat([tf.shape(x)[:-1], [out_dim]], axis=0)
        return pfor.wrap(tf.reshape(product, shape), True)

    return convert


_CONVERTERS: dict[str, Callable[[Any, Callable[[Any], Any]], Callable]] = {
    "BatchMatMulV2": _batch_matmul_converter,
    "Conv2DBackpropFilter": _conv2d_backprop_filter_converter,
    "MaxPoolGrad": _max_pool_grad_converter,
}


@contextlib.contextmanager
def _faster_converters() -> Iterator[None]:
    """Install this module's ``pfor`` converters while a map traces, then restore TF's."""
    pfor = _pfor_module()
    if pfor is None:  # pragma: no cover - a TensorFlow without pfor internals
        yield
        return
    registry = pfor._pfor_converter_registry
    originals = {name: registry.get(name) for name in _CONVERTERS}
    for name, make in _CONVERTERS.items():
        if originals[name] is not None:
            registry[name] = make(pfor, originals[name])
    try:
        yield
    finally:
        for name, original in originals.items():
            if original is not None:
                registry[name] = original


class _WhileLoopMessages(logging.Handler):
    """Collects TensorFlow's warnings about ops that ``pfor`` runs in a while loop."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "while_loop" in message:
            self.messages.append(message.splitlines()[0])


def per_example_map(
    fn: Callable[[Any], Any],
    elems: Any,
    *,
    fallback_to_while_loop: bool = True,
    in_loop: str | None = None,
) -> tuple[Any, list[str]]:
    """``tf.vectorized_map(fn, elems)`` with vectorised conv kernel gradients, in a graph.

    Args:
        fn: the per-record function (receives one record's slice of ``elems``).
        elems: a nested structure of tensors whose leading axis is the records.
        fallback_to_while_loop: passed to ``tf.vectorized_map``; with False an op without a
            converter raises instead of running in a loop.
        in_loop: a reason to skip ``tf.vectorized_map`` and run every record in a
            ``tf.map_fn`` loop (reported like a fallback), or None.

    Returns:
        ``(outputs, while_loops)``: the stacked outputs, and a description of every
        ``tf.while_loop`` ``pfor`` had to put in the graph (empty when fully vectorised).
        Called eagerly, the map runs in a freshly traced ``tf.function`` (for tests and
        debugging; call it inside your own ``tf.function`` for speed).
    """
    if tf.executing_eagerly():
        found: list[str] = []

        @tf.autograph.experimental.do_not_convert
        def traced(e: Any) -> Any:
            out, loops = per_example_map(
                fn, e, fallback_to_while_loop=fallback_to_while_loop, in_loop=in_loop
            )
            found.extend(loops)
            return out

        outputs = tf.function(traced)(elems)
        return outputs, found
    if in_loop is not None:
        return _map_in_loop(fn, elems), [f"every record runs in a tf.map_fn loop: {in_loop}"]
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    handler = _WhileLoopMessages()
    tf_logger = logging.getLogger("tensorflow")
    tf_logger.addHandler(handler)
    failure = None
    try:
        with _faster_converters():
            outputs = tf.vectorized_map(fn, elems, fallback_to_while_loop=fallback_to_while_loop)
    except (ValueError, TypeError, NotImplementedError, tf.errors.OpError) as exc:
        if not fallback_to_while_loop:
            raise
        failure = exc
    finally:
        tf_logger.removeHandler(handler)
    if failure is not None:
        # pfor cannot vectorise some graphs at all (e.g. gradients through tf.cond, whose
        # variant-typed intermediates it cannot stack): run every record in a loop instead.
        message = str(failure).strip().splitlines()
        outputs = _map_in_loop(fn, elems)
        return outputs, [
            "tf.vectorized_map failed ("
            + type(failure).__name__
            + (f": {message[-1]}" if message else "")
            + "), so every record runs in a tf.map_fn loop"
        ]
    loops = sorted({op.name for op in graph.get_operations()[before:] if op.type in _WHILE_OPS})
    described = list(dict.fromkeys(handler.messages))
    if loops and not described:
        described = [f"while loop(s) in the vectorised graph: {', '.join(loops)}"]
    return outputs, described


def _map_in_loop(fn: Callable[[Any], Any], elems: Any) -> Any:
    """``tf.map_fn`` over the records, with the output signature traced from one record."""
    element_spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), elems)
    concrete = tf.function(fn, autograph=False).get_concrete_function(element_spec)
    signature = tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype), concrete.structured_outputs
    )
    return tf.map_fn(fn, elems, fn_output_signature=signature)
