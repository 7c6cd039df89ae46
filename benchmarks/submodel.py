"""Sub-models: FedFA against HeteroFL, FlexiFed and NeFL, clean and under backdoor attack.

FedFA's evaluation (Park et al., section 5) on what this machine runs: digits (8x8),
the global model ``preresnet26_025`` with static batch norm (HeteroFL's sBN, as in
the paper), federations of real ClientApps (the project's own handlers, in-process
on :class:`tessera.local_grid.LocalGrid`, which the strategies treat as Flower's
simulation grid). For each

- **pair** of schemes flexible on the same axis, as in the paper's Table 1 and
  Figure 3: ``fedfa-depth`` (run-config ``fedfa-slices=depth``) beside ``flexifed``
  (``max-common``), ``fedfa-width`` beside ``heterofl``, ``fedfa`` (both axes)
  beside ``nefl``; and ``fedrolex`` (``heterofl`` with ``heterofl-rolling``, FedRolex's
  rolling window) beside them on the width axis;
- **partitioning**: ``iid`` and ``noniid`` (each client holds 2 of the 10 classes,
  20 % as in the paper, logits of absent classes masked in its loss);
- **scenario** (attack intensity lambda, malicious share): the paper's four,
  ``(1, 0 %)`` (clean), ``(1, 1 %)``, ``(1, 20 %)``, ``(20, 20 %)``, through the
  attack harness's ``backdoor`` (FedFA's label shuffling: the attacker sends
  ``w + lambda (w_s - w0)``, ``w_s`` trained on shuffled labels);
- **seed** (data split, initialisation, attacker draw),

one federation runs; its last round gives the full global model's accuracy on the
server test set (``global``), the mean personalised accuracy of the honest clients
on their own test split after local training (``local``, the paper's local test
accuracy), the smallest slice's server accuracy, and the bytes and training MACs per
client-round.

The fleet, as in the paper: half of the honest clients are limited to the scheme's
smallest slice (node-config ``arch``, what a device too small for more would pick);
the others pick the largest slice their emulated device fits
(``sim-device-profiles``); attackers train the full model (the paper: an attacker
picks the largest architecture to amplify its attack). 1 % of 10 clients is nobody:
the ``(1, 1 %)`` scenario runs with 100 clients, 10 sampled per round
(``fraction-train=0.1``), one of them hostile, and is compared with a clean run of
the same 100-client federation (scenario ``clean-100``). The baselines aggregate as
their papers do (plain example-weighted coverage average, ``clip-factor=0``); FedFA
uses its own scalable aggregation.

Printed and written to ``--out`` (default ``results/bench-submodel/``):
``cells.jsonl`` (one line per federation; an interrupted run resumes where it
stopped), ``tables.md`` (accuracy per scenario, FedFA / baseline ratios next to the
paper's, accuracy drop under attack, cost) and ``accuracy.png`` (the paper's
Figure 3 layout: IID global, non-IID local, non-IID global accuracy per scenario).

Usage::

    .venv/bin/python benchmarks/submodel.py [--variants fedfa,nefl,...]
        [--partitioners iid,noniid] [--seeds 0,1,2] [--scenarios clean,l1-1,l1-20,l20-20]
        [--nodes 10] [--rounds 8] [--local-epochs 1] [--out DIR] [--report]

The defaults (210 federations) take about 45 minutes on two shared CPU cores (one
torch thread).
"""

from __future__ import annotations

import argparse
import functools
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    ROOT,
    client_handlers,
    default_run_config,
    mean_std,
    read_rows,
    run_cells,
)

GLOBAL_MODEL = "preresnet26_025"

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fedfa-depth": ("fedfa", {"fedfa-slices": "depth"}),
    "flexifed": ("flexifed", {"flexifed-strategy": "max-common", "clip-factor": 0.0}),
    "fedfa-width": ("fedfa", {"fedfa-slices": "width"}),
    "heterofl": ("heterofl", {"clip-factor": 0.0}),
    "fedfa": ("fedfa", {"fedfa-slices": "both"}),
    "nefl": ("nefl", {"clip-factor": 0.0}),
    "fedrolex": ("heterofl", {"heterofl-rolling": True, "clip-factor": 0.0}),
}
"""Label -> (scheme, run-config overrides)."""

