"""Flower's SuperNode with paced pulls: a round's message is picked up in a fraction of a second.

In Flower 1.30 the SuperNode's main loop (``flwr/supernode/start_client_internal.py``,
``start_client_internal``) pulls a message from the SuperLink, runs it, pushes the
reply and pulls again. When a pull brings nothing it sleeps **3 s**
(``time.sleep(3)``), so the next round's message, sent while it sleeps, waits for the
end of that sleep: 2.0 s of a deployed round's 4.9 s here (``queued`` in
``benchmarks/overhead.py``). While the ClientApp runs, the SuperNode looks for its
reply every **0.5 s** (``_push_messages``), and waits as long between looks for the
reply's objects: another 0.25 s a round on average (in ``return``).

This launcher runs Flower's own ``flower-supernode`` (same arguments, same code) with
these pauses changed:

- **Paced pulls.** After an empty pull it sleeps ``--pull-min`` (0.1 s), then 1.5
  times longer after each further empty pull, up to ``--pull-max`` (Flower's 3 s);
  any message pulled starts the pacing again. A node waiting for its next round pulls
  often while a round is under way and falls back to Flower's pace when the
  federation is idle: a SuperNode idle for a minute has made about 26 pulls instead
  of 20 (:func:`pulls_within`).
- **Short waits for the reply**: ``--reply-wait`` (0.05 s) instead of 0.5 s. These
  look at the SuperNode's own in-memory state, not the network.
- **A short first object-pull backoff** (``--object-backoff``, 0.02 s instead of
  Flower's 1 s ``PULL_INITIAL_BACKOFF``, still doubling to Flower's cap). The
  SuperNode offers a task to its ClientApp, then pulls the message's objects from the
  SuperLink; when one is not there yet (the server pushes a message before its
  objects), Flower waits a second before asking again, and the ClientApp waits with
  it: its message pull took 1.3-1.5 s in 2 of 12 tasks of one deployed run, 0.02-0.2 s
  in the others.

The first two are module-level sleeps of Flower's code, changed by giving that
module a ``time`` whose ``sleep`` maps those two pauses (:class:`PacedTime`); every
other call goes to :mod:`time`. The third is the default of a keyword of Flower's
``pull_objects`` (:func:`shorten_object_pulls`). Applied only to the Flower release
it was written against (:data:`FLOWER_VERSION`); any other runs Flower's SuperNode
unchanged, with a log line saying so.

This file imports only the standard library and Flower, so the images copy it alone
(``/usr/local/lib/tessera/supernode.py``) and run it as a script.

Usage (every ``flower-supernode`` argument is passed on)::

    python -m tessera.supernode [--pull-min 0.1] [--pull-max 3] [--reply-wait 0.05]
        [--object-backoff 0.02] --insecure --superlink 127.0.0.1:9092 --isolation process ...
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger("flwr.tessera.supernode")

FLOWER_VERSION = "1.30.0"
"""The Flower release whose SuperNode loop this was written against."""
FLOWER_PULL_PAUSE = 3.0
"""Flower's pause after an empty pull (``time.sleep(3)`` in ``start_client_internal``)."""
FLOWER_REPLY_PAUSE = 0.5
"""Flower's pause between looks for a ClientApp's reply and its objects."""
PULL_MIN = 0.1
"""Default first pause after an empty pull."""
PULL_GROWTH = 1.5
"""Factor by which the pause grows after each further empty pull."""
REPLY_WAIT = 0.05
"""Default pause between looks for the ClientApp's reply."""
OBJECT_BACKOFF = 0.02
"""Default first pause before a missing object is asked for again (Flower's: 1 s)."""


def next_pause(previous: float | None, *, low: float, high: float) -> float:
    """Return the pause after an empty pull, given the one before (``None``: a message came).

    Examples
    --------
    >>> p = None
    >>> [p := next_pause(p, low=0.1, high=3.0) for _ in range(4)]
    [0.1, 0.15000000000000002, 0.22500000000000003, 0.3375]
    >>> next_pause(2.5, low=0.1, high=3.0)
    3.0
    """
    if previous is None:
        return low
    return min(previous * PULL_GROWTH, high)


def pulls_within(seconds: float, *, low: float, high: float) -> int:
    """Return how many empty pulls an idle SuperNode makes in ``seconds`` (pulls cost ~0).

    Examples
    --------
    >>> pulls_within(60.0, low=3.0, high=3.0)  # Flower's own pace
    20
    >>> pulls_within(60.0, low=0.1, high=3.0)
    26
    """
    elapsed, pause, pulls = 0.0, None, 0
    while True:
        pause = next_pause(pause, low=low, high=high)
        if elapsed + pause > seconds:
            return pulls
        elapsed += pause
        pulls += 1


