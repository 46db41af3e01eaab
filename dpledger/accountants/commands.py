"""``dpledger epsilon`` (post-hoc ε of a ledger file) and ``dpledger calibrate``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from typing import Any

from dpledger.accountants.base import (
    ACCOUNTANT_MODULES,
    SCHEME_SPECIFIC_ACCOUNTANTS,
    PrivacyResult,
    make_accountant,
)
from dpledger.accountants.bucketing import check_bucketing
from dpledger.accountants.display import curve_style, format_rounded
from dpledger.errors import (
    DeltaTooLargeWarning,
    DPLedgerError,
    InvalidParameterError,
    UnsupportedLedgerError,
)
from dpledger.ledger.commands import (
    add_ledger_checks,
    load_for_command,
    print_warnings,
    provenance_warnings,
)
from dpledger.ledger.provenance import provenance_of, provenance_text
from dpledger.validation import (
    check_delta,
    check_positive_finite,
    check_positive_int,
    check_probability,
    delta_too_large_message,
)

__all__ = ["accountant_names", "add_accounting_arguments", "register"]

_DEFAULT_CURVE_POINTS = 50
MAX_CURVE_POINTS = 1000  # each point is one more accountant evaluation


def add_accounting_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a command that states a ledger file's ε at δ: ``LEDGER``, ``--delta``
    and ``--accountant`` (the names :func:`accountant_names` reads)."""
    parser.add_argument("ledger", metavar="LEDGER", help="path of the ledger file")
    parser.add_argument("--delta", type=float, required=True, help="δ in (0, 1), e.g. 1e-5")
    parser.add_argument(
        "--accountant",
        default="all",
        help="comma-separated accountant names (" + ",".join(ACCOUNTANT_MODULES) + ") or 'all'",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``epsilon`` and ``calibrate`` commands to the ``dpledger`` parser."""
    eps = subparsers.add_parser(
        "epsilon",
        help="compute (ε, δ) of a ledger file with one or more accountants",
        description=(
            "Replay a ledger file with privacy accountants and print one row per accountant: "
            "ε, what kind of number it is (upper_bound, estimate, approximation), certified "
            "bounds, time and warnings. Only upper_bound values (or a PRV upper bound) are "
            "valid DP guarantees."
        ),
    )
    add_accounting_arguments(eps)
    eps.add_argument("--json", action="store_true", help="print one JSON object per accountant")
    eps.add_argument(
        "--curve",
        type=int,
        metavar="N",
        help="also compute ε after N evenly spaced step counts, 1 <= N <= "
        f"{MAX_CURVE_POINTS} (printed, or drawn with --plot)",
    )
    eps.add_argument(
        "--plot",
        metavar="FILE.png",
        help=f"draw ε against steps for each accountant (needs matplotlib; N defaults to "
        f"{_DEFAULT_CURVE_POINTS})",
    )
    eps.add_argument(
        "--bucketing",
        type=float,
        metavar="R",
        help="conservative bucketing precision in (0, 1) passed to every accountant (e.g. 1e-3)",
    )
    add_ledger_checks(eps)
    eps.set_defaults(func=_epsilon)

    cal = subparsers.add_parser(
        "calibrate",
        help="find the noise multiplier, sampling probability or steps that meet a target ε",
        description=(
            "Give --target-epsilon, --delta and exactly two of --noise-multiplier, "
            "--sampling-probability and --steps; the third is solved for: the smallest noise "
            "multiplier, the largest sampling probability or the largest number of steps whose "
            "ε (a valid upper bound) is at most the target."
        ),
    )
    cal.add_argument("--target-epsilon", type=float, required=True, help="the ε to meet")
    cal.add_argument("--delta", type=float, required=True, help="δ in (0, 1)")
    cal.add_argument("--noise-multiplier", type=float, help="z = σ̃ / S of every step")
    cal.add_argument("--sampling-probability", type=float, help="q of every step")
    cal.add_argument("--steps", type=int, help="number of steps T")
    cal.add_argument(
        "--accountant",
        default="prv",
        help="accountant name (default prv: its certified upper bound, the tightest valid ε)",
    )
    cal.add_argument(
        "--neighboring",
        default="add_remove",
        choices=["add_remove", "replace_one"],
        help="neighboring relation (default add_remove)",
    )
    cal.add_argument(
        "--allow-approximation",
        action="store_true",
        help="accept an accountant's approximation (e.g. GDP's CLT); the result is labelled",
    )
    cal.add_argument(
        "--population-size",
        type=int,
        help="n, the number of records the run protects (warns when δ ≥ 1/n)",
    )
    cal.add_argument("--json", action="store_true", help="print one JSON object")
    cal.set_defaults(func=_calibrate)


# --------------------------------------------------------------------------- epsilon
def accountant_names(spec: str) -> list[str]:
    """The accountants a comma-separated ``--accountant`` value names (``all``: every one).

    Raises:
        InvalidParameterError: an unknown name, or none.
    """
    names = [n.strip() for n in str(spec).split(",") if n.strip()]
    if names == ["all"]:
        return list(ACCOUNTANT_MODULES)
    if not names:
        raise InvalidParameterError("accountant", spec, "accountant names or 'all'")
    for n in names:
        if n not in ACCOUNTANT_MODULES:
            valid = ", ".join(ACCOUNTANT_MODULES)
            raise InvalidParameterError("accountant", n, f"one of {valid}, or 'all'")
    return names


def _curve_steps(total: int, points: int) -> list[int]:
    return sorted({max(1, round(total * (i + 1) / points)) for i in range(points)})


_fmt = format_rounded  # six significant digits, rounded toward the safe side when asked


def _bound_rounding(kind: str) -> str | None:
    """How to round a result's ε for display: up for an upper bound, to nearest otherwise."""
    return "up" if kind == "upper_bound" else None


def _epsilon(args: argparse.Namespace) -> int:
    # Every option is checked before the ledger is read or an accountant runs.
    delta = check_delta("delta", args.delta)
    names = accountant_names(args.accountant)
    points = args.curve
    if points is None and args.plot:
        points = _DEFAULT_CURVE_POINTS
    if points is not None and not 1 <= points <= MAX_CURVE_POINTS:
        raise InvalidParameterError(
            "curve", points, f"a number of points from 1 to {MAX_CURVE_POINTS}"
        )
    if args.bucketing is not None:
        check_bucketing(args.bucketing)
    if args.plot:
        _check_plot_path(args.plot)
    loaded, notes, problem = load_for_command(
        args.ledger, strict=args.strict, require_closed=args.require_closed
    )
    if problem is not None:
        print(f"dpledger epsilon: verification failed: {problem}", file=sys.stderr)
        return 1
    if not loaded.closed_cleanly and loaded.torn_tail is None:
        notes.append(
            f"{args.ledger}: the ledger does not end with a close marker (its writer crashed or "
            "is still running, or its final lines were deleted): ε is that of the steps it holds "
            "(--require-closed refuses such a ledger)"
        )
    notes.extend(provenance_warnings(loaded))
    sizes = [n for n in loaded.population_sizes if n is not None]
    too_large = delta_too_large_message(delta, max(sizes)) if sizes else None
    if too_large is not None:
        notes.append(too_large)
    print_warnings("epsilon", notes)
    ledger = loaded.compressed()
    sampling_notes = _sampling_notes(ledger, delta)
    if args.accountant.strip() == "all":  # a scheme's own accountant only where it applies
        names = [
            n
            for n in names
            if n not in SCHEME_SPECIFIC_ACCOUNTANTS
            or SCHEME_SPECIFIC_ACCOUNTANTS[n] in ledger.schemes
        ]
    steps = _curve_steps(ledger.num_steps, points) if points and ledger.num_steps else []
    settings = {} if args.bucketing is None else {"bucketing": args.bucketing}
    rows: list[dict[str, Any]] = []
    curves: dict[str, list[PrivacyResult]] = {}
    for name in names:
        try:
            acc = make_accountant(name, **settings)
        except ImportError as exc:
            print(f"note: {name}: not available in this installation ({exc})", file=sys.stderr)
            continue
        except TypeError:
            print(f"note: {name}: does not take the setting(s) {settings}", file=sys.stderr)
            continue
        try:
            with warnings.catch_warnings():  # warned about once, above
                warnings.simplefilter("ignore", DeltaTooLargeWarning)
                result = acc.epsilon(ledger, delta=delta)
                if steps:
                    curves[name] = list(acc.epsilon_curve(ledger, delta=delta, steps=steps))
        except UnsupportedLedgerError as exc:
            rows.append(_error_row(name, delta, str(exc)))
            continue
        except DPLedgerError as exc:
            if len(names) == 1:
                raise  # the one accountant asked for: its refusal is the command's error
            # beyond its budget or its arithmetic: that accountant's row, as `report` shows it
            rows.append(_error_row(name, delta, f"could not compute: {exc}"))
            continue
        row = result.to_dict()
        if steps:
            row["curve"] = [
                {"steps": r.num_steps, "epsilon": r.to_dict()["epsilon"]} for r in curves[name]
            ]
        rows.append(row)
    noise_lines = provenance_text(provenance_of(loaded.notes))
    if args.json:
        for row in rows:
            row["ledger_warnings"] = notes
            row["sampling_notes"] = sampling_notes
            row["noise_provenance"] = noise_lines
            print(json.dumps(row, sort_keys=True))
    else:
        torn = loaded.torn_tail
        prefix = (
            "" if torn is None else f" (the valid prefix: line {torn.line_number} is cut short)"
        )
        if ledger.correlated:
            prefix += f" and {len(ledger.correlated)} correlated-noise release(s)"
        _print_table(rows, ledger.num_steps, delta, prefix)
        for note in sampling_notes:
            print(f"sampling: {note}")
        for line in noise_lines:
            print(f"noise: {line}")
        if steps and not args.plot:
            _print_curves(curves)
    if args.plot and curves:
        _plot(curves, args.plot, delta)
        if not args.json:
            print(f"plot written to {args.plot}")
    # as `dpledger report`: 0 when some accountant answered, 2 when every one refused
    ok = any("error" not in row for row in rows)
    return 0 if ok else 2


def _sampling_notes(ledger: Any, delta: float) -> list[str]:
    """What the ledger's sampling schemes mean for the numbers (empty for Poisson ledgers)."""
    from dpledger.accountants.sampling_report import shuffle_gap

    events = ledger.sampling_events()
    if not events:
        return []
    notes = ["this ledger's steps were sampled by " + "; ".join(e.describe() for e in events)]
    gap = shuffle_gap(ledger, delta=delta)
    if gap is not None:
        notes.append(gap.describe())
    return notes


def _error_row(name: str, delta: float, message: str) -> dict[str, Any]:
    return {
        "accountant": name,
        "epsilon": None,
        "delta": delta,
        "kind": None,
        "lower": None,
        "upper": None,
        "upper_confidence": None,
        "confidence": None,
        "seconds": None,
        "warnings": [],
        "error": message,
    }


def _print_table(rows: list[dict[str, Any]], num_steps: int, delta: float, prefix: str) -> None:
    print(f"{num_steps} steps{prefix}, δ = {delta!r}")
    header = f"{'accountant':<10}  {'epsilon':>10}  {'kind':<13}  {'lower':>10}  {'upper':>10}"
    print(f"{header}  {'seconds':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['accountant']:<10}  refused: {row['error']}")
            continue
        print(
            f"{row['accountant']:<10}  "
            f"{_fmt(_num(row['epsilon']), _bound_rounding(row['kind'])):>10}  {row['kind']:<13}  "
            f"{_fmt(_num(row['lower']), 'down'):>10}  {_fmt(_num(row['upper']), 'up'):>10}  "
            f"{row['seconds']:>8.3f}"
        )
        if row.get("upper_confidence") is not None:
            print(f"{'':<10}  {_confidence_line(row)}")
        for w in row["warnings"]:
            print(f"{'':<10}  warning: {w}")


def _confidence_line(row: dict[str, Any]) -> str:
    """The Monte-Carlo bound of a row, apart from the certified ``upper`` column."""
    shown = _fmt(_num(row["upper_confidence"]), "up")
    return (
        f"Monte-Carlo bound: {row['quantity']} <= {shown} with probability "
        f"{row['confidence']:g} over the random draws (not certified)"
    )


def _num(x: Any) -> float | None:
    if x is None:
        return None
    if x == "inf":
        return math.inf
    return float(x)


def _print_curves(curves: dict[str, list[PrivacyResult]]) -> None:
    for name, results in curves.items():
        print(f"\n{name}: ε after t steps")
        for r in results:
            shown = _fmt(r.epsilon, _bound_rounding(r.kind.value))
            print(f"  {r.num_steps:>10}  {shown:>10}  {r.kind.value}")


def _check_plot_path(path: str) -> None:
    """Refuse a ``--plot`` file that cannot be written, before any accountant runs."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise DPLedgerError(
            "--plot needs matplotlib, which is not installed: pip install 'dpledger[plot]'"
        ) from None
    if "\x00" in path or not path:
        raise InvalidParameterError("plot", path, "the path of an image file to write")
    if os.path.isdir(path):
        raise InvalidParameterError("plot", path, "a file path, not a directory")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise InvalidParameterError(
            "plot", path, f"a file in an existing directory ({folder!r} is not one)"
        )
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise InvalidParameterError("plot", path, "a file this user may write")
    suffix = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise InvalidParameterError(
            "plot", path, f"a file name ending in one of .{', .'.join(sorted(formats))}"
        )


def _plot(curves: dict[str, list[PrivacyResult]], path: str, delta: float) -> None:
    import matplotlib.pyplot as plt

    fig = epsilon_figure(curves, delta)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def epsilon_figure(curves: dict[str, list[PrivacyResult]], delta: float) -> Any:
    """The matplotlib figure of ``dpledger epsilon --plot``: ε against steps, one curve per
    accountant in the report's style (:func:`~dpledger.accountants.display.curve_style`: its
    own colour, line style and marker, so that coinciding curves stay visible; the GDP
    approximation dashed and labelled as giving no guarantee)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, results in curves.items():
        xs = [r.num_steps for r in results]
        ys = [r.epsilon for r in results]
        kinds = sorted({r.kind.value for r in results})
        style, label = curve_style(name, kinds[0] if len(kinds) == 1 else ", ".join(kinds))
        ax.plot(xs, ys, label=label, linewidth=1.8, **style)
    ax.set_xlabel("steps")
    ax.set_ylabel(f"ε at δ = {delta!r}")
    ax.set_title("Privacy spent along the ledger")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- calibrate
