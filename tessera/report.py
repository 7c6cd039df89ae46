"""Print a run's per-round results table from its results folder.

Usage: ``python -m tessera.report results/<run-name>``. Exits with status 1 when the
run did not complete (no ``summary.json`` or fewer rounds than configured), so
scripts can rely on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tessera.results import TABLE_HEADER, format_round_row


def load_run(directory: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """Read ``config.json``, ``metrics.jsonl`` and ``summary.json`` of a run.

    Raises
    ------
    FileNotFoundError
        If the folder or its metrics are missing.
    """
    if not (directory / "metrics.jsonl").exists():
        raise FileNotFoundError(
            f"{directory} has no metrics.jsonl: the run did not start or wrote "
            "elsewhere (check run-config 'output-dir' and 'run-name')"
        )
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    rounds = [
        json.loads(line)
        for line in (directory / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    summary_path = directory / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return config, rounds, summary


def main(argv: list[str] | None = None) -> int:
    """Print the table; return 0 if the run completed."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tessera.report <results-folder>", file=sys.stderr)
        return 2
    directory = Path(args[0])
    try:
        config, rounds, summary = load_run(directory)
    except FileNotFoundError as err:
        print(f"report: {err}", file=sys.stderr)
        return 1
    expected = int(config.get("run_config", {}).get("num-server-rounds", len(rounds)))
    print(
        f"\nTessera run {directory.name}: strategy {config.get('scheme', '?')}, "
        f"dataset {config.get('run_config', {}).get('dataset', '?')}"
    )
    for node in config.get("nodes", []):
        if isinstance(node, dict):
            profile = node.get("profile", {})
            print(
                f"  node {node['node']} (partition {node['partition_id']}): "
                f"profile {profile.get('name')}, {node['num_train']} train samples "
                f"-> {node['arch']}"
            )
    print(TABLE_HEADER)
    for record in rounds:
        print(format_round_row(record, expected))
    by_arch = summary.get("final_personal_accuracy_by_arch") or {}
    for arch, acc in sorted(by_arch.items()):
        print(f"  final personalised accuracy on {arch}: {acc:.3f}")
    print(f"results, plots and logs: {directory.resolve()}")
    if not summary or len(rounds) < expected:
        print(
            f"report: the run is incomplete ({len(rounds)} of {expected} rounds, "
            f"summary.json {'present' if summary else 'missing'})",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
