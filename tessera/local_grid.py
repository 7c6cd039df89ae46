"""An in-process Grid that routes every message to the real ClientApp handlers.

For tests and benchmarks: :class:`LocalGrid` stands in for Flower's SuperLink. It
delivers each pushed message to an in-process handler (``client_app.app``'s
``handshake``, ``train`` and ``evaluate``, passed in by the caller) and hands back the
reply with the metadata Flower would set, so a strategy's round loop runs without a
SuperLink, SuperNodes or Ray.

The grid stands in for Flower's *simulation* grid: its :attr:`LocalGrid.simulation`
flag tells the strategies (``strategies.core.strategy``) to let clients emulate run-config
``sim-device-profiles``, as they do under ``flwr run`` in simulation.

Omniscient attackers (the attack harness's ALIE, IPM, min-max, min-sum, Mimic and
bound-riding, as in their papers) see the honest updates of the round before they
send theirs. Only an in-process grid can show them those: :attr:`LocalGrid.omniscient`
maps a node to a hook, and :meth:`LocalGrid.push_messages` handles every other node
of a batch of train messages first, then hands each such node's own (honest) reply
and the others' replies to its hook (:class:`BatchView`), and delivers the reply the
hook forged. The hooks are built by ``client_app.attacks.install_omniscient``.

This module sits below the apps (it never imports ``client_app`` or ``server_app``):
the handlers are injected. Callers above the apps build them, e.g.::

    from client_app.app import evaluate, handshake, train
    handlers = {wire.HANDSHAKE: handshake, "train": train, "evaluate": evaluate}
    grid = make_grid(run_config, 10, handlers)
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.typing import Run
from flwr.serverapp import Grid

__all__ = [
    "BatchView",
    "Exchange",
    "Handler",
    "LocalGrid",
    "OmniscientHook",
    "ReplyHook",
    "instruction",
    "make_context",
    "make_grid",
    "node_contexts",
    "stamp_pushed",
]

Handler = Callable[[Message, Context], Message]
"""A ClientApp handler: ``(message, context) -> reply``."""

ReplyHook = Callable[[Message], Message | None]
"""A function that may replace a reply (``None`` keeps it)."""


@dataclass(frozen=True)
class Exchange:
    """One delivered instruction and the reply its node's handler gave.

    Attributes
    ----------
    node : int
        The node's id.
    instruction : Message
        The server's message (the weights the node started from are in it).
    reply : Message
        The handler's reply, as it returned it (a :attr:`LocalGrid.tamper` hook that
        changes replies in place changes it here too).
    """

    node: int
    instruction: Message
    reply: Message


@dataclass(frozen=True)
class BatchView:
    """What an omniscient attacker sees of one batch of train messages.

    Attributes
    ----------
    own : Exchange
        The attacker's own exchange; its reply is what its ClientApp computed.
    others : tuple[Exchange, ...]
        The train exchanges of every node of the batch without an omniscient hook
        whose handler did not fail, in push order. The hook decides which of them
        it counts as honest (it may know other hostile nodes).
    cohort : int
        Train replies of the batch that are not errors, the attackers' included.
    """

    own: Exchange
    others: tuple[Exchange, ...]
    cohort: int


OmniscientHook = Callable[[BatchView], Message | None]
"""An omniscient attacker: forges its reply from a :class:`BatchView` (``None`` keeps
its own reply)."""


def make_context(
    node_id: int,
    run_config: Mapping[str, Any],
    node_config: Mapping[str, Any],
) -> Context:
    """Build a ClientApp context as a SuperNode would.

    Parameters
    ----------
    node_id : int
        The node's id.
    run_config : Mapping[str, Any]
        Flower's raw run config.
    node_config : Mapping[str, Any]
        The node config (``partition-id``, ``num-partitions``, ...).

    Returns
    -------
    Context
        A context of run 1 with an empty state.
    """
    return Context(
        run_id=1,
        node_id=node_id,
        node_config=dict(node_config),
        state=RecordDict(),
        run_config=dict(run_config),
    )


def stamp_pushed(msg: Message) -> None:
    """Set what ``InMemoryGrid.push_messages`` sets on an instruction message.

    Parameters
    ----------
    msg : Message
        The message, changed in place (run id, source node, message id).
    """
    msg.metadata.__dict__["_run_id"] = 1
    msg.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
    msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex


def instruction(content: RecordDict, *, dst_node_id: int, message_type: str) -> Message:
    """Build a server message as it is after the SuperLink accepted it.

    Parameters
    ----------
    content : RecordDict
        The message content.
    dst_node_id : int
        Destination node.
    message_type : str
        Flower message type (``"train"``, ``"evaluate"``, ...).

    Returns
    -------
    Message
        The message, with the ids set as Flower sets them.
    """
    msg = Message(content, dst_node_id=dst_node_id, message_type=message_type, ttl=60.0)
    stamp_pushed(msg)
    return msg


class LocalGrid(Grid):
    """A grid that routes every message to an in-process ClientApp handler.

    Parameters
    ----------
    contexts : Mapping[int, Context]
        One context per connected node (node id -> context).
    handlers : Mapping[str, Handler]
        Handler per message type.

    Attributes
    ----------
    simulation : bool
        Class flag read by the strategies: this grid stands in for Flower's
        simulation grid (clients emulate run-config ``sim-device-profiles``).
    silent : set[tuple[int, str]]
        ``(node, message type)`` pairs that never get a reply.
    tamper : dict[int, ReplyHook]
        Per node, a function that may replace the node's train reply.
    omniscient : dict[int, OmniscientHook]
        Per node, an attacker that forges the node's train reply after seeing the
        other nodes' replies of the same batch (applied before :attr:`tamper`).
    sent : list[Message]
        Every pushed message, in order.
    replies : list[Message]
        Every reply handed to the server, in order (after tampering).
    """

    simulation: ClassVar[bool] = True

    def __init__(self, contexts: Mapping[int, Context], handlers: Mapping[str, Handler]) -> None:
        self.contexts = dict(contexts)
        self.handlers = dict(handlers)
        self.silent: set[tuple[int, str]] = set()
        self.tamper: dict[int, ReplyHook] = {}
        self.omniscient: dict[int, OmniscientHook] = {}
        self.sent: list[Message] = []
        self.replies: list[Message] = []
        self._inbox: dict[str, Message] = {}

    # Grid interface ---------------------------------------------------------
    @property
    def run(self) -> Any:
        """No Flower run object (the grid runs in-process)."""
        return None

    def set_run(self, run: Run) -> None:
        """Ignore the run (there is one)."""
        return None

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Create a message as ``Grid.create_message`` does."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """Return the ids of the connected nodes."""
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message to its node's handler now; keep the reply for pulling.

        Train messages to nodes with an :attr:`omniscient` hook are handled after
        all the others of the batch, and their replies forged by the hook.
        """
        ids = []
        others: list[Exchange] = []
        deferred: list[Message] = []
        for msg in messages:
            stamp_pushed(msg)
            if msg.metadata.reply_to_message_id != "":
                raise ValueError("an instruction message must not be a reply")
            if not msg.metadata.ttl > 0:
                raise ValueError("an instruction message needs a positive ttl")
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            kind = msg.metadata.message_type
            ids.append(msg.metadata.message_id)
            if (node, kind) in self.silent or node not in self.contexts:
                continue
            if kind == "train" and node in self.omniscient:
                deferred.append(msg)
                continue
            reply = self._handle(msg)
            if kind == "train" and not reply.has_error():
                others.append(Exchange(node, msg, reply))
            self._deliver(msg, reply)
        own = [Exchange(m.metadata.dst_node_id, m, self._handle(m)) for m in deferred]
        cohort = len(others) + sum(not e.reply.has_error() for e in own)
        for exchange in own:
            reply = exchange.reply
            if not reply.has_error():
                view = BatchView(own=exchange, others=tuple(others), cohort=cohort)
                reply = self.omniscient[exchange.node](view) or reply
            self._deliver(exchange.instruction, reply)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Hand back the replies to these messages that are ready (once each)."""
        out = [self._inbox.pop(mid) for mid in list(message_ids) if mid in self._inbox]
        self.replies.extend(out)
        return out

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push the messages and pull their replies."""
        return list(self.pull_messages(self.push_messages(messages)))

    # helpers ----------------------------------------------------------------
    def _deliver(self, msg: Message, reply: Message) -> None:
        """Apply the node's :attr:`tamper` hook to a train reply; keep it for pulling."""
        node = msg.metadata.dst_node_id
        if msg.metadata.message_type == "train" and node in self.tamper:
            reply = self.tamper[node](reply) or reply
        self._inbox[msg.metadata.message_id] = reply

    def _handle(self, msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        handler = self.handlers[msg.metadata.message_type]
        try:
            return handler(msg, self.contexts[node])
        except Exception as err:  # a raising ClientApp: Flower replies with an Error
            error = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(err).__name__}: {err}")
            return Message(error, reply_to=msg)

    def replies_of(self, message_type: str) -> list[Message]:
        """Return the replies of one message type, in arrival order."""
        return [r for r in self.replies if r.metadata.message_type == message_type]

    def sent_of(self, message_type: str) -> list[Message]:
        """Return the pushed messages of one message type, in order."""
        return [m for m in self.sent if m.metadata.message_type == message_type]


