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
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from tests.conftest import simulate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RAY = str(Path(sys.executable).with_name("ray"))

NODES_SCRIPT = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps([n["NodeID"] for n in ray.nodes() if n["Alive"]]))
"""

ACTORS_SCRIPT = """
import json, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps([
    a["Address"]["NodeID"] for a in state.actors().values()
    if a.get("ActorClassName", "").endswith("ClientAppActor")
]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ask(script: str, address: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", script, address],
        capture_output=True,
        text=True,
        timeout=120,
        env=_ray_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def _ray_env() -> dict[str, str]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return env


def _cluster_pids(temp: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", temp], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


@contextmanager
def two_node_cluster(log: Path) -> Iterator[str]:
    """Start a Ray head and one worker node, one CPU each; yield the GCS address."""
    # a short folder of its own: Ray's socket paths must stay under ~100 characters,
    # and `ray start` writes ray_current_cluster there, not in /tmp/ray where any
    # other ray.init() on this machine would find it and join
    temp = tempfile.mkdtemp(prefix="tray-", dir="/tmp")
    address = f"127.0.0.1:{_free_port()}"
    common = ["--block", "--num-cpus=1", f"--temp-dir={temp}", "--disable-usage-stats"]
    procs: list[subprocess.Popen[bytes]] = []
    with log.open("wb") as out:
        try:
            procs.append(
                subprocess.Popen(
                    [RAY, "start", "--head", f"--port={address.rsplit(':', 1)[1]}",
                     "--include-dashboard=false", *common],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=_ray_env(),
                )
            )  # fmt: skip
            deadline = time.monotonic() + 120
            while not (Path(temp) / "ray_current_cluster").exists():
                assert procs[0].poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the Ray head did not start in 120 s"
                time.sleep(0.5)
            procs.append(
                subprocess.Popen(
                    [RAY, "start", f"--address={address}", *common],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=_ray_env(),
                )
            )  # fmt: skip
            while len(_ask(NODES_SCRIPT, address)) < 2:
                assert procs[1].poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the Ray worker did not join in 120 s"
                time.sleep(1)
            yield address
        finally:
            for proc in reversed(procs):
                with_group(proc, signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    with_group(proc, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while _cluster_pids(temp) and time.monotonic() < deadline:
                time.sleep(1)
            for pid in _cluster_pids(temp):  # a raylet's worker that outlived it
                with_pid(pid, signal.SIGKILL)
            time.sleep(1)
            left = _cluster_pids(temp)
            shutil.rmtree(temp, ignore_errors=True)
            assert not left, f"Ray processes left running: {left}"


def with_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``proc`` leads (gone already: nothing)."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def with_pid(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to ``pid`` (gone already: nothing)."""
    with suppress(ProcessLookupError):
        os.kill(pid, sig)


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
        nodes = set(_ask(NODES_SCRIPT, address))
        actor_nodes = _ask(ACTORS_SCRIPT, address)

    # Assert: every round completed with every node, on both Ray nodes
    rounds = [json.loads(line) for line in (result / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["num_ok"] == 4 and r["num_rejected"] == 0 for r in rounds)
    assert len(nodes) == 2
    assert set(actor_nodes) == nodes, (actor_nodes, nodes)
