"""Federations of hundreds to thousands of nodes: round time and server cost against node count.

Each size runs a real Flower simulation (``scripts/simulate.sh``: a local SuperLink,
Ray, ``flwr run``) for 2 rounds, every node training one local epoch on its IID share
of a generated data set (``npz:``, 64 features, 10 Gaussian classes, seeded), one per
size, so that every node holds ``--per-node`` training samples at every size. Every
node trains every round. ``--scheme`` picks what they train: ``fedavg`` on a tiny
model (``mlp-s``, 4,938 parameters with batch norm; the default), ``fedavg-groups``
(one model per architecture group, ``mlp-s/m/l`` by emulated device) or ``fedfa``
(slices of one ``preresnet`` global model).

From each run's ``metrics.jsonl`` it reports round 2 (the steady state: round 1 also
holds the handshake with every node and Ray's ClientApp start-up; with ``--rounds``
above 2, the median over rounds 2 onwards of each figure): the round's wall
time, the server's time per phase (``handshake``: finding and greeting new nodes;
``build``: selecting nodes and building their messages; ``exchange``: pushing
messages and pulling replies, which includes the clients' work, and within it
``pull``, the server's time in ``pull_messages``, and ``fold``, validating and
folding the replies; ``aggregate``; ``evaluate``: the global model on the server
pool); the server's own work per reply (its thread's CPU time pulling and folding,
which leaves out waiting for the engine and, in simulation, for the interpreter
lock, and the server's training on its pool that the bounded ``mean``'s direction
check does within the fold, at most once for the whole pool and 16 times for label
mixes a round, on a server pool that grows with the node count here (10 % of each
size's data set): that is shown apart, per round); the first round's handshake; and the
ServerApp process's resident memory (now and peak). Total wall time includes Ray's
start. Under the table it prints, for the sizes of 50 nodes or more, max over min of
the round time per node, the server's work per reply and the handshake per node:
issue 26's goal is 1.3 or less.

``--sim-engine direct,indexed`` runs every size under each way of handing messages to
Flower's engine (run-config ``sim-engine``, :mod:`tessera.sim_engine`), one after the
other, and prints each one's table, then their round times side by side.

Usage::

    .venv/bin/python benchmarks/scale.py [--nodes 10,50,100,200,500,1000,2000,5000]
        [--scheme fedavg] [--sim-engine direct] [--rounds 2] [--out results/bench-scale]

Prints a Markdown table and writes ``table.md``, ``scale.json`` and ``scale.png``; a
size that was already run (its ``metrics.jsonl`` complete) is not run again. Each
simulation runs in a process group of its own, stopped whole if the benchmark is
interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import sigterm_as_ctrl_c, simulate_command, stop_group

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 2
"""Rounds a federation runs unless ``--rounds`` says more (round 1 is the handshake)."""
PHASES = (
    "handshake",
    "build",
    "exchange",
    "pull",
    "fold",
    "pull_cpu",
    "fold_cpu",
    "pool_train_cpu",
    "aggregate",
    "evaluate",
)
FLAT_FROM = 50
"""Sizes from this many nodes on are held to the flatness goals (:func:`flatness`)."""
FLAT_GOAL = 1.3
"""Issue 26's goal: per-node round time and per-reply server work within 1.3x."""

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


SCHEMES: dict[str, str] = {
    "fedavg": "strategy='fedavg' fedavg-arch='mlp-s'",
    # one model per architecture group: the emulated fleet picks mlp-s, -m or -l
    "fedavg-groups": "strategy='fedavg-groups' model-family='mlp'",
    # slices of one global model (its default family, preresnet, reading each
    # 64-feature sample as a signal), with static batch norm as the leaderboard runs it
    "fedfa": "strategy='fedfa' model-family='' norm='static-batch'",
}
"""Run-config of each ``--scheme``: ``fedavg`` (one small model), the per-architecture
path (``fedavg-groups``) and a sub-model path (``fedfa``)."""


def train_samples(nodes: int, per_node: int) -> int:
    """Training samples of a data set that gives each of ``nodes`` nodes ``per_node`` of them.

    The client pool is what remains after the server pool (10 %), and each node keeps
    20 % of its share as its local test split. One data set per size keeps every
    node's training the same at every size (one data set for the largest size gave a
    10-node run 500 times a 5,000-node run's samples per node).

    Examples
    --------
    >>> train_samples(100, 40)
    5655
    """
    return int(nodes * per_node / 0.9 / 0.8) + 100


