"""What a run says under the evaluation protocol: the same fields for every scheme.

Pure functions of a run's round records (``metrics.jsonl``, one dict per round as
:class:`strategies.core.strategy.HeteroStrategy` writes them) and of finished cells; no
Flower, no torch. ``docs/pages/protocol.md`` says what each field means.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PLATEAU_FRACTION = 0.95
"""A scheme has plateaued at the first round reaching this share of its final accuracy."""

FLOOR = "local"
"""The scheme every comparison runs as the floor (each client alone)."""


def family_floor(scheme: str) -> str:
    """Return the label of the floor on ``scheme``'s own architectures.

    It is ``local`` run with run-config ``local-like`` set to ``scheme``: each client
    trains alone on what ``scheme`` would give it (its family, its sub-model slices).

    Examples
    --------
    >>> family_floor("fedfa")
    'local:fedfa'
    """
    return f"{FLOOR}:{scheme}"


def is_floor(name: str) -> bool:
    """Return whether ``name`` labels a floor (``local`` or a family floor).

    Examples
    --------
    >>> is_floor("local"), is_floor("local:ensemble"), is_floor("fedavg")
    (True, True, False)
    """
    return name == FLOOR or name.startswith(FLOOR + ":")


CEILING = "centralised"
"""The label of the ceiling: the same architectures trained on the pooled data."""


class ProtocolError(ValueError):
    """A comparison setting that cannot be run, or records that do not fit the protocol."""


@dataclass(frozen=True)
class Partitioning:
    """How the client pool is split: one of the protocol's partitionings.

    Attributes
    ----------
    scheme : str
        ``"iid"``, ``"dirichlet"`` or ``"pathological"``.
    alpha : float
        Dirichlet concentration (dirichlet only).
    classes : int
        Classes per client (pathological only).
    """

    scheme: str
    alpha: float = 0.5
    classes: int = 2

    @property
    def label(self) -> str:
        """Short name used in tables, keys and file names."""
        if self.scheme == "dirichlet":
            return f"dirichlet({self.alpha:g})"
        if self.scheme == "pathological":
            return f"pathological({self.classes})"
        return self.scheme

    @property
    def slug(self) -> str:
        """:attr:`label` fit for a file name."""
        return self.label.replace("(", "-").replace(")", "")

    def run_config(self) -> dict[str, Any]:
        """Run-config keys of this partitioning (every key, so nothing falls to a default)."""
        return {
            "partitioner": self.scheme,
            "dirichlet-alpha": float(self.alpha),
            "classes-per-client": int(self.classes),
        }


def parse_partitioning(text: str) -> Partitioning:
    """Parse ``iid``, ``dirichlet:<alpha>`` or ``pathological:<classes>``.

    ``dirichlet(0.5)`` and ``pathological(2)`` (the table labels) are accepted too.

    Raises
    ------
    ProtocolError
        If the name or its parameter is not valid.
    """
    raw = text.strip().lower()
    name, _, arg = raw.replace("(", ":").rstrip(")").partition(":")
    fix = "use iid, dirichlet:<alpha> (e.g. dirichlet:0.5) or pathological:<classes>"
    if name == "iid" and not arg:
        return Partitioning("iid")
    if name == "dirichlet":
        try:
            alpha = float(arg) if arg else 0.5
        except ValueError:
            raise ProtocolError(
                f"partitioning {text!r}: alpha {arg!r} is not a number; {fix}"
            ) from None
        if not (math.isfinite(alpha) and alpha > 0):
            raise ProtocolError(f"partitioning {text!r}: alpha must be > 0; {fix}")
        return Partitioning("dirichlet", alpha=alpha)
    if name == "pathological":
        try:
            classes = int(arg) if arg else 2
        except ValueError:
            raise ProtocolError(
                f"partitioning {text!r}: classes {arg!r} is not an integer; {fix}"
            ) from None
        if classes < 1:
            raise ProtocolError(f"partitioning {text!r}: classes must be >= 1; {fix}")
        return Partitioning("pathological", classes=classes)
    raise ProtocolError(f"partitioning {text!r} is unknown; {fix}")


def plateau_round(curve: Sequence[float | None], fraction: float = PLATEAU_FRACTION) -> int | None:
    """Return the first round (1-based) whose value reaches ``fraction`` of the final one.

    The final value is the last round's; rounds without a value (``None`` or NaN)
    never count. ``None`` when the last round has no value or it is not positive.

    Examples
    --------
    >>> plateau_round([0.2, 0.5, 0.9, 0.95, 1.0])
    4
    """
    values = [_number(v) for v in curve]
    if not values or values[-1] is None or values[-1] <= 0:
        return None
    target = fraction * values[-1]
    return next(i for i, v in enumerate(values, 1) if v is not None and v >= target)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    out = float(value)
    return None if math.isnan(out) else out


def bytes_per_client_round(rounds: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """Return the mean bytes ``(up, down)`` one client exchanged in one round.

    Sums over the rounds that were not skipped of the measured payloads (a client's
    reply up, the server's message down) divided by the client-rounds in them (the
    accepted replies). ``(0, 0)`` when no client ever replied.
    """
    up = down = 0
    client_rounds = 0
    for record in rounds:
        if record.get("skipped"):
            continue
        clients = record.get("clients") or []
        client_rounds += len(clients)
        up += sum(int(c.get("bytes_up", 0)) for c in clients)
        down += sum(int(c.get("bytes_down", 0)) for c in clients)
    if client_rounds == 0:
        return 0.0, 0.0
    return up / client_rounds, down / client_rounds


def run_fields(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Return the protocol's fields of one run (one scheme, one seed) from its rounds.

    Every scheme gets every field; a field the scheme has no value for is ``None``
    (``global`` for schemes without a global model) or empty (``slices``).

    Parameters
    ----------
    rounds : Sequence[Mapping]
        The run's round records, in order.

    Returns
    -------
    dict
        ``rounds``; ``personal`` (final mean personalised accuracy over clients),
        ``personal_clients_std``, ``personal_curve``, ``personal_by_arch``;
        ``global`` (mean of the global models' accuracy on the server test set),
        ``global_by_arch``, ``global_curve``; ``slices`` (each sub-model slice on
        the server test set); ``ensemble`` (the tuned ensemble); ``plateau_personal``,
        ``plateau_global``; ``bytes_up``, ``bytes_down``, ``bytes`` (per client and
        round); ``client_archs`` (partition id to architecture, last round);
        ``archs``; ``rejected``, ``failed``, ``skipped``.

    Raises
    ------
    ProtocolError
        If there are no rounds.
    """
    if not rounds:
        raise ProtocolError("the run wrote no round records; it did not complete a round")
    last = rounds[-1]
    personal_curve = [_number(r.get("personal_accuracy_mean")) for r in rounds]
    global_curve = [_number(r.get("global_accuracy")) for r in rounds]
    up, down = bytes_per_client_round(rounds)
    ensemble = next(
        (_number(r["ensemble_accuracy"]) for r in reversed(rounds) if "ensemble_accuracy" in r),
        None,
    )
    client_archs = {
        str(c["partition_id"]): str(c["arch"])
        for c in last.get("clients") or []
        if c.get("partition_id") is not None
    }
    return {
        "rounds": len(rounds),
        "personal": personal_curve[-1],
        "personal_clients_std": _number(last.get("personal_accuracy_std")),
        "personal_curve": personal_curve,
        "personal_by_arch": dict(last.get("personal_accuracy_by_arch") or {}),
        "global": global_curve[-1],
        "global_by_arch": dict(last.get("global_accuracy_by_arch") or {}),
        "global_curve": global_curve,
        "slices": dict(last.get("submodel_accuracy") or {}),
        "ensemble": ensemble,
        "plateau_personal": plateau_round(personal_curve),
        "plateau_global": plateau_round(global_curve),
        "bytes_up": up,
        "bytes_down": down,
        "bytes": up + down,
        "client_archs": client_archs,
        "archs": sorted(set(client_archs.values())),
        "rejected": sum(int(r.get("num_rejected", 0)) for r in rounds),
        "failed": sum(int(r.get("num_failed", 0)) for r in rounds),
        "skipped": [int(r["round"]) for r in rounds if r.get("skipped")],
    }


