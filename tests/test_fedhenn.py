"""FedHeNN driven through the real ClientApp on a fake grid, plus its pieces in isolation.

Three nodes on digits (partitions 0, 1, 2 emulating cpu-small, cpu-large and
jetson-orin), as in tests/test_strategies.py. The slow tests at the end run a real
Flower simulation and a real deployment.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ConfigRecord, Message, RecordDict
from torch import nn

from models import get_model, list_models
from strategies.fedhenn import linear_cka
from strategies.fedhenn.client import FedHeNNClient
from strategies.fedhenn.kbar import average_kernel, factorise, unit_scale
from strategies.fedhenn.options import FedHeNNOptions
from strategies.fedhenn.payload import ALIGN, PROBE, RAD_ROUND_KEY, REP, representation_problem
from strategies.fedhenn.server import RadSampler
from tessera import wire
from tessera.config import ConfigError, RunConfig
from tessera.data import split_server_pool
from tests.conftest import (
    install_fast_clients,
    memory_state,
    round_input,
    simulated_rounds,
    torch_threads,
)
from tests.test_strategies import TINY, Federation, run_federation

ROOT = Path(__file__).resolve().parents[1]
ALIGNING = {"strategy": "fedhenn", "eta0": 1.0}


def corrupt_rep(change: Callable[[np.ndarray], np.ndarray]) -> Callable[[Message], Message | None]:
    """A tamper hook replacing the reply's RAD representation (when it has one)."""

    def hook(reply: Message) -> Message | None:
        if not reply.has_content() or REP not in reply.content.array_records:
            return None
        record = reply.content.array_records[REP]
        record["rep"] = Array(np.ascontiguousarray(change(record["rep"].numpy())))
        return reply

    return hook


def with_nan(rep: np.ndarray) -> np.ndarray:
    out = rep.copy()
    out[3, 0] = np.nan
    return out


RUNS: dict[str, dict[str, Any]] = {
    "hetero": {"overrides": {**ALIGNING, "fedhenn-mode": "heterogeneous"}, "rounds": 3},
    "hetero-rbf": {
        "overrides": {
            **ALIGNING,
            "fedhenn-mode": "heterogeneous",
            "cka-kernel": "rbf",
            "cka-estimator": "unbiased",
            "kbar-weights": "capacity",
        },
        "rounds": 2,
    },
    "hetero-eta0": {"overrides": {"strategy": "fedhenn", "eta0": 0.0}, "rounds": 2},
    "homo": {"overrides": {**ALIGNING, "fedhenn-mode": "homogeneous"}, "rounds": 2},
    "homo-eta0": {
        "overrides": {"strategy": "fedhenn", "fedhenn-mode": "homogeneous", "eta0": 0.0},
        "rounds": 2,
    },
    "fedavg": {"overrides": {"strategy": "fedavg"}, "rounds": 2},
    "bad-rows": {
        "overrides": {**ALIGNING, "fedhenn-mode": "heterogeneous"},
        "tamper": {22: corrupt_rep(lambda r: r[:-1])},
    },
    "bad-nan": {
        "overrides": {**ALIGNING, "fedhenn-mode": "heterogeneous"},
        "tamper": {22: corrupt_rep(with_nan)},
    },
    "bad-zero": {
        "overrides": {**ALIGNING, "fedhenn-mode": "heterogeneous"},
        "tamper": {22: corrupt_rep(lambda r: np.ones_like(r))},
    },
}


@pytest.fixture(scope="module")
def federation(
    default_run_config: dict[str, Any],
    digits_bundle: Any,
    candidate_cost_cache: dict[tuple[Any, ...], Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], Federation]]:
    """``federation(name)``: the finished run ``RUNS[name]``, run on first use."""
    done: dict[str, Federation] = {}
    with pytest.MonkeyPatch.context() as mp, torch_threads(1):
        install_fast_clients(mp, digits_bundle, candidate_cost_cache)

        def get(name: str) -> Federation:
            if name not in done:
                spec = RUNS[name]
                rounds = spec.get("rounds", 2)
                config = {
                    **default_run_config,
                    **TINY,
                    **spec["overrides"],
                    "num-server-rounds": rounds,
                }
                done[name] = run_federation(
                    config,
                    digits_bundle,
                    tmp_path_factory.mktemp(name) / "run",
                    num_rounds=rounds,
                    tamper=spec.get("tamper"),
                )
            return done[name]

        yield get


