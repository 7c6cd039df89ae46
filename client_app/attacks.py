"""The attack harness: hostile clients built from the project's own client lifecycle.

An :class:`AttackClient` wraps any scheme's :class:`~strategies.client.ClientAlgorithm`
(it is a :class:`~strategies.client.ClientWrapper`), so every scheme can be evaluated
against the same attacks, and its replies are built exactly as an honest node's are
(the same records, the same Flower encoding). With ``w0`` the weights the node
started the round from and ``w`` those it trained honestly (learned parameters only;
batch-norm statistics are sent as trained, as a careful attacker would, since a
negative running variance is rejected at validation):

- ``label-flip``: trains on labels ``y -> C - 1 - y`` (its knowledge, for knowledge
  schemes, is computed on the flipped labels too);
- ``backdoor``: FedFA's label shuffling with intensity ``lambda`` (run-config
  ``attack-lambda``): it also trains a copy of ``w0`` on randomly shuffled labels,
  giving ``w_s``, and sends ``w + lambda (w_s - w0)``;
- ``boost``: sends ``w0 + s (w - w0)`` with ``s`` = ``attack-scale``, and scales
  every other floating payload (features, logits, representations) by ``s``;
- ``sign-flip``: sends ``w0 - s (w - w0)`` and negates (and scales) the payloads;
- ``noise``: adds Gaussian noise of standard deviation ``attack-noise`` to the
  weights and payloads;
- ``free-rider``: sends back the weights it received (``w0``) and the payload of the
  untrained model: it takes the federation's model and contributes nothing.

The honest parts of the reply (example counts, metrics) are left as they are: the
validation of claimed sizes is tested separately (``tests/test_untrusted.py``).
Which nodes attack: :mod:`tessera.attacks`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from strategies.client import ClientAlgorithm, ClientWrapper, Record, RoundInput, RoundOutcome
from tessera import wire
from tessera.attacks import attack_assignment
from tessera.config import ATTACKS, ConfigError, NodeConfig, RunConfig
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tessera.training import OptimConfig, cross_entropy_loss, train_model

log = logging.getLogger("flwr.tessera")


@dataclass(frozen=True)
class AttackSpec:
    """One hostile behaviour and its intensity.

    Attributes
    ----------
    kind : str
        One of :data:`tessera.config.ATTACKS`.
    lam : float
        ``attack-lambda`` (backdoor intensity).
    scale : float
        ``attack-scale`` (boost and sign-flip factor).
    noise : float
        ``attack-noise`` (standard deviation of the added noise).
    seed : int
        Seeds the shuffled labels and the noise (with the round).
    """

    kind: str
    lam: float = 1.0
    scale: float = 10.0
    noise: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        """Check the attack name."""
        if self.kind not in ATTACKS:
            raise ConfigError(f"attack '{self.kind}' is unknown; use one of {', '.join(ATTACKS)}")


def attack_for(run: RunConfig, node: NodeConfig) -> AttackSpec | None:
    """Return this node's attack: node-config ``attack``, else the run's seeded draw."""
    kind = node.attack
    if kind is None and node.partition_id is not None and node.num_partitions is not None:
        kind = attack_assignment(run, node.num_partitions).get(node.partition_id)
    if kind is None:
        return None
    seed = run.seed + 104729 * (node.partition_id if node.partition_id is not None else 0)
    return AttackSpec(
        kind, lam=run.attack_lambda, scale=run.attack_scale, noise=run.attack_noise, seed=seed
    )


def flip_labels(y: np.ndarray, num_classes: int) -> np.ndarray:
    """Return the labels mapped ``y -> num_classes - 1 - y``."""
    return np.asarray(num_classes - 1 - y, dtype=y.dtype)


def _floating(state: Mapping[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if torch.is_floating_point(v)]


class AttackClient(ClientWrapper):
    """A hostile client: an honest scheme client whose update or data is tampered with.

    Parameters
    ----------
    inner : ClientAlgorithm
        The scheme's client.
    spec : AttackSpec
        What it does.
    """

    def __init__(self, inner: ClientAlgorithm, spec: AttackSpec) -> None:
        super().__init__(inner)
        self.spec = spec
        self._start: dict[str, torch.Tensor] = {}
        self._train: ArrayDataset | None = None
        self._round = 0

    def prepare_data(
        self, train: ArrayDataset, test: ArrayDataset
    ) -> tuple[ArrayDataset, ArrayDataset]:
        """Copy the training labels (a label-flipper rewrites them once the task is known)."""
        train, test = self.inner.prepare_data(train, test)
        if self.spec.kind == "label-flip":
            train = ArrayDataset(train.x, train.y.copy())
        self._train = train
        return train, test

    def load_weights(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> str:
        """Load as the honest client does and remember the starting weights ``w0``."""
        source = self.inner.load_weights(model, rnd, state)
        self._start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._round = rnd.server_round
        return source

    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Flip the labels (``label-flip``), then let the honest client begin."""
        if self.spec.kind == "label-flip" and self._train is not None:
            self._train.y[:] = flip_labels(self._train.y, rnd.num_classes)
        self.inner.begin_round(model, rnd, state)

    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Tamper with the trained weights, let the honest client build the reply, tamper more."""
        trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        kind = self.spec.kind
        if kind in ("boost", "sign-flip", "free-rider", "noise", "backdoor"):
            model.load_state_dict(self._tampered(model, trained, outcome))
        records = self.inner.finish_round(model, rnd, outcome, state)
        if kind in ("boost", "sign-flip", "noise"):
            records = {
                name: self._tamper_payload(record)
                if isinstance(record, ArrayRecord) and name != wire.ARRAYS
                else record
                for name, record in records.items()
            }
        log.info("round %d: this node attacks (%s)", rnd.server_round, kind)
        return records

    # ---------------------------------------------------------------- internals
    def _generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.spec.seed * 1000 + self._round)

    def _tampered(
        self, model: nn.Module, trained: dict[str, torch.Tensor], outcome: RoundOutcome
    ) -> dict[str, torch.Tensor]:
        kind, start = self.spec.kind, self._start
        out = dict(trained)
        if kind == "backdoor":
            shuffled = self._shuffled_update(model, outcome)
        gen = self._generator()
        # Learned parameters only: batch-norm statistics stay honest (a negative
        # running variance would give the attacker away at validation).
        params = {name for name, _ in model.named_parameters()}
        for key in _floating(trained):
            if kind != "free-rider" and key not in params:
                continue
            w, w0 = trained[key], start[key].to(trained[key].device)
            if kind == "boost":
                out[key] = w0 + self.spec.scale * (w - w0)
            elif kind == "sign-flip":
                out[key] = w0 - self.spec.scale * (w - w0)
            elif kind == "free-rider":
                out[key] = w0.clone()
            elif kind == "noise":
                noise = torch.randn(w.shape, generator=gen, dtype=w.dtype) * self.spec.noise
                out[key] = w + noise.to(w.device)
            elif kind == "backdoor":
                out[key] = w + self.spec.lam * (shuffled[key] - w0)
        return out

    def _shuffled_update(self, model: nn.Module, outcome: RoundOutcome) -> dict[str, torch.Tensor]:
        """Train a copy of ``w0`` on randomly shuffled labels; return its weights."""
        assert self._train is not None
        rng = np.random.default_rng([self.spec.seed, self._round])
        shuffled = ArrayDataset(self._train.x, rng.permutation(self._train.y))
        twin = copy.deepcopy(model)
        twin.load_state_dict(self._start)
        run = self.run
        train_model(
            twin,
            shuffled,
            optim=OptimConfig(
                run.local_epochs, run.batch_size, run.learning_rate, run.momentum, run.weight_decay
            ),
            device=outcome.device,
            seed=self.spec.seed + self._round,
            loss_fn=cross_entropy_loss,
        )
        return {k: v.detach().clone() for k, v in twin.state_dict().items()}

    @np.errstate(over="ignore")
    def _tamper_payload(self, record: ArrayRecord) -> ArrayRecord:
        """Scale, negate or perturb the floating arrays of a payload record."""
        arrays = {k: v.numpy() for k, v in record.items()}
        rng = np.random.default_rng([self.spec.seed, self._round, 1])
        out: dict[str, np.ndarray] = {}
        for key, value in arrays.items():
            if not np.issubdtype(value.dtype, np.floating):
                out[key] = value
            elif self.spec.kind == "boost":
                out[key] = (value * self.spec.scale).astype(value.dtype)
            elif self.spec.kind == "sign-flip":
                out[key] = (value * -self.spec.scale).astype(value.dtype)
            else:
                noise = rng.normal(0.0, self.spec.noise, size=value.shape)
                out[key] = (value + noise).astype(value.dtype)
        return wire.numpy_to_record(out)


def with_attack(algorithm: ClientAlgorithm, run: RunConfig, node: NodeConfig) -> ClientAlgorithm:
    """Wrap ``algorithm`` in this node's attack, if it has one (else return it unchanged)."""
    spec = attack_for(run, node)
    if spec is None:
        return algorithm
    log.warning("this node is hostile: attack '%s' (attack harness)", spec.kind)
    return AttackClient(algorithm, spec)
