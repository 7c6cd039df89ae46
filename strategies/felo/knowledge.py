"""Per-class knowledge: what Felo, Velo and FedHe exchange instead of (or with) weights.

Pure maths and the payload schema, no training:

- on the client, :func:`class_means` averages a model's features and logits over its
  training data per class label and keeps the counts (:func:`collect_knowledge` runs
  the model);
- on the server, :func:`merge_knowledge` averages the clients' per-class means,
  weighted by their counts; a class only some clients hold is averaged over those,
  a class nobody holds is absent from the result;
- :func:`knowledge_to_record` / :func:`record_to_knowledge` are the wire format and
  :func:`check_knowledge_record` validates a client's record before any arithmetic.

Wire format (one :class:`~flwr.app.ArrayRecord`, kebab-case keys): ``class-ids``
(int64, ``(K,)``, distinct, in ``[0, num_classes)``), ``counts`` (int64, ``(K,)``,
positive), ``logits`` (float32, ``(K, num_classes)``) and, for schemes that exchange
features, ``features`` (float32, ``(K, feature_dim)``). The client sends it as record
``knowledge``; the server answers with its per-class targets in record
``class-targets`` (same keys; ``counts`` are the summed client counts).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from tessera import wire
from tessera.data import ArrayDataset

KNOWLEDGE = "knowledge"
"""Record name of a client's per-class knowledge in its train reply."""
CLASS_TARGETS = "class-targets"
"""Record name of the server's per-class targets in a train message."""

CLASS_IDS = "class-ids"
COUNTS = "counts"
FEATURES = "features"
LOGITS = "logits"
KINDS = (LOGITS, FEATURES)
"""The kinds of per-class rows, each bounded against its own cohort."""


class KnowledgeError(ValueError):
    """Per-class knowledge whose parts disagree (lengths, shapes, class ids)."""


@dataclass(frozen=True)
class ClassKnowledge:
    """Per-class mean features and logits with the number of samples behind each.

    Attributes
    ----------
    class_ids : np.ndarray
        int64 ``(K,)``: the classes present, ascending, distinct.
    counts : np.ndarray
        int64 ``(K,)``: samples per class, positive.
    logits : np.ndarray
        float32 ``(K, num_classes)``: mean logits per class.
    features : np.ndarray | None
        float32 ``(K, feature_dim)``: mean features per class, or ``None`` for
        logits-only schemes (FedHe).
    """

    class_ids: np.ndarray
    counts: np.ndarray
    logits: np.ndarray
    features: np.ndarray | None = None

    def __post_init__(self) -> None:
        """Check that the parts agree (shapes are never left to broadcasting)."""
        k = self.class_ids.shape[0] if self.class_ids.ndim == 1 else -1
        if k < 0 or self.counts.shape != (k,):
            raise KnowledgeError(
                f"class_ids {self.class_ids.shape} and counts {self.counts.shape} must "
                "both be 1-d of the same length"
            )
        if self.logits.ndim != 2 or self.logits.shape[0] != k:
            raise KnowledgeError(f"logits must be ({k}, num_classes), got {self.logits.shape}")
        if self.features is not None and (self.features.ndim != 2 or self.features.shape[0] != k):
            raise KnowledgeError(f"features must be ({k}, feature_dim), got {self.features.shape}")
        if len(np.unique(self.class_ids)) != k:
            raise KnowledgeError(f"class ids {self.class_ids.tolist()} repeat a class")

    @property
    def num_classes_present(self) -> int:
        """Number of classes this knowledge covers."""
        return int(self.class_ids.shape[0])

    def without_features(self) -> ClassKnowledge:
        """Return the same knowledge without the features (logits only)."""
        return ClassKnowledge(self.class_ids, self.counts, self.logits, None)


