"""PrivateGradients (one DP step) against explicit per-example loops and closed forms."""

from __future__ import annotations

import math
import zlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpledger import PrivacyLedger
from dpledger.adapters.tensorflow import PrivateGradients
from dpledger.adapters.tensorflow.dp_step import default_clip_margin, gradient_queries
from dpledger.diagnostics.bias import clipping_bias
from dpledger.errors import (
    InvalidParameterError,
    LedgerStateError,
    PerExampleLossError,
    RecordMixingLayerError,
)
from dpledger.mechanisms import AutomaticClipping
from dpledger.mechanisms.sum_query_checks import SensitivityCheckError
from tests.adapters.tensorflow.helpers import per_example_gradients
from tests.adapters.tensorflow.test_engine import CASES, COVERED_TYPES

Q, N = 0.1, 80  # q·n = 8
HUGE = 1e30  # a clip bound no gradient reaches: every factor is exactly 1


def _loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _cnn(dtype: str = "float32") -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((6, 6, 1), dtype=dtype),
            keras.layers.Conv2D(3, 3, activation="relu", dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
            keras.layers.Dense(5, activation="tanh", dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def _batch(batch: int = 6, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, 6, 6, 1)).astype(dtype), rng.integers(0, 3, batch).astype(
        np.int32
    )


def _private(model, **kwargs) -> PrivateGradients:
    kwargs.setdefault("sampling_probability", Q)
    kwargs.setdefault("population_size", N)
    kwargs.setdefault("seed", 0)
    return PrivateGradients(model, _loss(), **kwargs)


def _flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])


@pytest.mark.parametrize("strategy", ["ghost", "generic"])
def test_sigma_zero_and_infinite_clip_give_the_non_private_step(strategy):
    model = _cnn()
    x, y = _batch()
    private = _private(model, l2_norm_bound=HUGE, noise_multiplier=0.0, strategy=strategy)
    grads = private(x, y)
    with tf.GradientTape() as tape:
        total = tf.reduce_sum(_loss()(y, model(x, training=True)))
    expected = tape.gradient(total, model.trainable_variables)
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e) / (Q * N), rtol=2e-5, atol=1e-7)
    assert private.engine.path == strategy
    (step,) = list(private.ledger.steps())
    assert (step.sampling.sampling_probability, step.sampling.population_size) == (Q, N)
    assert [(e.l2_norm_bound, e.noise_stddev) for e in step.queries] == [(HUGE, 0.0)]


def _oracle_factors(norms: np.ndarray, bound: float, clipping: str) -> np.ndarray:
    if clipping == "flat":
        return np.minimum(1.0, bound / norms)
    if clipping == "global":
        return (norms <= bound).astype(np.float64)
    return bound / (norms + AutomaticClipping().stability)


@pytest.mark.slow
@pytest.mark.parametrize("clipping", ["flat", "global", "automatic"])
@pytest.mark.parametrize("strategy", ["ghost", "generic"])
def test_clipped_sum_equals_a_per_example_loop(clipping, strategy):
    model = _cnn("float64")
    x, y = _batch(8, seed=3, dtype=np.float64)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none", dtype="float64"
    )
    per_example = per_example_gradients(model, loss, x, y)
    rows = np.stack([_flat([g[i] for g in per_example]) for i in range(8)])
    norms = np.linalg.norm(rows, axis=1)
    bound = float(np.median(norms))
    private = PrivateGradients(
        model,
        loss,
        l2_norm_bound=bound,
        noise_multiplier=0.0,
        clipping=clipping,
        sampling_probability=Q,
        population_size=N,
        strategy=strategy,
        seed=0,
    )
    got = _flat(private(x, y)) * (Q * N)
    margin = default_clip_margin("float64")
    expected = _oracle_factors(norms, bound * (1 - margin), clipping) @ rows
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    assert 0 < np.count_nonzero(norms > bound) < 8


