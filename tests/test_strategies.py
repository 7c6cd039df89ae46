"""Schemes driven through HeteroStrategy.start with a fake grid and the real ClientApp.

Three nodes on the digits dataset, partitions 0, 1, 2 emulating the device profiles
cpu-small, cpu-large and jetson-orin, so the weak node chooses a smaller CNN than the
other two. Node ids differ from partition ids on purpose.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import Result
from torch import nn

from models import model_entry
from server_app.app import build_server
from strategies import get_scheme, list_schemes, register_scheme
from strategies.baselines.fedprox import FedProxClient, FedProxOptions
from strategies.core import registry as scheme_registry
from strategies.core.exchange import (
    MAX_POLL_INTERVAL,
    PENDING_WAIT,
    POLL_COST_FACTOR,
    exchange,
    poll_wait,
    pull_chunk,
    wait_for_nodes,
)
from strategies.core.nodes import parse_handshake
from strategies.core.validation import Rejection
from tessera import wire
from tessera.config import ConfigError, RunConfig
from tessera.results import plot_rounds
from tessera.training import proximal_term
from tests.conftest import (
    FakeGrid,
    client_handlers,
    install_fast_clients,
    make_context,
    memory_state,
    nan_first_float_array,
    round_input,
    torch_threads,
)
from tests.oracles import allowed_weights

NODE_IDS = (11, 22, 33)
WEAK_NODE = 11  # partition 0 -> cpu-small
TINY = {
    "local-epochs": 1,
    "dataset": "digits",
    "num-server-rounds": 2,
    "model-family": "cnn",
    "sim-device-profiles": "cpu-small,cpu-large,jetson-orin",
    "round-timeout": 1.0,
}
SCHEMES = ["fedavg", "fedprox", "fedavg-groups", "local"]


@dataclasses.dataclass
class Federation:
    server: Any
    grid: FakeGrid
    result: Result
    run_dir: Path

    def node_choices(self) -> dict[int, str]:
        """Architecture each node chose for itself in the handshake."""
        return {n: info.arch for n, info in self.server.nodes.items()}

    def metrics_lines(self) -> list[dict[str, Any]]:
        text = (self.run_dir / "metrics.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]


def raise_in_train(msg: Message, context: Any) -> Message:
    raise RuntimeError("CUDA out of memory")


# Every federation the tests look at, run at most once per module (read-only results).
RUNS: dict[str, dict[str, Any]] = {
    **{name: {"strategy": name} for name in SCHEMES},
    # the plain mean (clip-factor 0): the test checks the example weighting, and the
    # default bound clips the larger of two honest updates to the smaller's distance
    "fedavg-corrupt": {
        "strategy": "fedavg",
        "overrides": {"clip-factor": 0.0},
        "tamper": {22: nan_first_float_array},
    },
    "fedavg-groups-corrupt": {"strategy": "fedavg-groups", "tamper": {22: nan_first_float_array}},
    "fedavg-exclude": {
        "strategy": "fedavg",
        "overrides": {"fedavg-arch": "cnn-5", "fedavg-exclude-unfit": True},
    },
    "fedavg-forced": {"strategy": "fedavg", "overrides": {"fedavg-arch": "cnn-2"}, "rounds": 1},
    "local-like-fedfa": {
        "strategy": "local",
        "overrides": {"local-like": "fedfa", "model-family": "", "norm": "static-batch"},
        "rounds": 1,
    },
    "fedavg-groups-silent": {"strategy": "fedavg-groups", "silent": {(33, "train")}},
    "fedavg-groups-raising": {
        "strategy": "fedavg-groups",
        "handlers": {"train": raise_in_train},
        "rounds": 1,
    },
}


def run_federation(
    run_config: Mapping[str, Any],
    bundle: Any,
    run_dir: Path,
    *,
    num_rounds: int,
    tamper: Mapping[int, Callable[[Message], Message | None]] | None = None,
    silent: set[tuple[int, str]] | None = None,
    handlers: Mapping[str, Callable[[Message, Any], Message]] | None = None,
) -> Federation:
    """Run a scheme as the ServerApp does, on a fake grid of three real ClientApps."""
    contexts = {
        node: make_context(node, run_config, {"partition-id": i, "num-partitions": 3})
        for i, node in enumerate(NODE_IDS)
    }
    grid = FakeGrid(contexts)
    grid.tamper.update(tamper or {})
    grid.silent.update(silent or set())
    grid.handlers.update(handlers or {})
    config = {**run_config, "output-dir": str(run_dir.parent), "run-name": run_dir.name}
    built = build_server(config, bundle=bundle)
    server = built.runner
    result = server.start(
        grid, num_rounds=num_rounds, timeout=built.env.run.deployment.round_timeout
    )
    return Federation(server, grid, result, run_dir)


@pytest.fixture(scope="module")
def federation(
    default_run_config: dict[str, Any],
    digits_bundle: Any,
    candidate_cost_cache: dict[tuple[Any, ...], Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], Federation]]:
    """``federation(name)``: the finished run ``RUNS[name]``, run on first use."""
    done: dict[str, Federation] = {}
    with pytest.MonkeyPatch.context() as mp, torch_threads(1):
        install_fast_clients(mp, digits_bundle, candidate_cost_cache)

        def get(name: str) -> Federation:
            if name not in done:
                spec = RUNS[name]
                config = {
                    **default_run_config,
                    **TINY,
                    "strategy": spec["strategy"],
                    **spec.get("overrides", {}),
                }
                done[name] = run_federation(
                    config,
                    digits_bundle,
                    tmp_path_factory.mktemp(name) / "run",
                    num_rounds=spec.get("rounds", 2),
                    tamper=spec.get("tamper"),
                    silent=spec.get("silent"),
                    handlers=spec.get("handlers"),
                )
            return done[name]

        yield get


FederationRunner = Callable[[str], Federation]


def rank(arch: str) -> int:
    return model_entry(arch).size_rank


def all_finite(arrays: Mapping[str, np.ndarray]) -> bool:
    return all(
        bool(np.all(np.isfinite(a))) for a in arrays.values() if np.issubdtype(a.dtype, np.floating)
    )


def sent_arrays(message: Message) -> dict[str, np.ndarray]:
    return wire.record_to_numpy(message.content.array_records[wire.ARRAYS])


# --------------------------------------------------------------------------- all schemes
@pytest.mark.parametrize("strategy", SCHEMES)
def test_scheme_runs_two_rounds_with_three_clients(
    federation: FederationRunner, strategy: str
) -> None:
    # Execute
    fed = federation(strategy)

    # Assert
    assert [r["round"] for r in fed.server.rounds] == [1, 2]
    for record in fed.server.rounds:
        assert record["strategy"] == strategy
        assert record["num_sent"] == 3
        assert record["num_ok"] == 3
        assert record["num_rejected"] == 0
        assert record["num_failed"] == 0
        assert sorted(c["node"] for c in record["clients"]) == list(NODE_IDS)
        for client in record["clients"]:
            assert client["num_examples"] > 0
            assert 0.0 <= client["test_accuracy"] <= 1.0
            assert client["bytes_up"] > 0
            assert client["bytes_down"] > 0
        assert math.isfinite(record["personal_accuracy_mean"])
    # one handshake per node, one train message per node and round
    assert len(fed.grid.sent_of(wire.HANDSHAKE)) == 3
    assert len(fed.grid.sent_of("train")) == 6
    assert sorted(fed.result.train_metrics_clientapp) == [1, 2]
    assert fed.result.train_metrics_clientapp[2]["num-ok"] == 3


@pytest.mark.parametrize("strategy", SCHEMES)
def test_results_folder_has_two_metric_lines_and_config(
    federation: FederationRunner, strategy: str
) -> None:
    # Execute
    fed = federation(strategy)

    # Assert
    lines = fed.metrics_lines()
    assert [line["round"] for line in lines] == [1, 2]
    assert [line["num_ok"] for line in lines] == [3, 3]
    config = json.loads((fed.run_dir / "config.json").read_text())
    assert config["scheme"] == strategy
    assert sorted(n["node"] for n in config["nodes"]) == list(NODE_IDS)
    profiles = {n["partition_id"]: n["profile"]["name"] for n in config["nodes"]}
    assert profiles == {0: "cpu-small", 1: "cpu-large", 2: "jetson-orin"}


def test_weak_device_chooses_a_smaller_architecture(federation: FederationRunner) -> None:
    # Execute
    fed = federation("fedavg-groups")

    # Assert: the precondition of the FedAvg tests below
    choices = fed.node_choices()
    assert rank(choices[WEAK_NODE]) < rank(choices[22])
    assert rank(choices[WEAK_NODE]) < rank(choices[33])


# ---------------------------------------------------------------------- FedAvg / FedProx
@pytest.mark.parametrize("strategy", ["fedavg", "fedprox"])
def test_fedavg_assigns_everyone_the_smallest_chosen_arch(
    federation: FederationRunner, strategy: str
) -> None:
    # Execute
    fed = federation(strategy)

    # Assert
    choices = fed.node_choices()
    assert len(set(choices.values())) > 1, choices
    smallest = min(choices.values(), key=rank)
    assert fed.server.shared_arch == smallest
    assert fed.server.assignment == dict.fromkeys(NODE_IDS, smallest)
    for message in fed.grid.sent_of("train"):
        assert message.content.config_records[wire.CONFIG]["arch"] == smallest
    for record in fed.server.rounds:
        assert {c["arch"] for c in record["clients"]} == {smallest}
        assert record["shared_arch"] == smallest
        assert set(record["global_accuracy_by_arch"]) == {smallest}
    assert fed.server.excluded == {}


def test_fedavg_exclude_unfit_leaves_out_weaker_nodes(federation: FederationRunner) -> None:
    # Execute: fedavg-arch=cnn-5, fedavg-exclude-unfit=true
    fed = federation("fedavg-exclude")

    # Assert
    choices = fed.node_choices()
    unfit = {n for n, arch in choices.items() if rank(arch) < rank("cnn-5")}
    assert unfit == {WEAK_NODE}, choices
    assert set(fed.server.excluded) == unfit
    assert "cannot train the shared architecture" in fed.server.excluded[WEAK_NODE]
    assert WEAK_NODE not in {m.metadata.dst_node_id for m in fed.grid.sent_of("train")}
    for record in fed.server.rounds:
        assert record["num_sent"] == 2
        assert record["num_ok"] == 2
        assert sorted(c["node"] for c in record["clients"]) == [22, 33]
        assert {c["arch"] for c in record["clients"]} == {"cnn-5"}
    config = json.loads((fed.run_dir / "config.json").read_text())
    assert set(config["excluded"]) == {str(WEAK_NODE)}


def test_fedavg_forced_arch_without_exclusion_trains_everyone(
    federation: FederationRunner,
) -> None:
    # Execute: fedavg-arch=cnn-2
    fed = federation("fedavg-forced")

    # Assert
    (record,) = fed.server.rounds
    assert record["num_ok"] == 3
    assert {c["arch"] for c in record["clients"]} == {"cnn-2"}


def test_fedavg_global_model_is_example_weighted_average_of_accepted_replies(
    federation: FederationRunner,
) -> None:
    # Prepare: node 22's replies are corrupted, so only 11 and 33 count; the global
    # model after the last round is the average of that round's accepted replies
    fed = federation("fedavg-corrupt")
    last_round = fed.grid.replies_of("train")[3:]
    accepted = [r for r in last_round if r.metadata.src_node_id != 22]
    assert len(accepted) == 2
    # each weighs its claim within its cohort cap (all three nodes; the largest
    # handshake size is cut to the next one, weight-trim 0.2 of three)
    sizes = {n: info.num_train for n, info in fed.server.nodes.items()}
    counts = allowed_weights(sizes, accepted)
    arrays = [wire.record_to_numpy(r.content.array_records[wire.ARRAYS]) for r in accepted]

    # Execute
    global_arrays = fed.server.global_arrays

    # Assert: (n1 * w1 + n2 * w2) / (n1 + n2), integers rounded to the nearest
    assert list(global_arrays) == list(arrays[0])
    total = counts[0] + counts[1]
    for key, first in arrays[0].items():
        second = arrays[1][key]
        expected = (counts[0] * first.astype(np.float64) + counts[1] * second) / total
        if np.issubdtype(first.dtype, np.integer):
            expected = np.rint(expected)
        assert global_arrays[key].dtype == first.dtype
        assert global_arrays[key].shape == first.shape
        np.testing.assert_allclose(global_arrays[key], expected, rtol=1e-6, atol=1e-7)


def test_fedavg_round_one_sends_the_seeded_initial_model(federation: FederationRunner) -> None:
    # Execute
    fed = federation("fedavg")

    # Assert: every node receives the server's template weights (values)
    initial = fed.server.initial_arrays(fed.server.shared_arch)
    for message in fed.grid.sent_of("train")[:3]:
        payload = sent_arrays(message)
        assert list(payload) == list(initial)
        for key, value in initial.items():
            np.testing.assert_array_equal(payload[key].reshape(value.shape), value)


def test_fedavg_sends_weights_with_the_model_shapes(federation: FederationRunner) -> None:
    # Execute
    fed = federation("fedavg")

    # Assert
    spec = fed.server.array_spec(fed.server.shared_arch)
    for message in fed.grid.sent_of("train"):
        payload = sent_arrays(message)
        assert {k: (v.shape, str(v.dtype)) for k, v in payload.items()} == spec


def test_numpy_to_record_round_trip_keeps_0d_shape() -> None:
    # Prepare
    arrays = {"bn.num_batches_tracked": np.array(7, dtype=np.int64)}

    # Execute
    back = wire.record_to_numpy(wire.numpy_to_record(arrays))

    # Assert
    assert back["bn.num_batches_tracked"].shape == ()
    assert int(back["bn.num_batches_tracked"]) == 7


def test_state_to_record_keeps_0d_shape() -> None:
    # Prepare
    state = {"n": torch.tensor(7), "w": torch.ones(2, 3)}

    # Execute
    back = wire.record_to_numpy(wire.state_to_record(state))

    # Assert
    assert back["n"].shape == ()
    assert back["w"].shape == (2, 3)


@pytest.mark.parametrize("name", ["fedavg-corrupt", "fedavg-groups-corrupt"])
def test_corrupted_reply_is_rejected_and_global_model_stays_finite(
    federation: FederationRunner, name: str
) -> None:
    # Execute: node 22's train replies carry NaN weights
    fed = federation(name)

    # Assert
    for record in fed.server.rounds:
        assert record["num_rejected"] == 1
        assert record["num_ok"] == 2
        (rejection,) = record["rejected"]
        assert rejection["node"] == 22
        assert "non-finite" in rejection["reason"]
        assert 22 not in {c["node"] for c in record["clients"]}
        assert record["global_accuracy"] is not None
        assert math.isfinite(record["global_accuracy"])
    for arrays in fed.server.global_models().values():
        assert all_finite(arrays)
    assert [line["num_rejected"] for line in fed.metrics_lines()] == [1, 1]


def test_node_that_never_replies_is_counted_as_failed(federation: FederationRunner) -> None:
    # Execute: node 33 answers the handshake but never a train message
    fed = federation("fedavg-groups-silent")

    # Assert
    for record in fed.server.rounds:
        assert record["num_sent"] == 3
        assert record["num_ok"] == 2
        assert record["num_failed"] == 1
        assert record["failed"] == [{"node": 33, "reason": "no reply within round-timeout=1s"}]
        assert record["round_seconds"] >= 1.0
    assert [line["num_failed"] for line in fed.metrics_lines()] == [1, 1]


def test_client_error_reply_counts_as_failed_node(federation: FederationRunner) -> None:
    # Execute: every ClientApp raises during training (Flower answers with an error
    # reply on the node's behalf, as it does for NODE_UNAVAILABLE)
    fed = federation("fedavg-groups-raising")

    # Assert
    (record,) = fed.server.rounds
    assert record["num_ok"] == 0
    assert record["num_rejected"] == 0
    assert record["num_failed"] == 3
    assert sorted(f["node"] for f in record["failed"]) == [11, 22, 33]
    assert all("CUDA out of memory" in f["reason"] for f in record["failed"])
    assert record["clients"] == []


def test_too_few_nodes_after_handshake_stops_the_run(
    fast_clients: None,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    # Prepare: node 22's handshake fails, node 33 never answers it; min-nodes is 2
    real_handshake = client_handlers()[wire.HANDSHAKE]

    def handshake(msg: Message, context: Any) -> Message:
        if msg.metadata.dst_node_id == 22:
            raise OSError("no such device")
        return real_handshake(msg, context)

    config = run_config({**TINY, "strategy": "local"})

    # Execute / Assert
    with pytest.raises(RuntimeError) as info:
        run_federation(
            config,
            digits_bundle,
            tmp_path / "run",
            num_rounds=1,
            handlers={wire.HANDSHAKE: handshake},
            silent={(33, wire.HANDSHAKE)},
        )
    message = str(info.value)
    assert "only 1 node(s) can take part but min-nodes=2" in message
    assert "node 22: error 2: OSError: no such device" in message


def test_bytes_down_of_fedavg_covers_the_model(federation: FederationRunner) -> None:
    # Execute
    fed = federation("fedavg")

    # Assert: each transfer carries at least the weights of the shared arch
    arrays = fed.server.initial_arrays(fed.server.shared_arch)
    weight_bytes = sum(a.nbytes for a in arrays.values())
    for record in fed.server.rounds:
        for client in record["clients"]:
            assert client["bytes_down"] >= weight_bytes
            assert client["bytes_up"] >= weight_bytes
        assert record["bytes_down_total"] == sum(c["bytes_down"] for c in record["clients"])
        assert record["bytes_up_total"] == sum(c["bytes_up"] for c in record["clients"])


def test_fedprox_reads_proximal_mu_from_the_run_config_and_sends_nothing_for_it(
    federation: FederationRunner, default_run_config: dict[str, Any]
) -> None:
    from client_app.app import resolve

    # Execute
    fed = federation("fedprox")
    _, client = resolve({**default_run_config, "strategy": "fedprox", "proximal-mu": 0.3})

    # Assert: the server sends no key the client would not read; the client's mu is the
    # run config's (every node shares it)
    for message in fed.grid.sent_of("train"):
        assert "proximal-mu" not in message.content.config_records[wire.CONFIG]
    assert client.options.proximal_mu == 0.3


# ------------------------------------------------------------------------- groups, local
def test_fedavg_groups_keeps_one_global_model_per_arch(federation: FederationRunner) -> None:
    # Execute
    fed = federation("fedavg-groups")

    # Assert
    choices = fed.node_choices()
    archs = set(choices.values())
    assert len(archs) > 1, choices
    assert set(fed.server.group_arrays) == archs
    for arch, arrays in fed.server.group_arrays.items():
        spec = fed.server.array_spec(arch)
        assert {k: (v.shape, str(v.dtype)) for k, v in arrays.items()} == spec
    for record in fed.server.rounds:
        assert {c["node"]: c["arch"] for c in record["clients"]} == choices
        assert record["group_sizes"] == dict(sorted(Counter(choices.values()).items()))
        assert set(record["global_accuracy_by_arch"]) == archs
    # each node receives its own group's model
    for message in fed.grid.sent_of("train"):
        node = message.metadata.dst_node_id
        assert message.content.config_records[wire.CONFIG]["arch"] == choices[node]
        assert set(sent_arrays(message)) == set(fed.server.array_spec(choices[node]))


def test_fedavg_groups_single_member_group_takes_its_member_model(
    federation: FederationRunner,
) -> None:
    # Prepare: the weak node is alone in its group
    fed = federation("fedavg-groups")
    arch = fed.node_choices()[WEAK_NODE]
    last = [r for r in fed.grid.replies_of("train")[3:] if r.metadata.src_node_id == WEAK_NODE]
    (reply,) = last
    expected = wire.record_to_numpy(reply.content.array_records[wire.ARRAYS])

    # Execute
    group_model = fed.server.group_arrays[arch]

    # Assert
    for key, value in expected.items():
        np.testing.assert_array_equal(group_model[key], value)


def test_local_sends_and_receives_no_arrays(federation: FederationRunner) -> None:
    # Execute
    fed = federation("local")

    # Assert
    choices = fed.node_choices()
    for message in fed.grid.sent_of("train"):
        assert len(message.content.array_records) == 0
    for reply in fed.grid.replies_of("train"):
        assert len(reply.content.array_records) == 0
    for record in fed.server.rounds:
        assert {c["node"]: c["arch"] for c in record["clients"]} == choices
        assert all(c["bytes_down"] < 1024 for c in record["clients"])
        assert all(c["bytes_up"] < 1024 for c in record["clients"])
        assert record["bytes_down_total"] < 3 * 1024
        assert record["global_accuracy"] is None
    # the clients keep their personal models
    for node, context in fed.grid.contexts.items():
        assert "tessera.model" in context.state.array_records, node


def test_local_like_trains_the_named_schemes_slices_alone(
    federation: FederationRunner, default_run_config: dict[str, Any]
) -> None:
    from strategies.baselines.local import LocalOptions

    # Execute
    fed = federation("local-like-fedfa")

    # Assert: every node picked one of FedFA's slices and nothing travelled
    config = {**default_run_config, "local-like": "fedfa", "model-family": ""}
    options = LocalOptions.parse(config)
    assert get_scheme("local").family(options) == "preresnet"
    fedfa = get_scheme("fedfa")
    slices = fedfa.client(
        run=RunConfig.from_flower(config), options=fedfa.parse_options(config)
    ).candidate_archs("preresnet")
    slices = [ref.name for ref in slices]
    choices = fed.node_choices()
    assert len(choices) == 3 and set(choices.values()) <= set(slices), choices
    assert all("@" in arch for arch in choices.values())
    for reply in fed.grid.replies_of("train"):
        assert len(reply.content.array_records) == 0
    (record,) = fed.server.rounds
    assert all(c["test_accuracy"] > 0.2 for c in record["clients"]), record["clients"]


@pytest.mark.parametrize(
    ("like", "match"),
    [
        ("nope", "run-config 'local-like': unknown strategy 'nope'"),
        ("local", "run-config 'local-like' is 'local'; name another scheme"),
    ],
)
def test_local_like_refuses_a_bad_scheme(
    default_run_config: dict[str, Any], like: str, match: str
) -> None:
    from strategies.baselines.local import LocalOptions

    with pytest.raises(ConfigError, match=re.escape(match)):
        LocalOptions.parse({**default_run_config, "local-like": like})


def test_local_like_family_follows_the_named_scheme(default_run_config: dict[str, Any]) -> None:
    from strategies.baselines.local import LocalOptions

    local = get_scheme("local")
    for like, family in (("", "cnn"), ("ensemble", "mixed"), ("heterofl", "preresnet")):
        options = LocalOptions.parse({**default_run_config, "local-like": like})
        assert local.family(options) == family, like


# ------------------------------------------------------------------------- FedProx maths
def test_proximal_term_hand_value() -> None:
    # Prepare: Linear(2, 1) with w = [[1, 2]], b = [0.5]; anchor w0 = [[0, -1]], b0 = [0]
    # ||w - w0||^2 = 1^2 + 3^2 + 0.5^2 = 10.25
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.copy_(torch.tensor([0.5]))
    anchor = [torch.tensor([[0.0, -1.0]]), torch.tensor([0.0])]

    # Execute
    value = proximal_term(model, anchor)
    value.backward()

    # Assert: d/dw ||w - w0||^2 = 2 (w - w0) = [[2, 6]], d/db = [1]
    assert value.item() == pytest.approx(10.25)
    assert model.weight.grad is not None and model.bias.grad is not None
    torch.testing.assert_close(model.weight.grad, torch.tensor([[2.0, 6.0]]))
    torch.testing.assert_close(model.bias.grad, torch.tensor([1.0]))


def test_proximal_term_rejects_wrong_anchor_count() -> None:
    # Prepare
    model = nn.Linear(2, 1)

    # Execute / Assert
    with pytest.raises(ValueError, match="2 parameters but 1 anchors"):
        proximal_term(model, [torch.zeros(1, 2)])


def test_fedprox_client_loss_adds_half_mu_times_proximal_term(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare: anchor at w0 = 0, then move to w = [[1, 1], [1, 1]], b = [1, 1]:
    # ||w - w0||^2 = 6; mu = 0.5 -> proximal part 0.5 * 0.5 * 6 = 1.5
    run = RunConfig.from_flower(default_run_config)
    client = FedProxClient(run=run, options=FedProxOptions(None, False, proximal_mu=0.5))
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    client.begin_round(model, round_input(RecordDict()), memory_state())
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    x = torch.tensor([[1.0, 0.0]])
    y = torch.tensor([0])
    # logits = W x + b = [1 + 1, 1 + 1] = [2, 2] -> cross-entropy ln 2
    loss_fn = client.loss_fn()

    # Execute
    loss = loss_fn(model, x, y)

    # Assert
    assert loss.item() == pytest.approx(math.log(2.0) + 1.5)


# ----------------------------------------------------------------------------- registry
def test_unknown_scheme_raises_listing_the_names() -> None:
    # Execute / Assert
    with pytest.raises(scheme_registry.SchemeError) as info:
        get_scheme("fedmagic")
    message = str(info.value)
    assert "'fedmagic'" in message
    for name in ["fedavg", "fedavg-groups", "fedprox", "flwr-fedavg", "local"]:
        assert name in message


def test_registry_lists_the_schemes() -> None:
    # Execute / Assert
    assert set(SCHEMES) <= set(list_schemes())
    assert list_schemes() == sorted(list_schemes())


def test_scheme_modules_name_where_each_built_in_scheme_registers() -> None:
    # Execute: import every scheme
    names = list_schemes()

    # Assert: each listed module defines the scheme object of its name; every
    # scheme registered from the package is listed
    for name, module in scheme_registry.SCHEME_MODULES.items():
        scheme = get_scheme(name)
        assert any(value is scheme for value in vars(sys.modules[module]).values()), name
    built_in = {n for n in names if get_scheme(n).server.__module__.startswith("strategies.")}
    assert built_in == set(scheme_registry.SCHEME_MODULES)


def test_client_app_imports_no_scheme_until_one_is_named() -> None:
    # Flower re-imports the app's modules for every message in deployment, so the
    # ClientApp must not import every scheme up front
    code = (
        "import sys, client_app.app\n"
        "def schemes():\n"
        "    return sorted({m.split('.')[1] for m in sys.modules\n"
        "                   if m.startswith('strategies.') and m.split('.')[1] != 'core'})\n"
        "print(schemes())\n"
        "from strategies import get_scheme\n"
        "get_scheme('felo')\n"
        "print(schemes())\n"
    )

    # Execute
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split("\n")

    # Assert
    assert out[0] == "[]"
    assert out[1] == "['felo']"


def test_duplicate_registration_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a private copy of the registry (every scheme imported first, so none
    # registers into the copy alone) so nothing leaks into other tests
    list_schemes()
    monkeypatch.setattr(scheme_registry, "_SCHEMES", dict(scheme_registry._SCHEMES))
    local = get_scheme("local")
    server = type("LocalCopy", (local.server,), {})
    fresh = dataclasses.replace(local, name="local-copy", server=server)
    register_scheme(fresh)

    # Execute / Assert: the name is given to the server class; one class serves one scheme
    assert get_scheme("local-copy") is fresh
    assert server.name == "local-copy" and local.server.name == "local"  # type: ignore[attr-defined]
    with pytest.raises(scheme_registry.SchemeError, match="already the server of scheme 'local'"):
        register_scheme(dataclasses.replace(local, name="local-again"))
    with pytest.raises(scheme_registry.SchemeError, match="'local-copy' is already registered"):
        register_scheme(fresh)
    with pytest.raises(scheme_registry.SchemeError, match="'fedavg' is already registered"):
        register_scheme(get_scheme("fedavg"))


# ------------------------------------------------------------------- base-loop helpers
def test_wait_for_nodes_times_out_naming_min_nodes() -> None:
    # Prepare
    grid = FakeGrid({11: Mock()})

    # Execute / Assert
    with pytest.raises(TimeoutError, match="min-nodes=2"):
        wait_for_nodes(grid, min_nodes=2, timeout=0.0)


def test_exchange_reports_nodes_without_a_reply() -> None:
    # Prepare: node 22 answers, node 33 does not
    def echo(msg: Message, context: Any) -> Message:
        return Message(RecordDict({"config": ConfigRecord({"ok": True})}), reply_to=msg)

    grid = FakeGrid({22: Mock(), 33: Mock()}, handlers={"train": echo})
    grid.silent.add((33, "train"))
    messages = [
        Message(RecordDict(), dst_node_id=n, message_type="train", ttl=60.0) for n in (22, 33)
    ]

    # Execute
    outcome = exchange(grid, messages, timeout=0.05, poll=0.01)

    # Assert
    assert [r.metadata.src_node_id for r in outcome.replies] == [22]
    assert outcome.missing == {33: "no reply within round-timeout=0.05s"}
    assert set(outcome.bytes_down) == {22, 33}


def test_pull_chunk_keeps_what_is_held_near_64_mib() -> None:
    # 64 MiB / 1 MB = 67; capped at 256 for tiny payloads, floored at 8 for huge ones
    assert [pull_chunk(b) for b in (0, 100_000, 1_000_000, 50_000_000)] == [256, 256, 67, 8]


@pytest.mark.parametrize(("payload", "per_call"), [(1_000, 256), (2**20, 64), (10**8, 8)])
def test_exchange_pulls_small_replies_in_few_calls(payload: int, per_call: int) -> None:
    # Prepare: 300 nodes that all answer, and what the caller measured was sent
    def echo(msg: Message, context: Any) -> Message:
        return Message(RecordDict({"config": ConfigRecord({"ok": True})}), reply_to=msg)

    calls: list[int] = []

    class Counting(FakeGrid):
        def pull_messages(self, message_ids: Any) -> Any:
            ids = list(message_ids)
            calls.append(len(ids))
            return super().pull_messages(ids)

    nodes = list(range(1, 301))
    grid = Counting(dict.fromkeys(nodes, Mock()), handlers={"train": echo})
    messages = [Message(RecordDict(), dst_node_id=n, message_type="train", ttl=60.0) for n in nodes]

    # Execute
    outcome = exchange(
        grid, messages, timeout=5.0, poll=0.01, bytes_down=dict.fromkeys(nodes, payload)
    )

    # Assert: every reply, in calls of at most the chunk the payload size allows
    assert len(outcome.replies) == 300 and not outcome.missing
    assert max(calls) == per_call
    assert len(calls) == -(-300 // per_call) * outcome.polls


def test_poll_wait_backs_off_and_never_undercuts_the_poll_cost() -> None:
    # by hand: replies came -> the floor; none -> x1.5 up to the cap; a costly poll
    # (50 ms) -> 4 x 50 ms whatever else holds
    assert poll_wait(0.5, got_any=True, poll_seconds=0.0, poll=0.02) == 0.02
    assert poll_wait(0.1, got_any=False, poll_seconds=0.0, poll=0.02) == pytest.approx(0.15)
    assert poll_wait(0.2, got_any=False, poll_seconds=0.0, poll=0.02) == MAX_POLL_INTERVAL == 0.25
    assert poll_wait(0.02, got_any=True, poll_seconds=0.05, poll=0.02) == pytest.approx(
        POLL_COST_FACTOR * 0.05
    )
    assert poll_wait(0.9, got_any=False, poll_seconds=0.5, poll=0.02) == pytest.approx(2.0)
    # a floor above the cap is kept (a caller asking for slow polls gets them)
    assert poll_wait(3.0, got_any=False, poll_seconds=0.0, poll=3.0) == 3.0
    # and 0.1 ms per pending reply: 2,000 pending -> 0.2 s; 50 pending -> the floor
    assert poll_wait(0.02, got_any=True, poll_seconds=0.0, poll=0.02, pending=2000) == (
        pytest.approx(2000 * PENDING_WAIT)
    )
    assert poll_wait(0.02, got_any=True, poll_seconds=0.0, poll=0.02, pending=50) == 0.02


def test_exchange_spaces_costly_polls_and_times_the_server_s_own_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: a SuperLink whose pull takes 30 ms of wall time (a sleep: no CPU) and
    # whose node answers only on the fourth pull; the pauses between polls are recorded
    def echo(msg: Message, context: Any) -> Message:
        return Message(RecordDict({"config": ConfigRecord({"ok": True})}), reply_to=msg)

    pulls = 0
    real_sleep = time.sleep  # the exchange's time.sleep is patched below (one module)

    class Slow(FakeGrid):
        def pull_messages(self, message_ids: Any) -> Any:
            nonlocal pulls
            pulls += 1
            real_sleep(0.03)
            return super().pull_messages(message_ids) if pulls >= 4 else []

    pauses: list[float] = []
    monkeypatch.setattr(
        "strategies.core.exchange.time.sleep", lambda s: (pauses.append(s), real_sleep(0))
    )
    grid = Slow({22: Mock()}, handlers={"train": echo})
    message = Message(RecordDict(), dst_node_id=22, message_type="train", ttl=60.0)

    # Execute
    def busy(reply: Message) -> None:  # 20 ms of CPU work folding the reply
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass

    outcome = exchange(grid, [message], timeout=30.0, poll=0.01, on_reply=busy)

    # Assert: three pauses, none shorter than 4 x the 30 ms poll; the pull's wall time
    # holds the sleeps, its CPU time does not; the fold's work is CPU time
    assert not outcome.missing and outcome.polls == 4 == pulls
    assert len(pauses) == 3 and min(pauses) >= POLL_COST_FACTOR * 0.03
    assert outcome.pull_seconds >= 0.12
    assert 0.0 <= outcome.pull_cpu_seconds < outcome.pull_seconds / 2
    assert outcome.fold_cpu_seconds >= 0.02


def test_exchange_does_not_space_polls_by_the_download_of_replies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: two nodes; the pull that brings node 22's reply takes 200 ms (a busy
    # machine downloading it), every other pull 1 ms; node 23 answers from the third
    # pull on. Before, the pause after the slow pull was 4 x 200 ms, added to the round
    # (a deployed round waited 4 x 1.3 s after its first reply).
    def echo(msg: Message, context: Any) -> Message:
        return Message(RecordDict({"config": ConfigRecord({"ok": True})}), reply_to=msg)

    pulls = 0
    real_sleep = time.sleep

    class Downloading(FakeGrid):
        def pull_messages(self, message_ids: Any) -> Any:
            nonlocal pulls
            pulls += 1
            ids = list(message_ids)
            if pulls == 1:  # node 22's reply only (its message was sent first)
                real_sleep(0.2)
                return super().pull_messages(ids[:1])
            real_sleep(0.001)
            return super().pull_messages(ids) if pulls >= 3 else []

    pauses: list[float] = []
    monkeypatch.setattr(
        "strategies.core.exchange.time.sleep", lambda s: (pauses.append(s), real_sleep(0))
    )
    grid = Downloading({22: Mock(), 23: Mock()}, handlers={"train": echo})
    messages = [
        Message(RecordDict(), dst_node_id=node, message_type="train", ttl=60.0) for node in (22, 23)
    ]

    # Execute
    outcome = exchange(grid, messages, timeout=30.0, poll=0.01)

    # Assert: both replied; the pause after the slow, productive pull is the floor;
    # the pause after the empty 1 ms pull is its back-off, far below 4 x 200 ms
    assert not outcome.missing and pulls == 3
    assert pauses[0] == pytest.approx(0.01)
    assert pauses[1] < POLL_COST_FACTOR * 0.2 / 10
    assert outcome.fold_seconds >= outcome.fold_cpu_seconds - 0.005


def handshake_reply(node_id: int, **profile: Any) -> Mock:
    record = {
        "model": "cnn-2",
        "arch": "cnn-2",
        "family": "cnn",
        "size-rank": 1,
        "arch-fits": True,
        "num-train": 100,
        "num-test": 20,
        "partition-id": 0,
        "label-counts": [10] * 10,
        "device-name": "cpu-small",
    }
    record.update(profile)
    if "arch" in profile and "model" not in profile:  # a whole registered model
        record["model"] = profile["arch"]
    reply = Mock(spec=Message)
    reply.metadata.src_node_id = node_id
    reply.has_error.return_value = False
    reply.content = RecordDict({wire.PROFILE: ConfigRecord(record)})
    return reply


def test_parse_handshake_reads_the_profile() -> None:
    # Execute
    info = parse_handshake(handshake_reply(5), ["cnn-1", "cnn-2"])

    # Assert
    assert not isinstance(info, Rejection)
    assert info.node_id == 5
    assert info.arch == "cnn-2"
    assert info.size_rank == 1
    assert info.label_counts == (10,) * 10
    assert info.profile == {"name": "cpu-small"}


@pytest.mark.parametrize(
    ("profile", "fragment"),
    [
        ({"arch": "resnet-999"}, "unknown architecture 'resnet-999'"),
        ({"num-train": 0}, "num-train=0"),
        # a claim past MAX_EXAMPLES would make the round's weighted sums overflow
        ({"num-train": 1.7e308, "label-counts": [1.7e307] * 10}, "above the 1,000,000,000"),
        ({"num-train": 10**9 + 10, "label-counts": [10**8 + 1] * 10}, "num-train=1000000010"),
        ({"num-test": 10**9 + 1}, "num-test=1000000001"),
        ({"size-rank": "big"}, "malformed"),
    ],
)
def test_parse_handshake_rejects_bad_profiles(profile: dict[str, Any], fragment: str) -> None:
    # Execute
    info = parse_handshake(handshake_reply(5, **profile), ["cnn-1", "cnn-2"])

    # Assert
    assert isinstance(info, Rejection)
    assert fragment in info.reason


def test_a_checkpoint_s_node_table_cannot_bring_back_a_size_the_handshake_refuses() -> None:
    # Prepare: a node's table entry as a checkpoint writes it, its size then raised
    from strategies.core.nodes import MAX_EXAMPLES, NodeInfo
    from tessera.state_checks import StateFileError

    info = parse_handshake(handshake_reply(5), ["cnn-1", "cnn-2"])
    assert not isinstance(info, Rejection)
    entry = info.to_dict()
    assert NodeInfo.from_dict(entry, where="nodes.5") == info

    # Execute / Assert
    for key in ("num_train", "num_test"):
        with pytest.raises(StateFileError, match=rf"nodes.5.{key}.*at most 1,000,000,000"):
            NodeInfo.from_dict({**entry, key: MAX_EXAMPLES + 1}, where="nodes.5")


# ------------------------------------------------------------- Flower's FedAvg reference
@pytest.mark.parametrize(
    "changed",
    [{"aggregator": "median"}, {"weight-cap": 1.0}, {"clip-factor": 0.0, "server-trust": False}],
)
def test_flwr_fedavg_refuses_the_defence_keys_it_would_ignore(
    run_config: Callable[..., dict[str, Any]], changed: dict[str, Any]
) -> None:
    # Prepare: Flower's unmodified FedAvg weighs replies by their stated num-examples
    # and bounds nothing
    config = run_config({**TINY, "strategy": "flwr-fedavg", "fedavg-arch": "cnn-1"})
    scheme_registry.resolve_run(config)  # the defaults are not a change

    # Execute / Assert: a key it would ignore is refused, naming it and the fix
    with pytest.raises(ConfigError, match="flwr-fedavg' is Flower's unmodified") as info:
        scheme_registry.resolve_run({**config, **changed})
    for key in changed:
        assert repr(key) in str(info.value)
    assert "strategy='fedavg'" in str(info.value)


def test_flwr_fedavg_rounds_can_be_plotted(
    fast_clients: None,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    # Prepare
    config = run_config({**TINY, "strategy": "flwr-fedavg", "fedavg-arch": "cnn-1"})
    contexts = {
        node: make_context(node, config, {"partition-id": i, "num-partitions": 3})
        for i, node in enumerate(NODE_IDS)
    }
    grid = FakeGrid(contexts)
    config = {**config, "output-dir": str(tmp_path), "run-name": "r"}
    built = build_server(config, bundle=digits_bundle)
    runner, run = built.runner, built.env.run
    runner.start(grid, num_rounds=1, timeout=run.deployment.round_timeout)
    assert len(runner.rounds) == 1
    assert runner.rounds[0]["num_ok"] == 3

    # Execute: what server_app.main does after every run
    written = plot_rounds(runner.rounds, tmp_path / "r")

    # Assert
    assert [p.name for p in written] == ["accuracy.png", "bytes.png"]
