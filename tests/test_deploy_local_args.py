"""scripts/deploy-local.sh refuses bad arguments by value, before it starts anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "deploy-local.sh"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nodes", "2", "--isolation", "thread"],
            "--isolation is 'thread'; use subprocess or process",
        ),
        (["--nodes", "2", "--isolation"], "--isolation needs subprocess or process"),
        (["--nodes", "0"], "--nodes must be a positive whole number (got '0')"),
        (
            ["--nodes", "2", "--executor", "ray"],
            "--executor is 'ray'; use tessera or flower",
        ),
    ],
)
def test_bad_arguments_are_refused_by_value(args: list[str], message: str, tmp_path: Path) -> None:
    # Execute: a workdir that must stay empty
    workdir = tmp_path / "deploy"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--workdir", str(workdir), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )

    # Assert: refused with the value and the fix, nothing made
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert not workdir.exists()
