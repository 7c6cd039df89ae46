"""The attack suite: ALIE, IPM, min-max, min-sum, Mimic, dense-scale, bound-riding, ratchet
and inflate.

- the maths (:mod:`tessera.attack_math`) against values computed by hand;
- the in-process grid's omniscient hooks (:class:`tessera.local_grid.LocalGrid`) on
  stand-in handlers: who is handled when, what a hook sees;
- each attack on the real ClientApp handlers through the grid for ``fedavg`` (five
  nodes, one attacker), the forged reply checked against its formula, recomputed
  here with numpy from the honest replies the server received;
- the ServerApp refuses the omniscient attacks outside the in-process harness.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from statistics import NormalDist
from typing import Any, cast

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict

from client_app.attacks.client import AttackClient
from client_app.attacks.omniscient import OmniscientAttack, install_omniscient
from client_app.attacks.spec import AttackSpec
from client_app.attacks.vectors import flatten, unflatten
from server_app.app import build_server
from tessera import attack_math, wire
from tessera.attacks import attack_assignment, require_client_side
from tessera.config import ConfigError, RunConfig
from tessera.local_grid import BatchView, LocalGrid, OmniscientHook, instruction, make_context
from tests.conftest import TINY_DIGITS, load_default_run_config, make_grid

RunConfigFactory = Callable[..., dict[str, Any]]


# ---------------------------------------------------------------------------- maths
def test_alie_z_from_the_paper_by_hand() -> None:
    # n=5, f=1: s = floor(5/2 + 1) - 1 = 2, z = Phi^-1((5 - 2) / 5) = Phi^-1(0.6)
    assert attack_math.alie_z(5, 1) == pytest.approx(0.2533471, abs=1e-6)
    # n=10, f=3: s = 6 - 3 = 3, z = Phi^-1(0.7)
    assert attack_math.alie_z(10, 3) == pytest.approx(0.5244005, abs=1e-6)
    # n=4, f=3: s = 0, (n - s) / n = 1: no quantile
    with pytest.raises(ValueError, match="set run-config 'attack-z'"):
        attack_math.alie_z(4, 3)


def test_alie_is_mean_minus_z_sample_std() -> None:
    # mu = (2, 1); sample std = (sqrt 2, sqrt 2)
    honest = np.array([[1.0, 0.0], [3.0, 2.0]])
    np.testing.assert_allclose(
        attack_math.alie(honest, 1.0), [2.0 - math.sqrt(2), 1.0 - math.sqrt(2)]
    )
    np.testing.assert_allclose(attack_math.alie(honest[:1], 1.0), [1.0, 0.0])  # std 0


def test_ipm_is_minus_epsilon_mean() -> None:
    honest = np.array([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_allclose(attack_math.ipm(honest, 0.5), [-1.0, -1.5])


def test_perturbation_directions_by_hand() -> None:
    # mu = (2, -2), sample std = (sqrt 2, 0), |mu| = 2 sqrt 2
    honest = np.array([[1.0, -2.0], [3.0, -2.0]])
    np.testing.assert_allclose(attack_math.perturbation(honest, "std"), [-math.sqrt(2), 0.0])
    np.testing.assert_allclose(attack_math.perturbation(honest, "sign"), [-1.0, 1.0])
    np.testing.assert_allclose(
        attack_math.perturbation(honest, "unit"), [-1 / math.sqrt(2), 1 / math.sqrt(2)]
    )
    np.testing.assert_array_equal(attack_math.perturbation(np.zeros((2, 2)), "unit"), [0, 0])


def test_the_halving_search_finds_the_largest_admissible_gamma() -> None:
    assert attack_math.largest_gamma(lambda g: g <= 0.7) == pytest.approx(0.7, abs=1e-9)
    assert attack_math.largest_gamma(lambda g: g <= 0.7) <= 0.7
    assert attack_math.largest_gamma(lambda g: False) == 0.0
    # always admissible: 10 + 5 + 2.5 + ... (40 steps) -> just under 2 x start
    assert attack_math.largest_gamma(lambda g: True) == pytest.approx(20.0, abs=1e-9)
    tested: list[float] = []

    def admissible(gamma: float) -> bool:
        tested.append(gamma)
        return True

    attack_math.largest_gamma(admissible, steps=3)
    assert tested == [10.0, 15.0, 17.5]


def test_min_max_and_min_sum_by_hand() -> None:
    # honest 0, 0, 3: mu = 1, sample std = sqrt(6 / 2) = sqrt 3, p = -sqrt 3
    honest = np.array([[0.0], [0.0], [3.0]])
    # min-max: largest pairwise distance 3; x = 1 - gamma sqrt 3 with |3 - x| <= 3 -> x = 0
    np.testing.assert_allclose(attack_math.min_max(honest), [0.0], atol=1e-9)
    # min-sum: largest honest sum of squares 9 + 9 = 18; 2 x^2 + (3 - x)^2 <= 18 -> x >= -1
    np.testing.assert_allclose(attack_math.min_sum(honest), [-1.0], atol=1e-9)
    # one honest update: no room, the mean itself
    np.testing.assert_allclose(attack_math.min_max(honest[2:], "sign"), [3.0])


def test_squared_distances_by_hand() -> None:
    a = np.array([[0.0, 0.0], [1.0, 1.0]])
    b = np.array([[3.0, 4.0]])
    np.testing.assert_allclose(attack_math.squared_distances(a, b), [[25.0], [13.0]])


def test_mimic_copies_the_update_furthest_along_the_top_direction() -> None:
    # centred: (-4, 0), (-2, 0), (6, 0): the top direction is x, the furthest is the third
    honest = np.array([[0.0, 0.0], [2.0, 0.0], [10.0, 0.0]])
    assert attack_math.mimic_index(honest) == 2
    np.testing.assert_array_equal(attack_math.mimic(honest), [10.0, 0.0])
    # the sign of the direction does not matter
    assert attack_math.mimic_index(-honest) == 2
    # all equal: the first
    assert attack_math.mimic_index(np.ones((3, 2))) == 0


def test_bound_riding_ratchet_dense_and_lower_median_by_hand() -> None:
    # d = (3, 4), |d| = 5, B = 10 -> -0.99 x 10 x (0.6, 0.8)
    np.testing.assert_allclose(attack_math.bound_riding(np.array([3.0, 4.0]), 10.0), [-5.94, -7.92])
    np.testing.assert_array_equal(attack_math.bound_riding(np.zeros(2), 10.0), [0.0, 0.0])
    assert attack_math.ratchet_factor(1) == 1e3
    assert attack_math.ratchet_factor(2) == 1e-9
    assert attack_math.lower_median(np.array([3.0, 1.0, 2.0, 10.0])) == 2.0
    signs = attack_math.dense_signs(1000, np.random.default_rng(0))
    assert set(np.unique(signs)) == {-1.0, 1.0}
    np.testing.assert_array_equal(signs, attack_math.dense_signs(1000, np.random.default_rng(0)))


def test_a_bad_stack_is_refused() -> None:
    with pytest.raises(ValueError, match=r"non-empty \(n, d\) stack"):
        attack_math.ipm(np.zeros((0, 3)), 0.5)


def test_flatten_and_unflatten_round_trip_keeping_dtypes() -> None:
    like: dict[str, np.ndarray] = {"a": np.zeros((2, 2), np.float32), "b": np.zeros(3)}
    vector = np.arange(7, dtype=np.float64)
    out = unflatten(vector, like, ["a", "b"])
    np.testing.assert_array_equal(out["a"], [[0, 1], [2, 3]])
    assert out["a"].dtype == np.float32 and out["b"].dtype == np.float64
    np.testing.assert_array_equal(flatten(out, ["a", "b"]), vector)
    with pytest.raises(ValueError, match="cannot fill"):
        unflatten(np.zeros(3), like, ["a", "b"])


# ------------------------------------------------------------- the grid's hook order
def stand_in(msg: Message, context: Context) -> Message:
    """A ClientApp stand-in: replies with its node id as its only weight."""
    if context.node_id == 3:
        raise RuntimeError("this node fails")
    node = float(context.node_id)
    records = RecordDict({wire.ARRAYS: wire.numpy_to_record({"w": np.array([node], np.float32)})})
    return Message(records, reply_to=msg)


def first_weight(reply: Message) -> float:
    """The stand-in's only weight."""
    return float(reply.content.array_records[wire.ARRAYS]["w"].numpy()[0])


