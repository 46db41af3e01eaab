"""The DP step shared by :class:`~dpledger.adapters.tensorflow.PrivateGradients` (custom
loops) and :class:`~dpledger.adapters.tensorflow.DPKerasModel` (``fit``).

One DP step on a sample R of the n records (McMahan & Andrew, sections 1–3). The sequence is
the core's :class:`~dpledger.mechanisms.dp_step.DPStep` (written once for
PyTorch and Keras); this module runs it in a ``tf.function``:

1. per-example squared norms of every trainable variable's gradient (the engine, in the graph);
2. on the host, in float64: each group's clip factors f_{i,g} (:meth:`DPStep.clip_factors` of
   the core step: the group's :class:`~dpledger.mechanisms.GaussianSumQuery` and clipping
   strategy, flat, global or automatic, joint scaled clipping through
   :class:`~dpledger.mechanisms.ScaledGaussianSumQuery`);
3. the clipped sums Σ_i f_{i,g} g_{i,j} (the engine's book-keeping, in the graph);
4. on the host, the core step's release on summaries of the sums (their float64 norms, shapes
   and dtypes, :class:`~dpledger.mechanisms.backend.SummaryBackend`): the draw's event
   (:class:`~dpledger.mechanisms.step.StepEvents`), the sensitivity check
   ‖clipped sum‖ ≤ |R|·S_g, then the sampling event and one sum-query event (S_g, σ̃_g, label)
   per group; it returns the noise standard deviation of every variable (σ̃_g, or α_j·σ̃_g
   under joint scaling);
5. in the graph: Gaussian noise of exactly those standard deviations, drawn in float64 on the
   sums' device (the standard normals are drawn before stage 4, overlapping it), is added and
   the result rounded once (:class:`~dpledger.adapters.tensorflow.backend.TensorFlowBackend`), and
   the core step's fixed-denominator average is returned: sum/(q·n) for Poisson and truncated
   Poisson, sum/b for fixed-size and shuffled batches, sum/(n/k) for balls-in-bins (the event's
   ``average_denominator``).

The host stages run in ``tf.numpy_function`` callbacks, so the whole step is one
``tf.function`` and the ledger is written when the step *executes* — exactly once per executed
step, never at trace time, whatever the retracing, the epochs or ``steps_per_execution``. The
standard deviations the release draws with are what the graph then uses, so the ledger records
exactly the (S_g, σ̃_g) applied. Under
``tf.distribute`` stage 1–3 run per replica (each replica clips its own records); the clipped sums
are summed across replicas and stages 4–5 run once, so there is one noise draw of the full
variance and one sampling event per step.

**Float32 rounding.** The norms come from float32 reductions for float32 models, the factors
are rounded to float32 and multiplied in float32. To keep every record's contribution at or
below S_g despite that, the factors are computed for the slightly smaller bound S_g·(1 − ρ),
while S_g is what is recorded (and what the sensitivity check enforces). The default margin is
ρ = min(0.05, 2¹³·eps) of the variables' dtype (9.8·10⁻⁴ for float32, 1.8·10⁻¹² for float64): it
covers the worst-case relative error γ_d ≈ d·eps of a float sum of d ≤ 8,000 squares plus the
roundings of the factor and the product (Higham, *Accuracy and Stability of Numerical
Algorithms*, §3–4), and in practice far larger d, since TensorFlow reduces in blocks and trees
(error growing like log d). A ghost norm computed from Gram matrices (long sequences, large
convolutions) can lose more to cancellation; train in float64 where a proof is needed.

**Mixed precision.** Under Keras's ``mixed_float16`` / ``mixed_bfloat16`` policies the forward
and backward passes run in the compute dtype, but the variables are float32, and everything from
the output gradients on is computed in the variables' dtype: per-example norms (float32
reductions of the float16 output gradients cast to float32), factors (float64 on the host, with
float32's margin ρ), the clipped sums, and the noise (float64, rounded once to float32). The
norm and the clipped contribution come from the same output gradients, so ‖f_i g_i‖ ≤ S_g
holds as for float32 models. Without loss scaling, float16 output gradients can underflow to 0;
that loses utility, never privacy.

**Bias metrics** (``bias_callback``): the clipping bias of Knolle et al. (Σ g_i and Σ clip(g_i)
before noise, the per-example norms) via
:func:`dpledger.diagnostics.bias.clipping_bias_from_sums`. They are **not private**: for debugging
on data you may look at. With no callback nothing extra is traced or computed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from dpledger.adapters.tensorflow.backend import TensorFlowBackend
from dpledger.adapters.tensorflow.engine import PerExampleGradientEngine
from dpledger.diagnostics.bias import ClippingBiasCallback, clipping_bias_from_sums
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from dpledger.mechanisms.backend import SummaryBackend, SumSummary
from dpledger.mechanisms.clipping import rounding_clip_margin
from dpledger.mechanisms.dp_step import DPStep as CoreStep
from dpledger.mechanisms.gradient_queries import GradientQueries
from dpledger.mechanisms.step import StepEvents

__all__ = ["KerasDPStep", "default_clip_margin", "gradient_queries", "variable_layout"]


def _path(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", repr(variable)))


def variable_layout(variables: Sequence[Any]) -> dict[str, Any]:
    """The ``sizes``, ``layers`` and ``aliases`` of
    :class:`~dpledger.mechanisms.gradient_queries.GradientQueries` for Keras variables: each
    variable by its Keras 3 path (``"dense_1/kernel"``), its layer the path's folder (the
    variable's own path when it has none), and its ``name`` accepted where it is unique."""
    paths = [_path(v) for v in variables]
    sizes = {
        p: int(math.prod(int(d) for d in v.shape)) for p, v in zip(paths, variables, strict=True)
    }
    if len(sizes) != len(paths):
        repeated = sorted({p for p in paths if paths.count(p) > 1})
        raise InvalidParameterError("model", repeated, "trainable variables with distinct paths")
    names = [str(getattr(v, "name", "")) for v in variables]
    aliases = {
        n: p
        for n, p in zip(names, paths, strict=True)
        if n and n not in sizes and names.count(n) == 1
    }
    return {
        "sizes": sizes,
        "layers": {p: p.rpartition("/")[0] or p for p in paths},
        "aliases": aliases,
    }


