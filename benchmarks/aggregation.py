"""Streaming aggregation: throughput against torch in place, and server memory.

Three measurements, each printed as a Markdown table and written to
``--out/table.md`` (default ``results/bench-aggregation/``):

1. **Throughput**, side by side in one run on the same ``--clients`` float32 updates
   of ``--params`` parameters (a few entries, like a model): (a) the reference, a
   streaming float32 accumulation with torch in place (``acc.add_(t, alpha=w)``
   per entry, then one division); (b) ours, the ``mean`` aggregator the strategies
   use (:class:`strategies.core.mean.MeanAccumulator`); (c) the removed buffered
   ``weighted_average`` (float64 temporaries, kept here as the baseline). Each is
   timed ``--repeats`` times, interleaved (best kept); GB/s counts the client-update bytes
   folded. Target: ours / torch >= 0.8.
2. **Peak memory of the mean**: ``--memory-updates`` updates of ``--params``
   parameters generated one at a time and dropped after folding (the way replies
   arrive), against the buffered ``weighted_average`` of ``--buffered-updates``
   updates held in a list. Measured with :mod:`tracemalloc` (numpy reports its
   array buffers to it; torch in-place ops on numpy memory allocate nothing): the
   peak of what was allocated while folding, the global weights (allocated before)
   excluded, over one model's bytes: the float64 sums (two models: the price of a
   result that does not depend on the order replies arrive in), the one update
   alive and the float32 result. Target: <= 4, whatever the number of updates.
   The default bounded ``mean`` is measured too: it folds updates in pairs, so
   two are alive while it folds (about one model more).
3. **Peak memory of FedFA's scalable aggregation**
   (:class:`strategies.submodel.ScalableAccumulator`) for ``--fedfa-clients``
   clients at mixed widths (1, 1/2, 1/4): the peak must not grow with the clients.

Usage::

    .venv/bin/python benchmarks/aggregation.py [--params 1000000] [--clients 100]
        [--memory-updates 1000] [--buffered-updates 100] [--fedfa-clients 10,100]
        [--fedfa-params 1000000] [--repeats 7] [--blocks 512,8192] [--out DIR]

``--blocks`` adds a table: the default bounded ``mean`` with the compiled pass at
each block size (:data:`strategies.core.fused.BLOCK`), against torch in place.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import strategies.core.robust  # noqa: E402,F401  (registers the robust aggregators)
from strategies.core import fused  # noqa: E402
from strategies.core.aggregators import (  # noqa: E402
    Accumulator,
    AccumulatorReport,
    AggregatorSettings,
    Index,
    get_aggregator,
    list_aggregators,
)
from strategies.core.mean import MeanAggregator  # noqa: E402
from strategies.core.measure import update_distances  # noqa: E402
from strategies.submodel.aggregate import ScalableAccumulator  # noqa: E402

log = logging.getLogger("bench.aggregation")

Model = dict[str, np.ndarray]

BOUND_FACTOR = 1.0
"""``clip-factor`` of the bounded contender (the default)."""

SHARES = (0.5, 0.25, 0.125, 0.125)
"""How a model's parameters split into entries (a few layers of different sizes)."""


def model_shapes(params: int) -> dict[str, tuple[int, ...]]:
    """Return entry shapes totalling ``params`` values (2-D layers of 64 rows, a bias)."""
    shapes: dict[str, tuple[int, ...]] = {}
    left = params
    for i, share in enumerate(SHARES[:-1]):
        cols = max(1, int(params * share) // 64)
        shapes[f"layer{i}.weight"] = (64, cols)
        left -= 64 * cols
    shapes["head.bias"] = (max(1, left),)
    return shapes


def make_update(shapes: Mapping[str, tuple[int, ...]], seed: int) -> Model:
    """Return one float32 update (drawn in float32: no float64 temporary)."""
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}


def model_bytes(model: Mapping[str, np.ndarray]) -> int:
    """Bytes of a model's arrays."""
    return sum(v.nbytes for v in model.values())


# ---------------------------------------------------------------- the three contenders
def torch_reference(updates: Sequence[Model], weights: Sequence[float]) -> Model:
    """Streaming float32 accumulation with torch in place, then one division."""
    sums = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in updates[0].items()}
    for update, w in zip(updates, weights, strict=True):
        for k, acc in sums.items():
            acc.add_(torch.from_numpy(update[k]), alpha=w)
    total = float(sum(weights))
    return {k: acc.div_(total).numpy() for k, acc in sums.items()}


