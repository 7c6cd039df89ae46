"""One pass over an update: its distance, its dot with a direction, and its fold.

The bounded ``mean`` (:class:`strategies.core.mean.MeanAccumulator`) needs three
things of every update ``v`` against the global entry ``b``: ``sum((v - b) ** 2)``,
``sum((v - b) * d)`` with the server's own update ``d``, and ``total += w * v``
while the running distance is within the bound. With torch primitives that is four
passes (a subtraction into a buffer, two dot products, an in-place add), about
0.1x the speed of torch's plain in-place accumulation. This module does the three
in one compiled loop over blocks of :data:`BLOCK` elements, each measured in the
entry's precision while it is in cache (vectorised; the block sums are added in
float64, and a block whose float32 sums overflow is measured again in float64),
then folded in the entry's precision. Within a block the relative error of a
squared distance is at most about 1e-5 (float32; a bound only needs a few digits).

:func:`measure_fold_pair` does the same for two updates of one entry at once: the
global entry, the direction and the float64 sums (24 of the 28 bytes one update
moves per element) are read once for the two, which is what lifts the default path
from about 0.45x to above 0.6x of torch in place (``benchmarks/aggregation.py``).

Compiled by numba when it is installed (a dependency of the package; the Docker app
images leave it out and take the torch path). :func:`available` says whether it is;
environment variable ``TESSERA_FUSED=0`` turns it off (the benchmark's side-by-side
figures and the tests of both paths).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import cache
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

BLOCK = 256
"""Elements per block: a block of two updates, the global entry, the direction (1 KiB
each in float32) and the float64 sums (2 KiB) stay in a core's L1 data cache between
the measure and the fold. ``benchmarks/aggregation.py --blocks 128,256,512,1024``
measured them side by side with updates folded in pairs (2026-11-26, 2-core AMD
EPYC, 48 KiB L1d): 0.52x, 0.62x, 0.58x and 0.51x of torch in place."""

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
"""Entry dtypes the compiled loop takes (every other one takes the generic path)."""

_Kernel = Callable[..., tuple[int, float, float]]
_Correct = Callable[..., None]
_Fold = Callable[..., None]
_PairKernel = Callable[..., tuple[int, int, float, float, float, float]]
_FoldPair = Callable[..., None]

_OFF = False
"""Set inside :func:`disabled`."""


@cache
def _compile() -> tuple[_Kernel, _Correct, _Fold, _PairKernel, _FoldPair] | None:
    """Compile the loops with numba, or return ``None`` if numba cannot be imported."""
    if os.environ.get("TESSERA_FUSED", "1").strip() in {"0", "false", "no", "off"}:
        return None
    try:
        from numba import njit
    except ImportError:  # pragma: no cover - the Docker images and Jetson leave numba out
        log.info("numba is not installed: the bounded mean measures with torch (slower)")
        return None
    # reassociation lets LLVM vectorise the float64 sums; no "nnan"/"ninf": a
    # non-finite update must give a non-finite distance, and no "contract": the fold
    # rounds like torch's add_
    flags = {"reassoc", "nsz", "arcp"}

    @njit(fastmath=flags, inline="always")
    def _measure64(v: Any, b: Any) -> float:
        square = 0.0
        for i in range(v.size):
            x = np.float64(v[i]) - np.float64(b[i])
            square += x * x
        return square

    @njit(fastmath=flags, inline="always")
    def _measure_along64(v: Any, b: Any, d: Any) -> tuple[float, float]:
        square = 0.0
        dot = 0.0
        for i in range(v.size):
            x = np.float64(v[i]) - np.float64(b[i])
            square += x * x
            dot += x * np.float64(d[i])
        return square, dot

    @njit(fastmath=flags, inline="always")
    def _measure(v: Any, b: Any) -> float:
        # in the entry's precision within the block (vectorised, no conversions),
        # summed over blocks in float64; a block that overflows float32 again in float64
        square = v.dtype.type(0)
        for i in range(v.size):
            x = v[i] - b[i]
            square += x * x
        if square < np.inf:  # not np.isfinite: reassociation may fold x - x to 0
            return np.float64(square)
        return _measure64(v, b)

    @njit(fastmath=flags, inline="always")
    def _measure_along(v: Any, b: Any, d: Any) -> tuple[float, float]:
        # a loop of its own: a branch inside it keeps LLVM from vectorising
        square = v.dtype.type(0)
        dot = v.dtype.type(0)
        for i in range(v.size):
            x = v[i] - b[i]
            square += x * x
            dot += x * d[i]
        if square < np.inf and abs(dot) < np.inf:  # False for inf and NaN
            return np.float64(square), np.float64(dot)
        return _measure_along64(v, b, d)

    @njit(fastmath=flags, inline="always")
    def _fold(v: Any, t: Any, w: Any) -> None:
        for i in range(v.size):
            t[i] += w * v[i]

    @njit(fastmath=flags, nogil=True, cache=True)
    def measure_fold(
        v: Any,
        b: Any,
        d: Any,
        t: Any,
        w: Any,
        limit: float,
        square: float,
        along: bool,
        fold: bool,
        block: int,
    ) -> tuple[int, float, float]:
        n = v.size
        done = 0
        dot = 0.0
        for start in range(0, n, block):
            stop = min(n, start + block)
            if along:
                part, toward = _measure_along(v[start:stop], b[start:stop], d[start:stop])
                dot += toward
            else:
                part = _measure(v[start:stop], b[start:stop])
            square += part
            if fold and done == start and square <= limit:
                _fold(v[start:stop], t[start:stop], w)
                done = stop
        return done, square, dot

    @njit(fastmath=flags, inline="always")
    def _measure_pair(v: Any, u: Any, b: Any) -> tuple[Any, Any]:
        square = v.dtype.type(0)
        other = v.dtype.type(0)
        for i in range(v.size):
            x = v[i] - b[i]
            y = u[i] - b[i]
            square += x * x
            other += y * y
        return square, other

    @njit(fastmath=flags, inline="always")
    def _measure_along_pair(v: Any, u: Any, b: Any, d: Any) -> tuple[Any, Any, Any, Any]:
        square = v.dtype.type(0)
        dot = v.dtype.type(0)
        other = v.dtype.type(0)
        other_dot = v.dtype.type(0)
        for i in range(v.size):
            x = v[i] - b[i]
            y = u[i] - b[i]
            square += x * x
            dot += x * d[i]
            other += y * y
            other_dot += y * d[i]
        return square, dot, other, other_dot

    @njit(fastmath=flags, inline="always")
    def _fold_pair(v: Any, u: Any, t: Any, w: Any, w2: Any) -> None:
        for i in range(v.size):
            t[i] += w * v[i] + w2 * u[i]

    @njit(fastmath=flags, nogil=True, cache=True)
    def measure_fold_pair(
        v: Any,
        u: Any,
        b: Any,
        d: Any,
        t: Any,
        w: Any,
        w2: Any,
        limit: float,
        limit2: float,
        square: float,
        square2: float,
        along: bool,
        block: int,
    ) -> tuple[int, int, float, float, float, float]:
        # two updates against one global entry: the entry, the direction and the sums
        # are read once for both (what one update at a time reads twice)
        n = v.size
        done = 0
        done2 = 0
        dot = 0.0
        dot2 = 0.0
        for start in range(0, n, block):
            stop = min(n, start + block)
            vs = v[start:stop]
            us = u[start:stop]
            bs = b[start:stop]
            if along:
                ds = d[start:stop]
                p, q, p2, q2 = _measure_along_pair(vs, us, bs, ds)
                if p < np.inf and abs(q) < np.inf:  # False for inf and NaN
                    part, toward = float(p), float(q)
                else:
                    part, toward = _measure_along64(vs, bs, ds)
                if p2 < np.inf and abs(q2) < np.inf:
                    part2, toward2 = float(p2), float(q2)
                else:
                    part2, toward2 = _measure_along64(us, bs, ds)
                dot += toward
                dot2 += toward2
            else:
                p, p2 = _measure_pair(vs, us, bs)
                part = float(p) if p < np.inf else _measure64(vs, bs)
                part2 = float(p2) if p2 < np.inf else _measure64(us, bs)
            square += part
            square2 += part2
            first = done == start and square <= limit
            second = done2 == start and square2 <= limit2
            if first and second:
                _fold_pair(vs, us, t[start:stop], w, w2)
                done = stop
                done2 = stop
            elif first:
                _fold(vs, t[start:stop], w)
                done = stop
            elif second:
                _fold(us, t[start:stop], w2)
                done2 = stop
        return done, done2, square, square2, dot, dot2

    @njit(fastmath=flags, nogil=True, cache=True)
    def fold(v: Any, t: Any, w: Any) -> None:
        _fold(v, t, w)

    @njit(fastmath=flags, nogil=True, cache=True)
    def fold_pair(v: Any, u: Any, t: Any, w: Any, w2: Any) -> None:
        _fold_pair(v, u, t, w, w2)

    @njit(fastmath=flags, nogil=True, cache=True)
    def correct(v: Any, b: Any, t: Any, done: int, w: Any, f: Any) -> None:
        # the clipped value b + f (v - b), rounded once to the update's dtype, goes in
        # at w; the first `done` elements of v, folded at w, come back out
        for i in range(done):
            x = np.float64(b[i])
            c = v.dtype.type(x + f * (np.float64(v[i]) - x))
            t[i] += w * np.float64(c) - w * np.float64(v[i])
        for i in range(done, v.size):
            x = np.float64(b[i])
            c = v.dtype.type(x + f * (np.float64(v[i]) - x))
            t[i] += w * np.float64(c)

    return measure_fold, correct, fold, measure_fold_pair, fold_pair


def available() -> bool:
    """Return whether the compiled loop can be used (numba imported, not turned off)."""
    return not _OFF and _compile() is not None


def measure_fold(
    value: np.ndarray,
    base: np.ndarray,
    total: np.ndarray | None,
    weight: float,
    square: float,
    limit: float | None,
    direction: np.ndarray | None,
) -> tuple[int, float, float] | None:
    """Run the compiled pass; return ``None`` when it does not apply (use the torch path).

    Same contract as :func:`strategies.core.measure.measure_and_fold`: blocks of
    ``value`` are measured against ``base`` (and dotted with ``direction``), summed
    over blocks in float64; while the running ``square`` stays at most ``limit``, each block is
    added to ``total`` at ``weight`` in ``total``'s precision. The arrays must be
    flat views of one dtype (:data:`DTYPES`).

    Returns
    -------
    tuple[int, float, float] | None
        Elements folded (a prefix), the new ``square``, the dot with ``direction``
        (0 without one); ``None`` if numba is unavailable or the arrays do not fit.
    """
    compiled = None if _OFF else _compile()
    kernel = None if compiled is None else compiled[0]
    dtype = value.dtype
    if (
        kernel is None
        or dtype not in DTYPES
        or base.dtype != dtype
        or value.ndim != 1
        or base.shape != value.shape
        or (total is not None and (total.dtype not in DTYPES or total.shape != value.shape))
        or (direction is not None and (direction.dtype != dtype or direction.shape != value.shape))
    ):
        return None
    fold = limit is not None and total is not None
    d = direction if direction is not None else value
    t = total if total is not None and fold else np.empty(0, np.float64)  # never written
    done, square, dot = kernel(
        value,
        base,
        d,
        t,
        t.dtype.type(weight),
        float(limit) if limit is not None else -1.0,
        float(square),
        direction is not None,
        fold,
        BLOCK,
    )
    return int(done), float(square), float(dot)


def measure_fold_pair(
    value: np.ndarray,
    other: np.ndarray,
    base: np.ndarray,
    total: np.ndarray,
    weights: tuple[float, float],
    squares: tuple[float, float],
    limits: tuple[float | None, float | None],
    direction: np.ndarray | None,
) -> tuple[int, int, float, float, float, float] | None:
    """:func:`measure_fold` of two updates of one entry in one pass; ``None`` if it does not apply.

    Each update keeps its own running square, limit (``None``: measure only, fold
    nothing) and folded prefix, exactly as two calls of :func:`measure_fold` would;
    the global entry, the direction and the sums are read once for both. Where
    both fold a block it is added as ``total += w1 * v1 + w2 * v2`` (one rounding
    of the float64 sum instead of two).

    Returns
    -------
    tuple[int, int, float, float, float, float] | None
        Elements folded of each update, their new squares and their dots with
        ``direction`` (0 without one); ``None`` if numba is unavailable or the
        arrays do not fit (flat, one dtype of :data:`DTYPES`, one shape).
    """
    compiled = None if _OFF else _compile()
    dtype = value.dtype
    if (
        compiled is None
        or dtype not in DTYPES
        or value.ndim != 1
        or other.dtype != dtype
        or base.dtype != dtype
        or other.shape != value.shape
        or base.shape != value.shape
        or total.dtype not in DTYPES
        or total.shape != value.shape
        or (direction is not None and (direction.dtype != dtype or direction.shape != value.shape))
    ):
        return None
    w1, w2 = (total.dtype.type(w) for w in weights)
    limit1, limit2 = (-1.0 if lim is None else float(lim) for lim in limits)
    done1, done2, square1, square2, dot1, dot2 = compiled[3](
        value,
        other,
        base,
        value if direction is None else direction,
        total,
        w1,
        w2,
        limit1,
        limit2,
        float(squares[0]),
        float(squares[1]),
        direction is not None,
        BLOCK,
    )
    return int(done1), int(done2), float(square1), float(square2), float(dot1), float(dot2)


def correct(
    value: np.ndarray,
    base: np.ndarray,
    total: np.ndarray,
    done: int,
    weight: float,
    factor: float,
) -> bool:
    """Fold a clipped update in one pass; return ``False`` when it does not apply.

    ``total += weight * clipped`` and ``total[:done] -= weight * value[:done]`` (the
    blocks already folded unclipped), where ``clipped`` is ``base + factor * (value
    - base)`` computed in float64 and rounded once to ``value``'s dtype, as
    :func:`strategies.core.sums.clipped` computes it: the clipped update is one term
    of the sum, so the sum does not depend on the order updates arrive in. Flat
    contiguous arrays, ``value`` and ``base`` of one dtype of :data:`DTYPES`;
    otherwise nothing is done and ``False`` returned.
    """
    compiled = None if _OFF else _compile()
    dtype = value.dtype
    if (
        compiled is None
        or dtype not in DTYPES
        or value.ndim != 1
        or not value.flags.c_contiguous
        or base.dtype != dtype
        or base.size != value.size
        or not base.flags.c_contiguous
        or total.dtype not in DTYPES
        or total.shape != value.shape
        or not total.flags.c_contiguous
        or not 0 <= done <= value.size
    ):
        return False
    compiled[1](
        value,
        base.reshape(-1),
        total,
        int(done),
        total.dtype.type(weight),
        np.float64(factor),
    )
    return True


def fold(value: np.ndarray, total: np.ndarray, weight: float) -> bool:
    """Add ``weight * value`` to ``total`` in one compiled pass; ``False`` when it does not apply.

    For a float32 update into a float64 sum (what every plain fold is, see
    :func:`strategies.core.sums.sum_dtype`), where torch's mixed-dtype
    ``add_`` casts element by element at a fraction of the speed. Flat contiguous
    arrays of :data:`DTYPES` only.
    """
    compiled = None if _OFF else _compile()
    if (
        compiled is None
        or value.dtype not in DTYPES
        or total.dtype not in DTYPES
        or value.ndim != 1
        or total.shape != value.shape
        or not value.flags.c_contiguous
        or not total.flags.c_contiguous
        or not total.flags.writeable
    ):
        return False
    compiled[2](value, total, total.dtype.type(weight))
    return True


def fold_pair(
    value: np.ndarray, other: np.ndarray, total: np.ndarray, weights: tuple[float, float]
) -> bool:
    """Add ``w1 * value + w2 * other`` to ``total`` in one pass; ``False`` when it does not apply.

    What two calls of :func:`fold` do, with the sum read and written once for the two
    updates instead of twice (the plain ``mean`` folds its updates in pairs: the
    float64 sum is 16 of the 20 bytes one update moves per element). Flat contiguous
    arrays of :data:`DTYPES`, ``value`` and ``other`` of one dtype and shape.
    """
    compiled = None if _OFF else _compile()
    if (
        compiled is None
        or value.dtype not in DTYPES
        or other.dtype != value.dtype
        or total.dtype not in DTYPES
        or value.ndim != 1
        or other.shape != value.shape
        or total.shape != value.shape
        or not value.flags.c_contiguous
        or not other.flags.c_contiguous
        or not total.flags.c_contiguous
        or not total.flags.writeable
    ):
        return False
    w1, w2 = (total.dtype.type(w) for w in weights)
    compiled[4](value, other, total, w1, w2)
    return True


def warm_up() -> bool:
    """Compile, or load from numba's cache, every loop for float32 and float64 entries.

    numba compiles a loop for each argument type at its first call. In a fresh process
    that first call costs about 1.3 s even when numba's disk cache holds the loops
    (the import of numba, then loading each loop), and it fell inside a round: round
    1's first fold, round 2's first bounded fold. The ServerApp calls this at start,
    in a thread (:func:`start_warm_up`), while it waits for nodes. Returns whether the
    compiled loops are available.
    """
    if not available():
        return False
    for dtype in DTYPES:
        value = np.ones(BLOCK + 1, dtype)
        base = np.zeros_like(value)
        total = np.zeros(value.size, np.float64)
        fold(value, total, 1.0)
        fold_pair(value, value, total, (1.0, 1.0))
        measure_fold(value, base, total, 1.0, 0.0, 1e300, base)
        measure_fold(value, base, None, 0.0, 0.0, None, None)
        correct(value, base, total, 1, 0.5, 0.5)
        measure_fold_pair(value, value, base, total, (1.0, 1.0), (0.0, 0.0), (1e300, 1.0), base)
        measure_fold_pair(value, value, base, total, (1.0, 1.0), (0.0, 0.0), (None, 1.0), None)
    return True


PRE_IMPORTS = ("scipy.linalg",)
"""Modules numba's first compile imports (its BLAS bindings, ``scipy.linalg.cython_blas``)
that the ServerApp's own thread imports too (scikit-learn, loading a data set):
:func:`start_warm_up` imports them before the warm-up thread starts, so the two
threads never import them at once. They did once, and Python's import lock raised
``_DeadlockError`` in the ServerApp thread, which ended the run (a leaderboard cell,
2026-11-27)."""


def start_warm_up() -> threading.Thread:
    """Run :func:`warm_up` in a daemon thread (the loops release the interpreter lock).

    :data:`PRE_IMPORTS` are imported first, in the calling thread (0.1 s).
    """
    for name in PRE_IMPORTS:
        with suppress(ImportError):  # numba does without it, and so does the warm-up
            importlib.import_module(name)
    thread = threading.Thread(target=warm_up, name="tessera-fused-warm-up", daemon=True)
    thread.start()
    return thread


@contextmanager
def disabled() -> Iterator[None]:
    """Take the torch path inside the block (the benchmark's side-by-side figure)."""
    global _OFF
    before, _OFF = _OFF, True
    try:
        yield
    finally:
        _OFF = before