def test_per_layer_groups_with_dimension_allocation_and_joint_scaling():
    model = _cnn("float64")
    x, y = _batch(8, seed=4, dtype=np.float64)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none", dtype="float64"
    )
    per_example = per_example_gradients(model, loss, x, y)
    variables = model.trainable_variables
    kernel = variables[0].path
    private = PrivateGradients(
        model,
        loss,
        l2_norm_bound=0.3,
        noise_multiplier=0.0,
        groups="per_layer",
        clip_split="dimension",
        noise_allocation="dimension",
        scales={kernel: 4.0},
        sampling_probability=Q,
        population_size=N,
        clip_margin=0.0,
        seed=0,
    )
    got = private(x, y)
    queries = private.queries
    assert len(queries.positions) == 3
    bounds = [q.l2_norm_bound for q in queries.queries]
    dims = [sum(int(np.prod(variables[j].shape)) for j in m) for m in queries.positions]
    np.testing.assert_allclose(bounds, [0.3 * math.sqrt(d / sum(dims)) for d in dims], rtol=1e-15)
    for query, members in zip(queries.queries, queries.positions, strict=True):
        scales = np.array([query.scales[k] for k in range(len(members))])
        scaled = np.sqrt(
            sum(
                np.sum(per_example[j].reshape(8, -1) ** 2, axis=1) / a**2
                for j, a in zip(members, scales, strict=True)
            )
        )
        f = np.minimum(1.0, query.l2_norm_bound / scaled)
        for j in members:
            expected = np.tensordot(f, per_example[j], axes=1)
            np.testing.assert_allclose(np.asarray(got[j]) * Q * N, expected, rtol=1e-10, atol=1e-12)
    assert queries.queries[0].scales == (4.0, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("layer_type", sorted(COVERED_TYPES, key=lambda t: t.__name__))
def test_fast_and_vectorized_steps_agree_with_noise(layer_type):
    name = COVERED_TYPES[layer_type]
    results = []
    for strategy in ("ghost", "generic"):
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        keras.utils.set_random_seed(7)
        model, x, y = CASES[name](rng)
        private = _private(
            model, l2_norm_bound=0.05, noise_multiplier=0.5, strategy=strategy, seed=11
        )
        results.append(_flat(private(x, y)))
        assert private.engine.path == strategy
    scale = float(np.max(np.abs(results[1])))
    np.testing.assert_allclose(results[0], results[1], rtol=0, atol=2e-5 * scale)


@pytest.mark.statistical
def test_noise_standard_deviation_is_sigma_c_over_qn():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((40,)), keras.layers.Dense(25)])
    x = np.random.default_rng(5).normal(size=(7, 40)).astype(np.float32)
    y = np.random.default_rng(6).integers(0, 25, 7).astype(np.int32)
    clip, sigma = 0.5, 1.3
    noisy = _private(model, l2_norm_bound=clip, noise_multiplier=sigma, seed=3)
    exact = _private(model, l2_norm_bound=clip, noise_multiplier=0.0)
    clean = _flat(exact(x, y))
    samples = np.concatenate([_flat(noisy(x, y)) - clean for _ in range(8)])
    expected = sigma * clip / (Q * N)
    # the sample standard deviation of m normal draws has standard error σ/√(2m)
    assert abs(samples.std(ddof=1) - expected) < 4 * expected / math.sqrt(2 * samples.size)
    assert abs(samples.mean()) < 4 * expected / math.sqrt(samples.size)
    assert noisy.ledger.num_steps == 8
    assert {e.noise_stddev for s in noisy.ledger.steps() for e in s.queries} == {sigma * clip}


def _adversarial_records(count: int, dim: int, bound: float) -> np.ndarray:
    """float32 vectors whose exact (float64) norm lies in (S, S·(1 + 2⁻²⁵)]."""
    rng = np.random.default_rng(8)
    out = []
    while len(out) < count:
        v = rng.normal(size=dim)
        for k in range(-8, 9):
            w = (v / np.linalg.norm(v) * bound * (1 + k * 2.0**-26)).astype(np.float32)
            exact = np.linalg.norm(w.astype(np.float64))
            if bound < exact <= bound * (1 + 2.0**-25):
                out.append(w)
                break
    return np.stack(out)


