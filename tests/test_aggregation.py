"""Aggregation arithmetic against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies.aggregation import AggregationError, mean_std, weighted_average


def test_weighted_average_hand_values() -> None:
    # Prepare: (1*[1, 2] + 3*[3, 6]) / 4 = [10, 20] / 4 = [2.5, 5.0]
    arrays = [{"w": np.array([1.0, 2.0])}, {"w": np.array([3.0, 6.0])}]

    # Execute
    out = weighted_average(arrays, [1, 3])

    # Assert
    np.testing.assert_array_equal(out["w"], np.array([2.5, 5.0]))


def test_weighted_average_keeps_key_order_of_first_contribution() -> None:
    # Prepare
    arrays = [
        {"b": np.zeros(1), "a": np.zeros(1)},
        {"b": np.ones(1), "a": np.ones(1)},
    ]

    # Execute
    out = weighted_average(arrays, [1, 1])

    # Assert
    assert list(out) == ["b", "a"]
    np.testing.assert_array_equal(out["a"], [0.5])


def test_weighted_average_preserves_float32() -> None:
    # Prepare: (2*[1, 0] + 2*[0, 1]) / 4 = [0.5, 0.5]
    arrays = [
        {"w": np.array([1.0, 0.0], dtype=np.float32)},
        {"w": np.array([0.0, 1.0], dtype=np.float32)},
    ]

    # Execute
    out = weighted_average(arrays, [2, 2])

    # Assert
    assert out["w"].dtype == np.float32
    np.testing.assert_array_equal(out["w"], np.array([0.5, 0.5], dtype=np.float32))


def test_weighted_average_does_not_modify_inputs() -> None:
    # Prepare
    first = np.array([1.0, 2.0], dtype=np.float32)
    second = np.array([3.0, 6.0], dtype=np.float32)

    # Execute
    weighted_average([{"w": first}, {"w": second}], [1, 3])

    # Assert
    np.testing.assert_array_equal(first, [1.0, 2.0])
    np.testing.assert_array_equal(second, [3.0, 6.0])


def test_weighted_average_rounds_integer_arrays_to_0d_int64_array() -> None:
    # Prepare: num_batches_tracked 3 (weight 1) and 6 (weight 3): (3 + 18) / 4 = 5.25 -> 5
    arrays = [
        {"bn.num_batches_tracked": np.array(3, dtype=np.int64)},
        {"bn.num_batches_tracked": np.array(6, dtype=np.int64)},
    ]

    # Execute
    out = weighted_average(arrays, [1, 3])

    # Assert
    value = out["bn.num_batches_tracked"]
    assert isinstance(value, np.ndarray)  # a 0-d array, not a numpy scalar
    assert value.shape == ()
    assert value.dtype == np.int64
    assert int(value) == 5


def test_weighted_average_rounds_to_nearest_not_down() -> None:
    # Prepare: (1*[1, 10] + 3*[2, 20]) / 4 = [1.75, 17.5] -> [2, 18] (17.5 is a tie: even)
    arrays = [
        {"n": np.array([1, 10], dtype=np.int32)},
        {"n": np.array([2, 20], dtype=np.int32)},
    ]

    # Execute
    out = weighted_average(arrays, [1, 3])

    # Assert
    assert out["n"].dtype == np.int32
    np.testing.assert_array_equal(out["n"], [2, 18])


def test_weighted_average_single_contribution_is_identity() -> None:
    # Prepare
    arrays = [{"w": np.array([[1.5, -2.0]], dtype=np.float32)}]

    # Execute
    out = weighted_average(arrays, [7])

    # Assert
    np.testing.assert_array_equal(out["w"], arrays[0]["w"])


def test_weighted_average_zero_weight_ignores_contribution() -> None:
    # Prepare: weight 0 for [100, 100] -> result is the other one
    arrays = [{"w": np.array([1.0, 2.0])}, {"w": np.array([100.0, 100.0])}]

    # Execute
    out = weighted_average(arrays, [5, 0])

    # Assert
    np.testing.assert_array_equal(out["w"], [1.0, 2.0])


def test_mismatched_keys_raise_naming_the_keys() -> None:
    # Prepare
    arrays = [{"conv.weight": np.zeros(2)}, {"fc.weight": np.zeros(2)}]

    # Execute / Assert
    with pytest.raises(AggregationError, match=r"contribution 1") as info:
        weighted_average(arrays, [1, 1])
    assert "conv.weight" in str(info.value)
    assert "fc.weight" in str(info.value)


def test_extra_key_in_later_contribution_raises() -> None:
    # Prepare
    arrays = [{"w": np.zeros(2)}, {"w": np.zeros(2), "extra.bias": np.zeros(1)}]

    # Execute / Assert
    with pytest.raises(AggregationError, match=r"extra\.bias"):
        weighted_average(arrays, [1, 1])


def test_empty_first_contribution_against_non_empty_raises() -> None:
    # Prepare
    arrays = [{}, {"w": np.zeros(2)}]

    # Execute / Assert
    with pytest.raises(AggregationError, match="keys"):
        weighted_average(arrays, [1, 1])


def test_mismatched_shape_raises_naming_the_key() -> None:
    # Prepare
    arrays = [{"fc.weight": np.zeros((2, 3))}, {"fc.weight": np.zeros((3, 2))}]

    # Execute / Assert
    with pytest.raises(AggregationError, match=r"'fc\.weight'.*\(3, 2\).*\(2, 3\)"):
        weighted_average(arrays, [1, 1])


def test_same_size_different_shape_is_not_broadcast() -> None:
    # Prepare: (1, 2) would broadcast against (2,) in numpy
    arrays = [{"w": np.zeros(2)}, {"w": np.zeros((1, 2))}]

    # Execute / Assert
    with pytest.raises(AggregationError, match="'w'"):
        weighted_average(arrays, [1, 1])


def test_mismatched_dtype_raises_naming_the_key() -> None:
    # Prepare
    arrays = [
        {"fc.bias": np.zeros(2, dtype=np.float32)},
        {"fc.bias": np.zeros(2, dtype=np.float64)},
    ]

    # Execute / Assert
    with pytest.raises(AggregationError, match=r"'fc\.bias'.*float64.*float32"):
        weighted_average(arrays, [1, 1])


def test_more_weights_than_contributions_raises() -> None:
    # Prepare
    arrays = [{"w": np.zeros(2)}]

    # Execute / Assert
    with pytest.raises(AggregationError, match=r"1 contributions but 2 weights"):
        weighted_average(arrays, [1, 1])


@pytest.mark.parametrize(
    "weights",
    [
        pytest.param([0, 0], id="zero-total"),
        pytest.param([1, -1], id="negative-zero-total"),
        pytest.param([2, -1], id="negative-positive-total"),
        pytest.param([math.nan, 1], id="nan"),
        pytest.param([math.inf, 1], id="inf"),
    ],
)
def test_invalid_weights_raise(weights: list[float]) -> None:
    # Prepare
    arrays = [{"w": np.zeros(2)}, {"w": np.ones(2)}]

    # Execute / Assert
    with pytest.raises(AggregationError, match="weights"):
        weighted_average(arrays, weights)


def test_nothing_to_aggregate_raises() -> None:
    # Execute / Assert
    with pytest.raises(AggregationError, match="nothing to aggregate"):
        weighted_average([], [])


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
