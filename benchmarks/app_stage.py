"""What ``flwr run`` pays to build the app, from the project and from its staged copy.

``flwr run DIR`` walks every file under ``DIR`` before its publish rules keep the
app's (``flwr.cli.utils.collect_files``). This benchmark times, alternating in one
run (A, B, A, B, ...), Flower's own FAB build from the project folder and the path
the run scripts take: :func:`tessera.app_stage.stage_app` into a folder, then the
same Flower build from that folder. Both FABs must hash the same.

Usage::

    .venv/bin/python benchmarks/app_stage.py [--repeats 5] [--project .]

Prints the files each walk saw, the median seconds of each path and their ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _files_under(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def measure(project: Path, repeats: int) -> dict[str, Any]:
    """Time both paths ``repeats`` times each, alternating; return the figures."""
    from flwr.cli.build import build_fab_from_disk

    from tessera.app_stage import stage_app

    flower: list[float] = []
    staged: list[float] = []
    hashes: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="tessera-app-stage-") as tmp:
        dest = Path(tmp) / "app"
        for _ in range(repeats):
            started = time.perf_counter()
            fab = build_fab_from_disk(project)
            flower.append(time.perf_counter() - started)
            hashes.add(hashlib.sha256(fab).hexdigest())
            started = time.perf_counter()
            stage_app(project, dest)
            fab = build_fab_from_disk(dest)
            staged.append(time.perf_counter() - started)
            hashes.add(hashlib.sha256(fab).hexdigest())
        staged_files = _files_under(dest)
    return {
        "project_files": _files_under(project),
        "staged_files": staged_files,
        "flower_s": statistics.median(flower),
        "staged_s": statistics.median(staged),
        "flower_range": (min(flower), max(flower)),
        "staged_range": (min(staged), max(staged)),
        "same_fab": len(hashes) == 1,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each path (5)")
    parser.add_argument("--project", type=Path, default=ROOT, help="the app's folder (this one)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    r = measure(args.project, args.repeats)
    print(f"files under the project: {r['project_files']:,}; staged: {r['staged_files']:,}")
    print("| path | seconds (median, min-max) |")
    print("|---|---:|")
    lo, hi = r["flower_range"]
    print(f"| Flower's build from the project | {r['flower_s']:.2f} ({lo:.2f}-{hi:.2f}) |")
    lo, hi = r["staged_range"]
    print(
        f"| stage, then Flower's build from the stage | {r['staged_s']:.2f} ({lo:.2f}-{hi:.2f}) |"
    )
    print(f"staged / Flower's: {r['staged_s'] / r['flower_s']:.3f}x; same FAB: {r['same_fab']}")
    return 0 if r["same_fab"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
