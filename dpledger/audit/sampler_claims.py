"""What the ledger of one run claims, for the sampler audit: an upper bound, or a refusal and why.

For a Poisson-sampled run the PRV accountant certifies an ε. For shuffled batches it refuses
(no accountant credits shuffling with amplification), and the claim holds what the ledger says
instead: the upper bound without amplification (RDP: each epoch one Gaussian mechanism) and the
shuffle gap of :func:`~dpledger.accountants.sampling_report.shuffle_gap`, i.e. the Poisson ε the
run would be reported with and Chua et al.'s lower bound on the ε it has. Framework-free; used by
:mod:`dpledger.audit.torch_sampler_audit`.
"""

from __future__ import annotations

import attrs

from dpledger.accountants import make_accountant
from dpledger.accountants.sampling_report import ShuffleGap, shuffle_gap
from dpledger.errors import DPLedgerError, LedgerStateError
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.events import SamplingScheme
from dpledger.ledger.steps import CompressedLedger

__all__ = ["LedgerClaim", "ledger_claim"]


@attrs.frozen
class LedgerClaim:
    """What the ledger of one run of a sampler audit certifies at δ.

    Attributes:
        sampler: ``"poisson"`` or ``"shuffle"``.
        delta: δ.
        epsilon: the PRV accountant's upper bound on ε; None when it refused the ledger.
        refusal: the PRV accountant's refusal (shuffled batches), or None.
        no_amplification_epsilon: for shuffled batches, the RDP accountant's upper bound
            without amplification (each epoch one Gaussian mechanism, replace-one); else None.
        gap: for shuffled batches, the Poisson ε the run would be reported with and Chua et al.'s
            lower bound (:class:`~dpledger.accountants.sampling_report.ShuffleGap`); else None.
    """

    sampler: str
    delta: float
    epsilon: float | None
    refusal: str | None = None
    no_amplification_epsilon: float | None = None
    gap: ShuffleGap | None = None

    def describe(self) -> str:
        """One line for a table."""
        if self.epsilon is not None:
            return f"ε ≤ {self.epsilon:.3f} (PRV upper bound)"
        assert self.gap is not None and self.gap.lower_bound is not None
        return (
            f"PRV refuses; ε ≤ {self.no_amplification_epsilon:.3f} without amplification (RDP); "
            f"Poisson ε would be {self.gap.poisson_epsilon.epsilon:.3f}; "
            f"ε ≥ {self.gap.lower_bound.epsilon:.3f} (Chua et al.; both {self.gap.relation.label})"
        )


def ledger_claim(ledger: PrivacyLedger | CompressedLedger, *, delta: float) -> LedgerClaim:
    """The claim of one run's ledger at δ (see :class:`LedgerClaim`).

    Raises:
        LedgerStateError: the PRV accountant certified shuffled steps (it must refuse them).
        DPLedgerError: an accountant's error on a ledger without shuffled steps.
    """
    compressed = ledger if isinstance(ledger, CompressedLedger) else ledger.compressed()
    shuffled = any(r.scheme is SamplingScheme.SHUFFLE for r in compressed.runs)
    sampler = "shuffle" if shuffled else "poisson"
    try:
        eps = make_accountant("prv").epsilon(ledger, delta=delta).epsilon
    except DPLedgerError as err:
        if not shuffled:
            raise
        return LedgerClaim(
            sampler=sampler,
            delta=delta,
            epsilon=None,
            refusal=str(err),
            no_amplification_epsilon=make_accountant("rdp").epsilon(ledger, delta=delta).epsilon,
            gap=shuffle_gap(compressed, delta=delta),
        )
    if shuffled:
        raise LedgerStateError("the PRV accountant certified shuffled batches; it must refuse")
    return LedgerClaim(sampler=sampler, delta=delta, epsilon=eps)
