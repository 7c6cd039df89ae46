"""Sub-model and ensemble robustness (issue 23): FedFA's scaling is a bound, batch-norm
statistics are bounded in every sub-model scheme, one node cannot end an ensemble run,
and a node of another family cannot join an ensemble federation.

Each finding of the review is reproduced through the real aggregation code with the
expected bound computed by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Message, RecordDict

from models.spec import ModelRef
from strategies.core.context import RoundContext
from strategies.core.mean import MeanAggregator
from strategies.core.nodes import NodeInfo
from strategies.core.validation import ClientReply
from strategies.ensemble.weights import output_problem
from strategies.submodel import ScalableAccumulator
from strategies.submodel.norms import effective_norm, reference_norm
from tessera import wire
from tests.conftest import TINY_DIGITS, make_grid
from tests.oracles import scalable_aggregate


# ----------------------------------------------------------------------- pure pieces
def test_the_reference_is_the_median_of_the_others_never_a_norm_that_holds_its_own() -> None:
    # median of the positive norms with the largest left out
    assert reference_norm([5.0, 10.0, 15.0]) == 7.5  # median(5, 10)
    assert reference_norm([5.0, 5.0, 10.0, 500.0]) == 5.0  # median(5, 5, 10)
    assert reference_norm([5.0, 5.0, 10.0, 5e9]) == 5.0  # the largest cannot move it
    assert reference_norm([1.0, 3.0, 0.0]) == 1.0  # zeros moved nothing: left out
    # for every client it is at most the median of the *other* clients' norms
    norms = [2.0, 7.0, 1.0, 9.0, 4.0]
    for c in range(len(norms)):
        others = sorted(norms[:c] + norms[c + 1 :])
        assert reference_norm(norms) <= (others[1] + others[2]) / 2  # type: ignore[operator]
    assert reference_norm([4.0]) is None  # alone: no others
    assert reference_norm([0.0, 4.0]) is None


def test_the_effective_norm_bounds_what_the_trim_leaves_out() -> None:
    assert effective_norm(2.0, 3.0, 3.0) == 2.0  # honest: the trimmed norm
    assert effective_norm(2.0, 300.0, 3.0) == 100.0  # full / clip-factor
    assert effective_norm(0.0, 30.0, 3.0) == 10.0  # hidden values, the rest zero
    assert effective_norm(2.0, 300.0, 0.0) == 2.0  # clip-factor 0: the paper's norm
    with pytest.raises(ValueError, match="clip_factor"):
        effective_norm(1.0, 1.0, 0.5)


# ------------------------------------------------------------ FedFA: scaling bounds
def test_a_boosted_update_is_scaled_to_the_median_of_the_others() -> None:
    # Prepare: global 0; honest updates a, b (norm 5) and c (norm 10); the attacker sends
    # a times 100 (norm 500). Percentile 100: every value counts in the norm.
    g = {"w": np.zeros(4, np.float32)}
    a = {"w": np.array([3.0, 4.0, 0.0, 0.0], np.float32)}
    b = {"w": np.array([0.0, 0.0, 3.0, 4.0], np.float32)}
    c = {"w": np.array([0.0, 0.0, 8.0, 6.0], np.float32)}
    boosted = {"w": 100 * a["w"]}
    # the paper's mean (5 + 5 + 10 + 500) / 4 = 130 would scale a and b up by 26 (capped
    # at 10) and leave the attacker at norm 130. The reference is median(5, 5, 10) = 5:
    # factors 1, 1, 0.5 and 5 / 500 -> scaled a, b, [0, 0, 4, 3] and a again
    # -> ([3, 4, 0, 0] + [0, 0, 3, 4] + [0, 0, 4, 3] + [3, 4, 0, 0]) / 4
    expected = np.array([1.5, 2.0, 1.75, 1.75])

    for scale in (100.0, 1e6):  # however large the boost, the same result
        attacker = {"w": (scale * a["w"]).astype(np.float32)}

        # Execute
        acc = ScalableAccumulator(g, percentile=100, max_factor=10.0, clip_factor=3.0)
        for state in (a, attacker, b, c):
            acc.add(state)
        out = acc.result()

        # Assert: no factor above 1 (nobody amplified), the attacker at the others' median
        np.testing.assert_allclose(out["w"], expected, rtol=1e-6)
        assert acc.capped == 0 and acc.references == {"w": 5.0}
    buffered = scalable_aggregate(g, [a, boosted, b, c], percentile=100, clip_factor=3.0)
    np.testing.assert_allclose(buffered["w"], expected, rtol=1e-6)


def hidden_outliers() -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]], float]:
    """Three honest updates of 0.1 everywhere, and one with 4 of 100 values at 1e3.

    Returns the global, the four states, and the attacker's full norm.
    """
    g = {"w": np.zeros(100, np.float32)}
    honest = {"w": np.full(100, 0.1, np.float32)}
    hidden = np.full(100, 0.1, np.float32)
    hidden[96:] = 1e3
    full = math.sqrt(96 * 0.1**2 + 4 * 1e3**2)
    return g, [honest, honest, honest, {"w": hidden}], full


def test_values_hidden_above_the_percentile_are_bounded_by_the_full_norm() -> None:
    # Prepare: the honest trimmed norm is 0.1 * sqrt(100) = 1 (all |x| tie at P95, all
    # kept). The attacker's P95 of |x| is 0.1 (index 94.05 of 96 values 0.1, 4 of 1e3):
    # its trimmed norm 0.1 * sqrt(96) looks honest, the 1e3 values are not counted.
    g, states, full = hidden_outliers()

    # Execute: FedFA's defaults, clip-factor 3 (the run-config default)
    acc = ScalableAccumulator(g, percentile=95, max_factor=10.0, clip_factor=3.0)
    for state in states:
        acc.add(state)
    out = acc.result()

    # Assert: e = full / 3 for the attacker; reference median(1, 1, 1) = 1 -> its factor
    # 3 / full and its scaled full norm exactly 3 = clip-factor x reference
    factor = 3.0 / full
    expected = np.full(100, (3 * 0.1 + 0.1 * factor) / 4)
    expected[96:] = (3 * 0.1 + 1e3 * factor) / 4
    np.testing.assert_allclose(out["w"], expected, rtol=1e-5)
    assert float(np.abs(out["w"]).max()) < 0.5  # 255 without the bound (below)
    assert acc.norm_bounded == 1 and acc.capped == 0
    np.testing.assert_allclose(
        np.linalg.norm(states[3]["w"].astype(np.float64) * factor), 3.0, rtol=1e-6
    )

    # the paper's trimmed norm alone (clip-factor 0) lets the 1e3 values through
    paper = ScalableAccumulator(g, percentile=95, max_factor=10.0, clip_factor=0.0)
    for state in states:
        paper.add(state)
    assert float(np.abs(paper.result()["w"]).max()) > 250.0


def test_a_lone_client_is_scaled_to_the_last_reference_and_counted_when_there_is_none() -> None:
    # Prepare: one client, update norm 500 (percentile 100)
    g = {"w": np.zeros(2, np.float32)}
    lone = {"w": np.array([300.0, 400.0], np.float32)}

    # Execute: a layer fewer than two clients move takes the last round's reference (5)
    referenced = ScalableAccumulator(g, percentile=100, previous={"w": 5.0})
    referenced.add(lone)
    bare = ScalableAccumulator(g, percentile=100)
    bare.add(lone)

    # Assert: factor 5 / 500 -> [3, 4]; without any reference factor 1, counted
    np.testing.assert_allclose(referenced.result()["w"], [3.0, 4.0], rtol=1e-6)
    assert referenced.unreferenced == 0 and referenced.references == {}
    np.testing.assert_allclose(bare.result()["w"], [300.0, 400.0])
    assert bare.unreferenced == 1


def test_fedfa_drops_an_update_against_the_servers_direction_before_scaling() -> None:
    # Prepare: global 0, the server's own update d = (1, 0, 0, 0). Honest a = (3, 4, 0, 0)
    # (cosine 0.6) and b = (4, 3, 0, 0) (0.8); the attacker sends -a (cosine -0.6):
    # scaling would give it the honest size, not the honest direction
    g = {"w": np.zeros(4, np.float32)}
    d = {"w": np.array([1.0, 0.0, 0.0, 0.0], np.float32)}
    a = {"w": np.array([3.0, 4.0, 0.0, 0.0], np.float32)}
    b = {"w": np.array([4.0, 3.0, 0.0, 0.0], np.float32)}
    attacker = {"w": -a["w"]}

    # Execute
    acc = ScalableAccumulator(g, percentile=100, direction=d)
    for update in (a, attacker, b):
        acc.add(update)
    honest = ScalableAccumulator(g, percentile=100)
    for update in (a, b):
        honest.add(update)

    # Assert: the attacker is dropped whole (call 1, cosine -0.6), the result is the two
    # honest clients' (both norm 5: reference 5, factor 1, mean (3.5, 3.5, 0, 0))
    assert acc.count == 2
    assert [(call, round(cos, 6)) for call, cos in acc.dropped] == [(1, -0.6)]
    np.testing.assert_allclose(acc.result()["w"], [3.5, 3.5, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(honest.result()["w"], [3.5, 3.5, 0.0, 0.0], rtol=1e-6)


def test_fedfa_compares_a_slice_with_the_same_slice_of_the_direction() -> None:
    # Prepare: a 2x2 global layer; the server's direction is +1 on row 0, -10 on row 1.
    # A width-1/2 slice covers row 0 only: its update (1, 1) agrees with that row
    # (cosine 1); against the whole direction it would have 2 / (sqrt(2) sqrt(202))
    # = 0.0995, under the threshold, only through the row it never trained
    g = {"w": np.zeros((2, 2), np.float32)}
    d = {"w": np.array([[1.0, 1.0], [-10.0, -10.0]], np.float32)}
    narrow = {"w": np.array([[1.0, 1.0]], np.float32)}
    index = {"w": (slice(0, 1), slice(0, 2))}

    # Execute: threshold 0.5; the slice along its own part has cosine 1 -> kept
    acc = ScalableAccumulator(g, percentile=100, direction=d, threshold=0.5)
    acc.add(narrow, index=index)
    acc.add({"w": -narrow["w"]}, index=index)

    # Assert
    assert acc.count == 1
    assert [(call, round(cos, 6)) for call, cos in acc.dropped] == [(1, -1.0)]


def test_fedfa_batch_norm_statistics_are_clipped_apart_from_the_parameters() -> None:
    # Prepare: global statistics mean [0, 0], var [1, 1]; two honest updates move them by
    # L2 distance 0.5 each ([0.3, 0.4] and [0.4, 0.3]); the attacker sends 7e11
    g = {
        "w": np.zeros(2, np.float32),
        "bn.running_mean": np.zeros(2, np.float32),
        "bn.running_var": np.ones(2, np.float32),
        "bn.num_batches_tracked": np.array(0, np.int64),
    }

    def state(mean: list[float], var: float) -> dict[str, np.ndarray]:
        return {
            "w": np.array([1.0, 0.0], np.float32),
            "bn.running_mean": np.array(mean, np.float32),
            "bn.running_var": np.full(2, var, np.float32),
            "bn.num_batches_tracked": np.array(3, np.int64),
        }

    states = [state([0.3, 0.4], 1.0), state([0.4, 0.3], 1.0), state([7e11, 7e11], 7e11)]

    # Execute: the statistics go through the mean aggregator with clip-factor 3
    acc = ScalableAccumulator(g, percentile=100, statistics=MeanAggregator(clip_factor=3.0))
    for s in states:
        acc.add(s)
    out = acc.result()

    # Assert: distances 0.5, 0.5 and D (mean and var together) -> bound 3 x 0.5 = 1.5;
    # the attacker's statistics are moved 1.5 / D of the way, then all three averaged
    big = np.float32(7e11).item()
    distance = math.sqrt(2 * big**2 + 2 * (big - 1.0) ** 2)
    f = 1.5 / distance
    np.testing.assert_allclose(out["bn.running_mean"], [(0.3 + 0.4 + f * big) / 3] * 2, rtol=1e-5)
    np.testing.assert_allclose(out["bn.running_var"], [(3 + f * (big - 1.0)) / 3] * 2, rtol=1e-5)
    report = acc.report()
    # (0.3 and 0.4 in float32, measured in float64: 1.5 to float32's precision)
    assert [(c.position, c.kind) for c in report.clips] == [(2, "statistics")]
    assert report.clips[0].bound == pytest.approx(1.5, rel=1e-6)
    assert int(out["bn.num_batches_tracked"]) == 3
    # without the aggregator (the list functions) they would be averaged: 2.3e11
    plain = ScalableAccumulator(g, percentile=100)
    for s in states:
        plain.add(s)
    assert float(plain.result()["bn.running_var"][0]) > 1e11


# ----------------------------------------------------- the schemes, fold by fold
SUBMODEL = {
    **TINY_DIGITS,
    "model-family": "preresnet",
    "submodel-widths": "1,0.25",
    "norm": "batch",
}


def reply(node: int, arch: str, arrays: Mapping[str, np.ndarray]) -> ClientReply:
    """A validated reply of ``node`` training ``arch`` on 100 examples."""
    return ClientReply(
        node_id=node,
        arch=arch,
        metrics={wire.NUM_EXAMPLES: 100.0},
        arrays={k: np.asarray(v) for k, v in arrays.items()},
        content=RecordDict(),
        bytes_up=0,
        bytes_down=0,
    )


def statistics_of(state: Mapping[str, np.ndarray]) -> np.ndarray:
    """Every batch-norm running statistic of a state, flattened in key order."""
    keys = sorted(k for k in state if k.endswith(("running_mean", "running_var")))
    return np.concatenate([np.asarray(state[k], np.float64).ravel() for k in keys])


@pytest.mark.parametrize("scheme", ["heterofl", "flexifed", "nefl", "fedfa"])
def test_every_submodel_scheme_bounds_batch_norm_statistics(
    scheme: str,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    from server_app.app import build_server

    # Prepare: two honest replies of the full slice move every statistic by +0.01 and
    # every parameter by +0.001; a third sends statistics of 7e11. The server's own
    # direction check (server-trust) is off: these synthetic updates point nowhere in
    # particular, and what is checked here is the statistics' distance bound alone
    config = run_config(
        {**SUBMODEL, "strategy": scheme, "server-trust": False, "output-dir": str(tmp_path)}
    )
    server = build_server(config, bundle=digits_bundle).runner
    arch = server.full_arch
    start = server.sub_state(arch)
    honest = {
        k: v + np.asarray(0.01 if k.endswith(("running_mean", "running_var")) else 0.001, v.dtype)
        if np.issubdtype(v.dtype, np.floating)
        else v
        for k, v in start.items()
    }
    attacker = {
        k: np.full_like(v, 7e11) if k.endswith(("running_mean", "running_var")) else v
        for k, v in honest.items()
    }
    ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))
    d = float(np.linalg.norm(statistics_of(honest) - statistics_of(start)))

    # Execute
    for node, arrays in ((1, honest), (2, attacker), (3, honest)):
        server.fold(ctx, reply(node, arch, arrays))
    record = server.aggregate(ctx, [])

    # Assert: each update's statistics distance is at most clip-factor 3 x the median
    # distance d, so their mean moves the statistics by at most (d + 3 d + d) / 3
    moved = float(np.linalg.norm(statistics_of(server.sub_state(arch)) - statistics_of(start)))
    assert d > 0
    assert moved <= 5 * d / 3 * (1 + 1e-4), (moved, d)
    assert [c["node"] for c in record["clipped"] if c["kind"] == "statistics"] == [2]


def test_fedfa_bounds_a_boosted_node_and_keeps_its_references(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    from server_app.app import build_server

    # Prepare: three honest full-slice replies (random updates of scale 1e-3) and one
    # that sends the first honest update times 100 (run-config attack=boost). The
    # scaling alone is under test: random updates are not along the server's own
    # update, so its direction check (tested apart) is off
    config = run_config(
        {**SUBMODEL, "strategy": "fedfa", "output-dir": str(tmp_path), "server-trust": False}
    )
    server = build_server(config, bundle=digits_bundle).runner
    arch = server.full_arch
    g = server.global_state
    rng = np.random.default_rng(0)
    updates = [
        {
            k: (1e-3 * rng.standard_normal(v.shape)).astype(v.dtype)
            for k, v in g.items()
            if np.issubdtype(v.dtype, np.floating) and not k.endswith(("_mean", "_var"))
        }
        for _ in range(3)
    ]
    updates.insert(1, {k: 100 * v for k, v in updates[0].items()})
    ctx = RoundContext(server_round=1, num_rounds=1, rng=rng)

    # Execute
    for node, update in enumerate(updates):
        server.fold(ctx, reply(node, arch, {k: g[k] + update.get(k, 0) for k in g}))
    record = server.aggregate(ctx, [])

    # Assert: per layer, the reference is at most the median of the honest norms (the
    # attacker's is the largest, left out; a norm is at most the full L2 norm), and no
    # scaled update, so not their mean either, moves the layer by more than clip-factor
    # 3 x the reference
    new = server.global_state
    assert set(server.references) == {k for k in updates[0] if k in server.references}
    for key, reference in server.references.items():
        moved = float(np.linalg.norm(new[key].astype(np.float64) - g[key]))
        honest = sorted(float(np.linalg.norm(u[key])) for i, u in enumerate(updates) if i != 1)
        assert reference <= honest[1] * (1 + 1e-4), key  # float32 rounding of g + u - g
        assert moved <= 3 * reference * (1 + 1e-4), key
    assert record["capped_layers"] == 0 and record["unreferenced_layers"] == 0
    # the references travel in the checkpoint: a later lone node is scaled by them
    state = server.state_dict()
    assert state["fedfa_references"] == server.references
    server.references = {}
    server.load_state_dict(state)
    assert server.references == state["fedfa_references"]


def test_fedfa_drops_a_reversed_node_by_the_servers_own_update(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    from server_app.app import build_server

    # Prepare: default server-trust; the server's own update d of the global model on
    # its pool; three honest replies g + d (plus small noise), one g - d (sign flip at
    # the honest size, which FedFA's scaling alone would let in)
    config = run_config({**SUBMODEL, "strategy": "fedfa", "output-dir": str(tmp_path)})
    server = build_server(config, bundle=digits_bundle).runner
    arch = server.full_arch
    g = server.global_state
    direction = server.pool_direction(server.global_name, g)
    assert direction is not None
    rng = np.random.default_rng(0)
    ctx = RoundContext(server_round=1, num_rounds=1, rng=rng)

    def moved(sign: float) -> dict[str, np.ndarray]:
        return {
            k: (v + sign * direction[k] * (1 + 0.1 * rng.standard_normal(v.shape))).astype(v.dtype)
            if k in direction
            else v
            for k, v in g.items()
        }

    # Execute
    for node, sign in enumerate((1.0, -1.0, 1.0, 1.0)):
        server.fold(ctx, reply(node, arch, moved(sign)))
    record = server.aggregate(ctx, [])

    # Assert: node 1 is recorded as dropped by the direction check (cosine near -1);
    # the others are folded
    dropped = [c for c in record["clipped"] if c["kind"] == "direction"]
    assert [c["node"] for c in dropped] == [1]
    assert dropped[0]["distance"] < -0.9 and dropped[0]["bound"] == 0.0


# ------------------------------------------------------------ ensemble: sound models
def test_output_problem_names_the_split_and_the_samples() -> None:
    probs = np.array([[0.5, 0.5], [np.nan, 0.5], [np.inf, 0.0]])
    assert output_problem(probs, "tuning") == (
        "its outputs on the tuning data are not finite (2 of 3 samples): its logits overflow"
    )
    assert output_problem(np.full((4, 3), 1 / 3), "test") is None


ENSEMBLE = {
    **TINY_DIGITS,
    "strategy": "ensemble",
    "model-family": "cnn",
    "sim-device-profiles": "cpu-small,jetson-orin",
    "ensemble-optimizer": "random,gradient",
    "ensemble-trials": 10,
    "ensemble-gradient-steps": 20,
}


def ensemble_server(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path
) -> Any:
    from server_app.app import build_server

    config = run_config({**ENSEMBLE, "output-dir": str(tmp_path), "run-name": "r"})
    return build_server(config, bundle=digits_bundle).runner


@pytest.mark.parametrize("bad", ["overflow", "nan"])
def test_a_group_model_that_is_not_sound_is_left_out_and_the_rest_exported(
    bad: str,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
) -> None:
    from strategies.ensemble.artifact import load_ensemble

    # Prepare: two group models; cnn-2's weights all 1e18 (a node alone in its group
    # sent them) or NaN
    server = ensemble_server(run_config, digits_bundle, tmp_path)
    server.models.get("cnn-1")
    value = 1e18 if bad == "overflow" else math.nan
    server.models.arrays["cnn-2"] = {
        k: np.full_like(v, value) if np.issubdtype(v.dtype, np.floating) else v
        for k, v in server.initial_arrays("cnn-2").items()
    }
    server.completed_round = 1

    # Execute: tuning after the last round, then the end of the run
    entry = server.tune_ensemble(1)
    ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))
    summary = server.end_of_run(ctx)

    # Assert: cnn-2 left out with its reason; the artifact holds the sound model
    assert entry["members"] == ["cnn-1"] and list(entry["excluded"]) == ["cnn-2"]
    reason = entry["excluded"]["cnn-2"]
    assert ("logits overflow" if bad == "overflow" else "non-finite values") in reason
    assert len(entry["alpha"]) == 1  # one row per sound member
    ensemble = load_ensemble(summary["ensemble_artifact"])
    assert ensemble.archs == ["cnn-1"]


def test_with_no_sound_group_model_the_run_ends_saying_so(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: the only group model holds NaN
    server = ensemble_server(run_config, digits_bundle, tmp_path)
    server.models.arrays["cnn-1"] = {
        k: np.full_like(v, np.nan) if np.issubdtype(v.dtype, np.floating) else v
        for k, v in server.initial_arrays("cnn-1").items()
    }
    server.completed_round = 1
    ctx = RoundContext(server_round=1, num_rounds=1, rng=np.random.default_rng(0))

    # Execute
    with caplog.at_level("ERROR", logger="flwr.tessera"):
        record = server.evaluate(ctx)
        summary = server.end_of_run(ctx)

    # Assert: no crash, no accuracy, the record and the summary say why
    assert record["ensemble"]["members"] == []
    assert "no group model is sound" in record["ensemble"]["error"]
    assert "ensemble_accuracy" not in record
    assert "cnn-1" in summary["ensemble_error"]
    assert "ensemble_artifact" not in summary
    assert "no group model is sound" in caplog.text
    assert not (Path(server.results.directory) / "ensemble.npz").exists()


# ------------------------------------------------------------ ensemble: the family
def node_info(arch: str) -> NodeInfo:
    from models import model_entry

    entry = model_entry(arch)
    return NodeInfo(
        node_id=7,
        ref=ModelRef(arch),
        family=entry.family,
        size_rank=entry.size_rank,
        arch_fits=True,
        num_train=10,
        num_test=2,
        partition_id=0,
        label_counts=(1,) * 10,
        profile={},
    )


def test_the_ensemble_refuses_an_architecture_outside_its_candidate_set(
    run_config: Callable[..., dict[str, Any]], digits_bundle: Any, tmp_path: Path
) -> None:
    from server_app.app import build_server

    cnn = ensemble_server(run_config, digits_bundle, tmp_path / "cnn")
    mixed = build_server(
        run_config({**ENSEMBLE, "model-family": "", "output-dir": str(tmp_path / "mixed")}),
        bundle=digits_bundle,
    ).runner

    assert cnn.refuse_node(node_info("cnn-3")) is None
    reason = cnn.refuse_node(node_info("resnet10"))
    assert reason is not None
    assert "family 'resnet'" in reason and "family 'cnn'" in reason
    assert mixed.refuse_node(node_info("resnet10")) is None  # a member of "mixed"
    reason = mixed.refuse_node(node_info("resnet18"))  # its family, not its member
    assert reason is not None and "'resnet18'" in reason and "'mixed'" in reason


def test_a_hostile_ensemble_fleet_ends_with_an_artifact_of_sound_models(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    from server_app.app import build_server
    from strategies.ensemble.artifact import load_ensemble

    # Prepare: a cnn federation of three nodes: node 100 forced onto resnet10 (another
    # family), node 102 multiplies every weight it sends by 1e18
    config = run_config(
        {**ENSEMBLE, "num-server-rounds": 1, "min-nodes": 2}
        | {"output-dir": str(tmp_path), "run-name": "r"}
    )
    server = build_server(config, bundle=digits_bundle).runner
    grid = make_grid(config, 3)
    grid.contexts[100].node_config["arch"] = "resnet10"

    def boost(message: Message) -> Message:
        arrays = message.content.array_records[wire.ARRAYS]
        for key in list(arrays):
            value = arrays[key].numpy()
            if np.issubdtype(value.dtype, np.floating):
                from flwr.app import Array

                arrays[key] = Array((value * np.float32(1e18)).astype(value.dtype))
        return message

    grid.tamper[102] = boost

    # Execute
    server.start(grid, num_rounds=1, timeout=60.0)

    # Assert: the foreign node refused at the handshake, naming both families; the run
    # finished and exported only finite models
    reasons = [r.reason for r in server.table.rejections if r.node_id == 100]
    assert reasons and "family 'resnet'" in reasons[0] and "family 'cnn'" in reasons[0]
    assert 100 not in server.nodes
    artifact = server.final_metrics["ensemble_artifact"]
    ensemble = load_ensemble(artifact)
    for arch in ensemble.archs:
        assert all(np.isfinite(v).all() for v in server.models.get(arch).values()), arch
    record = server.rounds[-1]
    assert set(record["ensemble"]["members"]) == set(ensemble.archs)


def test_a_lone_first_round_layer_is_bounded_by_the_ceiling() -> None:
    # Prepare: global layer (3, 4) (norm 5); one client, no earlier reference, moves it
    # by (300, 400) (norm 500); clip-ceiling 2 -> at most 2 x 5 = 10
    g = {"w": np.array([3.0, 4.0], np.float32)}
    lone = {"w": np.array([303.0, 404.0], np.float32)}
    # Execute
    bounded = ScalableAccumulator(g, percentile=100, ceiling=2.0)
    bounded.add(lone)
    free = ScalableAccumulator(g, percentile=100)
    free.add(lone)
    # Assert: factor 10 / 500 -> update (6, 8) -> (9, 12); without a ceiling factor 1
    np.testing.assert_allclose(bounded.result()["w"], [9.0, 12.0], rtol=1e-5)
    np.testing.assert_allclose(free.result()["w"], [303.0, 404.0], rtol=1e-6)
    assert bounded.unreferenced == 1


def test_a_lone_first_round_layer_of_norm_zero_is_bounded_by_the_models_scale() -> None:
    # Prepare: a layer "w" (3, 4) of norm 5 and a bias "b" of zeros (as every batch-norm
    # bias starts): its own norm gives no ceiling. One client, alone, sends 1e30 in both
    g = {"w": np.array([3.0, 4.0], np.float32), "b": np.zeros(2, np.float32)}
    lone = {"w": np.array([1e30, 1e30], np.float32), "b": np.full(2, 1e30, np.float32)}

    # Execute
    acc = ScalableAccumulator(g, percentile=100, ceiling=2.0)
    acc.add(lone)
    out = acc.result()

    # Assert: the bias's yardstick is its size at the scaled layers' root mean square,
    # sqrt(25 / 4) x sqrt(2) = 3.536; ceiling 2 -> its update has norm 7.07: (5, 5)
    np.testing.assert_allclose(out["b"], [5.0, 5.0], rtol=1e-5)
    assert float(np.linalg.norm(out["w"] - g["w"])) == pytest.approx(10.0, rel=1e-5)
    assert acc.unreferenced == 2
