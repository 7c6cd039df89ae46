"""Device profiles: what a client can afford to train.

A :class:`DeviceProfile` describes the compute and memory a client has. It
comes either from a named entry of :data:`PREDEFINED_PROFILES` (simulation,
tests, or a node that wants to pretend to be a weaker device) or from
:func:`probe_device`, which reads cgroup limits, ``/proc/meminfo``, the
Jetson markers and the PyTorch accelerator back-ends of the machine it runs
on. :func:`resolve_profile` applies the precedence used by the ClientApp.

Every file read here is defensive: a missing or unreadable file yields
``None`` (logged at debug level) so that probing never fails on an unusual
kernel, container runtime or operating system.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final, TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")

__all__ = [
    "ACCELERATORS",
    "CPU_CONV_TRAINING_EFFICIENCY",
    "DEFAULT_CPU_TRAIN_MACS_PER_CORE",
    "GPU_CONV_TRAINING_EFFICIENCY",
    "PREDEFINED_PROFILES",
    "PROFILE_SOURCES",
    "DeviceProfile",
    "DeviceProfileError",
    "detect_jetson",
    "effective_cpu_count",
    "measure_accelerator_macs_per_second",
    "measure_cpu_macs_per_second",
    "predefined_profile",
    "probe_device",
    "read_cgroup_cpu_limit",
    "read_cgroup_memory_limit",
    "read_host_memory",
    "resolve_profile",
]

KiB: Final = 1024
MiB: Final = 1024 * KiB
GiB: Final = 1024 * MiB

ACCELERATORS: Final = frozenset({"cpu", "cuda", "mps"})
PROFILE_SOURCES: Final = frozenset({"probed", "predefined"})

# Throughput unit used everywhere here: multiply-accumulates *executed* per
# second while training a small conv net, forward and backward together
# (selection counts one training sample as 3x its forward MACs).
#
# A 256x256 fp32 GEMM runs closer to peak than conv-net training does
# (im2col/packing, memory-bound batch-norm and activations, narrow channels,
# dispatcher overhead). Measured on this project's x86 build machine
# (2 cores, PyTorch 2.14 CPU, SGD with momentum, 32x32x3 input, a 6-conv
# CIFAR-style net of width 8..64): training reached 0.22-0.32 of the GEMM
# rate for 2.6 M MACs/sample, 0.4-0.7 for 10-40 M and 0.85-0.97 for 150 M.
# 0.5 is the middle; it is conservative for the large models, which are the
# ones the time budget rejects.
CPU_CONV_TRAINING_EFFICIENCY: Final = 0.5

# The same ratio on a GPU against a 2048x2048 fp32 GEMM. Small kernels and
# small batches leave most streaming multiprocessors idle and kernel-launch
# overhead dominates, so small conv nets reach roughly 10-30 % of it (not
# measured here: no GPU on the build machine; order of magnitude only).
GPU_CONV_TRAINING_EFFICIENCY: Final = 0.2

# Training throughput per CPU core assumed when the benchmark is skipped
# (``probe_device(benchmark=False)``): a Cortex-A72 core (~1.5e9, GEMM ~3e9
# x 0.5), well below a desktop x86 core (~1.5e10), so that an unmeasured
# device is assumed slow rather than fast.
DEFAULT_CPU_TRAIN_MACS_PER_CORE: Final = 2.0e9

# Training throughput (MAC/s, unit above) of CUDA devices by marketing name,
# used when the GPU benchmark is skipped. Figures are fp32 peak (vendor data
# sheets; 2 FLOP per MAC) times GPU_CONV_TRAINING_EFFICIENCY, rounded.
# Patterns are matched as whole words, longest-first, so "A10" does not match
# "A100". Order of magnitude is what matters.
_CUDA_TRAIN_MACS_BY_NAME: Final[tuple[tuple[str, float], ...]] = (
    ("H200", 6.7e12),  # 67 TFLOPS fp32 -> 33.5e12 MAC/s peak x 0.2
    ("H100", 5.0e12),  # 51-67 TFLOPS fp32 (PCIe/SXM)
    ("A100", 2.0e12),  # 19.5 TFLOPS fp32
    ("L40S", 9.0e12),  # 91.6 TFLOPS fp32
    ("L4", 3.0e12),  # 30.3 TFLOPS fp32
    ("A10", 3.1e12),  # 31.2 TFLOPS fp32
    ("V100", 1.5e12),  # 15.7 TFLOPS fp32
    ("T4", 8.0e11),  # 8.1 TFLOPS fp32
    ("RTX 4090", 8.0e12),  # 82.6 TFLOPS fp32
    ("RTX 3090", 3.5e12),  # 35.6 TFLOPS fp32
    ("Orin", 1.0e11),  # Orin Nano/NX: 1024 CUDA cores @ 0.6-0.8 GHz, ~1.3-1.6 TFLOPS
    ("Xavier", 1.0e11),  # Xavier NX/AGX: 384-512 CUDA cores, ~1.0-1.4 TFLOPS
)
_DEFAULT_CUDA_TRAIN_MACS: Final = 1.0e12
_DEFAULT_JETSON_TRAIN_MACS: Final = 1.0e11

# cgroup v1 reports "no limit" as a page-aligned LONG_MAX
# (9223372036854771712); anything above 2**60 bytes (1 EiB) is treated the
# same way.
_CGROUP_V1_UNLIMITED_THRESHOLD: Final = 2**60

_JETSON_MODEL_KEYWORDS: Final = ("jetson", "orin", "xavier", "tegra")


class DeviceProfileError(ValueError):
    """A device profile, its name or its serialised form is invalid."""


@dataclass(frozen=True)
class DeviceProfile:
    """Compute and memory a client can use for local training.

    Parameters
    ----------
    name : str
        Name of the predefined profile, or ``"probed"``.
    source : str
        ``"probed"`` or ``"predefined"``.
    cpu_cores : float
        Effective CPU cores (cgroup CPU quota honoured, may be fractional).
    memory_bytes : int
        Usable host memory in bytes (cgroup memory limit honoured).
    accelerator : str
        ``"cpu"``, ``"cuda"`` or ``"mps"``.
    accelerator_name : str or None
        Accelerator model name, ``None`` on CPU-only devices.
    accelerator_memory_bytes : int or None
        Accelerator memory in bytes, ``None`` on CPU-only devices. On a
        Jetson this is the unified (host) memory.
    is_jetson : bool
        Whether the device is an NVIDIA Jetson (unified memory).
    train_macs_per_second : float
        Multiply-accumulates executed per second while training small conv
        nets, forward and backward together. Selection counts one training
        sample as three times its forward MACs.

    Raises
    ------
    DeviceProfileError
        If a field is out of range.
    """

    name: str
    source: str
    cpu_cores: float
    memory_bytes: int
    accelerator: str
    accelerator_name: str | None
    accelerator_memory_bytes: int | None
    is_jetson: bool
    train_macs_per_second: float

    def __post_init__(self) -> None:
        """Validate field values once, at construction."""
        if not self.name:
            raise DeviceProfileError("DeviceProfile name is empty; give a name such as 'probed'")
        if self.source not in PROFILE_SOURCES:
            raise DeviceProfileError(
                f"DeviceProfile source {self.source!r} is invalid; "
                f"use one of {sorted(PROFILE_SOURCES)}"
            )
        if self.accelerator not in ACCELERATORS:
            raise DeviceProfileError(
                f"DeviceProfile accelerator {self.accelerator!r} is invalid; "
                f"use one of {sorted(ACCELERATORS)}"
            )
        if not (math.isfinite(self.cpu_cores) and self.cpu_cores > 0):
            raise DeviceProfileError(
                f"DeviceProfile cpu_cores={self.cpu_cores!r} is invalid; use a positive number"
            )
        if self.memory_bytes <= 0:
            raise DeviceProfileError(
                f"DeviceProfile memory_bytes={self.memory_bytes!r} is invalid; "
                "use a positive byte count"
            )
        if self.accelerator_memory_bytes is not None and self.accelerator_memory_bytes <= 0:
            raise DeviceProfileError(
                "DeviceProfile accelerator_memory_bytes="
                f"{self.accelerator_memory_bytes!r} is invalid; "
                "use a positive byte count or None"
            )
        if not (math.isfinite(self.train_macs_per_second) and self.train_macs_per_second > 0):
            raise DeviceProfileError(
                "DeviceProfile train_macs_per_second="
                f"{self.train_macs_per_second!r} is invalid; "
                "use a positive number"
            )

    def to_dict(self) -> dict[str, str | int | float | bool]:
        """Serialise to a flat dict safe for JSON and a Flower ``ConfigRecord``.

        Keys are kebab-case (``"cpu-cores"``). ``None`` is not allowed in a
        ``ConfigRecord``, so an absent ``accelerator_name`` is written as
        ``""`` and an absent ``accelerator_memory_bytes`` as ``0``;
        :meth:`from_dict` maps them back to ``None``. The dict is invariant in
        its value type, so pass a copy to Flower for mypy:
        ``ConfigRecord({**profile.to_dict()})``.

        Returns
        -------
        dict of str to str, int, float or bool
            The profile.
        """
        return {
            "name": self.name,
            "source": self.source,
            "cpu-cores": float(self.cpu_cores),
            "memory-bytes": int(self.memory_bytes),
            "accelerator": self.accelerator,
            "accelerator-name": self.accelerator_name or "",
            "accelerator-memory-bytes": int(self.accelerator_memory_bytes or 0),
            "is-jetson": bool(self.is_jetson),
            "train-macs-per-second": float(self.train_macs_per_second),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> DeviceProfile:
        """Build a profile from the output of :meth:`to_dict`.

        Parameters
        ----------
        data : Mapping of str to object
            Flat mapping with the keys written by :meth:`to_dict`; extra
            keys are ignored.

        Returns
        -------
        DeviceProfile
            The profile.

        Raises
        ------
        DeviceProfileError
            If a key is missing or a value has the wrong type or range.
        """
        accelerator_name = _get_typed(data, "accelerator-name", str)
        accelerator_memory = _get_int(data, "accelerator-memory-bytes")
        return cls(
            name=_get_typed(data, "name", str),
            source=_get_typed(data, "source", str),
            cpu_cores=_get_float(data, "cpu-cores"),
            memory_bytes=_get_int(data, "memory-bytes"),
            accelerator=_get_typed(data, "accelerator", str),
            accelerator_name=accelerator_name or None,
            accelerator_memory_bytes=accelerator_memory or None,
            is_jetson=_get_typed(data, "is-jetson", bool),
            train_macs_per_second=_get_float(data, "train-macs-per-second"),
        )


def _require(data: Mapping[str, object], key: str) -> object:
    if key not in data:
        raise DeviceProfileError(
            f"device profile dict lacks key {key!r} (has {sorted(data)}); "
            "serialise it with DeviceProfile.to_dict()"
        )
    return data[key]


def _get_typed(data: Mapping[str, object], key: str, kind: type[_T]) -> _T:
    value = _require(data, key)
    if not isinstance(value, kind):
        raise DeviceProfileError(
            f"device profile key {key!r} has {value!r} of type {type(value).__name__}; "
            f"expected {kind.__name__}"
        )
    return value


def _get_int(data: Mapping[str, object], key: str) -> int:
    value = _require(data, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DeviceProfileError(
            f"device profile key {key!r} has {value!r}; expected an integer byte count"
        )
    return value


def _get_float(data: Mapping[str, object], key: str) -> float:
    value = _require(data, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DeviceProfileError(f"device profile key {key!r} has {value!r}; expected a number")
    return float(value)


# Throughput figures are training MAC/s (unit above): GEMM rate x
# CPU_CONV_TRAINING_EFFICIENCY, or fp32 peak x GPU_CONV_TRAINING_EFFICIENCY,
# rounded; only the order of magnitude matters.
# - cpu-small: Raspberry Pi Zero 2 W class, 512 MiB, one usable Cortex-A53
#   core at 1 GHz (the other three left to the OS and Flower; the board
#   throttles under sustained load). In-order A53 NEON fp32 GEMM reaches
#   ~1 GMAC/s; the small models such a device runs train at ~0.2-0.3 of GEMM
#   (see CPU_CONV_TRAINING_EFFICIENCY) -> 2e8.
# - cpu-medium: Raspberry Pi 4/5 class, 4 Cortex-A72/A76 cores, 4 GiB.
#   fp32 GEMM ~3e9 (A72) to ~8e9 (A76) per core; x 0.5 x 4 cores,
#   towards the Pi 4 end -> 1e10.
# - cpu-large: 8-core x86 laptop/desktop with AVX2/FMA, 16 GiB. GEMM
#   ~2-3e10 per core (this project's AVX-512 build machine measures 3.7e10
#   per core), sub-linear scaling to 8 cores and laptop throttling
#   (~1.5e11) x 0.5 -> 8e10.
# - jetson-orin: Orin Nano/NX 8 GB, 6 Arm cores, 1024-core Ampere GPU,
#   1.3-1.6 TFLOPS fp32 (NVIDIA data sheets) = 0.64-0.8e12 MAC/s x 0.2 ->
#   1e11 (barely above cpu-large for tiny models: launch-bound). Memory is
#   unified: accelerator memory == host memory.
# - gpu-server: A100 80 GB, 32 host cores, 256 GiB host memory.
#   19.5 TFLOPS fp32 (~1e13 MAC/s, more with cuDNN's default TF32) x 0.2
#   -> 2e12.
PREDEFINED_PROFILES: Final[Mapping[str, DeviceProfile]] = MappingProxyType(
    {
        "cpu-small": DeviceProfile(
            name="cpu-small",
            source="predefined",
            cpu_cores=1.0,
            memory_bytes=512 * MiB,
            accelerator="cpu",
            accelerator_name=None,
            accelerator_memory_bytes=None,
            is_jetson=False,
            train_macs_per_second=2.0e8,
        ),
        "cpu-medium": DeviceProfile(
            name="cpu-medium",
            source="predefined",
            cpu_cores=4.0,
            memory_bytes=4 * GiB,
            accelerator="cpu",
            accelerator_name=None,
            accelerator_memory_bytes=None,
            is_jetson=False,
            train_macs_per_second=1.0e10,
        ),
        "cpu-large": DeviceProfile(
            name="cpu-large",
            source="predefined",
            cpu_cores=8.0,
            memory_bytes=16 * GiB,
            accelerator="cpu",
            accelerator_name=None,
            accelerator_memory_bytes=None,
            is_jetson=False,
            train_macs_per_second=8.0e10,
        ),
        "jetson-orin": DeviceProfile(
            name="jetson-orin",
            source="predefined",
            cpu_cores=6.0,
            memory_bytes=8 * GiB,
            accelerator="cuda",
            accelerator_name="Orin",
            accelerator_memory_bytes=8 * GiB,
            is_jetson=True,
            train_macs_per_second=1.0e11,
        ),
        "gpu-server": DeviceProfile(
            name="gpu-server",
            source="predefined",
            cpu_cores=32.0,
            memory_bytes=256 * GiB,
            accelerator="cuda",
            accelerator_name="NVIDIA A100-SXM4-80GB",
            accelerator_memory_bytes=80 * GiB,
            is_jetson=False,
            train_macs_per_second=2.0e12,
        ),
    }
)


def predefined_profile(name: str) -> DeviceProfile:
    """Return the predefined profile called ``name``.

    Parameters
    ----------
    name : str
        A key of :data:`PREDEFINED_PROFILES`.

    Returns
    -------
    DeviceProfile
        The profile.

    Raises
    ------
    DeviceProfileError
        If ``name`` is not a predefined profile.
    """
    try:
        return PREDEFINED_PROFILES[name]
    except KeyError:
        raise DeviceProfileError(
            f"unknown device profile {name!r}; use one of "
            f"{sorted(PREDEFINED_PROFILES)} or leave it empty to probe the device"
        ) from None


def _read_text(path: Path) -> str | None:
    """Read a small text file, returning ``None`` (logged) on any OS error."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        log.debug("cannot read %s: %s", path, exc)
        return None


