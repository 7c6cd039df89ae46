"""Personalisation for the schemes that share weights (run-config ``personalise``).

:class:`PersonalisedClient` wraps any weight-sharing scheme's client (it is a
:class:`~strategies.core.client.ClientWrapper`, as the attacks are), so the scheme's
own training, payload and server are untouched. What the node keeps for itself, and
what its reply's ``test-accuracy`` measures on its own test split:

``none``
    The model it trained this round and sent (no wrapper).
``finetune``
    A copy of the model the server sent, trained ``personalise-epochs`` epochs with
    cross-entropy (beside the training of the reply, not after it); the copy is not
    sent and not kept.
``ditto`` (Li et al., ICML 2021)
    A personal model ``v`` kept in node state, trained every round for
    ``local-epochs`` epochs on ``CE(v) + ditto-lambda / 2 * ||v - w||^2``, ``w`` the
    weights the server sent. The shared model trains and travels as without it.
``rep`` (FedRep, Collins et al., ICML 2021)
    The received body under the node's personal head (``head.*``, kept in node
    state): the head trains ``personalise-epochs`` epochs with the body frozen,
    then the body trains the round's ``local-epochs`` with the head frozen. The
    reply carries the trained body and the head the server sent, unchanged, so every
    scheme's reply schema holds and the server's head stays as it was.

With ``finetune`` and ``ditto`` the reply adds ``shared-accuracy``: the sent model
on the same split (what ``none`` reports), so one run shows both.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common.typing import MetricRecordValues
from torch import nn

from strategies.core.client import (
    ClientAlgorithm,
    ClientWrapper,
    Record,
    RoundInput,
    RoundOutcome,
    load_state_record,
)
from tessera import wire
from tessera.config import RunConfig
from tessera.config.groups import PersonaliseConfig
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tessera.training import LossFn, OptimConfig, evaluate_model, proximal_term, train_model

__all__ = [
    "HEAD_PREFIX",
    "STATE_DITTO",
    "STATE_HEAD",
    "PersonalisedClient",
    "ditto_loss",
    "head_names",
    "with_personalisation",
]

log = logging.getLogger("flwr.tessera")

HEAD_PREFIX = "head."
"""State entries of a model's linear head (every zoo model's ``self.head``)."""
STATE_DITTO = "tessera.personal.ditto"
"""Node state: Ditto's personal model."""
STATE_HEAD = "tessera.personal.head"
"""Node state: FedRep's personal head."""
STATE_META = "tessera.personal.meta"
"""Node state: ``arch`` and ``mode`` of the personal part kept."""


def head_names(state: Mapping[str, Any]) -> list[str]:
    """Return the entries of a model state that belong to its linear head."""
    return [k for k in state if k.startswith(HEAD_PREFIX)]


def ditto_loss(lam: float, anchor: list[torch.Tensor]) -> LossFn:
    """Return Ditto's personal objective ``CE(v(x), y) + lam / 2 * ||v - w||^2``.

    Parameters
    ----------
    lam : float
        Weight of the proximal term (``ditto-lambda``); 0 trains ``v`` alone.
    anchor : list[torch.Tensor]
        The received weights ``w``, detached, in ``v.parameters()`` order.
    """

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        task = nn.functional.cross_entropy(model(x), y)
        if lam == 0.0:
            return task
        total: torch.Tensor = task + 0.5 * lam * proximal_term(model, anchor)
        return total

    return loss


def _set_trainable(model: nn.Module, *, head: bool, body: bool) -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(head if name.startswith(HEAD_PREFIX) else body)


