"""FedHeNN's client: the task loss plus ``eta(t) * (1 - CKA)`` on the server's RAD."""

from __future__ import annotations

import time

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common.typing import MetricRecordValues
from torch import nn

from models.base import TesseraModel
from strategies.core.client import ClientAlgorithm, Record, RoundInput, RoundOutcome
from strategies.fedhenn.cka import kernel_cka, linear_cka, rbf_cka, rbf_kernel
from strategies.fedhenn.kbar import unit_scale
from strategies.fedhenn.options import HETEROGENEOUS, FedHeNNOptions
from strategies.fedhenn.payload import (
    ALIGN,
    ETA_KEY,
    MIN_RAD_ROWS,
    PROBE,
    RAD_ROUND_KEY,
    REP,
    STAT_ALIGN_SECONDS,
    STAT_CKA,
    STAT_REP_SECONDS,
    STAT_SETUP_SECONDS,
    STAT_STEPS,
    STATE_PROBE,
    STATE_PROBE_META,
    STATS,
)
from tessera import wire
from tessera.config import ConfigError, RunConfig
from tessera.node_state import NodeState
from tessera.training import LossFn, cross_entropy_loss


def alignment_cka(
    features: torch.Tensor,
    target: torch.Tensor,
    *,
    kernel: str,
    target_is_factor: bool,
    unbiased: bool,
) -> torch.Tensor:
    """CKA between a client's features and its target on the same RAD rows.

    Parameters
    ----------
    features : torch.Tensor
        ``m x d`` representation of the client (differentiable).
    target : torch.Tensor
        ``m x k``: the global model's representation (homogeneous) or the rows of
        ``K_bar``'s factor (heterogeneous, ``K_bar = target @ target.T``).
    kernel : str
        ``"linear"`` or ``"rbf"``.
    target_is_factor : bool
        Whether ``target`` is a kernel factor rather than a representation.
    unbiased : bool
        Unbiased HSIC estimator.

    Returns
    -------
    torch.Tensor
        A differentiable scalar in ``[0, 1]``.
    """
    if kernel == "linear":
        # linear CKA of (features, F) is the CKA of their linear kernels, i.e. of K_bar
        return linear_cka(features, target, unbiased=unbiased)
    if target_is_factor:
        return kernel_cka(rbf_kernel(features), target @ target.T, unbiased=unbiased)
    return rbf_cka(features, target, unbiased=unbiased)


def _tensor(record: ArrayRecord, key: str, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.asarray(record[key].numpy(), dtype=np.float32)).to(device)


