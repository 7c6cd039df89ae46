"""CUDA for real: device selection, training and prediction on a GPU against the same machine's CPU.

Needs a machine where torch sees a CUDA device (it stops with exit status 2 where
none is). In one run it does what a user with a GPU would:

1. **Probe.** :func:`client_app.device.probe_device` (with its matmul benchmark) runs
   twice in fresh processes, with the GPU visible and hidden
   (``CUDA_VISIBLE_DEVICES=''``), and for each profile the architecture the handshake
   would choose in every model family for one node's share of digits
   (:func:`client_app.selection.choose_architecture`), under the run-config's
   ``train-time-budget`` (2 s) and under 0.05 s, where the devices' choices differ.
2. **Simulate.** Three real Flower simulations through ``scripts/simulate.sh``, every
   node probing its own device (``sim-device-profiles=''``):

   - ``ensemble`` on the GPU (``--gpus-per-node``), the scheme end to end, tuned by
     the ``gradient`` optimiser (the one that needs no optional package);
   - ``fedavg`` with one fixed architecture (``--arch``) on the GPU, then the same
     federation with the GPU hidden: local training time per round, GPU against CPU.
3. **Predict.** ``python -m strategies.ensemble predict`` labels digits' test split
   with the ensemble run's ``ensemble.npz`` on ``--device cuda`` and on ``cpu``: it
   counts the labels that differ (at most 1 % may, where float reduction order breaks
   a near tie), and the accuracy must be the one the run recorded.

Usage::

    .venv/bin/python -m benchmarks.cuda [--nodes 4] [--rounds 3] [--arch resnet18]
        [--gpus-per-node 0.25] [--out results/bench-cuda]

Prints a Markdown table and writes ``table.md`` and ``cuda.json`` to ``--out``. Time
per round is the mean over rounds 2 onwards (round 1 also holds CUDA's and Ray's
start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import run_in_group, sigterm_as_ctrl_c, simulate_command

ROOT = Path(__file__).resolve().parents[1]
TIGHT_BUDGET = 0.05
"""A second ``train-time-budget`` (seconds) the probe chooses under, where devices differ."""


def probe(families: Sequence[str] | None = None) -> dict[str, Any]:
    """Probe this process's device and choose an architecture per family, as a handshake does.

    Parameters
    ----------
    families : Sequence of str, optional
        Model families (``models.list_families()`` when omitted).

    Returns
    -------
    dict
        ``profile`` (:meth:`DeviceProfile.to_dict`), ``choices`` (family to the chosen
        architecture, whether it fits, the estimated seconds a round, under the
        run-config's ``train-time-budget``), ``choices_tight`` (likewise under
        :data:`TIGHT_BUDGET`), the
        ``workload`` the choice was made for, and ``torch`` (its version and CUDA build).
    """
    import torch

    import models
    from benchmarks.harness import default_run_config
    from client_app.device import probe_device
    from client_app.selection import Budget, Workload, candidate_costs, choose_architecture
    from tessera.data import load_bundle

    config = default_run_config()
    profile = probe_device(benchmark=True)
    train = load_bundle("digits").train
    nodes = 4  # one node's IID share of a 4-node federation
    workload = Workload(
        samples_per_round=len(train) // nodes * int(config["local-epochs"]),
        batch_size=int(config["batch-size"]),
        input_shape=tuple(int(v) for v in train.x.shape[1:]),
        num_classes=int(train.y.max()) + 1,
    )
    budget = Budget(
        max_round_seconds=float(config["train-time-budget"]),
        memory_fraction=float(config["memory-fraction"]),
    )
    tight = Budget(max_round_seconds=TIGHT_BUDGET, memory_fraction=budget.memory_fraction)
    choices: dict[str, Any] = {}
    choices_tight: dict[str, Any] = {}
    for family in families or models.list_families():
        candidates = candidate_costs(
            family,
            workload.input_shape,
            workload.num_classes,
            flat_input=config["flat-input"],
        )
        for chosen, limit in ((choices, budget), (choices_tight, tight)):
            choice = choose_architecture(profile, candidates, workload, limit)
            chosen[family] = {
                "arch": choice.name,
                "fits": choice.fits,
                "estimated_round_seconds": round(choice.estimated_round_seconds, 4),
            }
    return {
        "profile": profile.to_dict(),
        "choices": choices,
        "choices_tight": choices_tight,
        "workload": {
            "samples_per_round": workload.samples_per_round,
            "batch_size": workload.batch_size,
            "input_shape": list(workload.input_shape),
        },
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda},
    }


def probe_in_process(*, hide_gpu: bool) -> dict[str, Any]:
    """Run :func:`probe` in a fresh interpreter, with the GPU hidden or not."""
    env = {**os.environ}
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cuda", "--probe-only"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"probe failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def summarise_run(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Summarise one simulation's round records.

    Parameters
    ----------
    records : Sequence of Mapping
        The lines of ``metrics.jsonl``, in round order.

    Returns
    -------
    dict
        ``rounds``; ``archs`` and ``profiles`` (every architecture and device profile
        seen); ``train_seconds`` (the mean over rounds 2 onwards, or round 1 alone
        when there is no other, of the nodes' mean local training time);
        ``slowest_train_seconds`` and ``round_seconds`` (likewise); ``accuracy`` (the
        last round's ``ensemble_accuracy``, else its ``global_accuracy``).

    Raises
    ------
    ValueError
        If there is no record, or a round has no node that replied.

    Examples
    --------
    >>> rows = [
    ...     {"round": 1, "round_seconds": 9.0, "slowest_train_seconds": 5.0,
    ...      "global_accuracy": 0.5,
    ...      "clients": [{"arch": "a", "profile": "p", "train_seconds": 4.0}]},
    ...     {"round": 2, "round_seconds": 3.0, "slowest_train_seconds": 2.0,
    ...      "global_accuracy": 0.9,
    ...      "clients": [{"arch": "a", "profile": "p", "train_seconds": 1.0},
    ...                  {"arch": "b", "profile": "p", "train_seconds": 2.0}]},
    ... ]
    >>> s = summarise_run(rows)
    >>> s["train_seconds"], s["round_seconds"], s["archs"], s["accuracy"]
    (1.5, 3.0, ['a', 'b'], 0.9)
    """
    if not records:
        raise ValueError("no round record: the simulation ran no round")
    steady = [r for r in records if r["round"] >= 2] or list(records)
    per_round = []
    for r in steady:
        times = [float(c["train_seconds"]) for c in r["clients"]]
        if not times:
            raise ValueError(f"round {r['round']} has no node that replied")
        per_round.append(sum(times) / len(times))
    last = records[-1]
    accuracy = last.get("ensemble_accuracy")
    if accuracy is None:
        accuracy = last.get("global_accuracy")
    return {
        "rounds": len(records),
        "archs": sorted({str(c["arch"]) for r in records for c in r["clients"]}),
        "profiles": sorted({str(c["profile"]) for r in records for c in r["clients"]}),
        "train_seconds": sum(per_round) / len(per_round),
        "slowest_train_seconds": sum(float(r["slowest_train_seconds"]) for r in steady)
        / len(steady),
        "round_seconds": sum(float(r["round_seconds"]) for r in steady) / len(steady),
        "accuracy": None if accuracy is None else float(accuracy),
    }


