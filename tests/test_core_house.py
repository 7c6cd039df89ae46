"""The shared core (issue 24): the node table, the attack observer, the round record,
and the latent bugs the review found (each reproduced first, then fixed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from client_app.app import EMPTY_TEST_SPLIT, data_key, evaluate, handshake
from models import get_model
from models.spec import ModelRef, SubModelSpec
from server_app.app import summarise
from strategies.core.aggregation import AggregationError
from strategies.core.context import RoundContext
from strategies.core.nodes import NodeInfo, NodeTable
from strategies.core.observers import AttackObserver, flipped_test_set
from strategies.core.validation import ClientReply, Rejection
from tessera import wire
from tessera.config import RunConfig
from tessera.data import ArrayDataset
from tessera.state_checks import StateFileError
from tests.conftest import TINY_DIGITS, instruction, make_context

RunConfigFactory = Callable[..., dict[str, Any]]


def node(node_id: int, partition: int, key: int = -1) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        ref=ModelRef("cnn-1"),
        family="cnn",
        size_rank=0,
        arch_fits=True,
        num_train=10,
        num_test=2,
        partition_id=partition,
        label_counts=(10,),
        profile={"name": "cpu-small"},
        data_key=key,
    )


# ------------------------------------------------------------------- node table
def test_the_node_table_state_round_trips_and_older_entries_read_without_a_data_key() -> None:
    # Prepare
    table = NodeTable(
        nodes={3: node(3, 0), 7: node(7, -1, key=12345)},
        excluded={9: "cannot train the shared architecture"},
        rejections=[Rejection(11, "handshake names unknown architecture 'x'")],
    )

    # Execute
    back = NodeTable.from_state(table.state())
    old = table.state()
    del old["nodes"][1]["data_key"]  # a checkpoint written before data keys

    # Assert
    assert back.nodes == table.nodes
    assert back.excluded == table.excluded
    assert back.rejections == table.rejections
    assert NodeTable.from_state(old).nodes[7].data_key == -1


def test_the_attack_observer_plans_records_and_measures_outside_the_scheme(
    run_config: RunConfigFactory,
) -> None:
    # Prepare: 4 partitions, label-flip at 1/4 -> one hostile partition
    run = RunConfig.from_flower(
        run_config({"attack": "label-flip", "attack-fraction": 0.25, "seed": 0})
    )
    test = ArrayDataset(np.zeros((4, 1), np.float32), np.array([0, 1, 2, 9], np.int64))
    observer = AttackObserver(run, test, num_classes=10)
    table = NodeTable(nodes={100 + p: node(100 + p, p) for p in range(4)})

    # Execute
    plan = observer.plan(table)
    attackers = observer.attackers(table, {n: "cnn-1" for n in table.nodes})
    success = observer.evaluate(lambda data: {"cnn-1": float(len(data)) / 10})

    # Assert: one partition, recorded by node; success is each model's score on the
    # flipped samples (all four change: 0->9, 1->8, 2->7, 9->0)
    assert len(plan) == 1 and set(plan.values()) == {"label-flip"}
    assert [a["partition_id"] for a in attackers] == list(plan)
    assert success == {"attack_success_by_arch": {"cnn-1": 0.4}, "attack_success": 0.4}
    flipped = flipped_test_set(test, 10)
    assert flipped.y.tolist() == [9, 8, 7, 0]
    clean = AttackObserver(RunConfig.from_flower(run_config()), test, num_classes=10)
    assert clean.evaluate(lambda data: {"cnn-1": 1.0}) == {}
    assert clean.document(table) is None


def test_a_sample_whose_label_the_flip_keeps_is_left_out_of_the_success_set() -> None:
    # 5 of 10 classes: label 2 flips to 2 (C - 1 - y), so it cannot show success
    test = ArrayDataset(np.zeros((3, 1), np.float32), np.array([0, 2, 4], np.int64))
    assert flipped_test_set(test, 5).y.tolist() == [4, 0]


# ------------------------------------------------------------------ latent bugs
def test_a_skipped_round_does_not_make_the_best_accuracy_null() -> None:
    # Prepare: round 2 was skipped with no reply (NaN mean; None once read back)
    rounds = [
        {"round": 1, "personal_accuracy_mean": 0.5, "round_seconds": 1, "overhead_seconds": 0},
        {"round": 2, "personal_accuracy_mean": math.nan, "round_seconds": 1, "overhead_seconds": 0},
        {"round": 3, "personal_accuracy_mean": 0.7, "round_seconds": 1, "overhead_seconds": 0},
        {"round": 4, "personal_accuracy_mean": None, "round_seconds": 1, "overhead_seconds": 0},
    ]
    nan_first = [rounds[1], rounds[0]]

    # Execute / Assert
    assert summarise(rounds, 0.0)["best_personal_accuracy_mean"] == 0.7
    assert summarise(nan_first, 0.0)["best_personal_accuracy_mean"] == 0.5
    assert summarise([rounds[1]], 0.0)["best_personal_accuracy_mean"] is None


def write_own_data(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    x = rng.random((60, 1, 8, 8), dtype=np.float32)
    y = np.arange(60, dtype=np.int64) % 10
    np.savez(path, x_train=x, y_train=y)
    return path


def test_nodes_with_their_own_data_get_stable_distinct_keys(
    run_config: RunConfigFactory, tmp_path: Path, fast_clients: None
) -> None:
    # Prepare: two devices with their own files, and the first again after a restart
    # (another node id): all report partition -1
    config = run_config({"local-epochs": 1, "model-family": "cnn"})
    first = write_own_data(tmp_path / "a.npz", 0)
    second = write_own_data(tmp_path / "b.npz", 1)
    message = instruction(
        RecordDict({wire.CONFIG: ConfigRecord({"server-round": 0, "simulation": True})}),
        dst_node_id=5,
        message_type=wire.HANDSHAKE,
    )

    def key_of(node_id: int, path: Path) -> tuple[int, int]:
        reply = handshake(
            message,
            make_context(node_id, config, {"data-path": str(path), "device-profile": "cpu-small"}),
        )
        record = reply.content.config_records[wire.PROFILE]
        return int(record["partition-id"]), int(record["data-key"])  # type: ignore[call-overload]

    # Execute
    a, b, a_again = key_of(5, first), key_of(6, second), key_of(99, first)

    # Assert: the same data gives the same key whatever the node id; other data another
    assert a[0] == b[0] == -1
    assert a == a_again
    assert a[1] != b[1]
    assert 0 <= a[1] < 2**31


def test_data_key_covers_labels_and_inputs() -> None:
    x = np.zeros((4, 3), np.float32)
    base = data_key(ArrayDataset(x, np.array([0, 1, 2, 3])))
    assert data_key(ArrayDataset(x, np.array([0, 1, 2, 3]))) == base
    assert data_key(ArrayDataset(x, np.array([0, 1, 3, 2]))) != base
    assert data_key(ArrayDataset(x + 1, np.array([0, 1, 2, 3]))) != base


def test_the_server_orders_own_data_nodes_by_their_key_not_their_node_id(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    from server_app.app import build_server

    # Prepare: the same three devices (partition -1, keys 30, 10, 20) under two sets
    # of node ids, as after a restart; fraction-train picks 2 of 3
    config = run_config(
        {
            "strategy": "fedavg",
            "fraction-train": 0.5,
            "min-train-nodes": 1,
            "output-dir": str(tmp_path),
        }
    )
    picks = []
    for ids in ((1, 2, 3), (900, 500, 100)):
        server = build_server(config, bundle=digits_bundle).runner
        server.table.nodes.update(
            {n: node(n, -1, key=k) for n, k in zip(ids, (30, 10, 20), strict=True)}
        )
        ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng([0, 1]))
        ctx.eligible = {n: "cnn-1" for n in ids}
        keys = {n: server.nodes[n].data_key for n in ids}

        # Execute
        picks.append(sorted(keys[n] for n in server.select_nodes(ctx)))

    # Assert: the same devices are drawn
    assert picks[0] == picks[1]


def test_a_sub_model_reply_is_folded_whole_or_not_at_all(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path
) -> None:
    from server_app.app import build_server

    # Prepare: NeFL keeps a slice's normalisation layers apart (a second fold step);
    # node 2's private part has the wrong dtype, so that step must fail
    config = run_config(
        {
            **TINY_DIGITS,
            "strategy": "nefl",
            "model-family": "preresnet",
            "submodel-widths": "1,0.25",
            "norm": "batch",
            "server-trust": False,
            "output-dir": str(tmp_path),
        }
    )
    server = build_server(config, bundle=digits_bundle).runner
    arch = server.full_arch
    private = server.private_keys(arch)
    assert private, "NeFL keeps normalisation layers per slice"
    start = server.sub_state(arch)
    honest = {
        k: v + np.asarray(0.01, v.dtype) if np.issubdtype(v.dtype, np.floating) else v
        for k, v in start.items()
    }
    broken = {
        k: (v.astype(np.float64) if k in private and v.dtype == np.float32 else v + 5)
        for k, v in honest.items()
    }
    ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))

    def reply(node_id: int, arrays: dict[str, np.ndarray]) -> ClientReply:
        return ClientReply(
            node_id=node_id,
            arch=arch,
            metrics={wire.NUM_EXAMPLES: 100.0},
            arrays=arrays,
            content=RecordDict(),
            bytes_up=0,
            bytes_down=0,
        )

    # Execute
    server.fold(ctx, reply(1, honest))
    with pytest.raises(AggregationError, match="float64"):
        server.fold(ctx, reply(2, broken))
    server.aggregate(ctx, [])

    # Assert: the global model is node 1's alone (node 2's shared part, +5, is not in)
    after = server.sub_state(arch)
    for key in start:
        if key not in private and np.issubdtype(start[key].dtype, np.floating):
            np.testing.assert_allclose(after[key], honest[key], rtol=1e-5, atol=1e-6)


def test_evaluate_without_a_test_split_replies_with_an_error_naming_the_fix(
    run_config: RunConfigFactory, fast_clients: None
) -> None:
    # Prepare: local-test-fraction 0 leaves the node no test split
    config = run_config(
        {"strategy": "fedavg", "local-test-fraction": 0.0, "local-epochs": 1, "model-family": "cnn"}
    )
    context = make_context(100, config, {"partition-id": 0, "num-partitions": 3})
    model = get_model("cnn-1", input_shape=(1, 8, 8), num_classes=10)
    content = RecordDict(
        {
            wire.CONFIG: ConfigRecord({"model": "cnn-1", "arch": "cnn-1", "server-round": 1}),
            wire.ARRAYS: wire.state_to_record(model.state_dict()),
        }
    )

    # Execute
    reply = evaluate(instruction(content, dst_node_id=100, message_type="evaluate"), context)

    # Assert: no made-up example at accuracy 0; the reason names the key
    assert reply.has_error()
    assert reply.error.code == EMPTY_TEST_SPLIT
    assert "local-test-fraction" in (reply.error.reason or "")


# ------------------------------------------------------------ scheme contracts
@pytest.mark.parametrize(
    ("scheme", "norm"),
    [
        ("heterofl", "static-batch"),
        ("fedfa", "static-batch"),
        ("nefl", "static-batch"),
        ("flexifed", "static-batch"),
        ("fedavg", "batch"),
        ("felo", "batch"),
    ],
)
def test_each_scheme_owns_its_normalisation_default_and_an_explicit_one_wins(
    scheme: str, norm: str, run_config: RunConfigFactory
) -> None:
    from strategies import resolve_run

    # Execute
    default = resolve_run(run_config({"strategy": scheme}))
    chosen = resolve_run(run_config({"strategy": scheme, "norm": "group"}))

    # Assert
    assert default.run.scheme.norm == norm
    assert chosen.run.scheme.norm == "group"
    assert default.scheme.name == scheme


def test_a_scheme_refuses_an_aggregator_it_would_not_honour_naming_the_fix(
    run_config: RunConfigFactory,
) -> None:
    from strategies import resolve_run
    from tessera.config import ConfigError

    with pytest.raises(ConfigError, match=r"'aggregator' is 'median'.*'fedfa'.*use one of mean"):
        resolve_run(run_config({"strategy": "fedfa", "aggregator": "median"}))
    with pytest.raises(ConfigError, match=r"'krum'.*'heterofl'.*use one of mean, norm-clip"):
        resolve_run(run_config({"strategy": "heterofl", "aggregator": "krum"}))
    assert resolve_run(run_config({"strategy": "heterofl", "aggregator": "norm-clip"}))


def test_slice_axes_are_options_on_the_instance(run_config: RunConfigFactory) -> None:
    from strategies import resolve_run

    def axes(scheme: str, **extra: Any) -> tuple[bool, bool]:
        options = resolve_run(run_config({"strategy": scheme, **extra})).options
        return options.width_flexible, options.depth_flexible

    assert axes("heterofl") == (True, False)
    assert axes("flexifed") == (False, True)
    assert axes("nefl") == (True, True)
    assert axes("fedfa") == (True, True)
    assert axes("fedfa", **{"fedfa-slices": "width"}) == (True, False)
    assert axes("fedfa", **{"fedfa-slices": "depth"}) == (False, True)


def test_every_server_class_takes_its_name_from_the_registration() -> None:
    from strategies import get_scheme, list_schemes

    for name in list_schemes():
        scheme = get_scheme(name)
        classes = [scheme.server] if isinstance(scheme.server, type) else []
        for cls in [*classes, *scheme.server_classes]:
            assert cls.name == name, (cls, name)  # type: ignore[attr-defined]


# -------------------------------------------------------------- the README demo
def test_the_readme_block_keeps_what_a_seeded_run_reproduces(tmp_path: Path) -> None:
    import json

    from tessera.report import DEMO_BEGIN, DEMO_END, current_block, readme_block, replace_block

    # Prepare: a finished 1-round run with two nodes listed out of partition order
    nodes = [
        {"node": 9, "partition_id": 1, "num_train": 50, "arch": "cnn-5", "profile": {"name": "b"}},
        {"node": 3, "partition_id": 0, "num_train": 40, "arch": "cnn-4", "profile": {"name": "a"}},
    ]
    config = {"scheme": "fedavg", "run_config": {"dataset": "digits", "num-server-rounds": 1}}
    (tmp_path / "config.json").write_text(json.dumps({**config, "nodes": nodes}))
    record = {
        "round": 1,
        "num_ok": 2,
        "num_sent": 2,
        "num_rejected": 0,
        "num_failed": 0,
        "personal_accuracy_mean": 0.5,
        "personal_accuracy_std": 0.25,
        "global_accuracy": 0.75,
        "bytes_up_total": 2_000_000,
        "bytes_down_total": 1_000_000,
        "round_seconds": 12.34,
    }
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    summary = {"final_personal_accuracy_by_arch": {"cnn-5": 0.6, "cnn-4": 0.4}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))

    # Execute
    block = readme_block(tmp_path)
    readme = f"intro\n{DEMO_BEGIN}\nold\n{DEMO_END}\nrest\n"
    written = replace_block(readme, block)

    # Assert: partitions in order, no node ids, no seconds; the block round-trips
    lines = block.splitlines()
    assert lines[1] == "strategy fedavg, dataset digits, 2 nodes"
    assert lines[2].startswith("  partition 0: profile a, 40 train samples -> cnn-4")
    assert "node 9" not in block and "12.34" not in block
    assert "0.500±0.250" in block and "0.750" in block
    assert lines[-3:] == [
        "  final personalised accuracy on cnn-4: 0.400",
        "  final personalised accuracy on cnn-5: 0.600",
        "```",
    ]
    assert current_block(written) == block
    assert written.startswith("intro\n") and written.endswith(f"{DEMO_END}\nrest\n")
    with pytest.raises(ValueError, match="demo:begin"):
        replace_block("no markers", block)


# ------------------------------------------------------------------ the docs
ROOT = Path(__file__).resolve().parents[1]


def test_the_scheme_keys_page_is_what_the_code_generates() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("scheme_table", ROOT / "scripts/scheme_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    page = (ROOT / "docs/pages/scheme-keys.md").read_text()
    assert page == module.render(module.default_run_config()), (
        "docs/pages/scheme-keys.md is stale: run `.venv/bin/python scripts/scheme_table.py "
        "--write docs/pages/scheme-keys.md`"
    )


def test_the_readme_is_an_entrance_whose_links_resolve() -> None:
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local, "the README links to the docs pages"
    for link in local:
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_a_schemes_round_state_lives_in_the_round_context() -> None:
    from dataclasses import dataclass, field

    @dataclass
    class Gathered:
        nodes: list[int] = field(default_factory=list)

    # Execute: two hooks of one round, then the next round
    first = RoundContext(server_round=1, num_rounds=2, rng=np.random.default_rng(0))
    first.state(Gathered).nodes.append(7)
    first.state(Gathered).nodes.append(9)
    second = RoundContext(server_round=2, num_rounds=2, rng=np.random.default_rng(0))

    # Assert: one object per round and type; nothing carries over
    assert first.state(Gathered).nodes == [7, 9]
    assert second.state(Gathered).nodes == []
    assert first.state(list, lambda: [1]) == [1]


def test_every_source_path_the_readme_and_docs_name_exists() -> None:
    import re

    pattern = re.compile(
        r"\b((?:strategies|client_app|server_app|tessera|models|benchmarks|scripts)"
        r"/[A-Za-z0-9_/.-]+\.(?:py|sh))\b"
    )
    pages = [ROOT / "README.md", *sorted((ROOT / "docs" / "pages").rglob("*.md"))]
    missing = {
        (page.name, path)
        for page in pages
        for path in pattern.findall(page.read_text())
        if not (ROOT / path).exists()
    }
    assert not missing, f"pages name files that do not exist: {sorted(missing)}"


# ------------------------------------------------------------- slices as structure
def test_a_node_entry_keeps_its_slice_as_structure_and_older_entries_read_by_name() -> None:
    # Prepare: a node training a slice, as the node table writes it
    spec = SubModelSpec(0.5, (2, 2, 2, 2))
    info = NodeInfo(
        node_id=4,
        ref=ModelRef("preresnet18_050", spec),
        family="preresnet",
        size_rank=0,
        arch_fits=True,
        num_train=10,
        num_test=2,
        partition_id=0,
        label_counts=(10,),
        profile={},
    )
    entry = info.to_dict()
    older = {k: v for k, v in entry.items() if k not in ("model", "slice")}
    forged = {**entry, "slice": {"width": 0.25, "depths": [2, 2, 2, 2]}}
    broken = {**entry, "slice": {"width": 2.0, "depths": [2, 2, 2, 2]}}

    # Execute
    back = NodeInfo.from_dict(entry, where="nodes[0]")

    # Assert: the structure is written and read; a name-only entry still reads; a
    # structure that contradicts the name, or is no slice, is refused naming the field
    assert entry["model"] == "preresnet18_050"
    assert entry["slice"] == {"width": 0.5, "depths": [2, 2, 2, 2]}
    assert entry["arch"] == "preresnet18_050@w0.5-d2.2.2.2"
    assert back == info and back.ref.spec == spec
    assert NodeInfo.from_dict(older, where="nodes[0]") == info
    with pytest.raises(StateFileError, match=r"nodes\[0\]\.arch.*w0.25"):
        NodeInfo.from_dict(forged, where="nodes[0]")
    with pytest.raises(StateFileError, match=r"nodes\[0\]\.model.*width must be"):
        NodeInfo.from_dict(broken, where="nodes[0]")


def test_a_handshake_whose_name_and_structure_disagree_is_rejected() -> None:
    from unittest.mock import Mock

    from flwr.app import Message

    from strategies.core.nodes import parse_handshake

    # Prepare: a profile naming one slice and describing another
    record = {
        "model": "preresnet18_050",
        "slice-width": 0.25,
        "slice-depths": [2, 2, 2, 2],
        "arch": "preresnet18_050@w0.5-d2.2.2.2",
        "family": "preresnet",
        "size-rank": 0,
        "arch-fits": True,
        "num-train": 10,
        "num-test": 2,
        "partition-id": 0,
        "label-counts": [1] * 10,
    }
    reply = Mock(spec=Message)
    reply.metadata.src_node_id = 8
    reply.has_error.return_value = False
    reply.content = RecordDict({wire.PROFILE: ConfigRecord(record)})

    # Execute
    result = parse_handshake(reply, ["preresnet18_050@w0.5-d2.2.2.2"])

    # Assert
    assert isinstance(result, Rejection)
    assert "its model and slice give 'preresnet18_050@w0.25-d2.2.2.2'" in result.reason


def test_a_train_message_whose_name_and_structure_disagree_is_refused() -> None:
    from strategies import get_scheme
    from tessera.config import ConfigError
    from tests.conftest import load_default_run_config

    # Prepare
    config = load_default_run_config()
    scheme = get_scheme("fedavg")
    client = scheme.client(run=RunConfig.from_flower(config), options=scheme.parse_options(config))
    good = ConfigRecord({"model": "cnn-1", "arch": "cnn-1"})
    bad = ConfigRecord({"model": "cnn-2", "arch": "cnn-1"})

    # Execute / Assert
    assert client.arch_for(good) == ModelRef("cnn-1")
    with pytest.raises(ConfigError, match="names arch 'cnn-1' but its model and slice give"):
        client.arch_for(bad)


# ------------------------------------------------------------- typed scheme contracts
def _options_type(cls: type) -> type | None:
    """The options type a class gives its generic base (a type variable's bound), if any."""
    import sys
    import typing

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if not args:
                continue
            kind = args[0]
            if isinstance(kind, typing.TypeVar):  # generic further down: its bound, if any
                kind = kind.__bound__
            if isinstance(kind, str):  # a forward reference to the bound
                kind = vars(sys.modules[klass.__module__]).get(kind)
            if isinstance(kind, typing.ForwardRef):
                kind = vars(sys.modules[klass.__module__]).get(kind.__forward_arg__)
            if isinstance(kind, type):
                return kind
    return None


def test_every_scheme_s_server_and_client_are_typed_by_the_options_it_parses(
    default_run_config: dict[str, Any],
) -> None:
    from strategies import get_scheme, list_schemes

    untyped = []
    for name in list_schemes():
        # Prepare: the options the scheme parses from the defaults
        scheme = get_scheme(name)
        config = {**default_run_config, "strategy": name, "fedavg-arch": "cnn-2"}
        options = scheme.parse_options(config)

        servers = (scheme.server,) if isinstance(scheme.server, type) else ()
        classes = (*servers, *scheme.server_classes, scheme.client)

        # Execute: the options type each class declares
        declared = [_options_type(c) for c in classes]

        # Assert: what it declares is what it gets (None: a scheme with no options)
        for cls, kind in zip(classes, declared, strict=True):
            if kind is None:
                untyped.append((name, cls.__name__))
            else:
                assert isinstance(options, kind), (name, cls.__name__, kind, type(options))
    # only the generic client (it reads no options), fedavg-groups (it has none) and
    # the runner of Flower's own FedAvg (no Tessera strategy)
    assert sorted(untyped) == [
        ("ensemble", "ClientAlgorithm"),
        ("fedavg-groups", "ClientAlgorithm"),
        ("fedavg-groups", "FedAvgGroupsStrategy"),
        ("flwr-fedavg", "FlowerFedAvgRunner"),
    ]
