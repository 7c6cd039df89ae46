"""Tests for client_app.device: cgroup parsing, Jetson detection, profiles, probing."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from client_app import device
from client_app.device import (
    PREDEFINED_PROFILES,
    DeviceProfile,
    DeviceProfileError,
    detect_jetson,
    effective_cpu_count,
    measure_cpu_macs_per_second,
    predefined_profile,
    probe_device,
    read_cgroup_cpu_limit,
    read_cgroup_memory_limit,
    read_host_memory,
    resolve_profile,
)

CGROUP = Path(__file__).parent / "fixtures" / "cgroup"
MiB = 1024 * 1024
GiB = 1024 * MiB


# --- cgroup -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("v2-unlimited", None),  # cpu.max "max 100000"
        ("v2-limited", 1.5),  # cpu.max "150000 100000"
        ("v1-unlimited", None),  # cpu/cpu.cfs_quota_us -1
        ("v1-limited", 0.5),  # cpu,cpuacct/cpu.cfs_quota_us 50000 / 100000
        ("empty", None),  # no files at all
    ],
)
def test_read_cgroup_cpu_limit(fixture: str, expected: float | None) -> None:
    # Execute
    limit = read_cgroup_cpu_limit(CGROUP / fixture)

    # Assert
    assert limit == expected


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("v2-unlimited", None),  # memory.max "max"
        ("v2-limited", 536_870_912),
        ("v1-unlimited", None),  # 9223372036854771712
        ("v1-limited", 1_073_741_824),
        ("empty", None),
    ],
)
def test_read_cgroup_memory_limit(fixture: str, expected: int | None) -> None:
    # Execute
    limit = read_cgroup_memory_limit(CGROUP / fixture)

    # Assert
    assert limit == expected


def test_read_cgroup_cpu_limit_v1_plain_cpu_directory(tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")

    # Execute / Assert
    assert read_cgroup_cpu_limit(tmp_path) == 0.5


@pytest.mark.parametrize("content", ["", "garbage\n", "12 34 56\n", "0 100000\n"])
def test_read_cgroup_cpu_limit_malformed_is_none(tmp_path: Path, content: str) -> None:
    # Prepare
    (tmp_path / "cpu.max").write_text(content)

    # Execute / Assert
    assert read_cgroup_cpu_limit(tmp_path) is None


def test_read_cgroup_memory_limit_malformed_is_none(tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "memory.max").write_text("lots\n")

    # Execute / Assert
    assert read_cgroup_memory_limit(tmp_path) is None


def test_unreadable_cgroup_file_is_none(tmp_path: Path) -> None:
    # Prepare: a directory where the file should be makes read_text raise an OSError
    (tmp_path / "cpu.max").mkdir()
    (tmp_path / "memory.max").mkdir()

    # Execute / Assert
    assert read_cgroup_cpu_limit(tmp_path) is None
    assert read_cgroup_memory_limit(tmp_path) is None


def test_effective_cpu_count_honours_quota() -> None:
    # Prepare
    visible = len(os.sched_getaffinity(0))

    # Execute / Assert
    assert effective_cpu_count(CGROUP / "v1-limited") == min(visible, 0.5)
    assert effective_cpu_count(CGROUP / "v2-unlimited") == visible


def test_read_host_memory_prefers_mem_available(tmp_path: Path) -> None:
    # Prepare
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2048 kB\nMemFree: 100 kB\nMemAvailable:   1024 kB\n")

    # Execute / Assert
    assert read_host_memory(meminfo) == 1024 * 1024


def test_read_host_memory_falls_back_to_mem_total(tmp_path: Path) -> None:
    # Prepare
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2048 kB\n")

    # Execute / Assert
    assert read_host_memory(meminfo) == 2048 * 1024


# --- Jetson -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("release", "model", "expected"),
    [
        ("# R36 (release), REVISION: 4.0\n", None, True),
        (None, "NVIDIA Jetson Orin Nano Developer Kit\x00", True),
        (None, "NVIDIA Orin NX Developer Kit\x00", True),
        (None, "Jetson-AGX\x00", True),
        (None, "Raspberry Pi 4 Model B Rev 1.4\x00", False),
        (None, None, False),
    ],
)
def test_detect_jetson(
    tmp_path: Path, release: str | None, model: str | None, expected: bool
) -> None:
    # Prepare
    tegra_release = tmp_path / "nv_tegra_release"
    dt_model = tmp_path / "model"
    if release is not None:
        tegra_release.write_text(release)
    if model is not None:
        dt_model.write_text(model)

    # Execute / Assert
    assert detect_jetson(tegra_release, dt_model) is expected


# --- predefined profiles ------------------------------------------------------


def test_predefined_profiles_exist_and_are_immutable() -> None:
    # Assert
    for name in ("cpu-small", "cpu-medium", "cpu-large", "jetson-orin", "gpu-server"):
        profile = predefined_profile(name)
        assert profile.name == name
        assert profile.source == "predefined"
    with pytest.raises(TypeError):
        PREDEFINED_PROFILES["x"] = PREDEFINED_PROFILES["cpu-small"]  # type: ignore[index]


def test_predefined_profile_figures() -> None:
    # Prepare
    small = predefined_profile("cpu-small")
    large = predefined_profile("cpu-large")
    orin = predefined_profile("jetson-orin")
    server = predefined_profile("gpu-server")

    # Assert
    assert (small.cpu_cores, small.memory_bytes, small.accelerator) == (
        1.0,
        512 * MiB,
        "cpu",
    )
    assert 1e8 <= small.train_macs_per_second <= 1e9
    assert (large.cpu_cores, large.memory_bytes) == (8.0, 16 * GiB)
    assert orin.accelerator == "cuda" and orin.is_jetson
    assert orin.accelerator_memory_bytes == orin.memory_bytes == 8 * GiB
    assert server.accelerator == "cuda" and not server.is_jetson
    assert server.accelerator_memory_bytes == 80 * GiB
    speeds = [p.train_macs_per_second for p in (small, predefined_profile("cpu-medium"), large)]
    assert speeds == sorted(speeds)
    assert server.train_macs_per_second > orin.train_macs_per_second > large.train_macs_per_second


def test_unknown_profile_raises_listing_names() -> None:
    # Execute / Assert
    with pytest.raises(DeviceProfileError, match="cpu-small") as info:
        predefined_profile("raspberry")
    assert "raspberry" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "change",
    [
        {"source": "guessed"},
        {"accelerator": "tpu"},
        {"cpu_cores": 0.0},
        {"memory_bytes": 0},
        {"train_macs_per_second": -1.0},
        {"train_macs_per_second": math.nan},
        {"accelerator_memory_bytes": 0},
        {"name": ""},
    ],
)
def test_invalid_profile_raises(change: dict[str, object]) -> None:
    # Execute / Assert
    with pytest.raises(DeviceProfileError):
        replace(PREDEFINED_PROFILES["cpu-small"], **change)  # type: ignore[arg-type]


# --- serialisation ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PREDEFINED_PROFILES))
def test_to_dict_from_dict_round_trip(name: str) -> None:
    # Prepare
    profile = predefined_profile(name)

    # Execute
    data = profile.to_dict()
    restored = DeviceProfile.from_dict(json.loads(json.dumps(data)))

    # Assert
    assert restored == profile
    assert all(isinstance(v, (str, int, float, bool)) for v in data.values())


def test_to_dict_encodes_none_as_empty_and_zero() -> None:
    # Execute
    data = predefined_profile("cpu-small").to_dict()

    # Assert
    assert data["accelerator-name"] == ""
    assert data["accelerator-memory-bytes"] == 0


def test_to_dict_is_a_valid_flower_config_record() -> None:
    # Prepare
    from flwr.app import ConfigRecord

    profile = predefined_profile("gpu-server")

    # Execute
    record = ConfigRecord({**profile.to_dict()})

    # Assert
    assert DeviceProfile.from_dict(dict(record)) == profile


def test_from_dict_missing_key_raises() -> None:
    # Prepare
    data = predefined_profile("cpu-small").to_dict()
    del data["memory-bytes"]

    # Execute / Assert
    with pytest.raises(DeviceProfileError, match="memory-bytes"):
        DeviceProfile.from_dict(data)


def test_from_dict_wrong_type_raises() -> None:
    # Prepare
    data: dict[str, object] = dict(predefined_profile("cpu-small").to_dict())
    data["memory-bytes"] = "512MiB"

    # Execute / Assert
    with pytest.raises(DeviceProfileError, match="memory-bytes"):
        DeviceProfile.from_dict(data)


# --- resolve_profile ----------------------------------------------------------


def test_node_config_beats_sim_profiles() -> None:
    # Execute
    profile = resolve_profile("gpu-server", ["cpu-small", "cpu-large"], 0)

    # Assert
    assert profile.name == "gpu-server"


@pytest.mark.parametrize(
    ("partition_id", "expected"),
    [
        (0, "cpu-small"),
        (1, "cpu-large"),
        (2, "jetson-orin"),
        (3, "cpu-small"),
        (4, "cpu-large"),
    ],
)
def test_sim_profiles_round_robin(partition_id: int, expected: str) -> None:
    # Execute
    profile = resolve_profile(None, ["cpu-small", "cpu-large", "jetson-orin"], partition_id)

    # Assert
    assert profile.name == expected


def test_empty_strings_count_as_unset() -> None:
    # Execute
    profile = resolve_profile("", ["cpu-small", "cpu-large", "jetson-orin"], 4)
    probed = resolve_profile("  ", [""], None, benchmark=False)

    # Assert
    assert profile.name == "cpu-large"
    assert probed.source == "probed"


def test_unknown_sim_profile_raises_even_if_not_selected() -> None:
    # Execute / Assert
    with pytest.raises(DeviceProfileError, match="cpu-huge"):
        resolve_profile(None, ["cpu-small", "cpu-huge"], 0)


def test_unknown_node_config_profile_raises() -> None:
    # Execute / Assert
    with pytest.raises(DeviceProfileError, match="cpu-huge"):
        resolve_profile("cpu-huge", None, None)


@pytest.mark.parametrize("partition_id", [None, -1])
def test_sim_profiles_need_partition_id(partition_id: int | None) -> None:
    # Execute / Assert
    with pytest.raises(DeviceProfileError, match="partition"):
        resolve_profile(None, ["cpu-small"], partition_id)


def test_resolve_without_anything_probes() -> None:
    # Execute
    profile = resolve_profile(None, None, None, benchmark=False)

    # Assert
    assert profile.source == "probed"


# --- probing ------------------------------------------------------------------


def _expected_accelerator() -> str:
    """Accelerator probe_device should report here ("cpu" on the CI machine)."""
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def test_probe_device_without_benchmark() -> None:
    # Execute
    profile = probe_device(benchmark=False)

    # Assert
    assert profile.name == profile.source == "probed"
    assert profile.accelerator == _expected_accelerator()
    assert profile.cpu_cores >= 1
    assert profile.memory_bytes > 0
    assert profile.train_macs_per_second > 0
    assert DeviceProfile.from_dict(profile.to_dict()) == profile


def test_probe_device_honours_cgroup_fixture() -> None:
    # Execute
    profile = probe_device(cgroup_root=CGROUP / "v2-limited", benchmark=False)

    # Assert
    assert profile.cpu_cores == min(1.5, len(os.sched_getaffinity(0)))
    assert profile.memory_bytes <= 536_870_912


def test_probe_device_memory_is_min_of_meminfo_and_cgroup(tmp_path: Path) -> None:
    # Prepare
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4096 kB\nMemAvailable: 2048 kB\n")

    # Execute
    profile = probe_device(cgroup_root=CGROUP / "v1-limited", meminfo=meminfo, benchmark=False)

    # Assert
    assert profile.memory_bytes == 2048 * 1024


def test_probe_device_with_benchmark() -> None:
    # Prepare
    threads_before = torch.get_num_threads()

    # Execute
    profile = probe_device(benchmark=True)

    # Assert
    assert profile.train_macs_per_second > 0
    assert torch.get_num_threads() == threads_before


def test_measure_cpu_restores_thread_count() -> None:
    # Prepare
    threads_before = torch.get_num_threads()

    # Execute
    macs = measure_cpu_macs_per_second(1, seconds=0.05)

    # Assert
    assert macs > 0
    assert torch.get_num_threads() == threads_before


@pytest.mark.parametrize(("threads", "seconds"), [(0, 0.1), (1, 0.0), (1, -1.0)])
def test_measure_cpu_rejects_bad_arguments(threads: int, seconds: float) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="invalid"):
        measure_cpu_macs_per_second(threads, seconds)


@pytest.mark.parametrize(
    ("gpu_name", "jetson", "expected_macs"),
    [
        ("NVIDIA A100-SXM4-80GB", False, 2.0e12),
        ("NVIDIA A10", False, 3.1e12),  # not A100's figure
        ("NVIDIA H100 80GB HBM3", False, 5.0e12),
        ("NVIDIA L40S", False, 9.0e12),  # not L4's figure
        ("Tesla T4", False, 8.0e11),
        ("Orin", True, 1.0e11),
        ("Some Future GPU", False, 1.0e12),  # default
        ("Some Future Tegra", True, 1.0e11),  # Jetson default
    ],
)
def test_probe_device_cuda_path_without_gpu(
    monkeypatch: pytest.MonkeyPatch, gpu_name: str, jetson: bool, expected_macs: float
) -> None:
    # Prepare: pretend torch sees one CUDA device
    props = SimpleNamespace(name=gpu_name, total_memory=8 * GiB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(device.probe, "detect_jetson", lambda: jetson)

    # Execute
    profile = probe_device(benchmark=False)

    # Assert
    assert profile.accelerator == "cuda"
    assert profile.accelerator_name == gpu_name
    assert profile.accelerator_memory_bytes == 8 * GiB
    assert profile.is_jetson is jetson
    assert profile.train_macs_per_second == expected_macs


def test_probe_device_cuda_benchmark_failure_falls_back_to_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare
    def broken(device_name: str, seconds: float = 0.2) -> float:
        raise RuntimeError("CUDA error: out of memory")

    props = SimpleNamespace(name="Tesla T4", total_memory=16 * GiB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(device.probe, "measure_accelerator_macs_per_second", broken)

    # Execute
    profile = probe_device(benchmark=True)

    # Assert
    assert profile.train_macs_per_second == 8.0e11


def test_probe_device_mps_path_without_mac(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 12 * GiB)

    # Execute
    profile = probe_device(benchmark=False)

    # Assert
    assert profile.accelerator == "mps"
    assert profile.accelerator_memory_bytes == 12 * GiB
    assert profile.train_macs_per_second > 0


def test_measure_accelerator_rejects_cpu() -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="'cpu'"):
        device.measure_accelerator_macs_per_second("cpu")
