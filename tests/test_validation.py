"""Validation of client replies: every malformed reply becomes a Rejection with a reason."""

from __future__ import annotations

import math
from typing import Any
from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from strategies.core.validation import (
    ClientReply,
    Rejection,
    ReplySchema,
    check_arrays,
    validate_reply,
)
from tessera import wire
from tests.conftest import instruction

NODE = 7
ARCH = "cnn-2"
SPEC = {
    "fc.weight": ((2, 3), "float32"),
    "fc.bias": ((2,), "float32"),
    "bn.num_batches_tracked": ((), "int64"),
}
SCHEMA = ReplySchema(arrays=SPEC)


def good_arrays() -> dict[str, np.ndarray]:
    return {
        "fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "fc.bias": np.array([0.5, -0.5], dtype=np.float32),
        "bn.num_batches_tracked": np.array(12, dtype=np.int64),
    }


def good_metrics() -> dict[str, Any]:
    return {
        wire.NUM_EXAMPLES: 40,
        wire.TRAIN_LOSS: 0.75,
        wire.TEST_ACCURACY: 0.5,
        wire.TEST_LOSS: 1.25,
        wire.NUM_TEST_EXAMPLES: 10,
        wire.TRAIN_SECONDS: 0.2,
    }


def content(
    arrays: dict[str, np.ndarray] | None = None,
    metrics: dict[str, Any] | None = None,
    *,
    with_arrays: bool = True,
    with_metrics: bool = True,
) -> RecordDict:
    records = RecordDict()
    if with_arrays:
        arrays = good_arrays() if arrays is None else arrays
        records[wire.ARRAYS] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    if with_metrics:
        records[wire.METRICS] = MetricRecord(good_metrics() if metrics is None else metrics)
    return records


def reply_from(node_id: int, records: RecordDict) -> Message:
    """A real reply, built the way a ClientApp builds it (``reply_to=``)."""
    msg = instruction(
        RecordDict({wire.CONFIG: ConfigRecord({"server-round": 1})}),
        dst_node_id=node_id,
        message_type="train",
    )
    return Message(records, reply_to=msg)


def mock_reply(
    node_id: int, *, records: RecordDict | None = None, error: Error | None = None
) -> Mock:
    reply = Mock(spec=Message)
    reply.metadata.src_node_id = node_id
    reply.has_error.return_value = error is not None
    reply.has_content.return_value = records is not None
    reply.error = error
    reply.content = records
    return reply


def validate(reply: Any, schema: ReplySchema = SCHEMA) -> ClientReply | Rejection:
    return validate_reply(
        reply,
        expected_nodes={NODE: ARCH},
        schemas={NODE: schema},
        bytes_down={NODE: 1234},
    )


def assert_rejected(result: ClientReply | Rejection, *fragments: str) -> None:
    assert isinstance(result, Rejection), f"expected a rejection, got {result!r}"
    assert result.node_id == NODE
    for fragment in fragments:
        assert fragment in result.reason, f"{fragment!r} not in {result.reason!r}"


def test_valid_reply_is_accepted_and_converted() -> None:
    # Prepare
    reply = reply_from(NODE, content())

    # Execute
    result = validate(reply)

    # Assert
    assert isinstance(result, ClientReply)
    assert result.node_id == NODE
    assert result.arch == ARCH
    assert result.arrays is not None
    assert list(result.arrays) == list(SPEC)
    for key, expected in good_arrays().items():
        assert isinstance(result.arrays[key], np.ndarray)
        assert result.arrays[key].dtype == expected.dtype
        np.testing.assert_array_equal(result.arrays[key], expected)
    assert result.metrics == {k: float(v) for k, v in good_metrics().items()}
    assert all(type(v) is float for v in result.metrics.values())
    assert result.num_examples == 40
    assert isinstance(result.num_examples, int)
    assert result.bytes_up > 0
    assert result.bytes_down == 1234


def test_bytes_up_grows_with_the_payload() -> None:
    # Prepare: 6 float32 weights replaced by 600 -> at least 594 * 4 more bytes
    big = good_arrays()
    big["fc.weight"] = np.zeros((200, 3), dtype=np.float32)
    schema = ReplySchema(arrays={**SPEC, "fc.weight": ((200, 3), "float32")})

    # Execute
    small_result = validate(reply_from(NODE, content()))
    big_result = validate(reply_from(NODE, content(big)), schema)

    # Assert
    assert isinstance(small_result, ClientReply)
    assert isinstance(big_result, ClientReply)
    assert big_result.bytes_up - small_result.bytes_up >= 594 * 4


