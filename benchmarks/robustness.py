"""Robustness: accuracy under attack for each aggregator, and each aggregator's cost.

Two parts, printed as Markdown tables and written to ``--out`` (default
``results/bench-robustness/``):

A. **Accuracy under attack** (``--parts accuracy``). Federations of ``--nodes`` real
   ClientApps (the project's own handlers, run in-process on
   :class:`tessera.local_grid.LocalGrid`, which the strategies treat as Flower's
   simulation grid) on digits, for each scheme, partitioner (``iid``, ``dirichlet``
   with alpha 0.5), seed, attack (each of :data:`tessera.config.ATTACKS` at each
   ``--fractions`` share of malicious nodes, and the clean run) and aggregator:

   - ``fedavg`` (every client trains ``cnn-2``): the final global model's accuracy on
     the server's test set, under ``aggregator`` ``mean`` (the default: the size bound
     and the direction check, with the scheme's own defaults, ``scheme-defaults``),
     ``mean-unbounded`` (``clip-factor=0``, the plain weighted mean), the ablations
     of :data:`ABLATIONS`, and the robust rules of :data:`FEDAVG_AGGREGATORS`;
   - ``felo`` (the knowledge scheme; clients pick their own ``cnn`` size from the
     emulated ``sim-device-profiles``): the final round's mean personalised accuracy
     of the *honest* clients (each on its own test split), since Felo's global models
     are per-architecture groups and what a client uses is its own model; under
     ``knowledge-merge`` ``mean`` (bounded), ``mean-unbounded`` (``clip-factor=0``,
     which also unbounds the group weight average) and ``median``;
   - the rest of every scheme, each with its default ``mean`` (``--schemes``):
     ``fedavg-groups`` (the mean of its groups' global accuracies), the other
     sub-model schemes ``flexifed``, ``nefl`` and ``fedfa`` (as ``heterofl``: their
     default ``preresnet``, static batch norm), and the knowledge schemes ``fedhe``
     and ``fedtgp`` (as ``felo``: the honest clients' personalised accuracy).

   The defences are told the attack's size, as an operator sizing them for a fleet
   would: ``krum-byzantine`` is the number of attackers (1 in the clean run) and
   ``trim-fraction`` the malicious share (0.1 in the clean run). Attack intensities
   are the run-config defaults (``attack-scale=10``, ``attack-lambda=1``,
   ``attack-noise=1``). For ``label-flip`` the attack success (share of server test
   examples of class ``c`` the global model puts in class ``C-1-c``) is reported too.
   Each run appends one JSON line to ``cells.jsonl``; an interrupted run resumes where
   it stopped (cells already there are not run again).

B. **Cost** (``--parts cost``). Each aggregator folds ``--updates`` updates of
   ``--params`` float32 parameters (in four entries) and computes its result, the
   aggregators one after the other in the same process (``--repeats`` times,
   interleaved; the median is reported), as seconds and as a ratio to ``mean``
   (the plain mean, ``clip-factor=0``); then, in a second pass under
   :mod:`tracemalloc`, each one's peak memory during the round (what it keeps, plus
   the one update being handed over).

Usage::

    .venv/bin/python benchmarks/robustness.py [--parts accuracy,cost] [--report-only]
        [--schemes fedavg,felo] [--partitioners dirichlet] [--seeds 0,1,2]
        [--attacks label-flip,backdoor,boost,sign-flip,noise,free-rider]
        [--fractions 0.1,0.3] [--aggregators mean,mean-unbounded,...]
        [--nodes 10] [--rounds 5] [--local-epochs 2]
        [--updates 100] [--params 1000000] [--repeats 3] [--out DIR]

The defaults (390 federations, about 20 minutes on two shared CPU cores, one torch
thread) cover everything but the IID split; add it with ``--partitioners
iid,dirichlet`` (or run ``--partitioners iid`` into the same ``--out``: finished cells
are kept, the tables cover both). Five rounds of two local epochs is the shortest run
in which a clean ``fedavg`` is well past chance (one epoch leaves it near 40 %).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    ROOT,
    client_handlers,
    default_run_config,
    mean_std,
    run_cells,
)

sys.path.insert(0, str(ROOT))

from tessera.config import ATTACKS as ALL_ATTACKS  # the whole suite (16 attacks)

CLEAN = "clean"
ABSENT = "absent"
"""Not an attack: the drawn hostile partitions simply stay away, so the federation is
the honest nodes alone (ByzFL's reference: its attackers come on top of the honest
clients, while here they take honest partitions' places and their data is lost)."""
PARTITIONERS: dict[str, dict[str, Any]] = {
    "iid": {"partitioner": "iid"},
    "dirichlet": {"partitioner": "dirichlet", "dirichlet-alpha": 0.5},
}
SCHEMES: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg", "fedavg-arch": "cnn-2"},
    # the sub-model scheme: slices of one global model (its default family,
    # preresnet), with its papers' static batch norm (as the leaderboard runs it)
    "heterofl": {"strategy": "heterofl", "norm": "static-batch", "model-family": ""},
    "felo": {"strategy": "felo"},
    # the rest of the "each scheme": one model per architecture group, the
    # other sub-model schemes (as heterofl: their default family, static batch norm,
    # as the leaderboard runs them), and two more knowledge schemes (FedHe's logits,
    # FedTGP's trained global prototypes)
    "fedavg-groups": {"strategy": "fedavg-groups"},
    "flexifed": {"strategy": "flexifed", "norm": "static-batch", "model-family": ""},
    "nefl": {"strategy": "nefl", "norm": "static-batch", "model-family": ""},
    "fedfa": {"strategy": "fedfa", "norm": "static-batch", "model-family": ""},
    "fedhe": {"strategy": "fedhe"},
    "fedtgp": {"strategy": "fedtgp"},
}
FEDAVG_AGGREGATORS = (
    "mean",
    "mean-unbounded",
    "mean-bound-only",
    "mean-clip3",
    "norm-clip",
    "median",
    "trimmed-mean",
    "krum",
    "multi-krum",
    "centered-clip",
    "centered-clip+bucketing",
    "trimmed-mean+nnm",
    "centered-clip+nnm",
)
"""Aggregator labels of the weight schemes: ``<aggregator>[+<pre-aggregation>]``, or an
ablation of the default ``mean`` (:data:`ABLATIONS`)."""
FELO_MERGES = ("mean", "mean-unbounded", "median")
ON_DEMAND = (
    "mean-trust-0.1",
    "mean-common",
    "mean-clip2",
    "mean-clip3-trust",
    "mean-stretch",
    "mean-cap1",
    "mean-no-trim",
    "mean-cohort",
)
"""Ablations run only when ``--aggregators`` names them (not in the default grid)."""
SUB_MODEL_AGGREGATORS = ("mean", "mean-unbounded", "mean-bound-only", *ON_DEMAND)
KNOWLEDGE_SCHEMES = frozenset({"felo", "fedhe", "fedtgp"})
"""Schemes judged by the honest clients' own accuracy, whose label is a knowledge merge."""
WEIGHTLESS_SCHEMES = frozenset({"fedhe", "fedtgp"})
"""Knowledge schemes whose nodes send no weights: their run config refuses the
weight-only keys (``clip-factor``, ``server-trust``), so their ``mean-unbounded``
switches off the knowledge clip alone."""
SCHEME_AGGREGATORS = {
    "fedavg": FEDAVG_AGGREGATORS + ON_DEMAND,
    "fedavg-groups": SUB_MODEL_AGGREGATORS,
    "heterofl": SUB_MODEL_AGGREGATORS,
    "flexifed": SUB_MODEL_AGGREGATORS,
    "nefl": SUB_MODEL_AGGREGATORS,
    "fedfa": SUB_MODEL_AGGREGATORS,
    **{scheme: FELO_MERGES for scheme in sorted(KNOWLEDGE_SCHEMES)},
    "felo": (*FELO_MERGES, "mean-clip2"),
}
ABLATIONS: dict[str, dict[str, Any]] = {
    "mean-bound-only": {"server-trust": False},
    "mean-clip3": {"server-trust": False, "clip-factor": 3.0},
    "mean-trust-0.1": {"trust-threshold": -0.1},
    "mean-common": {"scheme-defaults": False},
    "mean-clip2": {"clip-factor": 2.0},
    "mean-clip3-trust": {"clip-factor": 3.0},
    "mean-stretch": {"bound-stretch": 2.0},
    "mean-cap1": {"weight-cap": 1.0},
    "mean-no-trim": {"weight-trim": 0.0},
    "mean-cohort": {"cohort-bound": True},
}
"""The default ``mean`` without parts of it: the size bound alone (no direction check),
the previous default (``clip-factor=3``, no direction check), the direction check
dropping only updates of cosine <= -0.1 (``trust-threshold=-0.1``; the default is 0),
the default without the scheme's own defaults (``scheme-defaults=false``: FlexiFed's
direction check at the common ``trust-threshold=0`` instead of its own -0.1), and the
default with ``clip-factor=2`` (tried for Felo) and ``clip-factor=3`` (the size bound
of the previous default beside the direction check), the default with each node's
bound grown with its examples (``bound-stretch=2``, within [1/2, 2]), and the default
with no node weighing more than the cohort's median size (``weight-cap=1``), and the
default without cutting the largest claimed sizes to the next (``weight-trim=0``, the
default before 2026-11-28), and the default with each architecture group also bounded by
the whole cohort's distances relative to each model's norm (``cohort-bound=true``;
it acts only where a round has two or more groups: ``fedavg-groups``)."""
GLOBAL_METRIC = {scheme: scheme not in KNOWLEDGE_SCHEMES for scheme in SCHEMES}
"""Whether a scheme is judged by its global model (else the honest clients' own)."""
COMMON: dict[str, Any] = {
    "dataset": "digits",
    "model-family": "cnn",
    "sim-device-profiles": "cpu-small,cpu-large,jetson-orin",
    "checkpoint-every": 0,
    "round-timeout": 30.0,
}
DEFAULTS: dict[str, str] = {
    "schemes": "fedavg,heterofl,felo",
    "partitioners": "iid,dirichlet",
    "seeds": "0,1,2",
    "attacks": ",".join(ALL_ATTACKS),
    "fractions": "0.1,0.2,0.3",
    "aggregators": ",".join(dict.fromkeys(FEDAVG_AGGREGATORS + FELO_MERGES)),
}
"""Defaults of the list flags (the run in docs/pages/robustness.md; see ``--help``)."""


