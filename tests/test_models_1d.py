"""The 1-d form of the conv families: signals (C, L) and flat vectors (L,) keep locality."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from torch import nn

from models import (
    PreResNetConfig,
    SectionedConfig,
    build_submodel,
    count_macs,
    family_layout,
    full_spec,
    get_model,
    get_norm,
    list_families,
    list_models,
    list_norms,
    model_entry,
)
from models.inputs import InputAdapter, validate_input_shape
from models.layers import LAYERS_1D, LAYERS_2D, SpatialLayers, spatial_layers
from models.norm import batch_norm, batch_norm_1d, norm_for_ndim, static_batch_norm_1d
from models.spec import ModelRef
from strategies.submodel import SubModelSpec, extract

NUM_CLASSES = 7  # not a default anywhere, so a head built for the wrong size fails
SIGNAL_SHAPES = [(40,), (3, 40)]
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
CONV_FAMILIES = [f for f in list_families() if f not in ("mlp", "mixed")]


def _model_param(name: str) -> object:
    """Wrap a model name as a pytest param, skipped when its dependency is absent."""
    needs_tv = model_entry(name).family == "torchvision"
    mark = pytest.mark.skipif(
        needs_tv and not HAS_TORCHVISION, reason="torchvision is not installed"
    )
    return pytest.param(name, marks=[mark], id=name)


CONV_MODELS = [_model_param(n) for f in CONV_FAMILIES for n in list_models(f)]
SMALLEST_PER_FAMILY = [_model_param(list_models(f)[0]) for f in CONV_FAMILIES]
ENDS_PER_FAMILY = [
    _model_param(n)
    for f in CONV_FAMILIES
    for n in dict.fromkeys(list_models(f)[:: len(list_models(f)) - 1 or 1])
]
"""The smallest and the largest model of each family (CI time: every model builds in 1-d
below, with a multichannel signal; the other forms are checked at each family's ends)."""
SIGNAL_CASES = [
    *[pytest.param(p.values[0], (3, 40), marks=p.marks, id=f"{p.id}-(3, 40)") for p in CONV_MODELS],
    *[
        pytest.param(p.values[0], (40,), marks=p.marks, id=f"{p.id}-(40,)")
        for p in SMALLEST_PER_FAMILY
    ],
]


def _layer_types(model: nn.Module) -> set[type[nn.Module]]:
    return {type(m) for m in model.modules()}


def _adapter(model: nn.Module) -> InputAdapter:
    adapter = model.get_submodule("adapter")
    assert isinstance(adapter, InputAdapter)
    return adapter


def _first_conv(model: nn.Module) -> nn.Conv1d | nn.Conv2d:
    conv = model.get_submodule("convs.0")
    assert isinstance(conv, (nn.Conv1d, nn.Conv2d))
    return conv


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# ---------------------------------------------------------------- every conv model, 1-d


def test_every_family_but_mlp_is_convolutional() -> None:
    # The parametrisation below must cover every conv family the registry knows.
    assert CONV_FAMILIES == [
        "cnn",
        "densenet",
        "mobilenetv2",
        "preresnet",
        "resnet",
        "torchvision",
        "vgg",
    ]


@pytest.mark.parametrize(("name", "input_shape"), SIGNAL_CASES)
def test_signal_form_builds_1d_layers_with_the_body_head_interface(
    name: str, input_shape: tuple[int, ...]
) -> None:
    # Prepare
    model = get_model(name, input_shape=input_shape, num_classes=NUM_CLASSES)
    x = torch.randn(3, *input_shape)

    # Execute
    logits = model(x)
    features = model.forward_features(x)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 3, 6]))
    loss.backward()  # type: ignore[no-untyped-call]

    # Assert: 1-d convolutions and norms only, the usual interface
    types = _layer_types(model)
    assert nn.Conv1d in types
    assert not types & {nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.AvgPool2d}
    assert nn.BatchNorm1d in types
    assert model.input_shape == input_shape
    assert logits.shape == (3, NUM_CLASSES)
    assert features.shape == (3, model.feature_dim)
    torch.testing.assert_close(model.forward_head(features), logits)
    assert model.get_classifier().out_features == NUM_CLASSES
    for pname, param in model.named_parameters():
        assert param.grad is not None, f"{name}: {pname} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{name}: {pname} has a bad gradient"


