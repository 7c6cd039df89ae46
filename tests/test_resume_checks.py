"""A checkpoint is checked before a resume uses it, and a refused one changes nothing.

Each test builds a real server of a scheme (``build_server``), gives it the state a
round leaves (group weights, and the scheme's own entries), tampers with the state,
writes it as the checkpoint of a results folder whose ``metrics.jsonl`` holds rounds
1 and 2, and resumes from that folder through the ServerApp's build. A bad
checkpoint must be refused with a :class:`~tessera.config.ConfigError` naming the
file, the field and the fix, and ``metrics.jsonl`` must be left as it was; an
intact one is restored and the rounds after it are cut from ``metrics.jsonl``.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server_app.app import build_server
from strategies.core.aggregators import AccumulatorReport, get_aggregator
from strategies.core.groups import GroupModels
from tessera.checkpoint import CheckpointError, load_state, save_state
from tessera.config import ConfigError
from tests.conftest import TINY_DIGITS
from tests.test_submodel_schemes import SUBMODEL

FIX = "start afresh without run-config 'resume'"
LINES = [json.dumps({"round": 1}), json.dumps({"round": 2})]
"""``metrics.jsonl`` of every folder resumed: round 2 ran after the checkpoint."""
RunConfig = Callable[..., dict[str, Any]]
Change = Callable[[dict[str, Any]], None]


def base_config(strategy: str, tmp_path: Path) -> dict[str, Any]:
    """Run-config overrides of the runs these tests resume."""
    extra: dict[str, Any] = {"model-family": "cnn"}
    if strategy in ("fedfa", "heterofl", "nefl"):
        extra = dict(SUBMODEL)
    if strategy == "ensemble":
        extra["ensemble-optimizer"] = "gradient"
    return {**TINY_DIGITS, **extra, "strategy": strategy, "output-dir": str(tmp_path)}


def after_one_round(run_config: RunConfig, bundle: Any, tmp_path: Path, strategy: str) -> Any:
    """A freshly built server given the state one round leaves (its weights built)."""
    config = run_config({**base_config(strategy, tmp_path), "run-name": "first"})
    server = build_server(config, bundle=bundle).runner
    if strategy in ("fedfa", "heterofl", "nefl"):
        server.global_state  # noqa: B018 - builds the global model's group
    else:
        for arch in ("cnn-1", "cnn-2"):
            server.models.get(arch)
    server.completed_round = 1
    return server


def resume(
    run_config: RunConfig, bundle: Any, tmp_path: Path, strategy: str, state: dict[str, Any]
) -> tuple[Any, Path]:
    """Write ``state`` as a results folder's checkpoint and resume from it."""
    folder = tmp_path / "resumed"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in LINES))
    save_state(folder / "checkpoint.npz", state)
    config = run_config(
        {**base_config(strategy, tmp_path), "num-server-rounds": 2, "resume": str(folder)}
    )
    return build_server(config, bundle=bundle), folder


def tampered(state: dict[str, Any], change: Change) -> dict[str, Any]:
    copied = copy.deepcopy(state)
    change(copied)
    return copied


def refused(
    run_config: RunConfig, bundle: Any, tmp_path: Path, strategy: str, state: dict[str, Any]
) -> tuple[str, Path]:
    """Resume from ``state``, which must be refused; return the message and the folder."""
    folder = tmp_path / "resumed"
    with pytest.raises(ConfigError) as info:
        resume(run_config, bundle, tmp_path, strategy, state)
    # nothing was rewritten: the rounds after the checkpoint are still there
    assert (folder / "metrics.jsonl").read_text().splitlines() == LINES
    return str(info.value), folder


def assert_names_file_field_and_fix(message: str, folder: Path, field: str) -> None:
    assert str(folder / "checkpoint.npz") in message, message
    assert re.search(f"field '{field}", message), message
    assert FIX in message, message


# ================================================================ group models
def _set(key: str, value: Any) -> Change:
    def change(state: dict[str, Any]) -> None:
        state[key] = value

    change.__name__ = f"{key}={value!r}"
    return change


def _without(key: str) -> Change:
    def change(state: dict[str, Any]) -> None:
        del state[key]

    change.__name__ = f"no {key}"
    return change


def _no_arrays(state: dict[str, Any]) -> None:
    state["group_models"]["arrays"] = {}


def _legacy_empty(state: dict[str, Any]) -> None:
    state["group_models"] = {}


