"""What the benchmarks that run federations share: fast in-process clients and a resumable grid.

The federations run real ClientApps (the project's own handlers) in-process on
:class:`tessera.local_grid.LocalGrid`; :func:`fast_clients` serves the ClientApp's slow
pure look-ups from memory; :func:`run_cells` runs the cells not yet in a
``cells.jsonl`` and appends one line per finished cell, so an interrupted benchmark
resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[1]


class CellLike(Protocol):
    """A federation of a benchmark grid: anything with a unique ``key``."""

    @property
    def key(self) -> str:
        """A unique name of the cell (resume key)."""
        ...


def default_run_config() -> dict[str, Any]:
    """Return the ``[tool.flwr.app.config]`` table of pyproject.toml (the real defaults)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: tomli (a dependency of flwr) is what tomllib was made from
        import tomli as tomllib

    with (ROOT / "pyproject.toml").open("rb") as fh:
        table = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    return dict(table)


def client_handlers() -> dict[str, Any]:
    """Return the real ClientApp handlers by message type."""
    from client_app.app import evaluate, handshake, train
    from tessera import wire

    return {wire.HANDSHAKE: handshake, "train": train, "evaluate": evaluate}


@contextlib.contextmanager
def fast_clients(bundle: Any) -> Iterator[None]:
    """Serve the ClientApp's three slow pure look-ups from memory, on one torch thread.

    ``load_bundle`` (the dataset), ``candidate_costs`` (which builds every model of a
    family to measure it) and ``partition_indices`` (flwr-datasets partitioners, run
    for every partition on every call) give the same result for the same arguments;
    keeping them makes each handshake and train call fast without changing what it
    computes. The partitions are handed out as copies.
    """
    from unittest import mock

    import numpy as np
    import torch

    import client_app.app
    import client_app.selection
    import tessera.data.splits

    real_load = tessera.data.load_bundle  # what client_app.app imported
    costs = functools.cache(client_app.selection.candidate_costs)
    real_partition = tessera.data.splits.partition_indices  # what client_data calls
    partitions: dict[tuple[Any, ...], list[Any]] = {}

    def partition_indices(labels: Any, *, num_partitions: int, config: Any) -> list[Any]:
        y = np.asarray(labels)
        key = (y.dtype.str, y.shape, y.tobytes(), num_partitions, config)
        if key not in partitions:
            partitions[key] = real_partition(y, num_partitions=num_partitions, config=config)
        return [p.copy() for p in partitions[key]]

    def load_bundle(spec: Any) -> Any:
        return bundle if spec == bundle.name else real_load(spec)

    def candidate_costs(
        family: str,
        input_shape: Any,
        num_classes: int,
        *,
        norm: str = "batch",
        flat_input: str = "signal",
        names: Any = None,
    ) -> Any:
        chosen = None if names is None else tuple(names)
        return costs(
            family, tuple(input_shape), num_classes, norm=norm, flat_input=flat_input, names=chosen
        )

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with (
            mock.patch.object(client_app.app, "load_bundle", load_bundle),
            mock.patch.object(client_app.selection, "candidate_costs", candidate_costs),
            mock.patch.object(tessera.data.splits, "partition_indices", partition_indices),
        ):
            yield
    finally:
        torch.set_num_threads(threads)


