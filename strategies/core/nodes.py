"""The node table: who took part, as each node described itself in the handshake.

A ``query.handshake`` goes to every node the SuperLink reports that the server has
not seen yet (before round 1, and for nodes that join later). Each reply is checked
(:func:`parse_handshake`) before the node enters the :class:`NodeTable`; the
scheme's hooks (:class:`NodePolicy`) may then refuse it or leave it out of the
federation. The table is part of the server's checkpoint (:meth:`NodeTable.state`,
:meth:`NodeTable.from_state`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from strategies.core.context import FEDERATION
from strategies.core.exchange import connected_nodes, exchange, is_simulation
from strategies.core.validation import Rejection, short_reason
from tessera import wire
from tessera.state_checks import (
    StateFileError,
    get_int,
    get_list,
    get_mapping,
    get_str,
    int_list,
)

if TYPE_CHECKING:
    from models.spec import ModelRef

log = logging.getLogger("flwr.tessera")

__all__ = ["NodeInfo", "NodePolicy", "NodeTable", "handshake_problem", "parse_handshake"]


@dataclass(frozen=True)
class NodeInfo:
    """A node as it described itself in the handshake.

    ``ref`` is the model it trains, structured (a registered model or a slice of
    one); :attr:`arch` is its printed name, the key rounds and results use.
    """

    node_id: int
    ref: ModelRef
    family: str
    size_rank: int
    arch_fits: bool
    num_train: int
    num_test: int
    partition_id: int
    label_counts: tuple[int, ...]
    profile: dict[str, Any]
    data_key: int = -1
    """Stable identity of the node's data (its partition, or a digest of its own file);
    orders nodes across restarts, where node ids change."""

    @property
    def arch(self) -> str:
        """The model's printed name (:attr:`ModelRef.name`)."""
        return self.ref.name

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe description for ``config.json`` and checkpoints."""
        return {
            "node": self.node_id,
            "partition_id": self.partition_id,
            "arch": self.arch,
            **self.ref.to_record(),
            "family": self.family,
            "size_rank": self.size_rank,
            "arch_fits": self.arch_fits,
            "num_train": self.num_train,
            "num_test": self.num_test,
            "label_counts": list(self.label_counts),
            "profile": self.profile,
            "data_key": self.data_key,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "") -> NodeInfo:
        """Inverse of :meth:`to_dict`, every field checked.

        Raises
        ------
        StateFileError
            If a field is missing or of the wrong type (the message names it).
        """
        any_int = -(2**63)
        counts = int_list(
            get_list(data, "label_counts", where=where), where=f"{where}.label_counts"
        )
        if not isinstance(data.get("arch_fits"), bool):
            raise StateFileError(f"{where}.arch_fits", "is not a boolean")
        return cls(
            node_id=get_int(data, "node", where=where),
            ref=_ref_of(data, where=where),
            family=get_str(data, "family", where=where),
            size_rank=get_int(data, "size_rank", where=where, minimum=any_int),
            arch_fits=bool(data["arch_fits"]),
            num_train=_size(data, "num_train", where=where),
            num_test=_size(data, "num_test", where=where),
            partition_id=get_int(data, "partition_id", where=where, minimum=any_int),
            label_counts=tuple(counts),
            profile=dict(get_mapping(data, "profile", where=where)),
            data_key=get_int(data, "data_key", where=where, minimum=any_int, default=-1),
        )


def _size(data: Mapping[str, Any], key: str, *, where: str) -> int:
    """Read a node's training or test-set size from a checkpoint, at most :data:`MAX_EXAMPLES`.

    The handshake refuses a larger claim; a checkpoint's node table must not bring one
    back.
    """
    value = get_int(data, key, where=where)
    if value > MAX_EXAMPLES:
        raise StateFileError(
            f"{where}.{key}", f"is {value}; a node may hold at most {MAX_EXAMPLES:,} examples"
        )
    return value


def _ref_of(data: Mapping[str, Any], *, where: str) -> ModelRef:
    """Read a node's model from a checkpoint's node entry (:meth:`NodeInfo.to_dict`).

    Entries written before models were structured hold only the name ``arch``,
    read back with :meth:`ModelRef.parse`.
    """
    from models.spec import MODEL_KEY, SLICE_DEPTHS_KEY, SLICE_WIDTH_KEY, ModelRef

    name = get_str(data, "arch", where=where)
    try:
        if "model" not in data:
            return ModelRef.parse(name)
        piece = data.get("slice")
        if piece is None:
            ref = ModelRef(get_str(data, "model", where=where))
        else:
            piece = get_mapping(data, "slice", where=where)
            ref = ModelRef.from_config(
                {
                    MODEL_KEY: data["model"],
                    SLICE_WIDTH_KEY: piece.get("width"),
                    SLICE_DEPTHS_KEY: piece.get("depths"),
                },
                where=f"{where}.slice",
            )
    except ValueError as err:
        raise StateFileError(f"{where}.model", str(err)) from err
    if ref.name != name:
        raise StateFileError(f"{where}.arch", f"is '{name}' but model and slice give '{ref.name}'")
    return ref


def parse_handshake(
    reply: Message, known_archs: Sequence[str], *, num_classes: int | None = None
) -> NodeInfo | Rejection:
    """Validate a handshake reply into a :class:`NodeInfo`.

    Nothing a node declares is taken on trust where the server can check it: the
    architecture must be registered, its family and size rank must be the registry's
    (a node cannot claim a rank that moves everyone onto its architecture), the label
    counts must be non-negative, one per class of the task, and sum to ``num-train``.
    """
    node_id = int(reply.metadata.src_node_id)
    if reply.has_error():
        return Rejection(
            node_id,
            f"handshake failed (code {reply.error.code}): {short_reason(reply.error.reason or '')}",
        )
    if wire.PROFILE not in reply.content.config_records:
        return Rejection(node_id, "handshake reply has no 'profile' record")
    rec = reply.content.config_records[wire.PROFILE]
    try:
        from models.spec import ModelRef

        ref = ModelRef.from_config(rec, where="handshake profile")
        named = str(rec["arch"])
        if named != ref.name:
            return Rejection(
                node_id,
                f"handshake names arch '{named}' but its model and slice give '{ref.name}'",
            )
        counts = wire.int_list_value(rec, "label-counts")
        info = NodeInfo(
            node_id=node_id,
            ref=ref,
            family=str(rec["family"]),
            size_rank=wire.int_value(rec, "size-rank"),
            arch_fits=bool(rec["arch-fits"]),
            num_train=wire.int_value(rec, "num-train"),
            num_test=wire.int_value(rec, "num-test"),
            partition_id=wire.int_value(rec, "partition-id"),
            label_counts=counts,
            profile={k[len("device-") :]: v for k, v in rec.items() if k.startswith("device-")},
            data_key=wire.int_value(rec, "data-key" if "data-key" in rec else "partition-id"),
        )
    except (KeyError, TypeError, ValueError) as err:
        return Rejection(node_id, f"handshake profile is malformed: {err}")
    if info.arch not in set(known_archs):
        return Rejection(node_id, f"handshake names unknown architecture '{info.arch}'")
    problem = handshake_problem(info, num_classes)
    if problem is not None:
        return Rejection(node_id, problem)
    return info


MAX_EXAMPLES = 10**9
"""The most examples a node may report for its training or test set.

