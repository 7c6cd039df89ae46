"""Cut a sub-model out of the global model (FedFA Algorithm 3, HeteroFL's prefix slice)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from models.spec import (
    Layout,
    SubModelError,
    SubModelSpec,
    section_depths,
    sub_shape,
)
from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import Index


def prefix_index(shape: tuple[int, ...]) -> Index:
    """Return the index of the channel prefix of ``shape`` inside a larger entry."""
    return tuple(slice(0, n) for n in shape)


def _check_depths(spec: SubModelSpec, depths: tuple[int, ...], layout: Layout) -> None:
    if len(spec.depths) != len(depths):
        raise SubModelError(
            f"spec keeps blocks of {len(spec.depths)} sections {spec.depths} but the global "
            f"model has {len(depths)} sections {depths}; give one count per section"
        )
    for s, (kept, total) in enumerate(zip(spec.depths, depths, strict=True)):
        if kept > total:
            raise SubModelError(
                f"spec keeps {kept} blocks of section {s}, which has {total}; keep at most {total}"
            )
        least = min(layout.min_depth, total)
        if kept < least:
            raise SubModelError(
                f"spec keeps {kept} block(s) of section {s}; this family needs at least "
                f"{least} (Layout.min_depth) so that grafting can restore the section"
            )


def _check_roles(global_state: Mapping[str, np.ndarray], layout: Layout) -> None:
    unknown = sorted((layout.keep_inputs | layout.keep_outputs) - set(global_state))
    if unknown:
        raise SubModelError(
            f"Layout names {unknown} in keep_inputs/keep_outputs but the global model has "
            f"no such entries; fix the keys"
        )


def extract(
    global_state: Mapping[str, np.ndarray],
    spec: SubModelSpec,
    layout: Layout,
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Index]]:
    """Return the sub-model ``spec`` of the global model and where each entry sits in it.

    Each section keeps its first ``spec.depths[s]`` blocks (the last ones are
    dropped), then every kept entry is cut to the channel prefix ``[:c_out, :c_in]``
    (:func:`~models.spec.sub_shape`). The values are copies.

    Parameters
    ----------
    global_state : Mapping[str, np.ndarray]
        The global model's weights, every section at its full depth.
    spec : SubModelSpec
        Width ratio and blocks kept per section.
    layout : Layout
        Naming of the block entries and the entries that keep whole channels.
    shapes : Mapping[str, tuple[int, ...]], optional
        The sub-model's own entry shapes (FedFA reads ``C_I, C_O`` from the local
        model), for families whose channel counts are not ``ceil(width * n)`` (e.g.
        rounded to multiples of 8). Every kept key must be given, and no other;
        each shape must fit inside the global one. Overrides the width ratio.

    Returns
    -------
    tuple[dict[str, np.ndarray], dict[str, Index]]
        The sub-model's state dict (global key order), and per key the index (one
        slice per dimension) of its values in the global entry: what
        :meth:`strategies.core.mean.MeanAccumulator.add` takes as ``index``.

    Raises
    ------
    SubModelError
        If the spec does not fit the global model's sections, the layout names
        entries the model lacks, or ``shapes`` does not fit.
    """
    _check_roles(global_state, layout)
    _check_depths(spec, section_depths(global_state, layout), layout)
    kept: list[str] = []
    for key in global_state:
        parsed = layout.parse(key)
        if parsed is None or parsed[1] < spec.depths[parsed[0]]:
            kept.append(key)
    if shapes is not None:
        missing = sorted(set(kept) - set(shapes))
        extra = sorted(set(shapes) - set(kept))
        if missing or extra:
            raise SubModelError(
                f"shapes do not match the spec's entries: missing {missing}, not in the "
                f"sub-model {extra}"
            )
    state: dict[str, np.ndarray] = {}
    index: dict[str, Index] = {}
    for key in kept:
        value = np.asarray(global_state[key])
        full = tuple(value.shape)
        shape = (
            tuple(int(n) for n in shapes[key])
            if shapes is not None
            else sub_shape(key, full, spec.width, layout)
        )
        if len(shape) != len(full) or any(n < 1 or n > m for n, m in zip(shape, full, strict=True)):
            raise SubModelError(
                f"entry '{key}': sub-model shape {shape} does not fit inside the global {full}"
            )
        where = prefix_index(shape)
        state[key] = np.array(value[where])  # a copy; an ndarray even for 0-d entries
        index[key] = where
    return state, index


def coverage_index(
    global_state: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray]
) -> dict[str, Index]:
    """Return, per entry of a sub-model's ``state``, the index of its channel prefix.

    Raises
    ------
    AggregationError
        If an entry is unknown to the global model, has another rank, or is larger
        than the global entry in some dimension (a reply that cannot be a slice).
    """
    index: dict[str, Index] = {}
    for key, value in state.items():
        if key not in global_state:
            raise AggregationError(f"entry '{key}' is not in the global model")
        full = tuple(np.shape(global_state[key]))
        shape = tuple(np.shape(value))
        if len(shape) != len(full) or any(n > m for n, m in zip(shape, full, strict=True)):
            raise AggregationError(
                f"entry '{key}' has shape {shape}, which is not a prefix of the global {full}"
            )
        index[key] = prefix_index(shape)
    return index


def roll_channels(
    state: Mapping[str, np.ndarray], layout: Layout, shift: int = 1
) -> dict[str, np.ndarray]:
    """Return ``state`` with every channel dimension rolled by ``shift`` (FedRolex's window).

    Every dimension a width slice cuts (output channels, and input channels of
    entries with two or more dimensions; not the inputs of
    :attr:`~models.spec.Layout.keep_inputs` nor the outputs of
    :attr:`~models.spec.Layout.keep_outputs`) is rolled with ``np.roll``, so channel
    ``c`` moves to ``(c + shift) mod C``. Dimensions of equal size that meet in the
    network (a layer's outputs, the next layer's inputs, a residual sum) move the same
    way, so the model computes the same function; but the channel prefix a width
    slice takes now starts ``shift`` channels further back. Rolling the global model
    by one after every round therefore makes HeteroFL's prefix slices the rolling
    window of FedRolex (Alam et al., NeurIPS 2022) without changing extraction or
    coverage averaging.
    """
    out: dict[str, np.ndarray] = {}
    for key, value in state.items():
        array = np.asarray(value)
        axes = []
        if array.ndim >= 1 and key not in layout.keep_outputs:
            axes.append(0)
        if array.ndim >= 2 and key not in layout.keep_inputs:
            axes.append(1)
        out[key] = np.roll(array, shift, axis=tuple(axes)) if axes else array.copy()
    return out
