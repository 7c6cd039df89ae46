"""Centered Kernel Alignment (Kornblith et al., 2019), differentiable and numerically safe.

CKA compares two representations of the same ``n`` samples, ``a`` (``n x d1``) and
``b`` (``n x d2``, ``d1 != d2`` allowed), through their ``n x n`` kernels ``K`` and
``L``::

    CKA(K, L) = HSIC(K, L) / sqrt(HSIC(K, K) * HSIC(L, L))

with the biased estimator ``HSIC(K, L) = tr(K H L H) / (n - 1)^2``, ``H = I - 11^T / n``
(FedHeNN's equation), or the unbiased estimator of Song et al. (2012) as an option.

Three entry points:

- :func:`linear_cka` on representation matrices, without any ``n x n`` matrix:
  ``||B_c^T A_c||_F^2 / (||A_c^T A_c||_F ||B_c^T B_c||_F)`` with column-centred
  ``A_c``, ``B_c`` (it switches to the kernel form when ``n^2`` is smaller than
  ``d1 * d2``);
- :func:`rbf_cka` on representation matrices with Gaussian kernels, bandwidth the
  median pairwise distance (detached) unless given;
- :func:`kernel_cka` on two ``n x n`` kernel matrices (FedHeNN's heterogeneous
  variant aligns to an averaged kernel, which has no representation).

Safety: centring subtracts row and column means (never an ``n x n`` centring matrix);
inputs are scaled to unit Frobenius norm first (CKA is invariant to isotropic
scaling, so this is exact and rules out overflow); arithmetic runs in float64 from
:data:`FLOAT64_MIN_ROWS` rows on (or when the input is float64); a zero norm gives
CKA 0 with finite zero gradients instead of NaN; squared distances are clamped at 0;
the result is clamped to ``[0, 1]`` (straight-through: the gradient is that of the
unclamped estimate, which matters for the unbiased estimator, whose estimate can be
negative).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "FLOAT64_MIN_ROWS",
    "centre_kernel",
    "kernel_cka",
    "linear_cka",
    "linear_kernel",
    "median_distance",
    "rbf_cka",
    "rbf_kernel",
    "squared_distances",
]

FLOAT64_MIN_ROWS = 512
"""From this many rows on, CKA is computed in float64 (sums of ``n^2`` terms)."""


class CKAInputError(ValueError):
    """The inputs of a CKA function have the wrong shape or type."""


# ----------------------------------------------------------------------------- helpers
def _work_dtype(x: Tensor, rows: int) -> torch.dtype:
    """float64 for float64 inputs or from FLOAT64_MIN_ROWS rows on (not on MPS)."""
    if x.dtype == torch.float64:
        return torch.float64
    if rows >= FLOAT64_MIN_ROWS and x.device.type != "mps":
        return torch.float64
    return torch.float32


def _check_matrix(x: Tensor, name: str) -> None:
    if not isinstance(x, Tensor):
        raise CKAInputError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise CKAInputError(
            f"{name} must be a 2-d matrix (samples x features or n x n kernel), got "
            f"shape {tuple(x.shape)}; flatten the representation first"
        )
    if not torch.is_floating_point(x):
        raise CKAInputError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _check_rows(a: Tensor, b: Tensor, *, unbiased: bool) -> int:
    if a.shape[0] != b.shape[0]:
        raise CKAInputError(
            f"both inputs must describe the same samples: {a.shape[0]} rows vs {b.shape[0]} rows"
        )
    rows = int(a.shape[0])
    minimum = 4 if unbiased else 2
    if rows < minimum:
        raise CKAInputError(
            f"CKA needs at least {minimum} samples with the "
            f"{'unbiased' if unbiased else 'biased'} estimator, got {rows}"
        )
    return rows


def _safe_scale(x: Tensor) -> tuple[Tensor, Tensor]:
    """Return ``x / ||x||_F`` (``x`` itself when the norm is 0) and whether it was > 0."""
    norm = torch.linalg.matrix_norm(x)
    ok = norm > torch.finfo(x.dtype).tiny
    safe = torch.where(ok, norm, torch.ones_like(norm))
    return x / safe, ok


def _ratio(num: Tensor, den_a: Tensor, den_b: Tensor, ok: Tensor) -> Tensor:
    """``num / sqrt(den_a * den_b)`` where defined, else 0; the value clamped to [0, 1]."""
    prod = den_a * den_b
    ok = ok & (prod > torch.finfo(prod.dtype).tiny)
    safe = torch.where(ok, prod, torch.ones_like(prod))
    value = torch.where(ok, num / torch.sqrt(safe), torch.zeros_like(num))
    # Straight-through clamp: the value is in [0, 1] (the unbiased estimate can fall
    # below 0, rounding can exceed 1) but the gradient is the estimator's own, so a
    # negative unbiased estimate still pulls the representations together.
    return value + (value.clamp(0.0, 1.0) - value).detach()


def centre_kernel(k: Tensor) -> Tensor:
    """Return ``H K H`` by subtracting row, column and grand means (no ``H`` is built).

    Parameters
    ----------
    k : Tensor
        An ``n x n`` kernel matrix.

    Returns
    -------
    Tensor
        The doubly centred kernel.
    """
    return k - k.mean(dim=0, keepdim=True) - k.mean(dim=1, keepdim=True) + k.mean()


def linear_kernel(a: Tensor) -> Tensor:
    """Return the linear kernel ``a a^T`` of an ``n x d`` representation."""
    _check_matrix(a, "a")
    return a @ a.T


def squared_distances(a: Tensor) -> Tensor:
    """Pairwise squared Euclidean distances of the rows of ``a``, clamped at 0.

    ``||x||^2 + ||y||^2 - 2 x.y`` can come out slightly negative in floating point;
    the clamp keeps the RBF kernel at most 1 and the median bandwidth real.
    """
    _check_matrix(a, "a")
    sq_norms = (a * a).sum(dim=1)
    sq = sq_norms[:, None] + sq_norms[None, :] - 2.0 * (a @ a.T)
    return sq.clamp_min(0.0)


def median_distance(sq: Tensor) -> Tensor:
    """Median pairwise distance from squared distances (off-diagonal), detached.

    Returns 1 when every distance is 0 (all samples identical), where any bandwidth
    gives the same constant kernel.
    """
    n = sq.shape[0]
    rows, cols = torch.triu_indices(n, n, offset=1, device=sq.device)
    dist = torch.sqrt(sq.detach()[rows, cols])
    median = torch.median(dist) if dist.numel() else torch.zeros((), dtype=sq.dtype)
    if not bool(median > 0):
        return torch.ones((), dtype=sq.dtype, device=sq.device)
    return median


def rbf_kernel(a: Tensor, sigma: float | Tensor | None = None) -> Tensor:
    """Gaussian kernel ``exp(-||x - y||^2 / (2 sigma^2))`` of the rows of ``a``.

    Parameters
    ----------
    a : Tensor
        An ``n x d`` representation.
    sigma : float or Tensor, optional
        Bandwidth; the median pairwise distance of ``a`` (detached) by default.

    Returns
    -------
    Tensor
        The ``n x n`` kernel.
    """
    sq = squared_distances(a)
    bandwidth = median_distance(sq) if sigma is None else torch.as_tensor(sigma, dtype=sq.dtype)
    if not bool(bandwidth > 0):
        raise CKAInputError(f"the RBF bandwidth sigma must be positive, got {float(bandwidth)}")
    return torch.exp(-sq / (2.0 * bandwidth.to(sq.device) ** 2))


# --------------------------------------------------------------------------------- HSIC
def _hsic_biased_kernels(k: Tensor, l: Tensor) -> Tensor:  # noqa: E741 - HSIC notation
    """``tr(K H L H)`` of centred kernels, up to the ``(n-1)^2`` that cancels in CKA."""
    return (k * l).sum()


def _hsic_unbiased_kernels(k: Tensor, l: Tensor) -> Tensor:  # noqa: E741 - HSIC notation
    """Song et al. (2012) unbiased HSIC of two ``n x n`` kernels (``n >= 4``)."""
    n = k.shape[0]
    kt = k - torch.diag(torch.diagonal(k))
    lt = l - torch.diag(torch.diagonal(l))
    trace = (kt * lt).sum()
    sum_k, sum_l = kt.sum(), lt.sum()
    cross = kt.sum(dim=1) @ lt.sum(dim=1)
    return (trace + sum_k * sum_l / ((n - 1) * (n - 2)) - 2.0 * cross / (n - 2)) / (n * (n - 3))


def _hsic_unbiased_linear(a: Tensor, b: Tensor) -> Tensor:
    """Unbiased HSIC of the linear kernels of ``a`` and ``b``, in O(n d) memory."""
    n = a.shape[0]
    diag_k = (a * a).sum(dim=1)
    diag_l = (b * b).sum(dim=1)
    trace = ((a.T @ b) ** 2).sum() - (diag_k * diag_l).sum()
    row_k = a @ a.sum(dim=0) - diag_k
    row_l = b @ b.sum(dim=0) - diag_l
    sum_k, sum_l = row_k.sum(), row_l.sum()
    cross = row_k @ row_l
    return (trace + sum_k * sum_l / ((n - 1) * (n - 2)) - 2.0 * cross / (n - 2)) / (n * (n - 3))


# ---------------------------------------------------------------------------------- CKA
def kernel_cka(k: Tensor, l: Tensor, *, unbiased: bool = False) -> Tensor:  # noqa: E741
    """CKA of two ``n x n`` kernel matrices.

    Parameters
    ----------
    k, l : Tensor
        Symmetric kernel matrices of the same ``n`` samples (``l`` as in the
        paper's notation ``HSIC(K, L)``).
    unbiased : bool
        Use the unbiased HSIC estimator (needs ``n >= 4``) instead of the biased one.

    Returns
    -------
    Tensor
        A differentiable scalar in ``[0, 1]`` (0 when a kernel is constant).
    """
    _check_matrix(k, "k")
    _check_matrix(l, "l")
    if k.shape[0] != k.shape[1] or l.shape[0] != l.shape[1]:
        raise CKAInputError(
            f"kernel_cka takes square n x n kernels, got {tuple(k.shape)} and "
            f"{tuple(l.shape)}; for n x d representations use linear_cka or rbf_cka"
        )
    rows = _check_rows(k, l, unbiased=unbiased)
    out_dtype = k.dtype
    dtype = _work_dtype(k, rows)
    first, second = k.to(dtype), l.to(dtype)
    if unbiased:
        first, ok_k = _safe_scale(first)
        second, ok_l = _safe_scale(second)
        hsic = _hsic_unbiased_kernels
    else:
        first, ok_k = _safe_scale(centre_kernel(first))
        second, ok_l = _safe_scale(centre_kernel(second))
        hsic = _hsic_biased_kernels
    hkl = hsic(first, second)
    hkk = hsic(first, first)
    hll = hsic(second, second)
    return _ratio(hkl, hkk, hll, ok_k & ok_l).to(out_dtype)


def linear_cka(a: Tensor, b: Tensor, *, unbiased: bool = False) -> Tensor:
    """CKA with linear kernels of two representations, without ``n x n`` matrices.

    Parameters
    ----------
    a : Tensor
        ``n x d1`` representation.
    b : Tensor
        ``n x d2`` representation of the same samples (``d2`` may differ from ``d1``).
    unbiased : bool
        Use the unbiased HSIC estimator (needs ``n >= 4``).

    Returns
    -------
    Tensor
        A differentiable scalar in ``[0, 1]``; equal to
        ``kernel_cka(a @ a.T, b @ b.T)``.
    """
    _check_matrix(a, "a")
    _check_matrix(b, "b")
    rows = _check_rows(a, b, unbiased=unbiased)
    out_dtype = a.dtype
    dtype = _work_dtype(a, rows)
    a, b = a.to(dtype), b.to(dtype)
    # Centring columns is H a; the linear kernel of H a is H K H.
    a, ok_a = _safe_scale(a - a.mean(dim=0, keepdim=True))
    b, ok_b = _safe_scale(b - b.mean(dim=0, keepdim=True))
    ok = ok_a & ok_b
    if unbiased:
        hab = _hsic_unbiased_linear(a, b)
        haa = _hsic_unbiased_linear(a, a)
        hbb = _hsic_unbiased_linear(b, b)
        return _ratio(hab, haa, hbb, ok).to(out_dtype)
    if rows * rows < a.shape[1] * b.shape[1]:
        k, l = a @ a.T, b @ b.T  # noqa: E741 - already centred
        return _ratio((k * l).sum(), (k * k).sum(), (l * l).sum(), ok).to(out_dtype)
    hab = ((b.T @ a) ** 2).sum()
    haa = ((a.T @ a) ** 2).sum()
    hbb = ((b.T @ b) ** 2).sum()
    return _ratio(hab, haa, hbb, ok).to(out_dtype)


def rbf_cka(
    a: Tensor,
    b: Tensor,
    sigma: float | None = None,
    *,
    unbiased: bool = False,
) -> Tensor:
    """CKA with Gaussian (RBF) kernels of two representations.

    Parameters
    ----------
    a : Tensor
        ``n x d1`` representation.
    b : Tensor
        ``n x d2`` representation of the same samples.
    sigma : float, optional
        Bandwidth used for both kernels; by default each kernel uses the median
        pairwise distance of its own representation (detached, so no gradient flows
        through the bandwidth).
    unbiased : bool
        Use the unbiased HSIC estimator (needs ``n >= 4``).

    Returns
    -------
    Tensor
        A differentiable scalar in ``[0, 1]``.
    """
    _check_matrix(a, "a")
    _check_matrix(b, "b")
    rows = _check_rows(a, b, unbiased=unbiased)
    out_dtype = a.dtype
    dtype = _work_dtype(a, rows)
    kernel_a = rbf_kernel(a.to(dtype), sigma)
    kernel_b = rbf_kernel(b.to(dtype), sigma)
    return kernel_cka(kernel_a, kernel_b, unbiased=unbiased).to(out_dtype)
