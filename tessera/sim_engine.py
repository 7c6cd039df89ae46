"""Flower 1.30's in-memory message store, indexed by node for the simulation engine.

Where the simulation engine stops scaling (issue 26, ``benchmarks/scale.py``):
Flower's engine hands messages to its workers from a thread
(``flwr/server/superlink/fleet/vce/vce_api.py``, ``add_messages_to_queue``) that
asks **every node, every 0.1 s**, for its next message with
``state.get_message_ins(node_id=node_id, limit=1)``; and
``InMemoryLinkState.get_message_ins``
(``flwr/server/superlink/linkstate/in_memory_linkstate.py``) finds a node's
message by walking **every stored message**, checking each for expiry and
federation membership on the way. A sweep of the engine is then
O(nodes x stored messages): a round of ``n`` nodes stores ``n`` messages, so each
sweep costs O(n^2) under the store's lock, which the ServerApp's pushes and pulls
also take. No Flower or Ray setting changes it (the loop has no knob; more Ray
workers only wait on it).

:func:`index_messages_by_node` keeps, per destination node, the ids of the
messages stored for it (in the order they were stored) and answers
``get_message_ins`` from that node's ids alone: the same messages, in the same
order, each checked for expiry and federation as Flower checks them, marked
delivered as Flower marks them. What differs: an expired message of *another* node
is removed when that node is asked (the engine asks every node every sweep), not
while this one is looked up. The ServerApp applies it in simulation only, and only
to the Flower version it was written against (:data:`FLOWER_VERSION`); any other
version keeps Flower's own method, with a log line saying so.

Two more costs of that thread remain with the index alone, and ``feed=True`` (run-config
``sim-engine=direct``, the default) removes them:

- **Latency.** A message stored just after a sweep waits up to 0.1 s for the next:
  a fixed cost of every round that weighs most in small federations (a round of 50
  nodes takes about 0.3 s). With the feed, storing a message for a node hands the
  node's next undelivered message (the one a sweep would hand it, marked delivered as
  Flower marks it) straight to the queue the engine's thread fills, found from that
  thread's own arguments. The sweep still runs and hands out whatever the feed did
  not (a message stored before the engine's thread started).
- **The sweep itself.** It still asks every node every 0.1 s, taking the store's
  lock each time: at 5,000 nodes, 5,000 calls a sweep that compete with the
  ServerApp's thread for the interpreter. The index keeps the set of nodes that have
  an undelivered message, and a node outside it is answered at once, without the lock
  and without Flower's checks: Flower's walk would only have dropped *delivered*
  messages of that node that expired (a reply the ServerApp then gets as an error
  either way: its pull checks every message it asks about) and returned nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("flwr.tessera")

FLOWER_VERSION = "1.30.0"
"""The Flower release whose ``InMemoryLinkState`` this was written against."""

_INDEX = "_tessera_node_index"
_UNDELIVERED = "_tessera_undelivered"
_QUEUE = "_tessera_engine_queue"
_PATCH_LOCK = threading.Lock()
_ORIGINAL: dict[str, Callable[..., Any]] = {}
_FEED: list[bool] = [False]
"""Whether storing a message hands it to the engine's queue at once (see the module doc)."""


def _index(state: Any) -> dict[int, list[str]]:
    """Return the state's per-node index, built from what is already stored on first use.

    Also builds the set of nodes with an undelivered message (:func:`_undelivered`).
    """
    index: dict[int, list[str]] | None = state.__dict__.get(_INDEX)
    if index is None:
        index = {}
        undelivered: set[int] = set()
        for message_id, message in list(state.message_ins_store.items()):
            node = int(message.metadata.dst_node_id)
            index.setdefault(node, []).append(message_id)
            if message.metadata.delivered_at == "":
                undelivered.add(node)
        state.__dict__[_UNDELIVERED] = undelivered
        state.__dict__[_INDEX] = index
    return index


def _undelivered(state: Any) -> set[int] | None:
    """Nodes that may hold an undelivered message (``None`` before the index exists)."""
    nodes: set[int] | None = state.__dict__.get(_UNDELIVERED)
    return nodes


