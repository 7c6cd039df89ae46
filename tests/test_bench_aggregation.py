"""``benchmarks/aggregation.py`` on tiny sizes: the contenders agree and the table is written.

No timing is asserted (speed is the benchmark's to print); the memory ratios are
deterministic and checked loosely.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, imported as a module."""
    spec = importlib.util.spec_from_file_location(
        "bench_aggregation", ROOT / "benchmarks" / "aggregation.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_model_shapes_add_up_to_the_parameters(bench: ModuleType) -> None:
    shapes = bench.model_shapes(10_000)
    # 64 x 78 + 64 x 39 + 64 x 19 = 8,704 in the layers, 1,296 in the bias
    assert shapes == {
        "layer0.weight": (64, 78),
        "layer1.weight": (64, 39),
        "layer2.weight": (64, 19),
        "head.bias": (1296,),
    }


def test_the_three_contenders_compute_the_same_mean(bench: ModuleType) -> None:
    shapes = bench.model_shapes(1000)
    updates = [bench.make_update(shapes, s) for s in range(5)]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    reference = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    expected = {
        k: sum(w * u[k].astype(np.float64) for u, w in zip(updates, weights, strict=True)) / 15.0
        for k in shapes
    }
    for result in (
        bench.torch_reference(updates, weights),
        bench.streaming_mean(reference, updates, weights),
        bench.buffered_weighted_average(updates, weights),
    ):
        for key, value in expected.items():
            np.testing.assert_allclose(result[key], value, rtol=1e-5, atol=1e-6)


def test_a_tiny_run_writes_the_table(bench: ModuleType, tmp_path: Path) -> None:
    # Execute
    code = bench.main(
        [
            "--params", "20000", "--clients", "4", "--memory-updates", "100",
            "--buffered-updates", "10", "--fedfa-clients", "4,12",
            "--fedfa-params", "20000", "--repeats", "1", "--out", str(tmp_path),
        ]
    )  # fmt: skip

    # Assert
    text = (tmp_path / "table.md").read_text()
    assert code == 0
    assert "| torch in place (reference) |" in text and "| ours: `mean` accumulator" in text
    rows = {
        (cells[1], int(cells[2])): float(cells[4])
        for line in text.splitlines()
        if (cells := [c.strip() for c in line.split("|")])
        and len(cells) == 6
        and cells[2].isdigit()
    }
    # float64 sums (2 models of float32) + the update alive and the one waiting for its
    # pair (the plain mean folds in pairs); the float32 result reuses the sums
    assert rows[("mean, streaming", 100)] < 4.2
    assert rows[("weighted_average, buffered", 10)] > 10.0  # every update held, float64
    # a first round holds the updates until FIRST_ROUND_BUFFER (32) arrived, then streams:
    # 10 updates -> the 10 held and the sums; 100 -> the 32 held and the sums, not 100
    assert 10.0 < rows[("mean, bounded (default), first round", 10)] < 16.0
    assert 32.0 < rows[("mean, bounded (default), first round", 100)] < 38.0
    assert rows[("FedFA scalable, streaming", 12)] < 1.2 * rows[("FedFA scalable, streaming", 4)]


@pytest.mark.parametrize("argv", [["--params", "10"], ["--fedfa-clients", "x"], ["--clients", "0"]])
def test_bad_arguments_are_refused(bench: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