FederationRunner = Callable[[str], Federation]


def server_pool_x(fed: Federation, digits_bundle: Any) -> np.ndarray:
    _, pool = split_server_pool(
        digits_bundle, pool_fraction=fed.server.env.run.data.server_pool_fraction, seed=42
    )
    return pool.x


def rad_arrays(message: Message) -> dict[str, np.ndarray]:
    out = {}
    for name in (ALIGN, PROBE):
        records = message.content.array_records
        if name in records and "x" in records[name]:
            out[name] = records[name]["x"].numpy()
    return out


def rad_records(message: Message) -> set[str]:
    return set(message.content.array_records) & {ALIGN, PROBE}


# --------------------------------------------------------------------------- options
def test_options_defaults_are_the_papers(default_run_config: dict[str, Any]) -> None:
    # Execute
    options = FedHeNNOptions.parse(default_run_config)

    # Assert
    assert options.mode == "heterogeneous"
    assert options.kernel == "linear"
    assert not options.unbiased
    assert options.eta0 == pytest.approx(0.001)
    assert options.rad_size == 5000
    assert options.kbar_weights == "uniform"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"fedhenn-mode": "mixed"}, "'fedhenn-mode' is 'mixed'; use one of homogeneous"),
        ({"cka-kernel": "cosine"}, "use one of linear, rbf"),
        ({"eta0": -1.0}, "'eta0' is -1.0"),
        ({"rad-size": 2}, "'rad-size' is 2"),
        ({"rad-batch": 3}, "use 0 (the whole RAD) or at least 4"),
        ({"kbar-energy": 1.5}, "'kbar-energy' is 1.5"),
        ({"fedhenn-precision": "int8"}, "use one of float16, float32"),
    ],
)
def test_bad_options_raise_naming_key_and_fix(
    default_run_config: dict[str, Any], overrides: dict[str, Any], fragment: str
) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError) as info:
        FedHeNNOptions.parse({**default_run_config, **overrides})
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("schedule", "etas"),
    [
        ("sqrt", [0.0, 0.5, 0.5 * math.sqrt(2), 0.5 * math.sqrt(3), 1.0]),
        ("linear", [0.0, 0.5, 1.0, 1.5, 2.0]),
        ("constant", [0.5] * 5),
    ],
)
def test_eta_grows_with_the_round(schedule: str, etas: list[float]) -> None:
    # Prepare
    options = FedHeNNOptions(arch=None, exclude_unfit=False, eta0=0.5, eta_schedule=schedule)

    # Execute / Assert
    assert [options.eta(t) for t in range(1, 6)] == pytest.approx(etas)


def test_client_constructor_picks_the_mode(default_run_config: dict[str, Any]) -> None:
    # Prepare
    run = RunConfig.from_flower(default_run_config)
    hetero = FedHeNNOptions(arch=None, exclude_unfit=False, mode="heterogeneous")
    homo = FedHeNNOptions(arch=None, exclude_unfit=False, mode="homogeneous")

    # Execute
    first = FedHeNNClient(run=run, options=hetero)
    second = FedHeNNClient(run=run, options=homo)

    # Assert
    assert first.heterogeneous
    assert first.keeps_personal_model and not first.sends_weights
    assert not second.heterogeneous
    assert second.sends_weights and not second.keeps_personal_model


