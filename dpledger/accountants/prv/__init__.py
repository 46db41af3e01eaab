"""PRV accountant (Gopi, Lee & Wutschitz 2021) with certified bounds; see :mod:`.accountant`."""

from dpledger.accountants.prv.accountant import PrvAccountant, PrvNumericalError

__all__ = ["PrvAccountant", "PrvNumericalError"]
