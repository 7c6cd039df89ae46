"""``benchmarks/scale.py`` without a federation: the data set, a row, the table and plot."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tessera.data import load_bundle
from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("scale")


def test_the_generated_data_set_loads_as_an_npz_spec(bench: ModuleType, tmp_path: Path) -> None:
    path = bench.make_dataset(tmp_path / "d.npz", n_train=50, n_test=20, features=8)

    bundle = load_bundle(f"npz:{path}")

    assert bundle.num_classes == 10 and bundle.input_shape == (8,)
    assert len(bundle.train) == 50 and len(bundle.test) == 20
    assert set(np.unique(bundle.train.y)) == set(range(10))


def test_a_row_reads_round_two_and_the_first_handshake(bench: ModuleType, tmp_path: Path) -> None:
    # Prepare: two round records as the server writes them
    rounds = [
        {
            "num_ok": 4,
            "round_seconds": 9.0,
            "phase_seconds": {"handshake": 6.0},
            "server_memory_mb": {"rss": 1.0, "peak": 1.0},
        },
        {
            "num_ok": 4,
            "round_seconds": 2.0,
            "phase_seconds": {
                "handshake": 0.0,
                "build": 0.1,
                "exchange": 1.5,
                "pull": 0.2,
                "fold": 0.3,
                "pull_cpu": 0.001,
                "fold_cpu": 0.011,
                "pool_train_cpu": 0.004,
                "aggregate": 0.01,
                "evaluate": 0.05,
            },
            "server_memory_mb": {"rss": 800.0, "peak": 810.0},
        },
    ]

    # Execute
    row = bench.row_of(4, rounds, 30.0)
    text = bench.markdown([row])
    png = bench.plot([row, {**row, "nodes": 8, "round_seconds": 4.0}], tmp_path / "s.png")

    # Assert: round 2's time per node is 2.0 s / 4 = 500 ms, the handshake 6 s / 4 =
    # 1500 ms a node, the server's own work (1 + 11 - 4) ms of CPU / 4 replies = 2 ms a
    # reply, its training on the pool (4 ms, inside the fold) apart: a cost per round
    assert row["round_seconds"] == 2.0 and row["first_handshake_seconds"] == 6.0
    assert (
        "| 4 | 4 | 2.0 | 500.0 | 6.0 (1500.0) | 0.10 | 1.5 (0.2, 0.30) | 2.00 | 0.00 | 0.010 "
        "| 0.05 | 800 (810) | 30 |" in text
    )
    assert png.stat().st_size > 1000
    # one size is no line: said so, not printed as nan
    assert "nan s +" not in text and "needs three sizes" in text


def test_flatness_is_max_over_min_from_fifty_nodes(bench: ModuleType) -> None:
    # Prepare: per node 20 ms at 50 nodes, 26 ms at 5,000 (x1.3); the 10-node size
    # (Ray's start-up dominates it) is left out; per reply 1 ms then 3 ms (x3)
    def row(nodes: int, round_s: float, fold_cpu: float) -> dict[str, float]:
        return {
            "nodes": nodes,
            "num_ok": nodes,
            "round_seconds": round_s,
            "first_handshake_seconds": nodes * 0.01,
            "pull_cpu_seconds": 0.0,
            "fold_cpu_seconds": fold_cpu,
        }

    rows = [row(10, 9.0, 0.01), row(50, 1.0, 0.05), row(5000, 130.0, 15.0)]

    # Execute
    flat = bench.flatness(rows)

    # Assert
    assert flat["per_node"] == pytest.approx(1.3)
    assert flat["server_per_reply"] == pytest.approx(3.0)
    assert flat["handshake_per_node"] == pytest.approx(1.0)
    assert bench.flatness(rows[:2])["per_node"] != bench.flatness(rows[:2])["per_node"]  # NaN


def test_linear_fit_recovers_a_fixed_part_and_a_slope(bench: ModuleType) -> None:
    # by hand: 5 s + 6 ms a node, the 5,000-node size 10 % above the line
    rows = [{"nodes": n, "h": 5.0 + 0.006 * n} for n in (10, 50, 500, 1000, 2000)]
    rows.append({"nodes": 5000, "h": 1.1 * (5.0 + 0.006 * 5000)})

    a, b, worst = bench.linear_fit(rows[:-1], "h")
    assert (a, b, worst) == (pytest.approx(5.0), pytest.approx(0.006), pytest.approx(0, abs=1e-9))
    assert bench.linear_fit(rows, "h")[2] > 0.03  # the outlier shows as a deviation
    assert bench.linear_fit(rows[:3], "h")[0] != bench.linear_fit(rows[:3], "h")[0]  # NaN
