"""PyTorch convenience for the DP-SGD implementation-bug checks (imports torch).

The user supplies a *step function* with the signature ::

    step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator) -> None

that performs one DP step on the batch (x, y) in place — per-example gradients, clipping to
``l2_norm_bound`` (C), Gaussian noise of standard deviation ``noise_multiplier``·C drawn from
``generator`` (a seeded ``torch.Generator``), the update with learning rate ``lr`` — and a
``model_factory()`` returning a fresh ``torch.nn.Module``. :func:`check_dp_sgd` wraps them in a
:class:`TorchStepHarness` (the shared :class:`~dpledger.checks.step_function.StepFunctionHarness`
with PyTorch tensors) and runs :mod:`dpledger.checks.checker` on synthetic data:

    report = check_dp_sgd(step, lambda: MyNet(), loss="cross_entropy", input_shape=(20,))
    print(report.summary()); report.plot("checks.png")

For optimisers with state (momentum, Adam) use :func:`check_dp_optimizer`, whose ``make_step``
builds a fresh stateful step for each model copy; the state is warmed up with a few σ = 0 steps
before every measured step (appendix E of "Finding Private Bugs"). :func:`assert_dp_sgd_correct`
is the one-line assertion for a user's own test suite.

Models run in float64 by default so that one-step loss changes are resolved; pass
``dtype=torch.float32`` to check the step in single precision (losses are still evaluated in
float64 from the float32 parameters). A full run of the four checks takes about 110 steps on
batches of at most 32 synthetic points; for small models ``torch.set_num_threads(1)`` is much
faster on a busy machine (intra-op threads only add overhead at that size).

After the checks pass for a step, a test suite keeps them passing with one line::

    assert_dp_sgd_correct(step, model_factory, loss="mse", input_shape=(10,), denominator=16)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from dpledger.checks.report import CheckReport
from dpledger.checks.step_function import StepFunction, StepFunctionChecks, StepFunctionHarness
from dpledger.checks.synthetic_data import LossKind
from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_int

__all__ = [
    "STEP_CHECKS",
    "TorchStepHarness",
    "assert_dp_sgd_correct",
    "check_dp_optimizer",
    "check_dp_sgd",
    "default_mlp",
    "run_for_command",
]


def default_mlp(input_shape: Sequence[int], num_outputs: int, *, hidden: int = 16) -> Any:
    """A small MLP: flatten → Linear(prod(input_shape), hidden) → tanh → Linear(hidden, out)."""
    n_in = int(np.prod(tuple(int(s) for s in input_shape)))
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(n_in, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, int(num_outputs)),
    )


def _per_example_loss(out: Any, y: Any, loss: LossKind) -> Any:
    if loss is LossKind.MSE:
        return ((out - y) ** 2).reshape(out.shape[0], -1).mean(dim=1)
    if y.dtype in (torch.int64, torch.int32):
        return torch.nn.functional.cross_entropy(out, y, reduction="none")
    return -(y * torch.log_softmax(out, dim=-1)).sum(dim=-1)


class TorchStepHarness(StepFunctionHarness):
    """A :class:`~dpledger.checks.step_harness.StepHarness` for a PyTorch model and DP step.

    Every :meth:`run` deep-copies the starting model, builds its step with ``make_step(model)``,
    replays the warm-up steps and runs the measured steps; the starting model is never changed.
    The arguments are those of :class:`~dpledger.checks.step_function.StepFunctionHarness`;
    ``model_factory`` returns a ``torch.nn.Module`` and ``dtype`` is ``torch.float64`` (default)
    or ``torch.float32``.
    """

    dtypes = (torch.float32, torch.float64)
    default_dtype = torch.float64
    index_dtype = torch.int64

    def _set_up(self, model_factory: Callable[[], Any], init_seed: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            model = model_factory()
        if not isinstance(model, torch.nn.Module):
            raise InvalidParameterError(
                "model_factory", model_factory, "a callable returning a torch.nn.Module"
            )
        self._base = model.to(dtype=self._dtype)
        self._eval = copy.deepcopy(self._base).to(dtype=torch.float64).eval()
        self._names = [n for n, p in self._base.named_parameters() if p.requires_grad]
        if not self._names:
            raise InvalidParameterError("model_factory", model_factory, "a model with parameters")

    def _base_model(self) -> Any:
        return self._base

    def _snapshot(self, model: Any) -> Any:
        return model

    def _num_outputs(self) -> int:
        with torch.no_grad():
            probe = torch.zeros((1, *self._input_shape), dtype=self._dtype)
            return int(self._eval_forward(self._base, probe).shape[-1])

    def _starting_model(self) -> Any:
        return copy.deepcopy(self._base)

    def _tensor(self, array: np.ndarray, dtype: Any) -> Any:
        return torch.as_tensor(array, dtype=dtype)

    def _flat(self, model: Any) -> np.ndarray:
        params = dict(model.named_parameters())
        return torch.cat([params[n].detach().reshape(-1) for n in self._names]).cpu().numpy()

    def _eval_forward(self, model: Any, x: Any) -> Any:
        state = {
            k: v.detach().to(torch.float64) if v.is_floating_point() else v.detach()
            for k, v in model.state_dict().items()
        }
        return torch.func.functional_call(self._eval, state, (x.to(torch.float64),))

    def _losses(self, model: Any, x: Any, y: Any, y_array: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = self._eval_forward(model, x)
            yy = y if y.dtype == torch.int64 else y.to(torch.float64)
            return _per_example_loss(out, yy, self._loss).cpu().numpy()

    def _generator(self, seed: int) -> Any:
        return torch.Generator().manual_seed(seed)

    def _before_step(self, model: Any) -> None:
        model.train()

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Outputs of the starting model (after warm-up), in the model's dtype."""
        with torch.no_grad():
            out = self._eval_forward(self._start, self._inputs(x))
        return out.to(self._dtype).cpu().numpy()