def _parse_int(text: str, path: Path) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        log.debug("unexpected content %r in %s", text, path)
        return None


def read_cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """Read the CPU quota of the current cgroup as a number of cores.

    Looks for cgroup v2 ``cpu.max`` (``"max 100000"`` or ``"50000 100000"``)
    directly under ``root``, then for cgroup v1
    ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` under ``root/cpu``,
    ``root/cpu,cpuacct`` or ``root/cpuacct,cpu`` (quota ``-1`` means no
    limit). Assumes the container's own cgroup is mounted at ``root``, as
    Docker and Kubernetes do with a private cgroup namespace.

    Parameters
    ----------
    root : Path
        cgroup file-system mount point.

    Returns
    -------
    float or None
        Quota in cores (``quota / period``), or ``None`` if unlimited or
        unreadable.
    """
    v2 = _read_text(root / "cpu.max")
    if v2 is not None:
        parts = v2.split()
        if len(parts) not in (1, 2) or parts[0] == "max":
            return None
        quota = _parse_int(parts[0], root / "cpu.max")
        period = _parse_int(parts[1], root / "cpu.max") if len(parts) == 2 else 100_000
        if quota is None or period is None or quota <= 0 or period <= 0:
            return None
        return quota / period
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        directory = root / controller
        quota_text = _read_text(directory / "cpu.cfs_quota_us")
        if quota_text is None:
            continue
        period_text = _read_text(directory / "cpu.cfs_period_us")
        quota = _parse_int(quota_text, directory / "cpu.cfs_quota_us")
        period = (
            _parse_int(period_text, directory / "cpu.cfs_period_us")
            if period_text is not None
            else None
        )
        if quota is None or period is None or quota <= 0 or period <= 0:
            return None
        return quota / period
    return None