def simulate(
    name: str, run_config: str, *, nodes: int, gpus: float, hide_gpu: bool, out: Path
) -> dict[str, Any]:
    """Run one federation through ``scripts/simulate.sh``; return its summary."""
    env = {**os.environ}
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = simulate_command(
        nodes=nodes,
        name=name,
        out=out,
        run_config=f"{run_config} sim-device-profiles=''",
        extra=("--gpus-per-node", f"{gpus:g}"),
    )
    started = time.monotonic()
    proc = run_in_group(cmd, env=env, timeout=1800)
    wall = time.monotonic() - started
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"simulation {name} failed (exit {proc.returncode})")
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    summary = summarise_run([json.loads(line) for line in lines])
    summary["wall_seconds"] = round(wall, 1)
    print(f"  {name}: {summary['rounds']} rounds in {wall:.0f} s, {summary['archs']}", flush=True)
    return summary


def predict(artifact: Path, data: Path, device: str) -> dict[str, Any]:
    """Label ``data`` with ``python -m strategies.ensemble predict`` on ``device``."""
    labels = data.with_name(f"labels-{device}.npy")
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strategies.ensemble",
            "predict",
            str(artifact),
            str(data),
            "--device",
            device,
            "--out",
            str(labels),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"predict --device {device} failed: {proc.stderr[-2000:]}")
    accuracy = float(proc.stdout.split("accuracy ")[1].split()[0])
    return {"device": device, "seconds": round(wall, 2), "accuracy": accuracy, "labels": labels}


