"""Probing the device a node runs on.

cgroup CPU and memory limits, host memory, Jetson detection, the accelerator.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import Final

from client_app.device.cost import (
    DEFAULT_CPU_TRAIN_MACS_PER_CORE,
    _cuda_macs_from_name,
    measure_accelerator_macs_per_second,
    measure_cpu_macs_per_second,
)
from client_app.device.profiles import DeviceProfile, KiB, MiB

log = logging.getLogger("client_app.device")

# cgroup v1 reports "no limit" as a page-aligned LONG_MAX
# (9223372036854771712); anything above 2**60 bytes (1 EiB) is treated the
# same way.
_CGROUP_V1_UNLIMITED_THRESHOLD: Final = 2**60


_JETSON_MODEL_KEYWORDS: Final = ("jetson", "orin", "xavier", "tegra")


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
