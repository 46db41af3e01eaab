"""PRV accountant (Gopi, Lee & Wutschitz 2021) with certified bounds; see :mod:`.accountant`.

``PrvDpAccountant`` (dp-accounting's interface) is in :mod:`.interop`, which imports
dp-accounting when loaded.
"""

from dpledger.accountants.prv.accountant import PrvAccountant

__all__ = ["PrvAccountant"]
