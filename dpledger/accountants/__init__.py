"""Accountants: replay a ledger to compute (ε, δ), with a label saying what each number is.

* :class:`RdpAccountant` — Rényi DP of the Poisson-subsampled Gaussian (upper bounds);
* :class:`PrvAccountant` — numerical composition of privacy random variables: certified
  (lower, estimate, upper) triples, the upper bound reported;
* :class:`PldAccountant` — dp-accounting's privacy loss distributions (upper bounds);
* :class:`GdpAccountant` — Gaussian DP (exact for full batches, a CLT approximation otherwise);
* calibration of the noise multiplier, sampling probability or number of steps for a target ε.

Accountants are also available by name through :func:`make_accountant` (``"rdp"``, ``"prv"``,
``"gdp"``, ``"pld"``). The dp-accounting ``PrivacyAccountant`` bridge and the Opacus history
import live in :mod:`dpledger.accountants.interop` (it imports dp-accounting when loaded).
"""

from dpledger.accountants.base import Accountant, PrivacyResult, ResultKind, make_accountant
from dpledger.accountants.calibration import (
    CalibrationResult,
    calibrate_noise_multiplier,
    calibrate_sampling_probability,
    calibrate_steps,
)
from dpledger.accountants.gdp import GdpAccountant
from dpledger.accountants.pld import PldAccountant
from dpledger.accountants.prv import PrvAccountant
from dpledger.accountants.rdp import RdpAccountant

__all__ = [
    "Accountant",
    "CalibrationResult",
    "GdpAccountant",
    "PldAccountant",
    "PrivacyResult",
    "PrvAccountant",
    "RdpAccountant",
    "ResultKind",
    "calibrate_noise_multiplier",
    "calibrate_sampling_probability",
    "calibrate_steps",
    "make_accountant",
]
