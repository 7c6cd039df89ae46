"""FML: the mutual objective by hand, the meme's schema, the node's lifecycle, runs, attacks.

The federations run on the FakeGrid of three real ClientApps under the settings of
``tests/test_prototypes.py`` (three CNN sizes: cnn-1, cnn-4, cnn-5), so one meme
(cnn-2) is trained beside three personal architectures; node 22's round-2 reply is
tampered with, to see it refused while the round goes on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from models.spec import ModelRef
from server_app.app import build_server
from strategies import get_scheme
from strategies.core.client import MODEL_ROUNDS, STATE_MODEL, STATE_MODEL_META
from strategies.core.context import RoundContext
from strategies.core.validation import check_arrays
from strategies.fml.client import FMLClient
from strategies.fml.objective import mutual_loss, mutual_losses
from strategies.fml.options import FMLOptions
from strategies.fml.pair import MutualPair
from strategies.fml.server import MEME_GROUP, FMLStrategy
from tessera import wire
from tessera.checkpoint import CheckpointError
from tessera.config import ConfigError, RunConfig
from tests.conftest import (
    TINY_DIGITS,
    install_fast_clients,
    memory_state,
    round_input,
    torch_threads,
)
from tests.test_prototypes import THREE_ARCHS, _attacked_run
from tests.test_strategies import NODE_IDS, Federation, run_federation


# ------------------------------------------------------------------ objective
def test_mutual_losses_by_hand() -> None:
    # Prepare: one sample of class 0; the personal model says (1/2, 1/2), the meme
    # (3/4, 1/4); alpha 0.5, beta 0.25
    personal = torch.tensor([[0.0, 0.0]])
    meme = torch.tensor([[math.log(3.0), 0.0]])
    y = torch.tensor([0])

    # Execute
    own, shared = mutual_losses(personal, meme, y, alpha=0.5, beta=0.25)

    # Assert: CE(p) = ln 2, CE(m) = ln 4/3;
    # KL(m || p) = 3/4 ln(3/2) + 1/4 ln(1/2), KL(p || m) = 1/2 ln(2/3) + 1/2 ln 2
    kl_m_p = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    kl_p_m = 0.5 * math.log(2 / 3) + 0.5 * math.log(2.0)
    assert own.item() == pytest.approx(0.5 * math.log(2.0) + 0.5 * kl_m_p, rel=1e-6)
    assert shared.item() == pytest.approx(0.25 * math.log(4 / 3) + 0.75 * kl_p_m, rel=1e-6)


def test_the_kl_is_the_batch_mean_of_the_per_sample_divergence() -> None:
    # Prepare: sample 1 as above, sample 2 where both models agree (KL 0); alpha 0
    personal = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    meme = torch.tensor([[math.log(3.0), 0.0], [1.0, -1.0]])
    y = torch.tensor([0, 1])

    # Execute
    own, shared = mutual_losses(personal, meme, y, alpha=0.0, beta=0.0)

    # Assert: half of sample 1's divergence (summed over classes, not averaged)
    assert own.item() == pytest.approx((0.75 * math.log(1.5) + 0.25 * math.log(0.5)) / 2)
    assert shared.item() == pytest.approx((0.5 * math.log(2 / 3) + 0.5 * math.log(2.0)) / 2)


def test_each_model_gets_the_gradient_of_its_own_loss_only() -> None:
    # Prepare
    personal = torch.tensor([[0.3, -0.2, 0.1]], requires_grad=True)
    meme = torch.tensor([[-0.5, 0.4, 0.0]], requires_grad=True)
    y = torch.tensor([2])

    # Execute
    own, shared = mutual_losses(personal, meme, y, alpha=0.5, beta=0.5)
    own.backward()  # type: ignore[no-untyped-call]

    # Assert: the meme's prediction is a target of the personal loss (and vice versa)
    assert meme.grad is None and personal.grad is not None
    shared.backward()  # type: ignore[no-untyped-call]
    assert meme.grad is not None


def test_the_loss_of_a_pair_is_the_sum_of_both_losses(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare: a cnn-4 personal model and a cnn-1 meme on 8x8 inputs
    client = FMLClient(run=RunConfig.from_flower(default_run_config), options=FMLOptions())
    torch.manual_seed(0)
    pair = client.build_model(ModelRef("cnn-4"), input_shape=(1, 8, 8), num_classes=10)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 3, 5, 9])

    # Execute
    total = client.loss_fn()(pair, x, y)

    # Assert: the pair's forward is its personal model's; its state both models'
    assert isinstance(pair, MutualPair)
    own, shared = mutual_losses(pair.personal(x), pair.meme(x), y, alpha=0.5, beta=0.5)
    assert total.item() == pytest.approx((own + shared).item(), rel=1e-6)
    torch.testing.assert_close(pair(x), pair.personal(x))
    assert pair.head is pair.personal.head
    assert {k.split(".")[0] for k in pair.state_dict()} == {"personal", "meme"}
    with pytest.raises(TypeError, match="MutualPair"):
        mutual_loss(alpha=0.5, beta=0.5)(pair.meme, x, y)


# ------------------------------------------------------------------ options
def test_options_defaults_and_refusals(default_run_config: dict[str, Any]) -> None:
    # Execute
    options = get_scheme("fml").parse_options(default_run_config)

    # Assert: the declared defaults; an unknown meme and weights outside [0, 1] refused
    assert options == FMLOptions(meme_arch="cnn-2", alpha=0.5, beta=0.5)
    assert get_scheme("fml").server is FMLStrategy
    for key, value, match in (
        ("fml-meme-arch", "cnn-99", "not a registered model"),
        ("fml-alpha", 1.5, "fml-alpha"),
        ("fml-beta", -0.1, "fml-beta"),
        ("fml-alpha", float("nan"), "fml-alpha"),
    ):
        with pytest.raises(ConfigError, match=match):
            FMLOptions.parse({**default_run_config, key: value})


# ------------------------------------------------------------------ server
def _ctx() -> RoundContext:
    return RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))


def _server(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path, **keys: Any
) -> Any:
    config = run_config({"strategy": "fml", **keys, "output-dir": str(tmp_path), "run-name": "r"})
    return build_server(config, bundle=digits_bundle).runner


def test_the_server_sends_the_meme_to_every_node_and_demands_exactly_it_back(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: the seeded cnn-2 meme, and what a cnn-5 node must send
    server = _server(run_config, digits_bundle, tmp_path)
    meme = {k: v.copy() for k, v in server.global_meme().items()}
    spec = server.reply_schema(_ctx(), 1, "cnn-5").arrays
    key = next(k for k, v in meme.items() if v.ndim == 4)  # a conv kernel

    def check(arrays: dict[str, np.ndarray]) -> Any:
        return check_arrays(wire.numpy_to_record(arrays), spec)

    # Execute: the meme, then one thing wrong each
    sent = server.node_content(_ctx(), 1, "cnn-5")
    good = check(meme)
    extra = check({**meme, "personal.x": np.zeros(2, "f4")})
    missing = check({k: v for k, v in meme.items() if k != key})
    wrong = check({**meme, key: np.zeros((1, *meme[key].shape), "f4")})
    double = check({**meme, key: meme[key].astype("f8")})
    meme[key][0, 0, 0, 0] = np.nan
    nan = check(meme)

    # Assert: the node's own arch in the config, the meme as the weights record
    assert sent.config_records[wire.CONFIG]["arch"] == "cnn-5"
    assert set(wire.record_to_numpy(sent.array_records[wire.ARRAYS])) == set(spec)
    assert spec == server.array_spec("cnn-2") and set(spec) == set(server.global_meme())
    assert isinstance(good, dict) and set(good) == set(spec)
    assert extra == "array names differ: missing [], unexpected ['personal.x']"
    assert missing == f"array names differ: missing ['{key}'], unexpected []"
    assert isinstance(wrong, str) and key in wrong and "shape" in wrong
    assert isinstance(double, str) and "float64" in double
    assert nan == f"array '{key}' has non-finite values"


def test_the_global_meme_is_the_example_weighted_mean_and_is_what_is_evaluated(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: the plain mean; node 1 (10 examples) moves every entry by +1, node 2
    # (30 examples) by -1
    from strategies.core.validation import ClientReply

    server = _server(run_config, digits_bundle, tmp_path, **{"clip-factor": 0.0})
    start = {k: v.copy() for k, v in server.global_meme().items()}
    ctx = _ctx()
    replies = [
        ClientReply(
            node,
            arch,
            {wire.NUM_EXAMPLES: float(n)},
            {k: v + step for k, v in start.items()},
            RecordDict(),
            0,
            0,
        )
        for node, arch, n, step in ((1, "cnn-4", 10, 1.0), (2, "cnn-5", 30, -1.0))
    ]

    # Execute
    for reply in replies:
        server.fold(ctx, reply)
    record = server.aggregate(ctx, replies)

    # Assert: (10 - 30) / 40 = -0.5 on every entry, both architectures in one group
    for key, value in server.global_meme().items():
        np.testing.assert_allclose(value, start[key] - 0.5, atol=1e-5)
    assert record == {"meme_updates": 2, "meme_clipped": []}
    assert set(server.global_models()) == {"cnn-2"}


# ------------------------------------------------------------------ client
def test_a_node_loads_the_server_meme_and_its_own_personal_model_and_sends_the_meme(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare: a node with a personal cnn-4 in its state, and the server's meme
    run = RunConfig.from_flower(default_run_config)
    client = FMLClient(run=run, options=FMLOptions())
    state = memory_state()
    config = RecordDict({wire.CONFIG: ConfigRecord({})})
    torch.manual_seed(1)
    earlier = client.build_model(ModelRef("cnn-4"), input_shape=(1, 8, 8), num_classes=10)
    assert isinstance(earlier, MutualPair)
    client.save_state(earlier, round_input(config, arch="cnn-4"), state)
    torch.manual_seed(2)
    other = client.build_model(ModelRef("cnn-4"), input_shape=(1, 8, 8), num_classes=10)
    assert isinstance(other, MutualPair)
    server_meme = wire.state_to_record(other.meme.state_dict())
    content = RecordDict({wire.CONFIG: ConfigRecord({}), wire.ARRAYS: server_meme})
    rnd = round_input(content, arch="cnn-4")
    torch.manual_seed(3)
    model = client.build_model(ModelRef("cnn-4"), input_shape=(1, 8, 8), num_classes=10)
    assert isinstance(model, MutualPair)

    # Execute
    source = client.load_weights(model, rnd, state)

    # Assert: the personal model from the state, the meme from the server
    assert source == "personal"
    for key, value in earlier.personal.state_dict().items():
        torch.testing.assert_close(model.personal.state_dict()[key], value)
    for key, value in wire.record_to_numpy(server_meme).items():
        np.testing.assert_array_equal(model.meme.state_dict()[key].numpy(), value)
    # Assert: the state holds the personal model under its own names, no meme
    stored = state.arrays(STATE_MODEL)
    assert stored is not None
    assert set(stored) == set(wire.exchanged_state(earlier.personal.state_dict()))
    assert client.sends_weights and client.keeps_personal_model


def test_a_node_refuses_a_missing_or_foreign_meme(default_run_config: dict[str, Any]) -> None:
    run = RunConfig.from_flower(default_run_config)
    client = FMLClient(run=run, options=FMLOptions())
    model = client.build_model(ModelRef("cnn-4"), input_shape=(1, 8, 8), num_classes=10)
    nothing = round_input(RecordDict({wire.CONFIG: ConfigRecord({})}), arch="cnn-4")
    with pytest.raises(ConfigError, match="sent no meme"):
        client.load_weights(model, nothing, memory_state())
    other = client.build_model(ModelRef("cnn-3"), input_shape=(1, 8, 8), num_classes=10)
    assert isinstance(other, MutualPair)
    foreign = RecordDict({wire.ARRAYS: wire.state_to_record(other.personal.state_dict())})
    with pytest.raises(ConfigError, match="fml-meme-arch"):
        client.load_weights(model, round_input(foreign, arch="cnn-4"), memory_state())


# ------------------------------------------------------------------ federation
def _spoil_round_2() -> Callable[[Message], Message]:
    """Node 22's second reply: its meme plus an array of its personal model."""
    calls = [0]

    def spoil(reply: Message) -> Message:
        calls[0] += 1
        if calls[0] == 2:
            arrays = wire.record_to_numpy(reply.content.array_records[wire.ARRAYS])
            arrays["personal.extra"] = np.zeros(3, np.float32)
            reply.content.array_records[wire.ARRAYS] = wire.numpy_to_record(arrays)
        return reply

    return spoil


