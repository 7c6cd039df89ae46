"""The direction check under label skew (issue 23): a node holding few classes is
compared with the server's own training on those classes, not on the whole pool.

Under pathological(2) the server's update on all ten classes and an honest node's
update on its two pointed apart (cosines of -0.8 in Velo's leaderboard cell), and
the bounded ``mean`` dropped honest nodes every round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from models.spec import ModelRef
from strategies.core.context import RoundContext
from strategies.core.direction import ClassDirections, skewed_classes
from strategies.core.nodes import NodeInfo
from tests.conftest import TINY_DIGITS
from tests.test_robust_submodel_ensemble import SUBMODEL, reply

Arrays = dict[str, np.ndarray]


# ----------------------------------------------------------------------- pure pieces
def test_a_node_is_skewed_when_it_holds_at_most_half_of_the_pools_classes() -> None:
    ten = range(10)
    assert skewed_classes([0, 4, 0, 0, 0, 0, 0, 9, 0, 0], ten) == frozenset({1, 7})
    five = [3, 1, 0, 0, 1, 0, 0, 1, 1, 0]  # five of ten: half
    assert skewed_classes(five, ten) == frozenset({0, 1, 4, 7, 8})
    six = [3, 1, 0, 0, 1, 0, 0, 1, 1, 2]
    assert skewed_classes(six, ten) is None  # six of ten: the whole pool
    assert skewed_classes([1] * 10, ten) is None  # IID
    assert skewed_classes([0] * 10, ten) is None  # claims nothing
    # only the pool's classes count: a class the pool lacks gives no yardstick
    assert skewed_classes([5, 5, 0, 0], [0, 2, 3]) == frozenset({0})
    assert skewed_classes([0, 5, 0, 0], [0, 2, 3]) is None
    # the share is a parameter
    assert skewed_classes([1, 1, 1, 0], range(4), share=0.75) == frozenset({0, 1, 2})
    assert skewed_classes([1, 1, 1, 0], range(4)) is None


def test_class_directions_are_made_once_per_model_and_class_set_and_bounded() -> None:
    made: list[tuple[str, frozenset[int]]] = []

    def maker(model: str, classes: frozenset[int]) -> Callable[[], Arrays | None]:
        def make() -> Arrays | None:
            made.append((model, classes))
            return {"w": np.full(2, float(len(made)), np.float32)}

        return make

    cache = ClassDirections(limit=2)
    a, b, c = frozenset({1}), frozenset({2, 3}), frozenset({4})
    first = cache.get("m", a, maker("m", a))
    assert cache.get("m", a, maker("m", a)) is first  # cached
    assert cache.get("n", a, maker("n", a)) is not first  # another model
    assert made == [("m", a), ("n", a)]
    # past the limit: nothing more is trained, the caller uses the whole pool's
    assert cache.get("m", b, maker("m", b)) is None
    assert cache.get("m", c, maker("m", c)) is None
    assert cache.get("m", a, maker("m", a)) is first  # those made stay
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


def test_a_skewed_nodes_update_is_checked_against_training_on_its_own_classes(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    # Prepare: fedavg-groups at its defaults (bounded mean, server trust); node 1 holds
    # classes 3 and 8 only, node 2 every class. Both send the same update u, which
    # points along the server's training on classes {3, 8} and away from its
    # training on the whole pool.
    server = groups_server(run_config, digits_bundle, tmp_path)
    arch = "cnn-1"
    g = server.models.get(arch)
    skewed = tuple(5 if c in (3, 8) else 0 for c in range(10))
    server.nodes[1] = node_info(1, arch, skewed)
    server.nodes[2] = node_info(2, arch, (1,) * 10)
    assert server.reference_classes(1) == frozenset({3, 8})
    assert server.reference_classes(2) is None
    whole = server.pool_direction(arch, g)
    own = server.pool_direction(arch, g, frozenset({3, 8}))
    assert whole is not None and own is not None
    u = apart(own, whole)
    moved = {k: (v + u[k]).astype(v.dtype) if k in u else v for k, v in g.items()}
    ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))

    # Execute
    for node in (1, 2):
        server.fold(ctx, reply(node, arch, moved))
    record = server.aggregate(ctx, [])

    # Assert: the skewed node's update is folded; the same update from a node that
    # claims every class is dropped by the check against the whole pool
    dropped = [c for c in record["clipped"] if c["kind"] == "direction"]
    assert [c["node"] for c in dropped] == [2]
    assert dropped[0]["distance"] < 0


def test_training_on_every_pool_class_is_training_on_the_pool(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    server = groups_server(run_config, digits_bundle, tmp_path)
    g = server.models.get("cnn-1")
    pool_classes = frozenset(int(c) for c in np.unique(server.env.server_pool.y))
    whole = server.pool_direction("cnn-1", g)
    same = server.pool_direction("cnn-1", g, pool_classes)
    two = server.pool_direction("cnn-1", g, frozenset({3, 8}))
    assert whole is not None and same is not None and two is not None
    assert all(np.array_equal(whole[k], same[k]) for k in whole)  # bit for bit
    assert not all(np.allclose(whole[k], two[k]) for k in whole)
    # the check is off: no class set either
    server.server_trust = False
    server.nodes[1] = node_info(1, "cnn-1", tuple(5 if c in (3, 8) else 0 for c in range(10)))
    assert server.reference_classes(1) is None


@pytest.mark.parametrize("scheme", ["heterofl", "fedfa"])
def test_a_sub_model_slice_of_a_skewed_node_is_checked_on_its_classes(
    scheme: str,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    from server_app.app import build_server

    config = run_config({**SUBMODEL, "strategy": scheme, "output-dir": str(tmp_path)})
    server = build_server(config, bundle=digits_bundle).runner
    narrow = next(a for a in server.refs if a != server.full_arch)
    classes = frozenset({3, 8})
    # the full-size slice has no direction of its own on the whole pool (the
    # accumulator's is that), but one on a skewed node's classes
    assert server.slice_direction(server.full_arch) is None
    full_own = server.slice_direction(server.full_arch, classes)
    assert full_own is not None
    narrow_whole = server.slice_direction(narrow)
    narrow_own = server.slice_direction(narrow, classes)
    assert narrow_whole is not None and narrow_own is not None
    assert not all(np.allclose(narrow_whole[k], narrow_own[k]) for k in narrow_own)
    assert server.slice_direction(narrow, classes) is narrow_own  # once a round
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