def test_nan_in_array_is_rejected() -> None:
    # Prepare
    arrays = good_arrays()
    arrays["fc.weight"][1, 2] = np.nan

    # Execute
    result = validate(reply_from(NODE, content(arrays)))

    # Assert
    assert_rejected(result, "'fc.weight'", "non-finite")


def test_inf_in_array_is_rejected() -> None:
    # Prepare
    arrays = good_arrays()
    arrays["fc.bias"][0] = -np.inf

    # Execute
    result = validate(reply_from(NODE, content(arrays)))

    # Assert
    assert_rejected(result, "'fc.bias'", "non-finite")


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_metric_is_rejected(bad: float) -> None:
    # Prepare
    metrics = good_metrics()
    metrics[wire.TRAIN_LOSS] = bad

    # Execute
    result = validate(reply_from(NODE, content(metrics=metrics)))

    # Assert
    assert_rejected(result, f"metric '{wire.TRAIN_LOSS}'", "not finite")


def test_non_finite_optional_metric_is_rejected() -> None:
    # Prepare: a metric the schema does not require is still checked
    metrics = {**good_metrics(), "extra-score": math.inf}

    # Execute
    result = validate(reply_from(NODE, content(metrics=metrics)))

    # Assert
    assert_rejected(result, "metric 'extra-score'", "not finite")


def test_wrong_shape_is_rejected_naming_both_shapes() -> None:
    # Prepare
    arrays = good_arrays()
    arrays["fc.weight"] = np.zeros((3, 2), dtype=np.float32)

    # Execute
    result = validate(reply_from(NODE, content(arrays)))

    # Assert
    assert_rejected(result, "'fc.weight'", "(3, 2)", "expected (2, 3)")


def test_wrong_dtype_is_rejected_naming_both_dtypes() -> None:
    # Prepare
    arrays = good_arrays()
    arrays["fc.bias"] = np.array([0.5, -0.5], dtype=np.float64)

    # Execute
    result = validate(reply_from(NODE, content(arrays)))

    # Assert
    assert_rejected(result, "'fc.bias'", "float64", "expected float32")


def test_wrong_array_names_are_rejected() -> None:
    # Prepare
    arrays = good_arrays()
    arrays["fc.bogus"] = arrays.pop("fc.bias")

    # Execute
    result = validate(reply_from(NODE, content(arrays)))

    # Assert
    assert_rejected(result, "array names differ", "missing ['fc.bias']", "unexpected ['fc.bogus']")


def test_missing_arrays_record_is_rejected() -> None:
    # Prepare
    reply = reply_from(NODE, content(with_arrays=False))

    # Execute
    result = validate(reply)

    # Assert
    assert_rejected(result, "record 'arrays' missing")


def test_arrays_not_required_when_schema_has_none() -> None:
    # Prepare
    reply = reply_from(NODE, content(with_arrays=False))

    # Execute
    result = validate(reply, ReplySchema(arrays=None))

    # Assert
    assert isinstance(result, ClientReply)
    assert result.arrays is None


def test_missing_metrics_record_is_rejected() -> None:
    # Prepare
    reply = reply_from(NODE, content(with_metrics=False))

    # Execute
    result = validate(reply)

    # Assert
    assert_rejected(result, "record 'metrics' missing")


@pytest.mark.parametrize("key", list(wire.REQUIRED_TRAIN_METRICS))
def test_missing_metric_key_is_rejected(key: str) -> None:
    # Prepare
    metrics = good_metrics()
    del metrics[key]

    # Execute
    result = validate(reply_from(NODE, content(metrics=metrics)))

    # Assert
    assert_rejected(result, f"metric '{key}' missing")


@pytest.mark.parametrize(
    ("num", "shown"), [(0, "0.0"), (-3, "-3.0"), (2.5, "2.5")], ids=["zero", "negative", "fraction"]
)
def test_bad_num_examples_is_rejected(num: float, shown: str) -> None:
    # Prepare
    metrics = good_metrics()
    metrics[wire.NUM_EXAMPLES] = num

    # Execute
    result = validate(reply_from(NODE, content(metrics=metrics)))

    # Assert
    assert_rejected(result, f"'{wire.NUM_EXAMPLES}' must be a positive integer", shown)


