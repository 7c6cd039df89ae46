"""Local training and evaluation loops (plain PyTorch, scheme-agnostic).

A scheme changes the local objective by passing ``loss_fn``; everything else (seeded
shuffling, optimiser, timing) is shared.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tessera.data import ArrayDataset

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(model, x, y) -> scalar loss`` for one minibatch."""


def cross_entropy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Return the plain task loss (cross-entropy)."""
    return nn.functional.cross_entropy(model(x), y)


def proximal_term(model: nn.Module, anchor: list[torch.Tensor]) -> torch.Tensor:
    """Return ``sum ||w - w0||^2`` over the model's parameters.

    Parameters
    ----------
    model : nn.Module
        The model being trained.
    anchor : list[torch.Tensor]
        Detached copies of the parameters at the start of the round, in
        ``model.parameters()`` order.

    Returns
    -------
    torch.Tensor
        A differentiable scalar.
    """
    params = list(model.parameters())
    if len(params) != len(anchor):
        raise ValueError(f"{len(params)} parameters but {len(anchor)} anchors")
    total = torch.zeros((), device=params[0].device)
    for p, a in zip(params, anchor, strict=True):
        total = total + torch.sum((p - a) ** 2)
    return total


@dataclass(frozen=True)
class TrainStats:
    """What one local training run did."""

    loss: float
    seconds: float
    num_examples: int
    steps: int


@dataclass(frozen=True)
class OptimConfig:
    """SGD settings for local training."""

    epochs: int
    batch_size: int
    learning_rate: float
    momentum: float
    weight_decay: float


def select_device(accelerator: str) -> torch.device:
    """Map a profile's accelerator to a torch device that exists here.

    Emulated profiles (a ``jetson-orin`` profile in simulation on a CPU machine) fall
    back to the CPU.
    """
    if accelerator == "cuda" and torch.cuda.is_available():
        return torch.device("cuda")
    if accelerator == "mps" and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def batch_bounds(n: int, batch_size: int) -> list[tuple[int, int]]:
    """Return the ``(begin, end)`` of each minibatch of an epoch over ``n`` examples.

    There are ``n // batch_size`` batches (one when ``n`` is smaller than a batch),
    and the remainder is spread over them one example each, so no batch is smaller
    than ``batch_size``. A short last batch would be harmful: a batch-norm layer that
    sees 1x1 feature maps normalises a 2-example batch from 2 numbers, and the
    running statistics it leaves behind skew the model (measured: ``vgg11_0125``
    trained on 930 examples in batches of 32 fitted 66 % of its own training data;
    on 928, 99 %).

    Examples
    --------
    >>> batch_bounds(70, 32)
    [(0, 35), (35, 70)]
    >>> batch_bounds(64, 32)
    [(0, 32), (32, 64)]
    >>> batch_bounds(10, 32)
    [(0, 10)]
    """
    count = max(1, n // batch_size)
    base, extra = divmod(n, count)
    bounds: list[tuple[int, int]] = []
    begin = 0
    for i in range(count):
        end = begin + base + (1 if i < extra else 0)
        bounds.append((begin, end))
        begin = end
    return bounds


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run a block with torch on ``threads`` intra-op threads; restore the count after.

    The server's own small trainings (its update on the server pool, Velo's CVAE)
    run on one thread: their batches are too small for threads to pay, and beside
    the simulation's client processes on the same cores a second thread made the
    pool training of a MobileNetV2 15 to 50 times slower (0.7-0.9 s on one thread,
    12-51 s on two, two simulations on two cores).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train_model(
    model: nn.Module,
    data: ArrayDataset,
    *,
    optim: OptimConfig,
    device: torch.device,
    seed: int,
    loss_fn: LossFn = cross_entropy_loss,
) -> TrainStats:
    """Train ``model`` in place with SGD (momentum) on ``data``.

    Parameters
    ----------
    model : nn.Module
        The model (moved to ``device``).
    data : ArrayDataset
        Training data.
    optim : OptimConfig
        Epochs, batch size and SGD settings.
    device : torch.device
        Where to train.
    seed : int
        Seeds the shuffling, so a run is reproducible. Each epoch's minibatches
        are :func:`batch_bounds` of a fresh permutation.
    loss_fn : LossFn
        The local objective for one minibatch.

    Returns
    -------
    TrainStats
        Mean training loss, seconds, examples seen per epoch and steps.
    """
    start = time.perf_counter()
    model.to(device)
    model.train()
    x_all = torch.from_numpy(data.x)
    y_all = torch.from_numpy(data.y)
    n = len(data)
    opt = torch.optim.SGD(
        model.parameters(),
        lr=optim.learning_rate,
        momentum=optim.momentum,
        weight_decay=optim.weight_decay,
    )
    gen = torch.Generator().manual_seed(seed)
    total, count, steps = 0.0, 0, 0
    for _ in range(optim.epochs):
        order = torch.randperm(n, generator=gen)
        for begin, end in batch_bounds(n, optim.batch_size):
            idx = order[begin:end]
            if len(idx) < 2 < n:
                continue  # batch norm cannot train on a single sample
            x = x_all[idx].to(device)
            y = y_all[idx].to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, x, y)
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"local loss became {loss.item()}; lower run-config 'learning-rate' "
                    f"(now {optim.learning_rate})"
                )
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            total += float(loss.item()) * len(idx)
            count += len(idx)
            steps += 1
    return TrainStats(
        loss=total / max(count, 1),
        seconds=time.perf_counter() - start,
        num_examples=n,
        steps=steps,
    )


@torch.no_grad()
def evaluate_model(
    model: nn.Module, data: ArrayDataset, *, batch_size: int, device: torch.device
) -> tuple[float, float]:
    """Return ``(mean cross-entropy, accuracy)`` of ``model`` on ``data``.

    An empty dataset gives ``(nan, nan)``.
    """
    if len(data) == 0:
        return math.nan, math.nan
    model.to(device)
    model.eval()
    loss_sum, correct = 0.0, 0
    for begin in range(0, len(data), batch_size):
        x = torch.from_numpy(data.x[begin : begin + batch_size]).to(device)
        y = torch.from_numpy(data.y[begin : begin + batch_size]).to(device)
        logits = model(x)
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum").item())
        correct += int((logits.argmax(dim=1) == y).sum().item())
    return loss_sum / len(data), correct / len(data)


@torch.no_grad()
def recompute_batch_statistics(model: nn.Module, data: ArrayDataset, *, batch_size: int) -> int:
    """Recompute every batch norm's running statistics from scratch on ``data``.

    HeteroFL's static batch norm: clients train without running statistics, and
    before a global model or sub-model is evaluated its statistics are computed
    anew on server data. Each batch norm's statistics are reset and set to the
    cumulative average over all batches (``momentum=None``), so nothing from an
    earlier round or another slice leaks in. The model is left in eval mode.

    Parameters
    ----------
    model : nn.Module
        A model whose batch norms track running statistics.
    data : ArrayDataset
        Server-side data (labels unused).
    batch_size : int
        Samples per forward pass.

    Returns
    -------
    int
        The number of batch-norm layers updated.

    Raises
    ------
    ValueError
        If ``data`` is empty or a batch norm does not track running statistics.
    """
    if len(data) == 0:
        raise ValueError("cannot recompute batch-norm statistics on an empty dataset")
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        if not norm.track_running_stats:
            raise ValueError(
                f"{type(norm).__name__} does not track running statistics; build the model "
                "with norm='batch' to recompute them"
            )
        norm.reset_running_stats()
        norm.momentum = None
    model.train()
    for begin in range(0, len(data), batch_size):
        model(torch.from_numpy(data.x[begin : begin + batch_size]))
    model.eval()
    return len(norms)


def label_counts(labels: np.ndarray, num_classes: int) -> list[int]:
    """Count labels per class (0..num_classes-1)."""
    return [
        int(c) for c in np.bincount(labels.astype(np.int64), minlength=num_classes)[:num_classes]
    ]