GROUP_MODELS = [
    (_set("group_models", [1, 2]), r"group_models' is \[1, 2\] \(list\); expected a mapping"),
    (_set("group_models", "abc"), r"group_models' is 'abc' \(str\); expected a mapping"),
    (_set("group_models", 5), r"group_models' is 5 \(int\); expected a mapping"),
    (_without("group_models"), r"group_models' is missing"),
    (_no_arrays, r"group_models\.arrays' holds no group's weights"),
    (_legacy_empty, r"group_models' holds no group's weights"),
]


@pytest.mark.parametrize(
    ("change", "match"), GROUP_MODELS, ids=[c.__name__ for c, _ in GROUP_MODELS]
)
def test_group_models_of_the_wrong_type_or_missing_are_refused(
    run_config: RunConfig,
    digits_bundle: Any,
    tmp_path: Path,
    change: Change,
    match: str,
) -> None:
    # Prepare
    state = after_one_round(run_config, digits_bundle, tmp_path, "fedavg-groups").state_dict()

    # Execute
    message, folder = refused(
        run_config, digits_bundle, tmp_path, "fedavg-groups", tampered(state, change)
    )

    # Assert
    assert_names_file_field_and_fix(message, folder, "group_models")
    assert re.search(match, message), message


@pytest.mark.parametrize("value", [[1, 2], "abc", 5])
def test_group_models_load_refuses_a_value_that_is_not_a_mapping(value: Any) -> None:
    # Prepare
    models = GroupModels(get_aggregator("mean"), lambda arch: {})

    # Execute / Assert
    with pytest.raises(CheckpointError, match=r"field 'group_models' is .*; expected a mapping"):
        models.load_state_dict(value)
    assert models.arrays == {}


@pytest.mark.parametrize("scheme", ["fedfa", "heterofl", "nefl"])
def test_a_submodel_checkpoint_without_its_global_model_is_refused(
    run_config: RunConfig, digits_bundle: Any, tmp_path: Path, scheme: str
) -> None:
    # Prepare: the global model's entry taken out (any per-slice entries kept)
    state = after_one_round(run_config, digits_bundle, tmp_path, scheme).state_dict()
    del state["group_models"]["arrays"]["preresnet26_025"]

    # Execute
    message, folder = refused(run_config, digits_bundle, tmp_path, scheme, state)

    # Assert
    assert_names_file_field_and_fix(message, folder, "group_models.arrays")
    assert "holds no weights of ['preresnet26_025']" in message, message


# ============================================================ base entries
def _other_seed(state: dict[str, Any]) -> None:
    state["run_config"]["seed"] = state["run_config"]["seed"] + 1


