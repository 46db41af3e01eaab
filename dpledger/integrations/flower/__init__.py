"""Federated learning with user-level DP on Flower (``pip install "dpledger[flower]"``).

:class:`~dpledger.integrations.flower.strategy.UserLevelDPStrategy` wraps a Flower strategy:
it draws each round's cohort with a recorded sampler, clips every client's update, adds the
Gaussian noise through the core mechanisms and records the round in the server's ledger;
:mod:`dpledger.integrations.flower.client` clips on the client for client-side clipping.
The package's names stay in their modules (import them from there).
"""

__all__: list[str] = []
