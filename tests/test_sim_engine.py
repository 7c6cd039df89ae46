"""``tessera.sim_engine``: Flower's in-memory message store, indexed by node.

Flower's own ``InMemoryLinkState`` is set up as ``flwr.simulation.run_simulation``
sets it up (a run, nodes registered by the engine's ``_register_nodes``, messages
pushed through ``InMemoryGrid``), once with Flower's method and once with the index,
and the same sequence of operations must give the same answers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

import tessera.sim_engine as sim_engine


@pytest.fixture(autouse=True)
def flower_restored() -> Iterator[None]:
    sim_engine.restore_flower()
    yield
    sim_engine.restore_flower()


def simulation_state(num_nodes: int) -> tuple[Any, Any, list[int]]:
    """A real in-memory LinkState and grid as ``run_simulation`` builds them."""
    from flwr.common.typing import Run
    from flwr.proto.task_pb2 import Task  # pylint: disable=no-name-in-module
    from flwr.server.grid.inmemory_grid import InMemoryGrid
    from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation import NoOpFederationManager

    factory = LinkStateFactory(
        FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()
    )
    state = factory.state()
    run = Run.create_empty(run_id=7)
    run.primary_task_id = 11
    run.federation = NOOP_FEDERATION
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[11] = Task(task_id=11, run_id=run.run_id)
    nodes = list(_register_nodes(num_nodes, factory))
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, grid, nodes


def push(grid: Any, nodes: list[int], tag: int, *, ttl: float = 600.0) -> list[str]:
    messages = [
        Message(
            RecordDict({"c": ConfigRecord({"tag": tag, "to": n})}),
            dst_node_id=n,
            message_type="train",
            ttl=ttl,
        )
        for n in nodes
    ]
    return [m for m in grid.push_messages(messages) if m]


def sweep(state: Any, nodes: list[int], limit: int | None = 1) -> list[tuple[int, int]]:
    """What the engine's thread does: ask every node for its next message.

    Returns (node position, message tag) pairs: node ids are drawn at random.
    """
    out = []
    for node in nodes:
        for msg in state.get_message_ins(node_id=node, limit=limit):
            config = msg.content.config_records["c"]
            assert msg.metadata.delivered_at != ""
            out.append((nodes.index(int(config["to"])), int(config["tag"])))
    return out


def scenario(indexed: bool) -> list[Any]:
    """One sequence of stores, lookups, expiries and deletions; every answer recorded."""
    if indexed:
        assert sim_engine.index_messages_by_node()
    state, grid, nodes = simulation_state(6)
    answers: list[Any] = []
    first = push(grid, nodes, tag=1)
    push(grid, nodes[:2], tag=2)  # two nodes get a second message
    answers.append(sweep(state, nodes))  # each node's first message
    answers.append(sweep(state, nodes))  # nodes 0 and 1: their second
    answers.append(sweep(state, nodes))  # nothing left undelivered
    state.delete_messages(set(first[:3]))  # replies pulled: deleted
    push(grid, nodes[4:], tag=3, ttl=0.05)  # soon expired
    time.sleep(0.1)
    push(grid, nodes[3:5], tag=4)
    answers.append(sweep(state, nodes, limit=None))  # the expired ones are dropped
    answers.append(state.num_message_ins())
    return answers


def test_the_index_answers_as_flower_does() -> None:
    # Execute
    flower = scenario(indexed=False)
    sim_engine.restore_flower()
    indexed = scenario(indexed=True)

    # Assert: the same messages, in the same order, delivered once; expired ones gone
    assert indexed == flower
    assert flower[0] == [(i, 1) for i in range(6)]
    assert flower[1] == [(0, 2), (1, 2)]
    assert flower[2] == []
    assert flower[3] == [(3, 4), (4, 4)]  # node 4's and 5's expired tag-3 messages are gone


def counting_checks(monkeypatch: pytest.MonkeyPatch, state: Any) -> list[int]:
    """Count the messages Flower checks (expiry, federation) from now on, in a 1-list."""
    count = [0]
    real = type(state)._check_stored_messages

    def counting(self: Any, message_ids: set[str]) -> None:
        count[0] += len(message_ids)
        real(self, message_ids)

    monkeypatch.setattr(type(state), "_check_stored_messages", counting)
    return count


def checks_in_two_sweeps(monkeypatch: pytest.MonkeyPatch, nodes: int) -> tuple[int, int]:
    """Messages Flower checks (expiry, federation) in two engine sweeps; and those delivered."""
    state, grid, ids = simulation_state(nodes)
    push(grid, ids, tag=1)
    count = counting_checks(monkeypatch, state)
    delivered = len(sweep(state, ids)) + len(sweep(state, ids))
    monkeypatch.undo()
    checks = count[0]
    return checks, delivered


def test_a_sweep_no_longer_walks_every_stored_message(monkeypatch: pytest.MonkeyPatch) -> None:
    # Execute: 300 nodes with a message each, two sweeps as the engine's thread makes
    # them, with Flower's walk and with the index
    flower, flower_delivered = checks_in_two_sweeps(monkeypatch, 300)
    assert sim_engine.index_messages_by_node()
    indexed, indexed_delivered = checks_in_two_sweeps(monkeypatch, 300)

    # Assert: each message delivered once either way; Flower walks the store for
    # every node (about 300 x 150 checks, then 300 x 300), the index checks each
    # node's own message (about 300 a sweep)
    assert flower_delivered == indexed_delivered == 300
    assert flower > 100_000
    assert indexed <= 2 * 300 + 10


def test_another_flower_version_keeps_flower_s_method(monkeypatch: pytest.MonkeyPatch) -> None:
    import flwr
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    original = InMemoryLinkState.get_message_ins
    monkeypatch.setattr(flwr, "__version__", "9.9.9")

    assert sim_engine.index_messages_by_node() is False
    assert InMemoryLinkState.get_message_ins is original


def run_engine_thread(state: Any) -> tuple[Any, Any, Any]:
    """Flower's own engine thread (``add_messages_to_queue``) on ``state``, sweeping no node.

    With no node in its mapping, its sweeps hand out nothing: whatever reaches its
    queue was handed over as it was stored.
    """
    import threading
    from queue import Queue

    from flwr.server.superlink.fleet.vce import vce_api

    queue: Queue[Any] = Queue()
    stop = threading.Event()
    thread = threading.Thread(
        target=vce_api.add_messages_to_queue, args=(state, queue, {}, stop), daemon=True
    )
    thread.start()
    return queue, stop, thread


def drained(queue: Any) -> list[tuple[int, int]]:
    out = []
    while not queue.empty():
        config = queue.get_nowait().content.config_records["c"]
        out.append((int(config["to"]), int(config["tag"])))
    return out


@pytest.mark.parametrize("feed", [True, False])
def test_the_feed_hands_each_stored_message_to_the_engine_s_queue(feed: bool) -> None:
    # Setup: the index, with or without the feed; Flower's engine thread running
    assert sim_engine.index_messages_by_node(feed=feed)
    state, grid, nodes = simulation_state(5)
    queue, stop, thread = run_engine_thread(state)
    try:
        # Execute: every node a message, two nodes a second one
        push(grid, nodes, tag=1)
        push(grid, nodes[:2], tag=2)
        handed = drained(queue)
        left = sweep(state, nodes)  # what the engine's next sweeps would still find
        later = sweep(state, nodes)
    finally:
        stop.set()
        thread.join(timeout=5)

    # Assert: with the feed, every message went to the queue as it was stored, in
    # the order stored, marked delivered, and the sweeps find nothing left; without
    # it the queue stays empty and the sweeps hand out one message per node each
    if feed:
        assert sim_engine.engine_queue(state) is queue
        assert handed == [(n, 1) for n in nodes] + [(nodes[0], 2), (nodes[1], 2)]
        assert left == later == []
    else:
        assert handed == []
        assert left == [(i, 1) for i in range(5)]
        assert later == [(0, 2), (1, 2)]


def test_the_feed_answers_as_flower_does() -> None:
    # The scenario of the first test, with the feed on and no engine thread: the
    # queue is not found, and every answer is Flower's
    flower = scenario(indexed=False)
    sim_engine.restore_flower()
    assert sim_engine.index_messages_by_node(feed=True)
    state, _, _ = simulation_state(1)
    assert sim_engine.engine_queue(state) is None
    sim_engine.restore_flower()
    assert scenario(indexed=True) == flower


def test_a_node_with_nothing_undelivered_is_answered_without_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Setup: 200 nodes, each message delivered by a first sweep
    assert sim_engine.index_messages_by_node()
    state, grid, ids = simulation_state(200)
    push(grid, ids, tag=1)
    assert len(sweep(state, ids)) == 200
    count = counting_checks(monkeypatch, state)

    # Execute: ten more sweeps, then one new message for node 7
    idle = [sweep(state, ids) for _ in range(10)]
    idle_checks = count[0]
    push(grid, [ids[7]], tag=2)
    found = sweep(state, ids)
    checks = count[0]

    # Assert: the idle sweeps check nothing and find nothing; the new message is
    # found, after checking node 7's two stored messages only
    assert idle == [[]] * 10
    assert idle_checks == 0
    assert found == [(7, 2)]
    assert checks == 2


def test_the_first_message_stored_is_indexed_once() -> None:
    # The index is built from the store on first use: built after the first
    # message was stored, it held that message twice (and handed it out twice to
    # a call without a limit)
    assert sim_engine.index_messages_by_node()
    state, grid, ids = simulation_state(2)
    push(grid, ids[:1], tag=1)

    assert sweep(state, ids, limit=None) == [(0, 1)]
    assert [len(v) for v in state.__dict__["_tessera_node_index"].values()] == [1]
