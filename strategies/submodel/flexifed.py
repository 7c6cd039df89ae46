"""FlexiFed (Wang et al., WWW 2023): depth-only slices, common layers shared, the rest personal.

Nodes train slices of one global model that differ in depth only (every section
keeps its first blocks, all channels). FlexiFed shares a layer between two
architectures only while their layer sequences, read from the input, are the same:
the *common prefix*. A (2,2,2,2) and a (3,3,3,3) slice share the stem and the first
two blocks of section 0; from the third block of section 0 on (including the deeper
sections and the classifier, which sit at different depths) their layers are their
own. FlexiFed's three aggregation strategies, run-config ``flexifed-strategy``:

- ``max-common`` (default): each layer of an architecture is averaged over every
  node whose architecture shares the common prefix up to and including that layer
  (FlexiFed's "maximum common part" of every subset of architectures);
- ``clustered-common``: the prefix common to *every* architecture in the
  federation is averaged over all nodes; the rest of each architecture only within
  its cluster (the nodes of the same architecture);
- ``basic-common``: the prefix common to every architecture is averaged over all
  nodes; the rest is personal: each node's own trained values, kept for it on the
  server (in checkpoints too) and sent back to it next round, never averaged into
  what another node receives. (The server evaluates each architecture with the mean
  of its nodes' personal layers.)

The server keeps one model per set of architectures that shares entries (named by
joining them with ``+``), so a shared entry is averaged once and every architecture
sharing it reads the same value; an architecture's model is read from those
groups. The full-depth model is the global model reported; each architecture's
model is evaluated on the server test set, and clients report personalised accuracy
on their own test split.
The sharing rule is pure (:func:`common_prefix`, :func:`sharing`) and tested by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import RecordDict

from strategies.core.context import RoundContext
from strategies.core.direction import PoolMix
from strategies.core.groups import GroupRound, non_finite_entries, without_arrays
from strategies.core.registry import Scheme, register_scheme
from strategies.core.validation import ArraySpec, ClientReply
from strategies.submodel.client import SubModelClient
from strategies.submodel.options import SubModelOptions, validate_submodel
from strategies.submodel.server import SubModelStrategy
from tessera import wire
from tessera.config import ConfigError, ConfigReader

STRATEGIES = ("max-common", "clustered-common", "basic-common")
"""FlexiFed's aggregation strategies."""


def common_prefix(a: ArraySpec, b: ArraySpec) -> int:
    """Return how many leading entries (name, shape, dtype, in order) ``a`` and ``b`` share.

    Examples
    --------
    >>> s = ((2,), "float32")
    >>> common_prefix({"x": s, "y": s, "z": s}, {"x": s, "z": s})
    1
    """
    count = 0
    for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=False):
        if ka != kb or va != vb:
            break
        count += 1
    return count


def sharing(specs: Mapping[str, ArraySpec], arch: str, strategy: str) -> dict[str, frozenset[str]]:
    """Return, per entry of ``arch``, the architectures whose models share it.

    Parameters
    ----------
    specs : Mapping[str, ArraySpec]
        Entry specs (in model order) of every architecture in the federation,
        ``arch`` included.
    arch : str
        The architecture of a reply.
    strategy : str
        One of :data:`STRATEGIES`.

    Returns
    -------
    dict[str, frozenset[str]]
        Entry -> architectures it is averaged into. An entry that is personal
        (``basic-common`` beyond the common prefix) maps to an empty set.
    """
    own = specs[arch]
    prefix = {b: common_prefix(own, spec) for b, spec in specs.items()}
    everyone = min(prefix.values())
    out: dict[str, frozenset[str]] = {}
    for position, key in enumerate(own):
        if position < everyone:
            out[key] = frozenset(specs)
        elif strategy == "max-common":
            out[key] = frozenset(b for b, n in prefix.items() if n > position)
        elif strategy == "clustered-common":
            out[key] = frozenset({arch})
        else:
            out[key] = frozenset()
    return out


