"""The client side of a scheme: a lifecycle the ClientApp drives once per round.

A scheme's :class:`ClientAlgorithm` lives in the scheme's own module, next to its
server strategy. The ClientApp (:mod:`client_app.app`) builds one instance per
message and calls, in order:

1. :meth:`~ClientAlgorithm.prepare_data` - this node's train and test splits;
2. :meth:`~ClientAlgorithm.arch_for` and :meth:`~ClientAlgorithm.build_model`;
3. :meth:`~ClientAlgorithm.load_weights` - the server's weights, or the personal
   model kept in the node's state;
4. :meth:`~ClientAlgorithm.begin_round` - read this round's payload, with access to
   the node's persisted state;
5. local training with :meth:`~ClientAlgorithm.loss_fn`, then evaluation on the
   node's own test split (shared code in :mod:`tessera.training`);
6. :meth:`~ClientAlgorithm.finish_round` - the reply's records, weights included;
7. :meth:`~ClientAlgorithm.save_state` - what must outlive the round (and, with
   node-config ``state-dir``, a restart of the device).

What varies per run (does the node send weights, keep a personal model) is decided
in ``__init__`` from the typed options and kept on the instance, so that a
:class:`ClientWrapper` (an attack, a sub-model slicer) composes around any scheme's
client without knowing which it is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.typing import MetricRecordValues
from torch import nn

from models.base import TesseraModel
from models.spec import MODEL_KEY, ModelRef
from tessera import wire
from tessera.config import ConfigError, RunConfig
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tessera.training import LossFn, TrainStats, cross_entropy_loss

log = logging.getLogger("flwr.tessera")

Record = ArrayRecord | ConfigRecord | MetricRecord
"""A Flower record."""

STATE_MODEL = "tessera.model"
"""Node state: the personal model's exchanged weights."""
STATE_MODEL_META = "tessera.model-meta"
"""Node state: ``arch`` and ``rounds`` (rounds the personal model has trained)."""
MODEL_ROUNDS = "model-rounds"
"""Reply metric of personal-model schemes: rounds the personal model has trained."""


@dataclass(frozen=True)
class RoundInput:
    """Hold this round's instruction as the node understood it.

    Attributes
    ----------
    server_round : int
        The round number.
    ref : ModelRef
        The model to train: a registered model or a slice of one.
    num_classes : int
        Classes of the federation's task.
    input_shape : tuple[int, ...]
        Per-sample input shape.
    content : RecordDict
        The message's records (the scheme's payload).
    config : ConfigRecord
        The message's ``config`` record.
    """

    server_round: int
    ref: ModelRef
    num_classes: int
    input_shape: tuple[int, ...]
    content: RecordDict
    config: ConfigRecord

    @property
    def arch(self) -> str:
        """The model's printed name (:attr:`ModelRef.name`), as logs and node state keep it."""
        return self.ref.name


@dataclass(frozen=True)
class RoundOutcome:
    """What local training and evaluation produced.

    Attributes
    ----------
    stats : TrainStats
        Loss, time and examples of local training.
    test_loss, test_accuracy : float
        On the node's own test split (NaN when it is empty).
    num_test : int
        Size of the test split.
    train : ArrayDataset
        The training data used (after :meth:`ClientAlgorithm.prepare_data`).
    device : torch.device
        Where the model lives.
    """

    stats: TrainStats
    test_loss: float
    test_accuracy: float
    num_test: int
    train: ArrayDataset
    device: torch.device


OptionsT = TypeVar("OptionsT")
"""A scheme's options type (what its ``parse_options`` returns)."""


