"""A deployed ClientApp is a fresh process per message: its imports must stay light.

``tessera.data`` imports scikit-learn, flwr-datasets, datasets and matplotlib only
inside the functions that use them; ``client_app.app`` (which also imports
``strategies`` and ``models``, owned elsewhere) must not pull them in either.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("matplotlib", "seaborn", "datasets", "flwr_datasets", "sklearn", "scipy", "pandas")


def _loaded_after(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; return which HEAVY top-level packages it loaded."""
    probe = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


@pytest.mark.parametrize(
    "code",
    [
        "import tessera.data",
        # the whole data pipeline's public names
        "from tessera.data import *",
        # what a deployed ClientApp process imports (strategies and models included)
        "import client_app.app",
    ],
)
def test_import_loads_no_heavy_package(code: str) -> None:
    assert _loaded_after(code) == []