def _draw_seed() -> int:
    """Draw a seed from torch's generator, which the ClientApp seeds per node and run."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


class PersonalisedClient(ClientWrapper[Any]):
    """A weight-sharing scheme's client that also keeps a personalised model.

    Parameters
    ----------
    inner : ClientAlgorithm
        The scheme's client; it must send weights (:func:`with_personalisation`
        is only called for schemes the run config allows).
    config : PersonaliseConfig
        The mode and its settings.
    """

    def __init__(self, inner: ClientAlgorithm[Any], config: PersonaliseConfig) -> None:
        super().__init__(inner)
        if config.mode == "none":
            raise ValueError("personalise 'none' needs no wrapper")
        if not inner.sends_weights:
            raise ValueError("only a client that sends weights can be personalised")
        self.config = config
        self._train: ArrayDataset | None = None
        self._test: ArrayDataset | None = None
        self._received: dict[str, torch.Tensor] = {}
        self._personal: nn.Module | None = None

    # ------------------------------------------------------------------ steps
    def prepare_data(
        self, train: ArrayDataset, test: ArrayDataset
    ) -> tuple[ArrayDataset, ArrayDataset]:
        """Delegate, and keep the splits for the personal training and evaluation."""
        self._train, self._test = self.inner.prepare_data(train, test)
        return self._train, self._test

    def load_weights(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> str:
        """Load the server's weights, keep a copy, and (``rep``) put the personal head in."""
        source = self.inner.load_weights(model, rnd, state)
        self._received = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if self.config.mode == "rep":
            stored = self._stored(state, STATE_HEAD, rnd, like=self._head_state(model))
            if stored is not None:
                load_state_record(_HeadView(model), stored)
        return source

    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Delegate; ``rep``: train the head alone, then freeze it for the body's epochs."""
        self.inner.begin_round(model, rnd, state)
        if self.config.mode != "rep":
            return
        train = self._data(self._train)
        _set_trainable(model, head=True, body=False)
        train_model(
            model,
            train,
            optim=self._optim(self.config.epochs),
            device=_device_of(model),
            seed=_draw_seed(),
        )
        _set_trainable(model, head=False, body=True)

    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Build the scheme's reply, then the personal model's accuracy in its metrics."""
        if self.config.mode == "rep":
            _set_trainable(model, head=True, body=True)
            records = self.inner.finish_round(model, rnd, outcome, state)
            records[wire.ARRAYS] = self._with_received_head(records)
            return records
        records = self.inner.finish_round(model, rnd, outcome, state)
        if self.config.mode == "finetune":
            personal = self._finetuned(model, outcome)
        else:
            personal = self._train_ditto(model, rnd, outcome, state)
            self._personal = personal
        if outcome.num_test == 0:
            return records
        loss, acc = evaluate_model(
            personal, self._data(self._test), batch_size=256, device=outcome.device
        )
        metrics: dict[str, MetricRecordValues] = dict(records[wire.METRICS])  # type: ignore[arg-type]
        metrics[wire.SHARED_ACCURACY] = metrics[wire.TEST_ACCURACY]
        metrics[wire.TEST_ACCURACY] = acc
        metrics[wire.TEST_LOSS] = loss
        records[wire.METRICS] = MetricRecord(metrics)
        return records

    def save_state(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Delegate, and keep the personal part (Ditto's model, FedRep's head)."""
        self.inner.save_state(model, rnd, state)
        if self.config.mode == "rep":
            kept = self._head_state(model)
        elif self.config.mode == "ditto" and self._personal is not None:
            kept = dict(self._personal.state_dict())
        else:
            return
        key = STATE_HEAD if self.config.mode == "rep" else STATE_DITTO
        state.put(key, wire.state_to_record(kept))
        state.put(STATE_META, ConfigRecord({"arch": rnd.arch, "mode": self.config.mode}))

    # ---------------------------------------------------------------- helpers
    def _optim(self, epochs: int) -> OptimConfig:
        t = self.run.training
        return OptimConfig(epochs, t.batch_size, t.learning_rate, t.momentum, t.weight_decay)

    @staticmethod
    def _data(data: ArrayDataset | None) -> ArrayDataset:
        if data is None:
            raise RuntimeError("prepare_data was not called before the round's training")
        return data

    @staticmethod
    def _head_state(model: nn.Module) -> dict[str, torch.Tensor]:
        state = model.state_dict()
        return {k: state[k].detach().cpu() for k in head_names(state)}

    def _stored(
        self, state: NodeState, key: str, rnd: RoundInput, *, like: Mapping[str, torch.Tensor]
    ) -> ArrayRecord | None:
        """Return the personal part kept for this model and mode, if it fits (else forget it)."""
        meta = state.config(STATE_META)
        if meta is None or state.arrays(key) is None:
            return None
        if str(meta.get("arch")) != rnd.arch or str(meta.get("mode")) != self.config.mode:
            log.warning(
                "the personal part kept is %s's (%s); this round trains %s (%s): starting afresh",
                meta.get("arch"),
                meta.get("mode"),
                rnd.arch,
                self.config.mode,
            )
            return None
        return state.fitting_arrays(key, like=wire.exchanged_state(like), forget=(STATE_META,))

    def _with_received_head(self, records: Mapping[str, Record]) -> ArrayRecord:
        """Return the reply's weights with the received head in place of the personal one."""
        sent = records[wire.ARRAYS]
        if not isinstance(sent, ArrayRecord):
            raise TypeError(f"the reply's '{wire.ARRAYS}' is a {type(sent).__name__}")
        arrays = wire.record_to_numpy(sent)
        for name in head_names(arrays):
            if name not in self._received:
                raise RuntimeError(f"the reply's head entry '{name}' was not received")
            arrays[name] = self._received[name].cpu().numpy()
        return wire.numpy_to_record(arrays)

    def _finetuned(self, model: nn.Module, outcome: RoundOutcome) -> nn.Module:
        """Return the received model trained ``personalise-epochs`` epochs on the node's data.

        It starts from the weights the server sent, as fine-tuning a federated model
        does in the papers, not from the model the node trained for its reply: that
        one has drifted towards the node's own labels for ``local-epochs`` already.
        """
        personal = copy.deepcopy(model)
        personal.load_state_dict(self._received)
        train_model(
            personal,
            self._data(self._train),
            optim=self._optim(self.config.epochs),
            device=outcome.device,
            seed=_draw_seed(),
        )
        return personal

    def _train_ditto(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> nn.Module:
        """Train Ditto's personal model ``v`` towards the received ``w`` (module docstring)."""
        personal = copy.deepcopy(model)
        personal.load_state_dict(self._received)
        stored = self._stored(state, STATE_DITTO, rnd, like=personal.state_dict())
        if stored is not None:
            load_state_record(personal, stored)
        received = dict(self._received)
        anchor = [
            received[name].detach().to(outcome.device) for name, _ in personal.named_parameters()
        ]
        train_model(
            personal,
            self._data(self._train),
            optim=self._optim(self.run.training.local_epochs),
            device=outcome.device,
            seed=_draw_seed(),
            loss_fn=ditto_loss(self.config.ditto_lambda, anchor),
        )
        return personal


class _HeadView(nn.Module):
    """A model seen through its head alone, to load a stored head with the usual checks."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.head = model.get_submodule("head")


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def with_personalisation(algorithm: ClientAlgorithm[Any], run: RunConfig) -> ClientAlgorithm[Any]:
    """Wrap ``algorithm`` in run-config ``personalise``'s mode (unchanged for ``none``)."""
    if run.personalise.mode == "none":
        return algorithm
    return PersonalisedClient(algorithm, run.personalise)