# ------------------------------------------------------------------------------- RAD
def test_unit_scale_hand_values_and_zero_peak() -> None:
    # Execute / Assert: divided by the largest magnitude, cast last
    scaled = unit_scale(np.array([[1e6, -2e6], [5e5, 0.0]]), "float16")
    assert scaled.dtype == np.float16
    assert scaled.tolist() == [[0.5, -1.0], [0.25, 0.0]]
    assert unit_scale(np.zeros((2, 2))).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_features_past_float16_range_are_sent_finite_with_their_cka() -> None:
    # Prepare: features of order 1e6, which float16 (max 65504) cannot hold
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(32, 6)) * 1e6
    with np.errstate(over="ignore"):
        assert not np.all(np.isfinite(raw.astype(np.float16)))

    # Execute: what the client now sends at fedhenn-precision='float16'
    sent = unit_scale(raw, "float16")

    # Assert: finite, accepted by the server's check, and the same representation
    # to CKA (invariant to the scale) within float16's rounding
    assert np.all(np.isfinite(sent))
    content = RecordDict({REP: wire.numpy_to_record({"rep": sent})})
    assert representation_problem(content, rows=32, dim=6) is None
    cka = linear_cka(torch.from_numpy(raw), torch.from_numpy(sent.astype(np.float64)))
    assert float(cka) == pytest.approx(1.0, abs=1e-5)