def engine_queue(state: Any) -> Any | None:
    """Return the queue Flower's engine thread fills for ``state``, if that thread runs.

    Found once from the arguments of the thread running
    ``vce_api.add_messages_to_queue`` (``state, queue, nodes_mapping, f_stop``),
    and only if its state is this one; ``None`` until the engine has started it.
    """
    queue = state.__dict__.get(_QUEUE)
    if queue is not None:
        return queue
    from flwr.server.superlink.fleet.vce import vce_api

    for thread in threading.enumerate():
        if getattr(thread, "_target", None) is not vce_api.add_messages_to_queue:
            continue
        args: tuple[Any, ...] = tuple(getattr(thread, "_args", ()))
        if len(args) >= 2 and args[0] is state:
            state.__dict__[_QUEUE] = args[1]
            log.debug("simulation engine: messages handed to its queue as they are stored")
            return args[1]
    return None


def _store_message_ins(state: Any, message: Any) -> str | None:
    """Flower's ``store_message_ins``, then the new message's id in its node's list.

    With the feed on and the engine's thread running, the node's next undelivered
    message then goes straight to the engine's queue.
    """
    with state.lock:
        _index(state)  # built first: built after, it would hold this message twice
    message_id: str | None = _ORIGINAL["store_message_ins"](state, message)
    if message_id is None:
        return None
    node = int(message.metadata.dst_node_id)
    with state.lock:
        _index(state).setdefault(node, []).append(message_id)
        state.__dict__[_UNDELIVERED].add(node)
    if _FEED[0]:
        queue = engine_queue(state)
        if queue is not None:
            for ready in _get_message_ins(state, node, 1):
                queue.put(ready)
    return message_id


def _get_message_ins(state: Any, node_id: int, limit: int | None) -> list[Any]:
    """Flower's ``get_message_ins``, walking only the messages stored for ``node_id``."""
    if limit is not None and limit < 1:
        raise AssertionError("`limit` must be >= 1")
    pending = _undelivered(state)
    if pending is not None and node_id not in pending:
        return []  # nothing to hand out: no lock, no walk
    found: list[Any] = []
    with state.lock:
        index = _index(state)
        live = []
        left = False  # an undelivered message stays for a later call
        for message_id in index.get(node_id, ()):
            if message_id not in state.message_ins_store:
                continue  # deleted (its reply was pulled, or it expired)
            state._check_stored_messages({message_id})  # expiry, federation: Flower's checks
            message = state.message_ins_store.get(message_id)
            if message is None:
                continue
            live.append(message_id)
            if message.metadata.delivered_at == "":
                if not limit or len(found) < limit:
                    found.append(message)
                else:
                    left = True
        if live:
            index[node_id] = live
        else:
            index.pop(node_id, None)
        if not left:
            state.__dict__[_UNDELIVERED].discard(node_id)
    if found:
        from flwr.common import now

        delivered_at = now().isoformat()
        for message in found:
            message.metadata.delivered_at = delivered_at
    return found


def index_messages_by_node(*, feed: bool = False) -> bool:
    """Index Flower's in-memory message store by destination node (see the module doc).

    Idempotent. Returns whether the index is in place: ``False`` (Flower's own
    method kept, logged once) when the installed Flower is not :data:`FLOWER_VERSION`.

    Parameters
    ----------
    feed : bool
        Also hand each stored message to the engine's queue at once (run-config
        ``sim-engine=direct``) instead of leaving it for the engine's next sweep.
    """
    import flwr
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    with _PATCH_LOCK:
        if _ORIGINAL:
            _FEED[0] = feed
            return True
        version = getattr(flwr, "__version__", "?")
        if version != FLOWER_VERSION:
            log.info(
                "Flower %s is not %s: its simulation engine keeps its own message lookup "
                "(O(nodes x messages) a sweep)",
                version,
                FLOWER_VERSION,
            )
            return False
        _ORIGINAL["store_message_ins"] = InMemoryLinkState.store_message_ins
        _ORIGINAL["get_message_ins"] = InMemoryLinkState.get_message_ins
        InMemoryLinkState.store_message_ins = _store_message_ins  # type: ignore[method-assign,assignment]
        InMemoryLinkState.get_message_ins = _get_message_ins  # type: ignore[method-assign,assignment]
        _FEED[0] = feed
        log.debug("simulation engine: messages looked up by node (fed at once: %s)", feed)
        return True


def restore_flower() -> None:
    """Put Flower's own methods back (for tests)."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    with _PATCH_LOCK:
        for name, method in _ORIGINAL.items():
            setattr(InMemoryLinkState, name, method)
        _ORIGINAL.clear()
        _FEED[0] = False
