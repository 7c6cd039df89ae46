"""The heterogeneous ensemble (Thonglek et al.): weights maths, optimisers, the scheme."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strategies.ensemble.optimizers import OPTIMIZERS, Split, tune
from strategies.ensemble.weights import (
    combine,
    ensemble_accuracy,
    ensemble_log_loss,
    softmax_weights,
    uniform_weights,
)


# --------------------------------------------------------------------------- maths by hand
def test_combine_weights_each_models_class_probability() -> None:
    probs = np.array(
        [
            [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]],  # model 0, samples 0 and 1
            [[0.1, 0.6, 0.3], [0.5, 0.4, 0.1]],  # model 1
        ]
    )
    alpha = np.array([[1.0, 0.5, 0.0], [0.2, 1.0, 1.0]])
    # sample 0: [1*0.7 + 0.2*0.1, 0.5*0.2 + 1*0.6, 0*0.1 + 1*0.3] = [0.72, 0.70, 0.30]
    # sample 1: [1*0.1 + 0.2*0.5, 0.5*0.1 + 1*0.4, 0*0.8 + 1*0.1] = [0.20, 0.45, 0.10]
    np.testing.assert_allclose(combine(probs, alpha), [[0.72, 0.70, 0.30], [0.20, 0.45, 0.10]])
    assert ensemble_accuracy(probs, np.array([0, 2]), alpha) == 0.5
    # log-loss of the normalised scores: -(log(0.72/1.72) + log(0.10/0.75)) / 2
    expected = -(np.log(0.72 / 1.72) + np.log(0.10 / 0.75)) / 2
    assert ensemble_log_loss(probs, np.array([0, 2]), alpha) == pytest.approx(expected)


def test_uniform_weights_are_the_plain_average_of_probabilities() -> None:
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(5), size=(3, 40))
    alpha = uniform_weights(3, 5)
    assert alpha.shape == (3, 5) and np.all(alpha == 1 / 3)
    np.testing.assert_allclose(combine(probs, alpha), probs.mean(axis=0))
    np.testing.assert_allclose(softmax_weights(np.zeros((3, 5))), alpha)


def test_bad_shapes_are_refused_with_the_shape_named() -> None:
    probs = np.full((2, 4, 3), 1 / 3)
    with pytest.raises(ValueError, match=r"alpha must be \(models, classes\) = \(2, 3\)"):
        combine(probs, np.ones((3, 2)))
    with pytest.raises(ValueError, match=r"got shape \(4, 3\)"):
        combine(np.ones((4, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        ensemble_accuracy(probs, np.array([0, 1, 2, 3]), np.ones((2, 3)))
    with pytest.raises(ValueError, match="NaN"):
        combine(np.full((2, 4, 3), np.nan), np.ones((2, 3)))


# ------------------------------------------------------------------ optimisers, synthetic
def halves(samples: int, seed: int) -> Split:
    """Two models: model 0 right on classes 0-4 (0.6 on the label), model 1 on 5-9;
    elsewhere each is confidently wrong (0.8) on a class of the other's half, so
    uniform weights are always wrong and per-class weights can be always right."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, size=samples)
    probs = np.full((2, samples, 10), 0.0)
    for s, label in enumerate(y):
        for model, (lo, hi) in enumerate(((0, 5), (5, 10))):
            other = 5 - lo  # the first class of the other model's half
            top, mass = (label, 0.6) if lo <= label < hi else (other + (label + 1) % 5, 0.8)
            rest = np.delete(np.arange(10), top)
            probs[model, s, rest] = rng.dirichlet(np.ones(9)) * (1 - mass)
            probs[model, s, top] = mass
    return Split(probs, y)


TUNING, VALIDATION = halves(200, 1), halves(200, 2)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimiser_improves_or_ties_uniform_on_the_tuning_split(name: str) -> None:
    uniform = TUNING.accuracy(uniform_weights(2, 10))
    assert uniform < 0.1  # the task is built so that averaging fails
    result = tune(name, TUNING, VALIDATION, trials=20, seed=0)
    print(name, uniform, result.tuning_accuracy, result.trials, f"{result.seconds:.2f}s")
    assert result.optimizer == name and result.alpha.shape == (2, 10)
    assert result.tuning_accuracy >= uniform
    assert result.tuning_accuracy == pytest.approx(TUNING.accuracy(result.alpha))
    assert 1 <= result.trials <= 20
    assert result.tuning_accuracy > uniform + 0.2  # a real improvement, not a tie
    assert np.all((result.alpha >= 0) & (result.alpha <= 1))


