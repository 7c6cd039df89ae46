"""Felo, Velo and FedHe: knowledge maths, the CVAE, the client loss, validation, runs.

The federations run on the FakeGrid of three real ClientApps (digits, partitions 0-2
emulating cpu-small, cpu-large and jetson-orin). ``train-time-budget=0.008`` with one
local epoch makes the three devices choose three CNN sizes (cnn-1, cnn-4, cnn-5): the
cost model puts cnn-5 at 0.009 s on cpu-large (370 samples at 8e10 MAC/s) and 0.006 s
on jetson-orin (286 samples at 1e11 MAC/s).
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from torch import Tensor, nn

from models import get_model, list_models
from models.base import TesseraModel
from models.projection import ProjectedModel
from strategies import get_scheme
from strategies.felo.client import FeloClient
from strategies.felo.cvae import CVAE, CVAEConfig, train_cvae
from strategies.felo.knowledge import (
    CLASS_TARGETS,
    KNOWLEDGE,
    ClassKnowledge,
    KnowledgeError,
    bound_knowledge,
    cap_counts,
    check_knowledge_record,
    class_means,
    content_order,
    knowledge_from_arrays,
    knowledge_to_record,
    merge_knowledge,
    record_to_knowledge,
)
from strategies.felo.loss import ClassTargets, loss_terms
from strategies.felo.options import FeloOptions
from tessera import wire
from tessera.config import ConfigError, RunConfig
from tests.conftest import (
    install_fast_clients,
    memory_state,
    round_input,
    simulated_rounds,
    torch_threads,
)
from tests.oracles import allowed_weights
from tests.test_strategies import Federation, run_federation

ROOT = Path(__file__).resolve().parents[1]
THREE_ARCHS = {
    "local-epochs": 1,
    "dataset": "digits",
    "model-family": "cnn",
    "sim-device-profiles": "cpu-small,cpu-large,jetson-orin",
    "train-time-budget": 0.008,
    "round-timeout": 30.0,
}
"""Settings under which the three emulated devices choose three different CNNs."""
THREE_ARCHS_CLI = (
    "local-epochs=1 train-time-budget=0.008 model-family='cnn' "
    "sim-device-profiles='cpu-small,cpu-large,jetson-orin'"
)


# ----------------------------------------------------------------------- knowledge
def test_class_means_hand_values() -> None:
    # Prepare: class 0 rows [1, 2] and [3, 4]; class 2 row [5, 6]; class 1 absent
    values = np.array([[1.0, 2.0], [5.0, 6.0], [3.0, 4.0]])
    labels = np.array([0, 2, 0])

    # Execute
    ids, counts, means = class_means(values, labels, num_classes=3)

    # Assert
    np.testing.assert_array_equal(ids, [0, 2])
    np.testing.assert_array_equal(counts, [2, 1])
    np.testing.assert_allclose(means, [[2.0, 3.0], [5.0, 6.0]])
    assert ids.dtype == np.int64 and means.dtype == np.float32


def test_class_means_rejects_out_of_range_labels() -> None:
    with pytest.raises(KnowledgeError, match="3 classes"):
        class_means(np.zeros((2, 1)), np.array([0, 3]), num_classes=3)


def test_merge_knowledge_is_count_weighted_and_handles_missing_classes() -> None:
    # Prepare: 4 classes. Client A holds classes 0 (3 samples) and 1 (1 sample);
    # client B holds classes 1 (3 samples) and 2 (2 samples); nobody holds class 3.
    a = ClassKnowledge(
        class_ids=np.array([0, 1]),
        counts=np.array([3, 1]),
        logits=np.array([[1.0, 0.0, 0.0, 0.0], [0.0, 4.0, 0.0, 0.0]], dtype=np.float32),
        features=np.array([[1.0, 1.0], [2.0, 0.0]], dtype=np.float32),
    )
    b = ClassKnowledge(
        class_ids=np.array([1, 2]),
        counts=np.array([3, 2]),
        logits=np.array([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0]], dtype=np.float32),
        features=np.array([[6.0, 4.0], [3.0, 3.0]], dtype=np.float32),
    )

    # Execute
    merged = merge_knowledge([a, b], num_classes=4)

    # Assert: class 0 only from A; class 1 = (1 * A + 3 * B) / 4; class 2 only from B
    np.testing.assert_array_equal(merged.class_ids, [0, 1, 2])
    np.testing.assert_array_equal(merged.counts, [3, 4, 2])
    assert merged.features is not None
    np.testing.assert_allclose(merged.features[0], [1.0, 1.0])
    np.testing.assert_allclose(merged.features[1], [(2.0 + 18.0) / 4, (0.0 + 12.0) / 4])
    np.testing.assert_allclose(merged.features[2], [3.0, 3.0])
    np.testing.assert_allclose(merged.logits[1], [0.0, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(merged.logits[2], [0.0, 0.0, 2.0, 0.0])


def test_merge_knowledge_logits_only() -> None:
    # Prepare
    a = ClassKnowledge(np.array([1]), np.array([1]), np.array([[2.0, 0.0]], dtype=np.float32))
    b = ClassKnowledge(np.array([1]), np.array([3]), np.array([[6.0, 4.0]], dtype=np.float32))

    # Execute
    merged = merge_knowledge([a, b], num_classes=2)

    # Assert: (1 * [2, 0] + 3 * [6, 4]) / 4 = [5, 3]
    assert merged.features is None
    np.testing.assert_array_equal(merged.class_ids, [1])
    np.testing.assert_allclose(merged.logits, [[5.0, 3.0]])


def test_merge_knowledge_rejects_empty_and_mismatched_widths() -> None:
    a = ClassKnowledge(np.array([0]), np.array([1]), np.zeros((1, 2), np.float32))
    b = ClassKnowledge(np.array([0]), np.array([1]), np.zeros((1, 3), np.float32))
    with pytest.raises(KnowledgeError, match="no client knowledge"):
        merge_knowledge([], num_classes=2)
    with pytest.raises(KnowledgeError, match="must agree"):
        merge_knowledge([a, b], num_classes=2)


def test_class_knowledge_checks_its_parts() -> None:
    with pytest.raises(KnowledgeError, match="same length"):
        ClassKnowledge(np.array([0, 1]), np.array([1]), np.zeros((2, 2), np.float32))
    with pytest.raises(KnowledgeError, match="repeat"):
        ClassKnowledge(np.array([1, 1]), np.array([1, 1]), np.zeros((2, 2), np.float32))
    with pytest.raises(KnowledgeError, match="features"):
        ClassKnowledge(np.array([0]), np.array([1]), np.zeros((1, 2), np.float32), np.zeros((2, 4)))


def test_knowledge_record_round_trip() -> None:
    # Prepare
    k = knowledge_from_arrays(
        np.arange(8, dtype=np.float32).reshape(4, 2),
        np.arange(12, dtype=np.float32).reshape(4, 3),
        np.array([2, 0, 2, 0]),
        num_classes=3,
    )

    # Execute
    back = record_to_knowledge(knowledge_to_record(k))

    # Assert
    for field in ("class_ids", "counts", "logits", "features"):
        np.testing.assert_array_equal(getattr(back, field), getattr(k, field))
    # class 0 = mean of rows [2, 3] and [6, 7]; class 2 = mean of [0, 1] and [4, 5]
    np.testing.assert_allclose(back.features, [[4.0, 5.0], [2.0, 3.0]])  # type: ignore[arg-type]


# ---------------------------------------------------------------------- projection
@pytest.mark.parametrize("arch", list_models("cnn") + list_models("mlp"))
def test_projected_model_maps_every_arch_to_the_shared_size(arch: str) -> None:
    # Prepare
    base = get_model(arch, input_shape=(1, 8, 8) if "cnn" in arch else (64,), num_classes=7)
    native = base.feature_dim
    x = torch.randn(4, *base.input_shape)

    # Execute
    model = ProjectedModel(base, feature_dim=96)
    z = model.forward_features(x)
    logits = model(x)

    # Assert
    assert z.shape == (4, 96) and logits.shape == (4, 7)
    assert model.native_dim == native and not model.is_identity
    assert not any(k.startswith("body.head") for k in model.state_dict())
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_projected_model_is_identity_when_native_size_matches() -> None:
    # Prepare: cnn-5's representation is 128-d
    base = get_model("cnn-5", input_shape=(1, 8, 8), num_classes=10)
    own_head = base.head
    x = torch.randn(3, 1, 8, 8)
    expected_features = base.forward_features(x)

    # Execute
    model = ProjectedModel(base, feature_dim=128)

    # Assert: no projection, the model's own head kept, same features
    assert model.is_identity
    assert model.head is own_head
    assert not any(k.startswith("projection") for k in model.state_dict())
    torch.testing.assert_close(model.forward_features(x), expected_features)


def test_projected_model_rejects_bad_size() -> None:
    base = get_model("cnn-1", input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(ValueError, match="feature-dim"):
        ProjectedModel(base, feature_dim=0)


# ---------------------------------------------------------------------------- CVAE
def _clustered_features(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 3.0, size=(4, 12))
    labels = rng.integers(0, 4, size=200)
    features = centers[labels] + rng.normal(0.0, 0.3, size=(200, 12))
    return features.astype(np.float32), labels, centers


def test_cvae_reconstruction_loss_falls(single_thread_torch: None) -> None:
    # Prepare
    features, labels, _ = _clustered_features()
    torch.manual_seed(0)
    model = CVAE(CVAEConfig(feature_dim=12, num_classes=4, latent_dim=3, epochs=100))

    # Execute
    result = train_cvae(model, features, labels, seed=0)

    # Assert
    assert len(result.loss_history) == 100 and result.num_samples == 200
    assert result.reconstruction_history[-1] < 0.2 * result.reconstruction_history[0]
    assert result.loss_history[-1] < result.loss_history[0]
    assert result.seconds > 0


def test_cvae_generates_features_of_each_requested_class(single_thread_torch: None) -> None:
    # Prepare
    features, labels, centers = _clustered_features()
    torch.manual_seed(0)
    model = CVAE(CVAEConfig(feature_dim=12, num_classes=4, latent_dim=3, epochs=100))
    train_cvae(model, features, labels, seed=0)

    # Execute
    generated = model.generate(np.array([2, 0, 3]), 25, generator=torch.Generator().manual_seed(1))

    # Assert: shape (classes, n, feature_dim), each class's samples near its centre
    assert generated.shape == (3, 25, 12)
    means = generated.mean(dim=1).numpy()
    for row, cls in enumerate([2, 0, 3]):
        distances = np.linalg.norm(centers - means[row], axis=1)
        assert int(np.argmin(distances)) == cls
        assert distances[cls] < 1.0


def test_cvae_generate_rejects_unknown_class() -> None:
    model = CVAE(CVAEConfig(feature_dim=4, num_classes=3))
    with pytest.raises(ValueError, match="out of range"):
        model.generate([3], 1)
    with pytest.raises(ValueError, match="n >= 1"):
        model.generate([0], 0)


# -------------------------------------------------------------------- client loss
class Tiny(TesseraModel):
    """features = x (2-d), head W = [[1, 0], [0, 1], [1, 1]], no bias."""

    def __init__(self) -> None:
        super().__init__(input_shape=(2,), feature_dim=2, num_classes=3)
        self.body = nn.Linear(2, 2, bias=False)
        self.head = nn.Linear(2, 3, bias=False)
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(2))
            self.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))

    def forward_features(self, x: Tensor) -> Tensor:
        out: Tensor = self.body(x)
        return out


# x -> logits: [1, 0] -> [1, 0, 1]; [0, 2] -> [0, 2, 2]; [1, 1] -> [1, 1, 2]
X = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
Y = torch.tensor([0, 1, 2])
# The server knows classes 0 and 1 only; class 2 gets no target term.
TARGETS = ClassKnowledge(
    class_ids=np.array([0, 1]),
    counts=np.array([5, 5]),
    logits=np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32),
    features=np.array([[0.0, 0.0], [0.0, 1.0]], dtype=np.float32),
)


def _softmax(z: list[float]) -> list[float]:
    e = [math.exp(v) for v in z]
    return [v / sum(e) for v in e]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def _hand_terms(temperature: float) -> tuple[float, float, float]:
    logits = [[1.0, 0.0, 1.0], [0.0, 2.0, 2.0], [1.0, 1.0, 2.0]]
    ce = -sum(math.log(_softmax(z)[y]) for z, y in zip(logits, [0, 1, 2], strict=True)) / 3
    # MSE over the 2 feature entries: sample 0 ((1-0)^2 + 0) / 2, sample 1 (0 + (2-1)^2) / 2
    mse = (0.5 + 0.5) / 3
    t = temperature
    kl0 = _kl(_softmax([1.0 / t, 0.0, 0.0]), _softmax([v / t for v in logits[0]]))
    kl1 = _kl(_softmax([0.0, 0.0, 0.0]), _softmax([v / t for v in logits[1]]))
    kl = t * t * (kl0 + kl1) / 3
    return ce, mse, kl


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_loss_terms_hand_values(temperature: float) -> None:
    # Prepare
    targets = ClassTargets.from_knowledge(TARGETS, num_classes=3)
    ce, mse, kl = _hand_terms(temperature)

    # Execute
    terms = loss_terms(Tiny(), X, Y, targets, temperature=temperature)

    # Assert
    assert terms.ce.item() == pytest.approx(ce, rel=1e-5)
    assert terms.mse.item() == pytest.approx(mse, rel=1e-5)
    assert terms.kl.item() == pytest.approx(kl, rel=1e-5)
    assert terms.total(0.5).item() == pytest.approx(ce + 0.5 * (mse + kl), rel=1e-5)


def test_loss_without_server_knowledge_is_cross_entropy() -> None:
    # Execute
    terms = loss_terms(Tiny(), X, Y, None, temperature=1.0)

    # Assert
    ce, _, _ = _hand_terms(1.0)
    assert terms.ce.item() == pytest.approx(ce, rel=1e-5)
    assert terms.mse.item() == 0.0 and terms.kl.item() == 0.0


def _train_content(targets: ClassKnowledge | None, num_classes: int = 3) -> RecordDict:
    content = RecordDict({wire.CONFIG: ConfigRecord({"num-classes": num_classes})})
    if targets is not None:
        content[CLASS_TARGETS] = knowledge_to_record(targets)
    return content


def _options(**changes: Any) -> FeloOptions:
    return dataclasses.replace(FeloOptions(feature_dim=2, alpha=0.5), **changes)


def test_felo_client_loss_is_equation_one(default_run_config: dict[str, Any]) -> None:
    # Prepare
    client = FeloClient(run=RunConfig.from_flower(default_run_config), options=_options())
    model = Tiny()
    client.begin_round(model, round_input(_train_content(TARGETS)), memory_state())
    ce, mse, kl = _hand_terms(1.0)

    # Execute
    loss = client.loss_fn()(model, X, Y)

    # Assert
    assert loss.item() == pytest.approx(ce + 0.5 * (mse + kl), rel=1e-5)


def test_felo_client_round_one_is_plain_cross_entropy(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare: no class targets in the message
    client = FeloClient(run=RunConfig.from_flower(default_run_config), options=_options())
    model = Tiny()
    client.begin_round(model, round_input(_train_content(None)), memory_state())

    # Execute
    loss = client.loss_fn()(model, X, Y)

    # Assert
    assert loss.item() == pytest.approx(_hand_terms(1.0)[0], rel=1e-5)


def test_fedhe_client_loss_has_no_feature_term(default_run_config: dict[str, Any]) -> None:
    # Prepare: logits-only targets
    options = FeloOptions.parse_fedhe({**default_run_config, "feature-dim": 2})
    client = FeloClient(run=RunConfig.from_flower(default_run_config), options=options)
    model = Tiny()
    client.begin_round(
        model, round_input(_train_content(TARGETS.without_features())), memory_state()
    )
    ce, _, kl = _hand_terms(1.0)

    # Execute
    loss = client.loss_fn()(model, X, Y)

    # Assert
    assert loss.item() == pytest.approx(ce + 0.5 * kl, rel=1e-5)


def test_client_rejects_targets_of_another_feature_size(
    default_run_config: dict[str, Any],
) -> None:
    client = FeloClient(
        run=RunConfig.from_flower(default_run_config), options=_options(feature_dim=5)
    )
    with pytest.raises(ConfigError, match="feature-dim"):
        client.begin_round(Tiny(), round_input(_train_content(TARGETS)), memory_state())


def test_client_variant_follows_weight_sharing(default_run_config: dict[str, Any]) -> None:
    # Prepare
    run = RunConfig.from_flower(default_run_config)

    # Execute
    sharing = FeloClient(run=run, options=_options(share_weights=True))
    knowledge_only = FeloClient(run=run, options=_options(share_weights=False))

    # Assert
    assert type(sharing) is FeloClient
    assert sharing.sends_weights and not sharing.keeps_personal_model
    assert type(knowledge_only) is FeloClient
    assert not knowledge_only.sends_weights and knowledge_only.keeps_personal_model
    assert knowledge_only.options.share_weights is False


def test_client_sends_per_class_means_of_its_training_data(
    default_run_config: dict[str, Any],
) -> None:
    # Prepare
    from tessera.data import ArrayDataset

    client = FeloClient(run=RunConfig.from_flower(default_run_config), options=_options())
    data = ArrayDataset(X.numpy(), np.array([0, 2, 0], dtype=np.int64))

    # Execute
    records = {KNOWLEDGE: client.knowledge_record(Tiny(), data, torch.device("cpu"))}

    # Assert: class 0 = mean of [1, 0] and [1, 1]; class 2 = [0, 2]
    k = record_to_knowledge(records[KNOWLEDGE])
    np.testing.assert_array_equal(k.class_ids, [0, 2])
    np.testing.assert_array_equal(k.counts, [2, 1])
    np.testing.assert_allclose(k.features, [[1.0, 0.5], [0.0, 2.0]])  # type: ignore[arg-type]
    np.testing.assert_allclose(k.logits, [[1.0, 0.5, 1.5], [0.0, 2.0, 2.0]])


# ------------------------------------------------------------------------- options
def test_options_defaults_and_run_config_keys(default_run_config: dict[str, Any]) -> None:
    # Execute
    options = FeloOptions.parse(default_run_config)
    fedhe = FeloOptions.parse_fedhe({**default_run_config, "felo-share-weights": True})

    # Assert: every option has a key in pyproject.toml with a working default
    for key in (
        "feature-dim",
        "felo-alpha",
        "felo-temperature",
        "felo-share-weights",
        "cvae-interval",
        "cvae-latent-dim",
        "cvae-hidden-dim",
        "cvae-epochs",
        "cvae-learning-rate",
        "cvae-samples",
        "cvae-history",
    ):
        assert key in default_run_config, key
    assert options.alpha == 0.5 and options.share_weights and options.exchange_features
    assert not fedhe.share_weights and not fedhe.exchange_features


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("feature-dim", 0),
        ("felo-alpha", -1.0),
        ("felo-temperature", 0.0),
        ("cvae-interval", 0),
        ("cvae-latent-dim", 0),
        ("cvae-samples", 0),
        ("cvae-history", -1),
    ],
)
def test_options_reject_bad_values(
    default_run_config: dict[str, Any], key: str, value: float
) -> None:
    with pytest.raises(ConfigError, match=key):
        FeloOptions.parse({**default_run_config, key: value})


# ---------------------------------------------------------------------- validation
def _reply_content(**changes: np.ndarray) -> RecordDict:
    arrays = {
        "class-ids": np.array([0, 3], dtype=np.int64),
        "counts": np.array([2, 1], dtype=np.int64),
        "features": np.zeros((2, 4), dtype=np.float32),
        "logits": np.zeros((2, 5), dtype=np.float32),
    }
    arrays.update(changes)
    return RecordDict(
        {
            wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 3}),
            KNOWLEDGE: wire.numpy_to_record(arrays),
        }
    )


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"features": np.zeros((2, 6), np.float32)}, "feature dimension 6 vs 4"),
        ({"class-ids": np.array([0, 5])}, "class id(s) [5] out of range [0, 5)"),
        ({"class-ids": np.array([-1, 3])}, "out of range"),
        ({"class-ids": np.array([3, 3])}, "repeat a class"),
        ({"counts": np.array([3, 0])}, "count 0 of class 3 is not positive"),
        ({"counts": np.array([4, -1])}, "not positive"),
        ({"counts": np.array([5, 1])}, "counts sum to 6 but the reply reports num-examples=3"),
        ({"features": np.array([[0, 0, np.nan, 0], [0] * 4], np.float32)}, "'features' has non"),
        ({"logits": np.full((2, 5), np.inf, np.float32)}, "'logits' has non-finite"),
        ({"logits": np.zeros((2, 4), np.float32)}, "logit width 4 vs 5"),
        ({"class-ids": np.array([0.0, 3.0])}, "integer array"),
        # float64 rows of 1e300 overflow their norms to inf (the wire format is float32)
        ({"logits": np.full((2, 5), 1e300)}, "'logits' must be float32, got float64"),
        ({"features": np.zeros((2, 4), np.float16)}, "'features' must be float32, got float16"),
    ],
)
def test_knowledge_validation_rejects_bad_replies(
    changes: dict[str, np.ndarray], reason: str
) -> None:
    # Execute
    problem = check_knowledge_record(_reply_content(**changes), num_classes=5, feature_dim=4)

    # Assert
    assert problem is not None and reason in problem


def test_knowledge_validation_accepts_a_good_reply() -> None:
    assert check_knowledge_record(_reply_content(), num_classes=5, feature_dim=4) is None


def test_knowledge_validation_of_logits_only_schemes() -> None:
    # Prepare: FedHe expects no features
    content = _reply_content()

    # Execute
    problem = check_knowledge_record(content, num_classes=5, feature_dim=None)
    missing = check_knowledge_record(RecordDict(), num_classes=5, feature_dim=None)

    # Assert
    assert problem is not None and "logits only" in problem
    assert missing == "record 'knowledge' missing"


# --------------------------------------------------------------------- federations
RUNS: dict[str, dict[str, Any]] = {
    "felo": {"strategy": "felo"},
    "velo": {"strategy": "velo", "cvae-epochs": 20},
    "velo-interval": {"strategy": "velo", "cvae-epochs": 20, "cvae-interval": 2},
    "velo-history": {"strategy": "velo", "cvae-epochs": 20, "cvae-history": 1},
    "fedhe": {"strategy": "fedhe"},
    "felo-knowledge-only": {"strategy": "felo", "felo-share-weights": False},
    "felo-bad-reply": {"strategy": "felo"},
    "felo-count-lie": {"strategy": "felo"},
}


def wrong_feature_dim(reply: Message) -> Message:
    """Replace node 22's features by 3-d ones (the federation uses feature-dim 128)."""
    record = reply.content.array_records[KNOWLEDGE]
    k = record_to_knowledge(record)
    bad = ClassKnowledge(k.class_ids, k.counts, k.logits, np.zeros((len(k.class_ids), 3)))
    reply.content.array_records[KNOWLEDGE] = knowledge_to_record(bad)
    return reply


