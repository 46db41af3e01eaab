"""Integrations: DP training where users already train (optional extras).

Each integration lives in its own module or package and is imported from there:
``from dpledger.integrations.transformers import DPTrainer`` (the ``transformers`` extra),
``from dpledger.integrations.flower import UserLevelDPStrategy`` (the ``flower`` extra).
Importing this package imports no training framework.

Integrations sit in the adapters' layer (docs/architecture.md, "Layers"): they use the core,
the diagnostics and the public API of an adapter, never the audit, the checks or the CLI.
"""

__all__: list[str] = []
