"""The averaged kernel K_bar of heterogeneous FedHeNN, and how it travels.

FedHeNN's heterogeneous variant aligns every client to ``K_bar = sum_j w_j K_j``, the
weighted average of the clients' ``n x n`` kernels on the RAD. Shipping ``n x n``
float32 kernels is ``4 n^2`` bytes each way (100 MB per client and round for the
paper's RAD of 5000), so here:

- clients send their representation ``A_j`` (``n x d_j``), never a kernel;
- the server builds the centred ``K_bar`` (for the linear kernel only as a factor
  ``Z`` with ``K_bar = Z Z^T``, never ``n x n``) and sends a low-rank factor ``F``
  (``n x r``) with ``F F^T ~ K_bar``: the top eigenvectors holding a fraction
  ``energy`` of ``||K_bar||_F^2``, scaled to a maximum magnitude of 1 and cast to
  float16 (or float32);
- a client aligns to ``F`` directly: the linear CKA of its representation and ``F``
  equals the CKA of its kernel and ``F F^T`` (and the rows of ``F`` for a RAD subset
  give that subset's kernel exactly).

Each ``K_j`` is centred and scaled to unit Frobenius norm before averaging, so the
weights ``w_j`` (not the arbitrary magnitude of each network's activations) decide
how much each client counts; CKA itself is invariant to that scaling. The paper
averages unscaled kernels.

Truncating to rank ``r`` gives ``CKA(K_bar, K_r) = sqrt(energy captured)`` exactly;
:func:`factorise` also measures the CKA between the exact and the transmitted
(quantised) kernel, which is what :attr:`FactoredKernel.cka` reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from strategies.fedhenn.cka import centre_kernel, kernel_cka, linear_cka, rbf_kernel

__all__ = [
    "EIGH_MAX_ROWS",
    "ExactKernel",
    "FactoredKernel",
    "KernelAccumulator",
    "average_kernel",
    "factorise",
    "normalise_weights",
]

EIGH_MAX_ROWS = 2048
"""Above this many rows an RBF ``K_bar`` is factorised by randomised SVD."""

LOWRANK_MAX_RANK = 256
"""Rank limit of the randomised factorisation of large RBF kernels."""


class KernelAverageError(ValueError):
    """The representations to average do not agree or carry no information."""


@dataclass(frozen=True)
class ExactKernel:
    """The exact centred ``K_bar``, in the cheapest exact form.

    Attributes
    ----------
    kernel : str
        ``"linear"`` or ``"rbf"``.
    z : np.ndarray | None
        Linear kernel: ``n x D`` float64 with ``K_bar = z z^T``.
    matrix : np.ndarray | None
        RBF kernel: the ``n x n`` float64 matrix.
    """

    kernel: str
    z: np.ndarray | None = None
    matrix: np.ndarray | None = None

    @property
    def rows(self) -> int:
        """Number of RAD samples ``n``."""
        source = self.z if self.z is not None else self.matrix
        assert source is not None
        return int(source.shape[0])


@dataclass(frozen=True)
class FactoredKernel:
    """What the server ships: ``factor @ factor.T`` approximates ``K_bar``.

    Attributes
    ----------
    factor : np.ndarray
        ``n x r`` in the wire dtype (float16 or float32).
    rank : int
        ``r``.
    energy : float
        Fraction of ``||K_bar||_F^2`` kept by the rank-``r`` truncation.
    cka : float
        CKA between the exact ``K_bar`` and the transmitted ``factor factor^T``.
    """

    factor: np.ndarray
    rank: int
    energy: float
    cka: float

    @property
    def nbytes(self) -> int:
        """Raw size of the factor in bytes."""
        return int(self.factor.nbytes)


def normalise_weights(weights: Sequence[float]) -> np.ndarray:
    """Return non-negative weights scaled to sum to 1.

    Raises
    ------
    KernelAverageError
        If a weight is negative or not finite, or they sum to 0.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise KernelAverageError(
            f"kernel weights {list(weights)} must be finite, non-negative and sum to > 0"
        )
    normalised: np.ndarray = w / w.sum()
    return normalised