def claims_class_zero(reply: Message) -> Message:
    """Make node 22 claim its samples on class 0, one on each other class.

    The counts still sum to its ``num-examples`` (validation checks that), so the
    round's weight cap leaves them as they are.
    """
    k = record_to_knowledge(reply.content.array_records[KNOWLEDGE])
    counts = np.ones_like(k.counts)
    counts[k.class_ids == 0] = int(k.counts.sum()) - (len(counts) - 1)
    lie = ClassKnowledge(k.class_ids, counts, k.logits, k.features)
    reply.content.array_records[KNOWLEDGE] = knowledge_to_record(lie)
    return reply


TAMPER: dict[str, Callable[[Message], Message]] = {
    "felo-bad-reply": wrong_feature_dim,
    "felo-count-lie": claims_class_zero,
}


@pytest.fixture(scope="module")
def federation(
    default_run_config: dict[str, Any],
    digits_bundle: Any,
    candidate_cost_cache: dict[tuple[Any, ...], Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], Federation]]:
    """``federation(name)``: the finished 2-round run ``RUNS[name]``, run on first use."""
    done: dict[str, Federation] = {}
    with pytest.MonkeyPatch.context() as mp, torch_threads(1):
        install_fast_clients(mp, digits_bundle, candidate_cost_cache)

        def get(name: str) -> Federation:
            if name not in done:
                config = {**default_run_config, **THREE_ARCHS, **RUNS[name]}
                done[name] = run_federation(
                    config,
                    digits_bundle,
                    tmp_path_factory.mktemp(name) / "run",
                    num_rounds=2,
                    tamper={22: TAMPER[name]} if name in TAMPER else None,
                )
            return done[name]

        yield get


