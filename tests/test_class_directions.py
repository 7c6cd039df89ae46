"""The direction check under label skew (issue 23): a node whose label proportions
are far from the pool's is compared with the server's own training on its mix of
the pool, not on the whole pool.

Under pathological(2) the server's update on all ten classes and an honest node's
update on its two pointed apart (cosines of -0.8 in Velo's leaderboard cell), and
under Dirichlet(0.5) the bounded ``mean`` dropped one to five of eight honest
updates a round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from models.spec import ModelRef
from strategies.core.context import RoundContext
from strategies.core.direction import (
    MIX_GATE,
    ClassDirections,
    PoolMix,
    along_mix,
    reference_mix,
    total_variation,
    update_cosine,
)
from strategies.core.nodes import NodeInfo
from tessera.data import ArrayDataset
from tests.conftest import TINY_DIGITS
from tests.test_robust_submodel_ensemble import SUBMODEL, reply

Arrays = dict[str, np.ndarray]


# ----------------------------------------------------------------------- pure pieces
def test_total_variation_by_hand() -> None:
    assert total_variation(np.array([1, 1]), np.array([3, 1])) == pytest.approx(0.25)
    assert total_variation(np.array([2, 0, 0]), np.array([0, 1, 1])) == pytest.approx(1.0)
    assert total_variation(np.array([4, 6]), np.array([2, 3])) == pytest.approx(0.0)


def test_a_node_gets_a_pool_mix_when_its_label_proportions_are_far_from_the_pools() -> None:
    pool = [5] * 10
    assert reference_mix([1] * 10, pool) is None  # IID
    assert reference_mix([12, 10, 10, 8] + [10] * 6, pool) is None  # TV 0.02: noise
    assert reference_mix([0] * 10, pool) is None  # claims nothing
    # two classes in the pool's own proportions: the pool's examples of them, as they are
    two = [0, 5, 0, 0, 0, 0, 0, 5, 0, 0]
    assert reference_mix(two, pool) == PoolMix((0, 5, 0, 0, 0, 0, 0, 5, 0, 0), resample=False)
    # two classes at 1:4 (TV 0.3 from the pool's 1:1): drawn to 1:4 from the 10 examples
    assert reference_mix([0, 2, 0, 0, 0, 0, 0, 8, 0, 0], pool) == PoolMix(
        (0, 2, 0, 0, 0, 0, 0, 8, 0, 0), resample=True
    )
    # every class, Dirichlet-like (TV 0.5 from the pool): drawn to its proportions,
    # largest remainders (7.5 and 2.5 of 10: the first gets the spare one)
    assert reference_mix([30, 10, 0, 0], [5, 5, 5, 5]) == PoolMix((8, 2, 0, 0), resample=True)
    assert reference_mix([50, 10, 20, 20], [5, 5, 5, 5]) == PoolMix((10, 2, 4, 4), resample=True)
    assert reference_mix([40, 20, 20, 20], [5, 5, 5, 5]) is None  # TV 0.15
    # only the pool's classes count: a class the pool lacks gives no yardstick
    assert reference_mix([5, 5, 0, 0], [4, 0, 4, 4]) == PoolMix((4, 0, 0, 0), resample=False)
    assert reference_mix([0, 5, 0, 0], [4, 0, 4, 4]) is None
    assert reference_mix([1, 1, 1, 9], [3, 3, 3]) is None  # class 3: not in the pool
    # the gate is a parameter
    assert reference_mix([12, 10, 10, 8], [5, 5, 5, 5], gate=0.01) == PoolMix(
        (6, 5, 5, 4), resample=True
    )
    assert MIX_GATE == 0.2


def test_a_pool_mix_selects_the_pools_examples_or_draws_them_to_its_counts() -> None:
    y = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2])
    pool = ArrayDataset(np.arange(len(y), dtype=np.float32)[:, None], y)
    kept = PoolMix((3, 0, 7), resample=False).select(pool, seed=(0, 1))
    assert kept.y.tolist() == [0, 0, 0] + [2] * 7
    assert kept.x[:, 0].tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11]
    mix = PoolMix((5, 1, 2), resample=True)
    drawn = mix.select(pool, seed=(0, 1))
    assert np.bincount(drawn.y).tolist() == [5, 1, 2]
    # class 0: all three once and two of them again; class 2: two distinct examples
    uses = np.bincount(drawn.x[:, 0].astype(np.int64), minlength=len(y))
    assert uses[:3].tolist() in ([2, 2, 1], [2, 1, 2], [1, 2, 2])
    assert uses[5:].max() == 1
    assert np.array_equal(mix.select(pool, seed=(0, 1)).x, drawn.x)  # seeded
    assert mix.classes == frozenset({0, 1, 2})
    assert mix.distance(PoolMix((5, 1, 2), resample=False)) == 0.0
    assert mix.distance(PoolMix((0, 0, 4), resample=True)) == pytest.approx(0.75)


def test_update_cosine_and_along_mix_by_hand() -> None:
    ref = {"w": np.array([1.0, 1.0, 1.0]), "bn.running_var": np.ones(1)}
    up = {"w": np.array([2.0, 1.0, 1.0]), "bn.running_var": np.array([50.0])}
    toward = {"w": np.array([1.0, 1.0, 0.0]), "bn.running_var": np.ones(1)}
    # diff (1, 0, 0) against (1, 1, 0): 1 / sqrt(2); statistics are not compared
    assert update_cosine(up, ref, toward) == pytest.approx(2**-0.5)
    away = {"w": -toward["w"], "bn.running_var": np.ones(1)}
    assert update_cosine(up, ref, away) == pytest.approx(-(2**-0.5))
    assert update_cosine(ref, ref, toward) is None  # no move
    # a slice: the reference's entries at the index
    big = {"w": np.array([[1.0, 1.0, 1.0], [5.0, 5.0, 5.0]])}
    at = {"w": (slice(0, 1), slice(0, 3))}
    assert update_cosine({"w": up["w"][None]}, big, {"w": toward["w"][None]}, at) == (
        pytest.approx(2**-0.5)
    )
    drawn, kept = PoolMix((8, 2), resample=True), PoolMix((8, 2), resample=False)
    assert along_mix(up, ref, drawn, toward, 0.0)
    assert not along_mix(up, ref, drawn, away, 0.0)
    assert along_mix(up, ref, kept, away, 0.0)  # a class-restricted mix is always used
    assert not along_mix(up, ref, drawn, toward, 0.9)  # the threshold


def test_class_directions_are_made_once_per_model_and_mix_and_bounded() -> None:
    made: list[tuple[str, PoolMix]] = []

    def maker(model: str, mix: PoolMix) -> Callable[[], Arrays | None]:
        def make() -> Arrays | None:
            made.append((model, mix))
            return {"w": np.full(2, float(len(made)), np.float32)}

        return make

    cache = ClassDirections(limit=2)
    a = PoolMix((5, 5, 0), resample=False)
    b = PoolMix((1, 9, 0), resample=True)
    c = PoolMix((9, 1, 0), resample=True)
    first = cache.get("m", a, maker("m", a))
    assert cache.get("m", a, maker("m", a)) is first  # cached
    assert cache.get("n", b, maker("n", b)) is not first  # another model
    assert made == [("m", a), ("n", b)]
    # past the limit nothing more is trained: the nearest made mix of the same model
    assert cache.get("m", b, maker("m", b)) is first
    assert cache.get("m", c, maker("m", c)) is first
    assert cache.get("n", c, maker("n", c)) is cache.made[("n", b)]
    assert cache.get("o", a, maker("o", a)) is None  # none made of that model
    assert len(made) == 2


# ------------------------------------------------------------- through the servers
def node_info(node: int, arch: str, label_counts: tuple[int, ...]) -> NodeInfo:
    return NodeInfo(
        node_id=node,
        ref=ModelRef.parse(arch),
        family="cnn",
        size_rank=0,
        arch_fits=True,
        num_train=sum(label_counts),
        num_test=2,
        partition_id=node,
        label_counts=label_counts,
        profile={"name": "cpu-small"},
    )


def groups_server(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path
) -> Any:
    """A ``fedavg-groups`` server at its defaults (bounded mean, server trust)."""
    from server_app.app import build_server

    config = run_config({**TINY_DIGITS, "strategy": "fedavg-groups", "output-dir": str(tmp_path)})
    return build_server(config, bundle=digits_bundle).runner


def skewed_directions(
    server: Any, counts: tuple[int, ...], nodes: tuple[int, ...]
) -> tuple[Arrays, Any, Arrays, Arrays]:
    """Give ``nodes`` the label ``counts``; return cnn-1's weights, node 1's mix and the
    server's update on the whole pool and on that mix."""
    arch = "cnn-1"
    g = server.models.get(arch)
    for node in nodes:
        server.nodes[node] = node_info(node, arch, counts)
    mix = server.reference_mix(nodes[0])
    assert mix is not None
    whole = server.pool_direction(arch, g)
    own = server.pool_direction(arch, g, mix)
    assert whole is not None and own is not None
    return g, mix, whole, own


