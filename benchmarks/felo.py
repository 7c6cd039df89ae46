"""Felo, Velo and FedHe: bytes on the wire and accuracy against the baselines.

Two parts, printed as markdown tables and written to ``results/felo-benchmark/<stamp>/``:

1. **Bytes** (no training): per-client upload of the per-class knowledge alone (Felo
   with ``felo-share-weights=false``; FedHe's logits) against FedAvg's weight upload,
   for the five digits CNNs (``feature-dim=128``) and a ResNet-18 on 32x32x3 inputs
   with 10 classes (``feature-dim=512``, the paper's setting). Sizes are
   :func:`tessera.wire.payload_bytes` of the real records a client sends.
2. **Accuracy**: real Flower simulations (``scripts/simulate.sh``) on digits with a
   Dirichlet(0.5) split over ``--nodes`` clients, one run per scheme and seed:

   - heterogeneous: ``felo``, ``velo``, ``fedhe``, ``local``, ``fedavg-groups`` on the
     ``cnn`` family, the clients emulating the five predefined device profiles with
     ``train-time-budget`` chosen so that they pick different sizes;
   - homogeneous (the paper's Table 2): ``fedavg``, ``felo``, ``velo`` with every
     client on the ``gpu-server`` profile, so all train ``cnn-5``.

   The accuracy is the final round's mean over clients of each client's model on its
   own test split (the paper's "average performance of all clients"), as mean and
   standard deviation over the seeds.

Usage::

    .venv/bin/python benchmarks/felo.py [--rounds 6] [--seeds 0,1,2] [--nodes 10]
        [--jobs 2] [--parts bytes,accuracy]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import mean_std, run_in_group, sigterm_as_ctrl_c, simulate_command

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HETERO_SCHEMES = ("felo", "velo", "fedhe", "local", "fedavg-groups")
HOMO_SCHEMES = ("fedavg", "felo", "velo")
HETERO_PROFILES = "cpu-small,cpu-medium,cpu-large,jetson-orin,gpu-server"
COMMON = "dataset='digits' partitioner='dirichlet' dirichlet-alpha=0.5 model-family='cnn'"


# ----------------------------------------------------------------------------- bytes
def bytes_rows() -> list[dict[str, Any]]:
    """Upload sizes of knowledge and weights for the digits CNNs and a ResNet-18."""
    import numpy as np
    import torch
    from flwr.app import RecordDict

    from models import count_parameters, get_model, list_models
    from models.projection import ProjectedModel
    from strategies.felo.knowledge import KNOWLEDGE, collect_knowledge, knowledge_to_record
    from tessera import wire
    from tessera.data import ArrayDataset, load_bundle

    digits = load_bundle("digits")
    rng = np.random.default_rng(0)
    cifar_like = ArrayDataset(
        rng.normal(size=(20, 3, 32, 32)).astype(np.float32), np.arange(20, dtype=np.int64) % 10
    )
    cases = [(name, digits.train, digits.input_shape, 128) for name in list_models("cnn")]
    cases.append(("resnet18 (32x32x3)", cifar_like, (3, 32, 32), 512))
    rows = []
    for label, data, shape, feature_dim in cases:
        arch = label.split(" ")[0]
        torch.manual_seed(0)
        plain = get_model(arch, input_shape=shape, num_classes=10)
        weights = wire.payload_bytes(
            RecordDict({wire.ARRAYS: wire.state_to_record(plain.state_dict())})
        )
        native = plain.feature_dim
        projected = ProjectedModel(plain, feature_dim=feature_dim)
        cpu = torch.device("cpu")
        felo = collect_knowledge(projected, data, num_classes=10, with_features=True, device=cpu)
        fedhe = felo.without_features()
        felo_bytes = wire.payload_bytes(RecordDict({KNOWLEDGE: knowledge_to_record(felo)}))
        fedhe_bytes = wire.payload_bytes(RecordDict({KNOWLEDGE: knowledge_to_record(fedhe)}))
        rows.append(
            {
                "model": label,
                "params": count_parameters(get_model(arch, input_shape=shape, num_classes=10)),
                "native_feature_dim": native,
                "feature_dim": feature_dim,
                "classes": felo.num_classes_present,
                "fedavg_weights_bytes": weights,
                "felo_knowledge_bytes": felo_bytes,
                "felo_percent": 100.0 * felo_bytes / weights,
                "fedhe_logits_bytes": fedhe_bytes,
                "fedhe_percent": 100.0 * fedhe_bytes / weights,
            }
        )
    return rows


def print_bytes(rows: list[dict[str, Any]]) -> None:
    """Print the bytes table."""
    print("\n### Per-client upload per round: knowledge alone vs FedAvg weights\n")
    print(
        "| model | params | native -> shared feature dim | FedAvg weights | "
        "Felo knowledge (features + logits) | % of FedAvg | FedHe logits | % of FedAvg |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params']:,} | {r['native_feature_dim']} -> "
            f"{r['feature_dim']} | {r['fedavg_weights_bytes']:,} B | "
            f"{r['felo_knowledge_bytes']:,} B | {r['felo_percent']:.3f}% | "
            f"{r['fedhe_logits_bytes']:,} B | {r['fedhe_percent']:.4f}% |"
        )


# -------------------------------------------------------------------------- accuracy
@dataclass(frozen=True)
class Run:
    """One simulation of the accuracy part."""

    fleet: str
    scheme: str
    seed: int

    @property
    def name(self) -> str:
        """Run name (results folder)."""
        return f"{self.fleet}-{self.scheme}-s{self.seed}"


def run_config(run: Run, rounds: int) -> str:
    """Return the run-config string of one simulation."""
    if run.fleet == "hetero":
        fleet = f"sim-device-profiles='{HETERO_PROFILES}' train-time-budget=0.015"
    else:
        fleet = "sim-device-profiles='gpu-server'"
    return (
        f"strategy='{run.scheme}' num-server-rounds={rounds} seed={run.seed} "
        f"local-epochs=5 {COMMON} {fleet}"
    )


def simulate(run: Run, *, rounds: int, nodes: int, out: Path, home: Path) -> dict[str, Any]:
    """Run one simulation through scripts/simulate.sh and summarise its last round."""
    started = time.monotonic()
    cmd = simulate_command(nodes=nodes, name=run.name, out=out, run_config=run_config(run, rounds))
    env = {**os.environ, "FLWR_HOME_SIM": str(home / run.name)}
    proc = run_in_group(cmd, env=env, timeout=1800)
    seconds = time.monotonic() - started
    metrics = out / run.name / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"simulation {run.name} failed (exit {proc.returncode})")
    rounds_done = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = rounds_done[-1]
    archs = Counter(c["arch"] for c in last["clients"])
    summary = {
        "fleet": run.fleet,
        "scheme": run.scheme,
        "seed": run.seed,
        "rounds": len(rounds_done),
        "personal_accuracy": last["personal_accuracy_mean"],
        "personal_accuracy_by_round": [r["personal_accuracy_mean"] for r in rounds_done],
        "global_accuracy": last["global_accuracy"],
        "bytes_up_per_client": statistics.mean(c["bytes_up"] for c in last["clients"]),
        "archs": dict(sorted(archs.items())),
        "num_ok": last["num_ok"],
        "cvae_seconds": [r.get("cvae_seconds") for r in rounds_done if "cvae_seconds" in r],
        "wall_seconds": seconds,
    }
    print(
        f"  {run.name:28s} acc {summary['personal_accuracy']:.3f} archs {summary['archs']} "
        f"({seconds:.0f} s)",
        flush=True,
    )
    return summary


def print_accuracy(summaries: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Print the heterogeneous and homogeneous tables."""
    for fleet, schemes, title in (
        ("hetero", HETERO_SCHEMES, "Heterogeneous fleet (cnn family, devices choose sizes)"),
        ("homo", HOMO_SCHEMES, "Homogeneous fleet (every client cnn-5; the paper's Table 2)"),
    ):
        rows = [s for s in summaries if s["fleet"] == fleet]
        if not rows:
            continue
        archs: Counter[str] = Counter()
        for s in rows:
            if s["scheme"] == schemes[0]:
                archs.update(s["archs"])
        print(
            f"\n### {title}: digits, Dirichlet(0.5), {args.nodes} clients, {args.rounds} "
            f"rounds, 5 local epochs, seeds {args.seeds}\n"
        )
        print(f"Architectures over the seeds (clients): {dict(sorted(archs.items()))}\n")
        print(
            "| scheme | personal accuracy % (mean ± std over seeds) | global-model accuracy % "
            "| upload per client per round |"
        )
        print("|---|---:|---:|---:|")
        for scheme in schemes:
            mine = [s for s in rows if s["scheme"] == scheme]
            if not mine:
                continue
            glob = [s["global_accuracy"] for s in mine if s["global_accuracy"] is not None]
            up = statistics.mean(s["bytes_up_per_client"] for s in mine)
            print(
                f"| {scheme} | {mean_std([s['personal_accuracy'] for s in mine])} | "
                f"{mean_std(glob)} | {up / 1024:.1f} KiB |"
            )


