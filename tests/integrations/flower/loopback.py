"""An in-process Flower grid: the strategy's messages go to a real ``ClientApp`` in this process.

Flower's ``Strategy.start`` drives the rounds and ``ClientApp.__call__`` dispatches every message
to the client's ``@train``/``@evaluate`` function, as in a deployment; only the transport (the
SuperLink's message store and the SuperNodes) is replaced by a direct call, so a test of a few
rounds takes milliseconds instead of starting Ray actors. ``silent`` partitions receive their
messages and never answer (a dropped client).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Iterator

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


@contextlib.contextmanager
def server_identity() -> Iterator[None]:
    """The identity Flower's server process sets before a ``ServerApp`` creates messages."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


class LoopbackGrid(Grid):
    """A grid of ``num_nodes`` nodes, each running ``client_app`` with its own partition id.

    Attributes:
        node_ids: the nodes' ids (random 62-bit integers, as Flower's), by partition.
        partition: node id → partition id.
        delivered: per ``send_and_receive`` call with train messages, the node ids they went to.
    """

    def __init__(
        self, client_app: ClientApp, num_nodes: int, *, silent: Iterable[int] = (), seed: int = 0
    ) -> None:
        rng = np.random.default_rng(seed)
        self.client_app = client_app
        self.node_ids = [int(x) for x in rng.choice(2**62, size=num_nodes, replace=False)]
        self.partition = {node: i for i, node in enumerate(self.node_ids)}
        self.silent = set(silent)
        self.delivered: list[list[int]] = []
        self._contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for node, i in self.partition.items()
        }

    def set_run(self, run) -> None:  # type: ignore[no-untyped-def]
        self._run = run

    @property
    def run(self):  # type: ignore[no-untyped-def]
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[no-untyped-def]
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("LoopbackGrid delivers through send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("LoopbackGrid delivers through send_and_receive")

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies, sent, train = [], [], False
        for message in messages:
            train = train or message.metadata.message_type.startswith("train")
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            node = message.metadata.dst_node_id
            sent.append(node)
            if self.partition[node] in self.silent:
                continue
            replies.append(self.client_app(message, self._contexts[node]))
        if train:
            self.delivered.append(sent)
        return replies