@pytest.fixture(scope="module")
def fed(
    default_run_config: dict[str, Any],
    digits_bundle: Any,
    candidate_cost_cache: dict[tuple[Any, ...], Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Federation]:
    """A finished 3-round FML run on three architectures (once per module)."""
    with pytest.MonkeyPatch.context() as mp, torch_threads(1):
        install_fast_clients(mp, digits_bundle, candidate_cost_cache)
        config = {**default_run_config, **THREE_ARCHS, "strategy": "fml"}
        run_dir = tmp_path_factory.mktemp("fml") / "run"
        yield run_federation(
            config, digits_bundle, run_dir, num_rounds=3, tamper={22: _spoil_round_2()}
        )


def test_fml_runs_three_rounds_on_three_architectures(fed: Federation) -> None:
    # Prepare
    run = fed
    meme = set(run.server.global_meme())

    # Assert: three architectures, no round skipped; node 22's spoilt round-2 reply
    # refused with its reason, the round going on with the other two
    assert len(set(run.node_choices().values())) == 3, run.node_choices()
    assert [r["round"] for r in run.server.rounds] == [1, 2, 3]
    for record in run.server.rounds:
        assert not record["skipped"], record["skip_reason"]
        rejected = 1 if record["round"] == 2 else 0
        assert record["num_ok"] == 3 - rejected, record["rejected"]
        assert record["meme_updates"] == 3 - rejected
        assert record["global_accuracy_by_arch"].keys() == {"cnn-2"}
    (refusal,) = run.server.rounds[1]["rejected"]
    assert refusal["node"] == 22 and "unexpected ['personal.extra']" in refusal["reason"]
    # Assert: the meme and nothing else goes down and up, under its own names
    for message in run.grid.sent_of("train"):
        assert set(message.content.array_records[wire.ARRAYS]) == meme
    uploads = [set(r.content.array_records[wire.ARRAYS]) for r in run.grid.replies_of("train")]
    assert len(uploads) == 9 and sum(up != meme for up in uploads) == 1
    # Assert: the personal models above chance (0.1) after three rounds; the meme
    # (a cnn-1 that FedAvg too leaves near chance here after three rounds) evaluated
    last = run.server.rounds[-1]
    assert last["personal_accuracy_mean"] > 0.4, last["personal_accuracy_mean"]
    assert 0.0 <= last["global_accuracy"] <= 1.0


def test_every_node_keeps_its_personal_model_across_rounds(fed: Federation) -> None:
    # Prepare: each node's architecture, and the rounds its replies counted
    run = fed
    rounds: dict[int, list[int]] = {node: [] for node in NODE_IDS}
    for reply in run.grid.replies_of("train"):
        metrics = reply.content.metric_records[wire.METRICS]
        rounds[int(reply.metadata.src_node_id)].append(wire.int_value(metrics, MODEL_ROUNDS))

    # Assert: the personal model trained on from round to round (1, 2, 3), and the
    # state holds it under its own names, of the node's own architecture
    assert all(sorted(r) == [1, 2, 3] for r in rounds.values()), rounds
    for node, context in run.grid.contexts.items():
        meta = context.state.config_records[STATE_MODEL_META]
        assert meta["arch"] == run.node_choices()[node] and meta["rounds"] == 3
        stored = set(context.state.array_records[STATE_MODEL])
        assert not any(k.startswith(("meme.", "personal.")) for k in stored)
        if meta["arch"] != "cnn-1":
            assert stored != set(run.server.global_meme())


def test_every_node_trains_from_one_meme_that_the_round_moves(fed: Federation) -> None:
    # Prepare: what round 3 sent
    run = fed
    sent = [
        wire.record_to_numpy(m.content.array_records[wire.ARRAYS])
        for m in run.grid.sent_of("train")
        if m.content.config_records[wire.CONFIG]["server-round"] == 3
    ]

    # Assert: one meme for three architectures, moved by round 3's replies
    assert len(sent) == 3
    for meme in sent[1:]:
        for key, value in sent[0].items():
            np.testing.assert_array_equal(meme[key], value)
    final = run.server.global_meme()
    assert any(not np.allclose(final[k], v) for k, v in sent[0].items())


def test_checkpoint_round_trip_and_refusal(
    fed: Federation,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    # Prepare: a fresh server of the same run (another results folder), and the
    # finished one's state
    state = fed.server.state_dict()
    fresh = _server(run_config, digits_bundle, tmp_path, **THREE_ARCHS)

    # Execute
    fresh.load_state_dict(state)

    # Assert: the meme is restored; a NaN meme, another group or none is refused
    for key, value in fed.server.global_meme().items():
        np.testing.assert_array_equal(fresh.global_meme()[key], value)
    saved = state["global_meme"]
    arrays = {k: v.copy() for k, v in saved["arrays"][MEME_GROUP].items()}
    first = next(iter(arrays))
    arrays[first] = np.full_like(arrays[first], np.nan)
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        fresh.load_state_dict({**state, "global_meme": {**saved, "arrays": {MEME_GROUP: arrays}}})
    other = {**saved, "arrays": {"cnn-1": saved["arrays"][MEME_GROUP]}, "medians": {}}
    with pytest.raises(CheckpointError, match="cnn-1"):
        fresh.load_state_dict({**state, "global_meme": other})
    with pytest.raises(CheckpointError, match="global_meme"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "global_meme"})


# ------------------------------------------------------------------ attacks
def test_a_hostile_node_s_boosted_meme_is_bounded(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # Prepare: four nodes, one boosting its meme update x1000
    config = run_config(
        {
            **TINY_DIGITS,
            "strategy": "fml",
            "attack": "boost",
            "attack-fraction": 0.25,
            "attack-scale": 1000.0,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )

    # Execute
    server, _, (hostile,) = _attacked_run(config, digits_bundle, rounds=2)

    # Assert: every round completed with the honest nodes in it; the hostile node's
    # meme cut from hundreds of times the bound to it (an honest one at most trimmed
    # near its bound, or dropped by the server's direction check); the meme finite
    for record in server.rounds:
        assert not record["skipped"], record["skip_reason"]
        assert len({c["node"] for c in record["clients"]} - {hostile}) == 3
        assert [a["node"] for a in record["attackers"]] == [hostile]
        clips = [c for c in record["meme_clipped"] if c["kind"] != "direction"]
        assert any(c["node"] == hostile and c["distance"] > 100 * c["bound"] for c in clips)
        assert all(c["distance"] < 2 * c["bound"] for c in clips if c["node"] != hostile)
    assert all(np.all(np.isfinite(v)) for v in server.global_meme().values())
