"""The warm ClientApp executor (``tessera.executor``): its settings, its fork server, its exit.

Its real use, a SuperNode in ``--isolation process`` whose messages it runs, is tested
end to end by the native deployment test in ``tests/test_deploy_local.py`` (FedFA,
process isolation, this executor by default) and timed by ``benchmarks/overhead.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.executor import (
    AUTO,
    DEFAULT_PRELOAD,
    WARM_UP_MODULE,
    ExecutorConfig,
    parse_args,
    parse_preload,
)
from tests.conftest import process_gone

ROOT = Path(__file__).resolve().parents[1]


def test_parse_preload_reads_names_and_refuses_what_is_not_one() -> None:
    assert parse_preload(" torch, numpy ,,flwr.clientapp ") == ("torch", "numpy", "flwr.clientapp")
    assert parse_preload("") == ()
    with pytest.raises(ValueError, match="'torch-2' is not a module name"):
        parse_preload("torch-2")


def test_parse_args_defaults_and_choices(tmp_path: Path) -> None:
    # Execute
    base = ["--insecure", "--appio-api-address", "127.0.0.1:9094"]
    plain = parse_args(base)
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    tls = parse_args(
        [
            "--appio-api-address",
            "node:9094",
            "--root-certificates",
            str(ca),
            "--preload",
            "",
            "--no-warm-up",
            "--poll-interval",
            "0.5",
        ]
    )

    # Assert
    assert plain == ExecutorConfig(appio_api_address="127.0.0.1:9094", insecure=True)
    assert plain.preload == DEFAULT_PRELOAD and plain.warm_up and plain.poll_interval == 0.1
    assert plain.bytecode_cache == AUTO
    assert parse_args([*base, "--bytecode-cache", ""]).bytecode_cache is None
    tmp_path.chmod(0o700)
    assert parse_args([*base, "--bytecode-cache", str(tmp_path)]).bytecode_cache == str(tmp_path)
    assert tls.root_certificates == ca and not tls.insecure
    assert tls.preload == () and not tls.warm_up and tls.poll_interval == 0.5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--appio-api-address", "a:1"], "give --insecure (plaintext) or --root-certificates"),
        (
            ["--appio-api-address", "a:1", "--insecure", "--root-certificates", "ca.crt"],
            "--insecure and --root-certificates exclude each other",
        ),
        (
            ["--appio-api-address", "a:1", "--insecure", "--poll-interval", "0"],
            "--poll-interval 0.0: give seconds in [0.001, 60]",
        ),
        (
            ["--appio-api-address", "a:1", "--insecure", "--preload", "torch;numpy"],
            "'torch;numpy' is not a module name",
        ),
        (
            ["--appio-api-address", "a:1", "--root-certificates", "/nonexistent/ca.crt"],
            "/nonexistent/ca.crt: no such file",
        ),
        (
            ["--appio-api-address", "a:1", "--insecure", "--bytecode-cache", "/etc/hostname"],
            "--bytecode-cache /etc/hostname: not a folder; give a folder, 'auto' or ''",
        ),
    ],
)
def test_parse_args_refuses_bad_settings_by_value(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


CHECK_CHILD = f"""
import os, sys
import torch
missing = [
    name
    for name, ok in (
        ("torch", "torch" in sys.modules),
        ("the warm-up", "{WARM_UP_MODULE}" in sys.modules),
        ("torch._dynamo (warmed)", "torch._dynamo" in sys.modules),
        ("no tessera", not any(n.split(".")[0] == "tessera" for n in sys.modules)),
        (
            "no app module",
            not any(n.split(".")[0] in ("client_app", "strategies", "models") for n in sys.modules),
        ),
        ("default threads", torch.get_num_threads() == {{threads}}),
    )
    if not ok
]
print("missing:", missing, file=sys.stderr, flush=True)
os._exit(3 if missing else 0)
"""

PARENT = """
import os, sys
from tessera.executor import DEFAULT_PRELOAD, fork_server
ctx = fork_server(DEFAULT_PRELOAD, warm_up=True)
child = ctx.Process(target=exec, args=(sys.argv[1],))
child.start()
child.join(60)
if "tessera-executor-" in os.environ.get("PYTHONPATH", ""):
    sys.exit(4)
