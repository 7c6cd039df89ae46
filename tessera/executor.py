"""A warm ClientApp executor: Flower's process isolation without a cold start per message.

In Flower 1.30 a SuperNode in ``--isolation process`` serves its ClientAppIo API to
a separate executor (``flower-superexec --plugin-type clientapp``). That executor
polls for tasks once a second and, for every message, launches a fresh
``flwr-clientapp`` process, which starts Python and imports torch and Flower before
it pulls the message: about 3 s a message on a small CPU (the Performance page).

This executor speaks the same ClientAppIo protocol (pull pending tasks, claim one,
hand its token to a ClientApp process that pulls the message, runs the ClientApp and
pushes the reply) with these differences:

- **Warm processes.** ClientApp processes are forked from a ``multiprocessing``
  fork server that imported the heavy third-party modules (torch, numpy, Flower's
  ClientApp runtime) once, at start-up. Each message still gets a process of its own,
  which runs Flower's own ``run_clientapp`` and exits, so one message's state never
  leaks into the next, exactly as with Flower's executor. The app's own modules are
  *not* preloaded: the process imports them from the app bundle (FAB) Flower
  installs, so the code that runs is always the bundle's.
- **Warm torch.** The fork server also runs a few training steps of a small CNN
  on one thread (``--no-warm-up`` skips them). A fresh process pays about a second
  for torch's first training steps (its lazy initialisation); a forked one inherits
  the initialised state. One thread, so that no OpenMP thread pool exists before
  the fork (GNU OpenMP does not survive a fork); the forked process starts its own.
- **Short polls.** It asks for pending tasks every ``--poll-interval`` seconds
  (default 0.1) instead of every second. A pull is one small gRPC call on the
  node's own ClientAppIo link.
- **Compiled once.** Each ClientApp process imports the app's modules from the FAB
  again (that is what keeps the code the bundle's), but their bytecode is cached in
  a private folder of the executor (``--bytecode-cache``), so that only the first
  message of an app compiles its sources. Flower's processes recompile the app for
  every message wherever bytecode is not written (``PYTHONDONTWRITEBYTECODE``, set
  in the images): 0.4 s of a round's ``start`` here. Python checks each cached file
  against its source's modification time and size, as it does for ``__pycache__``.
- **A short first object-pull backoff** in each ClientApp process (20 ms instead of
  Flower's 1 s; :func:`shorten_object_pull_backoff` says why).
- **It outlives a SuperNode restart**: a failed ClientAppIo call is logged and
  retried, where Flower's executor exits.

This file imports only the standard library and Flower, so the images copy it alone
(``/usr/local/lib/tessera/executor.py``) and run it as a script.

Usage (the node's SuperNode runs with ``--isolation process``)::

    python -m tessera.executor --insecure --appio-api-address 127.0.0.1:9094

``--preload '' --no-warm-up`` turns the warm start off (forked processes import
everything themselves, as ``flwr-clientapp`` does), for devices where an idle
process holding torch (about 740 MB resident here) costs too much memory. Runtime
dependency installation is not offered: the executor's environment is the app's.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any

LOG = logging.getLogger("tessera.executor")

#: modules the fork server imports once; third-party only (see the module docstring)
DEFAULT_PRELOAD = ("torch", "numpy", "flwr.clientapp", "flwr.supernode.runtime.run_clientapp")
DEFAULT_POLL_INTERVAL = 0.1
#: the top-level module name of the warm-up the fork server imports (written at start)
WARM_UP_MODULE = "_tessera_executor_warm_up"
#: its source: a module of its own, not the ``tessera`` package, so that the fork
#: server holds none of the app's modules; it must never raise (an error other than
#: ImportError in a preloaded module stops ``multiprocessing``'s fork server)
WARM_UP_SOURCE = """\
try:
    import torch
    from torch import nn

    _threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _model = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(8, 10),
        )
        _opt = torch.optim.SGD(_model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        _x = torch.randn(16, 1, 8, 8)
        _y = torch.randint(0, 10, (16,))
        for _ in range(3):
            _opt.zero_grad()
            nn.functional.cross_entropy(_model(_x), _y).backward()
            _opt.step()
        _model.eval()
        with torch.no_grad():
            _model(_x).softmax(dim=1)
        del _model, _opt, _x, _y
    finally:
        torch.set_num_threads(_threads)
except Exception:  # noqa: BLE001 - a failed warm-up only costs speed
    pass
"""
#: ``--bytecode-cache`` default: a private temporary folder for the executor's life
AUTO = "auto"
#: how long a stop waits for running ClientApps before it kills them
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class ExecutorConfig:
    """The executor's settings, parsed once from the command line.

    Attributes
    ----------
    appio_api_address : str
        The SuperNode's ClientAppIo API (``host:port``).
    insecure : bool
        Plaintext gRPC to the ClientAppIo API.
    root_certificates : Path | None
        PEM CA bundle for TLS to the ClientAppIo API (``None`` with ``insecure``).
    poll_interval : float
        Seconds between pulls for pending tasks while none is pending.
    preload : tuple[str, ...]
        Modules the fork server imports before it forks ClientApp processes.
    warm_up : bool
        Run a few training steps of a small CNN in the fork server (needs torch).
    parent_pid : int | None
        Exit when this process exits.
    health_server_address : str | None
        Where to serve gRPC health checks (``None``: no health server).
    superexec_auth_secret_file : Path | None
        Flower's SuperExec authentication secret, when the SuperNode requires it.
    bytecode_cache : str | None
        Where ClientApp processes cache the app's compiled modules: ``"auto"`` (a
        private temporary folder, removed when the executor stops), a folder, or
        ``None`` (no cache of ours: the environment decides, as in Flower).
    """

    appio_api_address: str
    insecure: bool = False
    root_certificates: Path | None = None
    poll_interval: float = DEFAULT_POLL_INTERVAL
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    warm_up: bool = True
    parent_pid: int | None = None
    health_server_address: str | None = None
    superexec_auth_secret_file: Path | None = None
    bytecode_cache: str | None = AUTO


def parse_preload(text: str) -> tuple[str, ...]:
    """Return the module names of a comma-separated ``--preload`` value.

    Parameters
    ----------
    text : str
        Comma-separated dotted module names; empty for none.

    Returns
    -------
    tuple[str, ...]
        The names, stripped, in order, without empty entries.

    Raises
    ------
    ValueError
        If a name is not a dotted Python identifier.
    """
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(
                f"--preload: '{name}' is not a module name; give dotted names such as "
                "torch,numpy separated by commas, or '' for none"
            )
    return names


def parse_args(argv: Sequence[str] | None = None) -> ExecutorConfig:
    """Parse the command line into an :class:`ExecutorConfig`.

    Parameters
    ----------
    argv : Sequence[str] | None
        Arguments without the program name (``None``: ``sys.argv[1:]``).

    Returns
    -------
    ExecutorConfig
        The checked settings.
    """
    parser = argparse.ArgumentParser(
        prog="python -m tessera.executor",
        description="Run a warm ClientApp executor for a SuperNode in --isolation process.",
    )
    parser.add_argument(
        "--appio-api-address", required=True, help="the SuperNode's ClientAppIo API"
    )
    parser.add_argument("--insecure", action="store_true", help="plaintext gRPC to that API")
    parser.add_argument("--root-certificates", type=Path, default=None, help="PEM CA bundle (TLS)")
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_INTERVAL,
        help=f"seconds between pulls while no task is pending (default {DEFAULT_POLL_INTERVAL})",
    )
    parser.add_argument(
        "--preload",
        default=",".join(DEFAULT_PRELOAD),
        help="modules imported once by the fork server ('' for none; default %(default)s)",
    )
    parser.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="skip the fork server's few training steps of a small CNN",
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when it exits")
    parser.add_argument(
        "--health-server-address", default=None, help="serve gRPC health checks here"
    )
    parser.add_argument(
        "--superexec-auth-secret-file",
        type=Path,
        default=None,
        help="Flower's SuperExec authentication secret, when the SuperNode requires one",
    )
    parser.add_argument(
        "--bytecode-cache",
        default=AUTO,
        help="folder where ClientApp processes cache the app's compiled modules ('auto': "
        "a private temporary one, removed at exit; '': none, the environment decides)",
    )
    args = parser.parse_args(argv)
    if not args.insecure and args.root_certificates is None:
        parser.error("give --insecure (plaintext) or --root-certificates FILE (TLS)")
    if args.insecure and args.root_certificates is not None:
        parser.error("--insecure and --root-certificates exclude each other; give one")
    if not 0.001 <= args.poll_interval <= 60:
        parser.error(f"--poll-interval {args.poll_interval}: give seconds in [0.001, 60]")
    try:
        preload = parse_preload(args.preload)
    except ValueError as err:
        parser.error(str(err))
    for path in (args.root_certificates, args.superexec_auth_secret_file):
        if path is not None and not path.is_file():
            parser.error(f"{path}: no such file")
    cache: str | None = args.bytecode_cache or None
    if cache is not None and cache != AUTO:
        problem = private_folder_problem(Path(cache))
        if problem:
            parser.error(f"--bytecode-cache {cache}: {problem}")
    return ExecutorConfig(
        appio_api_address=args.appio_api_address,
        insecure=args.insecure,
        root_certificates=args.root_certificates,
        poll_interval=args.poll_interval,
        preload=preload,
        warm_up=args.warm_up,
        parent_pid=args.parent_pid,
        health_server_address=args.health_server_address,
        superexec_auth_secret_file=args.superexec_auth_secret_file,
        bytecode_cache=cache,
    )


def fork_server(preload: Sequence[str], *, warm_up: bool) -> ForkServerContext:
    """Return a fork-server context that has imported ``preload`` and forked once.

    Parameters
    ----------
    preload : Sequence[str]
        Modules the fork server imports before it forks (a module that fails to import
        is skipped by ``multiprocessing``).
    warm_up : bool
        Also import :data:`WARM_UP_SOURCE` (a few training steps), written to a
        private folder that is put on the server's ``PYTHONPATH`` and removed once
        the server runs.

    Returns
    -------
    ForkServerContext
        The context whose ``Process`` forks from the warm server.
    """
    ctx = multiprocessing.get_context("forkserver")
    assert isinstance(ctx, ForkServerContext)
    modules = list(preload)
    folder = None
    pythonpath = os.environ.get("PYTHONPATH")
    if warm_up:
        folder = tempfile.mkdtemp(prefix="tessera-executor-")
        Path(folder, f"{WARM_UP_MODULE}.py").write_text(WARM_UP_SOURCE)
        # the fork server is a fresh interpreter that finds modules by PYTHONPATH
        # (Python 3.10 and 3.11 pass it the parent's sys.path but do not apply it)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, folder) if p)
        modules.append(WARM_UP_MODULE)
    ctx.set_forkserver_preload(modules)
    started = time.monotonic()
    try:
        # a first child makes the server start (and import) now; its target is from
        # the standard library because this file also runs as a script in the images
        first = ctx.Process(
            target=time.sleep, args=(0,), name="tessera-executor-warm-up", daemon=False
        )
        first.start()
        first.join()
    finally:
        if folder is not None:
            if pythonpath is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = pythonpath
            shutil.rmtree(folder, ignore_errors=True)
    LOG.info(
        "fork server ready in %.1f s (preloaded: %s)",
        time.monotonic() - started,
        ", ".join(modules) or "nothing",
    )
    return ctx


#: the first pause of a ClientApp process's retry for a message object not yet stored
OBJECT_PULL_BACKOFF = 0.02


def shorten_object_pull_backoff(first: float = OBJECT_PULL_BACKOFF) -> bool:
    """Make this process retry a message object not yet there after ``first`` seconds.

    A SuperNode offers the task before it has pulled the message's objects from the
    SuperLink (``flwr/supernode/start_client_internal.py``: ``create_task``, then
    ``pull_objects``). A ClientApp that starts within milliseconds, as it does here,
    asks for them too early, and Flower's pull backs off for 1 s
    (``PULL_INITIAL_BACKOFF``) before it asks again: a second of every round. The
    backoff still doubles from ``first`` up to Flower's cap.

    The ServerApp (:func:`server_app.app.main`) calls it too: the SuperLink lists a
    reply once its message has arrived, before its objects have, and a server polling
    every 20 ms often asks in between (``benchmarks/overhead.py`` measured ``return``
    at 1.04 s a node with Flower's backoff).

    Parameters
    ----------
    first : float
        The first pause in seconds.

    Returns
    -------
    bool
        Whether Flower's pull had the keyword to change (Flower 1.30); if not, the
        ClientApp runs with Flower's own backoff.
    """
    from flwr.supercore.inflatable import inflatable_utils

    changed = False
    for name in ("pull_and_inflate_object_from_tree", "pull_objects"):
        defaults = getattr(getattr(inflatable_utils, name, None), "__kwdefaults__", None)
        if isinstance(defaults, dict) and "initial_backoff" in defaults:
            defaults["initial_backoff"] = first
            changed = True
    return changed


def private_folder_problem(folder: Path) -> str:
    """Return why ``folder`` cannot hold cached bytecode ('' when it can, or is missing).

    Python runs whatever bytecode it finds there for a source of the recorded time and
    size, so the folder must be this user's alone: another user who can write to it
    could plant code that the ClientApps run.
    """
    if not folder.exists():
        return ""
    if not folder.is_dir():
        return "not a folder; give a folder, 'auto' or ''"
    info = folder.stat()
    if info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}, not this user ({os.getuid()}); give a folder of yours"
    if info.st_mode & 0o022:
        return (
            f"writable by other users (mode {info.st_mode & 0o777:o}); "
            f"make it private (chmod 700) or give 'auto'"
        )
    return ""


def cache_bytecode(folder: str | None) -> None:
    """Let this process read and write compiled modules under ``folder``.

    Sets ``sys.pycache_prefix`` (the cached files mirror the sources' absolute paths
    there, so the installed app's own folder is never written) and allows writing
    bytecode even where ``PYTHONDONTWRITEBYTECODE`` forbids it. ``None`` changes
    nothing. Python reads a cached file only while its recorded source modification
    time and size match the source's.
    """
    if folder is None:
        return
    sys.pycache_prefix = folder
    sys.dont_write_bytecode = False


def bytecode_folder(setting: str | None) -> tuple[str | None, bool]:
    """Return the folder for ``--bytecode-cache`` and whether the executor made it.

    ``"auto"`` makes a private (0700) temporary folder, which the caller removes; a
    given folder is created (0700) when missing and kept.
    """
    if setting is None:
        return None, False
    if setting == AUTO:
        return tempfile.mkdtemp(prefix="tessera-executor-pyc-"), True
    Path(setting).mkdir(mode=0o700, parents=True, exist_ok=True)
    return setting, False


def run_clientapp_process(bytecode_cache: str | None = None, **kwargs: object) -> None:
    """Run Flower's ``run_clientapp`` for one task (the target of a forked process).

    Parameters
    ----------
    bytecode_cache : str | None
        Where the app's compiled modules are cached (:func:`cache_bytecode`).
    **kwargs : object
        ``run_clientapp``'s keyword arguments.
    """
    cache_bytecode(bytecode_cache)
    from flwr.supernode.runtime import run_clientapp as runtime

    if not shorten_object_pull_backoff():
        LOG.warning("this Flower has no initial_backoff to shorten; keeping its own")
    timings = time_start_steps(runtime)
    started = time.monotonic()
    try:
        runtime.run_clientapp(**kwargs)  # type: ignore[arg-type]
    finally:
        from logging import INFO

        from flwr.common.logger import log

        log(INFO, "ClientApp process %d: %s", os.getpid(), describe_steps(timings, started))


START_STEPS = {
    "pull_task_input": "message pulled",
    "install_from_fab": "FAB installed",
    "get_load_client_app_fn": "app loaded",
}
"""The steps of Flower's ``run_clientapp`` before the ClientApp runs (its ``start``
phase in ``metrics.jsonl``), timed by :func:`time_start_steps`."""


def time_start_steps(runtime: object) -> dict[str, float]:
    """Time the steps of :data:`START_STEPS` in Flower's ``run_clientapp`` module.

    Replaces each function of ``runtime`` (this process's own copy of Flower's
    module; a forked ClientApp process runs one task and exits) by one that records
    its seconds in the returned dict. ``get_load_client_app_fn`` returns the loader,
    so its loader call is what is timed. Missing names are left alone.
    """
    timings: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            tick = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                timings[name] = timings.get(name, 0.0) + time.monotonic() - tick

        return run

    for name in START_STEPS:
        fn = getattr(runtime, name, None)
        if fn is None:
            continue
        if name == "get_load_client_app_fn":

            def loader_of(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
                return timed("get_load_client_app_fn", _fn(*args, **kwargs))

            setattr(runtime, name, loader_of)
        else:
            setattr(runtime, name, timed(name, fn))
    return timings


def describe_steps(timings: dict[str, float], started: float) -> str:
    """Render the timed start steps and the whole task, e.g. for a log line.

    Examples
    --------
    >>> describe_steps({"pull_task_input": 0.31, "get_load_client_app_fn": 0.2}, 0.0)[:44]
    'message pulled 0.31 s, app loaded 0.20 s, ta'
    """
    parts = [
        f"{what} {timings[name]:.2f} s" for name, what in START_STEPS.items() if name in timings
    ]
    parts.append(f"task {time.monotonic() - started:.2f} s")
    return ", ".join(parts)


def launch_clientapp(
    ctx: ForkServerContext,
    config: ExecutorConfig,
    token: str,
    certificates: bytes | None,
    bytecode_cache: str | None = None,
) -> BaseProcess:
    """Start Flower's ``run_clientapp`` for one task in a process forked from the server.

    Parameters
    ----------
    ctx : ForkServerContext
        The warm fork server.
    config : ExecutorConfig
        Where the ClientAppIo API is and how to reach it.
    token : str
        The task's token, granted by ``ClaimTask``.
    certificates : bytes or None
        The PEM CA bundle of ``config.root_certificates``, read once by the executor
        (``None`` with ``insecure``).
    bytecode_cache : str | None
        The folder of the app's compiled modules (:func:`bytecode_folder`).

    Returns
    -------
    BaseProcess
        The started process; it exits once it has pushed its reply.
    """
    proc = ctx.Process(
        target=run_clientapp_process,
        args=(bytecode_cache,),
        kwargs={
            "clientappio_api_address": config.appio_api_address,
            "token": token,
            "insecure": config.insecure,
            "certificates": certificates,
            "parent_pid": os.getpid(),
            "runtime_dependency_install": False,
        },
        name="flwr-clientapp",
        daemon=False,
    )
    proc.start()
    return proc


class Executor:
    """Pull tasks from a SuperNode's ClientAppIo API and run each in a warm process.

    Parameters
    ----------
    config : ExecutorConfig
        The parsed settings.
    """

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.children: list[BaseProcess] = []
        self._stop = threading.Event()

    def request_stop(self, signum: int, frame: FrameType | None = None) -> None:
        """Stop the loop (a signal handler).

        The first signal raises ``SystemExit`` in the main thread, so that a pull
        retrying against a SuperNode that is gone stops too; :meth:`run`'s clean-up
        then stops the running ClientApps. Later signals only log.
        """
        del frame
        if self._stop.is_set():
            LOG.info("signal %d: already stopping", signum)
            return
        LOG.info("signal %d: stopping", signum)
        self._stop.set()
        raise SystemExit(0)

    def _reap(self) -> None:
        alive = []
        for proc in self.children:
            if proc.is_alive():
                alive.append(proc)
            else:
                proc.join(0)
                if proc.exitcode not in (0, None):
                    LOG.warning("ClientApp process %s exited with %s", proc.pid, proc.exitcode)
                proc.close()
        self.children = alive

    def stop_children(self) -> None:
        """Wait up to :data:`STOP_GRACE_S` for running ClientApps, then terminate, then kill."""
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.children:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.children:
            if proc.is_alive():
                LOG.warning("terminating ClientApp process %s", proc.pid)
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        self.children = []

    def run(self) -> None:
        """Serve tasks until a signal, the parent's exit, or a fatal gRPC error."""
        cache, made = bytecode_folder(self.config.bytecode_cache)
        if cache is not None:
            LOG.info("caching the app's compiled modules in %s", cache)
        try:
            self._serve(cache)
        finally:
            if made and cache is not None:
                shutil.rmtree(cache, ignore_errors=True)

    def _serve(self, cache: str | None) -> None:
        import grpc
        from flwr.common.grpc import create_channel
        from flwr.common.retry_invoker import make_simple_grpc_retry_invoker, wrap_stub
        from flwr.proto.appio_pb2 import ClaimTaskRequest, PullPendingTasksRequest
        from flwr.proto.clientappio_pb2_grpc import ClientAppIoStub
        from flwr.supercore.interceptors import (
            RuntimeVersionClientInterceptor,
            SuperExecAuthClientInterceptor,
        )
        from flwr.supercore.interceptors.superexec_auth_interceptor import (
            CLIENTAPPIO_SUPEREXEC_METHODS,
        )

        config = self.config
        ctx = fork_server(config.preload, warm_up=config.warm_up)
        interceptors: list[grpc.UnaryUnaryClientInterceptor] = [
            RuntimeVersionClientInterceptor(component_name="SuperExec")
        ]
        if config.superexec_auth_secret_file is not None:
            from flwr.supercore.auth import load_superexec_auth_secret

            secret = load_superexec_auth_secret(secret_file=str(config.superexec_auth_secret_file))
            if secret is None:
                raise SystemExit(
                    f"{config.superexec_auth_secret_file}: no SuperExec secret in this file"
                )
            interceptors.append(
                SuperExecAuthClientInterceptor(
                    master_secret=secret, protected_methods=CLIENTAPPIO_SUPEREXEC_METHODS
                )
            )
        certificates = (
            None if config.root_certificates is None else config.root_certificates.read_bytes()
        )
        channel = create_channel(
            server_address=config.appio_api_address,
            insecure=config.insecure,
            root_certificates=certificates,
            interceptors=interceptors,
        )
        stub = ClientAppIoStub(channel)
        wrap_stub(stub, make_simple_grpc_retry_invoker())
        LOG.info(
            "serving ClientApp tasks of %s (poll every %.3f s)",
            config.appio_api_address,
            config.poll_interval,
        )
        try:
            while not self._stop.is_set():
                if config.parent_pid is not None and not _alive(config.parent_pid):
                    LOG.info("parent %d is gone: stopping", config.parent_pid)
                    break
                self._reap()
                try:
                    tasks = stub.PullPendingTasks(PullPendingTasksRequest()).tasks
                    if not tasks:
                        self._stop.wait(config.poll_interval)
                        continue
                    claim = stub.ClaimTask(ClaimTaskRequest(task_id=tasks[0].task_id))
                except Exception as err:  # the SuperNode may restart
                    # Flower's executor exits here; a node's SuperNode that restarts
                    # (a crash, a new container) finds this one still serving
                    LOG.warning("ClientAppIo call failed (%s); retrying in 1 s", _reason(err))
                    self._stop.wait(1.0)
                    continue
                if claim.token:
                    proc = launch_clientapp(ctx, config, claim.token, certificates, cache)
                    LOG.info("task %s: ClientApp process %s", tasks[0].task_id, proc.pid)
                    self.children.append(proc)
        finally:
            self.stop_children()
            channel.close()


def _reason(err: BaseException) -> str:
    """Return a gRPC error's code and details, or the exception's type and text."""
    code, details = getattr(err, "code", None), getattr(err, "details", None)
    if callable(code) and callable(details):
        return f"{code()}: {details()}"
    return f"{type(err).__name__}: {err}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def detach_main_module() -> None:
    """Make forked processes load this file by its path, not as ``tessera.executor``.

    ``multiprocessing`` re-imports the parent's ``__main__`` in every process it
    starts. Run as ``python -m tessera.executor`` that would import the ``tessera``
    package from this installation into each ClientApp process, and the app's own
    ``tessera`` modules would then be looked up there instead of in the FAB. Without a
    module spec it runs this file by its path (as it does for ``python executor.py``,
    the images' way), which imports only the standard library.
    """
    main_module = sys.modules.get("__main__")
    if main_module is not None and getattr(main_module, "__spec__", None) is not None:
        main_module.__spec__ = None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the executor (``python -m tessera.executor``).

    Parameters
    ----------
    argv : Sequence[str] | None
        Arguments without the program name.

    Returns
    -------
    int
        The exit status.
    """
    config = parse_args(argv)
    detach_main_module()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    executor = Executor(config)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, executor.request_stop)
    health = None
    if config.health_server_address is not None:
        from flwr.supercore.grpc_health import run_health_server_grpc_no_tls

        health = run_health_server_grpc_no_tls(config.health_server_address)
    try:
        executor.run()
    finally:
        if health is not None:
            health.stop(grace=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
