"""Federations of hundreds of nodes: round time and server memory against node count.

Each size runs a real Flower simulation (``scripts/simulate.sh``: a local SuperLink,
Ray, ``flwr run``) of ``fedavg`` on a tiny model (``mlp-s``, 4,938 parameters with
batch norm) for 2 rounds, every node training one local epoch on its IID share of a
generated data set large enough that every node holds at least ``--per-node`` training samples
(``npz:``, 64 features, 10 Gaussian classes, seeded). Every node trains every round.

From each run's ``metrics.jsonl`` it reports round 2 (the steady state: round 1 also
holds the handshake with every node and Ray's ClientApp start-up): the round's wall
time, the server's time per phase (``handshake``: finding and greeting new nodes;
``build``: selecting nodes and building their messages; ``exchange``: pushing
messages and pulling replies, which includes the clients' work, and within it
``pull``, the server's time in ``pull_messages``, and ``fold``, validating and
folding the replies; ``aggregate``;
``evaluate``: the global model on the server pool), and the ServerApp process's
resident memory (now and peak). Total wall time includes Ray's start.

Usage::

    .venv/bin/python benchmarks/scale.py [--nodes 10,50,100,200,500,1000]
        [--out results/bench-scale]

Prints a Markdown table and writes ``table.md``, ``scale.json`` and ``scale.png``; a
size that was already run (its ``metrics.jsonl`` complete) is not run again.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 2
PHASES = ("handshake", "build", "exchange", "pull", "fold", "aggregate", "evaluate")

log = logging.getLogger("scale")


def make_dataset(
    path: Path, *, n_train: int, n_test: int, features: int = 64, seed: int = 0
) -> Path:
    """Write a 10-class Gaussian data set as an ``npz`` the ``npz:`` spec reads."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=1.5, size=(10, features)).astype(np.float32)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, 10, size=n).astype(np.int64)
        y[:10] = np.arange(10)  # every class present
        x = centres[y] + rng.normal(size=(n, features)).astype(np.float32)
        return x.astype(np.float32), y

    x_train, y_train = draw(n_train)
    x_test, y_test = draw(n_test)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return path


