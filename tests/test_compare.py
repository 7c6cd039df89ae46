"""The evaluation protocol: metrics against hand-computed values, the report, the command."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import compare
from tessera.compare.ceiling import (
    CeilingSettings,
    ceiling_learning_rates,
    pooled_data,
    train_centralised,
)
from tessera.compare.metrics import (
    Partitioning,
    ProtocolError,
    beats_floor,
    bytes_per_client_round,
    ceiling_for,
    ceiling_key,
    ceiling_rates,
    mean_curve,
    parse_partitioning,
    plateau_round,
    run_fields,
    spread,
)
from tessera.compare.report import (
    beats_floor_summary,
    flat_rows,
    markdown_tables,
    plot_all,
    write_csv,
)
from tessera.data import PartitionConfig, load_bundle


# ----------------------------------------------------------------- partitionings
@pytest.mark.parametrize(
    ("text", "expected", "label"),
    [
        ("iid", Partitioning("iid"), "iid"),
        ("dirichlet:0.5", Partitioning("dirichlet", alpha=0.5), "dirichlet(0.5)"),
        ("Dirichlet(0.1)", Partitioning("dirichlet", alpha=0.1), "dirichlet(0.1)"),
        ("pathological:2", Partitioning("pathological", classes=2), "pathological(2)"),
        ("pathological(3)", Partitioning("pathological", classes=3), "pathological(3)"),
    ],
)
def test_parse_partitioning(text: str, expected: Partitioning, label: str) -> None:
    part = parse_partitioning(text)
    assert part == expected and part.label == label
    assert parse_partitioning(part.label) == part  # labels parse back


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("shards", "'shards' is unknown"),
        ("dirichlet:x", "alpha 'x' is not a number"),
        ("dirichlet:-1", "alpha must be > 0"),
        ("pathological:0", "classes must be >= 1"),
        ("pathological:1.5", "classes '1.5' is not an integer"),
        ("iid:3", "unknown"),
    ],
)
def test_parse_partitioning_rejects(text: str, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_partitioning(text)


def test_partitioning_run_config_sets_every_key() -> None:
    assert Partitioning("pathological", classes=3).run_config() == {
        "partitioner": "pathological",
        "dirichlet-alpha": 0.5,
        "classes-per-client": 3,
    }
    assert Partitioning("dirichlet", alpha=0.5).slug == "dirichlet-0.5"


# ----------------------------------------------------------------- maths
def test_plateau_round_hand_values() -> None:
    # final 1.0 -> target 0.95: first reached in round 4
    assert plateau_round([0.2, 0.5, 0.9, 0.95, 1.0]) == 4
    # final 0.8 -> target 0.76: round 2 (0.78) already; round 3 dips, still round 2
    assert plateau_round([0.1, 0.78, 0.5, 0.8]) == 2
    assert plateau_round([None, 0.9, float("nan"), 0.9]) == 2
    assert plateau_round([0.5, 0.6], fraction=1.0) == 2
    assert plateau_round([0.3, None]) is None
    assert plateau_round([]) is None
    assert plateau_round([0.0, 0.0]) is None


def _record(rnd: int, clients: list[tuple[int, str, int, int]], **extra: Any) -> dict[str, Any]:
    return {
        "round": rnd,
        "skipped": False,
        "clients": [
            {"partition_id": p, "arch": a, "bytes_up": up, "bytes_down": down}
            for p, a, up, down in clients
        ],
        "num_rejected": 0,
        "num_failed": 0,
        **extra,
    }


def test_bytes_per_client_round_hand_values() -> None:
    rounds = [
        _record(1, [(0, "a", 100, 10), (1, "b", 200, 20)]),
        {**_record(2, [(0, "a", 999, 999)]), "skipped": True},  # not counted
        _record(3, [(0, "a", 300, 30)]),
    ]
    # 3 client-rounds: up (100 + 200 + 300) / 3, down (10 + 20 + 30) / 3
    assert bytes_per_client_round(rounds) == (200.0, 20.0)
    assert bytes_per_client_round([]) == (0.0, 0.0)


def test_run_fields_reads_every_family_the_same_way() -> None:
    rounds = [
        _record(
            1,
            [(0, "cnn-1", 10, 20), (1, "cnn-5", 30, 40)],
            personal_accuracy_mean=0.5,
            personal_accuracy_std=0.1,
            global_accuracy=None,
        ),
        _record(
            2,
            [(0, "cnn-1", 10, 20), (1, "cnn-5", 30, 40)],
            personal_accuracy_mean=0.8,
            personal_accuracy_std=0.05,
            personal_accuracy_by_arch={"cnn-1": 0.7, "cnn-5": 0.9},
            global_accuracy=0.6,
            global_accuracy_by_arch={"full": 0.6},
            submodel_accuracy={"full": 0.6, "full@w0.5": 0.4},
            ensemble_accuracy=0.75,
            num_rejected=2,
        ),
    ]
    f = run_fields(rounds)
    assert f["rounds"] == 2 and f["personal"] == 0.8 and f["personal_clients_std"] == 0.05
    assert f["personal_curve"] == [0.5, 0.8] and f["global_curve"] == [None, 0.6]
    assert f["global"] == 0.6 and f["global_by_arch"] == {"full": 0.6}
    assert f["slices"] == {"full": 0.6, "full@w0.5": 0.4} and f["ensemble"] == 0.75
    assert f["plateau_personal"] == 2 and f["plateau_global"] == 2
    assert (f["bytes_up"], f["bytes_down"], f["bytes"]) == (20.0, 30.0, 50.0)
    assert f["client_archs"] == {"0": "cnn-1", "1": "cnn-5"}
    assert f["archs"] == ["cnn-1", "cnn-5"] and f["rejected"] == 2 and f["failed"] == 0
    # a scheme without global model, slices or ensemble reports the same keys, empty
    plain = run_fields(rounds[:1])
    assert set(plain) == set(f)
    assert plain["global"] is None and plain["slices"] == {} and plain["ensemble"] is None
    with pytest.raises(ProtocolError, match="no round records"):
        run_fields([])


def test_spread_and_floor() -> None:
    s = spread([0.5, None, 0.7, float("nan")])
    assert s.n == 2 and s.mean == pytest.approx(0.6) and s.std == pytest.approx(0.1)
    assert s.text() == "60.0 ± 10.0"
    assert spread([None]).text() == "-"
    assert spread([0.9]).std == 0.0
    assert beats_floor([0.6, 0.8], [0.5, 0.7]) is True
    assert beats_floor([0.6], [0.6]) is False  # equal is not better
    assert beats_floor([None], [0.5]) is None


def test_mean_curve_aligns_on_round_one() -> None:
    mean, std = mean_curve([[0.2, 0.4, 0.6], [0.4, 0.6]])
    assert mean[:2] == pytest.approx([0.3, 0.5]) and std[:2] == pytest.approx([0.1, 0.1])
    assert mean[2] == pytest.approx(0.6) and std[2] == 0.0
    mean, _ = mean_curve([[None, 0.5]])
    assert math.isnan(mean[0])


def test_ceiling_for_matches_each_client_to_its_architecture() -> None:
    central = {
        "cnn-1": {"personal": {"0": 0.6, "1": 0.8}, "global": 0.7},
        "cnn-5": {"personal": {"0": 0.9, "1": 1.0}, "global": 0.95},
    }
    # client 0 trains cnn-1 (0.6), client 1 cnn-5 (1.0); global models cnn-1 and cnn-5
    personal, glob = ceiling_for({"0": "cnn-1", "1": "cnn-5"}, ["cnn-1", "cnn-5"], central)
    assert personal == pytest.approx(0.8) and glob == pytest.approx(0.825)
    # a client with an empty held-out split is left out, not counted as zero
    central["cnn-1"]["personal"].pop("0")
    assert ceiling_for({"0": "cnn-1", "1": "cnn-5"}, [], central) == (1.0, None)
    # an architecture that was not trained centrally: no ceiling
    assert ceiling_for({"0": "vgg"}, ["vgg"], central) == (None, None)


def test_a_run_with_its_own_learning_rate_gets_the_ceiling_at_that_rate() -> None:
    # Arrange: cnn-5 trained centrally at the common rate and at 0.01
    central = {
        "cnn-5": {"personal": {"0": 0.9}, "global": 0.9},
        "cnn-5 lr=0.01": {"personal": {"0": 0.6}, "global": 0.5},
    }
    cell = _cell("tuned", 0, 0.7, global_by_arch={"cnn-5": 0.4})
    cell["run_config"] = {"strategy": "tuned", "learning-rate": 0.01}
    ceiling = {**_central(0), "centralised": central}

    # Execute
    rows = {r["scheme"]: r for r in flat_rows([cell, ceiling])}

    # Assert: the 0.01 entry, not the common one; a rate with no entry: no ceiling
    assert ceiling_key("cnn-5", 0.01) == "cnn-5 lr=0.01" and ceiling_key("cnn-5") == "cnn-5"
    assert ceiling_for({"0": "cnn-5"}, ["cnn-5"], central, 0.01) == (0.6, 0.5)
    assert rows["tuned"]["ceiling_global"] == pytest.approx(0.5)
    assert ceiling_for({"0": "cnn-5"}, ["cnn-5"], central, 0.02) == (None, None)


# ----------------------------------------------------------------- report
def _cell(scheme: str, seed: int, personal: float, **fields: Any) -> dict[str, Any]:
    base = run_fields(
        [
            _record(
                1,
                [(0, "cnn-1", 100, 100), (1, "cnn-5", 100, 100)],
                personal_accuracy_mean=personal / 2,
                global_accuracy=None,
            ),
            _record(
                2,
                [(0, "cnn-1", 100, 100), (1, "cnn-5", 100, 100)],
                personal_accuracy_mean=personal,
                personal_accuracy_by_arch={"cnn-1": personal - 0.05, "cnn-5": personal + 0.05},
                global_accuracy=fields.pop("global_accuracy", None),
                global_accuracy_by_arch=fields.pop("global_by_arch", {}),
                submodel_accuracy=fields.pop("slices", {}),
            ),
        ]
    )
    return {
        "key": f"{scheme}--iid--seed{seed}",
        "kind": "scheme",
        "scheme": scheme,
        "partitioning": "iid",
        "seed": seed,
        "fields": base,
        "seconds": 1.0,
    }


def _central(seed: int) -> dict[str, Any]:
    return {
        "key": f"centralised--iid--seed{seed}",
        "kind": "centralised",
        "scheme": "centralised",
        "partitioning": "iid",
        "seed": seed,
        "centralised": {
            "cnn-1": {"personal": {"0": 0.9, "1": 0.9}, "global": 0.9},
            "cnn-5": {"personal": {"0": 1.0, "1": 1.0}, "global": 1.0},
        },
        "seconds": 2.0,
    }


def _cells() -> list[dict[str, Any]]:
    cells = []
    for seed, shift in ((0, 0.0), (1, 0.02)):
        cells += [
            _cell("local", seed, 0.70 + shift),
            _cell("good", seed, 0.80 + shift, global_accuracy=0.6, global_by_arch={"cnn-5": 0.6}),
            _cell("bad", seed, 0.60 + shift, slices={"cnn-5": 0.5, "cnn-5@w0.5": 0.4}),
            _central(seed),
        ]
    return cells


def test_flat_rows_ceiling_and_floor() -> None:
    rows = {(r["scheme"], r["seed"]): r for r in flat_rows(_cells())}
    good = rows[("good", 0)]
    # own archs: client 0 cnn-1 (0.9), client 1 cnn-5 (1.0); global model cnn-5 (1.0)
    assert good["ceiling_personal"] == pytest.approx(0.95)
    assert good["ceiling_global"] == pytest.approx(1.0)
    assert good["beats_floor"] is True and rows[("bad", 1)]["beats_floor"] is False
    assert rows[("local", 0)]["beats_floor"] is None
    ceiling = rows[("centralised", 0)]
    assert ceiling["personal"] == pytest.approx(0.95) and ceiling["global"] == pytest.approx(0.95)
    assert ceiling["bytes"] == 0.0


def test_markdown_tables_flag_a_scheme_below_the_floor(tmp_path: Path) -> None:
    rows = flat_rows(_cells())
    text = markdown_tables(rows, ["good", "bad", "local"])
    lines = text.splitlines()
    assert lines[0] == "### iid (2 seeds: 0, 1)"
    good = next(line for line in lines if line.startswith("| good |"))
    bad = next(line for line in lines if line.startswith("| bad |"))
    # good: 0.80 and 0.82 -> 81.0 ± 1.0; floor 71.0 -> +10.0, above in both seeds
    assert "| 81.0 ± 1.0 | 60.0 ± 0.0 |" in good and "above floor (+10.0; 2/2 seeds)" in good
    assert "**not above floor** (-10.0; 0/2 seeds)" in bad
    assert "| local (floor) | 71.0 ± 1.0 |" in text
    assert "| centralised (ceiling) | 95.0 ± 0.0 | 95.0 ± 0.0 |" in text
    assert "- bad: cnn-5: 50.0 ± 0.0; cnn-5@w0.5: 40.0 ± 0.0" in text
    # bytes: 100 up + 100 down per client-round
    assert "| 0.2 kB |" in good
    # the floor and the ceiling come last, whatever order the schemes are given in
    order = [line.split("|")[1].strip() for line in lines if line.startswith("| ")][1:]
    assert order == ["good", "bad", "local (floor)", "centralised (ceiling)"]

    write_csv(rows, tmp_path / "results.csv")
    with (tmp_path / "results.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 8 and table[0]["scheme"] == "local"
    assert json.loads(next(r for r in table if r["scheme"] == "bad")["slices"])["cnn-5"] == 0.5
    paths = plot_all(rows, ["good", "bad", "local"], tmp_path)
    assert [p.name for p in paths] == [
        "accuracy_rounds.png",
        "accuracy_vs_bytes.png",
        "accuracy_by_arch.png",
        "margin_over_floor.png",
    ]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_a_scheme_is_judged_against_the_floor_of_its_own_architectures(tmp_path: Path) -> None:
    # Arrange: "sub" trains other architectures; its floor "local:sub" is stronger
    cells = []
    for seed in (0, 1):
        cells += [
            _cell("local", seed, 0.50),
            _cell("local:sub", seed, 0.80),
            _cell("sub", seed, 0.70),
            _cell("good", seed, 0.60),
        ]
    floors = {"sub": "local:sub", "good": "local"}

    # Execute
    rows = {(r["scheme"], r["seed"]): r for r in flat_rows(cells, floors)}
    text = markdown_tables(list(rows.values()), ["good", "sub", "local", "local:sub"])

    # Assert: 0.70 is above local (0.50) but below its own floor (0.80)
    assert rows[("sub", 0)]["floor"] == "local:sub" and rows[("sub", 0)]["beats_floor"] is False
    assert rows[("good", 1)]["beats_floor"] is True
    assert rows[("local:sub", 0)]["beats_floor"] is None
    sub = next(line for line in text.splitlines() if line.startswith("| sub |"))
    assert "**not above floor** (-10.0; 0/2 seeds) vs local:sub" in sub
    assert "| local:sub (floor) | 80.0 ± 0.0 |" in text
    order = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    assert order[1:] == ["good", "sub", "local (floor)", "local:sub (floor)"]
    assert beats_floor_summary(list(rows.values()))["iid"] == {"good": True, "sub": False}


def test_floor_verdict_pairs_seeds_and_leaves_out_a_seed_without_a_floor() -> None:
    # seed 0: 0.70 vs 0.60; seed 1: 0.90 but no floor run yet
    cells = [_cell("local:sub", 0, 0.60), _cell("sub", 0, 0.70), _cell("sub", 1, 0.90)]
    text = markdown_tables(flat_rows(cells, {"sub": "local:sub"}), ["sub", "local:sub"])
    sub = next(line for line in text.splitlines() if line.startswith("| sub |"))
    assert "above floor (+10.0; 1/1 seeds) vs local:sub" in sub  # not 80.0 - 60.0


def test_a_value_missing_for_some_seeds_says_how_many_it_covers() -> None:
    # Arrange: seed 1's ceiling is not trained yet
    cells = [c for c in _cells() if c["key"] != "centralised--iid--seed1"]

    # Execute
    text = markdown_tables(flat_rows(cells), ["good", "bad", "local"])

    # Assert: good's ceiling is seed 0's alone (0.95), and says so
    good = next(line for line in text.splitlines() if line.startswith("| good |"))
    assert "| 95.0 ± 0.0 (1 of 2 seeds) |" in good
    assert "| 81.0 ± 1.0 | 60.0 ± 0.0 |" in good  # values every seed has: unmarked


def test_a_ray_address_is_where_runs_go_not_a_setting_of_the_results() -> None:
    # Execute
    parser = compare.build_parser()
    joined = compare.comparison_from_args(parser.parse_args(["--ray-address", "127.0.0.1:6379"]))
    own = compare.comparison_from_args(parser.parse_args([]))

    # Assert: the cells' folder and keys are the same with and without a cluster
    assert joined.ray_address == "127.0.0.1:6379" and own.ray_address is None
    assert joined.settings.fingerprint() == own.settings.fingerprint()
    assert [c.key for c in joined.cells()] == [c.key for c in own.cells()]


def test_family_floors_of_every_scheme() -> None:
    # Execute
    comparison = compare.comparison_from_args(compare.build_parser().parse_args([]))

    # Assert: cnn schemes share local; each other candidate set has its own floor
    floors = comparison.floors
    for name in ("fedavg", "fedavg-groups", "fedprox", "fedhenn", "felo", "velo", "fedhe"):
        assert floors[name] == "local", name
    assert floors["ensemble"] == "local:ensemble"
    assert floors["heterofl"] == "local:heterofl" and floors["flexifed"] == "local:flexifed"
    assert floors["fedfa"] == floors["nefl"] == "local:fedfa"  # the same slices
    assert comparison.order[:5] == [
        "local",
        "local:ensemble",
        "local:fedfa",
        "local:flexifed",
        "local:heterofl",
    ]
    fedfa_floor = next(c for c in comparison.cells() if c.scheme == "local:fedfa")
    assert dict(fedfa_floor.config) == {
        "strategy": "local",
        "local-like": "fedfa",
        "norm": "static-batch",
    }
    assert fedfa_floor.key == "local-like-fedfa--iid--seed0"
    plain = compare.comparison_from_args(compare.build_parser().parse_args(["--no-family-floors"]))
    assert plain.floors == {} and plain.order[:2] == ["local", "ensemble"]


# ----------------------------------------------------------------- the ceiling
def _write_npz(path: Path) -> Path:
    digits = load_bundle("digits")
    np.savez(
        path,
        x_train=digits.train.x[:600].reshape(600, 8, 8),
        y_train=digits.train.y[:600],
        x_test=digits.test.x[:200].reshape(200, 8, 8),
        y_test=digits.test.y[:200],
    )
    return path


def _ceiling_settings(
    tmp_path: Path, part: PartitionConfig, *, num_partitions: int, epochs: int
) -> CeilingSettings:
    """The leaderboard's SGD settings on a small npz copy of digits."""
    return CeilingSettings(
        dataset=f"npz:{_write_npz(tmp_path / 'd.npz')}",
        partition=part,
        num_partitions=num_partitions,
        pool_fraction=0.1,
        test_fraction=0.2,
        epochs=epochs,
        batch_size=32,
        learning_rate=0.05,
        momentum=0.9,
        weight_decay=0.0,
    )


