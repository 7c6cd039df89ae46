"""The Tessera ServerApp: parse the config once, load server-side data, run a scheme."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from strategies.core.context import ServerEnv
from strategies.core.registry import ServerRunner
from tessera.checkpoint import CheckpointError
from tessera.config import ConfigError, RunConfig
from tessera.results import ResultsWriter, plot_rounds

if TYPE_CHECKING:
    from tessera.data import DataBundle

log = logging.getLogger("flwr.tessera")

app = ServerApp()


def results_dir(run: RunConfig) -> Path:
    """``<output-dir>/<run-name>``; the run name defaults to strategy and time."""
    name = run.deployment.run_name or (
        f"{run.scheme.strategy}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    )
    return Path(run.deployment.output_dir).expanduser() / name


def _finite(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and math.isfinite(value)


def summarise(rounds: list[Mapping[str, Any]], started: float) -> dict[str, Any]:
    """Compute a run's final figures from its round records."""
    if not rounds:
        return {"rounds": 0, "wall_seconds": time.monotonic() - started}
    last = rounds[-1]
    return {
        "rounds": len(rounds),
        "final_personal_accuracy_mean": last.get("personal_accuracy_mean"),
        "final_personal_accuracy_std": last.get("personal_accuracy_std"),
        "final_personal_accuracy_by_arch": last.get("personal_accuracy_by_arch"),
        "final_global_accuracy": last.get("global_accuracy"),
        "final_global_accuracy_by_arch": last.get("global_accuracy_by_arch"),
        "best_personal_accuracy_mean": max(
            # a skipped round with no reply records NaN (read back: None); neither counts
            (v for r in rounds if _finite(v := r.get("personal_accuracy_mean"))),
            default=None,
        ),
        "archs": sorted({c["arch"] for r in rounds for c in r.get("clients", [])}),
        "bytes_up_total": sum(r.get("bytes_up_total", 0) for r in rounds),
        "bytes_down_total": sum(r.get("bytes_down_total", 0) for r in rounds),
        "mean_round_seconds": float(np.mean([r["round_seconds"] for r in rounds])),
        "mean_overhead_seconds": float(np.mean([r["overhead_seconds"] for r in rounds])),
        "rejected_replies": sum(r.get("num_rejected", 0) for r in rounds),
        "failed_nodes": sum(r.get("num_failed", 0) for r in rounds),
        "skipped_rounds": [r["round"] for r in rounds if r.get("skipped")],
        "wall_seconds": time.monotonic() - started,
    }


@dataclass
class Server:
    """A scheme's server side, ready to run, with what the ServerApp reports on.

    Attributes
    ----------
    runner : ServerRunner
        The scheme's server (already restored from the checkpoint on resume).
    env : ServerEnv
        The task and server-side data.
    writer : ResultsWriter
        The results folder.
    dataset_name : str
        For the logs and plots.
    """

    runner: ServerRunner
    env: ServerEnv
    writer: ResultsWriter
    dataset_name: str