def simulate_command(
    *, nodes: int, name: str, out: Path, run_config: str, extra: Sequence[str] = ()
) -> list[str]:
    """Return the ``scripts/simulate.sh`` command of one benchmark federation.

    Examples
    --------
    >>> simulate_command(nodes=3, name="a", out=Path("/r"), run_config="seed=1")[2:]
    ['--nodes', '3', '--run-name', 'a', '--output-dir', '/r', '--run-config', 'seed=1']
    """
    return [
        "bash",
        str(ROOT / "scripts" / "simulate.sh"),
        "--nodes",
        str(nodes),
        "--run-name",
        name,
        "--output-dir",
        str(out),
        *extra,
        "--run-config",
        run_config,
    ]


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows already in a ``cells.jsonl`` (an unfinished last line is ignored)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def run_cells(
    cells: Sequence[CellLike],
    *,
    run: Callable[[Any, Any], dict[str, Any]],
    same: Mapping[str, Any],
    jsonl: Path,
    bundle: Any = None,
    log: Callable[[str], None] = print,
    summary: Callable[[dict[str, Any]], str] = lambda row: "",
) -> list[dict[str, Any]]:
    """Run every cell not yet in ``jsonl``, appending one line per cell as it finishes.

    Parameters
    ----------
    cells : Sequence[CellLike]
        The federations.
    run : Callable[[cell, bundle], dict]
        Runs one cell and returns its row (which must hold ``key``, ``seconds`` and
        the fields of ``same``).
    same : Mapping[str, Any]
        Settings a row found in ``jsonl`` must match to count as done (federation
        size and length).
    jsonl : Path
        Results file (created if absent; rows of other cells are kept).
    bundle : DataBundle, optional
        The digits dataset; loaded when omitted and something is left to run.
    log : Callable[[str], None], optional
        Progress printer.
    summary : Callable[[dict], str], optional
        What the progress line says of a finished row.

    Returns
    -------
    list[dict[str, Any]]
        The rows of ``cells`` (those found in ``jsonl`` and those run now), in order.
    """
    from tessera.data import load_bundle

    done = {
        r["key"]: r
        for r in read_rows(jsonl)
        if all(r.get(name) == value for name, value in same.items())
    }
    todo = [c for c in cells if c.key not in done]
    log(f"{len(cells)} federations, {len(cells) - len(todo)} already done")
    if todo:
        bundle = bundle if bundle is not None else load_bundle("digits")
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        width = max(len(c.key) for c in todo)
        with fast_clients(bundle), jsonl.open("a") as fh:
            for i, cell in enumerate(todo, 1):
                row = run(cell, bundle)
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                done[cell.key] = row
                left = (time.monotonic() - started) / i * (len(todo) - i)
                log(
                    f"  [{i}/{len(todo)}] {cell.key:{width}s} {summary(row)} "
                    f"({row['seconds']:.1f} s; ~{left / 60:.0f} min left)"
                )
    return [done[c.key] for c in cells]


def mean_std(values: Sequence[float | None]) -> str:
    """Return ``mean ± std`` in percent (population std over seeds), ``-`` when empty."""
    from tessera.compare.metrics import spread

    return spread(values).text()


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """Stop a process started with ``start_new_session=True`` and everything in its group.

    SIGTERM first (``scripts/simulate.sh`` and ``deploy-local.sh`` trap it and stop
    their SuperLink, the simulation engine and Ray), SIGKILL after 20 s.
    """
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_in_group(
    cmd: Sequence[str],
    *,
    timeout: float,
    cwd: Path = ROOT,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in a process group of its own and return what it printed.

    ``subprocess.run(..., timeout=...)`` kills only the process it started: a
    ``scripts/simulate.sh`` or ``deploy-local.sh`` killed so never runs its trap, and
    its SuperLink, ``flwr-simulation`` and Ray outlive the benchmark. Here the command
    gets a session of its own, and on a timeout, an exception or Ctrl-C (SIGTERM too,
    inside :func:`sigterm_as_ctrl_c`) the whole group is stopped (:func:`stop_group`)
    before the error propagates. Output goes to temporary files, not pipes, so a
    process stopping while it prints never blocks on a full pipe.

    Raises
    ------
    subprocess.TimeoutExpired
        If ``cmd`` ran past ``timeout`` seconds (its group is stopped first).
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=None if env is None else dict(env),
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                stop_group(proc)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(list(cmd), proc.returncode, out.read(), err.read())


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`KeyboardInterrupt` as Ctrl-C does.

    Python's default SIGTERM ends the process without running ``finally`` blocks, so
    a benchmark killed with ``kill`` would leave the simulation it started (in a
    process group of its own) running; this lets its clean-up (:func:`stop_group`) run.
    """

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
