"""Common interface of every model in the zoo, and of the configs that build them.

Every model is a :class:`TesseraModel`: a *body* (:meth:`TesseraModel.forward_features`)
that maps a batch of inputs to flat representations of size ``feature_dim``, and a
*head* (:meth:`TesseraModel.forward_head`), one linear layer mapping representations
to ``num_classes`` logits. Representation alignment (FedHeNN), feature/logit exchange
(Felo) and personalised heads all rely on this split, so it is part of the base class
rather than something probed for with ``hasattr``.

Every registered model is a frozen config that builds it (:class:`ModelConfig`). The
table-driven families derive their configs from :class:`FamilyConfig`, whose one
generic :meth:`FamilyConfig.build` instantiates the family's model class with the
config; the convolutional families derive their models from :class:`ConvModel`, which
owns what they share: the config, the input adapter (:mod:`models.inputs`), the layer
types of the input's dimensionality and the linear head.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

from torch import Tensor, nn

from models.inputs import FlatInput, InputAdapter, validate_input_shape, validate_num_classes
from models.layers import SpatialLayers, init_conv_weights
from models.norm import NormFactory, batch_norm

__all__ = [
    "ConvModel",
    "FamilyConfig",
    "ModelConfig",
    "TesseraModel",
]


class TesseraModel(nn.Module, ABC):
    """Abstract base of every model in the zoo: a body and a linear head.

    Subclasses implement :meth:`forward_features` and assign ``self.head`` (an
    ``nn.Linear(feature_dim, num_classes)``); :meth:`forward` composes the two.

    Parameters
    ----------
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)``, ``(C, L)`` or ``(L,)``.
    feature_dim : int
        Size of the flat representation returned by :meth:`forward_features`.
    num_classes : int
        Number of output classes, at least 2.

    Attributes
    ----------
    input_shape : tuple[int, ...]
        Shape of one sample the model was built for.
    feature_dim : int
        Size of the representation returned by :meth:`forward_features`.
    num_classes : int
        Number of logits returned by :meth:`forward_head`.
    head : nn.Linear
        The classifier, mapping representations to logits.
    """

    input_shape: tuple[int, ...]
    feature_dim: int
    num_classes: int
    head: nn.Linear

    def __init__(self, *, input_shape: Sequence[int], feature_dim: int, num_classes: int) -> None:
        super().__init__()
        if feature_dim < 1:
            raise ValueError(f"feature_dim must be >= 1, got {feature_dim}.")
        self.input_shape = validate_input_shape(input_shape)
        self.feature_dim = int(feature_dim)
        self.num_classes = validate_num_classes(num_classes)

    @abstractmethod
    def forward_features(self, x: Tensor) -> Tensor:
        """Map a batch of inputs to flat representations.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *input_shape)``.

        Returns
        -------
        Tensor
            Representations of shape ``(N, feature_dim)``.
        """

    def forward_head(self, z: Tensor) -> Tensor:
        """Map representations to logits.

        Parameters
        ----------
        z : Tensor
            Representations of shape ``(N, feature_dim)``.

        Returns
        -------
        Tensor
            Logits of shape ``(N, num_classes)``.
        """
        logits: Tensor = self.head(z)
        return logits

    def forward(self, x: Tensor) -> Tensor:
        """Return ``forward_head(forward_features(x))``.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *input_shape)``.

        Returns
        -------
        Tensor
            Logits of shape ``(N, num_classes)``.
        """
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Linear:
        """Return the classifier head.

        Returns
        -------
        nn.Linear
            The linear layer mapping representations to logits.
        """
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head with a freshly initialised one for ``num_classes`` classes.

        Parameters
        ----------
        num_classes : int
            New number of classes, at least 2.
        """
        self.num_classes = validate_num_classes(num_classes)
        old = self.head
        self.head = nn.Linear(
            self.feature_dim,
            self.num_classes,
            device=old.weight.device,
            dtype=old.weight.dtype,
        )


class ModelConfig(Protocol):
    """A frozen architecture that builds its model: what the registry keeps per model."""

    def build(
        self,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        norm_layer: NormFactory,
        flat_input: FlatInput = "signal",
    ) -> TesseraModel:
        """Build the model this config describes.

        Parameters
        ----------
        input_shape : Sequence[int]
            Shape of one sample (already valid), ``(C, H, W)``, ``(C, L)`` or ``(L,)``.
        num_classes : int
            Number of classes, at least 2.
        norm_layer : NormFactory
            Normalisation factory (:func:`models.norm.get_norm`).
        flat_input : FlatInput, optional
            How a flat vector is read, ``"signal"`` (default) or ``"square"``.

        Returns
        -------
        TesseraModel
            A freshly initialised model.
        """
        ...