def test_the_grid_handles_omniscient_nodes_last_and_shows_them_the_batch() -> None:
    # Prepare: four nodes, node 2 omniscient, node 3 fails
    contexts = {n: make_context(n, {}, {}) for n in (1, 2, 3, 4)}
    grid = LocalGrid(contexts, {"train": stand_in})
    seen: list[BatchView] = []

    def hook(view: BatchView) -> Message:
        seen.append(view)
        records = RecordDict(
            {wire.ARRAYS: wire.numpy_to_record({"w": np.array([-1.0], np.float32)})}
        )
        return Message(records, reply_to=view.own.instruction)

    grid.omniscient[2] = hook
    messages = [
        instruction(RecordDict(), dst_node_id=n, message_type="train") for n in (1, 2, 3, 4)
    ]

    # Execute
    replies = list(grid.send_and_receive(messages))

    # Assert: the replies come back in push order, node 2's forged
    (view,) = seen
    assert view.own.node == 2 and [e.node for e in view.others] == [1, 4]
    assert view.cohort == 3  # node 3's error is not a reply
    assert float(first_weight(view.own.reply)) == 2.0
    assert [r.metadata.src_node_id for r in replies] == [1, 2, 3, 4]
    assert float(first_weight(replies[1])) == -1.0
    assert replies[1].metadata.reply_to_message_id == messages[1].metadata.message_id
    assert replies[2].has_error()


