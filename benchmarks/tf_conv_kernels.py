"""Time ways to compute per-example kernel gradients of the benchmark CNN's first convolution.

The TensorFlow fast path materialises the per-example kernel gradients of a convolution whose
ghost norm would cost more (``conv_gradients.per_example_conv2d_kernel_gradients``). On the
digits CNN of ``benchmarks/tf_step_bench.py`` (``cnn``) that is the first convolution: 28×28×1
input, 8×8 kernel, stride 2, "same" padding, 16 filters, batch 256, so T = 196 output pixels,
K = 64 patch entries, F = 16 filters; per record A_bᵀ G_b is a (64 × 196)·(196 × 16) product,
51 million multiply-adds for the batch. This script times the engine's method against the
alternatives, each as one ``tf.function`` on the same tensors whose result is reduced to the
per-example squared norms (B,), so that copying a large result out does not count:

* ``engine``: what the engine runs (``conv_gradients.per_example_conv2d_kernel_gradients``:
  the input cut into 2×2 blocks, one grouped ``Conv2DBackpropFilter`` at stride 1 on a 4×4 kernel
  with 4 input channels per group, the batch folded into the channels);
* ``grouped, stride 2``: the grouped op on the input as it is (stride 2, 8×8 kernel, 1 channel
  per group; the engine's method before the blocks);
* ``grouped, 8 chunks``: the stride-2 grouped op on 8 slices of the batch;
* ``depthwise``: ``DepthwiseConv2dNativeBackpropFilter`` with the batch as channels;
* ``grouped NCHW``: the stride-2 grouped op in channels-first layout (the input needs no
  transpose);
* ``patches``: ``tf.image.extract_patches`` and a batched matmul (the engine's method where
  patches repeat each pixel at most 4 times; here they repeat it 16 times);
* ``identity-kernel patches``: the patch matrices from a convolution with an identity kernel,
  then the batched matmul;
* ``block slices``: the 2×2 blocks, 4 column-shifted and 4 row-shifted slices of them as the
  patch matrices, then the batched matmul.

Reference rows (not per-example gradients): ``batch kernel gradient`` is the ordinary
``Conv2DBackpropFilter`` of the non-private step; ``transpose of G`` (moving the batch of the
(B, 14, 14, 16) output gradients next to the channels, then one reduction of the result) and
``one pass over G`` (one reduction) are what moving that tensor costs on this machine; ``empty
call`` is the cost of calling a ``tf.function`` at all (subtract it from every row).

Run: ``PYTHONPATH=. python benchmarks/tf_conv_kernels.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from dpledger.adapters.tensorflow import conv_gradients

KERNEL = (8, 8, 1, 16)
STRIDES = (2, 2)
SIZE = 28
OUT = 14
PAD = 3  # "same" padding of an 8×8 kernel at stride 2 on 28×28: 3 on each side


def _norms(per_example: tf.Tensor) -> tf.Tensor:
    batch = tf.shape(per_example)[0]
    return tf.reduce_sum(tf.square(tf.reshape(per_example, [batch, -1])), axis=1)


def _blocks(x: tf.Tensor) -> tf.Tensor:
    """(B, 17, 17, 4): the padded input cut into 2×2 blocks."""
    return tf.nn.space_to_depth(tf.pad(x, [[0, 0], [PAD, PAD], [PAD, PAD], [0, 0]]), 2)


def methods(batch: int) -> dict[str, Callable[[tf.Tensor, tf.Tensor], tf.Tensor]]:
    """name → f(x, g) returning per-example squared norms of the kernel gradients (B,)."""
    kh, kw, cin, cout = KERNEL
    args = (KERNEL, STRIDES, (1, 1), "same")

    def engine(x, g):
        return _norms(
            conv_gradients.per_example_conv2d_kernel_gradients(
                x, g, kernel_shape=KERNEL, strides=STRIDES, dilation_rate=(1, 1), padding="same"
            )
        )

    def grouped(x, g):
        return _norms(conv_gradients._grouped(x, g, *args))

    def grouped_chunks(x, g):
        size = batch // 8
        parts = [grouped(x[i : i + size], g[i : i + size]) for i in range(0, batch, size)]
        return tf.concat(parts, 0)

    def depthwise(x, g):
        xi = tf.reshape(tf.transpose(x, [3, 1, 2, 0]), [1, SIZE, SIZE, batch])
        gi = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, OUT, OUT, batch * cout])
        r = tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
            input=xi,
            filter_sizes=[kh, kw, batch, cout],
            out_backprop=gi,
            strides=[1, *STRIDES, 1],
            padding="SAME",
            data_format="NHWC",
        )
        return tf.reduce_sum(tf.square(r), [0, 1, 3])

    def grouped_nchw(x, g):
        xi = tf.reshape(x, [1, batch, SIZE, SIZE])
        gi = tf.reshape(tf.transpose(g, [0, 3, 1, 2]), [1, batch * cout, OUT, OUT])
        r = tf.raw_ops.Conv2DBackpropFilter(
            input=xi,
            filter_sizes=[kh, kw, cin, batch * cout],
            out_backprop=gi,
            strides=[1, 1, *STRIDES],
            padding="SAME",
            data_format="NCHW",
        )
        return tf.reduce_sum(tf.square(tf.reshape(r, [kh * kw, batch, cout])), [0, 2])

    def patches(x, g):
        return _norms(conv_gradients._patches(x, g, *args))

    eye = tf.constant(np.eye(kh * kw, dtype=np.float32).reshape(kh, kw, 1, kh * kw))

    def identity_kernel(x, g):
        a = tf.reshape(tf.nn.conv2d(x, eye, STRIDES, "SAME"), [batch, OUT * OUT, kh * kw])
        return _norms(tf.matmul(a, tf.reshape(g, [batch, OUT * OUT, cout]), transpose_a=True))

    def block_slices(x, g):
        y = _blocks(x)
        cols = tf.concat([y[:, :, b : b + OUT, :] for b in range(4)], axis=-1)
        flat = tf.reshape(cols, [batch, 17 * OUT, 16])
        a = tf.concat([flat[:, OUT * r : OUT * r + OUT * OUT, :] for r in range(4)], axis=-1)
        return _norms(tf.matmul(a, tf.reshape(g, [batch, OUT * OUT, cout]), transpose_a=True))

    return {
        "engine": engine,
        "grouped, stride 2": grouped,
        "grouped, 8 chunks": grouped_chunks,
        "depthwise": depthwise,
        "grouped NCHW": grouped_nchw,
        "patches": patches,
        "identity-kernel patches": identity_kernel,
        "block slices": block_slices,
    }


def references(batch: int) -> dict[str, Callable[[tf.Tensor, tf.Tensor], tf.Tensor]]:
    """Rows that are not per-example gradients: what the pieces cost on this machine."""

    def batch_kernel_gradient(x, g):
        r = tf.raw_ops.Conv2DBackpropFilter(
            input=x,
            filter_sizes=list(KERNEL),
            out_backprop=g,
            strides=[1, *STRIDES, 1],
            padding="SAME",
            data_format="NHWC",
        )
        return tf.reduce_sum(r)

    def transpose_g(x, g):
        return tf.reduce_sum(tf.transpose(g, [1, 2, 0, 3]), [0, 1, 3])

    def one_pass(x, g):
        return tf.reduce_sum(g, [1, 2, 3])

    def empty(x, g):
        return g[0, 0, 0, :1]

    return {
        "batch kernel gradient": batch_kernel_gradient,
        "transpose of G": transpose_g,
        "one pass over G": one_pass,
        "empty call": empty,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    if args.batch % 8:
        parser.error("--batch must be a multiple of 8 (the chunked method splits it in 8)")
    print(
        f"python {platform.python_version()}, tensorflow {tf.__version__}, "
        f"{os.cpu_count()} CPUs, batch {args.batch}, {args.repeats} interleaved repeats"
    )
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(args.batch, SIZE, SIZE, 1)).astype(np.float32))
    g = tf.constant(rng.normal(size=(args.batch, OUT, OUT, KERNEL[3])).astype(np.float32))
    compiled = {
        k: tf.function(f, autograph=False)
        for k, f in {**methods(args.batch), **references(args.batch)}.items()
    }
    want = compiled["engine"](x, g).numpy()
    for name in methods(args.batch):
        got = compiled[name](x, g).numpy()
        error = float(np.max(np.abs(got - want) / want))
        if error > 1e-4:
            raise SystemExit(f"{name}: per-example norms differ by {error:.2e} (relative)")
    wall: dict[str, list[float]] = {k: [] for k in compiled}
    cpu: dict[str, list[float]] = {k: [] for k in compiled}
    for f in compiled.values():
        for _ in range(3):
            f(x, g).numpy()
    for _ in range(args.repeats):
        for k, f in compiled.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f(x, g).numpy()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    med = {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in compiled}
    base = med["engine"]
    print(f"\n{'method':32s} {'wall ms':>8s} {'x engine':>10s} {'CPU ms':>8s} {'x engine':>10s}")
    for k, (w, c) in med.items():
        if k == "batch kernel gradient":
            print("-- references (not per-example gradients)")
        print(f"{k:32s} {w * 1e3:8.3f} {w / base[0]:10.2f} {c * 1e3:8.3f} {c / base[1]:10.2f}")


if __name__ == "__main__":
    main()
