"""Sub-model maths (strategies.submodel) against small tensors computed by hand."""

from __future__ import annotations

import math
import tracemalloc
from typing import Any

import numpy as np
import pytest

from strategies.core.aggregation import AggregationError
from strategies.core.mean import MeanAccumulator
from strategies.submodel import (
    Layout,
    ScalableAccumulator,
    SubModelError,
    SubModelSpec,
    coverage_index,
    extract,
    graft,
    roll_channels,
    section_depths,
    sub_channels,
    sub_shape,
    trimmed_norm,
)
from tests.oracles import coverage_average, layer_norms, scalable_aggregate, scaling_factors

LAYOUT = Layout(
    keep_inputs=frozenset({"stem.weight"}),
    keep_outputs=frozenset({"head.weight", "head.bias"}),
)
BLOCK = ("conv.weight", "dw.weight", "norm.weight", "norm.num_batches_tracked")


def toy_global() -> dict[str, np.ndarray]:
    """Stem 3->4, two sections of two blocks (conv 4->4, depthwise 4, norm 4), head 4->3."""
    g: dict[str, np.ndarray] = {"stem.weight": np.arange(12, dtype=np.float32).reshape(4, 3, 1, 1)}
    for s in range(2):
        for b in range(2):
            base = 100.0 * (s + 1) + 10.0 * b
            g[f"sections.{s}.{b}.conv.weight"] = base + np.arange(16, dtype=np.float32).reshape(
                4, 4, 1, 1
            )
            g[f"sections.{s}.{b}.dw.weight"] = base + np.arange(4, dtype=np.float32).reshape(
                4, 1, 1, 1
            )
            g[f"sections.{s}.{b}.norm.weight"] = base + np.arange(4, dtype=np.float32)
            g[f"sections.{s}.{b}.norm.num_batches_tracked"] = np.array(5 + s, np.int64)
    g["head.weight"] = np.arange(12, dtype=np.float32).reshape(3, 4)
    g["head.bias"] = np.arange(3, dtype=np.float32)
    return g


def random_global(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: rng.normal(size=v.shape).astype(v.dtype) for k, v in toy_global().items()}


# --- SubModelSpec and Layout --------------------------------------------------


