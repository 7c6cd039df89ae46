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

    # Assert: round 2's time per node is 2.0 s / 4 = 500 ms
    assert row["round_seconds"] == 2.0 and row["first_handshake_seconds"] == 6.0
    assert (
        "| 4 | 4 | 2.0 | 500 | 6.0 | 0.10 | 1.5 (0.2, 0.30) | 0.010 | 0.05 | 800 (810) | 30 |"
        in text
    )
    assert png.stat().st_size > 1000
