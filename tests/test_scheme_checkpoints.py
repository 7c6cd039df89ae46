"""Schemes' own checkpoint entries are checked before use (issue 23, the remaining call sites).

A real one-round state of each scheme (Felo, Velo, FedHeNN heterogeneous, FlexiFed
basic-common) is tampered with - a NaN array, a wrong shape, a wrong type, a value out
of range - written as a checkpoint and read back; restoring it into a freshly built
server must raise a :class:`~tessera.checkpoint.CheckpointError` naming the file, the
field and the fix, and leave the scheme's own state unassigned. ``ResultsWriter.resume``
refuses a checkpoint round or a ``metrics.jsonl`` record that is not an integer round.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from server_app.app import build_server
from strategies.felo.server import knowledge_from_state
from tessera.checkpoint import CheckpointError, StateTree, load_state, save_state
from tessera.config import ConfigError
from tessera.results import ResultsWriter
from tests.conftest import install_fast_clients, make_grid, torch_threads
from tests.test_felo import THREE_ARCHS
from tests.test_strategies import TINY, run_federation
from tests.test_submodel_schemes import SUBMODEL

FIX = "start afresh without run-config 'resume'"
SHALLOW, DEEP = "preresnet26_025@w1-d2.2.2.2", "preresnet26_025@w1-d3.3.3.3"

RUNS: dict[str, dict[str, Any]] = {
    "felo": {**THREE_ARCHS, "strategy": "felo", "num-server-rounds": 1},
    "velo": {**THREE_ARCHS, "strategy": "velo", "cvae-epochs": 2, "num-server-rounds": 1},
    # two rounds planned, one run: round 1's probe builds the K_bar target of round 2
    "fedhenn": {
        **TINY,
        "strategy": "fedhenn",
        "fedhenn-mode": "heterogeneous",
        "eta0": 1.0,
        "num-server-rounds": 2,
    },
    "flexifed": {
        **SUBMODEL,
        "strategy": "flexifed",
        "flexifed-strategy": "basic-common",
        # the pool direction is built for a sharing group's name ("a+b"), which is no
        # architecture: it fails every reply today, so no personal entries would exist
        "server-trust": False,
        "min-nodes": 2,
        "num-server-rounds": 1,
    },
}
"""Run-config overrides of each scheme's one-round run."""


@dataclasses.dataclass(frozen=True)
class Trained:
    """A scheme after one round: its run-config and its state (``state_dict()``)."""

    config: dict[str, Any]
    state: dict[str, Any]


def _run_flexifed(config: dict[str, Any], bundle: Any, tmp_path: Path) -> Any:
    """Run flexifed one round on two nodes forced to a shallow and a deep slice."""
    config = {**config, "output-dir": str(tmp_path), "run-name": "r"}
    server = build_server(config, bundle=bundle).runner
    grid = make_grid(config, 2)
    for i, node in enumerate(sorted(grid.contexts)):
        grid.contexts[node].node_config["arch"] = SHALLOW if i % 2 else DEEP
    server.start(grid, num_rounds=1, timeout=60.0)
    return server


@pytest.fixture(scope="module")
def trained(
    default_run_config: dict[str, Any],
    digits_bundle: Any,
    candidate_cost_cache: dict[tuple[Any, ...], Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], Trained]]:
    """``trained(name)``: the state after one round of ``RUNS[name]``, run on first use."""
    done: dict[str, Trained] = {}
    with pytest.MonkeyPatch.context() as mp, torch_threads(1):
        install_fast_clients(mp, digits_bundle, candidate_cost_cache)

        def get(name: str) -> Trained:
            if name not in done:
                config = {**default_run_config, **RUNS[name]}
                folder = tmp_path_factory.mktemp(name)
                if name == "flexifed":
                    server = _run_flexifed(config, digits_bundle, folder)
                else:
                    server = run_federation(
                        config, digits_bundle, folder / "run", num_rounds=1
                    ).server
                done[name] = Trained(config, server.state_dict())
            return done[name]

        yield get