class FedHeNNClient(ClientAlgorithm[FedHeNNOptions]):
    """Client side of FedHeNN: cross-entropy plus ``eta * (1 - CKA)`` on RAD subsets.

    The mode is decided here, from the options. Homogeneous: the node trains the
    received global model, sends its weights, and aligns to that model's own
    representation of the RAD. Heterogeneous: the node keeps a personal model in its
    state, sends no weights, aligns to the factor of ``K_bar`` and reports its
    representation of the probe RAD, which it also keeps in its state (the server
    then need not send that RAD again when it aligns on it next round).
    """

    def __init__(self, *, run: RunConfig, options: FedHeNNOptions) -> None:
        super().__init__(run=run, options=options)
        self.options: FedHeNNOptions = options
        self.heterogeneous = options.mode == HETEROGENEOUS
        self.target_is_factor = self.heterogeneous
        self.sends_weights = not self.heterogeneous
        self.keeps_personal_model = self.heterogeneous
        self.eta = 0.0
        self.server_round = 0
        self.align_x: torch.Tensor | None = None
        self.align_target: torch.Tensor | None = None
        self.probe_x: np.ndarray | None = None
        self.align_seconds = 0.0
        self.setup_seconds = 0.0
        self.rep_seconds = 0.0
        self.steps = 0
        self.ckas: list[float] = []

    # ------------------------------------------------------------------ round setup
    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Read eta, the alignment target and (heterogeneous) the probe RAD."""
        content, config = rnd.content, rnd.config
        self.server_round = rnd.server_round
        if self.heterogeneous and PROBE in content.array_records:
            self.probe_x = content.array_records[PROBE]["x"].numpy()
        self.eta = wire.float_value(config, ETA_KEY) if ETA_KEY in config else 0.0
        if self.eta <= 0 or ALIGN not in content.array_records:
            self.eta = 0.0
            return
        started = time.perf_counter()
        device = next(model.parameters()).device
        record = content.array_records[ALIGN]
        x = self._alignment_rows(record, config, state, device)
        expected = tuple(_as_tessera(model).input_shape)
        if tuple(x.shape[1:]) != expected or x.shape[0] < MIN_RAD_ROWS:
            raise ConfigError(
                f"the RAD has samples of shape {tuple(x.shape)} but the model takes "
                f"(N >= {MIN_RAD_ROWS}, {', '.join(map(str, expected))}); server and "
                "client disagree on the task"
            )
        self.align_x = x
        self.align_target = self.prepare_target(model, record, x, device)
        if self.align_target.shape[0] != x.shape[0]:
            raise ConfigError(
                f"the alignment target has {self.align_target.shape[0]} rows but the RAD "
                f"has {x.shape[0]}; server and client run different FedHeNN code"
            )
        self.setup_seconds += time.perf_counter() - started

    def _alignment_rows(
        self, record: ArrayRecord, config: ConfigRecord, state: NodeState, device: torch.device
    ) -> torch.Tensor:
        """Return the RAD to align on: sent with the target, or the probe kept in node state."""
        if "x" in record:
            return _tensor(record, "x", device)
        wanted = wire.int_value(config, RAD_ROUND_KEY) if RAD_ROUND_KEY in config else None
        meta = state.config(STATE_PROBE_META)
        kept = state.arrays(STATE_PROBE)
        held = None if meta is None else (wire.int_value(meta, "round") if "round" in meta else -1)
        if wanted is None or kept is None or held != wanted:
            raise ConfigError(
                f"the server sent no RAD and expects this node to keep the probe of round "
                f"{wanted!r}, but its state holds round {held}; the node's state was lost "
                "(restart without node-config 'state-dir'?) - the server sends the RAD "
                "again next time"
            )
        return _tensor(kept, "x", device)

    def prepare_target(
        self, model: nn.Module, record: ArrayRecord, x: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """Return the target of this round on the RAD rows ``x``.

        Homogeneous: the just-loaded global model's representation of the RAD (no
        grad, eval mode). Heterogeneous: the factor of ``K_bar`` the server sent.
        """
        if not self.heterogeneous:
            return _eval_features(model, x)
        if "target" not in record:
            raise ConfigError(f"record '{ALIGN}' has no 'target' (the factor of K_bar)")
        target = _tensor(record, "target", device)
        if target.dim() != 2:
            raise ConfigError(f"K_bar's factor must be 2-d, got shape {tuple(target.shape)}")
        return target

    # ------------------------------------------------------------------- objective
    def loss_fn(self) -> LossFn:
        """Plain cross-entropy when eta is 0, else cross-entropy plus the CKA term.

        The alignment term's backward pass runs inside this function (its gradients
        accumulate in ``.grad`` before the training loop's backward adds the task
        gradients; the sum is the gradient of the full objective), so that its
        forward and backward time can be measured. The returned loss is
        ``task + alignment`` with the alignment part detached.
        """
        if self.eta <= 0 or self.align_x is None or self.align_target is None:
            return cross_entropy_loss
        x_rad, target = self.align_x, self.align_target
        eta, every, n = self.eta, self.options.align_every, int(x_rad.shape[0])
        batch = self.options.rad_batch if 0 < self.options.rad_batch < n else n
        gen = torch.Generator().manual_seed(self.run.seed * 1_000_003 + self.server_round)
        step = [0]

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            task = nn.functional.cross_entropy(model(x), y)
            step[0] += 1
            if (step[0] - 1) % every != 0:
                return task
            started = time.perf_counter()
            if batch < n:
                idx = torch.randperm(n, generator=gen)[:batch].to(x_rad.device)
                rows, goal = x_rad[idx], target[idx]
            else:
                rows, goal = x_rad, target
            tessera_model = _as_tessera(model)
            tessera_model.eval()  # target kernels were made in eval mode; keep BN stats local
            try:
                features = tessera_model.forward_features(rows)
            finally:
                tessera_model.train()
            cka = alignment_cka(
                features,
                goal,
                kernel=self.options.kernel,
                target_is_factor=self.target_is_factor,
                unbiased=self.options.unbiased,
            )
            align = eta * (1.0 - cka)
            if not torch.isfinite(align):
                raise FloatingPointError(f"the CKA alignment term became {align.item()}")
            align.backward()  # type: ignore[no-untyped-call]
            self.align_seconds += time.perf_counter() - started
            self.steps += 1
            self.ckas.append(float(cka.detach()))
            total: torch.Tensor = task + align.detach()
            return total

        return loss

    # ---------------------------------------------------------------------- replies
    def stats_record(self) -> MetricRecord:
        """Return the ``fedhenn.stats`` record."""
        values: dict[str, MetricRecordValues] = {
            STAT_ALIGN_SECONDS: self.align_seconds,
            STAT_SETUP_SECONDS: self.setup_seconds,
            STAT_REP_SECONDS: self.rep_seconds,
            STAT_STEPS: self.steps,
        }
        if self.ckas:
            values[STAT_CKA] = float(np.mean(self.ckas))
        return MetricRecord(values)

    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Return the base records, the statistics and, when probed, the representation."""
        records = super().finish_round(model, rnd, outcome, state)
        if self.probe_x is not None:
            started = time.perf_counter()
            x = torch.from_numpy(np.asarray(self.probe_x, dtype=np.float32)).to(outcome.device)
            # Scaled to a peak of 1 (the server's kernels are invariant to it), so
            # features past float16's range do not become infinities
            rep = unit_scale(_eval_features(model, x).cpu().numpy(), self.options.precision)
            records[REP] = wire.numpy_to_record({"rep": rep})
            self.rep_seconds += time.perf_counter() - started
        records[STATS] = self.stats_record()
        return records

    def save_state(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Keep the personal model (heterogeneous) and the probe RAD just represented."""
        super().save_state(model, rnd, state)
        if self.probe_x is not None:
            state.put(STATE_PROBE, wire.numpy_to_record({"x": self.probe_x}))
            state.put(STATE_PROBE_META, ConfigRecord({"round": rnd.server_round}))


def _as_tessera(model: nn.Module) -> TesseraModel:
    if not isinstance(model, TesseraModel):
        raise TypeError(
            f"FedHeNN needs a TesseraModel with forward_features, got {type(model).__name__}"
        )
    return model


@torch.no_grad()
def _eval_features(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    tessera_model = _as_tessera(model)
    was_training = tessera_model.training
    tessera_model.eval()
    try:
        return tessera_model.forward_features(x).detach()
    finally:
        tessera_model.train(was_training)