# -------------------------------------------------------------------------- part A
@dataclass(frozen=True)
class Cell:
    """One federation of part A.

    Attributes
    ----------
    scheme : str
        ``fedavg`` or ``felo``.
    partitioner : str
        ``iid`` or ``dirichlet``.
    seed : int
        Run-config ``seed`` (data split, model initialisation, attacker draw).
    attack : str
        An attack name, or ``clean``.
    fraction : float
        Share of malicious nodes (0 for ``clean``).
    aggregator : str
        Aggregator label (``fedavg``) or knowledge-merge label (``felo``).
    """

    scheme: str
    partitioner: str
    seed: int
    attack: str
    fraction: float
    aggregator: str

    @property
    def key(self) -> str:
        """A unique name of the cell (resume key)."""
        return (
            f"{self.scheme}/{self.partitioner}/s{self.seed}/{self.attack}/"
            f"{self.fraction:g}/{self.aggregator}"
        )


def make_cells(
    *,
    schemes: Sequence[str],
    partitioners: Sequence[str],
    seeds: Sequence[int],
    attacks: Sequence[str],
    fractions: Sequence[float],
    aggregators: Sequence[str],
) -> list[Cell]:
    """List the federations of part A: every attack and fraction, plus the clean run.

    Aggregator labels a scheme does not have are skipped for that scheme.

    Returns
    -------
    list[Cell]
        Ordered seed-major, so that a partial run covers every scheme and attack.
    """
    out = []
    for seed in seeds:
        for scheme in schemes:
            own = [a for a in aggregators if a in SCHEME_AGGREGATORS[scheme]]
            for partitioner in partitioners:
                for aggregator in own:
                    out.append(Cell(scheme, partitioner, seed, CLEAN, 0.0, aggregator))
                    for fraction in fractions:
                        out.append(Cell(scheme, partitioner, seed, ABSENT, fraction, aggregator))
                    for attack in attacks:
                        for fraction in fractions:
                            out.append(
                                Cell(scheme, partitioner, seed, attack, fraction, aggregator)
                            )
    return out


