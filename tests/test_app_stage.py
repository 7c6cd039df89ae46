"""The staged app (tessera/app_stage.py) builds the FAB that ``flwr run`` builds."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from tessera.app_stage import main, publishable_files, stage_app

ROOT = Path(__file__).resolve().parents[1]

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "toyapp"
version = "1.0.0"
dependencies = ["flwr==1.30.0"]

[tool.flwr.app]
publisher = "toy"

[tool.flwr.app.components]
serverapp = "pkg.server:app"
clientapp = "pkg.client:app"

[tool.flwr.app.config]
rounds = 1
"""


def _sha(fab: bytes) -> str:
    return hashlib.sha256(fab).hexdigest()


def _toy(root: Path) -> Path:
    """A project with an ignored venv, a re-included folder and a symlink."""
    (root / "pkg").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / ".gitignore").write_text(
        ".venv/\nresults/*\n!results/keep/\nresults/keep/*/*\n!results/keep/*/cells.jsonl\n"
    )
    (root / "pkg" / "server.py").write_text("app = None\n")
    (root / "pkg" / "client.py").write_text("app = None\n")
    (root / "pkg" / "notes.md").write_text("# notes\n")
    (root / "pkg" / "blob.bin").write_bytes(b"\0" * 10)  # no include pattern holds it
    (root / ".venv" / "lib").mkdir(parents=True)
    (root / ".venv" / "lib" / "site.py").write_text("x = 1\n")
    (root / "results" / "runs").mkdir(parents=True)
    (root / "results" / "runs" / "metrics.jsonl").write_text("{}\n")
    (root / "results" / "keep" / "a").mkdir(parents=True)
    (root / "results" / "keep" / "a" / "cells.jsonl").write_text("{}\n")
    (root / "results" / "keep" / "a" / "table.md").write_text("|a|\n")
    (root / "pkg" / "link.py").symlink_to(root / "pkg" / "server.py")
    return root


def test_the_staged_toy_app_builds_the_same_fab_and_skips_ignored_folders(tmp_path: Path) -> None:
    # Prepare
    root = _toy(tmp_path / "proj")

    # Execute
    staged = stage_app(root, tmp_path / "stage")

    # Assert: the ignored venv and results/runs are gone, the re-included cells kept,
    # the binary and the symlink left out, and Flower builds the same FAB from both
    assert staged == [
        ".gitignore",
        "pkg/client.py",
        "pkg/notes.md",
        "pkg/server.py",
        "pyproject.toml",
        "results/keep/a/cells.jsonl",
    ]
    assert _sha(build_fab_from_disk(tmp_path / "stage")) == _sha(build_fab_from_disk(root))


def test_restaging_removes_what_no_longer_belongs_and_keeps_modes(tmp_path: Path) -> None:
    # Prepare: a staged project, then one file removed and one made executable
    root = _toy(tmp_path / "proj")
    dest = tmp_path / "stage"
    stage_app(root, dest)
    (dest / "stray").mkdir()
    (dest / "stray" / "old.py").write_text("gone\n")
    (root / "pkg" / "notes.md").unlink()
    os.chmod(root / "pkg" / "server.py", 0o755)

    # Execute
    staged = stage_app(root, dest)

    # Assert
    assert "pkg/notes.md" not in staged
    assert not (dest / "pkg" / "notes.md").exists() and not (dest / "stray").exists()
    assert os.stat(dest / "pkg" / "server.py").st_mode & 0o777 == 0o755
    assert _sha(build_fab_from_disk(dest)) == _sha(build_fab_from_disk(root))


def test_staging_refuses_a_folder_that_would_publish_itself(tmp_path: Path) -> None:
    root = _toy(tmp_path / "proj")
    with pytest.raises(ValueError, match=r"inside .* not ignored"):
        stage_app(root, root / "pkg" / "stage")
    with pytest.raises(ValueError, match="holds it"):
        stage_app(root, tmp_path)
    with pytest.raises(ValueError, match=r"no pyproject\.toml"):
        stage_app(tmp_path / "proj" / "pkg", tmp_path / "stage")
    # An ignored folder inside the project is fine (scripts/simulate.sh's .flwr-home)
    assert "pyproject.toml" in stage_app(root, root / ".venv" / "stage")


def test_the_cli_prints_the_folder_and_names_a_bad_project(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _toy(tmp_path / "proj")
    assert main([str(root), str(tmp_path / "stage")]) == 0
    assert capsys.readouterr().out.strip() == str((tmp_path / "stage").resolve())
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "stage2")]) == 1
    assert "no pyproject.toml" in capsys.readouterr().err
    assert main([]) == 2


def test_this_project_stages_to_the_fab_flwr_run_builds(tmp_path: Path) -> None:
    # This checkout (with its .venv, caches and results): the staged folder's FAB is
    # the one `flwr run .` would send, byte for byte
    stage_app(ROOT, tmp_path / "stage")
    assert _sha(build_fab_from_disk(tmp_path / "stage")) == _sha(build_fab_from_disk(ROOT))
    assert not any(rel.startswith(".venv/") for rel in publishable_files(ROOT))
