"""End-to-end: real Flower simulation (`flwr run .`, Ray backend) through scripts/simulate.sh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import simulate


@pytest.mark.slow
def test_fedavg_groups_simulation_picks_different_architectures(tmp_path: Path) -> None:
    # Prepare
    run_config = (
        "strategy='fedavg-groups' num-server-rounds=2 local-epochs=1 "
        "sim-device-profiles='cpu-small,cpu-large,jetson-orin'"
    )
    # Execute
    result = simulate(tmp_path, run_config)
    # Assert
    rounds = [json.loads(line) for line in (result / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    archs = {c["arch"] for r in rounds for c in r["clients"]}
    assert len(archs) >= 2, archs
    for r in rounds:
        assert r["num_ok"] == 3 and r["num_rejected"] == 0
        for c in r["clients"]:
            assert c["bytes_up"] > 0 and c["bytes_down"] > 0
            assert 0.0 <= c["test_accuracy"] <= 1.0
    config = json.loads((result / "config.json").read_text())
    profiles = {n["profile"]["name"] for n in config["nodes"]}
    assert profiles == {"cpu-small", "cpu-large", "jetson-orin"}
    summary = json.loads((result / "summary.json").read_text())
    assert summary["rounds"] == 2
    for png in ("accuracy.png", "bytes.png", "label_distribution.png"):
        assert (result / png).stat().st_size > 1000
