"""Wall time of the examples whose run time the README and the docs quote.

Each example runs as a user would run it (a fresh ``python`` process, imports included, in a
temporary directory so that the files it writes go nowhere), ``--repeats`` times; the median and
the range are printed with the command line, so that every quoted time can name its machine and
its command. The examples are the README's main demo (``torch_digits.py``), the Keras demo
(``keras_digits.py``), the Hugging Face example (``hf_text_classifier.py``) and the audit demo
(``audit_digits.py``, defaults and ``--quick``). Nothing is downloaded.

Run: ``PYTHONPATH=. python benchmarks/examples_wall_time.py`` (``--only torch_digits,keras_digits``
to time a subset; ``--repeats 1`` for one run each).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXAMPLES: dict[str, list[str]] = {
    "torch_digits": ["examples/torch_digits.py", "--ledger", "torch_digits.dpl"],
    "keras_digits": ["examples/keras_digits.py"],
    "hf_text_classifier": ["examples/hf_text_classifier.py", "--ledger", "bert.dpl"],
    "audit_digits_quick": ["examples/audit_digits.py", "--quick", "--out", "audit_out"],
    "audit_digits": ["examples/audit_digits.py", "--out", "audit_out"],
}
"""Name → the script and its arguments, relative to the repository root."""


def time_example(args: list[str]) -> float:
    """Seconds of wall time of one run of ``python <args>`` in a fresh temporary directory."""
    script = os.path.join(ROOT, args[0])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-W", "ignore", script, *args[1:]],
            cwd=work,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return time.perf_counter() - start


def main() -> None:
    """Time the chosen examples and print one line each: median, range, command."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(EXAMPLES), help="comma-separated names")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    names = [n for n in opts.only.split(",") if n]
    unknown = sorted(set(names) - set(EXAMPLES))
    if unknown:
        parser.error(f"unknown examples {unknown}; known: {sorted(EXAMPLES)}")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; repeats: {opts.repeats}"
    )
    for name in names:
        times = [time_example(EXAMPLES[name]) for _ in range(opts.repeats)]
        command = "python " + " ".join(EXAMPLES[name])
        print(
            f"{name:20s} median {statistics.median(times):7.1f} s "
            f"(range {min(times):.1f}–{max(times):.1f} s)   {command}"
        )


if __name__ == "__main__":
    main()