def test_ceiling_pools_exactly_the_clients_training_splits(tmp_path: Path) -> None:
    from tessera.data import client_data

    part = PartitionConfig(scheme="dirichlet", alpha=0.5, seed=3)
    settings = _ceiling_settings(tmp_path, part, num_partitions=4, epochs=4)
    dataset = settings.dataset
    pooled, tests, server_test, classes, shape = pooled_data(settings)
    expected = [
        client_data(
            dataset,
            partition_id=i,
            num_partitions=4,
            partition=part,
            pool_fraction=0.1,
            test_fraction=0.2,
        )
        for i in range(4)
    ]
    assert np.array_equal(pooled.y, np.concatenate([train.y for train, _ in expected]))
    assert all(np.array_equal(t.x, e.x) for t, (_, e) in zip(tests, expected, strict=True))
    assert len(server_test) == 200 and classes == 10 and shape == (1, 8, 8)

    lines: list[str] = []
    out = train_centralised(settings, ["cnn-4", "cnn-3", "cnn-4"], seed=0, log=lines.append)
    assert sorted(out) == ["cnn-3", "cnn-4"] and len(lines) == 2
    for entry in out.values():
        assert entry["epochs"] == 4 and entry["train_examples"] == len(pooled)
        assert set(entry["personal"]) <= {"0", "1", "2", "3"}
        assert 0.5 < entry["global"] <= 1.0  # 4 epochs on 486 digits: far above 10 % chance
    # deterministic under the seed
    again = train_centralised(settings, ["cnn-3"], seed=0)
    assert again["cnn-3"]["global"] == out["cnn-3"]["global"]


