"""The node side of the sub-model schemes: masked cross-entropy and the scaler.

:class:`SubModelClient` trains the slice the server names; the device picks the
largest slice that fits its memory and round time (:mod:`client_app.selection`,
through :meth:`SubModelClient.candidate_archs`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from models.base import TesseraModel
from models.spec import ModelRef
from strategies.core.client import ClientAlgorithm, RoundInput
from strategies.submodel.options import SubModelOptionsT, candidate_specs, resolve_global
from tessera.config import RunConfig
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tessera.training import LossFn

__all__ = [
    "SubModelClient",
    "attach_scaler",
    "masked_cross_entropy",
    "norm_entries",
]


def norm_entries(model: nn.Module) -> frozenset[str]:
    """Return the state-dict keys that belong to normalisation layers of ``model``."""
    kinds = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    keys: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, kinds):
            keys.update(f"{name}.{k}" if name else k for k in module.state_dict())
    return frozenset(keys)


def masked_cross_entropy(present: torch.Tensor) -> LossFn:
    """Return cross-entropy over the classes in ``present`` only (a boolean mask).

    Logits of absent classes are set to the dtype's lowest value before the
    softmax, so they get no probability and no gradient (HeteroFL's masked loss).
    """

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        mask = present.to(logits.device)
        masked = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        return nn.functional.cross_entropy(masked, y)

    return loss


def attach_scaler(model: nn.Module, width: float) -> int:
    """Divide every convolution's output by ``width`` in training (HeteroFL's scaler).

    In evaluation the convolutions are left as they are. Returns the number of
    convolutions scaled (0 when ``width`` is 1).
    """
    if width == 1.0:
        return 0

    def scale(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output / width if module.training else output

    count = 0
    for module in model.modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            module.register_forward_hook(scale)
            count += 1
    return count


class SubModelClient(ClientAlgorithm[SubModelOptionsT]):
    """A node of a sub-model scheme: trains the slice the server names.

    Its options' ``width_flexible`` and ``depth_flexible`` say which slices it may
    pick in the handshake.
    """

    def __init__(self, *, run: RunConfig, options: SubModelOptionsT) -> None:
        super().__init__(run=run, options=options)
        self.present: torch.Tensor | None = None

    def slice_axes(self) -> tuple[bool, bool]:
        """Return whether a node may cut its slice in width and in depth."""
        return self.options.width_flexible, self.options.depth_flexible

    def candidate_archs(self, family: str) -> list[ModelRef]:
        """Return the slices of the global model this scheme lets a node train."""
        from models.slicing import family_layout, full_spec

        global_name = resolve_global(self.options.global_model, family)
        width, depth = self.slice_axes()
        specs = candidate_specs(
            full_spec(global_name),
            family_layout(global_name).min_depth,
            self.options.widths,
            width=width,
            depth=depth,
        )
        return [ModelRef(global_name, s) for s in specs]

    def build_model(
        self, ref: ModelRef, *, input_shape: tuple[int, ...], num_classes: int
    ) -> TesseraModel:
        """Build slice ``ref`` with the scheme's options (:meth:`SubModelOptions.model_kwargs`)."""
        from models import get_model

        return get_model(
            ref,
            input_shape=input_shape,
            num_classes=num_classes,
            norm=self.run.scheme.norm,
            flat_input=self.run.scheme.flat_input,
            **self.options.model_kwargs(),
        )

    def prepare_data(
        self, train: ArrayDataset, test: ArrayDataset
    ) -> tuple[ArrayDataset, ArrayDataset]:
        """Note which classes the node has training data of (for the masked loss)."""
        self.present = None
        if self.options.mask_classes and len(train) > 0:
            labels = torch.as_tensor(np.unique(train.y), dtype=torch.long)
            self.present = torch.zeros(int(labels.max()) + 1, dtype=torch.bool)
            self.present[labels] = True
        return train, test

    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Attach the scaler for a narrow slice; size the class mask to the task."""
        spec = rnd.ref.spec
        if self.options.scaler and spec is not None:
            attach_scaler(model, spec.width)
        if self.present is not None and len(self.present) != rnd.num_classes:
            mask = torch.zeros(rnd.num_classes, dtype=torch.bool)
            mask[: min(len(self.present), rnd.num_classes)] = self.present[: rnd.num_classes]
            self.present = mask

    def loss_fn(self) -> LossFn:
        """Masked cross-entropy when enabled, plain cross-entropy otherwise."""
        if self.present is None:
            return super().loss_fn()
        return masked_cross_entropy(self.present)
