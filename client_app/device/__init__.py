"""Device profiles: what a client can afford to train.

A :class:`DeviceProfile` describes the compute and memory a client has. It
comes either from a named entry of :data:`PREDEFINED_PROFILES` (simulation,
tests, or a node that wants to pretend to be a weaker device) or from
:func:`probe_device`, which reads cgroup limits, ``/proc/meminfo``, the
Jetson markers and the PyTorch accelerator back-ends of the machine it runs
on. :func:`resolve_profile` applies the precedence used by the ClientApp.

One module per concern: :mod:`~client_app.device.profiles` (the type and the
table), :mod:`~client_app.device.probe` (cgroup, memory, Jetson, accelerator),
:mod:`~client_app.device.cost` (MAC/s measured or assumed); this package's
``__init__`` holds the selection policy and names the public API.

Every file read here is defensive: a missing or unreadable file yields
``None`` (logged at debug level) so that probing never fails on an unusual
kernel, container runtime or operating system.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from client_app.device.cost import (
    CPU_CONV_TRAINING_EFFICIENCY,
    DEFAULT_CPU_TRAIN_MACS_PER_CORE,
    GPU_CONV_TRAINING_EFFICIENCY,
    measure_accelerator_macs_per_second,
    measure_cpu_macs_per_second,
)
from client_app.device.probe import (
    detect_jetson,
    effective_cpu_count,
    probe_device,
    read_cgroup_cpu_limit,
    read_cgroup_memory_limit,
    read_host_memory,
)
from client_app.device.profiles import (
    ACCELERATORS,
    PREDEFINED_PROFILES,
    PROFILE_SOURCES,
    DeviceProfile,
    DeviceProfileError,
    predefined_profile,
)

log = logging.getLogger(__name__)


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