def test_ceiling_halves_the_learning_rate_where_the_loss_diverges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tessera.training as training

    real = training.train_model

    def nan_above(limit: float) -> Any:
        def train(model: Any, data: Any, *, optim: Any, **kwargs: Any) -> Any:
            if optim.learning_rate > limit:
                raise FloatingPointError("local loss became nan")
            return real(model, data, optim=optim, **kwargs)

        return train

    settings = _ceiling_settings(
        tmp_path, PartitionConfig(scheme="iid", seed=0), num_partitions=2, epochs=1
    )
    assert ceiling_learning_rates(0.05) == [0.05, 0.025, 0.0125]

    # diverges at 0.05, trains at 0.025: recorded
    monkeypatch.setattr(training, "train_model", nan_above(0.03))
    lines: list[str] = []
    out = train_centralised(settings, ["cnn-3"], seed=0, log=lines.append)
    assert out["cnn-3"]["learning_rate"] == 0.025 and out["cnn-3"]["global"] is not None
    assert "nan at learning rate 0.05" in lines[0]

    # diverges at every rate: no ceiling, and no ceiling for the runs that trained it
    monkeypatch.setattr(training, "train_model", nan_above(0.0))
    out = train_centralised(settings, ["cnn-3"], seed=0)
    assert out["cnn-3"]["diverged"] and out["cnn-3"]["global"] is None
    assert ceiling_for({"0": "cnn-3"}, ["cnn-3"], out) == (None, None)


