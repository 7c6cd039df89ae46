"""Device profiles: the typed description of a device, and the table of predefined ones."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, TypeVar

KiB: Final = 1024


MiB: Final = 1024 * KiB


GiB: Final = 1024 * MiB


ACCELERATORS: Final = frozenset({"cpu", "cuda", "mps"})


PROFILE_SOURCES: Final = frozenset({"probed", "predefined"})


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


def _predefined(
    name: str,
    cores: float,
    memory: int,
    macs: float,
    *,
    cuda: str | None = None,
    cuda_memory: int | None = None,
    jetson: bool = False,
) -> DeviceProfile:
    """One row of :data:`PREDEFINED_PROFILES` (a CPU device unless ``cuda`` names a GPU)."""
    return DeviceProfile(
        name=name,
        source="predefined",
        cpu_cores=cores,
        memory_bytes=memory,
        accelerator="cpu" if cuda is None else "cuda",
        accelerator_name=cuda,
        accelerator_memory_bytes=cuda_memory,
        is_jetson=jetson,
        train_macs_per_second=macs,
    )


# Throughput figures are training MAC/s (the unit of client_app.device.cost): GEMM rate x
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
        profile.name: profile
        for profile in (
            _predefined("cpu-small", 1.0, 512 * MiB, 2.0e8),
            _predefined("cpu-medium", 4.0, 4 * GiB, 1.0e10),
            _predefined("cpu-large", 8.0, 16 * GiB, 8.0e10),
            _predefined(
                "jetson-orin", 6.0, 8 * GiB, 1.0e11, cuda="Orin", cuda_memory=8 * GiB, jetson=True
            ),
            _predefined(
                "gpu-server",
                32.0,
                256 * GiB,
                2.0e12,
                cuda="NVIDIA A100-SXM4-80GB",
                cuda_memory=80 * GiB,
            ),
        )
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


_T = TypeVar("_T")
