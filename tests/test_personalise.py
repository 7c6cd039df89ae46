"""Run-config ``personalise``: finetune, Ditto and FedRep around weight-sharing schemes.

The maths by hand, the config's refusals, three-round federations of real ClientApps
on the in-process grid (``fedavg-groups`` in each mode, HeteroFL's slices and Felo
with FedRep's personal head), and the personal parts surviving a node's restart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from client_app.personalise import (
    STATE_DITTO,
    STATE_HEAD,
    STATE_META,
    PersonalisedClient,
    ditto_loss,
    head_names,
)
from strategies import resolve_run
from strategies.core.client import ClientAlgorithm, RoundOutcome
from tessera import wire
from tessera.config import ConfigError, RunConfig
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tessera.training import TrainStats
from tests.conftest import install_fast_clients, memory_state, round_input, torch_threads
from tests.test_prototypes import THREE_ARCHS
from tests.test_strategies import Federation, run_federation

RunConfigFactory = Callable[..., dict[str, Any]]


# ------------------------------------------------------------------------ maths
def test_ditto_loss_is_cross_entropy_plus_half_lambda_times_the_squared_distance() -> None:
    # Prepare: a 2-class linear model at w = [[1, 0], [0, 1]], b = 0, anchored at 0;
    # x = [1, 0], y = 0: logits [1, 0], CE = log(1 + e^-1); ||v - 0||^2 = 2
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
        model.bias.zero_()
    anchor = [torch.zeros(2, 2), torch.zeros(2)]
    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])

    # Execute
    loss = ditto_loss(0.5, anchor)(model, x, y)
    plain = ditto_loss(0.0, anchor)(model, x, y)

    # Assert
    ce = float(np.log(1 + np.exp(-1.0)))
    assert loss.item() == pytest.approx(ce + 0.5 * 0.5 * 2.0, rel=1e-6)
    assert plain.item() == pytest.approx(ce, rel=1e-6)


def test_ditto_loss_pulls_the_personal_model_towards_the_anchor() -> None:
    # Prepare: zero data gradient (x = 0, balanced targets); only the proximal term moves
    model = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        model.weight.fill_(3.0)
    anchor = [torch.ones(2, 1)]
    loss = ditto_loss(2.0, anchor)(model, torch.zeros(2, 1), torch.tensor([0, 1]))

    # Execute
    loss.backward()  # type: ignore[no-untyped-call]

    # Assert: d/dv [lambda/2 ||v - w||^2] = lambda (v - w) = 2 * (3 - 1) = 4
    assert model.weight.grad is not None
    torch.testing.assert_close(model.weight.grad, torch.full((2, 1), 4.0))


def test_head_names_are_the_linear_heads_entries() -> None:
    assert head_names({"body.0.weight": 0, "head.weight": 1, "head.bias": 2, "header": 3}) == [
        "head.weight",
        "head.bias",
    ]


def test_finetune_starts_from_the_received_model_not_the_trained_one(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare: a node receives w = 3 everywhere and trains it to 5 for its reply; its
    # data are all x = 0, so cross-entropy has no gradient on the weights and a
    # fine-tuned copy ends exactly where it started
    run = RunConfig.from_flower({**default_run_config, "personalise": "finetune"})
    client = PersonalisedClient(ClientAlgorithm(run=run, options=None), run.personalise)
    data = ArrayDataset(np.zeros((4, 1), np.float32), np.array([0, 1, 0, 1]))
    client.prepare_data(data, data)
    model = nn.Linear(1, 2, bias=False)
    sent = {"weight": torch.full((2, 1), 3.0)}
    rnd = round_input(RecordDict({wire.ARRAYS: wire.state_to_record(sent)}))
    client.load_weights(model, rnd, memory_state())
    with torch.no_grad():
        model.weight.fill_(5.0)  # the reply's local training
    outcome = RoundOutcome(
        stats=TrainStats(loss=0.0, seconds=0.0, num_examples=4, steps=1),
        test_loss=0.0,
        test_accuracy=0.5,
        num_test=4,
        train=data,
        device=torch.device("cpu"),
    )

    # Execute
    personal = client._finetuned(model, outcome)

    # Assert: the personal copy is the received weights; the reply's model is untouched
    torch.testing.assert_close(personal.weight, torch.full((2, 1), 3.0))
    torch.testing.assert_close(model.weight, torch.full((2, 1), 5.0))


# ----------------------------------------------------------------------- config
def test_defaults_and_keys(default_run_config: dict[str, Any]) -> None:
    run = RunConfig.from_flower(default_run_config)
    assert (run.personalise.mode, run.personalise.epochs) == ("none", 1)
    assert run.personalise.ditto_lambda == pytest.approx(0.1)
    flat = run.to_dict()
    assert {"personalise", "personalise-epochs", "ditto-lambda"} <= set(flat)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"personalise": "maml"}, "use one of none, finetune, ditto, rep"),
        ({"personalise-epochs": 0}, "personalise-epochs"),
        ({"ditto-lambda": -1.0}, "ditto-lambda"),
        ({"ditto-lambda": float("nan")}, "ditto-lambda"),
    ],
)
def test_bad_values_are_refused_naming_the_key(
    run_config: RunConfigFactory, overrides: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        resolve_run(run_config(overrides))


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [
        ("fedhe", {}),
        ("fedproto", {}),
        ("lg-fedavg", {}),
        ("local", {}),
        ("felo", {"felo-share-weights": False}),
    ],
)
def test_a_scheme_that_shares_no_whole_model_refuses_personalise(
    run_config: RunConfigFactory, strategy: str, extra: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError, match=r"personalise.*'ditto'.*fedavg-groups"):
        resolve_run(run_config({"strategy": strategy, "personalise": "ditto", **extra}))


@pytest.mark.parametrize(
    "strategy",
    ["fedavg", "fedprox", "fedavg-groups", "heterofl", "flexifed", "nefl", "fedfa", "felo", "velo"],
)
def test_weight_sharing_schemes_accept_every_mode(
    run_config: RunConfigFactory, strategy: str
) -> None:
    for mode in ("finetune", "ditto", "rep"):
        resolved = resolve_run(run_config({"strategy": strategy, "personalise": mode}))
        assert resolved.run.personalise.mode == mode


# ---------------------------------------------------------------- stored parts
def test_a_stored_part_of_another_model_or_mode_is_not_used(
    caplog: pytest.LogCaptureFixture, default_run_config: dict[str, Any]
) -> None:
    # Prepare: a head kept for cnn-3 under rep
    run = RunConfig.from_flower({**default_run_config, "personalise": "rep"})
    client = PersonalisedClient(ClientAlgorithm(run=run, options=None), run.personalise)
    state: NodeState = memory_state()
    head = {"head.weight": torch.ones(10, 4), "head.bias": torch.zeros(10)}
    state.put(STATE_HEAD, wire.state_to_record(head))
    state.put(STATE_META, ConfigRecord({"arch": "cnn-3", "mode": "rep"}))
    rnd = round_input(RecordDict(), arch="cnn-3")
    other = round_input(RecordDict(), arch="cnn-2")

    # Execute / Assert: this model and mode: used; another model: not (said why);
    # another shape: forgotten
    assert client._stored(state, STATE_HEAD, rnd, like=head) is not None
    assert client._stored(state, STATE_HEAD, other, like=head) is None
    assert "starting afresh" in caplog.text
    wider = {"head.weight": torch.ones(10, 8), "head.bias": torch.zeros(10)}
    assert client._stored(state, STATE_HEAD, rnd, like=wider) is None
    assert state.arrays(STATE_HEAD) is None


def test_a_client_that_sends_no_weights_cannot_be_wrapped(
    default_run_config: dict[str, Any],
) -> None:
    run = RunConfig.from_flower({**default_run_config, "personalise": "ditto"})
    inner = ClientAlgorithm(run=run, options=None)
    inner.sends_weights = False
    with pytest.raises(ValueError, match="sends weights"):
        PersonalisedClient(inner, run.personalise)


# ------------------------------------------------------------------ federations
RUNS: dict[str, dict[str, Any]] = {
    "finetune": {"strategy": "fedavg-groups", "personalise": "finetune"},
    "ditto": {"strategy": "fedavg-groups", "personalise": "ditto", "ditto-lambda": 0.5},
    "rep": {"strategy": "fedavg-groups", "personalise": "rep", "personalise-epochs": 2},
    "heterofl-rep": {"strategy": "heterofl", "personalise": "rep", "model-family": ""},
    "felo-ditto": {"strategy": "felo", "personalise": "ditto"},
    "ensemble-finetune": {
        "strategy": "ensemble",
        "personalise": "finetune",
        "ensemble-trials": 5,
        "ensemble-gradient-steps": 20,
    },
}


@pytest.fixture(scope="module")
def federation(
    default_run_config: dict[str, Any],
    digits_bundle: Any,
    candidate_cost_cache: dict[tuple[Any, ...], Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], Federation]]:
    """``federation(name)``: the finished 3-round run ``RUNS[name]``, run on first use."""
    done: dict[str, Federation] = {}
    with pytest.MonkeyPatch.context() as mp, torch_threads(1):
        install_fast_clients(mp, digits_bundle, candidate_cost_cache)

        def get(name: str) -> Federation:
            if name not in done:
                config = {**default_run_config, **THREE_ARCHS, **RUNS[name]}
                run_dir = tmp_path_factory.mktemp(name) / "run"
                done[name] = run_federation(config, digits_bundle, run_dir, num_rounds=3)
            return done[name]

        yield get


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_round_is_accepted_and_the_record_names_the_mode(
    federation: Callable[[str], Federation], name: str
) -> None:
    run = federation(name)
    mode = RUNS[name]["personalise"]
    assert [r["round"] for r in run.server.rounds] == [1, 2, 3]
    for record in run.server.rounds:
        assert not record["skipped"], record["skip_reason"]
        assert record["num_rejected"] == 0, record["rejected"]
        assert record["personalise"] == mode
        assert record["personal_accuracy_mean"] > 0.1  # above chance on 10 classes
        has_shared = mode in ("finetune", "ditto")
        assert (record["shared_accuracy_mean"] is not None) == has_shared
        for client in record["clients"]:
            assert ("shared_accuracy" in client) == has_shared
    lines = run.metrics_lines()
    assert [line["personalise"] for line in lines] == [mode] * 3


@pytest.mark.parametrize("name", ["finetune", "ditto", "felo-ditto", "ensemble-finetune"])
def test_the_personal_model_is_not_the_sent_one(
    federation: Callable[[str], Federation], name: str
) -> None:
    # Assert: the personal accuracy is measured on another model than the sent one's
    # (on 3 x 3 replies, not one pair of accuracies may agree by chance everywhere)
    clients = [c for r in federation(name).server.rounds for c in r["clients"]]
    assert any(c["test_accuracy"] != c["shared_accuracy"] for c in clients)


def test_ditto_keeps_its_personal_model_in_node_state(
    federation: Callable[[str], Federation],
) -> None:
    run = federation("ditto")
    for node, context in run.grid.contexts.items():
        personal = context.state.array_records[STATE_DITTO].to_torch_state_dict()
        arch = run.server.nodes[node].arch
        shared = run.server.models.get(arch)
        assert set(personal) >= set(shared)
        assert any(not np.allclose(personal[k].numpy(), shared[k]) for k in shared if "weight" in k)
        assert context.state.config_records[STATE_META]["mode"] == "ditto"


@pytest.mark.parametrize("name", ["rep", "heterofl-rep"])
def test_rep_sends_back_the_head_it_received_and_keeps_its_own(
    federation: Callable[[str], Federation], name: str
) -> None:
    run = federation(name)
    sent = run.grid.sent_of("train")
    replies = run.grid.replies_of("train")
    assert len(sent) == len(replies) == 9
    by_message = {m.metadata.message_id: m for m in sent}
    for reply in replies:
        message = by_message[reply.metadata.reply_to_message_id]
        down = wire.record_to_numpy(message.content.array_records[wire.ARRAYS])
        up = wire.record_to_numpy(reply.content.array_records[wire.ARRAYS])
        heads = head_names(up)
        assert heads, "the reply lost the head entries"
        for key in heads:
            np.testing.assert_array_equal(up[key], down[key])
        body = [k for k in up if k not in heads and "weight" in k]
        assert any(not np.array_equal(up[k], down[k]) for k in body)
    for context in run.grid.contexts.values():
        kept = context.state.array_records[STATE_HEAD].to_torch_state_dict()
        assert set(kept) == {"head.weight", "head.bias"}
        assert context.state.config_records[STATE_META]["mode"] == "rep"


def test_rep_trains_the_personal_head_above_the_shared_head(
    federation: Callable[[str], Federation],
) -> None:
    # Assert: the server's heads never move (every reply returns them), so the
    # personal heads are what the personal accuracy owes its rise to; with the
    # server's untrained head the same bodies would be near chance
    run = federation("rep")
    last = run.server.rounds[-1]
    assert last["personal_accuracy_mean"] > 0.3, last["personal_accuracy_mean"]


# ------------------------------------------------------------------- restarts
def _node_context(run_config: RunConfigFactory, state_dir: Path, mode: str) -> Any:
    from tessera.local_grid import make_context

    config = run_config(
        {
            "strategy": "fedavg-groups",
            "personalise": mode,
            "local-epochs": 1,
            "model-family": "cnn",
        }
    )
    where = {"partition-id": 1, "num-partitions": 3, "state-dir": str(state_dir)}
    return make_context(7, config, where)


def _round_message(server_round: int) -> Any:
    from tessera.local_grid import instruction

    config = ConfigRecord(
        {
            "server-round": server_round,
            "scheme": "fedavg-groups",
            "model": "cnn-1",
            "arch": "cnn-1",
            "num-classes": 10,
            "input-shape": [1, 8, 8],
            "federation": "fed-p",
        }
    )
    return instruction(RecordDict({wire.CONFIG: config}), dst_node_id=7, message_type="train")


@pytest.mark.parametrize(("mode", "key"), [("ditto", STATE_DITTO), ("rep", STATE_HEAD)])
def test_the_personal_part_survives_a_restart_and_the_next_round_starts_from_it(
    run_config: RunConfigFactory,
    tmp_path: Path,
    fast_clients: None,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    key: str,
) -> None:
    import client_app.personalise
    from client_app.app import train
    from tessera.training import train_model as real

    # Prepare: record the weights every personal training starts from
    starts: list[dict[str, torch.Tensor]] = []

    def recording(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        starts.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(client_app.personalise, "train_model", recording)
    first = _node_context(run_config, tmp_path, mode)
    train(_round_message(1), first)
    kept = first.state.array_records[key].to_torch_state_dict()

    # Execute: the node restarts (a new context, its state empty) and trains round 2
    restarted = _node_context(run_config, tmp_path, mode)
    assert key not in restarted.state.array_records
    train(_round_message(2), restarted)

    # Assert: round 2's personal training started from what round 1 kept on disk
    assert len(starts) == 2
    for name, value in kept.items():
        torch.testing.assert_close(starts[1][name], value)
    assert not torch.equal(starts[0]["head.weight"], starts[1]["head.weight"])


def test_the_report_says_which_personalisation_the_accuracy_is_of() -> None:
    from tessera.report import personalise_line

    line = personalise_line({"personalise": "ditto", "shared_accuracy_mean": 0.8125})
    assert line == "  personalised by ditto; the shared models on the same splits: 0.812"
    assert personalise_line({"personalise": "rep", "shared_accuracy_mean": None}) == (
        "  personalised by rep"
    )
    assert personalise_line({"personalise": "none"}) == personalise_line({}) == ""
