r"""Every scheme under one evaluation protocol, in real Flower simulation.

Given schemes, a fleet (emulated device profiles), a data set, partitionings, rounds
and seeds, every scheme runs under exactly the same data split, fleet, seeds and
local budget (epochs, batch size, SGD settings), each run a real Flower simulation
(``scripts/simulate.sh``: SuperLink, simulation engine, Ray backend). Every
comparison also runs ``local`` (each client alone: the floor) and trains the fleet's
architectures centrally on the pooled client training data with the same budget
(the ceiling). The protocol is written down in ``docs/pages/protocol.md``.

Results go to one folder (``--out``, default ``results/compare/<dataset>``):

- ``settings.json``: every setting used (and the command that repeats the run);
- ``cells.jsonl``: one line per finished cell (scheme, partitioning, seed; and the
  ceiling per partitioning and seed); a rerun skips finished cells, so an
  interrupted comparison resumes where it stopped;
- ``results.csv``: one row per cell, the protocol's fields;
- ``leaderboard.md``: per partitioning, mean ± std over seeds;
- ``accuracy_rounds.png``, ``accuracy_vs_bytes.png``, ``accuracy_by_arch.png``;
- ``runs/<cell>/``: each simulation's own results folder (metrics, plots, logs).

Hyperparameters are never chosen on the reported seeds: ``--tune
scheme:key=v1|v2`` runs each value on ``--validation-seed`` (a seed not reported,
so a different server pool, partition and initialisation) and keeps, per
partitioning, the value with the best personalised accuracy on the clients' held-out
splits of that seed. A family floor ``local:<scheme>`` and a personalised row
``<scheme>+<mode>`` run with the values chosen for ``<scheme>``; the row's own tuned
keys (``--tune 'ensemble+ditto:ditto-lambda=...'``) are chosen on top of them.

Usage::

    .venv/bin/python -m benchmarks.compare        # the leaderboard (docs/pages/leaderboard.md)
    .venv/bin/python -m benchmarks.compare --schemes fedavg-groups,felo \\
        --partitionings dirichlet:0.5 --seeds 0 --rounds 5 --dataset npz:my.npz
    .venv/bin/python -m benchmarks.compare --report-only   # tables and plots again
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import read_rows, stop_group  # noqa: E402
from tessera.compare.metrics import (  # noqa: E402
    CEILING,
    FLOOR,
    Partitioning,
    ProtocolError,
    ceiling_key,
    ceiling_rates,
    family_floor,
    is_floor,
    parse_partitioning,
    run_fields,
    run_learning_rate,
)
from tessera.report import load_run  # noqa: E402

STOP = threading.Event()
"""Set on Ctrl-C: running simulations stop (their process groups are killed)."""

FLEET = "cpu-small,cpu-medium,cpu-large,jetson-orin"
LEFT_OUT = ("flwr-fedavg",)
"""Registered schemes ``all`` leaves out: ``flwr-fedavg`` is Flower's own FedAvg loop,
the same algorithm as ``fedavg`` (a yardstick for the round loop, not a scheme)."""

SUB_MODEL_NORM = {"norm": "static-batch"}
SCHEME_SETTINGS: dict[str, dict[str, Any]] = {
    # The sub-model schemes evaluate one global model (and its slices) assembled from
    # slices trained on different data; their papers use static batch norm (HeteroFL's
    # sBN: no running statistics while training, recomputed on the server for
    # evaluation), as benchmarks/submodel.py does. With plain batch norm the averaged
    # running statistics fit no slice (15-round IID digits: fedfa global 31 %).
    "heterofl": SUB_MODEL_NORM,
    "flexifed": SUB_MODEL_NORM,
    "nefl": SUB_MODEL_NORM,
    "fedfa": SUB_MODEL_NORM,
    # eta0 chosen on a held-out seed (7) among the paper's 0.001, 0.1, 1.0 by
    # benchmarks/fedhenn.py (docs/pages/fedhenn.md); the run-config default stays
    # the paper's 0.001.
    "fedhenn": {"eta0": 0.1},
}
"""Per-scheme run-config the protocol sets (each chosen on a validation seed, never on
the reported ones); everything else is the scheme's default in pyproject.toml."""


