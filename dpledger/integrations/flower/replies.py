"""The clients' training replies as model updates: who answered, what they sent, checked.

:func:`client_updates` turns the replies of a round into the updates Δ_i = w_i − w_global
stacked per model array (float64), refusing a reply from a client the round's sampler did not
draw; :func:`check_client_clipping` refuses an update over the bound in client-side clipping.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from flwr.app import ArrayRecord, Message

from dpledger.errors import InvalidParameterError, SamplerMismatchError, UpdateOverBoundError
from dpledger.integrations.flower.client import UPDATE_NORM_KEY

__all__ = ["ClientUpdates", "check_client_clipping", "client_updates", "rounding_tolerance"]


class ClientUpdates(NamedTuple):
    """The updates of the clients that answered a round.

    Attributes:
        keys: the model arrays' names.
        reference: the global model's arrays (float64) the round started from.
        members: per array, the repliers' updates stacked, shape (|R|, *array shape).
        reported: per replier, the update norm it reported (client-side clipping), or None.
        repliers: the node ids that answered, in the order of ``members``.
        tolerances: per replier, the relative rounding slack of its model's dtype.
    """

    keys: list[str]
    reference: list[np.ndarray]
    members: list[np.ndarray]
    reported: list[float | None]
    repliers: list[int]
    tolerances: list[float]


def rounding_tolerance(arrays: list[np.ndarray]) -> float:
    """The relative slack of the client-side bound check: the model's dtype rounds w + Δ."""
    eps = [float(np.finfo(a.dtype).eps) for a in arrays if np.issubdtype(a.dtype, np.floating)]
    return 1e3 * max(eps, default=float(np.finfo(np.float64).eps))


def _model_arrays(reply: Message, key: str, keys: list[str], node: int) -> list[np.ndarray]:
    record: Any = reply.content.array_records.get(key)
    if record is None and len(reply.content.array_records) == 1:
        record = next(iter(reply.content.array_records.values()))
    if not isinstance(record, ArrayRecord) or list(record.keys()) != keys:
        raise InvalidParameterError(
            "replies", f"a reply from client {node}", f"model arrays named {keys}"
        )
    return record.to_numpy_ndarrays()


def client_updates(
    reference: ArrayRecord, cohort: list[int], replies: list[Message], *, arrayrecord_key: str
) -> ClientUpdates:
    """The updates of the replies without an error (the others are silent clients).

    Args:
        reference: the global model sent to the cohort.
        cohort: the node ids the round's sampler drew.
        replies: the round's replies.
        arrayrecord_key: the key of the model in a reply (the only array record if absent).

    Raises:
        SamplerMismatchError: a reply from a node outside the cohort, or a second reply of one.
        InvalidParameterError: a reply whose model arrays differ in names or shapes.
    """
    keys = list(reference.keys())
    base = [np.asarray(a, dtype=np.float64) for a in reference.to_numpy_ndarrays()]
    members: list[list[np.ndarray]] = [[] for _ in keys]
    reported: list[float | None] = []
    repliers: list[int] = []
    tolerances: list[float] = []
    drawn = set(cohort)
    for reply in replies:
        if reply.has_error():
            continue
        node = int(reply.metadata.src_node_id)
        if node not in drawn or node in repliers:
            raise SamplerMismatchError(
                f"a training reply from client {node}, which the round's recorded sampler "
                "did not draw (or which answered twice); the round is refused"
            )
        repliers.append(node)
        local = _model_arrays(reply, arrayrecord_key, keys, node)
        for j, (a, b) in enumerate(zip(local, base, strict=True)):
            if a.shape != b.shape:
                raise InvalidParameterError(
                    f"replies[{node}][{keys[j]}]", f"shape {a.shape}", f"shape {b.shape}"
                )
            members[j].append(np.asarray(a, dtype=np.float64) - b)
        tolerances.append(rounding_tolerance(local))
        norm = None
        for metrics in reply.content.metric_records.values():
            if UPDATE_NORM_KEY in metrics:
                norm = float(metrics[UPDATE_NORM_KEY])  # type: ignore[arg-type]
        reported.append(norm)
    stacked = [
        np.stack(m) if m else np.zeros((0, *b.shape)) for m, b in zip(members, base, strict=True)
    ]
    return ClientUpdates(keys, base, stacked, reported, repliers, tolerances)


def check_client_clipping(updates: ClientUpdates, norms: np.ndarray, *, bound: float) -> None:
    """Refuse the round if a client's update is over S (beyond its dtype's rounding) or came
    without its reported norm (it did not clip with
    :func:`~dpledger.integrations.flower.client.clip_client_update`).

    Raises:
        UpdateOverBoundError: an update longer than ``bound``.
        InvalidParameterError: a reply without the reported norm.
    """
    for i, norm in enumerate(norms):
        if not float(norm) <= bound * (1.0 + updates.tolerances[i]):
            raise UpdateOverBoundError(client=updates.repliers[i], norm=float(norm), bound=bound)
        if updates.reported[i] is None:
            raise InvalidParameterError(
                "replies",
                f"a reply without {UPDATE_NORM_KEY!r}",
                "client-side clipping by clip_client_update, which reports the norm",
            )