def test_clients_send_features_past_float16_range_finite_and_accepted(
    default_run_config: dict[str, Any],
    digits_bundle: Any,
    candidate_cost_cache: dict[tuple[Any, ...], Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: every model's features scaled by 1e6, past float16's 65504, through
    # the real client, server and grid (the default fedhenn-precision is float16)
    import strategies.fedhenn.client as fedhenn_client

    features = fedhenn_client._eval_features
    monkeypatch.setattr(fedhenn_client, "_eval_features", lambda model, x: features(model, x) * 1e6)
    install_fast_clients(monkeypatch, digits_bundle, candidate_cost_cache)
    config = {**default_run_config, **TINY, **RUNS["hetero"]["overrides"], "num-server-rounds": 2}

    # Execute
    with torch_threads(1):
        fed = run_federation(config, digits_bundle, tmp_path / "run", num_rounds=2)

    # Assert: the representations arrive finite, scaled to a peak of 1, and none is
    # rejected (before the scale they were infinities, rejected as non-finite)
    reps = [
        r.content.array_records[REP]["rep"].numpy()
        for r in fed.grid.replies_of("train")
        if REP in r.content.array_records
    ]
    assert reps
    for rep in reps:
        assert rep.dtype == np.float16 and np.all(np.isfinite(rep))
        assert float(np.max(np.abs(rep))) == 1.0
    assert all(r["num_rejected"] == 0 for r in fed.server.rounds), fed.server.rounds


def test_rad_sampler_draws_pool_rows_seeded_by_round() -> None:
    # Prepare: a pool of 50 distinct rows
    pool = np.arange(50 * 4, dtype=np.float32).reshape(50, 1, 2, 2)
    sampler = RadSampler(pool, rad_size=20, seed=7, dtype="float32")

    # Execute
    first, again, second = sampler.draw(1), sampler.draw(1), sampler.draw(2)

    # Assert
    assert first.shape == (20, 1, 2, 2)
    rows = {r.tobytes() for r in pool}
    assert all(r.tobytes() in rows for r in np.concatenate([first, second]))
    assert len({r.tobytes() for r in first}) == 20
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(
        RadSampler(pool, rad_size=20, seed=7, dtype="float32").draw(2), second
    )


def test_rad_size_is_capped_at_the_pool() -> None:
    # Prepare / Execute
    sampler = RadSampler(
        np.zeros((12, 3), dtype=np.float32), rad_size=5000, seed=1, dtype="float16"
    )

    # Assert
    assert sampler.rows == 12
    assert sampler.draw(3).dtype == np.float16


def test_too_small_pool_raises_with_the_fix() -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match="server-pool-fraction"):
        RadSampler(np.zeros((3, 2), dtype=np.float32), rad_size=10, seed=1, dtype="float32")


@pytest.mark.parametrize("name", ["hetero", "homo"])
def test_rad_comes_only_from_the_server_pool(
    federation: FederationRunner, digits_bundle: Any, name: str
) -> None:
    # Prepare
    fed = federation(name)
    pool = server_pool_x(fed, digits_bundle).astype(np.float16)
    pool_rows = {r.tobytes() for r in pool}

    # Execute
    sent = [rad_arrays(m) for m in fed.grid.sent_of("train")]

    # Assert
    assert any(sent), "no RAD was sent"
    for records in sent:
        for rad in records.values():
            assert rad.shape == (len(pool), 1, 8, 8)  # rad-size 5000 capped at the pool
            assert all(row.tobytes() in pool_rows for row in rad)


# ------------------------------------------------------------------- heterogeneous mode
def test_heterogeneous_round_trip(federation: FederationRunner) -> None:
    # Execute
    fed = federation("hetero")

    # Assert: round 1 probes only, round 2 aligns and probes, round 3 (last) aligns only
    by_round: dict[int, list[Message]] = {}
    for m in fed.grid.sent_of("train"):
        by_round.setdefault(int(m.content.config_records[wire.CONFIG]["server-round"]), []).append(
            m
        )
    assert [rad_records(m) for m in by_round[1]] == [{PROBE}] * 3
    assert [rad_records(m) for m in by_round[2]] == [{ALIGN, PROBE}] * 3
    assert [rad_records(m) for m in by_round[3]] == [{ALIGN}] * 3
    for rnd in (2, 3):
        for m in by_round[rnd]:
            config = m.content.config_records[wire.CONFIG]
            assert config["fedhenn-eta"] > 0
            assert wire.ARRAYS not in m.content.array_records
            # every node kept the previous round's probe RAD: only K_bar's factor travels
            assert set(m.content.array_records[ALIGN]) == {"target"}
            assert config[RAD_ROUND_KEY] == rnd - 1
    for m in by_round[2]:
        assert m.content.config_records[wire.CONFIG]["fedhenn-eta"] == pytest.approx(1.0)
    first, second, third = fed.server.rounds
    assert all(r["num_ok"] == 3 and r["num_rejected"] == 0 for r in fed.server.rounds)
    assert first["eta"] == 0.0 and first["cka_mean"] is None
    assert second["eta"] == pytest.approx(1.0)
    assert 0.0 < second["cka_mean"] <= 1.0
    assert third["eta"] == pytest.approx(math.sqrt(2.0))
    assert second["alignment_seconds"] > 0
    assert 0.0 < second["alignment_share"] < 1.0
    assert all(c["alignment_steps"] > 0 for c in second["fedhenn_clients"])
    assert third["global_accuracy"] is None  # no global model in this mode


def test_heterogeneous_mode_keeps_personal_models_in_client_state(
    federation: FederationRunner,
) -> None:
    # Execute
    fed = federation("hetero")

    # Assert
    choices = fed.node_choices()
    assert len(set(choices.values())) > 1, choices
    for reply in fed.grid.replies_of("train"):
        assert wire.ARRAYS not in reply.content.array_records
    for node, context in fed.grid.contexts.items():
        assert "tessera.model" in context.state.array_records, node
        assert context.state.config_records["tessera.model-meta"]["arch"] == choices[node]
    for record in fed.server.rounds:
        assert {c["node"]: c["arch"] for c in record["clients"]} == choices


def test_heterogeneous_replies_carry_representations_of_each_width(
    federation: FederationRunner,
) -> None:
    # Execute
    fed = federation("hetero")

    # Assert
    choices = fed.node_choices()
    firsts = fed.grid.replies_of("train")[:3]
    for reply in firsts:
        rep = reply.content.array_records[REP]["rep"].numpy()
        arch = choices[reply.metadata.src_node_id]
        dim = get_model(arch, input_shape=(1, 8, 8), num_classes=10).feature_dim
        assert rep.shape == (144, dim)
        assert rep.dtype == np.float16


def test_transmitted_kbar_keeps_cka_above_099_and_cuts_bytes(
    federation: FederationRunner,
) -> None:
    # Execute
    fed = federation("hetero")

    # Assert
    probed = [r for r in fed.server.rounds if "kbar_cka" in r]
    assert len(probed) == 2
    for record in probed:
        assert record["kbar_cka"] >= 0.99
        assert 1 <= record["kbar_rank"] <= 144
        assert record["kbar_bytes"] == 144 * record["kbar_rank"] * 2
        assert record["kernel_bytes_sent"] < record["kernel_bytes_naive"]
        # the representations were folded as they arrived (3 of 144 x width float16),
        # so the server held at most the 144 x 144 float64 kernel, not them
        assert 0 < record["kbar_fold_peak_bytes"] <= 144 * 144 * 8
    assert fed.server.rounds[1]["kernel_bytes_naive"] == 2 * 4 * 144 * 144


def test_rbf_unbiased_capacity_weighted_variant_runs(federation: FederationRunner) -> None:
    # Execute
    fed = federation("hetero-rbf")

    # Assert
    first, second = fed.server.rounds
    assert first["num_ok"] == second["num_ok"] == 3
    assert first["kbar_cka"] >= 0.99
    assert second["cka_mean"] is not None


def test_heterogeneous_with_eta0_zero_sends_no_alignment_data(
    federation: FederationRunner,
) -> None:
    # Execute
    fed = federation("hetero-eta0")

    # Assert: it is 'local' training: no RAD down, no representation up
    for message in fed.grid.sent_of("train"):
        assert len(message.content.array_records) == 0
    for reply in fed.grid.replies_of("train"):
        assert len(reply.content.array_records) == 0
    for record in fed.server.rounds:
        assert all(c["bytes_down"] < 1024 for c in record["clients"])


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("bad-rows", "representation has 143 rows but the RAD has 144"),
        ("bad-nan", "representation has non-finite values"),
        ("bad-zero", "representation has zero norm after centring"),
    ],
)
def test_bad_representation_is_rejected_and_the_round_continues(
    federation: FederationRunner, name: str, fragment: str
) -> None:
    # Execute: node 22's representations are corrupted
    fed = federation(name)

    # Assert
    first, second = fed.server.rounds
    assert first["num_rejected"] == 1
    assert first["num_ok"] == 2
    (rejection,) = first["rejected"]
    assert rejection["node"] == 22
    assert fragment in rejection["reason"]
    assert "kbar_cka" in first  # K_bar built from the two valid replies
    assert second["num_ok"] == 3  # the last round asks for no representation
    assert second["cka_mean"] is not None