def capped_knowledge(fed: Federation, replies: list[Message]) -> list[ClassKnowledge]:
    """The replies' knowledge, each node's counts cut to the weight its cohort allows it."""
    sizes = {n: info.num_train for n, info in fed.server.nodes.items()}
    return [
        cap_counts(record_to_knowledge(r.content.array_records[KNOWLEDGE]), w)
        for r, w in zip(replies, allowed_weights(sizes, replies), strict=True)
    ]


def _train_messages(fed: Federation, server_round: int) -> list[Message]:
    return [
        m
        for m in fed.grid.sent_of("train")
        if m.content.config_records[wire.CONFIG]["server-round"] == server_round
    ]


@pytest.mark.parametrize("name", ["felo", "velo", "fedhe", "felo-knowledge-only"])
def test_scheme_runs_two_rounds_on_three_architectures(
    federation: Callable[[str], Federation], name: str
) -> None:
    # Execute
    fed = federation(name)

    # Assert
    assert len(set(fed.node_choices().values())) == 3, fed.node_choices()
    assert [r["round"] for r in fed.server.rounds] == [1, 2]
    for record in fed.server.rounds:
        assert record["num_ok"] == 3 and record["num_rejected"] == 0, record["rejected"]
        assert record["knowledge_classes"] == 10
        assert len({c["arch"] for c in record["clients"]}) == 3
        assert math.isfinite(record["personal_accuracy_mean"])
    # round 1 carries no targets, round 2 the per-class targets for every node
    assert all(CLASS_TARGETS not in m.content.array_records for m in _train_messages(fed, 1))
    assert all(CLASS_TARGETS in m.content.array_records for m in _train_messages(fed, 2))
    assert [line["round"] for line in fed.metrics_lines()] == [1, 2]


