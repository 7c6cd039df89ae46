"""FedHeNN's payload schema: record and config keys, and the checks on what a client sends back."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import RecordDict

from strategies.core.validation import ClientReply
from tessera import wire

ALIGN = "fedhenn.align"


PROBE = "fedhenn.probe"


REP = "fedhenn.rep"


STATS = "fedhenn.stats"


ETA_KEY = "fedhenn-eta"


MODE_KEY = "fedhenn-mode"


RAD_ROUND_KEY = "fedhenn-rad-round"


STATE_PROBE = "fedhenn.probe-rad"
"""Node state: the last probe RAD (``x``) this node represented."""


STATE_PROBE_META = "fedhenn.probe-rad-meta"
"""Node state: ``round`` of that probe."""


STAT_ALIGN_SECONDS = "alignment-seconds"


STAT_SETUP_SECONDS = "setup-seconds"


STAT_REP_SECONDS = "rep-seconds"


STAT_STEPS = "alignment-steps"


STAT_CKA = "cka-mean"


REQUIRED_STATS = (STAT_ALIGN_SECONDS, STAT_SETUP_SECONDS, STAT_REP_SECONDS, STAT_STEPS)


MIN_RAD_ROWS = 4
"""CKA needs a few samples (the unbiased estimator at least 4)."""


def _stats_problem(content: RecordDict) -> str | None:
    if STATS not in content.metric_records:
        return f"record '{STATS}' missing"
    record = content.metric_records[STATS]
    for key in REQUIRED_STATS:
        if key not in record:
            return f"metric '{key}' missing from the '{STATS}' record"
    for key, value in record.items():
        if isinstance(value, list) or not math.isfinite(float(value)):
            return f"'{STATS}' metric '{key}' must be a finite number, got {value!r}"
    return None


def representation_problem(content: RecordDict, *, rows: int, dim: int) -> str | None:
    """Check a reply's representation of the probe RAD; return a reason to reject.

    Parameters
    ----------
    content : RecordDict
        The reply's records.
    rows : int
        Rows of the probe RAD sent this round.
    dim : int
        The node's architecture's ``feature_dim``.

    Returns
    -------
    str | None
        Why the representation is unusable, or ``None``.
    """
    if REP not in content.array_records or "rep" not in content.array_records[REP]:
        return f"record '{REP}' with array 'rep' missing (the RAD representation)"
    try:
        rep = content.array_records[REP]["rep"].numpy()
    except Exception as err:
        return f"representation cannot be decoded: {err}"
    if rep.ndim != 2 or rep.shape[1] != dim:
        return f"representation has shape {rep.shape}, expected ({rows}, {dim})"
    if rep.shape[0] != rows:
        return f"representation has {rep.shape[0]} rows but the RAD has {rows}"
    if not np.issubdtype(rep.dtype, np.floating):
        return f"representation has dtype {rep.dtype}, expected floating point"
    values = rep.astype(np.float64)
    if not np.all(np.isfinite(values)):
        return "representation has non-finite values"
    if float(np.linalg.norm(values - values.mean(axis=0, keepdims=True))) <= 1e-12:
        return "representation has zero norm after centring (all RAD samples map to one point)"
    return None


def _stat(reply: ClientReply, key: str) -> float:
    return wire.float_value(reply.content.metric_records[STATS], key)


def alignment_metrics(replies: Sequence[ClientReply], eta: float) -> dict[str, Any]:
    """Round metrics on the clients' alignment work (from validated replies)."""
    per_client = []
    align_total, busy_total = 0.0, 0.0
    ckas = []
    for rep in sorted(replies, key=lambda r: r.node_id):
        align = _stat(rep, STAT_ALIGN_SECONDS)
        setup = _stat(rep, STAT_SETUP_SECONDS) + _stat(rep, STAT_REP_SECONDS)
        train = rep.metrics[wire.TRAIN_SECONDS]
        entry: dict[str, Any] = {
            "node": rep.node_id,
            "alignment_seconds": align,
            "setup_seconds": setup,
            "alignment_steps": int(_stat(rep, STAT_STEPS)),
            "alignment_share": (align + setup) / max(train + setup, 1e-12),
        }
        if STAT_CKA in rep.content.metric_records[STATS]:
            entry["cka"] = _stat(rep, STAT_CKA)
            ckas.append(entry["cka"])
        per_client.append(entry)
        align_total += align + setup
        busy_total += train + setup
    return {
        "eta": eta,
        "alignment_seconds": align_total / max(len(per_client), 1),
        "alignment_share": align_total / busy_total if busy_total > 0 else 0.0,
        "cka_mean": float(np.mean(ckas)) if ckas else None,
        "fedhenn_clients": per_client,
    }