def run_name(
    nodes: int, scheme: str = "fedavg", engine: str = "direct", rounds: int = ROUNDS
) -> str:
    """Return the results folder name of one federation.

    Examples
    --------
    >>> run_name(50), run_name(50, "fedfa", "indexed", 4)
    ('scale-50', 'scale-fedfa-indexed-r4-50')
    """
    parts = [] if scheme == "fedavg" else [scheme]
    parts += [] if engine == "direct" else [engine]
    parts += [] if rounds == ROUNDS else [f"r{rounds}"]
    return "-".join(["scale", *parts, str(nodes)])


def run_size(
    nodes: int,
    *,
    data: Path,
    out: Path,
    timeout: float,
    scheme: str = "fedavg",
    engine: str = "direct",
    rounds: int = ROUNDS,
) -> dict[str, Any]:
    """Run one federation of ``nodes`` simulated nodes; return its summary row."""
    name = run_name(nodes, scheme, engine, rounds)
    metrics = out / name / "metrics.jsonl"
    wall = float("nan")
    if not _complete(metrics, rounds):
        run_config = (
            f"{SCHEMES[scheme]} dataset='npz:{data}' partitioner='iid' "
            f"num-server-rounds={rounds} local-epochs=1 min-nodes={nodes} "
            f"round-timeout={timeout} node-wait-timeout={timeout} "
            f"sim-engine='{engine}' sim-device-profiles='cpu-small,cpu-large,jetson-orin'"
        )
        cmd = simulate_command(nodes=nodes, name=name, out=out, run_config=run_config)
        log.info("%d nodes: starting the simulation", nodes)
        start = time.monotonic()
        log_path = out / f"{name}.log"
        with log_path.open("w") as fh:
            # its own process group, stopped with everything in it (SuperLink, the
            # simulation engine, Ray) if this benchmark is interrupted or fails
            proc = None
            try:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
                )
                proc.wait()
            finally:
                if proc is not None and proc.poll() is None:
                    stop_group(proc)
        wall = time.monotonic() - start
        if proc.returncode != 0 or not _complete(metrics, rounds):
            raise RuntimeError(
                f"{nodes} nodes: simulation failed (exit {proc.returncode}); "
                f"see {out / (name + '.log')}"
            )
        (out / name / "wall_seconds.txt").write_text(f"{wall}\n")
    elif (out / name / "wall_seconds.txt").exists():
        wall = float((out / name / "wall_seconds.txt").read_text())
    rounds = [json.loads(line) for line in metrics.read_text().splitlines()]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"scheme": scheme, "sim_engine": engine, **row_of(nodes, records, wall)}


def _complete(metrics: Path, rounds: int = ROUNDS) -> bool:
    return metrics.exists() and len(metrics.read_text().splitlines()) >= rounds