def test_num_examples_as_whole_float_is_accepted() -> None:
    # Prepare
    metrics = good_metrics()
    metrics[wire.NUM_EXAMPLES] = 40.0

    # Execute
    result = validate(reply_from(NODE, content(metrics=metrics)))

    # Assert
    assert isinstance(result, ClientReply)
    assert result.num_examples == 40


@pytest.mark.parametrize("key", [wire.NUM_EXAMPLES, wire.TRAIN_LOSS])
def test_required_metric_sent_as_list_is_rejected(key: str) -> None:
    # Prepare
    metrics = good_metrics()
    metrics[key] = [1.0, 2.0]

    # Execute
    result = validate(reply_from(NODE, content(metrics=metrics)))

    # Assert
    assert_rejected(result, f"'{key}'")


def test_reply_from_unknown_node_is_rejected() -> None:
    # Prepare
    reply = reply_from(99, content())

    # Execute
    result = validate_reply(
        reply, expected_nodes={NODE: ARCH}, schemas={NODE: SCHEMA}, bytes_down={}
    )

    # Assert
    assert isinstance(result, Rejection)
    assert result.node_id == 99
    assert "unknown node 99" in result.reason


def test_unknown_node_with_mock_reply() -> None:
    # Prepare
    reply = mock_reply(42, records=content())

    # Execute
    result = validate_reply(
        reply, expected_nodes={NODE: ARCH}, schemas={NODE: SCHEMA}, bytes_down={}
    )

    # Assert
    assert isinstance(result, Rejection)
    assert result.reason == "reply from unknown node 42"


def test_error_reply_is_rejected_with_code_and_reason() -> None:
    # Prepare
    msg = instruction(RecordDict(), dst_node_id=NODE, message_type="train")
    reply = Message(Error(code=2, reason="ClientApp raised MemoryError"), reply_to=msg)

    # Execute
    result = validate(reply)

    # Assert
    assert_rejected(result, "error 2", "ClientApp raised MemoryError")


def test_error_reply_with_mock_message() -> None:
    # Prepare
    reply = mock_reply(NODE, error=Error(code=3, reason="timeout on device"))

    # Execute
    result = validate(reply)

    # Assert
    assert_rejected(result, "node reported error 3: timeout on device")


def test_reply_without_content_is_rejected() -> None:
    # Prepare
    reply = mock_reply(NODE)

    # Execute
    result = validate(reply)

    # Assert
    assert_rejected(result, "no content")


def test_extra_scheme_check_reason_rejects() -> None:
    # Prepare
    seen: list[RecordDict] = []

    def needs_logits(records: RecordDict) -> str | None:
        seen.append(records)
        return None if "logits" in records else "record 'logits' missing"

    schema = ReplySchema(arrays=SPEC, extra=needs_logits)
    reply = reply_from(NODE, content())

    # Execute
    result = validate(reply, schema)

    # Assert
    assert_rejected(result, "record 'logits' missing")
    assert len(seen) == 1


def test_extra_scheme_check_passing_accepts() -> None:
    # Prepare
    schema = ReplySchema(arrays=SPEC, extra=lambda records: None)

    # Execute
    result = validate(reply_from(NODE, content()), schema)

    # Assert
    assert isinstance(result, ClientReply)


def test_check_arrays_returns_numpy_in_spec_order() -> None:
    # Prepare: record order differs from the spec order
    arrays = good_arrays()
    record = ArrayRecord({k: Array(arrays[k]) for k in reversed(list(arrays))})

    # Execute
    out = check_arrays(record, SPEC)

    # Assert
    assert isinstance(out, dict)
    assert list(out) == list(SPEC)
    assert out["bn.num_batches_tracked"].shape == ()
    assert int(out["bn.num_batches_tracked"]) == 12


def test_integer_arrays_are_not_checked_for_finiteness() -> None:
    # Prepare: any int64 value is a valid counter
    arrays = good_arrays()
    arrays["bn.num_batches_tracked"] = np.array(np.iinfo(np.int64).max, dtype=np.int64)

    # Execute
    result = validate(reply_from(NODE, content(arrays)))

    # Assert
    assert isinstance(result, ClientReply)
