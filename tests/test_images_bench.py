"""benchmarks/images.py: its table rows by hand and its refusals (a run: tests/test_docker.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.images import ROLE_IMPORTS, ratio_row

ROOT = Path(__file__).resolve().parents[1]


def test_a_row_gives_both_values_and_the_server_over_client_ratio() -> None:
    values = {"tessera/app-cpu": 1800.0, "tessera/app-server": 2070.0}
    row = ratio_row("size", values, "tessera/app-cpu", "tessera/app-server", "MB", 0)
    assert row == "| size | 1800 MB | 2070 MB | 1.15 |"
    row = ratio_row("start", {"a": 0.2, "b": 0.25}, "a", "b", "s", 2)
    assert row == "| start | 0.20 s | 0.25 s | 1.25 |"


def test_the_server_image_imports_every_optimiser_the_ensemble_loads() -> None:
    from strategies.ensemble.optimizers import OPTIMIZERS

    server = ROLE_IMPORTS["tessera/app-server"]
    # each optional optimiser's library is among the timed imports
    for library in ("optuna", "cmaes", "pyswarms", "smac"):
        assert library in server
    assert "gradient" in OPTIMIZERS


def test_the_benchmark_refuses_bad_repeats() -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/images.py", "--repeats", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--repeats is 0; give 1 or more" in proc.stderr
