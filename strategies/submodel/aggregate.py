"""Averaging sub-models into the global model: coverage and FedFA's scalable aggregation.

Coverage averaging (HeteroFL, NeFL, and FedFA after grafting): every global entry
is averaged, element by element, over the clients whose slice covers it, weighted
by their examples (or uniformly); elements nobody covered keep the global value.
It is :class:`strategies.core.mean.MeanAccumulator` (``clip_factor=0``) fed with
each sub-model's channel-prefix index (``coverage_average`` in ``tests/oracles.py`` is
that, for lists).

Scalable aggregation (FedFA Algorithm 1, lines 12-22), per layer ``l`` (one
state-dict entry) and client ``c`` of the cohort, as built here::

    n_c      = || values of M_c^(l) under the 95th percentile ||_2   (the paper's norm)
    e_c      = max(n_c, || M_c^(l) ||_2 / kappa)                    (n_c when kappa = 0)
    rho      = median of the cohort's positive e_k, the largest left out
    alpha_c  = min(rho / e_c, max_factor)
    M_G^(l)  = (sum_c N_c * alpha_c * M_c^(l)) / Gamma^(l)   (element-wise)

with ``Gamma`` the example-weighted coverage and ``kappa`` run-config
``clip-factor``. The paper's factor is ``alpha_c = (1/m * sum_k n_k) / n_c``; the
two changes (the reference ``rho`` and the bound ``e_c``) are FedFA's scaling made
a bound, and are explained below after the two readings the text leaves open.

**Weights or updates** (``target``). Default ``"updates"``: ``M_c`` is the client's
update ``Delta_c = W_c - W_G[slice]``, scaled and added back, so the result is
``W_G + sum_c N_c alpha_c Delta_c / Gamma``. Reasons: the paper motivates the
scaling by step sizes ("the magnitudes of weight changes during each step ... can
differ", Section 3.3), says the factors apply "to the weight updates from each
client model" and that the averaged norm "moderates the convergence speed by
averaging the magnitude of updates" (Section 4.3), and its convergence analysis
(Appendix E) scales gradients. It is also the only reading under which an
aggregation of untrained replies leaves the global model where it was: with
``"weights"`` the factor rescales the weights themselves, and since a narrow
client's layer has fewer entries its norm is smaller by construction, so at mixed
widths its prefix is inflated and the rest shrunk every round, trained or not.
``"weights"`` follows Algorithm 1's symbols literally (``M_c^{t+1}`` is the local
model) and is there to compare.

**Percentile of what** (``trim``). Default ``"magnitude"``: keep the values whose
absolute value is at most the 95th percentile of the absolute values. The stated
purpose is to keep outliers out of an L2 norm, and a large negative value is as
much an outlier (and weighs as much in the norm) as a large positive one; a
signed percentile would keep every negative outlier and make ``n(-w) != n(w)``.
``"signed"`` keeps values at most the 95th percentile of the signed values (the
literal "under the 95th percentile"); ``"central"`` keeps the central 95 % (between
the 2.5th and 97.5th percentiles, Appendix E's "central 95% of the weights").
Percentiles are numpy's linear interpolation, and "under" is ``<=`` so that a
constant tensor keeps every value.

**The reference: never a norm that holds the client's own** (:func:`reference_norm`).
The paper's cohort mean holds every client's own norm: one client of four sending
its update times 100 raises the mean 25-fold, so every honest layer is scaled *up*
(to ``max_factor``) and the attacker's comes out at the mean, 25 honest norms
(the review measured on digits: accuracy 0.797 -> 0.281). ``rho``, the median of the
positive norms with the largest left out, is the smallest of the leave-one-out
medians ``median_{k != c} e_k``: no client is scaled to more than the median of
the *others'* norms, however large its own; each other client shifts ``rho`` by
at most one rank, so while the honest clients outnumber the others by two or more
it stays within the range of the honest norms. For
an honest cohort the median is the typical magnitude the mean stands for (the
paper's purpose, bringing every update to the cohort's scale, is kept). The exact
per-client leave-one-out median would depend on which half of the cohort a client
ends in, which a fold cannot know when the reply arrives; ``rho`` is one number per
layer, equal to the leave-one-out median of every client in the upper half and
never above anyone's, so the server still folds replies as they arrive in O(model).
A layer that fewer than two clients moved has no others to compare with: it takes
the reference of the last round that had one (``previous``), and without one its
factor is 1 (counted as *unreferenced*).

**Values hidden above the percentile** (:func:`effective_norm`). The trimmed norm
ignores the largest 5 % of a layer's values by design, so a client that moves 4 %
of every layer's coordinates to +-1e3 keeps an ordinary trimmed norm and factor ~1
(the review measured global max|w| 9970, accuracy 0.13). ``e_c >= ||M_c||_2 /
kappa`` bounds the scaled update's *full* L2 norm by ``kappa * rho`` as well as its
trimmed norm by ``rho``. An honest update's full norm is a small multiple of its
trimmed one (1.18 for normal values at the 95th percentile; on digits, preresnet
slices after one local epoch, a median of 1.2-1.3 and about 7 % of the layers
above 3: sparse last-section convolutions and 4-value normalisation layers), so
with ``kappa = 3`` nearly every honest layer keeps the paper's factor; with
``kappa = 1`` full norms are compared throughout (the trim then changes nothing);
``kappa = 0`` drops the bound (the paper's trimmed norm alone).

Only learned floating parameters are scaled. Batch-norm running statistics (a
variance times a factor is no variance) and integer entries (step counters) are
folded by the injected :class:`~strategies.core.aggregators.Aggregator` (``statistics``:
FedFA's run-config ``aggregator``, ``mean`` with ``clip-factor``), so each update's
statistics are bounded to a multiple of the cohort's median distance from the
global statistics, apart from the parameters, exactly as in every other scheme;
without one (the list functions) they are a plain coverage average. A client whose
``e_c`` is 0 (an update that did not move the layer) gets factor 1: its
contribution is the same for any factor.

Streaming: since ``alpha_c = rho / e_c``, the numerator is
``rho * sum_c (N_c / e_c) M_c`` and ``Gamma`` is the plain coverage, so an
accumulator can fold clients as they arrive keeping only the per-client norms and
multiply by ``rho`` at the end: :class:`ScalableAccumulator` (what FedFA's
server uses). The bound ``max_factor`` is not linear in ``rho``; how the
accumulator stays exact under it is in its docstring. The list form
(``scalable_aggregate`` in ``tests/oracles.py``) is the reference it is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import (
    Accumulator,
    AccumulatorReport,
    Aggregator,
    Clip,
    Index,
)
from strategies.core.mean import MeanAccumulator
from strategies.core.measure import measure_and_fold, squared_distance
from strategies.core.sums import Coverage, EntrySums, add_scaled, check_update
from strategies.submodel.extract import coverage_index
from strategies.submodel.norms import (
    TARGETS,
    TRIMS,
    Target,
    Trim,
    effective_norm,
    is_scaled,
    norms_of,
    reference_norm,
)

CANDIDATE_MARGIN = 2.0
"""How far under the running cap threshold a layer's norm may be and still be kept.