# ----------------------------------------------------------------- the command
def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = compare.main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--schemes", "fedavg,nope"], "unknown scheme(s) ['nope']"),
        (["--partitionings", "shards"], "partitioning 'shards' is unknown"),
        (["--seeds", "a"], "--seeds 'a': give integers"),
        (["--nodes", "1"], "at least 2 clients"),
        (["--set", "no-such-key=1"], "['no-such-key'] are not Tessera keys"),
        (["--set", "norm"], "'norm' is not key=value"),
        (["--set", "aggregator=nope"], "run-config 'aggregator' is 'nope'"),
        (["--set", "clip-norm=-1"], "clip-norm"),
        (["--scheme-set", "fedfa:fedfa-percentile=150"], "fedfa-percentile"),
        (["--scheme-set", "fedavg=1"], "is not scheme:key=value"),
        (["--schemes", "fedavg", "--scheme-set", "felo:felo-alpha=1"], "'felo' is tuned or set"),
        (["--tune", "fedhenn:eta0=0.1|1", "--seeds", "7"], "also a reported seed"),
    ],
)
def test_command_refuses_bad_settings(
    args: list[str],
    match: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_simulation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("bad settings must be refused before any simulation starts")

    monkeypatch.setattr(compare, "simulate", no_simulation)
    code, out = _main([*args, "--out", str(tmp_path)], capsys)
    assert code == 2 and match in out
    assert not (tmp_path / "cells.jsonl").exists()


def test_command_refuses_a_folder_of_other_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = _main(["--schemes", "local", "--report-only", "--out", str(tmp_path)], capsys)
    assert code == 0 and (tmp_path / "settings.json").exists()
    code, out = _main(
        ["--schemes", "local", "--rounds", "3", "--report-only", "--out", str(tmp_path)], capsys
    )
    assert code == 2 and "rounds: 15 -> 3" in out and "pass another --out" in out


def test_all_schemes_and_scheme_settings() -> None:
    import strategies

    names = compare.all_schemes()
    assert names[-1] == "local" and "flwr-fedavg" not in names
    assert set(names) == set(strategies.list_schemes()) - {"flwr-fedavg"}
    assert compare.check_schemes(["local", "felo"]) == ["felo", "local"]
    assert compare.scheme_config("fedhenn", {"fedhenn": {"eta0": 1.0}}) == {
        "strategy": "fedhenn",
        "eta0": 1.0,
    }
    assert compare.run_config_text({"a": "x", "b": 2, "c": True, "d": 0.5}) == (
        "a='x' b=2 c=true d=0.5"
    )
    with pytest.raises(ProtocolError, match="holds a quote"):
        compare.format_value("it's")
    assert [compare.parse_value(v) for v in ("true", "3", "0.5", "x")] == [True, 3, 0.5, "x"]


def test_a_personalised_row_is_its_scheme_with_run_config_personalise() -> None:
    # Execute
    comparison = compare.comparison_from_args(
        compare.build_parser().parse_args(
            ["--schemes", "all,fedavg-groups+ditto,heterofl+rep", "--no-ceiling"]
        )
    )

    # Assert: 'all' expanded in place, the variants their own rows with their scheme's
    # floor and the mode in their run-config
    assert comparison.schemes[-3:] == ["fedavg-groups+ditto", "heterofl+rep", "local"]
    assert comparison.floors["fedavg-groups+ditto"] == "local"
    assert comparison.floors["heterofl+rep"] == "local:heterofl"
    assert compare.scheme_config("fedavg-groups+ditto", {}) == {
        "strategy": "fedavg-groups",
        "personalise": "ditto",
    }
    cell = next(c for c in comparison.cells() if c.scheme == "heterofl+rep")
    assert dict(cell.config)["personalise"] == "rep" and cell.key.startswith("heterofl+rep--")
    assert compare.split_variant("felo") == ("felo", None)


@pytest.mark.parametrize(
    ("name", "named"),
    [
        ("fedhe+ditto", "shares no whole model"),
        ("fedavg-groups+maml", "is not one of finetune, ditto, rep"),
        ("fedavg-groups+none", "is not one of"),
        ("nosuch+ditto", "unknown scheme"),
    ],
)
def test_a_bad_personalised_row_is_refused(name: str, named: str) -> None:
    with pytest.raises(ProtocolError, match=named):
        compare.check_schemes([name])


def finish_tuning(
    comparison: compare.Comparison,
    cells: list[compare.Cell],
    scores: dict[str, float],
    archs: tuple[str, ...] = (),
) -> None:
    """Record tuning cells as finished, each with the score of its candidate value."""
    for cell in cells:
        comparison._append(
            {
                "key": cell.key,
                "kind": "scheme",
                "scheme": cell.label,
                "partitioning": cell.partitioning.label,
                "seed": cell.seed,
                "run_config": dict(cell.config),
                "fields": {"personal": scores[cell.variant], "archs": list(archs)},
                "seconds": 0.0,
            }
        )


def test_tuning_keeps_the_best_value_of_the_validation_seed(tmp_path: Path) -> None:
    args = compare.build_parser().parse_args(
        ["--schemes", "fedhenn", "--tune", "fedhenn:eta0=0.1|1.0", "--out", str(tmp_path)]
    )
    comparison = compare.comparison_from_args(args)
    assert comparison.tune == {"fedhenn": {"eta0": [0.1, 1.0]}}
    tuning = comparison.tuning_cells()
    assert {c.seed for c in tuning} == {7} and len(tuning) == 2 * 3
    part = comparison.partitionings[0]
    assert comparison.chosen("fedhenn", part) == {}  # nothing run yet: the scheme's own
    finish_tuning(
        comparison,
        [c for c in tuning if c.partitioning == part],
        {"eta0=0.1": 0.4, "eta0=1.0": 0.9},
    )
    assert comparison.chosen("fedhenn", part) == {"eta0": 1.0}
    fedhenn = next(
        c for c in comparison.cells() if c.scheme == "fedhenn" and c.partitioning == part
    )
    assert dict(fedhenn.config)["eta0"] == 1.0
    other = comparison.partitionings[1]
    assert (
        dict(
            next(
                c for c in comparison.cells() if c.scheme == "fedhenn" and c.partitioning == other
            ).config
        )["eta0"]
        == compare.SCHEME_SETTINGS["fedhenn"]["eta0"]
    )


def test_a_personalised_row_takes_its_schemes_tuned_values(tmp_path: Path) -> None:
    # Arrange: the ensemble's learning rate and ensemble+ditto's lambda are tuned
    args = compare.build_parser().parse_args(
        [
            "--schemes",
            "ensemble,ensemble+ditto",
            "--partitionings",
            "iid",
            "--tune",
            "ensemble:learning-rate=0.05|0.01",
            "--tune",
            "ensemble+ditto:ditto-lambda=0.1|1",
            "--out",
            str(tmp_path),
        ]
    )
    comparison = compare.comparison_from_args(args)

    # Act: the scheme's candidates first, then the row's on top of its choice
    finish_tuning(
        comparison,
        comparison.tuning_cells(["ensemble"]),
        {"learning-rate=0.05": 0.5, "learning-rate=0.01": 0.8},
    )
    row_tuning = comparison.tuning_cells(["ensemble+ditto"])
    finish_tuning(comparison, row_tuning, {"ditto-lambda=0.1": 0.7, "ditto-lambda=1": 0.6})

    # Assert: the row's candidates and its reported cells run at the scheme's rate
    assert {dict(c.config)["learning-rate"] for c in row_tuning} == {0.01}
    by_scheme = {c.scheme: dict(c.config) for c in comparison.cells()}
    assert by_scheme["ensemble"]["learning-rate"] == 0.01
    assert by_scheme["local:ensemble"]["learning-rate"] == 0.01
    assert by_scheme["ensemble+ditto"]["learning-rate"] == 0.01
    assert by_scheme["ensemble+ditto"]["ditto-lambda"] == 0.1
    assert "ditto-lambda" not in by_scheme["ensemble"]


def test_a_tuned_learning_rate_tunes_the_ceiling_on_the_validation_seed(tmp_path: Path) -> None:
    # Arrange: the ensemble's rate tuned over 0.05|0.02 (0.05 chosen); on the
    # validation seed mobilenet trained centrally reached 30 % at 0.05 and 90 % at
    # 0.02, vgg 90 % at both (a tie: the chosen rate stays)
    args = compare.build_parser().parse_args(
        [
            "--schemes",
            "ensemble",
            "--partitionings",
            "iid",
            "--seeds",
            "0",
            "--tune",
            "ensemble:learning-rate=0.05|0.02",
            "--out",
            str(tmp_path),
        ]
    )
    comparison = compare.comparison_from_args(args)
    part = comparison.partitionings[0]
    finish_tuning(
        comparison,
        comparison.tuning_cells(),
        {"learning-rate=0.05": 0.8, "learning-rate=0.02": 0.5},
        archs=("mobilenetv2_035", "vgg11_0125"),
    )
    assert comparison.ceiling_choice("ensemble", part) == {}  # no validation ceiling yet
    comparison._append(
        {
            "key": f"centralised--{part.slug}--seed7",
            "kind": "centralised",
            "scheme": "centralised",
            "partitioning": part.label,
            "seed": 7,
            "centralised": {
                "mobilenetv2_035 lr=0.05": {"personal": {"0": 0.2, "1": 0.4}, "global": 0.3},
                "mobilenetv2_035 lr=0.02": {"personal": {"0": 0.9, "1": 0.9}, "global": 0.9},
                "vgg11_0125 lr=0.05": {"personal": {"0": 0.9, "1": 0.9}, "global": 0.9},
                "vgg11_0125 lr=0.02": {"personal": {"0": 0.9, "1": 0.9}, "global": 0.9},
                "cnn-1": {"personal": {"0": 0.5}, "global": 0.5},
            },
            "seconds": 1.0,
        }
    )
    ensemble_run = {
        "key": "ensemble--iid--seed0",
        "kind": "scheme",
        "scheme": "ensemble",
        "partitioning": part.label,
        "seed": 0,
        "run_config": {"strategy": "ensemble", "learning-rate": 0.05},
        "fields": {
            "personal": 0.9,
            "archs": ["mobilenetv2_035", "vgg11_0125"],
            "global_by_arch": {},
        },
        "seconds": 1.0,
    }
    comparison._append(ensemble_run)

    # Act
    choice = comparison.ceiling_choice("ensemble", part)
    plan = comparison.ceiling_plan(0, part, comparison.done())
    validation_plan = comparison.ceiling_plan(7, part, comparison.done())

    # Assert: mobilenet's ceiling at 0.02, vgg's at the chosen 0.05; the family floor
    # takes the scheme's; an untuned scheme none; seed 0 trains the tuned entries, and
    # the validation seed each candidate at its own rate
    assert choice == {"mobilenetv2_035": 0.02, "vgg11_0125": 0.05}
    assert comparison.ceiling_grid("local:ensemble", part, comparison.done()) == [0.05, 0.02]
    assert comparison.ceiling_choice("local", part) == {}
    assert plan == {
        "mobilenetv2_035 lr=0.02": ("mobilenetv2_035", 0.02),
        "vgg11_0125 lr=0.05": ("vgg11_0125", 0.05),
    }
    assert set(validation_plan) == {
        f"{a} lr={r}" for a in ("mobilenetv2_035", "vgg11_0125") for r in ("0.05", "0.02")
    }
    central = {
        "mobilenetv2_035 lr=0.05": {"personal": {"0": 0.1}, "global": 0.1},
        "mobilenetv2_035 lr=0.02": {"personal": {"0": 0.95}, "global": 0.95},
    }
    assert ceiling_for({"0": "mobilenetv2_035"}, [], central, 0.05) == (0.1, None)
    assert ceiling_for({"0": "mobilenetv2_035"}, [], central, 0.05, choice) == (0.95, None)


def test_ceiling_rates_take_the_best_mean_and_skip_diverged_entries() -> None:
    cell = {
        "m lr=0.05": {"personal": {"0": 0.9, "1": 0.1}},  # mean 0.5
        "m lr=0.02": {"personal": {"0": 0.6, "1": 0.6}},  # mean 0.6
        "d lr=0.05": {"diverged": True, "personal": {}},
        "d lr=0.02": {"personal": {"0": 0.3}},
        "plain": {"personal": {"0": 1.0}},  # the common rate: not a candidate
    }
    assert ceiling_rates(cell, [0.05, 0.02]) == {"m": 0.02, "d": 0.02}
    assert ceiling_rates(cell, [0.01]) == {}


def test_a_finished_cell_with_another_run_config_runs_again(tmp_path: Path) -> None:
    # Arrange: fedhenn finished on seed 0 with eta0=0.1, then the validation seed chose 1.0
    args = compare.build_parser().parse_args(
        ["--schemes", "fedhenn", "--seeds", "0", "--partitionings", "iid", "--out", str(tmp_path)]
    )
    comparison = compare.comparison_from_args(args)
    logged: list[str] = []
    comparison.log = logged.append
    cells = comparison.cells()
    fedhenn = next(c for c in cells if c.scheme == "fedhenn")
    floor = next(c for c in cells if c.scheme == compare.FLOOR)
    for cell in (fedhenn, floor):
        comparison._append(cell.row({"personal": 0.5}, seconds=0.0))
    assert comparison.pending(cells) == []
    retuned = compare.Cell(
        fedhenn.scheme, fedhenn.partitioning, fedhenn.seed, (("strategy", "fedhenn"), ("eta0", 1.0))
    )

    # Execute
    todo = comparison.pending([retuned, floor])

    # Assert
    assert todo == [retuned]
    assert any("eta0 0.1 -> 1.0" in line for line in logged), logged


# ----------------------------------------------------------------- end to end
def _local_hub_dataset(root: Path) -> Path:
    """A Hugging Face dataset folder (parquet train/test splits) made from digits."""
    import datasets

    digits = load_bundle("digits")
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)}
    )
    (root / "data").mkdir(parents=True)
    for split, data, n in (("train", digits.train, 500), ("test", digits.test, 200)):
        images = [(x.reshape(8, 8) * 255 / max(x.max(), 1e-6)).astype(np.uint8) for x in data.x[:n]]
        table = datasets.Dataset.from_dict(
            {"image": images, "label": data.y[:n].tolist()}, features=features
        )
        table.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return root


