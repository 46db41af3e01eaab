"""Per-example convolution helpers against ``tf.image.extract_patches`` and explicit loops."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from dpledger.adapters.tensorflow import conv_gradients
from dpledger.adapters.tensorflow.conv_gradients import (
    MAX_PATCH_EXPANSION,
    grouped_convolution_supported,
    patch_expansion,
    patch_gram,
    patch_gram_supported,
    per_example_conv2d_kernel_gradients,
)

# (H, W, C, kernel, strides, padding): kernels multiple of the strides, odd and even sizes,
# "same" padding with an uneven split, rectangular kernels and strides.
GRAM_CASES = [
    (13, 13, 16, (4, 4), (2, 2), "valid"),
    (28, 28, 1, (8, 8), (2, 2), "same"),
    (7, 9, 3, (3, 3), (1, 1), "same"),
    (7, 9, 3, (3, 3), (1, 1), "valid"),
    (10, 11, 2, (2, 4), (2, 2), "same"),
    (9, 8, 2, (3, 6), (3, 2), "valid"),
    (5, 5, 1, (6, 6), (3, 3), "same"),
    (4, 4, 2, (4, 4), (2, 2), "valid"),
]


@pytest.mark.parametrize(("h", "w", "c", "kernel", "strides", "padding"), GRAM_CASES)
def test_patch_gram_equals_the_gram_of_extracted_patches(h, w, c, kernel, strides, padding):
    assert patch_gram_supported(kernel, strides, (1, 1))
    rng = np.random.default_rng(h * 100 + w)
    x = tf.constant(rng.normal(size=(3, h, w, c)))  # float64: compare to rounding only
    patches = tf.image.extract_patches(
        x, [1, *kernel, 1], [1, *strides, 1], [1, 1, 1, 1], padding.upper()
    )
    ho, wo = patches.shape[1], patches.shape[2]
    a = tf.reshape(patches, [3, ho * wo, -1]).numpy()
    want = np.einsum("btk,bsk->bts", a, a)
    got = patch_gram(x, kernel_size=kernel, strides=strides, padding=padding, output_size=(ho, wo))
    assert got.shape == (3, ho * wo, ho * wo)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_patch_gram_dynamic_and_empty_batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 6, 2)).astype(np.float32)

    @tf.function(input_signature=[tf.TensorSpec([None, 6, 6, 2], tf.float32)])
    def gram(t):
        return patch_gram(
            t, kernel_size=(2, 2), strides=(2, 2), padding="valid", output_size=(3, 3)
        )

    assert gram(x[:0]).shape == (0, 9, 9)
    full = gram(x).numpy()
    blocks = x.reshape(2, 3, 2, 3, 2, 2).transpose(0, 1, 3, 2, 4, 5).reshape(2, 9, 8)
    np.testing.assert_allclose(full, blocks @ blocks.transpose(0, 2, 1), rtol=1e-5, atol=1e-5)


def test_patch_gram_supported_cases():
    assert patch_gram_supported((4, 4), (2, 2), (1, 1))
    assert patch_gram_supported((3, 3), (1, 1), (1, 1))
    assert not patch_gram_supported((3, 3), (2, 2), (1, 1))  # kernel not a multiple
    assert not patch_gram_supported((2, 2), (1, 1), (2, 2))  # dilation


# (H, kernel, stride, output size): patch expansion 16·9/49 ≈ 2.9 (patch matrices) and
# 49·9/49 = 9 (grouped convolution where the dtype supports it).
@pytest.mark.parametrize(("h", "k", "s", "ho"), [(7, 3, 2, 4), (7, 3, 1, 7)])
def test_per_example_kernel_gradients_match_a_loop(h, k, s, ho):
    rng = np.random.default_rng(h + k + s)
    x = tf.constant(rng.normal(size=(3, h, h, 2)), tf.float32)
    g = tf.constant(rng.normal(size=(3, ho, ho, 5)), tf.float32)
    expansion = patch_expansion(x, g, (k, k, 2, 5))
    assert (expansion <= MAX_PATCH_EXPANSION) == (s == 2)
    got = per_example_conv2d_kernel_gradients(
        x, g, kernel_shape=(k, k, 2, 5), strides=(s, s), dilation_rate=(1, 1), padding="same"
    )
    for b in range(3):
        want = tf.raw_ops.Conv2DBackpropFilter(
            input=x[b : b + 1],
            filter_sizes=[k, k, 2, 5],
            out_backprop=g[b : b + 1],
            strides=[1, s, s, 1],
            padding="SAME",
            data_format="NHWC",
        )
        np.testing.assert_allclose(got[b].numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


# (H, W, C, F, kernel, strides, dilation, padding): the benchmark CNN's first convolution (with
# fewer filters), kernels that are multiples of rectangular strides, stride 1, and kernels the
# blocks cannot take (not a multiple of the stride, dilation).
KERNEL_CASES = [
    (28, 28, 1, 4, (8, 8), (2, 2), (1, 1), "same"),
    (13, 13, 3, 2, (4, 4), (2, 2), (1, 1), "valid"),
    (10, 11, 2, 3, (2, 4), (2, 2), (1, 1), "same"),
    (9, 8, 2, 2, (3, 6), (3, 2), (1, 1), "valid"),
    (7, 9, 3, 2, (3, 3), (1, 1), (1, 1), "same"),
    (10, 10, 2, 3, (5, 5), (2, 2), (1, 1), "same"),
    (6, 6, 2, 2, (3, 3), (1, 1), (2, 2), "same"),
]
METHODS = {
    "patches": lambda x, g, k, s, d, p: conv_gradients._patches(x, g, k, s, d, p),
    "grouped": lambda x, g, k, s, d, p: conv_gradients._grouped(x, g, k, s, d, p),
    "grouped_blocks": lambda x, g, k, s, d, p: conv_gradients._grouped_blocks(x, g, k, s, p),
}


def _problem(h, w, c, f, kernel, strides, dilation, padding, batch=3, seed=0):
    rng = np.random.default_rng(seed + h * 31 + w)
    x = tf.constant(rng.normal(size=(batch, h, w, c)), tf.float32)
    out = tf.nn.conv2d(x, tf.zeros((*kernel, c, f)), strides, padding.upper(), dilations=dilation)
    g = tf.constant(rng.normal(size=out.shape), tf.float32)
    return x, g, (*kernel, c, f)


def _loop(x, g, kernel_shape, strides, dilation, padding):
    return np.stack(
        [
            tf.raw_ops.Conv2DBackpropFilter(
                input=x[b : b + 1],
                filter_sizes=list(kernel_shape),
                out_backprop=g[b : b + 1],
                strides=[1, *strides, 1],
                padding=padding.upper(),
                dilations=[1, *dilation, 1],
                data_format="NHWC",
            ).numpy()
            for b in range(x.shape[0])
        ]
    )


# Blocks only where the kernel is a multiple of the stride without dilation (the dispatch test
# checks that the engine never picks them elsewhere).
METHOD_CASES = [
    (method, *case)
    for case in KERNEL_CASES
    for method in sorted(METHODS)
    if method != "grouped_blocks" or patch_gram_supported(case[4], case[5], case[6])
]


@pytest.mark.parametrize(
    ("method", "h", "w", "c", "f", "kernel", "strides", "dilation", "padding"), METHOD_CASES
)
def test_each_method_matches_a_per_record_loop(
    method, h, w, c, f, kernel, strides, dilation, padding
):
    if method != "patches" and not grouped_convolution_supported(tf.float32):
        pytest.skip("no grouped Conv2DBackpropFilter for float32 on this device")
    x, g, kernel_shape = _problem(h, w, c, f, kernel, strides, dilation, padding)
    want = _loop(x, g, kernel_shape, strides, dilation, padding)
    got = METHODS[method](x, g, kernel_shape, strides, dilation, padding)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5 * np.abs(want).max())


def test_the_method_is_chosen_by_expansion_and_kernel():
    if not grouped_convolution_supported(tf.float32):
        pytest.skip("no grouped Conv2DBackpropFilter for float32 on this device")
    picks = {}
    for case in KERNEL_CASES:
        h, _, _, _, kernel, strides, dilation, padding = case
        x, g, kernel_shape = _problem(*case)
        picks[(h, kernel, dilation)] = conv_gradients.kernel_gradient_method(
            x, g, kernel_shape=kernel_shape, strides=strides, dilation_rate=dilation
        )
        got = per_example_conv2d_kernel_gradients(
            x,
            g,
            kernel_shape=kernel_shape,
            strides=strides,
            dilation_rate=dilation,
            padding=padding,
        )
        want = _loop(x, g, kernel_shape, strides, dilation, padding)
        np.testing.assert_allclose(got.numpy(), want, atol=1e-5 * np.abs(want).max())
    # expansion 16, kernel a multiple of the stride: grouped over 2×2 blocks
    assert picks[(28, (8, 8), (1, 1))] == "grouped_blocks"
    # expansion 6.25, kernel 5 not a multiple of stride 2: grouped on the input as it is
    assert picks[(10, (5, 5), (1, 1))] == "grouped"
    # dilation (expansion 9): grouped on the input as it is
    assert picks[(6, (3, 3), (2, 2))] == "grouped"
    # stride 1 (expansion 9): blocks would be single pixels, so the input as it is
    assert picks[(7, (3, 3), (1, 1))] == "grouped"
    # expansion 2.4 ≤ 4: patch matrices
    assert picks[(13, (4, 4), (1, 1))] == "patches"


def test_float64_uses_patch_matrices_unless_grouped_ops_support_it():
    x, g, kernel_shape = _problem(*KERNEL_CASES[0])
    x64, g64 = tf.cast(x, tf.float64), tf.cast(g, tf.float64)
    args = {"kernel_shape": kernel_shape, "strides": (2, 2), "dilation_rate": (1, 1)}
    method = conv_gradients.kernel_gradient_method(x64, g64, **args)
    assert method == ("grouped_blocks" if grouped_convolution_supported(tf.float64) else "patches")
    got = per_example_conv2d_kernel_gradients(x64, g64, padding="same", **args)
    want = _loop(x64, g64, kernel_shape, (2, 2), (1, 1), "same")
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-12 * np.abs(want).max())
