"""RDP of the Gaussian on samples drawn without replacement against TensorFlow Privacy's values.

Reference: tensorflow/privacy, ``tensorflow_privacy/privacy/analysis/rdp_accountant_test.py``
(the sampling-without-replacement test; Wang, Balle & Kasiviswanathan 2019): q = 0.01,
σ = 2.5, 50 steps, replace-one, RDP at orders [1.001, 1.5, 2.5, 5, 50, 100, 256, 512, 1024] =
[3.4701e-3, 3.4701e-3, 4.6386e-3, 8.7634e-3, 9.8474e-2, 1.6776e2, 7.9297e2, 1.8174e3, 3.8656e3]
(an older version of that file had 792.838516 at order 256; obsolete). TensorFlow Privacy's σ is
the noise over the replace-one sensitivity taken as 1 (its base mechanism has RDP α/(2σ²)); in
dpledger's units (sensitivity 2S) that is z = 2σ = 5.

dpledger, like TensorFlow Privacy (and dp-accounting's ``_compute_rdp_sample_wor_gaussian``),
takes for α ≤ 256 each term of the sum as the smaller of Theorem 9's and the Gaussian-specific one
of Theorem 27, Theorem 9's alone above, and interpolates log A linearly between the integer orders
around a fractional one (Corollary 10); its rounding is bounded and added, so it may sit a few ulp
above the reference's float64 value, never more than rtol 1e-4 away.
"""

from __future__ import annotations

import numpy as np
import pytest

from dpledger.accountants.without_replacement import rdp_without_replacement

_ORDERS = [1.001, 1.5, 2.5, 5, 50, 100, 256, 512, 1024]
_EXPECTED = [3.4701e-3, 3.4701e-3, 4.6386e-3, 8.7634e-3, 9.8474e-2, 1.6776e2, 7.9297e2, 1.8174e3]
_EXPECTED.append(3.8656e3)


def test_rdp_sample_without_replacement_orders() -> None:
    """tensorflow/privacy rdp_accountant_test.py, the sampling-without-replacement RDP at nine
    orders (q = 0.01, σ = 2.5, 50 steps): every order within rtol 1e-4, and never 792.838516 (the
    obsolete order-256 value)."""
    ours = 50.0 * rdp_without_replacement(0.01, 5.0, _ORDERS)
    for order, got, want in zip(_ORDERS, ours, _EXPECTED, strict=True):
        assert got == pytest.approx(want, rel=1e-4), order
    assert not np.isclose(ours[_ORDERS.index(256)], 792.838516, rtol=1e-5)
