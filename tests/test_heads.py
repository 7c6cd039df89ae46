"""FedGH and LG-FedAvg: the global head by hand, what a node loads and sends, in-process runs.

The federations run on the FakeGrid of three real ClientApps under the settings of
``tests/test_prototypes.py`` (three CNN sizes: cnn-1, cnn-4, cnn-5), so one head
serves three bodies; node 22's round-2 reply is tampered with, to see it refused
while the round goes on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from models.spec import ModelRef
from server_app.app import build_server
from strategies import get_scheme
from strategies.core.context import RoundContext
from strategies.core.validation import ClientReply, check_arrays
from strategies.prototypes.fedgh import FedGHClient, FedGHOptions, FedGHStrategy, train_head
from strategies.prototypes.head import HEAD_KEYS, initial_head, linear_head
from strategies.prototypes.lgfedavg import LGFedAvgClient, LGFedAvgOptions, LGFedAvgStrategy
from strategies.prototypes.payload import CLASS_PROTOTYPES, ClassPrototypes, prototypes_to_record
from tessera import wire
from tessera.checkpoint import CheckpointError
from tessera.config import ConfigError, RunConfig
from tests.conftest import install_fast_clients, memory_state, round_input, torch_threads
from tests.test_prototypes import THREE_ARCHS, _reply
from tests.test_strategies import Federation, run_federation

HEAD = set(HEAD_KEYS)


# ------------------------------------------------------------------ FedGH server
def test_server_head_training_drives_the_ce_on_separable_prototypes_to_near_zero(
    single_thread_torch: None,
) -> None:
    # Prepare: three clients' prototypes of 4 classes around the axes (separable);
    # a zero head gives every class logit 0, so the CE is log 4 by hand
    gen = torch.Generator().manual_seed(0)
    rows = torch.cat([3.0 * torch.eye(4, 8) + 0.1 * torch.randn(4, 8, generator=gen)] * 3)
    labels = torch.arange(4).repeat(3)
    head = torch.nn.Linear(8, 4)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    before = F.cross_entropy(head(rows), labels).item()

    # Execute
    result = train_head(
        head, rows, labels, epochs=200, batch_size=32, learning_rate=0.5, generator=gen
    )

    # Assert: one batch of 12 per epoch; the CE from log 4 to near zero
    assert before == pytest.approx(math.log(4))
    assert result.steps == 200
    with torch.no_grad():
        after = F.cross_entropy(head(rows), labels).item()
    assert after < 0.02, after
    assert result.loss < 0.02


def _ctx() -> RoundContext:
    return RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))


def _server(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path, **keys: Any
) -> Any:
    config = run_config({**keys, "output-dir": str(tmp_path), "run-name": "r"})
    return build_server(config, bundle=digits_bundle).runner


def _proto_reply(node: int, protos: ClassPrototypes) -> ClientReply:
    content = RecordDict({CLASS_PROTOTYPES: prototypes_to_record(protos)})
    metrics = {wire.NUM_EXAMPLES: float(protos.counts.sum())}
    return ClientReply(node, "cnn-1", metrics, None, content, 0, 0)


def test_fedgh_server_trains_its_head_on_the_replies_and_sends_it(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: two nodes' prototypes of classes 0-3 (of 10) in a 4-d feature space
    server = _server(
        run_config,
        digits_bundle,
        tmp_path,
        strategy="fedgh",
        **{"feature-dim": 4, "fedgh-server-lr": 0.5, "fedgh-server-epochs": 200},
    )
    ids = np.arange(4, dtype=np.int64)
    replies = [
        _proto_reply(n, ClassPrototypes(ids, np.full(4, 5, np.int64), 3.0 * np.eye(4, dtype="f4")))
        for n in (1, 2)
    ]
    sent_before = server.node_content(_ctx(), 1, "cnn-1")

    # Execute
    record = server.aggregate(_ctx(), replies)

    # Assert: the seeded initial head was sent first; the trained head classifies
    # the prototypes, CE near zero
    first = wire.record_to_numpy(sent_before.array_records[wire.ARRAYS])
    expected = initial_head(num_classes=10, feature_dim=4, seed=server.env.run.seed)
    assert set(first) == HEAD
    np.testing.assert_array_equal(first["head.weight"], expected["head.weight"])
    head = linear_head(server.head)
    with torch.no_grad():
        logits = head(torch.from_numpy(3.0 * np.eye(4, dtype="f4")))
    assert F.cross_entropy(logits, torch.arange(4)).item() < 0.05
    assert record["fedgh_steps"] == 200 and record["prototype_classes"] == 4
    after = wire.record_to_numpy(server.node_content(_ctx(), 1, "cnn-1").array_records[wire.ARRAYS])
    np.testing.assert_array_equal(after["head.weight"], server.head["head.weight"])


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"prototypes": np.array([[0, np.nan, 0, 0], [0] * 4], np.float32)}, "non-finite"),
        ({"prototypes": np.zeros((2, 6), np.float32)}, "feature dimension 6 vs 4"),
        ({"counts": np.array([5, 1])}, "counts sum to 6 but the reply reports num-examples=3"),
    ],
)
def test_fedgh_reply_schema_refuses_bad_prototypes(
    changes: dict[str, np.ndarray],
    reason: str,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    # Prepare: a FedGH server's schema (feature-dim 4)
    server = _server(run_config, digits_bundle, tmp_path, strategy="fedgh", **{"feature-dim": 4})
    schema = server.reply_schema(_ctx(), 1, "cnn-1")

    # Execute
    assert schema.extra is not None
    problem = schema.extra(_reply(**changes))

    # Assert: no weights demanded; the prototype check names the problem
    assert schema.arrays is None
    assert problem is not None and reason in problem, problem
    assert schema.extra(_reply()) is None


# ------------------------------------------------------------------ FedGH client
def test_fedgh_client_replaces_its_own_head_by_the_global_one(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare: a node with a personal cnn-1 (feature-dim 8) in its state, and the
    # server's head (all weights 0.5, biases -1)
    run = RunConfig.from_flower(default_run_config)
    client = FedGHClient(run=run, options=FedGHOptions(feature_dim=8))
    state = memory_state()
    rnd = round_input(RecordDict({wire.CONFIG: ConfigRecord({})}), arch="cnn-1")
    torch.manual_seed(1)
    personal = client.build_model(ModelRef("cnn-1"), input_shape=(1, 8, 8), num_classes=10)
    client.save_state(personal, rnd, state)
    head = {"head.weight": np.full((10, 8), 0.5, "f4"), "head.bias": np.full(10, -1.0, "f4")}
    content = RecordDict({wire.CONFIG: ConfigRecord({}), wire.ARRAYS: wire.numpy_to_record(head)})
    torch.manual_seed(2)
    model = client.build_model(ModelRef("cnn-1"), input_shape=(1, 8, 8), num_classes=10)

    # Execute
    source = client.load_weights(model, round_input(content, arch="cnn-1"), state)

    # Assert: the personal body, the global head
    assert source == "personal"
    loaded = model.state_dict()
    for key, value in personal.state_dict().items():
        if key.startswith("head."):
            np.testing.assert_array_equal(loaded[key].numpy(), head[key])
        else:
            torch.testing.assert_close(loaded[key], value)
    assert not client.sends_weights and client.keeps_personal_model


def test_a_client_refuses_a_global_head_of_another_shape(
    default_run_config: dict[str, Any],
) -> None:
    run = RunConfig.from_flower(default_run_config)
    client = LGFedAvgClient(run=run, options=LGFedAvgOptions(feature_dim=8))
    model = client.build_model(ModelRef("cnn-1"), input_shape=(1, 8, 8), num_classes=10)
    wrong = {"head.weight": np.zeros((10, 4), "f4"), "head.bias": np.zeros(10, "f4")}
    content = RecordDict({wire.ARRAYS: wire.numpy_to_record(wrong)})
    with pytest.raises(ConfigError, match=r"global head is unusable .*shape \(10, 4\)"):
        client.load_weights(model, round_input(content, arch="cnn-1"), memory_state())


# ------------------------------------------------------------------ LG-FedAvg
def _head_reply(node: int, num_examples: int, head: dict[str, np.ndarray]) -> ClientReply:
    metrics = {wire.NUM_EXAMPLES: float(num_examples)}
    content = RecordDict({wire.METRICS: MetricRecord(dict(metrics))})
    return ClientReply(node, f"cnn-{node}", metrics, head, content, 0, 0)


def _lg_round(server: Any, replies: list[ClientReply]) -> dict[str, Any]:
    ctx = _ctx()
    for reply in replies:
        server.fold(ctx, reply)
    out: dict[str, Any] = server.aggregate(ctx, replies)
    return out


def test_lg_fedavg_head_is_the_example_weighted_mean_of_two_nodes(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: the plain mean (clip-factor 0); node 1 (10 examples) moves the
    # weights by +0.01 and the biases by +1, node 5 (30 examples) by +0.05 and -1
    server = _server(
        run_config, digits_bundle, tmp_path, strategy="lg-fedavg", **{"clip-factor": 0.0}
    )
    start = {k: v.copy() for k, v in server.global_head().items()}
    a = {"head.weight": start["head.weight"] + 0.01, "head.bias": start["head.bias"] + 1.0}
    b = {"head.weight": start["head.weight"] + 0.05, "head.bias": start["head.bias"] - 1.0}

    # Execute
    record = _lg_round(server, [_head_reply(1, 10, a), _head_reply(5, 30, b)])

    # Assert: (10 * 0.01 + 30 * 0.05) / 40 = 0.04; (10 - 30) / 40 = -0.5; both
    # architectures (cnn-1, cnn-5) in one group
    head = server.global_head()
    np.testing.assert_allclose(head["head.weight"], start["head.weight"] + 0.04, atol=1e-6)
    np.testing.assert_allclose(head["head.bias"], start["head.bias"] - 0.5, atol=1e-6)
    assert record == {"head_updates": 2, "head_clipped": []}


def test_lg_fedavg_bounds_a_head_scaled_1000_times(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: the default bounded mean; node 1 moves every weight by 0.01, node 5
    # by 1000 x 0.01 (biases unmoved), equal examples
    server = _server(run_config, digits_bundle, tmp_path, strategy="lg-fedavg")
    start = {k: v.copy() for k, v in server.global_head().items()}
    a = {"head.weight": start["head.weight"] + 0.01, "head.bias": start["head.bias"].copy()}
    b = {"head.weight": start["head.weight"] + 10.0, "head.bias": start["head.bias"].copy()}

    # Execute
    record = _lg_round(server, [_head_reply(1, 20, a), _head_reply(5, 20, b)])

    # Assert: the first round's bound is clip-factor (1) x the lower median of the
    # two distances, node 1's: node 5's update is cut to +0.01 too, so the mean is +0.01
    (clip,) = record["head_clipped"]
    assert clip["node"] == 5 and clip["arch"] == "head"
    assert clip["bound"] == pytest.approx(0.01 * math.sqrt(start["head.weight"].size), rel=1e-4)
    head = server.global_head()
    np.testing.assert_allclose(head["head.weight"], start["head.weight"] + 0.01, atol=1e-5)
    np.testing.assert_allclose(head["head.bias"], start["head.bias"], atol=1e-6)


def test_lg_fedavg_demands_exactly_the_head(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare
    server = _server(run_config, digits_bundle, tmp_path, strategy="lg-fedavg")
    spec = server.reply_schema(_ctx(), 1, "cnn-1").arrays
    head = {k: v.copy() for k, v in server.global_head().items()}

    # Execute: the head alone, the head plus a body entry, a NaN head
    good = check_arrays(wire.numpy_to_record(head), spec)
    body = check_arrays(wire.numpy_to_record({**head, "body.x": np.zeros(2, "f4")}), spec)
    head["head.bias"][0] = np.nan
    nan = check_arrays(wire.numpy_to_record(head), spec)

    # Assert
    assert isinstance(good, dict) and set(good) == HEAD
    assert body == "array names differ: missing [], unexpected ['body.x']"
    assert nan == "array 'head.bias' has non-finite values"


def test_options_defaults_and_refusals(default_run_config: dict[str, Any]) -> None:
    # Execute
    gh = get_scheme("fedgh").parse_options(default_run_config)
    lg = get_scheme("lg-fedavg").parse_options(default_run_config)

    # Assert: the declared defaults; bad values and an ignored merge rule refused
    assert gh == FedGHOptions(feature_dim=128, server_epochs=100, server_lr=0.1)
    assert lg == LGFedAvgOptions(feature_dim=128)
    for key, value in (("fedgh-server-epochs", 0), ("fedgh-server-lr", 0.0)):
        with pytest.raises(ConfigError, match=key):
            FedGHOptions.parse({**default_run_config, key: value})
    with pytest.raises(ConfigError, match="knowledge-merge"):
        from strategies import resolve_run

        resolve_run({**default_run_config, "strategy": "fedgh", "knowledge-merge": "median"})
    assert get_scheme("fedgh").server is FedGHStrategy
    assert get_scheme("lg-fedavg").server is LGFedAvgStrategy


# ------------------------------------------------------------------ federations
RUNS: dict[str, dict[str, Any]] = {
    "fedgh": {"strategy": "fedgh", "fedgh-server-epochs": 50},
    "lg-fedavg": {"strategy": "lg-fedavg"},
}


def _spoil_round_2(name: str) -> Callable[[Message], Message]:
    """Node 22's second reply: a NaN prototype (fedgh) or a body entry with the head (lg)."""
    calls = [0]

    def spoil(reply: Message) -> Message:
        calls[0] += 1
        if calls[0] != 2:
            return reply
        if name == "fedgh":
            arrays = wire.record_to_numpy(reply.content.array_records[CLASS_PROTOTYPES])
            arrays["prototypes"][0, 0] = np.nan
            reply.content.array_records[CLASS_PROTOTYPES] = wire.numpy_to_record(arrays)
        else:
            arrays = wire.record_to_numpy(reply.content.array_records[wire.ARRAYS])
            arrays["body.extra"] = np.zeros(3, np.float32)
            reply.content.array_records[wire.ARRAYS] = wire.numpy_to_record(arrays)
        return reply

    return spoil