def test_a_hook_that_keeps_the_reply_returns_none() -> None:
    contexts = {n: make_context(n, {}, {}) for n in (1, 2)}
    grid = LocalGrid(contexts, {"train": stand_in})
    grid.omniscient[2] = lambda view: None
    messages = [instruction(RecordDict(), dst_node_id=n, message_type="train") for n in (1, 2)]
    replies = list(grid.send_and_receive(messages))
    assert float(first_weight(replies[1])) == 2.0


# ---------------------------------------------------- the attacks on the real handlers
def is_learned(key: str, value: np.ndarray) -> bool:
    return value.dtype.kind == "f" and not key.endswith(("running_mean", "running_var"))


def update_of(sent: Message, reply: Message) -> np.ndarray:
    """Flat learned-parameter update of one node, float64, by hand."""
    w0 = wire.record_to_numpy(sent.content.array_records[wire.ARRAYS])
    w = wire.record_to_numpy(reply.content.array_records[wire.ARRAYS])
    keys = [k for k in w if is_learned(k, w[k])]
    return np.concatenate([(w[k].astype(np.float64) - w0[k]).ravel() for k in keys])


def round_updates(
    grid: LocalGrid, server_round: int, hostile: set[int]
) -> tuple[dict[int, np.ndarray], dict[int, Message]]:
    """Each node's update of one round, and its reply, by node id."""
    sent = {
        m.metadata.message_id: m
        for m in grid.sent_of("train")
        if int(cast(Any, m.content[wire.CONFIG])["server-round"]) == server_round
    }
    updates, replies = {}, {}
    for reply in grid.replies_of("train"):
        if reply.metadata.reply_to_message_id in sent:
            node = reply.metadata.src_node_id
            updates[node] = update_of(sent[reply.metadata.reply_to_message_id], reply)
            replies[node] = reply
    assert set(updates) >= hostile
    return updates, replies


def handshake_sizes(grid: LocalGrid) -> dict[int, int]:
    """Each node's handshake ``num-train`` (what it claims), by node id."""
    return {
        r.metadata.src_node_id: int(cast(int, r.content.config_records[wire.PROFILE]["num-train"]))
        for r in grid.replies_of(wire.HANDSHAKE)
    }