@dataclass(frozen=True)
class Spread:
    """Mean and population standard deviation of a figure over seeds."""

    mean: float | None
    std: float | None
    n: int

    def text(self, scale: float = 100.0, digits: int = 1) -> str:
        """``mean ± std`` (scaled, e.g. to percent); ``-`` when there is no value."""
        if self.mean is None:
            return "-"
        std = self.std or 0.0
        return f"{scale * self.mean:.{digits}f} ± {scale * std:.{digits}f}"


def spread(values: Iterable[float | None]) -> Spread:
    """Return the :class:`Spread` of the values that are present (``None`` skipped).

    Examples
    --------
    >>> spread([0.5, None, 0.7])
    Spread(mean=0.6, std=0.09999999999999998, n=2)
    """
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not kept:
        return Spread(None, None, 0)
    std = statistics.pstdev(kept) if len(kept) > 1 else 0.0
    return Spread(statistics.fmean(kept), std, len(kept))


def beats_floor(scheme: Sequence[float | None], floor: Sequence[float | None]) -> bool | None:
    """Whether a scheme's mean over seeds is above the floor's (``local``) mean.

    ``None`` when either has no value. Equal means do not beat the floor.
    """
    ours, base = spread(scheme).mean, spread(floor).mean
    if ours is None or base is None:
        return None
    return ours > base