def _calibrate(args: argparse.Namespace) -> int:
    from dpledger.accountants import calibration

    given = {
        "noise_multiplier": args.noise_multiplier,
        "sampling_probability": args.sampling_probability,
        "steps": args.steps,
    }
    missing = [k for k, v in given.items() if v is None]
    if len(missing) != 1:
        raise InvalidParameterError(
            "arguments",
            sorted("--" + k.replace("_", "-") for k, v in given.items() if v is not None),
            "exactly two of --noise-multiplier, --sampling-probability and --steps",
        )
    # Every option is checked before the search starts.
    check_positive_finite("target_epsilon", args.target_epsilon)
    check_delta("delta", args.delta)
    if args.noise_multiplier is not None:
        check_positive_finite("noise_multiplier", args.noise_multiplier)
    if args.sampling_probability is not None and not (
        check_probability("sampling_probability", args.sampling_probability) > 0.0
    ):
        raise InvalidParameterError(
            "sampling_probability", args.sampling_probability, "q in (0, 1]"
        )
    if args.steps is not None:
        check_positive_int("steps", args.steps)
    if args.population_size is not None:
        n = check_positive_int("population_size", args.population_size)
        too_large = delta_too_large_message(args.delta, n)
        if too_large is not None:
            print_warnings("calibrate", [too_large])
    common = {
        "target_epsilon": args.target_epsilon,
        "delta": args.delta,
        "accountant": _single_accountant(args.accountant),
        "neighboring": args.neighboring,
        "allow_approximation": args.allow_approximation,
    }
    if missing == ["noise_multiplier"]:
        result = calibration.calibrate_noise_multiplier(
            sampling_probability=args.sampling_probability, steps=args.steps, **common
        )
    elif missing == ["sampling_probability"]:
        result = calibration.calibrate_sampling_probability(
            noise_multiplier=args.noise_multiplier, steps=args.steps, **common
        )
    else:
        result = calibration.calibrate_steps(
            noise_multiplier=args.noise_multiplier,
            sampling_probability=args.sampling_probability,
            **common,
        )
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=True))
        return 0
    label = result.parameter.replace("_", " ")
    # Shown rounded towards the safe side: more noise, a smaller q, a larger ε.
    towards = {"noise_multiplier": "up", "sampling_probability": "down"}
    value = (
        f"{result.value}"
        if result.parameter == "steps"
        else _fmt(result.value, towards[result.parameter])
    )
    print(f"{label}: {value}")
    print(
        f"  ε = {_fmt(result.epsilon, _bound_rounding(result.kind.value))} ≤ "
        f"{result.target_epsilon:g} at δ = {result.delta:g} "
        f"({result.accountant}, {result.kind.value}); "
        f"q = {_fmt(result.sampling_probability, 'down')}, "
        f"z = {_fmt(result.noise_multiplier, 'up')}, T = {result.steps}; "
        f"{result.evaluations} evaluations, {result.seconds:.2f} s"
    )
    for w in result.warnings:
        print(f"  warning: {w}")
    return 0


def _single_accountant(spec: str) -> str:
    names = accountant_names(spec)
    if spec.strip() == "all" or len(names) != 1:
        raise InvalidParameterError("accountant", spec, "a single accountant name for calibrate")
    return names[0]
