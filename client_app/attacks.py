"""The attack harness: hostile clients built from the project's own client lifecycle.

An :class:`AttackClient` wraps any scheme's :class:`~strategies.core.client.ClientAlgorithm`
(it is a :class:`~strategies.core.client.ClientWrapper`), so every scheme can be evaluated
against the same attacks, and its replies are built exactly as an honest node's are
(the same records, the same Flower encoding). With ``w0`` the weights the node
started the round from, ``w`` those it trained honestly and ``u = w - w0`` its
update (learned parameters only; batch-norm statistics are sent as trained, as a
careful attacker would, since a negative running variance is rejected at
validation):

- ``label-flip``: trains on labels ``y -> C - 1 - y`` (its knowledge, for knowledge
  schemes, is computed on the flipped labels too);
- ``backdoor``: FedFA's label shuffling with intensity ``lambda`` (run-config
  ``attack-lambda``): it also trains a copy of ``w0`` on randomly shuffled labels,
  giving ``w_s``, and sends ``w + lambda (w_s - w0)``;
- ``boost``: sends ``w0 + s u`` with ``s`` = ``attack-scale``, and scales every
  other floating payload (features, logits, representations) by ``s``;
- ``sign-flip``: sends ``w0 - s u`` and negates (and scales) the payloads;
- ``noise``: adds Gaussian noise of standard deviation ``attack-noise`` to the
  weights and payloads;
- ``free-rider``: sends back the weights it received (``w0``) and the payload of the
  untrained model: it takes the federation's model and contributes nothing;
- ``dense-scale``: every learned coordinate ``w0 +- M`` (``attack-magnitude``, random
  signs seeded per node and round), and every floating payload value ``+-M``;
- ``bound-riding``: ``w0 - 0.99 B u / |u|`` with ``B`` = ``clip-factor`` x ``|u|``
  (its own distance stands in for the cohort's median; ``attack-scale`` when
  ``clip-factor`` is 0), payloads likewise; in the in-process grid it is omniscient
  (below);
- ``ratchet``: ``w0 + r u`` with ``r = 1e3`` in odd rounds and ``1e-9`` in even
  ones (payloads likewise), to move a cohort-relative bound up and down;
- ``inflate``: a self-consistent lie about its size: the handshake's ``num-train``
  and every label count multiplied by ``attack-inflate`` (so they still sum to
  ``num-train``), and its replies' ``num-examples`` equal to that ``num-train`` x
  ``local-epochs``; it trains honestly.

**Omniscient attacks** (``alie``, ``ipm``, ``min-max``, ``min-sum``, ``mimic``, and
``bound-riding`` in the in-process grid) forge their update from the honest updates
of the round, as in their papers (the maths: :mod:`tessera.attack_math`). Only the
in-process grid (:class:`tessera.local_grid.LocalGrid`) can show a node those:
:func:`install_omniscient` gives it an :class:`OmniscientAttack` hook per hostile
node, which the grid calls with the node's own honest reply and the other replies
of the batch. The hook turns each reply into a flat float64 update (learned
parameters of the ``arrays`` record, by :func:`strategies.core.aggregators.entry_kind`,
minus the same entries of the weights the node was sent, or minus zero where the
server sent none), counts as honest the nodes the run's draw does not make hostile
whose entries have the same names and shapes as the attacker's (its architecture or
slice), forges the update and builds the reply as the handler builds it (same
records and metrics, ``Message(content, reply_to=instruction)``). Every other
floating payload record (Felo's per-class features and logits, FedHeNN's
representations) is forged with the same maths over the honest nodes' record of
the same name when its floating arrays have the same shapes and its ``class-ids``
(if any) are equal, with zero as reference; otherwise the payload is left as the
node computed it, as the harness leaves it for the attacks that change weights
only. A real simulation or deployment cannot run the omniscient-only attacks: the
ServerApp refuses them (:func:`tessera.attacks.require_client_side`), and their
:class:`AttackClient` alone sends honest replies.

The honest parts of the reply (example counts, metrics) are left as they are but
for ``inflate``: the validation of claimed sizes is tested separately
(``tests/test_untrusted.py``). Which nodes attack: :mod:`tessera.attacks`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from torch import nn

from strategies.core.client import ClientAlgorithm, ClientWrapper, Record, RoundInput, RoundOutcome
from tessera import attack_math, wire
from tessera.attacks import attack_assignment
from tessera.config import ATTACKS, OMNISCIENT_ATTACKS, ConfigError, NodeConfig, RunConfig
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tessera.training import OptimConfig, cross_entropy_loss, train_model

if TYPE_CHECKING:
    from tessera.local_grid import BatchView, Exchange, LocalGrid

log = logging.getLogger("flwr.tessera")

WEIGHT_ATTACKS = (
    "boost",
    "sign-flip",
    "free-rider",
    "noise",
    "backdoor",
    "dense-scale",
    "bound-riding",
    "ratchet",
)
"""Attacks the client itself applies to its trained weights."""
PAYLOAD_ATTACKS = ("boost", "sign-flip", "noise", "dense-scale", "bound-riding", "ratchet")
"""Attacks the client itself applies to its other floating payloads."""
FORGED_IN_GRID = (*OMNISCIENT_ATTACKS, "bound-riding")
"""Attacks :func:`install_omniscient` forges in the in-process grid."""
ROW_KEYS = ("class-ids",)
"""Payload arrays that say what each row means (Felo's class ids): two nodes' payloads
are forged together only where these are equal."""


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
        ``attack-scale`` (boost and sign-flip factor; bound-riding's factor when
        ``clip_factor`` is 0).
    noise : float
        ``attack-noise`` (standard deviation of the added noise).
    seed : int
        Seeds the shuffled labels, the noise and dense-scale's signs (with the round).
    z : float
        ``attack-z``: ALIE's ``z``; 0 takes it from the paper's formula.
    epsilon : float
        ``attack-epsilon``: IPM's factor.
    perturbation : str
        ``attack-perturbation``: min-max/min-sum's direction (``std``, ``sign``, ``unit``).
    magnitude : float
        ``attack-magnitude``: dense-scale's ``M``.
    inflate : int
        ``attack-inflate``: inflate's factor on the claimed sizes.
    clip_factor : float
        Run-config ``clip-factor``: bound-riding's estimate of the server's bound.
    """

    kind: str
    lam: float = 1.0
    scale: float = 10.0
    noise: float = 1.0
    seed: int = 0
    z: float = 0.0
    epsilon: float = 0.5
    perturbation: str = "std"
    magnitude: float = 1e30
    inflate: int = 1000
    clip_factor: float = 3.0

    def __post_init__(self) -> None:
        """Check the attack name and the perturbation."""
        if self.kind not in ATTACKS:
            raise ConfigError(f"attack '{self.kind}' is unknown; use one of {', '.join(ATTACKS)}")
        if self.perturbation not in attack_math.PERTURBATIONS:
            raise ConfigError(
                f"attack perturbation '{self.perturbation}' is unknown; use one of "
                f"{', '.join(attack_math.PERTURBATIONS)}"
            )

    @property
    def riding_factor(self) -> float:
        """Bound-riding's multiple of a distance taken as the bound (``clip-factor``)."""
        return self.clip_factor if self.clip_factor > 0 else self.scale


def attack_for(run: RunConfig, node: NodeConfig) -> AttackSpec | None:
    """Return this node's attack: node-config ``attack``, else the run's seeded draw."""
    kind = node.attack
    if kind is None and node.partition_id is not None and node.num_partitions is not None:
        kind = attack_assignment(run, node.num_partitions).get(node.partition_id)
    if kind is None:
        return None
    seed = run.seed + 104729 * (node.partition_id if node.partition_id is not None else 0)
    return AttackSpec(
        kind,
        lam=run.attack.lam,
        scale=run.attack.scale,
        noise=run.attack.noise,
        seed=seed,
        z=run.attack.z,
        epsilon=run.attack.epsilon,
        perturbation=run.attack.perturbation,
        magnitude=run.attack.magnitude,
        inflate=run.attack.inflate,
        clip_factor=run.aggregation.clip_factor,
    )


def flip_labels(y: np.ndarray, num_classes: int) -> np.ndarray:
    """Return the labels mapped ``y -> num_classes - 1 - y``."""
    return np.asarray(num_classes - 1 - y, dtype=y.dtype)


def _floating(state: Mapping[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if torch.is_floating_point(v)]


def flatten(arrays: Mapping[str, np.ndarray], keys: Sequence[str]) -> np.ndarray:
    """Concatenate ``arrays[k]`` for ``k`` in ``keys`` into one float64 vector."""
    if not keys:
        return np.zeros(0)
    return np.concatenate([np.asarray(arrays[k], np.float64).ravel() for k in keys])


def unflatten(
    vector: np.ndarray, like: Mapping[str, np.ndarray], keys: Sequence[str]
) -> dict[str, np.ndarray]:
    """Split ``vector`` into arrays shaped and typed as ``like[k]`` for ``k`` in ``keys``.

    Raises
    ------
    ValueError
        If the vector's length is not the total size of those arrays.
    """
    total = sum(int(np.asarray(like[k]).size) for k in keys)
    if vector.shape != (total,):
        raise ValueError(
            f"a vector of shape {vector.shape} cannot fill arrays of {total} values; "
            "flatten and unflatten with the same keys"
        )
    out: dict[str, np.ndarray] = {}
    offset = 0
    for key in keys:
        ref = np.asarray(like[key])
        part = vector[offset : offset + ref.size].reshape(ref.shape)
        with np.errstate(over="ignore"):
            out[key] = part.astype(ref.dtype)
        offset += ref.size
    return out


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

    def handshake_profile(self, profile: Mapping[str, Any]) -> dict[str, Any]:
        """Report the honest profile, or (``inflate``) sizes multiplied by the factor."""
        out = self.inner.handshake_profile(profile)
        if self.spec.kind == "inflate":
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
        if kind == "inflate" and isinstance(records.get(wire.METRICS), MetricRecord):
            claimed = len(outcome.train) * self.spec.inflate * self.run.training.local_epochs
            metrics = dict(records[wire.METRICS])
            metrics[wire.NUM_EXAMPLES] = claimed
            records[wire.METRICS] = MetricRecord(metrics)  # type: ignore[arg-type]
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


# ------------------------------------------------------------ omniscient attacks
def _arrays(message: Message, name: str) -> dict[str, np.ndarray] | None:
    records = message.content.array_records
    if name not in records:
        return None
    return wire.record_to_numpy(records[name])


def _shape_of(arrays: Mapping[str, np.ndarray], keys: Sequence[str]) -> list[tuple[Any, ...]]:
    return [(k, np.asarray(arrays[k]).shape) for k in keys]


def weight_keys(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Return the floating entries of a weights record that are learned parameters."""
    from strategies.core.aggregators import entry_kind

    return [
        k
        for k, v in arrays.items()
        if np.issubdtype(np.asarray(v).dtype, np.floating) and entry_kind(k) == "parameters"
    ]


def weight_start(exchange: Exchange, keys: Sequence[str]) -> np.ndarray:
    """Return the flat ``w0`` a node's update over ``keys`` is measured from.

    Each entry is the same entry of the weights the server sent the node, or zero
    where it sent none of that name and shape (the node's ``arrays`` record has them).
    """
    sent = _arrays(exchange.instruction, wire.ARRAYS) or {}
    replied = _arrays(exchange.reply, wire.ARRAYS) or {}
    start = {
        k: sent[k]
        if k in sent and np.asarray(sent[k]).shape == np.asarray(replied[k]).shape
        else np.zeros(np.asarray(replied[k]).shape)
        for k in keys
    }
    return flatten(start, keys)


def weight_update(exchange: Exchange, keys: Sequence[str]) -> np.ndarray:
    """Return a node's flat update ``w - w0`` over ``keys`` of its ``arrays`` record."""
    replied = _arrays(exchange.reply, wire.ARRAYS) or {}
    return np.asarray(flatten(replied, keys) - weight_start(exchange, keys))


def _payload_peers(
    own: Mapping[str, np.ndarray], keys: Sequence[str], name: str, honest: Sequence[Exchange]
) -> list[dict[str, np.ndarray]]:
    """Return the honest nodes' payload ``name`` where it matches ``own``'s arrays and rows."""
    peers = []
    for exchange in honest:
        theirs = _arrays(exchange.reply, name)
        if theirs is None or any(k not in theirs for k in keys):
            continue
        if _shape_of(theirs, keys) != _shape_of(own, keys):
            continue
        rows = [k for k in ROW_KEYS if k in own]
        if all(k in theirs and np.array_equal(theirs[k], own[k]) for k in rows):
            peers.append(theirs)
    return peers


@dataclass(frozen=True)
class OmniscientAttack:
    """An omniscient attacker in the in-process grid (a :data:`~tessera.local_grid.OmniscientHook`).

    Parameters
    ----------
    spec : AttackSpec
        What it does (one of :data:`FORGED_IN_GRID`).
    hostile : frozenset[int]
        Every hostile node of the run (their replies never count as honest).
    """

    spec: AttackSpec
    hostile: frozenset[int]

    def __call__(self, view: BatchView) -> Message | None:
        """Forge this node's train reply from the honest replies of the batch.

        Returns
        -------
        Message or None
            The forged reply, built as the handler builds it; ``None`` (keep the
            node's own reply) when no honest node trained the same entries.
        """
        honest = [e for e in view.others if e.node not in self.hostile]
        n, f = view.cohort, view.cohort - len(honest)
        own = view.own
        content = dict(own.reply.content.items())
        forged_any = False
        weights = _arrays(own.reply, wire.ARRAYS)
        if weights is not None:
            keys = weight_keys(weights)
            peers = [
                e
                for e in honest
                if (theirs := _arrays(e.reply, wire.ARRAYS)) is not None
                and all(k in theirs for k in keys)
                and _shape_of(theirs, keys) == _shape_of(weights, keys)
            ]
            if keys and peers:
                stack = np.stack([weight_update(e, keys) for e in peers])
                forged = weight_start(own, keys) + self.forge(stack, n, f)
                arrays = {**weights, **unflatten(forged, weights, keys)}
                content[wire.ARRAYS] = wire.numpy_to_record(arrays)
                forged_any = True
        for name, record in own.reply.content.array_records.items():
            if name == wire.ARRAYS:
                continue
            payload = wire.record_to_numpy(record)
            keys = [k for k, v in payload.items() if np.issubdtype(v.dtype, np.floating)]
            payloads = _payload_peers(payload, keys, name, honest)
            if keys and payloads:
                stack = np.stack([flatten(p, keys) for p in payloads])
                forged = unflatten(self.forge(stack, n, f), payload, keys)
                content[name] = wire.numpy_to_record({**payload, **forged})
                forged_any = True
        if not forged_any:
            log.warning(
                "node %d (%s): its reply carries no floating entries that an honest node "
                "of this batch also sent (same names and shapes); its own reply is sent",
                own.node,
                self.spec.kind,
            )
            return None
        log.info(
            "node %d forges its reply (%s, omniscient) from %d honest replies of %d",
            own.node,
            self.spec.kind,
            len(honest),
            n,
        )
        return Message(RecordDict(cast("dict[str, Any]", content)), reply_to=own.instruction)

    def forge(self, honest: np.ndarray, num_nodes: int, num_attackers: int) -> np.ndarray:
        """Return the forged update from the ``(n_honest, d)`` honest updates.

        Parameters
        ----------
        honest : np.ndarray
            One honest update per row.
        num_nodes : int
            Nodes that replied in the batch (ALIE's ``n``).
        num_attackers : int
            Hostile nodes among them (ALIE's ``f``).

        Returns
        -------
        np.ndarray
            The forged update, of length ``d``.

        Raises
        ------
        ConfigError
            If ALIE's ``z`` cannot come from the formula (a hostile majority): set
            run-config ``attack-z``.
        """
        spec = self.spec
        kind = spec.kind
        if kind == "alie":
            z = spec.z
            if z == 0:
                try:
                    z = attack_math.alie_z(num_nodes, num_attackers)
                except ValueError as err:
                    raise ConfigError(str(err)) from None
            return attack_math.alie(honest, z)
        if kind == "ipm":
            return attack_math.ipm(honest, spec.epsilon)
        perturbation = cast("attack_math.Perturbation", spec.perturbation)
        if kind == "min-max":
            return attack_math.min_max(honest, perturbation)
        if kind == "min-sum":
            return attack_math.min_sum(honest, perturbation)
        if kind == "mimic":
            return attack_math.mimic(honest)
        if kind == "bound-riding":
            distances = np.linalg.norm(honest, axis=1)
            bound = spec.riding_factor * attack_math.lower_median(distances)
            return attack_math.bound_riding(honest.mean(axis=0), bound)
        raise ValueError(f"attack '{kind}' is not forged in the grid; use one of {FORGED_IN_GRID}")


def install_omniscient(grid: LocalGrid, run_config: Mapping[str, Any]) -> dict[int, str]:
    """Give the in-process grid the omniscient attackers of the run's draw.

    Every node of ``grid`` whose attack (node-config ``attack``, else run-config
    ``attack`` and ``attack-fraction``'s seeded draw, :func:`attack_for`) is one of
    :data:`FORGED_IN_GRID` gets an :class:`OmniscientAttack` hook in
    ``grid.omniscient``. Its reply is then forged from the honest replies of the same
    batch; the nodes of the other attacks stay client-side (:class:`AttackClient`),
    and their replies never count as honest.

    Parameters
    ----------
    grid : LocalGrid
        The in-process grid (its contexts say each node's partition).
    run_config : Mapping[str, Any]
        Flower's raw run config of the run.

    Returns
    -------
    dict[int, str]
        Node id -> attack, for the hooks installed.
    """
    run = RunConfig.from_flower(run_config)
    specs: dict[int, AttackSpec] = {}
    for node, context in grid.contexts.items():
        spec = attack_for(run, NodeConfig.from_flower(context.node_config))
        if spec is not None:
            specs[node] = spec
    hostile = frozenset(specs)
    installed: dict[int, str] = {}
    for node, spec in specs.items():
        if spec.kind in FORGED_IN_GRID:
            grid.omniscient[node] = OmniscientAttack(spec, hostile)
            installed[node] = spec.kind
    return installed