@pytest.mark.parametrize("width", [0, -0.5, 1.5, math.nan, math.inf, True, "0.5"])
def test_spec_rejects_a_width_outside_zero_one(width: object) -> None:
    with pytest.raises(ValueError, match=r"width must be a number in \(0, 1\]"):
        SubModelSpec(width=width, depths=(1, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("depths", [(0, 2), (1, -1), (1.5, 2), (True, 2), "12", 3])
def test_spec_rejects_depths_that_are_not_positive_counts(depths: object) -> None:
    with pytest.raises(ValueError, match="depths"):
        SubModelSpec(width=0.5, depths=depths)  # type: ignore[arg-type]


def test_spec_is_frozen_and_normalised() -> None:
    spec = SubModelSpec(width=1, depths=[1, 2])  # type: ignore[arg-type]
    assert spec == SubModelSpec(1.0, (1, 2)) and isinstance(spec.width, float)
    assert SubModelSpec.full((2, 2)) == SubModelSpec(1.0, (2, 2))
    with pytest.raises(AttributeError):
        spec.width = 0.5  # type: ignore[misc]


def test_layout_rejects_a_bare_string_and_a_bad_min_depth() -> None:
    with pytest.raises(ValueError, match="wrap it"):
        Layout(keep_inputs="stem.weight")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_depth"):
        Layout(min_depth=0)


def test_section_depths_reads_the_keys_and_rejects_gaps() -> None:
    assert section_depths(toy_global(), LAYOUT) == (2, 2)
    assert section_depths(["stem.weight"], LAYOUT) == ()
    with pytest.raises(SubModelError, match="blocks"):
        section_depths(["sections.0.0.w", "sections.0.2.w"], LAYOUT)
    with pytest.raises(SubModelError, match="not numbered"):
        section_depths(["sections.1.0.w"], LAYOUT)
    with pytest.raises(SubModelError, match="<section>"):
        section_depths(["sections.conv.weight"], LAYOUT)


# --- Channel counts -------------------------------------------------------------


def test_sub_channels_is_the_ceiling_without_float_error() -> None:
    assert sub_channels(4, 0.5) == 2
    assert sub_channels(10, 0.3) == 3  # 0.3 * 10 = 3.0000000000000004 in floats
    assert sub_channels(3, 0.25) == 1  # ceil(0.75)
    assert sub_channels(5, 0.5) == 3  # ceil(2.5)
    assert sub_channels(1, 0.1) == 1  # at least one channel
    assert sub_channels(7, 1.0) == 7


def test_sub_shape_reads_out_and_in_channels_from_the_rank() -> None:
    assert sub_shape("c.weight", (4, 4, 3, 3), 0.5, LAYOUT) == (2, 2, 3, 3)  # conv
    assert sub_shape("dw.weight", (4, 1, 3, 3), 0.5, LAYOUT) == (2, 1, 3, 3)  # depthwise
    assert sub_shape("fc.weight", (6, 4), 0.5, LAYOUT) == (3, 2)  # linear
    assert sub_shape("bn.bias", (4,), 0.5, LAYOUT) == (2,)  # vector
    assert sub_shape("bn.num_batches_tracked", (), 0.5, LAYOUT) == ()  # scalar
    assert sub_shape("stem.weight", (4, 3, 3, 3), 0.5, LAYOUT) == (2, 3, 3, 3)  # first layer
    assert sub_shape("head.weight", (3, 4), 0.5, LAYOUT) == (3, 2)  # classifier
    assert sub_shape("head.bias", (3,), 0.5, LAYOUT) == (3,)


# --- extract (Algorithm 3) ----------------------------------------------------


def test_extract_drops_last_blocks_then_slices_the_channel_prefix() -> None:
    # Prepare
    g = toy_global()

    # Execute
    sub, index = extract(g, SubModelSpec(0.5, (1, 2)), LAYOUT)

    # Assert: sections.0.1 dropped, the rest kept in the global order
    assert list(sub) == [k for k in g if not k.startswith("sections.0.1.")]
    assert list(index) == list(sub)
    np.testing.assert_array_equal(
        sub["sections.0.0.conv.weight"][:, :, 0, 0], [[100, 101], [104, 105]]
    )
    np.testing.assert_array_equal(
        sub["sections.1.1.conv.weight"][:, :, 0, 0], [[210, 211], [214, 215]]
    )
    assert sub["sections.1.0.dw.weight"].shape == (2, 1, 1, 1)
    np.testing.assert_array_equal(sub["sections.1.0.norm.weight"], [200, 201])
    assert int(sub["sections.1.0.norm.num_batches_tracked"]) == 6
    np.testing.assert_array_equal(sub["stem.weight"][:, :, 0, 0], [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(sub["head.weight"], [[0, 1], [4, 5], [8, 9]])
    np.testing.assert_array_equal(sub["head.bias"], [0, 1, 2])
    assert index["sections.0.0.conv.weight"] == (slice(0, 2), slice(0, 2), slice(0, 1), slice(0, 1))
    assert index["head.weight"] == (slice(0, 3), slice(0, 2))
    assert index["sections.0.0.norm.num_batches_tracked"] == ()
    assert all(sub[k].dtype == g[k].dtype for k in sub)


def test_extract_returns_copies() -> None:
    g = toy_global()
    sub, _ = extract(g, SubModelSpec(1.0, (2, 2)), LAYOUT)
    sub["head.bias"][0] = 99.0
    assert g["head.bias"][0] == 0.0


def test_extract_index_is_what_the_accumulator_takes() -> None:
    # A width-0.5 sub-model of all 7s folded alone: its prefix becomes 7, the rest stays.
    g = toy_global()
    sub, index = extract(g, SubModelSpec(0.5, (2, 2)), LAYOUT)
    sevens = {k: np.full_like(v, 7) for k, v in sub.items()}
    acc = MeanAccumulator(g)
    acc.add(sevens, 1.0, index=index)
    out = acc.result()
    np.testing.assert_array_equal(out["head.bias"], [7, 7, 7])
    np.testing.assert_array_equal(out["sections.0.0.norm.weight"], [7, 7, 102, 103])


@pytest.mark.parametrize(
    ("clip_factor", "previous"),
    [(100.0, None), (1.0, {"parameters": 1e6, "parameters@all": 1e6})],
)
def test_the_bounded_mean_of_slices_is_the_coverage_average(
    clip_factor: float, previous: dict[str, float] | None
) -> None:
    # Prepare: a width-0.5 and a full slice of the toy model, trained (moved) by the
    # clients; the bounded mean with bounds far above their moves, so nothing is
    # clipped: in a first round (buffered; its bounds come from the round itself)
    # and in a later one at the default clip-factor 1 (streamed, where the slice's
    # conv weights are strided views of the sums: they were added into copies and
    # lost, 223da63)
    rng = np.random.default_rng(3)
    g = random_global(rng)
    states, indices = [], []
    for width in (0.5, 1.0):
        sub, index = extract(g, SubModelSpec(width, (2, 2)), LAYOUT)
        states.append(
            {
                k: v + rng.normal(size=v.shape).astype(v.dtype) if v.dtype.kind == "f" else v
                for k, v in sub.items()
            }
        )
        indices.append(index)
    acc = MeanAccumulator(g, clip_factor=clip_factor, previous=previous)
    for state, index in zip(states, indices, strict=True):
        acc.add(state, 1.0, index=index)

    # Execute
    out = acc.result()

    # Assert: every floating entry is the coverage average (HeteroFL's Algorithm)
    expected = coverage_average(g, states, indices=indices)
    assert not acc.report().clips
    for key, value in g.items():
        if value.dtype.kind == "f":
            np.testing.assert_allclose(out[key], expected[key], rtol=1e-5, atol=1e-5, err_msg=key)


def test_extract_of_the_full_spec_is_the_identity() -> None:
    rng = np.random.default_rng(0)
    for _ in range(5):
        g = random_global(rng)
        sub, index = extract(g, SubModelSpec.full((2, 2)), LAYOUT)
        assert list(sub) == list(g)
        for key, value in g.items():
            np.testing.assert_array_equal(sub[key], value)
            assert sub[key].dtype == value.dtype
            assert value[index[key]].shape == value.shape


def test_extract_follows_given_shapes() -> None:
    # A family rounding channels: 3 of 4 kept, though ceil(0.5 * 4) = 2.
    g = toy_global()
    spec = SubModelSpec(0.5, (2, 1))
    keys = [k for k in g if not k.startswith("sections.1.1.")]
    shapes = {k: sub_shape(k, g[k].shape, 0.75, LAYOUT) for k in keys}
    sub, index = extract(g, spec, LAYOUT, shapes=shapes)
    assert sub["sections.0.0.conv.weight"].shape == (3, 3, 1, 1)
    assert index["head.weight"] == (slice(0, 3), slice(0, 3))
    with pytest.raises(SubModelError, match="missing"):
        extract(g, spec, LAYOUT, shapes={k: shapes[k] for k in keys[1:]})
    with pytest.raises(SubModelError, match="does not fit"):
        extract(g, spec, LAYOUT, shapes={**shapes, "head.bias": (4,)})


@pytest.mark.parametrize(
    ("spec", "layout", "match"),
    [
        (SubModelSpec(0.5, (1,)), LAYOUT, "one count per section"),
        (SubModelSpec(0.5, (3, 1)), LAYOUT, "keep at most 2"),
        (SubModelSpec(0.5, (1, 2)), Layout(min_depth=2), "at least 2"),
        (SubModelSpec(0.5, (2, 2)), Layout(keep_inputs=frozenset({"stem.w"})), "stem.w"),
    ],
)
def test_extract_rejects_a_spec_that_does_not_fit(
    spec: SubModelSpec, layout: Layout, match: str
) -> None:
    with pytest.raises(SubModelError, match=match):
        extract(toy_global(), spec, layout)


# --- graft (Algorithm 2) --------------------------------------------------------


def test_graft_repeats_the_last_block_of_a_shallow_section() -> None:
    # Prepare: width 0.5, section 0 keeps one block
    g = toy_global()
    sub, _ = extract(g, SubModelSpec(0.5, (1, 2)), LAYOUT)

    # Execute
    out = graft(sub, LAYOUT, (2, 2))

    # Assert: sections.0.1 is a copy of sections.0.0, placed right after it
    for rest in BLOCK:
        np.testing.assert_array_equal(out[f"sections.0.1.{rest}"], sub[f"sections.0.0.{rest}"])
    np.testing.assert_array_equal(
        out["sections.0.1.conv.weight"][:, :, 0, 0], [[100, 101], [104, 105]]
    )
    assert list(out) == list(g)
    assert out["sections.0.1.norm.weight"] is not out["sections.0.0.norm.weight"]
    out["sections.0.1.norm.weight"][0] = -1.0
    assert sub["sections.0.0.norm.weight"][0] == 100.0


def test_graft_of_three_blocks_from_one() -> None:
    layout = Layout(prefix="stages")
    state = {"stages.0.0.w": np.array([1.0, 2.0]), "stages.1.0.w": np.array([3.0])}
    out = graft(state, layout, (3, 1))
    assert list(out) == ["stages.0.0.w", "stages.0.1.w", "stages.0.2.w", "stages.1.0.w"]
    np.testing.assert_array_equal(out["stages.0.2.w"], [1.0, 2.0])


def test_graft_of_a_full_depth_state_is_the_identity() -> None:
    g = toy_global()
    out = graft(g, LAYOUT, (2, 2))
    assert list(out) == list(g)
    for key, value in g.items():
        np.testing.assert_array_equal(out[key], value)


def test_graft_of_a_depth_one_extract_has_the_global_keys_and_shapes() -> None:
    rng = np.random.default_rng(1)
    for _ in range(3):
        g = random_global(rng)
        out = graft(extract(g, SubModelSpec(1.0, (1, 1)), LAYOUT)[0], LAYOUT, (2, 2))
        assert list(out) == list(g)
        assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in g.items()}
        # at width 0.5 it has the keys and shapes of the full-depth width-0.5 sub-model
        half = graft(extract(g, SubModelSpec(0.5, (1, 1)), LAYOUT)[0], LAYOUT, (2, 2))
        full_depth, _ = extract(g, SubModelSpec(0.5, (2, 2)), LAYOUT)
        assert {k: v.shape for k, v in half.items()} == {k: v.shape for k, v in full_depth.items()}


def test_graft_rejects_what_it_cannot_restore() -> None:
    sub, _ = extract(toy_global(), SubModelSpec(0.5, (1, 2)), LAYOUT)
    with pytest.raises(SubModelError, match="max_depths gives 1"):
        graft(sub, LAYOUT, (2,))
    with pytest.raises(SubModelError, match="more than the global 1"):
        graft(sub, LAYOUT, (2, 1))
    with pytest.raises(SubModelError, match="min_depth"):
        graft(sub, Layout(min_depth=2), (2, 2))


# --- Coverage averaging ---------------------------------------------------------


def test_coverage_average_of_widths_half_and_full_by_hand() -> None:
    # Prepare: client A (width 0.5, 1 example), client B (width 1, 3 examples)
    g = {"v": np.array([10.0, 20.0, 30.0, 40.0]), "m": np.zeros((2, 2)), "u": np.array([9.0])}
    a = {"v": np.array([1.0, 2.0]), "m": np.array([[4.0]])}
    b = {"v": np.array([5.0, 6.0, 7.0, 8.0]), "m": np.array([[8.0, 2.0], [2.0, 2.0]])}

    # Execute
    out = coverage_average(g, [a, b], [1, 3])

    # Assert: (1*1 + 3*5)/4 = 4, (1*2 + 3*6)/4 = 5, then B alone; "u" nobody covers
    np.testing.assert_allclose(out["v"], [4.0, 5.0, 7.0, 8.0])
    np.testing.assert_allclose(out["m"], [[(4.0 + 24.0) / 4, 2.0], [2.0, 2.0]])
    np.testing.assert_array_equal(out["u"], [9.0])


def test_coverage_average_is_uniform_by_default_and_takes_indices() -> None:
    g = {"v": np.zeros(4)}
    a = {"v": np.array([2.0, 2.0])}
    b = {"v": np.array([4.0, 4.0])}
    out = coverage_average(g, [a, b], indices=[{"v": (slice(0, 2),)}, {"v": (slice(1, 3),)}])
    np.testing.assert_allclose(out["v"], [2.0, 3.0, 4.0, 0.0])


def test_coverage_average_rejects_what_is_not_a_slice() -> None:
    g = {"v": np.zeros(2)}
    with pytest.raises(AggregationError, match="not a prefix"):
        coverage_average(g, [{"v": np.zeros(3)}])
    with pytest.raises(AggregationError, match="not in the global"):
        coverage_average(g, [{"w": np.zeros(1)}])
    with pytest.raises(AggregationError, match="give one per state"):
        coverage_average(g, [{"v": np.zeros(2)}], [1, 2])
    with pytest.raises(AggregationError, match="nothing to aggregate"):
        coverage_average(g, [])
    assert coverage_index(g, {"v": np.zeros(1)}) == {"v": (slice(0, 1),)}


def test_graft_then_coverage_average_reaches_every_block() -> None:
    # A depth-1 client's block 0 also averages into block 1 (complete aggregation).
    g = toy_global()
    shallow, _ = extract(g, SubModelSpec(1.0, (1, 2)), LAYOUT)
    shallow = {k: np.zeros_like(v) for k, v in shallow.items()}
    full, _ = extract(g, SubModelSpec(1.0, (2, 2)), LAYOUT)
    out = coverage_average(g, [graft(shallow, LAYOUT, (2, 2)), full])
    np.testing.assert_allclose(out["sections.0.1.norm.weight"], [55.0, 55.5, 56.0, 56.5])


# --- Scalable aggregation -------------------------------------------------------


def test_trimmed_norm_by_hand() -> None:
    x = np.array([1.0, -2.0, 3.0, -4.0])
    # |x| sorted 1 2 3 4: P95 = 3 + 0.85 * 1 = 3.85 -> keep 1, -2, 3
    assert trimmed_norm(x) == pytest.approx(math.sqrt(14.0))
    # x sorted -4 -2 1 3: P95 = 1 + 0.85 * 2 = 2.7 -> keep -4, -2, 1
    assert trimmed_norm(x, trim="signed") == pytest.approx(math.sqrt(21.0))
    # P2.5 = -4 + 0.075 * 2 = -3.85, P97.5 = 1 + 0.925 * 2 = 2.85 -> keep -2, 1
    assert trimmed_norm(x, trim="central") == pytest.approx(math.sqrt(5.0))
    assert trimmed_norm(x, percentile=100) == pytest.approx(math.sqrt(30.0))
    assert trimmed_norm(np.full((2, 2), 3.0)) == pytest.approx(6.0)  # ties: all kept
    assert trimmed_norm(np.zeros(0)) == 0.0
    with pytest.raises(ValueError, match="percentile"):
        trimmed_norm(x, percentile=0)
    with pytest.raises(ValueError, match="trim"):
        trimmed_norm(x, trim="median")  # type: ignore[arg-type]


def test_scaling_factors_for_a_three_client_cohort_by_hand() -> None:
    # layer w: norms 5, 10, 15 -> reference: median of 5 and 10 (the largest left out)
    # = 7.5 -> factors 1.5, 0.75, 0.5 (no client is scaled past the others' median)
    # layer b: only the first two -> median of 2 = 2 -> 1, 1/2; a zero norm -> 1
    norms = [{"w": 5.0, "b": 2.0}, {"w": 10.0, "b": 4.0}, {"w": 15.0, "z": 0.0}]
    factors = scaling_factors(norms)
    assert factors[0] == pytest.approx({"w": 1.5, "b": 1.0})
    assert factors[1] == pytest.approx({"w": 0.75, "b": 0.5})
    assert factors[2] == pytest.approx({"w": 0.5, "z": 1.0})
    with pytest.raises(AggregationError, match="norm"):
        scaling_factors([{"w": math.nan}])


def test_scaling_factors_are_bounded_above_only() -> None:
    # layer w: norms 0.002, 1.998, 28 -> reference median(0.002, 1.998) = 1.0:
    # factors 500 (bound 6), 1 / 1.998, 1 / 28
    norms = [{"w": 0.002}, {"w": 1.998}, {"w": 28.0}]
    factors = scaling_factors(norms, max_factor=6.0)
    assert factors[0]["w"] == 6.0  # 1 / 0.002 = 500, bounded
    assert factors[1]["w"] == pytest.approx(1.0 / 1.998)  # under the bound
    assert factors[2]["w"] == pytest.approx(1.0 / 28.0)  # scaling down is not bounded
    assert scaling_factors(norms)[0]["w"] == pytest.approx(500.0)
    with pytest.raises(ValueError, match="max_factor"):
        scaling_factors(norms, max_factor=0.5)


def test_scalable_aggregation_of_updates_by_hand() -> None:
    # Prepare: global 1s; updates A (width 0.5) [3, 4], B [6, 8, 0, 0], C [0, 0, 9, 12]
    g = {"w": np.ones(4)}
    a = {"w": np.array([4.0, 5.0])}
    b = {"w": np.array([7.0, 9.0, 1.0, 1.0])}
    c = {"w": np.array([1.0, 1.0, 10.0, 13.0])}
    # norms 5, 10, 15 (percentile 100: every value) -> reference median(5, 10) = 7.5
    # -> factors 1.5, 0.75, 0.5
    assert [layer_norms(g, s, coverage_index(g, s), percentile=100) for s in (a, b, c)] == [
        {"w": 5.0},
        {"w": 10.0},
        {"w": 15.0},
    ]

    # Execute: examples 1, 1, 2
    out = scalable_aggregate(g, [a, b, c], [1, 1, 2], percentile=100)

    # Assert: scaled updates [4.5, 6], [4.5, 6, 0, 0], [0, 0, 4.5, 6] (each of norm 7.5);
    # coverage [4, 4, 3, 3] -> 1 + [(4.5 + 4.5) / 4, (6 + 6) / 4, 2 * 4.5 / 3, 2 * 6 / 3]
    np.testing.assert_allclose(out["w"], [3.25, 4.0, 4.0, 5.0])


def test_scalable_aggregation_of_weights_by_hand_at_the_95th_percentile() -> None:
    # Prepare: three full-width clients; the largest value of each is past the P95
    g = {
        "w": np.zeros(4),
        "n.running_var": np.ones(2),
        "n.num_batches_tracked": np.array(0, np.int64),
    }
    clients = [
        {"w": np.array([0.0, 3.0, 4.0, 50.0]), "n.running_var": np.full(2, 1.0)},
        {"w": np.array([0.0, 6.0, 8.0, 90.0]), "n.running_var": np.full(2, 3.0)},
        {"w": np.array([0.0, 9.0, 12.0, 200.0]), "n.running_var": np.full(2, 2.0)},
    ]
    for client, steps in zip(clients, (1, 2, 6), strict=True):
        client["n.num_batches_tracked"] = np.array(steps, np.int64)

    # Execute
    out = scalable_aggregate(g, clients, target="weights")

    # Assert: trimmed norms 5, 10, 15 -> reference 7.5 -> factors 1.5, 0.75, 0.5
    # w: ([0, 4.5, 6, 75] + [0, 4.5, 6, 67.5] + [0, 4.5, 6, 100]) / 3
    np.testing.assert_allclose(out["w"], [0.0, 4.5, 6.0, 242.5 / 3.0])
    # statistics and counters are averaged, not scaled
    np.testing.assert_allclose(out["n.running_var"], [2.0, 2.0])
    assert int(out["n.num_batches_tracked"]) == 3


def test_scalable_aggregation_keeps_an_untrained_global_only_for_updates() -> None:
    # Every client returns its slice of the global unchanged, at widths 0.5 and 1.
    g = toy_global()
    half, _ = extract(g, SubModelSpec(0.5, (2, 2)), LAYOUT)
    full, _ = extract(g, SubModelSpec(1.0, (2, 2)), LAYOUT)
    out = scalable_aggregate(g, [half, full])
    for key, value in g.items():
        np.testing.assert_allclose(out[key], value)
    moved = scalable_aggregate(g, [half, full], target="weights")
    assert not np.allclose(moved["sections.0.0.conv.weight"], g["sections.0.0.conv.weight"])


def test_scalable_aggregation_with_equal_norms_is_the_coverage_average() -> None:
    g = {"w": np.zeros(2, np.float32)}
    a = {"w": np.array([3.0, -4.0], np.float32)}
    b = {"w": np.array([-4.0, 3.0], np.float32)}  # same trimmed norm as a
    for target in ("updates", "weights"):
        out = scalable_aggregate(g, [a, b], [1, 3], target=target)  # type: ignore[arg-type]
        np.testing.assert_allclose(out["w"], coverage_average(g, [a, b], [1, 3])["w"])
        assert out["w"].dtype == np.float32


def test_scalable_aggregation_rejects_an_unknown_target() -> None:
    g = {"w": np.zeros(2)}
    with pytest.raises(ValueError, match="target"):
        scalable_aggregate(g, [{"w": np.ones(2)}], target="gradients")  # type: ignore[arg-type]
    with pytest.raises(AggregationError, match="nothing"):
        scalable_aggregate(g, [])


def test_roll_channels_moves_every_cut_dimension_by_hand() -> None:
    # Prepare: stem keeps its 3 inputs, the head its 3 outputs
    g = toy_global()

    # Execute
    rolled = roll_channels(g, LAYOUT, 1)

    # Assert: channel c moves to c + 1 (mod 4) on every dimension a width slice cuts
    assert rolled["stem.weight"][1, 2, 0, 0] == g["stem.weight"][0, 2, 0, 0]
    assert rolled["stem.weight"][0, 1, 0, 0] == g["stem.weight"][3, 1, 0, 0]
    conv = "sections.0.1.conv.weight"
    assert rolled[conv][1, 1, 0, 0] == g[conv][0, 0, 0, 0]
    assert rolled[conv][0, 3, 0, 0] == g[conv][3, 2, 0, 0]
    np.testing.assert_array_equal(rolled["head.weight"][:, 1], g["head.weight"][:, 0])
    np.testing.assert_array_equal(rolled["head.bias"], g["head.bias"])
    # a full cycle is the identity; the input is not changed
    back = g
    for _ in range(4):
        back = roll_channels(back, LAYOUT, 1)
    for key in g:
        np.testing.assert_array_equal(back[key], g[key])
    assert not np.array_equal(rolled[conv], g[conv])


@pytest.mark.parametrize(
    ("name", "shape"), [("preresnet26_025", (1, 8, 8)), ("mobilenetv2_035", (3, 32, 32))]
)
def test_rolling_the_channels_of_a_real_model_keeps_its_function(
    name: str, shape: tuple[int, ...]
) -> None:
    import torch

    from models import get_model
    from models.slicing import family_layout

    # Prepare: random batch-norm statistics, so that they must move with their channels
    torch.manual_seed(0)
    model = get_model(name, input_shape=shape, num_classes=10)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
    model.eval()
    x = torch.randn(4, *shape)
    before = model(x)
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}

    # Execute
    rolled = roll_channels(state, family_layout(name), 3)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in rolled.items()})

    # Assert
    changed = sum(not np.array_equal(state[k], rolled[k]) for k in state)
    assert changed > len(state) // 3
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-4)