def gradient_queries(variables: Sequence[Any], **arguments: Any) -> GradientQueries:
    """The Gaussian sum queries of a DP step over Keras ``variables``.

    Args:
        variables: the trainable variables, in the order of the gradients.
        **arguments: the keyword arguments of
            :class:`~dpledger.mechanisms.gradient_queries.GradientQueries` (``l2_norm_bound``,
            ``noise_multiplier``, ``clipping``, ``groups``, ``clip_split``,
            ``noise_allocation``, ``scales`` or ``queries``); names in ``groups`` and
            ``scales`` are variable paths (``variable.path``).

    Raises:
        InvalidParameterError: for any bad argument, naming it.
    """
    variables = tuple(variables)
    if not variables:
        raise InvalidParameterError("variables", variables, "at least one trainable variable")
    return GradientQueries(**variable_layout(variables), **arguments)


def default_clip_margin(dtype: Any) -> float:
    """ρ = min(0.05, 2¹³·eps) for a floating dtype: the factors clip to S·(1 − ρ).

    Args:
        dtype: a TensorFlow, NumPy or Keras floating dtype (or its name).
    """
    return rounding_clip_margin(float(np.finfo(tf.as_dtype(dtype).as_numpy_dtype).eps))


class KerasDPStep:
    """The DP step's stages, shared by :class:`PrivateGradients` and the Keras model.

    Not constructed by users; see the module docstring for the stages.
    """

    def __init__(
        self,
        engine: PerExampleGradientEngine,
        *,
        queries: GradientQueries,
        events: StepEvents,
        ledger: PrivacyLedger,
        generator: tf.random.Generator,
        clip_margin: float | None,
        bias_callback: ClippingBiasCallback | None,
    ) -> None:
        self.engine = engine
        self.events = events
        self.denominator = events.denominator
        self.ledger = ledger
        self.generator = generator
        self.bias_callback = bias_callback
        self.backend = TensorFlowBackend()
        self._host_backend = SummaryBackend()
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        variables = engine.trainable_variables
        self.variables = variables
        self._dtypes = [tf.as_dtype(v.dtype) for v in variables]
        self._shapes = [tuple(int(d) for d in v.shape) for v in variables]
        self._clip_margin = clip_margin
        self.set_queries(queries)

    def set_queries(self, queries: GradientQueries) -> None:
        """Use ``queries`` from the next executed step on (the graph does not depend on them:
        factors and noise scales come from the host stages)."""
        if len(queries.group_of) != len(self.variables):
            raise InvalidParameterError(
                "queries",
                f"queries over {len(queries.group_of)} variables",
                f"queries over the {len(self.variables)} trainable variables",
            )
        if self._clip_margin is None:
            margins: Any = tuple(
                max(default_clip_margin(self._dtypes[j]) for j in members)
                for members in queries.positions
            )
        else:
            margins = float(self._clip_margin)
        core = self.__dict__.get("core")
        if core is None:  # the first queries (a subclass sets up its own state, then calls this)
            self.core = CoreStep(
                queries, ledger=self.ledger, events=getattr(self, "events", None), margins=margins
            )
        else:
            core.set_queries(queries, margins=margins)

    @property
    def queries(self) -> GradientQueries:
        """The groups and their sum queries of the next executed step."""
        return self.core.queries

    # ------------------------------------------------------------------ host callbacks
    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._errors.append(exc)

    def take_error(self) -> BaseException | None:
        """The first exception a host stage raised since the last call (and forget them)."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors[0] if errors else None

    def _host_factors(self, *squared: np.ndarray) -> tuple[np.ndarray, ...]:
        try:
            return tuple(self.core.clip_factors(squared))
        except BaseException as exc:
            self._fail(exc)
            raise

    def _host_release(
        self, num_records: np.ndarray, position: np.ndarray, *squared_sum_norms: np.ndarray
    ) -> np.ndarray:
        try:
            count = int(num_records)
            event = self.core.claim(count, position=int(position))
            summaries = []
            for j, sq in enumerate(squared_sum_norms):
                info = np.finfo(self._dtypes[j].as_numpy_dtype)
                summaries.append(
                    SumSummary(
                        norm=math.sqrt(float(sq)),
                        shape=self._shapes[j],
                        eps=float(info.eps),
                        tiny=float(info.tiny),
                    )
                )
            positions = self.core.queries.positions
            released = self.core.noise(
                [[summaries[j] for j in members] for members in positions],
                num_records=count,
                event=event,
                backend=self._host_backend,
            )
            stddevs = np.zeros(len(summaries), dtype=np.float64)
            for members, orders in zip(positions, released, strict=True):
                for j, order in zip(members, orders, strict=True):
                    stddevs[j] = order.stddev
            return stddevs
        except BaseException as exc:
            self._fail(exc)
            raise

    def _host_bias(
        self,
        num_records: np.ndarray,
        norms: np.ndarray,
        num_clipped: np.ndarray,
        *sums: np.ndarray,
    ) -> np.int64:
        try:
            count = int(num_records)
            if count > 0 and self.bias_callback is not None:
                half = len(sums) // 2
                metrics = clipping_bias_from_sums(
                    unclipped_sum=[np.ravel(s) for s in sums[:half]],
                    clipped_sum=[np.ravel(s) for s in sums[half:]],
                    num_examples=count,
                    per_example_norms=np.asarray(norms, np.float64),
                    num_clipped=int(num_clipped),
                    denominator=self.denominator,
                )
                self.bias_callback(self.ledger.num_steps - 1, metrics)
            return np.int64(0)
        except BaseException as exc:
            self._fail(exc)
            raise

    # ------------------------------------------------------------------ graph stages
    def _cast_factors(self, f: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        out = tf.cast(f, dtype)
        tiny = np.finfo(dtype.as_numpy_dtype).tiny  # a subnormal factor counts as 0
        return tf.where(out < tiny, tf.zeros_like(out), out)

    def clip_replica(self, inputs: Any, targets: Any, sample_weight: Any = None) -> dict[str, Any]:
        """Stages 1–3 on this replica's records: clipped sums, counts, losses, predictions."""
        norms = self.engine.norms(inputs, targets, sample_weight=sample_weight)
        squared = list(norms.squared_norms)
        count = len(self.queries.positions)
        factors = tf.numpy_function(
            self._host_factors, squared, [tf.float64] * count, stateful=True, name="dp_factors"
        )
        if not isinstance(factors, (list, tuple)):
            factors = [factors]
        batch = tf.shape(norms.losses)[0]
        for f in factors:
            f.set_shape(norms.losses.shape)
        per_variable = [
            self._cast_factors(factors[g], self._dtypes[j])
            for j, g in enumerate(self.queries.group_of)
        ]
        sums = self.engine.clipped_sum(norms, factors=per_variable)
        out: dict[str, Any] = {
            "sums": tuple(sums),
            "num_records": batch,
            "losses": norms.losses,
            "predictions": norms.predictions,
        }
        if self.bias_callback is not None:
            ones = [tf.ones_like(f) for f in per_variable]
            out["unclipped"] = tuple(self.engine.clipped_sum(norms, factors=ones))
            total = tf.add_n([tf.cast(s, tf.float64) for s in squared])
            out["norms"] = tf.sqrt(tf.maximum(total, 0.0))
            clipped = tf.reduce_any(tf.stack([f < 1.0 for f in factors]), axis=0)
            out["num_clipped"] = tf.reduce_sum(tf.cast(clipped, tf.int32))
        return out

    def release(
        self,
        sums: Sequence[tf.Tensor],
        num_records: tf.Tensor,
        *,
        unclipped: Sequence[tf.Tensor] | None = None,
        norms: tf.Tensor | None = None,
        num_clipped: tf.Tensor | None = None,
        position: Any = None,
    ) -> list[tf.Tensor]:
        """Stages 4–5 (once per step, in cross-replica context): noise, record, average.

        ``position`` is the step's 0-based position in its epoch (an int64 scalar), which
        decides its sampling event (:meth:`StepEvents.at`); None counts the executed steps.
        """
        where = tf.constant(-1, tf.int64) if position is None else tf.cast(position, tf.int64)
        # The standard normals do not depend on the release, so they are drawn first and can
        # overlap with the host stage; the release's standard deviations scale them after.
        normals = [self.backend.standard_normal(s, generator=self.generator) for s in sums]
        squared = [tf.reduce_sum(tf.square(tf.cast(s, tf.float64))) for s in sums]
        stddevs = tf.numpy_function(
            self._host_release,
            [tf.cast(num_records, tf.int64), where, *squared],
            tf.float64,
            stateful=True,
            name="dp_release",
        )
        stddevs.set_shape([len(sums)])
        dependencies = [stddevs]
        if self.bias_callback is not None:
            with tf.control_dependencies([stddevs]):
                token = tf.numpy_function(
                    self._host_bias,
                    [
                        tf.cast(num_records, tf.int64),
                        norms,
                        num_clipped,
                        *unclipped,
                        *sums,
                    ],
                    tf.int64,
                    stateful=True,
                    name="dp_bias_metrics",
                )
            dependencies.append(token)
        with tf.control_dependencies(dependencies):
            noised = [
                self.backend.add_scaled_noise(s, normals[j], stddev=stddevs[j])
                for j, s in enumerate(sums)
            ]
        return CoreStep.average(noised, event=self.events.event, backend=self.backend)

    def gradients(
        self, inputs: Any, targets: Any, sample_weight: Any = None, position: Any = None
    ) -> tuple[list[tf.Tensor], dict[str, Any]]:
        """Stages 1–5 for one replica (no ``tf.distribute``): the averaged noised gradients."""
        out = self.clip_replica(inputs, targets, sample_weight)
        grads = self.release(
            out["sums"],
            out["num_records"],
            unclipped=out.get("unclipped"),
            norms=out.get("norms"),
            num_clipped=out.get("num_clipped"),
            position=position,
        )
        return grads, out

    def reraise(self, exc: BaseException) -> None:
        """Raise the typed error a host stage stored, from the TensorFlow error ``exc``."""
        stored = self.take_error()
        if stored is not None:
            raise stored from exc
        raise exc