def cell_run_config(
    cell: Cell, *, nodes: int, rounds: int, local_epochs: int, output_dir: Path
) -> dict[str, Any]:
    """Build the run config of one cell (defaults + the cell's choices).

    Parameters
    ----------
    cell : Cell
        The federation.
    nodes : int
        Number of nodes (partitions).
    rounds : int
        Server rounds.
    local_epochs : int
        Local epochs per round.
    output_dir : Path
        Where the server writes its results folder.

    Returns
    -------
    dict[str, Any]
        Flower's raw run config.
    """
    from tessera.attacks import attacked_partitions

    config = default_run_config()
    config.update(COMMON)
    config.update(SCHEMES[cell.scheme])
    config.update(PARTITIONERS[cell.partitioner])
    attackers = attacked_partitions(nodes, cell.fraction, cell.seed)
    config.update(
        {
            "seed": cell.seed,
            "num-server-rounds": rounds,
            "local-epochs": local_epochs,
            "min-nodes": nodes - len(attackers) if cell.attack == ABSENT else nodes,
            "attack": "" if cell.attack in (CLEAN, ABSENT) else cell.attack,
            "attack-fraction": cell.fraction if cell.attack not in (CLEAN, ABSENT) else 0.0,
            "krum-byzantine": max(1, len(attackers)),
            "trim-fraction": cell.fraction if cell.fraction > 0 else 0.1,
            "output-dir": str(output_dir),
            "run-name": "run",
        }
    )
    name = cell.aggregator
    unbounded = name == "mean-unbounded"
    rule = "mean" if unbounded else name
    if unbounded:  # the plain mean: no bound, no direction check, no knowledge clip
        if cell.scheme not in WEIGHTLESS_SCHEMES:
            config["clip-factor"] = 0.0
            config["server-trust"] = False
        config["knowledge-clip-factor"] = 0.0
        config["weight-trim"] = 0.0  # weight-cap's median bound stays, as before the cut
        # the declared weight-cap (2), not fedavg-groups' own 1: the plain weighted mean
        config["scheme-defaults"] = False
    elif name in ABLATIONS:
        rule = "mean"
        config.update(ABLATIONS[name])
    elif "+" in name:  # a buffered rule after a pre-aggregation
        rule, config["pre-aggregation"] = name.split("+", 1)
    if cell.scheme in KNOWLEDGE_SCHEMES:
        config["knowledge-merge"] = rule
    else:
        config["aggregator"] = rule
    return config


