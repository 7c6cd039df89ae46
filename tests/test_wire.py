"""Byte accounting of messages: measured once per distinct content, same numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from strategies.core.context import RoundContext
from tessera import wire


def _config(arch: str) -> ConfigRecord:
    return ConfigRecord({"server-round": 1, "arch": arch, "input-shape": [1, 8, 8]})


def test_payload_sizes_equal_payload_bytes_and_serialise_each_distinct_content_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: five messages, two global models shared between them (as a round
    # builds them with RoundContext.share), one config differing by value
    ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))
    small = {"w": np.ones((3, 4), dtype=np.float32)}
    large = {"w": np.ones((30, 4), dtype=np.float32)}
    contents = []
    for arch, weights in [("a", small), ("a", small), ("b", large), ("b", large), ("a", small)]:
        record = ctx.share(("arrays", arch), lambda weights=weights: wire.numpy_to_record(weights))
        contents.append(RecordDict({wire.CONFIG: _config(arch), wire.ARRAYS: record}))
    shared_a = ctx.shared[("arrays", "a")]
    contents.append(RecordDict({wire.CONFIG: _config("c"), wire.ARRAYS: shared_a}))
    calls: list[int] = []
    real = wire.payload_bytes

    def counting(content: RecordDict) -> int:
        calls.append(1)
        return real(content)

    monkeypatch.setattr(wire, "payload_bytes", counting)

    # Execute
    sizes = wire.payload_sizes(contents)
    monkeypatch.undo()

    # Assert: the same numbers as measuring each; three distinct contents measured
    assert sizes == [real(c) for c in contents]
    assert len(calls) == 3
    assert sizes[2] >= sizes[0] + 108 * 4  # 108 more float32 values in the large model
    assert contents[0][wire.ARRAYS] is contents[1][wire.ARRAYS] is contents[4][wire.ARRAYS]


@pytest.mark.parametrize(
    ("value", "expected"),
    [(3, 3), (3.0, 3), (-2, -2), (True, None), (2.7, None), ("3", None), (None, None)],
)
def test_int_value_reads_whole_numbers_only(value: object, expected: int | None) -> None:
    from tessera.wire import int_value

    if expected is None:
        with pytest.raises(ValueError, match=r"'k' is .* not a whole number"):
            int_value({"k": value}, "k")
    else:
        assert int_value({"k": value}, "k") == expected
        assert isinstance(int_value({"k": value}, "k"), int)


def test_float_and_int_list_values_refuse_what_int_and_float_would_coerce() -> None:
    from tessera.wire import float_value, int_list_value

    assert float_value({"x": 2}, "x") == 2.0
    assert int_list_value({"s": [1, 8.0, 8]}, "s") == (1, 8, 8)
    for bad in (True, "1.5"):
        with pytest.raises(ValueError, match=r"'x' is .* not a number"):
            float_value({"x": bad}, "x")
    for bad_list in ("1,8,8", [1, True], [1, 2.5]):
        with pytest.raises(ValueError, match="'s' is"):
            int_list_value({"s": bad_list}, "s")
    with pytest.raises(KeyError):
        float_value({}, "x")


@pytest.mark.parametrize("strategy", ["fedavg-groups", "heterofl"])
def test_a_round_sends_one_weights_record_per_architecture_not_per_node(
    strategy: str,
    run_config: Any,
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # Prepare: six real ClientApps on three device profiles (so two or more
    # architectures, or slices, each chosen by several nodes)
    from server_app.app import build_server
    from tests.conftest import TINY_DIGITS, make_grid

    config = run_config(
        {**TINY_DIGITS, "strategy": strategy, "num-server-rounds": 1, "min-nodes": 6}
        | {"output-dir": str(tmp_path), "run-name": "r"}
    )
    if strategy == "heterofl":
        config |= {"model-family": "preresnet", "submodel-widths": "1,0.25"}
    server = build_server(config, bundle=digits_bundle).runner
    grid = make_grid(config, 6)

    # Execute
    server.start(grid, num_rounds=1, timeout=5.0)

    # Assert: every node trained; the nodes of one architecture got the same record
    # (the round held one copy of each model, not one per node)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(train) == 6 and not server.rounds[0]["skipped"]
    by_arch: dict[str, set[int]] = {}
    for m in train:
        arch = str(m.content[wire.CONFIG]["arch"])
        by_arch.setdefault(arch, set()).add(id(m.content.array_records[wire.ARRAYS]))
    assert all(len(ids) == 1 for ids in by_arch.values()), by_arch
    assert len(by_arch) < len(train)
