"""``scripts/simulate.sh``'s retry when Ray will not start, with a stand-in ``flwr``.

Ray's start-up failure cannot be caused on demand, so these tests put a stand-in for
the ``flwr`` command (``TESSERA_FLWR``) in front of the real script: it plays the
log line Ray prints when its node times out, or a run that appends rounds. The real
runs through Ray are in ``test_simulation.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import process_gone

ROOT = Path(__file__).resolve().parents[1]

FAKE_FLWR = """#!{python}
import json, os, sys
from pathlib import Path

plan = Path(os.environ["FAKE_PLAN"])
steps = plan.read_text().split()
step, rest = steps[0], steps[1:]
plan.write_text(" ".join(rest))
run = Path(os.environ["FAKE_RUN"])
target = int(os.environ["FAKE_ROUNDS"])
if step == "fail":
    # what Ray prints when its raylet does not come up; the run damaged nothing
    # on purpose except the checkpoint, which a retry must put back
    print("The current node timed out during startup. logs/gcs_server.err")
    (run / "checkpoint.npz").unlink(missing_ok=True)
    sys.exit(1)
metrics = run / "metrics.jsonl"
have = len(metrics.read_text().splitlines()) if metrics.exists() else 0
if have and not (run / "checkpoint.npz").exists():
    print("resume: no checkpoint.npz in the run folder")
    sys.exit(1)
run.mkdir(parents=True, exist_ok=True)
row = dict(num_ok=3, num_sent=3, num_rejected=0, num_failed=0, bytes_up_total=0,
           bytes_down_total=0, round_seconds=0.1)
with metrics.open("a") as fh:
    for r in range(have + 1, target + 1):
        fh.write(json.dumps(dict(row, round=r)) + "\\n")
(run / "config.json").write_text(json.dumps({{"run_config": {{"num-server-rounds": target}}}}))
(run / "summary.json").write_text(json.dumps({{"rounds": target}}))
(run / "checkpoint.npz").write_text("round " + str(target))
(run / "ray-address").write_text(os.environ.get("RAY_ADDRESS", "<unset>"))
(run / "argv").write_text(json.dumps(sys.argv[1:]))
"""


def _run(
    tmp_path: Path, plan: str, rounds: int, *extra: str, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real script with the stand-in ``flwr`` playing ``plan`` (one step per attempt)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    fake = tmp_path / "flwr"
    fake.write_text(FAKE_FLWR.format(python=sys.executable))
    fake.chmod(0o755)
    (tmp_path / "plan").write_text(plan)
    out = tmp_path / "results"
    env = {
        **os.environ,
        "TESSERA_FLWR": str(fake),
        "FAKE_PLAN": str(tmp_path / "plan"),
        "FAKE_RUN": str(out / "e2e"),
        "FAKE_ROUNDS": str(rounds),
        "FLWR_HOME_SIM": str(tmp_path / "flwr-home"),
        "SIMULATE_RETRY_WAIT": "0",
        **(env_extra or {}),
    }
    cmd = ["bash", "scripts/simulate.sh", "--run-name", "e2e", "--output-dir", str(out), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _rounds(tmp_path: Path) -> list[int]:
    lines = (tmp_path / "results" / "e2e" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["round"] for line in lines]


def test_a_fresh_run_whose_ray_does_not_start_is_retried(tmp_path: Path) -> None:
    # Execute: Ray fails twice, then the run goes through
    proc = _run(tmp_path, "fail fail ok", rounds=2)

    # Assert
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Ray failed to start (attempt 1 of 6)" in proc.stderr
    assert "Ray failed to start (attempt 2 of 6)" in proc.stderr
    assert "machine state after Ray failed to start" in proc.stderr
    assert _rounds(tmp_path) == [1, 2]


def test_a_resumed_run_whose_ray_does_not_start_is_retried_from_its_folder(
    tmp_path: Path,
) -> None:
    # Prepare: a run folder that finished rounds 1 and 2 (the state a resume reads)
    run = tmp_path / "results" / "e2e"
    run.mkdir(parents=True)
    row = {"num_ok": 3, "num_sent": 3, "num_rejected": 0, "num_failed": 0}
    row |= {"bytes_up_total": 0, "bytes_down_total": 0, "round_seconds": 0.1}
    lines = [json.dumps(row | {"round": r}) + "\n" for r in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(lines))
    (run / "checkpoint.npz").write_text("round 2")

    # Execute: the resumed run's first attempt fails to start Ray (and loses the
    # checkpoint); the second resumes to round 4
    proc = _run(tmp_path, "fail ok", rounds=4)

    # Assert: retried (rounds already in the folder did not hide the failure), from
    # the folder as it was, so rounds 3 and 4 ran once
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Ray failed to start (attempt 1 of 6)" in proc.stderr
    assert _rounds(tmp_path) == [1, 2, 3, 4]
    assert (run / "checkpoint.npz").read_text() == "round 4"
    assert not (tmp_path / "flwr-home" / "e2e.before").exists()


def test_ray_that_never_starts_fails_the_script_with_the_reason(tmp_path: Path) -> None:
    # Execute
    proc = _run(tmp_path, "fail fail fail fail fail fail", rounds=2)

    # Assert: a non-zero status and the reason, not a report of an empty run
    assert proc.returncode == 1
    assert "Ray failed to start in 6 attempts; no round ran" in proc.stderr
    assert "Ray failed to start (attempt 5 of 6)" in proc.stderr


def test_ray_address_reaches_flower_and_a_stray_one_does_not(tmp_path: Path) -> None:
    # Execute: with --ray-address, and without it but with RAY_ADDRESS in the caller's env
    joined = _run(tmp_path / "a", "ok", 1, "--ray-address", "10.1.2.3:6379")
    alone = _run(tmp_path / "b", "ok", 1, env_extra={"RAY_ADDRESS": "10.9.9.9:1"})

    # Assert: Flower (and the SuperLink it starts) sees the cluster only when asked
    assert joined.returncode == 0, joined.stderr[-2000:]
    assert (tmp_path / "a" / "results" / "e2e" / "ray-address").read_text() == "10.1.2.3:6379"
    assert "the nodes run on the Ray cluster at 10.1.2.3:6379" in joined.stdout
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert (tmp_path / "b" / "results" / "e2e" / "ray-address").read_text() == "<unset>"


def test_a_malformed_ray_address_is_refused_by_value(tmp_path: Path) -> None:
    for bad in ("head-without-port", "head:", ":6379", "head:63x9", "a b:1"):
        proc = _run(tmp_path, "ok", 1, "--ray-address", bad)
        assert proc.returncode == 2, bad
        assert "--ray-address must be HOST:PORT" in proc.stderr and bad in proc.stderr


# A stand-in for the local SuperLink's tree: the SuperLink (its command line names
# its Flower home), a flwr-simulation it launched in a session of its own (named by
# --parent-pid, as Flower's exec plugin names it) that ignores SIGTERM as a hung
# graceful shutdown does, that one's child (Ray's), and a plain child.
FAKE_TREE = """
import os, signal, subprocess, sys, time

