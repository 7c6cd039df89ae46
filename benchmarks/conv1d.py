"""1-d signals: the conv families in their 1-d form against the reshaped square.

A flat vector ``(L,)`` reaches a convolutional model in one of two forms
(``models.get_model(..., flat_input=...)``): ``"signal"`` convolves it in 1-d, so a
kernel sees neighbouring entries; ``"square"`` zero-pads it to ``ceil(sqrt(L))**2``
values and reshapes it to a one-channel square image, so a 3x3 kernel mixes entries
``ceil(sqrt(L))`` apart and a pattern that spans a row boundary is cut in two.

**Data** (:func:`make_signals`, seeded): ``L = 40`` features, 10 classes. A bank of 5
motifs (smooth bumps of random shape, 7 samples wide) is drawn once; class ``k`` is
the ``k``-th of the 10 unordered pairs of motifs. A sample of class ``k`` holds its
two motifs at independently jittered positions (uniform over the signal, so they may
overlap) plus Gaussian noise (standard deviation 0.5). Only *which* motifs appear
tells the classes apart, wherever they appear: a local, shift-tolerant pattern.

**Training**: each model in each form is trained centrally, from the same seed, with
the project's training loop (:func:`tessera.training.train_model`: SGD with
momentum, the run-config defaults batch 32, learning rate 0.05, momentum 0.9) for
15 epochs on 3000 samples, and tested on 1000 others; over 3 seeds (data, model
initialisation and shuffling all follow the seed).

Printed and written to ``--out`` (default ``results/bench-conv1d/``): ``table.md``,
one row per model and form: test accuracy (mean ± std over seeds, in percent),
parameters and multiply-accumulates per sample (:func:`models.count_macs`).

Usage::

    .venv/bin/python benchmarks/conv1d.py [--models cnn-5,preresnet10_050,vgg11_0125]
        [--seeds 0,1,2] [--epochs 15] [--train 3000] [--test 1000] [--length 40]
        [--device cpu] [--threads 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repository importable
    sys.path.insert(0, str(ROOT))

LOG = logging.getLogger("bench.conv1d")

NUM_CLASSES = 10
NUM_MOTIFS = 5
"""Motifs in the bank; the 10 classes are its 10 unordered pairs."""
MOTIF_WIDTH = 7
NOISE = 0.5
FORMS = ("square", "signal")
MODELS = ("cnn-5", "preresnet10_050", "vgg11_0125")
"""FedHeNN's largest CNN, a small pre-activation ResNet (x0.5) and the smallest VGG."""
BATCH_SIZE = 32
LEARNING_RATE = 0.05
MOMENTUM = 0.9
"""The run-config defaults (``batch-size``, ``learning-rate``, ``momentum``)."""


@dataclass(frozen=True)
class Signals:
    """A generated data set: ``x`` float32 ``(N, L)``, ``y`` int64 ``(N,)``."""

    x: np.ndarray
    y: np.ndarray


def motif_bank(rng: np.random.Generator) -> np.ndarray:
    """Return :data:`NUM_MOTIFS` motifs, ``(NUM_MOTIFS, MOTIF_WIDTH)``, each of unit peak.

    A motif is random noise smoothed by a Hann window and scaled to a maximum
    absolute value of 1 (then times 2, to stand out of the noise).
    """
    window = np.hanning(MOTIF_WIDTH + 2)[1:-1]
    raw = rng.normal(size=(NUM_MOTIFS, MOTIF_WIDTH)) * window
    bank: np.ndarray = 2.0 * raw / np.abs(raw).max(axis=1, keepdims=True)
    return bank


def class_pairs() -> list[tuple[int, int]]:
    """Return the motif pair of each class: the 10 unordered pairs of 5 motifs."""
    pairs = list(itertools.combinations(range(NUM_MOTIFS), 2))
    assert len(pairs) == NUM_CLASSES  # C(5, 2) = 10
    return pairs


def make_signals(num: int, *, length: int, bank: np.ndarray, rng: np.random.Generator) -> Signals:
    """Draw ``num`` samples: per class, its two motifs at jittered positions, plus noise.

    Parameters
    ----------
    num : int
        Number of samples; labels are balanced up to one (``i mod 10``), shuffled.
    length : int
        Signal length ``L``, at least :data:`MOTIF_WIDTH`.
    bank : np.ndarray
        The motifs, from :func:`motif_bank`.
    rng : np.random.Generator
        Source of labels, positions and noise.

    Returns
    -------
    Signals
        ``x`` of shape ``(num, length)``, ``y`` of shape ``(num,)``.
    """
    if length < MOTIF_WIDTH:
        raise ValueError(f"--length must be at least {MOTIF_WIDTH} (a motif), got {length}")
    pairs = class_pairs()
    y = rng.permutation(np.arange(num) % NUM_CLASSES)
    x = rng.normal(scale=NOISE, size=(num, length))
    starts = rng.integers(0, length - MOTIF_WIDTH + 1, size=(num, 2))
    for i, label in enumerate(y):
        for motif, start in zip(pairs[label], starts[i], strict=True):
            x[i, start : start + MOTIF_WIDTH] += bank[motif]
    return Signals(x=x.astype(np.float32), y=y.astype(np.int64))


