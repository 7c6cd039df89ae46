"""Talking to the SuperLink: push, pull as replies arrive, retry transient errors.

Every exchange is bounded by a timeout (a node that never answers is reported
missing, never waited on forever). Replies are handed to a callback as they are
pulled, a few at a time, so the caller can validate and fold each one and drop it
before the next arrives. Calls to the grid that fail with a transient gRPC status
(``UNAVAILABLE``, ``DEADLINE_EXCEEDED``: the SuperLink restarting, a network blip)
are retried with exponential backoff for up to ``retry_timeout`` seconds instead of
ending the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from flwr.app import Message
from flwr.serverapp import Grid

from strategies.core.validation import short_reason
from tessera import wire

log = logging.getLogger("flwr.tessera")

T = TypeVar("T")

POLL_INTERVAL = 0.02
"""Shortest pause between two polls for replies (Flower's own grid sleeps 3 s).

A reply waits for the next poll, so this is most of a fast round's latency: at 0.2 s
it was 0.35 s of a 0.41 s simulated node round. :func:`poll_wait` lengthens it while
nothing arrives and when a poll itself is costly."""
MAX_POLL_INTERVAL = 0.25
"""Longest pause between polls while no reply arrives (it backs off from POLL_INTERVAL).

In deployment a round's replies come seconds apart, so the server is at this pause
when each arrives, and a round ends with its last reply: on average half of it is
added to every round (it was 1 s: ``benchmarks/overhead.py`` measured ``return``,
a reply's creation to its pull, at 1.65-1.85 s a node, of which Flower's own SuperNode
adds up to 0.5 s before it pushes). A poll of an idle SuperLink costs a millisecond,
and :data:`POLL_COST_FACTOR` and :data:`PENDING_WAIT` still space costly ones."""
POLL_COST_FACTOR = 4.0
"""A pause is at least this many times the duration of the last poll that brought
nothing, so that asking takes at most a fifth of the server's time however many
replies are pending (a poll asks for every pending reply: with thousands pending, a
poll of tens of milliseconds every 20 ms would starve the rest of the server).

Only an empty poll measures the price of asking: a poll that brought replies also
downloaded them, which is work the round needs whenever it is done. Counting that
time too made a deployed round wait 4 x 1.3 s after its first reply on a busy
machine (``benchmarks/overhead.py``: ``return`` 4.5-6 s for the last nodes)."""
PENDING_WAIT = 1e-4
"""Seconds of pause per pending reply (0.1 s with 1,000 pending). A poll asks the
SuperLink about every pending reply (Flower checks each id), so polls at a fixed
interval cost each reply work in proportion to the round's length, that is to the
node count; a pause that grows with what is pending keeps the polls per reply, and
so the server's pulling work per reply, constant (a reply then waits for its pull
about 0.05 ms per pending node on average: 0.25 s of a 5,000-node round)."""
PULL_CHUNK = 8
"""Fewest replies asked for per pull call (payloads of 8 MiB or more)."""
MAX_PULL_CHUNK = 256
"""Most replies asked for per pull call (small payloads)."""
HELD_BYTES = 64 * 2**20
"""Payload bytes the server may hold between a pull and the folds (sets the chunk)."""


def pull_chunk(payload_bytes: int) -> int:
    """Return how many replies to ask for per pull call, for payloads of this size.

    Each call is a round trip to the SuperLink, so with hundreds of pending replies a
    small fixed chunk costs hundreds of calls per poll (most of a 1,000-node round's
    pull time); the chunk grows while ``chunk x payload`` stays within
    :data:`HELD_BYTES`, between :data:`PULL_CHUNK` and :data:`MAX_PULL_CHUNK`.

    Examples
    --------
    >>> pull_chunk(100_000), pull_chunk(1_000_000), pull_chunk(50_000_000)
    (256, 67, 8)
    """
    return max(PULL_CHUNK, min(MAX_PULL_CHUNK, HELD_BYTES // max(1, payload_bytes)))


def poll_wait(
    previous: float, *, got_any: bool, poll_seconds: float, poll: float, pending: int = 0
) -> float:
    """Return the pause before the next poll.

    Back to ``poll`` after a poll that brought replies, else 1.5 times the previous
    pause (at most :data:`MAX_POLL_INTERVAL`, or ``poll`` when that is longer); never
    less than :data:`POLL_COST_FACTOR` times ``poll_seconds`` (the caller passes the
    last *empty* poll's duration, the price of asking), nor than
    :data:`PENDING_WAIT` per reply still pending.

    Examples
    --------
    >>> poll_wait(0.02, got_any=True, poll_seconds=0.001, poll=0.02)
    0.02
    >>> round(poll_wait(0.1, got_any=False, poll_seconds=0.001, poll=0.02), 3)
    0.15
    >>> poll_wait(0.2, got_any=False, poll_seconds=0.001, poll=0.02)
    0.25
    >>> poll_wait(0.02, got_any=True, poll_seconds=0.05, poll=0.02)
    0.2
    >>> round(poll_wait(0.02, got_any=True, poll_seconds=0.001, poll=0.02, pending=5000), 3)
    0.5
    """
    wait = poll if got_any else min(previous * 1.5, max(poll, MAX_POLL_INTERVAL))
    return max(wait, POLL_COST_FACTOR * poll_seconds, PENDING_WAIT * pending)


TRANSIENT_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


class SuperLinkUnavailableError(RuntimeError):
    """The SuperLink stayed unreachable for longer than the retry budget."""


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` is a gRPC error worth retrying (UNAVAILABLE, DEADLINE_EXCEEDED)."""
    code = getattr(err, "code", None)
    if not callable(code):
        return False
    try:
        status = code()
    except Exception:
        return False
    return getattr(status, "name", str(status)) in TRANSIENT_CODES


def call_with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    retry_timeout: float,
    first_delay: float = 0.5,
    max_delay: float = 8.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn``; retry transient gRPC errors with exponential backoff.

    Parameters
    ----------
    fn : Callable[[], T]
        The grid call.
    what : str
        What the call does, for the logs and the error.
    retry_timeout : float
        Seconds of retrying before giving up (0: no retry).
    first_delay, max_delay : float
        Backoff: ``first_delay``, doubled after every failure, at most ``max_delay``.
    sleep : Callable[[float], None]
        Injected for tests.

    Returns
    -------
    T
        What ``fn`` returned.

    Raises
    ------
    SuperLinkUnavailableError
        If transient errors lasted longer than ``retry_timeout``.
    Exception
        Any non-transient error of ``fn``, unchanged.
    """
    started = time.monotonic()
    delay = first_delay
    attempt = 1
    while True:
        try:
            return fn()
        except Exception as err:
            if not is_transient(err):
                raise
            waited = time.monotonic() - started
            if waited + delay > retry_timeout:
                raise SuperLinkUnavailableError(
                    f"{what}: the SuperLink was unreachable for {waited:.1f}s after "
                    f"{attempt} attempt(s) ({short_reason(str(err))}); check that it runs "
                    "and is reachable, or raise run-config 'superlink-retry-timeout'"
                ) from err
            log.warning(
                "%s: SuperLink error %s (attempt %d); retrying in %.1fs",
                what,
                short_reason(str(err), 120),
                attempt,
                delay,
            )
            sleep(delay)
            delay = min(delay * 2.0, max_delay)
            attempt += 1


@dataclass
class ExchangeResult:
    """Replies kept (when no callback took them), failed nodes and bytes sent."""

    replies: list[Message]
    missing: dict[int, str]
    bytes_down: dict[int, int] = field(default_factory=dict)
    pull_seconds: float = 0.0
    """Time spent in ``pull_messages`` calls (the server's side of waiting)."""
    fold_seconds: float = 0.0
    """Time spent in ``on_reply`` (validating and folding the replies)."""
    pull_cpu_seconds: float = 0.0
    """The calling thread's CPU time in ``pull_messages`` calls: the server's own work.

    In simulation the ServerApp shares its process with the engine dispatching the
    other nodes' messages, so wall time in a call also holds waits for the interpreter
    lock; CPU time of this thread does not (:func:`time.thread_time`)."""
    fold_cpu_seconds: float = 0.0
    """The calling thread's CPU time in ``on_reply``."""
    polls: int = 0
    """Polling rounds until every reply arrived or the timeout passed."""


def exchange(
    grid: Grid,
    messages: Sequence[Message],
    *,
    timeout: float,
    poll: float = POLL_INTERVAL,
    on_reply: Callable[[Message], None] | None = None,
    retry_timeout: float = 0.0,
    bytes_down: dict[int, int] | None = None,
) -> ExchangeResult:
    """Push messages and pull their replies until all arrived or ``timeout`` passed.

    Parameters
    ----------
    grid : Grid
        Flower's grid.
    messages : Sequence[Message]
        One message per destination node.
    timeout : float
        Seconds to wait for replies; nodes without a reply are reported missing.
    poll : float
        Seconds between pulls.
    on_reply : Callable[[Message], None], optional
        Called with each content reply as soon as it is pulled; the reply is then
        not kept in the result (the caller folds it and lets it go).
    retry_timeout : float
        Seconds to retry transient SuperLink errors (see :func:`call_with_retries`).
    bytes_down : dict[int, int], optional
        Payload size per node when the caller already measured it.

    Returns
    -------
    ExchangeResult
        The replies (none when ``on_reply`` is given) and the missing nodes with a
        reason.
    """
    if bytes_down is None:
        sizes = wire.payload_sizes([m.content for m in messages])
        bytes_down = {
            int(m.metadata.dst_node_id): size for m, size in zip(messages, sizes, strict=True)
        }
    if not messages:
        return ExchangeResult([], {}, bytes_down)
    pushed = call_with_retries(
        lambda: list(grid.push_messages(messages)),
        what="pushing messages",
        retry_timeout=retry_timeout,
    )
    accepted = {mid for mid in pushed if mid}
    pending: dict[str, int] = {}
    missing: dict[int, str] = {}
    for msg in messages:
        node = int(msg.metadata.dst_node_id)
        mid = msg.metadata.message_id
        if mid in accepted:
            pending[mid] = node
        else:
            missing[node] = "the SuperLink did not accept the message"
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    result = ExchangeResult(replies, missing, bytes_down)
    chunk_size = pull_chunk(max(bytes_down.values(), default=0))
    wait = poll
    query_seconds = 0.0  # the last empty poll's duration: the price of asking
    while pending:
        result.polls += 1
        got_any = False
        pulled_before = result.pull_seconds
        ids = list(pending)
        for begin in range(0, len(ids), chunk_size):
            chunk = [mid for mid in ids[begin : begin + chunk_size] if mid in pending]
            if not chunk:
                continue
            tick, cpu = time.monotonic(), time.thread_time()
            pulled = call_with_retries(
                lambda chunk=chunk: list(grid.pull_messages(chunk)),  # type: ignore[misc]
                what="pulling replies",
                retry_timeout=retry_timeout,
            )
            result.pull_seconds += time.monotonic() - tick
            result.pull_cpu_seconds += time.thread_time() - cpu
            pulled.reverse()
            while pulled:  # each reply is let go as soon as it was handled
                reply = pulled.pop()
                mid = reply.metadata.reply_to_message_id
                if mid not in pending:
                    continue
                got_any = True
                node = pending.pop(mid)
                if reply.has_error():
                    # Error replies come from the SuperLink on the node's behalf (node
                    # unavailable, ClientApp crashed or raised): the node failed.
                    err = reply.error
                    missing[node] = f"error {err.code}: {short_reason(err.reason or '')}"
                elif on_reply is not None:
                    tick, cpu = time.monotonic(), time.thread_time()
                    on_reply(reply)
                    result.fold_seconds += time.monotonic() - tick
                    result.fold_cpu_seconds += time.thread_time() - cpu
                else:
                    replies.append(reply)
                del reply
        if not pending or time.monotonic() >= deadline:
            break
        # poll quickly while replies come in, back off while none do: a round of
        # hundreds of nodes is otherwise polled hundreds of times for nothing
        if not got_any:
            query_seconds = result.pull_seconds - pulled_before
        wait = poll_wait(
            wait,
            got_any=got_any,
            poll_seconds=query_seconds,
            poll=poll,
            pending=len(pending),
        )
        time.sleep(min(wait, max(deadline - time.monotonic(), 0.0)))
    for node in pending.values():
        missing[node] = f"no reply within round-timeout={timeout:g}s"
    return result


def is_simulation(grid: Grid) -> bool:
    """Whether the grid is Flower's in-memory simulation grid.

    Only then do clients emulate the fleet of run-config ``sim-device-profiles``; a
    deployed node always probes its device (or takes node-config ``device-profile``).
    """
    from flwr.server.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


def connected_nodes(grid: Grid, *, retry_timeout: float = 0.0) -> set[int]:
    """Node ids the SuperLink currently lists (transient errors retried)."""
    return {
        int(n)
        for n in call_with_retries(
            lambda: list(grid.get_node_ids()), what="listing nodes", retry_timeout=retry_timeout
        )
    }


def wait_for_nodes(
    grid: Grid, *, min_nodes: int, timeout: float, retry_timeout: float = 0.0
) -> list[int]:
    """Wait until at least ``min_nodes`` nodes are connected.

    Raises
    ------
    TimeoutError
        If fewer nodes connected within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(connected_nodes(grid, retry_timeout=retry_timeout))
        if len(nodes) >= min_nodes:
            return nodes
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"only {len(nodes)} node(s) connected within node-wait-timeout="
                f"{timeout:g}s but min-nodes={min_nodes}; start more SuperNodes or "
                "lower run-config 'min-nodes'"
            )
        time.sleep(0.5)
