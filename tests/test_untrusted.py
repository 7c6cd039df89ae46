"""Hostile replies and handshakes, built as Flower builds them, against the real checks.

Each case is one of the hostile classes found by trying the server as a hostile
client would (issue "Untrusted clients"): what is decoded is checked (not only what
is declared), counts are checked for range and overflow, no node outweighs what it
told the handshake, metrics are range-checked, and handshake fields are checked
against the model registry and each other. Federations run on the fake grid with
the real ClientApp handlers; a tamper hook rewrites one node's reply.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from server_app.app import build_server
from strategies.core.nodes import parse_handshake
from strategies.core.validation import (
    Rejection,
    ReplyLimits,
    ReplySchema,
    validate_reply,
    weight_caps,
)
from strategies.felo.knowledge import COUNTS, KNOWLEDGE
from tessera import wire
from tests.conftest import TINY_DIGITS, instruction, make_grid

NODE = 7
TINY = TINY_DIGITS
RunConfigFactory = Callable[..., dict[str, Any]]


def npy_bytes(value: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, value, allow_pickle=False)
    return buffer.getvalue()


def reply_with(records: RecordDict) -> Message:
    msg = instruction(
        RecordDict({wire.CONFIG: ConfigRecord({"server-round": 1})}),
        dst_node_id=NODE,
        message_type="train",
    )
    return Message(records, reply_to=msg)


def metrics(**changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        wire.NUM_EXAMPLES: 40,
        wire.TRAIN_LOSS: 0.75,
        wire.TEST_ACCURACY: 0.5,
        wire.TEST_LOSS: 1.25,
        wire.NUM_TEST_EXAMPLES: 10,
        wire.TRAIN_SECONDS: 0.2,
    }
    values.update(changes)
    return values


def check(records: RecordDict, *, limits: ReplyLimits | None = None) -> Any:
    from flwr.app import MetricRecord

    if wire.METRICS not in records.metric_records:
        records[wire.METRICS] = MetricRecord(metrics())
    return validate_reply(
        reply_with(records),
        expected_nodes={NODE: "cnn-2"},
        schemas={NODE: ReplySchema(arrays={"w": ((2, 3), "float32")})},
        bytes_down={NODE: 0},
        limits=None if limits is None else {NODE: limits},
    )


# ---------------------------------------------------------------- decoded, not declared
@pytest.mark.parametrize(
    "payload",
    [
        np.zeros(3, dtype=np.float64),  # another dtype and shape
        np.zeros((3, 2), dtype=np.float32),  # the same bytes, another shape
        np.zeros((2, 3), dtype=np.float16),  # the same shape, another dtype
    ],
)
def test_array_whose_bytes_disagree_with_its_declaration_is_rejected(
    payload: np.ndarray,
) -> None:
    # Prepare: declares float32 (2, 3), carries something else
    array = Array(dtype="float32", shape=(2, 3), stype="numpy.ndarray", data=npy_bytes(payload))
    records = RecordDict({wire.ARRAYS: ArrayRecord({"w": array})})

    # Execute
    result = check(records)

    # Assert
    assert isinstance(result, Rejection)
    assert "declares float32(2, 3) but its bytes decode to" in result.reason


def test_array_with_garbage_bytes_is_rejected() -> None:
    array = Array(dtype="float32", shape=(2, 3), stype="numpy.ndarray", data=b"\x00garbage")
    result = check(RecordDict({wire.ARRAYS: ArrayRecord({"w": array})}))
    assert isinstance(result, Rejection) and "cannot be decoded" in result.reason


# --------------------------------------------------------------------- metric ranges
@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({wire.TEST_ACCURACY: 1e6}, "'test-accuracy' is 1e+06, outside [0, 1]"),
        ({wire.TEST_ACCURACY: -0.1}, "'test-accuracy' is -0.1"),
        ({wire.NUM_TEST_EXAMPLES: -5}, "'num-test-examples' is -5"),
        ({wire.NUM_TEST_EXAMPLES: 2.5}, "whole number"),
        ({wire.TRAIN_LOSS: -1.0}, "'train-loss' is -1"),
        ({wire.TRAIN_SECONDS: -3.0}, "'train-seconds' is -3"),
    ],
)
def test_out_of_range_metrics_are_rejected(change: dict[str, Any], fragment: str) -> None:
    from flwr.app import MetricRecord

    arrays = {"w": Array(np.zeros((2, 3), np.float32))}
    records = RecordDict(
        {wire.ARRAYS: ArrayRecord(arrays), wire.METRICS: MetricRecord(metrics(**change))}
    )
    result = check(records)
    assert isinstance(result, Rejection)
    assert fragment in result.reason


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({wire.NUM_EXAMPLES: 10**18}, "at most 300 (num-train x local-epochs)"),
        ({wire.NUM_EXAMPLES: 301}, "at most 300"),
        ({wire.NUM_TEST_EXAMPLES: 21}, "test set of 20"),
    ],
)
def test_no_node_outweighs_what_it_told_the_handshake(
    change: dict[str, Any], fragment: str
) -> None:
    from flwr.app import MetricRecord

    arrays = {"w": Array(np.zeros((2, 3), np.float32))}
    records = RecordDict(
        {wire.ARRAYS: ArrayRecord(arrays), wire.METRICS: MetricRecord(metrics(**change))}
    )
    limits = ReplyLimits(max_examples=300, max_test_examples=20)
    result = check(records, limits=limits)
    assert isinstance(result, Rejection)
    assert fragment in result.reason
    ok = RecordDict(
        {
            wire.ARRAYS: ArrayRecord(arrays),
            wire.METRICS: MetricRecord(metrics(**{wire.NUM_EXAMPLES: 300})),
        }
    )
    assert not isinstance(check(ok, limits=limits), Rejection)


def set_num_examples(value: int) -> Callable[[Message], Message | None]:
    def hook(reply: Message) -> Message | None:
        reply.content.metric_records[wire.METRICS][wire.NUM_EXAMPLES] = value
        return reply

    return hook


def test_inflated_num_examples_cannot_replace_the_global_model(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    # Prepare: node 102 claims 1e18 training examples (the plain mean, clip-factor 0:
    # the default bound would clip the larger of the two honest updates)
    config = run_config(
        {
            **TINY,
            "strategy": "fedavg",
            "clip-factor": 0.0,
            "num-server-rounds": 1,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    grid = make_grid(config, 3)
    grid.tamper[102] = set_num_examples(10**18)
    server = build_server(config, bundle=digits_bundle).runner

    # Execute
    server.start(grid, num_rounds=1, timeout=5.0)

    # Assert: rejected with the reason, the round averaged the two honest replies only
    (record,) = server.rounds
    assert record["num_ok"] == 2 and record["num_rejected"] == 1
    (rejection,) = record["rejected"]
    assert rejection["node"] == 102 and "num-train x local-epochs" in rejection["reason"]
    honest = [r for r in grid.replies_of("train") if r.metadata.src_node_id != 102]
    # each weighs its claim, at most its cohort cap (weight-trim 0.2 of three nodes:
    # the largest handshake size is cut to the next one, node 102's included)
    caps = weight_caps({n: info.num_train for n, info in server.nodes.items()}, 2.0, 0.2)
    weights = [
        min(
            float(r.content.metric_records[wire.METRICS][wire.NUM_EXAMPLES]),
            float(caps[r.metadata.src_node_id] or 0),
        )
        for r in honest
    ]
    assert server.global_arrays is not None
    for key, value in server.global_arrays.items():
        if not np.issubdtype(value.dtype, np.floating):
            continue
        parts = [r.content.array_records[wire.ARRAYS][key].numpy() for r in honest]
        expected = sum(w * p.astype(np.float64) for w, p in zip(weights, parts, strict=True))
        np.testing.assert_allclose(value, expected / sum(weights), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ per-class counts
@pytest.mark.parametrize(
    ("counts", "fragment"),
    [
        # int64 counts that wrap around to a small positive sum
        (np.array([2**62, 2**62, 2**62, 2**62 + 5], dtype=np.int64), "but the reply reports"),
        (np.array([1, 2], dtype=np.uint64), "int64"),
    ],
)
def test_hostile_per_class_counts_are_rejected(
    counts: np.ndarray,
    fragment: str,
    run_config: RunConfigFactory,
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # Prepare
    config = run_config(
        {
            **TINY,
            "strategy": "felo",
            "num-server-rounds": 1,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    grid = make_grid(config, 3)

    def hook(reply: Message) -> Message | None:
        record = reply.content.array_records[KNOWLEDGE]
        k = record["class-ids"].numpy().shape[0]
        value = np.resize(counts, k).astype(counts.dtype)
        record[COUNTS] = Array(value)
        return reply

    grid.tamper[101] = hook
    server = build_server(config, bundle=digits_bundle).runner

    # Execute
    server.start(grid, num_rounds=1, timeout=5.0)

    # Assert
    (record,) = server.rounds
    assert record["num_ok"] == 2 and record["num_rejected"] == 1
    assert fragment in record["rejected"][0]["reason"]
    assert server.targets is not None


# ------------------------------------------------------------------------ handshakes
def handshake(**changes: Any) -> Message:
    from unittest.mock import Mock

    record: dict[str, Any] = {
        "model": "cnn-2",
        "arch": "cnn-2",
        "family": "cnn",
        "size-rank": 1,
        "arch-fits": True,
        "num-train": 100,
        "num-test": 20,
        "partition-id": 0,
        "label-counts": [10] * 10,
    }
    record.update(changes)
    if "arch" in changes and "model" not in changes:  # a whole registered model
        record["model"] = changes["arch"]
    reply = Mock(spec=Message)
    reply.metadata.src_node_id = NODE
    reply.has_error.return_value = False
    reply.content = RecordDict({wire.PROFILE: ConfigRecord(record)})
    return reply  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"size-rank": -1}, "size-rank -1 for 'cnn-2', which the registry has as family 'cnn'"),
        ({"family": "resnet"}, "claims family 'resnet'"),
        ({"label-counts": [10] * 9}, "9 label counts but the task has 10 classes"),
        ({"label-counts": [-10] + [10] * 9}, "negative label counts"),
        ({"label-counts": [11] * 10}, "sum to 110 but num-train is 100"),
        ({"num-test": -1}, "num-test=-1"),
    ],
)
def test_handshake_fields_are_checked_against_the_registry_and_each_other(
    changes: dict[str, Any], fragment: str
) -> None:
    from models import list_models

    info = parse_handshake(handshake(**changes), list_models(), num_classes=10)
    assert isinstance(info, Rejection)
    assert fragment in info.reason
    assert not isinstance(parse_handshake(handshake(), list_models(), num_classes=10), Rejection)


def test_a_node_lying_about_its_rank_does_not_move_fedavg(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    # Prepare: node 100's handshake claims size-rank -5 for its architecture
    config = run_config(
        {
            **TINY,
            "strategy": "fedavg",
            "num-server-rounds": 1,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    grid = make_grid(config, 3)
    real = grid.handlers[wire.HANDSHAKE]

    def lying_handshake(msg: Message, context: Any) -> Message:
        reply = real(msg, context)
        if context.node_id == 100:
            reply.content.config_records[wire.PROFILE]["size-rank"] = -5
            reply.content.config_records[wire.PROFILE]["arch"] = "cnn-1"
        return reply

    grid.handlers[wire.HANDSHAKE] = lying_handshake
    server = build_server(config, bundle=digits_bundle).runner

    # Execute
    server.start(grid, num_rounds=1, timeout=5.0)

    # Assert: the liar is out, the shared architecture is the honest nodes' choice
    assert 100 not in server.nodes
    assert (
        server.shared_arch
        == min((i for i in server.nodes.values()), key=lambda i: i.size_rank).arch
    )
    assert server.shared_arch != "cnn-1"
    assert set(server.assignment) == {101, 102}


# ---------------------------------------------------------------- bound stretch
def test_a_reply_s_stretch_is_its_capped_weight_over_the_cohort_s_typical_one() -> None:
    from flwr.app import MetricRecord

    arrays = {"w": Array(np.zeros((2, 3), np.float32))}

    def stretch_of(num_examples: int, cap: float = 2.0) -> float:
        records = RecordDict(
            {
                wire.ARRAYS: ArrayRecord(arrays),
                wire.METRICS: MetricRecord(metrics(**{wire.NUM_EXAMPLES: num_examples})),
            }
        )
        limits = ReplyLimits(
            max_examples=300,
            max_test_examples=20,
            max_weight=200.0,
            typical_weight=100.0,
            stretch_cap=cap,
        )
        result = check(records, limits=limits)
        assert not isinstance(result, Rejection)
        return float(result.stretch)

    assert stretch_of(150) == pytest.approx(1.5)
    assert stretch_of(300) == 2.0  # weighs at most its cap of 200
    assert stretch_of(20) == 0.5
    assert stretch_of(150, cap=0.0) == 1.0  # bound-stretch=0: every reply the same bound


def test_the_server_sets_each_round_s_typical_weight_from_the_cohort(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    from models.spec import ModelRef
    from strategies.core.context import RoundContext
    from strategies.core.nodes import NodeInfo

    config = run_config(
        {**TINY, "strategy": "fedavg", "bound-stretch": 2.0, "output-dir": str(tmp_path)}
    )
    server = build_server(config, bundle=digits_bundle).runner
    sizes = {1: 50, 2: 100, 3: 120, 4: 10**9}  # node 4 claims a billion examples
    for node, n in sizes.items():
        server.nodes[node] = NodeInfo(
            node_id=node,
            ref=ModelRef.parse("cnn-2"),
            family="cnn",
            size_rank=0,
            arch_fits=True,
            num_train=n,
            num_test=2,
            partition_id=node,
            label_counts=(n,),
            profile={"name": "cpu-small"},
        )
    ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))
    ctx.eligible = {node: "cnn-2" for node in sizes}
    server.select(ctx)
    # caps: 50, 100, 120, and for the liar min(2 x 100, the next claim below it) =
    # 120 (weight-trim 0.2 of four: ceil(0.8) = 1 claim cut) -> typical (lower median) 100
    assert {n: lim.max_weight for n, lim in ctx.limits.items()} == {
        1: 50.0,
        2: 100.0,
        3: 120.0,
        4: 120.0,
    }
    assert {lim.typical_weight for lim in ctx.limits.values()} == {100.0}
    assert {lim.stretch_cap for lim in ctx.limits.values()} == {2.0}


def test_a_fold_bounds_each_reply_by_its_own_stretch(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    from strategies.core.aggregators import entry_kind
    from strategies.core.context import RoundContext
    from strategies.core.validation import ClientReply

    # Prepare: fedavg-groups at its defaults but without the direction check; in
    # its first round three replies move cnn-1 by 1, 4 and 3 units along one
    # direction, weighing 50, 200 and 100 examples (typical 100: stretches 0.5, 2, 1)
    config = run_config(
        {**TINY, "strategy": "fedavg-groups", "server-trust": False, "output-dir": str(tmp_path)}
    )
    server = build_server(config, bundle=digits_bundle).runner
    g = server.models.get("cnn-1")
    rng = np.random.default_rng(0)
    unit = {
        k: rng.standard_normal(v.shape)
        for k, v in g.items()
        if v.dtype == np.float32 and entry_kind(k) == "parameters"
    }
    norm = np.sqrt(sum(float(np.sum(u**2)) for u in unit.values()))
    ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))
    for node, (distance, weight) in enumerate(((1.0, 50), (4.0, 200), (3.0, 100)), start=1):
        moved = {
            k: (v + distance * unit[k] / norm).astype(v.dtype) if k in unit else v
            for k, v in g.items()
        }
        server.fold(
            ctx,
            ClientReply(
                node_id=node,
                arch="cnn-1",
                metrics={wire.NUM_EXAMPLES: float(weight)},
                arrays=moved,
                content=RecordDict(),
                bytes_up=0,
                bytes_down=0,
                max_weight=float(weight),
                typical_weight=100.0,
                stretch_cap=2.0,
            ),
        )

    # Execute
    record = server.aggregate(ctx, [])

    # Assert: per unit of stretch 2, 2, 3 -> scale 2; bounds 1, 4, 2: node 3 alone is
    # clipped (with one bound for all, the median 3 would clip node 2 instead)
    clipped = [(c["node"], c["bound"]) for c in record["clipped"] if c["kind"] == "parameters"]
    assert clipped == [(3, pytest.approx(2.0, rel=1e-4))]
