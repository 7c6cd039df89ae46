"""Real SuperLink and SuperNode processes refuse untrusted connections.

A SuperLink with TLS (certificates from ``scripts/gen-certs.sh``) accepts a SuperNode
that trusts its CA and refuses one without the CA and one started with
``--insecure``; with SuperNode authentication on, a registered key joins and an
unregistered one is refused. "Refused" is asserted on the SuperLink's own view
(``flwr supernode list --format json`` through the Control API) and on the refused
SuperNode's process, not only on a log line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / ".venv" / "bin"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (BIN / "flower-superlink").exists(),
        reason="needs .venv with Flower (run scripts/setup.sh)",
    ),
]


def _free_ports(count: int) -> list[int]:
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_port(port: int, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {limit}s")


@dataclass
class Deployment:
    """Processes of one test deployment; every one is killed at the end."""

    workdir: Path
    env: dict[str, str]
    fleet: int = 0
    control: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [str(a) for a in args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def supernode(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        appio = _free_ports(1)[0]
        return self.start(
            name,
            BIN / "flower-supernode",
            *args,
            "--superlink",
            f"127.0.0.1:{self.fleet}",
            "--clientappio-api-address",
            f"127.0.0.1:{appio}",
            "--node-config",
            "partition-id=0 num-partitions=1",
        )

    def nodes(self) -> list[dict[str, Any]]:
        """The SuperLink's list of SuperNodes, through the Control API (TLS)."""
        proc = subprocess.run(
            [str(BIN / "flwr"), "supernode", "list", "tls-test", "--format", "json"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        document = json.loads(proc.stdout)
        assert document.get("success") is True, document
        return list(document.get("nodes", []))

    def online(self) -> list[dict[str, Any]]:
        return [n for n in self.nodes() if str(n.get("status", "")).lower() == "online"]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):  # children that outlived it
                os.killpg(proc.pid, signal.SIGKILL)


def _processes_naming(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and int(proc.name) != os.getpid():
            found.append(f"{proc.name}: {cmdline}")
    return found


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    home = tmp_path / "flwr-home"
    home.mkdir()
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
    }
    subprocess.run(
        [
            "bash",
            "scripts/gen-certs.sh",
            "--out",
            str(tmp_path / "certs"),
            "--names",
            "127.0.0.1,localhost",
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    dep = Deployment(workdir=tmp_path, env=env)
    try:
        yield dep
    finally:
        dep.stop()
        assert [p for p in _processes_naming(str(tmp_path))] == []


def start_superlink(dep: Deployment, *extra: str) -> None:
    appio, dep.fleet, dep.control = _free_ports(3)
    certs = dep.workdir / "certs"
    dep.start(
        "superlink",
        BIN / "flower-superlink",
        "--ssl-ca-certfile",
        certs / "ca.crt",
        "--ssl-certfile",
        certs / "server.pem",
        "--ssl-keyfile",
        certs / "server.key",
        "--serverappio-api-address",
        f"127.0.0.1:{appio}",
        "--fleet-api-address",
        f"127.0.0.1:{dep.fleet}",
        "--control-api-address",
        f"127.0.0.1:{dep.control}",
        "--database",
        dep.workdir / "state.db",
        *extra,
    )
    for port in (dep.fleet, dep.control):
        _wait_port(port, 60)
    (dep.workdir / "flwr-home" / "config.toml").write_text(
        '[superlink]\ndefault = "tls-test"\n\n[superlink.tls-test]\n'
        f'address = "127.0.0.1:{dep.control}"\n'
        f'root-certificates = "{certs / "ca.crt"}"\n'
    )


def wait_until(predicate: Any, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(1.0)
    return False


def test_tls_superlink_refuses_nodes_without_the_ca_and_insecure_ones(
    deployment: Deployment,
) -> None:
    # Prepare
    dep = deployment
    start_superlink(dep)
    ca = dep.workdir / "certs" / "ca.crt"

    # Execute: one node trusts our CA; one has no CA (system roots); one is --insecure
    dep.supernode("trusted", "--root-certificates", str(ca))
    no_ca = dep.supernode("no-ca")
    insecure = dep.supernode("insecure", "--insecure")

    # Assert: exactly the trusted node is online, and stays the only one
    assert wait_until(lambda: len(dep.online()) == 1, 90), dep.nodes()
    time.sleep(10)  # give the refused nodes time to (fail to) connect
    assert len(dep.nodes()) == 1, dep.nodes()
    # ... and each refused node saw why: the one without our CA could not verify the
    # SuperLink's certificate; the plaintext one never got a gRPC connection through
    assert "CERTIFICATE_VERIFY_FAILED" in dep.log("no-ca"), dep.log("no-ca")[-3000:]
    assert "Connection attempt failed" in dep.log("insecure"), dep.log("insecure")[-3000:]
    assert insecure.poll() is None or insecure.returncode != 0
    assert no_ca.poll() is None or no_ca.returncode != 0


def test_authentication_refuses_an_unregistered_key(deployment: Deployment) -> None:
    # Prepare: two key pairs; only the first is registered with the SuperLink
    dep = deployment
    start_superlink(dep, "--enable-supernode-auth")
    keys = dep.workdir / "keys"
    keys.mkdir()
    for name in ("registered", "stranger"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f", str(keys / name)],
            check=True,
            capture_output=True,
            timeout=60,
        )
    reg = subprocess.run(
        [str(BIN / "flwr"), "supernode", "register", str(keys / "registered.pub"), "tls-test"],
        env=dep.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert reg.returncode == 0, reg.stdout + reg.stderr
    ca = str(dep.workdir / "certs" / "ca.crt")

    # Execute
    dep.supernode(
        "registered",
        "--root-certificates",
        ca,
        "--auth-supernode-private-key",
        str(keys / "registered"),
    )
    stranger = dep.supernode(
        "stranger",
        "--root-certificates",
        ca,
        "--auth-supernode-private-key",
        str(keys / "stranger"),
    )

    # Assert: the registered node comes online; the stranger is refused by the
    # SuperLink (FAILED_PRECONDITION) and never appears in its list
    assert wait_until(lambda: len(dep.online()) == 1, 90), dep.nodes()
    refused = "No SuperNode found with the given public key"
    assert wait_until(lambda: refused in dep.log("stranger"), 60), dep.log("stranger")[-3000:]
    assert "FAILED_PRECONDITION" in dep.log("stranger")
    assert stranger.poll() is None or stranger.returncode != 0
    nodes = dep.nodes()
    assert len(nodes) == 1, nodes
    assert len(dep.online()) == 1
