"""End-to-end: real Flower simulation (`flwr run .`, Ray backend) through scripts/simulate.sh."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tessera.checkpoint import load_state
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


@pytest.mark.slow
def test_resume_in_simulation_runs_every_round_once_and_reaches_the_same_model(
    tmp_path: Path,
) -> None:
    # Prepare
    base = (
        "strategy='fedavg-groups' local-epochs=1 "
        "sim-device-profiles='cpu-small,cpu-large,jetson-orin'"
    )

    # Execute: 4 rounds at once; then 2 rounds, and a new `flwr run` resuming to 4
    whole = simulate(tmp_path / "whole", f"{base} num-server-rounds=4")
    part = simulate(tmp_path / "part", f"{base} num-server-rounds=2")
    assert [json.loads(x)["round"] for x in (part / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]
    resumed = simulate(tmp_path / "part", f"{base} num-server-rounds=4 resume='{part}'")

    # Assert: one metrics.jsonl with rounds 1..4 exactly once
    assert resumed == part
    rounds = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    summary = json.loads((part / "summary.json").read_text())
    assert summary["rounds"] == 4
    # ... and the final global models equal those of the uninterrupted run (the
    # checkpoint after round 4 holds them)
    got = load_state(part / "checkpoint.npz")
    want = load_state(whole / "checkpoint.npz")
    assert got["round"] == want["round"] == 4
    assert got["group_models"].keys() == want["group_models"].keys()
    for arch, arrays in want["group_models"].items():
        for key, value in arrays.items():
            np.testing.assert_allclose(
                got["group_models"][arch][key], value, rtol=0, atol=1e-6, err_msg=f"{arch}/{key}"
            )