def fresh_server(trained: Trained, bundle: Any, tmp_path: Path) -> Any:
    """A newly built server of the same run-config (what a resume builds)."""
    config = {**trained.config, "output-dir": str(tmp_path), "run-name": "fresh"}
    return build_server(config, bundle=bundle).runner


def saved_tree(tmp_path: Path, state: dict[str, Any]) -> StateTree:
    """Write ``state`` as a checkpoint and read it back (a tree that knows its file)."""
    path = tmp_path / "checkpoint.npz"
    save_state(path, state)
    return load_state(path)


def node_ids(state: dict[str, Any]) -> list[str]:
    return sorted(str(entry["node"]) for entry in state["nodes"])


def nothing_restored(name: str, server: Any) -> bool:
    """Whether the scheme's own state of ``server`` is still that of a new server."""
    if name in ("felo", "velo"):
        velo_empty = name == "felo" or (server.feature_bank == [] and server.cvae is None)
        return (
            server.targets is None
            and server.models.arrays == {}
            and server.knowledge_scales == {}
            and velo_empty
        )
    if name == "fedhenn":
        return server.target is None and server.rad_holders == {}
    return bool(server.personal == {})


# ------------------------------------------------------------------ tamperings
def _set(path: str, value: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    """A tampering that replaces the entry at dotted ``path`` by ``value(old)``."""

    def change(state: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        tree = state
        for key in parents:
            tree = tree[key]
        tree[last] = value(tree.get(last))

    change.__name__ = f"set {path}"
    return change


def nan(array: np.ndarray) -> np.ndarray:
    out: np.ndarray = array.astype(np.float32)
    out.flat[0] = np.nan
    return out


def extra_dim(array: np.ndarray) -> np.ndarray:
    return np.zeros((*array.shape, 2), array.dtype)


def first_cvae(state: dict[str, Any]) -> str:
    keys: list[str] = sorted(k for k in state["cvae"] if k not in ("shift", "scale"))
    return keys[0]


def _cvae_shape(state: dict[str, Any]) -> None:
    key = first_cvae(state)
    state["cvae"][key] = extra_dim(state["cvae"][key])


def _cvae_nan(state: dict[str, Any]) -> None:
    key = first_cvae(state)
    state["cvae"][key] = nan(state["cvae"][key])


def _cvae_missing(state: dict[str, Any]) -> None:
    del state["cvae"][first_cvae(state)]


def _rad_holder_unknown(state: dict[str, Any]) -> None:
    state["rad_holders"]["999"] = 1


def _rad_holder_type(state: dict[str, Any]) -> None:
    state["rad_holders"][node_ids(state)[0]] = "x"


def _personal(state: dict[str, Any]) -> tuple[str, dict[str, np.ndarray], str]:
    node = sorted(state["personal"])[0]
    own = state["personal"][node]
    return node, own, sorted(own)[0]


def _personal_nan(state: dict[str, Any]) -> None:
    _, own, key = _personal(state)
    own[key] = nan(own[key])


def _personal_shape(state: dict[str, Any]) -> None:
    _, own, key = _personal(state)
    own[key] = extra_dim(own[key])


def _personal_type(state: dict[str, Any]) -> None:
    node, _, _ = _personal(state)
    state["personal"][node] = "weights"


def _personal_entry(state: dict[str, Any]) -> None:
    _, own, _ = _personal(state)
    own["bogus.weight"] = np.zeros(2, np.float32)


def _personal_node(state: dict[str, Any]) -> None:
    _, own, _ = _personal(state)
    state["personal"]["999"] = dict(own)


TAMPERINGS = [
    # felo: the class targets
    ("felo", _set("targets.logits", nan), r"'targets\.logits' holds NaN"),
    (
        "felo",
        _set("targets.features", lambda f: f[:, :3]),
        r"'targets\.features' is float32 \(10, 3\); expected shape \(10, 128\)",
    ),
    ("felo", _set("targets.class_ids", lambda _: "abc"), r"'targets\.class_ids' is str"),
    (
        "felo",
        _set("targets.class_ids", lambda ids: ids + 5),
        r"'targets\.class_ids' holds \[10, 11, 12, 13, 14\], outside the task's classes",
    ),
    ("felo", _set("targets.counts", lambda c: c * 0), r"'targets\.counts' holds a count <= 0"),
    ("felo", _set("targets", lambda _: [1]), r"'targets' is \[1\] \(list\); expected a mapping"),
    # felo: the knowledge scales (a restored bound is never switched off)
    (
        "felo",
        _set("knowledge_scales.logits", lambda _: float("nan")),
        r"'knowledge_scales\.logits' is nan",
    ),
    (
        "felo",
        _set("knowledge_scales.features", lambda _: 1e30),
        r"'knowledge_scales\.features' is 1e\+30",
    ),
    (
        "felo",
        _set("knowledge_scales.weights", lambda _: 1.0),
        r"'knowledge_scales\.weights' is not a kind",
    ),
    # velo: the feature bank and the CVAE
    ("velo", _set("bank_features", nan), r"'bank_features' holds NaN"),
    (
        "velo",
        _set("bank_sizes", lambda s: s + 1),
        r"'bank_ids' is int64 \(30,\); expected shape \(33,\)",
    ),
    ("velo", _set("bank_ids", lambda _: [1, 2]), r"'bank_ids' is list; expected an array"),
    ("velo", _set("bank_rounds", lambda r: r + 5), r"'bank_rounds' holds rounds 6 to 6"),
    ("velo", _set("cvae_classes", lambda c: c - 3), r"'cvae_classes' holds \[-3, -2, -1\]"),
    ("velo", _cvae_shape, r"'cvae\.decoder\.0\.bias' is float32 \(128, 2\) but the model has"),
    ("velo", _cvae_nan, r"'cvae\.decoder\.0\.bias' holds NaN"),
    ("velo", _cvae_missing, r"'cvae' does not have the model's entries: missing \['decoder"),
    ("velo", _set("cvae.scale", lambda s: s * 0), r"'cvae\.scale' holds a value <= 0"),
    ("velo", _set("targets.logits", nan), r"'targets\.logits' holds NaN"),
    # fedhenn: the K_bar target and who holds which RAD
    ("fedhenn", _set("target.x", nan), r"'target\.x' holds NaN"),
    (
        "fedhenn",
        _set("target.x", lambda x: x[:-1]),
        r"'target\.x' is float16 \(143, 1, 8, 8\); expected shape \(144, 1, 8, 8\)",
    ),
    ("fedhenn", _set("target.factor", lambda _: "abc"), r"'target\.factor' is str"),
    ("fedhenn", _set("target.factor", nan), r"'target\.factor' holds NaN"),
    (
        "fedhenn",
        _set("target.factor", lambda f: f * 300),
        r"'target\.factor' has largest magnitude 300",
    ),
    ("fedhenn", _set("target.rank", lambda r: r + 1), r"'target\.rank' is \d+ but the factor"),
    ("fedhenn", _set("target.rank", lambda _: "7"), r"'target\.rank' is '7' \(str\)"),
    ("fedhenn", _set("target.energy", lambda _: 2.0), r"'target\.energy' is 2\.0; expected"),
    ("fedhenn", _set("target.cka", lambda _: float("nan")), r"'target\.cka' is nan"),
    (
        "fedhenn",
        _set("target.built_in_round", lambda _: 99),
        r"'target\.built_in_round' is 99, after the checkpoint's round 1",
    ),
    ("fedhenn", _rad_holder_unknown, r"'rad_holders\.999' is not a node id"),
    ("fedhenn", _rad_holder_type, r"'rad_holders\.\d+' is 'x' \(str\)"),
    # flexifed: the personal entries of basic-common
    ("flexifed", _personal_nan, r"'personal\.\d+\.\S+' holds NaN"),
    ("flexifed", _personal_shape, r"'personal\.\d+\.\S+' is float32 \(.*\) but the model has"),
    ("flexifed", _personal_type, r"'personal\.\d+' is str; expected a mapping"),
    ("flexifed", _personal_entry, r"'personal\.\d+' .*unexpected \['bogus\.weight'\]"),
    ("flexifed", _personal_node, r"'personal\.999' is not a node id"),
]


@pytest.mark.parametrize(
    ("name", "change", "match"),
    TAMPERINGS,
    ids=[f"{name}-{change.__name__}" for name, change, _ in TAMPERINGS],
)
def test_a_tampered_scheme_checkpoint_is_refused_naming_file_field_and_fix(
    trained: Callable[[str], Trained],
    digits_bundle: Any,
    tmp_path: Path,
    name: str,
    change: Callable[[dict[str, Any]], None],
    match: str,
) -> None:
    # Prepare
    run = trained(name)
    state = copy.deepcopy(run.state)
    change(state)
    tree = saved_tree(tmp_path, state)
    server = fresh_server(run, digits_bundle, tmp_path)

    # Execute
    with pytest.raises(CheckpointError) as info:
        server.load_state_dict(tree)

    # Assert: file, field and fix named; nothing of the scheme's own state assigned
    message = str(info.value)
    assert str(tmp_path / "checkpoint.npz") in message, message
    assert re.search(f"field {match}", message), message
    assert FIX in message, message
    assert nothing_restored(name, server)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_an_intact_scheme_checkpoint_is_restored(
    trained: Callable[[str], Trained], digits_bundle: Any, tmp_path: Path, name: str
) -> None:
    # Prepare
    run = trained(name)
    tree = saved_tree(tmp_path, run.state)
    server = fresh_server(run, digits_bundle, tmp_path)

    # Execute
    server.load_state_dict(tree)

    # Assert: the restored server writes back what it read
    again = server.state_dict()
    if name in ("felo", "velo"):
        for key, value in run.state["targets"].items():
            np.testing.assert_array_equal(again["targets"][key], value)
        assert again["knowledge_scales"] == run.state["knowledge_scales"]
    if name == "felo":  # round 1 set the scales the next round's fold bounds by
        assert set(run.state["knowledge_scales"]) == {"logits", "features"}
    if name == "velo":
        for key in ("bank_rounds", "bank_sizes", "bank_ids", "bank_features", "cvae_classes"):
            np.testing.assert_array_equal(again[key], run.state[key])
        for key, value in run.state["cvae"].items():
            np.testing.assert_array_equal(again["cvae"][key], value)
        assert server.cvae is not None
    if name == "fedhenn":
        assert again["rad_holders"] == run.state["rad_holders"]
        for key, value in run.state["target"].items():
            np.testing.assert_array_equal(again["target"][key], value)
    if name == "flexifed":
        assert run.state["personal"], "basic-common should keep personal entries"
        assert sorted(again["personal"]) == sorted(run.state["personal"])
        for node, own in run.state["personal"].items():
            for key, value in own.items():
                np.testing.assert_array_equal(again["personal"][node][key], value)


def test_a_tampered_velo_checkpoint_is_refused_when_resuming(
    trained: Callable[[str], Trained], digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: a results folder whose checkpoint's CVAE has a NaN weight
    run = trained("velo")
    state = copy.deepcopy(run.state)
    _cvae_nan(state)
    folder = tmp_path / "r"
    save_state(folder / "checkpoint.npz", state)
    config = {**run.config, "output-dir": str(tmp_path), "run-name": "r", "resume": str(folder)}

    # Execute / Assert: the ServerApp's build refuses it with a ConfigError
    with pytest.raises(ConfigError, match=r"field 'cvae\.decoder\.0\.bias' holds NaN") as info:
        build_server(config, bundle=digits_bundle)
    assert str(folder / "checkpoint.npz") in str(info.value)


def test_fedhe_targets_with_features_are_refused(tmp_path: Path) -> None:
    # Prepare: FedHe exchanges logits only, so its targets carry no features
    targets = {
        "class_ids": np.arange(2),
        "counts": np.ones(2, np.int64),
        "logits": np.zeros((2, 10), np.float32),
        "features": np.zeros((2, 4), np.float32),
    }
    tree = saved_tree(tmp_path, {"targets": targets})

    # Execute / Assert
    with pytest.raises(CheckpointError, match=r"field 'targets\.features' holds features, but"):
        knowledge_from_state(tree["targets"], num_classes=10, feature_dim=None)
    back = knowledge_from_state(tree["targets"], num_classes=10, feature_dim=4)
    assert back.features is not None and back.features.shape == (2, 4)


def test_a_cvae_checkpoint_restores_the_weights(tmp_path: Path) -> None:
    # Prepare: hand-built CVAE weights, read back through a checkpoint
    from strategies.felo.cvae import CVAE, CVAEConfig
    from strategies.felo.velo import checked_cvae

    config = CVAEConfig(feature_dim=3, num_classes=2, latent_dim=2, hidden_dim=4)
    torch.manual_seed(0)
    weights = {k: v.numpy().copy() for k, v in CVAE(config).state_dict().items()}
    weights["scale"] = np.full(3, 2.0, np.float32)
    tree = saved_tree(tmp_path, {"cvae": weights})

    # Execute
    model = checked_cvae(tree, "cvae", config)

    # Assert
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), weights[key])
    with pytest.raises(
        CheckpointError,
        match=r"field 'cvae\.shift' is float32 \(3,\) but the model has float32 \(4,\)",
    ):
        checked_cvae(tree, "cvae", CVAEConfig(feature_dim=4, num_classes=2))


# ================================================================ results folder
def results_folder(tmp_path: Path, round_value: Any, lines: list[str]) -> Path:
    """A run folder with a checkpoint of ``round_value`` and ``metrics.jsonl`` lines."""
    folder = tmp_path / "run"
    save_state(folder / "checkpoint.npz", {"round": round_value})
    (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


@pytest.mark.parametrize("round_value", ["abc", -1, 1.5, [2], None])
def test_resume_refuses_a_checkpoint_round_that_is_not_an_integer(
    tmp_path: Path, round_value: Any
) -> None:
    # Prepare
    lines = [json.dumps({"round": 1}), json.dumps({"round": 2})]
    folder = results_folder(tmp_path, round_value, lines)

    # Execute / Assert
    with pytest.raises(CheckpointError) as info:
        ResultsWriter.resume(folder)
    message = str(info.value)
    assert str(folder / "checkpoint.npz") in message
    assert re.search(r"field 'round' is .*expected an integer >= 0", message), message
    assert FIX in message
    assert (folder / "metrics.jsonl").read_text().splitlines() == lines  # not rewritten


@pytest.mark.parametrize(
    ("bad_line", "match"),
    [
        (json.dumps({"round": "abc"}), r"line 2: field 'round' is 'abc' \(str\)"),
        (json.dumps([2]), r"line 2: holds a JSON list, not a round record"),
        (json.dumps({"round": True}), r"line 2: field 'round' is True \(bool\)"),
    ],
)
def test_resume_refuses_a_metrics_record_whose_round_is_not_an_integer(
    tmp_path: Path, bad_line: str, match: str
) -> None:
    # Prepare
    lines = [json.dumps({"round": 1}), bad_line, json.dumps({"round": 3})]
    folder = results_folder(tmp_path, 2, lines)

    # Execute / Assert
    with pytest.raises(CheckpointError, match=match) as info:
        ResultsWriter.resume(folder)
    assert str(folder / "metrics.jsonl") in str(info.value)
    assert "without run-config 'resume'" in str(info.value)
    assert (folder / "metrics.jsonl").read_text().splitlines() == lines


def test_resume_keeps_the_records_up_to_the_checkpoint_and_drops_a_cut_line(
    tmp_path: Path,
) -> None:
    # Prepare: round 3's line was cut by the crash
    lines = [json.dumps({"round": 1}), json.dumps({"round": 2}), '{"round": 3, "clie']
    folder = results_folder(tmp_path, 1, lines)

    # Execute
    writer, state = ResultsWriter.resume(folder)

    # Assert
    assert state["round"] == 1
    assert writer.rounds == [{"round": 1}]
    assert (folder / "metrics.jsonl").read_text() == '{"round": 1}\n'
