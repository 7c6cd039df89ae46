"""Bounded influence and the attack harness.

- the cohort-relative clip of ``mean`` (``clip-factor``), knowledge bounds and robust
  merges, against hand-computed values;
- the server never ships a non-finite state;
- every hostile class of the attack harness against every scheme's server side,
  through the real ClientApp handlers, validation and aggregation (fake grid).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array

from client_app.attacks.client import flip_labels
from client_app.attacks.omniscient import install_omniscient
from client_app.attacks.spec import AttackSpec, attack_for
from server_app.app import build_server
from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import AccumulatorReport, Index, get_aggregator, lower_median
from strategies.core.groups import GroupModels, GroupRound, NonFiniteStateError
from strategies.core.mean import MeanAccumulator
from strategies.fedhenn.kbar import average_kernel
from strategies.felo.knowledge import ClassKnowledge, bound_knowledge, merge_knowledge
from tessera.attacks import attack_assignment, attacked_partitions
from tessera.config import ATTACKS, ConfigError, NodeConfig, RunConfig
from tests.conftest import TINY_DIGITS, load_default_run_config, make_grid

RunConfigFactory = Callable[..., dict[str, Any]]


# ------------------------------------------------------------- cohort-relative clip
def vec(*values: float) -> dict[str, np.ndarray]:
    return {"w": np.array(values, dtype=np.float32)}


def test_lower_median_is_an_element() -> None:
    assert lower_median([3.0, 1.0, 2.0]) == 2.0
    assert lower_median([4.0, 1.0]) == 1.0
    with pytest.raises(ValueError, match="nothing"):
        lower_median([])


def test_first_round_clips_against_its_own_median() -> None:
    # distances from [0, 0]: 1, 2 and 100 -> lower median 2, bound 3 x 2 = 6
    acc = MeanAccumulator(vec(0.0, 0.0), clip_factor=3.0)
    acc.add(vec(1.0, 0.0), 1.0)
    acc.add(vec(0.0, 2.0), 1.0)
    acc.add(vec(60.0, 80.0), 2.0)  # distance 100 -> scaled to (3.6, 4.8)
    result = acc.result()["w"]
    np.testing.assert_allclose(result, [(1.0 + 0.0 + 2 * 3.6) / 4, (0.0 + 2.0 + 2 * 4.8) / 4])
    report = acc.report()
    assert report.medians == {"parameters": pytest.approx(2.0)}
    assert [(c.position, c.kind, c.distance, c.bound) for c in report.clips] == [
        (2, "parameters", pytest.approx(100.0), pytest.approx(6.0))
    ]


def test_later_rounds_stream_against_the_previous_median() -> None:
    # previous median 0.5 -> bound 1.5; the update at distance 5 is scaled by 0.3
    acc = MeanAccumulator(vec(1.0, 1.0), clip_factor=3.0, previous={"parameters": 0.5})
    acc.add(vec(4.0, 5.0), 1.0)  # delta (3, 4) -> (0.9, 1.2)
    acc.add(vec(1.0, 2.0), 1.0)  # delta (0, 1), kept
    assert acc._buffer == []  # folded as they came
    np.testing.assert_allclose(acc.result()["w"], [(1.9 + 1.0) / 2, (2.2 + 2.0) / 2])
    assert acc.report().medians["parameters"] == pytest.approx(1.0)  # lower median of 5, 1


def test_clip_factor_zero_is_the_plain_weighted_mean() -> None:
    acc = MeanAccumulator(vec(0.0), clip_factor=0.0)
    acc.add(vec(1.0), 1.0)
    acc.add(vec(1000.0), 3.0)
    np.testing.assert_allclose(acc.result()["w"], [(1.0 + 3000.0) / 4])
    assert acc.report().clips == ()


def test_free_riders_do_not_zero_the_bound_and_weigh_nothing() -> None:
    # two nodes send the global model back (distance 0): dropped as unmoved, so the
    # bound comes from the others (lower median 1, x 2) and 3 is clipped to 2; the
    # mean is over the two that moved, (1 + 2) / 2, not (0 + 0 + 1 + 2) / 4
    acc = MeanAccumulator(vec(0.0), clip_factor=2.0)
    for value in (0.0, 0.0, 1.0, 3.0):
        acc.add(vec(value), 1.0)
    np.testing.assert_allclose(acc.result()["w"], [(1.0 + 2.0) / 2])
    kinds = [(c.position, c.kind) for c in acc.report().clips]
    assert kinds == [(0, "unmoved"), (1, "unmoved"), (3, "parameters")]


def test_a_free_rider_streamed_against_a_known_scale_weighs_nothing() -> None:
    # a later round (a scale of 1 from the last one): the updates stream; the unmoved
    # one is taken back out, the two others (distances 0.5 and 1) are within the bound
    acc = MeanAccumulator(vec(0.0), clip_factor=1.0, previous={"parameters": 1.0})
    for value in (0.5, 0.0, 1.0):
        acc.add(vec(value), 2.0)
    np.testing.assert_allclose(acc.result()["w"], [(0.5 + 1.0) / 2])
    assert [(c.position, c.kind) for c in acc.report().clips] == [(1, "unmoved")]


def test_a_group_logs_the_free_rider_it_dropped(caplog: pytest.LogCaptureFixture) -> None:
    bounded = type(get_aggregator("mean"))(clip_factor=1.0)  # type: ignore[call-arg]
    models = GroupModels(bounded, lambda arch: vec(0.0, 0.0))
    rnd = GroupRound()
    models.fold(rnd, "a", vec(0.0, 0.0), 1.0, node=7)  # the global model, sent back
    models.fold(rnd, "a", vec(1.0, 1.0), 1.0, node=8)
    with caplog.at_level("WARNING"):
        done = models.commit(rnd)
    assert [(c["node"], c["kind"]) for c in done.clips] == [(7, "unmoved")]
    assert "node 7: update of 'a' dropped: its learned parameters are the global" in caplog.text
    np.testing.assert_allclose(models.arrays["a"]["w"], [1.0, 1.0])


def test_the_plain_mean_still_counts_a_free_rider() -> None:
    # clip-factor 0 is the plain weighted mean, free-riders included
    acc = MeanAccumulator(vec(0.0), clip_factor=0.0)
    for value in (0.0, 1.0):
        acc.add(vec(value), 1.0)
    np.testing.assert_allclose(acc.result()["w"], [0.5])


def test_partial_updates_are_clipped_on_what_they_cover() -> None:
    ref = {"w": np.zeros((2, 2), np.float32)}
    index: dict[str, Index] = {"w": (slice(0, 1), slice(0, 2))}
    acc = MeanAccumulator(ref, clip_factor=1.0, previous={"parameters": 1.0})
    acc.add({"w": np.array([[3.0, 4.0]], np.float32)}, 1.0, index=index)
    out = acc.result()["w"]
    # distance 5 on the 2 elements it covers; no scale of its slice class yet: the
    # whole-model scale 1 converted to 2 of 4 elements, sqrt(2 / 4) -> factor 0.7071 / 5
    f = math.sqrt(0.5) / 5.0
    np.testing.assert_allclose(out, [[3.0 * f, 4.0 * f], [0.0, 0.0]], rtol=1e-6)


def test_group_models_carry_the_median_across_rounds_and_checkpoints() -> None:
    models = GroupModels(get_aggregator("mean"), lambda arch: vec(0.0, 0.0))
    assert models.aggregator.name == "mean"
    models = GroupModels(
        type(get_aggregator("mean"))(clip_factor=3.0),  # type: ignore[call-arg]
        lambda arch: vec(0.0, 0.0),
    )
    rnd = GroupRound()
    models.fold(rnd, "a", vec(1.0, 0.0), 1.0, node=1)
    models.fold(rnd, "a", vec(0.0, 2.0), 1.0, node=2)
    models.fold(rnd, "a", vec(60.0, 80.0), 1.0, node=3)
    done = models.commit(rnd)
    assert done.sizes == {"a": 3}
    assert [c["node"] for c in done.clips] == [3]
    assert models.reports["a"].medians == {"parameters": pytest.approx(2.0)}
    restored = GroupModels(models.aggregator, lambda arch: vec(0.0, 0.0))
    restored.load_state_dict(models.state_dict())
    assert restored.reports["a"].medians == {"parameters": pytest.approx(2.0)}
    np.testing.assert_array_equal(restored.arrays["a"]["w"], models.arrays["a"]["w"])


class NaNAccumulator:
    """An accumulator whose result is not finite (a stand-in for a numerical bug)."""

    count = 1

    def add(self, update: Mapping[str, np.ndarray], weight: float, **_: Any) -> None:
        """Ignore the update."""

    def result(self) -> dict[str, np.ndarray]:
        """Return NaN weights."""
        return vec(float("nan"), 0.0)

    def report(self) -> AccumulatorReport:
        """Nothing measured."""
        return AccumulatorReport()


class NaNAggregator:
    name = "nan"

    def accumulator(
        self, reference: Any, *, previous: Any = None, direction: Any = None
    ) -> NaNAccumulator:
        return NaNAccumulator()


def test_a_non_finite_aggregate_is_never_committed() -> None:
    models = GroupModels(NaNAggregator(), lambda arch: vec(1.0, 2.0))  # type: ignore[arg-type]
    rnd = GroupRound()
    models.fold(rnd, "a", vec(0.0, 0.0), 1.0)
    with pytest.raises(NonFiniteStateError, match="non-finite"):
        models.commit(rnd)
    np.testing.assert_array_equal(models.get("a")["w"], [1.0, 2.0])


def test_the_server_skips_a_round_whose_aggregate_is_not_finite(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    config = run_config(
        {**TINY_DIGITS, "strategy": "fedavg-groups", "num-server-rounds": 1, "min-nodes": 2}
        | {"output-dir": str(tmp_path), "run-name": "r", "max-failed-rounds": 2}
    )
    server = build_server(config, bundle=digits_bundle).runner
    server.models.aggregator = NaNAggregator()  # type: ignore[attr-defined]
    before = {a: dict(w) for a, w in server.models.arrays.items()}  # type: ignore[attr-defined]
    server.start(make_grid(config, 2), num_rounds=1, timeout=5.0)
    record = server.rounds[0]
    assert record["skipped"] and "non-finite" in record["skip_reason"]
    for arch, arrays in server.models.arrays.items():  # type: ignore[attr-defined]
        assert all(np.all(np.isfinite(v)) for v in arrays.values() if v.dtype.kind == "f")
        if arch in before:
            np.testing.assert_array_equal(arrays["fc.weight"], before[arch]["fc.weight"])


# ------------------------------------------------------------------------ knowledge
def knowledge(ids: list[int], logits: list[list[float]], counts: list[int]) -> ClassKnowledge:
    return ClassKnowledge(
        class_ids=np.array(ids, np.int64),
        counts=np.array(counts, np.int64),
        logits=np.array(logits, np.float32),
    )


def test_knowledge_rows_are_bounded_against_the_cohort() -> None:
    # logit-row norms 1, 2, 1, 1000 -> lower median 1, bound 2 x 1 = 2
    honest = knowledge([0, 1], [[1.0, 0.0], [0.0, 2.0]], [5, 5])
    other = knowledge([0], [[0.0, 1.0]], [5])
    hostile = knowledge([1], [[600.0, 800.0]], [5])
    bounded, clips = bound_knowledge([honest, other, hostile], 2.0)
    np.testing.assert_allclose(bounded[2].logits, [[1.2, 1.6]], rtol=1e-6)
    np.testing.assert_array_equal(bounded[0].logits, honest.logits)
    assert clips == [(2, "logits", pytest.approx(1000.0), pytest.approx(2.0))]
    assert bound_knowledge([hostile], 0.0)[0][0] is hostile


def test_robust_knowledge_merges_by_hand() -> None:
    parts = [
        knowledge([0], [[1.0, 0.0]], [1]),
        knowledge([0], [[2.0, 0.0]], [1]),
        knowledge([0, 1], [[1e6, 0.0], [0.0, 4.0]], [100, 1]),
    ]
    mean = merge_knowledge(parts, 2)
    assert mean.logits[0, 0] == pytest.approx((1.0 + 2.0 + 100 * 1e6) / 102)
    median = merge_knowledge(parts, 2, rule="median")
    np.testing.assert_allclose(median.logits, [[2.0, 0.0], [0.0, 4.0]])
    trimmed = merge_knowledge(parts, 2, rule="trimmed-mean", trim_fraction=0.2)
    np.testing.assert_allclose(trimmed.logits[0], [2.0, 0.0])  # one trimmed from each end
    np.testing.assert_array_equal(median.counts, [102, 1])


def test_a_huge_representation_cannot_break_k_bar() -> None:
    rng = np.random.default_rng(0)
    reps = [rng.normal(size=(12, 4)), rng.normal(size=(12, 6))]
    for kernel in ("linear", "rbf"):
        clean = average_kernel(reps, [1.0, 1.0], kernel=kernel)
        scaled = average_kernel([reps[0] * 1e160, reps[1]], [1.0, 1.0], kernel=kernel)
        for a, b in ((clean.z, scaled.z), (clean.matrix, scaled.matrix)):
            if a is not None:
                assert b is not None and np.all(np.isfinite(b))
                np.testing.assert_allclose(
                    a @ a.T if a.shape[0] != a.shape[1] else a,
                    b @ b.T if b.shape[0] != b.shape[1] else b,
                    atol=1e-9,
                )


def test_median_k_bar_ignores_one_outlier() -> None:
    rng = np.random.default_rng(1)
    base = rng.normal(size=(10, 3))
    honest = [base + 0.01 * rng.normal(size=base.shape) for _ in range(4)]
    hostile = rng.normal(size=(10, 3))
    robust = average_kernel([*honest, hostile], [1.0] * 5, kernel="linear", merge="median")
    clean = average_kernel(honest, [1.0] * 4, kernel="linear", merge="median")
    assert robust.matrix is not None and clean.matrix is not None
    assert np.linalg.norm(robust.matrix - clean.matrix) < 0.05


# --------------------------------------------------------------------- the harness
def run_with(overrides: Mapping[str, Any]) -> RunConfig:
    base = {**load_default_run_config(), "attack": "boost", "attack-fraction": 0.25, "seed": 7}
    return RunConfig.from_flower({**base, **overrides})


def test_the_attack_draw_is_seeded_and_sized() -> None:
    assert attacked_partitions(10, 0.3, 7) == attacked_partitions(10, 0.3, 7)
    assert len(attacked_partitions(10, 0.3, 7)) == 3
    assert len(attacked_partitions(4, 0.25, 7)) == 1
    assert attacked_partitions(4, 0.0, 7) == []
    assert len(attacked_partitions(3, 0.01, 7)) == 1  # at least one when asked for
    plan = attack_assignment(run_with({"attack": "boost,noise", "attack-fraction": 0.5}), 8)
    assert sorted(plan.values()) == ["boost", "boost", "noise", "noise"]


def test_node_config_attack_wins_and_is_checked() -> None:
    run = run_with({"attack": ""})
    node = NodeConfig.from_flower({"partition-id": 0, "num-partitions": 3, "attack": "noise"})
    spec = attack_for(run, node)
    assert spec is not None and spec.kind == "noise"
    with pytest.raises(ConfigError, match="node-config 'attack' is 'nice'"):
        NodeConfig.from_flower({"partition-id": 0, "num-partitions": 3, "attack": "nice"})
    with pytest.raises(ConfigError, match="'attack'"):
        run_with({"attack": "boost,evil"})
    with pytest.raises(ConfigError, match="unknown"):
        AttackSpec("evil")


def test_flip_labels_by_hand() -> None:
    np.testing.assert_array_equal(flip_labels(np.array([0, 1, 9]), 10), [9, 8, 0])


SCHEMES: dict[str, dict[str, Any]] = {
    "fedavg": {"fedavg-arch": "cnn-2"},
    "fedavg-groups": {},
    "fedprox": {"fedavg-arch": "cnn-2"},
    "felo": {},
    "velo": {"cvae-epochs": 2},
    "fedhe": {},
    "fedhenn": {"rad-size": 32, "rad-batch": 8},
    "local": {},
    "fedproto": {},
    "fedtgp": {"fedtgp-server-epochs": 5},
    "fedgh": {"fedgh-server-epochs": 5},
    "lg-fedavg": {},
    "fml": {},
}


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_attack_against_every_scheme(
    scheme: str,
    attack: str,
    run_config: RunConfigFactory,
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    # Prepare: four nodes, one hostile (the seeded draw), two rounds
    config = run_config(
        {
            **TINY_DIGITS,
            **SCHEMES[scheme],
            "strategy": scheme,
            "num-server-rounds": 2,
            "attack": attack,
            "attack-fraction": 0.25,
            "attack-scale": 1000.0,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    grid = make_grid(config, 4)
    install_omniscient(grid, config)  # alie, ipm, ...: forged from the honest replies
    server = build_server(config, bundle=digits_bundle).runner

    # Execute
    server.start(grid, num_rounds=2, timeout=5.0)

    # Assert: every round ran, the honest nodes never failed, the hostile one is known
    # and bounded where it can be, and the global state stayed finite
    hostile = [p for p, _ in attack_assignment(RunConfig.from_flower(config), 4).items()]
    assert len(hostile) == 1
    for record in server.rounds:
        assert not record["skipped"], record["skip_reason"]
        # a hostile node may wreck its own personal model; honest ones never fail
        assert {f["node"] for f in record["failed"]} <= {100 + p for p in hostile}
        assert [a["partition_id"] for a in record["attackers"]] == hostile
        honest_ok = [c for c in record["clients"] if c["partition_id"] not in hostile]
        assert len(honest_ok) == 3
    for arrays in server.global_models().values():
        for value in arrays.values():
            assert np.all(np.isfinite(value))
    if attack in ("boost", "sign-flip") and scheme in ("fedavg", "fedprox", "fedavg-groups"):
        clipped = [c["node"] for r in server.rounds for c in r.get("clipped", [])]
        hostile_node = 100 + hostile[0]
        assert hostile_node in clipped, server.rounds[-1].get("clipped")
    if attack in ("boost", "sign-flip") and scheme in ("lg-fedavg", "fml"):  # one group each
        clipped = [
            c["node"]
            for r in server.rounds
            for c in r.get("head_clipped", r.get("meme_clipped", []))
        ]
        hostile_node = 100 + hostile[0]
        assert hostile_node in clipped, server.rounds[-1].get("clipped")
    knowledge = ("felo", "velo", "fedhe", "fedproto", "fedtgp", "fedgh")
    if attack in ("boost", "sign-flip") and scheme in knowledge:
        # bounded against the cohort, or (overflowing to infinity) rejected outright
        clipped = [
            c["node"]
            for r in server.rounds
            for key in ("knowledge_clipped", "prototypes_clipped")
            for c in r.get(key, [])
        ]
        rejected = [c["node"] for r in server.rounds for c in r["rejected"]]
        assert 100 + hostile[0] in clipped + rejected
    if attack == "label-flip" and server.global_models():
        assert "attack_success" in server.rounds[-1]


def boosted_fedavg(
    run_config: RunConfigFactory, digits_bundle: Any, tmp_path: Path, clip_factor: float
) -> tuple[Any, float]:
    """One fedavg round of four nodes, one boosting x1000; the server and how far it moved."""
    config = run_config(
        {
            **TINY_DIGITS,
            "strategy": "fedavg",
            "fedavg-arch": "cnn-2",
            "num-server-rounds": 1,
            "attack": "boost",
            "attack-fraction": 0.25,
            "attack-scale": 1000.0,
            "clip-factor": clip_factor,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    server = build_server(config, bundle=digits_bundle).runner
    initial = server.initial_arrays("cnn-2")
    server.start(make_grid(config, 4), num_rounds=1, timeout=5.0)
    keys = [k for k, v in initial.items() if v.dtype.kind == "f"]
    moved = np.sqrt(sum(float(np.sum((server.global_arrays[k] - initial[k]) ** 2)) for k in keys))
    return server, float(moved)


def test_a_boosted_update_is_bounded_by_default(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    # the default mean (clip-factor 3) keeps a x1000 update to 3 median distances
    server, moved = boosted_fedavg(run_config, digits_bundle, tmp_path, 3.0)
    medians = server.models.reports["cnn-2"].medians
    assert set(medians) == {"parameters", "statistics"}
    bound = 3.0 * np.hypot(medians["parameters"], medians["statistics"])
    assert moved <= bound + 1e-6  # a mean of updates each within 3 medians per kind
    (clip,) = server.rounds[0]["clipped"]
    assert clip["kind"] == "parameters" and clip["distance"] > 100 * clip["bound"]


def test_mean_without_bound_is_dragged(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    # the same attack with clip-factor=0: the defence is what made the difference
    server, moved = boosted_fedavg(run_config, digits_bundle, tmp_path, 0.0)
    assert moved > 50.0
    assert server.rounds[0].get("clipped") == []


def test_robust_aggregators_are_built_from_the_run_config(
    run_config: RunConfigFactory, digits_bundle: Any
) -> None:
    config = run_config({**TINY_DIGITS, "aggregator": "trimmed-mean", "trim-fraction": 0.3})
    server = build_server(config, bundle=digits_bundle).runner
    assert server.aggregator.name == "trimmed-mean"
    assert server.aggregator.trim_fraction == 0.3  # type: ignore[attr-defined]


def test_aggregation_errors_skip_the_round_instead_of_ending_the_run(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> None:
    # krum with f=1 needs more than 4 updates; 2 nodes cannot satisfy it
    config = run_config(
        {
            **TINY_DIGITS,
            "strategy": "fedavg",
            "fedavg-arch": "cnn-2",
            "aggregator": "krum",
            "num-server-rounds": 1,
            "output-dir": str(tmp_path),
            "run-name": "r",
        }
    )
    server = build_server(config, bundle=digits_bundle).runner
    server.start(make_grid(config, 2), num_rounds=1, timeout=5.0)
    assert server.rounds[0]["skipped"]
    assert "more than 4 updates" in server.rounds[0]["skip_reason"]
    assert isinstance(AggregationError("x"), ValueError)


def test_a_negative_running_variance_is_rejected() -> None:
    from flwr.app import ArrayRecord

    from strategies.core.validation import check_arrays

    spec = {"bn.running_var": ((2,), "float32")}
    bad = ArrayRecord({"bn.running_var": Array(np.array([1.0, -6.0], np.float32))})
    reason = check_arrays(bad, spec)
    assert isinstance(reason, str) and "negative variance (-6)" in reason
    good = ArrayRecord({"bn.running_var": Array(np.array([1.0, 0.0], np.float32))})
    assert not isinstance(check_arrays(good, spec), str)


def test_parameters_and_statistics_are_bounded_separately() -> None:
    # statistics move by 10 per node, parameters by 0.1: a x100 parameter step is
    # clipped against the parameters' median, not hidden under the statistics'
    ref = {"w": np.zeros(1, np.float32), "bn.running_var": np.ones(1, np.float32)}
    acc = MeanAccumulator(ref, clip_factor=2.0)
    for w, var in ((0.1, 11.0), (0.1, 11.0), (10.0, 11.0)):
        update = {"w": np.array([w], np.float32), "bn.running_var": np.array([var], np.float32)}
        acc.add(update, 1.0)
    out = acc.result()
    np.testing.assert_allclose(out["w"], [(0.1 + 0.1 + 0.2) / 3], rtol=1e-6)
    np.testing.assert_allclose(out["bn.running_var"], [11.0])
    assert [c.kind for c in acc.report().clips] == ["parameters"]
