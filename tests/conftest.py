"""Shared fixtures: the real run-config defaults, Flower contexts and a fake grid.

The fake grid (:class:`tessera.local_grid.LocalGrid`, on the real ``client_app.app``
handlers here) stands in for Flower's SuperLink: it delivers each message to an
in-process ClientApp handler and hands back the reply with the metadata Flower would
set, so a strategy's round loop runs without a SuperLink, SuperNodes or Ray. Like
Flower's simulation grid, it makes clients emulate run-config ``sim-device-profiles``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, Context, Message, RecordDict

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6): tomli is what tomllib was made from; flwr depends on it
    import tomli as tomllib

from tessera.local_grid import (
    Handler,
    LocalGrid,
    ReplyHook,
    instruction,
    make_context,
    node_contexts,
    stamp_pushed,
)
from tessera.training import torch_threads

__all__ = [
    "TINY_DIGITS",
    "FakeGrid",
    "Handler",
    "ReplyHook",
    "client_handlers",
    "instruction",
    "load_benchmark",
    "make_context",
    "make_grid",
    "stamp_pushed",
]

REPO_ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` as the module ``bench_<name>`` (scripts, not a package)."""
    module_name = f"bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(
        module_name, REPO_ROOT / "benchmarks" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def load_default_run_config() -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` table of pyproject.toml (the real defaults)."""
    with (REPO_ROOT / "pyproject.toml").open("rb") as fh:
        table = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    return dict(table)


@pytest.fixture(scope="session")
def default_run_config() -> dict[str, Any]:
    """The run-config defaults; copy before changing."""
    return load_default_run_config()


@pytest.fixture
def run_config(default_run_config: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    """Build a run config from the defaults plus kebab-case overrides.

    Usage: ``run_config({"strategy": "local", "local-epochs": 1})``.
    """

    def build(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        config = dict(default_run_config)
        config.update(overrides or {})
        return config

    return build


def client_handlers() -> dict[str, Handler]:
    """The real ClientApp handlers by message type."""
    from client_app.app import evaluate, handshake, train
    from tessera import wire

    return {wire.HANDSHAKE: handshake, "train": train, "evaluate": evaluate}


class FakeGrid(LocalGrid):
    """A :class:`~tessera.local_grid.LocalGrid` on the real ClientApp handlers by default.

    Parameters
    ----------
    contexts : Mapping[int, Context]
        One context per connected node (node id -> context).
    handlers : Mapping[str, Handler], optional
        Handler per message type; the real ClientApp handlers by default.
    """

    def __init__(
        self,
        contexts: Mapping[int, Context],
        handlers: Mapping[str, Handler] | None = None,
    ) -> None:
        super().__init__(contexts, handlers if handlers is not None else client_handlers())


def nan_first_float_array(reply: Message) -> Message:
    """Replace the first floating-point array of a train reply by NaNs (in place)."""
    from tessera import wire

    arrays = reply.content.array_records[wire.ARRAYS]
    for key in list(arrays):
        value = arrays[key].numpy()
        if np.issubdtype(value.dtype, np.floating):
            arrays[key] = Array(np.full_like(value, np.nan))
            return reply
    raise AssertionError("the reply has no floating-point array to corrupt")


@pytest.fixture(scope="session")
def digits_bundle() -> Any:
    """The digits dataset, loaded once."""
    from tessera.data import load_bundle

    return load_bundle("digits")


@pytest.fixture(scope="session")
def candidate_cost_cache() -> dict[tuple[Any, ...], Any]:
    """Results of ``candidate_costs`` by arguments, kept for the session."""
    return {}


def install_fast_clients(
    monkeypatch: pytest.MonkeyPatch, bundle: Any, cache: dict[tuple[Any, ...], Any]
) -> None:
    """Serve the ClientApp's two slow pure look-ups from a cache.

    ``load_bundle("digits")`` and ``candidate_costs`` (which builds every model of a
    family) give the same result on every call; caching them keeps the handshake and
    train handlers fast without changing what they compute.
    """
    import client_app.app
    import client_app.selection

    real_load = client_app.app.load_bundle
    real_costs = client_app.selection.candidate_costs

    def load_bundle(spec: Any) -> Any:
        return bundle if spec == "digits" else real_load(spec)

    def candidate_costs(
        family: str,
        input_shape: Any,
        num_classes: int,
        *,
        norm: str = "batch",
        flat_input: str = "signal",
        names: Any = None,
    ) -> Any:
        key = (
            family,
            tuple(input_shape),
            num_classes,
            norm,
            flat_input,
            None if names is None else tuple(names),
        )
        if key not in cache:
            cache[key] = real_costs(
                family, input_shape, num_classes, norm=norm, flat_input=flat_input, names=names
            )
        return cache[key]

    monkeypatch.setattr(client_app.app, "load_bundle", load_bundle)
    monkeypatch.setattr(client_app.selection, "candidate_costs", candidate_costs)


@pytest.fixture
def fast_clients(
    monkeypatch: pytest.MonkeyPatch,
    digits_bundle: Any,
    candidate_cost_cache: dict[tuple[Any, ...], Any],
) -> Iterator[None]:
    """Make the ClientApp handlers fast for one test (see install_fast_clients)."""
    install_fast_clients(monkeypatch, digits_bundle, candidate_cost_cache)
    with torch_threads(1):
        yield


@pytest.fixture
def single_thread_torch() -> Iterator[None]:
    """One torch thread for the duration of a test."""
    with torch_threads(1):
        yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the shared Ray head (if a simulation started it); fail if any of it remains."""
    from tests.ray_nodes import stop_shared_head

    try:
        left = stop_shared_head()
    except AssertionError as err:  # the head no longer answered
        left = [f"the shared Ray head could not be asked for its actors: {err!s:.500}"]
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("\nthe simulations on the shared Ray head left:", *left, sep="\n  ", file=sys.stderr)


def simulate(tmp_path: Path, run_config: str, *, nodes: int = 3, extra: Sequence[str] = ()) -> Path:
    """Run ``scripts/simulate.sh`` (real Flower simulation) and return the run's folder.

    ``extra``: more arguments of the script (e.g. ``--ray-address``). Without a
    ``--ray-address`` of its own the run joins the suite's shared Ray head
    (:func:`tests.ray_nodes.shared_head_address`: one Ray start for every simulation
    test, not one each). Asserts that the script succeeded and left no process behind.
    """
    import os
    import subprocess

    from tests.ray_nodes import shared_head_address

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "results"
    if "--ray-address" not in extra:
        address = shared_head_address()
        if address is not None:
            extra = [*extra, "--ray-address", address]
    proc = subprocess.run(
        [
            "bash",
            "scripts/simulate.sh",
            "--nodes",
            str(nodes),
            "--run-name",
            "e2e",
            "--output-dir",
            str(out),
            "--run-config",
            run_config,
            *extra,
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "FLWR_HOME_SIM": str(tmp_path / "flwr-home")},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    retries = proc.stderr.count("simulate.sh: Ray failed to start (attempt")
    if retries:
        # the run passed, but each retry cost about a minute: say so in the summary
        import warnings

        warnings.warn(
            f"Ray failed to start {retries} time(s) before this simulation ran "
            f"({tmp_path.name}); simulate.sh retried",
            stacklevel=2,
        )
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"processes left running: {leftover.stdout}"
    return out / "e2e"


def simulated_rounds(tmp_path: Path, run_config: str) -> list[dict[str, Any]]:
    """Run :func:`simulate` and return its ``metrics.jsonl`` records."""
    import json

    lines = (simulate(tmp_path, run_config) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def round_input(
    content: RecordDict,
    *,
    arch: str = "cnn-3",
    num_classes: int | None = None,
    input_shape: tuple[int, ...] = (1, 8, 8),
) -> Any:
    """A :class:`~strategies.core.client.RoundInput` for calling a client's hooks directly."""
    from flwr.app import ConfigRecord

    from models.spec import ModelRef
    from strategies.core.client import RoundInput
    from tessera import wire

    config = content.config_records.get(wire.CONFIG, ConfigRecord())
    classes = num_classes if num_classes is not None else int(config.get("num-classes", 10))
    return RoundInput(
        server_round=int(config.get("server-round", 1)),
        ref=ModelRef.parse(arch),
        num_classes=classes,
        input_shape=input_shape,
        content=content,
        config=config,
    )


def memory_state() -> Any:
    """An empty in-memory :class:`~tessera.node_state.NodeState`."""
    from tessera.node_state import NodeState

    return NodeState(RecordDict(), owner="test")


TINY_DIGITS = {
    "local-epochs": 1,
    "dataset": "digits",
    "model-family": "cnn",
    "sim-device-profiles": "cpu-small,cpu-large,jetson-orin",
    "round-timeout": 5.0,
}
"""Run-config overrides for quick federations on the fake grid."""


def make_grid(config: Mapping[str, Any], num_nodes: int, *, first_node: int = 100) -> FakeGrid:
    """A fake grid of ``num_nodes`` real ClientApps, node ``first_node + i`` on partition i."""
    return FakeGrid(node_contexts(config, num_nodes, first_node=first_node))


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie waiting to be reaped counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")