sys.exit(child.exitcode)
"""


def test_fork_server_holds_torch_warm_and_none_of_the_app() -> None:
    # Prepare: a fresh interpreter (this test process may have started multiprocessing's
    # fork server already, or changed torch's threads); torch's default thread count
    threads = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()

    # Execute: a parent starts the executor's fork server; a process forked from it
    # checks what it inherited
    proc = subprocess.run(
        [sys.executable, "-c", PARENT, CHECK_CHILD.format(threads=threads)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )

    # Assert: torch (warmed) and the warm-up are loaded, no module of the app is (the
    # app's own code comes from the FAB in each ClientApp process), the thread count is
    # the default again; the warm-up's private folder is off PYTHONPATH again (not 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "missing: []" in proc.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children_of(pid: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_sigterm_stops_the_executor_and_its_fork_server(tmp_path: Path) -> None:
    # Prepare: an executor whose SuperNode is not there (its pulls retry)
    log = tmp_path / "executor.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tessera.executor",
                "--insecure",
                "--appio-api-address",
                f"127.0.0.1:{free_port()}",
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 120
        while "fork server ready" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert "fork server ready" in log.read_text(), log.read_text()
        spawned = children_of(proc.pid)
        assert spawned, "the fork server is a child of the executor"

        # Execute
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)

        # Assert: a clean exit, the fork server went with it, so did the bytecode cache
        assert code == 0, log.read_text()
        cache = log.read_text().split("caching the app's compiled modules in ")[1].split()[0]
        assert "tessera-executor-pyc-" in cache and not Path(cache).exists()
        deadline = time.monotonic() + 10
        while not all(process_gone(p) for p in spawned) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(process_gone(p) for p in spawned), spawned
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_forked_processes_do_not_import_the_package_when_run_with_dash_m() -> None:
    # Prepare: a parent whose __main__ is tessera.executor, as `python -m` makes it
    code = (
        "import sys, tessera.executor as e\n"
        "sys.modules['__main__'] = e\n"
        "if sys.argv[1] == 'detach':\n"
        "    e.detach_main_module()\n"
        "ctx = e.fork_server((), warm_up=False)\n"
        "p = ctx.Process(target=exec, args=("
        "'import os, sys; os._exit(3 if \"tessera\" in sys.modules else 0)',))\n"
        "p.start(); p.join(60)\n"
        "sys.exit(p.exitcode)\n"
    )

    # Execute
    def run(mode: str) -> int:
        return subprocess.run(
            [sys.executable, "-c", code, mode], cwd=ROOT, timeout=120, check=False
        ).returncode

    # Assert: multiprocessing re-imports the package in each process unless detached
    assert run("keep") == 3
    assert run("detach") == 0


def test_the_start_steps_are_timed_in_a_copy_of_flower_s_runtime() -> None:
    # A stand-in for Flower's run_clientapp module: the wrappers time each step,
    # and the loader that get_load_client_app_fn returns is what is timed for it
    from types import SimpleNamespace

    from tessera.executor import describe_steps, time_start_steps

    calls: list[str] = []

    def pull_task_input(stub: object) -> str:
        calls.append("pull")
        time.sleep(0.02)
        return "message"

    def get_load_client_app_fn(**kwargs: object) -> object:
        def load(*args: object) -> str:
            calls.append("load")
            return "app"

        return load

    runtime = SimpleNamespace(
        pull_task_input=pull_task_input, get_load_client_app_fn=get_load_client_app_fn
    )
    timings = time_start_steps(runtime)

    assert runtime.pull_task_input("stub") == "message"
    assert runtime.get_load_client_app_fn(multi_app=True)("id", "v", "hash") == "app"
    assert calls == ["pull", "load"]
    assert set(timings) == {"pull_task_input", "get_load_client_app_fn"}
    assert timings["pull_task_input"] >= 0.02
    text = describe_steps(timings, time.monotonic())
    assert text.startswith("message pulled 0.0") and "app loaded 0.00 s" in text
    assert "FAB installed" not in text  # a step the stand-in lacks is left out


COMPILE_CHILD = """
import sys
from tessera.executor import fork_server
ctx = fork_server((), warm_up=False)
code = (
    "import sys; from tessera.executor import cache_bytecode; "
    f"cache_bytecode({sys.argv[1]!r} or None); sys.path.insert(0, {sys.argv[2]!r}); "
    "import app_module"
)
child = ctx.Process(target=exec, args=(code,))
child.start(); child.join(60)
sys.exit(child.exitcode)
"""


@pytest.mark.parametrize("cached", [True, False])
def test_a_clientapp_process_caches_the_app_s_bytecode_where_the_environment_forbids_it(
    tmp_path: Path, cached: bool
) -> None:
    # Prepare: an app module, and a forked process told not to write bytecode (as the
    # images' PYTHONDONTWRITEBYTECODE tells Flower's ClientApp processes)
    app = tmp_path / "fab"
    app.mkdir()
    (app / "app_module.py").write_text("VALUE = 1\n")
    cache = tmp_path / "pyc"
    cache.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}

    # Execute
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_CHILD, str(cache) if cached else "", str(app)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    # Assert: with the cache the module's bytecode is under it, mirroring the source's
    # path (the app's folder itself is never written); without it nothing is written
    assert done.returncode == 0, done.stderr
    written = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*.pyc"))
    mirrored = (app / "app_module").relative_to("/").as_posix()
    assert written == (
        [f"{mirrored}.cpython-{sys.version_info.major}{sys.version_info.minor}.pyc"]
        if cached
        else []
    )
    assert not (app / "__pycache__").exists()


def test_a_bytecode_cache_that_others_can_write_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # another user able to write there could plant bytecode that the ClientApps run
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(SystemExit):
        parse_args(["--insecure", "--appio-api-address", "a:1", "--bytecode-cache", str(shared)])
    err = capsys.readouterr().err
    assert f"--bytecode-cache {shared}: writable by other users (mode 777)" in err
    assert "chmod 700" in err