PAIRS: tuple[tuple[str, str, str], ...] = (
    ("depth", "fedfa-depth", "flexifed"),
    ("width", "fedfa-width", "heterofl"),
    ("both", "fedfa", "nefl"),
)
"""(axis, FedFA variant, baseline), the paper's comparisons."""

PARTITIONERS: dict[str, dict[str, Any]] = {
    "iid": {"partitioner": "iid"},
    "noniid": {"partitioner": "pathological", "classes-per-client": 2},
}

SCENARIOS: dict[str, tuple[float, float, int]] = {
    "clean": (1.0, 0.0, 1),
    "clean-100": (1.0, 0.0, 10),
    "l1-1": (1.0, 0.01, 10),
    "l1-20": (1.0, 0.2, 1),
    "l20-20": (20.0, 0.2, 1),
}
"""Name -> (attack-lambda, malicious share, clients multiplier): ``l1-1`` runs with
10 x ``--nodes`` clients, a tenth sampled per round, beside ``clean-100``."""

ATTACKED = ("l1-1", "l1-20", "l20-20")

BASELINE_OF = {"l1-1": "clean-100", "l1-20": "clean", "l20-20": "clean"}
"""The clean run each attacked scenario's accuracy drop is measured against."""

SCENARIO_LABEL = {
    "clean": "λ=1, 0 %",
    "clean-100": "λ=1, 0 % (100 clients)",
    "l1-1": "λ=1, 1 %",
    "l1-20": "λ=1, 20 %",
    "l20-20": "λ=20, 20 %",
}

PAPER_RATIOS = {
    # FedFA / baseline accuracy, clean (Table 1): IID global, non-IID local, non-IID global
    "depth": ("1.00-1.04", "0.98-1.02", "1.00-1.20"),
    "width": ("1.01-1.16", "0.99-1.13", "1.00-1.16"),
    "both": ("1.00-1.02", "0.99-1.06", "0.95-1.06"),
}
"""The paper's FedFA / baseline accuracy ratios without attack (section 5)."""

PAPER_DROPS = {
    # baseline's accuracy drop over FedFA's under attack (Figure 3 text)
    "depth": ("1.22-2.09", "2.21-3.31", "1.21-1.74"),
    "width": ("1.07-1.47", "0.89-2.37", "1.11-1.22"),
    "both": ("-", "-", "-"),
}
"""How many times more accuracy the baseline loses under attack than FedFA (the
paper's figures for depth and width; its text does not give NeFL's)."""

DEFAULTS: dict[str, str] = {
    "variants": ",".join(VARIANTS),
    "partitioners": ",".join(PARTITIONERS),
    "seeds": "0,1,2",
    "scenarios": ",".join(SCENARIOS),
}

COMMON: dict[str, Any] = {
    "dataset": "digits",
    "model-family": "preresnet",
    "submodel-global": GLOBAL_MODEL,
    "norm": "static-batch",
    "sim-device-profiles": "cpu-small,cpu-medium,cpu-large,jetson-orin",
    "checkpoint-every": 0,
    "round-timeout": 60.0,
    "attack": "backdoor",
}


@dataclass(frozen=True)
class Cell:
    """One federation.

    Attributes
    ----------
    variant : str
        A key of :data:`VARIANTS`.
    partitioner : str
        ``iid`` or ``noniid``.
    seed : int
        Run-config ``seed``.
    scenario : str
        A key of :data:`SCENARIOS`.
    """

    variant: str
    partitioner: str
    seed: int
    scenario: str

    @property
    def key(self) -> str:
        """A unique name of the cell (resume key)."""
        return f"{self.variant}/{self.partitioner}/s{self.seed}/{self.scenario}"


def make_cells(
    *,
    variants: Sequence[str],
    partitioners: Sequence[str],
    seeds: Sequence[int],
    scenarios: Sequence[str],
) -> list[Cell]:
    """List the federations, seed-major (a partial run covers every variant)."""
    return [
        Cell(v, p, s, sc) for s in seeds for sc in scenarios for p in partitioners for v in variants
    ]