# --- streaming scalable aggregation (FedFA without keeping the replies) --------
def fedfa_cohort(rng: np.random.Generator) -> tuple[dict[str, np.ndarray], list[Any]]:
    """Return a global model and 6 grafted replies with their examples.

    Mixed widths and depths; update scales falling 5-fold per reply (so every cap
    is decided exactly), down to a 1e-4 update (capped at max_factor 10); one reply unchanged
    (zero norms).
    """
    g = random_global(rng)
    for key in [k for k in g if k.startswith("sections.") and k.split(".")[2] == "1"]:
        # a block like the one grafted onto it: a shallow reply's update stays its noise
        # (block 1 of section s copies block 0 of the same section)
        section, _, rest = key.removeprefix("sections.").split(".", 2)
        g[key] = g[f"sections.{section}.0.{rest}"].copy()
    cohort = [
        ((1.0, (2, 2)), 1.0, 5.0),
        ((1.0, (1, 1)), 0.2, 2.0),
        ((0.5, (2, 2)), 0.04, 1.0),
        ((0.25, (1, 2)), 0.008, 3.0),
        ((0.5, (2, 1)), 1e-4, 1.0),
        ((0.25, (2, 2)), 0.0, 2.0),
    ]
    out = []
    for (width, depths), scale, examples in cohort:
        moved = {
            k: (v + scale * rng.normal(size=v.shape)).astype(v.dtype)
            if np.issubdtype(v.dtype, np.floating)
            else v + 1
            for k, v in g.items()
        }
        state = graft(extract(moved, SubModelSpec(width, depths), LAYOUT)[0], LAYOUT, (2, 2))
        out.append((state, examples))
    return g, out