def unit_scale(rep: np.ndarray, dtype: str = "float64") -> np.ndarray:
    """Return ``rep`` divided by its largest magnitude, as ``dtype``.

    The normalised linear kernel and the RBF kernel with a median-distance bandwidth
    are both invariant to this scale; it keeps products of huge (hostile) values
    from overflowing to infinities and NaNs on the server, and lets a client send
    features larger than float16 holds (65504) at ``fedhenn-precision='float16'``
    without their becoming infinities. The scale is taken in float64; a zero or
    non-finite peak leaves the values unscaled.

    Examples
    --------
    >>> unit_scale(np.array([[1e6, -2e6], [5e5, 0.0]]), "float16").tolist()
    [[0.5, -1.0], [0.25, 0.0]]
    """
    a = rep.astype(np.float64)
    peak = float(np.max(np.abs(a))) if a.size else 0.0
    scaled = a / peak if peak > 0 and np.isfinite(peak) else a
    return scaled.astype(dtype)


def _unit_kernel(rep: np.ndarray, kernel: str) -> np.ndarray:
    """Return the centred ``n x n`` kernel of one representation, of unit Frobenius norm."""
    a = unit_scale(rep)
    if kernel == "linear":
        a = a - a.mean(axis=0, keepdims=True)
        k = a @ a.T
    else:
        k = centre_kernel(rbf_kernel(torch.from_numpy(a))).numpy()
    norm = float(np.linalg.norm(k))
    if norm <= 0:
        raise KernelAverageError("a representation is constant (zero norm after centring)")
    return np.asarray(k / norm)


def _linear_part(rep: np.ndarray, weight: float) -> np.ndarray:
    """Return ``A_c sqrt(weight / ||A_c A_c^T||_F)``, whose outer product is the weighted kernel."""
    a = unit_scale(rep)
    a = a - a.mean(axis=0, keepdims=True)
    norm = float(np.linalg.norm(a.T @ a))  # = ||A_c A_c^T||_F
    if norm <= 0:
        raise KernelAverageError("a representation is constant (zero norm after centring)")
    part: np.ndarray = a * math.sqrt(weight / norm)
    return part