class PacedTime:
    """The ``time`` module as Flower's SuperNode loop sees it, with two pauses changed.

    ``sleep(3)`` (after an empty pull) becomes the paced pause of :func:`next_pause`;
    ``sleep(0.5)`` (waiting for a reply) becomes ``reply_wait``; everything else is
    :mod:`time` itself. :meth:`message_pulled` restarts the pacing.

    Parameters
    ----------
    low, high : float
        First and longest pause after an empty pull, in seconds.
    reply_wait : float
        Pause between looks for a ClientApp's reply, in seconds.
    sleep : Callable[[float], None]
        What actually sleeps (:func:`time.sleep`; tests pass a recorder).
    """

    def __init__(
        self,
        *,
        low: float = PULL_MIN,
        high: float = FLOWER_PULL_PAUSE,
        reply_wait: float = REPLY_WAIT,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.low, self.high, self.reply_wait = low, high, reply_wait
        self._sleep = sleep
        self._pause: float | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def message_pulled(self) -> None:
        """Restart the pacing: the next empty pull waits ``low`` again."""
        with self._lock:
            self._pause = None

    def sleep(self, seconds: float) -> None:
        """Sleep as Flower asked, except for the two pauses this class paces."""
        if seconds == FLOWER_PULL_PAUSE:
            with self._lock:
                self._pause = next_pause(self._pause, low=self.low, high=self.high)
                seconds = self._pause
        elif seconds == FLOWER_REPLY_PAUSE:
            seconds = self.reply_wait
        self._sleep(seconds)


def pace(module: ModuleType, paced: PacedTime) -> None:
    """Give Flower's SuperNode loop module ``paced`` as its ``time``.

    Its ``_push_messages`` (called after every pull that brought a message) first
    restarts the pacing, then runs Flower's own.
    """
    push = module._push_messages

    def push_messages(*args: Any, **kwargs: Any) -> Any:
        paced.message_pulled()
        return push(*args, **kwargs)

    module.time = paced  # type: ignore[attr-defined]
    module._push_messages = push_messages  # type: ignore[attr-defined]


def shorten_object_pulls(first: float) -> bool:
    """Make Flower's object pulls in this process retry first after ``first`` seconds.

    Sets the ``initial_backoff`` default of Flower's ``pull_objects`` (which the
    SuperNode's loop calls without one). Returns whether Flower had that keyword.
    """
    from flwr.supercore.inflatable import inflatable_utils

    defaults = getattr(getattr(inflatable_utils, "pull_objects", None), "__kwdefaults__", None)
    if not isinstance(defaults, dict) or "initial_backoff" not in defaults:
        return False
    defaults["initial_backoff"] = first
    return True


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split this launcher's options from the ``flower-supernode`` arguments.

    Raises ``SystemExit`` (argparse's usage error) on a value that is not a
    positive, finite number of seconds, or ``--pull-max`` below ``--pull-min``.

    Examples
    --------
    >>> ours, rest = parse_args(["--pull-min", "0.2", "--insecure"])
    >>> ours.pull_min, ours.pull_max, rest
    (0.2, 3.0, ['--insecure'])
    """
    parser = argparse.ArgumentParser(
        prog="tessera-supernode",
        allow_abbrev=False,  # a prefix of one of ours stays flower-supernode's
        description="Flower's flower-supernode with paced pulls (every other argument "
        "goes to flower-supernode)",
    )
    parser.add_argument("--pull-min", type=float, default=PULL_MIN, help="first pause, s")
    parser.add_argument(
        "--pull-max", type=float, default=FLOWER_PULL_PAUSE, help="longest pause, s"
    )
    parser.add_argument(
        "--reply-wait", type=float, default=REPLY_WAIT, help="pause between looks for a reply, s"
    )
    parser.add_argument(
        "--object-backoff",
        type=float,
        default=OBJECT_BACKOFF,
        help="first pause before asking the SuperLink again for a missing object, s",
    )
    ours, rest = parser.parse_known_args(list(argv))
    for name in ("pull_min", "pull_max", "reply_wait", "object_backoff"):
        value = getattr(ours, name)
        if not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} {value!r}: use a positive number of seconds")
    if ours.pull_max < ours.pull_min:
        parser.error(
            f"--pull-max {ours.pull_max!r} is below --pull-min {ours.pull_min!r}: "
            "give a longest pause at least the first"
        )
    return ours, rest


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``flower-supernode`` with paced pulls (see the module doc)."""
    ours, rest = parse_args(sys.argv[1:] if argv is None else argv)
    import flwr
    import flwr.supernode.start_client_internal as loop
    from flwr.supernode.cli import flower_supernode

    version = getattr(flwr, "__version__", "?")
    if version == FLOWER_VERSION:
        pace(loop, PacedTime(low=ours.pull_min, high=ours.pull_max, reply_wait=ours.reply_wait))
        shortened = shorten_object_pulls(ours.object_backoff)
        log.info(
            "SuperNode pulls paced: %g s after a message, growing to %g s; replies looked "
            "for every %g s; missing objects asked for again after %s",
            ours.pull_min,
            ours.pull_max,
            ours.reply_wait,
            f"{ours.object_backoff:g} s" if shortened else "Flower's own backoff",
        )
    else:
        log.info(
            "Flower %s is not %s: the SuperNode keeps Flower's own pauses (3 s, 0.5 s)",
            version,
            FLOWER_VERSION,
        )
    sys.argv = ["flower-supernode", *rest]
    flower_supernode()


if __name__ == "__main__":
    main()
