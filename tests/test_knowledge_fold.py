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

from strategies.felo.fold import KNOWLEDGE_SCALES, KnowledgeFold, scales_from_state
from strategies.felo.knowledge import (
    ClassKnowledge,
    KnowledgeError,
    bound_knowledge,
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


def node_medians(rows: list[ClassKnowledge], kind: str) -> list[float]:
    """Each part's lower median positive row norm: a node counts once in the round's median."""
    out: list[float] = []
    for p in rows:
        n = sorted(norms_of([p], kind))
        if n:
            out.append(n[(len(n) - 1) // 2])
    return out


def buffered(given: list[ClassKnowledge], factor: float = 3.0) -> ClassKnowledge:
    """The buffered merge the fold replaces: every row bounded by the round's median."""
    return merge_knowledge(bound_knowledge(given, factor)[0], C)


def test_a_first_round_keeps_every_row_and_equals_the_buffered_merge() -> None:
    # Prepare: no previous median, so no row can be folded before the round ends
    given = parts()
    fold = KnowledgeFold(C, clip_factor=3.0, previous=None, growth=2.0)

    # Execute
    for node, p in enumerate(given, start=10):
        fold.add(p, node)
    out = fold.result()

    # Assert: the buffered merge, its clips renamed to the tags, the round's medians
    _, clips = bound_knowledge(given, 3.0)
    assert_same(out.merged, buffered(given))
    assert out.clips == [(10 + i, kind, norm, bound) for i, kind, norm, bound in clips]
    assert {node for node, *_ in out.clips} == {16}  # the 50x node alone
    assert out.kept == out.rows == 2 * len(given)
    for kind in ("logits", "features"):
        medians = sorted(node_medians(given, kind))
        assert out.scales[kind] == medians[(len(medians) - 1) // 2]


@pytest.mark.parametrize("previous", [1.0, 2.0])
def test_a_later_round_folds_what_cannot_be_clipped_and_equals_the_buffered_merge(
    previous: float,
) -> None:
    # Prepare: last round's medians; the threshold is 3 x previous / 2
    given = parts()
    fold = KnowledgeFold(
        C, clip_factor=3.0, previous={"logits": previous, "features": previous}, growth=2.0
    )
    threshold = 3.0 * previous / 2.0

    # Execute
    for node, p in enumerate(given):
        fold.add(p, node)
    out = fold.result()

    # Assert: the round's own medians are within [previous / 2, previous x 2] here, so
    # the result is the buffered merge's; kept are the rows above the threshold in a kind
    assert all(previous / 2.0 < out.scales[k] < 2.0 * previous for k in ("logits", "features"))
    assert_same(out.merged, buffered(given))
    assert out.clips == bound_knowledge(given, 3.0)[1]
    above = sum(
        int(
            np.sum(
                (np.linalg.norm(p.logits.astype(np.float64), axis=1) > threshold)
                | (np.linalg.norm(p.features.astype(np.float64), axis=1) > threshold)
            )
        )
        for p in given
        if p.features is not None
    )
    assert out.kept == above and out.rows == 2 * len(given)


def test_the_median_cannot_rise_more_than_bound_growth_in_a_round() -> None:
    # Prepare: previous median 1, growth 2: the round's median is at most 2; three rows
    # of norm 1e30 (a majority, or one round of hostile rows) and one of norm 1
    fold = KnowledgeFold(2, clip_factor=3.0, previous={"logits": 1.0}, growth=2.0)
    for i, norm in enumerate((1e30, 1e30, 1e30, 1.0)):
        fold.add(ClassKnowledge(np.array([0]), np.array([1]), np.array([[norm, 0.0]])), i)

    # Execute
    out = fold.result()

    # Assert: median 2, bound 3 x 2 = 6; the three large rows clipped to 6:
    # (6 + 6 + 6 + 1) / 4 = 4.75
    assert out.scales == {"logits": 2.0}
    assert [c[3] for c in out.clips] == [6.0, 6.0, 6.0]
    assert out.merged.logits[0, 0] == pytest.approx(4.75)


def test_claiming_every_class_does_not_buy_the_median() -> None:
    # Prepare: three honest nodes of two classes each (row norm 1) and one that claims
    # all ten classes with rows of 1e30: ten of the sixteen rows are its own
    honest = [
        ClassKnowledge(np.array([c, c + 1]), np.array([5, 5]), np.full((2, 10), 0.1, np.float32))
        for c in (0, 2, 4)
    ]  # each row: norm sqrt(10 x 0.01) = 0.316...
    hostile = ClassKnowledge(
        np.arange(10), np.ones(10, np.int64), np.full((10, 10), 1e29, np.float32)
    )
    fold = KnowledgeFold(10, clip_factor=3.0, previous=None, growth=2.0)
    for i, p in enumerate([*honest, hostile]):
        fold.add(p, i)

    # Execute
    out = fold.result()
    bounds = bound_knowledge([*honest, hostile], 3.0)[1]

    # Assert: the node medians are 0.316, 0.316, 0.316 and 3.2e29: their lower median is
    # an honest one, so the hostile rows are clipped to 3 x 0.316 in both paths
    norm = math.sqrt(10 * 0.1**2)
    assert out.scales["logits"] == pytest.approx(norm, rel=1e-6)
    assert [(c[0], c[3]) for c in out.clips] == [(3, pytest.approx(3 * norm, rel=1e-6))]
    assert [(c[0], c[3]) for c in bounds] == [(3, pytest.approx(3 * norm, rel=1e-6))]
    assert float(np.abs(out.merged.logits).max()) < 3 * norm


def test_the_median_cannot_fall_more_than_bound_growth_in_a_round() -> None:
    # Prepare: previous median 10, growth 2: the round's median is at least 5; three
    # rows of norm 1 (a majority shrinking the bound, or a model that shrank)
    fold = KnowledgeFold(2, clip_factor=3.0, previous={"logits": 10.0}, growth=2.0)
    for i in range(3):
        row = np.array([[1.0, 0.0]], np.float32)
        fold.add(ClassKnowledge(np.array([0]), np.array([1]), row), i)

    # Execute
    out = fold.result()

    # Assert: every row folded at once (1 <= 3 x 10 / 2), nothing clipped, median 5
    assert out.kept == 0 and out.clips == []
    assert out.scales == {"logits": 5.0}
    np.testing.assert_allclose(out.merged.logits, [[1.0, 0.0]])


def test_a_minority_does_not_move_the_median() -> None:
    def median_with(hostile: list[float]) -> float:
        fold = KnowledgeFold(2, clip_factor=3.0, previous={"logits": 1.0}, growth=2.0)
        for i, norm in enumerate([1.0, 1.0, 1.0, *hostile]):
            row = np.array([[norm, 0.0]], np.float32)
            fold.add(ClassKnowledge(np.array([0]), np.array([1]), row), i)
        out = fold.result()
        assert all(bound == 3.0 for *_, bound in out.clips)
        return out.scales["logits"]

    assert median_with([1e6, 1e6]) == 1.0
    assert median_with([1e-9, 1e-9]) == 1.0


def test_the_fold_holds_the_same_sums_whatever_the_number_of_replies() -> None:
    sizes = []
    for n in (3, 300):
        fold = KnowledgeFold(C, clip_factor=3.0, previous={"logits": 100.0, "features": 100.0})
        for i in range(n):
            fold.add(part(i, [i % C]), i)
        assert fold.sums is not None and fold.kept == 0  # every row under 150
        sizes.append(fold.sums.nbytes)
    assert sizes[0] == sizes[1] == 4 * 8 + 4 * C * 8 + 4 * D * 8


def test_prototypes_with_zero_logits_need_no_logit_median() -> None:
    # Prepare: prototypes are features with all-zero logits
    zero = ClassKnowledge(
        np.array([1]),
        np.array([2]),
        np.zeros((1, C), np.float32),
        np.array([[3.0, 0.0, 4.0]], np.float32),
    )
    fold = KnowledgeFold(C, clip_factor=3.0, previous={"features": 4.0})

    # Execute
    fold.add(zero, 5)
    out = fold.result()

    # Assert: norm 5 <= 3 x 4 / 2: folded at once; no logit median invented
    assert out.kept == 0
    np.testing.assert_allclose(out.merged.features, [[3.0, 0.0, 4.0]], rtol=1e-6)
    assert set(out.scales) == {"features"}


def test_without_a_bound_the_fold_is_the_plain_mean() -> None:
    given = parts()
    fold = KnowledgeFold(C, clip_factor=0.0, previous={"logits": 1e-3})
    for i, p in enumerate(given):
        fold.add(p, i)
    out = fold.result()
    assert_same(out.merged, merge_knowledge(given, C))
    assert out.clips == [] and out.scales == {} and out.kept == 0


def test_logits_only_knowledge_folds() -> None:
    given = [part(i, [i % C], features=False) for i in range(4)]
    fold = KnowledgeFold(C, clip_factor=3.0, previous=None)
    for i, p in enumerate(given):
        fold.add(p, i)
    out = fold.result()
    assert_same(out.merged, buffered(given))
    assert set(out.scales) == {"logits"}


def test_a_reply_of_other_widths_is_refused_and_nothing_of_it_is_kept() -> None:
    fold = KnowledgeFold(C, clip_factor=3.0, previous={"logits": 1.0, "features": 1.0})
    fold.add(part(0, [0]), 0)
    assert fold.sums is not None
    before = fold.sums.logits.copy(), fold.sums.counts.copy(), fold.rows, fold.kept
    for bad, match in (
        (part(1, [1], features=False), "features of width None"),
        (ClassKnowledge(np.array([1]), np.array([1]), np.ones((1, C + 1), np.float32)), "width 5"),
    ):
        with pytest.raises(KnowledgeError, match=match):
            fold.add(bad, 1)
    assert fold.added == 1 and (fold.rows, fold.kept) == before[2:]
    np.testing.assert_array_equal(fold.sums.logits, before[0])
    np.testing.assert_array_equal(fold.sums.counts, before[1])


def test_bad_settings_and_an_empty_round_are_refused() -> None:
    with pytest.raises(ValueError, match="clip_factor"):
        KnowledgeFold(C, clip_factor=0.5)
    with pytest.raises(ValueError, match="growth"):
        KnowledgeFold(C, clip_factor=1.0, growth=1.0)
    with pytest.raises(KnowledgeError, match="nothing to merge"):
        KnowledgeFold(C, clip_factor=1.0).result()
    # a previous median that is not finite and positive is ignored (rows kept)
    fold = KnowledgeFold(C, clip_factor=1.0, previous={"logits": math.nan, "features": 0.0})
    assert fold.previous == {} and fold.thresholds == {}


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