class KernelAccumulator:
    """Fold the clients' representations into ``K_bar``'s weighted mean as they arrive.

    ``K_bar = sum_j w_j K_j / ||K_j||_F / sum_j w_j``, the ``merge="mean"`` of
    :func:`average_kernel`, without keeping the representations: the server adds each
    reply's and drops it. What it holds is bounded by the RAD, not the node count:

    - linear kernel: the weighted centred representations side by side as the factor
      ``Z`` (``K = Z Z^T``), until ``Z`` is as wide as the RAD has rows ``n``; from
      then on the ``n x n`` matrix ``Z Z^T``, to which each later part adds its outer
      product. At most ``n x max(n, D)`` float64, ``D`` the widest representation;
    - RBF kernel: the ``n x n`` sum of the weighted unit kernels.

    The weights may be of any positive scale: the sum is divided by their total at
    the end, so the result equals :func:`average_kernel`'s (to float64 rounding).

    Parameters
    ----------
    kernel : str
        ``"linear"`` or ``"rbf"``.

    Raises
    ------
    KernelAverageError
        If ``kernel`` is unknown.
    """

    def __init__(self, kernel: str) -> None:
        if kernel not in ("linear", "rbf"):
            raise KernelAverageError(f"unknown kernel '{kernel}'; use 'linear' or 'rbf'")
        self.kernel = kernel
        self.parts: list[np.ndarray] = []
        self.width = 0
        self.matrix: np.ndarray | None = None
        self.rows: int | None = None
        self.total_weight = 0.0
        self.count = 0

    @property
    def nbytes(self) -> int:
        """Bytes the accumulator holds now."""
        held = sum(p.nbytes for p in self.parts)
        return held + (0 if self.matrix is None else int(self.matrix.nbytes))

    def add(self, rep: np.ndarray, weight: float) -> None:
        """Add one client's ``n x d`` representation at ``weight`` (finite, >= 0).

        Raises
        ------
        KernelAverageError
            If the weight is negative or not finite, the representation is not a
            matrix of the rows the earlier ones had, or it is constant.
        """
        if not math.isfinite(weight) or weight < 0:
            raise KernelAverageError(f"kernel weight {weight} must be finite and non-negative")
        if rep.ndim != 2 or (self.rows is not None and rep.shape[0] != self.rows):
            raise KernelAverageError(
                "every representation must be an n x d matrix of the same n samples, got "
                f"shape {tuple(rep.shape)} after {self.rows} rows"
            )
        n = int(rep.shape[0])
        if self.kernel == "rbf":
            unit = _unit_kernel(rep, "rbf")  # raises before anything is kept
            if self.matrix is None:
                self.matrix = np.zeros((n, n), dtype=np.float64)
            self.matrix += weight * unit
        else:
            part = _linear_part(rep, weight)
            if self.matrix is not None:
                self.matrix += part @ part.T
            else:
                self.parts.append(part)
                self.width += int(part.shape[1])
                if self.width >= n:  # the factor is now no smaller than the matrix
                    z = np.concatenate(self.parts, axis=1)
                    self.matrix = z @ z.T
                    self.parts = []
        self.rows = n
        self.total_weight += weight
        self.count += 1

    def result(self) -> ExactKernel:
        """Return the centred ``K_bar`` of everything added.

        Raises
        ------
        KernelAverageError
            If nothing was added or the weights sum to 0.
        """
        if self.count == 0 or self.total_weight <= 0:
            raise KernelAverageError(
                f"{self.count} representation(s) of total weight {self.total_weight}; "
                "K_bar needs at least one of positive weight"
            )
        if self.matrix is not None:
            return ExactKernel(self.kernel, matrix=self.matrix / self.total_weight)
        z = np.concatenate(self.parts, axis=1) / math.sqrt(self.total_weight)
        return ExactKernel(self.kernel, z=z)


def average_kernel(
    representations: Sequence[np.ndarray],
    weights: Sequence[float],
    *,
    kernel: str,
    merge: str = "mean",
    trim_fraction: float = 0.1,
) -> ExactKernel:
    """Build the centred ``K_bar`` of the clients' representations.

    ``merge="mean"`` (the paper's): ``K_bar = sum_j w_j K_j / ||K_j||_F``; each
    client's kernel has unit norm, so no client outweighs its weight however it
    scales its representation. ``"median"`` / ``"trimmed-mean"``: the element-wise
    median / trimmed mean (``trim_fraction`` from each end) of the unit-norm kernels,
    unweighted (memory: one ``n x n`` float64 matrix per client).

    Parameters
    ----------
    representations : Sequence[np.ndarray]
        One ``n x d_j`` representation per client (same ``n``, any ``d_j``).
    weights : Sequence[float]
        One non-negative weight per client (normalised here; ignored by the robust
        merges).
    kernel : str
        ``"linear"`` or ``"rbf"`` (median-distance bandwidth per client).
    merge : str
        ``"mean"``, ``"median"`` or ``"trimmed-mean"`` (run-config ``knowledge-merge``).
    trim_fraction : float
        Share trimmed from each end by ``"trimmed-mean"``.

    Returns
    -------
    ExactKernel
        ``K_bar`` as a factor (linear mean) or a matrix, in float64.

    Raises
    ------
    KernelAverageError
        If the inputs disagree in rows, or a representation is constant.
    """
    if len(representations) != len(weights) or not representations:
        raise KernelAverageError(
            f"{len(representations)} representations but {len(weights)} weights; "
            "pass one weight per representation, at least one"
        )
    if kernel not in ("linear", "rbf"):
        raise KernelAverageError(f"unknown kernel '{kernel}'; use 'linear' or 'rbf'")
    if merge not in ("mean", "median", "trimmed-mean"):
        raise KernelAverageError(f"unknown merge '{merge}'; use mean, median or trimmed-mean")
    w = normalise_weights(weights)
    rows = {int(r.shape[0]) for r in representations}
    if len(rows) != 1 or any(r.ndim != 2 for r in representations):
        raise KernelAverageError(
            "every representation must be an n x d matrix of the same n samples, got "
            f"shapes {[tuple(r.shape) for r in representations]}"
        )
    if merge != "mean":
        stack = np.stack([_unit_kernel(rep, kernel) for rep in representations])
        k = stack.shape[0]
        trim = math.ceil(trim_fraction * k) if merge == "trimmed-mean" else 0
        if merge == "trimmed-mean" and 2 * trim < k:
            matrix = np.sort(stack, axis=0)[trim : k - trim].mean(axis=0)
        else:
            matrix = np.median(stack, axis=0)
        return ExactKernel(kernel, matrix=np.asarray(matrix))
    accumulator = KernelAccumulator(kernel)
    for weight, rep in zip(w, representations, strict=True):
        accumulator.add(rep, float(weight))
    return accumulator.result()


