"""The ``mean`` knowledge merge folded as replies arrive (:mod:`strategies.felo.fold`).

Every expected value is computed by hand or by the buffered functions the fold
replaces (:func:`~strategies.felo.knowledge.bound_knowledge` and
:func:`~strategies.felo.knowledge.merge_knowledge`), which have hand-value tests of
their own in ``tests/test_felo.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from strategies.core.scales import next_scale
from strategies.felo.fold import KNOWLEDGE_SCALES, KnowledgeFold, scales_from_state
from strategies.felo.knowledge import (
    ClassKnowledge,
    KnowledgeError,
    bound_knowledge,
    clip_knowledge,
    merge_knowledge,
)
from tessera.state_checks import StateFileError

C, D = 4, 3


def part(
    seed: int, classes: list[int], *, scale: float = 1.0, features: bool = True
) -> ClassKnowledge:
    """A reply's knowledge: random rows of ``classes``, counts 1-20."""
    rng = np.random.default_rng(seed)
    k = len(classes)
    return ClassKnowledge(
        np.array(classes, dtype=np.int64),
        rng.integers(1, 21, size=k).astype(np.int64),
        (scale * rng.normal(size=(k, C))).astype(np.float32),
        (scale * rng.normal(size=(k, D))).astype(np.float32) if features else None,
    )


def parts(n: int = 7) -> list[ClassKnowledge]:
    """``n`` replies over overlapping classes; the last one 50x larger (a hostile node)."""
    return [part(i, [i % C, (i + 1) % C], scale=50.0 if i == n - 1 else 1.0) for i in range(n)]


def assert_same(a: ClassKnowledge, b: ClassKnowledge) -> None:
    np.testing.assert_array_equal(a.class_ids, b.class_ids)
    np.testing.assert_array_equal(a.counts, b.counts)
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-6, atol=1e-7)
    if a.features is None or b.features is None:
        assert a.features is None and b.features is None
    else:
        np.testing.assert_allclose(a.features, b.features, rtol=1e-6, atol=1e-7)


def norms_of(rows: list[ClassKnowledge], kind: str) -> list[float]:
    out: list[float] = []
    for p in rows:
        values = getattr(p, kind)
        n = np.linalg.norm(values.astype(np.float64), axis=1)
        out.extend(n[n > 0].tolist())
    return out