def dataset(seed: int, *, train: int, test: int, length: int) -> tuple[Signals, Signals]:
    """Return the train and test sets of a seed (one motif bank for both)."""
    rng = np.random.default_rng(seed)
    bank = motif_bank(rng)
    return (
        make_signals(train, length=length, bank=bank, rng=rng),
        make_signals(test, length=length, bank=bank, rng=rng),
    )


def run_one(
    arch: str,
    form: str,
    *,
    seed: int,
    data: tuple[Signals, Signals],
    epochs: int,
    device: str,
) -> dict[str, Any]:
    """Train ``arch`` in ``form`` on the seed's train set; return its row."""
    import torch

    from models import count_macs, count_parameters, get_model
    from tessera.data import ArrayDataset
    from tessera.training import OptimConfig, evaluate_model, train_model

    train_set, test_set = data
    length = train_set.x.shape[1]
    torch.manual_seed(seed)
    model = get_model(
        arch,
        input_shape=(length,),
        num_classes=NUM_CLASSES,
        flat_input="signal" if form == "signal" else "square",
    )
    params = count_parameters(model)
    macs = count_macs(model, (length,))
    optim = OptimConfig(
        epochs=epochs,
        batch_size=BATCH_SIZE,
        learning_rate=LEARNING_RATE,
        momentum=MOMENTUM,
        weight_decay=0.0,
    )
    target = torch.device(device)
    stats = train_model(
        model, ArrayDataset(train_set.x, train_set.y), optim=optim, device=target, seed=seed
    )
    _, accuracy = evaluate_model(
        model, ArrayDataset(test_set.x, test_set.y), batch_size=256, device=target
    )
    return {
        "model": arch,
        "form": form,
        "seed": seed,
        "accuracy": float(accuracy),
        "train_loss": float(stats.loss),
        "params": params,
        "macs": macs,
        "seconds": float(stats.seconds),
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Return the Markdown table: one line per model and form, accuracy over seeds."""
    lines = [
        "| model | form | test accuracy (%) | params | MACs |",
        "|---|---|---|---:|---:|",
    ]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["form"]), []).append(row)
    for (arch, form), group in groups.items():
        accuracies = [r["accuracy"] for r in group]
        std = statistics.pstdev(accuracies) if len(accuracies) > 1 else 0.0
        accuracy = f"{100 * statistics.fmean(accuracies):.1f} ± {100 * std:.1f}"
        lines.append(
            f"| {arch} | {form} | {accuracy} | {group[0]['params']:,} | {group[0]['macs']:,} |"
        )
    return "\n".join(lines) + "\n"


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line."""
    from models import list_models, model_entry

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--train", type=int, default=3000, help="training samples")
    parser.add_argument("--test", type=int, default=1000, help="test samples")
    parser.add_argument("--length", type=int, default=40, help="features L")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-conv1d")
    args = parser.parse_args(argv)
    args.models = _csv(args.models)
    known = set(list_models())
    unknown = [m for m in args.models if m not in known]
    if unknown or not args.models:
        parser.error(f"--models: unknown {unknown}; pick from {', '.join(sorted(known))}")
    flat_only = [m for m in args.models if model_entry(m).family == "mlp"]
    if flat_only:
        parser.error(f"--models: {flat_only} have no convolutions, so no form to compare")
    try:
        args.seeds = [int(s) for s in _csv(args.seeds)]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.seeds:
        parser.error("--seeds is empty; give at least one, e.g. 0")
    for name in ("epochs", "train", "test", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.length < MOTIF_WIDTH:
        parser.error(f"--length must be at least {MOTIF_WIDTH} (a motif), got {args.length}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Train every model in both forms over the seeds; print and write the table."""
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    runs = [(m, f, s) for m in args.models for f in FORMS for s in args.seeds]
    LOG.info(
        "%d runs: %s x %s x seeds %s, %d epochs, %d train / %d test, L=%d, on %s",
        len(runs),
        ",".join(args.models),
        ",".join(FORMS),
        args.seeds,
        args.epochs,
        args.train,
        args.test,
        args.length,
        args.device,
    )
    data = {
        seed: dataset(seed, train=args.train, test=args.test, length=args.length)
        for seed in args.seeds
    }
    rows = []
    started = time.monotonic()
    for i, (arch, form, seed) in enumerate(runs, 1):
        row = run_one(
            arch, form, seed=seed, data=data[seed], epochs=args.epochs, device=args.device
        )
        rows.append(row)
        left = (time.monotonic() - started) / i * (len(runs) - i)
        LOG.info(
            "  [%d/%d] %s %s seed %d: test accuracy %.1f %% (%.1f s; ~%.0f min left)",
            i,
            len(runs),
            arch,
            form,
            seed,
            100 * row["accuracy"],
            row["seconds"],
            left / 60,
        )
    text = table(rows)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    LOG.info("written: %s", args.out / "table.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
