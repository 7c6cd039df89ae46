"""Aggregation arithmetic against values computed by hand."""

from __future__ import annotations

import contextlib
import math
import tracemalloc
import warnings

import numpy as np
import pytest

from strategies.core.aggregation import AggregationError, mean_std
from strategies.core.mean import MeanAccumulator
from strategies.core.sums import add_scaled, sum_dtype


def mean_of(updates: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    """Fold ``updates`` into a mean accumulator whose reference is zeros like the first."""
    acc = MeanAccumulator({k: np.zeros_like(v) for k, v in updates[0].items()})
    for update, weight in zip(updates, weights, strict=True):
        acc.add(update, weight)
    return acc.result()


def test_mean_hand_values() -> None:
    # (1 * [1, 2] + 3 * [5, 6]) / 4 = [4, 5]
    out = mean_of([{"w": np.array([1.0, 2.0])}, {"w": np.array([5.0, 6.0])}], [1, 3])
    np.testing.assert_allclose(out["w"], [4.0, 5.0])


def test_mean_keeps_the_reference_key_order_and_float32() -> None:
    first = {"b": np.ones(2, np.float32), "a": np.zeros(3, np.float32)}
    second = {"a": np.full(3, 2.0, np.float32), "b": np.full(2, 3.0, np.float32)}
    out = mean_of([first, second], [2, 2])
    assert list(out) == ["b", "a"]
    assert all(v.dtype == np.float32 for v in out.values())
    np.testing.assert_array_equal(out["b"], np.full(2, 2.0, np.float32))


def test_mean_does_not_modify_its_inputs() -> None:
    update = {"w": np.array([1.0, 2.0], np.float32)}
    copy = update["w"].copy()
    mean_of([update, {"w": np.array([3.0, 4.0], np.float32)}], [1, 1])
    np.testing.assert_array_equal(update["w"], copy)


def test_mean_rounds_integer_entries_to_the_nearest() -> None:
    # (1 * 1 + 3 * 2) / 4 = 1.75 -> 2 (not 1), a 0-d int64 array
    out = mean_of([{"n": np.array(1, np.int64)}, {"n": np.array(2, np.int64)}], [1, 3])
    assert out["n"].shape == () and out["n"].dtype == np.int64 and int(out["n"]) == 2


def test_mean_of_one_update_is_that_update() -> None:
    value = np.array([[0.1, -2.5]], np.float32)
    np.testing.assert_array_equal(mean_of([{"w": value}], [7])["w"], value)


def test_same_size_other_shape_is_not_broadcast() -> None:
    acc = MeanAccumulator({"w": np.zeros((2, 3), np.float32)})
    with pytest.raises(AggregationError, match="shape"):
        acc.add({"w": np.zeros((3, 2), np.float32)}, 1.0)


def test_mean_std_uniform_hand_values() -> None:
    # Prepare: mean (0.5 + 1.0) / 2 = 0.75; var ((-0.25)^2 + 0.25^2) / 2 = 0.0625
    values = [0.5, 1.0]

    # Execute
    mean, std = mean_std(values)

    # Assert
    assert mean == pytest.approx(0.75)
    assert std == pytest.approx(0.25)


def test_mean_std_weighted_hand_values() -> None:
    # Prepare: weights 1 and 3 -> mean (0 + 3*1) / 4 = 0.75;
    # var (1 * 0.75^2 + 3 * 0.25^2) / 4 = (0.5625 + 0.1875) / 4 = 0.1875
    values = [0.0, 1.0]

    # Execute
    mean, std = mean_std(values, [1, 3])

    # Assert
    assert mean == pytest.approx(0.75)
    assert std == pytest.approx(math.sqrt(0.1875))


def test_mean_std_single_value_has_zero_std() -> None:
    # Execute
    mean, std = mean_std([0.4])

    # Assert
    assert mean == pytest.approx(0.4)
    assert std == 0.0


def test_mean_std_empty_is_nan() -> None:
    # Execute
    mean, std = mean_std([])

    # Assert
    assert math.isnan(mean)
    assert math.isnan(std)


@pytest.mark.parametrize(
    "weights",
    [pytest.param([1.0], id="too-few"), pytest.param([0.0, 0.0], id="zero-total")],
)
def test_mean_std_bad_weights_raise(weights: list[float]) -> None:
    # Execute / Assert
    with pytest.raises(AggregationError, match="weights"):
        mean_std([0.5, 1.0], weights)


def test_mean_std_negative_weight_raises() -> None:
    # Execute / Assert
    with pytest.raises(AggregationError, match="non-negative"):
        mean_std([0.0, 1.0], [2.0, -1.0])


# ------------------------------------------------------------ streaming, in float32
def test_every_entry_is_summed_in_float64() -> None:
    for dtype in (np.float16, np.float32, np.float64, np.int64):
        assert sum_dtype(np.dtype(dtype)) == np.float64


@pytest.mark.parametrize("clip_factor", [0.0, 3.0])
def test_the_mean_is_the_same_bit_for_bit_whatever_order_the_updates_arrive_in(
    clip_factor: float,
) -> None:
    import itertools

    # Prepare: 5 example-weighted float32 updates of 20,000 values, one of them far off
    # (clipped when bounded), and a bound known from a previous round
    rng = np.random.default_rng(0)
    ref = {"w": rng.standard_normal(20_000).astype(np.float32)}
    updates = [
        {"w": (ref["w"] + rng.standard_normal(20_000) * s).astype(np.float32)}
        for s in (0.01, 0.02, 0.015, 0.5, 0.01)
    ]
    weights = [37.0, 12.0, 90.0, 45.0, 3.0]

    def mean(order: tuple[int, ...]) -> np.ndarray:
        acc = MeanAccumulator(ref, clip_factor=clip_factor)
        for i in order:
            acc.add(updates[i], weights[i])
        return acc.result()["w"]

    # Execute: all 120 orders
    results = [mean(order) for order in itertools.permutations(range(5))]

    # Assert: float32 sums differed in the last bits between orders; float64 sums do not
    for out in results[1:]:
        np.testing.assert_array_equal(out, results[0])

    def float32_sum(order: tuple[int, ...]) -> np.ndarray:
        total = np.zeros(20_000, np.float32)
        for i in order:
            total += np.float32(weights[i]) * updates[i]["w"]
        return total

    forward, backward = float32_sum((0, 1, 2, 3, 4)), float32_sum((4, 3, 2, 1, 0))
    assert not np.array_equal(forward, backward), "float32 sums would depend on the order"


@pytest.mark.parametrize("compiled", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("streamed", [False, True], ids=["first-round", "streamed"])
def test_a_clipped_update_is_one_term_so_two_nodes_mean_is_the_same_in_either_order(
    compiled: bool, streamed: bool
) -> None:
    from strategies.core import fused
    from strategies.core.sums import clipped

    # Prepare: the README demo's two-node group, made small: equal weights, one update
    # far (clipped) that leaves half its weights as they were (dead units), one near.
    # Folded as w f far + w (1 - f) ref, the unchanged ones came back as ref only to
    # within a float64 rounding, and the exact mean (a float32 halfway value) was
    # rounded up or down by the arrival order
    rng = np.random.default_rng(3)
    ref = {"a.weight": (rng.standard_normal((512, 512)) * 0.1).astype(np.float32)}
    far = ref["a.weight"] + (rng.standard_normal((512, 512)) * 0.01).astype(np.float32)
    far[:, ::2] = ref["a.weight"][:, ::2]
    near = ref["a.weight"] + (rng.standard_normal((512, 512)) * 0.001).astype(np.float32)
    previous = {"parameters": 1.0} if streamed else None

    def mean(order: list[np.ndarray]) -> tuple[np.ndarray, float]:
        acc = MeanAccumulator(ref, clip_factor=1.0, previous=previous)
        for update in order:
            acc.add({"a.weight": update}, 193.0)
        out = acc.result()["a.weight"]
        (clip,) = acc.report().clips
        return out, clip.bound / clip.distance

    # Execute: both orders, with the compiled pass and without
    with contextlib.nullcontext() if compiled else fused.disabled():
        forward, factor = mean([far, near])
        backward, _ = mean([near, far])

    # Assert: bit for bit the same, and the exact mean of the clipped update (rounded
    # to float32 once, as sent) and the near one, rounded once
    np.testing.assert_array_equal(forward, backward)
    assert 0 < factor < 1
    cut = clipped(far, ref["a.weight"], factor)
    want = ((cut.astype(np.float64) + near.astype(np.float64)) / 2).astype(np.float32)
    np.testing.assert_array_equal(forward, want)


def test_clipped_is_the_reference_where_the_update_left_it() -> None:
    from strategies.core.sums import clipped

    # base + 0.3 (value - base): 1 + 0.3 * 2 = 1.6; unchanged elements stay exactly base
    base = np.array([1.0, 0.1, -7.25], np.float32)
    value = np.array([3.0, 0.1, -7.25], np.float32)
    out = clipped(value, base, 0.3)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.array([1.6, 0.1, -7.25], np.float32))


def test_float32_weighted_mean_by_hand() -> None:
    # Prepare: (2 * [1, 2, -4] + 6 * [3, 5, 0]) / 8 = [20, 34, -8] / 8
    ref = {"w": np.zeros(3, np.float32)}
    acc = MeanAccumulator(ref)

    # Execute
    acc.add({"w": np.array([1.0, 2.0, -4.0], np.float32)}, 2.0)
    acc.add({"w": np.array([3.0, 5.0, 0.0], np.float32)}, 6.0)
    out = acc.result()

    # Assert: exact in float32 (summed in float64, rounded once)
    assert out["w"].dtype == np.float32
    np.testing.assert_array_equal(out["w"], np.array([2.5, 4.25, -1.0], np.float32))
    assert acc.result() is out  # taken once, in place
    with pytest.raises(AggregationError, match="already taken"):
        acc.add({"w": np.zeros(3, np.float32)}, 1.0)


def test_add_scaled_works_in_place_on_views_read_only_and_reversed_arrays() -> None:
    # Prepare
    total = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
    value = np.array([10.0, 20.0], np.float32)
    value.flags.writeable = False  # decoded replies may be read-only

    # Execute: into a strided view (column 1), then a reversed (negative-stride) value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        add_scaled(total[:, 1], value, 0.5)
    add_scaled(total[0], np.array([3.0, 2.0, 1.0], np.float32)[::-1], 2.0)

    # Assert: [2, 7] added to column 1; [2, 4, 6] to row 0
    np.testing.assert_array_equal(total, [[3.0, 11.0, 9.0], [4.0, 15.0, 6.0]])


def test_partial_updates_average_over_their_coverage() -> None:
    # Prepare: global 2x2 of 9s; A covers all (weight 1), B row 0 (weight 3)
    ref = {"w": np.full((2, 2), 9.0, np.float32), "n": np.array(0, np.int64)}
    acc = MeanAccumulator(ref)

    # Execute
    acc.add({"w": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)}, 1.0)
    acc.add({"w": np.array([[5.0, 6.0]], np.float32)}, 3.0, index={"w": (slice(0, 1), slice(0, 2))})
    out = acc.result()

    # Assert: row 0 (1*[1, 2] + 3*[5, 6]) / 4 = [4, 5]; row 1 only A; "n" untouched
    np.testing.assert_array_equal(out["w"], [[4.0, 5.0], [3.0, 4.0]])
    assert out["n"] == 0 and out["n"] is not ref["n"]


