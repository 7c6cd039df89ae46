"""Write the docs' table of schemes, their own run-config keys and defaults, from the code.

Each registered scheme's ``parse_options`` is run on the defaults of
``pyproject.toml`` (``[tool.flwr.app.config]``) while
:func:`tessera.config.recording_reads` records every key it reads; the table lists
those keys with their default values, next to what the :class:`Scheme` itself owns
(architecture family, normalisation). ``tests/test_core_house.py`` fails when the
page is stale.

Usage::

    .venv/bin/python scripts/scheme_table.py [--write docs/pages/scheme-keys.md]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PAGE = ROOT / "docs" / "pages" / "scheme-keys.md"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (Jetson)
    import tomli as tomllib


def default_run_config() -> dict[str, Any]:
    """Return ``[tool.flwr.app.config]`` of ``pyproject.toml``."""
    with (ROOT / "pyproject.toml").open("rb") as fh:
        return dict(tomllib.load(fh)["tool"]["flwr"]["app"]["config"])


def scheme_keys(run_config: Mapping[str, Any]) -> dict[str, list[str]]:
    """Return, per scheme, the run-config keys its option parser reads (sorted)."""
    from strategies import get_scheme, list_schemes
    from tessera.config import recording_reads

    out: dict[str, list[str]] = {}
    for name in list_schemes():
        config = {**run_config, "strategy": name}
        if name == "flwr-fedavg" and not config.get("fedavg-arch"):
            config["fedavg-arch"] = "cnn-3"  # it needs one; any registered model reads the same
        with recording_reads() as reads:
            get_scheme(name).parse_options(config)
        out[name] = sorted(key for source, key in reads if source == "run-config")
    return out


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def render(run_config: Mapping[str, Any]) -> str:
    """Return the page: one row per scheme."""
    from strategies import get_scheme

    lines = [
        "# Schemes: their own keys and defaults",
        "",
        "Generated from the code by `.venv/bin/python scripts/scheme_table.py --write "
        "docs/pages/scheme-keys.md` (a test fails when it is stale). *Family* and *norm*",
        "are what an empty run-config `model-family` and `norm` mean for the scheme; *keys*",
        "are the run-config keys its options read, with the defaults of `pyproject.toml`.",
        "Every other key is common to all schemes ([run configuration](configuration.md)).",
        "*Owns* lists the common keys whose default the scheme replaces with its own (used",
        "while the run leaves the key at its declared value and `scheme-defaults` is true).",
        "",
        "| scheme | what it does | family | norm | owns (its default) | its keys (default) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, keys in scheme_keys(run_config).items():
        scheme = get_scheme(name)
        shown = ", ".join(f"`{k}` ({_value(run_config.get(k))})" for k in keys) or "none"
        description = " ".join(scheme.description.split()).replace("|", "\\|")
        owns = (
            ", ".join(f"`{k}` ({_value(v)})" for k, v in sorted(scheme.config_defaults.items()))
            or "none"
        )
        lines.append(
            f"| `{name}` | {description} | `{scheme.default_family}` | `{scheme.norm}` "
            f"| {owns} | {shown} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the page, or write it with ``--write PATH``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, default=None, help="write the page here")
    args = parser.parse_args(argv)
    page = render(default_run_config())
    if args.write is None:
        print(page, end="")
    else:
        args.write.write_text(page)
        print(f"scheme_table: wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