def test_felo_sends_round_one_averages_and_group_weights(
    federation: Callable[[str], Federation],
) -> None:
    # Prepare: the count-weighted average of the round-1 replies' knowledge, each
    # node's counts within the weight the cohort allows it
    fed = federation("felo")
    first = fed.grid.replies_of("train")[:3]
    parts = capped_knowledge(fed, first)
    expected = merge_knowledge(parts, num_classes=10)

    # Execute
    sent = [
        record_to_knowledge(m.content.array_records[CLASS_TARGETS]) for m in _train_messages(fed, 2)
    ]

    # Assert
    for targets in sent:
        np.testing.assert_array_equal(targets.class_ids, expected.class_ids)
        np.testing.assert_allclose(targets.logits, expected.logits, rtol=1e-6)
        assert targets.features is not None and targets.features.shape == (10, 128)
        np.testing.assert_allclose(targets.features, expected.features, rtol=1e-6)  # type: ignore[arg-type]
    for message in _train_messages(fed, 2):
        assert wire.ARRAYS in message.content.array_records
    assert set(fed.server.global_models()) == set(fed.node_choices().values())
    assert fed.server.rounds[-1]["global_accuracy"] is not None


def test_velo_records_cvae_training_and_sends_synthetic_features(
    federation: Callable[[str], Federation],
) -> None:
    # Execute
    fed = federation("velo")

    # Assert
    for record in fed.server.rounds:
        assert record["cvae_trained"] is True
        assert record["cvae_seconds"] > 0
        assert math.isfinite(record["cvae_loss"])
    assert [r["cvae_dataset_size"] for r in fed.server.rounds] == [30, 60]
    first = fed.grid.replies_of("train")[:3]
    averages = merge_knowledge(capped_knowledge(fed, first), 10)
    (targets, *_) = [
        record_to_knowledge(m.content.array_records[CLASS_TARGETS]) for m in _train_messages(fed, 2)
    ]
    np.testing.assert_allclose(targets.logits, averages.logits, rtol=1e-6)
    assert targets.features is not None and targets.features.shape == (10, 128)
    assert not np.allclose(targets.features, averages.features)  # type: ignore[arg-type]
    lines = fed.metrics_lines()
    assert all("cvae_seconds" in line and "cvae_loss" in line for line in lines)