@dataclass(frozen=True)
class Settings:
    """Everything every run of one comparison shares (the resume fingerprint)."""

    dataset: str
    fleet: str
    nodes: int
    rounds: int
    local_epochs: int
    batch_size: int
    learning_rate: float
    momentum: float
    weight_decay: float
    train_time_budget: float
    server_pool_fraction: float
    local_test_fraction: float
    extra: dict[str, Any] = field(default_factory=dict)

    def run_config(self) -> dict[str, Any]:
        """Return the run-config keys every scheme gets."""
        return {
            "dataset": self.dataset,
            "sim-device-profiles": self.fleet,
            "num-server-rounds": self.rounds,
            "local-epochs": self.local_epochs,
            "batch-size": self.batch_size,
            "learning-rate": self.learning_rate,
            "momentum": self.momentum,
            "weight-decay": self.weight_decay,
            "train-time-budget": self.train_time_budget,
            "server-pool-fraction": self.server_pool_fraction,
            "local-test-fraction": self.local_test_fraction,
            "min-nodes": self.nodes,
            **self.extra,
        }

    def fingerprint(self) -> str:
        """Return a short hash of the settings (cells of other settings never count as done)."""
        text = json.dumps(self.__dict__, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Cell:
    """One run: a scheme (with its own run-config), a partitioning and a seed."""

    scheme: str
    partitioning: Partitioning
    seed: int
    config: tuple[tuple[str, Any], ...] = ()
    variant: str = ""

    @property
    def label(self) -> str:
        """The scheme and, for a tuning candidate, its value."""
        return f"{self.scheme}[{self.variant}]" if self.variant else self.scheme

    @property
    def key(self) -> str:
        """Resume key (also the run's folder name; ``local:fedfa`` -> ``local-like-fedfa``)."""
        return f"{self.label.replace(':', '-like-')}--{self.partitioning.slug}--seed{self.seed}"

    def row(self, fields: Mapping[str, Any], seconds: float) -> dict[str, Any]:
        """Return the ``cells.jsonl`` record of this cell, finished with ``fields``."""
        return {
            "key": self.key,
            "kind": "scheme",
            "scheme": self.label,
            "partitioning": self.partitioning.label,
            "seed": self.seed,
            "run_config": dict(self.config),
            "fields": dict(fields),
            "seconds": round(seconds, 1),
        }


def format_value(value: Any) -> str:
    """Write a run-config value as Flower's ``--run-config`` parses it (TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if "'" in text:
        raise ProtocolError(f"run-config value {text!r} holds a quote; it cannot be passed")
    return f"'{text}'"


def run_config_text(config: Mapping[str, Any]) -> str:
    """``key=value`` pairs for ``flwr run --run-config``."""
    return " ".join(f"{k}={format_value(v)}" for k, v in config.items())


def parse_value(text: str) -> Any:
    """Parse a command-line value: bool, int, float, else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_assignments(items: Sequence[str], *, what: str) -> dict[str, Any]:
    """Parse ``key=value`` items (``--set``)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ProtocolError(f"{what} {item!r} is not key=value; e.g. {what} norm=group")
        out[key.strip()] = parse_value(value)
    return out


def parse_scheme_items(items: Sequence[str], *, what: str) -> dict[str, dict[str, Any]]:
    """Parse ``scheme:key=value`` items (``--scheme-set`` and ``--tune``)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        scheme, sep, rest = item.partition(":")
        key, sep2, value = rest.partition("=")
        if not (sep and sep2 and scheme.strip() and key.strip()):
            raise ProtocolError(
                f"{what} {item!r} is not scheme:key=value; e.g. {what} fedhenn:eta0=0.1"
            )
        out.setdefault(scheme.strip(), {})[key.strip()] = value.strip()
    return out


def all_schemes() -> list[str]:
    """Every registered scheme but :data:`LEFT_OUT`, the floor last."""
    import strategies

    names = [s for s in strategies.list_schemes() if s not in LEFT_OUT and s != FLOOR]
    return [*names, FLOOR]


PERSONALISED = "+"
"""Separates a scheme from its run-config ``personalise`` mode in a row's name:
``fedavg-groups+ditto`` is ``fedavg-groups`` with ``personalise=ditto``."""


def split_variant(name: str) -> tuple[str, str | None]:
    """Return a row's scheme and its personalisation mode (``None`` for none).

    Examples
    --------
    >>> split_variant("fedavg-groups+ditto"), split_variant("felo")
    (('fedavg-groups', 'ditto'), ('felo', None))
    """
    scheme, sep, mode = name.partition(PERSONALISED)
    return scheme, (mode if sep else None)


def check_schemes(names: Sequence[str]) -> list[str]:
    """Validate scheme names (``all`` expands in place); add the floor when it is missing.

    A name ``<scheme>+<mode>`` is the scheme with run-config ``personalise=<mode>``, a
    row of its own; the scheme must accept personalisation.
    """
    import strategies
    from strategies.core.registry import personalisable_schemes
    from tessera.config.choices import PERSONALISE_MODES

    known = strategies.list_schemes()
    expanded = [n for name in names for n in (all_schemes() if name == "all" else [name])]
    bad = [n for n in expanded if split_variant(n)[0] not in known]
    if bad:
        raise ProtocolError(f"unknown scheme(s) {bad}; use 'all' or some of {known}")
    modes = [m for m in PERSONALISE_MODES if m != "none"]
    for name in expanded:
        scheme, mode = split_variant(name)
        if mode is None:
            continue
        if mode not in modes:
            raise ProtocolError(
                f"{name!r}: personalisation {mode!r} is not one of {', '.join(modes)}"
            )
        if not strategies.get_scheme(scheme).personalise:
            raise ProtocolError(
                f"{name!r}: {scheme} shares no whole model, so it cannot be personalised; "
                f"use one of {', '.join(personalisable_schemes())}"
            )
    unique = list(dict.fromkeys(n for n in expanded if n != FLOOR))
    return [*unique, FLOOR]


def scheme_config(scheme: str, overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Return the scheme's own run-config: the protocol's, then the user's ``--scheme-set``.

    A family floor ``local:<scheme>`` is ``local`` with ``local-like=<scheme>`` and the
    protocol's settings of that scheme (e.g. its normalisation), so its clients build
    exactly the models the scheme's clients build.
    """
    if is_floor(scheme) and scheme != FLOOR:
        like = scheme.split(":", 1)[1]
        return {
            "strategy": FLOOR,
            "local-like": like,
            **SCHEME_SETTINGS.get(like, {}),
            **overrides.get(scheme, {}),
        }
    base, mode = split_variant(scheme)
    return {
        "strategy": base,
        **SCHEME_SETTINGS.get(base, {}),
        **({"personalise": mode} if mode else {}),
        **overrides.get(scheme, {}),
    }


def family_floors(
    settings: Settings, schemes: Sequence[str], overrides: Mapping[str, Mapping[str, Any]]
) -> dict[str, str]:
    """Return each scheme's floor: ``local``, or the floor of its own architectures.

    A scheme whose clients pick from the same candidate architectures as ``local``
    (the ``cnn`` family) is compared with ``local``; any other (sub-model slices, the
    ensemble's ``mixed`` family) with ``local:<scheme>``, each client alone on what the
    scheme would give it. Schemes with the same candidates share one floor (NeFL and
    FedFA slice the same global model the same ways). A personalised row
    (``fedavg-groups+ditto``) has its scheme's floor.
    """
    from benchmarks.harness import default_run_config
    from strategies import get_scheme
    from tessera.config import RunConfig

    base = default_run_config()

    def candidates(name: str) -> tuple[str, ...]:
        config = {**base, **settings.run_config(), **scheme_config(name, overrides)}
        scheme = get_scheme(str(config["strategy"]))
        options = scheme.parse_options(config)
        run = RunConfig.from_flower(config)
        family = run.scheme.model_family or scheme.family(options)
        return tuple(scheme.client(run=run, options=options).candidate_archs(family))

    seen = {candidates(FLOOR): FLOOR}
    return {
        name: seen.setdefault(candidates(name), family_floor(split_variant(name)[0]))
        for name in schemes
        if not is_floor(name)
    }


# --------------------------------------------------------------------- one simulation
def simulate(
    cell: Cell,
    settings: Settings,
    out: Path,
    *,
    timeout: float,
    log: Callable[[str], None],
    ray_address: str | None = None,
) -> list[dict[str, Any]]:
    """Run one cell as a Flower simulation; return its round records.

    With ``ray_address`` the simulation joins that running Ray head
    (``scripts/simulate.sh --ray-address``) instead of starting a Ray of its own.

    Raises
    ------
    RuntimeError
        If the simulation fails or completes fewer rounds than asked.
    """
    config = {
        **settings.run_config(),
        **cell.partitioning.run_config(),
        "seed": cell.seed,
        **dict(cell.config),
    }
    runs = out / "runs"
    run_dir = runs / cell.key
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished earlier attempt
    home = out / "flwr-home" / cell.key
    shutil.rmtree(home, ignore_errors=True)
    cmd = [
        "bash",
        str(ROOT / "scripts" / "simulate.sh"),
        "--nodes",
        str(settings.nodes),
        "--run-name",
        cell.key,
        "--output-dir",
        str(runs),
        *(["--ray-address", ray_address] if ray_address else []),
        "--run-config",
        run_config_text(config),
    ]
    env = {**os.environ, "FLWR_HOME_SIM": str(home)}
    runs.mkdir(parents=True, exist_ok=True)
    log_path = runs / f"{cell.key}.log"
    seen = 0
    with log_path.open("w") as fh:
        # its own process group: SuperLink, the simulation engine and Ray go with it
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        started = time.monotonic()
        try:
            while proc.poll() is None:
                if STOP.wait(2.0):
                    raise RuntimeError(f"{cell.key}: stopped")
                seen = _round_progress(run_dir, seen, settings.rounds, log)
                if time.monotonic() - started > timeout:
                    raise RuntimeError(
                        f"{cell.key}: no result after {timeout:.0f} s (log {log_path})"
                    )
        finally:
            if proc.poll() is None:
                stop_group(proc)
    if proc.returncode != 0:
        tail = log_path.read_text()[-2500:]
        raise RuntimeError(f"{cell.key}: simulation exited {proc.returncode}\n{tail}")
    try:
        _, rounds, _ = load_run(run_dir)
    except FileNotFoundError as err:
        raise RuntimeError(f"{cell.key}: {err} (log {log_path})") from None
    if len(rounds) != settings.rounds:
        raise RuntimeError(
            f"{cell.key}: completed {len(rounds)} of {settings.rounds} rounds (log {log_path})"
        )
    shutil.rmtree(home, ignore_errors=True)
    return rounds


def _round_progress(run_dir: Path, seen: int, total: int, log: Callable[[str], None]) -> int:
    """Print one line per round the running simulation finished since the last look."""
    try:
        _, rounds, _ = load_run(run_dir)
    except (OSError, json.JSONDecodeError):
        return seen  # not started yet, or the line is being written
    for record in rounds[seen:]:
        acc = record.get("personal_accuracy_mean")
        glob = record.get("global_accuracy")
        log(
            f"      {run_dir.name} round {record['round']}/{total}: personalised "
            f"{'-' if acc is None else f'{acc:.3f}'}, global "
            f"{'-' if glob is None else f'{glob:.3f}'} ({record['round_seconds']:.1f} s)"
        )
    return max(seen, len(rounds))


# --------------------------------------------------------------------- the grid
@dataclass
class Comparison:
    """One comparison: its settings, its cells and its results folder."""

    settings: Settings
    schemes: list[str]
    partitionings: list[Partitioning]
    seeds: list[int]
    out: Path
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    tune: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    floors: dict[str, str] = field(default_factory=dict)
    """Each scheme's floor (:func:`family_floors`); absent: ``local``."""
    validation_seed: int = 7
    ceiling: bool = True
    timeout: float = 1800.0
    parallel: int = 1
    ray_address: str | None = None
    """A running Ray head's GCS address every simulation joins (``--ray-address``);
    ``None``: each starts a Ray of its own. Not a setting: the results are the same."""
    log: Callable[[str], None] = field(default=lambda text: print(text, flush=True))

    @property
    def jsonl(self) -> Path:
        """The finished cells."""
        return self.out / "cells.jsonl"

    def done(self) -> dict[str, dict[str, Any]]:
        """Finished cells of these settings, by key (the last line of a key wins)."""
        fp = self.settings.fingerprint()
        return {r["key"]: r for r in read_rows(self.jsonl) if r.get("settings") == fp}

    def _append(self, row: dict[str, Any]) -> None:
        row = {**row, "settings": self.settings.fingerprint()}
        with self.jsonl.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    def check_folder(self) -> None:
        """Refuse a results folder that holds another comparison's settings."""
        path = self.out / "settings.json"
        if not path.exists():
            return
        old = json.loads(path.read_text()).get("settings", {})
        new = json.loads(json.dumps(self.settings.__dict__, default=str))
        differ = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if differ:
            detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differ)
            raise ProtocolError(
                f"{self.out} holds a comparison with other settings ({detail}); "
                "pass another --out, or the same settings to resume it"
            )

    def write_settings(self, argv: Sequence[str]) -> dict[str, Any]:
        """Write and return ``settings.json`` (what a repeat needs)."""
        info = {
            "settings": json.loads(json.dumps(self.settings.__dict__, default=str)),
            "fingerprint": self.settings.fingerprint(),
            "schemes": self.schemes,
            "scheme_run_config": {s: scheme_config(s, self.overrides) for s in self.order},
            "floors": self.floors,
            "partitionings": [p.label for p in self.partitionings],
            "seeds": self.seeds,
            "validation_seed": self.validation_seed if self.tune else None,
            "tune": self.tune,
            "ceiling": self.ceiling,
            "common_run_config": self.settings.run_config(),
            "command": "python -m benchmarks.compare " + " ".join(shlex.quote(a) for a in argv),
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "settings.json").write_text(json.dumps(info, indent=2) + "\n")
        return info

    # ------------------------------------------------------------------ tuning
    def tuning_cells(self, schemes: Sequence[str] | None = None) -> list[Cell]:
        """Each candidate value of each tuned key, on the validation seed.

        ``schemes`` limits them to some tuned schemes. A personalised row's candidates
        run with the values already chosen for its scheme (:meth:`inherited`), so
        those must be finished first (:meth:`run` tunes the schemes before their rows).
        """
        done = self.done() if self.tune else {}
        cells = []
        for scheme, keys in self.tune.items():
            if schemes is not None and scheme not in schemes:
                continue
            for key, values in keys.items():
                for value in values:
                    for part in self.partitionings:
                        config = {
                            **scheme_config(scheme, self.overrides),
                            **self.inherited(scheme, part, done, own=False),
                            key: value,
                        }
                        cells.append(
                            Cell(
                                scheme,
                                part,
                                self.validation_seed,
                                tuple(config.items()),
                                variant=f"{key}={value}",
                            )
                        )
        return cells

    def inherited(
        self,
        scheme: str,
        part: Partitioning,
        done: Mapping[str, dict[str, Any]] | None = None,
        *,
        own: bool = True,
    ) -> dict[str, Any]:
        """Return the tuned values a row runs with: its scheme's, then its own.

        A family floor ``local:<scheme>`` and a personalised row ``<scheme>+<mode>``
        take the values tuned for ``<scheme>`` (e.g. the ensemble's learning rate), so
        they train the same models with the same settings; a personalised row's own
        tuned keys (e.g. ``ditto-lambda``) come on top unless ``own`` is false.

        Examples
        --------
        >>> Comparison.lineage("local:ensemble"), Comparison.lineage("ensemble+ditto")
        (['ensemble'], ['ensemble', 'ensemble+ditto'])
        """
        done = self.done() if done is None else done
        lineage = self.lineage(scheme)
        if not own:
            lineage = [name for name in lineage if name != scheme]
        out: dict[str, Any] = {}
        for name in lineage:
            out.update(self.chosen(name, part, done))
        return out

    @staticmethod
    def lineage(scheme: str) -> list[str]:
        """Return the tuned names a row takes values from, the most general first."""
        name = scheme.split(":", 1)[-1]  # "local:fedfa" -> "fedfa"
        base, mode = split_variant(name)
        return [base] if mode is None or is_floor(scheme) else [base, name]

    def chosen(
        self, scheme: str, part: Partitioning, done: Mapping[str, dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """Return the tuned values for a scheme and partitioning (best validation accuracy).

        ``done`` is :meth:`done` when the caller has read it already.
        """
        done = self.done() if done is None else done
        out: dict[str, Any] = {}
        for key, values in self.tune.get(scheme, {}).items():
            scored = []
            for value in values:
                cell = Cell(scheme, part, self.validation_seed, variant=f"{key}={value}")
                row = done.get(cell.key)
                if row is not None and row["fields"]["personal"] is not None:
                    scored.append((row["fields"]["personal"], value))
            if scored:
                out[key] = max(scored, key=lambda s: s[0])[1]
        return out

    def ceiling_grid(self, scheme: str, part: Partitioning, done: Mapping[str, Any]) -> list[float]:
        """Return the learning rates a scheme's ceiling is tuned over (none when not tuned).

        A scheme whose run-config ``learning-rate`` is tuned (its own or its
        lineage's, e.g. ``local:ensemble`` takes the ensemble's) gets its ceiling
        tuned over the same grid, the rate chosen for the scheme listed first.
        """
        for name in reversed(self.lineage(scheme)):
            grid = self.tune.get(name, {}).get("learning-rate")
            if grid:
                first = self.chosen(name, part, done).get("learning-rate")
                values = [float(v) for v in grid]
                return sorted(values, key=lambda v: v != first)
        return []

    def ceiling_choice(
        self, scheme: str, part: Partitioning, done: Mapping[str, Any] | None = None
    ) -> dict[str, float]:
        """Return, per architecture, the rate of its ceiling for a scheme (empty: the run's).

        From the validation seed's ceiling cell (:func:`ceiling_rates`); empty for a
        scheme whose learning rate is not tuned, or before that cell exists.
        """
        done = self.done() if done is None else done
        grid = self.ceiling_grid(scheme, part, done)
        if not grid:
            return {}
        cell = done.get(f"{CEILING}--{part.slug}--seed{self.validation_seed}", {})
        return ceiling_rates(cell.get("centralised", {}), grid)

    def tunes_learning_rate(self) -> bool:
        """Return whether any scheme's ``learning-rate`` is tuned (its ceiling is then)."""
        return any("learning-rate" in keys for keys in self.tune.values())

    @property
    def order(self) -> list[str]:
        """Every scheme the grid runs: ``local``, the family floors, then the schemes."""
        family = sorted({f for f in self.floors.values() if f != FLOOR})
        return [FLOOR, *family, *[s for s in self.schemes if not is_floor(s)]]

    def cells(self) -> list[Cell]:
        """Return the reported cells: seed, then partitioning, then scheme (floors first).

        Each row runs with :meth:`inherited` tuned values.
        """
        order = self.order
        done = self.done() if self.tune else {}  # read once, not once per cell
        cells = []
        for seed in self.seeds:
            for part in self.partitionings:
                for scheme in order:
                    config = {
                        **scheme_config(scheme, self.overrides),
                        **self.inherited(scheme, part, done),
                    }
                    cells.append(Cell(scheme, part, seed, tuple(config.items())))
        return cells

    # ------------------------------------------------------------------ running
    def run(self) -> list[str]:
        """Run what is not done yet; return the keys of cells that failed."""
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        failed: list[str] = []
        if self.tune:
            self.log(f"tuning on validation seed {self.validation_seed}:")
            rows = [s for s in self.tune if split_variant(s)[1] is not None]
            bases = [s for s in self.tune if s not in rows]
            failed += self._run_cells(self.tuning_cells(bases))
            if rows:  # a personalised row tunes on top of its scheme's chosen values
                failed += self._run_cells(self.tuning_cells(rows))
            for scheme in self.tune:
                for part in self.partitionings:
                    self.log(f"  {scheme} on {part.label}: chose {self.chosen(scheme, part)}")
            if self.ceiling and self.tunes_learning_rate():
                # a tuned rate tunes the ceiling: every candidate's architectures centrally
                failed += self._run_ceilings([self.validation_seed])
                for scheme in self.tune:
                    for part in self.partitionings:
                        if choice := self.ceiling_choice(scheme, part):
                            self.log(f"  ceiling of {scheme} on {part.label}: rates {choice}")
        cells = self.cells()
        for seed in self.seeds:  # a seed's ceilings as soon as its runs are in
            self.log(f"seed {seed}:")
            failed += self._run_cells([c for c in cells if c.seed == seed])
            if self.ceiling:
                failed += self._run_ceilings([seed])
        return failed

    def pending(self, cells: Sequence[Cell]) -> list[Cell]:
        """Return the cells to run: unfinished, or finished with another run-config.

        A finished cell whose recorded run-config differs from the cell's (a tuned
        value chosen again once more candidates finished, a changed scheme setting)
        is run again, and the log says which keys changed.
        """
        done = self.done()
        todo = []
        for cell in cells:
            row = done.get(cell.key)
            if row is None:
                todo.append(cell)
                continue
            want = json.loads(json.dumps(dict(cell.config)))
            have = row.get("run_config", want)
            if have != want:
                changed = ", ".join(
                    f"{k} {have.get(k)!r} -> {want.get(k)!r}"
                    for k in sorted(set(have) | set(want))
                    if have.get(k) != want.get(k)
                )
                self.log(f"  {cell.key} ran with another run-config ({changed}): running it again")
                todo.append(cell)
        return todo

    def _run_cells(self, cells: Sequence[Cell]) -> list[str]:
        todo = self.pending(cells)
        self.log(f"{len(cells)} runs, {len(cells) - len(todo)} already done, {len(todo)} to run")
        failed: list[str] = []
        started = time.monotonic()
        finished = 0
        lock = threading.Lock()

        def one(cell: Cell) -> None:
            nonlocal finished
            tick = time.monotonic()
            try:
                rounds = simulate(
                    cell,
                    self.settings,
                    self.out,
                    timeout=self.timeout,
                    log=self.log,
                    ray_address=self.ray_address,
                )
                fields = run_fields(rounds)
            except (RuntimeError, ProtocolError) as err:
                self.log(f"    {cell.key} FAILED: {err}")
                with lock:
                    failed.append(cell.key)
                return
            seconds = time.monotonic() - tick
            with lock:
                self._append(cell.row(fields, seconds))
                finished += 1
                left = (time.monotonic() - started) / finished * (len(todo) - finished)
                glob = fields["global"]
                self.log(
                    f"  [{finished}/{len(todo)}] {cell.key}: personalised "
                    f"{fields['personal']:.3f}, global {'-' if glob is None else f'{glob:.3f}'}, "
                    f"archs {', '.join(fields['archs'])} ({seconds:.0f} s; "
                    f"~{left / 60:.0f} min left)"
                )

        if self.parallel <= 1:
            for cell in todo:
                self.log(f"  starting {cell.key}")
                one(cell)
        else:
            pool = ThreadPoolExecutor(max_workers=self.parallel)
            futures = [pool.submit(one, cell) for cell in todo]
            try:
                for future in as_completed(futures):
                    future.result()
            except BaseException:  # Ctrl-C: stop the running simulations, keep what finished
                STOP.set()
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            pool.shutdown()
        return failed

    def ceiling_plan(
        self, seed: int, part: Partitioning, done: Mapping[str, Any]
    ) -> dict[str, tuple[str, float | None]]:
        """Return the ceiling entries a seed's runs need: key -> (architecture, rate).

        Each architecture a run trained, at the rate the run trained it (a scheme's
        own, or the common one: ``None``), or, on a reported seed, at the rate its
        ceiling was tuned to on the validation seed (:meth:`ceiling_choice`). On the
        validation seed: the architectures of every candidate of a scheme whose
        learning rate is tuned, each at the candidate's rate.
        """
        validation = seed == self.validation_seed
        runs = [
            r
            for r in done.values()
            if r["kind"] == "scheme"
            and r["partitioning"] == part.label
            and r["seed"] == seed
            and (
                # the validation seed: the candidates of a scheme whose rate is tuned
                self.ceiling_grid(r["scheme"].split("[", 1)[0], part, done)
                if validation
                else "[" not in r["scheme"]
            )
        ]
        archs: dict[str, tuple[str, float | None]] = {}
        for r in runs:
            rate = run_learning_rate(r.get("run_config", {}))
            tuned = {} if validation else self.ceiling_choice(r["scheme"], part, done)
            fields = r["fields"]
            for a in {*fields.get("archs", ()), *fields.get("global_by_arch", {})}:
                used = tuned.get(a, rate)
                archs[ceiling_key(a, used)] = (a, used)
        return archs

    def _run_ceilings(self, seeds: Sequence[int]) -> list[str]:
        """Train, per partitioning and seed, every architecture its runs trained."""
        from tessera.compare.ceiling import CeilingSettings, train_centralised
        from tessera.data import PartitionConfig

        failed = []
        for seed in seeds:
            for part in self.partitionings:
                done = self.done()
                key = f"{CEILING}--{part.slug}--seed{seed}"
                archs = self.ceiling_plan(seed, part, done)
                have = dict(done.get(key, {}).get("centralised", {}))
                missing = sorted(set(archs) - set(have))
                if not missing:
                    continue
                self.log(f"  ceiling {part.label} seed {seed}: {len(missing)} architectures")
                s = self.settings
                ceiling = CeilingSettings(
                    dataset=s.dataset,
                    partition=PartitionConfig(
                        scheme=part.scheme,
                        alpha=part.alpha,
                        classes_per_client=part.classes,
                        seed=seed,
                    ),
                    num_partitions=s.nodes,
                    pool_fraction=s.server_pool_fraction,
                    test_fraction=s.local_test_fraction,
                    epochs=s.rounds * s.local_epochs,
                    batch_size=s.batch_size,
                    learning_rate=s.learning_rate,
                    momentum=s.momentum,
                    weight_decay=s.weight_decay,
                    norm=str(s.extra.get("norm", "batch")),
                    flat_input=str(s.extra.get("flat-input", "signal")),
                )
                seconds = float(done.get(key, {}).get("seconds", 0.0))
                for name in missing:  # recorded one by one: a stop loses one architecture
                    arch, rate = archs[name]
                    at = ceiling if rate is None else replace(ceiling, learning_rate=rate)
                    tick = time.monotonic()
                    try:
                        have[name] = train_centralised(at, [arch], seed=seed, log=self.log)[arch]
                    except (ValueError, RuntimeError) as err:
                        self.log(f"    FAILED {name}: {err}")
                        failed.append(f"{key}:{name}")
                        continue
                    seconds += time.monotonic() - tick
                    self._append(
                        {
                            "key": key,
                            "kind": CEILING,
                            "scheme": CEILING,
                            "partitioning": part.label,
                            "seed": seed,
                            "centralised": dict(have),
                            "seconds": round(seconds, 1),
                        }
                    )
        return failed

    def report(self) -> Path:
        """Write the CSV, the leaderboard and the plots from the finished cells."""
        from tessera.compare.report import (
            flat_rows,
            goal_section,
            markdown_tables,
            plot_all,
            write_csv,
        )

        wanted = {c.key for c in self.cells()} | {
            f"{CEILING}--{p.slug}--seed{s}" for p in self.partitionings for s in self.seeds
        }
        done = self.done()
        cells = [r for k, r in done.items() if k in wanted]
        rates = {
            (scheme, part.label): choice
            for scheme in self.order
            for part in self.partitionings
            if (choice := self.ceiling_choice(scheme, part, done))
        }
        rows = flat_rows(cells, self.floors, rates)
        write_csv(rows, self.out / "results.csv")
        header = _header(self)
        text = header + markdown_tables(rows, self.order) + goal_section(rows)
        (self.out / "leaderboard.md").write_text(text)
        if rows:
            plot_all(rows, self.order, self.out)
        return self.out / "leaderboard.md"


def _header(comparison: Comparison) -> str:
    s = comparison.settings
    return (
        f"Dataset `{s.dataset}`, {s.nodes} clients on the fleet `{s.fleet}` "
        f"(train-time-budget {s.train_time_budget} s), {s.rounds} rounds of "
        f"{s.local_epochs} local epoch(s), batch {s.batch_size}, SGD lr {s.learning_rate} "
        f"momentum {s.momentum} weight decay {s.weight_decay}. Accuracy in percent, "
        "mean ± std over seeds (population std). Protocol: docs/pages/protocol.md.\n\n"
    )


def build_parser() -> argparse.ArgumentParser:
    """Build the command line."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        description="Run every scheme under one evaluation protocol (Flower simulation).",
    )
    p.add_argument(
        "--schemes",
        default="all",
        help="comma-separated, or 'all' (default); 'all' may be one of the items, and "
        "<scheme>+<mode> (e.g. fedavg-groups+ditto) is a row with run-config personalise",
    )
    p.add_argument(
        "--partitionings",
        default="iid,dirichlet:0.5,pathological:2",
        help="comma-separated: iid, dirichlet:<alpha>, pathological:<classes>",
    )
    p.add_argument("--seeds", default="0,1,2", help="reported seeds (comma-separated)")
    p.add_argument("--dataset", default="digits", help="digits, npz:<path> or a flwr-datasets name")
    p.add_argument(
        "--fleet", default=FLEET, help="emulated device profiles, one per client in turn"
    )
    p.add_argument("--nodes", type=int, default=8, help="clients (simulated SuperNodes)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument(
        "--train-time-budget",
        type=float,
        default=0.05,
        help="seconds a device may spend on a round (sets how the fleet picks sizes)",
    )
    p.add_argument("--server-pool-fraction", type=float, default=0.1)
    p.add_argument("--local-test-fraction", type=float, default=0.2)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run-config for every scheme (repeatable)",
    )
    p.add_argument(
        "--scheme-set",
        action="append",
        default=[],
        metavar="SCHEME:KEY=VALUE",
        help="run-config for one scheme (repeatable)",
    )
    p.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="SCHEME:KEY=V1|V2",
        help="choose a value on --validation-seed (repeatable)",
    )
    p.add_argument("--validation-seed", type=int, default=7)
    p.add_argument("--no-ceiling", action="store_true", help="skip the centralised ceiling")
    p.add_argument(
        "--no-family-floors",
        action="store_true",
        help="judge every scheme against local on the cnn family (no local:<scheme> runs)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per simulation")
    p.add_argument("--parallel", type=int, default=1, help="simulations at once")
    p.add_argument(
        "--ray-address",
        default=None,
        help="HOST:PORT of a running Ray head's GCS (as 'ray start --head' prints) every "
        "simulation joins, instead of starting a Ray of its own per run",
    )
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--report-only", action="store_true", help="rewrite tables and plots only")
    return p


def comparison_from_args(args: argparse.Namespace) -> Comparison:
    """Parse and check every argument once (a clear error names the bad value)."""
    names = [s.strip() for s in args.schemes.split(",") if s.strip()]
    schemes = check_schemes(names)
    partitionings = [parse_partitioning(p) for p in args.partitionings.split(",") if p.strip()]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ProtocolError(f"--seeds {args.seeds!r}: give integers, e.g. 0,1,2") from None
    if not seeds or not partitionings:
        raise ProtocolError("give at least one seed (--seeds) and one partitioning")
    if args.validation_seed in seeds and args.tune:
        raise ProtocolError(
            f"--validation-seed {args.validation_seed} is also a reported seed; tune on a "
            "seed you do not report"
        )
    for name, value in (
        ("--nodes", args.nodes),
        ("--rounds", args.rounds),
        ("--local-epochs", args.local_epochs),
        ("--batch-size", args.batch_size),
    ):
        if value < 1:
            raise ProtocolError(f"{name} {value} must be a positive integer")
    if args.nodes < 2:
        raise ProtocolError(f"--nodes {args.nodes}: a federation needs at least 2 clients")
    tune_raw = parse_scheme_items(args.tune, what="--tune")
    tune = {
        s: {k: [parse_value(v) for v in vs.split("|")] for k, vs in keys.items()}
        for s, keys in tune_raw.items()
    }
    overrides = {
        s: {k: parse_value(v) for k, v in keys.items()}
        for s, keys in parse_scheme_items(args.scheme_set, what="--scheme-set").items()
    }
    for scheme in [*tune, *overrides]:
        if scheme not in schemes:
            raise ProtocolError(f"{scheme!r} is tuned or set but not among --schemes {schemes}")
    settings = Settings(
        dataset=args.dataset,
        fleet=args.fleet,
        nodes=args.nodes,
        rounds=args.rounds,
        local_epochs=args.local_epochs,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        train_time_budget=args.train_time_budget,
        server_pool_fraction=args.server_pool_fraction,
        local_test_fraction=args.local_test_fraction,
        extra=parse_assignments(args.set, what="--set"),
    )
    _check_run_config(settings, schemes, overrides)
    floors = {} if args.no_family_floors else family_floors(settings, schemes, overrides)
    _check_run_config(settings, sorted(set(floors.values()) - {FLOOR}), overrides)
    slug = args.dataset.replace(":", "-").replace("/", "-")
    out = args.out or ROOT / "results" / "compare" / slug
    return Comparison(
        settings=settings,
        schemes=schemes,
        partitionings=partitionings,
        seeds=seeds,
        out=out,
        overrides=overrides,
        tune=tune,
        floors=floors,
        validation_seed=args.validation_seed,
        ceiling=not args.no_ceiling,
        timeout=args.timeout,
        parallel=args.parallel,
        ray_address=args.ray_address or None,
    )


def _check_run_config(
    settings: Settings, schemes: Sequence[str], overrides: Mapping[str, Mapping[str, Any]]
) -> None:
    """Parse every scheme's full run-config as the ServerApp will (fail before any run)."""
    from benchmarks.harness import default_run_config
    from strategies import get_scheme
    from strategies.core.aggregators import get_aggregator
    from tessera.config import ConfigError, RunConfig

    base = default_run_config()
    for scheme in schemes:
        config = {**base, **settings.run_config(), **scheme_config(scheme, overrides)}
        unknown = sorted(set(config) - set(base))
        if unknown:
            raise ProtocolError(
                f"run-config key(s) {unknown} are not Tessera keys; see [tool.flwr.app.config] "
                "in pyproject.toml"
            )
        try:
            run = RunConfig.from_flower(config)
            run.validate()
            get_aggregator(run.aggregation.aggregator)
            get_scheme(str(config["strategy"])).parse_options(config)
        except (ConfigError, ValueError) as err:
            raise ProtocolError(f"scheme {scheme}: {err}") from None


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison; 0 when every cell finished."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(args_list)
    try:
        comparison = comparison_from_args(args)
        comparison.check_folder()
    except ProtocolError as err:
        print(f"compare: {err}", file=sys.stderr)
        return 2
    if args.report_only and (comparison.out / "settings.json").exists():
        info = json.loads((comparison.out / "settings.json").read_text())  # keep the command
    else:
        info = comparison.write_settings(args_list)
    print("settings (repeat with the command below; settings.json has them all):")
    print(json.dumps({k: info[k] for k in ("settings", "schemes", "partitionings", "seeds")}))
    print(f"  command: {info['command']}")
    print(f"  results: {comparison.out}")
    failed: list[str] = []
    if not args.report_only:
        previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it like Ctrl-C
        try:
            failed = comparison.run()
        finally:
            signal.signal(signal.SIGTERM, previous)
    table = comparison.report()
    print(table.read_text())
    print(f"results: {comparison.out} (results.csv, leaderboard.md, *.png)")
    if failed:
        print(f"compare: {len(failed)} cell(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