def table(result: Mapping[str, Any]) -> str:
    """Render the benchmark's result as Markdown."""
    lines = ["| probe | accelerator | name | training MAC/s | budget s | chosen per family |"]
    lines.append("|---|---|---|---:|---:|---|")
    for key in ("gpu", "cpu"):
        p = result["probe"][key]
        prof = p["profile"]
        for field, budget in (("choices", "default"), ("choices_tight", f"{TIGHT_BUDGET:g}")):
            if field not in p:
                continue
            chosen = ", ".join(f"{f}: {c['arch']}" for f, c in p[field].items())
            lines.append(
                f"| {key} visible | {prof['accelerator']} | "
                f"{prof.get('accelerator-name') or '-'} | "
                f"{float(prof['train-macs-per-second']):.3g} | {budget} | {chosen} |"
            )
    lines.append("")
    lines.append(
        "| simulation | device | architectures | train s a round (node mean) | slowest node s "
        "| round s | accuracy | wall s |"
    )
    lines.append("|---|---|---|---:|---:|---:|---:|---:|")
    for name, run in result["runs"].items():
        acc = "-" if run["accuracy"] is None else f"{run['accuracy']:.4f}"
        lines.append(
            f"| {name} | {run['device']} | {', '.join(run['archs'])} | "
            f"{run['train_seconds']:.3f} | {run['slowest_train_seconds']:.3f} | "
            f"{run['round_seconds']:.2f} | {acc} | {run['wall_seconds']:.0f} |"
        )
    ratio = result.get("cpu_over_gpu_train")
    if ratio is not None:
        lines.append("")
        lines.append(f"CPU / GPU local training time a round, same federation: {ratio:.2f}x")
    pred = result.get("predict")
    if pred:
        lines.append("")
        lines.append(
            f"predict: cuda {pred['cuda']['seconds']} s, cpu {pred['cpu']['seconds']} s "
            f"(whole command); labels that differ: {pred['labels_differ']} of "
            f"{pred['samples']}; accuracy "
            f"{pred['cuda']['accuracy']:.4f} (the run recorded {pred['recorded']:.4f})"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arch", default="resnet18", help="fedavg's one architecture")
    parser.add_argument("--gpus-per-node", type=float, default=0.25)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-cuda")
    parser.add_argument("--probe-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_only:
        print(json.dumps(probe()))
        return 0

    import numpy as np
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.cuda: torch sees no CUDA device on this machine", file=sys.stderr)
        return 2
    out = args.out.resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    print(f"benchmarks.cuda: {torch.cuda.get_device_name(0)}, results in {out}", flush=True)
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0)}
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    print("probe (GPU visible, then hidden)", flush=True)
    result["probe"] = {
        "gpu": probe_in_process(hide_gpu=False),
        "cpu": probe_in_process(hide_gpu=True),
    }
    common = f"num-server-rounds={args.rounds} local-epochs=2"
    fedavg = f"strategy='fedavg' fedavg-arch='{args.arch}' partitioner='iid' {common}"
    runs = {
        "ensemble": (
            "strategy='ensemble' ensemble-optimizer='gradient' " + common,
            args.gpus_per_node,
            False,
        ),
        f"fedavg-{args.arch}-gpu": (fedavg, args.gpus_per_node, False),
        f"fedavg-{args.arch}-cpu": (fedavg, 0.0, True),
    }
    result["runs"] = {}
    for name, (run_config, gpus, hide) in runs.items():
        summary = simulate(name, run_config, nodes=args.nodes, gpus=gpus, hide_gpu=hide, out=out)
        summary["device"] = "cpu" if hide else "cuda"
        result["runs"][name] = summary
    gpu_run = result["runs"][f"fedavg-{args.arch}-gpu"]
    cpu_run = result["runs"][f"fedavg-{args.arch}-cpu"]
    result["cpu_over_gpu_train"] = cpu_run["train_seconds"] / gpu_run["train_seconds"]

    from tessera.data import load_bundle

    test = load_bundle("digits").test
    data = out / "digits-test.npz"
    np.savez(data, x=test.x, y=test.y)
    artifact = out / "ensemble" / "ensemble.npz"
    on_cuda, on_cpu = predict(artifact, data, "cuda"), predict(artifact, data, "cpu")
    differ = int(np.sum(np.load(on_cuda.pop("labels")) != np.load(on_cpu.pop("labels"))))
    recorded = result["runs"]["ensemble"]["accuracy"]
    result["predict"] = {
        "cuda": on_cuda,
        "cpu": on_cpu,
        "labels_differ": differ,
        "samples": len(test.y),
        "recorded": recorded,
    }
    (out / "cuda.json").write_text(json.dumps(result, indent=2, default=str))
    text = table(result)
    (out / "table.md").write_text(text + "\n")
    print(text)
    # the printed accuracy has 4 decimals; the labels may differ only where float
    # reduction order breaks a near tie (none is expected in full float32)
    ok = differ <= len(test.y) // 100 and abs(on_cuda["accuracy"] - recorded) <= 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    with sigterm_as_ctrl_c():  # `kill` stops the federation it started too
        sys.exit(main())
