"""The sub-model schemes (heterofl, flexifed, nefl, fedfa) on the in-process grid."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server_app.app import build_server
from tests.conftest import TINY_DIGITS, make_grid

SUBMODEL = {
    **TINY_DIGITS,
    "model-family": "preresnet",
    "sim-device-profiles": "cpu-small,jetson-orin",
    "submodel-widths": "1,0.25",
}
"""Digits, the preresnet26_025 global model, a weak and a strong device."""


def run_scheme(
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    tmp_path: Path,
    overrides: dict[str, Any],
    *,
    nodes: int = 4,
    rounds: int = 2,
) -> Any:
    config = run_config(
        {**SUBMODEL, "num-server-rounds": rounds, "min-nodes": nodes}
        | {"output-dir": str(tmp_path), "run-name": "r"}
        | overrides
    )
    server = build_server(config, bundle=digits_bundle).runner
    server.start(make_grid(config, nodes), num_rounds=rounds, timeout=60.0)
    return server


@pytest.mark.parametrize("scheme", ["heterofl", "flexifed", "nefl", "fedfa"])
def test_every_submodel_scheme_trains_slices_and_evaluates_them(
    scheme: str,
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    server = run_scheme(run_config, digits_bundle, tmp_path, {"strategy": scheme})
    archs = {info.arch for info in server.nodes.values()}
    print(scheme, archs, [r.get("global_accuracy") for r in server.rounds])
    assert all(a.startswith("preresnet26_025@") for a in archs)
    assert len(archs) >= 2, f"weak and strong devices picked the same slice: {archs}"
    for record in server.rounds:
        assert not record.get("skipped"), record.get("skip_reason")
        assert record["submodel_accuracy"]
        assert 0.0 <= record["global_accuracy"] <= 1.0
    assert server.rounds[-1]["global_accuracy"] > 0.1


@pytest.mark.parametrize(
    ("scheme", "extra"),
    [("heterofl", {}), ("fedfa", {"fedfa-scaling": False, "fedfa-weighted": True})],
)
def test_with_every_node_on_the_full_model_the_scheme_is_fedavg(
    scheme: str,
    extra: dict[str, Any],
    run_config: Callable[..., dict[str, Any]],
    digits_bundle: Any,
    fast_clients: None,
    tmp_path: Path,
) -> None:
    same = {
        "sim-device-profiles": "jetson-orin",
        "submodel-widths": "1",
        "submodel-mask-classes": False,
        "fedavg-arch": "preresnet26_025",
        "clip-factor": 0,  # fedfa has no update bound (its scaling is its defence)
    }
    fedavg = run_scheme(run_config, digits_bundle, tmp_path / "a", {"strategy": "fedavg", **same})
    sub = run_scheme(
        run_config, digits_bundle, tmp_path / "b", {"strategy": scheme, **same, **extra}
    )
    assert {i.arch for i in sub.nodes.values()} == {"preresnet26_025@w1-d3.3.3.3"}
    expected = fedavg.models.arrays["preresnet26_025"]
    got = sub.global_state
    assert list(got) == list(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=1e-6, err_msg=key)
    assert sub.rounds[-1]["global_accuracy"] == pytest.approx(fedavg.rounds[-1]["global_accuracy"])