A claimed size becomes a weight in the round's sums; without a bound, a node of a
cohort of one (or a cohort that all lies) could claim 1.7e308 and make every sum
overflow to infinity, skipping rounds until the run stops. No edge device trains
on a billion examples a round."""


def handshake_problem(info: NodeInfo, num_classes: int | None) -> str | None:
    """Return why a parsed profile contradicts the registry or itself, or ``None``."""
    from models import model_entry

    if info.num_train <= 0:
        return f"handshake reports num-train={info.num_train}"
    if info.num_test < 0:
        return f"handshake reports num-test={info.num_test}"
    for key, value in (("num-train", info.num_train), ("num-test", info.num_test)):
        if value > MAX_EXAMPLES:
            return (
                f"handshake reports {key}={value}, above the {MAX_EXAMPLES:,} examples a "
                "node may hold (MAX_EXAMPLES)"
            )
    model, spec = info.ref.model, info.ref.spec
    entry = model_entry(model)
    if spec is not None:
        # a slice's size rank is derived from its measured cost on the device, not
        # declared; the server never orders nodes by it
        if info.family != entry.family:
            return (
                f"handshake claims family '{info.family}' for '{info.arch}', a slice of "
                f"'{model}' of family '{entry.family}'"
            )
    elif info.family != entry.family or info.size_rank != entry.size_rank:
        return (
            f"handshake claims family '{info.family}' and size-rank {info.size_rank} for "
            f"'{info.arch}', which the registry has as family '{entry.family}', size-rank "
            f"{entry.size_rank}"
        )
    if num_classes is not None and len(info.label_counts) != num_classes:
        return (
            f"handshake has {len(info.label_counts)} label counts but the task has "
            f"{num_classes} classes"
        )
    if any(c < 0 for c in info.label_counts):
        return f"handshake has negative label counts {list(info.label_counts)[:10]}"
    if sum(info.label_counts) != info.num_train:
        return (
            f"handshake label counts sum to {sum(info.label_counts)} but num-train is "
            f"{info.num_train}"
        )
    return None


class NodePolicy(Protocol):
    """What the scheme decides about who joins (hooks of ``HeteroStrategy``)."""

    def known_archs(self) -> list[str]:
        """Return the architectures a node may name in the handshake."""
        ...

    def refuse_node(self, info: NodeInfo) -> str | None:
        """Return why a node that passed the handshake checks may not join, or ``None``."""
        ...

    def assign_architectures(self, nodes: Mapping[int, NodeInfo]) -> dict[int, str | None]:
        """Return the architecture each present node trains (``None`` leaves it out)."""
        ...


@dataclass
class NodeTable:
    """Nodes that passed the handshake, the architecture each trains, and who was left out.

    Attributes
    ----------
    nodes : dict[int, NodeInfo]
        Every node that passed the handshake, present or not.
    assignment : dict[int, str]
        Connected nodes that can take part, and their architectures.
    excluded : dict[int, str]
        Nodes left out of the federation and why.
    rejections : list[Rejection]
        Handshakes that failed or were refused.
    """

    nodes: dict[int, NodeInfo] = field(default_factory=dict)
    assignment: dict[int, str] = field(default_factory=dict)
    excluded: dict[int, str] = field(default_factory=dict)
    rejections: list[Rejection] = field(default_factory=list)

    def refresh(
        self,
        grid: Grid,
        policy: NodePolicy,
        *,
        federation: str,
        num_classes: int,
        timeout: float,
        retry_timeout: float,
    ) -> bool:
        """Handshake with nodes not seen yet; leave out nodes that disconnected.

        Returns
        -------
        bool
            Whether any node was asked for a handshake (the table changed).
        """
        connected = connected_nodes(grid, retry_timeout=retry_timeout)
        new = sorted(connected - set(self.nodes) - set(self.excluded))
        if new:
            self._handshake(
                grid,
                new,
                policy,
                federation=federation,
                num_classes=num_classes,
                timeout=timeout,
                retry_timeout=retry_timeout,
            )
        for gone in set(self.nodes) - connected:
            if gone in self.assignment:
                log.warning("node %d disconnected; it is left out until it returns", gone)
        present = {n: i for n, i in self.nodes.items() if n in connected}
        assignment = policy.assign_architectures(present)
        self.assignment = {n: a for n, a in assignment.items() if a is not None}
        for n, a in assignment.items():
            if a is None and n not in self.excluded:
                self.excluded[n] = "cannot train the shared architecture"
                log.warning(
                    "node %d is left out: its device cannot train the shared architecture", n
                )
        return bool(new)

    def _handshake(
        self,
        grid: Grid,
        new: Sequence[int],
        policy: NodePolicy,
        *,
        federation: str,
        num_classes: int,
        timeout: float,
        retry_timeout: float,
    ) -> None:
        content = RecordDict(
            {
                wire.CONFIG: ConfigRecord(
                    {
                        "server-round": 0,
                        # an in-process stand-in (tessera.local_grid) says so
                        "simulation": is_simulation(grid)
                        or getattr(grid, "simulation", False) is True,
                        FEDERATION: federation,
                    }
                )
            }
        )
        msgs = [
            Message(
                content=content, dst_node_id=n, message_type=wire.HANDSHAKE, ttl=max(timeout, 60.0)
            )
            for n in new
        ]
        outcome = exchange(grid, msgs, timeout=timeout, retry_timeout=retry_timeout)
        for node, reason in outcome.missing.items():
            log.warning("handshake: node %d failed: %s", node, reason)
            self.rejections.append(Rejection(node, reason))
        known = policy.known_archs()
        for reply in outcome.replies:
            info = parse_handshake(reply, known, num_classes=num_classes)
            if not isinstance(info, Rejection):
                refusal = policy.refuse_node(info)
                info = info if refusal is None else Rejection(info.node_id, refusal)
            if isinstance(info, Rejection):
                log.warning("handshake: node %d rejected: %s", info.node_id, info.reason)
                self.rejections.append(info)
                continue
            log.info(
                "node %d (partition %d): profile '%s', %g cores, %.0f MiB, %s -> %s%s",
                info.node_id,
                info.partition_id,
                info.profile.get("name"),
                float(info.profile.get("cpu-cores", 0)),
                float(info.profile.get("memory-bytes", 0)) / 2**20,
                info.profile.get("accelerator"),
                info.arch,
                "" if info.arch_fits else " (nothing fits: smallest)",
            )
            self.nodes[info.node_id] = info

    def partition_of(self, node_id: int) -> int | None:
        """Return the partition a node reported, or ``None`` for a node not in the table."""
        info = self.nodes.get(node_id)
        return None if info is None else info.partition_id

    def rejection_list(self) -> list[dict[str, Any]]:
        """Handshake rejections as JSON-safe entries."""
        return [{"node": r.node_id, "reason": r.reason} for r in self.rejections]

    def document(self) -> dict[str, Any]:
        """Return the table as ``config.json`` shows it."""
        return {
            "nodes": [info.to_dict() for _, info in sorted(self.nodes.items())],
            "assignment": {str(n): a for n, a in sorted(self.assignment.items())},
            "excluded": {str(n): r for n, r in sorted(self.excluded.items())},
            "handshake_rejections": self.rejection_list(),
        }

    def state(self) -> dict[str, Any]:
        """Return what a checkpoint keeps (the assignment is redone after a restart)."""
        return {
            "nodes": [info.to_dict() for _, info in sorted(self.nodes.items())],
            "excluded": {str(n): r for n, r in sorted(self.excluded.items())},
            "handshake_rejections": self.rejection_list(),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> NodeTable:
        """Inverse of :meth:`state`, every entry checked.

        Raises
        ------
        StateFileError
            If an entry is missing or malformed (the message names it).
        """
        nodes: dict[int, NodeInfo] = {}
        for i, entry in enumerate(get_list(state, "nodes", default=[])):
            where = f"nodes[{i}]"
            if not isinstance(entry, Mapping):
                raise StateFileError(where, f"is {type(entry).__name__}; expected a mapping")
            info = NodeInfo.from_dict(entry, where=where)
            nodes[info.node_id] = info
        excluded: dict[int, str] = {}
        for node, reason in get_mapping(state, "excluded", default={}).items():
            if not node.isdigit():
                raise StateFileError(f"excluded.{node}", "is not keyed by a node id")
            excluded[int(node)] = get_str({node: reason}, node, where="excluded")
        rejections = []
        for i, entry in enumerate(get_list(state, "handshake_rejections", default=[])):
            where = f"handshake_rejections[{i}]"
            if not isinstance(entry, Mapping):
                raise StateFileError(where, f"is {type(entry).__name__}; expected a mapping")
            rejections.append(
                Rejection(
                    get_int(entry, "node", where=where), get_str(entry, "reason", where=where)
                )
            )
        return cls(nodes=nodes, excluded=excluded, rejections=rejections)
