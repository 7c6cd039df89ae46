"""Validation of client replies, before any arithmetic touches them.

A reply is either accepted as a :class:`ClientReply` (numpy arrays, typed metrics)
or rejected with a :class:`Rejection` carrying a human-readable reason. Rejections
are logged and counted by the strategy base; they never raise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from tessera import wire
from tessera.phases import MAX_PHASE_SECONDS, PHASE_METRICS, return_seconds

ArraySpec = Mapping[str, tuple[tuple[int, ...], str]]
"""Expected ``name -> (shape, dtype name)`` of an architecture's arrays."""


@dataclass(frozen=True)
class ReplySchema:
    """What a node's reply must contain.

    Attributes
    ----------
    arrays : ArraySpec | None
        Expected arrays under the ``arrays`` record, or ``None`` when the scheme
        sends no weights back.
    metrics : tuple[str, ...]
        Metric keys the ``metrics`` record must hold.
    extra : Callable[[RecordDict], str | None] | None
        Scheme-specific check of further records; returns a reason to reject.
    """

    arrays: ArraySpec | None
    metrics: tuple[str, ...] = wire.REQUIRED_TRAIN_METRICS
    extra: Callable[[RecordDict], str | None] | None = None


@dataclass(frozen=True)
class ClientReply:
    """A validated reply."""

    node_id: int
    arch: str
    metrics: dict[str, float]
    arrays: dict[str, np.ndarray] | None
    content: RecordDict
    bytes_up: int
    bytes_down: int
    max_weight: float | None = None
    returned: float = 0.0
    """Seconds from the reply's creation at the node to its validation here (the way
    back: the SuperNode's push, the server's pull; :func:`tessera.phases.return_seconds`)."""
    typical_weight: float | None = None
    """The cohort's typical weight (:func:`typical_weight`), for :attr:`stretch`."""
    stretch_cap: float = 0.0
    """Run-config ``bound-stretch`` (:func:`bound_stretch`; ``0``: no stretch)."""

    @property
    def num_examples(self) -> int:
        """Training examples the node used this round."""
        return int(self.metrics[wire.NUM_EXAMPLES])

    @property
    def weight(self) -> float:
        """What the reply weighs in an example-weighted aggregate.

        Its claimed ``num-examples``, capped at ``max_weight`` (its own handshake
        ``num-train``, and a multiple of the cohort's median ``num-train``: see
        :class:`ReplyLimits`) when the round set one.
        """
        claimed = float(self.num_examples)
        return claimed if self.max_weight is None else min(claimed, self.max_weight)

    @property
    def stretch(self) -> float:
        """How much further than a typical node the reply may move a bounded model.

        :func:`bound_stretch` of its :attr:`weight`, the round's typical weight and
        run-config ``bound-stretch`` (``1.0`` when the round set none).
        """
        return bound_stretch(self.weight, self.typical_weight, self.stretch_cap)

    def with_record(self, name: str, record: ArrayRecord) -> ClientReply:
        """Return this reply with its content's record ``name`` replaced by ``record``."""
        content = RecordDict(dict(self.content.items()))
        content[name] = record
        return replace(self, content=content)


@dataclass(frozen=True)
class ReplyLimits:
    """What a node's reply may claim, from what it told the handshake.

    Attributes
    ----------
    max_examples : int
        Training examples it can have used: its training-set size times the local
        epochs (no node outweighs what it reported).
    max_test_examples : int
        Its test-set size.
    max_weight : float | None
        The most its reply may weigh in an example-weighted aggregate (``None``: its
        claimed ``num-examples``): its handshake ``num-train``, and at most
        ``weight-cap`` times the median ``num-train`` of the round's cohort, and at
        most the claim below the cohort's largest ``weight-trim`` share (bounds set
        by the cohort, which a minority cannot move, not by the node itself:
        :func:`weight_caps`).
    typical_weight : float | None
        The cohort's typical weight cap (:func:`typical_weight`): how far a reply
        may move a bounded model grows with its weight relative to it
        (:func:`bound_stretch`).
    stretch_cap : float
        Run-config ``bound-stretch`` (``0``: every reply the same bound).
    """

    max_examples: int
    max_test_examples: int
    max_weight: float | None = None
    typical_weight: float | None = None
    stretch_cap: float = 0.0


@dataclass(frozen=True)
class Rejection:
    """A reply (or a missing one) that was not used, and why."""

    node_id: int
    reason: str
    details: dict[str, str] = field(default_factory=dict)