def node_contexts(
    run_config: Mapping[str, Any], num_nodes: int, *, first_node: int = 100
) -> dict[int, Context]:
    """Contexts of ``num_nodes`` nodes, node ``first_node + i`` on partition i.

    Parameters
    ----------
    run_config : Mapping[str, Any]
        Flower's raw run config, shared by every node.
    num_nodes : int
        Number of nodes (and partitions).
    first_node : int, optional
        Id of the first node.

    Returns
    -------
    dict[int, Context]
        Node id -> context.
    """
    return {
        first_node + i: make_context(
            first_node + i, run_config, {"partition-id": i, "num-partitions": num_nodes}
        )
        for i in range(num_nodes)
    }


def make_grid(
    run_config: Mapping[str, Any],
    num_nodes: int,
    handlers: Mapping[str, Handler],
    *,
    first_node: int = 100,
) -> LocalGrid:
    """Build a local grid of ``num_nodes`` ClientApps, node ``first_node + i`` on partition i.

    Parameters
    ----------
    run_config : Mapping[str, Any]
        Flower's raw run config, shared by every node.
    num_nodes : int
        Number of nodes (and partitions).
    handlers : Mapping[str, Handler]
        Handler per message type (the real ClientApp handlers).
    first_node : int, optional
        Id of the first node.

    Returns
    -------
    LocalGrid
        The grid.
    """
    return LocalGrid(node_contexts(run_config, num_nodes, first_node=first_node), handlers)
