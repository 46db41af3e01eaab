"""The conformance suite every accountant's tests subclass (the dp-accounting pattern).

A subclass sets ``make_accountant`` (a zero-argument callable returning a configured accountant)
and may set ``rel_tol`` (how far two answers of the same accountant may differ for the same
ledger computed by different routes, e.g. curve vs single call; 0 for closed-form accountants).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import ClassVar

import pytest

from dpledger import PrivacyLedger
from dpledger.accountants.base import Accountant, PrivacyResult, ResultKind
from dpledger.errors import InvalidParameterError, UnsupportedLedgerError
from dpledger.ledger.steps import CompressedLedger

DELTA = 1e-5


def runs(*triples: tuple[float, float, int], neighboring: str = "add_remove") -> CompressedLedger:
    """A compressed ledger from (q, z, count) triples."""
    return CompressedLedger.from_runs(triples, neighboring=neighboring)


class AccountantConformance:
    """Tests every accountant must pass. Subclasses set ``make_accountant``."""

    make_accountant: ClassVar[Callable[[], Accountant]]
    rel_tol: ClassVar[float] = 0.0

    @pytest.fixture
    def acc(self) -> Accountant:
        return type(self).make_accountant()

    def eps(self, acc: Accountant, ledger: CompressedLedger, delta: float = DELTA) -> float:
        return acc.epsilon(ledger, delta=delta).epsilon

    # ----------------------------------------------------------- trivial ledgers
    def test_empty_ledger_spends_nothing(self, acc: Accountant) -> None:
        result = acc.epsilon(PrivacyLedger(), delta=DELTA)
        assert isinstance(result, PrivacyResult)
        assert result.epsilon == 0.0 and result.num_steps == 0
        assert acc.delta(PrivacyLedger(), epsilon=0.0).delta == 0.0

    def test_steps_without_queries_spend_nothing(self, acc: Accountant) -> None:
        ledger = PrivacyLedger()
        for _ in range(5):
            ledger.record_sample(sampling_probability=0.1, population_size=100)
        assert acc.epsilon(ledger, delta=DELTA).epsilon == 0.0

    def test_zero_noise_step_gives_infinite_epsilon(self, acc: Accountant) -> None:
        ledger = PrivacyLedger()
        ledger.record_sample(sampling_probability=0.01, population_size=1000)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
        ledger.record_sample(sampling_probability=0.01, population_size=1000)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=0.0)
        result = acc.epsilon(ledger, delta=DELTA)
        assert result.epsilon == math.inf
        assert result.warnings
        d = acc.delta(ledger, epsilon=1.0)
        assert 0.0 < d.delta <= 1.0 and not math.isnan(d.delta)

    # ----------------------------------------------------------- bad input
    @pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0, math.nan, math.inf])
    def test_bad_delta_is_rejected(self, acc: Accountant, delta: float) -> None:
        with pytest.raises(InvalidParameterError, match="delta"):
            acc.epsilon(runs((0.01, 1.0, 10)), delta=delta)

    @pytest.mark.parametrize("epsilon", [-0.1, math.nan])
    def test_bad_epsilon_is_rejected(self, acc: Accountant, epsilon: float) -> None:
        with pytest.raises(InvalidParameterError, match="epsilon"):
            acc.delta(runs((0.01, 1.0, 10)), epsilon=epsilon)

    def test_not_a_ledger_is_rejected(self, acc: Accountant) -> None:
        with pytest.raises(InvalidParameterError, match="ledger"):
            acc.epsilon([(0.01, 1.0, 10)], delta=DELTA)  # type: ignore[arg-type]

    # ----------------------------------------------------------- monotonicity
    def test_monotone_in_steps(self, acc: Accountant) -> None:
        values = [self.eps(acc, runs((0.01, 1.0, t))) for t in (1, 10, 100, 1000)]
        assert all(b >= a * (1 - self.rel_tol) for a, b in itertools.pairwise(values))
        assert values[-1] > values[0]

    def test_monotone_in_noise_multiplier(self, acc: Accountant) -> None:
        values = [self.eps(acc, runs((0.01, z, 100))) for z in (0.7, 1.0, 2.0, 5.0)]
        assert all(b <= a * (1 + self.rel_tol) for a, b in itertools.pairwise(values))
        assert values[-1] < values[0]

    def test_monotone_in_sampling_probability(self, acc: Accountant) -> None:
        values = [self.eps(acc, runs((q, 1.0, 100))) for q in (0.001, 0.01, 0.1, 1.0)]
        assert all(b >= a * (1 - self.rel_tol) for a, b in itertools.pairwise(values))
        assert values[-1] > values[0]

    def test_delta_decreases_with_epsilon(self, acc: Accountant) -> None:
        ledger = runs((0.01, 1.0, 1000))
        deltas = [acc.delta(ledger, epsilon=e).delta for e in (0.5, 1.0, 2.0, 4.0)]
        assert all(0.0 <= d <= 1.0 for d in deltas)
        assert all(b <= a * (1 + self.rel_tol) for a, b in itertools.pairwise(deltas))

    def test_epsilon_and_delta_are_consistent(self, acc: Accountant) -> None:
        ledger = runs((0.01, 1.0, 1000))
        eps = self.eps(acc, ledger)
        assert acc.delta(ledger, epsilon=eps).delta <= DELTA * (1 + 1e-2 + self.rel_tol)

    # ----------------------------------------------------------- curves
    def test_curve_matches_single_calls(self, acc: Accountant) -> None:
        ledger = runs((0.01, 1.2, 300), (0.02, 0.9, 200))
        steps = [0, 1, 150, 300, 301, 500]
        curve = acc.epsilon_curve(ledger, delta=DELTA, steps=steps)
        assert [r.num_steps for r in curve] == steps
        assert curve[0].epsilon == 0.0
        for t, r in zip(steps, curve, strict=False):
            single = self.eps(acc, ledger.prefix(t))
            assert r.epsilon == pytest.approx(single, rel=max(self.rel_tol, 1e-12), abs=1e-12)

    def test_curve_accepts_numpy_counts_and_leading_free_steps(self, acc: Accountant) -> None:
        np = pytest.importorskip("numpy")
        ledger = runs((0.01, math.inf, 5), (0.01, 1.0, 50))
        curve = acc.epsilon_curve(ledger, delta=DELTA, steps=np.array([5, 6, 55]))
        assert curve[0].epsilon == 0.0
        assert 0.0 < curve[1].epsilon <= curve[2].epsilon
        assert curve[2].epsilon == pytest.approx(
            self.eps(acc, ledger), rel=max(self.rel_tol, 1e-12)
        )

    def test_curve_rejects_bad_step_counts(self, acc: Accountant) -> None:
        ledger = runs((0.01, 1.0, 10))
        for bad in ([11], [-1], [1.5], []):
            with pytest.raises(InvalidParameterError, match="steps"):
                acc.epsilon_curve(ledger, delta=DELTA, steps=bad)

    # ----------------------------------------------------------- neighboring relation
    def test_replace_one_is_handled_or_refused(self, acc: Accountant) -> None:
        add_remove = runs((0.01, 1.0, 100))
        replace = runs((0.01, 1.0, 100), neighboring="replace_one")
        if not acc.supports_replace_one:
            with pytest.raises(UnsupportedLedgerError):
                acc.epsilon(replace, delta=DELTA)
            return
        try:
            value = self.eps(acc, replace)
        except UnsupportedLedgerError:
            return  # refused for subsampled steps: allowed
        # replace-one is at least as costly as add/remove (sensitivity 2S instead of S)
        assert value >= self.eps(acc, add_remove) * (1 - self.rel_tol)

    def test_replace_one_full_batch_is_a_gaussian_with_half_the_multiplier(
        self, acc: Accountant
    ) -> None:
        # Under replace-one a full-batch sum changes by up to 2S: exactly a Gaussian mechanism
        # with noise multiplier z/2 under add/remove (google/differential-privacy issue 378).
        replace = runs((1.0, 4.0, 3), (1.0, 6.0, 2), neighboring="replace_one")
        halved = runs((1.0, 2.0, 3), (1.0, 3.0, 2))
        if not acc.supports_replace_one:
            with pytest.raises(UnsupportedLedgerError):
                acc.epsilon(replace, delta=DELTA)
            return
        try:
            value = self.eps(acc, replace)
        except UnsupportedLedgerError:
            return
        assert value == pytest.approx(self.eps(acc, halved), rel=max(self.rel_tol, 1e-9))
        assert value > self.eps(acc, runs((1.0, 4.0, 3), (1.0, 6.0, 2)))

    # ----------------------------------------------------------- results
    def test_result_says_what_it_is(self, acc: Accountant) -> None:
        result = acc.epsilon(runs((0.01, 1.0, 100)), delta=DELTA)
        assert result.accountant == acc.name
        assert result.kind in set(ResultKind)
        assert result.quantity == "epsilon" and result.value == result.epsilon
        assert result.seconds >= 0.0 and result.num_steps == 100
        assert math.isfinite(result.epsilon) and result.epsilon > 0.0
        if result.lower is not None:
            if result.kind is ResultKind.APPROXIMATION and result.lower > result.epsilon:
                assert result.warnings  # an approximation below a certified bound must say so
            else:
                assert result.lower <= result.epsilon * (1 + 1e-12)
        if result.upper is not None:
            assert result.epsilon <= result.upper * (1 + 1e-12)
        assert result.to_dict()["kind"] == result.kind.value

    def test_accepts_full_ledger_and_compressed_view_alike(self, acc: Accountant) -> None:
        ledger = PrivacyLedger()
        for _ in range(20):
            ledger.record_sample(sampling_probability=0.05, population_size=1000)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=2.0)
            ledger.record_sum_query(l2_norm_bound=0.5, noise_stddev=1.0)
        a = acc.epsilon(ledger, delta=DELTA).epsilon
        b = acc.epsilon(ledger.compressed(), delta=DELTA).epsilon
        assert a == b
