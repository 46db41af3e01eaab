"""TensorFlow and Keras are imported only by the adapter package itself."""

from __future__ import annotations

import subprocess
import sys

import dpledger.adapters.tensorflow as adapter


def test_core_imports_do_not_import_tensorflow_or_keras():
    code = (
        "import sys, dpledger, dpledger.adapters, dpledger.errors, dpledger.ledger; "
        "bad = sorted(m for m in ('tensorflow', 'keras') if m in sys.modules); "
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == ""


def test_public_names_are_exported():
    for name in adapter.__all__:
        assert hasattr(adapter, name), name