def trimmed_claims(count: int, trim: float) -> int:
    """Return how many of a cohort's largest claims run-config ``weight-trim`` cuts.

    ``ceil(trim x count)``, at most ``count - 1``: the smallest claim is never cut,
    and a node alone keeps its own.

    >>> trimmed_claims(5, 0.2), trimmed_claims(10, 0.2), trimmed_claims(4, 0.2)
    (1, 2, 1)
    >>> trimmed_claims(1, 0.2), trimmed_claims(8, 0.0)
    (0, 0)
    """
    if count <= 1 or not trim > 0:
        return 0
    return min(math.ceil(trim * count - 1e-9), count - 1)


def weight_caps(
    num_train: Mapping[int, int], cap: float, trim: float = 0.0
) -> dict[int, float | None]:
    """Per node, the most its reply may weigh (see :class:`ReplyLimits`).

    Two bounds set by the cohort, not by the node: ``cap`` times the cohort's
    (lower) median claimed training-set size, and the ``k``-th largest claim, where
    ``k - 1`` = :func:`trimmed_claims` (``weight-trim``): the largest claims are cut
    to the next one down. A node that lies about its size (``inflate``) then weighs
    at most what an honest node of the cohort claims, as long as the liars are at
    most ``ceil(trim x count)``: with the median cap alone it weighed ``cap`` times
    a typical node, and its update, boosted to the size bound, took FedAvg under
    Dirichlet(0.5) label skew to 0.74x of its clean accuracy (one node in five,
    ``docs/pages/robustness.md``).

    Parameters
    ----------
    num_train : Mapping[int, int]
        The handshake ``num-train`` of each node of the round's cohort.
    cap : float
        Run-config ``weight-cap``: multiple of the cohort's (lower) median
        ``num-train`` no node may weigh more than; ``0`` leaves only each node's own
        ``num-train`` (and ``trim``) as its cap.
    trim : float
        Run-config ``weight-trim``: share of the cohort whose largest claims are cut
        to the next largest (``0``: none).

    Returns
    -------
    dict[int, float | None]
        Node id to ``min(num_train[node], cap x median, k-th largest claim)``.

    Examples
    --------
    >>> weight_caps({1: 100, 2: 120, 3: 90, 4: 110, 5: 10**9}, 2.0)[5]
    220.0
    >>> weight_caps({1: 100, 2: 120, 3: 90, 4: 110, 5: 10**9}, 2.0, 0.2)[5]
    120.0
    >>> sorted(weight_caps({1: 100, 2: 120, 3: 90, 4: 110, 5: 95}, 2.0, 0.2).values())
    [90.0, 95.0, 100.0, 110.0, 110.0]
    """
    if not num_train:
        return {}
    ordered = sorted(num_train.values())
    median = float(ordered[(len(ordered) - 1) // 2])
    bound = math.inf if cap <= 0 else cap * median
    cut = trimmed_claims(len(ordered), trim)
    if cut:
        bound = min(bound, float(ordered[len(ordered) - 1 - cut]))
    return {node: min(float(n), bound) for node, n in num_train.items()}


def bound_stretch(weight: float, typical: float | None, cap: float) -> float:
    """Return how much further than a typical node an update of ``weight`` may move the model.

    An honest node's update grows with the examples it trained on (SGD steps per
    epoch): under Dirichlet(0.5) label skew on digits, FedAvg's updates from nodes
    of 59-204 examples measured 0.19-1.57 in L2 distance, and a bound of one
    cohort median clipped every large node every round (the leaderboard's FedAvg
    lost 10 points of global accuracy to it). The bound of an update is therefore
    its scale times ``weight / typical``, kept within ``[1 / cap, cap]``; ``weight``
    is the reply's example weight (its claimed examples, already capped at
    ``weight-cap`` times the cohort's median training-set size) and ``typical``
    the cohort's median weight cap (:func:`typical_weight`), neither of which a
    minority can move past the honest nodes' range.

    ``cap`` is run-config ``bound-stretch``: ``0`` (the default) or ``1`` (or no
    ``typical``) gives every update the same bound (``1.0``). It is off by default
    because a node that lies about its size (within ``weight-cap``) then weighs
    ``cap`` times a typical node and moves the model ``cap`` times as far: one
    ``inflate-boost`` node in five took FedAvg to 0.48x of its clean accuracy
    (``docs/pages/robustness.md``).

    >>> bound_stretch(200.0, 100.0, 2.0), bound_stretch(500.0, 100.0, 2.0)
    (2.0, 2.0)
    >>> bound_stretch(25.0, 100.0, 2.0), bound_stretch(150.0, 100.0, 0.0)
    (0.5, 1.0)
    """
    if cap <= 1 or typical is None or not typical > 0 or not math.isfinite(typical):
        return 1.0
    ratio = float(weight) / float(typical)
    if not math.isfinite(ratio):
        return 1.0
    return min(max(ratio, 1.0 / cap), cap)


def typical_weight(caps: Sequence[float | None]) -> float | None:
    """Return the lower median of a cohort's weight caps (``None`` if none is set).

    Each node's cap is its handshake ``num-train`` at most ``weight-cap`` times the
    cohort's median (:func:`weight_caps`): their lower
    median is the cohort's typical training-set size, which a minority cannot move
    outside the honest nodes' range.

    >>> typical_weight([50.0, 200.0, 100.0, None]), typical_weight([None])
    (100.0, None)
    """
    values = [float(c) for c in caps if c is not None and math.isfinite(c) and c > 0]
    if not values:
        return None
    return sorted(values)[(len(values) - 1) // 2]


def short_reason(reason: str, limit: int = 300) -> str:
    """Condense a node's error text (Ray wraps it in a traceback) to its message."""
    if "Message: " in reason:
        reason = reason.rsplit("Message: ", 1)[1]
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    text = lines[-1] if lines else reason
    return text if len(text) <= limit else text[: limit - 3] + "..."


METRIC_RANGES: dict[str, tuple[float, float]] = {
    wire.TEST_ACCURACY: (0.0, 1.0),
    wire.SHARED_ACCURACY: (0.0, 1.0),
    wire.TRAIN_LOSS: (0.0, math.inf),
    wire.TEST_LOSS: (0.0, math.inf),
    wire.TRAIN_SECONDS: (0.0, math.inf),
    wire.NUM_TEST_EXAMPLES: (0.0, math.inf),
    **dict.fromkeys(PHASE_METRICS, (0.0, MAX_PHASE_SECONDS)),
}
"""Closed ranges of the common train metrics (a value outside is a bad reply)."""


def _check_metrics(
    record: MetricRecord, required: tuple[str, ...], limits: ReplyLimits | None = None
) -> str | dict[str, float]:
    metrics: dict[str, float] = {}
    for key in required:
        if key not in record:
            return f"metric '{key}' missing from the 'metrics' record"
        if isinstance(record[key], list):
            return f"metric '{key}' must be a number, got a list"
    for key, value in record.items():
        if isinstance(value, list):
            continue
        fvalue = float(value)
        if not math.isfinite(fvalue):
            return f"metric '{key}' is not finite ({value})"
        metrics[key] = fvalue
    for key, (low, high) in METRIC_RANGES.items():
        if key in metrics and not low <= metrics[key] <= high:
            return f"metric '{key}' is {metrics[key]:g}, outside [{low:g}, {high:g}]"
    tests = metrics.get(wire.NUM_TEST_EXAMPLES)
    if tests is not None and not tests.is_integer():
        return f"'{wire.NUM_TEST_EXAMPLES}' must be a whole number, got {tests}"
    if wire.NUM_EXAMPLES in required:
        num = metrics[wire.NUM_EXAMPLES]
        if num <= 0 or not float(num).is_integer():
            return f"'{wire.NUM_EXAMPLES}' must be a positive integer, got {num}"
    if limits is not None:
        claimed = metrics.get(wire.NUM_EXAMPLES)
        if claimed is not None and claimed > limits.max_examples:
            return (
                f"'{wire.NUM_EXAMPLES}' is {claimed:g} but the node reported a training set that "
                f"allows at most {limits.max_examples} (num-train x local-epochs)"
            )
        if tests is not None and tests > limits.max_test_examples:
            return (
                f"'{wire.NUM_TEST_EXAMPLES}' is {tests:g} but the node reported a test set of "
                f"{limits.max_test_examples}"
            )
    return metrics


def check_arrays(record: ArrayRecord, expected: ArraySpec) -> str | dict[str, np.ndarray]:
    """Check an :class:`ArrayRecord` against an expected spec.

    Parameters
    ----------
    record : ArrayRecord
        The received arrays.
    expected : ArraySpec
        Expected names, shapes and dtypes.

    Returns
    -------
    str | dict[str, np.ndarray]
        A reason for rejection, or the arrays as numpy.
    """
    missing = [k for k in expected if k not in record]
    unexpected = [k for k in record if k not in expected]
    if missing or unexpected:
        return f"array names differ: missing {missing[:5]}, unexpected {unexpected[:5]}"
    out: dict[str, np.ndarray] = {}
    for key, (shape, dtype) in expected.items():
        arr = record[key]
        if tuple(arr.shape) != tuple(shape):
            return f"array '{key}' has shape {tuple(arr.shape)}, expected {tuple(shape)}"
        if arr.dtype != dtype:
            return f"array '{key}' has dtype {arr.dtype}, expected {dtype}"
        try:
            value = arr.numpy()
        except Exception as err:
            return f"array '{key}' cannot be decoded: {err}"
        if tuple(value.shape) != tuple(shape) or value.dtype != np.dtype(dtype):
            return (
                f"array '{key}' declares {dtype}{tuple(shape)} but its bytes decode to "
                f"{value.dtype}{tuple(value.shape)}"
            )
        if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value)):
            return f"array '{key}' has non-finite values"
        if key.endswith("running_var") and value.size and float(value.min()) < 0:
            return (
                f"array '{key}' holds a negative variance ({float(value.min()):.4g}); "
                "batch-norm running variances are never negative"
            )
        out[key] = value
    return out


def validate_reply(
    reply: Message,
    *,
    expected_nodes: Mapping[int, str],
    schemas: Mapping[int, ReplySchema],
    bytes_down: Mapping[int, int],
    limits: Mapping[int, ReplyLimits] | None = None,
) -> ClientReply | Rejection:
    """Validate one train reply.

    Parameters
    ----------
    reply : Message
        The reply as pulled from the grid.
    expected_nodes : Mapping[int, str]
        Node id to the architecture it was asked to train this round.
    schemas : Mapping[int, ReplySchema]
        Node id to the schema its reply must satisfy.
    bytes_down : Mapping[int, int]
        Node id to the size of the payload it was sent.
    limits : Mapping[int, ReplyLimits], optional
        Node id to what its reply may claim (from its handshake).

    Returns
    -------
    ClientReply | Rejection
        The accepted reply or the reason it was rejected.
    """
    node_id = int(reply.metadata.src_node_id)
    if node_id not in expected_nodes:
        return Rejection(node_id, f"reply from unknown node {node_id}")
    if reply.has_error():
        err = reply.error
        why = short_reason(err.reason or "")
        return Rejection(node_id, f"node reported error {err.code}: {why}")
    if not reply.has_content():
        return Rejection(node_id, "reply has no content")
    content = reply.content
    schema = schemas[node_id]
    if wire.METRICS not in content.metric_records:
        return Rejection(node_id, "record 'metrics' missing")
    limit = None if limits is None else limits.get(node_id)
    metrics = _check_metrics(content.metric_records[wire.METRICS], schema.metrics, limit)
    if isinstance(metrics, str):
        return Rejection(node_id, metrics)
    arrays: dict[str, np.ndarray] | None = None
    if schema.arrays is not None:
        if wire.ARRAYS not in content.array_records:
            return Rejection(node_id, "record 'arrays' missing")
        checked = check_arrays(content.array_records[wire.ARRAYS], schema.arrays)
        if isinstance(checked, str):
            return Rejection(node_id, checked)
        arrays = checked
    if schema.extra is not None:
        problem = schema.extra(content)
        if problem is not None:
            return Rejection(node_id, problem)
    return ClientReply(
        node_id=node_id,
        arch=expected_nodes[node_id],
        metrics=metrics,
        arrays=arrays,
        content=content,
        bytes_up=wire.payload_bytes(content),
        bytes_down=bytes_down.get(node_id, 0),
        max_weight=None if limit is None else limit.max_weight,
        returned=return_seconds(_created_at(reply), time.time()),
        typical_weight=None if limit is None else limit.typical_weight,
        stretch_cap=0.0 if limit is None else limit.stretch_cap,
    )


def _created_at(reply: Message) -> float:
    """Return the reply's creation time as the node stamped it (NaN if not a number)."""
    try:
        return float(reply.metadata.created_at)
    except (TypeError, ValueError, AttributeError):
        return math.nan
