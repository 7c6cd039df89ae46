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
        # the whole data pipeline's public names, and the cache the ClientApp uses
        "from tessera.data import *\nimport tessera.data.cache",
        # what a deployed ClientApp process imports (strategies and models included)
        "import client_app.app",
    ],
)
def test_import_loads_no_heavy_package(code: str) -> None:
    assert _loaded_after(code) == []


def test_a_cached_node_reads_its_data_without_heavy_packages(tmp_path: Path) -> None:
    # Prepare: the first process builds the node's cache (this loads scikit-learn
    # and flwr-datasets to split and partition)
    build = (
        "from tessera.data import PartitionConfig\n"
        "from tessera.data.cache import node_partition_data\n"
        f"node_partition_data('digits', partition_id=1, num_partitions=3, "
        f"partition=PartitionConfig('dirichlet', alpha=0.5, seed=3), pool_fraction=0.1, "
        f"test_fraction=0.2, cache_dir={str(tmp_path)!r})"
    )
    assert "flwr_datasets" in _loaded_after(build)

    # Execute: the next message's process finds it
    loaded = _loaded_after(build)

    # Assert
    assert loaded == []