def test_velo_s_targets_do_not_depend_on_the_order_replies_arrive_in(
    federation: Callable[[str], Federation],
) -> None:
    # Prepare: a Velo server after two rounds and three clients' knowledge
    fed = federation("velo")
    server = fed.server
    parts = [
        record_to_knowledge(r.content.array_records[KNOWLEDGE])
        for r in fed.grid.replies_of("train")[:3]
    ]
    merged = merge_knowledge(parts, 10)
    saved = server.target_state()

    # Execute: round 3's targets from the same parts in two arrival orders
    first, _ = server.make_targets(3, parts, merged)
    server.restore_target_state(saved)
    second, _ = server.make_targets(3, parts[::-1], merged)

    # Assert: the CVAE banks them in one order, so the targets are bit for bit equal
    assert first.features is not None and second.features is not None
    np.testing.assert_array_equal(first.features, second.features)
    assert content_order(parts) == content_order(parts[::-1])


def test_velo_trains_its_cvae_every_interval_rounds(
    federation: Callable[[str], Federation],
) -> None:
    # Execute: cvae-interval=2 trains in rounds 1, 3, 5, ...
    fed = federation("velo-interval")

    # Assert
    first, second = fed.server.rounds
    assert first["cvae_trained"] is True and first["cvae_seconds"] > 0
    assert second["cvae_trained"] is False
    assert second["cvae_seconds"] == 0.0 and second["cvae_loss"] is None
    assert second["synthetic_classes"] == 10
    assert [rnd for rnd, _, _ in fed.server.feature_bank] == [1, 1, 1, 2, 2, 2]


