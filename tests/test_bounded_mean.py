"""The default bounded ``mean``: streaming fold, ratchet-proof scale, ceiling, weight caps.

Every expected value is computed by hand in the test. Every test runs twice: on the
compiled one-pass loop (:mod:`strategies.core.fused`, numba) and on the torch path.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pytest

import strategies.core.aggregators as aggregators
import strategies.core.fused as fused
import strategies.core.mean as mean_module
import strategies.core.measure as measure
from strategies.core.aggregation import AggregationError
from strategies.core.mean import MeanAccumulator
from strategies.core.measure import measure_and_fold, reference_norms, squared_distance
from strategies.core.scales import next_scale
from strategies.core.validation import bound_stretch, typical_weight, weight_caps


@pytest.fixture(autouse=True, params=["fused", "torch"])
def measure_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on the compiled loop, then on the torch path."""
    if request.param == "fused" and not fused.available():
        pytest.skip("numba is not installed")
    if request.param == "torch":
        monkeypatch.setattr(fused, "_compile", lambda: None)
    return str(request.param)


def blocks(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """Measure (and fold) in blocks of ``size`` elements on either path."""
    monkeypatch.setattr(measure, "CHUNK", size)
    monkeypatch.setattr(fused, "BLOCK", size)


def vec(*values: float) -> dict[str, np.ndarray]:
    return {"w": np.array(values, dtype=np.float32)}


# ---------------------------------------------------------------- next_scale
def test_next_scale_is_the_lower_median_of_what_was_accepted() -> None:
    assert next_scale([3.0, 1.0, 2.0], None, 2.0) == 2.0
    assert next_scale([3.0, 1.0, 2.0], 1.5, 2.0) == 2.0  # within [0.75, 3]


def test_next_scale_moves_by_at_most_the_growth_factor() -> None:
    # a majority sending 1e-9 would make the median 1e-9: kept at 4 / 2 = 2
    assert next_scale([1e-9, 1e-9, 1e-9, 5.0, 5.0], 4.0, 2.0) == 2.0
    # a majority at 1e6 (already clipped or not): kept at 4 x 2 = 8
    assert next_scale([1e6, 1e6, 1e6, 5.0, 5.0], 4.0, 2.0) == 8.0
    with pytest.raises(ValueError, match="growth"):
        next_scale([1.0], 1.0, 1.0)


def test_a_minority_only_picks_which_honest_distance_is_the_median() -> None:
    honest = [4.0, 5.0, 6.0]
    # two of five at 1e-9: the lower median is the honest 4; at the bound 1e3: honest 5
    assert next_scale([*honest, 1e-9, 1e-9], 5.0, 2.0) == 4.0
    assert next_scale([*honest, 1e3, 1e3], 5.0, 2.0) == 6.0


# ------------------------------------------------------------- measure_and_fold
def test_squared_distance_by_hand_and_past_float32() -> None:
    a = np.array([3.0, 4.0], np.float32)
    assert squared_distance(a, np.zeros(2, np.float32)) == pytest.approx(25.0)
    # 1e30 squared overflows float32: measured again in float64, 2 x 1e60
    huge = np.array([1e30, -1e30], np.float32)
    assert squared_distance(huge, np.zeros(2, np.float32)) == pytest.approx(2e60, rel=1e-6)


def test_measure_and_fold_folds_blocks_while_in_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: blocks of 2; differences (1, 0 | 2, 0 | 0, 0) -> running squares 1, 5, 5
    blocks(monkeypatch, 2)
    value = np.array([1.0, 0.0, 2.0, 0.0, 0.0, 0.0], np.float32)
    base = np.zeros(6, np.float32)
    total = np.zeros(6, np.float32)
    # Execute: limit 4 (distance 2): the first block fits, the second passes it
    done, square, _ = measure_and_fold(value, base, total, 3.0, 0.0, 4.0)
    # Assert: only the first block went in, at weight 3; all three were measured
    assert done == 2
    assert square == pytest.approx(5.0)
    np.testing.assert_allclose(total, [3.0, 0, 0, 0, 0, 0])


# ------------------------------------------------------------ streaming fold
@pytest.mark.parametrize("chunk", [1, 2, 1 << 20])
def test_streaming_equals_the_two_pass_definition(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: two entries of parameters and one of statistics; scale 1 per kind,
    # clip-factor 2 -> bound 2 for each kind
    blocks(monkeypatch, chunk)
    ref = {
        "a": np.array([1.0, 1.0], np.float32),
        "b": np.array([0.0], np.float32),
        "bn.running_var": np.array([1.0, 1.0], np.float32),
    }
    updates = [
        # parameters (1, 1 | 0) from ref: distance 1 -> kept; statistics 0 -> kept
        ({"a": [2.0, 1.0], "b": [0.0], "bn.running_var": [1.0, 1.0]}, 1.0),
        # parameters delta (3, 0 | 4): distance 5 -> factor 2/5; statistics delta (0, 8)
        # distance 8 -> factor 2/8
        ({"a": [4.0, 1.0], "b": [4.0], "bn.running_var": [1.0, 9.0]}, 3.0),
    ]
    acc = MeanAccumulator(
        ref, clip_factor=2.0, previous={"parameters": 1.0, "statistics": 1.0}, ceiling=0.0
    )
    # Execute
    for update, w in updates:
        acc.add({k: np.array(v, np.float32) for k, v in update.items()}, w)
    out = acc.result()
    # Assert: second update clipped to ref + 0.4 (3, 0 | 4) and ref + 0.25 (0, 8)
    want_a = (1.0 * np.array([2.0, 1.0]) + 3.0 * np.array([1.0 + 1.2, 1.0])) / 4.0
    want_b = (1.0 * 0.0 + 3.0 * 1.6) / 4.0
    want_v = (1.0 * np.array([1.0, 1.0]) + 3.0 * np.array([1.0, 3.0])) / 4.0
    np.testing.assert_allclose(out["a"], want_a, rtol=1e-6)
    np.testing.assert_allclose(out["b"], [want_b], rtol=1e-6)
    np.testing.assert_allclose(out["bn.running_var"], want_v, rtol=1e-6)
    clips = {(c.position, c.kind): (c.distance, c.bound) for c in acc.report().clips}
    assert clips == {
        (1, "parameters"): (pytest.approx(5.0), pytest.approx(2.0)),
        (1, "statistics"): (pytest.approx(8.0), pytest.approx(2.0)),
    }
    # the next scale counts the clipped update at its bound: parameters [1, 2] -> 1;
    # statistics: only the positive accepted distance 2 -> 2
    assert acc.report().medians == {"parameters": 1.0, "statistics": 2.0}


def test_a_dense_huge_update_is_clipped_and_the_result_stays_finite() -> None:
    ref = vec(0.5, -0.5, 0.25, 0.0)
    acc = MeanAccumulator(ref, clip_factor=1.0, previous={"parameters": 0.1})
    honest = vec(0.55, -0.45, 0.25, 0.0)  # distance sqrt(0.005) ~ 0.0707, kept
    acc.add(honest, 1.0)
    acc.add(vec(1e30, -1e30, 1e30, -1e30), 1.0)  # distance 2e30, clipped to 0.1
    out = acc.result()["w"]
    assert np.all(np.isfinite(out))
    clip = acc.report().clips[0]
    assert clip.distance == pytest.approx(2e30, rel=1e-6)
    assert clip.bound == pytest.approx(0.1)
    # hostile part: ref + 0.1 * (0.5, -0.5, 0.5, -0.5) (direction of +-1e30 from ref)
    hostile = np.array([0.5, -0.5, 0.25, 0.0]) + 0.1 * np.array([0.5, -0.5, 0.5, -0.5])
    np.testing.assert_allclose(out, (np.array([0.55, -0.45, 0.25, 0.0]) + hostile) / 2, atol=1e-6)


def test_ceiling_bounds_a_node_alone_in_its_first_round() -> None:
    # Prepare: global ||w|| = 5; no scale yet, one node: its own median is itself
    ref = vec(3.0, 4.0)
    acc = MeanAccumulator(ref, clip_factor=3.0, ceiling=2.0)
    # Execute: a lone update at distance 1e18
    acc.add(vec(3.0 + 6e17, 4.0 + 8e17), 1.0)
    out = acc.result()["w"]
    # Assert: clipped to 2 x 5 = 10 from the global model: (3, 4) + 10 (0.6, 0.8)
    np.testing.assert_allclose(out, [9.0, 12.0], rtol=1e-5)
    assert acc.report().medians == {"parameters": pytest.approx(10.0)}


def test_a_first_round_holds_at_most_the_buffer_and_streams_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: a buffer of 4; reference (0, 0); updates along the first axis at
    # distances 1, 2, 3, 4, then 10, each of weight 1; no scale yet (a first round)
    monkeypatch.setattr(mean_module, "FIRST_ROUND_BUFFER", 4)
    acc = MeanAccumulator(vec(0.0, 0.0), clip_factor=1.0)

    # Execute
    held = []
    for d in (1.0, 2.0, 3.0, 4.0, 10.0):
        acc.add(vec(d, 0.0), 1.0)
        held.append(len(acc._buffer))
    out = acc.result()["w"]

    # Assert: the fourth update folds the four against their lower median, 2 (so 3
    # and 4 are clipped to 2); the fifth streams against that scale, 1 x 2, and is
    # clipped to 2 too: (1 + 2 + 2 + 2 + 2) / 5 = 1.8. Holding all five would have
    # bounded them by their lower median, 3: (1 + 2 + 3 + 3 + 3) / 5 = 2.4
    assert held == [1, 2, 3, 0, 0]
    np.testing.assert_allclose(out, [1.8, 0.0], rtol=1e-6)
    clips = acc.report().clips
    assert [(c.position, c.distance, c.bound) for c in clips] == [
        (2, pytest.approx(3.0), pytest.approx(2.0)),
        (3, pytest.approx(4.0), pytest.approx(2.0)),
        (4, pytest.approx(10.0), pytest.approx(2.0)),
    ]
    # the next scale: the lower median of what was accepted (1, 2, 2, 2 and what the
    # streamed one sent, 10: a first round has no scale to grow from) = 2
    assert acc.report().medians == {"parameters": pytest.approx(2.0)}


@pytest.mark.parametrize(
    ("first", "expected_out"),
    [
        # four replies of distance 0.001 first: they bound the rest of the round by
        # their median (the six at 1 are clipped to 0.001): (10 x 0.001) / 10
        (0.001, 0.001),
        # four of distance 500 first: clipped to their own median (500), the six at 1
        # pass: (4 x 500 + 6 x 1) / 10
        (500.0, 200.6),
    ],
)
def test_a_minority_that_replies_first_cannot_set_the_next_rounds_scale(
    monkeypatch: pytest.MonkeyPatch, first: float, expected_out: float
) -> None:
    # Prepare: a buffer of 4 (FIRST_ROUND_BUFFER); no scale yet (a model's first
    # round); four hostile replies arrive first (a node that does not train replies
    # soonest), then six honest ones at distance 1
    monkeypatch.setattr(mean_module, "FIRST_ROUND_BUFFER", 4)
    acc = MeanAccumulator(vec(0.0, 0.0), clip_factor=1.0)

    # Execute
    for d in [first] * 4 + [1.0] * 6:
        acc.add(vec(d, 0.0), 1.0)
    out = acc.result()["w"]
    report = acc.report()

    # Assert: this round is bounded by the first four's median ...
    np.testing.assert_allclose(out, [expected_out, 0.0], rtol=1e-6)
    # ... but the next scale is the lower median of what the ten sent (4 x first,
    # 6 x 1: the fifth of ten sorted is 1), not within bound-growth of the first
    # four's: a minority picks only which honest distance is the median
    assert report.medians == {"parameters": pytest.approx(1.0)}


def test_a_majority_that_replies_first_sets_a_first_rounds_scale_as_in_a_held_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # six of ten replies at 0.001 first, then four at 1: the same lower median as
    # holding all ten (no previous scale; later rounds move it by bound-growth at most)
    monkeypatch.setattr(mean_module, "FIRST_ROUND_BUFFER", 4)
    acc = MeanAccumulator(vec(0.0, 0.0), clip_factor=1.0)
    for d in [0.001] * 6 + [1.0] * 4:
        acc.add(vec(d, 0.0), 1.0)
    acc.result()
    assert acc.report().medians == {"parameters": pytest.approx(0.001)}


def test_a_first_round_within_the_buffer_is_bounded_as_if_all_were_held() -> None:
    # the same five updates with the default buffer (32): their own lower median, 3
    acc = MeanAccumulator(vec(0.0, 0.0), clip_factor=1.0)
    for d in (1.0, 2.0, 3.0, 4.0, 10.0):
        acc.add(vec(d, 0.0), 1.0)
    np.testing.assert_allclose(acc.result()["w"], [2.4, 0.0], rtol=1e-6)


def test_ceiling_caps_the_streaming_bound() -> None:
    # scale 100 x clip-factor 3 = 300, but ||ref|| = 5 and ceiling 1 -> bound 5
    acc = MeanAccumulator(
        vec(3.0, 4.0), clip_factor=3.0, previous={"parameters": 100.0}, ceiling=1.0
    )
    acc.add(vec(3.0 + 30.0, 4.0 + 40.0), 1.0)
    np.testing.assert_allclose(acc.result()["w"], [6.0, 8.0], rtol=1e-6)


def test_reference_norms_per_kind() -> None:
    ref = {
        "w": np.array([3.0, 4.0], np.float32),
        "bn.running_mean": np.array([0.0], np.float32),
        "bn.running_var": np.array([2.0], np.float32),
        "bn.num_batches_tracked": np.array(7, np.int64),
    }
    assert reference_norms(ref) == {"parameters": 5.0, "statistics": 2.0}


def test_non_finite_or_zero_scales_are_not_trusted() -> None:
    # a checkpoint's NaN scale must not switch the bound off: the round is buffered
    # and clipped against its own median, as a first round
    for previous in ({"parameters": math.nan}, {"parameters": 0.0}, {"parameters": math.inf}):
        acc = MeanAccumulator(vec(0.0), clip_factor=1.0, previous=previous)
        for value in (1.0, 2.0, 100.0):
            acc.add(vec(value), 1.0)
        # lower median 2 -> bound 2: (1 + 2 + 2) / 3
        np.testing.assert_allclose(acc.result()["w"], [5.0 / 3.0], rtol=1e-6)


def test_the_bound_cannot_be_ratcheted_over_rounds() -> None:
    # Prepare: 3 honest nodes move 1.0 each round, 2 hostile ones try to shrink the
    # bound (1e-9), then 3 of 5 try to grow it (1e6)
    scale: dict[str, float] | None = {"parameters": 1.0}
    for _ in range(3):
        acc = MeanAccumulator(vec(0.0), clip_factor=1.0, previous=scale)
        for value in (1.0, 1.0, 1.0, 1e-9, 1e-9):
            acc.add(vec(value), 1.0)
        acc.result()
        scale = dict(acc.report().medians)
        # Assert: a minority does not move it at all
        assert scale == {"parameters": 1.0}
    # a majority's distances count as sent, at most 2x their bound: the median of
    # (1, 1, 2b, 2b, 2b) is 2b, kept within 2x the last scale (at clip-factor 1 and 3)
    for clip_factor in (1.0, 3.0):
        scale = {"parameters": 1.0}
        for expected in (2.0, 4.0, 8.0):
            acc = MeanAccumulator(vec(0.0), clip_factor=clip_factor, previous=scale)
            for value in (1.0, 1.0, 1e6, 1e6, 1e6):
                acc.add(vec(value), 1.0)
            acc.result()
            scale = dict(acc.report().medians)
            # a majority moves it by at most bound-growth (2) a round
            assert scale == {"parameters": expected}


# ---------------------------------------------------------------- weight caps
def test_weight_caps_are_set_by_the_cohort() -> None:
    # median num-train of (100, 120, 80, 1e9) is the lower median 100; cap 2 -> 200
    caps = weight_caps({1: 100, 2: 120, 3: 80, 4: 1_000_000_000}, 2.0)
    assert caps == {1: 100.0, 2: 120.0, 3: 80.0, 4: 200.0}
    # off: each node weighs at most its own handshake num-train
    assert weight_caps({1: 100, 2: 50}, 0.0) == {1: 100.0, 2: 50.0}
    assert weight_caps({}, 2.0) == {}


def test_weight_trim_cuts_the_largest_claims_to_the_next_one() -> None:
    from strategies.core.validation import trimmed_claims

    sizes = {1: 100, 2: 120, 3: 80, 4: 90, 5: 1_000_000_000}
    # trim 0.2 of 5: ceil(1.0) = 1 claim cut, to the 2nd largest (120); the median cap
    # (2 x 100 = 200) is looser
    assert weight_caps(sizes, 2.0, 0.2) == {1: 100.0, 2: 120.0, 3: 80.0, 4: 90.0, 5: 120.0}
    # without the median cap the cut alone holds the liar
    assert weight_caps(sizes, 0.0, 0.2)[5] == 120.0
    # two liars in ten, trim 0.2: ceil(2.0) = 2 cut to the 3rd largest, an honest 90
    ten = {i: 10 * i for i in range(1, 9)} | {9: 10**9, 10: 10**9}
    caps = weight_caps(ten, 0.0, 0.2)
    assert caps[9] == caps[10] == caps[8] == 80.0 and caps[7] == 70.0
    # ceil(0.2 x 4) = 1 of four; never all of a cohort; a node alone is never cut
    assert (trimmed_claims(4, 0.2), trimmed_claims(2, 0.49), trimmed_claims(1, 0.4)) == (1, 1, 0)
    assert weight_caps({1: 100, 2: 300}, 2.0, 0.2) == {1: 100.0, 2: 100.0}
    assert weight_caps({1: 5}, 2.0, 0.2) == {1: 5.0}
    # 0.1 x 30 is 3.0000000000000004 in floating point: still 3 cut, not 4
    assert trimmed_claims(30, 0.1) == 3


def test_knowledge_counts_are_capped_in_proportion() -> None:
    from strategies.felo.knowledge import ClassKnowledge, cap_counts

    part = ClassKnowledge(
        np.array([0, 3], np.int64),
        np.array([1000, 3000], np.int64),
        np.zeros((2, 4), np.float32),
    )
    # 4000 claimed, 40 allowed: (10, 30); a count never drops below 1
    assert cap_counts(part, 40.0).counts.tolist() == [10, 30]
    assert cap_counts(part, 2.0).counts.tolist() == [1, 1]
    assert cap_counts(part, 5000.0) is part


def test_knowledge_counts_are_cut_to_the_declared_label_counts() -> None:
    from strategies.felo.knowledge import ClassKnowledge, KnowledgeError, cap_to_declared

    logits = np.arange(12, dtype=np.float32).reshape(3, 4)
    features = np.arange(6, dtype=np.float32).reshape(3, 2)
    part = ClassKnowledge(
        np.array([0, 1, 3], np.int64), np.array([4, 9, 2], np.int64), logits, features
    )
    # declared (5, 6, 0, 0): class 0 within (4 <= 5), class 1 cut 9 -> 6, class 3
    # declared none of: dropped with its rows
    cut = cap_to_declared(part, [5, 6, 0, 0])
    assert cut.class_ids.tolist() == [0, 1] and cut.counts.tolist() == [4, 6]
    np.testing.assert_array_equal(cut.logits, logits[:2])
    assert cut.features is not None
    np.testing.assert_array_equal(cut.features, features[:2])
    # every count within: the same object; none declared: no class left
    assert cap_to_declared(part, [4, 9, 0, 2]) is part
    assert cap_to_declared(part, [0, 0, 7, 0]).num_classes_present == 0
    with pytest.raises(KnowledgeError, match="outside the 3 declared label counts"):
        cap_to_declared(part, [9, 9, 9])


def test_a_reply_of_undeclared_classes_only_is_refused_and_a_cut_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from types import SimpleNamespace

    from strategies.felo.fold import within_declared
    from strategies.felo.knowledge import ClassKnowledge, KnowledgeError

    ctx: Any = SimpleNamespace(server_round=3)
    part = ClassKnowledge(
        np.array([1, 2], np.int64), np.array([8, 3], np.int64), np.zeros((2, 3), np.float32)
    )
    assert within_declared(ctx, part, 7, None) is part  # no handshake on record
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        cut = within_declared(ctx, part, 7, [10, 5, 3])
    assert cut.counts.tolist() == [5, 3]
    assert "round 3: node 7 claims more samples than its handshake declared (1: 8 > 5" in (
        caplog.text
    )
    with pytest.raises(KnowledgeError, match=r"declared none of \(1: 8 > 0, 2: 3 > 0"):
        within_declared(ctx, part, 7, [10, 0, 0])


# ------------------------------------------------------------- direction check
@pytest.mark.parametrize("previous", [None, {"parameters": 10.0}])
def test_an_update_pointing_away_from_the_server_is_dropped_whole(
    previous: dict[str, float] | None,
) -> None:
    # Prepare: the server's own update points along (1, 0); threshold 0
    ref = vec(1.0, 1.0)
    direction = {"w": np.array([1.0, 0.0], np.float32)}
    acc = MeanAccumulator(
        ref, clip_factor=1.0, previous=previous, direction=direction, threshold=0.0
    )
    # Execute: deltas (2, 1) (cos 0.894), (1, -1) (cos 0.707), (-3, 0) (cos -1)
    acc.add(vec(3.0, 2.0), 1.0)
    acc.add(vec(2.0, 0.0), 1.0)
    acc.add(vec(-2.0, 1.0), 5.0)
    out = acc.result()["w"]
    # Assert: the third is gone (its weight 5 too); nothing is clipped: the bound is
    # 10 when streaming, and in the first round the lower median of all three sizes
    # (sqrt 2, sqrt 5, 3: the dropped one's size counts for this round's bounds),
    # sqrt 5, which the first (sqrt 5) does not exceed
    first = np.array([3.0, 2.0])
    np.testing.assert_allclose(out, (first + np.array([2.0, 0.0])) / 2.0, rtol=1e-6)
    dropped = [c for c in acc.report().clips if c.kind == aggregators.DIRECTION]
    assert [(c.position, c.distance, c.bound) for c in dropped] == [(2, pytest.approx(-1.0), 0.0)]
    # what was dropped never enters the next scale either: (sqrt 5, sqrt 2) -> sqrt 2
    assert acc.report().medians["parameters"] == pytest.approx(
        np.sqrt(2.0) if previous is None else 5.0  # growth: at least 10 / 2
    )


def test_dropping_takes_back_blocks_already_folded(monkeypatch: pytest.MonkeyPatch) -> None:
    # blocks of one element: the hostile update's first block is folded before its
    # cosine is known, and taken back out when it is
    blocks(monkeypatch, 1)
    ref = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    direction = {"a": np.array([1.0, 1.0], np.float32), "b": np.array([1.0, 1.0], np.float32)}
    acc = MeanAccumulator(ref, clip_factor=1.0, previous={"parameters": 100.0}, direction=direction)
    acc.add({"a": np.array([1.0, 1.0], np.float32), "b": np.array([1.0, 1.0], np.float32)}, 1.0)
    acc.add({"a": np.array([0.5, 0.0], np.float32), "b": np.array([-3.0, -3.0], np.float32)}, 1.0)
    out = acc.result()
    np.testing.assert_allclose(out["a"], [1.0, 1.0])
    np.testing.assert_allclose(out["b"], [1.0, 1.0])


def test_no_usable_direction_means_no_check() -> None:
    for direction in ({"w": np.zeros(2, np.float32)}, {"w": np.array([np.nan, 1.0], np.float32)}):
        acc = MeanAccumulator(
            vec(0.0, 0.0), clip_factor=1.0, previous={"parameters": 10.0}, direction=direction
        )
        acc.add(vec(-1.0, 0.0), 1.0)
        np.testing.assert_allclose(acc.result()["w"], [-1.0, 0.0])
        assert acc.report().clips == ()


def test_the_cosine_spans_every_entry_once() -> None:
    # direction (1 | 0) over two entries; update (-1 | 1): cosine -1 / sqrt(2)
    ref = {"a": np.zeros(1, np.float32), "b": np.zeros(1, np.float32)}
    direction = {"a": np.ones(1, np.float32), "b": np.zeros(1, np.float32)}
    for previous in (None, {"parameters": 10.0}):
        acc = MeanAccumulator(ref, clip_factor=1.0, previous=previous, direction=direction)
        acc.add({"a": np.array([2.0], np.float32), "b": np.array([0.0], np.float32)}, 1.0)
        acc.add({"a": np.array([-1.0], np.float32), "b": np.array([1.0], np.float32)}, 1.0)
        acc.result()
        (dropped,) = [c for c in acc.report().clips if c.kind == aggregators.DIRECTION]
        assert dropped.distance == pytest.approx(-1.0 / np.sqrt(2.0))


# ------------------------------------------------------------ the compiled pass
def test_the_compiled_pass_measures_past_float32_and_folds_a_prefix(
    measure_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if measure_path != "fused":
        pytest.skip("the compiled pass itself")
    # Prepare: blocks of 2; differences (1e30, 0 | 3, 4): float32 squares would
    # overflow, float64 holds 1e60 + 25
    monkeypatch.setattr(fused, "BLOCK", 2)
    value = np.array([1e30, 1.0, 3.0, 5.0], np.float32)
    base = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
    direction = np.array([1.0, 7.0, 2.0, 0.5], np.float32)
    total = np.zeros(4, np.float32)
    # Execute: a limit the first block passes -> nothing folded; a huge one -> all
    over = fused.measure_fold(value, base, total, 2.0, 0.0, 1.0, direction)
    under = fused.measure_fold(value, base, total, 2.0, 0.0, 1e70, direction)
    # Assert: square 1e60 + 9 + 16, dot 1e30 + 6 + 2; folded prefix 0, then 4
    want_square = float(np.float32(1e30)) ** 2 + 25.0
    want_dot = float(np.float32(1e30)) + 8.0
    assert over is not None and under is not None
    assert over[0] == 0 and under[0] == 4
    assert over[1] == pytest.approx(want_square) and over[2] == pytest.approx(want_dot)
    np.testing.assert_array_equal(total, 2.0 * value)
    # other dtypes take the generic path
    half = np.ones(4, np.float16)
    assert fused.measure_fold(half, half, None, 1.0, 0.0, None, None) is None


def test_the_compiled_pair_keeps_each_update_s_own_prefix_square_and_dot(
    measure_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if measure_path != "fused":
        pytest.skip("the compiled pass itself")
    # Prepare: blocks of 2; the first update's differences (1e30, 0 | 3, 4) overflow
    # float32 in its first block, the second's (1, 0 | 0, 2) do not
    monkeypatch.setattr(fused, "BLOCK", 2)
    base = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
    first = np.array([1e30, 1.0, 3.0, 5.0], np.float32)
    second = np.array([1.0, 1.0, 0.0, 3.0], np.float32)
    direction = np.array([1.0, 7.0, 2.0, 0.5], np.float32)
    total = np.zeros(4, np.float64)
    # Execute: limit 1 for the first (passed in its first block: nothing folded);
    # limit 2 for the second (square 1 after block 1, 5 after block 2: one block)
    result = fused.measure_fold_pair(
        first, second, base, total, (2.0, 3.0), (0.0, 0.0), (1.0, 2.0), direction
    )
    # Assert: squares and dots by hand, each update's own folded prefix
    assert result is not None
    done1, done2, square1, square2, dot1, dot2 = result
    assert (done1, done2) == (0, 2)
    assert square1 == pytest.approx(float(np.float32(1e30)) ** 2 + 25.0)
    assert dot1 == pytest.approx(float(np.float32(1e30)) + 8.0)
    assert (square2, dot2) == (pytest.approx(5.0), pytest.approx(2.0))
    np.testing.assert_array_equal(total, [3.0, 3.0, 0.0, 0.0])
    # both within: both fold every block, in one pass; a limit of None folds nothing
    total[:] = 0.0
    both = fused.measure_fold_pair(
        second, second, base, total, (1.0, 2.0), (0.0, 0.0), (1e9, None), None
    )
    assert both is not None and both[:2] == (4, 0) and both[4:] == (0.0, 0.0)
    np.testing.assert_array_equal(total, second.astype(np.float64))
    # mismatched dtypes take one update at a time
    assert (
        fused.measure_fold_pair(
            first, first.astype(np.float64), base, total, (1.0, 1.0), (0.0, 0.0), (1.0, 1.0), None
        )
        is None
    )


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
@pytest.mark.parametrize("previous", [{"parameters": 2.0, "statistics": 1.0}, None])
def test_updates_folded_in_pairs_equal_updates_folded_one_by_one(
    chunk: int,
    previous: dict[str, float] | None,
    measure_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: an odd number of updates of two kinds of entries, some within the
    # bound, some clipped mid-entry, one reversed (dropped by the direction check),
    # one dense 1e30, one with only its statistics far out, one a slice (it breaks a
    # pair and streams alone); the same round folded with pairs and with pairing off
    # (non-finite updates never get here: validation refuses them)
    blocks(monkeypatch, chunk)
    rng = np.random.default_rng(7)
    ref = {
        "a": rng.standard_normal(7).astype(np.float32),
        "b": rng.standard_normal(4).astype(np.float32),
        "bn.running_var": np.ones(3, np.float32),
    }
    direction = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in ref.items()}
    direction["bn.running_var"] = np.zeros(3, np.float32)

    def near(scale: float) -> dict[str, np.ndarray]:
        return {
            k: (v + scale * (direction[k] + rng.standard_normal(v.shape))).astype(np.float32)
            for k, v in ref.items()
        }

    updates: list[tuple[dict[str, np.ndarray], float, Any]] = [
        (near(0.3), 3.0, None),
        (near(2.0), 1.0, None),  # clipped
        ({k: (2 * ref[k] - v).astype(np.float32) for k, v in near(0.5).items()}, 2.0, None),
        ({k: np.full_like(v, 1e30) for k, v in ref.items()}, 1.0, None),
        (near(0.2), 5.0, None),
        ({"a": near(0.4)["a"][:3]}, 2.0, {"a": (slice(0, 3),)}),
        ({**near(0.1), "bn.running_var": np.full(3, 50.0, np.float32)}, 1.0, None),
        (near(0.25), 4.0, None),
        (near(1.5), 2.0, None),
    ]

    pair_calls: list[int] = []
    pair = fused.measure_fold_pair

    def counted(*args: Any) -> Any:
        pair_calls.append(1)
        return pair(*args)

    def fold(pairs: bool) -> tuple[dict[str, np.ndarray], Any]:
        monkeypatch.setattr(fused, "measure_fold_pair", counted)
        if not pairs:
            monkeypatch.setattr(MeanAccumulator, "_pairable", staticmethod(lambda _: False))
        acc = MeanAccumulator(
            ref, clip_factor=1.0, previous=previous, direction=direction, ceiling=10.0
        )
        for update, w, index in updates:
            acc.add(update, w, index=index)
        out = acc.result()
        monkeypatch.undo()
        blocks(monkeypatch, chunk)
        return out, acc.report()

    # Execute
    paired, paired_report = fold(True)
    paired_calls = len(pair_calls)
    alone, alone_report = fold(False)
    # Assert: the same means, clips, drops and next scales
    for key in ref:
        assert np.all(np.isfinite(paired[key]))
        np.testing.assert_allclose(paired[key], alone[key], rtol=1e-6, atol=1e-6)
    assert [(c.position, c.kind) for c in paired_report.clips] == [
        (c.position, c.kind) for c in alone_report.clips
    ]
    assert any(c.kind == aggregators.DIRECTION for c in paired_report.clips)
    # streaming (a previous scale) on the compiled path folds in pairs: 0-1, 2-3,
    # 6-7 (4 is streamed alone when the slice comes, 8 at the result), 3 entries
    # each; otherwise never
    assert paired_calls == (9 if previous is not None and measure_path == "fused" else 0)
    assert len(pair_calls) == paired_calls
    assert paired_report.medians == pytest.approx(dict(alone_report.medians))


def test_streaming_in_pairs_holds_two_updates_not_one_per_client() -> None:
    """tracemalloc peak while the bounded mean streams 100 updates arriving one at a time.

    The float64 sums are allocated by the first pair; then at most the held update
    and the one arriving are alive (bound 2.5 models; buffering would need 100).
    """
    import tracemalloc

    # Prepare: a bound about half the updates pass (a standard normal update is
    # about sqrt(n) from zero)
    shapes = {"a": (100, 500), "b": (40_000,)}
    ref = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    model = sum(v.nbytes for v in ref.values())
    rng = np.random.default_rng(3)
    acc = MeanAccumulator(ref, clip_factor=1.0, previous={"parameters": math.sqrt(90_000)})
    for _ in range(2):
        acc.add({k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}, 1.0)

    # Execute
    tracemalloc.start()
    try:
        for i in range(100):
            update = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
            acc.add(update, 1.0 + i % 5)
            del update
        folding = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    acc.result()

    # Assert: two updates alive at most, some clipped, none buffered
    assert folding < 2.5 * model
    assert 0 < len(acc.report().clips) < 102


# ------------------------------------------------------- slices: scales per class
def slice_update(values: list[float]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A width slice: the first len(values) of a 16-long entry."""
    return {"w": np.array(values, np.float32)}, {"w": (slice(0, len(values)),)}


def whole_update(first: float) -> dict[str, np.ndarray]:
    """A whole-model update of distance ``first`` from zero (one non-zero element)."""
    value = np.zeros(16, np.float32)
    value[0] = first
    return {"w": value}


def test_slices_are_bounded_by_their_own_class_and_a_lone_slice_by_the_others() -> None:
    # Prepare: reference 0 (16 elements); whole updates at distances 4 and 6; two
    # 4-element slices at distances 1 and 1.5; clip-factor 1, no ceiling
    acc = MeanAccumulator({"w": np.zeros(16, np.float32)}, clip_factor=1.0)
    acc.add(whole_update(4.0), 1.0)
    acc.add(whole_update(6.0), 1.0)
    for d in (1.0, 1.5):
        update, index = slice_update([d, 0.0, 0.0, 0.0])
        acc.add(update, 1.0, index=index)
    # Execute
    acc.result()
    report = acc.report()
    # Assert: whole ones against lower median(4, 6) = 4 -> 6 clipped to 4; slices
    # against lower median(1, 1.5) = 1 -> 1.5 clipped to 1 (one shared scale, the lower
    # median 1.5 of all four, would clip the whole updates to 1.5)
    assert [(c.position, c.distance, c.bound) for c in report.clips] == [
        (1, pytest.approx(6.0), pytest.approx(4.0)),
        (3, pytest.approx(1.5), pytest.approx(1.0)),
    ]
    # the next scales: whole 4 (accepted 4, 4), slices 1 (accepted 1, 1), pooled in
    # whole-model units sqrt(16 / 4) = 2 x (1, 1) and (4, 4): lower median of (2, 2, 4, 4)
    assert report.medians == {
        "parameters": pytest.approx(4.0),
        "parameters@4": pytest.approx(1.0),
        "parameters@all": pytest.approx(2.0),
    }


def test_a_slice_alone_in_its_class_never_takes_its_own_scale() -> None:
    # Prepare: whole updates at 4 and 6, one 4-element slice at distance 3
    acc = MeanAccumulator({"w": np.zeros(16, np.float32)}, clip_factor=1.0)
    acc.add(whole_update(4.0), 1.0)
    acc.add(whole_update(6.0), 1.0)
    update, index = slice_update([3.0, 0.0, 0.0, 0.0])
    acc.add(update, 1.0, index=index)
    # Execute
    acc.result()
    report = acc.report()
    # Assert: the lone slice is bounded by the others in whole-model units (lower
    # median of 4 and 6 = 4) converted to its size: 4 x sqrt(4 / 16) = 2; its class
    # gets no scale of its own
    slice_clips = [c for c in report.clips if c.position == 2]
    assert [(c.distance, c.bound) for c in slice_clips] == [
        (pytest.approx(3.0), pytest.approx(2.0))
    ]
    assert "parameters@4" not in report.medians


def test_a_later_round_bounds_each_class_by_its_scale_or_the_pooled_one() -> None:
    # Prepare: last round's scales: slices of 4 elements 1, pooled whole-model 2
    previous = {"parameters": 4.0, "parameters@4": 1.0, "parameters@all": 2.0}
    acc = MeanAccumulator({"w": np.zeros(16, np.float32)}, clip_factor=1.0, previous=previous)
    # Execute: a 4-element slice at 3 (its class: bound 1); an 8-element slice at 3 (no
    # class scale: pooled 2 x sqrt(8 / 16) = 1.414); a whole update at 5 (bound 4)
    four, at4 = slice_update([3.0, 0.0, 0.0, 0.0])
    eight, at8 = slice_update([3.0] + [0.0] * 7)
    acc.add(four, 1.0, index=at4)
    acc.add(eight, 1.0, index=at8)
    acc.add(whole_update(5.0), 1.0)
    acc.result()
    # Assert
    assert [(c.position, c.bound) for c in acc.report().clips] == [
        (0, pytest.approx(1.0)),
        (1, pytest.approx(2.0 * math.sqrt(0.5))),
        (2, pytest.approx(4.0)),
    ]


def test_a_slice_class_whose_updates_outgrow_its_bound_raises_its_scale() -> None:
    # Prepare: HeteroFL's narrow class (two 4-element slices) after its scale fell to
    # 0.48; its clients now move 1.4 and 2.4 (measured: every update 1.4-5x the
    # bound). Before, each counted at the bound, the next scale was 0.48 again, and
    # the class never learned.
    scale: dict[str, float] = {"parameters": 4.0, "parameters@4": 0.48}
    seen = []
    for _ in range(3):
        acc = MeanAccumulator({"w": np.zeros(16, np.float32)}, clip_factor=1.0, previous=scale)
        for d in (1.4, 2.4):
            update, index = slice_update([d, 0.0, 0.0, 0.0])
            acc.add(update, 1.0, index=index)
        acc.result()
        scale = dict(acc.report().medians)
        seen.append(scale["parameters@4"])
    # Assert: lower median of what they sent, each at most 2x its bound, within 2x the
    # last scale: 0.96 (both at 2 x 0.48), then 1.4 (1.4 and min(2.4, 1.92))
    assert seen == [pytest.approx(0.96), pytest.approx(1.4), pytest.approx(1.4)]


def test_the_scale_follows_honest_updates_that_grow_and_shrink() -> None:
    # Prepare / Execute: clip-factor 1, scale 1; every update 1.5 (all clipped)
    acc = MeanAccumulator(vec(0.0), clip_factor=1.0, previous={"parameters": 1.0})
    for value in (1.5, 1.6, 1.7):
        acc.add(vec(value), 1.0)
    acc.result()
    # Assert: the next scale is their lower median 1.6 (it held at 1 before)
    assert acc.report().medians == {"parameters": pytest.approx(1.6)}
    # and it falls as they shrink (0.7, 0.8, 0.9: lower median 0.8)
    acc = MeanAccumulator(vec(0.0), clip_factor=1.0, previous={"parameters": 1.6})
    for value in (0.7, 0.8, 0.9):
        acc.add(vec(value), 1.0)
    acc.result()
    assert acc.report().medians == {"parameters": pytest.approx(0.8)}


@pytest.mark.parametrize(
    "previous",
    [
        {"parameters": 100.0, "parameters@6": 100.0},  # streamed, nothing clipped
        {"parameters": 1.0, "parameters@6": 1.0},  # streamed, both clipped
        None,  # a first round: buffered
    ],
)
def test_a_strided_slice_is_folded_as_its_two_pass_definition(
    previous: dict[str, float] | None,
) -> None:
    # Prepare: HeteroFL's case: a 2 x 3 slice of a 4 x 6 entry (leading output and
    # input channels: a strided view of the sum). Streamed, such an update went into
    # a flat copy of the view and was lost, while its weight still counted: narrow
    # slices shrank every round and never learned.
    rng = np.random.default_rng(0)
    ref = {"w": rng.normal(size=(4, 6)).astype(np.float32)}
    where = (slice(0, 2), slice(0, 3))
    base = ref["w"][where].astype(np.float64)
    updates = [base + rng.normal(size=(2, 3)) * s for s in (1.0, 3.0)]
    acc = MeanAccumulator(ref, clip_factor=1.0, previous=previous)
    for update in updates:
        acc.add({"w": update.astype(np.float32)}, 1.0, index={"w": where})

    # Execute
    out = acc.result()["w"]

    # Assert: the mean of ref + f (update - ref), f = min(1, bound / distance), on the
    # slice; the rest of the entry keeps the reference
    deltas = [u.astype(np.float32).astype(np.float64) - base for u in updates]
    sizes = [float(np.linalg.norm(d)) for d in deltas]
    bound = min(sizes) if previous is None else previous["parameters@6"]
    expected = ref["w"].astype(np.float64)
    kept = [min(1.0, bound / n) * d for d, n in zip(deltas, sizes, strict=True)]
    expected[where] = base + sum(kept) / 2
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_warm_up_leaves_every_loop_compiled_for_both_dtypes(measure_path: str) -> None:
    # Prepare / Execute: the warm-up the ServerApp starts in a thread
    thread = fused.start_warm_up()
    thread.join(timeout=120)

    # Assert: on the torch path there is nothing to compile; with numba each loop
    # holds a float32 and a float64 specialisation, so no round pays a compile
    assert not thread.is_alive()
    if measure_path != "fused":
        assert fused.warm_up() is False
        return
    for loop in fused._compile():  # type: ignore[union-attr]
        first_args = {str(signature[0]) for signature in loop.signatures}
        assert {"array(float32, 1d, C)", "array(float64, 1d, C)"} <= first_args, loop


def test_the_modules_numba_and_the_server_both_import_are_imported_before_the_thread(
    measure_path: str,
) -> None:
    # Prepare: fresh interpreters (nothing imported yet). The first: what numba's
    # first compile imports, which the ServerApp's thread imports too when
    # scikit-learn loads a data set; the second: what start_warm_up has imported by
    # the time it returns (the thread may still be compiling)
    import subprocess
    import sys

    if measure_path != "fused":
        pytest.skip("the torch path compiles nothing")
    first = (
        "import sys; from strategies.core import fused; fused.warm_up(); "
        "print(sorted(m for m in fused.PRE_IMPORTS + ('scipy.linalg.cython_blas',) "
        "if m in sys.modules))"
    )
    second = (
        "import sys; from strategies.core import fused; t = fused.start_warm_up(); "
        "print(sorted(m for m in fused.PRE_IMPORTS if m in sys.modules)); t.join(120)"
    )

    # Execute
    compiled, started = (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
        ).stdout.strip()
        for code in (first, second)
    )

    # Assert: numba's compile imports scipy's BLAS bindings (the module of the
    # deadlock), and start_warm_up imports them before its thread can
    assert compiled == str(sorted((*fused.PRE_IMPORTS, "scipy.linalg.cython_blas")))
    assert started == str(sorted(fused.PRE_IMPORTS))


def test_a_lone_survivor_of_the_direction_check_is_bounded_by_the_round_s_sizes() -> None:
    # Prepare: NeFL's case: a group of three in the first round, the server's own
    # update along (1, 0); two honest updates point slightly away (dropped), the
    # third (dense-scale, +-1e30) happens to point along it
    ref = vec(0.0, 0.0)
    direction = {"w": np.array([1.0, 0.0], np.float32)}
    acc = MeanAccumulator(ref, clip_factor=1.0, direction=direction, threshold=0.0)
    acc.add(vec(-0.1, 0.5), 1.0)  # size 0.51, cos -0.196: dropped
    acc.add(vec(1e30, 1e30), 1.0)  # size 1.41e30, cos 0.707: kept
    acc.add(vec(-0.05, -0.5), 1.0)  # size 0.50, cos -0.0995: dropped

    # Execute
    out = acc.result()["w"]

    # Assert: bounded by the lower median of the three sizes (0.51), not by its own
    # size (before: the ceiling, or 1e30 without one)
    np.testing.assert_allclose(np.linalg.norm(out), np.hypot(0.1, 0.5), rtol=1e-5)
    np.testing.assert_allclose(out, np.hypot(0.1, 0.5) / np.sqrt(2.0) * np.ones(2), rtol=1e-5)


# ----------------------------------------------------------- bound stretch
def test_bound_stretch_by_hand() -> None:
    # weight over the typical weight, within [1 / cap, cap]
    assert bound_stretch(150.0, 100.0, 2.0) == pytest.approx(1.5)
    assert bound_stretch(1e9, 100.0, 2.0) == 2.0  # a claim beyond the cap buys nothing more
    assert bound_stretch(10.0, 100.0, 2.0) == 0.5
    assert bound_stretch(60.0, 100.0, 4.0) == pytest.approx(0.6)
    # off: cap 0 or 1, no typical weight, or a typical weight that is not positive
    for weight, typical, cap in ((150.0, 100.0, 0.0), (150.0, 100.0, 1.0), (150.0, None, 2.0)):
        assert bound_stretch(weight, typical, cap) == 1.0
    assert bound_stretch(150.0, 0.0, 2.0) == 1.0
    assert bound_stretch(150.0, math.nan, 2.0) == 1.0


def test_the_typical_weight_is_the_lower_median_of_the_caps() -> None:
    # caps of a cohort with a liar: weight_caps already holds it at 2 x 100
    caps = weight_caps({1: 100, 2: 120, 3: 80, 4: 1_000_000_000}, 2.0)
    assert typical_weight(list(caps.values())) == 100.0
    assert typical_weight([None, None]) is None
    assert typical_weight([]) is None


def test_a_stretched_update_may_move_further_and_counts_as_a_typical_one() -> None:
    # Prepare: scale 1, clip-factor 1; two updates at distance 1.5
    acc = MeanAccumulator(vec(0.0), clip_factor=1.0, previous={"parameters": 1.0})
    # Execute: one of twice the typical examples (stretch 2), one typical (stretch 1)
    acc.add(vec(1.5), 1.0, stretch=2.0)
    acc.add(vec(-1.5), 1.0, stretch=1.0)
    out = acc.result()["w"]
    report = acc.report()
    # Assert: the first is inside its bound 2 (kept), the second clipped to 1
    assert [(c.position, c.distance, c.bound) for c in report.clips] == [
        (1, pytest.approx(1.5), pytest.approx(1.0))
    ]
    np.testing.assert_allclose(out, [(1.5 - 1.0) / 2], rtol=1e-6)
    # the scale's evidence: 1.5 / 2 = 0.75 and the clipped one as sent, 1.5 (lower median 0.75)
    assert report.medians == {"parameters": pytest.approx(0.75)}


def test_a_small_node_s_bound_shrinks_with_its_stretch() -> None:
    acc = MeanAccumulator(vec(0.0), clip_factor=1.0, previous={"parameters": 1.0})
    acc.add(vec(0.8), 1.0, stretch=0.5)  # bound 0.5: clipped
    assert acc.result()["w"][0] == pytest.approx(0.5)
    assert acc.report().clips[0].bound == pytest.approx(0.5)


def test_the_ceiling_is_not_stretched() -> None:
    # scale 100 x 3 x stretch 2 = 600, but ||ref|| = 5 and ceiling 1 -> bound 5
    acc = MeanAccumulator(
        vec(3.0, 4.0), clip_factor=3.0, previous={"parameters": 100.0}, ceiling=1.0
    )
    acc.add(vec(3.0 + 30.0, 4.0 + 40.0), 1.0, stretch=2.0)
    np.testing.assert_allclose(acc.result()["w"], [6.0, 8.0], rtol=1e-6)


def test_a_first_round_takes_its_median_of_stretched_distances() -> None:
    # Prepare: no scale yet; distances 1 (stretch 0.5), 4 (stretch 2) and 3 (stretch 1)
    acc = MeanAccumulator(vec(0.0), clip_factor=1.0)
    acc.add(vec(1.0), 1.0, stretch=0.5)
    acc.add(vec(4.0), 1.0, stretch=2.0)
    acc.add(vec(3.0), 1.0, stretch=1.0)
    out = acc.result()["w"]
    report = acc.report()
    # Assert: per unit of stretch 2, 2, 3 -> lower median 2; bounds 1, 4, 2:
    # only the third is clipped (3 -> 2)
    assert [(c.position, c.bound) for c in report.clips] == [(2, pytest.approx(2.0))]
    np.testing.assert_allclose(out, [(1.0 + 4.0 + 2.0) / 3], rtol=1e-6)
    # without stretches the median is 3 and the update of 4 is clipped instead
    plain = MeanAccumulator(vec(0.0), clip_factor=1.0)
    for value in (1.0, 4.0, 3.0):
        plain.add(vec(value), 1.0)
    np.testing.assert_allclose(plain.result()["w"], [(1.0 + 3.0 + 3.0) / 3], rtol=1e-6)


@pytest.mark.parametrize("stretch", [0.0, -1.0, math.inf, math.nan])
def test_a_stretch_that_is_not_finite_and_positive_is_refused(stretch: float) -> None:
    acc = MeanAccumulator(vec(0.0), clip_factor=1.0, previous={"parameters": 1.0})
    with pytest.raises(AggregationError, match="stretch"):
        acc.add(vec(0.5), 1.0, stretch=stretch)
    assert acc.count == 0