def row_of(nodes: int, rounds: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Summarise one run: the steady rounds' time and phases, memory, round 1's handshake.

    The steady rounds are round 2 onwards; with more than one, each figure is their
    median (the replies: the fewest).

    Examples
    --------
    >>> recs = [{"num_ok": 3, "round_seconds": t, "phase_seconds": {"fold": t / 10}}
    ...         for t in (9.0, 1.0, 3.0, 2.0)]
    >>> row = row_of(3, recs, 20.0)
    >>> row["round_seconds"], row["fold_seconds"], row["first_round_seconds"]
    (2.0, 0.2, 9.0)
    """
    first, last = rounds[0], rounds[-1]
    steady = rounds[1:] or rounds

    def median(values: list[float]) -> float:
        return float(np.median(values)) if values else float("nan")

    phases = {
        p: median([r["phase_seconds"][p] for r in steady if p in r.get("phase_seconds", {})])
        for p in PHASES
    }
    memory = last.get("server_memory_mb", {})
    return {
        "nodes": nodes,
        "num_ok": min(r["num_ok"] for r in steady),
        "round_seconds": median([r["round_seconds"] for r in steady]),
        "steady_rounds": len(steady),
        "first_round_seconds": first["round_seconds"],
        "first_handshake_seconds": first.get("phase_seconds", {}).get("handshake", float("nan")),
        **{f"{p}_seconds": phases[p] for p in PHASES},
        "first_round_phases": first.get("phase_seconds", {}),
        "server_rss_mb": memory.get("rss", float("nan")),
        "server_peak_mb": memory.get("peak", float("nan")),
        "wall_seconds": wall,
    }


def pool_train_seconds(row: dict[str, Any]) -> float:
    """Return the CPU seconds of the server's own training on its pool in a round (0 if unrecorded).

    The bounded ``mean``'s direction check trains the model on the server pool, once
    for the whole pool and at most ``MAX_CLASS_DIRECTIONS`` times for label mixes a
    round: work per round, whatever the node count, done inside the fold.

    Examples
    --------
    >>> pool_train_seconds({"pool_train_cpu_seconds": 0.25}), pool_train_seconds({})
    (0.25, 0.0)
    >>> pool_train_seconds({"pool_train_cpu_seconds": float("nan")})
    0.0
    """
    value = float(row.get("pool_train_cpu_seconds", 0.0))
    return 0.0 if math.isnan(value) else value


def server_work_ms(row: dict[str, Any]) -> float:
    """Return the server's own work per reply in ms: its thread's CPU time pulling and folding.

    The server's training on its pool (:func:`pool_train_seconds`), a cost per round
    that a fold may trigger, is left out: it is reported per round beside it.

    Examples
    --------
    >>> round(server_work_ms({"num_ok": 50, "pull_cpu_seconds": 0.01, "fold_cpu_seconds": 0.2,
    ...                       "pool_train_cpu_seconds": 0.06}), 6)
    3.0
    """
    work = row["pull_cpu_seconds"] + row["fold_cpu_seconds"] - pool_train_seconds(row)
    return float(1000 * work / max(1, row["num_ok"]))


def flatness(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Max over min, across the sizes of :data:`FLAT_FROM` nodes or more, of three costs.

    ``per_node``: the steady round time per node; ``server_per_reply``: :func:`server_work_ms`;
    ``handshake_per_node``: round 1's handshake per node (linear handshake: flat).
    NaN where fewer than two sizes qualify.

    Examples
    --------
    >>> rows = [
    ...     {"nodes": n, "num_ok": n, "round_seconds": t, "first_handshake_seconds": n / 100,
    ...      "pull_cpu_seconds": 0.0, "fold_cpu_seconds": n / 1000}
    ...     for n, t in ((10, 5.0), (50, 1.0), (500, 13.0))
    ... ]
    >>> {k: round(v, 2) for k, v in flatness(rows).items()}
    {'per_node': 1.3, 'server_per_reply': 1.0, 'handshake_per_node': 1.0}
    """
    big = [r for r in rows if r["nodes"] >= FLAT_FROM]

    def spread(values: list[float]) -> float:
        return max(values) / min(values) if len(values) >= 2 and min(values) > 0 else math.nan

    return {
        "per_node": spread([r["round_seconds"] / r["nodes"] for r in big]),
        "server_per_reply": spread([server_work_ms(r) for r in big]),
        "handshake_per_node": spread([r["first_handshake_seconds"] / r["nodes"] for r in big]),
    }


def linear_fit(rows: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    """Least-squares ``key = a + b * nodes`` over the sizes of :data:`FLAT_FROM` or more.

    A cost with a fixed part (Ray's start in the handshake, the engine's 0.1 s sweep in
    a round) is linear in the nodes when it fits a line, though its per-node ratio
    falls with size. Returns ``a`` (s), ``b`` (s a node) and the largest deviation
    from the line as a share of the value (NaN with fewer than three sizes).

    Examples
    --------
    >>> rows = [{"nodes": n, "h": 5.0 + 0.006 * n} for n in (50, 500, 5000)]
    >>> a, b, worst = linear_fit(rows, "h")
    >>> round(a, 3), round(b, 4), round(worst, 6)
    (5.0, 0.006, 0.0)
    """
    big = [r for r in rows if r["nodes"] >= FLAT_FROM]
    if len(big) < 3:
        return math.nan, math.nan, math.nan
    x = np.array([r["nodes"] for r in big], dtype=float)
    y = np.array([r[key] for r in big], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    worst = float(np.max(np.abs(y - (intercept + slope * x)) / np.abs(y)))
    return float(intercept), float(slope), worst


def markdown(rows: list[dict[str, Any]]) -> str:
    """Render the rows as a Markdown table, then the flatness ratios against the goal."""
    head = (
        "| nodes | replies | steady round s | per node ms | handshake (round 1) s (per node ms) "
        "| build s | exchange s (pull, fold) | server work per reply ms "
        "| server pool training s a round | aggregate s "
        "| evaluate s | server RSS MB (peak) | total wall s |"
    )
    lines = [head, "|" + "---:|" * 13]
    for r in rows:
        lines.append(
            f"| {r['nodes']} | {r['num_ok']} | {r['round_seconds']:.1f} | "
            f"{1000 * r['round_seconds'] / r['nodes']:.1f} | "
            f"{r['first_handshake_seconds']:.1f} "
            f"({1000 * r['first_handshake_seconds'] / r['nodes']:.1f}) | "
            f"{r['build_seconds']:.2f} | "
            f"{r['exchange_seconds']:.1f} ({r['pull_seconds']:.1f}, {r['fold_seconds']:.2f}) | "
            f"{server_work_ms(r):.2f} | {pool_train_seconds(r):.2f} | "
            f"{r['aggregate_seconds']:.3f} | "
            f"{r['evaluate_seconds']:.2f} | {r['server_rss_mb']:.0f} ({r['server_peak_mb']:.0f}) "
            f"| {r['wall_seconds']:.0f} |"
        )
    flat = flatness(rows)
    lines += [
        "",
        f"Max / min over the sizes of {FLAT_FROM} nodes or more (goal <= {FLAT_GOAL:g}): "
        f"round time per node {flat['per_node']:.2f}, server work per reply "
        f"{flat['server_per_reply']:.2f}, first handshake per node "
        f"{flat['handshake_per_node']:.2f}.",
    ]
    for key, what in (("round_seconds", "steady round"), ("first_handshake_seconds", "handshake")):
        a, b, worst = linear_fit(rows, key)
        if math.isnan(a):
            lines.append(
                f"Least squares of {what}: needs three sizes of {FLAT_FROM} nodes or more."
            )
            continue
        lines.append(
            f"Least squares over the same sizes: {what} = {a:.2f} s + {1000 * b:.2f} ms a node "
            f"(largest deviation from the line {100 * worst:.0f} %)."
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Draw per-node and per-reply costs, round time, and server memory against nodes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = np.array([r["nodes"] for r in rows], dtype=float)
    fig, (flat, total, memory) = plt.subplots(1, 3, figsize=(14, 4))
    flat.plot(
        nodes,
        [1000 * r["round_seconds"] / r["nodes"] for r in rows],
        "o-",
        label="steady round time per node",
    )
    flat.plot(
        nodes, [server_work_ms(r) for r in rows], "s--", label="server's own work per reply (CPU)"
    )
    flat.plot(
        nodes,
        [1000 * pool_train_seconds(r) / r["nodes"] for r in rows],
        "^:",
        label="server's training on its pool, per node (CPU)",
    )
    flat.set_xscale("log")
    flat.set_ylim(bottom=0)
    flat.set_xlabel("simulated nodes")
    flat.set_ylabel("ms")
    flat.legend(fontsize=8)
    flat.set_title("cost per node (flat = linear; handshake: middle)")
    total.loglog(nodes, [r["round_seconds"] for r in rows], "o-", label="steady round wall time")
    total.loglog(
        nodes, [r["first_handshake_seconds"] for r in rows], "^-", label="round 1 handshake"
    )
    per_node = rows[-1]["round_seconds"] / rows[-1]["nodes"]
    total.loglog(nodes, per_node * nodes, ":", color="grey", label="linear in nodes")
    total.set_xlabel("simulated nodes")
    total.set_ylabel("seconds")
    total.legend(fontsize=8)
    total.set_title("round time")
    memory.plot(nodes, [r["server_rss_mb"] for r in rows], "o-", label="RSS after the last round")
    memory.plot(nodes, [r["server_peak_mb"] for r in rows], "s--", label="peak")
    memory.set_xscale("log")
    memory.set_xlabel("simulated nodes")
    memory.set_ylabel("MiB")
    memory.legend(fontsize=8)
    memory.set_title("ServerApp process memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def side_by_side(rows: list[dict[str, Any]], engines: list[str]) -> str:
    """Render the round time per node of each engine at each size, and the ratios to the first.

    Examples
    --------
    >>> rows = [{"nodes": 50, "sim_engine": e, "round_seconds": t, "num_ok": 50,
    ...          "pull_cpu_seconds": 0.0, "fold_cpu_seconds": 0.05}
    ...         for e, t in (("direct", 0.2), ("indexed", 0.3))]
    >>> print(side_by_side(rows, ["direct", "indexed"]).splitlines()[2])
    | 50 | 4.0 | 6.0 | 1.50 | 1.00 |
    """
    by = {(r["sim_engine"], r["nodes"]): r for r in rows}
    sizes = sorted({r["nodes"] for r in rows})
    base, others = engines[0], engines[1:]
    head = (
        "| nodes | "
        + " | ".join(f"`{e}` per node ms" for e in engines)
        + " | "
        + " | ".join(f"`{e}` / `{base}` round" for e in others)
        + " | "
        + " | ".join(f"`{e}` / `{base}` server work per reply" for e in others)
        + " |"
    )
    lines = [head, "|" + "---:|" * (1 + len(engines) + 2 * len(others))]
    for n in sizes:
        if any((e, n) not in by for e in engines):
            continue
        per_node = [1000 * by[(e, n)]["round_seconds"] / n for e in engines]
        work = [server_work_ms(by[(e, n)]) for e in engines]
        lines.append(
            f"| {n} | "
            + " | ".join(f"{v:.1f}" for v in per_node)
            + " | "
            + " | ".join(f"{v / per_node[0]:.2f}" for v in per_node[1:])
            + " | "
            + " | ".join(f"{v / work[0]:.2f}" if work[0] > 0 else "nan" for v in work[1:])
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the sizes not run yet and print the table."""
    from tessera.config.choices import SIM_ENGINES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="10,50,100,200,500,1000")
    parser.add_argument("--per-node", type=int, default=40, help="training samples per node")
    parser.add_argument("--timeout", type=float, default=3600.0, help="round timeout, s")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-scale")
    parser.add_argument(
        "--scheme",
        choices=sorted(SCHEMES),
        default="fedavg",
        help="fedavg (mlp-s), fedavg-groups (mlp-s/m/l by device) or fedfa (preresnet slices)",
    )
    parser.add_argument(
        "--sim-engine",
        default="direct",
        help=f"comma-separated run-config sim-engine values ({', '.join(SIM_ENGINES)}), "
        "each run at every size; the first is the reference of the side-by-side table",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="rounds a federation runs; figures are medians over round 2 onwards",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    sizes = [int(n) for n in args.nodes.split(",") if n.strip()]
    if not sizes or min(sizes) < 2:
        parser.error(f"--nodes {args.nodes!r}: give sizes of 2 or more, e.g. 10,50,100")
    engines = [e.strip() for e in args.sim_engine.split(",") if e.strip()]
    if not engines or any(e not in SIM_ENGINES for e in engines):
        parser.error(f"--sim-engine {args.sim_engine!r}: use some of {', '.join(SIM_ENGINES)}")
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: use 2 or more (round 1 holds the handshake)")
    rows: list[dict[str, Any]] = []
    with sigterm_as_ctrl_c():  # `kill` stops the running simulation too
        for engine in engines:
            for nodes in sizes:
                data = make_dataset(
                    args.out / f"data-{nodes}.npz",
                    n_train=train_samples(nodes, args.per_node),
                    n_test=2000,
                )
                rows.append(
                    run_size(
                        nodes,
                        data=data.resolve(),
                        out=args.out,
                        timeout=args.timeout,
                        scheme=args.scheme,
                        engine=engine,
                        rounds=args.rounds,
                    )
                )
                log.info(
                    "%d nodes, sim-engine %s: steady round %.2f s",
                    nodes,
                    engine,
                    rows[-1]["round_seconds"],
                )
    parts = []
    for engine in engines:
        mine = [r for r in rows if r["sim_engine"] == engine]
        parts.append((f"sim-engine={engine}:\n\n" if len(engines) > 1 else "") + markdown(mine))
    if len(engines) > 1:
        parts.append("Side by side (one run of this command):\n\n" + side_by_side(rows, engines))
    text = "\n\n".join(parts)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "scale.json").write_text(json.dumps(rows, indent=2))
    first = [r for r in rows if r["sim_engine"] == engines[0]]
    log.info("plot: %s", plot(first, args.out / "scale.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
