"""Run- and node-config parsing: real defaults parse, every bad value names its key."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from strategies import get_scheme, list_schemes
from tessera.config import (
    LIMITS,
    ConfigError,
    ConfigReader,
    NodeConfig,
    RunConfig,
    parse_csv,
    recording_reads,
)

RunConfigFactory = Callable[..., dict[str, Any]]


def test_defaults_parse(default_run_config: dict[str, Any]) -> None:
    # Execute
    cfg = RunConfig.from_flower(default_run_config)

    # Assert: every typed field equals the pyproject value
    assert cfg.scheme.strategy == default_run_config["strategy"]
    assert cfg.scheme.num_server_rounds == default_run_config["num-server-rounds"]
    assert cfg.data.partitioner == default_run_config["partitioner"]
    assert cfg.training.learning_rate == default_run_config["learning-rate"]
    assert cfg.training.momentum == default_run_config["momentum"]
    assert cfg.deployment.round_timeout == default_run_config["round-timeout"]
    assert cfg.training.train_time_budget == default_run_config["train-time-budget"]
    assert cfg.deployment.sim_device_profiles == tuple(
        default_run_config["sim-device-profiles"].split(",")
    )
    # empty strings in pyproject mean "not set"
    assert default_run_config["model-family"] == ""
    assert cfg.scheme.model_family is None
    assert default_run_config["run-name"] == ""
    assert cfg.deployment.run_name is None


def test_every_declared_key_is_read_and_every_read_key_is_declared(
    default_run_config: dict[str, Any],
) -> None:
    # Execute: parse the declared defaults the way a run does (RunConfig, then every
    # scheme's options), recording the keys the readers look up
    with recording_reads() as reads:
        RunConfig.from_flower(default_run_config)
        for name in list_schemes():
            try:
                get_scheme(name).parse_options(default_run_config)
            except ConfigError:  # flwr-fedavg needs fedavg-arch set; it still read it
                assert name == "flwr-fedavg"

    # Assert: pyproject declares exactly the keys the code reads, nothing else
    read = {key for source, key in reads if source == "run-config"}
    assert read == set(default_run_config), (
        f"declared but never read: {sorted(set(default_run_config) - read)}; "
        f"read but not declared: {sorted(read - set(default_run_config))}"
    )


def test_to_dict_uses_kebab_case_keys_of_pyproject(default_run_config: dict[str, Any]) -> None:
    # Execute
    with recording_reads() as reads:
        out = RunConfig.from_flower(default_run_config).to_dict()

    # Assert: the common keys, as RunConfig read them (scheme keys are the schemes')
    assert set(out) == {key for _, key in reads}
    assert set(out) < set(default_run_config)
    assert out["sim-device-profiles"] == ["cpu-small", "cpu-large", "jetson-orin"]


def test_a_missing_run_config_key_is_named_with_where_it_is_declared(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare: a run config without one declared key (no default in the code)
    config = dict(default_run_config)
    del config["local-epochs"]

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"'local-epochs' is missing.*pyproject\.toml"):
        RunConfig.from_flower(config)


def test_every_scheme_parses_its_options_from_the_defaults(
    default_run_config: dict[str, Any],
) -> None:
    # Execute / Assert: flwr-fedavg is the only scheme that needs a key set
    for name in list_schemes():
        scheme = get_scheme(name)
        if name == "flwr-fedavg":
            with pytest.raises(ConfigError, match="fedavg-arch"):
                scheme.parse_options(default_run_config)
        else:
            scheme.parse_options(default_run_config)


def test_partitioner_is_case_insensitive(run_config: RunConfigFactory) -> None:
    # Execute
    cfg = RunConfig.from_flower(run_config({"partitioner": "IID"}))

    # Assert
    assert cfg.data.partitioner == "iid"


def test_string_numbers_are_converted(run_config: RunConfigFactory) -> None:
    # Prepare: values from a CLI may arrive as strings
    config = run_config({"num-server-rounds": "3", "learning-rate": "0.1", "batch-size": 8.0})

    # Execute
    cfg = RunConfig.from_flower(config)

    # Assert
    assert cfg.scheme.num_server_rounds == 3
    assert cfg.training.learning_rate == 0.1
    assert cfg.training.batch_size == 8
    assert isinstance(cfg.training.batch_size, int)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("num-server-rounds", 0, "1 or more rounds"),
        ("num-server-rounds", "five", "not a valid int"),
        ("num-server-rounds", 2.5, "whole number"),
        ("num-server-rounds", True, "whole number"),
        ("partitioner", "foo", "iid, dirichlet, pathological"),
        ("dirichlet-alpha", 0.0, "positive"),
        ("classes-per-client", 0, "1 or more"),
        ("server-pool-fraction", 0.0, "(0, 0.9)"),
        ("server-pool-fraction", 0.9, "(0, 0.9)"),
        ("local-test-fraction", 0.95, "[0, 0.9)"),
        ("local-test-fraction", -0.1, "[0, 0.9)"),
        ("seed", "x", "not a valid int"),
        ("local-epochs", 0, "1 or more"),
        ("batch-size", 0, "positive"),
        ("learning-rate", -1, "positive learning rate"),
        ("learning-rate", 0, "positive learning rate"),
        ("learning-rate", "fast", "not a valid float"),
        ("learning-rate", float("inf"), "finite"),
        ("learning-rate", float("nan"), "finite"),
        ("momentum", 1.0, "[0, 1)"),
        ("momentum", -0.5, "[0, 1)"),
        ("momentum", True, "use a number"),
        ("weight-decay", -0.001, "non-negative"),
        ("round-timeout", 0, "positive"),
        ("min-nodes", 0, "1 or more"),
        ("node-wait-timeout", -1, "positive"),
        ("train-time-budget", 0, "positive"),
        ("memory-fraction", 0.0, "(0, 1]"),
        ("memory-fraction", 1.5, "(0, 1]"),
        ("output-dir", "  ", "name a folder"),
        ("flat-input", "image", "use one of signal, square"),
        # values that passed the parse and failed only later (on a client, in a
        # results path, or with wrong advice)
        ("norm", "bogus", "use one of batch, static-batch, group, none"),
        ("sim-device-profiles", "cpu-small,bogus", "bogus is not one"),
        ("dirichlet-alpha", 1e308, "above the largest accepted 1000000"),
        ("run-name", "a/../../escape", "without a path separator"),
        ("run-name", "..", "other than . or .."),
        ("run-name", "x" * 256, "at most 255 bytes"),
        ("output-dir", "/tmp/" + "y" * 256, "at most 255 bytes"),
        ("learning-rate", 10**400, "finite"),
        ("round-timeout", 10**400, "finite"),
    ],
)
def test_invalid_run_config_value_raises_naming_the_key(
    run_config: RunConfigFactory, key: str, value: Any, fragment: str
) -> None:
    # Prepare
    config = run_config({key: value})

    # Execute / Assert
    with pytest.raises(ConfigError) as info:
        RunConfig.from_flower(config)
    message = str(info.value)
    assert f"'{key}'" in message
    assert fragment in message


@pytest.mark.parametrize(
    ("strategy", "key", "value", "fragment"),
    [
        ("fedavg", "fedavg-arch", "cnn-99", "not a registered model"),
        ("fedavg", "fedavg-exclude-unfit", "maybe", "not a valid bool"),
        ("fedavg", "fedavg-exclude-unfit", 2, "not a valid bool"),
        ("fedprox", "proximal-mu", -0.1, "non-negative"),
        ("fedprox", "proximal-mu", "a lot", "not a valid float"),
    ],
)
def test_invalid_scheme_option_raises_naming_the_key(
    run_config: RunConfigFactory, strategy: str, key: str, value: Any, fragment: str
) -> None:
    # Prepare
    config = run_config({"strategy": strategy, key: value})

    # Execute / Assert
    with pytest.raises(ConfigError) as info:
        get_scheme(strategy).parse_options(config)
    assert f"'{key}'" in str(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(True, True), (False, False), ("true", True), ("False", False), ("1", True), (0, False)],
)
def test_bool_values(raw: Any, expected: bool) -> None:
    # Execute
    value = ConfigReader({"flag": raw}, "run-config").get("flag", bool, False)

    # Assert
    assert value is expected


def test_fedavg_options_parse(run_config: RunConfigFactory) -> None:
    # Prepare
    config = run_config({"fedavg-arch": "cnn-5", "fedavg-exclude-unfit": "true"})

    # Execute
    options = get_scheme("fedavg").parse_options(config)

    # Assert
    assert options.arch == "cnn-5"
    assert options.exclude_unfit is True


def test_fedprox_options_parse(run_config: RunConfigFactory) -> None:
    # Prepare
    config = run_config({"proximal-mu": 0.5})

    # Execute
    options = get_scheme("fedprox").parse_options(config)

    # Assert
    assert options.proximal_mu == 0.5
    assert options.arch is None
    assert options.exclude_unfit is False


def test_missing_key_without_default_raises_naming_it() -> None:
    # Prepare
    reader = ConfigReader({}, "node-config")

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"node-config key 'partition-id' is missing"):
        reader.get("partition-id", int)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a,b", ("a", "b")),
        (" a , b ", ("a", "b")),
        ("", ()),
        ("  ", ()),
        (None, ()),
    ],
)
def test_parse_csv(text: str | None, expected: tuple[str, ...]) -> None:
    # Execute / Assert
    assert parse_csv(text) == expected


@pytest.mark.parametrize("text", [",,,", "a,,b", "a,", " , a"])
def test_parse_csv_refuses_empty_names(text: str) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"run-config key 'attack' has value .*empty name"):
        parse_csv(text, key="attack")


# ------------------------------------------------------------------------ upper bounds
def integer_keys(defaults: dict[str, Any]) -> list[str]:
    return [k for k, v in defaults.items() if isinstance(v, int) and not isinstance(v, bool)]


def test_every_integer_key_has_an_upper_bound(default_run_config: dict[str, Any]) -> None:
    # Execute
    unbounded = [k for k in integer_keys(default_run_config) if k not in LIMITS]

    # Assert: seed has its own two-sided range; every other integer key is in LIMITS
    assert unbounded == ["seed"]
    for key in integer_keys(default_run_config):
        if key != "seed":
            assert default_run_config[key] <= LIMITS[key].high, key


@pytest.mark.parametrize("key", sorted(k for k, v in LIMITS.items() if v.low is None))
def test_an_integer_above_its_bound_is_refused_naming_key_value_and_fix(key: str) -> None:
    # Prepare
    limit = LIMITS[key]
    reader = ConfigReader({key: int(limit.high) + 1}, "run-config")

    # Execute / Assert
    with pytest.raises(ConfigError) as info:
        reader.get(key, int)
    message = str(info.value)
    assert f"run-config key '{key}' has value {int(limit.high) + 1}" in message
    assert f"above the largest accepted {int(limit.high)}" in message
    assert limit.fix in message
    assert ConfigReader({key: int(limit.high)}, "run-config").get(key, int) == limit.high


@pytest.mark.parametrize(
    ("key", "limit"),
    [
        ("min-replies", "100000"),
        ("krum-byzantine", "100000"),
        ("num-server-rounds", "100000"),
        ("batch-size", "65536"),
        ("local-epochs", "1000"),
    ],
)
def test_huge_integers_are_refused_by_the_run_config(
    run_config: RunConfigFactory, key: str, limit: str
) -> None:
    # Execute / Assert: 1e308 is a whole number, so only the bound stops it
    with pytest.raises(ConfigError, match=rf"'{key}' has value 1e\+308, above .* {limit}"):
        RunConfig.from_flower(run_config({key: 1e308}))


@pytest.mark.parametrize(
    ("strategy", "key", "value", "fragment"),
    [
        ("ensemble", "ensemble-trials", 1e308, "above the largest accepted 100000"),
        ("ensemble", "ensemble-gradient-steps", 10**8, "above the largest accepted 10000000"),
        ("fedhenn", "rad-size", 10**7, "above the largest accepted 1000000"),
        ("felo", "feature-dim", 10**6, "above the largest accepted 65536"),
        ("fedfa", "fedfa-percentile", 1e-300, "outside [50, 100]"),
        ("fedfa", "fedfa-percentile", 49.9, "outside [50, 100]"),
        ("fedfa", "fedfa-percentile", 100.5, "outside [50, 100]"),
        ("heterofl", "submodel-widths", "1,1e-300", "outside [0.015625, 1]"),
        ("heterofl", "submodel-widths", "1,0.01", "outside [0.015625, 1]"),
        ("heterofl", "submodel-widths", "1,2", "outside [0.015625, 1]"),
        ("heterofl", "submodel-widths", "1,,0.5", "empty name"),
        ("heterofl", "submodel-widths", "1,half", "item 'half' is not a number"),
        ("heterofl", "submodel-widths", "1,nan", "item 'nan' is not finite"),
    ],
)
def test_scheme_keys_are_bounded_where_they_are_read(
    run_config: RunConfigFactory, strategy: str, key: str, value: Any, fragment: str
) -> None:
    # Prepare
    config = run_config({"strategy": strategy, key: value})

    # Execute / Assert
    with pytest.raises(ConfigError) as info:
        get_scheme(strategy).parse_options(config)
    assert f"run-config key '{key}'" in str(info.value)
    assert fragment in str(info.value)


def test_bounds_themselves_are_accepted(run_config: RunConfigFactory) -> None:
    # Prepare
    config = run_config({"fedfa-percentile": 50.0, "submodel-widths": "1,0.015625"})

    # Execute
    fedfa = get_scheme("fedfa").parse_options(config)
    heterofl = get_scheme("heterofl").parse_options(config)

    # Assert
    assert fedfa.percentile == 50.0
    assert heterofl.widths == (1.0, 0.015625)


@pytest.mark.parametrize("value", [",,,", "boost,", "boost,,noise"])
def test_attack_list_with_an_empty_name_is_refused(
    run_config: RunConfigFactory, value: str
) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"'attack' has value .*empty name"):
        RunConfig.from_flower(run_config({"attack": value}))


# ------------------------------------------------------- attack intensities, defence keys
def test_new_keys_parse_from_the_defaults(default_run_config: dict[str, Any]) -> None:
    # Execute
    cfg = RunConfig.from_flower(default_run_config)

    # Assert
    assert (cfg.attack.z, cfg.attack.epsilon, cfg.attack.perturbation) == (0.0, 0.5, "std")
    assert (cfg.attack.magnitude, cfg.attack.inflate) == (1e30, 1000)
    assert (
        cfg.aggregation.weight_cap,
        cfg.aggregation.bound_growth,
        cfg.aggregation.clip_ceiling,
    ) == (2.0, 2.0, 4.0)
    assert cfg.to_dict()["weight-cap"] == 2.0


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("attack-z", -0.5, "positive z"),
        ("attack-epsilon", 0.0, "positive IPM factor"),
        ("attack-perturbation", "gauss", "use one of std, sign, unit"),
        ("attack-magnitude", 0.0, "at most 1e+38"),
        ("attack-magnitude", 1e39, "at most 1e+38"),
        ("attack-inflate", 0, "factor of 1 to 1000000000"),
        ("attack-inflate", 10**10, "above the largest accepted 1000000000"),
        ("weight-cap", 0.5, "0 (no cap) or a multiple >= 1"),
        ("weight-cap", float("inf"), "finite"),
        ("weight-trim", 0.5, "share of the cohort, below 0.5"),
        ("weight-trim", -0.1, "0 (off) or the share"),
        ("weight-trim", float("nan"), "finite"),
        ("bound-growth", 1.0, "factor > 1"),
        ("bound-growth", float("inf"), "finite"),
        ("bound-stretch", 0.5, "0 (every node the same bound) or a multiple in [1, 100]"),
        ("bound-stretch", 1e308, "0 (every node the same bound) or a multiple in [1, 100]"),
        ("bound-stretch", float("nan"), "finite"),
        ("clip-ceiling", -1.0, "0 (off) or a non-negative multiple"),
    ],
)
def test_new_keys_refuse_bad_values(
    run_config: RunConfigFactory, key: str, value: Any, fragment: str
) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError) as info:
        RunConfig.from_flower(run_config({key: value}))
    assert f"'{key}'" in str(info.value)
    assert fragment in str(info.value)


def test_zero_turns_weight_cap_and_clip_ceiling_off(run_config: RunConfigFactory) -> None:
    # Execute
    cfg = RunConfig.from_flower(run_config({"weight-cap": 0, "clip-ceiling": 0}))

    # Assert
    assert (cfg.aggregation.weight_cap, cfg.aggregation.clip_ceiling) == (0.0, 0.0)


def test_node_config_refuses_omniscient_attacks() -> None:
    # Execute / Assert: a node alone cannot see the honest updates of the round
    with pytest.raises(ConfigError, match=r"'alie'.*in-process harness"):
        NodeConfig.from_flower({"partition-id": 0, "num-partitions": 3, "attack": "alie"})
    node = NodeConfig.from_flower({"partition-id": 0, "num-partitions": 3, "attack": "inflate"})
    assert node.attack == "inflate"


def test_node_config_with_partition() -> None:
    # Execute
    node = NodeConfig.from_flower({"partition-id": 2, "num-partitions": 3})

    # Assert
    assert node.partition_id == 2
    assert node.num_partitions == 3
    assert node.data_path is None
    assert node.arch is None
    assert node.device_profile is None


def test_node_config_with_data_path_and_overrides() -> None:
    # Execute
    node = NodeConfig.from_flower(
        {"data-path": "/data/mine.npz", "arch": "cnn-2", "device-profile": "cpu-small"}
    )

    # Assert
    assert node.data_path == "/data/mine.npz"
    assert node.partition_id is None
    assert node.arch == "cnn-2"
    assert node.device_profile == "cpu-small"


def test_node_config_blank_strings_mean_unset() -> None:
    # Execute
    node = NodeConfig.from_flower(
        {"partition-id": 0, "num-partitions": 1, "arch": " ", "device-profile": ""}
    )

    # Assert
    assert node.arch is None
    assert node.device_profile is None


@pytest.mark.parametrize(
    "node_config",
    [
        pytest.param({}, id="empty"),
        pytest.param({"partition-id": 0}, id="no-num-partitions"),
        pytest.param({"num-partitions": 3}, id="no-partition-id"),
        pytest.param({"data-path": "  "}, id="blank-data-path"),
    ],
)
def test_node_config_needs_partition_keys_or_data_path(node_config: dict[str, Any]) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError) as info:
        NodeConfig.from_flower(node_config)
    assert "'partition-id'" in str(info.value)
    assert "'num-partitions'" in str(info.value)
    assert "'data-path'" in str(info.value)


@pytest.mark.parametrize(
    ("pid", "nparts"),
    [(3, 3), (-1, 3), (0, 0), (5, 2)],
)
def test_partition_id_out_of_range_raises(pid: int, nparts: int) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError) as info:
        NodeConfig.from_flower({"partition-id": pid, "num-partitions": nparts})
    assert f"partition-id={pid}" in str(info.value)
    assert f"num-partitions={nparts}" in str(info.value)
    assert "[0, num-partitions)" in str(info.value)


def test_partition_id_not_an_int_raises_naming_the_key() -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"node-config key 'partition-id' has value 'first'"):
        NodeConfig.from_flower({"partition-id": "first", "num-partitions": 3})


@pytest.mark.parametrize(("form", "conv"), [("signal", "Conv1d"), ("square", "Conv2d")])
def test_flat_input_reaches_the_models_of_the_client_and_the_server(
    run_config: RunConfigFactory, form: str, conv: str
) -> None:
    # Prepare: a run on flat 40-feature samples, the conv family
    from client_app.selection import candidate_costs
    from strategies.core.client import ClientAlgorithm

    run = RunConfig.from_flower(run_config({"flat-input": form.upper()}))

    # Execute: the model a client trains and the candidates it measures
    model = ClientAlgorithm(run=run, options=None).build_model(
        "cnn-2", input_shape=(40,), num_classes=3
    )
    costs = candidate_costs("cnn", (40,), 3, norm=run.scheme.norm, flat_input=run.scheme.flat_input)
    square = candidate_costs("cnn", (40,), 3, norm=run.scheme.norm, flat_input="square")

    # Assert: the run's form is used (case-insensitive); the two forms cost differently
    kinds = {type(m).__name__ for m in model.modules()}
    assert conv in kinds and ({"Conv1d", "Conv2d"} - {conv}).isdisjoint(kinds)
    assert (costs == square) is (form == "square")


def test_the_run_config_groups_hold_every_common_key_once_as_the_docs_list_them(
    default_run_config: dict[str, Any],
) -> None:
    import re
    from dataclasses import fields

    # Prepare: the docs' table of groups and keys
    page = (Path(__file__).parent.parent / "docs/pages/configuration.md").read_text()
    documented = {
        m[1]: re.findall(r"`([a-z0-9-]+)`(?: \(`\w+`\))?", m[2])
        for m in re.finditer(r"^\| `run\.(\w+)` \| (.+) \|$", page, flags=re.M)
    }

    # Execute
    cfg = RunConfig.from_flower(default_run_config)
    flat = cfg.to_dict()
    grouped = {"seed": ["seed"]} | {
        f.name: [key for key, _ in getattr(cfg, f.name).items()]
        for f in fields(cfg)
        if f.name != "seed"
    }

    # Assert: each key in one group, the flat record is their union, and the docs agree
    keys = [k for ks in grouped.values() for k in ks]
    assert len(keys) == len(set(keys)) == len(flat)
    assert set(keys) == set(flat)
    assert {g: sorted(ks) for g, ks in documented.items()} == {
        g: sorted(ks) for g, ks in grouped.items()
    }
    assert flat["attack-lambda"] == cfg.attack.lam
    assert flat["attack"] == list(cfg.attack.kinds)


# ------------------------------------------------- keys a scheme would ignore
@pytest.mark.parametrize("strategy", ["fedhe", "fedproto", "fedtgp", "fedgh", "local"])
@pytest.mark.parametrize(
    "overrides",
    [{"aggregator": "median"}, {"clip-factor": 2.0}, {"server-trust": False}],
)
def test_a_scheme_that_sends_no_weights_refuses_a_changed_weight_key(
    default_run_config: dict[str, Any], strategy: str, overrides: dict[str, Any]
) -> None:
    from strategies import resolve_run

    (key,) = overrides
    config = {**default_run_config, "strategy": strategy, **overrides}
    with pytest.raises(ConfigError, match=rf"'{key}' set, but '{strategy}' sends no weights"):
        resolve_run(config)
    resolve_run({**default_run_config, "strategy": strategy})  # the defaults: accepted


def test_weight_sharing_schemes_take_the_weight_keys(default_run_config: dict[str, Any]) -> None:
    from strategies import resolve_run

    for strategy in ("fedavg-groups", "felo", "lg-fedavg", "fml"):
        run = resolve_run({**default_run_config, "strategy": strategy, "aggregator": "median"})
        assert run.run.aggregation.aggregator == "median"


def test_changed_keys_compares_with_the_declared_defaults(tmp_path: Path) -> None:
    from tessera.config.declared import changed_keys, declared_defaults

    declared = declared_defaults()
    assert declared is not None and declared["clip-factor"] == 1.0
    values = {"clip-factor": 1.0, "aggregator": "krum", "unknown": 3}
    assert changed_keys(values, ["clip-factor", "aggregator", "unknown"]) == ["aggregator"]
    assert declared_defaults(tmp_path / "missing.toml") is None


def test_the_config_s_closed_lists_are_the_registries_names() -> None:
    # tessera.config sits below models and client_app; its lists of norms and of
    # simulated device profiles are held to theirs here
    from client_app.device import PREDEFINED_PROFILES
    from models import norm
    from tessera.config.choices import NORMS, SIM_DEVICE_PROFILES

    assert set(NORMS) == set(norm._NORMS)
    assert set(SIM_DEVICE_PROFILES) == set(PREDEFINED_PROFILES)