def run_size(nodes: int, *, data: Path, out: Path, timeout: float) -> dict[str, Any]:
    """Run one federation of ``nodes`` simulated nodes; return its summary row."""
    name = f"scale-{nodes}"
    metrics = out / name / "metrics.jsonl"
    wall = float("nan")
    if not _complete(metrics):
        run_config = (
            f"strategy='fedavg' fedavg-arch='mlp-s' dataset='npz:{data}' partitioner='iid' "
            f"num-server-rounds={ROUNDS} local-epochs=1 min-nodes={nodes} "
            f"round-timeout={timeout} node-wait-timeout={timeout} "
            "sim-device-profiles='cpu-small,cpu-large,jetson-orin'"
        )
        cmd = [
            "bash",
            str(ROOT / "scripts" / "simulate.sh"),
            "--nodes",
            str(nodes),
            "--run-name",
            name,
            "--output-dir",
            str(out),
            "--run-config",
            run_config,
        ]
        log.info("%d nodes: starting the simulation", nodes)
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.monotonic() - start
        (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not _complete(metrics):
            raise RuntimeError(
                f"{nodes} nodes: simulation failed (exit {proc.returncode}); "
                f"see {out / (name + '.log')}"
            )
        (out / name / "wall_seconds.txt").write_text(f"{wall}\n")
    elif (out / name / "wall_seconds.txt").exists():
        wall = float((out / name / "wall_seconds.txt").read_text())
    rounds = [json.loads(line) for line in metrics.read_text().splitlines()]
    return row_of(nodes, rounds, wall)


def _complete(metrics: Path) -> bool:
    return metrics.exists() and len(metrics.read_text().splitlines()) >= ROUNDS


def row_of(nodes: int, rounds: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Summarise one run: round 2's time, phases and memory, round 1's handshake."""
    first, last = rounds[0], rounds[-1]
    phases = last.get("phase_seconds", {})
    memory = last.get("server_memory_mb", {})
    return {
        "nodes": nodes,
        "num_ok": last["num_ok"],
        "round_seconds": last["round_seconds"],
        "first_round_seconds": first["round_seconds"],
        "first_handshake_seconds": first.get("phase_seconds", {}).get("handshake", float("nan")),
        **{f"{p}_seconds": phases.get(p, float("nan")) for p in PHASES},
        "server_rss_mb": memory.get("rss", float("nan")),
        "server_peak_mb": memory.get("peak", float("nan")),
        "wall_seconds": wall,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """Render the rows as a Markdown table."""
    head = (
        "| nodes | replies | round 2 s | per node ms | handshake (round 1) s | build s "
        "| exchange s (pull, fold) | aggregate s | evaluate s | server RSS MB (peak) "
        "| total wall s |"
    )
    lines = [head, "|" + "---:|" * 11]
    for r in rows:
        lines.append(
            f"| {r['nodes']} | {r['num_ok']} | {r['round_seconds']:.1f} | "
            f"{1000 * r['round_seconds'] / r['nodes']:.0f} | "
            f"{r['first_handshake_seconds']:.1f} | {r['build_seconds']:.2f} | "
            f"{r['exchange_seconds']:.1f} ({r['pull_seconds']:.1f}, {r['fold_seconds']:.2f}) | "
            f"{r['aggregate_seconds']:.3f} | "
            f"{r['evaluate_seconds']:.2f} | {r['server_rss_mb']:.0f} ({r['server_peak_mb']:.0f}) "
            f"| {r['wall_seconds']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Draw round time (with the server's own share) and server memory against nodes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = np.array([r["nodes"] for r in rows], dtype=float)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.loglog(nodes, [r["round_seconds"] for r in rows], "o-", label="round 2 wall time")
    server = [
        r["build_seconds"] + r["pull_seconds"] + r["fold_seconds"] + r["aggregate_seconds"]
        for r in rows
    ]
    left.loglog(nodes, server, "s--", label="server work (build, pull, fold, aggregate)")
    per_node = rows[-1]["round_seconds"] / rows[-1]["nodes"]
    left.loglog(nodes, per_node * nodes, ":", color="grey", label="linear in nodes")
    left.set_xlabel("simulated nodes")
    left.set_ylabel("seconds")
    left.legend(fontsize=8)
    left.set_title("round time")
    right.plot(nodes, [r["server_rss_mb"] for r in rows], "o-", label="RSS after round 2")
    right.plot(nodes, [r["server_peak_mb"] for r in rows], "s--", label="peak")
    right.set_xscale("log")
    right.set_xlabel("simulated nodes")
    right.set_ylabel("MiB")
    right.legend(fontsize=8)
    right.set_title("ServerApp process memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Run the sizes not run yet and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="10,50,100,200,500,1000")
    parser.add_argument("--per-node", type=int, default=40, help="training samples per node")
    parser.add_argument("--timeout", type=float, default=3600.0, help="round timeout, s")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-scale")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    sizes = [int(n) for n in args.nodes.split(",") if n.strip()]
    if not sizes or min(sizes) < 2:
        parser.error(f"--nodes {args.nodes!r}: give sizes of 2 or more, e.g. 10,50,100")
    # the client pool is what remains after the server pool (10 %) and local test splits
    n_train = int(max(sizes) * args.per_node / 0.9 / 0.8) + 100
    data = make_dataset(args.out / "data.npz", n_train=n_train, n_test=2000)
    rows: list[dict[str, Any]] = []
    for nodes in sizes:
        rows.append(run_size(nodes, data=data.resolve(), out=args.out, timeout=args.timeout))
        log.info("%d nodes: round 2 took %.1f s", nodes, rows[-1]["round_seconds"])
    text = markdown(rows)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "scale.json").write_text(json.dumps(rows, indent=2))
    log.info("plot: %s", plot(rows, args.out / "scale.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
