"""The sub-model schemes (heterofl, flexifed, nefl, fedfa) on the in-process grid."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from models.spec import ModelRef, SubModelSpec
from server_app.app import build_server
from tessera import wire
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
    # static batch norm, as the schemes' papers train (see the warning under norm='batch')
    overrides = {"strategy": scheme, "norm": "static-batch"}
    server = run_scheme(run_config, digits_bundle, tmp_path, overrides)
    archs = {info.arch for info in server.nodes.values()}
    print(scheme, archs, [r.get("global_accuracy") for r in server.rounds])
    assert all(a.startswith("preresnet26_025@") for a in archs)
    assert len(archs) >= 2, f"weak and strong devices picked the same slice: {archs}"
    for record in server.rounds:
        assert not record.get("skipped"), record.get("skip_reason")
        assert record["submodel_accuracy"]
        assert 0.0 <= record["global_accuracy"] <= 1.0
        # each reply's slice is recorded as structure, its printed name beside it
        for client in record["clients"]:
            assert client["model"] == "preresnet26_025"
            piece = client["slice"]
            spec = SubModelSpec(piece["width"], tuple(piece["depths"]))
            assert ModelRef(client["model"], spec).name == client["arch"]
    # the nodes' slices came as structure in the handshake
    assert all(info.ref.spec is not None for info in server.nodes.values())
    assert server.rounds[-1]["global_accuracy"] > 0.25


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
        "clip-factor": 0,  # no update bound: FedAvg's plain mean, compared exactly
        "norm": "batch",  # the same normalisation on both sides (sub-models default to static)
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
    from strategies.submodel.options import depth_levels

    assert depth_levels((3, 3, 3, 3), 2) == [(3, 3, 3, 3), (2, 2, 2, 2)]
    assert depth_levels((1, 2, 3, 4, 3, 3, 1), 2) == [
        (1, 2, 3, 4, 3, 3, 1),
        (1, 2, 3, 3, 3, 3, 1),
        (1, 2, 2, 2, 2, 2, 1),
    ]
    assert depth_levels((2, 2), 2) == [(2, 2)]


def test_candidate_specs_follow_what_the_scheme_slices() -> None:
    from models.spec import SubModelSpec
    from strategies.submodel.options import candidate_specs

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

    from strategies.submodel.client import masked_cross_entropy

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

    from strategies.submodel.client import attach_scaler

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


def test_nefl_keeps_its_norm_and_step_entries_apart(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path
) -> None:
    config = run_config({**SUBMODEL, "strategy": "nefl", "output-dir": str(tmp_path)})
    nefl = build_server(config, bundle=digits_bundle).runner
    arch = "preresnet26_025@w0.25-d2.2.2.2"
    private = nefl.private_keys(arch)
    steps = {k for k in private if k.endswith(".step")}
    assert steps == {f"sections.{s}.{b}.step" for s in range(4) for b in range(2)}
    assert all("norm" in k or k.startswith("final.0.") for k in private - steps)
    assert not any(k.endswith("conv1.weight") for k in private)

    off = run_config({**config, "nefl-learnable-step": False, "output-dir": str(tmp_path / "b")})
    plain = build_server(off, bundle=digits_bundle).runner
    assert not any(k.endswith(".step") for k in plain.array_spec(arch))
    assert not any(k.endswith(".step") for k in plain.private_keys(arch))


def test_nefl_learns_each_slices_step_sizes_apart(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # Prepare: 4 nodes, two on a narrow shallow slice, two on the full model
    narrow, full = "preresnet26_025@w0.25-d2.2.2.2", "preresnet26_025@w1-d3.3.3.3"
    config = run_config(
        {**SUBMODEL, "strategy": "nefl"}
        | {"num-server-rounds": 2, "min-nodes": 4, "output-dir": str(tmp_path), "run-name": "r"}
    )
    server = build_server(config, bundle=digits_bundle).runner
    grid = make_grid(config, 4)
    for i, node in enumerate(sorted(grid.contexts)):
        grid.contexts[node].node_config["arch"] = narrow if i % 2 else full

    # Execute
    server.start(grid, num_rounds=2, timeout=60.0)

    # Assert: both slices trained the step of block 0.0, each to its own value, and
    # the conv they share is one value (the narrow one is the prefix of the full one)
    assert not any(r.get("skipped") for r in server.rounds)
    key = "sections.0.0.step"
    a, b = float(server.sub_state(narrow)[key]), float(server.sub_state(full)[key])
    assert a != 1.0 and b != 1.0 and a != b
    conv = "sections.0.0.conv1.weight"
    small = server.sub_state(narrow)[conv]
    np.testing.assert_array_equal(
        server.sub_state(full)[conv][tuple(slice(0, n) for n in small.shape)], small
    )
    assert set(server.rounds[-1]["submodel_accuracy"]) == {"preresnet26_025", narrow}


def test_flexifed_shares_layers_only_along_the_common_prefix() -> None:
    from strategies.submodel.flexifed import common_prefix, sharing

    e = ((2,), "float32")
    full = {"x": e, "y": e, "z": e, "w": e}  # a deep architecture
    mid = {"x": e, "y": e, "z": e, "v": e}  # diverges at the fourth layer
    small = {"x": e, "q": e}  # diverges at the second
    assert common_prefix(full, mid) == 3 and common_prefix(full, small) == 1
    assert common_prefix(full, {"x": ((3,), "float32"), "y": e}) == 0  # shape differs
    specs = {"full": full, "mid": mid, "small": small}
    every = frozenset(specs)

    got = sharing(specs, "full", "max-common")
    assert got == {
        "x": every,
        "y": frozenset({"full", "mid"}),
        "z": frozenset({"full", "mid"}),
        "w": frozenset({"full"}),
    }
    assert sharing(specs, "small", "max-common") == {"x": every, "q": frozenset({"small"})}
    clustered = sharing(specs, "full", "clustered-common")
    assert clustered == {"x": every, **{k: frozenset({"full"}) for k in "yzw"}}
    basic = sharing(specs, "mid", "basic-common")
    assert basic == {"x": every, **{k: frozenset() for k in "yzv"}}


@pytest.mark.parametrize("strategy", ["max-common", "clustered-common", "basic-common"])
def test_flexifed_strategies_keep_what_is_not_common_apart(
    strategy: str,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # Prepare: 4 nodes, two forced to the shallow slice, two to the full depth
    shallow, deep = "preresnet26_025@w1-d2.2.2.2", "preresnet26_025@w1-d3.3.3.3"
    config = run_config(
        {**SUBMODEL, "strategy": "flexifed", "flexifed-strategy": strategy}
        | {"num-server-rounds": 2, "min-nodes": 4, "output-dir": str(tmp_path), "run-name": "r"}
    )
    server = build_server(config, bundle=digits_bundle).runner
    grid = make_grid(config, 4)
    for i, node in enumerate(sorted(grid.contexts)):
        grid.contexts[node].node_config["arch"] = shallow if i % 2 else deep

    # Execute
    server.start(grid, num_rounds=2, timeout=60.0)

    # Assert: the stem is one value across both models; the classifier is not
    glob, own = server.sub_state(deep), server.sub_state(shallow)
    stem = next(k for k in own if k.startswith("stem"))
    np.testing.assert_array_equal(glob[stem], own[stem])
    head = next(k for k in own if k == "head.weight")
    assert not np.array_equal(glob[head], own[head])
    assert not any(r.get("skipped") for r in server.rounds)
    if strategy == "basic-common":  # every node has its own classifier, sent back to it
        assert sorted(server.personal) == sorted(grid.contexts)
        heads = [server.personal[n][head] for n in sorted(server.personal)]
        assert not np.array_equal(heads[0], heads[2])
        last = [m for m in grid.sent_of("train") if m.metadata.dst_node_id == 100][-1]
        sent = last.content[wire.ARRAYS][head].numpy()
        first = server.rounds[0]
        assert first["round"] == 1 and not np.array_equal(sent, glob[head])
    else:
        assert server.personal == {}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strategy": "heterofl", "submodel-widths": "1,0"}, "submodel-widths"),
        ({"strategy": "heterofl", "submodel-global": "cnn-3"}, "no sections"),
        ({"strategy": "heterofl", "model-family": "cnn"}, "no model with sections"),
        ({"strategy": "heterofl", "aggregator": "median"}, "averages partial updates"),
        ({"strategy": "fedfa", "aggregator": "norm-clip"}, "use one of mean"),
        ({"strategy": "fedfa", "fedfa-trim": "x"}, "fedfa-trim"),
        ({"strategy": "fedfa", "fedfa-max-factor": 0.5}, "fedfa-max-factor"),
        ({"strategy": "fedfa", "fedfa-slices": "deep"}, "fedfa-slices"),
        ({"strategy": "flexifed", "flexifed-strategy": "most-common"}, "flexifed-strategy"),
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


def test_heterofl_rolling_moves_the_narrow_window_each_round(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    from models.spec import sub_channels
    from strategies.submodel import roll_channels

    # Prepare: one node, training a quarter of the channels (a few fast steps, whose
    # update is nearly orthogonal to the server's own: the direction check, tested
    # apart, is off so that every round's update goes in)
    config = run_config(
        {**SUBMODEL, "strategy": "heterofl", "heterofl-rolling": True, "server-trust": False}
        | {"num-server-rounds": 2, "min-nodes": 1, "output-dir": str(tmp_path), "run-name": "r"}
    )
    server = build_server(config, bundle=digits_bundle).runner
    initial = server.initial_arrays(server.global_name)
    grid = make_grid(config, 1)
    grid.contexts[100].node_config["arch"] = "preresnet26_025@w0.25-d3.3.3.3"

    # Execute
    server.start(grid, num_rounds=2, timeout=60.0)

    # Assert: in the original channel order, round 1 trained channels 0..c-1 and
    # round 2 channels 1..c: channel c changed, channel c+1 never did
    assert [r.get("window_shift") for r in server.rounds] == [1, 1]
    original = roll_channels(server.global_state, server.layout, 2)
    key = "sections.1.0.conv1.weight"
    channels = initial[key].shape[0]
    c = sub_channels(channels, 0.25)
    assert channels > c + 1
    assert not np.array_equal(original[key][c], initial[key][c])
    np.testing.assert_array_equal(original[key][c + 1 :], initial[key][c + 1 :])
    assert not np.array_equal(original[key][0], initial[key][0])


@pytest.fixture(scope="module")
def digits_as(tmp_path_factory: pytest.TempPathFactory, digits_bundle: Any) -> dict[str, str]:
    """Digits as 3 x 32 x 32 images (each pixel a 4 x 4 patch) and as 64-long vectors."""
    root = tmp_path_factory.mktemp("digits-kinds")
    train, test = digits_bundle.train, digits_bundle.test
    n, m = 320, 120
    images = {
        "x_train": np.repeat(np.kron(train.x[:n], np.ones((1, 1, 4, 4))), 3, axis=1),
        "x_test": np.repeat(np.kron(test.x[:m], np.ones((1, 1, 4, 4))), 3, axis=1),
    }
    flat = {"x_train": train.x[:n].reshape(n, -1), "x_test": test.x[:m].reshape(m, -1)}
    labels = {"y_train": train.y[:n], "y_test": test.y[:m]}
    out = {}
    for kind, arrays in (("32x32", images), ("1-D", flat)):
        path = root / f"{kind}.npz"
        np.savez(path, **{k: v.astype(np.float32) for k, v in arrays.items()}, **labels)
        out[kind] = f"npz:{path}"
    return out


@pytest.mark.parametrize("kind", ["32x32", "1-D"])
@pytest.mark.parametrize("scheme", ["heterofl", "flexifed", "nefl", "fedfa"])
def test_every_submodel_scheme_runs_on_images_and_vectors(
    scheme: str,
    kind: str,
    digits_as: dict[str, str],
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    from tessera.data import load_bundle

    # Prepare: a narrow-and-shallow slice beside the full model, one round
    bundle = load_bundle(digits_as[kind])
    config = run_config(
        {**SUBMODEL, "strategy": scheme, "dataset": digits_as[kind], "model-family": ""}
        | {"num-server-rounds": 1, "min-nodes": 2, "output-dir": str(tmp_path), "run-name": "r"}
    )
    server = build_server(config, bundle=bundle).runner
    grid = make_grid(config, 2)
    grid.contexts[100].node_config["arch"] = server.known_archs()[-1]

    # Execute
    server.start(grid, num_rounds=1, timeout=60.0)

    # Assert: the default family, both slices trained and evaluated on this input kind
    record = server.rounds[0]
    assert server.global_name == "preresnet26_025" and server.env.input_shape == bundle.input_shape
    assert not record.get("skipped") and record["num_ok"] == 2, record.get("skip_reason")
    assert len(record["submodel_accuracy"]) == 2