def read_cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Read the memory limit of the current cgroup.

    cgroup v2 ``memory.max`` (``"max"`` means none) directly under ``root``,
    else cgroup v1 ``memory/memory.limit_in_bytes`` (values above 2**60, such
    as ``9223372036854771712``, mean none).

    Parameters
    ----------
    root : Path
        cgroup file-system mount point.

    Returns
    -------
    int or None
        Limit in bytes, or ``None`` if unlimited or unreadable.
    """
    v2 = _read_text(root / "memory.max")
    if v2 is not None:
        if v2.strip() == "max":
            return None
        limit = _parse_int(v2, root / "memory.max")
        return limit if limit is not None and limit > 0 else None
    v1_path = root / "memory" / "memory.limit_in_bytes"
    v1 = _read_text(v1_path)
    if v1 is None:
        return None
    limit = _parse_int(v1, v1_path)
    if limit is None or limit <= 0 or limit >= _CGROUP_V1_UNLIMITED_THRESHOLD:
        return None
    return limit


def read_host_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Read the memory the host can give a new process.

    ``MemAvailable`` from ``/proc/meminfo`` (free plus reclaimable), else
    ``MemTotal``, else ``os.sysconf`` physical pages (macOS and others).

    Parameters
    ----------
    meminfo : Path
        Path of the ``/proc/meminfo`` file.

    Returns
    -------
    int or None
        Bytes, or ``None`` if nothing could be read.
    """
    text = _read_text(meminfo)
    if text is not None:
        fields: dict[str, int] = {}
        for line in text.splitlines():
            match = re.fullmatch(r"(\w+):\s+(\d+)\s*kB", line.strip())
            if match:
                fields[match.group(1)] = int(match.group(2)) * KiB
        for key in ("MemAvailable", "MemTotal"):
            if fields.get(key, 0) > 0:
                return fields[key]
        log.debug("no MemAvailable/MemTotal in %s", meminfo)
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError) as exc:
        log.debug("os.sysconf cannot report physical memory: %s", exc)
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def effective_cpu_count(root: Path = Path("/sys/fs/cgroup")) -> float:
    """Return the CPU cores this process may use.

    The minimum of the CPUs in the scheduler affinity mask (``os.cpu_count``
    where affinity is unsupported) and the cgroup CPU quota.

    Parameters
    ----------
    root : Path
        cgroup file-system mount point.

    Returns
    -------
    float
        Effective cores, at least ``0.01``; fractional under a fractional
        quota.
    """
    try:
        visible = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError) as exc:
        log.debug("sched_getaffinity unavailable (%s); using os.cpu_count()", exc)
        visible = float(os.cpu_count() or 1)
    quota = read_cgroup_cpu_limit(root)
    cores = visible if quota is None else min(visible, quota)
    return max(cores, 0.01)


