"""The ceiling: the fleet's architectures trained centrally on the pooled client data.

Every client's training split (exactly the split a federated client of the same run
holds: same dataset, server pool, partitioner, seed and local test share) is pooled;
each architecture is trained on the pool with the federation's local budget
stretched over the run (``rounds x local-epochs`` epochs, the same batch size and
SGD settings), then evaluated on every client's held-out split (the personalised
ceiling) and on the server's test set (the global ceiling).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessera.data import ArrayDataset, PartitionConfig, load_bundle
from tessera.data.splits import federation_partitions


@dataclass(frozen=True)
class CeilingSettings:
    """What the ceiling shares with the federated runs it is the ceiling of.

    Attributes
    ----------
    dataset : str
        Run-config ``dataset`` (``digits``, ``npz:<path>`` or a flwr-datasets name).
    partition : PartitionConfig
        Partitioner and seed (the run's).
    num_partitions : int
        Number of clients.
    pool_fraction, test_fraction : float
        Run-config ``server-pool-fraction`` and ``local-test-fraction``.
    epochs, batch_size : int
        Centralised epochs (``rounds x local-epochs``) and batch size.
    learning_rate, momentum, weight_decay : float
        SGD settings (the run's).
    norm, flat_input : str
        Run-config ``norm`` and ``flat-input`` (how models are built).
    """

    dataset: str
    partition: PartitionConfig
    num_partitions: int
    pool_fraction: float
    test_fraction: float
    epochs: int
    batch_size: int
    learning_rate: float
    momentum: float
    weight_decay: float
    norm: str = "batch"
    flat_input: str = "signal"


def pooled_data(
    settings: CeilingSettings,
) -> tuple[ArrayDataset, list[ArrayDataset], ArrayDataset, int, tuple[int, ...]]:
    """Return the pooled client training data, each client's test split and the server test.

    Returns
    -------
    tuple
        ``(pooled train, [client test splits by partition id], server test,
        num_classes, input_shape)``.
    """
    bundle = load_bundle(settings.dataset)
    federation = federation_partitions(
        bundle,
        num_partitions=settings.num_partitions,
        partition=settings.partition,
        pool_fraction=settings.pool_fraction,
    )
    trains, tests = [], []
    for pid in range(settings.num_partitions):
        train, test = federation.client_split(pid, test_fraction=settings.test_fraction)
        trains.append(train)
        tests.append(test)
    pooled = ArrayDataset(
        np.concatenate([t.x for t in trains]), np.concatenate([t.y for t in trains])
    )
    return pooled, tests, bundle.test, bundle.num_classes, bundle.input_shape


def ceiling_learning_rates(learning_rate: float, halvings: int = 2) -> list[float]:
    """Return the learning rates the ceiling tries, in order: the runs' own, then halves.

    A ceiling that diverges is no ceiling: an architecture whose loss becomes NaN at
    the federation's learning rate (a deep narrow model with momentum 0.9) is trained
    again at half of it, up to ``halvings`` times; the rate used is recorded.

    Examples
    --------
    >>> ceiling_learning_rates(0.05)
    [0.05, 0.025, 0.0125]
    """
    return [learning_rate / 2**i for i in range(halvings + 1)]


def train_centralised(
    settings: CeilingSettings,
    archs: Iterable[str],
    *,
    seed: int,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, dict[str, Any]]:
    """Train each architecture on the pooled data; evaluate it as the protocol does.

    Parameters
    ----------
    settings : CeilingSettings
        Data and budget (those of the federated runs).
    archs : Iterable[str]
        Architecture names (zoo models or sub-model slices ``<model>@<tag>``).
    seed : int
        Seeds the initialisation and the shuffling.
    log : Callable[[str], None], optional
        Progress printer (one line per architecture).

    Returns
    -------
    dict
        Per architecture: ``personal`` (accuracy on each client's held-out split,
        by partition id as a string; clients with an empty split are left out),
        ``global`` (accuracy on the server test set), ``learning_rate`` (the rate
        that trained it: the runs' own, or a half of it where that diverged, see
        :func:`ceiling_learning_rates`), ``seconds``, ``epochs``, ``train_examples``.
        An architecture that diverged at every rate has ``diverged`` true,
        ``global`` None and no ``personal`` accuracies.
    """
    import torch

    from models import get_model
    from tessera.training import OptimConfig, evaluate_model, train_model

    pooled, client_tests, server_test, num_classes, input_shape = pooled_data(settings)
    device = torch.device("cpu")
    out: dict[str, dict[str, Any]] = {}
    for arch in sorted(set(archs)):
        started = time.monotonic()
        model = None
        for learning_rate in ceiling_learning_rates(settings.learning_rate):
            torch.manual_seed(seed)
            model = get_model(
                arch,
                input_shape=input_shape,
                num_classes=num_classes,
                norm=settings.norm,
                flat_input=settings.flat_input,  # type: ignore[arg-type]
            )
            optim = OptimConfig(
                settings.epochs,
                settings.batch_size,
                learning_rate,
                settings.momentum,
                settings.weight_decay,
            )
            try:
                train_model(model, pooled, optim=optim, device=device, seed=seed)
                break
            except FloatingPointError:
                log(f"    centralised {arch}: loss became nan at learning rate {learning_rate:g}")
                model = None
        if model is None:
            out[arch] = {
                "personal": {},
                "global": None,
                "diverged": True,
                "learning_rate": None,
                "seconds": round(time.monotonic() - started, 3),
                "epochs": settings.epochs,
                "train_examples": len(pooled),
            }
            log(f"    centralised {arch}: diverged at every learning rate tried; no ceiling")
            continue
        personal = {
            str(pid): evaluate_model(model, test, batch_size=256, device=device)[1]
            for pid, test in enumerate(client_tests)
            if len(test) > 0
        }
        _, global_acc = evaluate_model(model, server_test, batch_size=256, device=device)
        seconds = time.monotonic() - started
        out[arch] = {
            "personal": personal,
            "global": float(global_acc),
            "learning_rate": learning_rate,
            "seconds": round(seconds, 3),
            "epochs": settings.epochs,
            "train_examples": len(pooled),
        }
        log(f"    centralised {arch}: global {global_acc:.3f} ({seconds:.1f} s)")
    return out