def test_float32_rounding_never_lets_a_contribution_exceed_the_bound():
    keras.utils.set_random_seed(0)
    bound, dim = 1.0, 64
    records = _adversarial_records(48, dim, bound)
    model = keras.Sequential([keras.Input((dim,)), keras.layers.Dense(1, use_bias=False)])

    def contributions(margin):
        private = PrivateGradients(
            model,
            lambda y_true, y_pred: y_pred[:, 0],  # gradient of record i is x_i
            l2_norm_bound=bound,
            noise_multiplier=0.0,
            sampling_probability=1.0,
            population_size=1,
            clip_margin=margin,
            seed=0,
        )
        return np.array(
            [np.linalg.norm(np.asarray(private(r[None, :])[0], np.float64)) for r in records]
        )

    assert np.all(contributions(None) <= bound)
    # Without the margin some factor rounds to 1 in float32 and the record passes unshrunk.
    assert np.any(contributions(0.0) > bound)


@pytest.mark.slow
def test_empty_batches_and_one_event_per_executed_step_inside_a_tf_function():
    model = _cnn()
    private = _private(model, l2_norm_bound=1.0, noise_multiplier=0.0)

    @tf.function
    def step(x, y):
        return private(x, y)

    for size in (5, 0, 3, 0, 7):
        x, y = _batch(size, seed=size)
        grads = step(x, y)
        if size == 0:
            assert all(float(tf.reduce_max(tf.abs(g))) == 0.0 for g in grads)
    assert private.ledger.num_steps == 5
    assert [s.sampling.sampling_probability for s in private.ledger.steps()] == [Q] * 5


@pytest.mark.slow
def test_bias_callback_reports_the_metrics_of_the_explicit_loop():
    model = _cnn("float64")
    x, y = _batch(8, seed=9, dtype=np.float64)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none", dtype="float64"
    )
    per_example = per_example_gradients(model, loss, x, y)
    rows = np.stack([_flat([g[i] for g in per_example]) for i in range(8)])
    bound = float(np.median(np.linalg.norm(rows, axis=1)))
    seen = []
    private = PrivateGradients(
        model,
        loss,
        l2_norm_bound=bound,
        noise_multiplier=1.0,
        sampling_probability=Q,
        population_size=N,
        clip_margin=0.0,
        seed=0,
        bias_callback=lambda step, metrics: seen.append((step, metrics)),
    )
    private(x, y)
    private(x[:0], y[:0])  # no metrics for an empty batch
    private(x, y)
    assert [s for s, _ in seen] == [0, 2]
    expected = clipping_bias(rows, l2_norm_bound=bound, denominator=Q * N)
    got = seen[0][1]
    assert got.fraction_clipped == expected.fraction_clipped
    assert got.bias_norm == pytest.approx(expected.bias_norm, rel=1e-9)
    assert got.cosine == pytest.approx(expected.cosine, rel=1e-9)


def test_ledger_errors_come_back_typed_and_nothing_is_applied():
    model = _cnn()
    ledger = PrivacyLedger()
    private = _private(model, l2_norm_bound=1.0, noise_multiplier=1.0, ledger=ledger)
    x, y = _batch()
    private(x, y)
    ledger.close()
    with pytest.raises(LedgerStateError):
        private(x, y)


def test_a_step_refused_by_the_sensitivity_check_records_nothing():
    model = _cnn()
    ledger = PrivacyLedger()
    private = _private(model, l2_norm_bound=0.1, noise_multiplier=1.0, ledger=ledger)
    engine, clipped_sum = private.engine, private.engine.clipped_sum

    def inflated(norms, *, factors):  # a planted bug: every clipped sum 1000 times too long
        return tuple(s * 1000.0 for s in clipped_sum(norms, factors=factors))

    engine.clipped_sum = inflated
    x, y = _batch()
    with pytest.raises(SensitivityCheckError):
        private(x, y)
    assert ledger.num_events == 0  # checked before the sampling event is recorded


