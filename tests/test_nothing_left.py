"""A real simulation stopped by Ctrl-C on a loaded machine leaves no process behind.

``scripts/simulate.sh`` starts a local SuperLink (which outlives ``flwr run``), which
launches ``flwr-simulation`` in a session of its own, which starts Ray (its GCS,
raylet and workers). This test loads both cores, starts a real run, and while it
runs records every process id of that tree: the script's descendants, re-scanned
every half second (a process re-parented to init after its parent ended stays
recorded), and every process whose command line names the test's folder (the
SuperLink and ``flwr-simulation`` name their Flower home). Once a round has been
recorded it sends SIGINT to the script's process group, as a terminal's Ctrl-C does,
and checks by process id that every recorded process has ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import process_gone

ROOT = Path(__file__).resolve().parents[1]


def _parents() -> dict[int, int]:
    """Map every live process id to its parent's."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            out[int(entry.name)] = int(fields[1])
    return out


def _descendants(root: int) -> set[int]:
    parents = _parents()
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _naming(text: str) -> set[int]:
    """Process ids whose command line holds ``text`` (this test's own process aside)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                out.add(int(entry.name))
    return out


@pytest.mark.slow
def test_ctrl_c_mid_run_on_a_loaded_machine_leaves_no_process(tmp_path: Path) -> None:
    # Prepare: both cores busy, then a real run long enough to be stopped mid-way
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    out = tmp_path / "results"
    metrics = out / "ctrl-c" / "metrics.jsonl"
    script = None
    seen: set[int] = set()
    try:
        script = subprocess.Popen(
            [
                "bash",
                "scripts/simulate.sh",
                "--nodes",
                "3",
                "--run-name",
                "ctrl-c",
                "--output-dir",
                str(out),
                "--run-config",
                "num-server-rounds=40 local-epochs=1",
            ],
            cwd=ROOT,
            env={**os.environ, "FLWR_HOME_SIM": str(tmp_path / "flwr-home")},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline and script.poll() is None:
            seen |= _descendants(script.pid) | _naming(str(tmp_path))
            if metrics.exists() and metrics.read_text().strip():
                break
            time.sleep(0.5)
        assert script.poll() is None, f"the run ended by itself (exit {script.returncode})"
        assert metrics.exists() and metrics.read_text().strip(), "no round within 420 s"
        seen |= _descendants(script.pid) | _naming(str(tmp_path))
        assert any("flwr-simulation" in _cmdline(pid) for pid in seen), "no flwr-simulation seen"

        # Execute: Ctrl-C
        os.killpg(script.pid, signal.SIGINT)
        script.wait(timeout=120)

        # Assert: every process of the run's tree has ended
        time.sleep(1.0)
        left = {pid: _cmdline(pid) for pid in seen if not process_gone(pid)}
        assert left == {}, f"processes left running after Ctrl-C: {left}"
    finally:
        if script is not None and script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
        for proc in load:
            proc.kill()
            proc.wait()


_CMDLINES: dict[int, str] = {}


def _cmdline(pid: int) -> str:
    """A process's command line (remembered, so it can be named after it ended)."""
    with contextlib.suppress(OSError):
        _CMDLINES[pid] = (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")).decode()
    return _CMDLINES.get(pid, "?")


# A benchmark in miniature: it starts a "simulation" (a process tree in a session of
# its own, as benchmarks/scale.py starts scripts/simulate.sh) and waits for it.
BENCHMARK = """
import subprocess, sys
from benchmarks.harness import sigterm_as_ctrl_c, stop_group

with sigterm_as_ctrl_c():
    proc = subprocess.Popen(
        ["bash", "-c", "sleep 300 & sleep 300 & echo $$ $(jobs -p); wait"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        print(proc.stdout.readline().strip(), flush=True)
        proc.wait()
    finally:
        if proc.poll() is None:
            stop_group(proc)
"""


def test_a_benchmark_stopped_with_kill_stops_the_simulation_it_started(tmp_path: Path) -> None:
    # Prepare: the miniature benchmark, and the process ids of its child's tree
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCHMARK],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert bench.stdout is not None
    tree = [int(pid) for pid in bench.stdout.readline().split()]
    assert len(tree) == 3

    # Execute: `kill` (SIGTERM), which by default ends Python without its clean-up
    bench.terminate()
    bench.wait(timeout=60)

    # Assert: the child's whole group ended with it
    time.sleep(0.5)
    assert [pid for pid in tree if not process_gone(pid)] == []


def test_a_benchmark_command_past_its_timeout_is_stopped_with_its_whole_group(
    tmp_path: Path,
) -> None:
    # Prepare: a "simulation" whose children outlive it unless its group is stopped
    # (as the SuperLink outlives `flwr run`); subprocess.run's timeout kills bash alone
    from benchmarks.harness import run_in_group

    pids = tmp_path / "pids"
    script = f"sleep 300 & sleep 300 & echo $$ $(jobs -p) > {pids}; wait"

    # Execute
    with pytest.raises(subprocess.TimeoutExpired):
        run_in_group(["bash", "-c", script], timeout=2.0)

    # Assert: the script and both children ended, by process id
    tree = [int(pid) for pid in pids.read_text().split()]
    assert len(tree) == 3
    time.sleep(0.5)
    assert [pid for pid in tree if not process_gone(pid)] == []


def test_a_benchmark_command_in_its_group_returns_its_output_and_status() -> None:
    from benchmarks.harness import run_in_group

    done = run_in_group(["bash", "-c", "echo out; echo err >&2; exit 3"], timeout=30.0)

    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
