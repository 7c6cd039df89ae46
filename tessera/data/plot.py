"""A picture of how the labels are spread over the clients."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import numpy.typing as npt

from tessera.data.arrays import DataError

logger = logging.getLogger(__name__)


def plot_label_distribution(label_counts: npt.ArrayLike, path: Path, *, title: str) -> None:
    """Write a stacked horizontal bar chart of labels per client as PNG.

    One bar per client, one colour per class. Up to 20 classes get a legend;
    more classes get a colour bar instead.

    Parameters
    ----------
    label_counts : array_like of int
        ``(num_partitions, num_classes)`` counts.
    path : pathlib.Path
        Output file; parent directories are created.
    title : str
        Figure title.

    Raises
    ------
    DataError
        If ``label_counts`` is not a non-empty 2-D array of counts >= 0.
    """
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    counts = np.asarray(label_counts)
    if (
        counts.ndim != 2
        or counts.size == 0
        or counts.dtype.kind not in "iuf"
        or not np.isfinite(counts).all()
        or (counts < 0).any()
    ):
        raise DataError(
            f"label_counts has shape {counts.shape} and dtype {counts.dtype}; pass a "
            "non-empty (num_partitions, num_classes) array of counts >= 0"
        )
    num_clients, num_classes = counts.shape
    if num_classes <= 10:
        cmap = colormaps["tab10"]
    elif num_classes <= 20:
        cmap = colormaps["tab20"]
    else:
        cmap = colormaps["viridis"]
    colours = (
        [cmap(c) for c in range(num_classes)]
        if num_classes <= 20
        else [cmap(c / max(num_classes - 1, 1)) for c in range(num_classes)]
    )
    fig = Figure(figsize=(9.0, max(2.5, 0.3 * num_clients + 1.5)))
    ax = fig.add_subplot()
    clients = np.arange(num_clients)
    left = np.zeros(num_clients)
    for cls in range(num_classes):
        ax.barh(
            clients,
            counts[:, cls],
            left=left,
            color=colours[cls],
            label=str(cls),
            height=0.8,
        )
        left += counts[:, cls]
    step = 1 if num_clients <= 50 else num_clients // 25
    ax.set_yticks(clients[::step])
    ax.invert_yaxis()
    ax.set_xlabel("samples")
    ax.set_ylabel("client (partition id)")
    ax.set_title(title)
    if num_classes <= 20:
        ax.legend(
            title="class",
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            ncol=1 if num_classes <= 10 else 2,
            fontsize="small",
        )
    else:
        mappable = ax.scatter([], [], c=[], cmap=cmap, vmin=0, vmax=num_classes - 1)
        fig.colorbar(mappable, ax=ax, label="class")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)
    logger.info("wrote label distribution plot %s", path)
