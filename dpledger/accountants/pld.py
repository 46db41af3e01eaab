"""Privacy-loss-distribution accountant: a thin bridge to dp-accounting's PLD machinery.

The privacy loss distribution (PLD) of a mechanism is the distribution of the log-likelihood
ratio of its outputs on the worst-case neighbouring pair; PLDs of composed mechanisms convolve,
and δ(ε) = E[(1 − e^{ε − L})₊] is read off the composed PLD (Koskela, Jälkö & Honkela 2020;
Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022, "Connect the Dots"). dp-accounting builds the
PLD of a Poisson-subsampled Gaussian for both the add and the remove direction, discretises it
pessimistically (every loss rounded so that the computed δ(ε) is an upper bound), and composes
by FFT. We use exactly that, with two changes in how a ledger is fed to it:

* each distinct (q, z) is built once and self-composed with its *total* count (composition is
  commutative), so a ledger with R runs of K distinct steps costs K PLD constructions, not R;
* all full-batch steps (q = 1) together form one Gaussian mechanism with
  μ = √(Σ count·(sensitivity / z)²) (Gaussian mechanisms compose exactly), built once; a ledger
  of full-batch steps only needs no PLD at all: its privacy curve is exactly that of μ-GDP,
  δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth & Su 2019), computed in closed form
  (a discretised PLD of a Gaussian with large μ would need hundreds of millions of points).

Results are upper bounds (pessimistic estimate). Replace-one: a full-batch step changes the sum
by up to 2S, so it is a Gaussian with sensitivity 2 (handled). For Poisson-subsampled steps under
replace-one dp-accounting uses the pair (1 − q)N(0, z²) + qN(∓1, z²); this module does not rely
on that pair without a proof it can cite and test, so such ledgers are refused with
:class:`~dpledger.errors.UnsupportedLedgerError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dpledger.accountants.base import Accountant, Answer
from dpledger.accountants.bucketing import check_bucketing, maybe_bucket
from dpledger.accountants.gdp import gdp_delta, gdp_epsilon
from dpledger.errors import InvalidParameterError, UnsupportedLedgerError
from dpledger.ledger.events import NeighboringRelation
from dpledger.ledger.steps import CompressedLedger

__all__ = ["PldAccountant"]


class PldAccountant(Accountant):
    """dp-accounting's PLD accountant (pessimistic), fed distinct steps with their counts.

    Args:
        value_discretization_interval: the PLD grid spacing of privacy-loss values (smaller is
            tighter and slower; dp-accounting's default is 1e-4).
        bucketing: None, or a relative precision r: round q up and z down first (conservative).
    """

    name = "pld"
    supports_replace_one = True

    def __init__(
        self, *, value_discretization_interval: float = 1e-4, bucketing: float | None = None
    ) -> None:
        v = value_discretization_interval
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
            raise InvalidParameterError(
                "value_discretization_interval", v, "a number in (0, 1], e.g. 1e-4"
            )
        self.value_discretization_interval = float(v)
        self.bucketing = check_bucketing(bucketing)

    def settings(self) -> dict[str, Any]:
        """The discretisation interval and the bucketing precision."""
        return {
            "value_discretization_interval": self.value_discretization_interval,
            "pessimistic_estimate": True,
            "bucketing": self.bucketing,
        }

    def check_supported(self, ledger: CompressedLedger) -> None:
        """Refuse Poisson-subsampled steps (0 < q < 1) under the replace-one relation."""
        super().check_supported(ledger)
        if ledger.neighboring is NeighboringRelation.REPLACE_ONE:
            for run in ledger.runs:
                if not run.releases_nothing and run.sampling_probability < 1.0:
                    raise UnsupportedLedgerError(
                        "the pld accountant supports the replace-one relation only for full-batch "
                        f"steps (q = 1); this ledger has steps with q = {run.sampling_probability}"
                        " under replace-one; record the ledger under add_remove or use full batches"
                    )

    # ------------------------------------------------------------------ PLD construction
    def _factor(self, ledger: CompressedLedger) -> float:
        return 2.0 if ledger.neighboring is NeighboringRelation.REPLACE_ONE else 1.0

    def _subsampled(self, q: float, z: float) -> Any:
        from dp_accounting.pld import privacy_loss_distribution as pld_lib

        return pld_lib.from_gaussian_mechanism(
            standard_deviation=z,
            sampling_prob=q,
            pessimistic_estimate=True,
            value_discretization_interval=self.value_discretization_interval,
        )

    def _gaussian(self, mu_squared: float) -> Any:
        from dp_accounting.pld import privacy_loss_distribution as pld_lib

        return pld_lib.from_gaussian_mechanism(
            standard_deviation=1.0 / math.sqrt(mu_squared),
            pessimistic_estimate=True,
            value_discretization_interval=self.value_discretization_interval,
        )

    def _compose(self, parts: list[Any]) -> Any:
        total = parts[0]
        for p in parts[1:]:
            total = total.compose(p)
        return total

    def _gaussian_only(self, ledger: CompressedLedger) -> float | None:
        """μ of the ledger if every costly step is full batch (else None)."""
        factor = self._factor(ledger)
        mu_squared = 0.0
        for run in ledger.runs:
            if run.releases_nothing:
                continue
            if run.sampling_probability < 1.0:
                return None
            mu_squared += run.count * (factor / run.noise_multiplier) ** 2
        return math.sqrt(mu_squared)

    def distribution(self, ledger: CompressedLedger) -> Any:
        """The composed dp-accounting ``PrivacyLossDistribution`` of a ledger's costly steps.

        Each distinct subsampled (q, z) is self-composed once with its total count; all
        full-batch steps form one Gaussian. Returns None if no step is costly.
        """
        ledger = maybe_bucket(ledger, self.bucketing)
        factor = self._factor(ledger)
        mu_squared = 0.0
        parts = []
        for (q, z), count in ledger.distinct().items():
            if q == 0.0 or math.isinf(z):
                continue
            if q == 1.0:
                mu_squared += count * (factor / z) ** 2
            else:
                parts.append(self._subsampled(q, z).self_compose(count))
        if mu_squared > 0.0:
            parts.append(self._gaussian(mu_squared))
        return self._compose(parts) if parts else None

    # ------------------------------------------------------------------ accountant hooks
    def _epsilon(self, ledger: CompressedLedger, delta: float) -> Answer:
        mu = self._gaussian_only(maybe_bucket(ledger, self.bucketing))
        if mu is not None:
            eps = gdp_epsilon(mu, delta)
            return Answer(eps, upper=eps, details={"closed_form_gaussian_mu": mu})
        pld = self.distribution(ledger)
        eps = max(0.0, float(pld.get_epsilon_for_delta(delta)))
        return Answer(eps, upper=eps, details={"distinct_runs": len(ledger.distinct())})

    def _delta(self, ledger: CompressedLedger, epsilon: float) -> Answer:
        mu = self._gaussian_only(maybe_bucket(ledger, self.bucketing))
        if mu is not None:
            delta = gdp_delta(mu, epsilon)
            return Answer(delta, upper=delta, details={"closed_form_gaussian_mu": mu})
        pld = self.distribution(ledger)
        delta = min(1.0, max(0.0, float(pld.get_delta_for_epsilon(epsilon))))
        return Answer(delta, upper=delta, details={"distinct_runs": len(ledger.distinct())})

    def _epsilon_curve(
        self, ledger: CompressedLedger, delta: float, steps: Sequence[int]
    ) -> list[Answer]:
        """Incremental: the subsampled part of the PLD after t_i steps is that after t_{i−1}
        composed with the steps in between (each distinct step's single-step PLD is built once);
        the full-batch steps so far are one Gaussian, composed in at each point (or, with no
        subsampled step yet, the closed form)."""
        ledger = maybe_bucket(ledger, self.bucketing)
        factor = self._factor(ledger)
        base: dict[tuple[float, float], Any] = {}
        answers = []
        current = None  # PLD of the subsampled steps so far
        full_mu_squared = 0.0
        done = 0
        run_index, used_in_run = 0, 0
        runs = ledger.runs
        for t in steps:
            parts = [] if current is None else [current]
            need = t - done
            while need > 0:
                run = runs[run_index]
                take = min(need, run.count - used_in_run)
                q, z = run.sampling_probability, run.noise_multiplier
                if not run.releases_nothing:
                    if q == 1.0:
                        full_mu_squared += take * (factor / z) ** 2
                    else:
                        if (q, z) not in base:
                            base[(q, z)] = self._subsampled(q, z)
                        parts.append(base[(q, z)].self_compose(take))
                need -= take
                used_in_run += take
                if used_in_run == run.count:
                    run_index, used_in_run = run_index + 1, 0
            done = t
            if parts:
                current = self._compose(parts)
            if current is None:
                eps = gdp_epsilon(math.sqrt(full_mu_squared), delta)
            else:
                pld = current
                if full_mu_squared > 0.0:
                    pld = current.compose(self._gaussian(full_mu_squared))
                eps = max(0.0, float(pld.get_epsilon_for_delta(delta)))
            answers.append(Answer(eps, upper=eps))
        return answers