def test_velo_history_keeps_only_the_last_rounds(
    federation: Callable[[str], Federation],
) -> None:
    # Execute: cvae-history=1 trains on (and keeps) the latest round's features only
    fed = federation("velo-history")

    # Assert
    assert [r["cvae_dataset_size"] for r in fed.server.rounds] == [30, 30]
    assert [rnd for rnd, _, _ in fed.server.feature_bank] == [2, 2, 2]


def test_fedhe_exchanges_logits_only(federation: Callable[[str], Federation]) -> None:
    # Execute
    fed = federation("fedhe")

    # Assert
    for message in fed.grid.sent_of("train"):
        assert wire.ARRAYS not in message.content.array_records
    for reply in fed.grid.replies_of("train"):
        assert set(reply.content.array_records) == {KNOWLEDGE}
        assert "features" not in reply.content.array_records[KNOWLEDGE]
    for context in fed.grid.contexts.values():
        assert "tessera.model" in context.state.array_records
    assert fed.server.rounds[-1]["global_accuracy"] is None
    assert all(c["bytes_up"] < 4096 for c in fed.server.rounds[-1]["clients"])


def test_felo_without_weight_sharing_keeps_personal_models(
    federation: Callable[[str], Federation],
) -> None:
    # Execute
    fed = federation("felo-knowledge-only")

    # Assert
    for message in fed.grid.sent_of("train"):
        assert wire.ARRAYS not in message.content.array_records
    for reply in fed.grid.replies_of("train"):
        assert set(reply.content.array_records) == {KNOWLEDGE}
    for context in fed.grid.contexts.values():
        assert "tessera.model" in context.state.array_records
    # 10 classes x (128 features + 10 logits) float32 + ids and counts, plus framing
    for client in fed.server.rounds[-1]["clients"]:
        assert 10 * 138 * 4 < client["bytes_up"] < 10 * 138 * 4 + 2048