def detect_jetson(
    tegra_release: Path = Path("/etc/nv_tegra_release"),
    dt_model: Path = Path("/proc/device-tree/model"),
) -> bool:
    """Tell whether this is an NVIDIA Jetson (Tegra SoC, unified memory).

    Parameters
    ----------
    tegra_release : Path
        L4T release file, present on JetPack installs and L4T containers.
    dt_model : Path
        Device-tree model string, e.g.
        ``"NVIDIA Jetson Orin Nano Developer Kit"``.

    Returns
    -------
    bool
        ``True`` if the release file exists or the model names a Jetson,
        Orin, Xavier or Tegra module.
    """
    if tegra_release.is_file():
        log.debug("found %s: Jetson", tegra_release)
        return True
    model = _read_text(dt_model)
    if model is None:
        return False
    model = model.replace("\x00", "").strip().lower()
    return any(keyword in model for keyword in _JETSON_MODEL_KEYWORDS)


def _check_benchmark_args(seconds: float) -> None:
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"benchmark seconds={seconds!r} is invalid; use a positive duration such as 0.2"
        )


def measure_cpu_macs_per_second(threads: int, seconds: float = 0.2) -> float:
    """Estimate training throughput of the CPU with a short matmul benchmark.

    Runs 256x256 fp32 matmuls with ``torch.set_num_threads(threads)`` for
    about ``seconds`` and at least 20 iterations (the previous thread count is
    restored afterwards), and multiplies the GEMM rate by
    :data:`CPU_CONV_TRAINING_EFFICIENCY` (0.5) to approximate what training a
    small conv net achieves. With one thread the rate is taken over the
    thread's CPU time (``time.thread_time``), so a cgroup CPU quota or other
    processes on the machine do not distort the per-core figure (inside a
    container with ``--cpus 0.5`` wall-clock timing would count the throttled
    periods); with more threads it is taken over wall-clock time.

    Parameters
    ----------
    threads : int
        Intra-op threads to use, at least 1.
    seconds : float
        Approximate benchmark duration.

    Returns
    -------
    float
        Training MAC/s, forward and backward together.

    Raises
    ------
    ValueError
        If ``threads`` < 1 or ``seconds`` is not positive.
    """
    import torch

    if threads < 1:
        raise ValueError(f"benchmark threads={threads!r} is invalid; use at least 1")
    _check_benchmark_args(seconds)
    size = 256
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            a = torch.randn(size, size)
            b = torch.randn(size, size)
            torch.mm(a, b)  # warm-up: thread pool, packing buffers
            iterations = 0
            start = time.perf_counter()
            cpu_start = time.thread_time()
            elapsed = 0.0
            while elapsed < seconds or iterations < 20:
                torch.mm(a, b)
                iterations += 1
                elapsed = time.perf_counter() - start
            cpu_elapsed = time.thread_time() - cpu_start
    finally:
        torch.set_num_threads(previous)
    timed = cpu_elapsed if threads == 1 and cpu_elapsed > 0 else elapsed
    gemm_rate = iterations * size**3 / timed
    log.debug("CPU GEMM %.3g MAC/s with %d threads", gemm_rate, threads)
    return gemm_rate * CPU_CONV_TRAINING_EFFICIENCY


