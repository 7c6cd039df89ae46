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
    """The tests' run config; ``extra`` holds ``key=value`` overrides (no spaces in values)."""
    values = {
        "num-server-rounds": "2",
        "strategy": "'fedavg-groups'",
        "round-timeout": "120",
        "output-dir": f"'{tmp_path / 'results'}'",
        "run-name": "'e2e'",
    }
    for item in extra.split():
        key, value = item.split("=", 1)
        values[key] = value
    return " ".join(f"{k}={v}" for k, v in values.items())


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
    # Prepare: node 2 is hostile (node-config attack='boost': its update x100); it
    # shares cnn-5 with node 1, so the cohort bound applies to it
    config = _run_config(tmp_path, "attack-scale=100.0")
    cmd = [*_command(tmp_path, config), "--node-config", "2:attack='boost'"]
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

    # Assert: the attacking SuperNode took part, every round completed, and where it
    # shared an architecture group its boosted update was clipped
    clipped = []
    for r in rounds:
        assert not r["skipped"] and r["num_failed"] == 0, r
        node_of = {c["partition_id"]: c["node"] for c in r["clients"]}
        clipped += [c["distance"] / c["bound"] for c in r["clipped"] if c["node"] == node_of[2]]
    assert clipped and max(clipped) > 10, [r["clipped"] for r in rounds]
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
                    if _is_supernode(cmdline) and str(tmp_path) in cmdline:
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


def _is_supernode(cmdline: str) -> bool:
    """Whether a command line is a SuperNode's: Flower's own, or Tessera's paced launcher."""
    return "flower-supernode" in cmdline or "tessera.supernode" in cmdline


