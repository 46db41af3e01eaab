"""The shared conformance suite, run for the RDP, GDP and PLD accountants."""

from __future__ import annotations

from dpledger.accountants.gdp import GdpAccountant
from dpledger.accountants.pld import PldAccountant
from dpledger.accountants.rdp import RdpAccountant
from tests.accountants.conformance import AccountantConformance


class TestRdpConformance(AccountantConformance):
    make_accountant = staticmethod(lambda: RdpAccountant())


class TestRdpBucketedConformance(AccountantConformance):
    make_accountant = staticmethod(lambda: RdpAccountant(bucketing=1e-3))
    rel_tol = 5e-3  # the same z lands on different grid cells in the two routes compared


class TestGdpConformance(AccountantConformance):
    make_accountant = staticmethod(lambda: GdpAccountant())


class TestPldConformance(AccountantConformance):
    make_accountant = staticmethod(lambda: PldAccountant(value_discretization_interval=1e-3))
    rel_tol = 1e-6  # curve vs single calls: compositions grouped differently (~1e-9 seen)