def measure_accelerator_macs_per_second(device: str, seconds: float = 0.2) -> float:
    """Estimate training throughput of a CUDA or MPS device with a matmul benchmark.

    Runs 2048x2048 fp32 matmuls on ``device`` for about ``seconds``,
    synchronising before reading the clock, and multiplies the GEMM rate by
    :data:`GPU_CONV_TRAINING_EFFICIENCY` (0.2).

    Parameters
    ----------
    device : str
        ``"cuda"`` or ``"mps"``.
    seconds : float
        Approximate benchmark duration.

    Returns
    -------
    float
        Training MAC/s, forward and backward together.

    Raises
    ------
    ValueError
        If ``device`` is not ``"cuda"`` or ``"mps"`` or ``seconds`` is not positive.
    """
    import torch

    if device not in ("cuda", "mps"):
        raise ValueError(f"accelerator benchmark device {device!r} is invalid; use 'cuda' or 'mps'")
    _check_benchmark_args(seconds)

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()
        else:
            torch.mps.synchronize()

    size = 2048
    with torch.no_grad():
        a = torch.randn(size, size, device=device)
        b = torch.randn(size, size, device=device)
        torch.mm(a, b)
        synchronize()
        iterations = 0
        start = time.perf_counter()
        elapsed = 0.0
        while elapsed < seconds:
            for _ in range(4):
                torch.mm(a, b)
            synchronize()
            iterations += 4
            elapsed = time.perf_counter() - start
    gemm_rate = iterations * size**3 / elapsed
    log.debug("%s GEMM %.3g MAC/s", device, gemm_rate)
    return gemm_rate * GPU_CONV_TRAINING_EFFICIENCY


