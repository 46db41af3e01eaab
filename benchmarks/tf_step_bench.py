"""Time one DP-SGD step of dpledger's Keras per-example gradient engine against the plain step.

Models (``--models``):

* ``cnn`` (default): the two-conv, two-dense CNN of Opacus's and TensorFlow Privacy's MNIST
  examples, as in benchmarks/torch_step_bench.py (Conv2D 16 k8 s2 "same" = padding 3, max-pool
  2/1, Conv2D 32 k4 s2 "valid", max-pool 2/1, Dense 512→32, Dense 32→10; 26,010 parameters),
  batch 256, on scikit-learn's 8×8 digits upsampled to 28×28 (timing does not depend on pixels).
* ``cnn8``: a two-conv, two-dense CNN on the digits at 8×8 (25,730 parameters), batch 256.
* ``demo``: the model of ``examples/keras_digits.py`` (``digits_cnn``: Conv 16 3×3 "same", Conv 32
  3×3 stride 2, Dense 32, Dense 10; 14,378 parameters) on the 8×8 digits, batch 256.
* ``transformer`` / ``transformer-mha``: token and position embeddings, one pre-LayerNorm block
  with single-head attention from four Dense layers (or ``keras.layers.MultiHeadAttention``), a
  Dense MLP, mean pooling and a Dense head; width 64, length 32, vocabulary 1000, batch 64, as
  in the PyTorch benchmark.

Steps, each one ``tf.function`` on the same batch:

* non-private: forward, mean loss, backward, SGD step.
* fast (book-keeping): :class:`PerExampleGradientEngine` fast path — forward, backward to the
  layer outputs, per-example squared norms, flat clipping factors f_i = min(1, C/‖g_i‖) in the
  graph, Σ_i f_i g_i from the stored activations and output gradients — then Gaussian noise
  σ·C on every coordinate (a seeded ``tf.random.Generator``), division by B, SGD step.
* fast (second backward): the same norms, then Σ_i f_i g_i as the gradient of Σ_i f_i ℓ_i by a
  second backward pass through the recorded forward (a persistent tape around the engine), the
  usual TensorFlow Privacy approach; kept to justify book-keeping as the engine's choice.
* vectorized: the engine's ``tf.vectorized_map`` path (per-example gradients materialised).

``--ablate`` adds, for attribution only, a ``DPKerasModel`` fast step whose per-example kernel
gradients of materialised convolutions are replaced by zeros (it is *not* private: it shows
what the step costs without them; on ``cnn`` that is the first convolution, the second takes
the ghost norm).

Times are medians over interleaved repeats (each repeat runs every step once, so drifts in the
machine's load hit all alike) of wall time and of process CPU time; ratios are to the
non-private step of the same run. ``--tf-pfor-converters`` times the vectorised path with
TensorFlow's own ``pfor`` converters instead of the engine's.

Run: ``PYTHONPATH=. python benchmarks/tf_step_bench.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from dpledger.adapters.tensorflow import DPKerasModel, PerExampleGradientEngine

CLIP = 1.0
SIGMA = 1.0
LR = 0.05


class Attention(keras.layers.Layer):
    """Single-head self-attention from four Dense layers."""

    def __init__(self, width: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.q = keras.layers.Dense(width)
        self.k = keras.layers.Dense(width)
        self.v = keras.layers.Dense(width)
        self.out = keras.layers.Dense(width)

    def call(self, x):
        scores = tf.matmul(self.q(x), self.k(x), transpose_b=True) / float(x.shape[-1]) ** 0.5
        return self.out(tf.matmul(tf.nn.softmax(scores, axis=-1), self.v(x)))


class TinyTransformer(keras.Model):
    """Token + position embeddings, one pre-LayerNorm block, mean pooling, linear head."""

    def __init__(self, *, vocab: int = 1000, width: int = 64, length: int = 32, mha: bool = False):
        super().__init__(name="transformer-mha" if mha else "transformer")
        self.tokens = keras.layers.Embedding(vocab, width)
        self.positions = keras.layers.Embedding(length, width)
        self.ln1 = keras.layers.LayerNormalization()
        self.attn = keras.layers.MultiHeadAttention(4, width // 4) if mha else Attention(width)
        self.mha = mha
        self.ln2 = keras.layers.LayerNormalization()
        self.mlp1 = keras.layers.Dense(2 * width, activation="gelu")
        self.mlp2 = keras.layers.Dense(width)
        self.ln3 = keras.layers.LayerNormalization()
        self.head = keras.layers.Dense(4)

    def call(self, ids):
        # Position ids per record, so that the embedding sees the batch on axis 0.
        pos = tf.tile(tf.range(tf.shape(ids)[1])[None, :], [tf.shape(ids)[0], 1])
        h = self.tokens(ids) + self.positions(pos)
        x = self.ln1(h)
        h = h + (self.attn(x, x) if self.mha else self.attn(x))
        h = h + self.mlp2(self.mlp1(self.ln2(h)))
        return self.head(tf.reduce_mean(self.ln3(h), axis=1))


def _demo_model() -> keras.Model:
    """``digits_cnn`` of examples/keras_digits.py, loaded from the file (not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "keras_digits.py"
    spec = importlib.util.spec_from_file_location("keras_digits_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.digits_cnn()
    model.name = "demo"
    return model


def make_model(name: str) -> keras.Model:
    """The benchmark models (see the module docstring)."""
    if name == "demo":
        return _demo_model()
    if name in ("transformer", "transformer-mha"):
        model = TinyTransformer(mha=name == "transformer-mha")
        model(np.zeros((1, 32), np.int32))
        return model
    if name == "cnn":
        return keras.Sequential(
            [
                keras.Input((28, 28, 1)),
                keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(2, 1),
                keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
                keras.layers.MaxPooling2D(2, 1),
                keras.layers.Flatten(),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(10),
            ],
            name="cnn",
        )
    if name == "cnn8":
        return keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(2),
                keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(40, activation="relu"),
                keras.layers.Dense(10),
            ],
            name="cnn8",
        )
    raise ValueError(f"unknown model {name!r}")


