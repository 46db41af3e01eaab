"""``dpledger check``: run the DP-SGD implementation-bug checks on a PyTorch step function.

    dpledger check mypkg.train:dp_step --loss cross_entropy --input-shape 20 --outputs 4

imports ``dp_step`` from ``mypkg.train`` (the current directory is searched first), builds the
model with ``--model module:factory`` or a small default MLP, runs the checks of
:mod:`dpledger.checks.torch_step` and prints the report. Exit status: 0 when no check failed,
1 when a check failed (also when one was inconclusive with ``--strict``), 2 on a usage error.
PyTorch is imported only when the command runs, by :mod:`dpledger.checks.torch_step`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from dpledger.checks.checker import CHECK_NAMES
from dpledger.errors import InvalidParameterError

__all__ = ["load_object", "register"]


def load_object(spec: str, *, parameter: str) -> Callable[..., Any]:
    """Import ``module:attribute`` (dotted attributes allowed) and return it; it must be callable.

    The current working directory is put on ``sys.path`` if it is not there, so that a script's
    module next to the caller can be named.

    Raises:
        InvalidParameterError: the spec is malformed, the import fails or the object is not
            callable.
    """
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise InvalidParameterError(parameter, spec, "'module:function'")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidParameterError(
            parameter, spec, f"an importable module ({type(exc).__name__}: {exc})"
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InvalidParameterError(
                parameter, spec, f"a name defined in module {module_name!r}"
            ) from None
    if not callable(obj):
        raise InvalidParameterError(parameter, spec, "a callable")
    return obj


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid shape {text!r}: use e.g. 20 or 1,28,28"
        ) from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"invalid shape {text!r}: positive integers needed")
    return shape


def _denominator(text: str) -> str | float:
    if text == "batch":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid denominator {text!r}: 'batch' or a number"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"invalid denominator {text!r}: must be > 0")
    return value


def _checks(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [n for n in names if n not in CHECK_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown check(s) {', '.join(bad) or text!r}: choose from {', '.join(CHECK_NAMES)}"
        )
    return names


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``dpledger check`` to the ``dpledger`` parser."""
    p = subparsers.add_parser(
        "check",
        help="check a PyTorch DP-SGD step function for implementation bugs",
        description=(
            "Run the DP-SGD implementation-bug checks (clipping applied, per-example clipping, "
            "noise calibrated to C, noise magnitude) on STEP, a function "
            "step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator) that performs "
            "one DP step in place. Exit status 0: no check failed; 1: a check failed."
        ),
    )
    p.add_argument("step", metavar="STEP", help="the step function as module:function")
    p.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="zero-argument function returning the torch.nn.Module (default: a small MLP)",
    )
    p.add_argument("--loss", choices=("mse", "cross_entropy"), default="mse")
    p.add_argument(
        "--labels",
        choices=("soft", "hard"),
        default="soft",
        help="cross-entropy targets as probabilities (soft) or class indices (hard)",
    )
    p.add_argument(
        "--input-shape", type=_shape, default=(10,), help="shape of one input, e.g. 20 or 1,28,28"
    )
    p.add_argument(
        "--outputs", type=int, default=3, help="outputs of the default MLP (classes for CE)"
    )
    p.add_argument("--lr", type=float, default=0.01, help="learning rate passed to the step")
    p.add_argument(
        "--denominator",
        type=_denominator,
        default="batch",
        help="what the step divides the noisy sum by: 'batch' (realised B) or a number",
    )
    p.add_argument("--noise-multiplier", type=float, default=None, help="σ of the noise checks")
    p.add_argument(
        "--stateful",
        action="store_true",
        help=(
            "STEP is a factory make_step(model) -> step owning a stateful optimiser (momentum, "
            "Adam): warm up, skip the magnitude test"
        ),
    )
    p.add_argument("--warmup-steps", type=int, default=5, help="warm-up steps with --stateful")
    p.add_argument("--float32", action="store_true", help="run the model in float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (1 is fastest for small models on a busy machine)",
    )
    p.add_argument(
        "--checks", type=_checks, default=CHECK_NAMES, help="comma-separated subset of checks"
    )
    p.add_argument("--plot", metavar="PATH", help="save the curves to an image (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--strict", action="store_true", help="also exit 1 when a check is inconclusive")
    p.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    step = load_object(args.step, parameter="step")
    factory = load_object(args.model, parameter="--model") if args.model else None
    if args.outputs < 1:
        raise InvalidParameterError("--outputs", args.outputs, "an integer >= 1")
    try:
        from dpledger.checks import torch_step
    except ImportError as exc:  # pragma: no cover - torch is installed in the test environment
        print(f"dpledger check: error: PyTorch is needed ({exc})", file=sys.stderr)
        return 2
    report = torch_step.run_for_command(
        step,
        factory,
        input_shape=args.input_shape,
        num_outputs=args.outputs,
        stateful=args.stateful,
        warmup_steps=args.warmup_steps,
        float32=args.float32,
        threads=args.threads,
        loss=args.loss,
        labels=args.labels,
        lr=args.lr,
        denominator=args.denominator,
        noise_multiplier=args.noise_multiplier,
        seed=args.seed,
        checks=args.checks,
    )
    if args.plot:
        report.plot(args.plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.summary())
        if args.plot:
            print(f"plot written to {args.plot}")
    bad = bool(report.failed) or (args.strict and bool(report.inconclusive))
    return 1 if bad else 0
