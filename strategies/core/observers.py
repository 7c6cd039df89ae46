"""Watching a run from outside the scheme: the attack harness's plan and its success.

The round loop asks an :class:`AttackObserver` which nodes the run config made
hostile (simulation draws them from run-config ``attack``, so the server knows them
for the record; nodes made hostile by their node-config alone are not known to the
server) and, after the scheme's own evaluation, how well the attack did. No scheme
checks for an attack itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from strategies.core.nodes import NodeTable
from tessera.attacks import attack_assignment
from tessera.config import RunConfig
from tessera.data import ArrayDataset

__all__ = ["AttackObserver", "flipped_test_set"]

Scorer = Callable[[ArrayDataset], Mapping[str, float]]
"""Accuracy of each global model (by architecture) on a data set."""


def flipped_test_set(test: ArrayDataset, num_classes: int) -> ArrayDataset:
    """Return the samples the label-flip attack relabels, relabelled ``C - 1 - y``.

    A model's accuracy on it is the attack's success: the share predicted as the
    flipped label (samples whose label the flip leaves alone are dropped).
    """
    target = num_classes - 1 - test.y
    changed = target != test.y
    return ArrayDataset(test.x[changed], target[changed].astype(np.int64))


class AttackObserver:
    """The run's attack plan and the attack's measured success.

    Parameters
    ----------
    run : RunConfig
        Its ``attack*`` keys.
    test : ArrayDataset
        The server's test set.
    num_classes : int
        Classes of the task.
    """

    def __init__(self, run: RunConfig, test: ArrayDataset, num_classes: int) -> None:
        self.run = run
        self.test = test
        self.num_classes = num_classes
        self._flipped: ArrayDataset | None = None

    def plan(self, table: NodeTable) -> dict[int, str]:
        """Return the hostile partitions and their attacks as the run config draws them."""
        if not self.run.attack.kinds or not table.nodes:
            return {}
        count = max([len(table.nodes)] + [i.partition_id + 1 for i in table.nodes.values()])
        return attack_assignment(self.run, count)

    def document(self, table: NodeTable) -> dict[str, Any] | None:
        """Return the attack settings and plan for ``config.json`` (``None`` without one)."""
        run = self.run
        if not run.attack.kinds:
            return None
        return {
            "attacks": list(run.attack.kinds),
            "fraction": run.attack.fraction,
            "partitions": {str(p): a for p, a in sorted(self.plan(table).items())},
            "lambda": run.attack.lam,
            "scale": run.attack.scale,
            "noise": run.attack.noise,
        }

    def attackers(self, table: NodeTable, selected: Mapping[int, str]) -> list[dict[str, Any]]:
        """Return the selected nodes that the plan made hostile, for the round record."""
        plan = self.plan(table)
        out = []
        for node in sorted(selected):
            partition = table.partition_of(node)
            if partition is not None and partition in plan:
                out.append({"node": node, "partition_id": partition, "attack": plan[partition]})
        return out

    def flipped(self) -> ArrayDataset:
        """Return the server test set as the label-flip attack relabels it (built once)."""
        if self._flipped is None:
            self._flipped = flipped_test_set(self.test, self.num_classes)
        return self._flipped

    def evaluate(self, score: Scorer) -> dict[str, Any]:
        """Measure the label-flip attack's success on the global models (empty without one).

        ``attack_success_by_arch`` is each global model's accuracy on
        :meth:`flipped`, ``attack_success`` their mean.
        """
        if "label-flip" not in self.run.attack.kinds:
            return {}
        success = dict(score(self.flipped()))
        if not success:
            return {}
        return {
            "attack_success_by_arch": success,
            "attack_success": float(np.mean(list(success.values()))),
        }
