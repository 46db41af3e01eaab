"""The checks both adapters run when a DP step is built, where they need no framework.

:class:`~dpledger.adapters.torch.DPOptimizer`, :func:`~dpledger.adapters.torch.make_private`,
:class:`~dpledger.adapters.tensorflow.DPKerasModel` and
:class:`~dpledger.adapters.tensorflow.PrivateGradients` check here the step's config (which must
carry a noise multiplier), the switches and callbacks they take, and the ledger they are given
(a :class:`~dpledger.ledger.PrivacyLedger` that is open). What inspects a framework's objects (the
model, the optimizer, the generator, the data loader) stays in the adapter. Every refusal is an
:class:`~dpledger.errors.InvalidParameterError` naming the argument, its value and what to change
(a closed ledger: :class:`~dpledger.errors.LedgerStateError`).
"""

from __future__ import annotations

from typing import Any

from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.ledger import PrivacyLedger, SamplingEvent
from dpledger.mechanisms.config import DPConfig
from dpledger.sampling.relations import check_ledger_relation, default_relation

__all__ = [
    "check_bias_callback",
    "check_ledger",
    "check_switch",
    "config_with_noise",
    "ledger_location",
    "step_ledger",
]


def ledger_location(ledger: PrivacyLedger) -> str:
    """The ledger's file for messages, or ``(in memory)``."""
    return repr(str(ledger.path)) if ledger.path is not None else "(in memory)"


def config_with_noise(config: DPConfig | None, *, calibrate: str, **fields: Any) -> DPConfig:
    """The step's :class:`~dpledger.mechanisms.DPConfig` from ``config`` or the keyword
    arguments of its fields (None: not given); it must carry a noise multiplier.

    Args:
        config: the ``config=`` argument.
        calibrate: where a target ε is calibrated instead, for the message.
        **fields: the adapter's keyword arguments for the config's fields.

    Raises:
        InvalidParameterError: as :meth:`DPConfig.resolve`, or a config with ``target_epsilon``
            (naming ``target_epsilon``).
    """
    config = DPConfig.resolve(config, **fields)
    if config.noise_multiplier is None:
        raise InvalidParameterError("target_epsilon", config.target_epsilon, f"None: {calibrate}")
    return config


def check_switch(name: str, value: Any) -> bool:
    """``value`` if it is True or False.

    Raises:
        InvalidParameterError: naming ``name``.
    """
    if not isinstance(value, bool):
        raise InvalidParameterError(name, value, "True or False")
    return value


def check_bias_callback(callback: Any) -> Any:
    """None or a callable ``callback(step, metrics)`` (the clipping-bias metrics).

    Raises:
        InvalidParameterError: naming ``bias_callback``.
    """
    if callback is not None and not callable(callback):
        raise InvalidParameterError(
            "bias_callback", callback, "None or a callable callback(step, ClippingBias)"
        )
    return callback


def check_ledger(ledger: Any, *, rank: int = 0) -> PrivacyLedger | None:
    """``ledger``: None, or an open :class:`~dpledger.ledger.PrivacyLedger` on rank 0 (the
    other ranks of a distributed step record nothing and take None).

    Raises:
        InvalidParameterError: not a ledger, or a ledger on a rank other than 0.
        LedgerStateError: a closed ledger.
    """
    if ledger is None:
        return None
    if not isinstance(ledger, PrivacyLedger):
        raise InvalidParameterError("ledger", ledger, "a dpledger.PrivacyLedger or None")
    if rank != 0:
        raise InvalidParameterError(
            "ledger", ledger, f"None on rank {rank}: only rank 0 draws the noise and records events"
        )
    if ledger.closed:
        raise LedgerStateError(
            f"the ledger {ledger_location(ledger)} is closed; open a new one or resume its file"
        )
    return ledger


def step_ledger(ledger: Any, event: SamplingEvent, *, rank: int = 0) -> PrivacyLedger | None:
    """The ledger a DP step records to: ``ledger`` (checked by :func:`check_ledger`), or a new
    in-memory one on rank 0 (None on the other ranks) under the neighbouring relation
    ``event``'s scheme is analysed under (add/remove where it can be).

    Raises:
        InvalidParameterError: as :func:`check_ledger`, or a ledger whose neighbouring relation
            ``event``'s scheme is not analysed under (fixed-size and shuffled batches:
            replace-one only).
        LedgerStateError: a closed ledger.
    """
    checked = check_ledger(ledger, rank=rank)
    if checked is None and rank == 0:
        checked = PrivacyLedger(neighboring=default_relation(event))
    if checked is not None:
        check_ledger_relation(event, checked.neighboring)
    return checked