def test_a_checkpoint_of_another_experiment_leaves_metrics_untouched_and_names_the_file(
    run_config: RunConfig, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare
    state = after_one_round(run_config, digits_bundle, tmp_path, "fedavg-groups").state_dict()

    # Execute
    message, folder = refused(
        run_config, digits_bundle, tmp_path, "fedavg-groups", tampered(state, _other_seed)
    )

    # Assert
    assert f"checkpoint {folder / 'checkpoint.npz'}" in message, message
    assert re.search(r"differ .*\(seed: 43 -> 42\); use the original values", message), message


@pytest.mark.parametrize(
    ("change", "field", "match"),
    [
        (_without("scheme"), "scheme", r"'scheme' is missing"),
        (_set("scheme", 7), "scheme", r"'scheme' is 7 \(int\); expected a string"),
        (_set("round", 10**30), "round", r"'round' is 10{30}; expected at most 100000"),
    ],
    ids=["no-scheme", "scheme-int", "round-huge"],
)
def test_a_bad_scheme_or_round_is_refused_naming_file_field_and_fix(
    run_config: RunConfig,
    digits_bundle: Any,
    tmp_path: Path,
    change: Change,
    field: str,
    match: str,
) -> None:
    # Prepare
    state = after_one_round(run_config, digits_bundle, tmp_path, "fedavg-groups").state_dict()

    # Execute
    message, folder = refused(
        run_config, digits_bundle, tmp_path, "fedavg-groups", tampered(state, change)
    )

    # Assert
    assert_names_file_field_and_fix(message, folder, field)
    assert re.search(match, message), message
    assert "None" not in message


def test_another_schemes_checkpoint_is_refused_naming_the_file(
    run_config: RunConfig, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare
    state = after_one_round(run_config, digits_bundle, tmp_path, "fedavg-groups").state_dict()
    state["scheme"] = "fedavg"

    # Execute
    message, folder = refused(run_config, digits_bundle, tmp_path, "fedavg-groups", state)

    # Assert
    assert f"checkpoint {folder / 'checkpoint.npz'}" in message
    assert "is of scheme 'fedavg' but run-config 'strategy' is 'fedavg-groups'" in message


def test_an_intact_checkpoint_resumes_and_cuts_the_later_rounds(
    run_config: RunConfig, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare
    original = after_one_round(run_config, digits_bundle, tmp_path, "fedavg-groups")

    # Execute
    server, folder = resume(
        run_config, digits_bundle, tmp_path, "fedavg-groups", original.state_dict()
    )

    # Assert: round 2, written after the checkpoint, is dropped (it runs again)
    assert server.runner.completed_round == 1
    assert sorted(server.runner.models.arrays) == ["cnn-1", "cnn-2"]
    assert (folder / "metrics.jsonl").read_text() == LINES[0] + "\n"
    assert server.runner.rounds == [{"round": 1}]


def test_a_refused_aggregator_leaves_no_results_folder(
    run_config: RunConfig, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: an aggregator no one registered (the server's build refuses it)
    config = run_config(
        {**base_config("fedavg-groups", tmp_path), "aggregator": "nope", "run-name": "refused"}
    )

    # Execute / Assert
    with pytest.raises(ConfigError, match="run-config 'aggregator' is 'nope'"):
        build_server(config, bundle=digits_bundle)
    assert not (tmp_path / "refused").exists()


# ===================================================================== fedfa
def fedfa_state(run_config: RunConfig, bundle: Any, tmp_path: Path) -> dict[str, Any]:
    """FedFA's state after a round: a reference per scaled layer, a statistics scale."""
    from strategies.submodel.norms import is_scaled

    server = after_one_round(run_config, bundle, tmp_path, "fedfa")
    layers = [k for k, v in server.global_state.items() if is_scaled(k, v)]
    server.references = {k: 0.5 for k in layers[:3]}
    server.statistics_report = AccumulatorReport(medians={"statistics": 0.25})
    state: dict[str, Any] = server.state_dict()
    return state


def _first_reference(value: Any) -> Change:
    def change(state: dict[str, Any]) -> None:
        refs = state["fedfa_references"]
        refs[sorted(refs)[0]] = value

    change.__name__ = f"reference={value!r}"
    return change


FEDFA = [
    (
        _set("fedfa_statistics_scale", {"statistics": 1e30}),
        r"fedfa_statistics_scale\.statistics' is 1e\+30; expected a finite number > 0 and <= ",
    ),
    (_set("fedfa_statistics_scale", {"statistics": True}), r"is True \(bool\); expected a number"),
    (_set("fedfa_statistics_scale", "abc"), r"fedfa_statistics_scale' is 'abc' \(str\)"),
    (
        _set("fedfa_statistics_scale", {"weights": 1.0}),
        r"fedfa_statistics_scale\.weights' is not a scale key",
    ),
    (_first_reference(1e30), r"fedfa_references\.\S+' is 1e\+30; expected a finite number"),
    (_first_reference(float("nan")), r"fedfa_references\.\S+' is nan"),
    (_first_reference("x"), r"fedfa_references\.\S+' is 'x' \(str\); expected a number"),
    (_first_reference({"b": 1}), r"fedfa_references\.\S+' is .* expected a number"),
    (_set("fedfa_references", [1, 2]), r"fedfa_references' is \[1, 2\] \(list\)"),
    (
        _set("fedfa_references", {"parameters": 1.0}),
        r"fedfa_references\.parameters' is not a layer FedFA scales",
    ),
]


@pytest.mark.parametrize(("change", "match"), FEDFA, ids=[c.__name__ for c, _ in FEDFA])
def test_a_bad_fedfa_scale_is_refused_naming_file_field_and_fix(
    run_config: RunConfig,
    digits_bundle: Any,
    tmp_path: Path,
    change: Change,
    match: str,
) -> None:
    # Prepare
    state = fedfa_state(run_config, digits_bundle, tmp_path)

    # Execute
    message, folder = refused(run_config, digits_bundle, tmp_path, "fedfa", tampered(state, change))

    # Assert
    assert_names_file_field_and_fix(message, folder, "fedfa_")
    assert re.search(match, message), message


def test_fedfa_scales_within_their_bounds_are_restored(
    run_config: RunConfig, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare
    state = fedfa_state(run_config, digits_bundle, tmp_path)

    # Execute
    server, _ = resume(run_config, digits_bundle, tmp_path, "fedfa", state)

    # Assert
    runner = server.runner
    assert runner.references == state["fedfa_references"] and len(runner.references) == 3
    assert runner.statistics_report.medians == {"statistics": 0.25}


# ==================================================================== fedavg
@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("nope-9", r"'shared_arch' is 'nope-9', which is not a registered model"),
        (["cnn-1"], r"'shared_arch' is \['cnn-1'\] \(list\); expected a string"),
        ("cnn-3", r"'shared_arch' is 'cnn-3', whose weights field 'group_models\.arrays'"),
    ],
)
def test_a_bad_shared_arch_is_refused_naming_file_field_and_fix(
    run_config: RunConfig, digits_bundle: Any, tmp_path: Path, value: Any, match: str
) -> None:
    # Prepare
    original = after_one_round(run_config, digits_bundle, tmp_path, "fedavg")
    original.shared_arch = "cnn-1"
    state = original.state_dict()
    state["shared_arch"] = value

    # Execute
    message, folder = refused(run_config, digits_bundle, tmp_path, "fedavg", state)

    # Assert
    assert_names_file_field_and_fix(message, folder, "shared_arch")
    assert re.search(match, message), message


def test_a_registered_shared_arch_is_restored(
    run_config: RunConfig, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare
    original = after_one_round(run_config, digits_bundle, tmp_path, "fedavg")
    original.shared_arch = "cnn-2"

    # Execute
    server, _ = resume(run_config, digits_bundle, tmp_path, "fedavg", original.state_dict())

    # Assert
    assert server.runner.shared_arch == "cnn-2"


# ================================================================== ensemble
KEPT = {"round": 1, "archs": ["cnn-1", "cnn-2"], "optimizer": "uniform"}


def _kept(**fields: Any) -> Change:
    def change(state: dict[str, Any]) -> None:
        state["ensemble"] = {**KEPT, "alpha": np.full((2, 10), 0.5).tolist(), **fields}

    change.__name__ = "kept-" + "-".join(fields)
    return change


ENSEMBLE = [
    (_set("ensemble", [1, 2]), "ensemble", r"is \[1, 2\] \(list\); expected a mapping"),
    (_set("ensemble", "abc"), "ensemble", r"is 'abc' \(str\); expected a mapping"),
    (
        _kept(alpha=np.full((2, 10), np.nan)),
        "ensemble.alpha",
        r"is float64 \(2, 10\) holding NaN or infinities; expected finite numbers of shape "
        r"\(2, 10\)",
    ),
    (_kept(alpha=[[1.0]]), "ensemble.alpha", r"is float64 \(1, 1\); expected finite"),
    (_kept(alpha=[["x"] * 10] * 2), "ensemble.alpha", r"is \[\['x', .*; expected finite numbers"),
    (_kept(archs=["cnn-1", "cnn-3"]), "ensemble.archs[1]", r"is 'cnn-3'; expected an arch"),
    (_kept(archs=5), "ensemble.archs", r"is 5 \(int\); expected a list"),
    (_kept(round=2), "ensemble.round", r"is 2, after the checkpoint's round 1"),
    (_kept(round="x"), "ensemble.round", r"is 'x' \(str\); expected an integer >= 1"),
    (_kept(optimizer="magic"), "ensemble.optimizer", r"is 'magic'; expected 'uniform' or"),
]


@pytest.mark.parametrize(
    ("change", "field", "match"), ENSEMBLE, ids=[c.__name__ for c, _, _ in ENSEMBLE]
)
def test_a_bad_kept_ensemble_is_refused_naming_file_field_and_fix(
    run_config: RunConfig,
    digits_bundle: Any,
    tmp_path: Path,
    change: Change,
    field: str,
    match: str,
) -> None:
    # Prepare
    state = after_one_round(run_config, digits_bundle, tmp_path, "ensemble").state_dict()

    # Execute
    message, folder = refused(
        run_config, digits_bundle, tmp_path, "ensemble", tampered(state, change)
    )

    # Assert
    assert_names_file_field_and_fix(message, folder, re.escape(field))
    assert re.search(f"field '{re.escape(field)}' {match}", message), message


def test_a_kept_ensemble_is_restored_and_exports_an_artifact_that_loads(
    run_config: RunConfig, digits_bundle: Any, tmp_path: Path
) -> None:
    from strategies.ensemble.artifact import load_ensemble

    # Prepare: uniform weights kept after round 1
    state = after_one_round(run_config, digits_bundle, tmp_path, "ensemble").state_dict()
    _kept()(state)

    # Execute
    server, folder = resume(run_config, digits_bundle, tmp_path, "ensemble", state)
    runner = server.runner
    artifact = runner.export(folder / "ensemble.npz")

    # Assert
    assert runner.kept == {**KEPT, "alpha": np.full((2, 10), 0.5).tolist()}
    loaded = load_ensemble(artifact)
    np.testing.assert_array_equal(loaded.alpha, np.full((2, 10), 0.5))
    assert load_state(folder / "checkpoint.npz")["ensemble"]["optimizer"] == "uniform"
