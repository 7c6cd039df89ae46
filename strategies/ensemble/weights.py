"""The weighted ensemble's maths (Thonglek et al.), numpy only.

``N`` group models each give class probabilities ``P[i, s, j]`` for sample ``s``
and class ``j``. The ensemble scores class ``j`` as ``sum_i alpha[i, j] P[i, s, j]``
with one weight per model and class (an ``N x C`` matrix) and predicts the class of
the highest score. Uniform weights ``1/N`` give the plain average of the models'
probabilities; scaling every weight by one constant changes no prediction.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "check_probabilities",
    "combine",
    "ensemble_accuracy",
    "ensemble_log_loss",
    "output_problem",
    "softmax_weights",
    "uniform_weights",
]


def check_probabilities(probs: np.ndarray, labels: np.ndarray | None = None) -> np.ndarray:
    """Return ``probs`` as float64 after checking it is ``(N models, S samples, C classes)``.

    Raises
    ------
    ValueError
        If the array is not 3-D with at least one model, sample and class, holds
        non-finite values, or ``labels`` is not ``S`` integers in ``[0, C)``.
    """
    array = np.asarray(probs, dtype=np.float64)
    if array.ndim != 3 or min(array.shape) < 1:
        raise ValueError(
            f"model probabilities must be an (models, samples, classes) array, got shape "
            f"{array.shape}"
        )
    if not np.isfinite(array).all():
        raise ValueError("model probabilities hold NaN or infinite values")
    if labels is not None:
        y = np.asarray(labels)
        if y.shape != (array.shape[1],) or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(
                f"labels must be {array.shape[1]} integers (one per sample), got shape "
                f"{y.shape} of {y.dtype}"
            )
        if y.size and (y.min() < 0 or y.max() >= array.shape[2]):
            raise ValueError(
                f"labels must lie in [0, {array.shape[2]}), got {int(y.min())}..{int(y.max())}"
            )
    return array


def output_problem(probs: np.ndarray, split: str) -> str | None:
    """Return why one model's ``(S, C)`` outputs on ``split`` cannot be tuned, or None.

    A model whose logits overflow (weights of 1e18 do it) gives NaN or infinite
    probabilities; the ensemble leaves such a model out rather than fail.

    Examples
    --------
    >>> output_problem(np.array([[0.5, 0.5], [np.nan, np.nan]]), "validation")
    'its outputs on the validation data are not finite (1 of 2 samples): its logits overflow'
    >>> output_problem(np.array([[0.5, 0.5]]), "validation") is None
    True
    """
    array = np.asarray(probs, dtype=np.float64)
    if array.ndim != 2:
        return f"its outputs on the {split} data have shape {array.shape}, not (samples, classes)"
    bad = int((~np.isfinite(array)).any(axis=1).sum())
    if bad:
        return (
            f"its outputs on the {split} data are not finite ({bad} of {array.shape[0]} "
            "samples): its logits overflow"
        )
    return None


def uniform_weights(num_models: int, num_classes: int) -> np.ndarray:
    """Return the ``num_models x num_classes`` matrix of ``1 / num_models``."""
    if num_models < 1 or num_classes < 1:
        raise ValueError(
            f"an ensemble needs at least one model and one class, got {num_models} x {num_classes}"
        )
    return np.full((num_models, num_classes), 1.0 / num_models)


def combine(probs: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Return the ensemble's class scores ``S[s, j] = sum_i alpha[i, j] P[i, s, j]``.

    Parameters
    ----------
    probs : np.ndarray
        ``(N, S, C)`` class probabilities of each model.
    alpha : np.ndarray
        ``(N, C)`` weights.

    Returns
    -------
    np.ndarray
        ``(S, C)`` scores.

    Examples
    --------
    >>> p = np.array([[[0.9, 0.1]], [[0.2, 0.8]]])
    >>> combine(p, np.array([[1.0, 0.0], [0.0, 1.0]])).tolist()
    [[0.9, 0.8]]
    """
    array = check_probabilities(probs)
    weights = np.asarray(alpha, dtype=np.float64)
    if weights.shape != (array.shape[0], array.shape[2]):
        raise ValueError(
            f"alpha must be (models, classes) = {(array.shape[0], array.shape[2])}, got "
            f"{weights.shape}"
        )
    scores: np.ndarray = np.einsum("nsc,nc->sc", array, weights)
    return scores


def ensemble_accuracy(probs: np.ndarray, labels: np.ndarray, alpha: np.ndarray) -> float:
    """Return the share of samples whose highest ensemble score is their label."""
    y = np.asarray(labels)
    check_probabilities(probs, y)
    return float(np.mean(combine(probs, alpha).argmax(axis=1) == y)) if y.size else 0.0


def ensemble_log_loss(
    probs: np.ndarray, labels: np.ndarray, alpha: np.ndarray, *, eps: float = 1e-12
) -> float:
    """Return the mean negative log of the label's share of the ensemble's scores.

    Scores are normalised per sample (``S[s] / sum_j S[s, j]``) to a distribution
    first; ``eps`` keeps a zero score finite.
    """
    y = np.asarray(labels)
    check_probabilities(probs, y)
    scores = combine(probs, alpha)
    total = scores.sum(axis=1)
    share = scores[np.arange(len(y)), y] / np.maximum(total, eps)
    return float(-np.mean(np.log(np.maximum(share, eps))))


def softmax_weights(theta: np.ndarray) -> np.ndarray:
    """Return ``alpha`` with ``alpha[:, j] = softmax(theta[:, j])`` over the models.

    The gradient fit's parametrisation: every class's weights are positive and sum
    to one, and ``theta = 0`` is the uniform ensemble.

    Examples
    --------
    >>> softmax_weights(np.zeros((2, 3))).tolist()
    [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]
    """
    t = np.asarray(theta, dtype=np.float64)
    e = np.exp(t - t.max(axis=0, keepdims=True))
    out: np.ndarray = e / e.sum(axis=0, keepdims=True)
    return out