def fedavg_config(
    run_config: RunConfigFactory, tmp_path: Path, attack: str, **overrides: Any
) -> dict[str, Any]:
    return run_config(
        {
            **TINY_DIGITS,
            "strategy": "fedavg",
            "fedavg-arch": "cnn-2",
            "partitioner": "iid",
            "num-server-rounds": 1,
            "attack": attack,
            "attack-fraction": 0.2,
            "output-dir": str(tmp_path),
            "run-name": attack or "clean",
            **overrides,
        }
    )


def recording(hook: OmniscientHook, seen: list[BatchView]) -> OmniscientHook:
    """Wrap ``hook`` so that what it sees is kept in ``seen``."""

    def wrapped(view: BatchView) -> Message | None:
        seen.append(view)
        return hook(view)

    return wrapped


def run_federation(
    config: dict[str, Any], bundle: Any, *, nodes: int = 5, omniscient: bool = True
) -> tuple[Any, LocalGrid, set[int], list[BatchView]]:
    """Run ``config``; return the server, the grid, the hostile node ids and what hooks saw."""
    grid = make_grid(config, nodes)
    seen: list[BatchView] = []
    if omniscient:
        install_omniscient(grid, config)
        for node, hook in list(grid.omniscient.items()):
            grid.omniscient[node] = recording(hook, seen)
    server = build_server(config, bundle=bundle).runner
    rounds = int(config["num-server-rounds"])
    server.start(grid, num_rounds=rounds, timeout=5.0)
    assert len(server.rounds) == rounds
    for record in server.rounds:
        assert not record["skipped"], record["skip_reason"]
    plan = attack_assignment(RunConfig.from_flower(config), nodes)
    return server, grid, {100 + p for p in plan}, seen


