"""End-to-end: real Flower simulation (`flwr run .`, Ray backend) through scripts/simulate.sh."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server_app.app import build_server
from strategies.core.strategy import RunStoppedError
from tessera.checkpoint import load_state
from tests.conftest import make_grid, simulate


@pytest.mark.slow
def test_the_main_job_prints_what_the_readme_shows_and_picks_different_architectures(
    tmp_path: Path,
) -> None:
    from tessera.report import current_block, readme_block

    # Execute: the README's demo, as `bash scripts/simulate.sh` runs it (default config)
    result = simulate(tmp_path, "", nodes=6)

    # Assert: the README's block is this run's, to the digit
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert readme_block(result) == current_block(readme), (
        "the README's demo block is stale: run `bash scripts/readme-demo.sh` and commit "
        "README.md\n" + readme_block(result)
    )
    rounds = [json.loads(line) for line in (result / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5]
    archs = {c["arch"] for r in rounds for c in r["clients"]}
    assert len(archs) >= 2, archs
    for r in rounds:
        assert r["num_ok"] == 6 and r["num_rejected"] == 0
        for c in r["clients"]:
            assert c["bytes_up"] > 0 and c["bytes_down"] > 0
            assert 0.0 <= c["test_accuracy"] <= 1.0
    config = json.loads((result / "config.json").read_text())
    profiles = {n["profile"]["name"] for n in config["nodes"]}
    assert profiles == {"cpu-small", "cpu-large", "jetson-orin"}
    summary = json.loads((result / "summary.json").read_text())
    assert summary["rounds"] == 5
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
    got_models, want_models = got["group_models"]["arrays"], want["group_models"]["arrays"]
    assert got_models.keys() == want_models.keys()
    for arch, arrays in want_models.items():
        for key, value in arrays.items():
            np.testing.assert_allclose(
                got_models[arch][key], value, rtol=0, atol=1e-6, err_msg=f"{arch}/{key}"
            )
    # ... and the clipping bound carried over the restart (the medians are checkpointed)
    want_medians = want["group_models"]["medians"]
    assert got["group_models"]["medians"].keys() == want_medians.keys()
    for arch, medians in want_medians.items():
        for kind, value in medians.items():
            assert got["group_models"]["medians"][arch][kind] == pytest.approx(value, rel=1e-5)


@pytest.mark.slow
def test_hostile_nodes_are_bounded_in_real_simulation(
    tmp_path: Path,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
) -> None:
    # Prepare: eight nodes, three of them hostile (more than one in five), drawn by
    # the run config's seeded attack draw: one sends every learned weight as
    # +-1e30 (dense-scale), one the reverse of its update just under the bound
    # (bound-riding), one claims 1000x its training set in a self-consistent
    # handshake and its replies (inflate). Default defences.
    base: dict[str, Any] = {
        "strategy": "fedavg",
        "fedavg-arch": "cnn-2",
        "num-server-rounds": 5,
        "local-epochs": 1,
        "attack-fraction": 0.375,
    }
    attacks = "attack='dense-scale,bound-riding,inflate'"
    hostile = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in base.items())

    def reference(extra: dict[str, Any], name: str) -> float:
        """The same federation on the in-process grid (same handlers, split, seeds)."""
        config = run_config(
            {**base, **extra, "output-dir": str(tmp_path / name), "run-name": name}
            | {"min-nodes": 8}
        )
        server = build_server(config, bundle=digits_bundle).runner
        # the undefended run may stop early (the attack broke every client's training)
        with contextlib.suppress(RunStoppedError):
            server.start(make_grid(config, 8), num_rounds=5, timeout=30.0)
        accuracy: float = server.rounds[-1]["global_accuracy"] or 0.0
        return accuracy

    # Execute: the attacked run in real simulation; the clean run, and the attacked
    # run with no defence (clip-factor=0: no bound, no direction check; weight-cap=0
    # leaves each node's own claimed num-train), as references
    result = simulate(tmp_path, f"{hostile} {attacks}", nodes=8)
    clean_acc = reference({}, "clean")
    undefended_acc = reference(
        {
            "attack": "dense-scale,bound-riding,inflate",
            "clip-factor": 0.0,
            "weight-cap": 0.0,
        },
        "undefended",
    )

    # Assert: every round ran with every node; the dense and bound-riding nodes were
    # clipped or dropped every round; the inflating node never weighed more than
    # twice the cohort's median
    rounds = [json.loads(line) for line in (result / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((result / "config.json").read_text())
    plan = config["attack"]["partitions"]
    assert sorted(plan.values()) == ["bound-riding", "dense-scale", "inflate"]
    by_attack = {attack: int(p) for p, attack in plan.items()}
    for r in rounds:
        assert not r["skipped"] and r["num_failed"] == 0 and r["num_ok"] == 8, r
        node_of = {a["partition_id"]: a["node"] for a in r["attackers"]}
        bounded = {c["node"] for c in r["clipped"]}
        assert node_of[by_attack["dense-scale"]] in bounded, r["clipped"]
        assert node_of[by_attack["bound-riding"]] in bounded, r["clipped"]
    # Assert: with no defence the model is destroyed (chance level); with the
    # defaults it stays close to the clean run
    attacked_acc = rounds[-1]["global_accuracy"]
    assert undefended_acc <= 0.15, undefended_acc
    assert attacked_acc >= clean_acc - 0.1, (attacked_acc, clean_acc)


PERSONALISE_IN_SIM = {"flexifed": "finetune", "nefl": "ditto"}


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["heterofl", "flexifed", "nefl", "fedfa"])
def test_submodel_schemes_train_slices_in_real_simulation(scheme: str, tmp_path: Path) -> None:
    # a weak and a strong device pick different slices of preresnet26_025; static
    # batch norm as in the schemes' papers (with plain batch norm the averaged
    # running statistics fit no slice and the global model can sit at chance)
    # two of them personalise too (run-config personalise in real simulation: the
    # personal parts in node state, the records naming the mode)
    personalise = PERSONALISE_IN_SIM.get(scheme, "none")
    run_config = (
        f"strategy='{scheme}' num-server-rounds=2 local-epochs=1 model-family='preresnet' "
        "submodel-widths='1,0.25' sim-device-profiles='cpu-small,jetson-orin' "
        f"norm='static-batch' personalise='{personalise}'"
    )
    rounds = [
        json.loads(line)
        for line in (simulate(tmp_path, run_config) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["round"] for r in rounds] == [1, 2]
    archs = {c["arch"] for r in rounds for c in r["clients"]}
    assert len(archs) >= 2 and all(a.startswith("preresnet26_025@") for a in archs), archs
    for r in rounds:
        assert r["num_ok"] == 3 and r["num_rejected"] == 0
        assert set(r["submodel_accuracy"]) >= {"preresnet26_025"}
        assert sum(r["slices"].values()) == 3
        assert r["personalise"] == personalise
        # finetune and ditto also measure the shared model on the same splits
        assert (r["shared_accuracy_mean"] is not None) == (personalise != "none")
    # measured in process with this config, fedfa over seeds 1, 2, 3, 42: 0.48-0.67
    # after round 2 (chance is 0.1; with norm='batch' it stayed at 0.10-0.13)
    assert rounds[-1]["global_accuracy"] > 0.25


@pytest.mark.slow
def test_ensemble_with_a_mixed_family_fleet_in_real_simulation(tmp_path: Path) -> None:
    import subprocess
    import sys

    from models import list_models, model_entry

    # Prepare: the default family of the ensemble scheme is "mixed"; a weak and a
    # strong device pick models of different families
    run_config = (
        "strategy='ensemble' num-server-rounds=2 local-epochs=1 "
        "sim-device-profiles='cpu-small,jetson-orin' ensemble-optimizer='random,gradient' "
        "ensemble-trials=20"
    )

    # Execute
    result = simulate(tmp_path, run_config)

    # Assert: two families trained, the last round tuned, the artifact labels data
    rounds = [json.loads(line) for line in (result / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    archs = {c["arch"] for r in rounds for c in r["clients"]}
    assert archs <= set(list_models("mixed")) and len({model_entry(a).family for a in archs}) == 2
    assert all(r["num_ok"] == 3 and r["num_rejected"] == 0 for r in rounds)
    entry = rounds[-1]["ensemble"]
    assert set(entry["optimizers"]) == {"uniform", "random", "gradient"}
    assert sorted(entry["members"]) == sorted(archs)
    assert (result / "ensemble_alpha.png").stat().st_size > 1000
    data = tmp_path / "data.npz"
    from tessera.data import load_bundle

    test = load_bundle("digits").test
    np.savez(data, x=test.x, y=test.y)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strategies.ensemble",
            "predict",
            str(result / "ensemble.npz"),
            str(data),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    accuracy = float(proc.stdout.split("accuracy ")[1].split()[0])
    assert accuracy == pytest.approx(rounds[-1]["ensemble_accuracy"], abs=1e-4)


@pytest.mark.slow
def test_fedtgp_trains_its_global_prototypes_in_real_simulation(tmp_path: Path) -> None:
    # Prepare: three devices choosing three CNN sizes (as in tests/test_prototypes.py)
    run_config = (
        "strategy='fedtgp' num-server-rounds=2 local-epochs=1 train-time-budget=0.008 "
        "sim-device-profiles='cpu-small,cpu-large,jetson-orin'"
    )

    # Execute
    rounds = [
        json.loads(line)
        for line in (simulate(tmp_path, run_config) / "metrics.jsonl").read_text().splitlines()
    ]

    # Assert: both rounds ran with every node, prototypes only (no weights), the server
    # trained its prototypes each round, the personal models are above chance (0.1)
    assert [r["round"] for r in rounds] == [1, 2]
    assert len({c["arch"] for r in rounds for c in r["clients"]}) >= 2
    for r in rounds:
        assert not r["skipped"] and r["num_ok"] == 3 and r["num_rejected"] == 0, r
        assert r["prototype_classes"] == 10 and r["global_accuracy"] is None
        assert r["fedtgp_steps"] > 0 and 0 < r["fedtgp_margin"] <= 100.0
        assert all(c["bytes_up"] < 16_384 for c in r["clients"])
    assert rounds[-1]["personal_accuracy_mean"] > 0.2
    assert rounds[-1]["proto_accuracy_mean"] is not None
