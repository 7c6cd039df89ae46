"""Each scheme's options have one default: the option class's own, which pyproject.toml repeats.

Every scheme's parser reads a key it is not given with its option class's field
default (no literal of its own), and the ``[tool.flwr.app.config]`` table users edit
holds the same values: parsing the shipped defaults and parsing an empty run config
give the same options.
"""

from __future__ import annotations

from typing import Any

import pytest

from strategies.core.registry import get_scheme, list_schemes
from tessera.config import ConfigError


@pytest.mark.parametrize("name", list_schemes())
def test_the_shipped_defaults_are_the_option_class_s_own(
    name: str, default_run_config: dict[str, Any]
) -> None:
    # Prepare
    scheme = get_scheme(name)

    # Execute: the shipped table, and nothing at all
    try:
        shipped = scheme.parse_options(default_run_config)
    except ConfigError as err:  # a key the table leaves to the user (flwr-fedavg's arch)
        with pytest.raises(ConfigError):
            scheme.parse_options({})
        pytest.skip(f"{name} needs a key the shipped table leaves unset: {err}")
    bare = scheme.parse_options({})

    # Assert
    assert shipped == bare


# ------------------------------------------------ run-config keys a scheme owns
def test_a_scheme_s_own_default_replaces_the_declared_one_only_when_left_unset(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare: flexifed owns trust-threshold (-0.1); heterofl owns nothing
    from strategies.core.registry import resolve_run

    flexifed = {**default_run_config, "strategy": "flexifed"}
    heterofl = {**default_run_config, "strategy": "heterofl"}

    # Execute
    left = resolve_run(flexifed).run.aggregation
    set_to_0_2 = resolve_run({**flexifed, "trust-threshold": 0.2}).run.aggregation
    others = resolve_run(heterofl).run.aggregation

    # Assert: the declared 0 reads as flexifed's -0.1; another value is kept; others keep 0
    assert default_run_config["trust-threshold"] == 0.0
    assert left.trust_threshold == -0.1
    assert set_to_0_2.trust_threshold == 0.2
    assert others.trust_threshold == 0.0
    assert left.clip_factor == others.clip_factor == 1.0


def test_fedavg_groups_weighs_no_node_above_the_median_claim_unless_told(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare: fedavg-groups owns weight-cap (1); fedavg keeps the declared 2
    from strategies.core.registry import resolve_run
    from strategies.core.validation import weight_caps

    groups = {**default_run_config, "strategy": "fedavg-groups"}
    fedavg = {**default_run_config, "strategy": "fedavg"}

    # Execute
    left = resolve_run(groups).run.aggregation
    set_to_3 = resolve_run({**groups, "weight-cap": 3.0}).run.aggregation
    declared = resolve_run({**groups, "scheme-defaults": False}).run.aggregation
    others = resolve_run(fedavg).run.aggregation

    # Assert: the declared 2 reads as 1 for fedavg-groups only; a liar claiming 900
    # among claims of 100, 120, 90, 110 weighs the median claim, 110, not 220
    assert default_run_config["weight-cap"] == 2.0
    assert left.weight_cap == 1.0
    assert set_to_3.weight_cap == 3.0
    assert declared.weight_cap == others.weight_cap == 2.0
    claims = {1: 100, 2: 120, 3: 90, 4: 110, 5: 900}
    assert weight_caps(claims, left.weight_cap)[5] == 110
    assert weight_caps(claims, others.weight_cap)[5] == 220


@pytest.mark.parametrize("name", list_schemes())
def test_a_scheme_owns_only_declared_keys_with_valid_values(
    name: str, default_run_config: dict[str, Any]
) -> None:
    # Prepare
    from strategies.core.registry import apply_config_defaults, resolve_run

    scheme = get_scheme(name)

    # Execute
    owned = dict(scheme.config_defaults)
    applied = apply_config_defaults(scheme, {**default_run_config, "strategy": name})

    # Assert: every owned key is a declared run-config key, of the declared type, and
    # the scheme's value passes the common validation
    for key, value in owned.items():
        assert key in default_run_config, key
        assert type(value) is type(default_run_config[key]), key
        assert applied[key] == value
    if owned and name != "flwr-fedavg":
        resolve_run(applied)


def test_a_scheme_s_own_default_does_not_trip_the_weight_key_check(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare: felo without weight sharing sends no weights, so a changed clip-factor
    # is refused; a value the scheme owns is not a change (felo given one here)
    import dataclasses

    from strategies.core.registry import apply_config_defaults, check_weight_keys
    from tessera.config import RunConfig

    felo = dataclasses.replace(get_scheme("felo"), config_defaults={"clip-factor": 2.0})
    config = {**default_run_config, "strategy": "felo", "felo-share-weights": False}
    options = felo.parse_options(config)

    def run_of(values: dict[str, Any]) -> RunConfig:
        return RunConfig.from_flower(apply_config_defaults(felo, values))

    # Execute
    own = run_of(config)
    check_weight_keys(felo, own, options)

    # Assert
    assert own.aggregation.clip_factor == 2.0
    with pytest.raises(ConfigError, match="clip-factor"):
        check_weight_keys(felo, run_of({**config, "clip-factor": 3.0}), options)


@pytest.mark.parametrize("off", [False, "false"])
def test_scheme_defaults_false_keeps_every_declared_value(
    default_run_config: dict[str, Any], off: bool | str
) -> None:
    # Prepare
    from strategies.core.registry import resolve_run

    flexifed = {**default_run_config, "strategy": "flexifed", "scheme-defaults": off}

    # Execute
    run = resolve_run(flexifed).run

    # Assert: the declared trust-threshold 0, not flexifed's -0.1
    assert run.aggregation.trust_threshold == 0.0
    assert run.scheme.scheme_defaults is False
