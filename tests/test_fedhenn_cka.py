"""CKA maths of FedHeNN (strategies.fedhenn.cka): values by hand, properties, safety."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from strategies.fedhenn import kernel_cka, linear_cka, rbf_cka
from strategies.fedhenn.cka import (
    FLOAT64_MIN_ROWS,
    CKAInputError,
    centre_kernel,
    median_distance,
    rbf_kernel,
    squared_distances,
)


def rand(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen, dtype=dtype)


def orthogonal(dim: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(rand(dim, dim, seed))
    return q


def reference_cka(k: np.ndarray, l: np.ndarray) -> float:  # noqa: E741
    """The paper's formula with an explicit centring matrix H (independent code path)."""
    n = k.shape[0]
    h = np.eye(n) - np.ones((n, n)) / n

    def hsic(x: np.ndarray, y: np.ndarray) -> float:
        return float(np.trace(x @ h @ y @ h)) / (n - 1) ** 2

    return hsic(k, l) / math.sqrt(hsic(k, k) * hsic(l, l))


def reference_unbiased_hsic(k: np.ndarray, l: np.ndarray) -> float:  # noqa: E741
    """Song et al. (2012), eq. 5, written with loops over the zero-diagonal kernels."""
    n = k.shape[0]
    kt, lt = k.copy(), l.copy()
    np.fill_diagonal(kt, 0.0)
    np.fill_diagonal(lt, 0.0)
    ones = np.ones(n)
    term1 = float(np.trace(kt @ lt))
    term2 = float(ones @ kt @ ones) * float(ones @ lt @ ones) / ((n - 1) * (n - 2))
    term3 = 2.0 / (n - 2) * float(ones @ kt @ lt @ ones)
    return (term1 + term2 - term3) / (n * (n - 3))


# ----------------------------------------------------------------------------- by hand
def test_linear_cka_of_a_3x2_matrix_worked_by_hand() -> None:
    # Prepare: a = [[1, 0], [0, 1], [1, 1]], b = [1, 2, 4]^T.
    # Centred (times 3): A = [[1, -2], [-2, 1], [1, 1]], B = [-4, -1, 5]^T.
    # A^T B = [3, 12] -> ||A^T B||^2 = 153; A^T A = [[6, -3], [-3, 6]] -> ||.||_F = sqrt(90);
    # B^T B = 42. CKA = 153 / (sqrt(90) * 42) = 17 / (14 sqrt(10)).
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = torch.tensor([[1.0], [2.0], [4.0]])
    expected = 17.0 / (14.0 * math.sqrt(10.0))

    # Execute
    rep_form = linear_cka(a, b)
    kernel_form = kernel_cka(a @ a.T, b @ b.T)

    # Assert
    assert rep_form.item() == pytest.approx(expected, rel=1e-6)
    assert kernel_form.item() == pytest.approx(expected, rel=1e-6)
    assert rep_form.dtype == torch.float32


def test_centre_kernel_equals_h_k_h() -> None:
    # Prepare
    k = rand(6, 6, 1)
    h = torch.eye(6, dtype=torch.float64) - 1.0 / 6

    # Execute / Assert
    torch.testing.assert_close(centre_kernel(k), h @ k @ h)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_cka_matches_the_explicit_centring_matrix_formula(seed: int) -> None:
    # Prepare
    a, b = rand(12, 3, seed), rand(12, 5, seed + 10)
    k, l = (a @ a.T), torch.exp(-squared_distances(b) / 4.0)  # noqa: E741

    # Execute
    value = kernel_cka(k, l)

    # Assert
    assert value.item() == pytest.approx(reference_cka(k.numpy(), l.numpy()), rel=1e-10)


@pytest.mark.parametrize("seed", [0, 1])
def test_unbiased_estimator_matches_song_et_al(seed: int) -> None:
    # Prepare
    a, b = rand(15, 4, seed), rand(15, 6, seed + 20)
    k, l = (a @ a.T).numpy(), (b @ b.T).numpy()  # noqa: E741
    expected = reference_unbiased_hsic(k, l) / math.sqrt(
        reference_unbiased_hsic(k, k) * reference_unbiased_hsic(l, l)
    )

    # Execute
    kernel_form = kernel_cka(torch.from_numpy(k), torch.from_numpy(l), unbiased=True)
    rep_form = linear_cka(a, b, unbiased=True)

    # Assert
    assert kernel_form.item() == pytest.approx(max(expected, 0.0), rel=1e-9, abs=1e-12)
    assert rep_form.item() == pytest.approx(kernel_form.item(), rel=1e-9, abs=1e-12)