@pytest.mark.slow
def test_compare_runs_flower_simulations_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two schemes (fedavg-groups, and the floor) on a flwr-datasets data set read from a
    local folder, through real Flower simulations; then the ceiling; a rerun runs nothing."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    dataset = f"hf:{_local_hub_dataset(tmp_path / 'hub-digits')}"
    out = tmp_path / "cmp"
    from tests.ray_nodes import shared_head_address

    address = shared_head_address()  # the suite's one Ray head (no Ray start per run)
    args = [
        *(["--ray-address", address] if address else []),
        "--schemes", "fedavg-groups",
        "--partitionings", "dirichlet:0.5",
        "--seeds", "3",
        "--rounds", "2",
        "--nodes", "3",
        "--fleet", "cpu-small,cpu-large",
        "--dataset", dataset,
        "--out", str(out),
    ]  # fmt: skip
    code, text = _main(args, capsys)
    assert code == 0, text[-3000:]
    assert '"rounds": 2' in text and f"--dataset {dataset}" in text  # the settings, printed
    lines = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    last = {r["key"]: r for r in lines}  # the ceiling is recorded architecture by architecture
    rows = list(last.values())
    assert list(last) == [
        "local--dirichlet-0.5--seed3",
        "fedavg-groups--dirichlet-0.5--seed3",
        "centralised--dirichlet-0.5--seed3",
    ]
    assert len(lines) == 2 + len(rows[2]["centralised"])
    fedavg = rows[1]["fields"]
    assert fedavg["rounds"] == 2 and len(fedavg["personal_curve"]) == 2
    assert fedavg["global"] is not None and fedavg["bytes"] > 10_000  # weights, both ways
    assert rows[0]["fields"]["global"] is None and rows[0]["fields"]["bytes"] < 2_000
    # every run saw exactly the same split, fleet and seed
    configs = [
        json.loads((out / "runs" / r["key"] / "config.json").read_text())["run_config"]
        for r in rows[:2]
    ]
    for key in ("dataset", "seed", "partitioner", "sim-device-profiles", "local-epochs"):
        assert configs[0][key] == configs[1][key], key
    assert configs[0]["seed"] == 3 and configs[0]["dataset"] == dataset
    archs = set(rows[0]["fields"]["archs"]) | set(rows[1]["fields"]["archs"])
    assert set(rows[2]["centralised"]) >= archs
    board = (out / "leaderboard.md").read_text()
    assert "| fedavg-groups |" in board and "| local (floor) |" in board
    assert "| centralised (ceiling) |" in board
    with (out / "results.csv").open() as fh:
        assert {r["scheme"] for r in csv.DictReader(fh)} == {
            "local",
            "fedavg-groups",
            "centralised",
        }
    assert all(
        (out / f).stat().st_size > 10_000
        for f in ("accuracy_rounds.png", "accuracy_vs_bytes.png", "accuracy_by_arch.png")
    )
    code, text = _main(args, capsys)
    assert code == 0 and "2 runs, 2 already done, 0 to run" in text
    assert len((out / "cells.jsonl").read_text().splitlines()) == len(lines)