def streaming_mean(reference: Model, updates: Sequence[Model], weights: Sequence[float]) -> Model:
    """Our path: the ``mean`` aggregator's accumulator, folded one update at a time."""
    accumulator = MeanAggregator().accumulator(reference)
    for update, w in zip(updates, weights, strict=True):
        accumulator.add(update, w)
    return accumulator.result()


@contextmanager
def float32_sums() -> Iterator[None]:
    """Sum float32 entries in float32 inside the block (before commit c0a7720).

    Order-dependent: what the float64 sums replaced so that a seeded run reproduces
    whatever order replies arrive in; measured side by side to show what that costs.
    """
    from strategies.core import sums

    before = sums.sum_dtype
    sums.sum_dtype = lambda dtype: (  # type: ignore[assignment]
        np.promote_types(dtype, np.float32)
        if np.issubdtype(dtype, np.floating)
        else np.dtype(np.float64)
    )
    try:
        yield
    finally:
        sums.sum_dtype = before


def bounded_mean(
    reference: Model,
    updates: Sequence[Model],
    weights: Sequence[float],
    scale: float,
    direction: Model,
) -> Model:
    """Fold like the default: bounded ``mean`` with its direction check, bound known."""
    accumulator = MeanAggregator(clip_factor=BOUND_FACTOR, ceiling=4.0).accumulator(
        reference, previous=AccumulatorReport(medians={"parameters": scale}), direction=direction
    )
    for update, w in zip(updates, weights, strict=True):
        accumulator.add(update, w)
    return accumulator.result()