def test_rbf_kernel_uses_the_median_pairwise_distance() -> None:
    # Prepare: points 0, 1, 3 on a line: distances 1, 3, 2 -> median 2 -> sigma = 2
    a = torch.tensor([[0.0], [1.0], [3.0]], dtype=torch.float64)
    d2 = torch.tensor([[0.0, 1.0, 9.0], [1.0, 0.0, 4.0], [9.0, 4.0, 0.0]], dtype=torch.float64)

    # Execute
    sigma = median_distance(squared_distances(a))
    kernel = rbf_kernel(a)

    # Assert
    assert sigma.item() == pytest.approx(2.0)
    torch.testing.assert_close(kernel, torch.exp(-d2 / 8.0))


# ------------------------------------------------------------------------- properties
CKAS = {
    "linear": lambda a, b: linear_cka(a, b),
    "linear-unbiased": lambda a, b: linear_cka(a, b, unbiased=True),
    "rbf": lambda a, b: rbf_cka(a, b),
    "rbf-unbiased": lambda a, b: rbf_cka(a, b, unbiased=True),
    "kernel": lambda a, b: kernel_cka(a @ a.T, b @ b.T),
}


@pytest.mark.parametrize("name", sorted(CKAS))
def test_cka_of_identical_inputs_is_one(name: str) -> None:
    # Prepare
    a = rand(20, 6, 3)

    # Execute / Assert
    assert CKAS[name](a, a).item() == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("name", sorted(CKAS))
def test_cka_is_invariant_to_orthogonal_transforms_and_isotropic_scaling(name: str) -> None:
    # Prepare
    a, b = rand(25, 6, 4), rand(25, 9, 5)
    q = orthogonal(6, 6)

    # Execute
    base = CKAS[name](a, b)
    rotated = CKAS[name](a @ q, b)
    scaled = CKAS[name](3.7 * a, 0.02 * b)

    # Assert
    assert rotated.item() == pytest.approx(base.item(), rel=1e-9, abs=1e-12)
    assert scaled.item() == pytest.approx(base.item(), rel=1e-9, abs=1e-12)
    assert CKAS[name](a, a @ q).item() == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("name", sorted(CKAS))
def test_cka_is_symmetric(name: str) -> None:
    # Prepare
    a, b = rand(18, 4, 7), rand(18, 11, 8)

    # Execute / Assert
    assert CKAS[name](a, b).item() == pytest.approx(CKAS[name](b, a).item(), rel=1e-12)


@pytest.mark.parametrize("name", sorted(CKAS))
def test_cka_lies_in_zero_one(name: str) -> None:
    for seed in range(10):
        # Prepare: independent, correlated and nearly collinear pairs
        a = rand(10, 3, seed)
        for b in (rand(10, 5, seed + 100), a[:, :2] + 0.1 * rand(10, 2, seed + 200), -a):
            # Execute
            value = CKAS[name](a, b).item()

            # Assert
            assert 0.0 <= value <= 1.0


@pytest.mark.parametrize("name", sorted(CKAS))
def test_cka_gradient_is_finite_and_non_zero_for_different_widths(name: str) -> None:
    # Prepare: d1 = 5 != d2 = 13
    a = rand(16, 5, 9, torch.float32).requires_grad_(True)
    b = rand(16, 13, 10, torch.float32)

    # Execute
    value = CKAS[name](a, b)
    value.backward()

    # Assert
    assert value.shape == ()
    assert a.grad is not None
    assert torch.all(torch.isfinite(a.grad))
    assert a.grad.abs().sum().item() > 0


def test_linear_cka_representation_form_equals_kernel_form_when_features_exceed_samples() -> None:
    # Prepare: n^2 = 64 < d1 * d2, which takes the kernel branch internally
    a, b = rand(8, 40, 11), rand(8, 30, 12)

    # Execute / Assert
    for unbiased in (False, True):
        rep = linear_cka(a, b, unbiased=unbiased)
        ker = kernel_cka(a @ a.T, b @ b.T, unbiased=unbiased)
        assert rep.item() == pytest.approx(ker.item(), rel=1e-10, abs=1e-12)