def main() -> int:
    """Run the benchmark and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2, help="simulations run side by side")
    parser.add_argument("--parts", default="bytes,accuracy")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "felo-benchmark")
    args = parser.parse_args()
    parts = {p for p in args.parts.split(",") if p}
    if not parts <= {"bytes", "accuracy"}:
        parser.error(f"--parts: use bytes and/or accuracy, got {args.parts!r}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if "bytes" in parts:
        report["bytes"] = bytes_rows()
        print_bytes(report["bytes"])
    if "accuracy" in parts:
        runs = [Run("hetero", s, seed) for seed in seeds for s in HETERO_SCHEMES]
        runs += [Run("homo", s, seed) for seed in seeds for s in HOMO_SCHEMES]
        print(f"\nrunning {len(runs)} simulations, {args.jobs} at a time", flush=True)
        with (
            tempfile.TemporaryDirectory(prefix="felo-bench-") as home,
            ThreadPoolExecutor(max_workers=args.jobs) as pool,
        ):
            futures = [
                pool.submit(
                    simulate, r, rounds=args.rounds, nodes=args.nodes, out=out, home=Path(home)
                )
                for r in runs
            ]
            report["runs"] = [f.result() for f in futures]
        print_accuracy(report["runs"], args)
    report["wall_seconds"] = time.monotonic() - started
    (out / "felo.json").write_text(json.dumps(report, indent=2))
    print(f"\nwall time {report['wall_seconds'] / 60:.1f} min; written to {out / 'felo.json'}")
    return 0


if __name__ == "__main__":
    with sigterm_as_ctrl_c():  # `kill` stops the federation it started too
        sys.exit(main())