@pytest.mark.parametrize("name", ENDS_PER_FAMILY)
def test_square_form_reshapes_a_flat_vector_to_a_2d_image(name: str) -> None:
    model = get_model(name, input_shape=(40,), num_classes=NUM_CLASSES, flat_input="square")

    logits = model(torch.randn(2, 40))

    types = _layer_types(model)
    assert nn.Conv2d in types
    assert nn.Conv1d not in types
    assert _adapter(model).form == "square"
    assert _adapter(model).output_shape == (1, 7, 7)  # ceil(sqrt(40)) = 7
    assert logits.shape == (2, NUM_CLASSES)


@pytest.mark.parametrize("norm", list_norms())
@pytest.mark.parametrize("name", SMALLEST_PER_FAMILY)
def test_every_norm_has_a_1d_form(name: str, norm: str) -> None:
    model = get_model(name, input_shape=(3, 40), num_classes=NUM_CLASSES, norm=norm)
    model.train()

    assert model(torch.randn(4, 3, 40)).shape == (4, NUM_CLASSES)
    types = _layer_types(model)
    batch_norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    assert nn.BatchNorm2d not in types
    if norm == "batch":
        assert batch_norms
        assert all(m.track_running_stats for m in batch_norms)
    elif norm == "static-batch":
        assert batch_norms
        assert not any(m.track_running_stats for m in batch_norms)
    elif norm == "group":
        assert not batch_norms
        assert nn.GroupNorm in types
    else:
        assert not batch_norms
        assert nn.GroupNorm not in types


def test_a_1d_model_has_the_2d_models_keys_with_1d_kernels() -> None:
    signal = get_model("resnet10", input_shape=(40,), num_classes=NUM_CLASSES)
    square = get_model("resnet10", input_shape=(40,), num_classes=NUM_CLASSES, flat_input="square")

    signal_state, square_state = signal.state_dict(), square.state_dict()

    assert list(signal_state) == list(square_state)
    for key, value in square_state.items():
        expected = value.shape[:-1] if value.dim() == 4 else value.shape  # drop a kernel axis
        assert signal_state[key].shape == expected, key
    assert signal_state["stem.0.weight"].shape == (64, 1, 3)