def build_server(run_config: Mapping[str, Any], *, bundle: DataBundle | None = None) -> Server:
    """Parse the run config once and build the scheme's server (used by tests too).

    Parameters
    ----------
    run_config : Mapping[str, Any]
        Flower's raw run config.
    bundle : DataBundle, optional
        The dataset, when the caller already loaded it (tests); loaded otherwise.

    Returns
    -------
    Server
        The runner and its environment. With run-config ``resume`` the results
        folder is the one named there, and the runner continues from its checkpoint.
        The folder is created, and on resume ``metrics.jsonl`` cut back to the
        checkpoint's round, only once the config and the checkpoint are accepted.

    Raises
    ------
    ConfigError
        If a value is invalid, or the checkpoint to resume is of another run.
    """
    from models import list_models
    from strategies import resolve_run
    from tessera.data import load_bundle, split_server_pool

    resolved = resolve_run(run_config)
    run, scheme, options = resolved.run, resolved.scheme, resolved.options
    family = run.scheme.model_family or scheme.family(options)
    values = run.to_dict()
    owned = [f"{k}={v}" for k, v in scheme.config_defaults.items() if values.get(k) == v]
    if owned:
        log.info(
            "Tessera: %s's own defaults: %s (a run that sets the key keeps its value)",
            scheme.name,
            ", ".join(owned),
        )
    try:
        list_models(family)
    except ValueError as err:
        raise ConfigError(f"run-config 'model-family': {err}") from err
    if bundle is None:
        bundle = load_bundle(run.data.dataset)
    _, server_pool = split_server_pool(
        bundle, pool_fraction=run.data.server_pool_fraction, seed=run.seed
    )
    env = ServerEnv(
        run=run,
        num_classes=bundle.num_classes,
        input_shape=bundle.input_shape,
        global_test=bundle.test,
        server_pool=server_pool,
        family=family,
    )
    state: Mapping[str, Any] | None = None
    if run.deployment.resume is not None:
        try:
            writer, state = ResultsWriter.reopen(Path(run.deployment.resume))
        except CheckpointError as err:
            raise ConfigError(str(err)) from err
    else:
        writer = ResultsWriter(results_dir(run), create=False)
    runner: ServerRunner = scheme.server(env=env, options=options, results=writer)
    if state is not None:
        runner.load_state_dict(state)  # refuses a bad checkpoint before anything is written
        writer.cut_metrics()
    writer.create()
    return Server(runner=runner, env=env, writer=writer, dataset_name=bundle.name)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the scheme named by run-config ``strategy``.

    Refuses the omniscient attacks of the harness, which only the in-process grid
    can run (:func:`tessera.attacks.require_client_side`).
    """
    from strategies.core import fused
    from strategies.core.exchange import is_simulation
    from tessera.attacks import require_client_side
    from tessera.data import plot_label_distribution
    from tessera.executor import shorten_object_pull_backoff
    from tessera.sim_engine import index_messages_by_node

    started = time.monotonic()
    run_config = RunConfig.from_flower(context.run_config)
    require_client_side(run_config)
    fused.start_warm_up()  # the aggregation loops load while the server waits for nodes
    # a reply pulled between its message and its objects reaching the SuperLink is
    # asked for again after 20 ms, not after Flower's 1 s (deployment; the
    # simulation's grid pulls no objects)
    shorten_object_pull_backoff()
    engine = run_config.deployment.sim_engine
    if is_simulation(grid) and engine != "flower":  # each node's message found in O(1)
        index_messages_by_node(feed=engine == "direct")
    server = build_server(context.run_config)
    run, env, writer, runner = server.env.run, server.env, server.writer, server.runner
    log.info(
        "Tessera: strategy %s, dataset %s (%d classes, input %s), family %s; results in %s%s",
        run.scheme.strategy,
        server.dataset_name,
        env.num_classes,
        env.input_shape,
        env.family,
        writer.directory,
        f" (resuming after round {len(runner.rounds)})" if run.deployment.resume else "",
    )
    try:
        runner.start(
            grid, num_rounds=run.scheme.num_server_rounds, timeout=run.deployment.round_timeout
        )
    finally:
        rounds = list(runner.rounds)
        summary = summarise(rounds, started)
        summary["strategy"] = run.scheme.strategy
        summary["results_dir"] = str(writer.directory)
        if runner.final_metrics:
            summary["end_of_run"] = dict(runner.final_metrics)
        writer.write_summary(summary)
        plot_rounds(rounds, writer.directory)
        nodes = runner.nodes
        if nodes:
            ordered = sorted(nodes.values(), key=lambda i: (i.partition_id, i.node_id))
            width = max([env.num_classes, *(len(i.label_counts) for i in ordered)])
            counts = np.array(
                [list(i.label_counts) + [0] * (width - len(i.label_counts)) for i in ordered]
            )
            plot_label_distribution(
                counts,
                writer.directory / "label_distribution.png",
                title=(
                    f"{server.dataset_name}: {run.data.partitioner} partition "
                    f"({len(ordered)} clients)"
                ),
            )
        log.info(
            "Tessera: finished %d round(s); final personalised accuracy %s, global "
            "accuracy %s; results in %s",
            summary.get("rounds", 0),
            _fmt(summary.get("final_personal_accuracy_mean")),
            _fmt(summary.get("final_global_accuracy")),
            writer.directory,
        )


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{float(value):.3f}"
