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


def _function(name: str) -> str:
    """The text of shell function ``name`` in deploy-local.sh (to its closing brace)."""
    lines = SCRIPT.read_text().splitlines()
    start = lines.index(f"{name}() {{")
    end = lines.index("}", start)
    return "\n".join(lines[start : end + 1])


def test_a_started_group_exists_as_soon_as_start_group_returns(tmp_path: Path) -> None:
    # Arrange: start_group as the script defines it, then at once look for the group,
    # as wait_ports and the clean-up do. The child makes its session only when it runs
    # setsid; a group looked for before that seems to have exited (a flake in CI:
    # "process group N exited before listening", with an empty log).
    script = "\n".join(
        [
            'have() { command -v "$1" >/dev/null 2>&1; }',
            "py=python3",
            "pgids=()",
            _function("start_group"),
            "missing=0",
            "for i in $(seq 40); do",
            f'    start_group "{tmp_path}/log-$i" sleep 2',
            '    kill -0 -- "-$last_pgid" 2>/dev/null || missing=$((missing + 1))',
            "done",
            'kill -- $(printf -- "-%s " "${pgids[@]}") 2>/dev/null',
            'echo "missing $missing"',
        ]
    )

    # Act
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)

    # Assert: every group was there to be checked (and killed)
    assert proc.stdout.strip().splitlines()[-1] == "missing 0", proc.stdout + proc.stderr