def test_the_gradient_fit_recovers_which_model_to_trust_for_which_class() -> None:
    result = tune("gradient", TUNING, VALIDATION, trials=300, seed=0)
    alpha = result.alpha
    assert np.all(alpha[0, :5] > alpha[1, :5]) and np.all(alpha[1, 5:] > alpha[0, 5:])
    np.testing.assert_allclose(alpha.sum(axis=0), 1.0)
    assert VALIDATION.accuracy(alpha) > 0.95


def test_the_grid_search_states_its_grid_one_weight_per_model() -> None:
    from strategies.ensemble.optimizers import GRID_LEVELS

    result = tune("grid", TUNING, VALIDATION, trials=50, seed=0)
    assert result.trials == len(GRID_LEVELS) ** 2  # the whole 3 x 3 grid, not 50
    assert np.all(result.alpha == result.alpha[:, :1])  # the same weight for every class
    assert set(np.unique(result.alpha)) <= set(GRID_LEVELS)


def test_tune_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="unknown ensemble optimiser 'bayes'"):
        tune("bayes", TUNING, VALIDATION)
    with pytest.raises(ValueError, match="trials is 0"):
        tune("tpe", TUNING, VALIDATION, trials=0)
    with pytest.raises(ValueError, match=r"\(2, 10\) but the validation split \(1, 10\)"):
        tune("tpe", TUNING, Split(TUNING.probs[:1], TUNING.labels))


# --------------------------------------------------------------------------- the scheme
ENSEMBLE = {
    "strategy": "ensemble",
    "local-epochs": 1,
    "dataset": "digits",
    "model-family": "",  # the scheme's default: "mixed", devices pick across families
    "sim-device-profiles": "cpu-small,jetson-orin",
    "round-timeout": 5.0,
    "ensemble-optimizer": "random,gradient",
    "ensemble-trials": 20,
}


def run_ensemble(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
    overrides: dict[str, Any] | None = None,
    *,
    nodes: int = 4,
    rounds: int = 2,
) -> Any:
    from server_app.app import build_server
    from tests.conftest import make_grid

    config = run_config(
        {**ENSEMBLE, "num-server-rounds": rounds, "min-nodes": nodes}
        | {"output-dir": str(tmp_path), "run-name": "r"}
        | (overrides or {})
    )
    server = build_server(config, bundle=digits_bundle).runner
    server.start(make_grid(config, nodes), num_rounds=rounds, timeout=60.0)
    return server


