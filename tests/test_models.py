"""Tests of the model zoo: registry, every model on every input kind, norms, counts."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import models
from models import (
    CNNConfig,
    MobileNetV2Config,
    PreResNetConfig,
    ResNetConfig,
    TesseraModel,
    count_activations,
    count_macs,
    count_parameters,
    get_model,
    get_norm,
    image_shape,
    list_families,
    list_models,
    list_norms,
    model_entry,
)
from models.cnn import CNN_VARIANTS
from models.inputs import InputAdapter
from models.layers import make_divisible
from models.norm import group_count
from models.registry import ModelRegistry, register_family
from models.resnet import RESNET_STAGE_BLOCKS

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_CLASSES = 7  # not a default anywhere, so a head built for the wrong size fails
INPUT_SHAPES = [(1, 8, 8), (3, 32, 32), (20,)]
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def _model_param(name: str) -> object:
    """Wrap a model name as a pytest param, skipped when its dependency is absent."""
    needs_tv = model_entry(name).family == "torchvision"
    marks = [
        pytest.mark.skipif(
            needs_tv and not HAS_TORCHVISION,
            reason="torchvision is not installed; tv-* models need it",
        )
    ]
    return pytest.param(name, marks=marks, id=name)


ALL_MODELS = [_model_param(name) for name in list_models()]
FAMILIES_WITHOUT_TV = [f for f in list_families() if f != "torchvision"]
FAMILIES = [
    pytest.param(
        f,
        marks=pytest.mark.skipif(
            f == "torchvision" and not HAS_TORCHVISION,
            reason="torchvision is not installed",
        ),
    )
    for f in list_families()
]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# --------------------------------------------------------------------------- registry


def test_families_registered_on_import() -> None:
    assert list_families() == [
        "cnn",
        "densenet",
        "mixed",
        "mlp",
        "mobilenetv2",
        "preresnet",
        "resnet",
        "torchvision",
        "vgg",
    ]


def test_unknown_model_raises_with_name_and_choices() -> None:
    with pytest.raises(ValueError, match=r"Unknown model 'resnet-9000'\. Available: "):
        get_model("resnet-9000", input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    with pytest.raises(ValueError, match="cnn-1"):
        model_entry("resnet-9000")


CNN_1, CNN_2 = CNN_VARIANTS[0][1], CNN_VARIANTS[1][1]


def test_duplicate_name_raises() -> None:
    # Prepare
    registry = ModelRegistry()
    registry.register("a", CNN_1, family="f", size_rank=0)

    # Execute / Assert
    with pytest.raises(ValueError, match="'a' is already registered"):
        registry.register("a", CNN_2, family="g", size_rank=0)
    with pytest.raises(ValueError, match="'a' is already registered"):
        registry.register_family("h", [("b", CNN_1, ""), ("a", CNN_2, "")])
    with pytest.raises(ValueError, match="'cnn-1' is already registered"):
        register_family("other", [("cnn-1", CNN_1, "")])
    assert model_entry("cnn-1").family == "cnn"


def test_duplicate_family_rank_raises() -> None:
    registry = ModelRegistry()
    registry.register("a", CNN_1, family="f", size_rank=0)

    with pytest.raises(ValueError, match="already has size_rank 0"):
        registry.register("b", CNN_2, family="f", size_rank=0)
    with pytest.raises(ValueError, match="already has size_rank 0"):
        registry.register_family("f", [("c", CNN_2, "")])
    with pytest.raises(ValueError, match="size_rank must be >= 0"):
        registry.register("c", CNN_2, family="f", size_rank=-1)
    assert registry.names() == ["a"]


def test_register_family_ranks_by_place_in_table() -> None:
    # Prepare
    registry = ModelRegistry()

    # Execute
    registry.register_family("f", [("small", CNN_1, "one conv"), ("big", CNN_2, "two convs")])

    # Assert: ranks 0, 1 in table order; each entry keeps its config and description
    assert registry.names("f") == ["small", "big"]
    assert [registry.entry(n).size_rank for n in ("small", "big")] == [0, 1]
    assert registry.entry("big").config is CNN_2
    assert registry.entry("small").description == "one conv"


def test_registered_ranks_are_contiguous() -> None:
    for family in [f for f in list_families() if f != "mixed"]:
        ranks = [model_entry(n).size_rank for n in list_models(family)]
        assert ranks == list(range(len(ranks))), family


@pytest.mark.parametrize("name", ["cnn-2", "mlp-s", "resnet10", "vgg11_0125"])
def test_get_model_builds_the_entrys_config(name: str) -> None:
    # Prepare
    config = model_entry(name).config
    torch.manual_seed(5)
    expected = config.build(
        input_shape=(20,), num_classes=NUM_CLASSES, norm_layer=get_norm("group")
    )

    # Execute
    torch.manual_seed(5)
    model = get_model(name, input_shape=(20,), num_classes=NUM_CLASSES, norm="group")

    # Assert: same class, same keys in the same order, same values
    assert type(model) is type(expected)
    assert list(model.state_dict()) == list(expected.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected.state_dict()[key]), key


def test_list_models_orders_by_family_then_size_rank() -> None:
    # Prepare: a registry filled out of order
    registry = ModelRegistry()
    for name, family, rank in [("z1", "b", 1), ("z0", "b", 0), ("y", "a", 3)]:
        registry.register(name, CNN_1, family=family, size_rank=rank)

    # Execute / Assert
    assert registry.names() == ["y", "z0", "z1"]
    assert registry.names("b") == ["z0", "z1"]
    assert list_models("cnn") == ["cnn-1", "cnn-2", "cnn-3", "cnn-4", "cnn-5"]
    assert list_models("resnet") == [
        "resnet10",
        "resnet14",
        "resnet18",
        "resnet22",
        "resnet26",
    ]
    # "mixed" is a cross-family set of registered models, not a family of its own
    families = [f for f in list_families() if f != "mixed"]
    assert list_models() == [n for f in families for n in list_models(f)]
    for family in families:
        ranks = [model_entry(n).size_rank for n in list_models(family)]
        assert ranks == sorted(ranks)


def test_unknown_family_raises_listing_families() -> None:
    with pytest.raises(ValueError, match=r"Unknown model family 'vit'.*cnn, densenet, mixed, mlp"):
        list_models("vit")


@pytest.mark.parametrize("num_classes", [1, 0, -3, 2.0, True])
def test_bad_num_classes_raises(num_classes: object) -> None:
    with pytest.raises(ValueError, match="num_classes"):
        get_model("cnn-1", input_shape=(1, 8, 8), num_classes=num_classes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "input_shape", [(), (8, 0), (1, 1, 8, 8), (1, 0, 8), (-4,), (1, 8.0, 8), (True,)]
)
def test_bad_input_shape_raises(input_shape: tuple[object, ...]) -> None:
    with pytest.raises(ValueError, match=r"input_shape"):
        get_model("cnn-1", input_shape=input_shape, num_classes=NUM_CLASSES)  # type: ignore[arg-type]


def test_entries_describe_models() -> None:
    for name in list_models():
        entry = model_entry(name)
        assert entry.name == name
        assert entry.description
        with pytest.raises(dataclasses.FrozenInstanceError):
            entry.size_rank = 99  # type: ignore[misc]


# ---------------------------------------------------------------- every model x input


@pytest.mark.parametrize("input_shape", INPUT_SHAPES, ids=str)
@pytest.mark.parametrize("name", ALL_MODELS)
def test_model_forward_backward(name: str, input_shape: tuple[int, ...]) -> None:
    # Prepare
    model = get_model(name, input_shape=input_shape, num_classes=NUM_CLASSES)
    x = torch.randn(3, *input_shape)
    target = torch.tensor([0, 3, 6])

    # Execute
    logits = model(x)
    features = model.forward_features(x)
    recomposed = model.forward_head(features)
    torch.nn.functional.cross_entropy(logits, target).backward()

    # Assert
    assert isinstance(model, TesseraModel)
    assert model.num_classes == NUM_CLASSES
    assert model.input_shape == input_shape
    assert logits.shape == (3, NUM_CLASSES)
    assert features.shape == (3, model.feature_dim)
    torch.testing.assert_close(recomposed, logits)
    for pname, param in model.named_parameters():
        assert param.grad is not None, f"{name}: {pname} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{name}: {pname} has a bad gradient"


@pytest.mark.parametrize("name", ALL_MODELS)
def test_model_init_is_deterministic_given_seed(name: str) -> None:
    torch.manual_seed(123)
    first = get_model(name, input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    torch.manual_seed(123)
    second = get_model(name, input_shape=(1, 8, 8), num_classes=NUM_CLASSES)

    for (key, a), (_, b) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("name", ["cnn-2", "resnet10", "mlp-s"])
def test_model_rejects_batch_of_wrong_shape(name: str) -> None:
    model = get_model(name, input_shape=(1, 8, 8), num_classes=NUM_CLASSES)

    with pytest.raises(ValueError, match=r"input_shape \(1, 8, 8\).*\(2, 3, 8, 8\)"):
        model(torch.randn(2, 3, 8, 8))


def test_reset_classifier() -> None:
    model = get_model("cnn-3", input_shape=(20,), num_classes=NUM_CLASSES)

    model.reset_classifier(4)

    assert model.num_classes == 4
    assert model.get_classifier().out_features == 4
    assert model(torch.randn(2, 20)).shape == (2, 4)


# ------------------------------------------------------------------------ flat inputs


def test_square_form_pads_flat_vectors_to_a_square() -> None:
    # Prepare: 20 values -> ceil(sqrt(20)) = 5, so 5 zeros of padding
    adapter = InputAdapter(input_shape=(20,), flat_input="square")
    x = torch.arange(40, dtype=torch.float32).reshape(2, 20) + 1

    # Execute
    image = adapter(x)

    # Assert
    assert adapter.output_shape == (1, 5, 5)
    assert image.shape == (2, 1, 5, 5)
    torch.testing.assert_close(image.flatten(1)[:, :20], x)
    assert (image.flatten(1)[:, 20:] == 0).all()
    assert image_shape((64,)) == (1, 8, 8)
    assert image_shape((3, 32, 32)) == (3, 32, 32)
    assert image_shape((1,)) == (1, 1, 1)


@pytest.mark.skipif(not HAS_TORCHVISION, reason="torchvision is not installed")
def test_torchvision_models_upsample_small_inputs() -> None:
    small = get_model("tv-resnet18", input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    large = get_model("tv-resnet18", input_shape=(3, 64, 64), num_classes=NUM_CLASSES)

    assert isinstance(small.resize, nn.Upsample)
    assert small.resize.size == (32, 32)
    assert isinstance(large.resize, nn.Identity)
    assert small.get_submodule("backbone.conv1").in_channels == 1


def test_torchvision_missing_raises_helpful_import_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.models", None)

    expected = (
        "torchvision is required for model 'tv-resnet18'; install it with pip "
        "install torchvision, or pick a model from the families cnn/"
    )
    with pytest.raises(ImportError, match=re.escape(expected)):
        get_model("tv-resnet18", input_shape=(3, 32, 32), num_classes=NUM_CLASSES)


def test_models_import_without_torchvision() -> None:
    code = (
        "import sys; sys.modules['torchvision'] = None; import models; "
        "m = models.get_model('cnn-1', input_shape=(64,), num_classes=3); "
        "assert 'tv-resnet18' in models.list_models(); "
        "assert 'torchvision' not in [k for k, v in sys.modules.items() if v]"
    )

    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )

    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------- norms


NORM_MODELS = ["cnn-3", "resnet10", "preresnet10_050", "mobilenetv2_035", "mlp-m"]


@pytest.mark.parametrize("norm", list_norms())
@pytest.mark.parametrize("name", NORM_MODELS)
def test_every_norm_builds_and_runs(name: str, norm: str) -> None:
    # Prepare
    model = get_model(name, input_shape=(1, 8, 8), num_classes=NUM_CLASSES, norm=norm)
    norms = [m for m in model.modules() if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm))]

    # Execute
    out = model(torch.randn(4, 1, 8, 8))
    out.sum().backward()

    # Assert
    assert out.shape == (4, NUM_CLASSES)
    if norm == "none":
        assert norms == []
    elif norm == "group":
        assert norms and all(isinstance(m, nn.GroupNorm) for m in norms)
    else:
        assert norms and all(isinstance(m, nn.BatchNorm2d) for m in norms)
        tracking = norm == "batch"
        assert all(m.track_running_stats is tracking for m in norms)


@pytest.mark.parametrize("name", ["cnn-3", "resnet10", "mlp-m"])
def test_static_batch_norm_same_output_in_train_and_eval(name: str) -> None:
    # Prepare
    static = get_model(name, input_shape=(1, 8, 8), num_classes=NUM_CLASSES, norm="static-batch")
    running = get_model(name, input_shape=(1, 8, 8), num_classes=NUM_CLASSES, norm="batch")
    x = torch.randn(5, 1, 8, 8) * 3 + 1

    # Execute
    static_train, running_train = static.train()(x), running.train()(x)
    static_eval, running_eval = static.eval()(x), running.eval()(x)

    # Assert: identical for static BN; ordinary BN differs, so the check can fail
    torch.testing.assert_close(static_train, static_eval)
    assert not torch.allclose(running_train, running_eval)


def test_unknown_norm_raises() -> None:
    with pytest.raises(ValueError, match=r"Unknown norm 'layer'.*batch, static-batch"):
        get_norm("layer")
    with pytest.raises(ValueError, match="Unknown norm 'layer'"):
        get_model("cnn-3", input_shape=(1, 8, 8), num_classes=NUM_CLASSES, norm="layer")


@pytest.mark.parametrize(
    ("channels", "groups"), [(64, 32), (48, 24), (16, 16), (12, 12), (33, 11), (1, 1)]
)
def test_group_norm_uses_largest_divisor_up_to_32(channels: int, groups: int) -> None:
    assert group_count(channels) == groups
    norm = get_norm("group")(channels)
    assert isinstance(norm, nn.GroupNorm)
    assert norm.num_groups == groups


# --------------------------------------------------------------------------- counting


def test_counts_of_a_linear_layer() -> None:
    # 4 * 3 weights + 3 biases; 3 outputs each summing 4 products
    model = nn.Linear(4, 3)

    assert count_parameters(model) == 15
    assert count_macs(model, (4,)) == 12
    assert count_activations(model, (4,)) == 3


def test_counts_of_convolutions() -> None:
    # 2 output maps of 4x4, each pixel 1 channel x 3x3 products
    conv = nn.Conv2d(1, 2, 3, padding=1)
    # depthwise: 4 maps of 5x5, each pixel 1 channel x 3x3 products
    depthwise = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
    # 4 output channels of length 10 - 3 + 1 = 8, each 2 channels x 3 products
    conv1d = nn.Conv1d(2, 4, 3)

    assert count_parameters(conv) == 2 * 1 * 9 + 2
    assert count_macs(conv, (1, 4, 4)) == 2 * 1 * 9 * 16 == 288
    assert count_macs(depthwise, (4, 5, 5)) == 4 * 25 * 1 * 9
    assert count_macs(conv1d, (2, 10)) == 4 * 8 * 2 * 3


def test_counts_skip_frozen_parameters_and_identity() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Identity())
    model[0].bias.requires_grad_(False)

    assert count_parameters(model) == 12
    assert count_activations(model, (4,)) == 3 + 3


def test_cnn_counts_match_hand_computed_formula() -> None:
    # cnn-1 on (1, 8, 8): conv 1->16 3x3 pad 1 (no bias), BN(16), ReLU, max-pool,
    # global average pool, head Linear(16, 7).
    cnn1 = get_model("cnn-1", input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    conv_macs = 16 * (8 * 8) * (1 * 3 * 3)
    head_macs = 16 * NUM_CLASSES
    params = 16 * 1 * 3 * 3 + 2 * 16 + (16 * NUM_CLASSES + NUM_CLASSES)
    assert count_macs(cnn1, (1, 8, 8)) == conv_macs + head_macs == 9328
    assert count_parameters(cnn1) == params == 295

    # The same on a flat 20-vector, seen as a 5x5 image.
    cnn1_flat = get_model("cnn-1", input_shape=(20,), num_classes=NUM_CLASSES, flat_input="square")
    assert count_macs(cnn1_flat, (20,)) == 16 * 25 * 9 + head_macs

    # cnn-3: conv 1->16 at 8x8, pool to 4x4, conv 16->32 at 4x4, pool to 2x2, GAP,
    # fc 32->64, head 64->7.
    cnn3 = get_model("cnn-3", input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    macs = 16 * 64 * 9 + 32 * 16 * (16 * 9) + 32 * 64 + 64 * NUM_CLASSES
    params = (16 * 9 + 32) + (32 * 16 * 9 + 64) + (32 * 64 + 64) + (64 * 7 + 7)
    assert count_macs(cnn3, (1, 8, 8)) == macs
    assert count_parameters(cnn3) == params


def test_mlp_counts_match_hand_computed_formula() -> None:
    # mlp-m on (3, 4, 4) = 48 inputs: 48->128 (+BN), 128->64 (+BN), head 64->7.
    mlp = get_model("mlp-m", input_shape=(3, 4, 4), num_classes=NUM_CLASSES)

    assert count_macs(mlp, (3, 4, 4)) == 48 * 128 + 128 * 64 + 64 * 7
    assert count_parameters(mlp) == (
        (48 * 128 + 128) + 2 * 128 + (128 * 64 + 64) + 2 * 64 + (64 * 7 + 7)
    )


def test_counting_leaves_modes_and_statistics_untouched() -> None:
    # Prepare: train mode overall, one submodule in eval mode
    model = get_model("resnet10", input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    model.train()
    model.get_submodule("stem").eval()
    modes = {name: m.training for name, m in model.named_modules()}
    before = {k: v.clone() for k, v in model.state_dict().items()}

    # Execute
    count_macs(model, (1, 8, 8))
    count_activations(model, (1, 8, 8))

    # Assert
    assert {name: m.training for name, m in model.named_modules()} == modes
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_counting_works_with_static_batch_norm_at_1x1() -> None:
    # resnet10 on 8x8 reaches 1x1 maps, where static BN needs more than one sample.
    model = get_model(
        "resnet10", input_shape=(1, 8, 8), num_classes=NUM_CLASSES, norm="static-batch"
    )
    reference = get_model("resnet10", input_shape=(1, 8, 8), num_classes=NUM_CLASSES)

    assert count_macs(model, (1, 8, 8)) == count_macs(reference, (1, 8, 8))
    assert count_activations(model, (1, 8, 8)) > 0


# ------------------------------------------------------------------------ model sizes


@pytest.mark.parametrize("input_shape", [(1, 8, 8), (3, 32, 32)], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_sizes_strictly_increase_within_family(family: str, input_shape: tuple[int, ...]) -> None:
    built = [
        get_model(n, input_shape=input_shape, num_classes=NUM_CLASSES) for n in list_models(family)
    ]

    params = [count_parameters(m) for m in built]
    macs = [count_macs(m, input_shape) for m in built]

    assert all(a < b for a, b in itertools.pairwise(params)), params
    assert all(a < b for a, b in itertools.pairwise(macs)), macs


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize("depth", sorted(RESNET_STAGE_BLOCKS))
def test_resnet_depth_table(depth: int) -> None:
    config = ResNetConfig(stage_blocks=RESNET_STAGE_BLOCKS[depth])
    model = get_model(f"resnet{depth}", input_shape=(3, 32, 32), num_classes=NUM_CLASSES)
    weight_layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    shortcuts = len(config.stage_blocks) - 1  # one 1x1 projection per later stage

    assert config.depth == depth
    assert len(weight_layers) - shortcuts == depth
    assert model.feature_dim == 512


def test_configs_are_frozen_and_validated() -> None:
    config = PreResNetConfig(stage_depths=(1, 1, 1, 1), width_mult=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.width_mult = 1.0  # type: ignore[misc]
    assert config.widths == (32, 64, 128, 256)

    with pytest.raises(ValueError, match="one width per stage"):
        PreResNetConfig(stage_depths=(1, 1), base_widths=(64, 128, 256))
    with pytest.raises(ValueError, match="width_mult must be > 0, got 0"):
        MobileNetV2Config(width_mult=0)
    with pytest.raises(ValueError, match="depths must give a positive block count"):
        MobileNetV2Config(depths=(1, 2))
    with pytest.raises(ValueError, match="at least one convolution"):
        CNNConfig(conv_channels=())
    with pytest.raises(ValueError, match="base_width must be >= 1"):
        ResNetConfig(stage_blocks=(1, 1), base_width=0)


def test_small_resnet_via_base_width() -> None:
    model = models.ResNet(
        config=ResNetConfig(stage_blocks=(1, 1), base_width=8),
        input_shape=(20,),
        num_classes=NUM_CLASSES,
    )

    assert model.feature_dim == 16
    assert model(torch.randn(2, 20)).shape == (2, NUM_CLASSES)


def test_mobilenetv2_depths_override_table() -> None:
    config = MobileNetV2Config(width_mult=0.5, depths=(1, 1, 1, 1, 1, 1, 1))
    model = models.MobileNetV2(config=config, input_shape=(1, 8, 8), num_classes=3)

    blocks = [m for m in model.modules() if isinstance(m, models.mobilenetv2.InvertedResidual)]
    assert len(blocks) == 7
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 3)


@pytest.mark.parametrize(
    ("value", "expected"), [(32 * 0.35, 16), (24 * 0.5, 16), (1280.0, 1280), (3.0, 8)]
)
def test_make_divisible(value: float, expected: int) -> None:
    assert make_divisible(value) == expected
