"""Aggregation arithmetic against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies.aggregation import AggregationError, mean_std
from strategies.aggregators import MeanAccumulator


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
