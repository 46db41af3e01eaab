"""Run the same timing code against two checkouts of dpledger, alternately, in one run.

Each checkout runs in its own process (so that both revisions can be imported), with its root
first on the module path; the child code prints one JSON object of results, which also carries
the path it imported dpledger from, so that a table can say which tree each column timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["alternate", "run_in_tree"]


def run_in_tree(tree: str, child: str) -> dict[str, Any]:
    """Run ``child`` (Python source printing a JSON object) with ``tree``'s dpledger."""
    root = os.path.abspath(tree)
    env = dict(os.environ, PYTHONPATH=root)
    # run in the tree's root: ``python -c`` puts the working directory first on sys.path
    done = subprocess.run(
        [sys.executable, "-c", child],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(done.stdout)
    if not str(out.get("_path", "")).startswith(root):
        raise RuntimeError(f"{tree}: imported dpledger from {out.get('_path')}, not this tree")
    return out


def alternate(before: str, after: str, rounds: int, child: str) -> dict[str, list[dict]]:
    """``rounds`` runs of ``child`` in each tree, alternating before and after."""
    results: dict[str, list[dict]] = {before: [], after: []}
    for _ in range(rounds):
        for tree in (before, after):
            results[tree].append(run_in_tree(tree, child))
    return results