def dot(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    return sum(float(np.dot(a[k].ravel().astype(np.float64), b[k].ravel())) for k in a)


def apart(own: Arrays, whole: Arrays) -> Arrays:
    """An update with a positive cosine with ``own`` and a negative one with ``whole``.

    ``own - beta * whole``: with ``p = <own, whole>``, the cosine with ``whole`` is
    negative for ``beta > p / |whole|^2`` and the one with ``own`` positive for
    ``beta < |own|^2 / p`` (``p > 0``; any ``beta`` when ``p <= 0``); Cauchy-Schwarz
    puts the first below the second, and the midpoint is taken.
    """
    p, ww, oo = dot(own, whole), dot(whole, whole), dot(own, own)
    beta = (p / ww + oo / p) / 2 if p > 0 else float(np.sqrt(oo / ww))
    out = {k: (own[k] - beta * whole[k]).astype(own[k].dtype) for k in own}
    assert dot(out, whole) < 0 < dot(out, own)
    return out


@pytest.mark.parametrize(
    "counts",
    [
        tuple(5 if c in (3, 8) else 0 for c in range(10)),  # pathological: two classes
        (60, 2, 3, 1, 4, 2, 30, 2, 1, 5),  # Dirichlet-like: every class, far from even
    ],
    ids=["two-classes", "proportions"],
)
def test_a_skewed_nodes_update_is_checked_against_training_on_its_own_mix(
    counts: tuple[int, ...],
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    # Prepare: fedavg-groups at its defaults (bounded mean, server trust); node 1
    # claims a skewed label mix, node 2 every class evenly. Both send the same update
    # u, which points along the server's training on node 1's mix of the pool and
    # away from its training on the whole pool.
    server = groups_server(run_config, digits_bundle, tmp_path)
    arch = "cnn-1"
    g, mix, whole, own = skewed_directions(server, counts, (1,))
    server.nodes[2] = node_info(2, arch, (1,) * 10)
    assert server.reference_mix(2) is None
    held = {c for c, n in enumerate(counts) if n > 0}
    assert mix.classes == held and mix.resample == (len(held) == 10)
    u = apart(own, whole)
    moved = {k: (v + u[k]).astype(v.dtype) if k in u else v for k, v in g.items()}
    ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))

    # Execute
    for node in (1, 2):
        server.fold(ctx, reply(node, arch, moved))
    record = server.aggregate(ctx, [])

    # Assert: the skewed node's update is folded; the same update from a node that
    # claims every class evenly is dropped by the check against the whole pool
    dropped = [c for c in record["clipped"] if c["kind"] == "direction"]
    assert [c["node"] for c in dropped] == [2]
    assert dropped[0]["distance"] < 0


