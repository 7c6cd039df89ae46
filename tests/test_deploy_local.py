"""End-to-end: a real Flower deployment on loopback through scripts/deploy-local.sh.

One SuperLink and three SuperNodes (separate processes, gRPC with TLS), each node
emulating another device profile, then ``flwr run``. Checks the results the
ServerApp wrote, that TLS was in use, and that nothing the script started survives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "deploy-local.sh"
PROFILES = ("cpu-small", "cpu-large", "jetson-orin")
SUPERLINK_NODE_ID = 1  # flwr.common.constant.SUPERLINK_NODE_ID: sender of SuperLink errors

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (ROOT / ".venv" / "bin" / "flower-superlink").exists(),
        reason="needs .venv with Flower (run scripts/setup.sh)",
    ),
]


def _command(tmp_path: Path, run_config: str, nodes: int = 3) -> list[str]:
    return [
        "bash",
        str(SCRIPT),
        "--nodes",
        str(nodes),
        "--profiles",
        ",".join(PROFILES),
        "--run-config",
        run_config,
        "--workdir",
        str(tmp_path / "deploy"),
        "--timeout",
        "300",
    ]


def _run_config(tmp_path: Path, extra: str = "") -> str:
    return (
        "num-server-rounds=2 strategy='fedavg-groups' round-timeout=120 "
        f"output-dir='{tmp_path / 'results'}' run-name='e2e' {extra}"
    ).strip()


def _processes_naming(text: str) -> list[str]:
    """Live processes whose command line contains ``text`` (not this test's own)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and int(proc.name) != os.getpid():
            found.append(f"{proc.name}: {cmdline}")
    return found


def _processes_of(tmp_path: Path) -> list[str]:
    """Live processes that name ``tmp_path`` in their command line or environment.

    Every process of the deployment inherits ``FLWR_HOME=<workdir>/flwr-home``, so
    this also finds children whose command line does not name the workdir
    (flower-superexec, flwr-serverapp, flwr-clientapp).
    """
    needle = str(tmp_path).encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes()
        except OSError:  # exited, or another user's process
            continue
        if int(proc.name) == os.getpid() or not cmdline:
            continue
        if needle in cmdline or needle in environ:
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{proc.name}: {command}")
    return found


def _rounds(result: Path) -> list[dict[str, Any]]:
    lines = (result / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _output(proc: subprocess.CompletedProcess[str] | subprocess.Popen[str], out: str) -> str:
    return f"exit {proc.returncode}\n{out[-6000:]}"


def test_deploy_local_tls_three_nodes(tmp_path: Path) -> None:
    # Prepare
    cmd = _command(tmp_path, _run_config(tmp_path))
    result = tmp_path / "results" / "e2e"
    workdir = tmp_path / "deploy"

    # Execute
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    out = proc.stdout + proc.stderr

    # Assert: the run finished and wrote its results
    assert proc.returncode == 0, _output(proc, out)
    rounds = _rounds(result)
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert len(r["clients"]) >= 2, r
        assert r["num_rejected"] == 0, r["rejected"]
    archs = {c["arch"] for r in rounds for c in r["clients"]}
    assert len(archs) >= 2, f"every device chose the same architecture: {archs}"
    assert {c["profile"] for r in rounds for c in r["clients"]} == set(PROFILES)
    summary = json.loads((result / "summary.json").read_text())
    assert summary["rounds"] == 2

    # Assert: TLS was in use on the Fleet and Control APIs
    assert "TLS verified: Fleet API" in out and "TLS verified: Control API" in out, out
    superlink_log = (workdir / "logs" / "superlink.log").read_text()
    assert "--insecure" not in superlink_log and "insecure HTTP" not in superlink_log
    flwr_config = (workdir / "flwr-home" / "config.toml").read_text()
    assert f'root-certificates = "{workdir / "certs" / "ca.crt"}"' in flwr_config
    assert "insecure" not in flwr_config
    assert oct((workdir / "certs" / "server.key").stat().st_mode & 0o777) == "0o600"

    # Assert: nothing the deployment started is still running
    assert _processes_of(tmp_path) == []


def test_deploy_local_reports_a_supernode_stopped_during_round_two(tmp_path: Path) -> None:
    # Prepare: stop the third node (SIGTERM) once it has received its round-2 train
    # message, i.e. after round 1 completed and while round 2 is in flight
    cmd = _command(tmp_path, _run_config(tmp_path, "local-epochs=1"))
    metrics = tmp_path / "results" / "e2e" / "metrics.jsonl"
    node_log = tmp_path / "deploy" / "logs" / "supernode-2.log"

    # Execute
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    stopped: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            log = node_log.read_text() if node_log.exists() else ""
            if log.count("Receiving: train message") >= 2:
                for line in _processes_naming("partition-id=2 "):
                    pid, cmdline = line.split(": ", 1)
                    if "flower-supernode" in cmdline and str(tmp_path) in cmdline:
                        os.kill(int(pid), signal.SIGTERM)
                        stopped.append(line)
                break
            time.sleep(0.1)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=60)

    # Assert: one node was stopped and the run still finished round 2 without it
    assert len(stopped) == 1, _output(proc, out)
    assert proc.returncode == 0, _output(proc, out)
    first, second = _rounds(metrics.parent)
    assert first["num_ok"] == 3
    (lost,) = {c["node"] for c in first["clients"] if c["partition_id"] == 2}
    assert second["num_sent"] == 3
    assert {c["partition_id"] for c in second["clients"]} == {0, 1}, second
    assert _processes_of(tmp_path) == []

    # Assert: the stopped node is reported as failed in round 2
    failed = {e["node"] for e in second["failed"]}
    assert failed == {lost}, second