STEP_CHECKS = StepFunctionChecks(TorchStepHarness)
"""The checks bound to :class:`TorchStepHarness`; the three functions below are its methods."""

check_dp_optimizer = STEP_CHECKS.check_dp_optimizer
check_dp_sgd = STEP_CHECKS.check_dp_sgd
assert_dp_sgd_correct = STEP_CHECKS.assert_dp_sgd_correct


def run_for_command(
    step: StepFunction,
    model_factory: Callable[[], Any] | None,
    *,
    input_shape: Sequence[int],
    num_outputs: int,
    stateful: bool,
    warmup_steps: int,
    float32: bool,
    threads: int | None,
    **kwargs: Any,
) -> CheckReport:
    """What ``dpledger check`` runs (kept here so that the command module imports no torch).

    Args:
        step: the step function, or with ``stateful`` the factory ``make_step(model)``.
        model_factory: the model factory; None builds :func:`default_mlp`.
        input_shape: shape of one input.
        num_outputs: outputs of the default MLP.
        stateful: check a stateful optimiser with :func:`check_dp_optimizer`.
        warmup_steps: warm-up steps for ``stateful``.
        float32: run the model in float32 instead of float64.
        threads: ``torch.set_num_threads`` value, or None to keep torch's default.
        **kwargs: further keyword arguments of :func:`check_dp_sgd`.
    """
    if threads is not None:
        torch.set_num_threads(check_positive_int("--threads", threads))
    if model_factory is None:
        shape, outputs = tuple(input_shape), int(num_outputs)

        def model_factory() -> Any:
            return default_mlp(shape, outputs)

    dtype = torch.float32 if float32 else torch.float64
    if stateful:
        return check_dp_optimizer(
            step,
            model_factory,
            input_shape=input_shape,
            warmup_steps=warmup_steps,
            plain_sgd=False,
            dtype=dtype,
            **kwargs,
        )
    return check_dp_sgd(step, model_factory, input_shape=input_shape, dtype=dtype, **kwargs)
