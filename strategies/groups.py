"""Global weights per architecture group, aggregated through the Aggregator seam.

:class:`GroupModels` is the weight-averaging component every weight-sharing scheme
uses (``fedavg`` and ``fedprox`` with one group, ``fedavg-groups``, Felo's weight
sharing, FedHeNN's homogeneous mode). Each round it opens one accumulator per group
lazily, folds each accepted reply in as it arrives, and either commits the results
(the round reached its quorum) or discards them (the global weights stay as they
were).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
from flwr.app import RecordDict

from strategies.aggregators import Accumulator, Aggregator, Index
from strategies.validation import ClientReply
from tessera import wire


class GroupModels:
    """One set of global weights per architecture, and this round's accumulators.

    Parameters
    ----------
    aggregator : Aggregator
        Folds updates into new weights.
    initial : Callable[[str], dict[str, np.ndarray]]
        Seeded initial weights of an architecture (the first time it is needed).
    """

    def __init__(
        self, aggregator: Aggregator, initial: Callable[[str], dict[str, np.ndarray]]
    ) -> None:
        self.aggregator = aggregator
        self.initial = initial
        self.arrays: dict[str, dict[str, np.ndarray]] = {}
        self._pending: dict[str, Accumulator] = {}

    def get(self, arch: str) -> dict[str, np.ndarray]:
        """Return the current global weights of ``arch`` (initialised on first use)."""
        if arch not in self.arrays:
            self.arrays[arch] = self.initial(arch)
        return self.arrays[arch]

    def fold(
        self,
        arch: str,
        update: Mapping[str, np.ndarray],
        weight: float,
        *,
        index: Mapping[str, Index] | None = None,
    ) -> None:
        """Fold one accepted update of ``arch`` into this round's accumulator."""
        if arch not in self._pending:
            self._pending[arch] = self.aggregator.accumulator(self.get(arch))
        self._pending[arch].add(update, weight, index=index)

    def commit(self) -> dict[str, int]:
        """Replace each group's weights by its aggregate; return updates per group."""
        sizes = {}
        for arch, acc in sorted(self._pending.items()):
            if acc.count > 0:
                self.arrays[arch] = acc.result()
                sizes[arch] = acc.count
        self._pending = {}
        return sizes

    def discard(self) -> None:
        """Drop this round's accumulators; the global weights stay unchanged."""
        self._pending = {}

    def state_dict(self) -> dict[str, Any]:
        """Return the global weights, for a checkpoint."""
        return {arch: dict(arrays) for arch, arrays in self.arrays.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the global weights of :meth:`state_dict`."""
        self.arrays = {
            str(arch): {str(k): np.asarray(v) for k, v in arrays.items()}
            for arch, arrays in state.items()
        }
        self._pending = {}


def without_arrays(reply: ClientReply) -> ClientReply:
    """Return the reply without its weights (kept for the round record once they are folded)."""
    content = RecordDict({k: v for k, v in reply.content.items() if k != wire.ARRAYS})
    return replace(reply, arrays=None, content=content)


def fold_weights(models: GroupModels, reply: ClientReply) -> ClientReply:
    """Fold a validated reply's weights (example-weighted) and return it without them.

    Raises
    ------
    ValueError
        If the reply carries no weights (the reply schema should have demanded them).
    """
    if reply.arrays is None:
        raise ValueError(f"node {reply.node_id} sent no weights")
    models.fold(reply.arch, reply.arrays, float(reply.num_examples))
    return without_arrays(reply)
