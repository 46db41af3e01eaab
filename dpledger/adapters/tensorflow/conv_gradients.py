"""Per-example kernel gradients of a 2-D convolution.

For record b with input x_b and output gradient G_b, the kernel gradient is
Σ_t a_{b,t}ᵀ G_{b,t} over the output pixels t, with a_{b,t} ∈ R^{k_h·k_w·C} the input patch at t
(flattened in (i, j, c) order, the layout of a (k_h, k_w, C, F) kernel).

Three implementations, all exact:

* **grouped** — folding the batch into the channel axis turns the B per-record products into
  one *grouped* convolution with B groups, so a single ``Conv2DBackpropFilter`` (TensorFlow's own
  kernel, with strides, dilation and padding as in the forward convolution) computes all of them.
* **grouped over blocks** — the same with the input first cut into s_h × s_w blocks (when the
  kernel size is a multiple of a stride > 1 and there is no dilation, see :func:`patch_gram`): the
  convolution becomes a stride-1 one with a (k_h/s_h) × (k_w/s_w) kernel over s_h·s_w·C
  channels, which oneDNN runs faster: on the benchmark CNN's first convolution (28×28×1 input,
  8×8 kernel, stride 2) the strided grouped op took 1.12–1.15× as long
  (benchmarks/tf_conv_kernels.py, benchmarks/RESULTS.md).
* **patches** — ``tf.image.extract_patches`` and one batched matmul A_bᵀ G_b. Used where grouped
  convolutions are not available (TensorFlow's CPU kernels support them only through oneDNN and
  only for some dtypes; float64 is refused, for instance), and where the patch matrices repeat
  each input pixel at most ``MAX_PATCH_EXPANSION`` = 4 times (T·k_h·k_w ≤ 4·H·W): there the
  grouped op, with many input channels per group, was the slower one. On the benchmark CNN's
  second convolution (13×13×16 input, 4×4 kernel, stride 2: expansion 2.4) the patches made the
  vectorised DP step 2.18–2.19× the non-private step against 2.36× with the grouped op; its
  first convolution (expansion 16) takes a grouped op.

Whether grouped convolutions work for a dtype is probed once, eagerly, on the default device,
with a two-record problem whose answer is checked against the patch implementation.

For the ghost norm, :func:`patch_gram` gives each record's Gram matrix of input patches
A_b A_bᵀ (T × T) without building the patches when the kernel size is a multiple of the stride
(no dilation): with the input cut into s_h × s_w blocks, y_b(u) ∈ R^{s_h·s_w·C} the block at
block position u, a patch at output pixel t is the concatenation of the (k_h/s_h)·(k_w/s_w)
blocks y_b(t + o) for the block offsets o, so

    (A_b A_bᵀ)_{t,t'} = Σ_o ⟨y_b(t + o), y_b(t' + o)⟩ = Σ_o (Y_b Y_bᵀ)_{t+o, t'+o},

one Gram matrix of the blocks (U × U with U ≈ T, inner size s_h·s_w·C instead of k_h·k_w·C) and
a sum of shifted windows of it. The blocks are a reshape and one transpose of the (padded,
cropped) input, where ``tf.image.extract_patches`` copies every pixel k_h·k_w/(s_h·s_w) times
with a generic kernel; on the benchmark CNN's second convolution this made the whole fast-path
step cheaper (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = [
    "MAX_PATCH_EXPANSION",
    "grouped_convolution_supported",
    "kernel_gradient_method",
    "patch_expansion",
    "patch_gram",
    "patch_gram_supported",
    "per_example_conv2d_kernel_gradients",
]

MAX_PATCH_EXPANSION = 4.0
_Ints = Sequence[int]  # a kernel shape (k_h, k_w, C, F), strides or dilations (h, w)
_probe_lock = threading.Lock()
_probed: dict[str, bool] = {}


def _sizes(x: tf.Tensor, kernel_shape: _Ints) -> tuple[int, int, int, int, tf.Tensor]:
    """k_h, k_w, C, F of the kernel and B, the (dynamic) batch size."""
    kh, kw, cin, cout = (int(d) for d in kernel_shape)
    return kh, kw, cin, cout, tf.shape(x)[0]


def _grouped_filter_gradient(
    inputs: tf.Tensor, filter_sizes: tf.Tensor, g: tf.Tensor, *, strides: _Ints, **conv: Any
) -> tf.Tensor:
    """``Conv2DBackpropFilter`` of ``inputs`` (the records folded into the channels) against
    the output gradients ``g`` folded the same way: the B per-example gradients as groups."""
    return tf.raw_ops.Conv2DBackpropFilter(
        input=inputs,
        filter_sizes=filter_sizes,
        out_backprop=_grouped_output_gradients(g),
        strides=[1, *strides, 1],
        data_format="NHWC",
        **conv,
    )


def _grouped(
    x: tf.Tensor, g: tf.Tensor, kernel_shape: _Ints, strides: _Ints, dilation: _Ints, padding: str
) -> tf.Tensor:
    """(B, k_h, k_w, C, F): one grouped ``Conv2DBackpropFilter`` with B groups."""
    kh, kw, cin, cout, batch = _sizes(x, kernel_shape)
    h, w = x.shape[1], x.shape[2]
    xi = tf.reshape(tf.transpose(x, [1, 2, 0, 3]), [1, h, w, batch * cin])
    grads = _grouped_filter_gradient(
        xi,
        tf.stack([kh, kw, cin, batch * cout]),
        g,
        strides=strides,
        padding=padding.upper(),
        dilations=[1, *dilation, 1],
    )
    return tf.transpose(tf.reshape(grads, [kh, kw, cin, batch, cout]), [3, 0, 1, 2, 4])


def _grouped_output_gradients(g: tf.Tensor) -> tf.Tensor:
    """(1, H_o, W_o, B·F): the output gradients with the batch folded into the channels."""
    ho, wo, cout = g.shape[1], g.shape[2], g.shape[3]
    return tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, ho, wo, tf.shape(g)[0] * cout])


def _grouped_blocks(
    x: tf.Tensor, g: tf.Tensor, kernel_shape: _Ints, strides: _Ints, padding: str
) -> tf.Tensor:
    """(B, k_h, k_w, C, F): the grouped op at stride 1 over input blocks.

    The op's kernel entry (a, b, (i, j, c)) is block offset (a, b), position (i, j) in the block
    and channel c, i.e. entry (a·s_h + i, b·s_w + j, c) of the convolution's kernel.
    """
    kh, kw, cin, cout, batch = _sizes(x, kernel_shape)
    sh, sw = (int(v) for v in strides)
    y = _blocks(
        x, kernel_size=(kh, kw), strides=(sh, sw), padding=padding, output_size=g.shape[1:3]
    )
    bh, bw = y.shape[1], y.shape[3]
    # (B, bh, s_h, bw, s_w, C) → (bh, bw, B, s_h, s_w, C): block grid outside, records as groups
    yi = tf.reshape(tf.transpose(y, [1, 3, 0, 2, 4, 5]), [1, bh, bw, batch * sh * sw * cin])
    grads = _grouped_filter_gradient(
        yi,
        tf.stack([kh // sh, kw // sw, sh * sw * cin, batch * cout]),
        g,
        strides=(1, 1),
        padding="VALID",
        dilations=[1, 1, 1, 1],
    )
    grads = tf.reshape(grads, [kh // sh, kw // sw, sh, sw, cin, batch, cout])
    # (a, b, i, j, C, B, F) → (B, a, i, b, j, C, F) = (B, k_h, k_w, C, F)
    return tf.reshape(tf.transpose(grads, [5, 0, 2, 1, 3, 4, 6]), [batch, kh, kw, cin, cout])


def _patches(
    x: tf.Tensor, g: tf.Tensor, kernel_shape: _Ints, strides: _Ints, dilation: _Ints, padding: str
) -> tf.Tensor:
    """(B, k_h, k_w, C, F): the per-example products of the patch matrices and the output
    gradients."""
    kh, kw, cin, cout, batch = _sizes(x, kernel_shape)
    patches = tf.image.extract_patches(
        x,
        sizes=[1, kh, kw, 1],
        strides=[1, *strides, 1],
        rates=[1, *dilation, 1],
        padding=padding.upper(),
    )
    positions = g.shape[1] * g.shape[2]
    a = tf.reshape(patches, [batch, positions, kh * kw * cin])
    b = tf.reshape(g, [batch, positions, cout])
    return tf.reshape(tf.matmul(a, b, transpose_a=True), [batch, kh, kw, cin, cout])


def grouped_convolution_supported(dtype: tf.DType) -> bool:
    """Whether grouped ``Conv2DBackpropFilter`` gives correct results for ``dtype`` here.

    Probed once per dtype, eagerly (outside any ``tf.function`` being traced), on the default
    device.
    """
    key = tf.as_dtype(dtype).name
    with _probe_lock:
        if key in _probed:
            return _probed[key]
        with tf.init_scope():
            rng = np.random.default_rng(0)
            x = tf.constant(rng.normal(size=(2, 4, 4, 2)), dtype)
            g = tf.constant(rng.normal(size=(2, 3, 3, 3)), dtype)
            args = ((2, 2, 2, 3), (1, 1), (1, 1), "valid")
            try:
                got = _grouped(x, g, *args).numpy()
                want = _patches(x, g, *args).numpy()
                ok = bool(np.allclose(got, want, rtol=1e-3, atol=1e-3))
            except (tf.errors.OpError, ValueError, TypeError):
                ok = False
        _probed[key] = ok
        return ok


def kernel_gradient_method(
    x: tf.Tensor, g: tf.Tensor, *, kernel_shape: _Ints, strides: _Ints, dilation_rate: _Ints
) -> str:
    """Which implementation :func:`per_example_conv2d_kernel_gradients` uses here:
    ``"patches"``, ``"grouped_blocks"`` or ``"grouped"`` (see the module docstring)."""
    if patch_expansion(x, g, kernel_shape) <= MAX_PATCH_EXPANSION or not (
        grouped_convolution_supported(x.dtype)
    ):
        return "patches"
    strided = any(int(v) > 1 for v in strides)
    if strided and patch_gram_supported(kernel_shape[:2], strides, dilation_rate):
        return "grouped_blocks"
    return "grouped"  # at stride 1 the blocks would be single pixels: nothing to gain


def per_example_conv2d_kernel_gradients(
    x: tf.Tensor,
    g: tf.Tensor,
    *,
    kernel_shape: Sequence[int],
    strides: Sequence[int],
    dilation_rate: Sequence[int],
    padding: str,
) -> tf.Tensor:
    """Per-example kernel gradients (B, k_h, k_w, C, F) of a conv2d.

    Args:
        x: the convolution's input, NHWC, static H, W and C.
        g: the gradient of the summed loss with respect to its output, NHWC, static sizes.
        kernel_shape: (k_h, k_w, C, F).
        strides: (s_h, s_w).
        dilation_rate: (d_h, d_w).
        padding: ``"same"`` or ``"valid"`` (any case).

    Returns:
        The gradient of record b's loss with respect to the kernel, for every b.
    """
    method = kernel_gradient_method(
        x, g, kernel_shape=kernel_shape, strides=strides, dilation_rate=dilation_rate
    )
    if method == "patches":
        return _patches(x, g, kernel_shape, strides, dilation_rate, padding)
    if method == "grouped_blocks":
        return _grouped_blocks(x, g, kernel_shape, strides, padding)
    return _grouped(x, g, kernel_shape, strides, dilation_rate, padding)


def patch_expansion(x: tf.Tensor, g: tf.Tensor, kernel_shape: Sequence[int]) -> float:
    """T·k_h·k_w / (H·W): how many times the patch matrices repeat each input pixel."""
    kh, kw = int(kernel_shape[0]), int(kernel_shape[1])
    return (g.shape[1] * g.shape[2] * kh * kw) / (x.shape[1] * x.shape[2])


def patch_gram_supported(
    kernel_size: Sequence[int], strides: Sequence[int], dilation_rate: Sequence[int]
) -> bool:
    """Whether :func:`patch_gram` applies: no dilation and each kernel size a multiple of its
    stride."""
    return all(int(d) == 1 for d in dilation_rate) and all(
        int(k) % int(s) == 0 for k, s in zip(kernel_size, strides, strict=True)
    )


def _same_padding(size: int, out: int, k: int, s: int) -> tuple[int, int]:
    total = max((out - 1) * s + k - size, 0)
    return total // 2, total - total // 2


def _blocks(
    x: tf.Tensor, *, kernel_size: _Ints, strides: _Ints, padding: str, output_size: _Ints
) -> tf.Tensor:
    """The padded input cut into s_h × s_w blocks: (B, b_h, s_h, b_w, s_w, C).

    Exactly the b_h·s_h × b_w·s_w pixels the patches read (kernel sizes multiples of the
    strides): output pixel t starts at block t and spans k/s blocks, so b = H_o − 1 + k/s.
    """
    (kh, kw), (sh, sw), (ho, wo) = (
        tuple(int(v) for v in kernel_size),
        tuple(int(v) for v in strides),
        tuple(int(v) for v in output_size),
    )
    h, w, c = (int(d) for d in x.shape[1:])
    bh, bw = ho - 1 + kh // sh, wo - 1 + kw // sw
    if padding.lower() == "same":
        top, bottom = _same_padding(h, ho, kh, sh)
        left, right = _same_padding(w, wo, kw, sw)
    else:
        top = bottom = left = right = 0
    # Pad as the convolution does (then h + top + bottom ≥ bh·sh, and likewise for VALID), and
    # keep exactly the bh·sh × bw·sw pixels the patches read.
    if top or bottom or left or right:
        x = tf.pad(x, [[0, 0], [top, bottom], [left, right], [0, 0]])
    x = x[:, : bh * sh, : bw * sw, :]
    return tf.reshape(x, [tf.shape(x)[0], bh, sh, bw, sw, c])


def patch_gram(
    x: tf.Tensor,
    *,
    kernel_size: Sequence[int],
    strides: Sequence[int],
    padding: str,
    output_size: Sequence[int],
) -> tf.Tensor:
    """Per-record Gram matrices A_b A_bᵀ of a conv2d's input patches, shape (B, T, T).

    A_b ∈ R^{T × k_h·k_w·C} holds record b's input patch at each of the T = H_o·W_o output
    pixels (row-major), as ``tf.image.extract_patches`` would (the order of the patch entries
    does not matter for A_b A_bᵀ). See the module docstring for the block identity used.

    Args:
        x: the convolution's input, NHWC, static H, W and C.
        kernel_size: (k_h, k_w), multiples of the strides (see :func:`patch_gram_supported`).
        strides: (s_h, s_w).
        padding: ``"same"`` or ``"valid"`` (any case).
        output_size: (H_o, W_o) of the convolution's output.
    """
    y = _blocks(
        x, kernel_size=kernel_size, strides=strides, padding=padding, output_size=output_size
    )
    batch = tf.shape(x)[0]
    bh, sh, bw, sw, c = (int(d) for d in y.shape[1:])
    kh, kw = (int(v) for v in kernel_size)
    ho, wo = (int(v) for v in output_size)
    if sh * sw > 1:
        y = tf.transpose(y, [0, 1, 3, 2, 4, 5])
    y = tf.reshape(y, [batch, bh * bw, sh * sw * c])
    blocks = tf.reshape(tf.matmul(y, y, transpose_b=True), [batch, bh, bw, bh, bw])
    gram = None
    for a in range(kh // sh):
        for b in range(kw // sw):
            part = blocks[:, a : a + ho, b : b + wo, a : a + ho, b : b + wo]
            gram = part if gram is None else gram + part
    return tf.reshape(gram, [batch, ho * wo, ho * wo])