def test_representation_problem_accepts_a_good_representation() -> None:
    # Prepare
    rep = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float16)
    content = RecordDict({REP: wire.numpy_to_record({"rep": rep})})

    # Execute / Assert
    assert representation_problem(content, rows=10, dim=4) is None
    assert "shape (10, 4), expected (10, 5)" in str(representation_problem(content, rows=10, dim=5))
    assert "missing" in str(representation_problem(RecordDict(), rows=10, dim=4))


# --------------------------------------------------------------------- homogeneous mode
def test_homogeneous_mode_trains_one_global_model_with_alignment(
    federation: FederationRunner,
) -> None:
    # Execute
    fed = federation("homo")

    # Assert
    shared = fed.server.shared_arch
    assert set(fed.server.assignment.values()) == {shared}
    first, second = fed.server.rounds
    assert first["eta"] == 0.0 and first["rad_rows"] == 0
    assert second["eta"] == pytest.approx(1.0) and second["rad_rows"] == 144
    assert 0.0 < second["cka_mean"] <= 1.0
    for record in fed.server.rounds:
        assert record["global_accuracy"] is not None
        assert record["num_ok"] == 3
    round_one = fed.grid.sent_of("train")[:3]
    assert all(ALIGN not in m.content.array_records for m in round_one)


def test_homogeneous_with_eta0_zero_reproduces_fedavg(federation: FederationRunner) -> None:
    # Execute
    henn = federation("homo-eta0")
    avg = federation("fedavg")

    # Assert: same architecture, bit-identical global models after 2 rounds
    assert henn.server.shared_arch == avg.server.shared_arch
    assert henn.server.global_arrays is not None and avg.server.global_arrays is not None
    assert list(henn.server.global_arrays) == list(avg.server.global_arrays)
    for key, value in avg.server.global_arrays.items():
        np.testing.assert_array_equal(henn.server.global_arrays[key], value, err_msg=key)
    for message in henn.grid.sent_of("train"):
        assert set(message.content.array_records) == {wire.ARRAYS}
    henn_accs = [r["global_accuracy"] for r in henn.server.rounds]
    assert henn_accs == [r["global_accuracy"] for r in avg.server.rounds]


