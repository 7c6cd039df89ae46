"""Tests of the vgg and densenet families and of the cross-family set "mixed"."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch import nn

from client_app.device import predefined_profile
from client_app.selection import Budget, Workload, candidate_costs, choose_architecture
from models import (
    VGG,
    DenseNet,
    DenseNetConfig,
    VGGConfig,
    count_macs,
    count_parameters,
    get_model,
    get_norm,
    list_families,
    list_models,
    list_norms,
    model_entry,
)
from models.cnn import CNN_VARIANTS
from models.cross_family import MIXED_FAMILY, MIXED_MEMBERS
from models.registry import ModelRegistry, register_family
from models.vgg import VGG_STAGE_TABLES

NUM_CLASSES = 7  # not a default anywhere, so a head built for the wrong size fails
INPUT_SHAPES = [(1, 8, 8), (3, 32, 32), (64,)]
NEW_FAMILIES = ["vgg", "densenet"]
NEW_MODELS = [name for family in NEW_FAMILIES for name in list_models(family)]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# ------------------------------------------------------------------------ registration


def test_new_families_are_registered_with_configs() -> None:
    # Assert
    assert list_models("vgg") == ["vgg11_0125", "vgg13_025", "vgg16_025"]
    assert list_models("densenet") == ["densenet40_k12", "densenet76_k12"]
    for name in NEW_MODELS:
        entry = model_entry(name)
        assert entry.description
        assert isinstance(entry.config, (VGGConfig, DenseNetConfig))
    assert model_entry("vgg13_025").config == VGGConfig(
        stages=VGG_STAGE_TABLES[13], width_mult=0.25
    )
    assert model_entry("densenet40_k12").config == DenseNetConfig(
        block_config=(6, 6, 6), growth_rate=12, bn_size=4, compression=0.5, init_features=24
    )


# ----------------------------------------------------------- every model x input x norm


@pytest.mark.parametrize("norm", list_norms())
@pytest.mark.parametrize("input_shape", INPUT_SHAPES, ids=str)
@pytest.mark.parametrize("name", NEW_MODELS)
def test_forward_every_input_and_norm(name: str, input_shape: tuple[int, ...], norm: str) -> None:
    # Prepare
    model = get_model(name, input_shape=input_shape, num_classes=NUM_CLASSES, norm=norm)
    x = torch.randn(3, *input_shape)

    # Execute
    logits = model(x)
    features = model.forward_features(x)

    # Assert
    assert isinstance(model, (VGG, DenseNet))
    assert isinstance(model.head, nn.Linear)
    assert model.get_classifier() is model.head
    assert logits.shape == (3, NUM_CLASSES)
    assert features.shape == (3, model.feature_dim)
    assert model.feature_dim == model.config.feature_dim
    assert model.head.in_features == model.feature_dim
    torch.testing.assert_close(model.forward_head(features), logits)


@pytest.mark.parametrize("name", NEW_MODELS)
def test_backward_reaches_every_parameter(name: str) -> None:
    model = get_model(name, input_shape=(1, 8, 8), num_classes=NUM_CLASSES, norm="group")
    logits = model(torch.randn(2, 1, 8, 8))

    nn.functional.cross_entropy(logits, torch.tensor([0, 6])).backward()

    for pname, param in model.named_parameters():
        assert param.grad is not None, f"{name}: {pname} got no gradient"


def test_feature_dims_follow_the_tables() -> None:
    # VGG: the last stage's rounded width; 512 * 0.125 = 64, 512 * 0.25 = 128.
    assert get_model("vgg11_0125", input_shape=(1, 8, 8), num_classes=2).feature_dim == 64
    assert get_model("vgg16_025", input_shape=(1, 8, 8), num_classes=2).feature_dim == 128
    # DenseNet-BC-40, k=12: 24 + 6 * 12 = 96 -> 48; 48 + 72 = 120 -> 60; 60 + 72 = 132.
    config = DenseNetConfig(block_config=(6, 6, 6), growth_rate=12)
    assert config.block_channels() == ((24, 96), (48, 120), (60, 132))
    assert config.depth == 40
    assert get_model("densenet40_k12", input_shape=(64,), num_classes=2).feature_dim == 132


# -------------------------------------------------------------------- spatial sizes


@pytest.mark.parametrize(
    ("input_shape", "vgg_pools", "densenet_pools"),
    [
        ((1, 8, 8), 3, 2),  # vgg 8 -> 4 -> 2 -> 1, then no more pooling
        ((3, 32, 32), 5, 2),  # vgg 32 -> 16 -> 8 -> 4 -> 2 -> 1
        ((20,), 2, 2),  # a 5x5 image: vgg 5 -> 2 -> 1; densenet 5 -> 2 -> 1
        ((2, 1, 9), 0, 0),  # one pixel high: nothing is pooled
        ((1, 1, 1), 0, 0),
    ],
    ids=str,
)
def test_pooling_never_goes_below_one_pixel(
    input_shape: tuple[int, ...], vgg_pools: int, densenet_pools: int
) -> None:
    # Prepare: a flat vector in the square form
    vgg = get_model(
        "vgg11_0125", input_shape=input_shape, num_classes=NUM_CLASSES, flat_input="square"
    )
    dense = get_model(
        "densenet40_k12", input_shape=input_shape, num_classes=NUM_CLASSES, flat_input="square"
    )
    x = torch.randn(2, *input_shape)

    # Execute
    vgg_map = vgg.stages(vgg.adapter(x))

    # Assert
    assert sum(isinstance(m, nn.MaxPool2d) for m in vgg.modules()) == vgg_pools
    assert sum(isinstance(m, nn.AvgPool2d) for m in dense.modules()) == densenet_pools
    assert min(vgg_map.shape[2:]) >= 1
    assert vgg(x).shape == dense(x).shape == (2, NUM_CLASSES)


@pytest.mark.parametrize("name", NEW_MODELS)
def test_state_dict_keys_do_not_depend_on_input_size(name: str) -> None:
    small = get_model(name, input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    large = get_model(name, input_shape=(1, 32, 32), num_classes=NUM_CLASSES)

    assert {k: v.shape for k, v in small.state_dict().items()} == {
        k: v.shape for k, v in large.state_dict().items()
    }


# ------------------------------------------------------------------------ model sizes


@pytest.mark.parametrize("input_shape", [(1, 8, 8), (3, 32, 32)], ids=str)
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_sizes_grow_with_size_rank(family: str, input_shape: tuple[int, ...]) -> None:
    names = list_models(family)
    built = [get_model(n, input_shape=input_shape, num_classes=NUM_CLASSES) for n in names]

    params = [count_parameters(m) for m in built]
    macs = [count_macs(m, input_shape) for m in built]

    assert [model_entry(n).size_rank for n in names] == list(range(len(names)))
    assert all(a < b for a, b in itertools.pairwise(params)), params
    assert all(a < b for a, b in itertools.pairwise(macs)), macs


@pytest.mark.parametrize(
    ("norm", "expected"),
    [
        # Tiny VGG: stages ((8,), (16, 16)), input (1, 8, 8), 3 classes. Convolutions
        # have no bias:
        #   conv 1->8 3x3:   1 * 8 * 9 =    72   norm 2 * 8  = 16
        #   conv 8->16 3x3:  8 * 16 * 9 = 1152   norm 2 * 16 = 32
        #   conv 16->16 3x3: 16 * 16 * 9 = 2304  norm 2 * 16 = 32
        #   head 16 -> 3:    16 * 3 + 3 =    51
        # batch (or group) norm: 72 + 16 + 1152 + 32 + 2304 + 32 + 51 = 3659
        # no norm:               72 + 1152 + 2304 + 51               = 3579
        ("batch", 3659),
        ("group", 3659),
        ("none", 3579),
    ],
)
def test_tiny_vgg_parameter_count_by_hand(norm: str, expected: int) -> None:
    # Prepare
    config = VGGConfig(stages=((8,), (16, 16)))

    # Execute
    model = config.build(input_shape=(1, 8, 8), num_classes=3, norm_layer=get_norm(norm))

    # Assert: MACs by hand, 8x8 -> pool -> 4x4 -> pool -> 2x2:
    #   conv1: 8 * 8 * 8 outputs * 1 * 9  =  4608
    #   conv2: 16 * 4 * 4 outputs * 8 * 9 = 18432
    #   conv3: 16 * 4 * 4 outputs * 16 * 9 = 36864
    #   head:  3 outputs * 16              =    48  -> 59952
    assert count_parameters(model) == expected
    assert count_macs(model, (1, 8, 8)) == 59_952
    assert config.num_convs == 3
    assert model.feature_dim == 16


def test_tiny_densenet_parameter_count_by_hand() -> None:
    # Prepare: two blocks of one dense layer, k=4, bottleneck 2 * 4 = 8, stem 8.
    config = DenseNetConfig(
        block_config=(1, 1), growth_rate=4, bn_size=2, compression=0.5, init_features=8
    )

    # Execute
    model = config.build(input_shape=(1, 8, 8), num_classes=3, norm_layer=get_norm("batch"))

    # Assert: parameters by hand (convolutions without bias, batch norm 2 per channel):
    #   stem conv 1->8 3x3                            1 * 8 * 9 =  72
    #   block 1 (8 in): norm 16, conv 8->8 1x1 64, norm 16, conv 8->4 3x3 288 = 384
    #     -> 8 + 4 = 12 channels
    #   transition: norm 24, conv 12->6 1x1 (floor(0.5 * 12) = 6) 72         =  96
    #   block 2 (6 in): norm 12, conv 6->8 1x1 48, norm 16, conv 8->4 3x3 288 = 364
    #     -> 6 + 4 = 10 channels
    #   final norm 2 * 10 = 20; head 10 * 3 + 3 = 33
    #   72 + 384 + 96 + 364 + 20 + 33 = 969
    assert count_parameters(model) == 969
    assert config.block_channels() == ((8, 12), (6, 10))
    assert model.feature_dim == 10
    assert config.depth == 7  # stem, 2 * 2 layer convs, 1 transition, head
    # MACs by hand, 8x8 for block 1, 4x4 after the transition's pool:
    #   stem 8 * 64 * 9 = 4608; block 1: 8 * 64 * 8 = 4096, 4 * 64 * 72 = 18432;
    #   transition 6 * 64 * 12 = 4608; block 2: 8 * 16 * 6 = 768, 4 * 16 * 72 = 4608;
    #   head 3 * 10 = 30; total 37150
    assert count_macs(model, (1, 8, 8)) == 37_150


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": ()}, r"stages must be a non-empty tuple.*got \(\)"),
        ({"stages": ((64,), ())}, r"non-empty stages.*got \(\(64,\), \(\)\)"),
        ({"stages": ((64, 0),)}, r"positive ints, got stage \(64, 0\)"),
        ({"stages": ((64, -8),)}, r"got stage \(64, -8\)"),
        ({"stages": ((64, 2.5),)}, r"got stage \(64, 2\.5\)"),
        ({"stages": ((64,),), "width_mult": 0}, "width_mult must be > 0, got 0"),
        ({"stages": ((64,),), "width_mult": -0.5}, "width_mult must be > 0, got -0.5"),
        ({"stages": ((64,),), "round_nearest": 0}, "round_nearest must be >= 1, got 0"),
    ],
)
def test_vgg_config_rejects_bad_tables(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VGGConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_config": ()}, r"block_config must be a non-empty tuple.*got \(\)"),
        ({"block_config": (6, 0, 6)}, r"got \(6, 0, 6\)"),
        ({"block_config": (6, True)}, r"got \(6, True\)"),
        ({"growth_rate": 0}, "growth_rate must be an int >= 1, got 0"),
        ({"bn_size": -1}, "bn_size must be an int >= 1, got -1"),
        ({"init_features": 2.5}, "init_features must be an int >= 1, got 2.5"),
        ({"compression": 0}, r"compression must be in \(0, 1\].*got 0"),
        ({"compression": 1.5}, r"compression must be in \(0, 1\].*got 1.5"),
    ],
)
def test_densenet_config_rejects_bad_tables(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DenseNetConfig(**kwargs)  # type: ignore[arg-type]


def test_configs_are_frozen_and_rounded() -> None:
    vgg = VGGConfig(stages=VGG_STAGE_TABLES[11], width_mult=0.25)
    dense = DenseNetConfig()

    with pytest.raises(dataclasses.FrozenInstanceError):
        vgg.width_mult = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        dense.growth_rate = 32  # type: ignore[misc]
    assert vgg.widths == ((16,), (32,), (64, 64), (128, 128), (128, 128))
    assert VGGConfig(stages=((20,),), width_mult=1.0).widths == ((24,),)  # make_divisible


# ----------------------------------------------------------------------------- mixed


def test_mixed_lists_one_model_per_family_by_cost() -> None:
    # Execute
    mixed = list_models(MIXED_FAMILY)

    # Assert: the members, each from another family, cheapest first
    assert MIXED_FAMILY == "mixed"
    assert mixed == ["vgg11_0125", "mobilenetv2_035", "densenet76_k12", "resnet10"]
    assert sorted(mixed) == sorted(MIXED_MEMBERS)
    families = [model_entry(n).family for n in mixed]
    assert sorted(families) == ["densenet", "mobilenetv2", "resnet", "vgg"]


@pytest.mark.parametrize("input_shape", [(1, 8, 8), (3, 32, 32)], ids=str)
def test_mixed_costs_grow_together(input_shape: tuple[int, ...]) -> None:
    # Parameters and MACs agree on the order, on digits and on CIFAR-sized images.
    built = [
        get_model(n, input_shape=input_shape, num_classes=NUM_CLASSES) for n in list_models("mixed")
    ]

    params = [count_parameters(m) for m in built]
    macs = [count_macs(m, input_shape) for m in built]

    assert all(a < b for a, b in itertools.pairwise(params)), params
    assert all(a < b for a, b in itertools.pairwise(macs)), macs


def test_mixed_is_an_alias_not_a_registration() -> None:
    # Prepare
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)

    # Execute
    mixed = list_models("mixed")
    drawn = torch.rand(4)
    everything = list_models()

    # Assert: listed as a family, members listed once, nothing registered as "mixed",
    # and measuring the costs leaves torch's random state alone
    assert "mixed" in list_families()
    assert {"densenet", "vgg"} <= set(list_families())
    assert len(everything) == len(set(everything))
    assert all(everything.count(n) == 1 for n in mixed)
    assert all(model_entry(n).family != "mixed" for n in everything)
    torch.testing.assert_close(drawn, expected)
    with pytest.raises(ValueError, match="'mixed' is the name of a cross-family set"):
        register_family("mixed", [("mixed-1", CNN_VARIANTS[0][1], "")])


def test_cross_family_set_of_a_separate_registry() -> None:
    # Prepare: a registry whose set lists the bigger model first
    cnn_1, cnn_5 = CNN_VARIANTS[0][1], CNN_VARIANTS[4][1]

    registry = ModelRegistry(cross_family_sets={"both": ("big", "small")})
    registry.register("big", cnn_5, family="b", size_rank=0)
    registry.register("small", cnn_1, family="a", size_rank=0)

    # Execute / Assert
    assert registry.families() == ["a", "b", "both"]
    assert registry.names("both") == ["small", "big"]
    assert registry.names() == ["small", "big"]


def test_cross_family_set_errors() -> None:
    cnn_1, cnn_2 = CNN_VARIANTS[0][1], CNN_VARIANTS[1][1]

    with pytest.raises(ValueError, match="distinct member models"):
        ModelRegistry(cross_family_sets={"s": ("a", "a")})
    with pytest.raises(ValueError, match="distinct member models"):
        ModelRegistry(cross_family_sets={"s": ()})

    unregistered = ModelRegistry(cross_family_sets={"s": ("a", "ghost")})
    unregistered.register("a", cnn_1, family="f", size_rank=0)
    with pytest.raises(ValueError, match="Unknown model 'ghost'"):
        unregistered.names("s")

    same_family = ModelRegistry(cross_family_sets={"s": ("a", "b")})
    same_family.register_family("f", [("a", cnn_1, ""), ("b", cnn_2, "")])
    with pytest.raises(ValueError, match=r"at most one model per family.*a \(f\), b \(f\)"):
        same_family.names("s")


def test_mixed_selection_picks_families_by_capacity() -> None:
    # Prepare: digits-sized work, 5000 samples a round. On cpu-small (2e8 MAC/s) a
    # round costs 3 * MACs * 5000 / 2e8 s: resnet10 3 * 15_770_624 * 5000 / 2e8 =
    # 1183 s and densenet76_k12 3 * 11_675_796 * 5000 / 2e8 = 876 s miss the 600 s
    # budget, mobilenetv2_035 3 * 969_264 * 5000 / 2e8 = 73 s fits.
    workload = Workload(
        samples_per_round=5000, batch_size=32, input_shape=(1, 8, 8), num_classes=10
    )
    budget = Budget(max_round_seconds=600.0)

    # Execute
    costs = candidate_costs("mixed", (1, 8, 8), 10)
    small = choose_architecture(predefined_profile("cpu-small"), costs, workload, budget)
    big = choose_architecture(predefined_profile("gpu-server"), costs, workload, budget)

    # Assert: ranks derived from cost across families (the members' own ranks, 0, 0,
    # 1 and 0, only order models within a family), the GPU takes the ResNet, the
    # slow CPU the MobileNet
    assert [c.name for c in costs] == list_models("mixed")
    assert [c.size_rank for c in costs] == [0, 1, 2, 3]
    assert big.name == "resnet10"
    assert small.name == "mobilenetv2_035"
    assert small.fits
