"""``benchmarks/conv1d.py`` on tiny sizes: the data, one run per form, the table.

No accuracy is asserted: two epochs on a few samples say nothing about the forms.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, imported as a module."""
    return load_benchmark("conv1d")


def test_the_classes_are_the_ten_pairs_of_five_motifs(bench: ModuleType) -> None:
    pairs = bench.class_pairs()

    assert len(pairs) == len(set(pairs)) == 10
    assert pairs[0] == (0, 1) and pairs[-1] == (3, 4)


def test_a_noiseless_sample_is_its_two_motifs_wherever_they_are(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: without noise a sample's sum is its motifs' sums, whatever the positions
    monkeypatch.setattr(bench, "NOISE", 0.0)
    rng = np.random.default_rng(0)
    bank = bench.motif_bank(rng)

    # Execute
    data = bench.make_signals(50, length=40, bank=bank, rng=rng)

    # Assert
    assert data.x.shape == (50, 40) and data.x.dtype == np.float32
    assert data.y.dtype == np.int64
    assert sorted(np.bincount(data.y).tolist()) == [5] * 10
    assert np.abs(bank).max(axis=1) == pytest.approx([2.0] * 5)
    for x, label in zip(data.x, data.y, strict=True):
        a, b = bench.class_pairs()[label]
        assert x.sum() == pytest.approx(bank[a].sum() + bank[b].sum(), abs=1e-5)
        assert np.count_nonzero(x) <= 2 * bench.MOTIF_WIDTH


def test_a_seed_fixes_the_data(bench: ModuleType) -> None:
    first = bench.dataset(3, train=20, test=10, length=40)
    again = bench.dataset(3, train=20, test=10, length=40)
    other = bench.dataset(4, train=20, test=10, length=40)

    np.testing.assert_array_equal(first[0].x, again[0].x)
    np.testing.assert_array_equal(first[1].y, again[1].y)
    assert not np.array_equal(first[0].x, other[0].x)


def test_a_tiny_run_prints_and_writes_the_table(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Execute: cnn-1 in both forms, one seed, one epoch, a few samples
    code = bench.main(
        [
            "--models",
            "cnn-1",
            "--seeds",
            "0",
            "--epochs",
            "1",
            "--train",
            "40",
            "--test",
            "20",
            "--out",
            str(tmp_path),
        ]
    )

    # Assert: one row per form; cnn-1's MACs by hand: 16 * 49 * 9 (7x7) or 16 * 40 * 3
    text = (tmp_path / "table.md").read_text()
    assert code == 0
    assert text in capsys.readouterr().out
    lines = text.strip().splitlines()
    assert lines[0] == "| model | form | test accuracy (%) | params | MACs |"
    assert lines[2].startswith("| cnn-1 | square | ")
    assert lines[2].endswith(f"| {16 * 49 * 9 + 16 * 10:,} |")
    assert lines[3].startswith("| cnn-1 | signal | ")
    assert lines[3].endswith(f"| {16 * 40 * 3 + 16 * 10:,} |")
    assert len(lines) == 4


@pytest.mark.parametrize(
    "argv",
    [
        ["--models", "resnet-9000"],
        ["--models", "mlp-s"],
        ["--seeds", "a,b"],
        ["--seeds", ","],
        ["--epochs", "0"],
        ["--length", "5"],
    ],
)
def test_bad_arguments_are_refused(bench: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