def _wait_for(predicate: Any, proc: subprocess.Popen[str], limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _supernode_of_partition(
    tmp_path: Path, partition: int
) -> tuple[int, list[str], dict[str, str]]:
    """The pid, argv and environment of the SuperNode serving ``partition``."""
    for line in _processes_naming(f"partition-id={partition} "):
        pid, cmdline = line.split(": ", 1)
        if _is_supernode(cmdline) and str(tmp_path) in cmdline:
            proc = Path("/proc") / pid
            argv = proc.joinpath("cmdline").read_bytes().split(b"\0")
            env = proc.joinpath("environ").read_bytes().split(b"\0")
            return (
                int(pid),
                [a.decode() for a in argv if a],
                dict(e.decode().split("=", 1) for e in env if b"=" in e),
            )
    raise AssertionError(f"no SuperNode for partition {partition}")


def test_supernode_killed_mid_round_restarts_and_its_personal_model_continues(
    tmp_path: Path,
) -> None:
    # Prepare: 'local' keeps a personal model per node; node 2 is SIGKILLed once its
    # round-2 train message arrived, and started again at once with the same
    # command line (so the same node-config state-dir)
    cmd = _command(
        tmp_path,
        _run_config(
            tmp_path,
            "strategy='local' num-server-rounds=3 local-epochs=1 node-wait-timeout=120",
        ),
    )
    metrics = tmp_path / "results" / "e2e" / "metrics.jsonl"
    node_log = tmp_path / "deploy" / "logs" / "supernode-2.log"
    restarted: list[subprocess.Popen[bytes]] = []

    # Execute
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        got_round_two = _wait_for(
            lambda: node_log.exists() and node_log.read_text().count("Receiving: train") >= 2,
            proc,
            300,
        )
        assert got_round_two, "node 2 never received its round-2 message"
        pid, argv, env = _supernode_of_partition(tmp_path, 2)
        os.kill(pid, signal.SIGKILL)
        with (tmp_path / "supernode-2-restarted.log").open("wb") as log_file:
            restarted.append(
                subprocess.Popen(
                    argv, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=60)
        for p in restarted:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)

    # Assert: the run completed every round
    assert proc.returncode == 0, _output(proc, out)
    rounds = _rounds(metrics.parent)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    by_round = [{c["partition_id"]: c for c in r["clients"]} for r in rounds]
    first_node = by_round[0][2]["node"]
    assert 2 not in by_round[1], "the killed node answered round 2"
    # the restarted node (a new node id) rejoined and went on from its saved model:
    # it counts the rounds its model trained, including round 1 before the crash
    last = by_round[2][2]
    assert last["node"] != first_node
    # round 1 (and round 2 if it was saved before the kill), then round 3; a node
    # that lost its state would count 1
    assert last["model_rounds"] >= 2, last
    # ... and it did not fall back to a fresh model: round 3 (its first after the
    # restart) starts from the trained model, so its training loss is far below that of
    # round 1, which started from scratch (accuracy on ~70 local test samples is too
    # noisy a witness for one extra round)
    after_restart = by_round[2][2]
    assert after_restart["node"] == last["node"]
    assert after_restart["train_loss"] < 0.8 * by_round[0][2]["train_loss"], (
        after_restart,
        by_round[0][2],
    )
    assert (tmp_path / "deploy" / "node-state" / "2").is_dir()
    assert _processes_of(tmp_path) == []


def test_stopped_deployment_resumes_with_every_round_once(tmp_path: Path) -> None:
    # Prepare: stop the whole deployment (SuperLink, ServerApp, nodes) once round 1
    # is written, then start it again with --resume on the same workdir
    config = _run_config(tmp_path, "num-server-rounds=3 local-epochs=1")
    metrics = tmp_path / "results" / "e2e" / "metrics.jsonl"

    # Execute
    first = subprocess.Popen(
        _command(tmp_path, config),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        reached = _wait_for(
            lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 1, first, 400
        )
        assert reached, "round 1 never finished"
        first.send_signal(signal.SIGTERM)
        first_out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate(timeout=60)
    assert _processes_of(tmp_path) == []
    done_before = len(metrics.read_text().splitlines())
    second = subprocess.run(
        [*_command(tmp_path, config), "--resume"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = second.stdout + second.stderr

    # Assert
    assert first.returncode != 0, first_out[-3000:]
    assert 1 <= done_before < 3
    assert second.returncode == 0, _output(second, out)
    rounds = _rounds(metrics.parent)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["num_ok"] == 3 for r in rounds), [r["num_ok"] for r in rounds]
    assert "resuming the run in" in out
    summary = json.loads((metrics.parent / "summary.json").read_text())
    assert summary["rounds"] == 3
    assert _processes_of(tmp_path) == []


def test_fedfa_trains_width_and_depth_slices_in_native_deployment(tmp_path: Path) -> None:
    # Prepare: FedFA on preresnet26_025; the three device profiles pick their slices.
    # The nodes run in Flower's process isolation (--isolation process): each has a
    # ClientApp executor of its own (Tessera's warm executor, the default), as the
    # compose cluster's executor containers
    config = _run_config(
        tmp_path,
        "strategy='fedfa' model-family='preresnet' submodel-widths='1,0.25' local-epochs=1",
    )
    result = tmp_path / "results" / "e2e"
    logs = tmp_path / "deploy" / "logs"

    # Execute
    proc = subprocess.run(
        [*_command(tmp_path, config), "--isolation", "process"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
    )
    out = proc.stdout + proc.stderr

    # Assert: every node's ClientApps ran in processes forked by its own warm
    # executor (one per message: handshake and two rounds), none from an executor the
    # SuperNode started
    assert proc.returncode == 0, _output(proc, out)
    for i in range(3):
        executor = (logs / f"clientapp-executor-{i}.log").read_text()
        assert "fork server ready" in executor, executor[-2000:]
        assert executor.count(": ClientApp process ") >= 3, executor[-2000:]
        assert "exited with" not in executor, executor[-2000:]
        assert "Starting Flower SuperExec" not in (logs / f"supernode-{i}.log").read_text()

    # Assert: both rounds ran over gRPC, slices of the global model came back and were
    # grafted and aggregated, the full model and each slice were evaluated
    assert proc.returncode == 0, _output(proc, out)
    rounds = _rounds(result)
    assert [r["round"] for r in rounds] == [1, 2]
    archs = {c["arch"] for r in rounds for c in r["clients"]}
    assert all(a.startswith("preresnet26_025@") for a in archs), archs
    for r in rounds:
        assert not r["skipped"] and r["num_rejected"] == 0, r
        assert sum(r["slices"].values()) == len(r["clients"]) >= 2
        assert "preresnet26_025" in r["submodel_accuracy"]
    assert _processes_of(tmp_path) == []


def test_the_ensemble_trains_family_groups_and_exports_in_native_deployment(
    tmp_path: Path,
) -> None:
    # Prepare: the ensemble on its default family ("mixed"); the three device profiles
    # pick their models across families
    config = _run_config(
        tmp_path, "strategy='ensemble' local-epochs=1 ensemble-optimizer='tpe,gradient'"
    )
    result = tmp_path / "results" / "e2e"

    # Execute
    proc = subprocess.run(
        _command(tmp_path, config), cwd=ROOT, capture_output=True, text=True, timeout=420
    )
    out = proc.stdout + proc.stderr

    # Assert: both rounds ran over gRPC, the groups were averaged, the ensemble was
    # tuned after the last round and exported
    assert proc.returncode == 0, _output(proc, out)
    rounds = _rounds(result)
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(not r["skipped"] and r["num_rejected"] == 0 for r in rounds), rounds
    entry = rounds[-1]["ensemble"]
    assert len(entry["members"]) >= 2 and set(entry["optimizers"]) == {"uniform", "tpe", "gradient"}
    summary = json.loads((result / "summary.json").read_text())
    assert Path(summary["end_of_run"]["ensemble_artifact"]).is_file()
    assert _processes_of(tmp_path) == []


def test_fedtgp_trains_its_global_prototypes_in_native_deployment(tmp_path: Path) -> None:
    # Execute: FedTGP over gRPC; the three device profiles pick different CNN sizes
    extra = "strategy='fedtgp' local-epochs=1 train-time-budget=0.008 model-family='cnn'"
    cmd = _command(tmp_path, _run_config(tmp_path, extra))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)

    # Assert: both rounds ran over gRPC with every node, only prototypes travelled,
    # the server trained its prototypes each round and sent them in round 2
    assert proc.returncode == 0, _output(proc, proc.stdout + proc.stderr)
    rounds = _rounds(tmp_path / "results" / "e2e")
    assert [r["round"] for r in rounds] == [1, 2]
    assert len({c["arch"] for r in rounds for c in r["clients"]}) >= 2
    for r in rounds:
        assert not r["skipped"] and r["num_ok"] == 3 and r["num_rejected"] == 0, r
        assert r["prototype_classes"] == 10 and r["fedtgp_steps"] > 0
        assert all(c["bytes_up"] < 16_384 for c in r["clients"])
    assert rounds[0]["proto_accuracy_mean"] is None
    assert rounds[1]["proto_accuracy_mean"] is not None
    assert _processes_of(tmp_path) == []