def test_nan_loss_is_refused_with_the_record_named():
    model = _cnn()
    private = _private(model, l2_norm_bound=1.0, noise_multiplier=1.0)
    x, y = _batch()
    x[2, 0, 0, 0] = np.nan
    with pytest.raises(InvalidParameterError, match=r"squared_norms\[\d\]"):
        private(x, y)


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"l2_norm_bound": 0.0}, "l2_norm_bound"),
        ({"l2_norm_bound": -1.0}, "l2_norm_bound"),
        ({"l2_norm_bound": math.inf}, "l2_norm_bound"),
        ({"l2_norm_bound": math.nan}, "l2_norm_bound"),
        ({"noise_multiplier": -0.1}, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, "noise_multiplier"),
        ({"sampling_probability": 0.0}, "sampling_probability"),
        ({"sampling_probability": 1.5}, "sampling_probability"),
        ({"sampling_probability": math.nan}, "sampling_probability"),
        ({"population_size": 0}, "population_size"),
        ({"clip_margin": 0.5}, "clip_margin"),
        ({"clipping": "median"}, "clipping"),
        ({"groups": "per_block"}, "groups"),
        ({"clip_split": "random"}, "clip_split"),
        ({"noise_allocation": "even"}, "noise_allocation"),
        ({"scales": {"nope": 2.0}}, "scales"),
        ({"seed": -3}, "seed"),
        ({"ledger": "run.ledger"}, "ledger"),
        ({"bias_callback": 3}, "bias_callback"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, parameter):
    args = {"l2_norm_bound": 1.0, "noise_multiplier": 1.0, **kwargs}
    with pytest.raises(InvalidParameterError, match=parameter):
        _private(_cnn(), **args)


def test_sampler_or_explicit_sampling_is_required():
    with pytest.raises(InvalidParameterError, match="sampling_probability"):
        PrivateGradients(_cnn(), _loss(), l2_norm_bound=1.0, noise_multiplier=1.0)


def test_batch_normalization_is_refused_with_a_suggestion():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization()]
    )
    with pytest.raises(RecordMixingLayerError, match="GroupNormalization"):
        _private(model, l2_norm_bound=1.0, noise_multiplier=1.0)


def test_losses_without_per_example_values_are_refused():
    model = _cnn()
    x, y = _batch()
    with pytest.raises(PerExampleLossError, match="reduction='none'"):
        PrivateGradients(
            model,
            lambda t, p: tf.reduce_mean(p),
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            sampling_probability=Q,
            population_size=N,
        )(x, y)
    with pytest.raises(PerExampleLossError):
        PrivateGradients(
            model,
            "no_such_loss",
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            sampling_probability=Q,
            population_size=N,
        )


def test_gradient_queries_groups_and_explicit_queries():
    model = _cnn()
    variables = model.trainable_variables
    explicit = gradient_queries(
        variables,
        groups={
            "group0": [v.path for v in variables[:2]],
            "group1": [v.path for v in variables[2:]],
        },
        l2_norm_bound=2.0,
        noise_multiplier=1.5,
    )
    assert explicit.positions == ((0, 1), (2, 3, 4, 5))
    assert explicit.effective_noise_multiplier == pytest.approx(1.5, rel=1e-12)
    per_variable = gradient_queries(
        variables, groups="per_parameter", l2_norm_bound=2.0, noise_multiplier=1.5
    )
    assert len(per_variable.queries) == len(variables)
    reused = gradient_queries(
        variables,
        queries=list(explicit.queries),
        groups={
            "group0": [v.path for v in variables[:2]],
            "group1": [v.path for v in variables[2:]],
        },
    )
    assert reused.queries == explicit.queries
    with pytest.raises(InvalidParameterError, match="groups"):
        gradient_queries(
            variables,
            groups={"group0": [variables[0].path]},
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
        )
    with pytest.raises(InvalidParameterError, match="queries"):
        gradient_queries(variables, queries=list(explicit.queries), l2_norm_bound=1.0)
