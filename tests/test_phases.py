"""The phases of a node's round (tessera.phases): by hand, on the wire and in the record."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from strategies.core.record import client_phases, mean_phases
from strategies.core.validation import ClientReply, Rejection
from tessera import wire
from tessera.phases import (
    CLIENT_PHASES,
    PHASE_METRICS,
    RETURN,
    PhaseClock,
    arrival_phases,
    metric_key,
    process_start_time,
    return_seconds,
)
from tests.conftest import TINY_DIGITS, instruction
from tests.test_validation import NODE, content, good_metrics, reply_from, validate


def test_phase_clock_charges_each_lap_the_time_since_the_last() -> None:
    ticks: Iterator[float] = iter([10.0, 10.5, 12.0, 12.25, 13.0])
    clock = PhaseClock(lambda: next(ticks))
    clock.lap("data")  # 0.5
    clock.lap("train")  # 1.5
    clock.lap("data")  # 0.25 more
    clock.lap("reply")  # 0.75
    assert clock.seconds == {"data": 0.75, "train": 1.5, "reply": 0.75}


def test_a_fresh_process_splits_queued_and_start() -> None:
    # instruction at 100, process started 103, handler entered 106.5
    assert arrival_phases(100.0, 106.5, 103.0) == {"queued": 3.0, "start": 3.5}


def test_a_long_lived_process_is_all_queue() -> None:
    # started long before the instruction (a Ray actor, an executor)
    assert arrival_phases(100.0, 101.25, 50.0) == {"queued": 1.25, "start": 0.0}
    assert arrival_phases(100.0, 101.25, None) == {"queued": 1.25, "start": 0.0}


def test_clocks_that_disagree_are_clamped_at_zero() -> None:
    # the node's clock is behind the server's: entry "before" the instruction
    assert arrival_phases(100.0, 98.0, None) == {"queued": 0.0, "start": 0.0}
    assert arrival_phases(math.nan, 98.0, 97.0) == {"queued": 0.0, "start": 0.0}
    assert return_seconds(10.0, 9.0) == 0.0
    assert return_seconds(10.0, 12.5) == 2.5
    assert return_seconds(math.inf, 12.5) == 0.0


def test_process_start_time_from_a_proc_folder(tmp_path: Path) -> None:
    # Prepare: a command name with spaces and parentheses, started 250 ticks after boot
    (tmp_path / "self").mkdir()
    fields = ["S"] + ["0"] * 18 + ["250"] + ["0"] * 10  # fields 3.. ; 22nd is 250
    (tmp_path / "self" / "stat").write_text("4242 (my (odd) name) " + " ".join(fields))
    (tmp_path / "stat").write_text("cpu 1 2 3\nbtime 1700000000\nprocesses 9\n")

    # Execute / Assert: without /proc/uptime, whole-second btime
    assert process_start_time(tmp_path) == pytest.approx(
        1700000000 + 250 / os.sysconf("SC_CLK_TCK")
    )
    assert process_start_time(tmp_path / "missing") is None

    # with it, the boot is now minus the uptime (to its 10 ms, not btime's second)
    (tmp_path / "uptime").write_text("1000.25 1900.50\n")
    assert process_start_time(tmp_path, now=1700001000.97) == pytest.approx(
        1700000000.72 + 250 / os.sysconf("SC_CLK_TCK")
    )


def test_this_process_started_before_now() -> None:
    import time

    started = process_start_time()
    if started is None:
        pytest.skip("no /proc on this system")
    # and not a second early (btime's whole seconds did that): this process is
    # younger than the test session
    assert time.time() - 3600 < started <= time.time()


def test_a_reply_with_phases_is_accepted_and_recorded() -> None:
    # Prepare
    metrics = {**good_metrics(), **{k: 0.5 for k in PHASE_METRICS}}
    reply = reply_from(NODE, content(metrics=metrics))

    # Execute
    accepted = validate(reply)

    # Assert: each phase, and the way back measured here
    assert isinstance(accepted, ClientReply)
    phases = client_phases(accepted)
    assert list(phases) == [*CLIENT_PHASES, RETURN]
    assert all(phases[p] == 0.5 for p in CLIENT_PHASES)
    assert 0.0 <= phases[RETURN] < 60.0


@pytest.mark.parametrize("value", [-1.0, 2e6, math.nan])
def test_a_phase_out_of_range_rejects_the_reply(value: float) -> None:
    metrics = {**good_metrics(), metric_key("train"): value}
    result = validate(reply_from(NODE, content(metrics=metrics)))
    assert isinstance(result, Rejection)
    assert "phase-train" in result.reason


def test_mean_phases_over_the_replies_that_report_them() -> None:
    clients: list[dict[str, Any]] = [
        {"phases": {"train": 1.0, "data": 0.5, RETURN: 0.1}},
        {"phases": {"train": 3.0, RETURN: 0.3}},
        {},
    ]
    assert mean_phases(clients) == {"data": 0.5, "train": 2.0, RETURN: 0.2}


def two_rounds(
    run_config: Callable[..., dict[str, Any]], bundle: Any, out: Path, **extra: Any
) -> list[dict[str, Any]]:
    """Run two real rounds of three real ClientApps (in process); return the round records."""
    from tests.test_spine_rounds import run

    config = run_config(
        {**TINY_DIGITS, "num-server-rounds": 2, "output-dir": str(out), "run-name": "p", **extra}
    )
    run(config, bundle, num_nodes=3)
    return [json.loads(x) for x in (out / "p" / "metrics.jsonl").read_text().splitlines()]


def test_a_round_records_every_phase_of_every_node(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # Execute
    rounds = two_rounds(run_config, digits_bundle, tmp_path)

    # Assert: every client's phases, a round mean, and training where training is
    for record in rounds:
        for client in record["clients"]:
            assert set(client["phases"]) == {*CLIENT_PHASES, RETURN}
            assert all(v >= 0.0 for v in client["phases"].values())
            assert client["phases"]["train"] >= 0.9 * client["train_seconds"]
        assert set(record["client_phase_seconds"]) == {*CLIENT_PHASES, RETURN}


def test_the_handler_stamps_phases_from_the_instruction(tmp_path: Path) -> None:
    from client_app.app import with_phases

    config = RecordDict({wire.CONFIG: ConfigRecord({"server-round": 1})})
    msg = instruction(config, dst_node_id=1, message_type="train")
    created = float(msg.metadata.created_at)
    clock = PhaseClock(iter([0.0, 2.0]).__next__)
    clock.lap("train")
    out = with_phases({wire.METRICS: MetricRecord({"x": 1.0})}, msg, created + 4.0, clock)
    record = out[wire.METRICS]
    assert isinstance(record, MetricRecord)
    assert record["phase-train"] == 2.0 and record["x"] == 1.0
    arrival = float(record["phase-queued"]) + float(record["phase-start"])  # type: ignore[arg-type]
    assert arrival == pytest.approx(4.0, abs=1e-5)
    assert record["phase-data"] == 0.0
    # no metrics record: nothing to add
    assert with_phases({}, msg, created, clock) == {}
    assert isinstance(Message(RecordDict(out), reply_to=msg), Message)


@pytest.mark.parametrize("trust", [True, False])
def test_a_round_records_the_servers_pool_training_inside_its_fold(
    trust: bool,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # Execute: the default bounded mean, its direction check on or off
    rounds = two_rounds(run_config, digits_bundle, tmp_path, **{"server-trust": trust})

    # Assert: the server trained on its pool while folding (a part of fold_cpu), only
    # with the direction check on
    for record in rounds:
        phases = record["phase_seconds"]
        if trust:
            assert 0.0 < phases["pool_train_cpu"] <= phases["fold_cpu"]
        else:
            assert phases["pool_train_cpu"] == 0.0