def run_cell(
    cell: Cell, *, nodes: int, rounds: int, local_epochs: int, bundle: Any
) -> dict[str, Any]:
    """Run one federation in-process and summarise its last round.

    Parameters
    ----------
    cell : Cell
        The federation.
    nodes : int
        Number of nodes.
    rounds : int
        Server rounds.
    local_epochs : int
        Local epochs per round.
    bundle : DataBundle
        The digits dataset (loaded once by the caller).

    Returns
    -------
    dict[str, Any]
        The cell's fields and, from the last round: ``global_accuracy``,
        ``honest_accuracy`` (mean personalised accuracy of the honest clients),
        ``attack_success`` (label-flip), and over the run: clipped, rejected and
        failed counts, skipped rounds, the attackers' partitions, the wall seconds,
        and per round the knowledge rows a fold kept to the round's end and received
        (``knowledge_kept_by_round``, ``knowledge_rows_by_round``);
        ``stopped`` is the reason when the run stopped early (``max-failed-rounds``
        rounds in a row skipped, e.g. every honest client failing), else ``None``.
    """
    from client_app.attacks.omniscient import install_omniscient
    from server_app.app import build_server
    from strategies.core.strategy import RunStoppedError
    from tessera.attacks import attacked_partitions
    from tessera.local_grid import make_grid

    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="bench-robustness-"))
    stopped = None
    try:
        config = cell_run_config(
            cell, nodes=nodes, rounds=rounds, local_epochs=local_epochs, output_dir=workdir
        )
        server = build_server(config, bundle=bundle).runner
        grid = make_grid(config, nodes, client_handlers())
        install_omniscient(grid, config)  # alie, ipm, min-max, min-sum, mimic, bound-riding
        if cell.attack == ABSENT:  # the hostile partitions never connect
            for partition in attacked_partitions(nodes, cell.fraction, cell.seed):
                grid.contexts.pop(100 + partition, None)
        try:
            server.start(grid, num_rounds=rounds, timeout=float(config["round-timeout"]))
        except RunStoppedError as err:  # the attack broke the federation: a result
            stopped = str(err)
        records = list(server.rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    hostile = set(attacked_partitions(nodes, cell.fraction, cell.seed))
    last = records[-1] if records else {}
    honest = [
        c["test_accuracy"]
        for c in last.get("clients", [])
        if c["partition_id"] not in hostile and c["num_test_examples"] > 0
    ]
    return {
        **asdict(cell),
        "key": cell.key,
        "nodes": nodes,
        "rounds": rounds,
        "rounds_run": len(records),
        "stopped": stopped,
        "local_epochs": local_epochs,
        "attackers": sorted(hostile),
        "global_accuracy": last.get("global_accuracy"),
        "honest_accuracy": statistics.fmean(honest) if honest else None,
        "personal_accuracy": last.get("personal_accuracy_mean"),
        "attack_success": last.get("attack_success"),
        "global_accuracy_by_round": [r.get("global_accuracy") for r in records],
        "clipped": sum(len(r.get("clipped", [])) for r in records),
        "knowledge_clipped": sum(len(r.get("knowledge_clipped", [])) for r in records),
        # rows a knowledge fold kept to each round's end, of the rows it received
        # (Felo, FedHe, FedProto under the mean merge; None where nothing is folded)
        "knowledge_kept_by_round": [r.get("knowledge_kept") for r in records],
        "knowledge_rows_by_round": [r.get("knowledge_rows") for r in records],
        "rejected": sum(len(r.get("rejected", [])) for r in records),
        "failed": sum(len(r.get("failed", [])) for r in records),
        "skipped_rounds": sum(1 for r in records if r.get("skipped")),
        "seconds": time.monotonic() - started,
    }


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
    """Run every cell not yet in ``jsonl`` (:func:`benchmarks.harness.run_cells`).

    Parameters
    ----------
    cells : Sequence[Cell]
        The federations.
    nodes, rounds, local_epochs : int
        Federation size and length, local epochs per round.
    jsonl : Path
        Results file (created if absent; rows of other cells are kept).
    bundle : DataBundle, optional
        The digits dataset; loaded when omitted.
    log : Callable[[str], None], optional
        Progress printer.

    Returns
    -------
    list[dict[str, Any]]
        The rows of ``cells`` (those found in ``jsonl`` and those run now), in order.
    """

    def summary(row: dict[str, Any]) -> str:
        return f"acc {_pct(row[_metric(row['scheme'])]):>5s}"

    return run_cells(
        cells,
        run=lambda cell, data: run_cell(
            cell, nodes=nodes, rounds=rounds, local_epochs=local_epochs, bundle=data
        ),
        same={"nodes": nodes, "rounds": rounds, "local_epochs": local_epochs},
        jsonl=jsonl,
        bundle=bundle,
        log=log,
        summary=summary,
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _metric(scheme: str) -> str:
    return "global_accuracy" if GLOBAL_METRIC[scheme] else "honest_accuracy"


def worst_case_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """ByzFL's summary: per scheme, partitioner, aggregator and share, the worst attack.

    For each group, the clean figure is the mean over seeds of the clean runs; each
    attack's figure is the mean over seeds of its runs at that share; the worst case
    is the smallest of those, with the attack that achieved it and its ratio to the
    clean figure. A run that stopped early counts with the accuracy it was left at
    (``fedavg``) or is left out (no honest accuracy).
    """
    out: list[dict[str, Any]] = []

    def group(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return (r["scheme"], r["nodes"], r.get("rounds", 0), r["partitioner"], r["aggregator"])

    for key in sorted({group(r) for r in rows}):
        scheme = key[0]
        metric = _metric(scheme)
        mine = [r for r in rows if group(r) == key]
        clean = [r[metric] for r in mine if r["attack"] == CLEAN and r[metric] is not None]
        if not clean:
            continue
        clean_mean = statistics.fmean(clean)
        for fraction in sorted({r["fraction"] for r in mine if r["attack"] != CLEAN}):
            alone = [
                r[metric]
                for r in mine
                if r["attack"] == ABSENT and r["fraction"] == fraction and r[metric] is not None
            ]
            honest_only = statistics.fmean(alone) if alone else None
            per_attack: dict[str, float] = {}
            for attack in sorted({r["attack"] for r in mine} - {CLEAN, ABSENT}):
                got = [
                    r[metric]
                    for r in mine
                    if r["attack"] == attack and r["fraction"] == fraction and r[metric] is not None
                ]
                if got:
                    per_attack[attack] = statistics.fmean(got)
            if not per_attack:
                continue
            worst = min(per_attack, key=lambda a: per_attack[a])
            out.append(
                {
                    "scheme": scheme,
                    "partitioner": key[3],
                    "aggregator": key[4],
                    "fraction": fraction,
                    "nodes": mine[0]["nodes"],
                    "rounds": mine[0].get("rounds"),
                    "seeds": sorted({r["seed"] for r in mine}),
                    "clean": clean_mean,
                    "worst": per_attack[worst],
                    "worst_attack": worst,
                    "ratio": per_attack[worst] / clean_mean if clean_mean > 0 else float("nan"),
                    "honest_only": honest_only,
                    "ratio_honest": (
                        per_attack[worst] / honest_only if honest_only else float("nan")
                    ),
                    "attacks": len(per_attack),
                }
            )
    return out


def worst_case_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of :func:`worst_case_rows`."""
    summary = worst_case_rows(rows)
    if not summary:
        return ""
    out = [
        "#### Worst case over the attack suite (ByzFL's figure): mean over seeds, %\n",
        "| scheme | split | aggregator | attackers | rounds | clean | honest only | worst case | "
        "worst attack | worst / clean | worst / honest only | attacks |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in summary:
        split = "IID" if r["partitioner"] == "iid" else "Dirichlet(0.5)"
        share = f"{round(r['fraction'] * r['nodes'])} of {r['nodes']}"
        out.append(
            f"| `{r['scheme']}` | {split} | {r['aggregator']} | {share} | {r['rounds']} | "
            f"{_pct(r['clean'])} | {_pct(r['honest_only'])} | {_pct(r['worst'])} | "
            f"{r['worst_attack']} | {r['ratio']:.2f} | "
            f"{'-' if r['honest_only'] is None else format(r['ratio_honest'], '.2f')} | "
            f"{r['attacks']} |"
        )
    out.append("")
    return "\n".join(out)


def clean_cost_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Return the default defence's price on a clean federation (`mean` against `mean-unbounded`).

    Per scheme, federation size and split, the clean runs of the default (``mean``)
    and of the plain unbounded mean (``mean-unbounded``), on the seeds both ran:
    their means and the cost in points (unbounded minus default; negative when the
    default did better), with the standard deviation of the per-seed differences.

    A scheme judged on its global model (``fedavg``, the sub-model schemes) also
    gets the cost on its clients' personalised accuracy (``personal_*``; ``None``
    where a run lacks it): the narrow slices the weak devices keep are not in the
    full model's figure (HeteroFL's sat at chance under a defect of the bound while
    its full model lost under a point, ``docs/pages/robustness.md``).
    """
    out: list[dict[str, Any]] = []

    def mean_cost(
        default: Mapping[int, float], plain: Mapping[int, float], seeds: Sequence[int]
    ) -> tuple[float, float, float, float]:
        d = [default[s] for s in seeds]
        p = [plain[s] for s in seeds]
        differences = [100 * (b - a) for b, a in zip(p, d, strict=True)]
        spread = statistics.stdev(differences) if len(differences) > 1 else 0.0
        return statistics.fmean(d), statistics.fmean(p), statistics.fmean(differences), spread

    def group(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return (r["scheme"], r["nodes"], r.get("rounds", 0), r["partitioner"])

    clean = [r for r in rows if r["attack"] == CLEAN]
    for key in sorted({group(r) for r in clean}):
        metric = _metric(key[0])
        per_seed: dict[str, dict[int, float]] = {"mean": {}, "mean-unbounded": {}}
        personal: dict[str, dict[int, float]] = {"mean": {}, "mean-unbounded": {}}
        for r in clean:
            if group(r) != key or r["aggregator"] not in per_seed:
                continue
            if r.get(metric) is not None:
                per_seed[r["aggregator"]][r["seed"]] = r[metric]
            if r.get("honest_accuracy") is not None:
                personal[r["aggregator"]][r["seed"]] = r["honest_accuracy"]
        seeds = sorted(set(per_seed["mean"]) & set(per_seed["mean-unbounded"]))
        if not seeds:
            continue
        default, plain, cost, cost_std = mean_cost(
            per_seed["mean"], per_seed["mean-unbounded"], seeds
        )
        summary: dict[str, Any] = {
            "scheme": key[0],
            "nodes": key[1],
            "rounds": key[2],
            "partitioner": key[3],
            "seeds": seeds,
            "default": default,
            "unbounded": plain,
            "cost": cost,
            "cost_std": cost_std,
            "personal_default": None,
            "personal_unbounded": None,
            "personal_cost": None,
        }
        if metric != "honest_accuracy" and all(
            s in personal["mean"] and s in personal["mean-unbounded"] for s in seeds
        ):
            p_default, p_plain, p_cost, _ = mean_cost(
                personal["mean"], personal["mean-unbounded"], seeds
            )
            summary |= {
                "personal_default": p_default,
                "personal_unbounded": p_plain,
                "personal_cost": p_cost,
            }
        out.append(summary)
    return out


def clean_cost_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of :func:`clean_cost_rows` (empty without both aggregators' clean runs)."""
    summary = clean_cost_rows(rows)
    if not summary:
        return ""
    out = [
        "#### What the default costs a clean federation: `mean` against `mean-unbounded`, %\n",
        "| scheme | split | nodes | rounds | seeds | default | unbounded | cost (points) | "
        "std of the per-seed cost | personalised: default / unbounded (cost) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary:
        personal = "same as the figure"
        if r["personal_cost"] is not None:
            personal = (
                f"{_pct(r['personal_default'])} / {_pct(r['personal_unbounded'])} "
                f"({r['personal_cost']:+.1f})"
            )
        split = "IID" if r["partitioner"] == "iid" else "Dirichlet(0.5)"
        out.append(
            f"| `{r['scheme']}` | {split} | {r['nodes']} | {r['rounds']} | {len(r['seeds'])} | "
            f"{_pct(r['default'])} | {_pct(r['unbounded'])} | {r['cost']:+.1f} | "
            f"{r['cost_std']:.1f} | {personal} |"
        )
    out.append("")
    return "\n".join(out)


def accuracy_tables(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown tables of part A: one per scheme and partitioner.

    Rows are the clean run and each attack at each fraction (and, for label-flip,
    the attack success); columns are the aggregators; cells are mean ± std over the
    seeds, in percent.
    """
    out = []
    for scheme in SCHEMES:
        mine = [r for r in rows if r["scheme"] == scheme]
        if not mine:
            continue
        metric = _metric(scheme)
        what = (
            "final global-model accuracy on the server test set"
            if GLOBAL_METRIC[scheme]
            else "final mean personalised accuracy of the honest clients"
        )
        aggs = [a for a in SCHEME_AGGREGATORS[scheme] if any(r["aggregator"] == a for r in mine)]
        for partitioner in PARTITIONERS:
            part = [r for r in mine if r["partitioner"] == partitioner]
            if not part:
                continue
            seeds = sorted({r["seed"] for r in part})
            nodes, rounds, epochs = part[0]["nodes"], part[0]["rounds"], part[0]["local_epochs"]
            split = "IID" if partitioner == "iid" else "Dirichlet(0.5)"
            head = "knowledge-merge" if scheme in KNOWLEDGE_SCHEMES else "aggregator"
            out.append(
                f"#### `{scheme}`, {split}: {what}, % (mean ± std over seeds {seeds}; "
                f"{nodes} nodes, {rounds} rounds of {epochs} local epochs)\n"
            )
            out.append(f"| attack \\ {head} | " + " | ".join(aggs) + " |")
            out.append("|---|" + "---:|" * len(aggs))
            lines: list[tuple[str, str, float, str]] = [("clean", CLEAN, 0.0, metric)]
            attacks = [a for a in ALL_ATTACKS if any(r["attack"] == a for r in part)]
            fractions = sorted({r["fraction"] for r in part if r["attack"] != CLEAN})
            for attack in attacks:
                for fraction in fractions:
                    label = f"{attack} {100 * fraction:.0f} %"
                    lines.append((label, attack, fraction, metric))
                    if attack == "label-flip" and scheme == "fedavg":
                        lines.append((f"{label}: attack success", attack, fraction, "success"))
            any_stopped = False
            for label, attack, fraction, key in lines:
                cells = []
                for agg in aggs:
                    got = [
                        r
                        for r in part
                        if r["attack"] == attack
                        and r["fraction"] == fraction
                        and r["aggregator"] == agg
                    ]
                    field = "attack_success" if key == "success" else key
                    text = mean_std([r[field] for r in got]) if got else ""
                    halted = sum(1 for r in got if r.get("stopped"))
                    if halted:
                        text = ("stopped" if text == "-" else text) + f" †{halted}"
                        any_stopped = True
                    cells.append(text)
                if any(cells):
                    out.append(f"| {label} | " + " | ".join(cells) + " |")
            if any_stopped:
                out.append(
                    "\n†k: in k seeds the run stopped early (max-failed-rounds rounds in a row "
                    "skipped: no client's training survived); "
                    + (
                        "the figure is the global model as it was left."
                        if scheme == "fedavg"
                        else "those seeds have no honest accuracy and are left out."
                    )
                )
            out.append("")
    return "\n".join(out)


# -------------------------------------------------------------------------- part B
COST_AGGREGATORS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "mean": ("mean", {"clip_factor": 0.0}, False),
    "mean (default: bounded, direction check, streaming)": (
        "mean",
        {"clip_factor": 1.0, "ceiling": 4.0},
        True,
    ),
    "mean (default, first round)": ("mean", {"clip_factor": 1.0, "ceiling": 4.0}, False),
    "norm-clip": ("norm-clip", {}, False),
    "median": ("median", {}, False),
    "trimmed-mean": ("trimmed-mean", {"trim_fraction": 0.1}, False),
    "krum": ("krum", {"krum_byzantine": -1}, False),
    "multi-krum": ("multi-krum", {"krum_byzantine": -1}, False),
    "centered-clip": ("centered-clip", {}, False),
    "centered-clip+bucketing": ("centered-clip", {"pre_aggregation": "bucketing"}, False),
    "trimmed-mean+nnm": (
        "trimmed-mean",
        {"trim_fraction": 0.1, "krum_byzantine": -1, "pre_aggregation": "nnm"},
        False,
    ),
}
"""Label -> (aggregator, settings, whether a previous round's median is known).

(Multi-)Krum's ``f`` (``-1`` here) is a tenth of the updates, like the trimmed share.

``mean`` with ``clip-factor`` clips as updates arrive once it knows the previous
round's median distance, and keeps the round's updates in its first round.
"""


def _reference(params: int, entries: int, seed: int = 0) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = [params // entries] * entries
    sizes[-1] += params - sum(sizes)
    return {f"w{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}


def _one_cost(
    label: str,
    reference: Mapping[str, Any],
    pool: Sequence[Mapping[str, Any]],
    updates: int,
    *,
    measure_memory: bool,
) -> tuple[float, int]:
    """Fold ``updates`` updates into one accumulator; return seconds and peak bytes.

    Each update is a fresh copy (as a decoded reply is), made outside the timing;
    the peak memory is what the accumulator allocates and keeps, plus the one update
    being handed over (4 bytes per parameter). The streaming bounded ``mean`` takes
    its bound from an earlier round of the same kind of updates (measured beforehand,
    outside the timing).
    """
    import numpy as np

    from strategies.core.aggregators import AggregatorSettings, get_aggregator

    name, settings, streaming = COST_AGGREGATORS[label]
    if "krum_byzantine" in settings:
        settings = {**settings, "krum_byzantine": max(1, min(updates // 10, (updates - 3) // 2))}
    aggregator = get_aggregator(name, AggregatorSettings(**settings))
    previous = None
    if streaming:  # the report of an earlier round of the same model: its median
        warm = aggregator.accumulator(reference)
        for update in pool[:3]:
            warm.add(update, 1.0)
        warm.result()
        previous = warm.report()
        del warm
    gc.collect()
    if measure_memory:
        tracemalloc.start()
    seconds = 0.0
    # the default mean compares every update with the server's own update: the
    # pool's mean difference from the reference stands in for it (kept by all)
    direction = {k: np.mean([u[k] for u in pool], axis=0) - v for k, v in reference.items()}
    accumulator = aggregator.accumulator(reference, previous=previous, direction=direction)
    for i in range(updates):
        update = {k: np.array(v, copy=True) for k, v in pool[i % len(pool)].items()}
        started = time.perf_counter()
        accumulator.add(update, 1.0 + i % 3)
        seconds += time.perf_counter() - started
        del update
    started = time.perf_counter()
    result = accumulator.result()
    seconds += time.perf_counter() - started
    peak = 0
    if measure_memory:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    del accumulator, result
    return seconds, peak


def cost_rows(
    *,
    updates: int = 100,
    params: int = 1_000_000,
    entries: int = 4,
    repeats: int = 3,
    labels: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Measure each aggregator's cost per round, side by side in this process.

    Parameters
    ----------
    updates : int, optional
        Updates per round.
    params : int, optional
        Float32 parameters per update.
    entries : int, optional
        Arrays the parameters are split into.
    repeats : int, optional
        Timing passes (aggregators interleaved within each); the median is kept.
    labels : Sequence[str], optional
        Rows of :data:`COST_AGGREGATORS` to measure (all by default; ``mean`` is
        always measured, as the reference).
    log : Callable[[str], None], optional
        Progress printer.

    Returns
    -------
    list[dict[str, Any]]
        Per aggregator: ``seconds`` (median over repeats), ``ratio`` to ``mean``,
        ``peak_mib`` (tracemalloc peak during the round) and ``seconds_all``.
    """
    import numpy as np

    chosen = list(dict.fromkeys(["mean", *(labels or COST_AGGREGATORS)]))
    reference = _reference(params, entries)
    rng = np.random.default_rng(1)
    pool = [
        {
            k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in reference.items()
        }
        for _ in range(8)
    ]
    times: dict[str, list[float]] = {label: [] for label in chosen}
    for rep in range(repeats):
        for label in chosen:
            seconds, _ = _one_cost(label, reference, pool, updates, measure_memory=False)
            times[label].append(seconds)
        log(
            f"  part B pass {rep + 1}/{repeats}: "
            + ", ".join(f"{lb} {times[lb][-1]:.2f} s" for lb in chosen)
        )
    peaks = {}
    for label in chosen:
        _, peaks[label] = _one_cost(label, reference, pool, updates, measure_memory=True)
    base = statistics.median(times["mean"])
    return [
        {
            "aggregator": label,
            "updates": updates,
            "params": params,
            "seconds": statistics.median(times[label]),
            "seconds_all": times[label],
            "ratio": statistics.median(times[label]) / base if base > 0 else float("nan"),
            "peak_mib": peaks[label] / 2**20,
        }
        for label in chosen
    ]


def cost_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of part B."""
    if not rows:
        return ""
    first = rows[0]
    out = [
        f"#### Cost per round: {first['updates']} updates of {first['params']:,} float32 "
        f"parameters, one process, median of {len(first['seconds_all'])} interleaved passes\n",
        "| aggregator | seconds per round | × `mean` | peak memory (tracemalloc) |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['aggregator']} | {r['seconds']:.3f} | {r['ratio']:.1f} | "
            f"{r['peak_mib']:,.0f} MiB |"
        )
    out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------ main
def _list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--parts", default="accuracy,cost", help="accuracy and/or cost")
    for flag, default in DEFAULTS.items():
        parser.add_argument(f"--{flag}", default=default, help=f"comma list (default {default})")
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--updates", type=int, default=100, help="part B: updates per round")
    parser.add_argument("--params", type=int, default=1_000_000, help="part B: parameters")
    parser.add_argument("--repeats", type=int, default=3, help="part B: timing passes")
    parser.add_argument(
        "--log-level", default="ERROR", help="Flower/Tessera log level (default ERROR)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-robustness")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rebuild the tables from every cell already in --out/cells.jsonl",
    )
    args = parser.parse_args(argv)
    bad = set(_list(args.parts)) - {"accuracy", "cost"}
    if bad:
        parser.error(f"--parts: use accuracy and/or cost, got {sorted(bad)}")
    for flag, allowed in (
        ("schemes", SCHEMES),
        ("partitioners", PARTITIONERS),
        ("attacks", ALL_ATTACKS),
        ("aggregators", FEDAVG_AGGREGATORS + FELO_MERGES + ON_DEMAND),
    ):
        unknown = set(_list(getattr(args, flag))) - set(allowed)
        if unknown:
            parser.error(f"--{flag}: unknown {sorted(unknown)}; use {', '.join(allowed)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the tables and write them to ``--out``."""
    args = parse_args(argv)
    import flwr.common.logger  # noqa: F401  (sets the "flwr" level on import: set ours after)

    logging.getLogger("flwr").setLevel(args.log_level)
    parts = set(_list(args.parts))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    text = []
    if "accuracy" in parts:
        cells = make_cells(
            schemes=_list(args.schemes),
            partitioners=_list(args.partitioners),
            seeds=[int(s) for s in _list(args.seeds)],
            attacks=_list(args.attacks),
            fractions=[float(f) for f in _list(args.fractions)],
            aggregators=_list(args.aggregators),
        )
        if args.report_only:
            from benchmarks.harness import read_rows

            rows = list({r["key"]: r for r in read_rows(args.out / "cells.jsonl")}.values())
        else:
            rows = run_grid(
                cells,
                nodes=args.nodes,
                rounds=args.rounds,
                local_epochs=args.local_epochs,
                jsonl=args.out / "cells.jsonl",
                log=lambda line: print(line, flush=True),
            )
        (args.out / "worst.json").write_text(json.dumps(worst_case_rows(rows), indent=2))
        text.append(worst_case_table(rows))
        text.append(clean_cost_table(rows))
        text.append(accuracy_tables(rows))
    if "cost" in parts and args.report_only:  # a report runs nothing: the last costs, if any
        saved = args.out / "cost.json"
        if saved.exists():
            text.append(cost_table(json.loads(saved.read_text())))
    elif "cost" in parts:
        print("part B: aggregator cost", flush=True)
        costs = cost_rows(
            updates=args.updates,
            params=args.params,
            repeats=args.repeats,
            log=lambda line: print(line, flush=True),
        )
        (args.out / "cost.json").write_text(json.dumps(costs, indent=2))
        text.append(cost_table(costs))
    table = "\n".join(text)
    print("\n" + table)
    (args.out / "tables.md").write_text(table)
    print(f"wall time {(time.monotonic() - started) / 60:.1f} min; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
