"""The engine against an explicit per-example loop, for every registered layer type and path."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpledger.adapters.tensorflow import PerExampleGradientEngine
from dpledger.adapters.tensorflow.registry import registered_layer_types
from tests.adapters.tensorflow.helpers import (
    assert_close,
    per_example_gradients,
    squared_norms,
    weighted_sums,
)

BATCH = 4


def _scce(dtype: str = "float32") -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none", dtype=dtype
    )


def _labels(rng: np.random.Generator, classes: int = 2) -> np.ndarray:
    return rng.integers(0, classes, size=BATCH).astype(np.int32)


def _head(h: keras.KerasTensor, dtype: str = "float32") -> keras.KerasTensor:
    return keras.layers.Dense(2, dtype=dtype)(keras.layers.Flatten()(h))


def _functional(inputs, outputs) -> keras.Model:
    return keras.Model(inputs, outputs)


def case_dense_mlp(rng):
    inputs = keras.Input((5,))
    h = keras.layers.Dense(4, activation="relu")(inputs)
    model = _functional(inputs, keras.layers.Dense(3)(h))
    return model, rng.normal(size=(BATCH, 5)).astype(np.float32), _labels(rng, 3)


def case_dense_sequence_ghost(rng):
    # T = 3 positions, K = C = 16: T·(K + C) = 96 < K·C = 256, so the ghost norm is used.
    model = keras.Sequential(
        [
            keras.Input((3, 16)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.normal(size=(BATCH, 3, 16)).astype(np.float32), _labels(rng)


def case_dense_sequence_materialised(rng):
    # T = 6, K = 3, C = 4: materialising the per-example kernel gradient is cheaper.
    model = keras.Sequential(
        [keras.Input((6, 3)), keras.layers.Dense(4), keras.layers.Flatten(), keras.layers.Dense(2)]
    )
    return model, rng.normal(size=(BATCH, 6, 3)).astype(np.float32), _labels(rng)


def case_einsum_dense_like(rng):
    inputs = keras.Input((3, 4))
    h = keras.layers.EinsumDense(
        "abc,cde->abde", output_shape=(3, 2, 4), bias_axes="de", activation="relu"
    )(inputs)
    h = keras.layers.EinsumDense("abde,fde->abf", output_shape=(3, 5), bias_axes="f")(h)
    h = keras.layers.EinsumDense("abc,dc->abd", output_shape=(3, 6), bias_axes="d")(h)
    return (
        _functional(inputs, _head(h)),
        rng.normal(size=(BATCH, 3, 4)).astype(np.float32),
        _labels(rng),
    )


def case_einsum_ellipsis_and_generic(rng):
    inputs = keras.Input((3, 4))
    h = keras.layers.EinsumDense("...b,bc->...c", output_shape=5, bias_axes="c")(inputs)
    # c is a kernel axis carried to the output: not Dense-like, per-example einsum path.
    h = keras.layers.EinsumDense("abc,cd->abcd", output_shape=(3, 5, 2), bias_axes="d")(h)
    return (
        _functional(inputs, _head(h)),
        rng.normal(size=(BATCH, 3, 4)).astype(np.float32),
        _labels(rng),
    )


def case_multi_head_attention(rng):
    # Keras's attention is built from EinsumDense sub-layers, so the fast path covers it.
    inputs = keras.Input((3, 8))
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    return (
        _functional(inputs, _head(h)),
        rng.normal(size=(BATCH, 3, 8)).astype(np.float32),
        _labels(rng),
    )


def case_conv_grouped(rng):
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.normal(size=(BATCH, 6, 6, 2)).astype(np.float32), _labels(rng)


def case_conv_strided_blocks(rng):
    # The benchmark CNN's first layer, scaled down: kernel 8 at stride 2 on one channel (patch
    # expansion 36·64/144 = 16), so its per-example kernel gradients come from the grouped op
    # over 2×2 input blocks; the second layer (expansion 9·16/36 = 4) takes patch matrices.
    model = keras.Sequential(
        [
            keras.Input((12, 12, 1)),
            keras.layers.Conv2D(4, 8, strides=2, padding="same", activation="relu"),
            keras.layers.Conv2D(3, 4, strides=2, padding="same"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.normal(size=(BATCH, 12, 12, 1)).astype(np.float32), _labels(rng)


def case_conv_strided_dilated(rng):
    model = keras.Sequential(
        [
            keras.Input((7, 7, 2)),
            keras.layers.Conv2D(3, 3, strides=2, padding="valid"),
            keras.layers.Conv2D(2, 2, dilation_rate=2, padding="same", use_bias=False),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.normal(size=(BATCH, 7, 7, 2)).astype(np.float32), _labels(rng)


def case_conv_ghost(rng):
    # One output pixel (T = 1) and K·C = 72·16 large: the ghost norm branch.
    model = keras.Sequential(
        [
            keras.Input((4, 4, 8)),
            keras.layers.Conv2D(16, 3, strides=2),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.normal(size=(BATCH, 4, 4, 8)).astype(np.float32), _labels(rng)


def case_conv_ghost_strided_dilated(rng):
    # T = 4 output pixels (stride 2, "same") and T = 16 (dilation 2): both ghost-norm branch.
    model = keras.Sequential(
        [
            keras.Input((6, 6, 8)),
            keras.layers.Conv2D(64, 2, dilation_rate=2),
            keras.layers.Conv2D(32, 3, strides=2, padding="same"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.normal(size=(BATCH, 6, 6, 8)).astype(np.float32), _labels(rng)


def case_conv_ghost_block_gram(rng):
    # Ghost-norm convolutions whose kernel size is a multiple of the stride, where the patch
    # Gram matrices come from the input's blocks (conv_gradients.patch_gram): stride 2 "valid"
    # (T = 9, K = 128, F = 32), stride 2 "same" with uneven padding (T = 9, K = 32, F = 48) and
    # stride 1 "same" (T = 9, K = 72, F = 64).
    model = keras.Sequential(
        [
            keras.Input((8, 8, 8)),
            keras.layers.Conv2D(32, 4, strides=2, activation="relu"),
            keras.layers.Conv2D(48, 2, strides=2, padding="same", use_bias=False),
            keras.layers.Conv2D(64, 3, padding="same", activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.normal(size=(BATCH, 8, 8, 8)).astype(np.float32), _labels(rng)


def case_conv_channels_first(rng):
    model = keras.Sequential(
        [
            keras.Input((2, 6, 6)),
            keras.layers.Conv2D(3, 3, data_format="channels_first"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.normal(size=(BATCH, 2, 6, 6)).astype(np.float32), _labels(rng)


def case_embedding_sequence(rng):
    # 6 ids drawn from a vocabulary of 4: every example repeats some id.
    model = keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(4, 3),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.integers(0, 4, size=(BATCH, 6)).astype(np.int32), _labels(rng)


def case_embedding_single(rng):
    model = keras.Sequential(
        [
            keras.Input((1,), dtype="int32"),
            keras.layers.Embedding(7, 3),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.integers(0, 7, size=(BATCH, 1)).astype(np.int32), _labels(rng)


def case_layer_normalization(rng):
    model = keras.Sequential(
        [
            keras.Input((4, 5)),
            keras.layers.Dense(5),
            keras.layers.LayerNormalization(),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.normal(size=(BATCH, 4, 5)).astype(np.float32), _labels(rng)


def case_layer_normalization_variants(rng):
    model = keras.Sequential(
        [
            keras.Input((3, 4)),
            keras.layers.LayerNormalization(axis=[1, 2], center=False),
            keras.layers.Dense(4),
            keras.layers.LayerNormalization(axis=1, scale=False),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    return model, rng.normal(size=(BATCH, 3, 4)).astype(np.float32), _labels(rng)


def case_shared_layers(rng):
    # The same Dense applied twice and the same Embedding on two inputs: per-example gradients
    # add over the calls, so their norms have cross terms.
    ids = keras.Input((3,), dtype="int32", name="ids")
    other = keras.Input((2,), dtype="int32", name="other")
    embed = keras.layers.Embedding(5, 4)
    dense = keras.layers.Dense(4, activation="tanh")
    h = keras.layers.Concatenate(axis=1)([embed(ids), embed(other)])
    h = dense(dense(h))
    model = keras.Model({"ids": ids, "other": other}, _head(h))
    x = {
        "ids": rng.integers(0, 5, size=(BATCH, 3)).astype(np.int32),
        "other": rng.integers(0, 5, size=(BATCH, 2)).astype(np.int32),
    }
    return model, x, _labels(rng)


def case_float64(rng):
    model = keras.Sequential(
        [
            keras.Input((5, 5, 1), dtype="float64"),
            keras.layers.Conv2D(2, 3, dtype="float64"),
            keras.layers.Flatten(dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
            keras.layers.LayerNormalization(dtype="float64"),
            keras.layers.Dense(2, dtype="float64"),
        ]
    )
    return model, rng.normal(size=(BATCH, 5, 5, 1)), _labels(rng)


CASES: dict[str, Callable] = {
    name[len("case_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")
}

COVERED_TYPES = {
    keras.layers.Dense: "dense_mlp",
    keras.layers.EinsumDense: "einsum_dense_like",
    keras.layers.Conv2D: "conv_grouped",
    keras.layers.Embedding: "embedding_sequence",
    keras.layers.LayerNormalization: "layer_normalization",
}


def test_every_registered_type_has_a_case():
    from tests.adapters.tensorflow.test_recurrent import RECURRENT_COVERED_TYPES

    assert set(registered_layer_types()) == set(COVERED_TYPES) | set(RECURRENT_COVERED_TYPES)


def _step(engine: PerExampleGradientEngine) -> Callable:
    @tf.function
    def step(x, y, factors):
        norms = engine.norms(x, y)
        return norms.squared_norms, engine.clipped_sum(norms, factors=list(factors)), norms.losses

    return step


@pytest.mark.parametrize("name", sorted(CASES))
def test_paths_match_the_per_example_loop(name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    keras.utils.set_random_seed(7)
    model, x, y = CASES[name](rng)
    dtype = model.trainable_variables[0].dtype
    tf_dtype = tf.as_dtype(dtype)
    loss = _scce("float64" if tf_dtype == tf.float64 else "float32")
    expected = per_example_gradients(model, loss, x, y)
    expected_sq = squared_norms(expected)
    factors = [rng.uniform(0.1, 1.0, size=BATCH) for _ in expected]
    expected_sums = weighted_sums(expected, factors)
    batch_gradient = [g.sum(axis=0) for g in expected]
    ones = tuple(tf.ones([BATCH], tf_dtype) for _ in expected)
    random_factors = tuple(tf.constant(f, tf_dtype) for f in factors)

    # Rounding errors scale with the largest terms of the backward pass, not with each
    # variable's own gradient (which can be zero up to rounding, e.g. a bias before a
    # normalisation), so tolerances use the largest value of each kind over all variables.
    sq_scale = max(float(np.max(e)) for e in expected_sq)
    sum_scale = max(float(np.max(np.abs(e))) for e in (*expected_sums, *batch_gradient))

    results = {}
    for strategy in ("ghost", "generic"):
        engine = PerExampleGradientEngine(model, loss, strategy=strategy)
        step = _step(engine)
        sq, sums, losses = step(x, y, random_factors)
        assert engine.path == strategy
        for j, v in enumerate(model.trainable_variables):
            assert sq[j].dtype == v.dtype and sq[j].shape == (BATCH,)
            assert sums[j].dtype == v.dtype and sums[j].shape == v.shape
            assert_close(sq[j], expected_sq[j], dtype=tf_dtype, scale=sq_scale)
            assert_close(sums[j], expected_sums[j], dtype=tf_dtype, scale=sum_scale)
        _, unit_sums, _ = step(x, y, ones)
        for j in range(len(expected)):
            assert_close(unit_sums[j], batch_gradient[j], dtype=tf_dtype, scale=sum_scale)
        assert losses.shape == (BATCH,)
        results[strategy] = [np.asarray(t) for t in (*sq, *sums)]
    scales = [sq_scale] * len(expected) + [sum_scale] * len(expected)
    for fast, vectorized, scale in zip(results["ghost"], results["generic"], scales, strict=True):
        assert_close(fast, vectorized, dtype=tf_dtype, scale=scale)


def test_clipped_gradients_single_factor_and_eager_call():
    rng = np.random.default_rng(3)
    model, x, y = case_conv_grouped(rng)
    loss = _scce()
    expected = per_example_gradients(model, loss, x, y)
    total = np.sqrt(np.sum(squared_norms(expected), axis=0))
    clip = float(np.median(total))
    flat = np.minimum(1.0, clip / total)
    expected_sums = weighted_sums(expected, [flat] * len(expected))
    for strategy in ("ghost", "generic"):
        engine = PerExampleGradientEngine(model, loss, strategy=strategy)

        def factors(sq):
            return tf.minimum(1.0, clip / tf.sqrt(tf.add_n(list(sq))))

        result = engine.clipped_gradients(x, y, clip_factors=factors)  # eager
        for j, s in enumerate(result.sums):
            assert_close(s, expected_sums[j], dtype=tf.float32)
        for f in result.factors:
            assert_close(f, flat, dtype=tf.float32)
        assert result.predictions.shape == (BATCH, 2)
        # Every clipped per-example gradient has norm at most C: Σ_j f²‖g_ij‖² ≤ C².
        clipped_sq = sum(
            f.numpy() ** 2 * n.numpy()
            for f, n in zip(result.factors, result.squared_norms, strict=True)
        )
        assert np.all(clipped_sq <= clip**2 * (1 + 1e-5))


def test_sample_weight_scales_each_example():
    rng = np.random.default_rng(4)
    model, x, y = case_dense_mlp(rng)
    loss = _scce()
    weights = rng.uniform(0.5, 2.0, size=BATCH).astype(np.float32)
    expected = per_example_gradients(model, loss, x, y, sample_weight=weights)
    for strategy in ("ghost", "generic"):
        engine = PerExampleGradientEngine(model, loss, strategy=strategy)
        norms = engine.norms(x, y, sample_weight=weights)
        for got, want in zip(norms.squared_norms, squared_norms(expected), strict=True):
            assert_close(got, want, dtype=tf.float32)
        unweighted = engine.norms(x, y).losses.numpy()
        assert_close(norms.losses, unweighted * weights, dtype=tf.float32)


@pytest.mark.slow
def test_dynamic_batch_size_inside_tf_function():
    """Traced once with an unknown batch size, then run on batches of 4, 1 and 0 records."""
    rng = np.random.default_rng(5)
    model, x, y = case_conv_strided_dilated(rng)
    loss = _scce()
    for strategy in ("ghost", "generic"):
        engine = PerExampleGradientEngine(model, loss, strategy=strategy)

        @tf.function(
            input_signature=[
                tf.TensorSpec([None, 7, 7, 2], tf.float32),
                tf.TensorSpec([None], tf.int32),
            ]
        )
        def step(x, y, engine=engine):
            result = engine.clipped_gradients(x, y, clip_factors=lambda n: tf.ones_like(n[0]))
            return result.squared_norms, result.sums

        for size in (4, 1, 0):
            expected = per_example_gradients(model, loss, x[:size], y[:size]) if size else None
            sq, sums = step(x[:size], y[:size])
            for j, v in enumerate(model.trainable_variables):
                assert sq[j].shape == (size,)
                assert sums[j].shape == v.shape
                if size:
                    assert_close(sq[j], squared_norms(expected)[j], dtype=tf.float32)
                    assert_close(sums[j], expected[j].sum(axis=0), dtype=tf.float32)
                else:
                    assert np.all(sums[j].numpy() == 0)


@pytest.mark.parametrize("strategy", ["ghost", "generic"])
def test_static_empty_and_single_batches(strategy):
    rng = np.random.default_rng(6)
    model, x, y = case_embedding_sequence(rng)
    loss = _scce()
    engine = PerExampleGradientEngine(model, loss, strategy=strategy)
    empty = engine.clipped_gradients(x[:0], y[:0], clip_factors=lambda n: tf.ones_like(n[0]))
    for sq, s, v in zip(empty.squared_norms, empty.sums, model.trainable_variables, strict=True):
        assert sq.shape == (0,)
        assert s.shape == v.shape and np.all(s.numpy() == 0)
    assert empty.losses.shape == (0,)
    one = engine.clipped_gradients(x[:1], y[:1], clip_factors=lambda n: tf.ones_like(n[0]))
    expected = per_example_gradients(model, loss, x[:1], y[:1])
    for s, g in zip(one.sums, expected, strict=True):
        assert_close(s, g[0], dtype=tf.float32)


def test_variables_frozen_after_construction_are_dropped():
    rng = np.random.default_rng(8)
    model, x, y = case_dense_mlp(rng)
    loss = _scce()
    engine = PerExampleGradientEngine(model, loss, strategy="ghost")
    assert len(engine.norms(x, y).squared_norms) == 4
    first = model.get_layer(index=1)  # index 0 is the InputLayer
    assert isinstance(first, keras.layers.Dense)
    first.trainable = False
    try:
        norms = engine.norms(x, y)
        assert len(norms.squared_norms) == len(engine.trainable_variables) == 2
        expected = per_example_gradients(model, loss, x, y)
        for got, want in zip(norms.squared_norms, squared_norms(expected), strict=True):
            assert_close(got, want, dtype=tf.float32)
    finally:
        first.trainable = True


@pytest.mark.parametrize("strategy", ["ghost", "generic"])
def test_two_stages_in_separate_tf_functions_with_host_factors(strategy):
    """Norms leave one tf.function, factors are computed on the host in float64, and the
    clipped sums come from the residual in another tf.function (no second forward pass)."""
    rng = np.random.default_rng(9)
    model, x, y = case_conv_strided_dilated(rng)
    loss = _scce()
    engine = PerExampleGradientEngine(model, loss, strategy=strategy)
    stage_a = tf.function(lambda x, y: engine.norms(x, y))
    stage_c = tf.function(lambda norms, factors: engine.clipped_sum(norms, factors=factors))
    norms = stage_a(x, y)
    total = np.sqrt(sum(n.numpy().astype(np.float64) for n in norms.squared_norms))
    clip = float(np.median(total))
    factors = np.minimum(1.0, clip / total)
    sums = stage_c(norms, tf.constant(factors, tf.float32))
    expected = per_example_gradients(model, loss, x, y)
    for got, want in zip(sums, weighted_sums(expected, [factors] * len(expected)), strict=True):
        assert_close(got, want, dtype=tf.float32)


def test_concurrent_traces_in_threads_keep_their_own_taps():
    """tf.distribute traces replicas in threads: two fast-path traces of the same model that
    are inside the forward pass at the same time must not see each other's layer calls."""
    import threading

    barrier = threading.Barrier(2, timeout=30)
    armed = threading.Event()

    class Rendezvous(keras.layers.Layer):
        def call(self, x):
            if armed.is_set():
                barrier.wait()  # both threads are now inside the tapped forward pass
            return x

    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh"),
            Rendezvous(),
            keras.layers.Dense(2),
        ]
    )
    loss = _scce()
    rng = np.random.default_rng(11)
    batches = [
        (rng.normal(size=(3, 5)).astype(np.float32), rng.integers(0, 2, size=3).astype(np.int32)),
        (rng.normal(size=(4, 5)).astype(np.float32), rng.integers(0, 2, size=4).astype(np.int32)),
    ]
    engine = PerExampleGradientEngine(model, loss, strategy="ghost")
    results: dict[int, object] = {}

    def run(i):
        x, y = batches[i]
        results[i] = tf.function(lambda x, y: engine.norms(x, y).squared_norms)(x, y)

    armed.set()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    armed.clear()
    for i, (x, y) in enumerate(batches):
        expected = squared_norms(per_example_gradients(model, loss, x, y))
        for got, want in zip(results[i], expected, strict=True):
            assert_close(got, want, dtype=tf.float32)
    assert "call" not in model.layers[0].__dict__  # the routing was removed afterwards
