"""The ``torchvision`` family: torchvision's ImageNet architectures, untrained.

Each model is a frozen :class:`TorchvisionConfig` (which torchvision constructor,
where its classifier is) whose :meth:`~TorchvisionConfig.build` imports torchvision
lazily, so ``import models`` works on an image without torchvision; building a
``tv-*`` model there raises an ``ImportError`` that says how to fix it. Weights are
never downloaded (``weights=None``).

Adaptation to the zoo's interface:

* the first convolution is rebuilt for the input's channel count (1 for digits and
  for flat vectors);
* the original classifier's last linear layer becomes the head (built for
  ``num_classes``), everything before it is the body, so ``forward_features`` returns
  the pre-logit vector (512-d for ResNet-18, 1024-d / 1280-d for MobileNetV3
  small / large); MobileNetV3's classifier dropout is removed so that ``forward`` is
  deterministic;
* the injected norm replaces torchvision's (for MobileNetV3 that drops its
  ``eps=1e-3, momentum=0.01`` batch-norm settings);
* inputs smaller than :data:`MIN_INPUT_SIZE` pixels in height or width are
  bilinearly upsampled inside the model to at least that size: the ImageNet stems
  downsample by 32, so an 8x8 digit would otherwise be 1x1 after the second stage.

Signals ``(C, L)`` and, by default, flat vectors ``(L,)`` give a 1-d form
(:class:`models.inputs.InputAdapter`): torchvision builds the 2-d network with the 1-d
counterpart of the injected norm (``BatchNorm1d``), then every ``Conv2d``,
``MaxPool2d`` and ``AdaptiveAvgPool2d`` is replaced by its 1-d counterpart with the
same channels, groups and (first-axis) kernel size, stride, padding and dilation
(:func:`convert_to_1d`), and short signals are linearly upsampled to
:data:`MIN_INPUT_SIZE`. ``flat_input="square"`` reshapes a flat vector to a
one-channel square image instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Final, Literal

from torch import Tensor, nn

from models.base import TesseraModel
from models.inputs import FlatInput, InputAdapter
from models.norm import NormFactory, norm_for_ndim
from models.registry import list_families, register_family

__all__ = [
    "MIN_INPUT_SIZE",
    "TORCHVISION_VARIANTS",
    "TorchvisionConfig",
    "TorchvisionModel",
    "convert_to_1d",
]

FAMILY: Final = "torchvision"

MIN_INPUT_SIZE: Final = 32
"""Smaller inputs are upsampled to this height and width inside the model."""


class TorchvisionModel(TesseraModel):
    """A torchvision body and a linear head behind the zoo's interface.

    Parameters
    ----------
    backbone : nn.Module
        Maps a batch in the adapter's form (an image batch, or a signal batch for a
        backbone passed through :func:`convert_to_1d`) to flat representations of
        size ``head.in_features``.
    head : nn.Linear
        Classifier mapping representations to ``num_classes`` logits.
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)``, ``(C, L)`` or ``(L,)``.
    num_classes : int
        Number of classes, at least 2; must equal ``head.out_features``.
    min_input_size : int, optional
        Images smaller than this in height or width are bilinearly upsampled to at
        least this size (signals shorter than it linearly), by default
        :data:`MIN_INPUT_SIZE`.
    flat_input : FlatInput, optional
        How a flat vector is read, ``"signal"`` (default) or ``"square"``; the
        backbone must have the matching dimensionality.
    """

    def __init__(
        self,
        *,
        backbone: nn.Module,
        head: nn.Linear,
        input_shape: Sequence[int],
        num_classes: int,
        min_input_size: int = MIN_INPUT_SIZE,
        flat_input: FlatInput = "signal",
    ) -> None:
        super().__init__(
            input_shape=input_shape,
            feature_dim=head.in_features,
            num_classes=num_classes,
        )
        if head.out_features != self.num_classes:
            raise ValueError(
                f"head has {head.out_features} outputs but num_classes is "
                f"{self.num_classes}; build the head with num_classes outputs."
            )
        self.adapter = InputAdapter(input_shape=self.input_shape, flat_input=flat_input)
        _, *spatial = self.adapter.output_shape
        self.resize: nn.Module = nn.Identity()
        if min(spatial) < min_input_size:
            size = tuple(max(s, min_input_size) for s in spatial)
            mode = "linear" if len(spatial) == 1 else "bilinear"
            self.resize = nn.Upsample(size=size, mode=mode, align_corners=False)
        self.backbone = backbone
        self.head = head

    def forward_features(self, x: Tensor) -> Tensor:
        """Map a batch to representations of size ``feature_dim``.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *input_shape)``.

        Returns
        -------
        Tensor
            Representations of shape ``(N, feature_dim)``.
        """
        z: Tensor = self.backbone(self.resize(self.adapter(x)))
        return z


def _torchvision_models(model_name: str) -> ModuleType:
    """Import ``torchvision.models``, or explain how to do without it."""
    try:
        return importlib.import_module("torchvision.models")
    except ImportError as err:
        others = [f for f in list_families() if f != FAMILY]
        raise ImportError(
            f"torchvision is required for model '{model_name}'; install it with pip "
            f"install torchvision, or pick a model from the families "
            f"{'/'.join(others)}."
        ) from err


def _adapt_first_conv(model: nn.Module, in_channels: int) -> None:
    """Rebuild the first ``Conv2d`` of ``model`` for ``in_channels`` input channels."""
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    if not convs:  # pragma: no cover - every torchvision classifier starts with a conv
        raise ValueError(f"{type(model).__name__} has no Conv2d to adapt.")
    name, first = convs[0]
    if first.in_channels == in_channels:
        return
    replacement = nn.Conv2d(
        in_channels,
        first.out_channels,
        kernel_size=first.kernel_size,  # type: ignore[arg-type]
        stride=first.stride,  # type: ignore[arg-type]
        padding=first.padding,  # type: ignore[arg-type]
        bias=first.bias is not None,
    )
    nn.init.kaiming_normal_(replacement.weight, mode="fan_out", nonlinearity="relu")
    if replacement.bias is not None:
        nn.init.zeros_(replacement.bias)
    parent_name, _, child_name = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child_name, replacement)


def _first(value: int | tuple[int, ...] | str) -> int:
    """Return a 2-d layer's setting along the first spatial axis."""
    if isinstance(value, str):  # pragma: no cover - torchvision pads with numbers
        raise ValueError(f"padding {value!r} has no 1-d counterpart here.")
    return value if isinstance(value, int) else value[0]