@pytest.mark.parametrize("target", ["updates", "weights"])
@pytest.mark.parametrize("trim", ["magnitude", "central"])
@pytest.mark.parametrize("max_factor", [math.inf, 10.0, 2.0])
def test_streaming_scalable_aggregation_equals_the_buffered_one(
    target: str, trim: str, max_factor: float
) -> None:
    # Prepare
    g, cohort = fedfa_cohort(np.random.default_rng(3))
    kwargs: dict[str, Any] = {"target": target, "trim": trim, "max_factor": max_factor}
    buffered = scalable_aggregate(
        g, [s for s, _ in cohort], [w for _, w in cohort], percentile=95, **kwargs
    )

    # Execute: fold one reply at a time
    acc = ScalableAccumulator(g, percentile=95, **kwargs)
    for state, weight in cohort:
        acc.add(state, weight, index=coverage_index(g, state))
    streamed = acc.result()

    # Assert: same keys, dtypes and values (float32 rounding apart); caps decided exactly
    assert acc.late_caps == 0 and acc.count == len(cohort)
    assert list(streamed) == list(g)
    for key, value in buffered.items():
        assert streamed[key].dtype == value.dtype
        np.testing.assert_allclose(streamed[key], value, rtol=2e-5, atol=2e-6, err_msg=key)
    if max_factor == 10.0 and target == "updates":
        assert acc.capped > 0  # the 1e-4 reply's layers are scaled by 10, not by thousands