def omniscient_expected(attack: str, honest: np.ndarray) -> np.ndarray | None:
    """The forged update by the formula, for the attacks with a closed form."""
    mu: np.ndarray = honest.mean(axis=0)
    if attack == "ipm":
        return -0.5 * mu
    if attack == "alie":
        # n = 5 nodes, f = 1: z = Phi^-1(0.6)
        return np.asarray(mu - NormalDist().inv_cdf(0.6) * honest.std(axis=0, ddof=1))
    if attack == "bound-riding":
        # B = clip-factor 1 (the default) x lower median of the honest distances;
        # reverse of the mean
        distances = np.sort(np.linalg.norm(honest, axis=1))
        bound = 1.0 * distances[(len(distances) - 1) // 2]
        return np.asarray(-0.99 * bound * mu / np.linalg.norm(mu))
    if attack == "mimic":
        # the honest update furthest along the top principal direction (SVD here)
        centred = honest - mu
        top = np.linalg.svd(centred, full_matrices=False)[2][0]
        return np.asarray(honest[int(np.argmax(np.abs(centred @ top)))])
    return None


@pytest.mark.parametrize("attack", ["alie", "ipm", "min-max", "min-sum", "mimic", "bound-riding"])
def test_each_omniscient_attack_forges_what_its_formula_says(
    attack: str,
    run_config: RunConfigFactory,
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # Prepare: five nodes, one hostile (the seeded draw), one round
    config = fedavg_config(run_config, tmp_path, attack)

    # Execute
    _, grid, hostile, seen = run_federation(config, digits_bundle)

    # Assert: the attacker's update is the formula over the four honest updates
    (attacker,) = hostile
    updates, replies = round_updates(grid, 1, hostile)
    honest = np.stack([u for node, u in sorted(updates.items()) if node != attacker])
    assert honest.shape[0] == 4
    forged = updates[attacker]
    expected = omniscient_expected(attack, honest)
    scale = float(np.abs(honest).max())
    if expected is not None:
        np.testing.assert_allclose(forged, expected, rtol=1e-4, atol=1e-5 * scale)
    mu, sigma = honest.mean(axis=0), honest.std(axis=0, ddof=1)
    if attack in ("min-max", "min-sum"):
        # mu - gamma sigma, gamma > 0 the largest that meets the constraint (binding)
        gamma = float((mu - forged) @ sigma / (sigma @ sigma))
        assert gamma > 0
        np.testing.assert_allclose(forged, mu - gamma * sigma, rtol=1e-4, atol=1e-5 * scale)
        to_honest = ((honest - forged) ** 2).sum(axis=1)
        pairwise = ((honest[:, None, :] - honest[None, :, :]) ** 2).sum(axis=2)
        if attack == "min-max":
            assert to_honest.max() == pytest.approx(pairwise.max(), rel=1e-3)
        else:
            assert to_honest.sum() == pytest.approx(pairwise.sum(axis=1).max(), rel=1e-3)
    # the hook saw the attacker's own reply and the four honest ones; the reply is
    # built as the handler builds it: same records, metrics, statistics
    (view,) = seen
    assert view.cohort == 5 and len(view.others) == 4
    own, sent = view.own.reply, replies[attacker]
    assert list(sent.content.keys()) == list(own.content.keys())
    assert dict(sent.content[wire.METRICS]) == dict(own.content[wire.METRICS])
    assert sent.metadata.reply_to_message_id == view.own.instruction.metadata.message_id
    before = wire.record_to_numpy(own.content.array_records[wire.ARRAYS])
    after = wire.record_to_numpy(sent.content.array_records[wire.ARRAYS])
    assert list(before) == list(after)
    for key, value in before.items():
        assert after[key].dtype == value.dtype
        if not is_learned(key, value):
            np.testing.assert_array_equal(after[key], value)


def test_an_omniscient_attacker_never_counts_another_attackers_update_as_honest(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    # Prepare: two attackers of five, one ipm (omniscient), one dense-scale (client side)
    config = fedavg_config(run_config, tmp_path, "ipm,dense-scale", **{"attack-fraction": 0.4})
    plan = attack_assignment(RunConfig.from_flower(config), 5)
    grid = make_grid(config, 5)

    # Execute
    installed = install_omniscient(grid, config)

    # Assert: only the ipm node is forged in the grid
    by_kind = {kind: 100 + p for p, kind in plan.items()}
    assert installed == {by_kind["ipm"]: "ipm"}

    # Execute: the round
    server = build_server(config, bundle=digits_bundle).runner
    server.start(grid, num_rounds=1, timeout=5.0)

    # Assert: ipm's update is -0.5 x the mean of the three honest ones only
    updates, _ = round_updates(grid, 1, set(by_kind.values()))
    honest = np.stack([u for n, u in sorted(updates.items()) if n not in by_kind.values()])
    assert honest.shape[0] == 3
    np.testing.assert_allclose(
        updates[by_kind["ipm"]], -0.5 * honest.mean(axis=0), rtol=1e-4, atol=1e-6
    )
    assert not server.rounds[0]["skipped"]


def test_client_side_vector_attacks_against_the_same_nodes_honest_update(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    # Prepare: the clean round gives each node's honest update (training is seeded
    # per partition and round, so the attacker would have trained exactly this)
    clean = fedavg_config(run_config, tmp_path, "", **{"attack-fraction": 0.0})
    _, grid, _, _ = run_federation(clean, digits_bundle)
    honest_updates, _ = round_updates(grid, 1, set())
    expected = {
        "bound-riding": lambda u: -0.99 * 1.0 * u,  # B = clip-factor (1) x its own distance
        "ratchet": lambda u: 1e3 * u,  # round 1 is odd
    }
    for attack in ("dense-scale", "bound-riding", "ratchet"):
        config = fedavg_config(run_config, tmp_path, attack)

        # Execute: in the real-simulation form (no omniscient hook)
        _, grid, hostile, _ = run_federation(config, digits_bundle, omniscient=False)

        # Assert
        (attacker,) = hostile
        updates, replies = round_updates(grid, 1, hostile)
        u = honest_updates[attacker]
        if attack == "dense-scale":
            w = wire.record_to_numpy(replies[attacker].content.array_records[wire.ARRAYS])
            learned = np.concatenate([v.ravel() for k, v in w.items() if is_learned(k, v)])
            np.testing.assert_allclose(np.abs(learned), 1e30, rtol=1e-6)
            assert (learned > 0).any() and (learned < 0).any()
            stats = [v for k, v in w.items() if k.endswith("running_var")]
            assert stats and all(np.abs(v).max() < 1e3 for v in stats)
        else:
            np.testing.assert_allclose(
                updates[attacker], expected[attack](u), rtol=1e-3, atol=1e-6 * np.abs(u).max()
            )


def test_ratchet_goes_up_then_down_and_every_round_completes(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    # Prepare
    config = fedavg_config(run_config, tmp_path, "ratchet", **{"num-server-rounds": 2})

    # Execute
    _, grid, hostile, _ = run_federation(config, digits_bundle)

    # Assert: 1e3 x and 1e-9 x an honest-sized distance, both finite
    (attacker,) = hostile
    for server_round, low, high in ((1, 100.0, 1e5), (2, 0.0, 1e-6)):
        updates, _ = round_updates(grid, server_round, hostile)
        norms = {n: float(np.linalg.norm(u)) for n, u in updates.items()}
        typical = float(np.median([v for n, v in norms.items() if n != attacker]))
        assert low * typical <= norms[attacker] <= high * typical, (server_round, norms)


def test_inflate_lies_consistently_and_trains_honestly(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    # Prepare
    config = fedavg_config(run_config, tmp_path, "inflate", **{"local-epochs": 2})

    # Execute
    server, grid, hostile, _ = run_federation(config, digits_bundle)

    # Assert: num-train and the label counts x 1000, summing to it; num-examples is
    # the claimed num-train x local-epochs; the reply is accepted
    (attacker,) = hostile
    profiles = {
        r.metadata.src_node_id: r.content.config_records[wire.PROFILE]
        for r in grid.replies_of(wire.HANDSHAKE)
    }
    claimed = int(cast(int, profiles[attacker]["num-train"]))
    counts = [int(c) for c in cast(list[int], profiles[attacker]["label-counts"])]
    honest_sizes = [int(cast(int, p["num-train"])) for n, p in profiles.items() if n != attacker]
    assert claimed % 1000 == 0 and sum(counts) == claimed
    assert all(c % 1000 == 0 for c in counts)
    assert claimed >= 1000 * min(honest_sizes) // 2 and max(honest_sizes) < 1000
    assert server.nodes[attacker].num_train == claimed
    _, replies = round_updates(grid, 1, hostile)
    metrics = replies[attacker].content[wire.METRICS]
    assert int(cast(int, metrics[wire.NUM_EXAMPLES])) == claimed * 2
    assert attacker not in {r["node"] for r in server.rounds[0]["rejected"]}


@pytest.mark.parametrize("trim", [0.0, 0.2], ids=["median-cap", "trimmed"])
def test_an_inflating_node_weighs_what_the_cohort_allows(
    trim: float,
    run_config: RunConfigFactory,
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # Prepare: the plain mean (no size bound, no direction check), so the round's
    # model is the weighted mean of the replies, computed here by hand
    config = fedavg_config(
        run_config,
        tmp_path,
        "inflate",
        **{"local-epochs": 2, "clip-factor": 0.0, "server-trust": False, "weight-trim": trim},
    )

    # Execute
    server, grid, hostile, _ = run_federation(config, digits_bundle)

    # Assert: each honest node weighs its handshake num-train (its num-examples are
    # twice that); the liar weighs 2 x the lower median claim with the median cap
    # alone, and the largest honest claim with weight-trim 0.2 (ceil(0.2 x 5) = 1
    # largest claim, its own, cut to the next one down)
    (attacker,) = hostile
    sizes = handshake_sizes(grid)
    honest = sorted(n for node, n in sizes.items() if node != attacker)
    assert sizes[attacker] > 100 * honest[-1]
    claims = sorted(sizes.values())
    median = claims[(len(claims) - 1) // 2]
    liar = float(honest[-1]) if trim else 2.0 * median
    weights = {node: liar if node == attacker else float(n) for node, n in sizes.items()}
    updates, _ = round_updates(grid, 1, hostile)
    expected = sum(weights[n] * u for n, u in updates.items()) / sum(weights.values())
    sent = next(iter(grid.sent_of("train")))
    w0 = wire.record_to_numpy(sent.content.array_records[wire.ARRAYS])
    after = server.models.arrays["cnn-2"]
    moved = np.concatenate(
        [(after[k].astype(np.float64) - w0[k]).ravel() for k in w0 if is_learned(k, w0[k])]
    )
    np.testing.assert_allclose(moved, expected, rtol=1e-5, atol=1e-7)
    if trim:
        assert liar < 2.0 * median


def test_felo_knowledge_is_forged_over_the_honest_knowledge(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    # Prepare: IID, so every node holds every class and the knowledge rows align
    config = fedavg_config(run_config, tmp_path, "ipm", strategy="felo")

    # Execute
    _, grid, hostile, _ = run_federation(config, digits_bundle)

    # Assert: logits and features are -0.5 x the honest mean; counts and ids honest
    (attacker,) = hostile
    replies = {r.metadata.src_node_id: r for r in grid.replies_of("train")}
    payloads = {
        n: wire.record_to_numpy(r.content.array_records["knowledge"]) for n, r in replies.items()
    }
    honest = [p for n, p in payloads.items() if n != attacker]
    for key in ("logits", "features"):
        mean = np.mean([p[key].astype(np.float64) for p in honest], axis=0)
        np.testing.assert_allclose(payloads[attacker][key], -0.5 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(payloads[attacker]["class-ids"], np.arange(10))


def test_install_omniscient_covers_only_the_attacks_forged_in_the_grid(
    run_config: RunConfigFactory, tmp_path: Path
) -> None:
    # Prepare
    config = fedavg_config(run_config, tmp_path, "inflate,ratchet", **{"attack-fraction": 0.4})
    grid = make_grid(config, 5)

    # Execute / Assert
    assert install_omniscient(grid, config) == {}
    assert grid.omniscient == {}


def test_alie_with_a_hostile_majority_asks_for_attack_z() -> None:
    attack = OmniscientAttack(AttackSpec("alie"), frozenset())
    with pytest.raises(ConfigError, match="attack-z"):
        attack.forge(np.zeros((1, 2)), 4, 3)
    np.testing.assert_allclose(
        OmniscientAttack(AttackSpec("alie", z=1.0), frozenset()).forge(
            np.array([[1.0], [3.0]]), 4, 3
        ),
        [2.0 - math.sqrt(2)],
    )


@pytest.mark.parametrize("cap", [0.0, 2.0], ids=["one-bound", "stretched"])
def test_inflate_boost_is_bounded_at_the_cohort_s_caps(
    cap: float,
    run_config: RunConfigFactory,
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    from strategies.core.validation import bound_stretch, typical_weight, weight_caps

    # Prepare: the bounded mean (weight-cap 2; one bound for all, the default, or
    # bound-stretch 2) without the direction check, so the size bound alone meets it
    config = fedavg_config(
        run_config,
        tmp_path,
        "inflate-boost",
        **{"local-epochs": 2, "server-trust": False, "bound-stretch": cap},
    )

    # Execute
    server, grid, hostile, _ = run_federation(config, digits_bundle)

    # Assert: it claims 1000x its size and sends 10x its update ...
    (attacker,) = hostile
    profiles = handshake_sizes(grid)
    updates, replies = round_updates(grid, 1, hostile)
    claimed = {
        n: float(cast(int, r.content[wire.METRICS][wire.NUM_EXAMPLES])) for n, r in replies.items()
    }
    assert profiles[attacker] > 500 * max(v for n, v in profiles.items() if n != attacker)
    # ... but weighs at most the cohort's caps, and its bound is stretched by at
    # most bound-stretch: the first round's bound of every update is
    # the lower median of distance / stretch, times its own stretch
    caps = weight_caps(profiles, 2.0, 0.2)
    typical = typical_weight(list(caps.values()))
    stretch = {n: bound_stretch(min(claimed[n], float(caps[n] or 0)), typical, cap) for n in caps}
    # the liar weighs the largest honest claim (weight-trim), so it stretches as far
    # as the largest honest node, never further
    assert caps[attacker] == max(float(v) for n, v in profiles.items() if n != attacker)
    assert stretch[attacker] == max(stretch.values())
    distances = {n: float(np.linalg.norm(u)) for n, u in updates.items()}
    scale = sorted(distances[n] / stretch[n] for n in distances)[(len(distances) - 1) // 2]
    clips = {c["node"]: c for c in server.rounds[0]["clipped"] if c["kind"] == "parameters"}
    assert clips[attacker]["bound"] == pytest.approx(stretch[attacker] * scale, rel=1e-4)
    assert clips[attacker]["distance"] == pytest.approx(distances[attacker], rel=1e-4)
    assert distances[attacker] > 4 * clips[attacker]["bound"]  # cut to under a quarter


# ------------------------------------------------------------------ handshake and refusal
def test_inflate_multiplies_the_claimed_sizes_by_hand() -> None:
    # Prepare
    from strategies.core.client import ClientAlgorithm

    run = RunConfig.from_flower(load_default_run_config())
    client = AttackClient(ClientAlgorithm(run=run, options=None), AttackSpec("inflate", inflate=3))
    profile: Mapping[str, Any] = {"num-train": 5, "label-counts": [2, 0, 3], "arch": "cnn-2"}

    # Execute
    out = client.handshake_profile(profile)

    # Assert
    assert out == {"num-train": 15, "label-counts": [6, 0, 9], "arch": "cnn-2"}
    honest = AttackClient(ClientAlgorithm(run=run, options=None), AttackSpec("boost"))
    assert honest.handshake_profile(profile) == dict(profile)
    both = AttackClient(
        ClientAlgorithm(run=run, options=None), AttackSpec("inflate-boost", inflate=3)
    )
    assert both.handshake_profile(profile)["num-train"] == 15


@pytest.mark.parametrize("attack", ["alie", "boost,min-sum", "mimic"])
def test_the_server_app_refuses_omniscient_attacks(attack: str) -> None:
    # Prepare
    config = {**load_default_run_config(), "attack": attack}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    from server_app.app import main

    # Execute / Assert: before anything is loaded or built
    with pytest.raises(ConfigError, match=r"'attack' names .*in-process harness"):
        main(cast(Any, None), context)
    with pytest.raises(ConfigError, match=r"benchmarks/robustness\.py"):
        require_client_side(RunConfig.from_flower(config))


@pytest.mark.parametrize(
    "attack", ["dense-scale", "bound-riding", "ratchet", "inflate", "inflate-boost", ""]
)
def test_client_side_attacks_are_allowed_in_real_runs(attack: str) -> None:
    require_client_side(RunConfig.from_flower({**load_default_run_config(), "attack": attack}))


def test_dense_scale_payloads_are_dense_and_seeded() -> None:
    # Prepare
    from strategies.core.client import ClientAlgorithm

    run = RunConfig.from_flower(load_default_run_config())
    client = AttackClient(ClientAlgorithm(run=run, options=None), AttackSpec("dense-scale", seed=3))
    record = ArrayRecord(
        {
            "logits": torch.ones(2, 3),
            "class-ids": torch.tensor([0, 1]),
        }
    )

    # Execute
    out = wire.record_to_numpy(client._tamper_payload(record))
    again = wire.record_to_numpy(client._tamper_payload(record))

    # Assert
    np.testing.assert_allclose(np.abs(out["logits"]), 1e30, rtol=1e-6)
    np.testing.assert_array_equal(out["logits"], again["logits"])
    np.testing.assert_array_equal(out["class-ids"], [0, 1])
