"""The local training loop's minibatches (``tessera.training``)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from models import get_model
from tessera.data import ArrayDataset
from tessera.training import OptimConfig, batch_bounds, torch_threads, train_model


@pytest.mark.parametrize(
    ("n", "batch_size", "sizes"),
    [
        (930, 32, [33, 33] + [32] * 27),  # 29 batches, the remainder 2 spread over two
        (64, 32, [32, 32]),
        (95, 32, [48, 47]),  # 2 batches, the remainder 31 spread
        (10, 32, [10]),  # smaller than a batch: one batch
        (1, 32, [1]),
    ],
)
def test_batch_bounds_cover_every_example_with_no_short_batch(
    n: int, batch_size: int, sizes: list[int]
) -> None:
    bounds = batch_bounds(n, batch_size)
    assert [end - begin for begin, end in bounds] == sizes
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def test_train_model_never_feeds_a_short_last_batch() -> None:
    # Arrange: 66 examples in batches of 32 would leave a last batch of 2
    rng = np.random.default_rng(0)
    data = ArrayDataset(
        rng.normal(size=(66, 1, 8, 8)).astype(np.float32),
        rng.integers(0, 10, size=66).astype(np.int64),
    )
    model = get_model("cnn-1", input_shape=(1, 8, 8), num_classes=10)
    seen: list[int] = []

    def record(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if _module.training:
            seen.append(int(args[0].shape[0]))

    model.register_forward_pre_hook(record)

    # Execute
    stats = train_model(
        model,
        data,
        optim=OptimConfig(2, 32, 0.01, 0.9, 0.0),
        device=torch.device("cpu"),
        seed=0,
    )

    # Assert: two batches of 33 per epoch, every example seen
    assert seen == [33, 33, 33, 33] and stats.steps == 4 and stats.num_examples == 66


def test_torch_threads_sets_the_count_for_the_block_and_restores_it() -> None:
    import torch

    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="inside"), torch_threads(1):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before  # restored after an error too