def test_images_ignore_flat_input() -> None:
    torch.manual_seed(1)
    default = get_model("cnn-2", input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    torch.manual_seed(1)
    square = get_model("cnn-2", input_shape=(1, 8, 8), num_classes=NUM_CLASSES, flat_input="square")

    assert _adapter(default).form == _adapter(square).form == "image"
    for (key, a), (_, b) in zip(
        default.state_dict().items(), square.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), key


# ------------------------------------------------------------------------------ locality


def test_a_signal_conv_sees_only_its_three_neighbours() -> None:
    # Prepare: cnn-1's first convolution has kernel 3, padding 1
    model = get_model("cnn-1", input_shape=(40,), num_classes=NUM_CLASSES)
    conv, adapter = _first_conv(model), _adapter(model)
    x = torch.randn(1, 40)
    far = x.clone()
    far[0, 30] += 10.0  # position 30 is in the receptive field of outputs 29, 30, 31 only

    # Execute
    with torch.no_grad():
        out = conv(adapter(x))
        out_far = conv(adapter(far))

    # Assert: output 5 of channel 0 is w[0] x[4] + w[1] x[5] + w[2] x[6], by hand
    w = conv.weight[0, 0].detach()  # (3,)
    expected = w[0] * x[0, 4] + w[1] * x[0, 5] + w[2] * x[0, 6]
    torch.testing.assert_close(out[0, 0, 5], expected)
    changed = (out - out_far).abs().amax(dim=1)[0] > 0
    assert changed.nonzero().flatten().tolist() == [29, 30, 31]


def test_the_square_form_mixes_entries_seven_apart() -> None:
    # Prepare: in a 7x7 square, entry 30 (row 4, column 2) sits just below entry 23
    model = get_model("cnn-1", input_shape=(40,), num_classes=NUM_CLASSES, flat_input="square")
    conv, adapter = _first_conv(model), _adapter(model)
    x = torch.randn(1, 40)
    far = x.clone()
    far[0, 30] += 10.0

    # Execute
    with torch.no_grad():
        changed = (conv(adapter(x)) - conv(adapter(far))).abs().amax(dim=1)[0] > 0

    # Assert: the 3x3 around (4, 2) changed, i.e. the outputs at entries 22-24, 29-31, 36-38
    assert changed.flatten().nonzero().flatten().tolist() == [22, 23, 24, 29, 30, 31, 36, 37, 38]


def test_a_signal_is_passed_as_one_channel_and_a_multichannel_signal_as_it_is() -> None:
    x = torch.arange(80, dtype=torch.float32).reshape(2, 40)
    y = torch.arange(240, dtype=torch.float32).reshape(2, 3, 40)

    flat, multi = InputAdapter(input_shape=(40,)), InputAdapter(input_shape=(3, 40))

    assert (flat.form, flat.output_shape, flat.ndim) == ("signal", (1, 40), 1)
    assert (multi.form, multi.output_shape, multi.ndim) == ("signal", (3, 40), 1)
    torch.testing.assert_close(flat(x), x[:, None, :])
    assert multi(y) is y
    assert flat.layers is LAYERS_1D
    assert InputAdapter(input_shape=(40,), flat_input="square").layers is LAYERS_2D


# ---------------------------------------------------------------------------- flat_input


@pytest.mark.parametrize("value", ["sqaure", "Signal", "", None, 1, ("signal",)])
def test_a_bad_flat_input_names_the_value_and_the_choices(value: object) -> None:
    with pytest.raises(ValueError, match="flat_input must be 'signal'") as info:
        get_model("cnn-1", input_shape=(40,), num_classes=NUM_CLASSES, flat_input=value)  # type: ignore[arg-type]

    assert f"got {value!r}" in str(info.value)
    assert "flat_input='square'" in str(info.value)


def test_a_multichannel_signal_refuses_the_square_form_and_says_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"input_shape \(3, 40\) is a \(C, L\) signal") as info:
        get_model("cnn-1", input_shape=(3, 40), num_classes=NUM_CLASSES, flat_input="square")

    assert "drop flat_input='square'" in str(info.value)
    assert "flat vectors of shape (120,)" in str(info.value)


def test_a_bad_flat_input_is_refused_even_for_images_and_the_mlp() -> None:
    for name, shape in [("cnn-1", (1, 8, 8)), ("mlp-s", (40,))]:
        with pytest.raises(ValueError, match="got 'round'"):
            get_model(name, input_shape=shape, num_classes=NUM_CLASSES, flat_input="round")  # type: ignore[arg-type]