def test_bad_reply_is_rejected_and_round_continues(
    federation: Callable[[str], Federation],
) -> None:
    # Execute: node 22 sends 3-d features every round
    fed = federation("felo-bad-reply")

    # Assert
    for record in fed.server.rounds:
        assert record["num_ok"] == 2 and record["num_rejected"] == 1
        (rejection,) = record["rejected"]
        assert rejection["node"] == 22
        assert "feature dimension 3 vs 128" in rejection["reason"]
        assert record["knowledge_classes"] > 0
    assert fed.server.targets is not None
    assert fed.server.targets.features is not None
    assert np.all(np.isfinite(fed.server.targets.features))


def test_claimed_counts_are_cut_to_the_handshake_label_counts(
    federation: Callable[[str], Federation],
) -> None:
    # Prepare: node 22 claims its whole training set on class 0 (one sample on each
    # other); its handshake declared its true label counts, which honest counts equal
    fed = federation("felo-count-lie")
    first = fed.grid.replies_of("train")[:3]
    declared = {n: np.asarray(info.label_counts) for n, info in fed.server.nodes.items()}
    sent = [record_to_knowledge(r.content.array_records[KNOWLEDGE]) for r in first]
    lie = next(k for r, k in zip(first, sent, strict=True) if r.metadata.src_node_id == 22)
    assert int(lie.counts[lie.class_ids == 0][0]) > 2 * int(declared[22][0])
    # each node's counts within its declared ones, then within the weight it may weigh
    within = [
        ClassKnowledge(
            k.class_ids,
            np.minimum(k.counts, declared[r.metadata.src_node_id][k.class_ids]),
            k.logits,
            k.features,
        )
        for r, k in zip(first, sent, strict=True)
    ]
    weights = allowed_weights({n: int(d.sum()) for n, d in declared.items()}, first)
    expected = merge_knowledge(
        [cap_counts(k, w) for k, w in zip(within, weights, strict=True)], num_classes=10
    )
    unguarded = merge_knowledge(
        [cap_counts(k, w) for k, w in zip(sent, weights, strict=True)], num_classes=10
    )

    # Execute: the targets round 2 sent
    targets = [
        record_to_knowledge(m.content.array_records[CLASS_TARGETS]) for m in _train_messages(fed, 2)
    ]

    # Assert: node 22 weighs in as its handshake said, never by what it claimed; the
    # reply is kept (the cut is its bound, not a refusal)
    assert all(r["num_ok"] == 3 and r["num_rejected"] == 0 for r in fed.server.rounds), [
        r["rejected"] for r in fed.server.rounds
    ]
    assert not np.allclose(expected.logits, unguarded.logits, rtol=1e-3)
    for got in targets:
        np.testing.assert_array_equal(got.counts, expected.counts)
        np.testing.assert_allclose(got.logits, expected.logits, rtol=1e-6)
        assert got.features is not None and expected.features is not None
        np.testing.assert_allclose(got.features, expected.features, rtol=1e-6)


def test_schemes_are_registered() -> None:
    for name in ("felo", "velo", "fedhe"):
        scheme = get_scheme(name)
        assert scheme.default_family == "cnn"
        assert scheme.client is FeloClient


# ------------------------------------------------------------------ end to end (slow)
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["felo", "velo", "fedhe"])
def test_simulation_two_rounds_three_profiles(tmp_path: Path, strategy: str) -> None:
    # Execute
    rounds = simulated_rounds(
        tmp_path, f"strategy='{strategy}' num-server-rounds=2 cvae-epochs=2 {THREE_ARCHS_CLI}"
    )

    # Assert
    assert [r["round"] for r in rounds] == [1, 2]
    archs = {c["arch"] for r in rounds for c in r["clients"]}
    assert len(archs) >= 2, archs
    for r in rounds:
        assert r["num_ok"] == 3 and r["num_rejected"] == 0, r["rejected"]
        assert r["knowledge_classes"] == 10
        assert {c["profile"] for c in r["clients"]} == {"cpu-small", "cpu-large", "jetson-orin"}
    if strategy == "velo":
        assert all(r["cvae_seconds"] > 0 and math.isfinite(r["cvae_loss"]) for r in rounds)
    if strategy == "fedhe":
        assert all(c["bytes_up"] < 4096 for r in rounds for c in r["clients"])