def test_a_drawn_mix_node_passes_along_the_whole_pool_too(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    # Prepare: nodes 1 and 2 claim the same drawn mix (every class, far from evenly).
    # Node 1's update points along the server's training on the whole pool and away
    # from its training on the mix; node 2's points away from both.
    server = groups_server(run_config, digits_bundle, tmp_path)
    arch = "cnn-1"
    g, mix, whole, own = skewed_directions(server, (60, 2, 3, 1, 4, 2, 30, 2, 1, 5), (1, 2))
    assert mix.resample
    along_whole = apart(whole, own)  # + with the whole pool's, - with the mix's
    both_away = {k: -(own[k] + whole[k]) for k in own}
    ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))

    # Execute
    for node, u in ((1, along_whole), (2, both_away)):
        moved = {k: (v + u[k]).astype(v.dtype) if k in u else v for k, v in g.items()}
        server.fold(ctx, reply(node, arch, moved))
    record = server.aggregate(ctx, [])

    # Assert: node 1 passes on the whole pool's training; node 2 is dropped
    dropped = [c for c in record["clipped"] if c["kind"] == "direction"]
    assert [c["node"] for c in dropped] == [2]


def test_training_on_every_pool_class_is_training_on_the_pool(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    server = groups_server(run_config, digits_bundle, tmp_path)
    g = server.models.get("cnn-1")
    pool_counts = tuple(int(n) for n in np.bincount(server.env.server_pool.y))
    whole = server.pool_direction("cnn-1", g)
    same = server.pool_direction("cnn-1", g, PoolMix(pool_counts, resample=False))
    two = server.pool_direction("cnn-1", g, PoolMix((0, 0, 0, 9, 0, 0, 0, 0, 9), False))
    assert whole is not None and same is not None and two is not None
    assert all(np.array_equal(whole[k], same[k]) for k in whole)  # bit for bit
    assert not all(np.allclose(whole[k], two[k]) for k in whole)
    # the check is off: no mix either
    server.server_trust = False
    server.nodes[1] = node_info(1, "cnn-1", tuple(5 if c in (3, 8) else 0 for c in range(10)))
    assert server.reference_mix(1) is None


@pytest.mark.parametrize("scheme", ["heterofl", "fedfa"])
def test_a_sub_model_slice_of_a_skewed_node_is_checked_on_its_mix(
    scheme: str,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    from server_app.app import build_server

    config = run_config({**SUBMODEL, "strategy": scheme, "output-dir": str(tmp_path)})
    server = build_server(config, bundle=digits_bundle).runner
    narrow = next(a for a in server.refs if a != server.full_arch)
    mix = PoolMix((20, 0, 0, 5, 0, 0, 0, 0, 5), resample=True)
    # the full-size slice has no direction of its own on the whole pool (the
    # accumulator's is that), but one on a skewed node's mix
    assert server.slice_direction(server.full_arch) is None
    full_own = server.slice_direction(server.full_arch, mix)
    assert full_own is not None
    narrow_whole = server.slice_direction(narrow)
    narrow_own = server.slice_direction(narrow, mix)
    assert narrow_whole is not None and narrow_own is not None
    assert not all(np.allclose(narrow_whole[k], narrow_own[k]) for k in narrow_own)
    assert server.slice_direction(narrow, mix) is narrow_own  # once a round
    assert set(narrow_own) == set(narrow_whole)  # in the form fold hands on


def test_a_nefl_slices_own_entries_are_checked_against_that_slices_training(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    from server_app.app import build_server

    # Prepare: NeFL keeps each slice's normalisation (and steps) apart, in a group of
    # its own that holds only those entries (the rest stays at the initial slice).
    # Node 1 sends a private update along the slice's own training on the pool and
    # away from a training of that mostly initial model (what the group used to be
    # compared with); node 2 sends the slice's own update reversed.
    config = run_config({**SUBMODEL, "strategy": "nefl", "output-dir": str(tmp_path)})
    server = build_server(config, bundle=digits_bundle).runner
    narrow = next(a for a in server.refs if a != server.full_arch)
    private = server.private_keys(narrow)
    # the global model has trained (at its initial weights the two trainings coincide)
    rng = np.random.default_rng(1)
    for value in server.global_state.values():
        if np.issubdtype(value.dtype, np.floating):
            value += (0.3 * value.std() * rng.standard_normal(value.shape)).astype(value.dtype)
    own = server.slice_direction(narrow)
    stale = server.pool_direction(narrow, server.models.get(narrow))
    assert own is not None and stale is not None
    assert server.group_direction(narrow, server.models.get(narrow)) is own
    full = server.group_direction(server.full_arch, server.models.get(server.full_arch))
    assert full is server.slice_direction(server.full_arch, whole=True) and full is not None
    learned = sorted(k for k in private if k in own)  # statistics are not compared
    u = apart({k: own[k] for k in learned}, {k: stale[k] for k in learned})
    start = server.sub_state(narrow)
    ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))

    # Execute
    for node, sign in ((1, 1.0), (2, -1.0)):
        arrays = {k: v.copy() for k, v in start.items()}
        for k in learned:
            step = u[k] if sign > 0 else -own[k]
            arrays[k] = (arrays[k] + step).astype(arrays[k].dtype)
        server.fold(ctx, reply(node, narrow, arrays))
    record = server.aggregate(ctx, [])

    # Assert: only the reversed update is dropped by the direction check
    dropped = [c for c in record["clipped"] if c["kind"] == "direction"]
    assert [c["node"] for c in dropped] == [2]