@pytest.fixture(scope="module", params=sorted(RUNS))
def fed(
    request: pytest.FixtureRequest,
    default_run_config: dict[str, Any],
    digits_bundle: Any,
    candidate_cost_cache: dict[tuple[Any, ...], Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Federation]]:
    """Each scheme of :data:`RUNS` and its finished 3-round run (once per module)."""
    name: str = request.param
    with pytest.MonkeyPatch.context() as mp, torch_threads(1):
        install_fast_clients(mp, digits_bundle, candidate_cost_cache)
        config = {**default_run_config, **THREE_ARCHS, **RUNS[name]}
        run_dir = tmp_path_factory.mktemp(name) / "run"
        spoil = {22: _spoil_round_2(name)}
        yield name, run_federation(config, digits_bundle, run_dir, num_rounds=3, tamper=spoil)


def test_scheme_runs_three_rounds_on_three_architectures(fed: tuple[str, Federation]) -> None:
    # Prepare
    name, run = fed

    # Assert: three architectures, no round skipped; node 22's spoilt round-2 reply
    # refused with its reason, the round going on with the other two
    assert len(set(run.node_choices().values())) == 3, run.node_choices()
    assert [r["round"] for r in run.server.rounds] == [1, 2, 3]
    for record in run.server.rounds:
        assert not record["skipped"], record["skip_reason"]
        rejected = 1 if record["round"] == 2 else 0
        assert record["num_ok"] == 3 - rejected, record["rejected"]
        assert record["num_rejected"] == rejected
        assert record["global_accuracy"] is None  # the bodies stay at the nodes
    (refusal,) = run.server.rounds[1]["rejected"]
    assert refusal["node"] == 22
    reason = "non-finite" if name == "fedgh" else "unexpected ['body.extra']"
    assert reason in refusal["reason"], refusal
    # Assert: the head and nothing else goes down every round, the same to every node
    # (what the server held), and (lg-fedavg) up; the bodies stay in the node state
    for message in run.grid.sent_of("train"):
        assert set(message.content.array_records[wire.ARRAYS]) == HEAD
    replies = run.grid.replies_of("train")
    uploads = [set(r.content.array_records.get(wire.ARRAYS, {})) for r in replies]
    if name == "lg-fedavg":  # 9 replies: the head alone, and the head of node 22's spoilt one
        assert len(uploads) == 9 and all(up >= HEAD for up in uploads)
        assert [up - HEAD for up in uploads if up != HEAD] == [{"body.extra"}]
    else:
        assert uploads == [set()] * 9
    for reply in replies:
        assert (CLASS_PROTOTYPES in reply.content.array_records) == (name == "fedgh")
    for context in run.grid.contexts.values():
        personal = context.state.array_records["tessera.model"]
        assert any(key.startswith("body.") for key in personal)
    # Assert: above chance (0.1) on the personal models after three rounds
    last = run.server.rounds[-1]
    assert last["personal_accuracy_mean"] > 0.4, last["personal_accuracy_mean"]


