"""What a scheme knows about its task (:class:`ServerEnv`) and one round (:class:`RoundContext`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np

from strategies.core.validation import ClientReply, Rejection, ReplyLimits, ReplySchema
from tessera.config import RunConfig
from tessera.data import ArrayDataset

_T = TypeVar("_T")

FEDERATION = "federation"
"""Config key of the federation id sent with every message (keys node state)."""


@dataclass(frozen=True)
class ServerEnv:
    """What the server knows about the task, resolved once by the ServerApp.

    Attributes
    ----------
    run : RunConfig
        The common run configuration.
    num_classes : int
        Number of classes of the dataset.
    input_shape : tuple[int, ...]
        Per-sample input shape.
    global_test : ArrayDataset
        The held-out test set the server evaluates global models on.
    server_pool : ArrayDataset
        Server-side data that never overlaps client data (alignment data, tuning
        sets); labels are there but schemes that need unlabelled data must not use
        them.
    family : str
        The architecture family in use.
    """

    run: RunConfig
    num_classes: int
    input_shape: tuple[int, ...]
    global_test: ArrayDataset
    server_pool: ArrayDataset
    family: str


@dataclass
class RoundContext:
    """Everything about one round that the hooks need, passed to each of them.

    Attributes
    ----------
    server_round : int
        The round number (1-based).
    num_rounds : int
        Rounds of the whole run.
    rng : np.random.Generator
        This round's generator, ``default_rng([seed, server_round])``.
    eligible : dict[int, str]
        Nodes that could train this round and their architectures.
    assignment : dict[int, str]
        Nodes selected to train this round (a subset of ``eligible``).
    bytes_down : dict[int, int]
        Payload bytes sent to each node.
    failures : dict[int, str]
        Nodes that failed (error reply, no reply) and why.
    accepted : list[ClientReply]
        Replies that passed validation and were folded.
    rejected : list[Rejection]
        Replies that did not, with the reason.
    started : float
        ``time.monotonic()`` at the start of the round.
    schemas : dict[int, ReplySchema]
        What each selected node's reply must contain.
    limits : dict[int, ReplyLimits]
        What each selected node's reply may claim (from its handshake).
    phases : dict[str, float]
        Seconds the server spent in each phase of the round (``handshake``, ``build``,
        ``exchange``, and within it ``pull`` and ``fold``, ``aggregate``,
        ``evaluate``), for the round record.
    shared : dict
        Records built once this round and put into several messages (:meth:`share`).
    scheme_state : dict
        A scheme's own state for this round, one object per type (:meth:`state`):
        it lives and dies with the round, so a skipped round leaves nothing behind.
    """

    server_round: int
    num_rounds: int
    rng: np.random.Generator
    eligible: dict[int, str] = field(default_factory=dict)
    assignment: dict[int, str] = field(default_factory=dict)
    bytes_down: dict[int, int] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    accepted: list[ClientReply] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    schemas: dict[int, ReplySchema] = field(default_factory=dict)
    limits: dict[int, ReplyLimits] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    shared: dict[Hashable, Any] = field(default_factory=dict)
    scheme_state: dict[type, Any] = field(default_factory=dict)

    def share(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """Return ``build()``, built once per round per ``key`` and shared afterwards.

        Records every node of a group receives (a global model as an
        :class:`~flwr.app.ArrayRecord`) are built once and put into each message,
        as Flower's own strategies do: the round then holds one copy per
        architecture instead of one per node, and measuring the payloads
        (:func:`tessera.wire.payload_sizes`) serialises each once.
        """
        if key not in self.shared:
            self.shared[key] = build()
        return cast("_T", self.shared[key])

    def state(self, kind: type[_T], build: Callable[[], _T] | None = None) -> _T:
        """Return this round's scheme state of type ``kind``, built on first use.

        ``build()`` (or ``kind()``) makes it the first time a hook asks in the round;
        later calls return the same object. A scheme keeps what it gathers during a
        round here rather than on itself (FedFA's accumulator, FlexiFed's personal
        entries), so nothing carries over into the next round by mistake.
        """
        if kind not in self.scheme_state:
            self.scheme_state[kind] = build() if build is not None else kind()
        return cast("_T", self.scheme_state[kind])

    def timed(self, phase: str, started: float) -> None:
        """Record the seconds since ``started`` (``time.monotonic()``) as ``phase``."""
        self.phases[phase] = time.monotonic() - started
