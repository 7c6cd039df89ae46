"""Tessera's model zoo: heterogeneous architectures behind one interface.

Every model is a :class:`TesseraModel` with a body (``forward_features``, flat
representations of size ``feature_dim``) and a linear head (``forward_head``).
Importing this package registers every family (``cnn``, ``densenet``, ``mlp``,
``mobilenetv2``, ``preresnet``, ``resnet``, ``torchvision``, ``vgg``); build models by
name with :func:`get_model` and enumerate them with :func:`list_models`. Every family
is a table of frozen configs (:class:`~models.base.ModelConfig`, exposed as
``model_entry(name).config``) registered with :func:`models.registry.register_family`.
torchvision is only imported when a ``tv-*`` model is built. ``mixed`` is a cross-family
pseudo-family, not a family of its own: ``list_models("mixed")`` names one small
model of each of ``mobilenetv2``, ``vgg``, ``densenet`` and ``resnet``
(:data:`models.cross_family.MIXED_MEMBERS`) by ascending cost, so that devices of
different capacity pick different families.

Inputs are images ``(C, H, W)``, signals ``(C, L)`` or flat vectors ``(L,)``. Every
convolutional family has a 2-d form for images and a 1-d form (``Conv1d``,
``BatchNorm1d``, 1-d pooling; same table, names and sizes) for signals; a flat vector
is a one-channel signal by default, or, with ``get_model(..., flat_input="square")``,
a zero-padded square image (:mod:`models.inputs`).

The sectioned families (``preresnet``, ``mobilenetv2``) can be sliced by width and
depth: :func:`build_submodel` builds any :class:`~strategies.submodel.SubModelSpec`
of a registered model's config (``model_entry(name).config``), and
:func:`family_layout` returns the :class:`~strategies.submodel.Layout` that
extraction and grafting use (:mod:`models.slicing`).

Examples
--------
>>> from models import get_model, list_models
>>> model = get_model("cnn-3", input_shape=(1, 8, 8), num_classes=10, norm="group")
>>> list_models("mlp")
['mlp-s', 'mlp-m', 'mlp-l']
"""

# Importing the family modules registers their models; keep one import per family.
from models import cnn, densenet, mlp, mobilenetv2, preresnet, resnet, tv, vgg
from models.base import ConvModel, FamilyConfig, ModelConfig, TesseraModel
from models.cnn import CNN, CNNConfig
from models.cost import count_activations, count_macs, count_parameters
from models.densenet import DenseNet, DenseNetConfig
from models.inputs import FLAT_INPUTS, FlatInput, image_shape
from models.mlp import MLP, MLPConfig
from models.mobilenetv2 import (
    BlockPlan,
    InvertedResidualSetting,
    MobileNetV2,
    MobileNetV2Config,
)
from models.norm import NormFactory, get_norm, list_norms
from models.preresnet import PreResNet, PreResNetConfig
from models.registry import (
    ModelEntry,
    get_model,
    list_families,
    list_models,
    model_entry,
)
from models.resnet import ResNet, ResNetConfig
from models.slicing import (
    SectionedConfig,
    build_submodel,
    family_layout,
    full_spec,
    global_config,
)
from models.tv import TorchvisionConfig, TorchvisionModel
from models.vgg import VGG, VGGConfig

__all__ = [
    "CNN",
    "FLAT_INPUTS",
    "MLP",
    "VGG",
    "BlockPlan",
    "CNNConfig",
    "ConvModel",
    "DenseNet",
    "DenseNetConfig",
    "FamilyConfig",
    "FlatInput",
    "InvertedResidualSetting",
    "MLPConfig",
    "MobileNetV2",
    "MobileNetV2Config",
    "ModelConfig",
    "ModelEntry",
    "NormFactory",
    "PreResNet",
    "PreResNetConfig",
    "ResNet",
    "ResNetConfig",
    "SectionedConfig",
    "TesseraModel",
    "TorchvisionConfig",
    "TorchvisionModel",
    "VGGConfig",
    "build_submodel",
    "cnn",
    "count_activations",
    "count_macs",
    "count_parameters",
    "densenet",
    "family_layout",
    "full_spec",
    "get_model",
    "get_norm",
    "global_config",
    "image_shape",
    "list_families",
    "list_models",
    "list_norms",
    "mlp",
    "mobilenetv2",
    "model_entry",
    "preresnet",
    "resnet",
    "tv",
    "vgg",
]
