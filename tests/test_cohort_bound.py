"""The cohort bound of group-averaging schemes (run-config ``cohort-bound``).

A group of two or three nodes has no honest majority: one hostile node in it picks
its group's median distance and rides it. :class:`GroupModels` pools every group's
accepted distances relative to its model's norm into the cohort's scale, and every
group's next bound is at most ``clip-factor`` times it times the model's norm. The
maths by hand here; what it does against ``inflate-boost`` is measured by
``benchmarks/robustness.py`` (docs/pages/robustness.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server_app.app import build_server
from strategies.core.aggregators import AccumulatorReport
from strategies.core.groups import GroupModels, GroupRound
from strategies.core.mean import MeanAccumulator, MeanAggregator
from strategies.core.scales import cohort_cap, cohort_scale
from tests.conftest import TINY_DIGITS, load_default_run_config, make_grid


def vec(*values: float) -> dict[str, np.ndarray]:
    return {"w": np.array(values, dtype=np.float32)}


def initial(arch: str) -> dict[str, np.ndarray]:
    # group a starts at (3, 4), norm 5; group b at (6, 8), norm 10
    return vec(3.0, 4.0) if arch == "a" else vec(6.0, 8.0)


def test_cohort_scale_is_the_lower_median_moved_at_most_growth() -> None:
    # five relative distances, one hostile (0.5): sorted 0.01 0.02 0.03 0.04 0.5 -> 0.03
    assert cohort_scale([0.02, 0.5, 0.03, 0.04, 0.01], None, 2.0) == 0.03
    # from a previous 0.01 it may grow to 0.02 at most; from 0.1 fall to 0.05 at most
    assert cohort_scale([0.02, 0.5, 0.03, 0.04, 0.01], 0.01, 2.0) == 0.02
    assert cohort_scale([0.02, 0.5, 0.03, 0.04, 0.01], 0.1, 2.0) == 0.05
    # non-finite and zero distances tell nothing; a broken previous is ignored
    assert cohort_scale([math.nan, 0.0, 0.2, math.inf], None, 2.0) == 0.2
    assert cohort_scale([0.2], math.nan, 2.0) == 0.2
    assert cohort_scale([math.nan], 0.1, 2.0) is None


def test_cohort_cap_is_factor_times_scale_times_norm() -> None:
    assert cohort_cap(1.0, 0.1, 5.0) == pytest.approx(0.5)
    assert cohort_cap(3.0, 0.1, 5.0) == pytest.approx(1.5)
    assert cohort_cap(1.0, 0.1, 0.0) is None
    assert cohort_cap(0.0, 0.1, 5.0) is None
    assert cohort_cap(1.0, -0.1, 5.0) is None


def test_a_cohort_scale_clips_an_update_its_own_scale_lets_through() -> None:
    # reference (3, 4), norm 5; own scale 10, cohort 0.1 -> bound min(10, 0.1 x 5) = 0.5
    update = vec(3.0, 14.0)  # distance 10 from the reference
    bounded = MeanAccumulator(
        vec(3.0, 4.0), clip_factor=1.0, previous={"parameters": 10.0}, cohort={"parameters": 0.1}
    )
    bounded.add(update, 1.0)
    np.testing.assert_allclose(bounded.result()["w"], [3.0, 4.5], rtol=1e-6)
    (clip,) = bounded.report().clips
    assert (clip.distance, clip.bound) == (pytest.approx(10.0), pytest.approx(0.5))
    # without the cohort's scale the update is within its own bound: folded whole
    alone = MeanAccumulator(vec(3.0, 4.0), clip_factor=1.0, previous={"parameters": 10.0})
    alone.add(update, 1.0)
    np.testing.assert_allclose(alone.result()["w"], [3.0, 14.0])
    assert alone.report().clips == ()


def test_the_report_gives_each_accepted_distance_over_the_model_norm() -> None:
    # reference (3, 4), norm 5: distances 0.5 and 1.0; first round, bound = lower
    # median 0.5, so the second is clipped and tells the scale 0.5 (growth 1 there)
    acc = MeanAccumulator(vec(3.0, 4.0), clip_factor=1.0)
    acc.add(vec(3.5, 4.0), 1.0)
    acc.add(vec(3.0, 5.0), 1.0)
    acc.result()
    assert acc.report().relative == {"parameters": (pytest.approx(0.1), pytest.approx(0.1))}


def test_pooled_scale_pools_two_or_more_groups_only() -> None:
    models = GroupModels(MeanAggregator(clip_factor=1.0), initial, cohort=True)
    two = {
        "a": AccumulatorReport(relative={"parameters": (0.02, 0.5)}),
        "b": AccumulatorReport(relative={"parameters": (0.03, 0.04, 0.01)}),
    }
    assert models.pooled_scale(two) == {"parameters": 0.03}
    models.relative = {"parameters": 0.01}  # growth 2: at most 0.02 next
    assert models.pooled_scale(two) == {"parameters": 0.02}
    # one group: its own median already bounds it; the cohort's scale is kept
    assert models.pooled_scale({"a": two["a"]}) == {"parameters": 0.01}
    off = GroupModels(MeanAggregator(clip_factor=1.0), initial, cohort=False)
    assert off.pooled_scale(two) == {}


def run_two_rounds(cohort: bool) -> tuple[GroupModels, list[dict[str, Any]]]:
    models = GroupModels(MeanAggregator(clip_factor=1.0), initial, cohort=cohort)
    # round 1: group a moves 0.5 twice (relative 0.1), group b 3 twice (0.3)
    rnd = GroupRound()
    models.fold(rnd, "a", vec(3.5, 4.0), 1.0, node=1)
    models.fold(rnd, "a", vec(3.0, 4.5), 1.0, node=2)
    models.fold(rnd, "b", vec(9.0, 8.0), 1.0, node=3)
    models.fold(rnd, "b", vec(6.0, 11.0), 1.0, node=4)
    assert models.commit(rnd).clips == []
    # round 2: group b (its own scale 3) gets one update moving 3
    rnd = GroupRound()
    models.fold(rnd, "b", vec(7.5, 12.5), 1.0, node=3)
    return models, models.commit(rnd).clips


def test_a_small_group_is_bounded_by_the_cohort_not_only_by_itself() -> None:
    # Execute
    models, clips = run_two_rounds(cohort=True)

    # Assert: the cohort's scale is the lower median of 0.1, 0.1, 0.3, 0.3 = 0.1;
    # b's model is (7.5, 9.5) after round 1, norm sqrt(146.5): its update of
    # distance 3 (within b's own scale of 3) is clipped to 0.1 x sqrt(146.5)
    (clip,) = clips
    assert clip["node"] == 3 and clip["arch"] == "b"
    assert clip["distance"] == pytest.approx(3.0)
    assert clip["bound"] == pytest.approx(0.1 * math.sqrt(146.5), rel=1e-6)
    np.testing.assert_allclose(
        models.arrays["b"]["w"], [7.5, 9.5 + 0.1 * math.sqrt(146.5)], rtol=1e-6
    )
    # round 2 had one group: the cohort's scale is kept, not set by b alone
    assert models.relative == {"parameters": pytest.approx(0.1)}


def test_without_cohort_bound_each_group_keeps_its_own_bound() -> None:
    models, clips = run_two_rounds(cohort=False)
    assert clips == []
    np.testing.assert_allclose(models.arrays["b"]["w"], [7.5, 12.5])
    assert models.relative == {}


def test_the_cohort_scale_survives_a_checkpoint_and_a_bad_one_is_refused() -> None:
    from tessera.checkpoint import CheckpointError

    models, _ = run_two_rounds(cohort=True)
    state = models.state_dict()
    assert state["cohort"] == {"parameters": pytest.approx(0.1)}
    restored = GroupModels(MeanAggregator(clip_factor=1.0), initial, cohort=True)
    restored.load_state_dict(state)
    assert restored.relative == models.relative
    for bad, problem in (
        ({"parameters": math.nan}, "nan"),
        ({"parameters": 0.0}, "finite number > 0"),
        ({"parameters": 1e7}, r"<= 1e\+06"),
        ({"weights": 0.1}, "not an entry kind"),
    ):
        with pytest.raises(CheckpointError, match=problem) as info:
            restored.load_state_dict({**state, "cohort": bad})
        assert "group_models.cohort" in str(info.value)
        assert restored.relative == models.relative  # nothing restored


def test_fedavg_groups_pools_its_groups_through_a_real_round(
    run_config: Any, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    # Prepare: four real ClientApps on the in-process grid, three profiles -> two or
    # more architecture groups
    config = run_config(
        {
            **TINY_DIGITS,
            "strategy": "fedavg-groups",
            "cohort-bound": True,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    server = build_server(config, bundle=digits_bundle).runner

    # Execute
    server.start(make_grid(config, 4), num_rounds=2, timeout=5.0)

    # Assert: the groups' distances were pooled into a finite, positive scale
    models = server.models  # type: ignore[attr-defined]
    assert models.cohort is True
    assert len(models.arrays) >= 2
    (scale,) = [v for k, v in models.relative.items() if k == "parameters"]
    assert math.isfinite(scale) and 0.0 < scale < 1.0
    # off by default (pyproject.toml), and then the groups are not pooled
    assert load_default_run_config()["cohort-bound"] is False
    off = build_server(
        {**config, "cohort-bound": False, "run-name": "off"}, bundle=digits_bundle
    ).runner
    assert off.models.cohort is False  # type: ignore[attr-defined]