# ------------------------------------------------------------------------ client maths
def aligned_client(
    default_run_config: dict[str, Any], *, rad_batch: int
) -> tuple[FedHeNNClient, nn.Module, RecordDict]:
    run = RunConfig.from_flower(default_run_config)
    options = FedHeNNOptions(
        arch=None, exclude_unfit=False, mode="homogeneous", rad_batch=rad_batch
    )
    client = FedHeNNClient(run=run, options=options)
    assert not client.heterogeneous
    torch.manual_seed(0)
    model = get_model("cnn-3", input_shape=(1, 8, 8), num_classes=10)
    rad = np.random.default_rng(1).random((24, 1, 8, 8)).astype(np.float32)
    content = RecordDict(
        {
            wire.CONFIG: ConfigRecord({"server-round": 3, "fedhenn-eta": 0.7}),
            ALIGN: wire.numpy_to_record({"x": rad}),
        }
    )
    return client, model, content


def test_client_loss_gradient_is_that_of_task_plus_eta_one_minus_cka(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare: whole RAD per step (rad-batch 0), so the objective is deterministic
    client, model, content = aligned_client(default_run_config, rad_batch=0)
    client.begin_round(model, round_input(content), memory_state())
    with torch.no_grad():  # move away from the global model so CKA < 1
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.train()
    x = torch.rand(6, 1, 8, 8)
    y = torch.tensor([0, 1, 2, 3, 4, 5])
    rad = torch.from_numpy(content.array_records[ALIGN]["x"].numpy())
    target = client.align_target
    assert target is not None

    twin = copy.deepcopy(model)  # same weights and batch-norm statistics

    # Execute: the client's loss (alignment backward inside) then the loop's backward
    model.zero_grad()
    loss = client.loss_fn()(model, x, y)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters() if p.grad is not None]

    # Assert: against the direct objective CE + 0.7 * (1 - CKA(features, target))
    task = nn.functional.cross_entropy(twin(x), y)
    twin.eval()
    cka = linear_cka(twin.forward_features(rad), target)
    expected = task + 0.7 * (1.0 - cka)
    expected.backward()
    want = [p.grad for p in twin.parameters() if p.grad is not None]
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert 0.0 < cka.item() < 1.0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert client.steps == 1 and client.align_seconds > 0


