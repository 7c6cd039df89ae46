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
