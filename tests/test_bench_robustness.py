"""``benchmarks/robustness.py`` on tiny sizes: the rows and tables it produces.

No timing is asserted; the accuracy part runs real (tiny) federations on the local
grid, the cost part real aggregators on small updates.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tessera.local_grid import LocalGrid, make_grid
from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, imported as a module."""
    return load_benchmark("robustness")


def test_cells_cover_the_clean_run_and_every_attack_per_scheme(bench: ModuleType) -> None:
    # Execute
    cells = bench.make_cells(
        schemes=["fedavg", "felo"],
        partitioners=["iid"],
        seeds=[0, 1],
        attacks=["boost", "noise"],
        fractions=[0.1, 0.3],
        aggregators=["mean", "krum"],
    )

    # Assert: felo has no krum; each (scheme, seed, aggregator) has 1 clean, 2 with the
    # attackers absent (one per fraction) and 2 x 2 attacked
    assert len(cells) == 2 * (2 + 1) * (1 + 2 + 2 * 2)
    assert len({c.key for c in cells}) == len(cells)
    assert {c.aggregator for c in cells if c.scheme == "felo"} == {"mean"}
    assert sum(c.attack == "clean" for c in cells) == 2 * 3


def test_run_configs_size_the_defences_to_the_attack(bench: ModuleType, tmp_path: Path) -> None:
    # Prepare
    attacked = bench.Cell("fedavg", "dirichlet", 0, "boost", 0.3, "multi-krum")
    clean = bench.Cell("felo", "iid", 0, "clean", 0.0, "mean-unbounded")

    # Execute
    a = bench.cell_run_config(attacked, nodes=10, rounds=2, local_epochs=1, output_dir=tmp_path)
    c = bench.cell_run_config(clean, nodes=10, rounds=2, local_epochs=1, output_dir=tmp_path)

    # Assert
    assert (a["aggregator"], a["krum-byzantine"], a["trim-fraction"]) == ("multi-krum", 3, 0.3)
    assert (a["attack"], a["partitioner"], a["dirichlet-alpha"]) == ("boost", "dirichlet", 0.5)
    assert (c["knowledge-merge"], c["clip-factor"], c["attack"]) == ("mean", 0.0, "")
    assert c["aggregator"] == "mean"
    # the plain mean keeps weight-cap's median bound but not the default's cut
    assert (c["weight-cap"], c["weight-trim"], a["weight-trim"]) == (2.0, 0.0, 0.2)


def test_the_plain_mean_keeps_the_declared_weight_cap_where_a_scheme_owns_another(
    bench: ModuleType, tmp_path: Path
) -> None:
    # Prepare: fedavg-groups owns weight-cap=1; its default and its plain mean
    from strategies.core.registry import resolve_run

    cells = {
        name: bench.Cell("fedavg-groups", "dirichlet", 0, "clean", 0.0, name)
        for name in ("mean", "mean-unbounded", "mean-common")
    }

    # Execute: the cap each run reads once the scheme's defaults are applied
    caps = {
        name: resolve_run(
            bench.cell_run_config(cell, nodes=5, rounds=1, local_epochs=1, output_dir=tmp_path)
        ).run.aggregation.weight_cap
        for name, cell in cells.items()
    }

    # Assert: the default weighs no node above the median claim; the plain weighted
    # mean and the default without the scheme's own keys keep the declared 2
    assert caps == {"mean": 1.0, "mean-unbounded": 2.0, "mean-common": 2.0}


def test_the_local_grid_counts_as_simulation() -> None:
    grid = make_grid({"seed": 0}, 2, {})
    assert isinstance(grid, LocalGrid) and grid.simulation is True
    assert sorted(grid.get_node_ids()) == [100, 101]