def _top_eigen(exact: ExactKernel) -> tuple[np.ndarray, np.ndarray, float]:
    """Eigenvalues (descending, >= 0), eigenvectors and ``||K_bar||_F^2``."""
    if exact.z is not None:
        u, s, _ = np.linalg.svd(exact.z, full_matrices=False)
        eig = s**2
        return eig, u, float(np.sum(eig**2))
    assert exact.matrix is not None
    k = exact.matrix
    total = float(np.sum(k * k))
    if k.shape[0] <= EIGH_MAX_ROWS or exact.kernel == "linear":  # linear: exact, as z's SVD
        eig, vec = np.linalg.eigh(k)
        eig, vec = eig[::-1], vec[:, ::-1]
    else:
        q = min(LOWRANK_MAX_RANK, k.shape[0])
        left, values, _ = torch.svd_lowrank(torch.from_numpy(k), q=q, niter=4)
        eig, vec = values.numpy(), left.numpy()
    return np.clip(eig, 0.0, None), vec, total


def factorise(exact: ExactKernel, *, energy: float, dtype: str) -> FactoredKernel:
    """Low-rank, reduced-precision factor of ``K_bar`` and its measured fidelity.

    Parameters
    ----------
    exact : ExactKernel
        The exact centred ``K_bar``.
    energy : float
        Fraction of ``||K_bar||_F^2`` to keep, in ``(0, 1]``; the CKA of the
        truncation is ``sqrt(energy)`` (before quantisation).
    dtype : str
        ``"float16"`` or ``"float32"``.

    Returns
    -------
    FactoredKernel
        The factor (``n x r``) and its rank, energy and CKA to the exact kernel.
    """
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    eig, vec, total = _top_eigen(exact)
    if total <= 0 or eig.size == 0:
        raise KernelAverageError("K_bar is zero; nothing to align to")
    captured = np.cumsum(eig**2) / total
    rank = min(int(np.searchsorted(captured, energy - 1e-12)) + 1, int(eig.size))
    factor = vec[:, :rank] * np.sqrt(eig[:rank])[None, :]
    peak = float(np.max(np.abs(factor)))
    if peak > 0:
        factor = factor / peak  # CKA is scale invariant; keeps float16 in range
    wire = factor.astype(np.dtype(dtype))
    sent = torch.from_numpy(wire.astype(np.float64))
    if exact.z is not None:
        cka = float(linear_cka(torch.from_numpy(exact.z), sent))
    else:
        assert exact.matrix is not None
        cka = float(kernel_cka(torch.from_numpy(exact.matrix), sent @ sent.T))
    return FactoredKernel(
        factor=np.ascontiguousarray(wire), rank=rank, energy=float(captured[rank - 1]), cka=cka
    )
