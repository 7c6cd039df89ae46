"""Real Ray nodes for the end-to-end tests: one shared head, and clusters of their own.

Each ``scripts/simulate.sh`` run used to start a Ray of its own (Flower's backend calls
``ray.init()``), about 20 s of each simulation test on this 2-core machine, and now and
then a raylet that did not come up within Ray's fixed 30 s, which the script retries
(40 s and more each). The suite's simulations therefore join one Ray head instead
(:func:`shared_head_address`), started on first use with the CPUs Ray detects (as a Ray
of the run's own would), and stopped at the end of the session (:func:`stop_shared_head`, from
``pytest_sessionfinish``), which checks by process id that nothing of it remains. Each
run is a Ray job of its own: its actors and workers end with its driver, as they do
when it starts its own Ray. ``TESSERA_TEST_OWN_RAY=1`` makes every simulation start its
own Ray again, as a user's run does; ``tests/test_nothing_left.py`` keeps testing that
path (Ctrl-C and kill on a loaded machine).

:class:`RayNodes` starts real ``ray start --block`` processes, each its own process
group, in a short temporary folder of their own (Ray's socket paths must stay under
about 100 characters, and ``ray start`` writes ``ray_current_cluster`` there rather than
in ``/tmp/ray``, where any other ``ray.init()`` on this machine would find it and join).
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
import warnings
from contextlib import suppress
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
#: seconds a head or a worker may take to start
START_TIMEOUT_S = 120.0

NODES_SCRIPT = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps([n["NodeID"] for n in ray.nodes() if n["Alive"]]))
"""

#: the actors (alive or dead) of every job the cluster ran, by state and class
ACTOR_STATES_SCRIPT = """
import json, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps([
    f"{a.get('State')} {a.get('ActorClassName')} (job {a.get('JobID')})"
    for a in state.actors().values()
]))
"""


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_env() -> dict[str, str]:
    """This process's environment without a ``RAY_ADDRESS``, usage statistics off."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return env


def ask(script: str, address: str) -> list[str]:
    """Run ``script`` (a Ray driver printing a JSON list last) against ``address``."""
    out = subprocess.run(
        [sys.executable, "-c", script, address],
        capture_output=True,
        text=True,
        timeout=120,
        env=ray_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def pids_under(folder: str) -> list[int]:
    """Process ids whose command line names ``folder``."""
    found = subprocess.run(["pgrep", "-f", folder], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def with_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``proc`` leads (gone already: nothing)."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def with_pid(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to ``pid`` (gone already: nothing)."""
    with suppress(ProcessLookupError):
        os.kill(pid, sig)


class RayNodes:
    """A Ray head and optional workers on this machine, stopped whole by :meth:`stop`.

    Parameters
    ----------
    log : Path
        Where the nodes' ``ray start`` output goes.
    num_cpus : int | None
        CPUs each node offers (``None``: what Ray detects, as a Ray of a run's own does).
    """

    def __init__(self, log: Path, *, num_cpus: int | None) -> None:
        self.temp = tempfile.mkdtemp(prefix="tray-", dir="/tmp")
        self.address = f"127.0.0.1:{free_port()}"
        self.log = log
        cpus = [] if num_cpus is None else [f"--num-cpus={num_cpus}"]
        self._common = ["--block", *cpus, f"--temp-dir={self.temp}", "--disable-usage-stats"]
        self._procs: list[subprocess.Popen[bytes]] = []

    def _start(self, args: list[str]) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as out:
            proc = subprocess.Popen(
                [RAY, "start", *args, *self._common],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=ray_env(),
            )
        self._procs.append(proc)
        return proc

    def start_head(self) -> None:
        """Start the head and wait until a driver can join it and sees one node."""
        port = self.address.rsplit(":", 1)[1]
        head = self._start(["--head", f"--port={port}", "--include-dashboard=false"])
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (Path(self.temp) / "ray_current_cluster").exists():
            assert head.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray head did not start in 120 s"
            time.sleep(0.5)
        assert len(ask(NODES_SCRIPT, self.address)) == 1, self.log.read_text()[-3000:]

    def add_worker(self) -> None:
        """Start one worker node and wait until the head lists it."""
        worker = self._start([f"--address={self.address}"])
        want = len(self._procs)
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(ask(NODES_SCRIPT, self.address)) < want:
            assert worker.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray worker did not join in 120 s"
            time.sleep(1)

    def stop(self) -> list[int]:
        """Stop every node (workers first); return the process ids that outlived it."""
        for proc in reversed(self._procs):
            with_group(proc, signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with_group(proc, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pids_under(self.temp) and time.monotonic() < deadline:
            time.sleep(1)
        for pid in pids_under(self.temp):  # a raylet's worker that outlived it
            with_pid(pid, signal.SIGKILL)
        time.sleep(1)
        left = pids_under(self.temp)
        shutil.rmtree(self.temp, ignore_errors=True)
        return left


_SHARED: dict[str, RayNodes | None] = {}


def shared_head_address() -> str | None:
    """The shared Ray head's GCS address, started on first call; ``None``: start your own.

    ``None`` when ``TESSERA_TEST_OWN_RAY=1``, or when the head failed to start (a
    warning says why; each simulation then starts its own Ray, with the script's
    retries), and on every later call after such a failure.
    """
    if os.environ.get("TESSERA_TEST_OWN_RAY", "").strip() in {"1", "true", "yes"}:
        return None
    if "head" not in _SHARED:
        log = Path(tempfile.gettempdir()) / f"tessera-test-ray-{os.getpid()}.log"
        nodes = RayNodes(log, num_cpus=None)
        try:
            nodes.start_head()
        except (AssertionError, OSError, subprocess.SubprocessError) as err:
            left = nodes.stop()
            warnings.warn(
                f"the shared Ray head did not start ({err!s:.300}; log {log}); each "
                f"simulation starts its own Ray{f'; left running: {left}' if left else ''}",
                stacklevel=2,
            )
            _SHARED["head"] = None
        else:
            _SHARED["head"] = nodes
    head = _SHARED["head"]
    return None if head is None else head.address


def stop_shared_head() -> list[str]:
    """Stop the shared head if one was started; return what its runs left behind.

    Before the head stops, every actor any simulation started on it must be dead
    (each run's actors end with its job, as its own Ray's would); after, no process
    of the head may remain. Returns one line per actor still alive and per process
    left running (empty: nothing was left).
    """
    head = _SHARED.pop("head", None)
    if head is None:
        return []
    deadline = time.monotonic() + 30
    alive = [a for a in ask(ACTOR_STATES_SCRIPT, head.address) if not a.startswith("DEAD")]
    while alive and time.monotonic() < deadline:  # the last job's actors may still be ending
        time.sleep(1)
        alive = [a for a in ask(ACTOR_STATES_SCRIPT, head.address) if not a.startswith("DEAD")]
    left = head.stop()
    return [f"actor still alive: {a}" for a in alive] + [f"process left: {p}" for p in left]
