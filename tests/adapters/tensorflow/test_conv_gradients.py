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


def test_grouped_and_patch_implementations_agree():
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(size=(4, 9, 9, 3)), tf.float32)
    g = tf.constant(rng.normal(size=(4, 4, 4, 6)), tf.float32)
    args = ((3, 3, 3, 6), (2, 2), (1, 1), "valid")
    if not grouped_convolution_supported(tf.float32):
        pytest.skip("no grouped Conv2DBackpropFilter for float32 on this device")
    np.testing.assert_allclose(
        conv_gradients._grouped(x, g, *args).numpy(),
        conv_gradients._patches(x, g, *args).numpy(),
        rtol=1e-4,
        atol=1e-4,
    )
