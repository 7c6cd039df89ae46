"""The sub-model schemes (heterofl, flexifed, nefl, fedfa) on the in-process grid."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server_app.app import build_server
from tests.conftest import TINY_DIGITS, make_grid

SUBMODEL = {
    **TINY_DIGITS,
    "model-family": "preresnet",
    "sim-device-profiles": "cpu-small,jetson-orin",
    "submodel-widths": "1,0.25",
}
"""Digits, the preresnet26_025 global model, a weak and a strong device."""


def run_scheme(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
    overrides: dict[str, Any],
    *,
    nodes: int = 4,
    rounds: int = 2,
) -> Any:
    config = run_config(
        {**SUBMODEL, "num-server-rounds": rounds, "min-nodes": nodes}
        | {"output-dir": str(tmp_path), "run-name": "r"}
        | overrides
    )
    server = build_server(config, bundle=digits_bundle).runner
    server.start(make_grid(config, nodes), num_rounds=rounds, timeout=60.0)
    return server


@pytest.mark.parametrize("scheme", ["heterofl", "flexifed", "nefl", "fedfa"])
def test_every_submodel_scheme_trains_slices_and_evaluates_them(
    scheme: str,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    server = run_scheme(run_config, digits_bundle, tmp_path, {"strategy": scheme})
    archs = {info.arch for info in server.nodes.values()}
    print(scheme, archs, [r.get("global_accuracy") for r in server.rounds])
    assert all(a.startswith("preresnet26_025@") for a in archs)
    assert len(archs) >= 2, f"weak and strong devices picked the same slice: {archs}"
    for record in server.rounds:
        assert not record.get("skipped"), record.get("skip_reason")
        assert record["submodel_accuracy"]
        assert 0.0 <= record["global_accuracy"] <= 1.0
    assert server.rounds[-1]["global_accuracy"] > 0.1


@pytest.mark.parametrize(
    ("scheme", "extra"),
    [("heterofl", {}), ("fedfa", {"fedfa-scaling": False, "fedfa-weighted": True})],
)
def test_with_every_node_on_the_full_model_the_scheme_is_fedavg(
    scheme: str,
    extra: dict[str, Any],
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    same = {
        "sim-device-profiles": "jetson-orin",
        "submodel-widths": "1",
        "submodel-mask-classes": False,
        "fedavg-arch": "preresnet26_025",
        "clip-factor": 0,  # fedfa has no update bound (its scaling is its defence)
    }
    fedavg = run_scheme(run_config, digits_bundle, tmp_path / "a", {"strategy": "fedavg", **same})
    sub = run_scheme(
        run_config, digits_bundle, tmp_path / "b", {"strategy": scheme, **same, **extra}
    )
    assert {i.arch for i in sub.nodes.values()} == {"preresnet26_025@w1-d3.3.3.3"}
    expected = fedavg.models.arrays["preresnet26_025"]
    got = sub.global_state
    assert list(got) == list(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=1e-6, err_msg=key)
    assert sub.rounds[-1]["global_accuracy"] == pytest.approx(fedavg.rounds[-1]["global_accuracy"])


# --------------------------------------------------------------------------- pieces by hand
def test_depth_levels_cut_every_section_to_k_blocks_and_no_further_than_allowed() -> None:
    from strategies.submodel.scheme import depth_levels

    assert depth_levels((3, 3, 3, 3), 2) == [(3, 3, 3, 3), (2, 2, 2, 2)]
    assert depth_levels((1, 2, 3, 4, 3, 3, 1), 2) == [
        (1, 2, 3, 4, 3, 3, 1),
        (1, 2, 3, 3, 3, 3, 1),
        (1, 2, 2, 2, 2, 2, 1),
    ]
    assert depth_levels((2, 2), 2) == [(2, 2)]


def test_candidate_specs_follow_what_the_scheme_slices() -> None:
    from models.spec import SubModelSpec
    from strategies.submodel.scheme import candidate_specs

    full = SubModelSpec(1.0, (3, 3))
    both = candidate_specs(full, 2, (0.5, 0.25), width=True, depth=True)
    assert [(s.width, s.depths) for s in both] == [
        (1.0, (3, 3)), (1.0, (2, 2)), (0.5, (3, 3)), (0.5, (2, 2)), (0.25, (3, 3)), (0.25, (2, 2)),
    ]  # fmt: skip
    width = candidate_specs(full, 2, (0.5,), width=True, depth=False)
    assert [(s.width, s.depths) for s in width] == [(1.0, (3, 3)), (0.5, (3, 3))]
    depth = candidate_specs(full, 2, (0.5,), width=False, depth=True)
    assert [(s.width, s.depths) for s in depth] == [(1.0, (3, 3)), (1.0, (2, 2))]


def test_masked_cross_entropy_ignores_absent_classes() -> None:
    import math

    import torch

    from strategies.submodel.scheme import masked_cross_entropy

    logits = torch.tensor([[1.0, 2.0, 3.0]])
    model = torch.nn.Identity()
    present = torch.tensor([True, False, True])
    loss = masked_cross_entropy(present)(model, logits, torch.tensor([0]))
    # softmax over classes 0 and 2 only: -log(e^1 / (e^1 + e^3))
    assert float(loss) == pytest.approx(-math.log(math.e / (math.e + math.e**3)), rel=1e-6)
    x = logits.clone().requires_grad_(True)
    masked_cross_entropy(present)(model, x, torch.tensor([2])).backward()
    assert x.grad is not None and float(x.grad[0, 1]) == 0.0


def test_the_scaler_divides_convolutions_by_the_width_in_training_only() -> None:
    import torch

    from strategies.submodel.scheme import attach_scaler

    conv = torch.nn.Conv2d(1, 1, 1, bias=False)
    torch.nn.init.ones_(conv.weight)
    model = torch.nn.Sequential(conv)
    assert attach_scaler(model, 0.25) == 1
    x = torch.ones(1, 1, 2, 2)
    assert float(model.train()(x).detach()[0, 0, 0, 0]) == 4.0
    assert float(model.eval()(x)[0, 0, 0, 0]) == 1.0
    assert attach_scaler(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1)), 1.0) == 0


def test_batch_statistics_are_recomputed_from_scratch_on_server_data() -> None:
    import torch

    from tessera.data import ArrayDataset
    from tessera.training import recompute_batch_statistics

    norm = torch.nn.BatchNorm2d(1)
    norm.running_mean.fill_(100.0)  # stale statistics from elsewhere must not leak in
    model = torch.nn.Sequential(norm)
    x = np.array([1.0, 2.0, 3.0, 6.0], np.float32).reshape(4, 1, 1, 1)
    data = ArrayDataset(x, np.zeros(4, np.int64))
    assert recompute_batch_statistics(model, data, batch_size=2) == 1
    # cumulative average of the two batch means (1.5, 4.5) and unbiased variances (0.5, 4.5)
    assert float(norm.running_mean[0]) == pytest.approx(3.0)
    assert float(norm.running_var[0]) == pytest.approx(2.5)
    assert not model.training
    with pytest.raises(ValueError, match="does not track running statistics"):
        recompute_batch_statistics(
            torch.nn.Sequential(torch.nn.BatchNorm2d(1, track_running_stats=False)),
            data,
            batch_size=2,
        )


def test_nefl_and_basic_common_keep_their_private_entries_apart(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path
) -> None:
    config = run_config({**SUBMODEL, "strategy": "nefl", "output-dir": str(tmp_path)})
    nefl = build_server(config, bundle=digits_bundle).runner
    arch = "preresnet26_025@w0.25-d2.2.2.2"
    private = nefl.private_keys(arch)
    assert private and all("norm" in k or k.startswith("final.0.") for k in private)
    assert not any(k.endswith("conv1.weight") for k in private)

    config = run_config(
        {**SUBMODEL, "strategy": "flexifed", "flexifed-strategy": "basic-common"}
        | {"output-dir": str(tmp_path)}
    )
    flexi = build_server(config, bundle=digits_bundle).runner
    flexi.assignment = {1: "preresnet26_025@w1-d2.2.2.2", 2: "preresnet26_025@w1-d3.3.3.3"}
    deep = flexi.private_keys("preresnet26_025@w1-d3.3.3.3")
    assert deep and all(k.startswith(tuple(f"sections.{s}.2." for s in range(4))) for k in deep)
    assert flexi.private_keys("preresnet26_025@w1-d2.2.2.2") == frozenset()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strategy": "heterofl", "submodel-widths": "1,0"}, "submodel-widths"),
        ({"strategy": "heterofl", "submodel-global": "cnn-3"}, "no sections"),
        ({"strategy": "heterofl", "model-family": "cnn"}, "no model with sections"),
        ({"strategy": "heterofl", "aggregator": "median"}, "averages partial updates"),
        ({"strategy": "fedfa", "aggregator": "norm-clip"}, "use one of mean"),
        ({"strategy": "fedfa", "fedfa-trim": "x"}, "fedfa-trim"),
        ({"strategy": "flexifed", "flexifed-strategy": "clustered-common"}, "not built"),
    ],
)
def test_bad_submodel_settings_are_refused_naming_the_key(
    overrides: dict[str, Any],
    message: str,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    from tessera.config import ConfigError

    config = run_config({**SUBMODEL, "output-dir": str(tmp_path)} | overrides)
    with pytest.raises(ConfigError, match=message):
        build_server(config, bundle=digits_bundle)


def test_a_node_naming_a_slice_the_scheme_does_not_train_is_rejected(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # flexifed slices depth only: a width-0.25 slice forced by node-config is refused
    config = run_config(
        {**SUBMODEL, "strategy": "flexifed", "num-server-rounds": 1, "min-nodes": 1}
        | {"output-dir": str(tmp_path), "run-name": "r"}
    )
    server = build_server(config, bundle=digits_bundle).runner
    grid = make_grid(config, 2)
    grid.contexts[100].node_config["arch"] = "preresnet26_025@w0.25-d3.3.3.3"
    server.start(grid, num_rounds=1, timeout=60.0)
    assert 100 not in server.nodes and 101 in server.nodes
    assert not server.rounds[0].get("skipped")