# ------------------------------------------------------------ against the floor
def _row(
    scheme: str,
    part: str,
    seed: int,
    personal: float | None,
    floor: str | None,
    ceiling: float | None = None,
) -> dict[str, Any]:
    return {
        "scheme": scheme,
        "partitioning": part,
        "seed": seed,
        "personal": personal,
        "floor": floor,
        "ceiling_personal": ceiling,
    }


GOAL_ROWS = [
    # dirichlet: floor 0.80 / 0.90, ceiling 0.95 / 0.99 -> gap mean (0.15 + 0.09) / 2 = 0.12
    _row("local", "dir", 0, 0.80, None),
    _row("local", "dir", 1, 0.90, None),
    _row("centralised", "dir", 0, 0.95, "local"),
    _row("centralised", "dir", 1, 0.99, "local"),
    _row("a", "dir", 0, 0.86, "local", 0.95),  # +0.06, +0.02: mean 0.04 >= 0.12 / 3
    _row("a", "dir", 1, 0.92, "local", 0.99),
    _row("b", "dir", 0, 0.90, "local:b", 0.98),  # against its own floor: +0.10, one seed
    _row("local:b", "dir", 0, 0.80, None),
    _row("c", "dir", 0, 0.79, "local", 0.95),  # -0.01, seed 1 missing its value
    _row("c", "dir", 1, None, "local", 0.99),
    # pathological: floor 0.99 above the ceiling 0.97
    _row("local", "path", 0, 0.99, None),
    _row("centralised", "path", 0, 0.97, "local"),
    _row("a", "path", 0, 0.995, "local", 0.97),
]