def test_a_late_cap_scales_every_folded_layer_down_never_up() -> None:
    # Prepare: global [0, 0]; updates [1, 0] (norm 1), [0, 1000] and [1000, 0] (norm 1000)
    # (percentile 100: every value counts), max_factor 10, one example each
    g = {"w": np.zeros(2, np.float32)}
    small = {"w": np.array([1.0, 0.0], np.float32)}
    up = {"w": np.array([0.0, 1000.0], np.float32)}
    right = {"w": np.array([1000.0, 0.0], np.float32)}
    # buffered: reference median(1, 1000) = 500.5 (the largest left out) -> factors
    # min(500.5, 10) = 10 and 0.5005 twice -> ([10, 0] + [0, 500.5] + [500.5, 0]) / 3
    buffered = scalable_aggregate(g, [small, up, right], percentile=100, max_factor=10.0)
    np.testing.assert_allclose(buffered["w"], [510.5 / 3.0, 500.5 / 3.0], rtol=1e-6)

    # Execute: the large ones first, then the small one (kept: 1 * 10 < 2 * 1000)
    first = ScalableAccumulator(g, percentile=100, max_factor=10.0)
    for state in (up, right, small):
        first.add(state)
    # ... and the small one first: it is folded (no reference yet) before the reference
    # is known; the final one would give it 500.5, so the multiplier is
    # min(500.5, 10 * 1) = 10: factors 10 / 1 and 10 / 1000 -> ([10, 0] + [0, 10] + [10, 0]) / 3
    late = ScalableAccumulator(g, percentile=100, max_factor=10.0)
    for state in (small, up, right):
        late.add(state)

    # Assert
    np.testing.assert_allclose(first.result()["w"], [510.5 / 3.0, 500.5 / 3.0], rtol=1e-6)
    assert (first.capped, first.late_caps) == (1, 0)
    np.testing.assert_allclose(late.result()["w"], [20.0 / 3.0, 10.0 / 3.0], rtol=1e-6)
    assert (late.capped, late.late_caps) == (1, 1)


def test_streaming_scalable_aggregation_memory_does_not_grow_with_clients() -> None:
    """tracemalloc peak of 10 and of 60 full-width replies folded one at a time."""

    def peak(clients: int) -> int:
        rng = np.random.default_rng(0)
        g = {"a.weight": np.zeros((64, 1000), np.float32), "b.bias": np.zeros(4000, np.float32)}
        acc = ScalableAccumulator(g, max_factor=10.0)
        acc.add({k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in g.items()})
        tracemalloc.start()
        try:
            for _ in range(clients):
                state = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in g.items()}
                acc.add(state, 2.0)
                del state
            acc.result()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    model = (64 * 1000 + 4000) * 4
    few, many = peak(10), peak(60)
    # one reply, its update and one float64 copy of the largest layer for the norm
    assert many < 5 * model
    assert many < 1.1 * few
