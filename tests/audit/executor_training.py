"""Tiny NumPy training functions for the executor tests of the distinguishing game.

Module-level, so that worker processes (a process pool, Dask workers) can import them.
"""

from __future__ import annotations

import os

from tests.audit.gaussian_mechanism import noisy_sum


def dies_once(include_canary: bool, seed: int, *, marker: str, fatal_seed: int) -> float:
    """:func:`noisy_sum`, except that the run with ``fatal_seed`` kills its worker process the
    first time (while ``marker`` does not exist yet), as a crash or an out-of-memory kill would."""
    if seed == fatal_seed and not os.path.exists(marker):
        with open(marker, "w", encoding="utf-8") as fh:
            fh.write("killed\n")
        os._exit(3)
    return noisy_sum(include_canary, seed)