def test_the_ensemble_scheme_tunes_after_the_last_round_and_exports_what_it_kept(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    from strategies.ensemble.artifact import load_ensemble

    # Execute: 2 rounds, tuning every round
    server = run_ensemble(run_config, digits_bundle, tmp_path, {"ensemble-tune-every": 1})

    # Assert: the weak and the strong device picked models of different families;
    # every round has an ensemble entry with uniform, both optimisers, each group
    from models import list_models, model_entry

    archs = sorted({info.arch for info in server.nodes.values()})
    assert len(archs) == 2 and set(archs) <= set(list_models("mixed")), archs
    assert len({model_entry(a).family for a in archs}) == 2
    for record in server.rounds:
        entry = record["ensemble"]
        assert entry["members"] == archs
        assert set(entry["optimizers"]) == {"uniform", "random", "gradient"}
        assert set(entry["groups"]) == set(archs)
        for name, row in entry["optimizers"].items():
            assert 0.0 <= row["test_accuracy"] <= 1.0
            if name != "uniform":
                assert row["trials"] >= 1 and row["seconds"] >= 0
        assert (
            entry["optimizers"]["random"]["tuning_accuracy"]
            >= (entry["optimizers"]["uniform"]["tuning_accuracy"])
        )
        chosen = entry["optimizers"][entry["chosen"]]
        best = max(r["validation_accuracy"] for r in entry["optimizers"].values())
        assert chosen["validation_accuracy"] == best
        assert record["ensemble_accuracy"] == chosen["test_accuracy"]
        assert entry["tuning_size"] + entry["validation_size"] == len(server.env.server_pool)
    final = server.final_metrics
    assert final["ensemble_members"] == archs
    assert Path(final["ensemble_heatmap"]).is_file()

    # the exported artifact predicts what the server's ensemble predicts
    ensemble = load_ensemble(final["ensemble_artifact"])
    assert ensemble.archs == archs
    sound, excluded, splits = server._probabilities(archs)
    assert sound == archs and excluded == {} and splits is not None
    test = splits[2]
    alpha = np.asarray(server.kept["alpha"])
    expected = combine(test.probs, alpha).argmax(axis=1)
    got = ensemble.predict(server.env.global_test.x)
    np.testing.assert_array_equal(got, expected)
    assert float(np.mean(got == server.env.global_test.y)) == pytest.approx(
        server.rounds[-1]["ensemble_accuracy"]
    )


def test_the_predict_command_labels_an_npz_and_refuses_bad_input(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from strategies.ensemble.__main__ import main

    server = run_ensemble(run_config, digits_bundle, tmp_path / "run", rounds=1)
    artifact = server.final_metrics["ensemble_artifact"]
    test = server.env.global_test
    data = tmp_path / "batch.npz"
    np.savez(data, x=test.x[:40], y=test.y[:40])
    out = tmp_path / "labels.npy"

    assert main(["predict", artifact, str(data), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "40 sample(s) labelled by 2 model(s)" in printed and "accuracy" in printed
    from strategies.ensemble.artifact import load_ensemble

    np.testing.assert_array_equal(np.load(out), load_ensemble(artifact).predict(test.x[:40]))

    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((3, 5), np.float32))
    assert main(["predict", artifact, str(wrong)]) == 2
    assert "the samples have shape (5,) but this ensemble was trained on (1, 8, 8)" in (
        capsys.readouterr().err
    )
    assert main(["predict", str(data), str(data)]) == 2
    assert "not a Tessera ensemble artifact" in capsys.readouterr().err


def test_ensemble_options_refuse_bad_values(run_config: Callable[..., dict[str, Any]]) -> None:
    from strategies.ensemble.scheme import EnsembleOptions
    from tessera.config import ConfigError

    ok = EnsembleOptions.parse(run_config({"ensemble-optimizer": "smac, tpe,smac"}))
    assert ok.optimizers == ("smac", "tpe")
    for key, value, match in [
        ("ensemble-optimizer", "tpe,bayes", "'tpe,bayes'; give one or more of grid"),
        ("ensemble-trials", 0, "'ensemble-trials' is 0"),
        ("ensemble-tune-every", -1, "'ensemble-tune-every' is -1"),
        ("ensemble-validation-fraction", 1.0, "'ensemble-validation-fraction' is 1.0"),
        ("ensemble-gradient-steps", 0, "'ensemble-gradient-steps' is 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            EnsembleOptions.parse(run_config({key: value}))


def test_a_server_without_an_optimisers_package_refuses_to_start(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    import importlib.util

    from server_app.app import build_server
    from tessera.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "smac" else real(name, *a)
    )
    config = run_config({**ENSEMBLE, "ensemble-optimizer": "gradient,smac"})
    with pytest.raises(ConfigError, match=r"names smac, whose package\(s\) smac this server lacks"):
        build_server(config | {"output-dir": str(tmp_path)}, bundle=digits_bundle)


def test_pso_leaves_logging_and_the_working_directory_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging
    import os

    # pyswarms' Reporter would add root handlers and write report.log into the cwd
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    before = (list(root.handlers), root.level, os.environ.get("LOG_CFG"))
    tune("pso", TUNING, VALIDATION, trials=10, seed=0)
    assert (list(root.handlers), root.level, os.environ.get("LOG_CFG")) == before
    assert list(tmp_path.iterdir()) == []


def test_full_float32_turns_tf32_off_inside_and_restores_it() -> None:
    import torch

    from strategies.ensemble.artifact import full_float32

    # Prepare: TF32 on for both, as cuDNN's default is for convolutions
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        # Execute / Assert: off inside, back on after, an exception included
        with full_float32():
            assert not torch.backends.cudnn.allow_tf32
            assert not torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
        with pytest.raises(RuntimeError), full_float32():
            raise RuntimeError("boom")
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