class FamilyConfig(ABC):
    """Base of the frozen config tables: one generic :meth:`build` for every family.

    A family's config is a frozen dataclass deriving from this class that names the
    model class it builds in the class variable ``model_class``; the model class takes
    the keyword-only arguments ``config``, ``input_shape``, ``num_classes``,
    ``norm_layer`` and ``flat_input``.
    """

    model_class: ClassVar[Callable[..., TesseraModel]]
    """The family's model class, built by :meth:`build` with ``config=self``."""

    @property
    @abstractmethod
    def feature_dim(self) -> int:
        """Size of the representation of the model this config describes."""

    def build(
        self,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        norm_layer: NormFactory,
        flat_input: FlatInput = "signal",
    ) -> TesseraModel:
        """Build ``model_class(config=self, ...)``, see :meth:`ModelConfig.build`."""
        return type(self).model_class(
            config=self,
            input_shape=input_shape,
            num_classes=num_classes,
            norm_layer=norm_layer,
            flat_input=flat_input,
        )


class ConvModel(TesseraModel):
    """Base of the convolutional families: config, input adapter, body, linear head.

    The constructor is the families' common template: it keeps the config, builds the
    :class:`~models.inputs.InputAdapter` of the input, calls :meth:`build_body` with
    the layer types of the adapter's dimensionality (1-d for signals, 2-d for images)
    and the injected norm turned into their dimensionality, then builds the head
    ``nn.Linear(config.feature_dim, num_classes)`` and calls :meth:`init_weights`.
    :meth:`forward_features` applies the adapter, then the family's
    :meth:`forward_body`.

    Parameters
    ----------
    config : FamilyConfig
        The frozen architecture; ``config.feature_dim`` is the representation size.
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)``, ``(C, L)`` or ``(L,)``.
    num_classes : int
        Number of classes, at least 2.
    norm_layer : NormFactory, optional
        Normalisation of the body, batch norm by default (its 1-d form for signals,
        :func:`models.norm.norm_for_ndim`).
    flat_input : FlatInput, optional
        How a flat vector is read, ``"signal"`` (default) or ``"square"``.

    Attributes
    ----------
    config : FamilyConfig
        The architecture the model was built from.
    adapter : InputAdapter
        Turns a batch into what the body convolves.
    """

    config: FamilyConfig
    adapter: InputAdapter

    def __init__(
        self,
        *,
        config: FamilyConfig,
        input_shape: Sequence[int],
        num_classes: int,
        norm_layer: NormFactory = batch_norm,
        flat_input: FlatInput = "signal",
    ) -> None:
        super().__init__(
            input_shape=input_shape, feature_dim=config.feature_dim, num_classes=num_classes
        )
        self.config = config
        self.adapter = InputAdapter(input_shape=self.input_shape, flat_input=flat_input)
        layers = self.adapter.layers
        self.build_body(layers, layers.norm(norm_layer))
        self.head = nn.Linear(self.feature_dim, self.num_classes)
        self.init_weights()

    @abstractmethod
    def build_body(self, layers: SpatialLayers, norm_layer: NormFactory) -> None:
        """Build the body's modules from ``self.config``, in the order they run.

        Parameters
        ----------
        layers : SpatialLayers
            Convolution, pooling and norm types of the model's form (1-d or 2-d).
        norm_layer : NormFactory
            The injected norm, of the dimensionality of ``layers``.
        """

    def init_weights(self) -> None:
        """Initialise convolutions and norms as torchvision does (after the head)."""
        init_conv_weights(self)

    @abstractmethod
    def forward_body(self, x: Tensor) -> Tensor:
        """Map an adapted batch (:attr:`adapter`'s output) to representations.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *adapter.output_shape)``.

        Returns
        -------
        Tensor
            Representations of shape ``(N, feature_dim)``.
        """

    def forward_features(self, x: Tensor) -> Tensor:
        """Map a batch to representations: the adapter, then :meth:`forward_body`.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *input_shape)``.

        Returns
        -------
        Tensor
            Representations of shape ``(N, feature_dim)``.
        """
        return self.forward_body(self.adapter(x))