def buffered_weighted_average(arrays: Sequence[Model], weights: Sequence[float]) -> Model:
    """Average like the removed ``weighted_average``: float64, all updates at once."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    out: Model = {}
    for key, ref in arrays[0].items():
        acc = np.zeros(ref.shape, dtype=np.float64)
        for i, contribution in enumerate(arrays):
            acc += w[i] * contribution[key].astype(np.float64)
        out[key] = acc.astype(ref.dtype)
    return out


# ----------------------------------------------------------------------- measurements
@dataclass(frozen=True)
class Throughput:
    """GB/s of client-update bytes folded by each contender."""

    params: int
    clients: int
    torch_gbs: float
    ours_gbs: float
    bounded_gbs: float
    bounded_torch_gbs: float
    buffered_gbs: float
    max_difference: float
    clipped: int
    ours32_gbs: float = float("nan")
    bounded32_gbs: float = float("nan")

    @property
    def ratio(self) -> float:
        """Ours over torch's in-place reference (target >= 0.8)."""
        return self.ours_gbs / self.torch_gbs

    @property
    def bounded_ratio(self) -> float:
        """The default bounded path over torch's in-place reference (target >= 0.5)."""
        return self.bounded_gbs / self.torch_gbs


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """Return the fastest of ``repeats`` runs of ``run``."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def bounded_round(
    shapes: Mapping[str, tuple[int, ...]], updates: Sequence[Model]
) -> tuple[Model, Model, list[Model], float]:
    """Return the global model, direction, updates and scale of a bounded round.

    The bounded contender folds around a global model the updates are near (as in
    training): the same updates plus a common part, read as global + (update + 2
    common) / 100, with the common part as the server's own direction (so the
    direction check keeps them, as in a clean round) and a scale that clips about
    one in ten of them.
    """
    rng = np.random.default_rng(0)
    global_model = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    common = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    direction = {k: v / np.float32(100) for k, v in common.items()}
    near = [
        {k: global_model[k] + (v + 2 * common[k]) / np.float32(100) for k, v in u.items()}
        for u in updates
    ]
    distances = sorted(update_distances(u, global_model, {})["parameters"] for u in near)
    scale = distances[int(0.9 * (len(distances) - 1))] / BOUND_FACTOR
    return global_model, direction, near, scale


def measure_blocks(
    params: int, clients: int, repeats: int, blocks: Sequence[int]
) -> list[tuple[str, float]]:
    """GB/s of torch in place and of the default bounded ``mean`` at each compiled block size.

    Interleaved like :func:`measure_throughput` (best of ``repeats`` kept), so the
    ratios compare block sizes under the same machine state.
    """
    shapes = model_shapes(params)
    updates = [make_update(shapes, seed) for seed in range(clients)]
    weights = [float(10 + (7 * i) % 50) for i in range(clients)]
    folded = clients * model_bytes(updates[0]) / 1e9
    global_model, direction, near, scale = bounded_round(shapes, updates)
    default = fused.BLOCK

    def at(block: int) -> Callable[[], object]:
        def run() -> object:
            fused.BLOCK = block
            try:
                return bounded_mean(global_model, near, weights, scale, direction)
            finally:
                fused.BLOCK = default

        return run

    contenders: dict[str, Callable[[], object]] = {
        "torch in place (reference)": lambda: torch_reference(updates, weights)
    }
    contenders.update({f"bounded `mean`, block {b:,}": at(b) for b in blocks})
    seconds = dict.fromkeys(contenders, float("inf"))
    for run in contenders.values():  # compile and warm up once
        run()
    for _ in range(repeats):
        for name, run in contenders.items():
            seconds[name] = min(seconds[name], best_seconds(run, 1))
    return [(name, folded / s) for name, s in seconds.items()]


def blocks_table(rows: Sequence[tuple[str, float]], params: int, clients: int) -> str:
    """Return the Markdown table of :func:`measure_blocks`."""
    reference = rows[0][1]
    lines = [
        f"Block size of the compiled pass: {clients} float32 updates of {params:,} parameters "
        f"(default `strategies.core.fused.BLOCK` = {fused.BLOCK:,})",
        "",
        "| aggregation | GB/s | / torch in place |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {gbs:.2f} | {gbs / reference:.2f} |" for name, gbs in rows]
    return "\n".join(lines) + "\n"


def measure_throughput(params: int, clients: int, repeats: int) -> Throughput:
    """Time the three contenders on the same updates (see the module docstring)."""
    shapes = model_shapes(params)
    updates = [make_update(shapes, seed) for seed in range(clients)]
    weights = [float(10 + (7 * i) % 50) for i in range(clients)]
    reference = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    folded = clients * model_bytes(updates[0]) / 1e9
    ours = streaming_mean(reference, updates, weights)
    torch_out = torch_reference(updates, weights)
    diff = max(float(np.max(np.abs(ours[k] - torch_out[k]))) for k in shapes)
    global_model, direction, near, scale = bounded_round(shapes, updates)
    clipped = MeanAggregator(clip_factor=BOUND_FACTOR, ceiling=4.0).accumulator(
        global_model,
        previous=AccumulatorReport(medians={"parameters": scale}),
        direction=direction,
    )
    for u, w in zip(near, weights, strict=True):
        clipped.add(u, w)
    clipped.result()
    n_clipped = len(clipped.report().clips)
    # interleaved (torch, ours, bounded, buffered, torch, ...) so that each repeat
    # compares them under the same machine state; the best of each is kept
    torch_s = ours_s = bounded_s = bounded_torch_s = buffered_s = float("inf")
    ours32_s = bounded32_s = float("inf")

    def bounded_torch() -> None:
        with fused.disabled():
            bounded_mean(global_model, near, weights, scale, direction)

    def ours32() -> None:
        with float32_sums():
            streaming_mean(reference, updates, weights)

    def bounded32() -> None:
        with float32_sums():
            bounded_mean(global_model, near, weights, scale, direction)

    for _ in range(repeats):
        torch_s = min(torch_s, best_seconds(lambda: torch_reference(updates, weights), 1))
        ours_s = min(ours_s, best_seconds(lambda: streaming_mean(reference, updates, weights), 1))
        bounded_s = min(
            bounded_s,
            best_seconds(lambda: bounded_mean(global_model, near, weights, scale, direction), 1),
        )
        bounded_torch_s = min(bounded_torch_s, best_seconds(bounded_torch, 1))
        ours32_s = min(ours32_s, best_seconds(ours32, 1))
        bounded32_s = min(bounded32_s, best_seconds(bounded32, 1))
        buffered_s = min(
            buffered_s, best_seconds(lambda: buffered_weighted_average(updates, weights), 1)
        )
    return Throughput(
        params=sum(int(np.prod(s)) for s in shapes.values()),
        clients=clients,
        torch_gbs=folded / torch_s,
        ours_gbs=folded / ours_s,
        bounded_gbs=folded / bounded_s,
        bounded_torch_gbs=folded / bounded_torch_s,
        buffered_gbs=folded / buffered_s,
        max_difference=diff,
        clipped=n_clipped,
        ours32_gbs=folded / ours32_s,
        bounded32_gbs=folded / bounded32_s,
    )


@dataclass(frozen=True)
class Memory:
    """Peak traced bytes of one aggregation, over one model's bytes."""

    what: str
    updates: int
    peak_bytes: int
    model_bytes: int

    @property
    def peak_models(self) -> float:
        """The peak in models."""
        return self.peak_bytes / self.model_bytes


