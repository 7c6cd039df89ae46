"""The conditional VAE on Velo's server (Sohn et al., 2015; the paper's equation (2)).

Four dense layers, as in the paper: an encoder of two (``[s, onehot(y)] -> hidden ->
(mu, log sigma^2)``) and a decoder of two (``[z, onehot(y)] -> hidden -> s``), with a
ReLU after each hidden layer. The loss is the negative ELBO with one latent sample,
per sample and averaged over the batch: the squared reconstruction error summed over
the feature entries (a unit-variance Gaussian log-likelihood up to constants) plus
``beta * KL(q(z|s,y) || N(0, I))`` summed over the latent entries. Both terms are sums,
so the reconstruction is not drowned by the KL term when ``feature_dim`` is large
(averaging it over entries instead makes the encoder ignore its input).

Features are standardised per dimension with the training set's mean and standard
deviation (kept as buffers) before encoding, and generated features are mapped back;
client features are ReLU outputs of arbitrary scale, which would otherwise dominate
the reconstruction term.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import Tensor, nn

from tessera.training import torch_threads


@dataclass(frozen=True)
class CVAEConfig:
    """Sizes and training settings of the CVAE.

    Attributes
    ----------
    feature_dim : int
        Size of the features it models.
    num_classes : int
        Number of classes it is conditioned on.
    latent_dim : int
        Size of the latent code (run-config ``cvae-latent-dim``).
    hidden_dim : int
        Width of the hidden layer of the encoder and of the decoder.
    epochs : int
        Passes over the feature dataset per training (``cvae-epochs``).
    learning_rate : float
        Adam learning rate.
    batch_size : int
        Minibatch size.
    beta : float
        Weight of the KL term.
    """

    feature_dim: int
    num_classes: int
    latent_dim: int = 16
    hidden_dim: int = 128
    epochs: int = 100
    learning_rate: float = 1e-3
    batch_size: int = 128
    beta: float = 1.0

    def __post_init__(self) -> None:
        """Validate sizes once, at construction."""
        for name in ("feature_dim", "latent_dim", "hidden_dim", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"CVAEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_classes < 2:
            raise ValueError(f"CVAEConfig.num_classes must be >= 2, got {self.num_classes}")
        if not self.learning_rate > 0 or self.beta < 0:
            raise ValueError(
                f"CVAEConfig learning_rate={self.learning_rate} must be > 0 and "
                f"beta={self.beta} >= 0"
            )


@dataclass(frozen=True)
class CVAETrainResult:
    """What one training of the CVAE did.

    Attributes
    ----------
    loss_history : list[float]
        Mean total loss (reconstruction + beta * KL) per epoch.
    reconstruction_history : list[float]
        Mean reconstruction loss per epoch (squared error summed over the
        standardised feature entries).
    seconds : float
        Wall-clock training time.
    num_samples : int
        Rows of the feature dataset.
    """

    loss_history: list[float]
    reconstruction_history: list[float]
    seconds: float
    num_samples: int

    @property
    def final_loss(self) -> float:
        """Mean loss of the last epoch."""
        return self.loss_history[-1]


class CVAE(nn.Module):
    """Conditional VAE over per-class feature vectors.

    Parameters
    ----------
    config : CVAEConfig
        Sizes (see :class:`CVAEConfig`).
    """

    shift: Tensor
    scale: Tensor

    def __init__(self, config: CVAEConfig) -> None:
        super().__init__()
        self.config = config
        d, c, h, z = config.feature_dim, config.num_classes, config.hidden_dim, config.latent_dim
        self.encoder = nn.Sequential(nn.Linear(d + c, h), nn.ReLU(), nn.Linear(h, 2 * z))
        self.decoder = nn.Sequential(nn.Linear(z + c, h), nn.ReLU(), nn.Linear(h, d))
        self.register_buffer("shift", torch.zeros(d))
        self.register_buffer("scale", torch.ones(d))

    def _onehot(self, labels: Tensor) -> Tensor:
        return F.one_hot(labels.long(), self.config.num_classes).to(self.shift.dtype)

    def fit_scaling(self, features: Tensor) -> None:
        """Set the per-dimension standardisation from a feature dataset."""
        self.shift.copy_(features.mean(dim=0))
        std = features.std(dim=0, unbiased=False) if features.shape[0] > 1 else None
        self.scale.copy_(torch.ones_like(self.scale) if std is None else std.clamp_min(1e-3))

    def encode(self, features: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``(mu, logvar)`` of ``q(z | s, y)`` for raw features ``s``."""
        s = (features - self.shift) / self.scale
        mu, logvar = self.encoder(torch.cat([s, self._onehot(labels)], dim=1)).chunk(2, dim=1)
        return mu, logvar.clamp(-10.0, 10.0)

    def decode(self, latent: Tensor, labels: Tensor) -> Tensor:
        """Return standardised features decoded from ``latent`` for ``labels``."""
        out: Tensor = self.decoder(torch.cat([latent, self._onehot(labels)], dim=1))
        return out

    def loss(self, features: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``(total, reconstruction)`` losses of a batch (one latent sample)."""
        mu, logvar = self.encode(features, labels)
        latent = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        target = (features - self.shift) / self.scale
        recon = torch.mean(torch.sum((self.decode(latent, labels) - target) ** 2, dim=1))
        kl = -0.5 * torch.mean(torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1))
        return recon + self.config.beta * kl, recon

    @torch.no_grad()
    def generate(
        self, class_ids: Tensor | np.ndarray, n: int, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """Decode ``n`` samples ``z ~ N(0, I)`` for each requested class.

        Parameters
        ----------
        class_ids : Tensor | np.ndarray
            ``(K,)`` class ids in ``[0, num_classes)``.
        n : int
            Samples per class, at least 1.
        generator : torch.Generator, optional
            Source of the latent samples (reproducible generation).

        Returns
        -------
        Tensor
            ``(K, n, feature_dim)`` features in the original (unstandardised) scale.

        Raises
        ------
        ValueError
            If ``n`` < 1 or a class id is out of range.
        """
        ids = torch.as_tensor(np.asarray(class_ids), dtype=torch.long).reshape(-1)
        if n < 1:
            raise ValueError(f"generate needs n >= 1 samples per class, got {n}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.num_classes):
            raise ValueError(
                f"class ids {ids.tolist()} out of range [0, {self.config.num_classes})"
            )
        self.eval()
        labels = ids.repeat_interleave(n)
        latent = torch.randn(
            (labels.numel(), self.config.latent_dim), generator=generator, dtype=self.shift.dtype
        )
        out = self.decode(latent, labels) * self.scale + self.shift
        return out.reshape(ids.numel(), n, self.config.feature_dim)


def train_cvae(
    model: CVAE, features: np.ndarray, labels: np.ndarray, *, seed: int
) -> CVAETrainResult:
    """Train ``model`` with Adam on a feature dataset (its standardisation refitted first).

    Runs on one torch thread (restored afterwards): the dataset is a few thousand
    short rows at most, and on a shared CPU more threads only spin-wait for each other.

    Parameters
    ----------
    model : CVAE
        The CVAE; trained in place.
    features : np.ndarray
        ``(N, feature_dim)`` features.
    labels : np.ndarray
        ``(N,)`` class ids.
    seed : int
        Seeds the shuffling and the latent samples.

    Returns
    -------
    CVAETrainResult
        Loss histories, seconds and dataset size.

    Raises
    ------
    ValueError
        If the dataset is empty or its shapes disagree with the model.
    """
    cfg = model.config
    if features.ndim != 2 or features.shape[1] != cfg.feature_dim or features.shape[0] == 0:
        raise ValueError(
            f"features must be a non-empty (N, {cfg.feature_dim}) array, got {features.shape}"
        )
    if labels.shape != (features.shape[0],):
        raise ValueError(f"labels {labels.shape} do not match features {features.shape}")
    start = time.perf_counter()
    with torch_threads(1):
        losses, recons = _fit(model, features, labels, seed=seed)
    model.eval()
    return CVAETrainResult(losses, recons, time.perf_counter() - start, features.shape[0])


def _fit(
    model: CVAE, features: np.ndarray, labels: np.ndarray, *, seed: int
) -> tuple[list[float], list[float]]:
    cfg = model.config
    torch.manual_seed(seed)
    x = torch.from_numpy(np.asarray(features, dtype=np.float32))
    y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    model.fit_scaling(x)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg.learning_rate)
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    recons: list[float] = []
    n = x.shape[0]
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=gen)
        total = recon_total = 0.0
        for begin in range(0, n, cfg.batch_size):
            idx = order[begin : begin + cfg.batch_size]
            opt.zero_grad(set_to_none=True)
            loss, recon = model.loss(x[idx], y[idx])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            total += float(loss.item()) * len(idx)
            recon_total += float(recon.item()) * len(idx)
        losses.append(total / n)
        recons.append(recon_total / n)
    return losses, recons
