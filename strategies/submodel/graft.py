"""Layer grafting (FedFA Algorithm 2): bring a shallow sub-model to the global depth."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from models.spec import Layout, SubModelError, section_depths


def graft(
    state: Mapping[str, np.ndarray], layout: Layout, max_depths: Sequence[int]
) -> dict[str, np.ndarray]:
    """Repeat each section's last block until the section has ``max_depths[s]`` blocks.

    Block ``d-1`` of a section with ``d`` blocks is copied to blocks ``d .. D-1``
    (keys renamed ``{prefix}.{s}.{b}.<param>``); the width is left as it is, so the
    result has the global model's keys at the client's width. A section already at
    full depth, and every key outside the sections, is kept unchanged (copied).
    Grafted entries follow their section's last block in the key order.

    Parameters
    ----------
    state : Mapping[str, np.ndarray]
        A sub-model's weights (its sections' first blocks).
    layout : Layout
        Naming of the block entries.
    max_depths : Sequence[int]
        The global model's blocks per section.

    Returns
    -------
    dict[str, np.ndarray]
        The full-depth state dict.

    Raises
    ------
    SubModelError
        If the sections do not match ``max_depths`` in number, a section is deeper
        than the global one, or a section to graft is shallower than
        ``layout.min_depth`` (its last block cannot stand in for the others).
    """
    depths = section_depths(state, layout)
    targets = tuple(int(d) for d in max_depths)
    if len(depths) != len(targets):
        raise SubModelError(
            f"the sub-model has {len(depths)} sections {depths} but max_depths gives "
            f"{len(targets)} {targets}; give the global model's blocks per section"
        )
    for s, (depth, target) in enumerate(zip(depths, targets, strict=True)):
        if depth > target:
            raise SubModelError(
                f"section {s} has {depth} blocks, more than the global {target}; the "
                f"sub-model is not a slice of this global model"
            )
        if depth < target and depth < layout.min_depth:
            raise SubModelError(
                f"section {s} has {depth} block(s); grafting it needs at least "
                f"{layout.min_depth} (Layout.min_depth), its last block differs from the rest"
            )
    last_key: dict[int, str] = {}
    for key in state:
        parsed = layout.parse(key)
        if parsed is not None and parsed[1] == depths[parsed[0]] - 1:
            last_key[parsed[0]] = key
    out: dict[str, np.ndarray] = {}
    for key, value in state.items():
        out[key] = np.array(value, copy=True)
        parsed = layout.parse(key)
        if parsed is None or last_key.get(parsed[0]) != key:
            continue
        s = parsed[0]
        last = depths[s] - 1
        block = [
            (p[2], v) for k, v in state.items() if (p := layout.parse(k)) and p[:2] == (s, last)
        ]
        for b in range(depths[s], targets[s]):
            for rest, block_value in block:
                out[layout.key(s, b, rest)] = np.array(block_value, copy=True)
    return out
