"""The client-side attacks: a wrapper around an honest scheme client.

:class:`AttackClient` tampers with the trained weights (:data:`WEIGHT_ATTACKS`), the
other floating payloads (:data:`PAYLOAD_ATTACKS`), the training labels
(``label-flip``) or the claimed sizes (``inflate``); :func:`with_attack` wraps a
node's client in its attack, if it has one. What each attack sends:
:mod:`client_app.attacks`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord
from flwr.common.typing import MetricRecordValues
from torch import nn

from client_app.attacks.spec import AttackSpec, attack_for
from client_app.attacks.vectors import flatten, unflatten
from strategies.core.client import ClientAlgorithm, ClientWrapper, Record, RoundInput, RoundOutcome
from tessera import attack_math, wire
from tessera.config import OMNISCIENT_ATTACKS, NodeConfig, RunConfig
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tessera.training import OptimConfig, cross_entropy_loss, train_model

log = logging.getLogger("flwr.tessera")

WEIGHT_ATTACKS = (
    "boost",
    "inflate-boost",
    "sign-flip",
    "free-rider",
    "noise",
    "backdoor",
    "dense-scale",
    "bound-riding",
    "ratchet",
)
"""Attacks the client itself applies to its trained weights."""
PAYLOAD_ATTACKS = (
    "boost",
    "inflate-boost",
    "sign-flip",
    "noise",
    "dense-scale",
    "bound-riding",
    "ratchet",
)
"""Attacks the client itself applies to its other floating payloads."""
INFLATING = ("inflate", "inflate-boost")
"""Attacks that lie about the node's size (handshake and claimed examples)."""
BOOSTING = ("boost", "inflate-boost")
"""Attacks that scale the update (and payloads) up by ``attack-scale``."""


def flip_labels(y: np.ndarray, num_classes: int) -> np.ndarray:
    """Return the labels mapped ``y -> num_classes - 1 - y``."""
    return np.asarray(num_classes - 1 - y, dtype=y.dtype)