def traced_peak(run: Callable[[], object]) -> int:
    """Peak bytes traced by :mod:`tracemalloc` while ``run`` runs (numpy buffers included)."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def streamed_peak(
    shapes: Mapping[str, tuple[int, ...]], updates: int, accumulator: Callable[[], Accumulator]
) -> int:
    """Peak traced while ``accumulator()`` folds ``updates`` updates generated one at a time."""

    def run() -> None:
        acc = accumulator()
        for seed in range(updates):
            update = make_update(shapes, seed)  # a reply arrives ...
            acc.add(update, float(1 + seed % 9))
            del update  # ... and is dropped once folded
        acc.result()

    return traced_peak(run)


def measure_mean_memory(params: int, updates: int) -> Memory:
    """Peak while folding ``updates`` updates generated one at a time (module docstring).

    It folds them in pairs (:meth:`strategies.core.mean.MeanAccumulator.add`), so one
    update waits for the next.
    """
    shapes = model_shapes(params)
    reference = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    peak = streamed_peak(shapes, updates, lambda: MeanAggregator().accumulator(reference))
    return Memory("mean, streaming", updates, peak, model_bytes(reference))


def measure_bounded_memory(params: int, updates: int) -> Memory:
    """Peak of the default bounded ``mean`` (bound known) on updates generated one at a time.

    It folds the updates in pairs (:meth:`strategies.core.mean.MeanAccumulator.add`),
    so one update waits for the next, as in the plain mean.
    """
    shapes = model_shapes(params)
    reference = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    # a standard normal update is about sqrt(params) from zero: about half are clipped
    previous = AccumulatorReport(medians={"parameters": float(np.sqrt(params))})
    bounded = MeanAggregator(clip_factor=BOUND_FACTOR)
    peak = streamed_peak(shapes, updates, lambda: bounded.accumulator(reference, previous=previous))
    return Memory(
        "mean, bounded (default), streaming in pairs", updates, peak, model_bytes(reference)
    )


def measure_first_round_memory(params: int, updates: int) -> Memory:
    """Peak of the default bounded ``mean`` in a model's first round (no scale yet).

    It holds at most :data:`strategies.core.mean.FIRST_ROUND_BUFFER` updates, whose
    lower median becomes the scale the others stream against: the peak is that many
    models (plus the sums), however many updates the round brings.
    """
    shapes = model_shapes(params)
    reference = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    bounded = MeanAggregator(clip_factor=BOUND_FACTOR)
    peak = streamed_peak(shapes, updates, lambda: bounded.accumulator(reference))
    return Memory("mean, bounded (default), first round", updates, peak, model_bytes(reference))


def measure_buffered_memory(params: int, updates: int) -> Memory:
    """Peak of the buffered ``weighted_average`` given the updates in a list."""
    shapes = model_shapes(params)
    weights = [float(1 + i % 9) for i in range(updates)]

    def run() -> None:
        held = [make_update(shapes, seed) for seed in range(updates)]
        buffered_weighted_average(held, weights)

    peak = traced_peak(run)
    return Memory("weighted_average, buffered", updates, peak, params * 4)


def fedfa_client(
    global_shapes: Mapping[str, tuple[int, ...]], client: int
) -> tuple[Model, dict[str, Index]]:
    """One client's slice (width 1, 1/2 or 1/4 by turn) and its index."""
    width = (1.0, 0.5, 0.25)[client % 3]
    rng = np.random.default_rng(client)
    state: Model = {}
    index: dict[str, Index] = {}
    for key, shape in global_shapes.items():
        cut = tuple(max(1, round(n * width)) for n in shape)
        state[key] = rng.standard_normal(cut, dtype=np.float32)
        index[key] = tuple(slice(0, n) for n in cut)
    return state, index