def test_a_first_round_equals_the_buffered_merge() -> None:
    # Prepare: no previous scale, so every reply waits for the round's own median
    given = parts()
    fold = KnowledgeFold(C, clip_factor=3.0, previous=None, growth=2.0)

    # Execute
    for node, p in enumerate(given, start=10):
        fold.add(p, node)
    out = fold.result()

    # Assert: the buffered bound-then-merge, clips renamed to the tags, scale = the
    # lower median of the accepted (clipped) norms
    bounded, clips = bound_knowledge(given, 3.0)
    assert_same(out.merged, merge_knowledge(bounded, C))
    assert out.clips == [(10 + i, kind, norm, bound) for i, kind, norm, bound in clips]
    assert {node for node, *_ in out.clips} == {16}  # the 50x node alone
    assert out.buffered == len(given)
    for kind in ("logits", "features"):
        accepted = sorted(norms_of(bounded, kind))
        assert out.scales[kind] == accepted[(len(accepted) - 1) // 2]


def test_a_later_round_bounds_by_the_previous_scale_and_folds_at_once() -> None:
    # Prepare: last round's scales 0.5 (logits) and 2.0 (features), factor 3
    given = parts()
    previous = {"logits": 0.5, "features": 2.0}
    fold = KnowledgeFold(C, clip_factor=3.0, previous=previous, growth=2.0)

    # Execute
    for node, p in enumerate(given):
        fold.add(p, node)
        assert fold.sums is not None and not fold._buffer  # folded, not kept
    out = fold.result()

    # Assert: every row clipped to 3 x its kind's previous scale (1.5 and 6), merged
    bounded, clips = clip_knowledge(given, {"logits": 1.5, "features": 6.0})
    assert_same(out.merged, merge_knowledge(bounded, C))
    assert out.clips == clips and out.buffered == 0
    for p in bounded:
        assert np.linalg.norm(p.logits.astype(np.float64), axis=1).max() <= 1.5 * (1 + 1e-6)
    # Assert: the next scale is the lower median of what was accepted, within 2x
    for kind in ("logits", "features"):
        expected = next_scale(norms_of(bounded, kind), previous[kind], 2.0)
        assert out.scales[kind] == pytest.approx(expected)


def test_one_row_by_hand() -> None:
    # Prepare: scale 1, factor 2: the bound is 2; a row (6, 8) of norm 10, count 3,
    # and a row (0.3, 0.4) of norm 0.5, count 1, both class 0
    fold = KnowledgeFold(2, clip_factor=2.0, previous={"logits": 1.0}, growth=2.0)
    a = ClassKnowledge(np.array([0]), np.array([3]), np.array([[6.0, 8.0]], np.float32))
    b = ClassKnowledge(np.array([0]), np.array([1]), np.array([[0.3, 0.4]], np.float32))

    # Execute
    fold.add(a, 1)
    fold.add(b, 2)
    out = fold.result()

    # Assert: (6, 8) becomes (1.2, 1.6); the mean (3 * (1.2, 1.6) + (0.3, 0.4)) / 4
    np.testing.assert_allclose(out.merged.logits, [[0.975, 1.3]], rtol=1e-6)
    assert out.merged.counts.tolist() == [4]
    assert out.clips == [(1, "logits", 10.0, 2.0)]
    # accepted norms (2, 0.5): lower median 0.5, kept within [1 / 2, 1 x 2]
    assert out.scales == {"logits": pytest.approx(0.5)}


def test_the_scale_cannot_be_ratcheted() -> None:
    # Prepare: 3 honest rows of norm 1, scale 1, factor 3
    def round_with(hostile: list[float], previous: float) -> float:
        fold = KnowledgeFold(2, clip_factor=3.0, previous={"logits": previous}, growth=2.0)
        for i, norm in enumerate([1.0, 1.0, 1.0, *hostile]):
            row = np.array([[norm, 0.0]], np.float32)
            fold.add(ClassKnowledge(np.array([0]), np.array([1]), row), i)
        return fold.result().scales["logits"]

    # Assert: a minority (2 of 5) sending 1e6 or 1e-9 does not move it at all
    assert round_with([1e6, 1e6], 1.0) == 1.0
    assert round_with([1e-9, 1e-9], 1.0) == 1.0
    # a majority (4 of 7) moves it by at most bound-growth (2) a round: what they got
    # accepted is 3 x the scale, or their tiny rows
    assert round_with([1e6] * 4, 1.0) == 2.0
    assert round_with([1e-9] * 4, 1.0) == 0.5


def test_the_fold_holds_the_same_memory_whatever_the_number_of_replies() -> None:
    sizes = []
    for n in (3, 300):
        fold = KnowledgeFold(C, clip_factor=3.0, previous={"logits": 1.0, "features": 1.0})
        for i in range(n):
            fold.add(part(i, [i % C]), i)
        assert fold.sums is not None and not fold._buffer
        sizes.append(fold.sums.nbytes)
    assert sizes[0] == sizes[1] == 4 * 8 + 4 * C * 8 + 4 * D * 8


def test_prototypes_with_zero_logits_stream_on_the_feature_scale_alone() -> None:
    # Prepare: prototypes are features with all-zero logits (no logit scale ever)
    zero = ClassKnowledge(
        np.array([1]),
        np.array([2]),
        np.zeros((1, C), np.float32),
        np.array([[3.0, 0.0, 4.0]], np.float32),
    )
    fold = KnowledgeFold(C, clip_factor=1.0, previous={"features": 2.0})

    # Execute
    fold.add(zero, 5)
    out = fold.result()

    # Assert: folded at once, (3, 0, 4) clipped to norm 2; no logit scale invented
    assert out.buffered == 0
    np.testing.assert_allclose(out.merged.features, [[1.2, 0.0, 1.6]], rtol=1e-6)
    assert set(out.scales) == {"features"}


def test_a_reply_moving_a_kind_without_a_scale_waits_for_the_round_median() -> None:
    # Prepare: a logit scale only; the replies carry features too
    given = [part(i, [0, 1]) for i in range(5)]
    fold = KnowledgeFold(C, clip_factor=3.0, previous={"logits": 0.25})

    # Execute
    for i, p in enumerate(given):
        fold.add(p, i)
    out = fold.result()

    # Assert: logits bounded by 3 x 0.25, features by 3 x the round's lower median
    feature_median = sorted(norms_of(given, "features"))[(10 - 1) // 2]
    bounded, _ = clip_knowledge(given, {"logits": 0.75, "features": 3.0 * feature_median})
    assert_same(out.merged, merge_knowledge(bounded, C))
    assert out.buffered == 5


def test_without_a_bound_the_fold_is_the_plain_mean() -> None:
    given = parts()
    fold = KnowledgeFold(C, clip_factor=0.0, previous={"logits": 1e-3})
    for i, p in enumerate(given):
        fold.add(p, i)
    out = fold.result()
    assert_same(out.merged, merge_knowledge(given, C))
    assert out.clips == [] and out.scales == {} and out.buffered == 0


def test_logits_only_knowledge_folds() -> None:
    given = [part(i, [i % C], features=False) for i in range(4)]
    fold = KnowledgeFold(C, clip_factor=3.0, previous=None)
    for i, p in enumerate(given):
        fold.add(p, i)
    out = fold.result()
    assert_same(out.merged, merge_knowledge(bound_knowledge(given, 3.0)[0], C))
    assert set(out.scales) == {"logits"}


def test_a_reply_of_other_widths_is_refused_and_nothing_of_it_is_kept() -> None:
    fold = KnowledgeFold(C, clip_factor=3.0, previous={"logits": 1.0, "features": 1.0})
    fold.add(part(0, [0]), 0)
    assert fold.sums is not None
    before = fold.sums.logits.copy(), fold.sums.counts.copy()
    for bad, match in (
        (part(1, [1], features=False), "features of width None"),
        (ClassKnowledge(np.array([1]), np.array([1]), np.ones((1, C + 1), np.float32)), "width 5"),
    ):
        with pytest.raises(KnowledgeError, match=match):
            fold.add(bad, 1)
    assert fold.added == 1
    np.testing.assert_array_equal(fold.sums.logits, before[0])
    np.testing.assert_array_equal(fold.sums.counts, before[1])


def test_bad_settings_and_an_empty_round_are_refused() -> None:
    with pytest.raises(ValueError, match="clip_factor"):
        KnowledgeFold(C, clip_factor=0.5)
    with pytest.raises(ValueError, match="growth"):
        KnowledgeFold(C, clip_factor=1.0, growth=1.0)
    with pytest.raises(KnowledgeError, match="nothing to merge"):
        KnowledgeFold(C, clip_factor=1.0).result()
    # a previous scale that is not finite and positive is ignored (that kind waits)
    fold = KnowledgeFold(C, clip_factor=1.0, previous={"logits": math.nan, "features": 0.0})
    assert fold.previous == {}


@pytest.mark.parametrize(
    ("saved", "match"),
    [
        ({"logits": math.nan}, "knowledge_scales.logits"),
        ({"logits": 1e30}, "<= 1e"),
        ({"logits": -1.0}, "> 0"),
        ({"logits": True}, "expected a number"),
        ({"weights": 1.0}, "not a kind of row"),
        ([1.0], "expected a mapping"),
    ],
)
def test_checkpoint_scales_are_checked(saved: Any, match: str) -> None:
    with pytest.raises(StateFileError, match=match):
        scales_from_state({KNOWLEDGE_SCALES: saved})


def test_checkpoint_scales_round_trip_and_default_to_none() -> None:
    assert scales_from_state({KNOWLEDGE_SCALES: {"logits": 2.5, "features": 1}}) == {
        "logits": 2.5,
        "features": 1.0,
    }
    assert scales_from_state({}) == {}
