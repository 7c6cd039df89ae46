"""``benchmarks/submodel.py`` on tiny sizes: its fleet, run configs, rows and tables.

No timing is asserted; the federations are real (tiny) ones on the local grid.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, imported as a module."""
    return load_benchmark("submodel")


def test_the_fleet_limits_half_the_honest_clients_and_gives_attackers_the_full_model(
    bench: ModuleType,
) -> None:
    # Execute
    clean = bench.node_archs(bench.Cell("fedfa", "iid", 0, "clean"), 10)
    hit = bench.node_archs(bench.Cell("heterofl", "iid", 0, "l20-20"), 10)
    one = bench.node_archs(bench.Cell("flexifed", "iid", 0, "l1-1"), 10)

    # Assert
    assert bench.extreme_slices("fedfa") == (
        "preresnet26_025@w0.125-d2.2.2.2",
        "preresnet26_025@w1-d3.3.3.3",
    )
    assert bench.extreme_slices("heterofl")[0] == "preresnet26_025@w0.125-d3.3.3.3"
    assert bench.extreme_slices("flexifed")[0] == "preresnet26_025@w1-d2.2.2.2"
    assert sorted(clean) == [0, 2, 4, 6, 8] and set(clean.values()) == {
        "preresnet26_025@w0.125-d2.2.2.2"
    }
    full = [p for p, a in hit.items() if a.endswith("w1-d3.3.3.3")]
    assert len(full) == 2 and len(hit) == 2 + 4  # 2 attackers, half of the 8 honest
    assert len(one) == 1 + 50 and sum(a.endswith("d3.3.3.3") for a in one.values()) == 1


def test_run_configs_follow_the_scenario(bench: ModuleType, tmp_path: Path) -> None:
    # Execute
    one = bench.cell_run_config(
        bench.Cell("fedfa-width", "noniid", 1, "l1-1"),
        nodes=10,
        rounds=2,
        local_epochs=1,
        output_dir=tmp_path,
    )
    big = bench.cell_run_config(
        bench.Cell("nefl", "iid", 0, "l20-20"),
        nodes=10,
        rounds=2,
        local_epochs=1,
        output_dir=tmp_path,
    )

    # Assert: 1 % runs on 100 clients, a tenth sampled; baselines average unbounded
    assert (one["min-nodes"], one["fraction-train"], one["attack-fraction"]) == (100, 0.1, 0.01)
    assert (one["strategy"], one["fedfa-slices"], one["partitioner"]) == (
        "fedfa",
        "width",
        "pathological",
    )
    assert (big["attack"], big["attack-lambda"], big["clip-factor"]) == ("backdoor", 20.0, 0.0)
    assert big["norm"] == "static-batch" and big["submodel-global"] == "preresnet26_025"


def test_a_tiny_grid_gives_rows_tables_and_a_plot(
    bench: ModuleType, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: 4 clients, 1 round; FedFA (both) and NeFL, clean and attacked
    cells = bench.make_cells(
        variants=["fedfa", "nefl"],
        partitioners=["noniid"],
        seeds=[0],
        scenarios=["clean", "l20-20"],
    )
    jsonl = tmp_path / "cells.jsonl"

    # Execute
    rows = bench.run_grid(
        cells, nodes=4, rounds=1, local_epochs=1, jsonl=jsonl, bundle=digits_bundle, log=print
    )
    again = bench.run_grid(
        cells, nodes=4, rounds=1, local_epochs=1, jsonl=jsonl, bundle=digits_bundle, log=print
    )
    bench.plot(rows, tmp_path / "accuracy.png")

    # Assert
    assert again == rows and len(jsonl.read_text().splitlines()) == 4
    for row in rows:
        assert row["rounds_run"] == 1 and row["failed"] == 0
        assert 0.0 <= row["global_accuracy"] <= 1.0 and row["local_accuracy"] is not None
        assert row["smallest_accuracy"] is not None and row["train_macs"] > 0
        assert sum(row["slices"].values()) == 4 and row["bytes_up"] > 0
    attacked = [r for r in rows if r["scenario"] == "l20-20"]
    assert all(len(r["attackers"]) == 1 for r in attacked)
    tables = bench.accuracy_table(rows) + bench.ratio_table(rows) + bench.cost_table(rows)
    assert "| fedfa |" in tables and "| both (fedfa / nefl) | non-IID global |" in tables
    assert (tmp_path / "accuracy.png").stat().st_size > 10_000


def test_drop_ratios_by_hand(bench: ModuleType) -> None:
    rows = [
        {"variant": v, "partitioner": "iid", "scenario": s, "seed": 0, "global_accuracy": acc}
        for v, s, acc in [
            ("fedfa-width", "clean", 0.90),
            ("fedfa-width", "l20-20", 0.80),
            ("heterofl", "clean", 0.90),
            ("heterofl", "l20-20", 0.60),
            ("heterofl", "l1-20", 0.89),
            ("fedfa-width", "l1-20", 0.90),
        ]
    ]
    table = bench.ratio_table(rows)
    line = next(x for x in table.splitlines() if x.startswith("| width") and "IID global" in x)
    cells = [c.strip() for c in line.split("|")]
    assert cells[3] == "1.00"  # clean ratio
    assert cells[6] == "(+1.0, +0.0)"  # l1-20: FedFA lost nothing, a ratio means nothing
    assert cells[7] == "3.00"  # l20-20: 30 points against 10