def class_means(
    values: np.ndarray, labels: np.ndarray, num_classes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Average rows of ``values`` per label.

    Parameters
    ----------
    values : np.ndarray
        ``(N, D)`` rows.
    labels : np.ndarray
        ``(N,)`` integer labels in ``[0, num_classes)``.
    num_classes : int
        Number of classes of the task.

    Returns
    -------
    tuple[np.ndarray, np.ndarray, np.ndarray]
        ``class_ids`` (int64, the labels present, ascending), ``counts`` (int64) and
        the per-class means (float32 ``(K, D)``, accumulated in float64).

    Raises
    ------
    KnowledgeError
        If the shapes disagree or a label is out of range.
    """
    if values.ndim != 2 or labels.shape != (values.shape[0],):
        raise KnowledgeError(
            f"values {values.shape} and labels {labels.shape} must be (N, D) and (N,)"
        )
    y = labels.astype(np.int64)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise KnowledgeError(
            f"labels span [{y.min()}, {y.max()}] but the task has {num_classes} classes"
        )
    counts_all = np.bincount(y, minlength=num_classes)
    sums = np.zeros((num_classes, values.shape[1]), dtype=np.float64)
    np.add.at(sums, y, values.astype(np.float64))
    present = np.flatnonzero(counts_all > 0)
    counts = counts_all[present].astype(np.int64)
    means = sums[present] / counts[:, None]
    return present.astype(np.int64), counts, means.astype(np.float32)


def knowledge_from_arrays(
    features: np.ndarray | None, logits: np.ndarray, labels: np.ndarray, num_classes: int
) -> ClassKnowledge:
    """Per-class knowledge of a dataset's features (optional) and logits.

    Parameters
    ----------
    features : np.ndarray | None
        ``(N, feature_dim)`` features, or ``None`` for logits only.
    logits : np.ndarray
        ``(N, num_classes)`` logits.
    labels : np.ndarray
        ``(N,)`` labels.
    num_classes : int
        Number of classes of the task.

    Returns
    -------
    ClassKnowledge
        Means and counts of the classes present.
    """
    ids, counts, mean_logits = class_means(logits, labels, num_classes)
    mean_features = None
    if features is not None:
        _, _, mean_features = class_means(features, labels, num_classes)
    return ClassKnowledge(ids, counts, mean_logits, mean_features)


@torch.no_grad()
def collect_knowledge(
    model: nn.Module,
    data: ArrayDataset,
    *,
    num_classes: int,
    with_features: bool,
    device: torch.device,
    batch_size: int = 256,
) -> ClassKnowledge:
    """Run ``model`` (eval mode) over ``data`` and average features and logits per class.

    Parameters
    ----------
    model : nn.Module
        A :class:`~models.base.TesseraModel` (``forward_features``/``forward_head``).
    data : ArrayDataset
        The client's training data.
    num_classes : int
        Number of classes of the task.
    with_features : bool
        Also average the features (Felo, Velo); logits only otherwise (FedHe).
    device : torch.device
        Where the model lives.
    batch_size : int
        Inference batch size.

    Returns
    -------
    ClassKnowledge
        The client's per-class knowledge.
    """
    model.eval()
    feats: list[np.ndarray] = []
    logits: list[np.ndarray] = []
    for begin in range(0, len(data), batch_size):
        x = torch.from_numpy(data.x[begin : begin + batch_size]).to(device)
        z = model.forward_features(x)  # type: ignore[operator]
        logits.append(model.forward_head(z).cpu().numpy())  # type: ignore[operator]
        if with_features:
            feats.append(z.cpu().numpy())
    return knowledge_from_arrays(
        np.concatenate(feats) if with_features else None,
        np.concatenate(logits),
        data.y,
        num_classes,
    )


def content_order(parts: Sequence[ClassKnowledge]) -> list[ClassKnowledge]:
    """Return ``parts`` in an order fixed by their contents, not by their arrival.

    Replies arrive in whatever order the clients finish, and node ids change from run
    to run; a consumer whose result depends on order (Velo's CVAE, trained on the
    rows in the order they were banked) takes them in the order of a digest of their
    bytes, so a seeded run reproduces.

    Examples
    --------
    >>> a = ClassKnowledge(np.array([0]), np.array([1]), np.zeros((1, 2), np.float32))
    >>> b = ClassKnowledge(np.array([1]), np.array([1]), np.ones((1, 2), np.float32))
    >>> content_order([a, b]) == content_order([b, a])
    True
    """

    def digest(part: ClassKnowledge) -> bytes:
        h = hashlib.sha256()
        for values in (part.class_ids, part.counts, part.logits, part.features):
            if values is not None:
                h.update(np.ascontiguousarray(values).tobytes())
        return h.digest()

    return sorted(parts, key=digest)


def cap_counts(knowledge: ClassKnowledge, max_total: float) -> ClassKnowledge:
    """Scale the class counts down so that they sum to at most ``max_total``.

    A node's counts weigh its knowledge in the count-weighted merge; this keeps
    them within the weight the round allows it (its capped
    :attr:`strategies.core.validation.ClientReply.weight`), in proportion, each count
    at least 1 (a class it reports still counts).

    Examples
    --------
    Counts (1000, 3000) capped at 40 become (10, 30).
    """
    total = int(knowledge.counts.sum())
    if total <= max_total or total <= 0:
        return knowledge
    scaled = np.maximum(1, np.floor(knowledge.counts * (max_total / total))).astype(np.int64)
    return ClassKnowledge(knowledge.class_ids, scaled, knowledge.logits, knowledge.features)


def cap_to_declared(knowledge: ClassKnowledge, declared: Sequence[int]) -> ClassKnowledge:
    """Cap each class's count at the node's handshake label count for it.

    An honest node's counts are its training labels (:func:`class_means` over the
    split whose :func:`~tessera.data.label_counts` it sent at the handshake), so they
    never exceed ``declared``. A count above it is cut to it, and a class the node
    declared none of is dropped: a node cannot weigh in on a class, or on one more
    than it said it held, by what it claims in a reply. ``knowledge`` is returned
    itself when nothing is over.

    Parameters
    ----------
    knowledge : ClassKnowledge
        A checked reply's knowledge (class ids in ``[0, len(declared))``).
    declared : Sequence[int]
        The node's handshake label counts, one per class of the task.

    Returns
    -------
    ClassKnowledge
        The knowledge within ``declared`` (possibly of no class).

    Examples
    --------
    >>> k = ClassKnowledge(np.array([0, 2, 3]), np.array([5, 9, 4]), np.eye(3, 4, dtype=np.float32))
    >>> capped = cap_to_declared(k, [5, 7, 6, 0])  # class 2 over (9 > 6), class 3 undeclared
    >>> capped.class_ids.tolist(), capped.counts.tolist(), capped.logits.shape
    ([0, 2], [5, 6], (2, 4))
    >>> cap_to_declared(k, [5, 0, 9, 4]) is k
    True
    """
    limits = np.asarray(declared, dtype=np.int64)
    ids = knowledge.class_ids
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limits.size):
        raise KnowledgeError(
            f"class ids {ids.tolist()[:10]} are outside the {limits.size} declared label counts"
        )
    allowed = limits[ids]
    if bool(np.all(knowledge.counts <= allowed)):
        return knowledge
    keep = allowed > 0
    features = None if knowledge.features is None else knowledge.features[keep]
    return ClassKnowledge(
        ids[keep],
        np.minimum(knowledge.counts, allowed)[keep],
        knowledge.logits[keep],
        features,
    )


def _lower_median(values: np.ndarray) -> float:
    ordered = np.sort(values)
    return float(ordered[(ordered.size - 1) // 2])


def knowledge_bounds(parts: Sequence[ClassKnowledge], clip_factor: float) -> dict[str, float]:
    """Return the round's own row bound per kind: ``clip_factor`` x the lower median norm.

    Per kind (logits, features), each part's lower median row norm, then the lower
    median of those: a node counts once, however many classes it claims. (A median
    over every row let one node that claimed all ten classes outnumber three that
    hold two each and set the bound with rows of 1e30.) A kind with no positive norm
    (or ``clip_factor <= 0``) has no bound.

    Examples
    --------
    >>> k = ClassKnowledge(np.array([0, 1]), np.array([1, 1]), np.array([[3.0, 4.0], [0, 1]]))
    >>> knowledge_bounds([k], 2.0)  # logits norms (5, 1): lower median 1
    {'logits': 2.0}
    """
    bounds: dict[str, float] = {}
    if clip_factor <= 0:
        return bounds
    for kind in KINDS:
        rows = [getattr(p, kind) for p in parts if getattr(p, kind) is not None]
        medians = [m for m in (node_median(row_norms(r)) for r in rows) if m is not None]
        if medians:
            bounds[kind] = clip_factor * _lower_median(np.asarray(medians))
    return bounds


def node_median(norms: np.ndarray) -> float | None:
    """Return the lower median of one node's positive row norms (``None``: none positive).

    >>> node_median(row_norms(np.array([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0]])))  # 5, 1, 0
    1.0
    """
    positive = norms[norms > 0]
    return float(_lower_median(positive)) if positive.size else None


def row_norms(values: np.ndarray) -> np.ndarray:
    """Return the float64 L2 norm of every row of ``values``."""
    return np.asarray(np.linalg.norm(values.astype(np.float64), axis=1))


def clip_knowledge(
    parts: Sequence[ClassKnowledge], bounds: Mapping[str, float]
) -> tuple[list[ClassKnowledge], list[tuple[int, str, float, float]]]:
    """Scale every row whose L2 norm exceeds its kind's bound down to that bound.

    Returns
    -------
    tuple[list[ClassKnowledge], list[tuple[int, str, float, float]]]
        The bounded parts, and one ``(part index, "logits" | "features", largest
        norm, bound)`` per part and kind that was clipped.
    """
    out: list[ClassKnowledge] = []
    clips: list[tuple[int, str, float, float]] = []
    for i, part in enumerate(parts):
        changed: dict[str, np.ndarray] = {}
        for kind, bound in bounds.items():
            values = getattr(part, kind)
            if values is None:
                continue
            as64 = values.astype(np.float64)
            norms = np.linalg.norm(as64, axis=1)
            if np.any(norms > bound):
                scale = np.minimum(1.0, bound / np.maximum(norms, 1e-300))
                changed[kind] = (as64 * scale[:, None]).astype(values.dtype)
                clips.append((i, kind, float(norms.max()), bound))
        out.append(replace(part, **changed) if changed else part)
    return out, clips


def bound_knowledge(
    parts: Sequence[ClassKnowledge], clip_factor: float
) -> tuple[list[ClassKnowledge], list[tuple[int, str, float, float]]]:
    """Clip every per-class vector to ``clip_factor`` times the cohort's median norm.

    The bounds are :func:`knowledge_bounds` (the round's own rows); a row whose L2
    norm exceeds its kind's bound is scaled down to it (:func:`clip_knowledge`), so
    no client can make every client's target arbitrarily large. ``clip_factor <= 0``
    returns the parts unchanged.

    Returns
    -------
    tuple[list[ClassKnowledge], list[tuple[int, str, float, float]]]
        The bounded parts, and one ``(part index, "logits" | "features", largest
        norm, bound)`` per part whose rows were clipped.
    """
    if clip_factor <= 0 or not parts:
        return list(parts), []
    return clip_knowledge(parts, knowledge_bounds(parts, clip_factor))


class KnowledgeSums:
    """The count-weighted per-class sums the ``mean`` merge divides: O(classes x width).

    Parameters
    ----------
    num_classes : int
        Number of classes of the task (the logit width).
    feature_dim : int | None
        Width of the features summed, or ``None`` to sum the logits alone.
    """

    def __init__(self, num_classes: int, feature_dim: int | None) -> None:
        self.counts = np.zeros(num_classes, dtype=np.int64)
        self.logits = np.zeros((num_classes, num_classes), dtype=np.float64)
        self.features = (
            None if feature_dim is None else np.zeros((num_classes, feature_dim), dtype=np.float64)
        )

    @property
    def nbytes(self) -> int:
        """Bytes the sums hold."""
        extra = 0 if self.features is None else self.features.nbytes
        return int(self.counts.nbytes + self.logits.nbytes + extra)

    def add(self, part: ClassKnowledge) -> None:
        """Add ``n_kc * row_kc`` of every class ``c`` of ``part`` (and ``n_kc`` to its count)."""
        n = part.counts.astype(np.float64)[:, None]
        self.counts[part.class_ids] += part.counts
        self.logits[part.class_ids] += n * part.logits.astype(np.float64)
        if self.features is not None:
            assert part.features is not None  # checked by the caller
            self.features[part.class_ids] += n * part.features.astype(np.float64)

    def means(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Return the classes present and their float64 mean logits (and features)."""
        present = np.flatnonzero(self.counts > 0)
        total = self.counts[present].astype(np.float64)[:, None]
        logits = self.logits[present] / total
        features = None if self.features is None else self.features[present] / total
        return present, logits, features

    def merged(self) -> ClassKnowledge:
        """Return the count-weighted means as float32 knowledge with summed counts."""
        present, logits, features = self.means()
        return ClassKnowledge(
            class_ids=present.astype(np.int64),
            counts=self.counts[present],
            logits=logits.astype(np.float32),
            features=None if features is None else features.astype(np.float32),
        )


def _robust_rows(stack: np.ndarray, rule: str, trim_fraction: float) -> np.ndarray:
    """Combine ``(k, d)`` rows of one class by ``rule`` (``median`` or ``trimmed-mean``)."""
    k = stack.shape[0]
    if rule == "trimmed-mean":
        trim = math.ceil(trim_fraction * k)
        if 2 * trim < k:
            return np.asarray(np.sort(stack, axis=0)[trim : k - trim].mean(axis=0))
    return np.asarray(np.median(stack, axis=0))


def merge_knowledge(
    parts: Sequence[ClassKnowledge],
    num_classes: int,
    *,
    rule: str = "mean",
    trim_fraction: float = 0.1,
) -> ClassKnowledge:
    """Merge several clients' per-class knowledge, class by class.

    ``rule="mean"`` (Felo's): for class ``c``, ``sum_k n_kc * mean_kc / sum_k n_kc``
    over the clients ``k`` that hold ``c``. ``"median"``: the coordinate-wise median
    of the holders' vectors, unweighted (a claimed count buys no influence).
    ``"trimmed-mean"``: per coordinate, drop the ``ceil(trim_fraction * k)`` largest
    and smallest of the ``k`` holders' values and average the rest (the median when
    too few hold the class). Classes no client holds are absent from the result;
    counts are summed. Features are merged only if every part has them.

    Parameters
    ----------
    parts : Sequence[ClassKnowledge]
        Validated client knowledge (same logit width; same feature width if any).
    num_classes : int
        Number of classes of the task.
    rule : str
        ``"mean"``, ``"median"`` or ``"trimmed-mean"`` (run-config ``knowledge-merge``).
    trim_fraction : float
        Share trimmed from each end by ``"trimmed-mean"``.

    Returns
    -------
    ClassKnowledge
        Per-class merged knowledge with summed counts.

    Raises
    ------
    KnowledgeError
        If ``parts`` is empty, the widths disagree or the rule is unknown.
    """
    if not parts:
        raise KnowledgeError("nothing to merge: no client knowledge was given")
    if rule not in ("mean", "median", "trimmed-mean"):
        raise KnowledgeError(f"unknown merge rule '{rule}'; use mean, median or trimmed-mean")
    with_features = all(p.features is not None for p in parts)
    feature_dims = {p.features.shape[1] for p in parts if p.features is not None}
    logit_dims = {p.logits.shape[1] for p in parts}
    if logit_dims != {num_classes} or len(feature_dims) > 1:
        raise KnowledgeError(
            f"logit widths {sorted(logit_dims)} (expected {num_classes}) and feature "
            f"widths {sorted(feature_dims)} must agree across clients"
        )
    dim = feature_dims.pop() if feature_dims else 0
    sums = KnowledgeSums(num_classes, dim if with_features else None)
    for part in parts:
        sums.add(part)
    if rule == "mean":
        return sums.merged()
    present, logits, features = sums.means()
    for row, c in enumerate(present):
        holders = [(p, np.flatnonzero(p.class_ids == c)) for p in parts]
        rows = [(p, int(j[0])) for p, j in holders if j.size]
        logits[row] = _robust_rows(
            np.stack([p.logits[j].astype(np.float64) for p, j in rows]), rule, trim_fraction
        )
        if features is not None:
            feats = [p.features[j] for p, j in rows if p.features is not None]
            features[row] = _robust_rows(np.stack(feats).astype(np.float64), rule, trim_fraction)
    return ClassKnowledge(
        class_ids=present.astype(np.int64),
        counts=sums.counts[present],
        logits=logits.astype(np.float32),
        features=None if features is None else features.astype(np.float32),
    )


# ----------------------------------------------------------------------------- wire
def knowledge_to_record(knowledge: ClassKnowledge) -> ArrayRecord:
    """Encode knowledge as an :class:`ArrayRecord` (see the module docstring)."""
    arrays: dict[str, np.ndarray] = {
        CLASS_IDS: knowledge.class_ids.astype(np.int64),
        COUNTS: knowledge.counts.astype(np.int64),
        LOGITS: knowledge.logits.astype(np.float32),
    }
    if knowledge.features is not None:
        arrays[FEATURES] = knowledge.features.astype(np.float32)
    return wire.numpy_to_record(arrays)


def record_to_knowledge(record: ArrayRecord) -> ClassKnowledge:
    """Decode a record written by :func:`knowledge_to_record`.

    Raises
    ------
    KnowledgeError
        If an array is missing or the parts disagree.
    """
    arrays = wire.record_to_numpy(record)
    missing = [k for k in (CLASS_IDS, COUNTS, LOGITS) if k not in arrays]
    if missing:
        raise KnowledgeError(f"knowledge record lacks {missing}")
    return ClassKnowledge(
        class_ids=arrays[CLASS_IDS],
        counts=arrays[COUNTS],
        logits=arrays[LOGITS],
        features=arrays.get(FEATURES),
    )


def check_knowledge_record(
    content: RecordDict, *, num_classes: int, feature_dim: int | None
) -> str | None:
    """Validate a client's ``knowledge`` record; return a reason to reject, or ``None``.

    Checked before any arithmetic: the record is there with exactly the expected
    arrays; class ids are a non-empty 1-d integer array of distinct values in
    ``[0, num_classes)``; counts are positive integers, one per class, summing to the
    reply's ``num-examples``; logits are ``(K, num_classes)`` and features
    ``(K, feature_dim)``, float32; every value is finite.

    Parameters
    ----------
    content : RecordDict
        The reply's records.
    num_classes : int
        Number of classes of the task.
    feature_dim : int | None
        Expected feature width, or ``None`` when no features may be sent (FedHe).

    Returns
    -------
    str | None
        Why the reply must be rejected, or ``None`` when it is fine.
    """
    if KNOWLEDGE not in content.array_records:
        return f"record '{KNOWLEDGE}' missing"
    record = content.array_records[KNOWLEDGE]
    expected = {CLASS_IDS, COUNTS, LOGITS} | ({FEATURES} if feature_dim is not None else set())
    if set(record) != expected:
        return f"'{KNOWLEDGE}' holds {sorted(record)}, expected {sorted(expected)}" + (
            "" if feature_dim is not None else " (this scheme exchanges logits only)"
        )
    try:
        arrays = wire.record_to_numpy(record)
    except Exception as err:
        return f"'{KNOWLEDGE}' cannot be decoded: {err}"
    ids, counts = arrays[CLASS_IDS], arrays[COUNTS]
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        return f"'{CLASS_IDS}' must be a non-empty 1-d integer array, got {ids.dtype}{ids.shape}"
    k = ids.shape[0]
    bad = [int(c) for c in ids if not 0 <= int(c) < num_classes]
    if bad:
        return f"class id(s) {bad[:5]} out of range [0, {num_classes})"
    if len(np.unique(ids)) != k:
        return f"class ids {ids.tolist()} repeat a class"
    if counts.shape != (k,) or counts.dtype != np.int64:
        return f"'{COUNTS}' must be {k} int64 values, got {counts.dtype}{counts.shape}"
    if np.any(counts <= 0):
        where = int(ids[int(np.argmin(counts))])
        return f"count {int(counts.min())} of class {where} is not positive"
    total = sum(int(c) for c in counts)  # Python ints: no wrap-around
    if wire.METRICS in content.metric_records:
        num = content.metric_records[wire.METRICS].get(wire.NUM_EXAMPLES)
        if isinstance(num, (int, float)) and total != int(num):
            return f"counts sum to {total} but the reply reports num-examples={num}"
    shapes = {LOGITS: (k, num_classes)}
    if feature_dim is not None:
        shapes[FEATURES] = (k, feature_dim)
    for key, shape in shapes.items():
        value = arrays[key]
        if value.shape != shape:
            what = "feature dimension" if key == FEATURES else "logit width"
            return (
                f"'{key}' has shape {value.shape}, expected {shape} ({what} "
                f"{value.shape[-1] if value.ndim else '?'} vs {shape[1]})"
            )
        if value.dtype != np.float32:  # float64 rows of 1e300 overflow their norms
            return f"'{key}' must be float32, got {value.dtype}"
        if not np.all(np.isfinite(value)):
            return f"'{key}' has non-finite values"
    return None