def test_float32_error_of_1000_clients_is_far_below_the_update() -> None:
    """The test behind summing in float32 (weights and coverage too).

    1,000 clients send the global weights (scale 0.1) plus a shared drift and their
    own noise (scale 1e-3), with 1 to 600 examples each; every other client covers
    only the first half (partial, with coverage). The float32 mean differs from the
    float64 one by under 0.1 % of the update it makes (measured: 0.04 %) and by a
    few float32 spacings of the weights.
    """
    # Prepare
    rng = np.random.default_rng(0)
    size, clients = 10_000, 1000
    w_global = (0.1 * rng.standard_normal(size)).astype(np.float32)
    drift = 1e-3 * rng.standard_normal(size)
    examples = rng.integers(1, 601, clients).astype(np.float64) + 0.5
    acc = MeanAccumulator({"w": w_global})
    sums, cover = np.zeros(size), np.zeros(size)
    half = (slice(0, size // 2),)

    # Execute
    for c in range(clients):
        update = (w_global + drift + 1e-3 * rng.standard_normal(size)).astype(np.float32)
        if c % 2:
            acc.add({"w": update[half]}, examples[c], index={"w": half})
            sums[half] += examples[c] * update[half].astype(np.float64)
            cover[half] += examples[c]
        else:
            acc.add({"w": update}, examples[c])
            sums += examples[c] * update.astype(np.float64)
            cover += examples[c]
    exact = sums / cover
    error = np.abs(acc.result()["w"].astype(np.float64) - exact)

    # Assert
    step = np.sqrt(np.mean((exact - w_global) ** 2))
    assert error.max() < 1e-3 * step
    assert error.max() < 16 * np.spacing(np.float32(np.abs(w_global).max()))


def test_streaming_memory_is_one_model_not_one_per_client() -> None:
    """tracemalloc peak while folding 200 updates that arrive one at a time.

    Deterministic: it counts numpy's buffers, not time. The float64 sums (two models
    of float32) are allocated before; while folding only the update alive and the one
    held for its partner count (the updates are folded in pairs: bound 2.5 models;
    buffering would need 200, a float64 temporary per update 3 more), and the result
    adds the float32 model it returns (bound 3.5 in all).
    """
    # Prepare
    shapes = {"a": (100, 500), "b": (40_000,), "c": (10_000,)}
    ref = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    model = sum(v.nbytes for v in ref.values())
    rng = np.random.default_rng(1)
    acc = MeanAccumulator(ref)
    for _ in range(2):  # a pair: its fold compiled (numba) before memory is traced
        acc.add({k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}, 1.0)

    # Execute
    tracemalloc.start()
    try:
        for i in range(200):
            update = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
            acc.add(update, 1.0 + i % 7)
            del update
        folding = tracemalloc.get_traced_memory()[1]
        acc.result()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    # Assert: two updates alive while folding, no float64 temporaries; then the result
    assert folding < 2.5 * model
    assert peak < 3.5 * model


def test_a_lone_update_comes_back_bit_for_bit_whatever_its_weight() -> None:
    # in float32, -0.218791663646698 * 37 / 37 is not -0.218791663646698 (checked below);
    # summed in float64 and rounded once, the lone update comes back exactly
    value = np.array([0.1, -0.218791663646698, 3e-8], np.float32)
    assert ((value * np.float32(37)) / np.float32(37))[1] != value[1]
    out = mean_of([{"w": value}], [37.0])
    np.testing.assert_array_equal(out["w"], value)