def measure_fedfa_memory(params: int, clients: int) -> Memory:
    """Peak of FedFA's streaming scalable aggregation of ``clients`` mixed-width slices."""
    shapes = model_shapes(params)
    reference = {k: np.zeros(s, np.float32) for k, s in shapes.items()}

    def run() -> None:
        accumulator = ScalableAccumulator(reference, max_factor=10.0)
        for c in range(clients):
            state, index = fedfa_client(shapes, c)
            accumulator.add(state, float(10 + c % 7), index=index)
            del state
        accumulator.result()

    peak = traced_peak(run)
    return Memory("FedFA scalable, streaming", clients, peak, model_bytes(reference))


# ------------------------------------------------------------------------------ report
@dataclass(frozen=True)
class RoundCost:
    """Seconds one round of an aggregator takes, and its ratio to plain ``mean``'s."""

    aggregator: str
    seconds: float
    ratio: float


def measure_round_costs(params: int, clients: int, repeats: int) -> list[RoundCost]:
    """Time a round (accumulator, every update added, result) of every registered aggregator.

    Run-config defaults (``trimmed-mean`` 0.1, ``krum-byzantine`` 1), the same
    updates for each; ``mean`` is the plain (unbounded) one, ``mean (default)`` the
    default bounded one with its direction and the bound known from a last round.
    """
    shapes = model_shapes(params)
    rng = np.random.default_rng(1)
    global_model = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    direction = {k: rng.standard_normal(s).astype(np.float32) / 100 for k, s in shapes.items()}
    updates = [
        {k: global_model[k] + direction[k] + v / np.float32(100) for k, v in u.items()}
        for u in (make_update(shapes, 100 + seed) for seed in range(clients))
    ]
    weights = [float(10 + (7 * i) % 50) for i in range(clients)]
    scale = float(np.median([update_distances(u, global_model, {})["parameters"] for u in updates]))

    def round_of(name: str, settings: AggregatorSettings, bounded: bool) -> Callable[[], object]:
        aggregator = get_aggregator(name, settings)

        def run() -> object:
            accumulator = aggregator.accumulator(
                global_model,
                previous=AccumulatorReport(medians={"parameters": scale}) if bounded else None,
                direction=direction if bounded else None,
            )
            for u, w in zip(updates, weights, strict=True):
                accumulator.add(u, w)
            return accumulator.result()

        return run

    contenders: dict[str, Callable[[], object]] = {
        "mean": round_of("mean", AggregatorSettings(), False),
        "mean (default: bounded, direction check)": round_of(
            "mean", AggregatorSettings(clip_factor=1.0, ceiling=4.0), True
        ),
    }
    for name in list_aggregators():
        if name != "mean":
            contenders[name] = round_of(name, AggregatorSettings(), False)
    seconds = dict.fromkeys(contenders, float("inf"))
    for _ in range(repeats):  # interleaved, best of each kept
        for name, run in contenders.items():
            seconds[name] = min(seconds[name], best_seconds(run, 1))
    base = seconds["mean"]
    return [RoundCost(name, s, s / base) for name, s in seconds.items()]


def cost_table(costs: Sequence[RoundCost], params: int, clients: int) -> str:
    """Return the Markdown table of the aggregators' round costs."""
    lines = [
        f"Round cost of each aggregator: {clients} float32 updates of {params:,} parameters "
        "(seconds per round, best of the repeats; ratio to the plain `mean`, lower is cheaper)",
        "",
        "| aggregator | seconds | / `mean` |",
        "|---|---:|---:|",
    ]
    lines += [f"| {c.aggregator} | {c.seconds:.3f} | {c.ratio:.1f} |" for c in costs]
    return "\n".join(lines) + "\n"


