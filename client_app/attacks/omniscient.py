"""The omniscient attacks: replies forged in the in-process grid from the honest ones.

:func:`install_omniscient` gives :class:`tessera.local_grid.LocalGrid` an
:class:`OmniscientAttack` hook per hostile node whose attack is one of
:data:`FORGED_IN_GRID`; the hook forges the node's reply from the honest replies of
its batch (the maths: :mod:`tessera.attack_math`). How: :mod:`client_app.attacks`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from flwr.app import Message, RecordDict

from client_app.attacks.spec import AttackSpec, attack_for
from client_app.attacks.vectors import (
    flatten,
    message_arrays,
    shapes_of,
    unflatten,
    weight_keys,
    weight_start,
    weight_update,
)
from tessera import attack_math, wire
from tessera.config import OMNISCIENT_ATTACKS, ConfigError, NodeConfig, RunConfig

if TYPE_CHECKING:
    from tessera.local_grid import BatchView, Exchange, LocalGrid

log = logging.getLogger("flwr.tessera")

FORGED_IN_GRID = (*OMNISCIENT_ATTACKS, "bound-riding")
"""Attacks :func:`install_omniscient` forges in the in-process grid."""
ROW_KEYS = ("class-ids",)
"""Payload arrays that say what each row means (the class ids of Felo's knowledge and of
FedProto's and FedTGP's prototypes): two nodes' payloads are forged together only
where these are equal."""


def _payload_peers(
    own: Mapping[str, np.ndarray], keys: Sequence[str], name: str, honest: Sequence[Exchange]
) -> list[dict[str, np.ndarray]]:
    """Return the honest nodes' payload ``name`` where it matches ``own``'s arrays and rows."""
    peers = []
    for exchange in honest:
        theirs = message_arrays(exchange.reply, name)
        if theirs is None or any(k not in theirs for k in keys):
            continue
        if shapes_of(theirs, keys) != shapes_of(own, keys):
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
        weights = message_arrays(own.reply, wire.ARRAYS)
        if weights is not None:
            keys = weight_keys(weights)
            peers = [
                e
                for e in honest
                if (theirs := message_arrays(e.reply, wire.ARRAYS)) is not None
                and all(k in theirs for k in keys)
                and shapes_of(theirs, keys) == shapes_of(weights, keys)
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
