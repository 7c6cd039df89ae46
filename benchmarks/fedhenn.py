"""FedHeNN on digits against its baselines, through real Flower simulations.

Pathological split, 2 classes per client, 10 clients, the ``cnn`` family (five
sizes), a fleet of five emulated device profiles (``sim-device-profiles``), several
seeds. Every run is ``scripts/simulate.sh`` (Flower simulation, Ray backend).

- heterogeneous: ``fedhenn`` (``fedhenn-mode=heterogeneous``) against ``local`` and
  ``fedavg-groups``, personalised accuracy (each client's model on its own test
  split). The devices choose their architectures; ``train-time-budget`` is lowered
  (``--hetero-budget``, default 0.01 s) so that several cnn sizes are chosen.
- homogeneous: ``fedhenn`` (``fedhenn-mode=homogeneous``) against ``fedavg`` and
  ``fedprox``, accuracy of the global model on the server's test set; all three
  train the weakest device's choice (default budget, ``--homo-budget``).

Also: bytes per client and round (measured payloads), FedHeNN's kernel payload
against naive ``n x n`` float32 kernels, and the share of local time spent on the
alignment. ``eta0`` defaults to 0.1, chosen on a held-out seed (7) among the paper's
0.001, 0.1 and 1.0 (see docs/pages/fedhenn.md).

Usage::

    .venv/bin/python benchmarks/fedhenn.py [--seeds 42,43,44] [--rounds 8]
        [--nodes 10] [--eta0 0.1] [--groups hetero,homo] [--parallel 1]

Prints a markdown table (mean ± std over seeds) and writes
``results/bench-fedhenn/<time>/fedhenn.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.harness import run_in_group, sigterm_as_ctrl_c, simulate_command

ROOT = Path(__file__).resolve().parents[1]
PROFILES = "cpu-small,cpu-medium,cpu-large,jetson-orin,gpu-server"
GROUPS: dict[str, list[tuple[str, str]]] = {
    # (label, run-config of the scheme)
    "hetero": [
        ("fedhenn (heterogeneous)", "strategy='fedhenn' fedhenn-mode='heterogeneous'"),
        ("local", "strategy='local'"),
        ("fedavg-groups", "strategy='fedavg-groups'"),
    ],
    "homo": [
        ("fedhenn (homogeneous)", "strategy='fedhenn' fedhenn-mode='homogeneous'"),
        ("fedavg", "strategy='fedavg'"),
        ("fedprox", "strategy='fedprox'"),
    ],
}
METRIC = {"hetero": "personal_accuracy_mean", "homo": "global_accuracy"}
RAD_ROWS_PAPER = 5000


def run_once(run_config: str, *, nodes: int, out: Path, name: str) -> list[dict[str, Any]]:
    """Run one simulation (in its own FLWR_HOME) and return its round records."""
    cmd = simulate_command(nodes=nodes, name=name, out=out, run_config=run_config)
    started = time.monotonic()
    env = {**os.environ, "FLWR_HOME_SIM": str(out / "flwr-home" / name)}
    proc = run_in_group(cmd, env=env, timeout=900)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"run {name} failed (exit {proc.returncode})")
    rounds = load_rounds(out / name)
    print(f"  {name}: {len(rounds)} rounds in {time.monotonic() - started:.0f} s", flush=True)
    return rounds


def load_rounds(run_dir: Path) -> list[dict[str, Any]]:
    """Return the round records of a finished run."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    if not values:
        return float("nan"), float("nan")
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(rounds: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Per-run numbers: final and last-3-round accuracy, bytes, alignment."""
    values = [r[metric] for r in rounds if r.get(metric) is not None]
    clients = [c for r in rounds for c in r["clients"]]
    out: dict[str, Any] = {
        "final": values[-1] if values else None,
        "last3": statistics.mean(values[-3:]) if values else None,
        "bytes_per_client_round": statistics.mean(c["bytes_up"] + c["bytes_down"] for c in clients),
        "archs": sorted({c["arch"] for c in clients}),
        "arch_counts": _arch_counts(rounds[-1]),
    }
    aligned = [r for r in rounds if r.get("eta", 0) > 0]
    if aligned:
        out["alignment_share"] = statistics.mean(r["alignment_share"] for r in aligned)
        out["alignment_seconds"] = statistics.mean(r["alignment_seconds"] for r in aligned)
        out["cka_mean"] = statistics.mean(r["cka_mean"] for r in aligned if r["cka_mean"])
    kernel = [r for r in rounds if r.get("kernel_bytes_naive")]
    if kernel:
        out["kernel_bytes_naive"] = statistics.mean(r["kernel_bytes_naive"] for r in kernel)
        out["kernel_bytes_sent"] = statistics.mean(r["kernel_bytes_sent"] for r in kernel)
    factored = [r for r in rounds if "kbar_cka" in r]
    if factored:
        out["kbar_cka_min"] = min(r["kbar_cka"] for r in factored)
        out["kbar_rank_mean"] = statistics.mean(r["kbar_rank"] for r in factored)
        out["kbar_bytes_mean"] = statistics.mean(r["kbar_bytes"] for r in factored)
        out["rep_bytes_mean"] = statistics.mean(r["rep_bytes_up"] for r in factored)
        out["rad_rows"] = factored[0]["rad_rows"]
    if rounds and rounds[0]["clients"]:
        out["train_seconds_mean"] = statistics.mean(c["train_seconds"] for c in clients)
    return out


def _arch_counts(record: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in record["clients"]:
        counts[c["arch"]] = counts.get(c["arch"], 0) + 1
    return dict(sorted(counts.items()))


def fmt(values: list[float], scale: float = 100.0) -> str:
    mean, std = mean_std([v * scale for v in values])
    return f"{mean:.1f} ± {std:.1f}"


def main() -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="42,43,44")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--eta0", type=float, default=0.1)
    parser.add_argument("--hetero-budget", type=float, default=0.01)
    parser.add_argument("--homo-budget", type=float, default=2.0)
    parser.add_argument("--groups", default="hetero,homo")
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="simulations at a time (2 overlaps their start-up, but on a busy 2-core "
        "machine it was slower than 1)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-fedhenn")
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=None,
        help="re-print the table of a finished benchmark folder instead of running",
    )
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    groups = [g for g in args.groups.split(",") if g]
    for group in groups:
        if group not in GROUPS:
            parser.error(f"--groups: unknown group '{group}'; use hetero and/or homo")
    out = args.source or args.out / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    common = (
        f"num-server-rounds={args.rounds} dataset='digits' partitioner='pathological' "
        f"classes-per-client=2 model-family='cnn' sim-device-profiles='{PROFILES}' "
        f"eta0={args.eta0}"
    )
    jobs: list[tuple[str, str, str, str]] = []  # group, label, name, run-config
    for group in groups:
        budget = args.hetero_budget if group == "hetero" else args.homo_budget
        for seed in seeds:
            for label, scheme in GROUPS[group]:
                name = f"{group}-{label.split()[0]}-{seed}"
                config = f"{common} {scheme} seed={seed} train-time-budget={budget}"
                jobs.append((group, label, name, config))
    if args.source is not None:
        records = [load_rounds(out / name) for _, _, name, _ in jobs]
    else:
        with ThreadPoolExecutor(max_workers=max(args.parallel, 1)) as pool:
            futures = [
                pool.submit(run_once, config, nodes=args.nodes, out=out, name=name)
                for _, _, name, config in jobs
            ]
            records = [f.result() for f in futures]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for (group, label, _, _), rounds in zip(jobs, records, strict=True):
        by_label = results.setdefault(group, {lab: [] for lab, _ in GROUPS[group]})
        by_label[label].append(summarise(rounds, METRIC[group]))
    elapsed = time.monotonic() - started

    print(
        f"\nFedHeNN on digits, pathological 2 classes/client, {args.nodes} clients, cnn "
        f"family, {args.rounds} rounds, seeds {args.seeds}, eta0={args.eta0} "
        f"(eta(t) = eta0 sqrt(t-1)), {elapsed / 60:.1f} min\n"
    )
    print(
        "| group | scheme | metric | final round (%) | mean of last 3 rounds (%) "
        "| bytes per client-round | alignment share of local time | architectures |"
    )
    print("|---|---|---|---:|---:|---:|---:|---|")
    for group, by_label in results.items():
        metric = "personalised acc." if group == "hetero" else "global acc."
        for label, runs in by_label.items():
            finals = [r["final"] for r in runs if r["final"] is not None]
            last3 = [r["last3"] for r in runs if r["last3"] is not None]
            kib = statistics.mean(r["bytes_per_client_round"] for r in runs) / 1024
            share = [r["alignment_share"] for r in runs if "alignment_share" in r]
            share_s = fmt(share) + " %" if share else "-"
            archs = runs[0]["arch_counts"]
            arch_s = ", ".join(f"{a}×{n}" for a, n in archs.items())
            print(
                f"| {group} | {label} | {metric} | {fmt(finals)} | {fmt(last3)} "
                f"| {kib:.1f} KiB | {share_s} | {arch_s} |"
            )
    henn = results.get("hetero", {}).get("fedhenn (heterogeneous)", [])
    kernel = [r for r in henn if "kbar_bytes_mean" in r]
    if kernel:
        n = kernel[0]["rad_rows"]
        square = 4 * n * n / 1024
        rank = statistics.mean(r["kbar_rank_mean"] for r in kernel)
        factor = statistics.mean(r["kbar_bytes_mean"] for r in kernel) / 1024
        rep = statistics.mean(r["rep_bytes_mean"] for r in kernel) / 1024
        cka = min(r["kbar_cka_min"] for r in kernel)
        dim = rep * 1024 / n / 2
        rows = RAD_ROWS_PAPER
        print(
            f"\nHeterogeneous kernel payload (RAD = {n} rows, the whole digits server pool), "
            f"per client and round: up, the representation ({dim:.0f} columns on average, "
            f"float16) {rep:.1f} KiB instead of K_i as n x n float32 {square:.1f} KiB; down, "
            f"K_bar's factor (mean rank {rank:.1f}, float16) {factor:.1f} KiB instead of "
            f"{square:.1f} KiB. CKA(exact K_bar, transmitted) >= {cka:.4f} in every round. "
            f"At the paper's RAD of {rows} rows, same widths and rank: "
            f"{4 * rows * rows / 2**20:.0f} MiB each way naive, "
            f"{rows * dim * 2 / 2**20:.2f} MiB up and {rows * rank * 2 / 2**20:.2f} MiB down."
        )
    (out / "fedhenn.json").write_text(
        json.dumps({"args": vars(args) | {"out": out}, "results": results}, indent=2, default=str)
    )
    print(f"\nwritten to {out / 'fedhenn.json'}")
    return 0


if __name__ == "__main__":
    with sigterm_as_ctrl_c():  # `kill` stops the federation it started too
        sys.exit(main())
