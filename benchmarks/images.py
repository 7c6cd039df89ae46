"""The Docker images side by side: size, container start, and the imports each role pays.

For each image (``tessera/app-cpu``, the ClientApp's; ``tessera/app-server``, the
ServerApp's, which adds the ensemble's optimisers; ``tessera/flower``, the SuperLink's
and SuperNodes') it reports the size ``docker image inspect`` gives and two start
times, each the median of ``--repeats`` runs taken in turns (image after image, so
that the machine's state weighs on all alike):

- **start**: ``docker run --rm --entrypoint python IMAGE -c pass``: the container's
  creation, start and removal with an interpreter that imports nothing;
- **imports**: the same container importing what its role imports before it can work
  (``ROLE_IMPORTS``): a ClientApp's torch and Flower's ClientApp runtime; the
  ServerApp's torch, Flower's ServerApp runtime and the four optimiser libraries an
  ``ensemble`` run loads; the SuperLink's Flower server.

Usage (needs a Docker engine and the images: ``scripts/docker-build.sh``)::

    .venv/bin/python benchmarks/images.py [--repeats 5]

Prints a Markdown table with the ServerApp image's figures as ratios of the ClientApp
image's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Final

ROLE_IMPORTS: Final = {
    "tessera/app-cpu": "import torch, flwr.clientapp",
    "tessera/app-server": "import torch, flwr.serverapp, optuna, cmaes, pyswarms, smac",
    "tessera/flower": "import flwr.server",
}
"""What each image's role imports before it can work."""


def image_size_mb(image: str) -> float:
    """Return the image's size in MB (10^6 bytes) as ``docker image inspect`` gives it."""
    out = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Size}}", image],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return int(out.strip()) / 1e6


def timed_run(image: str, code: str) -> float:
    """Return the seconds ``docker run --rm`` takes to run ``python -c code`` in ``image``."""
    started = time.monotonic()
    subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python", image, "-c", code],
        capture_output=True,
        check=True,
        timeout=600,
    )
    return time.monotonic() - started


def ratio_row(
    name: str, values: dict[str, float], base: str, other: str, unit: str, digits: int
) -> str:
    """One table row: both images' value and their ratio.

    Examples
    --------
    >>> ratio_row("size", {"a": 2.0, "b": 3.0}, "a", "b", "MB", 0)
    '| size | 2 MB | 3 MB | 1.50 |'
    """
    return (
        f"| {name} | {values[base]:.{digits}f} {unit} | {values[other]:.{digits}f} {unit} | "
        f"{values[other] / values[base]:.2f} |"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats is {args.repeats}; give 1 or more")
    images = list(ROLE_IMPORTS)
    try:
        sizes = {image: image_size_mb(image) for image in images}
    except (OSError, subprocess.CalledProcessError) as err:
        print(
            f"images: cannot inspect the images ({err}); start a Docker engine and build "
            "them with scripts/docker-build.sh",
            file=sys.stderr,
        )
        return 2
    starts: dict[str, list[float]] = {image: [] for image in images}
    imports: dict[str, list[float]] = {image: [] for image in images}
    for image in images:  # one untimed run each: the first start reads the layers cold
        timed_run(image, ROLE_IMPORTS[image])
    for i in range(args.repeats):
        for image in images:
            starts[image].append(timed_run(image, "pass"))
            imports[image].append(timed_run(image, ROLE_IMPORTS[image]))
        print(f"  repeat {i + 1}/{args.repeats} done", flush=True)
    start = {image: statistics.median(v) for image, v in starts.items()}
    loaded = {image: statistics.median(v) for image, v in imports.items()}
    print(f"\nmedian of {args.repeats} runs, taken in turns\n")
    print("| image | size MB | start s | start + role's imports s |")
    print("|---|---:|---:|---:|")
    for image in images:
        print(f"| `{image}` | {sizes[image]:.0f} | {start[image]:.2f} | {loaded[image]:.2f} |")
    base, other = "tessera/app-cpu", "tessera/app-server"
    print("\n| figure | ClientApp image | ServerApp image | server / client |")
    print("|---|---:|---:|---:|")
    print(ratio_row("size", sizes, base, other, "MB", 0))
    print(ratio_row("start", start, base, other, "s", 2))
    print(ratio_row("start + role's imports", loaded, base, other, "s", 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