@dataclass(frozen=True)
class FlexiFedOptions(SubModelOptions):
    """The sub-model options plus ``flexifed-strategy``."""

    strategy: str = "max-common"
    width_flexible: bool = False
    depth_flexible: bool = True

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FlexiFedOptions:
        """Read the options from the run config."""
        strategy = ConfigReader(run_config, "run-config").get(
            "flexifed-strategy", str, "max-common"
        )
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"run-config 'flexifed-strategy' is '{strategy}'; use one of "
                f"{', '.join(STRATEGIES)}"
            )
        return cls(**cls.read(run_config), strategy=strategy)


class FlexiFedClient(SubModelClient[FlexiFedOptions]):
    """A FlexiFed node: picks a depth, keeps every channel."""


@dataclass
class PendingPersonal:
    """``basic-common``: this round's personal entries by node (kept in the round context)."""

    entries: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)


class FlexiFedStrategy(SubModelStrategy[FlexiFedOptions]):
    """FlexiFed's server (module docstring)."""

    def checkpoint_groups(self) -> tuple[str, ...]:
        """Return none by name: FlexiFed's groups are its sharing sets, not the global model."""
        return ()

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.personal: dict[int, dict[str, np.ndarray]] = {}
        """``basic-common``: each node's own entries beyond the common prefix."""
        self._groups: dict[tuple[str, tuple[str, ...]], dict[str, tuple[str, bool]]] = {}

    def group_initial(self, group: str) -> dict[str, np.ndarray]:
        """Return a sharing group's initial weights: those of its first architecture."""
        return super().group_initial(sorted(group.split("+"))[0])

    def pool_direction(
        self,
        arch: str,
        weights: Mapping[str, np.ndarray],
        mix: PoolMix | None = None,
    ) -> dict[str, np.ndarray] | None:
        """Return the server's own update of a sharing group (its first architecture's)."""
        return super().pool_direction(sorted(arch.split("+"))[0], weights, mix)

    def group_direction(
        self,
        group: str,
        weights: Mapping[str, np.ndarray],
        mix: PoolMix | None = None,
    ) -> dict[str, np.ndarray] | None:
        """Return a sharing group's own update (:meth:`pool_direction`).

        FlexiFed's groups hold whole entries, not a slice's private part.
        """
        return self.pool_direction(group, weights, mix)

    def archs_in_use(self, extra: str | None = None) -> tuple[str, ...]:
        """Return the architectures assigned to nodes (plus ``extra``), sorted."""
        archs = set(self.assignment.values()) | ({extra} if extra else set())
        return tuple(sorted(a for a in archs if a))

    def groups_of(self, arch: str) -> dict[str, tuple[str, bool]]:
        """Per entry of ``arch``: the model that holds it, and whether it is personal.

        A model holds the entries one set of architectures shares (named by joining
        them with ``+``), so an entry shared by several architectures is averaged once
        and every one of them reads the same value.
        """
        archs = self.archs_in_use(arch)
        key = (arch, archs)
        if key not in self._groups:
            specs = {a: self.array_spec(a) for a in archs}
            self._groups[key] = {
                entry: ("+".join(sorted(shared or {arch})), not shared)
                for entry, shared in sharing(specs, arch, self.options.strategy).items()
            }
        return self._groups[key]

    def sub_state(self, arch: str) -> dict[str, np.ndarray]:
        """Return ``arch``'s model: each entry from the group that shares it."""
        return {
            entry: self.models.get(group)[entry].copy()
            for entry, (group, _) in self.groups_of(arch).items()
        }

    def node_content(self, ctx: RoundContext, node_id: int, arch: str) -> RecordDict:
        """Send the architecture's model, with the node's personal entries (``basic-common``)."""
        content = super().node_content(ctx, node_id, arch)
        own = self.personal.get(node_id)
        if own:
            state = self.sub_state(arch)
            spec = self.array_spec(arch)
            state.update({k: v for k, v in own.items() if k in spec and v.shape == spec[k][0]})
            content[wire.ARRAYS] = wire.numpy_to_record(state)
        return content

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Average each entry into the models that share it; keep personal entries apart."""
        if reply.arrays is None:
            raise ValueError(f"node {reply.node_id} sent no weights")
        weight = reply.weight
        targets: dict[str, dict[str, np.ndarray]] = {}
        personal: dict[str, np.ndarray] = {}
        for key, (group, own) in self.groups_of(reply.arch).items():
            value = reply.arrays[key]
            if own:  # personal; the architecture's model (for evaluation) takes the mean
                personal[key] = value
            targets.setdefault(group, {})[key] = value
        for group, update in sorted(targets.items()):
            self.models.fold(
                ctx.state(GroupRound),
                group,
                update,
                weight,
                node=reply.node_id,
                stretch=reply.stretch,
            )
        if personal:
            ctx.state(PendingPersonal).entries[reply.node_id] = personal
        return without_arrays(reply)

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Commit the shared averages and the personal entries."""
        pending = ctx.state(PendingPersonal).entries
        bad = [n for n, own in pending.items() if non_finite_entries(own)]
        for node in bad:  # validated replies are finite; kept as a second line of defence
            del pending[node]
        out = super().aggregate(ctx, replies)
        self.personal.update(pending)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Return the base state plus the personal entries."""
        return {
            **super().state_dict(),
            "personal": {str(n): dict(own) for n, own in self.personal.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the base state and the models, then the personal entries, checked first.

        ``personal`` maps node ids of the checkpoint's node table to entries of
        that node's architecture, each with the architecture's shape and dtype and
        finite; none is assigned unless all pass.

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix.
        """
        from tessera.checkpoint import field_of, refusal
        from tessera.state_checks import StateFileError, arrays_problem, get_mapping

        super().load_state_dict(state)
        self._groups = {}
        personal: dict[int, dict[str, np.ndarray]] = {}
        try:
            entries = get_mapping(state, "personal", default={})
            where = field_of(entries, "personal")
            for node, own in entries.items():
                field = f"{where}.{node}"
                info = self.nodes.get(int(node)) if node.isdigit() else None
                if info is None:
                    raise StateFileError(field, "is not a node id of the checkpoint's node table")
                try:
                    spec = self.array_spec(info.arch)
                except Exception as err:  # an unknown name fails in the model registry
                    raise StateFileError(
                        field,
                        f"is for architecture '{info.arch}', which this run cannot build ({err})",
                    ) from err
                if not isinstance(own, Mapping):
                    raise StateFileError(field, f"is {type(own).__name__}; expected a mapping")
                expected = {  # shape and dtype only: nothing of the model's size is allocated
                    k: np.broadcast_to(np.zeros((), dtype), shape)
                    for k, (shape, dtype) in spec.items()
                    if k in own
                }
                problem = arrays_problem(own, expected, where=field)
                if problem is not None:
                    raise problem
                personal[int(node)] = {str(k): np.asarray(v) for k, v in own.items()}
        except StateFileError as err:
            raise refusal(state, err) from err
        self.personal = personal


SCHEME = register_scheme(
    Scheme(
        name="flexifed",
        server=FlexiFedStrategy,
        client=FlexiFedClient,
        parse_options=FlexiFedOptions.parse,
        default_family="preresnet",
        norm="static-batch",
        validate=validate_submodel,
        description="FlexiFed: depth slices, common prefix shared, the rest per cluster or node",
        personalise=True,
        # the direction check drops only updates clearly against the server's own:
        # under Dirichlet(0.5) the honest full-depth updates sit at cosines of -0.1 to
        # 0 with it, and the common threshold 0 dropped them (robustness page)
        config_defaults={"trust-threshold": -0.1},
    )
)