def digits_batch(batch: int, size: int) -> tuple[tf.Tensor, tf.Tensor]:
    """The first ``batch`` scikit-learn digits, scaled to [0, 1] and resized to size×size."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits.images[:batch].astype(np.float32)[..., None] / 16.0
    if size != 8:
        x = tf.image.resize(x, (size, size)).numpy()
    return tf.constant(x), tf.constant(digits.target[:batch].astype(np.int32))


def model_batch(name: str, model: keras.Model, batch: int) -> tuple[tf.Tensor, tf.Tensor]:
    """The batch a model is timed on."""
    if name.startswith("transformer"):
        rng = np.random.default_rng(1)
        return (
            tf.constant(rng.integers(0, 1000, size=(batch, 32)), tf.int32),
            tf.constant(rng.integers(0, 4, size=batch), tf.int32),
        )
    return digits_batch(batch, model.input_shape[1])


def _without_conv_kernel_gradients() -> Callable[[], None]:
    """Replace materialised per-example conv kernel gradients by zeros; returns the undo."""
    from dpledger.adapters.tensorflow import layer_rules

    original = layer_rules.per_example_conv2d_kernel_gradients

    def zeros(x, g, *, kernel_shape, **_):
        # keep the dependency on g (the step still waits for the backward pass), not its cost
        return tf.zeros([tf.shape(x)[0], *kernel_shape], x.dtype) * g[0, 0, 0, 0]

    layer_rules.per_example_conv2d_kernel_gradients = zeros

    def undo() -> None:
        layer_rules.per_example_conv2d_kernel_gradients = original

    return undo


def build_steps(
    name: str, batch: int, *, ablate: bool = False
) -> dict[str, Callable[[], tf.Tensor]]:
    """One ``tf.function`` per method, each on its own copy of the model and optimizer."""
    keras.utils.set_random_seed(0)
    base = make_model(name)
    x, y = model_batch(name, base, batch)
    weights = base.get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    generator = tf.random.Generator.from_seed(1)

    def fresh() -> tuple[keras.Model, keras.optimizers.Optimizer]:
        model = make_model(name)
        model.set_weights(weights)
        optimizer = keras.optimizers.SGD(LR)
        optimizer.build(model.trainable_variables)
        return model, optimizer

    def flat_factors(squared_norms: tuple[tf.Tensor, ...]) -> tf.Tensor:
        norm = tf.sqrt(tf.add_n(list(squared_norms)))
        return tf.minimum(1.0, CLIP / (norm + 1e-6))

    def noisy_step(optimizer, variables, sums) -> None:
        size = tf.cast(batch, sums[0].dtype)
        grads = [(s + generator.normal(tf.shape(s), stddev=SIGMA * CLIP)) / size for s in sums]
        optimizer.apply_gradients(zip(grads, variables, strict=True))

    steps: dict[str, Callable[[], tf.Tensor]] = {}

    m0, o0 = fresh()

    @tf.function
    def non_private(x, y):
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(loss(y, m0(x, training=True)))
        grads = tape.gradient(value, m0.trainable_variables)
        o0.apply_gradients(zip(grads, m0.trainable_variables, strict=True))
        return value

    steps["non-private"] = lambda: non_private(x, y)

    def ours(strategy: str) -> Callable[[], tf.Tensor]:
        model, optimizer = fresh()
        engine = PerExampleGradientEngine(model, loss, strategy=strategy)

        @tf.function
        def step(x, y):
            result = engine.clipped_gradients(x, y, clip_factors=flat_factors)
            noisy_step(optimizer, model.trainable_variables, result.sums)
            return tf.reduce_mean(result.losses)

        return lambda: step(x, y)

    steps["ours fast (book-keeping)"] = ours("ghost")

    m2, o2 = fresh()
    engine2 = PerExampleGradientEngine(m2, loss, strategy="ghost")

    @tf.function
    def second_backward(x, y):
        with tf.GradientTape() as tape:
            norms = engine2.norms(x, y)
        factors = flat_factors(norms.squared_norms)
        sums = tape.gradient(norms.losses, m2.trainable_variables, output_gradients=factors)
        noisy_step(o2, m2.trainable_variables, sums)
        return tf.reduce_mean(norms.losses)

    steps["ours fast (second backward)"] = lambda: second_backward(x, y)
    steps["ours vectorized"] = ours("generic")

    def keras_fit_step(model: keras.Model) -> Callable[[], tf.Tensor]:
        model.make_train_function()
        function = model.train_function
        return lambda: function(iter([(x, y)]))["loss"]

    plain = make_model(name)
    plain.set_weights(weights)
    plain.compile(optimizer=keras.optimizers.SGD(LR), loss=loss)
    steps["keras non-private (fit step)"] = keras_fit_step(plain)

    def dp_keras_model(method: str) -> DPKerasModel:
        model = make_model(name)
        model.set_weights(weights)
        # q·n = batch: the same denominator as the engine steps above
        wrapper = DPKerasModel(
            model,
            l2_norm_bound=CLIP,
            noise_multiplier=SIGMA,
            sampling_probability=0.1,
            population_size=10 * batch,
            strategy={"fast": "ghost", "vectorized": "generic"}[method],
            seed=2,
        )
        wrapper.compile(optimizer=keras.optimizers.SGD(LR), loss=loss)
        return wrapper

    for method in ("fast", "vectorized"):
        steps[f"DPKerasModel {method} (fit step)"] = keras_fit_step(dp_keras_model(method))
    if ablate:
        step = keras_fit_step(dp_keras_model("fast"))
        undo = _without_conv_kernel_gradients()
        try:
            step().numpy()  # traced now, with the zeros
        finally:
            undo()
        steps["ablation: fast, no conv kernel grads"] = step
    return steps


def time_steps(
    steps: dict[str, Callable[[], tf.Tensor]], repeats: int, warmup: int
) -> dict[str, tuple[float, float]]:
    """Median (wall, process CPU) seconds per step, interleaving the methods.

    Process CPU time (all of TensorFlow's threads) is less sensitive than wall time to other
    processes sharing the machine; both are reported.
    """
    for f in steps.values():
        for _ in range(warmup):
            f().numpy()
    wall: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for k, f in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f().numpy()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default="cnn",
        help="comma-separated: cnn, cnn8, demo, transformer, transformer-mha",
    )
    parser.add_argument(
        "--batch", type=int, default=0, help="batch size (0: 256 for CNNs, 64 for transformers)"
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=0, help="TensorFlow intra- and inter-op threads (0: default)"
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="also time the fast Keras step without per-example conv kernel gradients (not DP)",
    )
    parser.add_argument(
        "--tf-pfor-converters",
        action="store_true",
        help="vectorised path with TensorFlow's own pfor converters only (to measure ours)",
    )
    args = parser.parse_args()
    if args.tf_pfor_converters:
        from dpledger.adapters.tensorflow import vectorized

        vectorized._CONVERTERS.clear()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    logging.basicConfig(level=logging.ERROR)
    tf.get_logger().setLevel("ERROR")
    print(
        f"python {platform.python_version()}, tensorflow {tf.__version__}, keras "
        f"{keras.__version__}, devices {[d.name for d in tf.config.list_logical_devices()]}, "
        f"threads intra {tf.config.threading.get_intra_op_parallelism_threads() or 'default'} "
        f"inter {tf.config.threading.get_inter_op_parallelism_threads() or 'default'}"
    )
    for name in args.models.split(","):
        batch = args.batch or (64 if name.startswith("transformer") else 256)
        steps = build_steps(name, batch, ablate=args.ablate)
        nparams = make_model(name).count_params()
        med = time_steps(steps, args.repeats, args.warmup)
        base = med["non-private"]
        print(f"\n## {name}: {nparams} parameters, batch {batch}, {args.repeats} repeats")
        print(
            f"{'method':38s} {'wall ms':>8s} {'x non-private':>14s} {'CPU ms':>8s} "
            f"{'x non-private':>14s}"
        )
        for k, (w, c) in med.items():
            print(f"{k:38s} {w * 1e3:8.2f} {w / base[0]:14.2f} {c * 1e3:8.2f} {c / base[1]:14.2f}")
        fit = med["keras non-private (fit step)"]
        print("full wrapper over Keras's own non-private fit step:")
        for method in ("fast", "vectorized"):
            w, c = med[f"DPKerasModel {method} (fit step)"]
            print(f"  {method:10s} wall {w / fit[0]:.2f}x, CPU {c / fit[1]:.2f}x")


if __name__ == "__main__":
    main()