def test_floor_margins_pair_each_scheme_with_its_own_floor_by_seed() -> None:
    from tessera.compare.report import floor_gaps, floor_margins, own_gaps

    margins = floor_margins(GOAL_ROWS)
    assert margins["dir"]["a"] == pytest.approx({0: 0.06, 1: 0.02})
    assert margins["dir"]["b"] == pytest.approx({0: 0.10})
    assert margins["dir"]["c"] == pytest.approx({0: -0.01})
    assert set(margins["dir"]) == {"a", "b", "c"}  # no floor, no ceiling
    gaps = floor_gaps(GOAL_ROWS)
    assert gaps["dir"] == pytest.approx(0.12)
    assert gaps["path"] == pytest.approx(-0.02)
    own = own_gaps(GOAL_ROWS)
    assert own["dir"] == pytest.approx({"a": 0.12, "b": 0.18, "c": 0.12})
    assert own["path"] == pytest.approx({"a": -0.02})


def test_goal_section_names_the_best_scheme_with_most_seeds_and_a_third_of_its_gap() -> None:
    from tessera.compare.report import goal_section

    text = goal_section(GOAL_ROWS)
    # b's +10 on one seed does not beat a's +4 on two seeds
    assert "| dir | a | +4.0 (+6.0, +2.0) | 2/2 | +12.0 | yes |" in text
    assert (
        "| path | a | +0.5 (+0.5) | 1/1 | -2.0 | impossible: the floor is above the ceiling |"
        in (text)
    )


