"""The Tessera ServerApp: parse the config once, load server-side data, run a scheme."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from tessera.config import ConfigError, RunConfig
from tessera.results import ResultsWriter, plot_rounds

log = logging.getLogger("flwr.tessera")

app = ServerApp()


def results_dir(run: RunConfig) -> Path:
    """``<output-dir>/<run-name>``; the run name defaults to strategy and time."""
    name = run.run_name or (
        f"{run.strategy}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    )
    return Path(run.output_dir).expanduser() / name


def summarise(rounds: list[dict[str, Any]], started: float) -> dict[str, Any]:
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
            (
                r["personal_accuracy_mean"]
                for r in rounds
                if r.get("personal_accuracy_mean") is not None
            ),
            default=None,
        ),
        "archs": sorted({c["arch"] for r in rounds for c in r.get("clients", [])}),
        "bytes_up_total": sum(r.get("bytes_up_total", 0) for r in rounds),
        "bytes_down_total": sum(r.get("bytes_down_total", 0) for r in rounds),
        "mean_round_seconds": float(np.mean([r["round_seconds"] for r in rounds])),
        "mean_overhead_seconds": float(np.mean([r["overhead_seconds"] for r in rounds])),
        "rejected_replies": sum(r.get("num_rejected", 0) for r in rounds),
        "failed_nodes": sum(r.get("num_failed", 0) for r in rounds),
        "wall_seconds": time.monotonic() - started,
    }


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the scheme named by run-config ``strategy``."""
    from models import list_models
    from strategies import get_scheme
    from strategies.base import ServerEnv
    from tessera.data import load_bundle, plot_label_distribution, split_server_pool

    started = time.monotonic()
    run = RunConfig.from_flower(context.run_config)
    scheme = get_scheme(run.strategy)
    options = scheme.parse_options(context.run_config)
    family = run.model_family or scheme.default_family
    try:
        list_models(family)
    except ValueError as err:
        raise ConfigError(f"run-config 'model-family': {err}") from err

    bundle = load_bundle(run.dataset)
    _, server_pool = split_server_pool(
        bundle, pool_fraction=run.server_pool_fraction, seed=run.seed
    )
    out_dir = results_dir(run)
    writer = ResultsWriter(out_dir)
    log.info(
        "Tessera: strategy %s, dataset %s (%d classes, input %s), family %s; results in %s",
        run.strategy,
        bundle.name,
        bundle.num_classes,
        bundle.input_shape,
        family,
        writer.directory,
    )
    env = ServerEnv(
        run=run,
        num_classes=bundle.num_classes,
        input_shape=bundle.input_shape,
        global_test=bundle.test,
        server_pool=server_pool,
        family=family,
    )
    server = scheme.server(env=env, options=options, results=writer)
    try:
        server.start(grid=grid, num_rounds=run.num_server_rounds, timeout=run.round_timeout)
    finally:
        rounds: list[dict[str, Any]] = list(getattr(server, "rounds", []))
        summary = summarise(rounds, started)
        summary["strategy"] = run.strategy
        summary["results_dir"] = str(writer.directory)
        writer.write_summary(summary)
        plot_rounds(rounds, writer.directory)
        nodes = getattr(server, "nodes", {})
        if nodes:
            ordered = sorted(nodes.values(), key=lambda i: (i.partition_id, i.node_id))
            width = max([env.num_classes, *(len(i.label_counts) for i in ordered)])
            counts = np.array(
                [list(i.label_counts) + [0] * (width - len(i.label_counts)) for i in ordered]
            )
            plot_label_distribution(
                counts,
                writer.directory / "label_distribution.png",
                title=f"{bundle.name}: {run.partitioner} partition ({len(ordered)} clients)",
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
