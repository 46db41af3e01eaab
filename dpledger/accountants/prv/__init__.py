"""PRV accountant (Gopi, Lee & Wutschitz 2021) with certified bounds; see :mod:`.accountant`.

``PrvDpAccountant`` (dp-accounting's interface) is imported on first use, so importing this
package does not import dp-accounting.
"""

from typing import Any

from dpledger.accountants.prv.accountant import PrvAccountant, PrvNumericalError

__all__ = ["PrvAccountant", "PrvDpAccountant", "PrvNumericalError"]


def __getattr__(name: str) -> Any:
    if name == "PrvDpAccountant":
        from dpledger.accountants.prv.interop import PrvDpAccountant

        return PrvDpAccountant
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
