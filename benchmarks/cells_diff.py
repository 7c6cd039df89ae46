"""Two leaderboard cell files side by side: the same rows, before and after a change.

``benchmarks.compare`` keeps every finished federation in a ``cells.jsonl``. When a
change of the default is tried on some rows only (its cells written to another
folder), this prints, per row (scheme, partitioning), the mean personalised and
global accuracy of both files over the seeds both hold::

    .venv/bin/python -m benchmarks.cells_diff BEFORE/cells.jsonl AFTER/cells.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

Row = tuple[str, str]
"""A leaderboard row: scheme label and partitioning."""


def scheme_cells(lines: Iterable[str]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Return the federated cells of a ``cells.jsonl`` by (scheme, partitioning, seed)."""
    cells: dict[tuple[str, str, int], dict[str, Any]] = {}
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("kind") != "scheme":
            continue
        cells[(record["scheme"], record["partitioning"], int(record["seed"]))] = record["fields"]
    return cells


def paired_rows(
    before: Mapping[tuple[str, str, int], Mapping[str, Any]],
    after: Mapping[tuple[str, str, int], Mapping[str, Any]],
    field: str,
) -> dict[Row, tuple[list[int], float, float]]:
    """Per row both files hold, the common seeds and the two means of ``field``.

    Cells whose ``field`` is missing or ``None`` (a scheme with no global model) are
    left out.

    >>> b = {("a", "iid", 0): {"personal": 0.8}, ("a", "iid", 1): {"personal": 0.6}}
    >>> a = {("a", "iid", 0): {"personal": 0.7}, ("a", "iid", 2): {"personal": 0.1}}
    >>> paired_rows(b, a, "personal")
    {('a', 'iid'): ([0], 0.8, 0.7)}
    """
    seeds: dict[Row, list[int]] = {}
    for scheme, partitioning, seed in sorted(set(before) & set(after)):
        key = (scheme, partitioning, seed)
        if before[key].get(field) is None or after[key].get(field) is None:
            continue
        seeds.setdefault((scheme, partitioning), []).append(seed)
    return {
        row: (
            common,
            statistics.fmean(float(before[(*row, s)][field]) for s in common),
            statistics.fmean(float(after[(*row, s)][field]) for s in common),
        )
        for row, common in seeds.items()
    }


def _pct(value: tuple[list[int], float, float] | None, i: int) -> str:
    """Return the ``i``-th figure of a :func:`paired_rows` entry in %, or ``-``."""
    return "-" if value is None else f"{100 * value[i]:.1f}"


def table(
    before: Mapping[tuple[str, str, int], Mapping[str, Any]],
    after: Mapping[tuple[str, str, int], Mapping[str, Any]],
) -> str:
    """Return a markdown table: personalised and global %, before and after, per row."""
    personal = paired_rows(before, after, "personal")
    overall = paired_rows(before, after, "global")
    lines = [
        "| scheme | partitioning | seeds | personalised: before | after | global: before | after |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for row in sorted(set(personal) | set(overall)):
        p = personal.get(row)
        g = overall.get(row)
        seeds = (p or g or ([], 0.0, 0.0))[0]
        lines.append(
            f"| {row[0]} | {row[1]} | {','.join(map(str, seeds))} | {_pct(p, 1)} | "
            f"{_pct(p, 2)} | {_pct(g, 1)} | {_pct(g, 2)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table of two ``cells.jsonl`` files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    before = scheme_cells(args.before.read_text().splitlines())
    after = scheme_cells(args.after.read_text().splitlines())
    print(table(before, after))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