def test_goal_section_says_how_far_a_scheme_is_from_a_third_of_the_gap() -> None:
    from tessera.compare.report import goal_section

    rows = [r for r in GOAL_ROWS if r["partitioning"] == "dir" and r["scheme"] in ("local", "c")]
    rows += [r for r in GOAL_ROWS if r["scheme"] == "centralised" and r["partitioning"] == "dir"]
    assert "| dir | c | -1.0 (-1.0) | 0/1 | +12.0 | no (needs +4.0) |" in goal_section(rows)


def test_cells_diff_prints_both_files_means_over_their_common_seeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.cells_diff import main

    def cell(scheme: str, seed: int, personal: float, global_: float | None) -> str:
        fields = {"personal": personal, "global": global_}
        row = {"kind": "scheme", "scheme": scheme, "partitioning": "iid", "seed": seed}
        return json.dumps({**row, "fields": fields})

    before = tmp_path / "before.jsonl"
    after = tmp_path / "after.jsonl"
    ceiling = json.dumps({"kind": "centralised", "scheme": "x", "partitioning": "iid"})
    before.write_text("\n".join([cell("a", 0, 0.8, 0.5), cell("a", 1, 0.6, 0.3), ceiling]))
    after.write_text("\n".join([cell("a", 0, 0.7, 0.4), cell("a", 2, 0.1, None)]))

    assert main([str(before), str(after)]) == 0

    # seed 0 only is in both: 80.0 -> 70.0 personalised, 50.0 -> 40.0 global
    assert "| a | iid | 0 | 80.0 | 70.0 | 50.0 | 40.0 |" in capsys.readouterr().out
