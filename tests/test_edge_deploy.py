"""The edge-deploy tool's pure parts: image choice per host, and input checks.

No Docker engine needed; ``tests/test_docker.py`` runs the tool against a real one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "edge_deploy", ROOT / "scripts" / "edge_deploy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["edge_deploy"] = module
    spec.loader.exec_module(module)
    return module


ed = _load()


def _host(arch: str, runtimes: tuple[str, ...] = ("runc",)) -> object:
    return ed.HostInfo(name="dev", arch=arch, runtimes=runtimes, os="Linux")


@pytest.mark.parametrize(
    ("arch", "runtimes", "gpu", "app", "runtime"),
    [
        ("amd64", ("runc",), "auto", "tessera/app-cpu:latest", None),
        ("arm64", ("runc",), "auto", "tessera/app-cpu:latest", None),  # Raspberry Pi
        ("arm64", ("nvidia", "runc"), "auto", "tessera/app-jetson:latest", "nvidia"),  # Jetson
        ("arm64", ("nvidia", "runc"), "off", "tessera/app-cpu:latest", None),
        ("amd64", ("nvidia", "runc"), "auto", "tessera/app-cpu:latest", None),  # x86 GPU box
        ("amd64", ("nvidia", "runc"), "on", "tessera/app-cpu:latest", "nvidia"),
    ],
)
def test_plan_images_by_host(
    arch: str, runtimes: tuple[str, ...], gpu: str, app: str, runtime: str | None
) -> None:
    plan = ed.plan_images(_host(arch, runtimes), gpu=gpu)
    assert plan.supernode == "tessera/flower:latest"
    assert plan.clientapp == app
    assert plan.runtime == runtime


def test_plan_images_honours_explicit_images_and_tag() -> None:
    plan = ed.plan_images(_host("arm64"), tag="v2", app_image="reg.example/app:1")
    assert plan.supernode == "tessera/flower:v2"
    assert plan.clientapp == "reg.example/app:1"


def test_plan_images_rejects_gpu_without_runtime_and_unknown_arch() -> None:
    with pytest.raises(ed.DeployError, match="no 'nvidia' container runtime"):
        ed.plan_images(_host("amd64"), gpu="on")
    with pytest.raises(ed.DeployError, match="amd64 and arm64"):
        ed.plan_images(_host("arm"))


def test_host_info_maps_engine_architecture_names() -> None:
    info = ed.HostInfo.from_info(
        {"Name": "orin", "Architecture": "aarch64", "Runtimes": {"runc": {}, "nvidia": {}}}
    )
    assert (info.arch, info.has_nvidia, info.is_jetson) == ("arm64", True, True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("superlink:9092", ("superlink", 9092)),
        ("192.0.2.10:9092", ("192.0.2.10", 9092)),
        ("[2001:db8::1]:9092", ("2001:db8::1", 9092)),
    ],
)
def test_parse_superlink(text: str, expected: tuple[str, int]) -> None:
    assert ed.parse_superlink(text) == expected


@pytest.mark.parametrize("text", ["superlink", "superlink:", "a:b:9092", "host:0", "host:70000"])
def test_parse_superlink_rejects(text: str) -> None:
    with pytest.raises(ed.UsageError):
        ed.parse_superlink(text)


def test_parse_node_config() -> None:
    assert ed.parse_node_config("partition-id=0 num-partitions=4") == {
        "partition-id": "0",
        "num-partitions": "4",
    }
    assert ed.parse_node_config("data-path='/data/x.npz'")["data-path"] == "/data/x.npz"
    with pytest.raises(ed.UsageError, match="not key=value"):
        ed.parse_node_config("partition-id")
    with pytest.raises(ed.UsageError, match="partition-id and num-partitions"):
        ed.parse_node_config("partition-id=0")


@pytest.mark.parametrize("name", ["Pi-1", "-x", "a b", "x" * 42, ""])
def test_check_name_rejects(name: str) -> None:
    with pytest.raises(ed.UsageError):
        ed.check_name(name)


def test_bad_usage_exits_2_without_an_engine(capsys: pytest.CaptureFixture[str]) -> None:
    status = ed.main(
        ["deploy", "--name", "pi-1", "--superlink", "nohost", "--node-config", "partition-id=0"]
    )
    assert status == 2
    assert "host:port" in capsys.readouterr().err


# ------------------------------------------------------------------------ node state
def test_with_state_dir_adds_the_container_folder_once() -> None:
    got = ed.with_state_dir("partition-id=0 num-partitions=4")
    assert got == "partition-id=0 num-partitions=4 state-dir='/data/node-state'"
    assert ed.parse_node_config(got)["state-dir"] == "/data/node-state"
    own = "partition-id=0 num-partitions=4 state-dir='/mnt/x'"
    assert ed.with_state_dir(own) == own


def test_state_volume_is_named_per_node_or_an_absolute_host_folder() -> None:
    assert ed.state_volume("pi-1", None) == ("tessera-pi-1-state", True)
    assert ed.state_volume("pi-1", "/var/lib/tessera/pi-1") == ("/var/lib/tessera/pi-1", False)
    with pytest.raises(ed.UsageError, match="absolute"):
        ed.state_volume("pi-1", "state")


def _compose(name: str) -> dict[str, object]:
    import yaml

    document = yaml.safe_load((ROOT / name).read_text())
    assert isinstance(document, dict)
    return document


def test_compose_nodes_keep_their_state_in_a_volume_of_their_own() -> None:
    # Prepare
    compose = _compose("compose.yaml")
    services = compose["services"]
    assert isinstance(services, dict)

    # Assert: supernode-N passes state-dir, clientapp-N (which runs the ClientApp
    # code that reads it) mounts node-N-state there, and the volume is declared
    for n in range(1, 7):
        node_config = services[f"supernode-{n}"]["environment"]["TESSERA_NODE_CONFIG"]
        assert ed.parse_node_config(node_config)["state-dir"] == "/data/node-state"
        assert f"node-{n}-state:/data" in services[f"clientapp-{n}"]["volumes"]
        assert f"node-{n}-state" in compose["volumes"]  # type: ignore[operator]
    jetson = _compose("compose.jetson.yaml")["services"]
    assert isinstance(jetson, dict)
    for service in ("supernode-1", "supernode-2", "supernode-3", "supernode-jetson"):
        node_config = jetson[service]["environment"]["TESSERA_NODE_CONFIG"]
        assert ed.parse_node_config(node_config)["state-dir"] == "/data/node-state"
    assert "node-jetson-state:/data" in jetson["clientapp-jetson"]["volumes"]


def test_every_compose_supernode_takes_the_supernode_choice() -> None:
    # TESSERA_SUPERNODE picks Tessera's paced launcher or Flower's flower-supernode
    # for every node (overhead.py's compose-flower mode sets it to flower)
    choice = "${TESSERA_SUPERNODE:-tessera}"
    services = _compose("compose.yaml")["services"]
    jetson = _compose("compose.jetson.yaml")["services"]
    assert isinstance(services, dict) and isinstance(jetson, dict)
    for n in range(1, 7):
        assert services[f"supernode-{n}"]["environment"]["TESSERA_SUPERNODE"] == choice
    assert jetson["supernode-jetson"]["environment"]["TESSERA_SUPERNODE"] == choice
