"""Robust aggregators: the maths against hand-computed values, and one boosted node."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, Message

from server_app.app import build_server
from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import AggregatorSettings, get_aggregator, list_aggregators
from strategies.core.robust import (
    NormClipAccumulator,
    clip_to_norm,
    coordinate_median,
    krum_scores,
    trimmed_mean,
)
from tessera import wire
from tests.conftest import make_grid

RunConfigFactory = Callable[..., dict[str, Any]]


def test_coordinate_median_by_hand() -> None:
    stack = np.array([[1.0, 10.0], [2.0, 20.0], [100.0, -5.0]])
    np.testing.assert_array_equal(coordinate_median(stack), [2.0, 10.0])


def test_trimmed_mean_by_hand() -> None:
    stack = np.array([[1.0], [2.0], [3.0], [100.0]])
    np.testing.assert_array_equal(trimmed_mean(stack, 1), [2.5])
    with pytest.raises(AggregationError, match="leaves nothing"):
        trimmed_mean(stack, 2)


def test_krum_scores_by_hand() -> None:
    # f = 1, k = 5: each row's 2 nearest others
    vectors = np.array([[0.0], [1.0], [2.0], [3.0], [100.0]])
    np.testing.assert_allclose(krum_scores(vectors, 1), [5.0, 2.0, 2.0, 5.0, 97**2 + 98**2])
    with pytest.raises(AggregationError, match="more than 4 updates"):
        krum_scores(vectors[:4], 1)


def test_clip_to_norm_by_hand() -> None:
    clipped, factor = clip_to_norm(np.array([3.0, 4.0]), 1.0)
    np.testing.assert_allclose(clipped, [0.6, 0.8])
    assert factor == pytest.approx(0.2)
    same, one = clip_to_norm(np.array([0.3, 0.4]), 1.0)
    np.testing.assert_array_equal(same, [0.3, 0.4])
    assert one == 1.0


def test_norm_clip_accumulator_clips_distance_from_the_global_model() -> None:
    # reference [1, 1]; updates [4, 5] (delta [3, 4], clipped to [0.6, 0.8]) and [1, 2]
    acc = NormClipAccumulator({"w": np.ones(2, np.float32)}, max_norm=1.0)
    acc.add({"w": np.array([4.0, 5.0], np.float32)}, 1.0)
    acc.add({"w": np.array([1.0, 2.0], np.float32)}, 1.0)
    np.testing.assert_allclose(acc.result()["w"], [1.3, 1.9], rtol=1e-6)
    assert acc.clipped == 1


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("median", 2.0),  # median of [0, 1, 2, 3, 1e30]
        ("trimmed-mean", 2.0),  # ceil(0.2 x 5) = 1 cut each end: mean of [1, 2, 3]
        ("krum", 1.0),  # scores [5, 2, 2, 5, huge]: the first best
        ("multi-krum", 1.5),  # the k - f = 4 best: mean of [1, 2, 0, 3]
    ],
)
def test_buffered_aggregators_shrug_off_one_absurd_update(name: str, expected: float) -> None:
    # Prepare: four honest updates 0..3 and one of 1e30 claiming a huge weight
    settings = AggregatorSettings(trim_fraction=0.2, krum_byzantine=1)
    acc = get_aggregator(name, settings).accumulator({"w": np.zeros(1, np.float32)})

    # Execute
    for value, weight in ((0.0, 1), (1.0, 1), (2.0, 1), (3.0, 1), (1e30, 10**6)):
        acc.add({"w": np.array([value], np.float32)}, float(weight))

    # Assert: example weights buy nothing; the absurd update is out
    np.testing.assert_allclose(acc.result()["w"], [expected])


def test_buffered_aggregators_need_full_updates() -> None:
    acc = get_aggregator("median").accumulator({"w": np.zeros(2, np.float32)})
    with pytest.raises(AggregationError, match="full updates"):
        acc.add({"w": np.zeros(1, np.float32)}, 1.0, index={"w": (slice(0, 1),)})


def test_every_robust_aggregator_is_registered() -> None:
    assert {"mean", "median", "trimmed-mean", "krum", "multi-krum", "norm-clip"} <= set(
        list_aggregators()
    )


def boost(factor: float) -> Callable[[Message], Message | None]:
    """A tamper hook scaling every floating array of a train reply."""

    def hook(reply: Message) -> Message | None:
        arrays = reply.content.array_records[wire.ARRAYS]
        for key in list(arrays):
            value = arrays[key].numpy()
            if np.issubdtype(value.dtype, np.floating):
                arrays[key] = Array((value * factor).astype(value.dtype))
        return reply

    return hook


@pytest.mark.parametrize("aggregator", ["median", "norm-clip"])
def test_a_boosted_node_cannot_drag_the_global_model(
    aggregator: str,
    run_config: RunConfigFactory,
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # Prepare: fedavg on one architecture, five nodes, node 104 scales its weights x1000
    config = run_config(
        {
            "strategy": "fedavg",
            "fedavg-arch": "cnn-2",
            "local-epochs": 1,
            "num-server-rounds": 1,
            "round-timeout": 5.0,
            "aggregator": aggregator,
            "clip-norm": 5.0,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    grid = make_grid(config, 5)
    grid.tamper[104] = boost(1000.0)
    server = build_server(config, bundle=digits_bundle).runner
    initial = server.initial_arrays("cnn-2")

    # Execute
    server.start(grid, num_rounds=1, timeout=5.0)

    # Assert: the global model stays near where it was (each honest update moves it
    # by a few units of L2 at most; the boosted one is x1000)
    keys = [k for k, v in initial.items() if np.issubdtype(v.dtype, np.floating)]
    moved = np.sqrt(
        sum(
            float(np.sum((server.global_arrays[k].astype(np.float64) - initial[k]) ** 2))
            for k in keys
        )
    )
    boosted = np.sqrt(sum(float(np.sum(initial[k].astype(np.float64) ** 2)) for k in keys))
    assert server.rounds[0]["num_ok"] == 5
    assert moved < 0.05 * 1000 * boosted, (moved, boosted)
    assert np.isfinite(moved) and moved < 50.0, moved
