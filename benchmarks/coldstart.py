"""ClientApp cold start: a fresh process per message, as a SuperNode starts them.

In deployment Flower 1.30 runs every message (handshake, train, evaluate) in a new
``flwr-clientapp`` process that imports the ClientApp before it can do anything. This
benchmark spawns such fresh interpreters, alternating in one run (A, B, C, A, B, C,
...) so that every ratio compares processes started under the same machine state:

- ``bare``: ``import torch, flwr.clientapp`` (the floor: what any PyTorch ClientApp
  on Flower imports);
- ``clientapp``: ``import client_app.app`` and load the ``ClientApp`` object the way
  ``flwr-clientapp`` does (``client_app.app:app``);
- ``clientapp+strategies``: the same plus ``import strategies`` (every scheme's
  server side too: what a process that loads the whole project pays).

Each process is timed from spawn to exit by the parent (interpreter start included,
as a SuperNode pays it) and its peak resident memory is the child's own ``ru_maxrss``
(from ``os.wait4``). The child also lists which heavy modules got imported, so a
regression names its cause.

Usage::

    .venv/bin/python benchmarks/coldstart.py [--repeats 7] [--out results/bench-coldstart]

Prints a table with the medians and the ratios to ``bare`` (targets: <= 1.15x time,
<= 1.10x peak RSS for ``clientapp``) and writes ``coldstart.json`` and ``table.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("matplotlib", "seaborn", "datasets", "flwr_datasets", "sklearn", "scipy", "pandas")
"""Modules a ClientApp process should not import unless a message needs them."""
TARGET_TIME = 1.15
TARGET_RSS = 1.10

log = logging.getLogger("coldstart")

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
{imports}
t1 = time.perf_counter()
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
print(json.dumps({{"imports": t1 - t0, "heavy": heavy}}))
"""

CASES: dict[str, str] = {
    "bare": "import torch, flwr.clientapp",
    "clientapp": (
        "from flwr.common.object_ref import load_app\n"
        "app = load_app('client_app.app:app', ValueError, '.')"
    ),
    "clientapp+strategies": (
        "from flwr.common.object_ref import load_app\n"
        "app = load_app('client_app.app:app', ValueError, '.')\n"
        "import strategies"
    ),
}


@dataclass(frozen=True)
class Sample:
    """One fresh process."""

    case: str
    wall_s: float
    """Parent-side wall time from spawn to exit."""
    import_s: float
    """Child-side time spent in the imports."""
    peak_rss_mb: float
    heavy: tuple[str, ...]


def spawn(case: str, python: str = sys.executable) -> Sample:
    """Start one fresh interpreter for ``case`` and measure it."""
    code = _CHILD.format(imports=CASES[case], heavy=HEAVY)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [python, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out = proc.stdout.read().decode() if proc.stdout else ""
    err = proc.stderr.read().decode() if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{case}: child exited {proc.returncode}: {err[-2000:]}")
    report = json.loads(out.strip().splitlines()[-1])
    return Sample(
        case=case,
        wall_s=wall,
        import_s=float(report["imports"]),
        peak_rss_mb=usage.ru_maxrss / 1024.0,  # Linux: KiB
        heavy=tuple(report["heavy"]),
    )


def summarise(samples: list[Sample]) -> dict[str, dict[str, Any]]:
    """Return the medians per case and their ratios to ``bare``."""
    table: dict[str, dict[str, Any]] = {}
    for case in CASES:
        mine = [s for s in samples if s.case == case]
        if not mine:
            continue
        table[case] = {
            "runs": len(mine),
            "wall_s": statistics.median(s.wall_s for s in mine),
            "wall_min_s": min(s.wall_s for s in mine),
            "wall_max_s": max(s.wall_s for s in mine),
            "peak_rss_mb": statistics.median(s.peak_rss_mb for s in mine),
            "heavy": sorted({m for s in mine for m in s.heavy}),
        }
    bare = table.get("bare")
    for row in table.values():
        row["time_ratio"] = row["wall_s"] / bare["wall_s"] if bare else float("nan")
        row["rss_ratio"] = row["peak_rss_mb"] / bare["peak_rss_mb"] if bare else float("nan")
    return table


def markdown(table: dict[str, dict[str, Any]]) -> str:
    """Render the table as Markdown."""
    lines = [
        "| process | runs | wall s (median, min-max) | peak RSS MB | time / bare | RSS / bare "
        "| heavy modules imported |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for case, row in table.items():
        lines.append(
            f"| {case} | {row['runs']} | {row['wall_s']:.2f} "
            f"({row['wall_min_s']:.2f}-{row['wall_max_s']:.2f}) | {row['peak_rss_mb']:.0f} | "
            f"{row['time_ratio']:.2f}x | {row['rss_ratio']:.2f}x | "
            f"{', '.join(row['heavy']) or 'none'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return 0 when ``clientapp`` meets both targets, else 1."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="processes per case")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-coldstart")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; use some of {', '.join(CASES)}")
    spawn("bare")  # warm the page cache once; not counted
    samples: list[Sample] = []
    for i in range(args.repeats):
        for case in cases:
            sample = spawn(case)
            samples.append(sample)
            log.info(
                "[%d/%d] %-22s %.2f s  %.0f MB",
                i + 1,
                args.repeats,
                case,
                sample.wall_s,
                sample.peak_rss_mb,
            )
    table = summarise(samples)
    text = markdown(table)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "coldstart.json").write_text(
        json.dumps({"table": table, "samples": [s.__dict__ for s in samples]}, indent=2)
    )
    row = table.get("clientapp")
    if row is None:
        return 0
    ok = row["time_ratio"] <= TARGET_TIME and row["rss_ratio"] <= TARGET_RSS
    print(
        f"clientapp: {row['time_ratio']:.2f}x time (target <= {TARGET_TIME}x), "
        f"{row['rss_ratio']:.2f}x peak RSS (target <= {TARGET_RSS}x): "
        f"{'met' if ok else 'NOT met'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