def _layer_1d(module: nn.Module) -> nn.Module | None:
    """Return the 1-d counterpart of a 2-d layer, None for a module without one."""
    if isinstance(module, nn.Conv2d):
        conv = nn.Conv1d(
            module.in_channels,
            module.out_channels,
            kernel_size=_first(module.kernel_size),
            stride=_first(module.stride),
            padding=_first(module.padding),
            dilation=_first(module.dilation),
            groups=module.groups,
            bias=module.bias is not None,
        )
        nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        if conv.bias is not None:
            nn.init.zeros_(conv.bias)
        return conv
    if isinstance(module, nn.MaxPool2d):
        return nn.MaxPool1d(
            kernel_size=_first(module.kernel_size),
            stride=_first(module.stride),
            padding=_first(module.padding),
            dilation=_first(module.dilation),
            ceil_mode=module.ceil_mode,
        )
    if isinstance(module, nn.AdaptiveAvgPool2d):
        size = module.output_size
        if isinstance(size, int):
            return nn.AdaptiveAvgPool1d(size)
        first = None if size is None else size[0]
        if first is None:  # pragma: no cover - torchvision pools to a fixed size
            raise ValueError(f"{module!r} keeps the input size; it has no 1-d form here.")
        return nn.AdaptiveAvgPool1d(first)
    return None


def convert_to_1d(model: nn.Module) -> None:
    """Replace, in place, every ``Conv2d`` and 2-d pooling of ``model`` by its 1-d form.

    Convolutions keep their channels, groups and bias and take the first axis's
    kernel size, stride, padding and dilation (torchvision's kernels are square);
    they are freshly initialised (Kaiming normal, fan-out, as torchvision does).
    ``MaxPool2d`` becomes ``MaxPool1d``, ``AdaptiveAvgPool2d`` ``AdaptiveAvgPool1d``.
    Norm layers are not touched: build the model with a 1-d norm
    (:func:`models.norm.norm_for_ndim`).

    Parameters
    ----------
    model : nn.Module
        The network to convert.

    Raises
    ------
    ValueError
        If a 2-d module without a 1-d counterpart here (e.g. ``BatchNorm2d`` or
        ``AvgPool2d``) is left after the conversion.
    """
    for name, child in model.named_children():
        replacement = _layer_1d(child)
        if replacement is None:
            convert_to_1d(child)
        else:
            setattr(model, name, replacement)
    left = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("2d")})
    if left:
        raise ValueError(
            f"{type(model).__name__} still has 2-d layers {left} after conversion to 1-d; "
            f"build it with a 1-d norm (models.norm.norm_for_ndim) or use "
            f"flat_input='square'."
        )


