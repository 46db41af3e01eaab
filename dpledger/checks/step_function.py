"""What the PyTorch and Keras conveniences share: a harness around a user's DP step function, with
optional σ = 0 warm-up steps, and the run of the checks on it.

The user supplies a *step function* with the signature ::

    step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator) -> None

that performs one DP step on the batch (x, y) in place, and a ``model_factory()``. A framework
module (:mod:`dpledger.checks.torch_step`, :mod:`dpledger.checks.keras_step`) subclasses
:class:`StepFunctionHarness` with the few framework-specific operations (copying the model,
converting arrays, flattening the parameters, per-example losses, the noise generator) and binds
a :class:`StepFunctionChecks` to the subclass, whose methods are the framework's
``check_dp_optimizer``, ``check_dp_sgd`` and ``assert_dp_sgd_correct``: the two frameworks
share one driver. This module imports no framework.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dpledger.checks.checker import CHECK_NAMES, DPSGDChecker
from dpledger.checks.config import CheckConfig
from dpledger.checks.report import CheckReport
from dpledger.checks.step_harness import StepOutcome
from dpledger.checks.synthetic_data import LabelKind, LossKind, ordinary_batch
from dpledger.errors import InvalidParameterError
from dpledger.validation import check_non_negative_int, check_positive_finite

__all__ = [
    "StepFunction",
    "StepFunctionChecks",
    "StepFunctionHarness",
    "assert_checks_pass",
]

StepFunction = Callable[..., Any]
"""``step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator) -> None``."""


class StepFunctionHarness(abc.ABC):
    """A :class:`~dpledger.checks.step_harness.StepHarness` for a DP step function.

    Every :meth:`run` starts from the starting model (:meth:`_starting_model`), builds its step
    with ``make_step(model)`` (a fresh optimiser state), replays the warm-up steps (σ = 0,
    C = ``warmup_clip_norm``, a fixed batch of ordinary points) and then runs the measured steps;
    the starting model is never changed. A framework subclass implements the model operations.

    Args:
        make_step: ``make_step(model) -> step``; the step has the signature of the module
            docstring. For a stateless step, ``lambda model: step``.
        model_factory: returns a fresh model (called once, under ``init_seed``).
        input_shape: shape of one input.
        loss: ``"mse"`` or ``"cross_entropy"`` (per-example losses are computed with it).
        labels: ``"soft"`` or ``"hard"`` cross-entropy targets.
        lr: learning rate passed to the step.
        dtype: the model's floating dtype, one of :attr:`dtypes` (None: :attr:`default_dtype`).
        init_seed: seed of the model's initialisation and of the warm-up batch.
        warmup_steps: σ = 0 steps taken before each measured step.
        warmup_clip_norm: C of the warm-up steps.
        warmup_batch_size: size of the warm-up batch.
    """

    dtypes: tuple[Any, ...] = ()
    """The accepted model dtypes (single and double precision)."""
    default_dtype: Any = None
    """The dtype when none is given (double precision, so that loss changes are resolved)."""
    index_dtype: Any = None
    """The framework's int64 dtype, of class-index targets."""

    @classmethod
    def report_settings(cls, dtype: Any) -> dict[str, Any]:
        """The framework's entries in the report's settings for a model in ``dtype``."""
        return {"dtype": str(dtype)}

    def __init__(
        self,
        make_step: Callable[[Any], StepFunction],
        model_factory: Callable[[], Any],
        *,
        input_shape: Sequence[int],
        loss: str | LossKind,
        labels: str | LabelKind = "soft",
        lr: float,
        dtype: Any = None,
        init_seed: int = 0,
        warmup_steps: int = 0,
        warmup_clip_norm: float = 1.0,
        warmup_batch_size: int = 8,
    ) -> None:
        if not callable(make_step):
            raise InvalidParameterError("make_step", make_step, "a callable")
        if not callable(model_factory):
            raise InvalidParameterError("model_factory", model_factory, "a callable")
        dtype = self.default_dtype if dtype is None else dtype
        if dtype not in self.dtypes:
            raise InvalidParameterError("dtype", dtype, " or ".join(map(repr, self.dtypes)))
        self._make_step = make_step
        self._loss = LossKind.parse(loss)
        self._labels = LabelKind.parse(labels)
        self._lr = check_positive_finite("lr", lr)
        self._dtype = dtype
        self._input_shape = tuple(int(s) for s in input_shape)
        self._warmup_steps = check_non_negative_int("warmup_steps", warmup_steps)
        self._warmup_clip = check_positive_finite("warmup_clip_norm", warmup_clip_norm)
        self._warm_batch: tuple[Any, Any] | None = None
        self._set_up(model_factory, int(init_seed))
        self._start = self._snapshot(self._base_model())
        if self._warmup_steps:
            wx, wy = ordinary_batch(
                input_shape=self._input_shape,
                num_outputs=self._num_outputs(),
                batch_size=warmup_batch_size,
                loss=self._loss,
                labels=self._labels,
                rng=np.random.default_rng([int(init_seed), 99]),
            )
            self._warm_batch = (self._inputs(wx), self._targets(wy))
            warmed, _ = self._fresh()
            self._start = self._snapshot(warmed)

    # ------------------------------------------------------------ framework operations
    @abc.abstractmethod
    def _set_up(self, model_factory: Callable[[], Any], init_seed: int) -> None:
        """Build the model with ``model_factory()`` under ``init_seed`` in ``self._dtype`` and
        check it (raise :class:`InvalidParameterError` for a bad one)."""

    @abc.abstractmethod
    def _base_model(self) -> Any:
        """The model as built."""

    @abc.abstractmethod
    def _snapshot(self, model: Any) -> Any:
        """What :meth:`predict` needs to reproduce ``model``'s current state later."""

    @abc.abstractmethod
    def _num_outputs(self) -> int:
        """Output dimension of the model as built."""

    @abc.abstractmethod
    def _starting_model(self) -> Any:
        """A model in the initial state, which the step may change."""

    @abc.abstractmethod
    def _tensor(self, array: np.ndarray, dtype: Any) -> Any:
        """``array`` as the framework's tensor of ``dtype``."""

    def _inputs(self, x: np.ndarray) -> Any:
        """Inputs as the framework's tensor in the model's dtype."""
        return self._tensor(np.asarray(x), self._dtype)

    def _targets(self, y: np.ndarray) -> Any:
        """Targets as the framework's tensor: int64 class indices or the model's dtype."""
        arr = np.asarray(y)
        if np.issubdtype(arr.dtype, np.integer):
            return self._tensor(arr, self.index_dtype)
        return self._tensor(arr, self._dtype)

    @abc.abstractmethod
    def _flat(self, model: Any) -> np.ndarray:
        """The trainable parameters of ``model``, flattened."""

    @abc.abstractmethod
    def _losses(self, model: Any, x: Any, y: Any, y_array: np.ndarray) -> np.ndarray:
        """Per-example losses (B,) of ``model`` on the converted batch (x, y); ``y_array`` is
        the target array before conversion."""

    @abc.abstractmethod
    def _generator(self, seed: int) -> Any:
        """The framework's random generator seeded with ``seed``."""

    @abc.abstractmethod
    def _before_step(self, model: Any) -> None:
        """Called before every step (e.g. to put the model in training mode)."""

    @abc.abstractmethod
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Outputs of the starting model (after warm-up)."""

    # ------------------------------------------------------------ shared driver
    def _take_step(
        self,
        step: StepFunction,
        model: Any,
        x: Any,
        y: Any,
        *,
        l2_norm_bound: float,
        noise_multiplier: float,
        generator: Any,
    ) -> None:
        self._before_step(model)
        step(
            model,
            x,
            y,
            l2_norm_bound=l2_norm_bound,
            noise_multiplier=noise_multiplier,
            lr=self._lr,
            generator=generator,
        )

    def _fresh(self) -> tuple[Any, StepFunction]:
        """The starting model with a new step, after the warm-up steps."""
        model = self._starting_model()
        step = self._make_step(model)
        if self._warm_batch is not None:
            wx, wy = self._warm_batch
            for t in range(self._warmup_steps):
                self._take_step(
                    step,
                    model,
                    wx,
                    wy,
                    l2_norm_bound=self._warmup_clip,
                    noise_multiplier=0.0,
                    generator=self._generator(t),
                )
        return model, step

    def run(
        self,
        x: np.ndarray,
        y: np.ndarray,
        *,
        l2_norm_bound: float,
        noise_multiplier: float,
        seed: int,
        num_steps: int = 1,
    ) -> StepOutcome:
        """Start afresh, warm up, take ``num_steps`` steps; see ``StepHarness``."""
        model, step = self._fresh()
        xt, yt = self._inputs(x), self._targets(y)
        before = self._flat(model)
        losses_before = self._losses(model, xt, yt, y)
        generator = self._generator(int(seed))
        for _ in range(num_steps):
            self._take_step(
                step,
                model,
                xt,
                yt,
                l2_norm_bound=l2_norm_bound,
                noise_multiplier=noise_multiplier,
                generator=generator,
            )
        return StepOutcome(
            params_before=before,
            params_after=self._flat(model),
            losses_before=losses_before,
            losses_after=self._losses(model, xt, yt, y),
        )


class StepFunctionChecks:
    """The checks of a framework's DP step functions: one driver for PyTorch and Keras.

    A framework module binds one instance to its :class:`StepFunctionHarness` subclass and
    exports its methods as module functions (``check_dp_optimizer``, ``check_dp_sgd``,
    ``assert_dp_sgd_correct``), so that the frameworks differ only in their harness.

    Args:
        harness_type: the framework's :class:`StepFunctionHarness` subclass.
    """

    def __init__(self, harness_type: type[StepFunctionHarness]) -> None:
        if not (isinstance(harness_type, type) and issubclass(harness_type, StepFunctionHarness)):
            raise InvalidParameterError(
                "harness_type", harness_type, "a StepFunctionHarness subclass"
            )
        self.harness_type = harness_type

    def check_dp_optimizer(
        self,
        make_step: Callable[[Any], StepFunction],
        model_factory: Callable[[], Any],
        *,
        loss: str,
        input_shape: Sequence[int],
        dtype: Any = None,
        labels: str = "soft",
        lr: float = 0.01,
        plain_sgd: bool = False,
        warmup_steps: int = 5,
        warmup_clip_norm: float = 1.0,
        denominator: str | float = "batch",
        noise_multiplier: float | None = None,
        seed: int = 0,
        config: CheckConfig | None = None,
        checks: Sequence[str] = CHECK_NAMES,
    ) -> CheckReport:
        """Check a DP step whose optimiser keeps state (momentum, Adam, …).

        ``make_step(model)`` returns a step function (signature in the module docstring) bound
        to a fresh optimiser for ``model``; it is called once per experiment on a copy of the
        starting model, followed by ``warmup_steps`` σ = 0 steps on a fixed batch so that the
        optimiser state is non-zero (appendix E). With ``plain_sgd=False`` (the default) the
        magnitude test is skipped and σ is chosen by the appendix-B search unless
        ``noise_multiplier`` is given.

        Args:
            make_step: builds the step for one model copy.
            model_factory: returns a fresh model of the framework (a ``torch.nn.Module``, a
                ``keras.Model``); called once under ``seed``.
            loss: ``"mse"`` or ``"cross_entropy"`` — the loss the step minimises.
            input_shape: shape of one input.
            dtype: the model's dtype in the framework's terms (``torch.float64`` or
                ``torch.float32``; the Keras floatx name ``"float64"`` or ``"float32"``); None:
                double precision.
            labels: ``"soft"`` (probability targets, exact zero-gradient fillers) or ``"hard"``.
            lr: learning rate passed to the step.
            plain_sgd: True if the update is −(lr/D)·(noisy clipped sum).
            warmup_steps: σ = 0 steps before each measured step.
            warmup_clip_norm: C of the warm-up steps.
            denominator: what the step divides the noisy sum by: ``"batch"`` or a number.
            noise_multiplier: σ of the noise checks (None: see above).
            seed: seeds the model initialisation, the synthetic data and the noise.
            config: grids and thresholds (:class:`~dpledger.checks.config.CheckConfig`).
            checks: which checks to run.

        Returns:
            The :class:`~dpledger.checks.report.CheckReport`; its settings add ``learning_rate``,
            the framework's entries and (unless ``plain_sgd``) ``warmup_steps``.
        """
        harness_type = self.harness_type
        dtype = harness_type.default_dtype if dtype is None else dtype
        harness = harness_type(
            make_step,
            model_factory,
            input_shape=input_shape,
            loss=loss,
            labels=labels,
            lr=lr,
            dtype=dtype,
            init_seed=seed,
            warmup_steps=warmup_steps,
            warmup_clip_norm=warmup_clip_norm,
        )
        checker = DPSGDChecker(
            harness,
            input_shape=input_shape,
            loss=loss,
            labels=labels,
            learning_rate=lr if plain_sgd else None,
            denominator=denominator,
            plain_sgd=plain_sgd,
            noise_multiplier=noise_multiplier,
            seed=seed,
            config=config,
        )
        report = checker.run(checks)
        settings = {**report.settings, "learning_rate": lr, **harness_type.report_settings(dtype)}
        if not plain_sgd:
            settings["warmup_steps"] = warmup_steps
        return CheckReport(results=report.results, settings=settings)

    def check_dp_sgd(
        self, step: StepFunction, model_factory: Callable[[], Any], **kwargs: Any
    ) -> CheckReport:
        """Run the four DP-SGD implementation-bug checks on a plain-SGD step function.

        Args:
            step: ``step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator)``: one
                DP step in place, dividing the noisy clipped sum by ``denominator``.
            model_factory: returns a fresh model of the framework; called once under ``seed``.
            **kwargs: ``loss`` (``"mse"`` or ``"cross_entropy"``, the loss the step minimises)
                and ``input_shape`` (shape of one input), both required; ``labels``
                (``"soft"`` or ``"hard"`` cross-entropy targets; soft ones give exact
                zero-gradient fillers, and the step must accept probability targets), ``lr``
                (0.01; small keeps one-step loss changes first-order), ``denominator``
                (``"batch"`` if the step divides by the realised batch size, else the fixed
                number it divides by, e.g. the expected batch size q·n), ``noise_multiplier``
                (default 1.0), ``dtype``, ``seed``, ``config`` and ``checks``.

        Returns:
            The :class:`~dpledger.checks.report.CheckReport`.
        """
        if not callable(step):
            raise InvalidParameterError("step", step, "a callable")
        return self.check_dp_optimizer(
            lambda _model: step, model_factory, plain_sgd=True, warmup_steps=0, **kwargs
        )

    def assert_dp_sgd_correct(
        self,
        step: StepFunction,
        model_factory: Callable[[], Any],
        *,
        allow_inconclusive: bool = False,
        **kwargs: Any,
    ) -> CheckReport:
        """Assert that a DP-SGD step passes every check; fail with the report's text.

        A one-liner for a test suite::

            def test_my_dp_step():
                assert_dp_sgd_correct(my_step, lambda: MyNet(), loss="mse", input_shape=(10,))

        Args:
            step: the step function, as for :meth:`check_dp_sgd`.
            model_factory: as for :meth:`check_dp_sgd`.
            allow_inconclusive: accept checks that could not decide.
            **kwargs: ``loss``, ``input_shape`` and the further keyword arguments of
                :meth:`check_dp_sgd`.

        Returns:
            The report, when it passed.

        Raises:
            AssertionError: a check failed (or was inconclusive); the message is the summary.
        """
        report = self.check_dp_sgd(step, model_factory, **kwargs)
        return assert_checks_pass(report, allow_inconclusive=allow_inconclusive)


def assert_checks_pass(report: CheckReport, *, allow_inconclusive: bool) -> CheckReport:
    """``report`` when every check passed (or, with ``allow_inconclusive``, could not decide).

    Raises:
        AssertionError: a check failed (or was inconclusive); the message is the summary.
    """
    report.assert_passed(allow_inconclusive=allow_inconclusive)
    return report