def _cuda_macs_from_name(name: str, *, is_jetson: bool) -> float:
    """Look up a CUDA device's nominal training throughput by its name."""
    for pattern, macs in sorted(_CUDA_TRAIN_MACS_BY_NAME, key=lambda item: -len(item[0])):
        word = rf"(?<![A-Za-z0-9]){re.escape(pattern)}(?![A-Za-z0-9])"
        if re.search(word, name, flags=re.IGNORECASE):
            return macs
    default = _DEFAULT_JETSON_TRAIN_MACS if is_jetson else _DEFAULT_CUDA_TRAIN_MACS
    log.debug("no throughput figure for CUDA device %r; assuming %.3g MAC/s", name, default)
    return default


def probe_device(
    *,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    benchmark: bool = True,
    meminfo: Path = Path("/proc/meminfo"),
) -> DeviceProfile:
    """Describe the machine this process runs on.

    CPU cores and host memory honour cgroup limits. The accelerator is CUDA
    (``torch.cuda``: name and total memory of device 0) if available, else
    MPS (``torch.backends.mps``), else CPU. Throughput comes from a short
    benchmark (:func:`measure_accelerator_macs_per_second`,
    :func:`measure_cpu_macs_per_second`) or, with ``benchmark=False``, from
    the name table (CUDA) or :data:`DEFAULT_CPU_TRAIN_MACS_PER_CORE` times
    the cores (CPU).

    Parameters
    ----------
    cgroup_root : Path
        cgroup file-system mount point.
    benchmark : bool
        Whether to time a short matmul benchmark (~0.2 s).
    meminfo : Path
        Path of ``/proc/meminfo``.

    Returns
    -------
    DeviceProfile
        A profile with ``name == source == "probed"``.
    """
    import torch

    cores = effective_cpu_count(cgroup_root)
    host_memory = read_host_memory(meminfo)
    cgroup_memory = read_cgroup_memory_limit(cgroup_root)
    known = [m for m in (host_memory, cgroup_memory) if m is not None]
    if not known:
        log.warning("cannot determine host memory; assuming 512 MiB")
    memory = min(known) if known else 512 * MiB
    is_jetson = detect_jetson()

    accelerator = "cpu"
    accelerator_name: str | None = None
    accelerator_memory: int | None = None
    macs: float
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        accelerator, accelerator_name = "cuda", str(props.name)
        accelerator_memory = int(props.total_memory)
        macs = _cuda_macs_from_name(accelerator_name, is_jetson=is_jetson)
        if benchmark:
            try:
                macs = measure_accelerator_macs_per_second("cuda")
            except RuntimeError as exc:  # out of memory, busy or broken device
                log.warning("CUDA benchmark failed (%s); assuming %.3g MAC/s", exc, macs)
    elif torch.backends.mps.is_available():
        accelerator, accelerator_name = "mps", "Apple MPS"
        try:
            accelerator_memory = int(torch.mps.recommended_max_memory()) or memory
        except (AttributeError, RuntimeError) as exc:
            log.debug(
                "torch.mps.recommended_max_memory unavailable (%s); using host memory",
                exc,
            )
            accelerator_memory = memory
        # Without a benchmark, assume an entry-level Apple GPU (~2.6 TFLOPS
        # fp32 = 1.3e12 MAC/s for an M1 8-core GPU) x GPU_CONV_TRAINING_EFFICIENCY.
        macs = measure_accelerator_macs_per_second("mps") if benchmark else 2.6e11
    elif benchmark:
        # One core's rate over its CPU time, times the effective cores (cgroup
        # quota honoured): robust to throttling and to a busy machine.
        macs = measure_cpu_macs_per_second(1) * cores
    else:
        macs = DEFAULT_CPU_TRAIN_MACS_PER_CORE * cores

    profile = DeviceProfile(
        name="probed",
        source="probed",
        cpu_cores=cores,
        memory_bytes=memory,
        accelerator=accelerator,
        accelerator_name=accelerator_name,
        accelerator_memory_bytes=accelerator_memory,
        is_jetson=is_jetson,
        train_macs_per_second=macs,
    )
    log.info("probed device: %s", asdict(profile))
    return profile


