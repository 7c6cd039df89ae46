"""A node's data held in this process's memory, across the messages it serves.

A simulation worker process serves many messages, and Flower calls the handlers as
plain functions: module state is the only thing the process keeps from one message
to the next. Two things are kept here:

- each node's splits, in :class:`MemoryCache` (bounded in entries and bytes), the
  process's own one being :func:`process_cache`;
- each federation's partitioning (:func:`federation_of`), the last
  :data:`FEDERATIONS_KEPT` of them, since a worker serves far more nodes of a
  federation than the per-node cache holds.

:func:`clear_memory_cache` forgets both (the disk cache, :mod:`tessera.data.cache`,
is kept).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from tessera.data.splits import FederationPartitions, NodeSplits


class MemoryCache:
    """A least-recently-used map from key to :class:`NodeSplits`, bounded twice.

    Parameters
    ----------
    max_entries : int
        Most entries kept.
    max_bytes : int
        Most array bytes kept; an entry larger than this is not kept at all.

    Raises
    ------
    ValueError
        If a bound is negative.
    """

    def __init__(self, *, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(
                f"MemoryCache bounds must be >= 0, got max_entries={max_entries} and "
                f"max_bytes={max_bytes}; use 0 to keep nothing"
            )
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, NodeSplits] = OrderedDict()
        self._nbytes = 0  # kept as entries come and go: summing them per put was O(entries)

    def __len__(self) -> int:
        """Return the number of entries held."""
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Array bytes held by all entries."""
        return self._nbytes

    def get(self, key: str) -> NodeSplits | None:
        """Return the entry of ``key`` (marking it recently used), or ``None``."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, value: NodeSplits) -> None:
        """Keep ``value`` under ``key``, evicting the least recently used to fit."""
        self.discard(key)
        if self.max_entries == 0 or value.nbytes > self.max_bytes:
            return
        self._entries[key] = value
        self._nbytes += value.nbytes
        while len(self._entries) > self.max_entries or self._nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._nbytes -= evicted.nbytes

    def discard(self, key: str) -> None:
        """Drop the entry of ``key`` if there is one."""
        dropped = self._entries.pop(key, None)
        if dropped is not None:
            self._nbytes -= dropped.nbytes

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self._nbytes = 0


# Per process on purpose: Flower calls the handlers as plain functions, so module
# state is the only thing a simulation worker keeps from one message to the next
# (``context.state`` is serialised and would copy the arrays on every message).
# Bounded by bytes first: a simulation worker serves its nodes in turn, round after
# round, so a least-recently-used cache of fewer entries than it has nodes misses on
# every message (16 entries made a 1,000-node federation rebuild every node's splits
# on every message); small nodes' splits all fit, large ones are held by the byte bound.
_MEMORY = MemoryCache(max_entries=100_000, max_bytes=1 << 30)

FEDERATIONS_KEPT = 2
"""Federations whose partitioning a process keeps (:func:`federation_of`)."""
_FEDERATIONS: OrderedDict[str, FederationPartitions] = OrderedDict()


def clear_memory_cache() -> None:
    """Forget every node's data held in this process (the disk cache is kept)."""
    _MEMORY.clear()
    _FEDERATIONS.clear()


def federation_of(
    key: str | None, build: Callable[[], FederationPartitions]
) -> FederationPartitions:
    """Return a federation's partitioning, computed once per process per ``key``.

    A simulation worker serves every node of a federation in turn, far more nodes
    than the per-node cache holds; the server-pool split and the partitioning are
    the same for all of them, so they are kept (the last :data:`FEDERATIONS_KEPT`
    federations) and each node's data is then a slice of them.
    """
    if key is None:
        return build()
    found = _FEDERATIONS.get(key)
    if found is None:
        found = build()
        _FEDERATIONS[key] = found
        while len(_FEDERATIONS) > FEDERATIONS_KEPT:
            _FEDERATIONS.popitem(last=False)
    else:
        _FEDERATIONS.move_to_end(key)
    return found


def process_cache() -> MemoryCache:
    """Return this process's own in-memory cache of node data."""
    return _MEMORY
