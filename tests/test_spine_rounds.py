"""The round loop's seams driven end to end on a fake grid of real ClientApp handlers.

Sampling, quorum and stragglers, checkpoint and resume, the evaluation and
end-of-run hooks, client wrappers and node state across a device restart. The
server is built by ``server_app.app.build_server``, exactly as the ServerApp does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from client_app.app import handshake, resolve, train, train_round
from server_app.app import build_server
from strategies.baselines.fedavg_groups import FedAvgGroupsStrategy
from strategies.core.client import ClientWrapper, Record, RoundInput, RoundOutcome
from strategies.core.context import RoundContext
from strategies.core.strategy import HeteroStrategy, RunStoppedError
from strategies.felo.knowledge import KNOWLEDGE, record_to_knowledge
from tessera import wire
from tessera.config import ConfigError
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tests.conftest import TINY_DIGITS, FakeGrid, instruction, make_context, make_grid

TINY = {**TINY_DIGITS, "cvae-epochs": 5}

RunConfigFactory = Callable[..., dict[str, Any]]


@pytest.fixture(autouse=True)
def _fast(fast_clients: None) -> None:
    """Cached data and candidate costs, one torch thread."""


def run(
    config: Mapping[str, Any],
    bundle: Any,
    *,
    grid: FakeGrid | None = None,
    num_nodes: int = 3,
) -> tuple[Any, FakeGrid]:
    """Build the server as the ServerApp does and run it on a fake grid."""
    grid = grid if grid is not None else make_grid(config, num_nodes)
    built = build_server(config, bundle=bundle)
    built.runner.start(
        grid,
        num_rounds=built.env.run.scheme.num_server_rounds,
        timeout=built.env.run.deployment.round_timeout,
    )
    return built.runner, grid


def metrics_lines(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------- sampling
def test_fraction_train_half_of_ten_nodes_trains_five_per_round_seeded(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare
    def config(name: str) -> dict[str, Any]:
        return run_config(
            {
                **TINY,
                "strategy": "fedavg-groups",
                "num-server-rounds": 3,
                "fraction-train": 0.5,
                "min-nodes": 10,
                "output-dir": str(tmp_path),
                "run-name": name,
            }
        )

    # Execute: the same run twice
    first, grid = run(config("a"), digits_bundle, num_nodes=10)
    run(config("b"), digits_bundle, num_nodes=10)

    # Assert: 5 of 10 each round, recorded, different across rounds, same on a rerun
    draws = [tuple(r["selected_partitions"]) for r in metrics_lines(tmp_path / "a")]
    assert [len(d) for d in draws] == [5, 5, 5]
    assert len(set(draws)) > 1, draws
    assert draws == [tuple(r["selected_partitions"]) for r in metrics_lines(tmp_path / "b")]
    for record in first.rounds:
        assert record["num_eligible"] == 10 and record["num_sent"] == 5 and record["num_ok"] == 5
        assert sorted(c["node"] for c in record["clients"]) == record["selected"]
    trained = [m.metadata.dst_node_id for m in grid.sent_of("train")]
    assert len(trained) == 15
    assert len(grid.sent_of(wire.HANDSHAKE)) == 10


# --------------------------------------------------------------- quorum and stragglers
def test_straggler_below_min_replies_skips_the_round_and_keeps_the_global_state(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: node 102 never answers; a round needs all three replies; timeout 1 s
    config = run_config(
        {
            **TINY,
            "strategy": "fedavg",
            "num-server-rounds": 3,
            "round-timeout": 1.0,
            "min-replies": 3,
            "max-failed-rounds": 2,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    grid = make_grid(config, 3)
    grid.silent.add((102, "train"))
    built = build_server(config, bundle=digits_bundle)

    # Execute
    with pytest.raises(RunStoppedError, match=r"2 rounds in a row.*min-replies=3"):
        built.runner.start(grid, num_rounds=3, timeout=1.0)

    # Assert: two rounds recorded as skipped, the global model never moved
    lines = metrics_lines(tmp_path / "r")
    assert [r["round"] for r in lines] == [1, 2]
    for record in lines:
        assert record["skipped"] is True
        assert "2 accepted replies of 3 sent, min-replies=3" in record["skip_reason"]
        assert record["num_ok"] == 2 and record["num_failed"] == 1
        assert record["failed"][0]["node"] == 102
        assert "round-timeout=1s" in record["failed"][0]["reason"]
        assert 1.0 <= record["round_seconds"] < 10.0
    server = built.runner
    initial = server.initial_arrays(server.shared_arch)
    for key, value in server.global_arrays.items():
        np.testing.assert_array_equal(value, initial[key], err_msg=key)
    # and the checkpoint says so too
    assert json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[-1])["skipped"]


def test_a_straggler_above_the_quorum_only_costs_the_timeout(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare
    config = run_config(
        {
            **TINY,
            "strategy": "fedavg-groups",
            "num-server-rounds": 1,
            "round-timeout": 1.0,
            "min-replies": 2,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    grid = make_grid(config, 3)
    grid.silent.add((102, "train"))

    # Execute
    server, _ = run(config, digits_bundle, grid=grid)

    # Assert
    (record,) = server.rounds
    assert record["skipped"] is False and record["num_ok"] == 2
    assert server.failed_streak == 0


# ------------------------------------------------------------------ checkpoint, resume
SERVER_STATE_SCHEMES = ["fedavg", "fedavg-groups", "felo", "velo"]


def final_weights(server: Any) -> dict[str, dict[str, np.ndarray]]:
    return {arch: dict(arrays) for arch, arrays in server.global_models().items()}


@pytest.mark.parametrize("strategy", SERVER_STATE_SCHEMES)
def test_resume_continues_to_the_same_model_with_every_round_once(
    strategy: str, run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare
    base = {**TINY, "strategy": strategy, "output-dir": str(tmp_path)}
    whole = run_config({**base, "num-server-rounds": 4, "run-name": "whole"})
    part = run_config({**base, "num-server-rounds": 2, "run-name": "part"})
    resumed = run_config(
        {**base, "num-server-rounds": 4, "run-name": "ignored", "resume": str(tmp_path / "part")}
    )

    # Execute: 4 rounds at once; 2 rounds, then a new server (fresh grid) resumes to 4
    uninterrupted, _ = run(whole, digits_bundle)
    run(part, digits_bundle)
    continued, _ = run(resumed, digits_bundle)

    # Assert: one metrics.jsonl with rounds 1..4 exactly once, and the same final model
    assert [r["round"] for r in metrics_lines(tmp_path / "part")] == [1, 2, 3, 4]
    assert not (tmp_path / "ignored").exists()
    assert [r["round"] for r in continued.rounds] == [1, 2, 3, 4]
    got, want = final_weights(continued), final_weights(uninterrupted)
    assert got.keys() == want.keys() and want
    for arch, arrays in want.items():
        for key, value in arrays.items():
            np.testing.assert_array_equal(got[arch][key], value, err_msg=f"{arch}/{key}")
    if strategy in ("felo", "velo"):
        assert continued.targets is not None and uninterrupted.targets is not None
        np.testing.assert_array_equal(continued.targets.logits, uninterrupted.targets.logits)


def test_resume_drops_rounds_written_after_the_last_checkpoint(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: 2 rounds, then a crash after round 3's metrics line but before its checkpoint
    base = {**TINY, "strategy": "fedavg-groups", "output-dir": str(tmp_path), "run-name": "r"}
    run(run_config({**base, "num-server-rounds": 2}), digits_bundle)
    metrics = tmp_path / "r" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    ghost = json.loads(lines[-1]) | {"round": 3}
    metrics.write_text("\n".join([*lines, json.dumps(ghost), '{"round": 4, "cut']) + "\n")

    # Execute
    resumed, _ = run(
        run_config({**base, "num-server-rounds": 3, "resume": str(tmp_path / "r")}),
        digits_bundle,
    )

    # Assert
    assert [r["round"] for r in metrics_lines(tmp_path / "r")] == [1, 2, 3]
    assert metrics_lines(tmp_path / "r")[2]["num_ok"] == 3
    assert resumed.completed_round == 3


def test_resume_refuses_another_experiment(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare
    base = {**TINY, "strategy": "fedavg-groups", "output-dir": str(tmp_path), "run-name": "r"}
    run(run_config({**base, "num-server-rounds": 1}), digits_bundle)

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"seed: 42 -> 7"):
        build_server(
            run_config({**base, "seed": 7, "resume": str(tmp_path / "r")}), bundle=digits_bundle
        )
    with pytest.raises(ConfigError, match=r"scheme 'fedavg-groups'.*'local'"):
        build_server(
            run_config({**base, "strategy": "local", "resume": str(tmp_path / "r")}),
            bundle=digits_bundle,
        )
    with pytest.raises(ConfigError, match=r"holds no checkpoint\.npz"):
        build_server(run_config({**base, "resume": str(tmp_path)}), bundle=digits_bundle)


def test_a_fresh_run_refuses_a_used_results_folder(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    base = {**TINY, "strategy": "local", "output-dir": str(tmp_path), "run-name": "r"}
    run(run_config({**base, "num-server-rounds": 1}), digits_bundle)
    with pytest.raises(FileExistsError, match="resume="):
        build_server(run_config(base), bundle=digits_bundle)


# ------------------------------------------------------------ evaluation, end of run
class CustomEvaluation(FedAvgGroupsStrategy):
    """Overrides the evaluation and end-of-run hooks."""

    name = "fedavg-groups"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.evaluated: list[int] = []

    def evaluate(self, ctx: RoundContext) -> dict[str, Any]:
        self.evaluated.append(ctx.server_round)
        return {**super().evaluate(ctx), "custom_metric": 10 * ctx.server_round}

    def end_of_run(self, ctx: RoundContext) -> dict[str, Any]:
        return {"tuned_after_round": ctx.server_round, "rounds_seen": len(self.rounds)}


def test_evaluation_and_end_of_run_hooks(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare
    config = run_config(
        {
            **TINY,
            "strategy": "fedavg-groups",
            "num-server-rounds": 2,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    built = build_server(config, bundle=digits_bundle)
    server = CustomEvaluation(env=built.env, options=None, results=built.writer)

    # Execute
    server.start(make_grid(config, 3), num_rounds=2, timeout=5.0)

    # Assert
    assert server.evaluated == [1, 2]
    assert [r["custom_metric"] for r in metrics_lines(tmp_path / "r")] == [10, 20]
    assert all(0.0 <= r["global_accuracy"] <= 1.0 for r in server.rounds)
    assert server.final_metrics == {"tuned_after_round": 2, "rounds_seen": 2}


# --------------------------------------------------------------------------- wrapper
class ShiftLabels(ClientWrapper):
    """Alters data and reply of any scheme: labels shifted by one, a metric added."""

    def prepare_data(
        self, train: ArrayDataset, test: ArrayDataset
    ) -> tuple[ArrayDataset, ArrayDataset]:
        train, test = super().prepare_data(train, test)
        self.original = train
        shifted = ArrayDataset(train.x, (train.y + 1) % 10)
        return shifted, test

    def finish_round(
        self, model: Any, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        records = super().finish_round(model, rnd, outcome, state)
        changed = int(np.sum(outcome.train.y != self.original.y))
        records["wrapper"] = MetricRecord({"labels-changed": changed})
        return records


def wrapped_train(msg: Message, context: Context) -> Message:
    _, client = resolve(context.run_config)
    return train_round(msg, context, ShiftLabels(client))


@pytest.mark.parametrize("strategy", ["fedavg", "felo"])
def test_a_wrapper_alters_data_and_reply_of_any_scheme(
    strategy: str, run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: every node's train handler wraps the scheme's client
    config = run_config(
        {
            **TINY,
            "strategy": strategy,
            "num-server-rounds": 1,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    grid = make_grid(config, 3)
    grid.handlers["train"] = wrapped_train

    # Execute
    server, _ = run(config, digits_bundle, grid=grid)

    # Assert: the server accepted the wrapped replies, which carry the wrapper's record
    (record,) = server.rounds
    assert record["num_ok"] == 3 and record["num_rejected"] == 0
    replies = grid.replies_of("train")
    assert len(replies) == 3
    for reply in replies:
        assert reply.content.metric_records["wrapper"]["labels-changed"] > 0
        if strategy == "fedavg":
            assert wire.ARRAYS in reply.content.array_records
        else:
            # Felo's own knowledge was computed on the shifted labels: class c holds
            # what the node's data has as class c - 1
            knowledge = record_to_knowledge(reply.content.array_records[KNOWLEDGE])
            node = reply.metadata.src_node_id
            info = server.nodes[node]
            original = dict(enumerate(info.label_counts))
            for cls, count in zip(knowledge.class_ids, knowledge.counts, strict=True):
                assert count == original[(int(cls) - 1) % 10]


# ------------------------------------------------------------- node state, restarts
def test_personal_model_continues_after_a_restart_with_state_dir(
    run_config: RunConfigFactory, tmp_path: Path
) -> None:
    # Prepare: a 'local' node with state-dir trains two rounds
    config = run_config({**TINY, "strategy": "local"})
    node_config = {"partition-id": 1, "num-partitions": 3, "state-dir": str(tmp_path / "s")}
    federation = "local-abc"

    def message(kind: str, server_round: int) -> Message:
        values: dict[str, Any] = {"server-round": server_round, "federation": federation}
        if kind == "train":
            values.update(
                {
                    "scheme": "local",
                    "model": "cnn-2",
                    "arch": "cnn-2",
                    "num-classes": 10,
                    "input-shape": [1, 8, 8],
                }
            )
        else:
            values["simulation"] = True
        content = RecordDict({wire.CONFIG: ConfigRecord(values)})
        mtype = "train" if kind == "train" else wire.HANDSHAKE
        return instruction(content, dst_node_id=7, message_type=mtype)

    before = make_context(7, config, node_config)
    handshake(message("handshake", 0), before)
    for rnd in (1, 2):
        reply = train(message("train", rnd), before)
        assert reply.content.metric_records[wire.METRICS]["model-rounds"] == rnd
    saved = before.state.array_records["tessera.model"]

    # Execute: the device restarts: a new context with empty state, the same state-dir
    after = make_context(8, config, node_config)
    hello = handshake(message("handshake", 0), after)
    restored = {k: v.numpy().copy() for k, v in after.state.array_records["tessera.model"].items()}
    reply = train(message("train", 3), after)

    # Assert: it said so, and its personal model went on from round 2's
    profile = hello.content.config_records[wire.PROFILE]
    assert profile["state-restored"] is True and profile["state-round"] == 2
    for key, value in saved.items():
        np.testing.assert_array_equal(restored[key], value.numpy(), err_msg=key)
    assert reply.content.metric_records[wire.METRICS]["model-rounds"] == 3
    assert (tmp_path / "s" / federation / "node-state.pb").is_file()


def test_hetero_strategy_is_not_a_flower_strategy_subclass() -> None:
    # The loop is Tessera's own (see strategies.core.strategy); its hooks take a RoundContext.
    import inspect

    params = inspect.signature(HeteroStrategy.node_content).parameters
    assert list(params)[:2] == ["self", "ctx"]


class FlakyGrid(FakeGrid):
    """A fake grid whose SuperLink is unreachable for the first few pulls."""

    def __init__(self, *args: Any, failures: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failures = failures
        self.pulls = 0

    def pull_messages(self, message_ids: Any) -> Any:
        self.pulls += 1
        if self.failures > 0:
            self.failures -= 1
            raise UnavailableError()
        return super().pull_messages(message_ids)


class UnavailableError(Exception):
    """Looks like grpc.RpcError with status UNAVAILABLE."""

    def code(self) -> Any:
        import grpc

        return grpc.StatusCode.UNAVAILABLE


def test_round_survives_a_superlink_that_is_briefly_unreachable(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    # Prepare: the first two pulls of the run fail with UNAVAILABLE
    config = run_config(
        {
            **TINY,
            "strategy": "fedavg-groups",
            "num-server-rounds": 1,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    base = make_grid(config, 3)
    grid = FlakyGrid(base.contexts, failures=2)

    # Execute
    server, _ = run(config, digits_bundle, grid=grid)

    # Assert: retried, and the round went through with every node
    assert grid.pulls >= 3
    assert server.rounds[0]["num_ok"] == 3 and not server.rounds[0]["skipped"]


@pytest.mark.parametrize(
    ("fraction", "minimum", "expected"),
    [(0.5, 1, 5), (0.1, 3, 3), (0.05, 1, 1), (0.25, 1, 3), (1.0, 1, 10), (0.5, 20, 10)],
)
def test_select_nodes_count_is_max_of_min_and_ceil_fraction(
    fraction: float,
    minimum: int,
    expected: int,
    run_config: RunConfigFactory,
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    # Prepare: ten eligible nodes whose ids run against their partitions
    from strategies.core.nodes import NodeInfo

    config = run_config(
        {
            "fraction-train": fraction,
            "min-train-nodes": minimum,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    server = build_server(config, bundle=digits_bundle).runner
    for p in range(10):
        node = 1000 - p
        server.nodes[node] = NodeInfo(node, "cnn-1", "cnn", 0, True, 10, 2, p, (1,) * 10, {})
    ctx = RoundContext(
        server_round=3,
        num_rounds=5,
        rng=np.random.default_rng([42, 3]),
        eligible={1000 - p: "cnn-1" for p in range(10)},
    )

    # Execute
    picked = server.select_nodes(ctx)

    # Assert
    assert len(picked) == expected == len(set(picked))
    assert set(picked) <= set(ctx.eligible)
    if expected == 10:  # everyone, in partition order, no draw
        assert picked == [1000 - p for p in range(10)]