def mean_curve(curves: Sequence[Sequence[float | None]]) -> tuple[list[float], list[float]]:
    """Round-wise mean and population std over seeds (NaN where no seed has a value).

    Curves of different lengths are aligned on the first round; a round counts the
    seeds that reached it.
    """
    length = max((len(c) for c in curves), default=0)
    means: list[float] = []
    stds: list[float] = []
    for i in range(length):
        s = spread(c[i] if i < len(c) else None for c in curves)
        means.append(math.nan if s.mean is None else s.mean)
        stds.append(math.nan if s.std is None else s.std)
    return means, stds


def ceiling_key(arch: str, learning_rate: float | None = None) -> str:
    """Return the centralised record's key for an architecture at a run's learning rate.

    A scheme that trains at a learning rate of its own (run-config
    ``learning-rate``, e.g. the ensemble's tuned one) gets the ceiling of its
    architectures at that rate: the same budget includes the optimiser. Without
    one, the key is the architecture's name (the common rate).

    Examples
    --------
    >>> ceiling_key("cnn-1")
    'cnn-1'
    >>> ceiling_key("vgg11_0125", 0.01)
    'vgg11_0125 lr=0.01'
    """
    return arch if learning_rate is None else f"{arch} lr={learning_rate:g}"


def run_learning_rate(run_config: Mapping[str, Any]) -> float | None:
    """Return the learning rate a run set for itself (run-config ``learning-rate``), if any.

    Examples
    --------
    >>> run_learning_rate({"strategy": "ensemble", "learning-rate": 0.01})
    0.01
    >>> run_learning_rate({"strategy": "local"}) is None
    True
    """
    value = run_config.get("learning-rate")
    return None if value is None else float(value)


