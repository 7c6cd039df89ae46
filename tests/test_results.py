"""Results folder: metrics.jsonl lines, strict JSON, refusal to mix runs, plots, table row."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tessera.results import TABLE_HEADER, ResultsWriter, dumps, format_round_row, plot_rounds

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def strict_loads(text: str) -> Any:
    """json.loads that refuses NaN/Infinity, which strict JSON does not allow."""

    def refuse(name: str) -> Any:
        raise ValueError(f"non-strict JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def round_record(number: int, **overrides: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "round": number,
        "strategy": "fedavg-groups",
        "clients": [
            {"node": 1, "arch": "cnn-2", "test_accuracy": 0.5, "num_test_examples": 10},
            {"node": 2, "arch": "cnn-5", "test_accuracy": 0.75, "num_test_examples": 12},
        ],
        "num_sent": 3,
        "num_ok": 2,
        "num_rejected": 1,
        "num_failed": 0,
        "personal_accuracy_mean": 0.625,
        "personal_accuracy_std": 0.125,
        "global_accuracy": 0.6,
        "bytes_up_total": 2_000_000,
        "bytes_down_total": 3_000_000,
        "round_seconds": 1.5,
    }
    record.update(overrides)
    return record


def test_append_round_writes_one_parseable_line_per_round(tmp_path: Path) -> None:
    # Prepare
    writer = ResultsWriter(tmp_path / "out" / "run-a")
    first, second = round_record(1), round_record(2)

    # Execute
    writer.append_round(first)
    writer.append_round(second)

    # Assert
    lines = (tmp_path / "out" / "run-a" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert [strict_loads(line) for line in lines] == [first, second]
    assert writer.rounds == [first, second]


def test_nan_and_inf_become_null(tmp_path: Path) -> None:
    # Prepare
    writer = ResultsWriter(tmp_path / "run")
    record = round_record(
        1, personal_accuracy_mean=math.nan, personal_accuracy_std=math.inf, global_accuracy=None
    )
    record["clients"][0]["test_accuracy"] = -math.inf

    # Execute
    writer.append_round(record)

    # Assert
    (line,) = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    parsed = strict_loads(line)
    assert parsed["personal_accuracy_mean"] is None
    assert parsed["personal_accuracy_std"] is None
    assert parsed["global_accuracy"] is None
    assert parsed["clients"][0]["test_accuracy"] is None
    assert parsed["clients"][1]["test_accuracy"] == 0.75


def test_numpy_values_are_serialised(tmp_path: Path) -> None:
    # Prepare
    record = {
        "round": np.int64(3),
        "acc": np.float32(0.5),
        "counts": np.array([1, 2]),
        "archs": ("cnn-1",),
    }

    # Execute
    parsed = strict_loads(dumps(record))

    # Assert
    assert parsed == {"round": 3, "acc": 0.5, "counts": [1, 2], "archs": ["cnn-1"]}


@pytest.mark.parametrize(
    "value",
    [np.float32("nan"), np.array([0.5, np.nan])],
    ids=["float32-scalar", "array"],
)
def test_numpy_nan_becomes_null(value: Any) -> None:
    # Execute
    text = dumps({"acc": value})

    # Assert
    strict_loads(text)


def test_existing_non_empty_metrics_file_raises(tmp_path: Path) -> None:
    # Prepare
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"round": 1}\n')

    # Execute / Assert
    with pytest.raises(FileExistsError, match="run-name"):
        ResultsWriter(run_dir)
    assert (run_dir / "metrics.jsonl").read_text() == '{"round": 1}\n'


def test_existing_empty_metrics_file_is_reused(tmp_path: Path) -> None:
    # Prepare
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")

    # Execute
    writer = ResultsWriter(run_dir)
    writer.append_round(round_record(1))

    # Assert
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1


def test_write_config_and_summary_are_strict_json(tmp_path: Path) -> None:
    # Prepare
    writer = ResultsWriter(tmp_path / "run")

    # Execute
    writer.write_config({"seed": np.int64(42), "shape": (1, 8, 8), "alpha": math.nan})
    writer.write_summary({"final": 0.5, "best": None, "rounds": 2})

    # Assert
    config = strict_loads((tmp_path / "run" / "config.json").read_text())
    assert config == {"seed": 42, "shape": [1, 8, 8], "alpha": None}
    summary = strict_loads((tmp_path / "run" / "summary.json").read_text())
    assert summary == {"final": 0.5, "best": None, "rounds": 2}
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_plot_rounds_writes_pngs(tmp_path: Path) -> None:
    # Prepare
    rounds = [round_record(1), round_record(2, global_accuracy=None)]

    # Execute
    written = plot_rounds(rounds, tmp_path)

    # Assert
    assert written == [tmp_path / "accuracy.png", tmp_path / "bytes.png"]
    for path in written:
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert path.stat().st_size > 1000


def test_plot_rounds_handles_a_round_without_clients(tmp_path: Path) -> None:
    # Prepare: every reply of round 2 was rejected
    rounds = [
        round_record(1),
        round_record(2, clients=[], personal_accuracy_mean=None, personal_accuracy_std=None),
    ]

    # Execute
    written = plot_rounds(rounds, tmp_path)

    # Assert
    assert [p.name for p in written] == ["accuracy.png", "bytes.png"]


def test_writer_plot_rounds_uses_appended_rounds(tmp_path: Path) -> None:
    # Prepare
    writer = ResultsWriter(tmp_path / "run")
    writer.append_round(round_record(1))

    # Execute
    written = writer.plot_rounds()

    # Assert
    assert [p.name for p in written] == ["accuracy.png", "bytes.png"]
    assert all(p.parent == (tmp_path / "run").resolve() for p in written)


def test_plot_rounds_without_rounds_writes_nothing(tmp_path: Path) -> None:
    # Execute
    written = plot_rounds([], tmp_path)

    # Assert
    assert written == []
    assert list(tmp_path.iterdir()) == []


def test_format_round_row_hand_formatted() -> None:
    # Prepare: 2 MB up, 3 MB down, 0.625 ± 0.125, global 0.6
    record = round_record(2)

    # Execute
    row = format_round_row(record, 5)

    # Assert
    assert row == (
        "|     2/5 |     2/3 |   1 |    0 |    0.625±0.125 |  0.600 |    2.000 |    3.000 "
        "|    1.50 |"
    )


def test_format_round_row_without_accuracies() -> None:
    # Prepare
    record = round_record(1, personal_accuracy_mean=math.nan, global_accuracy=None)

    # Execute
    row = format_round_row(record, 5)

    # Assert
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "-"
    assert cells[5] == "-"


def test_format_round_row_lines_up_with_header() -> None:
    # Prepare
    record = round_record(12, bytes_up_total=123_456_789, round_seconds=1234.5)

    # Execute
    row = format_round_row(record, 100)

    # Assert
    bars = [i for i, ch in enumerate(TABLE_HEADER) if ch == "|"]
    assert [i for i, ch in enumerate(row) if ch == "|"] == bars
