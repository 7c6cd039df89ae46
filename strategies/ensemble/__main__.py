"""Label data with an exported ensemble: ``python -m strategies.ensemble predict``.

Examples
--------
::

    python -m strategies.ensemble predict results/ensemble-run/ensemble.npz data.npz
    python -m strategies.ensemble predict ensemble.npz batch.npy --device cuda --out labels.npy

``DATA`` is a ``.npy`` array of samples, or an ``.npz`` holding ``x`` (or
``x_test``), and optionally ``y`` (or ``y_test``): then the accuracy is printed too.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def read_samples(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """Return the samples (and labels, if any) of a ``.npy`` or ``.npz`` file.

    Raises
    ------
    ValueError
        If the file is missing, unreadable or holds no samples under a known name.
    """
    if not path.is_file():
        raise ValueError(f"no data file at {path}")
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            return loaded, None
        with loaded as data:
            for xs, ys in (("x", "y"), ("x_test", "y_test")):
                if xs in data.files:
                    labels = np.asarray(data[ys]) if ys in data.files else None
                    return np.asarray(data[xs]), labels
            raise ValueError(f"{path} holds {sorted(data.files)}; name the samples 'x' or 'x_test'")
    except (OSError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(
            f"{path} cannot be read as samples ({type(err).__name__}: {err}); give a .npy "
            "array or an .npz written by np.savez"
        ) from err


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m strategies.ensemble", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    predict = sub.add_parser("predict", help="label samples with an exported ensemble")
    predict.add_argument("artifact", type=Path, help="ensemble.npz written by a run")
    predict.add_argument("data", type=Path, help=".npy samples or .npz with x (and y)")
    predict.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    predict.add_argument("--batch-size", type=int, default=256)
    predict.add_argument("--out", type=Path, help="write the labels here (.npy)")
    args = parser.parse_args(argv)

    import torch

    from strategies.ensemble.artifact import ArtifactError, load_ensemble

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {args.device} but this machine has no CUDA device", file=sys.stderr)
        return 2
    try:
        ensemble = load_ensemble(args.artifact, device=args.device)
        x, y = read_samples(args.data)
        labels = ensemble.predict(x, batch_size=args.batch_size, device=args.device)
    except (ArtifactError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"{len(labels)} sample(s) labelled by {len(ensemble.archs)} model(s) "
        f"({', '.join(ensemble.archs)}; weights by {ensemble.manifest.get('optimizer')}) on "
        f"{args.device}"
    )
    if y is not None and len(y) == len(labels):
        print(f"accuracy {float(np.mean(labels == y)):.4f} against the labels in {args.data}")
    if args.out is not None:
        np.save(args.out, labels)
        print(f"labels written to {args.out}")
    else:
        print(" ".join(str(int(v)) for v in labels[:50]) + (" ..." if len(labels) > 50 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