def test_rbf_cka_equals_kernel_cka_of_the_rbf_kernels() -> None:
    # Prepare
    a, b = rand(14, 3, 13), rand(14, 8, 14)

    # Execute / Assert
    assert rbf_cka(a, b).item() == pytest.approx(
        kernel_cka(rbf_kernel(a), rbf_kernel(b)).item(), rel=1e-12
    )
    assert rbf_cka(a, b, sigma=1.5).item() == pytest.approx(
        kernel_cka(rbf_kernel(a, 1.5), rbf_kernel(b, 1.5)).item(), rel=1e-12
    )


def test_unbiased_estimator_removes_the_small_sample_bias() -> None:
    # Prepare: independent random features, few samples, many features
    a, b = rand(30, 200, 15), rand(30, 200, 16)

    # Execute
    biased = linear_cka(a, b).item()
    unbiased = linear_cka(a, b, unbiased=True).item()

    # Assert: the biased estimate is far from the population value 0
    assert biased > 0.5
    assert unbiased < 0.1


# ------------------------------------------------------------------------------ safety
def test_float64_accumulation_for_large_n() -> None:
    # Prepare: float32 inputs with a large offset; centring them in float32 loses digits
    n = 4 * FLOAT64_MIN_ROWS
    a32 = (rand(n, 8, 17) + 1e4).float()
    b32 = (rand(n, 6, 18) + 1e4).float()
    a64, b64 = a32.double(), b32.double()
    ac, bc = a64 - a64.mean(0), b64 - b64.mean(0)
    expected = (
        torch.linalg.matrix_norm(bc.T @ ac) ** 2
        / (torch.linalg.matrix_norm(ac.T @ ac) * torch.linalg.matrix_norm(bc.T @ bc))
    ).item()

    # Execute
    value = linear_cka(a32, b32)

    # Assert
    assert value.dtype == torch.float32
    assert value.item() == pytest.approx(expected, abs=1e-6)


def test_zero_norm_gives_zero_with_finite_gradient() -> None:
    # Prepare: every sample has the same representation
    constant = torch.ones(10, 4, requires_grad=True)
    other = rand(10, 3, 19, torch.float32)

    # Execute
    values = [linear_cka(constant, other), rbf_cka(constant, other)]
    for value in values:
        value.backward()

    # Assert
    assert [v.item() for v in values] == [0.0, 0.0]
    assert constant.grad is not None
    assert torch.all(torch.isfinite(constant.grad))


def test_squared_distances_are_clamped_at_zero() -> None:
    # Prepare: identical large rows, where |x|^2 + |y|^2 - 2 x.y rounds below zero
    a = torch.full((5, 3), 12345.678, dtype=torch.float32) + torch.tensor([0.0, 1e-3, 0.0])

    # Execute
    sq = squared_distances(a)
    value = rbf_cka(a, rand(5, 2, 20, torch.float32))

    # Assert
    assert torch.all(sq >= 0)
    assert torch.isfinite(value)


def test_rbf_bandwidth_is_detached() -> None:
    # Prepare: the same kernel with the median passed as a constant
    a = rand(9, 4, 21).requires_grad_(True)
    b = a.detach().clone().requires_grad_(True)
    sigma = float(median_distance(squared_distances(a)))

    # Execute
    rbf_kernel(a).sum().backward()
    rbf_kernel(b, sigma).sum().backward()

    # Assert
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize(
    ("a", "b", "kwargs", "fragment"),
    [
        (torch.ones(5, 2), torch.ones(6, 2), {}, "5 rows vs 6 rows"),
        (torch.ones(5), torch.ones(5, 2), {}, "2-d matrix"),
        (torch.ones(3, 2), torch.ones(3, 2), {"unbiased": True}, "at least 4 samples"),
        (torch.ones(5, 2, dtype=torch.int64), torch.ones(5, 2), {}, "floating-point"),
    ],
)
def test_bad_inputs_raise_naming_the_problem(
    a: torch.Tensor, b: torch.Tensor, kwargs: dict[str, bool], fragment: str
) -> None:
    # Execute / Assert
    with pytest.raises(CKAInputError, match=fragment):
        linear_cka(a, b, **kwargs)


def test_kernel_cka_rejects_non_square_kernels() -> None:
    # Execute / Assert
    with pytest.raises(CKAInputError, match="square n x n kernels"):
        kernel_cka(torch.ones(4, 3), torch.ones(4, 4))