def ceiling_rates(
    centralised: Mapping[str, Mapping[str, Any]], grid: Sequence[float]
) -> dict[str, float]:
    """Return, per architecture, the rate of ``grid`` its centralised training scored best at.

    ``centralised`` is the validation seed's ceiling cell (keyed by
    :func:`ceiling_key`); the score is the mean of an entry's ``personal``
    accuracies (every client's held-out split), and a diverged entry scores
    nothing. Ties go to the rate listed first (the caller lists the scheme's own
    chosen rate first). Architectures with no entry at any rate of ``grid`` are
    left out.

    A scheme whose learning rate is tuned on the validation seed gets its ceiling
    tuned the same way: the rate that trains a handful of local epochs well can be
    too high for ``rounds x local-epochs`` epochs of central training
    (``mobilenetv2_035`` at the ensemble's 0.05 reached 16 % once).

    Examples
    --------
    >>> cell = {
    ...     "m lr=0.05": {"personal": {"0": 0.2, "1": 0.4}},
    ...     "m lr=0.02": {"personal": {"0": 0.9, "1": 0.9}},
    ...     "v lr=0.05": {"personal": {"0": 0.9}},
    ...     "v lr=0.02": {"personal": {"0": 0.9}},
    ... }
    >>> ceiling_rates(cell, [0.05, 0.02, 0.01])
    {'m': 0.02, 'v': 0.05}
    """
    scores: dict[str, list[tuple[float, int, float]]] = {}
    for order, rate in enumerate(grid):
        for key, entry in centralised.items():
            arch, sep, tail = key.rpartition(" lr=")
            if not sep or float(tail) != float(rate) or entry.get("diverged"):
                continue
            values = [float(v) for v in entry.get("personal", {}).values()]
            if values:
                scores.setdefault(arch, []).append((statistics.fmean(values), -order, rate))
    return {arch: max(found)[2] for arch, found in sorted(scores.items())}


def ceiling_for(
    client_archs: Mapping[str, str],
    global_archs: Iterable[str],
    centralised: Mapping[str, Mapping[str, Any]],
    learning_rate: float | None = None,
    rates: Mapping[str, float] | None = None,
) -> tuple[float | None, float | None]:
    """Return the ceiling matched to one run: its own architectures trained centrally.

    Parameters
    ----------
    client_archs : Mapping[str, str]
        The run's partition id (as a string) to the architecture it trained.
    global_archs : Iterable[str]
        The run's global models (``global_by_arch`` keys).
    centralised : Mapping[str, Mapping]
        Per architecture, the centralised model's ``personal`` accuracies by
        partition id and its ``global`` accuracy on the server test set
        (:func:`tessera.compare.ceiling.train_centralised`), keyed by
        :func:`ceiling_key`.
    learning_rate : float, optional
        The run's own learning rate (run-config ``learning-rate``), if it set one.
    rates : Mapping[str, float], optional
        Per architecture, the rate its ceiling was tuned to on the validation seed
        (:func:`ceiling_rates`); it replaces ``learning_rate`` for that architecture.

    Returns
    -------
    tuple
        ``(personal, global)``: the mean over the run's clients of their own
        architecture's centralised accuracy on their held-out split, and the mean
        over its global models of their centralised accuracy on the server test
        set; ``None`` where an architecture was not trained centrally.
    """
    rates = rates or {}
    personal: list[float] = []
    glob = _global_ceiling(global_archs, centralised, learning_rate, rates)
    for pid, arch in client_archs.items():
        entry = centralised.get(ceiling_key(arch, rates.get(arch, learning_rate)))
        if entry is None or entry.get("diverged"):
            return None, glob
        value = entry.get("personal", {}).get(pid)
        if value is not None:  # absent: the client's held-out split is empty
            personal.append(float(value))
    mean = statistics.fmean(personal) if personal else None
    return mean, glob


def _global_ceiling(
    archs: Iterable[str],
    centralised: Mapping[str, Mapping[str, Any]],
    learning_rate: float | None,
    rates: Mapping[str, float],
) -> float | None:
    values = [
        centralised.get(ceiling_key(a, rates.get(a, learning_rate)), {}).get("global")
        for a in archs
    ]
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(float(v) for v in values if v is not None)
