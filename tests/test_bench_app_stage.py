"""benchmarks/app_stage.py on a toy project: both paths timed, the same FAB."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import load_benchmark
from tests.test_app_stage import _toy


def test_a_tiny_run_prints_both_paths_and_the_same_fab(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_benchmark("app_stage")
    root = _toy(tmp_path / "proj")

    assert bench.main(["--repeats", "2", "--project", str(root)]) == 0

    out = capsys.readouterr().out
    # the toy holds 11 files (the symlink counts as one), 6 of them publishable
    assert "files under the project: 11; staged: 6" in out
    assert "| Flower's build from the project |" in out
    assert "same FAB: True" in out


def test_repeats_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("app_stage")
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err