def test_alignment_pass_leaves_batch_norm_statistics_alone(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare
    client, model, content = aligned_client(default_run_config, rad_batch=8)
    client.begin_round(model, round_input(content), memory_state())
    model.train()
    x = torch.rand(6, 1, 8, 8)
    y = torch.zeros(6, dtype=torch.int64)
    reference = get_model("cnn-3", input_shape=(1, 8, 8), num_classes=10)
    reference.load_state_dict(model.state_dict())
    reference.train()

    # Execute
    client.loss_fn()(model, x, y)
    nn.functional.cross_entropy(reference(x), y)

    # Assert: running statistics moved exactly as with the task forward pass alone
    for (name, buf), ref in zip(model.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(buf, ref, msg=name)
    assert model.training


def test_eta_zero_client_is_plain_cross_entropy(default_run_config: dict[str, Any]) -> None:
    # Prepare
    client, model, content = aligned_client(default_run_config, rad_batch=8)
    content[wire.CONFIG]["fedhenn-eta"] = 0.0

    # Execute
    client.begin_round(model, round_input(content), memory_state())

    # Assert
    from tessera.training import cross_entropy_loss

    assert client.loss_fn() is cross_entropy_loss
    assert client.align_x is None and client.setup_seconds == 0.0


# ------------------------------------------------------------------------ K_bar maths
def test_average_linear_kernel_factor_equals_the_weighted_normalised_kernels() -> None:
    # Prepare
    rng = np.random.default_rng(3)
    reps = [rng.normal(size=(20, d)) for d in (3, 7, 12)]
    weights = [1.0, 2.0, 1.0]

    # Execute
    exact = average_kernel(reps, weights, kernel="linear")

    # Assert
    h = np.eye(20) - 1.0 / 20
    expected = np.zeros((20, 20))
    for w, a in zip(np.array(weights) / 4.0, reps, strict=True):
        k = h @ a @ a.T @ h
        expected += w * k / np.linalg.norm(k)
    # 3 + 7 + 12 = 22 columns >= 20 rows: K_bar comes as the matrix, not the factor
    assert exact.z is None and exact.matrix is not None
    np.testing.assert_allclose(exact.matrix, expected, atol=1e-12)
    narrow = average_kernel(reps[:2], weights[:2], kernel="linear")  # 10 columns < 20
    assert narrow.z is not None
    h_expected = sum(
        w * (h @ a @ a.T @ h) / np.linalg.norm(h @ a @ a.T @ h)
        for w, a in zip(np.array(weights[:2]) / 3.0, reps[:2], strict=True)
    )
    np.testing.assert_allclose(narrow.z @ narrow.z.T, h_expected, atol=1e-12)


@pytest.mark.parametrize("kernel", ["linear", "rbf"])
def test_factor_of_kbar_from_every_cnn_keeps_cka_above_099(digits_bundle: Any, kernel: str) -> None:
    # Prepare: representations of the server pool by the five cnn sizes
    _, pool = split_server_pool(digits_bundle, pool_fraction=0.1, seed=42)
    x = torch.from_numpy(pool.x)
    reps = []
    for i, arch in enumerate(list_models("cnn")):
        torch.manual_seed(i)
        model = get_model(arch, input_shape=(1, 8, 8), num_classes=10).eval()
        with torch.no_grad():
            reps.append(model.forward_features(x).numpy().astype(np.float16))
    exact = average_kernel(reps, [1.0] * len(reps), kernel=kernel)
    n = len(pool)

    # Execute
    shipped = factorise(exact, energy=0.99, dtype="float16")

    # Assert
    assert shipped.cka >= 0.99
    assert shipped.factor.shape == (n, shipped.rank)
    assert shipped.nbytes < n * n  # at least 4x fewer bytes than n x n float32
    exact32 = factorise(exact, energy=1.0, dtype="float32")
    assert exact32.cka == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------------- end to end
SIM = (
    "strategy='fedhenn' num-server-rounds=2 local-epochs=1 eta0=1.0 "
    "sim-device-profiles='cpu-small,cpu-large,jetson-orin'"
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_heterogeneous_simulation_two_rounds(tmp_path: Path) -> None:
    # Execute
    rounds = simulated_rounds(tmp_path, f"{SIM} fedhenn-mode='heterogeneous'")

    # Assert
    first, second = rounds
    assert first["num_ok"] == second["num_ok"] == 3
    assert len({c["arch"] for c in first["clients"]}) >= 2
    assert first["kbar_cka"] >= 0.99
    assert second["cka_mean"] is not None and second["eta"] == pytest.approx(1.0)
    assert second["global_accuracy"] is None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_homogeneous_simulation_two_rounds(tmp_path: Path) -> None:
    # Execute
    rounds = simulated_rounds(tmp_path, f"{SIM} fedhenn-mode='homogeneous'")

    # Assert
    first, second = rounds
    assert first["num_ok"] == second["num_ok"] == 3
    assert len({c["arch"] for c in second["clients"]}) == 1
    assert second["cka_mean"] is not None and second["rad_rows"] == 144
    assert second["global_accuracy"] is not None


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    not (ROOT / ".venv" / "bin" / "flower-superlink").exists(),
    reason="needs .venv with Flower (run scripts/setup.sh)",
)
def test_heterogeneous_through_deploy_local(tmp_path: Path) -> None:
    # Prepare
    run_config = (
        "strategy='fedhenn' fedhenn-mode='heterogeneous' eta0=1.0 num-server-rounds=2 "
        f"local-epochs=1 round-timeout=120 output-dir='{tmp_path / 'results'}' run-name='e2e'"
    )
    cmd = [
        "bash",
        str(ROOT / "scripts" / "deploy-local.sh"),
        "--nodes",
        "3",
        "--profiles",
        "cpu-small,cpu-large,jetson-orin",
        "--run-config",
        run_config,
        "--workdir",
        str(tmp_path / "deploy"),
        "--timeout",
        "200",
    ]

    # Execute
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=230)

    # Assert
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    lines = (tmp_path / "results" / "e2e" / "metrics.jsonl").read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert first["num_ok"] == second["num_ok"] == 3
    assert len({c["arch"] for c in first["clients"]}) >= 2
    assert first["kbar_cka"] >= 0.99
    assert second["cka_mean"] is not None
    # personal models persisted in the SuperNodes: no weights travelled either way
    assert all(c["bytes_up"] < 64 * 1024 for c in second["clients"])


def _hand_kbar(reps: list[np.ndarray], weights: list[float], kernel: str) -> np.ndarray:
    """sum_j w_j K_j / ||K_j||_F / sum_j w_j, each K_j centred, built the long way."""
    n = reps[0].shape[0]
    h = np.eye(n) - 1.0 / n
    total = np.zeros((n, n))
    for w, a in zip(weights, reps, strict=True):
        if kernel == "linear":
            k = h @ a @ a.T @ h
        else:
            from strategies.fedhenn.cka import rbf_kernel

            k = h @ rbf_kernel(torch.from_numpy(a / np.abs(a).max())).numpy() @ h
        total += w * k / np.linalg.norm(k)
    return total / sum(weights)


@pytest.mark.parametrize(
    ("kernel", "dims"),
    [
        ("linear", (3, 5, 4)),  # 12 columns < 16 rows: the factor form throughout
        ("linear", (6, 7, 9, 5, 8)),  # 13 then 22 >= 16: switches to the matrix at the 3rd
        ("rbf", (3, 5, 4)),
    ],
)
def test_the_folded_kbar_equals_the_buffered_one(kernel: str, dims: tuple[int, ...]) -> None:
    from strategies.fedhenn.kbar import KernelAccumulator

    # Prepare: 16 RAD rows, representations of several widths, weights of any scale
    rng = np.random.default_rng(5)
    reps = [rng.normal(size=(16, d)) for d in dims]
    weights = [float(w) for w in rng.integers(1, 50, size=len(dims))]

    # Execute: folded one at a time, as replies arrive
    acc = KernelAccumulator(kernel)
    held = []
    for rep, w in zip(reps, weights, strict=True):
        acc.add(rep, w)
        held.append(acc.nbytes)
    exact = acc.result()

    # Assert: the kernel the buffered formula gives, to 1e-12 (float64 rounding), and
    # what is held never exceeds the 16 x 16 matrix or the factor narrower than it
    got = exact.z @ exact.z.T if exact.z is not None else exact.matrix
    np.testing.assert_allclose(got, _hand_kbar(reps, weights, kernel), atol=1e-12)
    assert max(held) <= 16 * max(16, 16 + max(dims)) * 8
    if kernel == "linear" and sum(dims) >= 16:
        assert exact.z is None and held[-1] == 16 * 16 * 8  # the matrix, however many more
    # the same weights scaled by 1000 give the same K_bar
    scaled = KernelAccumulator(kernel)
    for rep, w in zip(reps, weights, strict=True):
        scaled.add(rep, 1000.0 * w)
    again = scaled.result()
    np.testing.assert_allclose(
        again.z @ again.z.T if again.z is not None else again.matrix, got, atol=1e-12
    )


def test_the_kbar_fold_refuses_bad_input_and_keeps_nothing_of_it() -> None:
    from strategies.fedhenn.kbar import KernelAccumulator, KernelAverageError

    acc = KernelAccumulator("rbf")
    with pytest.raises(KernelAverageError, match="at least one of positive weight"):
        acc.result()
    with pytest.raises(KernelAverageError, match="zero norm after centring"):
        acc.add(np.ones((8, 3)), 1.0)
    assert acc.nbytes == 0 and acc.count == 0
    acc.add(np.random.default_rng(0).normal(size=(8, 3)), 1.0)
    with pytest.raises(KernelAverageError, match=r"shape \(7, 3\) after 8 rows"):
        acc.add(np.zeros((7, 3)), 1.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(KernelAverageError, match="must be finite and non-negative"):
            acc.add(np.random.default_rng(1).normal(size=(8, 3)), bad)
    assert acc.count == 1
    with pytest.raises(KernelAverageError, match="unknown kernel 'cosine'"):
        KernelAccumulator("cosine")