:class:`ScalableAccumulator` keeps a client's layer (instead of folding it) when its
norm is under ``CANDIDATE_MARGIN * running_reference / max_factor``: only such
layers can end up capped unless the layer's reference grows more than
``CANDIDATE_MARGIN``-fold after the client's reply."""


def zero_layer_norm(reference: Mapping[str, np.ndarray], scaled: Iterable[str], size: int) -> float:
    """Return the L2 norm of ``size`` values at the scaled layers' root mean square value.

    The yardstick of a layer whose own norm is 0 (``ScalableAccumulator``'s ceiling):
    ``sqrt(size)`` times the root mean square of every scaled layer's values, a scale
    no client sets. 0 when every scaled layer is 0.

    >>> ref = {"a": np.full(4, 2.0), "b": np.zeros(9)}
    >>> zero_layer_norm(ref, ["a", "b"], 9)  # RMS sqrt(16 / 13), times sqrt(9)
    3.328201177351375
    """
    total = count = 0.0
    for key in scaled:
        values = reference[key]
        total += float(np.sum(np.square(values, dtype=np.float64)))
        count += values.size
    return math.sqrt(total / count * size) if count > 0 and total > 0 else 0.0


class ScalableAccumulator:
    """FedFA's scalable aggregation, folded one (grafted) client at a time.

    Equal, within float32 rounding, to ``scalable_aggregate`` (``tests/oracles.py``) of the same
    clients (with ``statistics`` left out), without keeping their states. Per
    scaled layer ``l`` it holds, in the entry's precision and in place
    (:class:`~strategies.core.sums.EntrySums`)::

        P_l = sum_{c: e_c > 0} (N_c / e_c) X_c     (X: the update, or the weights)
        S_l = sum_{c: e_c = 0} N_c X_c              (factor 1)
        Gamma_l = sum_c N_c                          (element-wise coverage)

    plus each client's norm ``e_c`` (a float), and at the end sets
    ``M_G = rho_l * P_l + S_l`` over ``Gamma_l`` (added to the global weights for
    ``"updates"``), ``rho_l`` the layer's reference (:func:`reference_norm`). Entries
    that are not scaled (batch-norm statistics, counters) go to the accumulator of
    ``statistics`` (bounded there), or a plain coverage mean without one.

    The factor bound ``max_factor`` (``alpha_c = min(rho_l / e_c, max_factor)``)
    depends on the final reference, which is known only at the end, and no bounded
    state can decide it for every client afterwards. A client's layer whose norm is
    under ``CANDIDATE_MARGIN`` times the running threshold ``rho / max_factor``
    is therefore kept apart and folded with its exact factor at the end; memory is
    O(model) plus those layers (updates far smaller than the cohort's, such as a
    narrow slice's normalisation layer; none in ``benchmarks/aggregation.py``).
    Should the final reference cap a layer that was already folded (it grew over
    ``CANDIDATE_MARGIN``-fold after the layer arrived), ``P_l`` is multiplied by
    ``max_factor`` times the smallest folded norm instead of ``rho_l``: no factor
    exceeds ``max_factor``, the folded layers' factors all shrink by the same
    ratio, and :attr:`late_caps` counts the client layers that were capped late
    (the round record's ``late_capped_layers``).

    Parameters
    ----------
    global_state : Mapping[str, np.ndarray]
        The current global weights.
    target, percentile, trim, max_factor, clip_factor
        As FedFA's scalable aggregation (module docstring): what is scaled, the
        values kept for the norm and which, the largest factor, ``kappa`` of
        :func:`effective_norm`.
    previous : Mapping[str, float], optional
        Per layer, the reference of the last round that had one (:attr:`references`
        of that round): the scale of a layer fewer than two clients move.
    statistics : Aggregator, optional
        Folds the entries that are not scaled (the scheme's run-config
        ``aggregator``, which bounds batch-norm statistics); a plain coverage mean
        when omitted.
    previous_statistics : AccumulatorReport, optional
        The last round's :meth:`report`, for a ``statistics`` bound carried over.
    direction : Mapping[str, np.ndarray], optional
        The server's own update of the global model on its pool
        (:meth:`~strategies.core.strategy.HeteroStrategy.pool_direction`). A client whose
        scaled layers' update (its slice of them, grafted) has cosine at most
        ``threshold`` with the same slice of it is dropped whole, before anything
        is folded (:attr:`dropped`): scaling fixes a layer's size, not its direction.
    threshold : float
        Run-config ``trust-threshold`` (default 0).
    ceiling : float
        Run-config ``clip-ceiling``: a layer with no reference (one client moved it,
        no earlier round had one) is scaled to at most this multiple of the global
        layer's own L2 norm (0: no ceiling, factor 1).
    """

    def __init__(
        self,
        global_state: Mapping[str, np.ndarray],
        *,
        target: Target = "updates",
        percentile: float = 95.0,
        trim: Trim = "magnitude",
        max_factor: float = math.inf,
        clip_factor: float = 0.0,
        previous: Mapping[str, float] | None = None,
        statistics: Aggregator | None = None,
        previous_statistics: AccumulatorReport | None = None,
        direction: Mapping[str, np.ndarray] | None = None,
        threshold: float = 0.0,
        ceiling: float = 0.0,
    ) -> None:
        if target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
        if trim not in TRIMS:
            raise ValueError(f"trim must be one of {', '.join(TRIMS)}, got {trim!r}")
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile!r}; FedFA uses 95")
        if not max_factor >= 1:
            raise ValueError(f"max_factor must be >= 1, got {max_factor!r}")
        effective_norm(0.0, 0.0, clip_factor)  # checks clip_factor
        self.reference = dict(global_state)
        self.target: Target = target
        self.percentile = float(percentile)
        self.trim: Trim = trim
        self.max_factor = float(max_factor)
        self.clip_factor = float(clip_factor)
        self.previous = {
            k: float(v) for k, v in (previous or {}).items() if math.isfinite(v) and v > 0
        }
        self._scaled = frozenset(k for k, v in self.reference.items() if is_scaled(k, v))
        plain = {k: v for k, v in self.reference.items() if k not in self._scaled}
        self._plain: Accumulator = (
            MeanAccumulator(plain)
            if statistics is None
            else statistics.accumulator(plain, previous=previous_statistics)
        )
        self._plain_clients: list[int] = []
        self._inverse = EntrySums(self.reference)
        self._unit = EntrySums(self.reference)
        self._cover = Coverage(self.reference)
        self._norms: dict[str, list[float]] = {}
        self._kept: dict[str, list[tuple[np.ndarray, Index | None, float, float]]] = {}
        self._smallest: dict[str, float] = {}
        self._count = 0
        self.late_caps = 0
        """Folded layers the final reference capped (they kept the uncapped factor)."""
        self.capped = 0
        """Client layers whose factor ``rho / norm`` exceeds ``max_factor``."""
        self.norm_bounded = 0
        """Client layers scaled by their full norm: values hidden above the percentile."""
        self.unreferenced = 0
        """Layers fewer than two clients moved, with no earlier reference: factor 1."""
        self.references: dict[str, float] = {}
        """Per layer, the reference this round computed (:func:`reference_norm`)."""
        self.ceiling = float(ceiling) if math.isfinite(ceiling) and ceiling > 0 else 0.0
        self.direction = None if direction is None else dict(direction)
        self.threshold = float(threshold)
        self.dropped: list[tuple[int, float]] = []
        """``(call number, cosine)`` of each client the direction check dropped."""
        self._calls = 0

    @property
    def count(self) -> int:
        """Number of clients folded in so far."""
        return self._count

    def _reference(self, key: str, norms: Sequence[float]) -> float | None:
        ref = reference_norm(norms)
        return self.previous.get(key) if ref is None else ref

    def _ceiling(self, key: str) -> float:
        """Return the most a layer with no reference may be scaled to (``inf``: no ceiling).

        ``clip-ceiling`` x the global layer's own L2 norm; for a layer whose norm is 0
        (a batch-norm bias as every model starts it, a layer no round moved yet),
        ``clip-ceiling`` x the norm it would have at the scaled layers' root mean
        square value (:func:`zero_layer_norm`): without it, one node alone in a first
        round set such a layer to 1e30.
        """
        if self.ceiling <= 0:
            return math.inf
        ref = self.reference[key]
        layer = float(np.sqrt(np.sum(np.square(ref, dtype=np.float64))))
        if layer <= 0:
            layer = zero_layer_norm(self.reference, self._scaled, int(ref.size))
        return self.ceiling * layer if layer > 0 else math.inf

    def add(
        self,
        state: Mapping[str, np.ndarray],
        weight: float = 1.0,
        *,
        index: Mapping[str, Index] | None = None,
        direction: Mapping[str, np.ndarray] | None = None,
        stretch: float = 1.0,
    ) -> None:
        """Fold one client's (grafted) state, weighted by ``weight`` (its examples).

        ``direction``: the server's own update of the client's slice (grafted like
        the state), compared with instead of the cut of the accumulator's direction.
        ``stretch``: passed to the accumulator of the entries FedFA does not scale
        (batch-norm statistics; :meth:`Accumulator.add`); the scaled layers are
        bounded by their norms.

        Raises
        ------
        AggregationError
            If the weight is not finite and positive, an entry does not fit the
            global model, or a norm is not finite; nothing is folded then.
        """
        w = float(weight)
        if not math.isfinite(w) or w <= 0:
            raise AggregationError(f"weight {weight!r} must be finite and positive")
        where = coverage_index(self.reference, state) if index is None else index
        checked = check_update(self.reference, state, where)
        call, self._calls = self._calls, self._calls + 1
        cosine = self._cosine(checked, direction)
        if cosine is not None and cosine <= self.threshold:
            self.dropped.append((call, cosine))
            return
        norms: dict[str, float] = {}
        bounded = 0
        for key, (value, at) in checked.items():
            if key in self._scaled:  # every norm first: a bad one folds nothing
                trimmed, full = norms_of(
                    self._values(key, value, at), percentile=self.percentile, trim=self.trim
                )
                if not (math.isfinite(trimmed) and math.isfinite(full)):
                    raise AggregationError(
                        f"layer '{key}' has norm {full!r}; norms are finite and >= 0"
                    )
                norms[key] = effective_norm(trimmed, full, self.clip_factor)
                bounded += norms[key] > trimmed
        plain = {k: v for k, (v, _) in checked.items() if k not in norms}
        if plain:
            self._plain.add(
                plain,
                w,
                index={k: i for k, (_, i) in checked.items() if i is not None and k in plain},
                stretch=stretch,
            )
            self._plain_clients.append(self._count)
        self.norm_bounded += bounded
        for key, n in norms.items():
            value, at = checked[key]
            seen = self._norms.setdefault(key, [])
            seen.append(n)
            self._cover.add(key, w, at)
            x = self._values(key, value, at)  # the update again: one entry at a time
            if n == 0:
                self._unit.add(key, x, w, at)
                continue
            running = self._reference(key, seen)
            if n * self.max_factor < CANDIDATE_MARGIN * (n if running is None else running):
                self._kept.setdefault(key, []).append((x if x is not value else x.copy(), at, w, n))
            else:
                self._inverse.add(key, x, w / n, at)
                self._smallest[key] = min(self._smallest.get(key, math.inf), n)
        self._count += 1

    def _cosine(
        self,
        checked: Mapping[str, tuple[np.ndarray, Index | None]],
        own: Mapping[str, np.ndarray] | None = None,
    ) -> float | None:
        """Cosine of the client's scaled layers' update with the direction (``None``: none).

        ``own`` (the slice's own direction, entries shaped like the client's; finite,
        as :meth:`~strategies.core.strategy.HeteroStrategy.pool_direction` returns it) is used
        where it has an entry of the right shape; else the cut of the accumulator's
        direction.
        """
        if self.direction is None:
            return None
        dot = square = norm2 = 0.0
        for key, (value, at) in checked.items():
            if key not in self._scaled or key not in self.direction:
                continue
            ref, along = self.reference[key], self.direction[key]
            base = ref if at is None else ref[at]
            mine = None if own is None else own.get(key)
            if mine is not None and mine.shape == value.shape and mine.dtype == value.dtype:
                part = np.ascontiguousarray(mine)
            else:
                part = along if at is None else along[at]
            _, square, toward = measure_and_fold(value, base, None, 0.0, square, None, None, part)
            dot += toward
            norm2 += squared_distance(part, np.zeros_like(part))
        if square <= 0 or norm2 <= 0 or not math.isfinite(square * norm2):
            return None
        return max(-1.0, min(1.0, dot / math.sqrt(square * norm2)))

    def _values(self, key: str, value: np.ndarray, at: Index | None) -> np.ndarray:
        if self.target == "weights":
            return value
        ref = self.reference[key]
        delta: np.ndarray = np.subtract(value, ref if at is None else ref[at])
        return delta

    def result(self) -> dict[str, np.ndarray]:
        """Return the new global weights.

        Raises
        ------
        AggregationError
            If no client was folded.
        """
        if self._count == 0:
            raise AggregationError("nothing to aggregate: no state was given")
        out = self._plain.result() if self._plain.count else {}
        for key, ref in self.reference.items():
            if key not in self._norms:
                if key not in out:
                    out[key] = ref.copy()
                continue
            norms = self._norms[key]
            own = reference_norm(norms)
            if own is not None:
                self.references[key] = own
            rho = self._reference(key, norms)
            cap = math.inf
            if rho is None:
                # fewer than two clients moved the layer (at most one is folded) and no
                # earlier round gives a scale: factor 1, its own norm as the multiplier,
                # but never past the ceiling, a scale no client sets (clip-ceiling x the
                # global layer's own norm): a lone node's first round is bounded too
                self.unreferenced += 1
                cap = self._ceiling(key)
            total = self._inverse.pop(key)
            smallest = self._smallest.get(key, math.inf)
            # min(rho, max_factor * smallest folded norm): rho itself unless a folded layer
            # turns out capped; then no folded factor exceeds max_factor
            total *= min(smallest, cap) if rho is None else min(rho, self.max_factor * smallest)
            if key in self._unit.sums:
                total += self._unit.pop(key)
            kept_capped = 0
            for x, at, w, n in self._kept.pop(key, []):
                factor = min(1.0, cap / n) if rho is None else rho / n
                if factor > self.max_factor:
                    factor = self.max_factor
                    kept_capped += 1
                add_scaled(total if at is None else total[at], x, w * factor)
            capped = (
                0 if rho is None else sum(1 for n in norms if n > 0 and rho / n > self.max_factor)
            )
            self.capped += capped
            self.late_caps += capped - kept_capped
            out[key] = self._cover.divide(key, total, offset=self.target == "updates")
        return {key: out[key] for key in self.reference}

    def report(self) -> AccumulatorReport:
        """Return the statistics' report, clips numbered in client fold order (after result)."""
        if not self._plain.count:
            return AccumulatorReport()
        inner = self._plain.report()
        clips = tuple(
            Clip(
                self._plain_clients[c.position]
                if c.position < len(self._plain_clients)
                else c.position,
                c.kind,
                c.distance,
                c.bound,
            )
            for c in inner.clips
        )
        return AccumulatorReport(medians=dict(inner.medians), clips=clips)