def resolve_profile(
    node_config_profile: str | None,
    sim_profiles: Sequence[str] | None,
    partition_id: int | None,
    *,
    benchmark: bool = True,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> DeviceProfile:
    """Pick the device profile of a client.

    Precedence: the node-config ``device-profile`` name, then the
    simulation round-robin ``sim_profiles[partition_id % len(sim_profiles)]``,
    then :func:`probe_device`. Empty or blank strings count as unset; blank
    entries of ``sim_profiles`` are dropped. Every name in ``sim_profiles`` is
    validated, so a typo fails on every client rather than on some.

    Parameters
    ----------
    node_config_profile : str or None
        Value of the node-config key ``device-profile``.
    sim_profiles : Sequence of str or None
        Profile names assigned round-robin to simulated partitions.
    partition_id : int or None
        The client's partition id; needed when ``sim_profiles`` is used.
    benchmark : bool
        Passed to :func:`probe_device`.
    cgroup_root : Path
        Passed to :func:`probe_device`.

    Returns
    -------
    DeviceProfile
        The resolved profile.

    Raises
    ------
    DeviceProfileError
        If a name is unknown, or ``sim_profiles`` is used without a
        non-negative ``partition_id``.
    """
    if node_config_profile is not None and node_config_profile.strip():
        profile = predefined_profile(node_config_profile.strip())
        log.info("device profile %r from node config", profile.name)
        return profile
    names = [n.strip() for n in (sim_profiles or ()) if n.strip()]
    if names:
        profiles = [predefined_profile(n) for n in names]
        if partition_id is None or partition_id < 0:
            raise DeviceProfileError(
                f"partition_id={partition_id!r} is invalid for simulated device "
                f"profiles {names}; "
                "set node-config 'partition-id' to a non-negative integer"
            )
        profile = profiles[partition_id % len(profiles)]
        log.info(
            "device profile %r for partition %d (round-robin)",
            profile.name,
            partition_id,
        )
        return profile
    return probe_device(cgroup_root=cgroup_root, benchmark=benchmark)
