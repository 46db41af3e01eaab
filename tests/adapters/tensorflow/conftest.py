"""Shared setup of the TensorFlow adapter tests: quiet TensorFlow logs, small helpers."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None:
    # The adapter is an optional extra; without TensorFlow there is nothing here to test.
    collect_ignore_glob = ["test_*.py"]
