"""``tessera.supernode``: Flower's SuperNode with paced pulls.

The pacing maths by hand; the two pauses it changes are still in the Flower release
it names, where it expects them; applied to a fresh copy of Flower's own loop module,
the loop's sleeps go through it; and a real SuperNode started by the launcher
connects to a real SuperLink and logs its pacing. The deployments of
``test_deploy_local.py`` run every SuperNode through it.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tessera import supernode
from tessera.supernode import PacedTime, next_pause, parse_args, pulls_within

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_paced_time_maps_flower_s_two_pauses_and_passes_the_rest() -> None:
    slept: list[float] = []
    paced = PacedTime(low=0.1, high=0.5, reply_wait=0.05, sleep=slept.append)

    for _ in range(6):
        paced.sleep(3)  # Flower's pause after an empty pull
    paced.message_pulled()
    paced.sleep(3)
    paced.sleep(0.5)  # Flower's pause while it waits for a reply
    paced.sleep(1.0)  # any other pause is Flower's own

    expected = [0.1, 0.15, 0.225, 0.3375, 0.5, 0.5, 0.1, 0.05, 1.0]
    assert len(slept) == len(expected)
    assert all(math.isclose(a, b) for a, b in zip(slept, expected, strict=True))
    assert paced.monotonic is time.monotonic  # the rest is the time module


def test_next_pause_and_idle_pulls_by_hand() -> None:
    assert next_pause(None, low=0.2, high=3.0) == 0.2
    assert math.isclose(next_pause(0.2, low=0.2, high=3.0), 0.3)
    assert next_pause(2.9, low=0.2, high=3.0) == 3.0
    # Flower's pace: one pull every 3 s; paced: 0.1 + 0.15 + ... (8 pulls reach 2.56 s
    # in 4.93 s), then every 3 s: 8 + 18 in a minute
    assert pulls_within(60.0, low=3.0, high=3.0) == 20
    assert pulls_within(60.0, low=0.1, high=3.0) == 26


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pull-min", "0"], "--pull-min 0.0: use a positive number of seconds"),
        (["--reply-wait", "nan"], "--reply-wait nan: use a positive number of seconds"),
        (["--object-backoff", "-1"], "--object-backoff -1.0: use a positive number of seconds"),
        (["--pull-min", "2", "--pull-max", "1"], "--pull-max 1.0 is below --pull-min 2.0"),
    ],
)
def test_bad_pacing_is_refused_with_the_value(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_flower_s_loop_still_holds_the_pauses_it_paces() -> None:
    # If a Flower release moves these, the version check keeps Flower's code; this
    # test names what to look at again
    import flwr
    import flwr.supernode.start_client_internal as loop

    assert flwr.__version__ == supernode.FLOWER_VERSION
    assert "time.sleep(3)" in inspect.getsource(loop.start_client_internal)
    assert "time.sleep(0.5)" in inspect.getsource(loop._push_messages)
    assert loop.time is time  # nothing in this process paced Flower's own module


def test_the_object_pull_backoff_is_shortened_in_flower_s_pull() -> None:
    from flwr.supercore.inflatable import inflatable_utils

    defaults = inflatable_utils.pull_objects.__kwdefaults__
    before = defaults["initial_backoff"]
    try:
        assert supernode.shorten_object_pulls(0.03) is True
        assert defaults["initial_backoff"] == 0.03
    finally:
        defaults["initial_backoff"] = before  # another test's process state may differ


def fresh_loop_module() -> ModuleType:
    """A private copy of Flower's ``start_client_internal`` module (Flower's stays as is)."""
    import flwr.supernode.start_client_internal as loop

    spec = importlib.util.spec_from_file_location("tessera_test_loop", loop.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pace_routes_the_loop_s_sleeps_and_restarts_after_a_message() -> None:
    # Setup: a copy of Flower's loop module, paced with a recorder
    module = fresh_loop_module()
    slept: list[float] = []
    paced = PacedTime(low=0.1, high=3.0, reply_wait=0.05, sleep=slept.append)
    original_push = module._push_messages
    calls: list[object] = []
    module._push_messages = lambda *a, **k: calls.append(a)
    supernode.pace(module, paced)

    # Execute: two empty pulls' pauses as the loop makes them, then a pushed reply,
    # then one more empty pull
    module.time.sleep(3)
    module.time.sleep(3)
    module._push_messages("state")
    module.time.sleep(3)

    # Assert: the module's sleeps are paced, and the push restarted the pacing
    assert module.time is paced
    assert calls == [("state",)]
    assert slept == [0.1, 0.1 * 1.5, 0.1]
    assert original_push is not module._push_messages


@pytest.mark.slow
def test_the_launcher_runs_a_real_supernode_against_a_real_superlink(tmp_path: Path) -> None:
    # A SuperLink and one SuperNode through the launcher, plaintext on loopback; the
    # node connects (the SuperLink lists it) and logs its pacing
    import socket

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    fleet, appio, control, serverappio = (free_port() for _ in range(4))
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home")}
    link_log = (tmp_path / "superlink.log").open("wb")
    node_log_path = tmp_path / "supernode.log"
    node_log = node_log_path.open("wb")
    procs = [
        subprocess.Popen(
            [
                str(BIN / "flower-superlink"),
                "--insecure",
                "--fleet-api-address",
                f"127.0.0.1:{fleet}",
                "--control-api-address",
                f"127.0.0.1:{control}",
                "--serverappio-api-address",
                f"127.0.0.1:{serverappio}",
                "--database",
                ":flwr-in-memory:",
            ],
            stdout=link_log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    ]
    try:
        time.sleep(2)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tessera.supernode",
                    "--pull-min",
                    "0.2",
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{fleet}",
                    "--clientappio-api-address",
                    f"127.0.0.1:{appio}",
                    "--isolation",
                    "process",
                ],
                cwd=ROOT,
                stdout=node_log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            text = node_log_path.read_text(errors="replace")
            if "SuperNode ID" in text:
                break
            assert procs[1].poll() is None, text
            time.sleep(0.2)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)
        link_log.close()
        node_log.close()

    assert "SuperNode pulls paced: 0.2 s after a message, growing to 3 s" in text, text
    assert "SuperNode ID" in text, text
