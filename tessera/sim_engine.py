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
_PATCH_LOCK = threading.Lock()
_ORIGINAL: dict[str, Callable[..., Any]] = {}


def _index(state: Any) -> dict[int, list[str]]:
    """Return the state's per-node index, built from what is already stored on first use."""
    index: dict[int, list[str]] | None = state.__dict__.get(_INDEX)
    if index is None:
        index = {}
        for message_id, message in list(state.message_ins_store.items()):
            index.setdefault(int(message.metadata.dst_node_id), []).append(message_id)
        state.__dict__[_INDEX] = index
    return index


def _store_message_ins(state: Any, message: Any) -> str | None:
    """Flower's ``store_message_ins``, then the new message's id in its node's list."""
    message_id: str | None = _ORIGINAL["store_message_ins"](state, message)
    if message_id is not None:
        with state.lock:
            _index(state).setdefault(int(message.metadata.dst_node_id), []).append(message_id)
    return message_id


def _get_message_ins(state: Any, node_id: int, limit: int | None) -> list[Any]:
    """Flower's ``get_message_ins``, walking only the messages stored for ``node_id``."""
    if limit is not None and limit < 1:
        raise AssertionError("`limit` must be >= 1")
    found: list[Any] = []
    with state.lock:
        index = _index(state)
        live = []
        for message_id in index.get(node_id, ()):
            if message_id not in state.message_ins_store:
                continue  # deleted (its reply was pulled, or it expired)
            state._check_stored_messages({message_id})  # expiry, federation: Flower's checks
            message = state.message_ins_store.get(message_id)
            if message is None:
                continue
            live.append(message_id)
            if (not limit or len(found) < limit) and message.metadata.delivered_at == "":
                found.append(message)
        if live:
            index[node_id] = live
        else:
            index.pop(node_id, None)
    if found:
        from flwr.common import now

        delivered_at = now().isoformat()
        for message in found:
            message.metadata.delivered_at = delivered_at
    return found


def index_messages_by_node() -> bool:
    """Index Flower's in-memory message store by destination node (see the module doc).

    Idempotent. Returns whether the index is in place: ``False`` (Flower's own
    method kept, logged once) when the installed Flower is not :data:`FLOWER_VERSION`.
    """
    import flwr
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    with _PATCH_LOCK:
        if _ORIGINAL:
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
        log.debug("simulation engine: messages looked up by node")
        return True


def restore_flower() -> None:
    """Put Flower's own methods back (for tests)."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    with _PATCH_LOCK:
        for name, method in _ORIGINAL.items():
            setattr(InMemoryLinkState, name, method)
        _ORIGINAL.clear()
