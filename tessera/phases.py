"""Where a node's part of a round goes: the phases a train reply reports.

A deployed round is the server's send, the SuperNode's pull wait, the ClientApp's
start and imports, data, the model, training, evaluation, the reply's records, and
the way back. The ClientApp measures its own share and sends it as reply metrics
``phase-<name>`` (seconds); the server adds the way back (the reply's creation to
its pull) and :mod:`strategies.core.record` writes them per node into
``metrics.jsonl`` (``clients[i].phases``) and as a round mean
(``client_phase_seconds``).

- ``queued``: from the instruction's creation on the server to this process's start
  (a fresh ClientApp per message, as the SuperNode's subprocess isolation runs it),
  or to the handler's entry (a long-lived process: a simulation's Ray actor, a
  process-isolation executor): the server's push, the SuperNode's pull interval,
  and the spawn;
- ``start``: the fresh process's start to the handler's entry (Python, imports,
  Flower loading the app; 0 for a long-lived process);
- ``data``, ``model``, ``train``, ``evaluate``, ``reply``: the handler's own steps
  (:class:`PhaseClock`); ``reply`` is the scheme's reply records (serialising the
  weights) and saving the node state.

``queued`` and the server's ``return`` compare two machines' wall clocks: across
devices whose clocks disagree they are clamped at 0 and only as good as the clocks.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

CLIENT_PHASES = ("queued", "start", "data", "model", "train", "evaluate", "reply")
"""The phases a ClientApp reports, in the order they happen."""

RETURN = "return"
"""The server's phase of a reply: its creation at the node to its pull at the server."""

MAX_PHASE_SECONDS = 1e6
"""Largest value a reply's phase may take (about 11 days): more is a bad reply."""


def metric_key(phase: str) -> str:
    """Return the reply metric of ``phase`` (``phase-<name>``)."""
    return f"phase-{phase}"


PHASE_METRICS = tuple(metric_key(p) for p in CLIENT_PHASES)
"""The reply metrics of :data:`CLIENT_PHASES`."""


class PhaseClock:
    """Laps of a monotonic clock: :meth:`lap` charges the time since the last lap.

    Parameters
    ----------
    clock : Callable[[], float]
        Seconds from a monotonic source (``time.monotonic``; tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap (or the start) to ``phase``."""
        now = self._clock()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + (now - self._last)
        self._last = now


def process_start_time(proc: Path = Path("/proc"), *, now: float | None = None) -> float | None:
    """Return this process's start as a UNIX time, or ``None`` where ``/proc`` lacks it.

    Linux: field 22 of ``/proc/self/stat`` (clock ticks after boot) plus the boot's
    UNIX time, taken as ``now`` minus ``/proc/uptime`` (to its 10 ms). ``btime`` of
    ``/proc/stat``, the fallback, holds whole seconds only: it put every start up to
    a second early (0.72 s on the benchmark machine), which counted part of
    ``queued`` as ``start``.

    Parameters
    ----------
    proc : Path
        The proc file system.
    now : float | None
        The current UNIX time (``None``: ``time.time()``).

    Returns
    -------
    float | None
        The start, or ``None`` if ``proc`` does not tell it.
    """
    try:
        stat = (proc / "self" / "stat").read_text()
        # the command name (field 2) may hold spaces and parentheses: split after it
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks = int(fields[19])
    except (OSError, ValueError, IndexError):
        return None
    try:
        uptime = float((proc / "uptime").read_text().split()[0])
        boot = (time.time() if now is None else now) - uptime
    except (OSError, ValueError, IndexError):
        try:
            boot = next(
                int(line.split()[1])
                for line in (proc / "stat").read_text().splitlines()
                if line.startswith("btime ")
            )
        except (OSError, ValueError, IndexError, StopIteration):
            return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def arrival_phases(
    created_at: float, entered_at: float, started_at: float | None
) -> dict[str, float]:
    """Split an instruction's creation to the handler's entry into ``queued`` and ``start``.

    Parameters
    ----------
    created_at : float
        The instruction's creation on the server (UNIX time, its metadata).
    entered_at : float
        The handler's entry (UNIX time).
    started_at : float | None
        This process's start (UNIX time), or ``None`` if unknown.

    Returns
    -------
    dict[str, float]
        ``queued`` and ``start``, each at least 0. A process started after the
        instruction was created is a fresh one per message: ``queued`` runs to its
        start and ``start`` from there; otherwise the process was waiting already
        and ``queued`` runs to the entry (``start`` 0).
    """
    if not (math.isfinite(created_at) and math.isfinite(entered_at)):
        return {"queued": 0.0, "start": 0.0}
    if started_at is not None and math.isfinite(started_at) and started_at > created_at:
        started = min(started_at, entered_at)
        return {"queued": started - created_at, "start": entered_at - started}
    return {"queued": max(0.0, entered_at - created_at), "start": 0.0}


def return_seconds(reply_created_at: float, pulled_at: float) -> float:
    """Return the reply's way back: its creation at the node to its pull (at least 0)."""
    if not (math.isfinite(reply_created_at) and math.isfinite(pulled_at)):
        return 0.0
    return max(0.0, pulled_at - reply_created_at)