def test_every_node_trains_from_one_head_that_the_round_moves(
    fed: tuple[str, Federation],
) -> None:
    # Prepare: what round 3 sent, and the head the server holds at the end
    _, run = fed
    sent = [
        wire.record_to_numpy(m.content.array_records[wire.ARRAYS])
        for m in run.grid.sent_of("train")
        if m.content.config_records[wire.CONFIG]["server-round"] == 3
    ]

    # Assert: one head for all three architectures in round 3, moved by round 3's replies
    assert len(sent) == 3
    for head in sent[1:]:
        for key in HEAD:
            np.testing.assert_array_equal(head[key], sent[0][key])
    final = run.server.global_head()
    assert not np.allclose(final["head.weight"], sent[0]["head.weight"])


def test_checkpoint_round_trip_and_refusal(
    fed: tuple[str, Federation],
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    # Prepare: a fresh server of the same run (another results folder), and the
    # finished one's state
    name, run = fed
    state = run.server.state_dict()
    fresh = _server(run_config, digits_bundle, tmp_path, **{**THREE_ARCHS, **RUNS[name]})

    # Execute
    fresh.load_state_dict(state)

    # Assert: the head is restored; a NaN head or a missing one is refused
    for key in HEAD:
        np.testing.assert_array_equal(fresh.global_head()[key], run.server.global_head()[key])
    saved = state["global_head"]
    if name == "fedgh":
        bad = {**saved, "head.bias": np.full_like(saved["head.bias"], np.nan)}
    else:
        arrays = dict(saved["arrays"]["head"])
        arrays["head.bias"] = np.full_like(arrays["head.bias"], np.nan)
        bad = {**saved, "arrays": {"head": arrays}}
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        fresh.load_state_dict({**state, "global_head": bad})
    with pytest.raises(CheckpointError, match="global_head"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "global_head"})