def stubborn(*extra):
    return subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "time.sleep(300)", *extra],
        start_new_session=True,
    )

if sys.argv[1] == "flower-superlink":
    sim = subprocess.Popen(
        [sys.executable, __file__, "flwr-simulation", "--parent-pid", str(os.getpid())],
        start_new_session=True,
    )
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(sim.pid, plain.pid, flush=True)
    time.sleep(300)
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ray = stubborn("raylet")
    print(ray.pid, flush=True)
    time.sleep(300)
"""


def test_stopping_the_local_superlink_ends_its_whole_tree_on_a_loaded_machine(
    tmp_path: Path,
) -> None:
    import time

    # Prepare: load both cores, then start the stand-in tree
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    script = tmp_path / "tree.py"
    script.write_text(FAKE_TREE)
    home = tmp_path / "flwr home [x]"  # a folder name with regex characters
    home.mkdir()
    try:
        superlink = subprocess.Popen(
            [sys.executable, str(script), "flower-superlink", "--home", str(home)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert superlink.stdout is not None
        sim_pid, plain_pid = (int(p) for p in superlink.stdout.readline().split())
        deadline = time.monotonic() + 30
        ray_pid = None
        while ray_pid is None and time.monotonic() < deadline:
            children = subprocess.run(
                ["pgrep", "-P", str(sim_pid)], capture_output=True, text=True
            ).stdout.split()
            ray_pid = int(children[0]) if children else None
            time.sleep(0.1)
        assert ray_pid is not None, "the stand-in flwr-simulation started no child"
        tree = [superlink.pid, sim_pid, plain_pid, ray_pid]

        # Execute
        subprocess.run(
            ["bash", "-c", 'source scripts/flower-env.sh && stop_local_superlink "$STOP_HOME"'],
            cwd=ROOT,
            env={**os.environ, "STOP_HOME": str(home)},
            check=True,
            timeout=60,
        )
        superlink.wait(timeout=10)

        # Assert: every process of the tree has ended, by process id
        time.sleep(0.5)
        assert [pid for pid in tree if not process_gone(pid)] == []
    finally:
        for proc in load:
            proc.kill()
            proc.wait()


def test_gpus_per_node_reaches_flower_and_is_checked(tmp_path: Path) -> None:
    import torch

    # Execute: the default, a malformed share, and a share on this machine
    default = _run(tmp_path / "a", "ok", 1)
    bad = [_run(tmp_path / "b", "ok", 1, "--gpus-per-node", v) for v in ("abc", "1.2.3", "-1")]
    share = _run(tmp_path / "c", "ok", 1, "--gpus-per-node", "0.25")

    # Assert: no GPU is reserved by default; a malformed share is refused by value;
    # a share reaches Flower's federation config where torch sees a GPU, and is refused
    # with the reason where it sees none (Ray would never schedule the ClientApps)
    assert default.returncode == 0, default.stderr
    argv = json.loads((tmp_path / "a" / "results" / "e2e" / "argv").read_text())
    assert "client-resources-num-gpus=0" in argv[argv.index("--federation-config") + 1]
    for proc, value in zip(bad, ("abc", "1.2.3", "-1"), strict=True):
        assert proc.returncode == 2 and f"got '{value}'" in proc.stderr, proc.stderr
    if torch.cuda.device_count() > 0:
        assert share.returncode == 0, share.stderr
        argv = json.loads((tmp_path / "c" / "results" / "e2e" / "argv").read_text())
        assert "client-resources-num-gpus=0.25" in argv[argv.index("--federation-config") + 1]
    else:
        assert share.returncode == 2
        assert "--gpus-per-node 0.25 but torch sees no CUDA device" in share.stderr