def slice_axes(variant: str) -> tuple[bool, bool]:
    """Return whether ``variant`` cuts slices in width and in depth."""
    scheme, extra = VARIANTS[variant]
    if scheme == "fedfa":
        slices = extra.get("fedfa-slices", "both")
        return slices in ("both", "width"), slices in ("both", "depth")
    return {"heterofl": (True, False), "flexifed": (False, True)}.get(scheme, (True, True))


@functools.cache
def extreme_slices(variant: str) -> tuple[str, str]:
    """Return the (smallest, full) slice names ``variant`` allows on the global model."""
    from models.slicing import family_layout, full_spec
    from models.spec import ModelRef
    from strategies.submodel.options import DEFAULT_WIDTHS, candidate_specs

    width, depth = slice_axes(variant)
    full = full_spec(GLOBAL_MODEL)
    specs = candidate_specs(
        full, family_layout(GLOBAL_MODEL).min_depth, DEFAULT_WIDTHS, width=width, depth=depth
    )
    return ModelRef(GLOBAL_MODEL, specs[-1]).name, ModelRef(GLOBAL_MODEL, specs[0]).name


def cell_nodes(cell: Cell, nodes: int) -> int:
    """Return the number of clients of the cell's federation."""
    return nodes * SCENARIOS[cell.scenario][2]


def cell_run_config(
    cell: Cell, *, nodes: int, rounds: int, local_epochs: int, output_dir: Path
) -> dict[str, Any]:
    """Build the run config of one cell (pyproject defaults + the cell's choices)."""
    lam, share, mult = SCENARIOS[cell.scenario]
    scheme, extra = VARIANTS[cell.variant]
    count = cell_nodes(cell, nodes)
    config = default_run_config()
    config.update(COMMON)
    config.update(PARTITIONERS[cell.partitioner])
    config.update(extra)
    config.update(
        {
            "strategy": scheme,
            "seed": cell.seed,
            "num-server-rounds": rounds,
            "local-epochs": local_epochs,
            "min-nodes": count,
            "fraction-train": 1.0 / mult,
            "attack": "backdoor" if share > 0 else "",
            "attack-fraction": share,
            "attack-lambda": lam,
            "output-dir": str(output_dir),
            "run-name": "run",
        }
    )
    return config


def node_archs(cell: Cell, nodes: int) -> dict[int, str]:
    """Partition -> forced slice: half the honest clients the smallest, attackers the full.

    The honest clients limited are every other one in partition order, so that both
    halves draw from the whole split.
    """
    from tessera.attacks import attacked_partitions

    count = cell_nodes(cell, nodes)
    hostile = set(attacked_partitions(count, SCENARIOS[cell.scenario][1], cell.seed))
    smallest, full = extreme_slices(cell.variant)
    honest = [p for p in range(count) if p not in hostile]
    forced = {p: smallest for p in honest[::2]}
    forced.update({p: full for p in hostile})
    return forced


@functools.cache
def slice_macs(arch: str, input_shape: tuple[int, ...], num_classes: int) -> int:
    """Forward multiply-accumulates of one example through slice ``arch``."""
    from models import get_model
    from models.cost import count_macs

    model = get_model(arch, input_shape=input_shape, num_classes=num_classes)
    return int(count_macs(model, input_shape))


