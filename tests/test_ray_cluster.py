"""Past one machine: the simulation joins an existing two-node Ray cluster.

The test starts a real Ray head and one real worker node (``ray start --block``, each
its own process tree, on this machine's own addresses; one CPU each, so Flower's
actor pool takes one actor on each), runs ``scripts/simulate.sh --ray-address`` on
it, reads from the cluster's GCS which Ray node ran each ``ClientAppActor``, then
stops both nodes and checks by process id that nothing of the cluster or the run
remains.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import simulate
from tests.ray_nodes import NODES_SCRIPT, RayNodes, ask

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ACTORS_SCRIPT = """
import json, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps([
    a["Address"]["NodeID"] for a in state.actors().values()
    if a.get("ActorClassName", "").endswith("ClientAppActor")
]))
"""


@contextmanager
def two_node_cluster(log: Path) -> Iterator[str]:
    """Start a Ray head and one worker node, one CPU each; yield the GCS address."""
    nodes = RayNodes(log, num_cpus=1)
    try:
        nodes.start_head()
        nodes.add_worker()
        yield nodes.address
    finally:
        left = nodes.stop()
        assert not left, f"Ray processes left running: {left}"


def test_simulation_runs_on_a_two_node_ray_cluster_and_leaves_nothing(tmp_path: Path) -> None:
    with two_node_cluster(tmp_path / "ray.log") as address:
        # Execute: the project's simulation script, told to use the cluster
        result = simulate(
            tmp_path,
            "strategy='fedavg' num-server-rounds=2 local-epochs=1 dataset='digits' "
            "round-timeout=120.0 checkpoint-every=0",
            nodes=4,
            extra=["--ray-address", address],
        )
        nodes = set(ask(NODES_SCRIPT, address))
        actor_nodes = ask(ACTORS_SCRIPT, address)

    # Assert: every round completed with every node, on both Ray nodes
    rounds = [json.loads(line) for line in (result / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["num_ok"] == 4 and r["num_rejected"] == 0 for r in rounds)
    assert len(nodes) == 2
    assert set(actor_nodes) == nodes, (actor_nodes, nodes)