def _floating(state: Mapping[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if torch.is_floating_point(v)]


class AttackClient(ClientWrapper[Any]):
    """A hostile client: an honest scheme client whose update or data is tampered with.

    Parameters
    ----------
    inner : ClientAlgorithm
        The scheme's client.
    spec : AttackSpec
        What it does.
    """

    def __init__(self, inner: ClientAlgorithm[Any], spec: AttackSpec) -> None:
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

    def handshake_profile(self, profile: Mapping[str, Any]) -> dict[str, Any]:
        """Report the honest profile, or (``inflate``) sizes multiplied by the factor."""
        out = self.inner.handshake_profile(profile)
        if self.spec.kind in INFLATING:
            k = self.spec.inflate
            out["num-train"] = int(out["num-train"]) * k
            out["label-counts"] = [int(c) * k for c in out["label-counts"]]
            log.warning("handshake: this node claims %d training samples (inflate)", k)
        return out

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
        if kind in WEIGHT_ATTACKS:
            model.load_state_dict(self._tampered(model, trained, outcome))
        records = self.inner.finish_round(model, rnd, outcome, state)
        if kind in PAYLOAD_ATTACKS:
            records = {
                name: self._tamper_payload(record)
                if isinstance(record, ArrayRecord) and name != wire.ARRAYS
                else record
                for name, record in records.items()
            }
        sent = records.get(wire.METRICS)
        if kind in INFLATING and isinstance(sent, MetricRecord):
            claimed = len(outcome.train) * self.spec.inflate * self.run.training.local_epochs
            metrics: dict[str, MetricRecordValues] = dict(sent)
            metrics[wire.NUM_EXAMPLES] = claimed
            records[wire.METRICS] = MetricRecord(metrics)
        if kind in OMNISCIENT_ATTACKS:
            log.info(
                "round %d: this node attacks (%s): it replies honestly and the in-process "
                "grid forges its reply from the honest ones",
                rnd.server_round,
                kind,
            )
        else:
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
        # Learned parameters only: batch-norm statistics stay honest (a negative
        # running variance would give the attacker away at validation).
        params = {name for name, _ in model.named_parameters()}
        keys = [k for k in _floating(trained) if kind == "free-rider" or k in params]
        if kind in ("dense-scale", "bound-riding", "ratchet"):
            return {**out, **self._vector_attack(trained, keys)}
        gen = self._generator()
        for key in keys:
            w, w0 = trained[key], start[key].to(trained[key].device)
            if kind in BOOSTING:
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

    def _vector_attack(
        self, trained: Mapping[str, torch.Tensor], keys: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """Dense-scale, bound-riding or ratchet on the flat update of ``keys``."""
        w = {k: trained[k].detach().cpu().numpy() for k in keys}
        w0 = {k: self._start[k].detach().cpu().numpy() for k in keys}
        start = flatten(w0, keys)
        forged = start + self._forge_vector(flatten(w, keys) - start, offset=start)
        arrays = unflatten(forged, w, keys)
        return {k: torch.from_numpy(v).to(trained[k].device) for k, v in arrays.items()}

    def _forge_vector(self, update: np.ndarray, *, offset: np.ndarray | None = None) -> np.ndarray:
        """Return the forged update of a client-side vector attack (reference 0 if no offset)."""
        kind = self.spec.kind
        if kind == "dense-scale":
            rng = np.random.default_rng([self.spec.seed, self._round, 2])
            return self.spec.magnitude * attack_math.dense_signs(update.size, rng)
        if kind == "bound-riding":
            bound = self.spec.riding_factor * float(np.linalg.norm(update))
            return attack_math.bound_riding(update, bound)
        if kind == "ratchet":
            return attack_math.ratchet_factor(self._round) * update
        raise ValueError(f"'{kind}' is not a client-side vector attack")

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
                run.training.local_epochs,
                run.training.batch_size,
                run.training.learning_rate,
                run.training.momentum,
                run.training.weight_decay,
            ),
            device=outcome.device,
            seed=self.spec.seed + self._round,
            loss_fn=cross_entropy_loss,
        )
        return {k: v.detach().clone() for k, v in twin.state_dict().items()}

    @np.errstate(over="ignore")
    def _tamper_payload(self, record: ArrayRecord) -> ArrayRecord:
        """Scale, negate, perturb or forge the floating arrays of a payload record."""
        arrays = {k: v.numpy() for k, v in record.items()}
        keys = [k for k, v in arrays.items() if np.issubdtype(v.dtype, np.floating)]
        if self.spec.kind in ("dense-scale", "bound-riding", "ratchet"):
            forged = unflatten(self._forge_vector(flatten(arrays, keys)), arrays, keys)
            return wire.numpy_to_record({**arrays, **forged})
        rng = np.random.default_rng([self.spec.seed, self._round, 1])
        out: dict[str, np.ndarray] = {}
        for key, value in arrays.items():
            if key not in keys:
                out[key] = value
            elif self.spec.kind in BOOSTING:
                out[key] = (value * self.spec.scale).astype(value.dtype)
            elif self.spec.kind == "sign-flip":
                out[key] = (value * -self.spec.scale).astype(value.dtype)
            else:
                noise = rng.normal(0.0, self.spec.noise, size=value.shape)
                out[key] = (value + noise).astype(value.dtype)
        return wire.numpy_to_record(out)


def with_attack(
    algorithm: ClientAlgorithm[Any], run: RunConfig, node: NodeConfig
) -> ClientAlgorithm[Any]:
    """Wrap ``algorithm`` in this node's attack, if it has one (else return it unchanged)."""
    spec = attack_for(run, node)
    if spec is None:
        return algorithm
    log.warning("this node is hostile: attack '%s' (attack harness)", spec.kind)
    return AttackClient(algorithm, spec)