class ClientAlgorithm(Generic[OptionsT]):
    """Default client behaviour: cross-entropy training of the model it is sent.

    Generic over the scheme's options type, as the server strategy is.

    Parameters
    ----------
    run : RunConfig
        The common run configuration.
    options : OptionsT
        The scheme's typed options.

    Attributes
    ----------
    sends_weights : bool
        Whether the reply carries the trained weights (``arrays`` record).
    keeps_personal_model : bool
        Whether the trained model is kept in the node's state and the next round
        starts from it when the server sends no weights.
    """

    def __init__(self, *, run: RunConfig, options: OptionsT) -> None:
        self.run = run
        self.options = options
        self.sends_weights = True
        self.keeps_personal_model = False

    # ------------------------------------------------------------------ set-up
    def candidate_archs(self, family: str) -> list[ModelRef]:
        """Models a device may pick from in the handshake (default: the family's)."""
        from models import list_models

        return [ModelRef(name) for name in list_models(family)]

    def prepare_data(
        self, train: ArrayDataset, test: ArrayDataset
    ) -> tuple[ArrayDataset, ArrayDataset]:
        """Return the train and test data of this round (default: unchanged)."""
        return train, test

    def handshake_profile(self, profile: Mapping[str, Any]) -> dict[str, Any]:
        """Return the profile this node reports at the handshake (default: unchanged).

        Parameters
        ----------
        profile : Mapping[str, Any]
            What the ClientApp measured: architecture, data sizes (``num-train``,
            ``label-counts``), device (``device-*``).

        Returns
        -------
        dict[str, Any]
            The ``profile`` record's values.
        """
        return dict(profile)

    def arch_for(self, config: ConfigRecord) -> ModelRef:
        """Return the model to train this round, as the server's message names it.

        The message carries the structure (:meth:`ModelRef.to_config`) and the
        printed name (``arch``); they must agree.

        Raises
        ------
        ConfigError
            If the message names no model, or a malformed or inconsistent one.
        """
        if MODEL_KEY not in config or "arch" not in config:
            raise ConfigError(
                f"the message's config names no '{MODEL_KEY}' or 'arch'; the server and "
                "this client run different scheme code (check both use the same FAB)"
            )
        try:
            ref = ModelRef.from_config(config, where="the message's config")
        except ValueError as err:
            raise ConfigError(str(err)) from err
        named = str(config["arch"])
        if ref.name != named:
            raise ConfigError(
                f"the message's config names arch '{named}' but its model and "
                f"slice give '{ref.name}'; the server and this client disagree"
            )
        return ref

    def build_model(
        self, ref: ModelRef, *, input_shape: tuple[int, ...], num_classes: int
    ) -> TesseraModel:
        """Build the model this scheme trains for ``ref`` (default: the zoo's model).

        A scheme that changes the model (e.g. a projection to a shared feature
        dimension) overrides this and the server strategy's ``build_model`` alike.
        """
        from models import get_model

        return get_model(
            ref,
            input_shape=input_shape,
            num_classes=num_classes,
            norm=self.run.scheme.norm,
            flat_input=self.run.scheme.flat_input,
        )

    def load_weights(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> str:
        """Load the round's starting weights into ``model``; say where they came from.

        The server's ``arrays`` record when present; otherwise, for schemes that keep
        a personal model, the one in the node's state (if it is of this
        architecture); otherwise the fresh initialisation. A stored personal model
        that no longer fits the model (other names, shapes or dtypes, or NaN) is
        discarded with its metadata and a warning
        (:meth:`~tessera.node_state.NodeState.fitting_arrays`), and so is one whose
        metadata is malformed (:func:`stored_model_meta`), so the node starts afresh
        instead of failing every round.

        Returns
        -------
        str
            ``"server"``, ``"personal"`` or ``"fresh"``.
        """
        if wire.ARRAYS in rnd.content.array_records:
            load_state_record(model, rnd.content.array_records[wire.ARRAYS])
            return "server"
        if not self.keeps_personal_model:
            return "fresh"
        meta = stored_model_meta(state)
        stored = state.arrays(STATE_MODEL)
        if stored is None or meta is None:
            return "fresh"
        if str(meta.get("arch")) != rnd.arch:
            log.warning(
                "stored personal model is %s but the server asks for %s; starting %s from scratch",
                meta.get("arch"),
                rnd.arch,
                rnd.arch,
            )
            return "fresh"
        # A stored model that no longer fits (NaN, other shapes or dtypes: a damaged
        # file, a changed task) would fail every round: forget it, say so, start afresh.
        fitting = state.fitting_arrays(
            STATE_MODEL,
            like=wire.exchanged_state(model.state_dict()),
            forget=(STATE_MODEL_META,),
        )
        if fitting is None:
            return "fresh"
        load_state_record(model, fitting)
        return "personal"

    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Prepare the round, after the weights are loaded and before training."""

    # -------------------------------------------------------------- objective
    def loss_fn(self) -> LossFn:
        """Return the local objective for one minibatch."""
        return cross_entropy_loss

    # ----------------------------------------------------------------- reply
    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Return the reply's records: metrics, and the weights if the scheme sends them."""
        empty = outcome.num_test == 0
        metrics: dict[str, MetricRecordValues] = {
            wire.NUM_EXAMPLES: outcome.stats.num_examples,
            wire.TRAIN_LOSS: outcome.stats.loss,
            wire.TEST_ACCURACY: 0.0 if empty else outcome.test_accuracy,
            wire.TEST_LOSS: 0.0 if empty else outcome.test_loss,
            wire.NUM_TEST_EXAMPLES: outcome.num_test,
            wire.TRAIN_SECONDS: outcome.stats.seconds,
        }
        if self.keeps_personal_model:
            metrics[MODEL_ROUNDS] = personal_rounds(state, rnd.arch) + 1
        records: dict[str, Record] = {wire.METRICS: MetricRecord(metrics)}
        if self.sends_weights:
            records[wire.ARRAYS] = wire.state_to_record(model.state_dict())
        return records

    def save_state(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Keep what must outlive the round (default: the personal model, if kept)."""
        if self.keeps_personal_model:
            rounds = personal_rounds(state, rnd.arch) + 1
            state.put(STATE_MODEL, wire.state_to_record(model.state_dict()))
            state.put(STATE_MODEL_META, ConfigRecord({"arch": rnd.arch, "rounds": rounds}))


def model_meta_problem(meta: ConfigRecord) -> str | None:
    """Say why a stored :data:`STATE_MODEL_META` record is malformed (``None``: it is not).

    It must name the model (``arch``, text) and may count the rounds it has trained
    (``rounds``, a whole number >= 0; none counts as 0), as
    :meth:`ClientAlgorithm.save_state` writes it.
    """
    arch = meta.get("arch")
    if not isinstance(arch, str) or not arch:
        return f"its 'arch' is {arch!r}, not a model name"
    if "rounds" not in meta:
        return None
    try:
        rounds = wire.int_value(meta, "rounds")
    except ValueError as err:
        return str(err)
    if rounds < 0:
        return f"its 'rounds' is {rounds}, below 0"
    return None


def stored_model_meta(state: NodeState) -> ConfigRecord | None:
    """Return the stored personal model's metadata if well formed (:func:`model_meta_problem`).

    Malformed metadata is forgotten with the model it describes and a warning
    (:meth:`~tessera.node_state.NodeState.checked_config`): the node starts its
    personal model, and its round count, afresh instead of failing every round.
    """
    return state.checked_config(STATE_MODEL_META, model_meta_problem, forget=(STATE_MODEL,))


def personal_rounds(state: NodeState, arch: str) -> int:
    """Return the rounds the stored personal model of ``arch`` has trained (0 if none)."""
    meta = stored_model_meta(state)
    if meta is None or meta["arch"] != arch:
        return 0
    return wire.int_value(meta, "rounds") if "rounds" in meta else 0


def load_state_record(model: nn.Module, record: ArrayRecord) -> None:
    """Load exchanged weights into ``model`` after checking names and shapes.

    Raises
    ------
    ConfigError
        If the record does not match the model (names missing or unexpected, wrong
        shapes): server and client disagree on the architecture or the task.
    """
    state = record.to_torch_state_dict()
    own = model.state_dict()
    missing = [k for k in own if k not in state and wire.is_exchanged(k)]
    unexpected = [k for k in state if k not in own]
    wrong = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or wrong:
        raise ConfigError(
            f"received weights do not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shapes {wrong[:5]}; server and client "
            "disagree on the architecture or the task (classes, input shape)"
        )
    model.load_state_dict(state, strict=False)


class ClientWrapper(ClientAlgorithm[OptionsT]):
    """A client that delegates every lifecycle step to another, to alter some of them.

    Subclasses override the steps they change and call the inner client for the
    rest (``super().finish_round(...)`` reaches the inner client's). The wrapper
    knows nothing of the scheme it wraps.

    Parameters
    ----------
    inner : ClientAlgorithm
        The scheme's client (or another wrapper).
    """

    def __init__(self, inner: ClientAlgorithm[OptionsT]) -> None:
        self.inner = inner
        self.run = inner.run
        self.options = inner.options
        self.sends_weights = inner.sends_weights
        self.keeps_personal_model = inner.keeps_personal_model

    def candidate_archs(self, family: str) -> list[ModelRef]:
        """Delegate to the inner client."""
        return self.inner.candidate_archs(family)

    def prepare_data(
        self, train: ArrayDataset, test: ArrayDataset
    ) -> tuple[ArrayDataset, ArrayDataset]:
        """Delegate to the inner client."""
        return self.inner.prepare_data(train, test)

    def handshake_profile(self, profile: Mapping[str, Any]) -> dict[str, Any]:
        """Delegate to the inner client."""
        return self.inner.handshake_profile(profile)

    def arch_for(self, config: ConfigRecord) -> ModelRef:
        """Delegate to the inner client."""
        return self.inner.arch_for(config)

    def build_model(
        self, ref: ModelRef, *, input_shape: tuple[int, ...], num_classes: int
    ) -> TesseraModel:
        """Delegate to the inner client."""
        return self.inner.build_model(ref, input_shape=input_shape, num_classes=num_classes)

    def load_weights(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> str:
        """Delegate to the inner client."""
        return self.inner.load_weights(model, rnd, state)

    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Delegate to the inner client."""
        self.inner.begin_round(model, rnd, state)

    def loss_fn(self) -> LossFn:
        """Delegate to the inner client."""
        return self.inner.loss_fn()

    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Delegate to the inner client."""
        return self.inner.finish_round(model, rnd, outcome, state)

    def save_state(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Delegate to the inner client."""
        self.inner.save_state(model, rnd, state)
