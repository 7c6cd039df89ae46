"""``benchmarks/ensemble.py`` on tiny sizes: the fleet, rows, tables and the heat map.

No timing is asserted; the federation is a real (tiny) one on the local grid.
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
    return load_benchmark("ensemble")


def test_a_tiny_grid_gives_rows_tables_and_the_alpha_plot(
    bench: ModuleType, digits_bundle: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Prepare: two fast optimisers, 4 clients (one per family), 1 round, 10 trials
    monkeypatch.setattr(bench, "OPTIMIZERS", ("grid", "gradient"))
    cell = bench.Cell("dirichlet", 0)

    # Execute
    row = bench.run_cell(cell, nodes=4, rounds=1, local_epochs=1, trials=10, bundle=digits_bundle)
    text = bench.tables([row])
    bench.plot_alpha([row], tmp_path / "alpha.png")

    # Assert: the four families each trained a group, every method has a number
    assert row["members"] == sorted(bench.members())
    assert len({m.split("_")[0].rstrip("0123456789") for m in row["members"]}) == 4
    assert set(row["optimizers"]) == {"uniform", "grid", "gradient"}
    assert set(row["groups"]) == set(row["members"]) == set(row["central"])
    assert all(0.0 <= v <= 1.0 for v in row["central"].values())
    assert (
        row["optimizers"]["grid"]["tuning_accuracy"]
        >= (row["optimizers"]["uniform"]["tuning_accuracy"])
    )
    assert "| uniform weights |" in text and "| gradient |" in text and "central |" in text
    assert "| grid | " in text and "0.28 h" in text  # the paper's 17 minutes beside ours
    assert (tmp_path / "alpha.png").stat().st_size > 5_000


def test_bad_arguments_are_refused(bench: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--partitioners", "pathological"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--nodes", "3"])