def test_a_tiny_grid_writes_one_row_per_cell_and_resumes(
    bench: ModuleType, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: 4 nodes, 1 round, 1 seed, 1 attack, 2 aggregators (+ the clean runs)
    cells = bench.make_cells(
        schemes=["fedavg"],
        partitioners=["iid"],
        seeds=[0],
        attacks=["label-flip"],
        fractions=[0.25],
        aggregators=["mean", "median"],
    )
    jsonl = tmp_path / "cells.jsonl"
    lines: list[str] = []

    # Execute
    rows = bench.run_grid(
        cells,
        nodes=4,
        rounds=1,
        local_epochs=1,
        jsonl=jsonl,
        bundle=digits_bundle,
        log=lines.append,
    )
    again = bench.run_grid(
        cells,
        nodes=4,
        rounds=1,
        local_epochs=1,
        jsonl=jsonl,
        bundle=digits_bundle,
        log=lines.append,
    )
    table = bench.accuracy_tables(rows)

    # Assert
    # (per aggregator: clean, attackers absent, label-flip)
    assert [r["key"] for r in rows] == [c.key for c in cells] and len(rows) == 6
    assert len(jsonl.read_text().splitlines()) == 6  # the second call ran nothing
    assert again == [json.loads(line) for line in jsonl.read_text().splitlines()]
    for row in rows:
        assert row["rounds"] == row["rounds_run"] == 1 and row["stopped"] is None
        assert row["failed"] == 0 and row["skipped_rounds"] == 0
        assert 0.0 <= row["global_accuracy"] <= 1.0
        if row["attack"] == "absent":  # the drawn partition never connected
            assert row["honest_accuracy"] is not None
        assert row["attackers"] == ([] if row["attack"] == "clean" else [row["attackers"][0]])
    assert all(r["attack_success"] is not None for r in rows if r["attack"] == "label-flip")
    assert "| attack \\ aggregator | mean | median |" in table
    body = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert [line.split(" | ")[0] for line in body] == [
        "| clean",
        "| label-flip 25 %",
        "| label-flip 25 %: attack success",
    ]


def test_a_stopped_run_is_marked_in_the_table(bench: ModuleType) -> None:
    # Prepare: two seeds of one cell, one of which stopped (every client diverged)
    base = {"scheme": "felo", "partitioner": "iid", "attack": "boost", "fraction": 0.1}
    base |= {"aggregator": "mean-unbounded", "nodes": 4, "rounds": 2, "local_epochs": 1}
    rows = [
        {**base, "seed": 0, "honest_accuracy": 0.5, "stopped": None},
        {**base, "seed": 1, "honest_accuracy": None, "stopped": "3 rounds in a row"},
    ]

    # Execute
    table = bench.accuracy_tables(rows)

    # Assert
    assert "| boost 10 % | 50.0 ± 0.0 †1 |" in table
    assert "†k: in k seeds the run stopped early" in table


def test_cost_rows_compare_every_aggregator_with_mean(bench: ModuleType) -> None:
    # Execute
    rows = bench.cost_rows(updates=12, params=2_000, repeats=2, log=lambda line: None)
    table = bench.cost_table(rows)

    # Assert
    assert [r["aggregator"] for r in rows] == list(bench.COST_AGGREGATORS)
    assert rows[0]["aggregator"] == "mean" and rows[0]["ratio"] == pytest.approx(1.0)
    for row in rows:
        assert set(row) >= {"seconds", "ratio", "peak_mib", "seconds_all"}
        assert len(row["seconds_all"]) == 2 and row["peak_mib"] >= 0
    assert table.count("\n| ") == len(rows) + 1  # header + one line per aggregator


def test_worst_case_is_the_smallest_seed_mean_over_the_suite(bench: ModuleType) -> None:
    # Prepare: two seeds; clean 0.9 / 0.8, honest-only 0.8 / 0.8, attacks a and b
    def row(seed: int, attack: str, fraction: float, acc: float) -> dict[str, Any]:
        return {
            "scheme": "fedavg",
            "partitioner": "iid",
            "aggregator": "mean",
            "seed": seed,
            "attack": attack,
            "fraction": fraction,
            "nodes": 5,
            "global_accuracy": acc,
        }

    rows = [
        row(0, "clean", 0.0, 0.9),
        row(1, "clean", 0.0, 0.8),
        row(0, "absent", 0.2, 0.8),
        row(1, "absent", 0.2, 0.8),
        row(0, "a", 0.2, 0.5),  # mean 0.65
        row(1, "a", 0.2, 0.8),
        row(0, "b", 0.2, 0.7),  # mean 0.6: the worst
        row(1, "b", 0.2, 0.5),
    ]

    # Execute
    (summary,) = bench.worst_case_rows(rows)

    # Assert
    assert summary["worst_attack"] == "b"
    assert summary["clean"] == pytest.approx(0.85)
    assert summary["worst"] == pytest.approx(0.6)
    assert summary["ratio"] == pytest.approx(0.6 / 0.85)
    assert summary["ratio_honest"] == pytest.approx(0.6 / 0.8)
    assert summary["attacks"] == 2
    assert "| 1 of 5 |" in bench.worst_case_table(rows)


def test_clean_cost_pairs_the_seeds_both_aggregators_ran(bench: ModuleType) -> None:
    # Prepare: the default on seeds 0, 1, 2; the unbounded mean on seeds 0 and 1 only;
    # an attacked row that must not count; a knowledge scheme judged on its clients
    def row(
        scheme: str,
        aggregator: str,
        seed: int,
        acc: float,
        attack: str = "clean",
        personal: float | None = None,
    ) -> dict[str, Any]:
        metric = "honest_accuracy" if scheme in bench.KNOWLEDGE_SCHEMES else "global_accuracy"
        out = {
            "scheme": scheme,
            "partitioner": "iid",
            "aggregator": aggregator,
            "seed": seed,
            "attack": attack,
            "fraction": 0.0 if attack == "clean" else 0.2,
            "nodes": 5,
            "rounds": 5,
            metric: acc,
        }
        if personal is not None:
            out["honest_accuracy"] = personal
        return out

    rows = [
        row("fedavg", "mean", 0, 0.90, personal=0.60),
        row("fedavg", "mean", 1, 0.80, personal=0.70),
        row("fedavg", "mean", 2, 0.10),  # no unbounded partner: left out
        row("fedavg", "mean-unbounded", 0, 0.93, personal=0.80),
        row("fedavg", "mean-unbounded", 1, 0.79, personal=0.74),
        row("fedavg", "mean-unbounded", 1, 0.20, attack="sign-flip"),
        row("felo", "mean", 0, 0.50),
    ]

    # Execute
    (summary,) = bench.clean_cost_rows(rows)

    # Assert: seeds 0 and 1; cost +3 and -1 points -> mean +1, std sqrt(8)
    assert summary["scheme"] == "fedavg" and summary["seeds"] == [0, 1]
    assert summary["default"] == pytest.approx(0.85)
    assert summary["unbounded"] == pytest.approx(0.86)
    assert summary["cost"] == pytest.approx(1.0)
    assert summary["cost_std"] == pytest.approx(8**0.5)
    # the clients' personalised accuracy on the same seeds: 0.65 against 0.77, +12
    assert summary["personal_default"] == pytest.approx(0.65)
    assert summary["personal_unbounded"] == pytest.approx(0.77)
    assert summary["personal_cost"] == pytest.approx(12.0)
    assert "| +1.0 | 2.8 | 65.0 / 77.0 (+12.0) |" in bench.clean_cost_table(rows)
    assert bench.clean_cost_table(rows[:3]) == ""
    # a run without the personalised figure leaves the column out for that row
    (bare,) = bench.clean_cost_rows([{**r, "honest_accuracy": None} for r in rows[:5]])
    assert bare["personal_cost"] is None and bare["cost"] == pytest.approx(1.0)


def test_every_scheme_and_label_gives_a_run_config_the_scheme_accepts(
    bench: ModuleType, tmp_path: Path
) -> None:
    # Prepare / Execute: each cell's run config through the ServerApp's own parsing
    # (a weightless scheme refuses the weight-only keys: fedhe's and fedtgp's
    # `mean-unbounded` once failed there)
    from strategies import resolve_run

    for scheme, labels in bench.SCHEME_AGGREGATORS.items():
        for label in labels:
            cell = bench.Cell(scheme, "iid", 0, bench.CLEAN, 0.0, label)
            config = bench.cell_run_config(
                cell, nodes=5, rounds=2, local_epochs=1, output_dir=tmp_path
            )
            resolved = resolve_run(config)

            # Assert: the scheme and, for the unbounded mean, no knowledge clip
            assert resolved.scheme.name == scheme
            if label == "mean-unbounded":
                assert config["knowledge-clip-factor"] == 0.0


def test_flexifed_s_default_and_its_common_ablation_differ_only_in_the_threshold(
    bench: ModuleType, tmp_path: Path
) -> None:
    # Prepare
    from strategies import resolve_run

    def resolved(label: str) -> Any:
        cell = bench.Cell("flexifed", "dirichlet", 0, bench.CLEAN, 0.0, label)
        config = bench.cell_run_config(cell, nodes=5, rounds=2, local_epochs=1, output_dir=tmp_path)
        return resolve_run(config).run.aggregation

    # Execute
    default, common, clip2 = resolved("mean"), resolved("mean-common"), resolved("mean-clip2")
    clip3, clip3_trust = resolved("mean-clip3"), resolved("mean-clip3-trust")
    stretch, cap1 = resolved("mean-stretch"), resolved("mean-cap1")
    no_trim = resolved("mean-no-trim")

    # Assert: flexifed's own trust-threshold -0.1 by default, the declared 0 without it
    assert (default.trust_threshold, common.trust_threshold) == (-0.1, 0.0)
    assert default.clip_factor == common.clip_factor == 1.0
    assert clip2.clip_factor == 2.0
    # the previous default had no direction check; its factor beside the check keeps it
    assert (clip3.clip_factor, clip3.server_trust) == (3.0, False)
    assert (clip3_trust.clip_factor, clip3_trust.server_trust) == (3.0, True)
    # one bound for all by default; the ablations stretch it or cap weights at the median
    assert (default.bound_stretch, stretch.bound_stretch) == (0.0, 2.0)
    assert (default.weight_cap, cap1.weight_cap, cap1.bound_stretch) == (2.0, 1.0, 0.0)
    # the largest claims cut to the next one by default; the ablation without the cut
    assert (default.weight_trim, no_trim.weight_trim, no_trim.weight_cap) == (0.2, 0.0, 2.0)


def test_a_report_runs_nothing_not_even_the_cost_part(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: one finished cell, and a cost part that must not run
    row = json.loads(
        (ROOT / "results/bench-robustness/felo-n5/cells.jsonl").read_text().splitlines()[0]
    )
    (tmp_path / "cells.jsonl").write_text(json.dumps(row) + "\n")

    def no_cost(**_: Any) -> None:
        raise AssertionError("--report-only ran the cost part")

    monkeypatch.setattr(bench, "cost_rows", no_cost)

    # Execute: the default --parts (accuracy,cost); main sets Flower's log level
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    try:
        code = bench.main(["--report-only", "--out", str(tmp_path)])
    finally:
        flwr_log.setLevel(level)

    # Assert
    assert code == 0
    assert not (tmp_path / "cost.json").exists()
    assert "`felo`" in (tmp_path / "tables.md").read_text()
