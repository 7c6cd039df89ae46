"""Pre-aggregation (NNM, bucketing) and centered clipping: by hand, and against ByzFL.

ByzFL (LPD-EPFL's reference implementations of the robustness literature) is the
oracle for the maths; the aggregator-level tests go through the real run-config
parsing and the Aggregator seam.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import AggregatorSettings, get_aggregator
from strategies.core.mixing import (
    Mixing,
    bucket_means,
    bucket_order,
    content_order,
    nearest_neighbour_mixing,
    pairwise_sq_distances,
)
from strategies.core.robust import centered_clipping, krum_scores, median_radius
from tessera.config import ConfigError, RunConfig

byzfl = pytest.importorskip("byzfl")

ROWS = np.array([[0.0], [1.0], [2.0], [10.0]])


# ------------------------------------------------------------------------- by hand
def test_nnm_by_hand() -> None:
    # k - f = 3 nearest of each (itself included): {0,1,2} for the first three, {10,2,1}
    out = nearest_neighbour_mixing(ROWS, 1)
    np.testing.assert_allclose(out[:, 0], [1.0, 1.0, 1.0, 13.0 / 3.0])


def test_nnm_with_f_zero_is_the_mean_for_every_row() -> None:
    out = nearest_neighbour_mixing(ROWS, 0)
    np.testing.assert_allclose(out[:, 0], [13.0 / 4.0] * 4)


@pytest.mark.parametrize("f", [-1, 4, 5])
def test_nnm_refuses_f_out_of_range(f: int) -> None:
    with pytest.raises(AggregationError, match="krum-byzantine"):
        nearest_neighbour_mixing(ROWS, f)


def test_bucket_means_by_hand() -> None:
    order = np.array([3, 0, 2, 1])
    np.testing.assert_allclose(bucket_means(ROWS, 2, order)[:, 0], [5.0, 1.5])
    # a last, smaller bucket is kept: (10 + 0 + 2) / 3 and 1
    np.testing.assert_allclose(bucket_means(ROWS, 3, order)[:, 0], [4.0, 1.0])
    np.testing.assert_allclose(bucket_means(ROWS, 1, order)[:, 0], [10.0, 0.0, 2.0, 1.0])


def test_bucket_means_refuses_bad_size_and_order() -> None:
    with pytest.raises(AggregationError, match="bucket-size"):
        bucket_means(ROWS, 0, np.arange(4))
    with pytest.raises(AggregationError, match="permutation"):
        bucket_means(ROWS, 2, np.array([0, 0, 1, 2]))


def test_centered_clipping_by_hand() -> None:
    rows = np.array([[1.0], [2.0], [100.0]])
    center = np.zeros(1)
    # tau 3, one iteration: differences 1, 2, 100 clipped to 1, 2, 3: mean 2
    np.testing.assert_allclose(centered_clipping(rows, center, 3.0, 1), [2.0])
    # second iteration from 2: -1, 0, 98 -> -1, 0, 3: 2 + 2/3
    np.testing.assert_allclose(centered_clipping(rows, center, 3.0, 2), [2.0 + 2.0 / 3.0])


def test_median_radius_by_hand() -> None:
    rows = np.array([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0], [0.0, 0.0]])
    # distances from (0, 0): 5, 1, 10, 0: lower median 1
    assert median_radius(rows, np.zeros(2)) == 1.0
    assert median_radius(rows, np.array([3.0, 4.0])) == pytest.approx(
        math.sqrt(18.0)
    )  # 0, 4.2, 5, 5


def test_centered_clipping_refuses_no_iteration_and_no_radius() -> None:
    with pytest.raises(AggregationError, match="cc-iterations"):
        centered_clipping(ROWS, np.zeros(1), 1.0, 0)
    for tau in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(AggregationError, match="cc-tau"):
            centered_clipping(ROWS, np.zeros(1), tau, 1)


def test_the_default_radius_comes_from_the_updates_before_bucketing() -> None:
    # Prepare: 7 honest updates at distance 1, 3 hostile ones at 1e6 (3 of 10: with
    # buckets of 2 most bucket means hold a hostile one, and their median is huge)
    rng = np.random.default_rng(0)
    honest = [np.array([np.cos(a), np.sin(a)]) for a in rng.uniform(0, 0.3, 7)]
    hostile = [np.array([-1e6, 0.0])] * 3
    settings = AggregatorSettings(pre_aggregation="bucketing", bucket_size=2, seed=0)

    # Execute
    out = _aggregate("centered-clip", settings, honest + hostile)

    # Assert: every clipped difference is at most the honest radius 1, so the model
    # moves by at most 1 per iteration (3), never by the hostile 1e6
    assert np.linalg.norm(out) <= 3.0 + 1e-6


def test_distances_relative_to_the_global_model_keep_their_digits() -> None:
    # weights near 1e4 that differ by 1e-3: the plain Gram form cancels their digits
    rng = np.random.default_rng(0)
    center = np.full(1000, 1e4)
    rows = center + 1e-3 * rng.standard_normal((5, 1000))
    exact = ((rows[:, None, :] - rows[None, :, :]) ** 2).sum(axis=2)
    np.testing.assert_allclose(pairwise_sq_distances(rows, center), exact, rtol=1e-9)
    assert np.abs(pairwise_sq_distances(rows) - exact).max() > 1e-6  # what it avoids


# ------------------------------------------------------------------ against ByzFL
def _stack(k: int = 9, d: int = 40, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    stack = rng.standard_normal((k, d))
    stack[-2:] += 8.0  # two far rows
    return stack


@pytest.mark.parametrize("f", [0, 1, 2, 4])
def test_nnm_matches_byzfl(f: int) -> None:
    stack = _stack()
    np.testing.assert_allclose(
        nearest_neighbour_mixing(stack, f), byzfl.NNM(f=f)(stack.copy()), rtol=1e-12
    )


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_bucketing_matches_byzfl_under_the_same_shuffle(size: int) -> None:
    stack = _stack()
    np.random.seed(5)
    order = np.random.permutation(len(stack))
    np.random.seed(5)
    expected = byzfl.Bucketing(s=size)(stack.copy())
    np.testing.assert_allclose(bucket_means(stack, size, order), expected, rtol=1e-12)


@pytest.mark.parametrize(("tau", "iterations"), [(0.5, 1), (2.0, 1), (1.0, 3), (100.0, 2)])
def test_centered_clipping_matches_byzfl(tau: float, iterations: int) -> None:
    stack = _stack()
    expected = byzfl.CenteredClipping(L=iterations, tau=tau)(stack.copy())
    out = centered_clipping(stack, np.zeros(stack.shape[1]), tau, iterations)
    np.testing.assert_allclose(out, expected, rtol=1e-12)


def test_nnm_then_trimmed_mean_matches_byzfl() -> None:
    stack = _stack(k=10)
    mixed = byzfl.NNM(f=2)(stack.copy())
    expected = byzfl.TrMean(f=2)(mixed)
    acc = get_aggregator(
        "trimmed-mean",
        AggregatorSettings(trim_fraction=0.2, krum_byzantine=2, pre_aggregation="nnm"),
    ).accumulator({"w": np.zeros(stack.shape[1])})
    for row in stack:
        acc.add({"w": row}, 1.0)
    np.testing.assert_allclose(acc.result()["w"], expected, rtol=1e-12)


def test_krum_matches_byzfl() -> None:
    stack = _stack(k=10)
    expected = byzfl.Krum(f=2)(stack.copy())
    scores = krum_scores(stack, 2, np.zeros(stack.shape[1]))
    np.testing.assert_allclose(stack[int(np.argmin(scores))], expected, rtol=1e-12)


# ------------------------------------------------------------- through the seam
def _aggregate(name: str, settings: AggregatorSettings, rows: list[np.ndarray]) -> np.ndarray:
    acc = get_aggregator(name, settings).accumulator({"w": np.zeros(rows[0].size, np.float32)})
    for row in rows:
        acc.add({"w": row.astype(np.float32)}, 1.0)
    return acc.result()["w"]


def test_bucketing_does_not_depend_on_arrival_order() -> None:
    rows = list(_stack(k=7, d=6).astype(np.float32))
    settings = AggregatorSettings(pre_aggregation="bucketing", bucket_size=2, seed=3)
    first = _aggregate("median", settings, rows)
    again = _aggregate("median", settings, rows[::-1])
    np.testing.assert_array_equal(first, again)


def test_bucketing_shuffle_depends_on_seed_and_global_model() -> None:
    stack = _stack(k=12, d=4)
    base = bucket_order(stack, 0, np.zeros(4))
    assert sorted(base.tolist()) == list(range(12))
    assert not np.array_equal(base, bucket_order(stack, 1, np.zeros(4)))
    assert not np.array_equal(base, bucket_order(stack, 0, np.ones(4)))
    np.testing.assert_array_equal(base, bucket_order(stack, 0, np.zeros(4)))


def test_content_order_is_the_same_for_any_arrival_order() -> None:
    stack = _stack(k=6, d=3)
    perm = np.array([4, 1, 5, 0, 3, 2])
    np.testing.assert_array_equal(
        stack[content_order(stack)], stack[perm][content_order(stack[perm])]
    )


def test_centered_clip_shrugs_off_absurd_updates_with_nnm() -> None:
    # Prepare: six honest updates near 1 and two of 1e30
    honest = [np.full(3, 1.0 + 0.01 * i) for i in range(6)]
    hostile = [np.full(3, 1e30), np.full(3, -1e30)]
    settings = AggregatorSettings(krum_byzantine=2, pre_aggregation="nnm")

    # Execute
    out = _aggregate("centered-clip", settings, honest + hostile)

    # Assert: within the honest range
    assert np.all((out > 0.99) & (out < 1.06))


def test_mixing_none_leaves_the_rule_alone() -> None:
    rows = [np.array([v]) for v in (0.0, 1.0, 2.0, 3.0, 1e30)]
    assert _aggregate("median", AggregatorSettings(), rows)[0] == 2.0
    assert Mixing().apply(np.stack(rows), np.zeros(1)) is not None


# ----------------------------------------------------------------------- config
def test_streaming_aggregators_refuse_pre_aggregation() -> None:
    for name in ("mean", "norm-clip"):
        with pytest.raises(ConfigError, match="streams the updates"):
            get_aggregator(name, AggregatorSettings(pre_aggregation="nnm"))


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("pre-aggregation", "nmm", "pre-aggregation"),
        ("bucket-size", 0, "bucket-size"),
        ("bucket-size", 10**9, "bucket-size"),
        ("cc-tau", -1.0, "cc-tau"),
        ("cc-iterations", 0, "cc-iterations"),
        ("cc-iterations", 10**6, "cc-iterations"),
    ],
)
def test_bad_mixing_keys_are_refused_by_name(
    run_config: Callable[..., dict[str, Any]], key: str, value: object, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_flower(run_config({key: value}))


def test_run_config_reaches_the_aggregator(run_config: Callable[..., dict[str, Any]]) -> None:
    run = RunConfig.from_flower(
        run_config(
            {
                "aggregator": "centered-clip",
                "pre-aggregation": "bucketing",
                "bucket-size": 3,
                "cc-tau": 0.5,
                "cc-iterations": 2,
                "seed": 11,
            }
        )
    )
    settings = AggregatorSettings.from_run(run)
    assert (settings.pre_aggregation, settings.bucket_size, settings.seed) == ("bucketing", 3, 11)
    agg = get_aggregator(run.aggregation.aggregator, settings)
    assert (agg.tau, agg.iterations, agg.mixing.kind) == (0.5, 2, "bucketing")  # type: ignore[attr-defined]