def test_the_mlp_ignores_flat_input() -> None:
    torch.manual_seed(2)
    signal = get_model("mlp-s", input_shape=(40,), num_classes=NUM_CLASSES)
    torch.manual_seed(2)
    square = get_model("mlp-s", input_shape=(40,), num_classes=NUM_CLASSES, flat_input="square")

    assert str(signal) == str(square)
    assert all(
        torch.equal(a, b)
        for a, b in zip(signal.state_dict().values(), square.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("shape", [(3, 40), (1, 1), (40,), (1, 8, 8)])
def test_input_shapes_of_one_two_and_three_entries_are_valid(shape: tuple[int, ...]) -> None:
    assert validate_input_shape(shape) == shape


@pytest.mark.parametrize("shape", [(3, 0), (0, 40), (3.0, 40), (1, 1, 8, 8)])
def test_a_bad_signal_shape_is_refused(shape: tuple[object, ...]) -> None:
    with pytest.raises(ValueError, match="input_shape"):
        get_model("cnn-1", input_shape=shape, num_classes=NUM_CLASSES)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- norms, layers


def test_norms_map_to_their_1d_counterparts() -> None:
    assert get_norm("batch", ndim=1) is batch_norm_1d
    assert norm_for_ndim(get_norm("batch"), 1) is batch_norm_1d
    assert norm_for_ndim(batch_norm_1d, 2) is batch_norm
    assert norm_for_ndim(get_norm("static-batch"), 1) is static_batch_norm_1d
    assert norm_for_ndim(get_norm("group"), 1) is get_norm("group")
    assert isinstance(get_norm("static-batch", ndim=1)(8), nn.BatchNorm1d)

    def custom(channels: int) -> nn.Module:
        return nn.LayerNorm(channels)

    assert norm_for_ndim(custom, 1) is custom  # a caller's own factory is theirs to fit


@pytest.mark.parametrize("ndim", [0, 3, True, 1.5])
def test_a_bad_ndim_is_refused(ndim: object) -> None:
    with pytest.raises(ValueError, match=r"ndim must be 1 .*got"):
        get_norm("batch", ndim=ndim)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ndim must be 1 .*got"):
        spatial_layers(ndim)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ndim must be 1 .*got"):
        SpatialLayers(ndim=ndim)  # type: ignore[arg-type]


def test_spatial_layers_build_the_layer_types_of_their_dimensionality() -> None:
    conv1 = LAYERS_1D.conv3x3(2, 4, stride=2, groups=2)
    conv2 = LAYERS_2D.conv1x1(2, 4)

    assert isinstance(conv1, nn.Conv1d)
    assert (conv1.kernel_size, conv1.stride, conv1.padding, conv1.groups) == ((3,), (2,), (1,), 2)
    assert conv1.bias is None
    assert isinstance(conv2, nn.Conv2d)
    assert conv2.kernel_size == (1, 1)
    assert isinstance(LAYERS_1D.max_pool(), nn.MaxPool1d)
    assert isinstance(LAYERS_1D.avg_pool(), nn.AvgPool1d)
    assert isinstance(LAYERS_1D.global_pool()[0], nn.AdaptiveAvgPool1d)
    assert LAYERS_1D.global_pool()(torch.ones(2, 3, 5)).shape == (2, 3)


# -------------------------------------------------------------------------------- costs


def test_count_macs_counts_1d_convolutions_by_hand() -> None:
    # cnn-1: conv 1 -> 16, kernel 3, at length 40; pooled 16-d; head 16 -> 7.
    head = 16 * NUM_CLASSES
    signal = get_model("cnn-1", input_shape=(40,), num_classes=NUM_CLASSES)
    square = get_model("cnn-1", input_shape=(40,), num_classes=NUM_CLASSES, flat_input="square")
    multi = get_model("cnn-1", input_shape=(3, 40), num_classes=NUM_CLASSES)

    assert count_macs(signal, (40,)) == 16 * 40 * 1 * 3 + head
    assert count_macs(square, (40,)) == 16 * 49 * 1 * 9 + head  # a 7x7 image
    assert count_macs(multi, (3, 40)) == 16 * 40 * 3 * 3 + head


def test_mixed_is_still_ordered_by_cost_on_images() -> None:
    assert list_models("mixed") == [
        "vgg11_0125",
        "mobilenetv2_035",
        "densenet76_k12",
        "resnet10",
    ]


# ------------------------------------------------------------------------------ slicing

PRERESNET = PreResNetConfig(stage_depths=(3, 2, 3, 2), width_mult=0.25)
SLICES = [
    pytest.param(PRERESNET, SubModelSpec(0.5, (3, 2, 3, 2)), id="preresnet-w0.5"),
    pytest.param(PRERESNET, SubModelSpec(0.3, (2, 2, 2, 2)), id="preresnet-w0.3-shallow"),
    pytest.param(
        "mobilenetv2_035", SubModelSpec(0.25, (1, 2, 2, 2, 2, 2, 1)), id="mobilenet-w0.25-min"
    ),
]


@pytest.mark.parametrize("input_shape", SIGNAL_SHAPES, ids=str)
@pytest.mark.parametrize(("model", "spec"), SLICES)
def test_a_1d_slice_is_a_slice_of_the_1d_global_model(
    model: str | SectionedConfig, spec: SubModelSpec, input_shape: tuple[int, ...]
) -> None:
    # Prepare
    global_model = build_submodel(
        model, full_spec(model), input_shape=input_shape, num_classes=NUM_CLASSES
    )
    global_state = {k: v.numpy() for k, v in global_model.state_dict().items()}

    # Execute
    state, index = extract(global_state, spec, family_layout(model))
    sub = build_submodel(model, spec, input_shape=input_shape, num_classes=NUM_CLASSES)
    sub.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})
    sub.eval()

    # Assert: 1-d layers, the extracted keys and shapes, values the global prefix
    assert nn.Conv2d not in _layer_types(sub)
    assert [(k, tuple(np.shape(v))) for k, v in state.items()] == [
        (k, tuple(v.shape)) for k, v in sub.state_dict().items()
    ]
    for key, value in sub.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), global_state[key][index[key]])
    assert sub(torch.randn(2, *input_shape)).shape == (2, NUM_CLASSES)


