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
    # Prepare: felo owns clip-factor (2); fedavg-groups owns nothing
    from strategies.core.registry import resolve_run

    felo = {**default_run_config, "strategy": "felo"}
    groups = {**default_run_config, "strategy": "fedavg-groups"}

    # Execute
    left = resolve_run(felo).run.aggregation
    set_to_3 = resolve_run({**felo, "clip-factor": 3.0}).run.aggregation
    others = resolve_run(groups).run.aggregation

    # Assert: the declared 1 reads as felo's 2; another value is kept; others keep 1
    assert default_run_config["clip-factor"] == 1.0
    assert left.clip_factor == 2.0
    assert set_to_3.clip_factor == 3.0
    assert others.clip_factor == 1.0


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
    # is refused; its own default is not a change
    from strategies.core.registry import resolve_run

    felo = {**default_run_config, "strategy": "felo", "felo-share-weights": False}

    # Execute
    run = resolve_run(felo).run

    # Assert
    assert run.aggregation.clip_factor == 2.0
    with pytest.raises(ConfigError, match="clip-factor"):
        resolve_run({**felo, "clip-factor": 3.0})


@pytest.mark.parametrize("off", [False, "false"])
def test_scheme_defaults_false_keeps_every_declared_value(
    default_run_config: dict[str, Any], off: bool | str
) -> None:
    # Prepare
    from strategies.core.registry import resolve_run

    felo = {**default_run_config, "strategy": "felo", "scheme-defaults": off}

    # Execute
    run = resolve_run(felo).run

    # Assert: the declared clip-factor 1, not felo's 2
    assert run.aggregation.clip_factor == 1.0
    assert run.scheme.scheme_defaults is False


def test_flexifed_owns_a_negative_trust_threshold(default_run_config: dict[str, Any]) -> None:
    # Prepare
    from strategies.core.registry import resolve_run

    flexifed = {**default_run_config, "strategy": "flexifed"}

    # Execute
    own = resolve_run(flexifed).run.aggregation
    common = resolve_run({**flexifed, "scheme-defaults": False}).run.aggregation
    heterofl = resolve_run({**default_run_config, "strategy": "heterofl"}).run.aggregation

    # Assert
    assert (own.trust_threshold, common.trust_threshold) == (-0.1, 0.0)
    assert heterofl.trust_threshold == 0.0
    assert own.clip_factor == common.clip_factor == 1.0