def table(throughput: Throughput, memories: Sequence[Memory]) -> str:
    """Return the Markdown tables of a run."""
    t = throughput
    lines = [
        f"Throughput: {t.clients} float32 updates of {t.params:,} parameters "
        f"(GB/s of update bytes folded; ours - torch max |difference| {t.max_difference:.2g})",
        "",
        "| aggregation | GB/s | / torch in place |",
        "|---|---:|---:|",
        f"| torch in place (reference) | {t.torch_gbs:.2f} | 1.00 |",
        f"| ours: `mean` accumulator, streaming, float64 sums | {t.ours_gbs:.2f} | {t.ratio:.2f} |",
        f"| ours: default bounded `mean` with direction check (bound known; {t.clipped} of "
        f"{t.clients} clipped), float64 sums | "
        f"{t.bounded_gbs:.2f} | {t.bounded_ratio:.2f} |",
        f"| the two above with float32 sums (order-dependent, before c0a7720): `mean` | "
        f"{t.ours32_gbs:.2f} | {t.ours32_gbs / t.torch_gbs:.2f} |",
        f"| ... default bounded `mean`, float32 sums | "
        f"{t.bounded32_gbs:.2f} | {t.bounded32_gbs / t.torch_gbs:.2f} |",
        f"| the same without numba (torch: subtract, two dot products, fold) | "
        f"{t.bounded_torch_gbs:.2f} | {t.bounded_torch_gbs / t.torch_gbs:.2f} |",
        f"| old `weighted_average`, buffered float64 | {t.buffered_gbs:.2f} | "
        f"{t.buffered_gbs / t.torch_gbs:.2f} |",
        "",
        "Peak traced memory (tracemalloc: numpy buffers allocated during the aggregation, "
        "the global weights excluded), in models:",
        "",
        "| aggregation | updates | peak MiB | peak / model |",
        "|---|---:|---:|---:|",
    ]
    for m in memories:
        lines.append(
            f"| {m.what} | {m.updates} | {m.peak_bytes / 2**20:.1f} | {m.peak_models:.2f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--memory-updates", type=int, default=1000)
    parser.add_argument("--buffered-updates", type=int, default=100)
    parser.add_argument("--fedfa-clients", default="10,100")
    parser.add_argument("--fedfa-params", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--robust-clients",
        type=int,
        default=20,
        help="updates per round in the aggregators' round-cost table (Krum is quadratic)",
    )
    parser.add_argument(
        "--blocks",
        default="",
        help="also time the default bounded mean at these compiled block sizes, e.g. "
        "512,8192 (needs numba)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-aggregation")
    args = parser.parse_args(argv)
    try:
        args.blocks = [int(b) for b in args.blocks.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--blocks is '{args.blocks}'; give sizes like 512,8192")
    if any(b < 1 for b in args.blocks):
        parser.error("--blocks needs positive sizes, e.g. 512,8192")
    for name in (
        "params",
        "clients",
        "memory_updates",
        "buffered_updates",
        "repeats",
        "robust_clients",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} is {getattr(args, name)}; use 1 or more")
    if args.params < 256 or args.fedfa_params < 256:
        parser.error("--params and --fedfa-params must be at least 256 (64-row layers)")
    try:
        args.fedfa_clients = [int(c) for c in args.fedfa_clients.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--fedfa-clients is '{args.fedfa_clients}'; give counts like 10,100")
    if not args.fedfa_clients or min(args.fedfa_clients) < 1:
        parser.error("--fedfa-clients needs positive counts, e.g. 10,100")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the three measurements, print the tables and write them."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info(
        "torch threads: %d; numba one-pass loop: %s",
        torch.get_num_threads(),
        "yes" if fused.available() else "no (torch path)",
    )
    throughput = measure_throughput(args.params, args.clients, args.repeats)
    # warm-up: first calls allocate once (imports, numpy's percentile), not per update
    measure_mean_memory(1000, 2)
    measure_bounded_memory(1000, 3)
    measure_fedfa_memory(1000, 2)
    memories = [
        measure_mean_memory(args.params, args.memory_updates),
        measure_bounded_memory(args.params, args.memory_updates),
        *(
            measure_first_round_memory(args.params, n)
            for n in sorted({args.buffered_updates, args.memory_updates})
        ),
        measure_buffered_memory(args.params, args.buffered_updates),
        *(measure_fedfa_memory(args.fedfa_params, c) for c in args.fedfa_clients),
    ]
    costs = measure_round_costs(args.params, args.robust_clients, max(1, args.repeats // 2))
    text = table(throughput, memories) + "\n" + cost_table(costs, args.params, args.robust_clients)
    if args.blocks and fused.available():
        rows = measure_blocks(args.params, args.clients, args.repeats, args.blocks)
        text += "\n" + blocks_table(rows, args.params, args.clients)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    print(f"written: {args.out / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