@pytest.mark.slow
@pytest.mark.skipif(
    not (ROOT / ".venv" / "bin" / "flower-superlink").exists(),
    reason="needs .venv with Flower (run scripts/setup.sh)",
)
def test_felo_native_deployment(tmp_path: Path) -> None:
    # Prepare
    run_config = (
        f"strategy='felo' num-server-rounds=2 round-timeout=120 {THREE_ARCHS_CLI} "
        f"output-dir='{tmp_path / 'results'}' run-name='e2e'"
    )
    cmd = [
        "bash",
        str(ROOT / "scripts" / "deploy-local.sh"),
        "--nodes",
        "3",
        "--profiles",
        "cpu-small,cpu-large,jetson-orin",
        "--run-config",
        run_config,
        "--workdir",
        str(tmp_path / "deploy"),
        "--timeout",
        "300",
    ]

    # Execute
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)

    # Assert
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    lines = (tmp_path / "results" / "e2e" / "metrics.jsonl").read_text().splitlines()
    rounds = [json.loads(line) for line in lines]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["num_ok"] == 3 and r["num_rejected"] == 0, r["rejected"]
        assert r["knowledge_classes"] == 10
        assert r["global_accuracy"] is not None
    assert len({c["arch"] for r in rounds for c in r["clients"]}) >= 2


def _round_messages(fed: Federation, server_round: int) -> list[Message]:
    ids = {m.metadata.message_id for m in _train_messages(fed, server_round)}
    return [r for r in fed.grid.replies_of("train") if r.metadata.reply_to_message_id in ids]


def _round_replies(fed: Federation, server_round: int) -> list[ClassKnowledge]:
    return [
        record_to_knowledge(r.content.array_records[KNOWLEDGE])
        for r in _round_messages(fed, server_round)
    ]


@pytest.mark.parametrize("name", ["felo", "fedhe"])
def test_knowledge_folded_as_it_arrives_equals_the_buffered_merge(
    federation: Callable[[str], Federation], name: str
) -> None:
    # Prepare: the buffered merge of round 2's replies (knowledge-clip-factor 3 x the
    # round's own lower median), and which rows the fold could not take at once: a
    # norm above 3 x round 1's median / bound-growth 2 in some kind
    fed = federation(name)
    first, second = _round_replies(fed, 1), _round_replies(fed, 2)
    kinds = ["logits", "features"] if name == "felo" else ["logits"]

    def norms(rows: list[ClassKnowledge], kind: str) -> np.ndarray:
        return np.concatenate(
            [np.linalg.norm(getattr(p, kind).astype(np.float64), axis=1) for p in rows]
        )

    def lower_median(values: np.ndarray) -> float:
        ordered = np.sort(values)
        return float(ordered[(ordered.size - 1) // 2])

    def median(rows: list[ClassKnowledge], kind: str) -> float:
        # each node's lower median positive row norm, then their lower median
        own = [norms([p], kind) for p in rows]
        return lower_median(np.array([lower_median(n[n > 0]) for n in own if (n > 0).any()]))

    capped = capped_knowledge(fed, _round_messages(fed, 2))
    expected = merge_knowledge(bound_knowledge(capped, 3.0)[0], num_classes=10)
    above = np.zeros(sum(p.num_classes_present for p in second), dtype=bool)
    for k in kinds:
        # the clamp to [round 1's median / 2, x 2] did not bind
        assert median(first, k) / 2.0 <= median(second, k) <= 2.0 * median(first, k)
        above |= norms(second, k) > 3.0 * median(first, k) / 2.0

    # Execute: the server's state after round 2
    targets = fed.server.targets

    # Assert: the same targets; round 1 kept every row, round 2 only those above
    assert targets is not None
    np.testing.assert_allclose(targets.logits, expected.logits, rtol=1e-6, atol=1e-7)
    if name == "felo":
        assert targets.features is not None and expected.features is not None
        np.testing.assert_allclose(targets.features, expected.features, rtol=1e-6, atol=1e-7)
    rows = [sum(p.num_classes_present for p in r) for r in (first, second)]
    assert [r["knowledge_rows"] for r in fed.server.rounds] == rows
    assert [r["knowledge_kept"] for r in fed.server.rounds] == [rows[0], int(above.sum())]
    assert fed.server.knowledge_scales == pytest.approx({k: median(second, k) for k in kinds})
    # the medians travel in the checkpoint
    assert fed.server.state_dict()["knowledge_scales"] == fed.server.knowledge_scales


def test_velo_keeps_every_row_for_its_cvae(federation: Callable[[str], Federation]) -> None:
    fed = federation("velo")
    assert all("knowledge_kept" not in r for r in fed.server.rounds)
    assert fed.server.knowledge_scales == {}