def test_a_named_1d_slice_with_block_steps_builds_like_build_submodel() -> None:
    spec = SubModelSpec(0.5, (2, 2, 2, 2))
    name = ModelRef("preresnet18_050", spec).name

    torch.manual_seed(3)
    named = get_model(name, input_shape=(40,), num_classes=NUM_CLASSES, block_step=True)
    torch.manual_seed(3)
    full = get_model("preresnet18_050", input_shape=(40,), num_classes=NUM_CLASSES, block_step=True)

    steps = [k for k in named.state_dict() if k.endswith(".step")]
    assert len(steps) == 8  # one per kept block
    assert nn.Conv1d in _layer_types(named)
    assert named.state_dict()["stem.weight"].shape == (16, 1, 3)  # ceil(0.5 * 32) = 16
    assert full.state_dict()["stem.weight"].shape == (32, 1, 3)
    assert named(torch.randn(2, 40)).shape == (2, NUM_CLASSES)


def test_a_1d_slice_refuses_the_square_form_of_a_multichannel_signal() -> None:
    with pytest.raises(ValueError, match=r"\(C, L\) signal"):
        build_submodel(
            PRERESNET,
            full_spec(PRERESNET),
            input_shape=(3, 40),
            num_classes=NUM_CLASSES,
            flat_input="square",
        )


@pytest.mark.parametrize(
    ("input_shape", "vgg_pools", "densenet_pools"),
    [
        ((40,), 5, 2),  # vgg 40 -> 20 -> 10 -> 5 -> 2 -> 1; densenet 40 -> 20 -> 10
        ((2, 3), 1, 1),  # 3 -> 1, then no more pooling
        ((2, 1), 0, 0),  # one sample long: nothing is pooled
    ],
    ids=str,
)
def test_1d_pooling_never_goes_below_one_sample(
    input_shape: tuple[int, ...], vgg_pools: int, densenet_pools: int
) -> None:
    vgg = get_model("vgg11_0125", input_shape=input_shape, num_classes=NUM_CLASSES)
    dense = get_model("densenet40_k12", input_shape=input_shape, num_classes=NUM_CLASSES)
    x = torch.randn(2, *input_shape)

    vgg_map = vgg.get_submodule("stages")(_adapter(vgg)(x))

    assert sum(isinstance(m, nn.MaxPool1d) for m in vgg.modules()) == vgg_pools
    assert sum(isinstance(m, nn.AvgPool1d) for m in dense.modules()) == densenet_pools
    assert vgg_map.shape[2] >= 1
    assert vgg(x).shape == dense(x).shape == (2, NUM_CLASSES)