def _as_linear(module: object, where: str) -> nn.Linear:
    """Return ``module`` if it is the expected linear classifier, else raise."""
    if not isinstance(module, nn.Linear):  # pragma: no cover - torchvision changed
        raise TypeError(
            f"Expected torchvision's {where} to be nn.Linear, got "
            f"{type(module).__name__}; this torchvision version is not supported."
        )
    return module


@dataclass(frozen=True)
class TorchvisionConfig:
    """Which torchvision classifier a ``tv-*`` model is, and how it is adapted.

    Attributes
    ----------
    arch : str
        Name of the constructor in ``torchvision.models``, e.g. ``"resnet18"``; the
        model is registered as ``tv-<arch>`` (:attr:`model_name`).
    classifier : {"fc", "classifier"}
        Where the last linear layer, which becomes the head, sits: ``"fc"`` for
        ResNet's ``fc`` (replaced by an identity); ``"classifier"`` for
        MobileNetV3's ``classifier`` (pre-logits, activation, dropout, linear),
        built with ``dropout=0.0`` and cut to pre-logits and activation.
    """

    arch: str
    classifier: Literal["fc", "classifier"]

    @property
    def model_name(self) -> str:
        """The registered name, ``tv-<arch>``."""
        return f"tv-{self.arch}"

    def build(
        self,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        norm_layer: NormFactory,
        flat_input: FlatInput = "signal",
    ) -> TorchvisionModel:
        """Build the torchvision network behind the zoo's interface (module docstring).

        Parameters
        ----------
        input_shape : Sequence[int]
            Shape of one sample, ``(C, H, W)``, ``(C, L)`` or ``(L,)``.
        num_classes : int
            Number of classes, at least 2.
        norm_layer : NormFactory
            Normalisation replacing torchvision's, mapped to the input's
            dimensionality (:func:`models.norm.norm_for_ndim`).
        flat_input : FlatInput, optional
            How a flat vector is read, ``"signal"`` (default) or ``"square"``.

        Returns
        -------
        TorchvisionModel
            A freshly initialised, untrained model.

        Raises
        ------
        ImportError
            If torchvision is not installed; the message says how to fix it.
        """
        tvm = _torchvision_models(self.model_name)
        adapter = InputAdapter(input_shape=input_shape, flat_input=flat_input)
        options = {"dropout": 0.0} if self.classifier == "classifier" else {}
        model: nn.Module = getattr(tvm, self.arch)(
            weights=None,
            num_classes=num_classes,
            norm_layer=norm_for_ndim(norm_layer, adapter.ndim),
            **options,
        )
        _adapt_first_conv(model, adapter.output_shape[0])
        if self.classifier == "fc":
            head = _as_linear(model.fc, f"{self.arch}.fc")
            model.fc = nn.Identity()
        else:
            pre_logits, activation, _dropout, last = model.get_submodule("classifier").children()
            head = _as_linear(last, f"{self.arch}.classifier[3]")
            model.classifier = nn.Sequential(pre_logits, activation)
        if adapter.ndim == 1:
            convert_to_1d(model)
        return TorchvisionModel(
            backbone=model,
            head=head,
            input_shape=input_shape,
            num_classes=num_classes,
            flat_input=flat_input,
        )


TORCHVISION_VARIANTS: Final[tuple[tuple[str, TorchvisionConfig, str], ...]] = tuple(
    (config.model_name, config, description)
    for config, description in (
        (
            TorchvisionConfig(arch="mobilenet_v3_small", classifier="classifier"),
            "torchvision MobileNetV3-Small, untrained, 1024-d features",
        ),
        (
            TorchvisionConfig(arch="mobilenet_v3_large", classifier="classifier"),
            "torchvision MobileNetV3-Large, untrained, 1280-d features",
        ),
        (
            TorchvisionConfig(arch="resnet18", classifier="fc"),
            "torchvision ResNet-18 (ImageNet stem), untrained, 512-d features",
        ),
    )
)
"""The registered models, ``(name, config, description)`` by ascending size rank."""


register_family(FAMILY, TORCHVISION_VARIANTS)