def run_cell(
    cell: Cell, *, nodes: int, rounds: int, local_epochs: int, bundle: Any
) -> dict[str, Any]:
    """Run one federation in-process and summarise it.

    Returns
    -------
    dict[str, Any]
        The cell's fields and, from the last round: ``global_accuracy`` (full
        model, server test set), ``local_accuracy`` (mean personalised accuracy of
        the honest clients), ``smallest_accuracy`` (the smallest slice on the server
        test set, when a node trained it), and over the run: bytes up and down and
        training MACs per client-round (3 x forward MACs x examples x local epochs),
        the slices trained, the wall seconds.
    """
    from server_app.app import build_server
    from tessera.local_grid import make_grid

    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="bench-submodel-"))
    count = cell_nodes(cell, nodes)
    forced = node_archs(cell, nodes)
    try:
        config = cell_run_config(
            cell, nodes=nodes, rounds=rounds, local_epochs=local_epochs, output_dir=workdir
        )
        server = build_server(config, bundle=bundle).runner
        grid = make_grid(config, count, client_handlers())
        for context in grid.contexts.values():
            arch = forced.get(int(context.node_config["partition-id"]))
            if arch is not None:
                context.node_config["arch"] = arch
        server.start(grid, num_rounds=rounds, timeout=float(config["round-timeout"]))
        records = list(server.rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    smallest, _ = extreme_slices(cell.variant)
    hostile = _attackers(cell, nodes)
    last = records[-1] if records else {}
    honest = [
        c["test_accuracy"]
        for c in last.get("clients", [])
        if c["partition_id"] not in hostile and c["num_test_examples"] > 0
    ]
    client_rounds = [c for r in records for c in r.get("clients", [])]
    shape = tuple(bundle.input_shape)
    macs = [
        3 * slice_macs(c["arch"], shape, bundle.num_classes) * c["num_examples"] * local_epochs
        for c in client_rounds
    ]
    slices: dict[str, int] = {}
    for c in client_rounds:
        slices[c["arch"]] = slices.get(c["arch"], 0) + 1
    return {
        **asdict(cell),
        "key": cell.key,
        "nodes": nodes,
        "clients": count,
        "rounds": rounds,
        "local_epochs": local_epochs,
        "rounds_run": len(records),
        "attackers": sorted(_attackers(cell, nodes)),
        "global_accuracy": last.get("global_accuracy"),
        "local_accuracy": statistics.fmean(honest) if honest else None,
        "smallest_accuracy": last.get("submodel_accuracy", {}).get(smallest),
        "global_accuracy_by_round": [r.get("global_accuracy") for r in records],
        "bytes_up": statistics.fmean(c["bytes_up"] for c in client_rounds),
        "bytes_down": statistics.fmean(c["bytes_down"] for c in client_rounds),
        "train_macs": statistics.fmean(macs) if macs else 0.0,
        "slices": dict(sorted(slices.items())),
        "rejected": sum(len(r.get("rejected", [])) for r in records),
        "failed": sum(len(r.get("failed", [])) for r in records),
        "seconds": time.monotonic() - started,
    }


def _attackers(cell: Cell, nodes: int) -> set[int]:
    from tessera.attacks import attacked_partitions

    share = SCENARIOS[cell.scenario][1]
    return set(attacked_partitions(cell_nodes(cell, nodes), share, cell.seed))


def run_grid(
    cells: Sequence[Cell],
    *,
    nodes: int,
    rounds: int,
    local_epochs: int,
    jsonl: Path,
    bundle: Any = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Run every cell not yet in ``jsonl`` (:func:`benchmarks.harness.run_cells`)."""
    return run_cells(
        cells,
        run=lambda cell, data: run_cell(
            cell, nodes=nodes, rounds=rounds, local_epochs=local_epochs, bundle=data
        ),
        same={"nodes": nodes, "rounds": rounds, "local_epochs": local_epochs},
        jsonl=jsonl,
        bundle=bundle,
        log=log,
        summary=lambda row: (
            f"global {_pct(row['global_accuracy'])} local {_pct(row['local_accuracy'])}"
        ),
    )


# ----------------------------------------------------------------------- tables
def _pct(value: float | None) -> str:
    return "  -  " if value is None else f"{100 * value:5.1f}"


def _values(rows: Sequence[Mapping[str, Any]], field: str, **match: Any) -> list[float]:
    return [
        r[field]
        for r in rows
        if all(r[k] == v for k, v in match.items()) and r.get(field) is not None
    ]


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


METRICS = (
    ("iid", "global_accuracy", "IID global"),
    ("noniid", "local_accuracy", "non-IID local"),
    ("noniid", "global_accuracy", "non-IID global"),
)
"""(partitioner, field, label): the paper's three panels."""


def accuracy_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Accuracy per variant and scenario, mean ± std over seeds, one table per panel."""
    out = []
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    scenarios = [s for s in SCENARIOS if any(r["scenario"] == s for r in rows)]
    for partitioner, field, label in METRICS:
        part = [r for r in rows if r["partitioner"] == partitioner]
        if not part:
            continue
        seeds = sorted({r["seed"] for r in part})
        out.append(f"#### {label} accuracy, % (mean ± std over seeds {seeds})\n")
        out.append("| scheme | " + " | ".join(SCENARIO_LABEL[s] for s in scenarios) + " |")
        out.append("|---|" + "---:|" * len(scenarios))
        for v in variants:
            cells = [mean_std(_values(part, field, variant=v, scenario=s)) for s in scenarios]
            out.append(f"| {v} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "-"
    return f"{a / b:.2f}"


def ratio_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """FedFA / baseline accuracy (clean) and baseline / FedFA accuracy drop (attacked)."""
    out = [
        "#### FedFA against its baseline: clean accuracy ratio (FedFA / baseline) and "
        "accuracy lost under attack (baseline's drop / FedFA's drop), ours beside the paper's\n",
        "| axis | panel | clean ratio, ours | clean ratio, paper | "
        + " | ".join(f"drop ratio {SCENARIO_LABEL[s]}" for s in ATTACKED)
        + " | drop ratio, paper |",
        "|---|---|---:|---:|" + "---:|" * len(ATTACKED) + "---:|",
    ]
    for axis, fedfa, base in PAIRS:
        for i, (partitioner, field, label) in enumerate(METRICS):
            part = [r for r in rows if r["partitioner"] == partitioner]
            f_clean = _mean(_values(part, field, variant=fedfa, scenario="clean"))
            b_clean = _mean(_values(part, field, variant=base, scenario="clean"))
            if f_clean is None and b_clean is None:
                continue
            drops = []
            for s in ATTACKED:
                ref = BASELINE_OF[s]
                f_drop = _drop(part, field, fedfa, ref, s)
                b_drop = _drop(part, field, base, ref, s)
                drops.append(_drop_ratio(b_drop, f_drop))
            out.append(
                f"| {axis} ({fedfa} / {base}) | {label} | {_ratio(f_clean, b_clean)} | "
                f"{PAPER_RATIOS[axis][i]} | " + " | ".join(drops) + f" | {PAPER_DROPS[axis][i]} |"
            )
    out.append(
        "\nDrop = clean accuracy − attacked accuracy (percentage points, mean over seeds; the "
        "`λ=1, 1 %` scenario against the clean 100-client run). A drop ratio above 1 means "
        "the baseline lost more than FedFA; `(b, f)` gives both drops when either is ≤ 0.5 "
        "points (or negative), where a ratio means nothing.\n"
    )
    return "\n".join(out)


def _drop(
    rows: Sequence[Mapping[str, Any]], field: str, variant: str, ref: str, scenario: str
) -> float | None:
    clean = _mean(_values(rows, field, variant=variant, scenario=ref))
    hit = _mean(_values(rows, field, variant=variant, scenario=scenario))
    if clean is None or hit is None:
        return None
    return 100 * (clean - hit)


def _drop_ratio(base: float | None, fedfa: float | None) -> str:
    if base is None or fedfa is None:
        return "-"
    if fedfa <= 0.5 or base <= 0.5:  # one of them lost (almost) nothing: no ratio
        return f"({base:+.1f}, {fedfa:+.1f})"
    return f"{base / fedfa:.2f}"


def cost_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Bytes and training MACs per client-round, clean runs (mean over cells)."""
    clean = [r for r in rows if r["scenario"] == "clean"]
    if not clean:
        return ""
    out = [
        "#### Cost per client-round (clean runs, mean over clients, rounds and seeds)\n",
        "| scheme | slices trained (client-rounds) | KiB down | KiB up | training MMACs |",
        "|---|---|---:|---:|---:|",
    ]
    for v in VARIANTS:
        mine = [r for r in clean if r["variant"] == v]
        if not mine:
            continue
        slices: dict[str, int] = {}
        for r in mine:
            for arch, n in r["slices"].items():
                slices[arch] = slices.get(arch, 0) + n
        names = ", ".join(f"`{a.split('@')[-1]}` {n}" for a, n in sorted(slices.items()))
        out.append(
            f"| {v} | {names} | {statistics.fmean(r['bytes_down'] for r in mine) / 1024:,.0f} | "
            f"{statistics.fmean(r['bytes_up'] for r in mine) / 1024:,.0f} | "
            f"{statistics.fmean(r['train_macs'] for r in mine) / 1e6:,.1f} |"
        )
    out.append(
        "\nTraining MACs = 3 × forward MACs of the slice × examples × local epochs "
        "(backward ≈ 2 × forward).\n"
    )
    return "\n".join(out)


def plot(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Draw grouped bars like the paper's Figure 3: a panel per metric, a bar per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    scenarios = [s for s in SCENARIOS if s != "clean-100" and any(r["scenario"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 3.8), sharey=True)
    width = 0.8 / max(1, len(scenarios))
    for ax, (partitioner, field, label) in zip(np.atleast_1d(axes), METRICS, strict=False):
        part = [r for r in rows if r["partitioner"] == partitioner]
        for j, s in enumerate(scenarios):
            means, stds = [], []
            for v in variants:
                vals = _values(part, field, variant=v, scenario=s)
                means.append(100 * statistics.fmean(vals) if vals else np.nan)
                stds.append(100 * statistics.pstdev(vals) if len(vals) > 1 else 0.0)
            x = np.arange(len(variants)) + (j - (len(scenarios) - 1) / 2) * width
            ax.bar(x, means, width, yerr=stds, capsize=2, label=SCENARIO_LABEL[s])
        ax.set_xticks(np.arange(len(variants)), variants, rotation=30, ha="right")
        ax.set_title(f"{label} accuracy")
        ax.set_ylim(0, 100)
        ax.grid(axis="y", alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("test accuracy (%)")
    np.atleast_1d(axes)[-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Sub-model schemes on digits ({GLOBAL_MODEL}, static BN), backdoor scenarios")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------ main
def _list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    for flag, default in DEFAULTS.items():
        parser.add_argument(f"--{flag}", default=default, help=f"comma list (default {default})")
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--log-level", default="ERROR", help="Flower/Tessera log level")
    parser.add_argument(
        "--report",
        action="store_true",
        help="run nothing: tables and plot from the cells already in --out/cells.jsonl",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-submodel")
    args = parser.parse_args(argv)
    for flag, allowed in (
        ("variants", VARIANTS),
        ("partitioners", PARTITIONERS),
        ("scenarios", SCENARIOS),
    ):
        unknown = set(_list(getattr(args, flag))) - set(allowed)
        if unknown:
            parser.error(f"--{flag}: unknown {sorted(unknown)}; use {', '.join(allowed)}")
    if args.nodes < 2:
        parser.error(f"--nodes is {args.nodes}; use 2 or more")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the tables and write them to ``--out``."""
    args = parse_args(argv)
    import flwr.common.logger  # noqa: F401  (sets the "flwr" level on import: set ours after)

    logging.getLogger("flwr").setLevel(args.log_level)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cells = make_cells(
        variants=_list(args.variants),
        partitioners=_list(args.partitioners),
        seeds=[int(s) for s in _list(args.seeds)],
        scenarios=_list(args.scenarios),
    )
    if args.report:
        same = (args.nodes, args.rounds, args.local_epochs)
        wanted = {c.key for c in cells}
        rows = [
            r
            for r in read_rows(args.out / "cells.jsonl")
            if r["key"] in wanted and (r["nodes"], r["rounds"], r["local_epochs"]) == same
        ]
        print(f"{len(rows)} of {len(cells)} federations found in {args.out / 'cells.jsonl'}")
    else:
        rows = run_grid(
            cells,
            nodes=args.nodes,
            rounds=args.rounds,
            local_epochs=args.local_epochs,
            jsonl=args.out / "cells.jsonl",
            log=lambda line: print(line, flush=True),
        )
    table = "\n".join([accuracy_table(rows), ratio_table(rows), cost_table(rows)])
    print("\n" + table)
    (args.out / "tables.md").write_text(table)
    plot(rows, args.out / "accuracy.png")
    print(f"wall time {(time.monotonic() - started) / 60:.1f} min; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
