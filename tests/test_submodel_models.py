"""Sectioned families as data: slices built by models.slicing match strategies.submodel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from models import (
    MobileNetV2Config,
    PreResNetConfig,
    SectionedConfig,
    TesseraModel,
    build_submodel,
    family_layout,
    full_spec,
    get_model,
    global_config,
    list_models,
    model_entry,
)
from models.layers import slice_channels
from models.mobilenetv2 import InvertedResidual
from models.preresnet import PreActBlock
from strategies.submodel import SubModelError, SubModelSpec, extract, graft, sub_channels

NUM_CLASSES = 7  # not a default anywhere, so a head sliced by mistake fails
INPUT_SHAPES = [(1, 8, 8), (3, 32, 32), (64,)]

# A small PreResNet deep enough to drop blocks (the registered ones have 1 or 2 per stage,
# and every stage after the first needs 2 to be grafted back).
PRERESNET = PreResNetConfig(stage_depths=(3, 2, 3, 2), width_mult=0.25)
MOBILENET = "mobilenetv2_035"  # sections (1, 2, 3, 4, 3, 3, 1)

# (model, spec): full width and depth, width only, width and depth, an odd width, least depth.
CASES = [
    pytest.param(PRERESNET, SubModelSpec(1.0, (3, 2, 3, 2)), id="preresnet-full"),
    pytest.param(PRERESNET, SubModelSpec(0.5, (3, 2, 3, 2)), id="preresnet-w0.5"),
    pytest.param(PRERESNET, SubModelSpec(0.25, (2, 2, 2, 2)), id="preresnet-w0.25-shallow"),
    pytest.param(PRERESNET, SubModelSpec(0.3, (3, 2, 2, 2)), id="preresnet-w0.3"),
    pytest.param(MOBILENET, SubModelSpec(1.0, (1, 2, 3, 4, 3, 3, 1)), id="mobilenet-full"),
    pytest.param(MOBILENET, SubModelSpec(0.5, (1, 2, 3, 4, 3, 3, 1)), id="mobilenet-w0.5"),
    pytest.param(MOBILENET, SubModelSpec(0.25, (1, 2, 2, 2, 2, 2, 1)), id="mobilenet-w0.25-min"),
    pytest.param(MOBILENET, SubModelSpec(0.3, (1, 2, 3, 2, 3, 2, 1)), id="mobilenet-w0.3"),
]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def numpy_state(model: nn.Module) -> dict[str, np.ndarray]:
    """Return a model's state dict as numpy arrays (what the server holds)."""
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def torch_state(state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Return a numpy state dict as tensors (``extract`` gives 0-d entries as numpy scalars)."""
    return {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}


def shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Return a model's state-dict keys, in order, with their shapes."""
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def build_global(
    model: str | SectionedConfig, input_shape: tuple[int, ...], norm: str
) -> nn.Module:
    """Build the global model behind a name or a config."""
    if isinstance(model, str):
        return get_model(model, input_shape=input_shape, num_classes=NUM_CLASSES, norm=norm)
    return build_submodel(
        model, full_spec(model), input_shape=input_shape, num_classes=NUM_CLASSES, norm=norm
    )


# --------------------------------------------------------------------------- extract == build


@pytest.mark.parametrize("input_shape", INPUT_SHAPES, ids=str)
@pytest.mark.parametrize(("model", "spec"), CASES)
def test_extracted_slice_loads_into_the_built_submodel(
    model: str | SectionedConfig, spec: SubModelSpec, input_shape: tuple[int, ...]
) -> None:
    # Prepare
    global_model = build_global(model, input_shape, "batch")
    layout = family_layout(model)
    global_state = numpy_state(global_model)

    # Execute
    state, index = extract(global_state, spec, layout)
    sub = build_submodel(
        model, spec, input_shape=input_shape, num_classes=NUM_CLASSES, norm="batch"
    )
    sub.load_state_dict(torch_state(state), strict=True)
    sub.eval()
    logits = sub(torch.randn(2, *input_shape))

    # Assert: same keys in the same order (batch-norm step counters included), same shapes
    assert [(k, np.shape(v)) for k, v in state.items()] == shapes(sub)
    assert set(index) == set(state)
    assert logits.shape == (2, NUM_CLASSES)
    assert torch.isfinite(logits).all()
    for key, value in sub.state_dict().items():  # the values are the global prefix
        np.testing.assert_array_equal(value.numpy(), global_state[key][index[key]])


@pytest.mark.parametrize(("model", "spec"), CASES[1:3] + CASES[5:7])
def test_static_batch_slices_have_no_running_statistics(
    model: str | SectionedConfig, spec: SubModelSpec
) -> None:
    global_model = build_global(model, (1, 8, 8), "static-batch")

    state, _ = extract(numpy_state(global_model), spec, family_layout(model))
    sub = build_submodel(
        model, spec, input_shape=(1, 8, 8), num_classes=NUM_CLASSES, norm="static-batch"
    )
    sub.load_state_dict(torch_state(state), strict=True)

    assert [(k, np.shape(v)) for k, v in state.items()] == shapes(sub)
    assert not any("running" in k or "num_batches" in k for k in state)
    assert sub(torch.randn(2, 1, 8, 8)).shape == (2, NUM_CLASSES)


def test_a_slice_has_ceil_width_channels_without_rounding() -> None:
    # Prepare: the global MobileNetV2 rounds to multiples of 8; the slice must not
    config = MobileNetV2Config(width_mult=0.35)
    spec = SubModelSpec(0.3, (1, 2, 2, 2, 2, 2, 1))

    # Execute
    sub = build_submodel(config, spec, input_shape=(1, 8, 8), num_classes=NUM_CLASSES)

    # Assert: by hand, stem 16 -> ceil(4.8) = 5, section 1's block 0 expands 8 * 6 = 48 -> 15
    # (not 3 * 6 = 18), the last convolution 1280 -> 384, the head keeps its 7 classes
    state = sub.state_dict()
    assert state["stem.0.weight"].shape == (5, 1, 3, 3)
    assert state["sections.1.0.block.0.weight"].shape == (15, 3, 1, 1)
    assert state["sections.1.0.block.3.weight"].shape == (15, 1, 3, 3)  # depthwise
    assert state["final.0.weight"].shape == (384, 34, 1, 1)  # 320 * 0.35 -> 112 -> 34
    assert state["head.weight"].shape == (NUM_CLASSES, 384)
    assert sub.feature_dim == 384
    assert slice_channels(16, 0.3) == sub_channels(16, 0.3) == 5
    assert slice_channels(1280, 1.0) == 1280


def test_a_slice_keeps_the_global_blocks_structure() -> None:
    # Prepare: at width 0.01 every channel count is 1, so "in == out" holds everywhere
    config = global_config("mobilenetv2_100")
    spec = SubModelSpec(0.01, (1, 2, 2, 2, 2, 2, 1))

    # Execute
    global_model = build_global("mobilenetv2_100", (1, 8, 8), "batch")
    sub = build_submodel(config, spec, input_shape=(1, 8, 8), num_classes=NUM_CLASSES)

    # Assert: the residual connections are the global model's (block 0 of sections 0, 1,
    # 4 and 6 changes the channels at stride 1 and has none)
    def residuals(model: nn.Module, depths: tuple[int, ...]) -> list[bool]:
        sections = model.get_submodule("sections")
        return [
            block.use_residual
            for s, depth in enumerate(depths)
            for block in list(sections[s])[:depth]
            if isinstance(block, InvertedResidual)
        ]

    assert residuals(sub, spec.depths) == residuals(global_model, spec.depths)
    first_blocks = [sub.get_submodule(f"sections.{s}.0") for s in range(7)]
    assert [b.use_residual for b in first_blocks if isinstance(b, InvertedResidual)] == [False] * 7


# --------------------------------------------------------------------------- full spec, graft


@pytest.mark.parametrize("name", list_models("preresnet") + list_models("mobilenetv2"))
def test_the_full_spec_is_the_registered_model(name: str) -> None:
    # Prepare
    torch.manual_seed(3)
    registered = get_model(name, input_shape=(1, 8, 8), num_classes=NUM_CLASSES)

    # Execute
    torch.manual_seed(3)
    full = build_submodel(name, full_spec(name), input_shape=(1, 8, 8), num_classes=NUM_CLASSES)

    # Assert: same keys, shapes and (same seed) values
    assert shapes(full) == shapes(registered)
    for key, value in full.state_dict().items():
        assert torch.equal(value, registered.state_dict()[key]), key


@pytest.mark.parametrize(
    ("model", "depths"),
    [
        (PRERESNET, (2, 2, 2, 2)),
        (MOBILENET, (1, 2, 2, 2, 2, 2, 1)),
        (MOBILENET, (1, 2, 3, 3, 2, 3, 1)),
    ],
    ids=["preresnet", "mobilenet-min", "mobilenet"],
)
def test_grafting_a_full_width_slice_gives_the_global_shapes(
    model: str | SectionedConfig, depths: tuple[int, ...]
) -> None:
    # Prepare
    global_model = build_global(model, (3, 32, 32), "batch")
    layout = family_layout(model)
    state, _ = extract(numpy_state(global_model), SubModelSpec(1.0, depths), layout)

    # Execute
    grafted = graft(state, layout, global_config(model).section_depths)

    # Assert
    assert sorted((k, np.shape(v)) for k, v in grafted.items()) == sorted(shapes(global_model))
    global_model.load_state_dict(torch_state(grafted))


# --------------------------------------------------------------------------- registry, layout


def test_registry_exposes_each_entrys_frozen_config() -> None:
    entry = model_entry("preresnet18_050")

    assert entry.config == PreResNetConfig(stage_depths=(2, 2, 2, 2), width_mult=0.5)
    assert model_entry("mobilenetv2_075").config == MobileNetV2Config(width_mult=0.75)
    assert global_config("preresnet18_050") is entry.config
    assert global_config("mobilenetv2") is model_entry("mobilenetv2_100").config  # largest
    assert global_config(PRERESNET) is PRERESNET
    assert isinstance(entry.config, SectionedConfig)


@pytest.mark.parametrize(
    ("model", "stem"), [("preresnet10_050", "stem.weight"), ("mobilenetv2_050", "stem.0.weight")]
)
def test_family_layout_names_existing_entries(model: str, stem: str) -> None:
    layout = family_layout(model)
    keys = set(build_global(model, (1, 8, 8), "batch").state_dict())

    assert layout.prefix == "sections"
    assert layout.keep_inputs == frozenset({stem})
    assert layout.keep_outputs == frozenset({"head.weight", "head.bias"})
    assert layout.min_depth == 2
    assert layout.keep_inputs | layout.keep_outputs <= keys
    assert all(layout.parse(k) is not None for k in keys if k.startswith("sections."))


def test_dropping_a_block_leaves_the_other_keys_as_they_are() -> None:
    full = build_global(MOBILENET, (1, 8, 8), "batch")
    sub = build_submodel(
        MOBILENET, SubModelSpec(1.0, (1, 2, 2, 4, 3, 3, 1)), input_shape=(1, 8, 8), num_classes=7
    )

    dropped = set(full.state_dict()) - set(sub.state_dict())

    assert set(sub.state_dict()) <= set(full.state_dict())
    assert dropped and all(k.startswith("sections.2.2.") for k in dropped)


def test_a_preresnet_slice_keeps_the_projection_of_each_stage() -> None:
    sub = build_submodel(
        PRERESNET, SubModelSpec(0.25, (2, 2, 2, 2)), input_shape=(64,), num_classes=7
    )

    blocks = [m for m in sub.modules() if isinstance(m, PreActBlock)]

    assert [b.shortcut is not None for b in blocks] == [False, False] + [True, False] * 3
    assert isinstance(sub, TesseraModel) and sub.feature_dim == 32  # ceil(0.25 * 128)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("model", "depths", "match"),
    [
        (PRERESNET, (1, 2, 2, 2), "keep between 2 and 3"),
        (PRERESNET, (3, 2, 4, 2), "keep between 2 and 3"),
        (PRERESNET, (3, 2, 3), "one count per section"),
        (MOBILENET, (1, 1, 3, 4, 3, 3, 1), "section 1; keep between 2 and 2"),
    ],
)
def test_a_spec_that_does_not_fit_is_refused_like_extract_does(
    model: str | SectionedConfig, depths: tuple[int, ...], match: str
) -> None:
    spec = SubModelSpec(0.5, depths)
    global_model = build_global(model, (1, 8, 8), "batch")

    with pytest.raises(ValueError, match=match):
        build_submodel(model, spec, input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    with pytest.raises(SubModelError):
        extract(numpy_state(global_model), spec, family_layout(model))


def test_only_sectioned_global_configs_can_be_sliced() -> None:
    spec = SubModelSpec(0.5, (2, 2, 2, 2))
    sliced = PRERESNET.sliced(0.5, (2, 2, 2, 2))

    with pytest.raises(ValueError, match="already a slice"):
        build_submodel(sliced, spec, input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    with pytest.raises(ValueError, match="has no sections, so it cannot be sliced"):
        build_submodel("cnn-3", spec, input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    with pytest.raises(ValueError, match="Unknown model or family 'nope'"):
        family_layout("nope")
    with pytest.raises(ValueError, match=r"slice_width must be in \(0, 1\]"):
        PreResNetConfig(stage_depths=(1,), base_widths=(8,), slice_width=0.0)


# --------------------------------------------------------------------------- slice names


def test_a_spec_tag_round_trips_and_names_a_slice() -> None:
    from models.spec import ModelRef

    spec = SubModelSpec(0.125, (3, 2, 3, 2))
    assert spec.tag == "w0.125-d3.2.3.2"
    assert SubModelSpec.from_tag(spec.tag) == spec
    assert ModelRef("preresnet26_025", spec).name == "preresnet26_025@w0.125-d3.2.3.2"
    assert ModelRef.parse("preresnet26_025@w0.125-d3.2.3.2") == ModelRef("preresnet26_025", spec)
    assert ModelRef.parse("cnn-3") == ModelRef("cnn-3")


def test_a_model_ref_travels_as_message_values_and_refuses_malformed_ones() -> None:
    from models.spec import ModelRef

    # Prepare
    sliced = ModelRef("preresnet26_025", SubModelSpec(0.5, (3, 2, 3, 2)))
    whole = ModelRef("cnn-3")

    # Execute
    values = sliced.to_config()

    # Assert: the structure round-trips, and a whole model carries no slice keys
    assert values == {"model": "preresnet26_025", "slice-width": 0.5, "slice-depths": [3, 2, 3, 2]}
    assert ModelRef.from_config(values, where="x") == sliced
    assert whole.to_config() == {"model": "cnn-3"}
    assert ModelRef.from_config(whole.to_config(), where="x") == whole
    assert sliced.to_record() == {
        "model": "preresnet26_025",
        "slice": {"width": 0.5, "depths": [3, 2, 3, 2]},
    }
    bad: list[tuple[dict[str, object], str]] = [
        ({}, "model=None"),
        ({"model": 3}, "model=3"),
        ({"model": "cnn-3", "slice-width": 0.5}, "needs both"),
        ({"model": "m", "slice-width": True, "slice-depths": [1]}, "must be a number"),
        ({"model": "m", "slice-width": 0.5, "slice-depths": "2.2"}, "must be a list"),
        ({"model": "m", "slice-width": 0.5, "slice-depths": [2, 2.5]}, "whole block counts"),
        ({"model": "m", "slice-width": 1.5, "slice-depths": [2]}, r"width must be .* \(0, 1\]"),
        ({"model": "m@w0.5-d2", "slice-width": 0.5, "slice-depths": [2]}, "not in the name"),
    ]
    for values_, message in bad:
        with pytest.raises(ValueError, match=message):
            ModelRef.from_config(values_, where="the handshake")


@pytest.mark.parametrize("tag", ["", "w0.5", "d2.2", "w-d2", "w0.5-d", "w1.5-d2.2", "w0.5-d0.2"])
def test_a_bad_tag_is_refused_with_the_expected_form(tag: str) -> None:
    with pytest.raises(ValueError, match=r"w<width>-d|width must|depths\[0\]"):
        SubModelSpec.from_tag(tag)


def test_get_model_builds_a_named_slice_like_build_submodel() -> None:
    spec = SubModelSpec(0.5, (2, 3, 2, 2))
    by_name = get_model("preresnet26_025@" + spec.tag, input_shape=(1, 8, 8), num_classes=7)
    built = build_submodel("preresnet26_025", spec, input_shape=(1, 8, 8), num_classes=7)
    assert shapes(by_name) == shapes(built)
    with pytest.raises(ValueError, match="'cnn-3' has no sections"):
        get_model("cnn-3@w0.5-d2", input_shape=(1, 8, 8), num_classes=7)
    with pytest.raises(ValueError, match="keep between 2 and 3"):
        get_model("preresnet26_025@w0.5-d1.3.3.3", input_shape=(1, 8, 8), num_classes=7)


# --------------------------------------------------------------------------- NeFL's step sizes
@pytest.mark.parametrize(
    ("name", "residual_only"), [("preresnet26_025", False), ("mobilenetv2_035", True)]
)
def test_block_step_adds_one_scalar_per_residual_block_and_keeps_the_function(
    name: str, residual_only: bool
) -> None:
    torch.manual_seed(0)
    plain = get_model(name, input_shape=(1, 8, 8), num_classes=NUM_CLASSES).eval()
    stepped = get_model(name, input_shape=(1, 8, 8), num_classes=NUM_CLASSES, block_step=True)
    stepped.eval()
    extra = set(stepped.state_dict()) - set(plain.state_dict())
    assert not set(plain.state_dict()) - set(stepped.state_dict())
    blocks = {
        n: m for n, m in stepped.named_modules() if isinstance(m, (PreActBlock, InvertedResidual))
    }
    residual = {
        n for n, m in blocks.items() if not residual_only or getattr(m, "use_residual", True)
    }
    assert extra == {f"{n}.step" for n in residual}
    assert residual_only == (len(residual) < len(blocks))
    assert all(stepped.state_dict()[k].shape == () for k in extra)
    assert all(float(stepped.state_dict()[k]) == 1.0 for k in extra)

    # with every step at 1 the model is the plain one; step 0 makes a block the identity,
    # step 2 doubles its branch: x + 2 (f(x) - x)
    stepped.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(3, 1, 8, 8)
    torch.testing.assert_close(stepped(x), plain(x))
    name = sorted(residual)[0]
    block = blocks[name]
    conv = next(m for m in block.modules() if isinstance(m, nn.Conv2d))
    h = torch.randn(2, conv.in_channels, 4, 4)
    once = block(h).detach()
    with torch.no_grad():
        stepped.get_parameter(f"{name}.step").fill_(0.0)
        torch.testing.assert_close(block(h), h)
        stepped.get_parameter(f"{name}.step").fill_(2.0)
        torch.testing.assert_close(block(h), h + 2 * (once - h))


def test_block_step_slices_keep_their_steps_whole_and_only_on_kept_blocks() -> None:
    spec = SubModelSpec(0.25, (2, 2, 2, 2))
    torch.manual_seed(0)
    full = get_model("preresnet26_025", input_shape=(1, 8, 8), num_classes=7, block_step=True)
    state = {k: v.numpy() for k, v in full.state_dict().items()}
    sliced = get_model(
        f"preresnet26_025@{spec.tag}", input_shape=(1, 8, 8), num_classes=7, block_step=True
    )
    cut, _ = extract(state, spec, family_layout("preresnet26_025"))
    assert set(cut) == set(sliced.state_dict())
    steps = sorted(k for k in cut if k.endswith(".step"))
    assert steps == [f"sections.{s}.{b}.step" for s in range(4) for b in range(2)]
    assert all(cut[k].shape == () for k in steps)
    sliced.load_state_dict({k: torch.from_numpy(v) for k, v in cut.items()})


def test_block_step_refuses_a_family_without_residual_blocks() -> None:
    with pytest.raises(ValueError, match=r"'cnn-\w+' has no residual blocks with step sizes"):
        get_model(list_models("cnn")[0], input_shape=(1, 8, 8), num_classes=7, block_step=True)
