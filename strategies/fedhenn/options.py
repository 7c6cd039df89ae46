"""FedHeNN's run-config options (``fedhenn-mode``, ``eta0``, CKA and RAD), parsed once."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strategies.baselines.fedavg import FedAvgOptions
from strategies.fedhenn.payload import MIN_RAD_ROWS
from tessera.config import ConfigError, ConfigReader

HOMOGENEOUS = "homogeneous"


HETEROGENEOUS = "heterogeneous"


MODES = (HOMOGENEOUS, HETEROGENEOUS)


KERNELS = ("linear", "rbf")


ESTIMATORS = ("biased", "unbiased")


SCHEDULES = ("sqrt", "linear", "constant")


KBAR_WEIGHTS = ("uniform", "data", "capacity")


PRECISIONS = ("float16", "float32")


@dataclass(frozen=True)
class FedHeNNOptions(FedAvgOptions):
    """FedHeNN's run-config options.

    ``fedavg-arch`` and ``fedavg-exclude-unfit`` choose the shared architecture of the
    homogeneous mode, as for ``fedavg``.

    Attributes
    ----------
    mode : str
        ``fedhenn-mode``: ``"heterogeneous"`` or ``"homogeneous"``.
    kernel : str
        ``cka-kernel``: ``"linear"`` (default) or ``"rbf"``.
    unbiased : bool
        ``cka-estimator="unbiased"`` (default ``"biased"``, the paper's).
    eta0 : float
        ``eta0``: the paper's tuned value for CIFAR, 0.001.
    eta_schedule : str
        ``eta-schedule``: ``"sqrt"`` (``eta0 * sqrt(t - 1)``), ``"linear"``
        (``eta0 * (t - 1)``) or ``"constant"``.
    rad_size : int
        ``rad-size``: the paper's 5000, capped at the server pool's size.
    rad_batch : int
        ``rad-batch``: RAD rows per aligned local step (0: the whole RAD).
    align_every : int
        ``align-every``: align on every k-th local step.
    kbar_weights : str
        ``kbar-weights``: ``"uniform"`` (the paper's 1/N), ``"data"`` or
        ``"capacity"`` (parameter count).
    kbar_energy : float
        ``kbar-energy``: fraction of ``||K_bar||_F^2`` kept by the factor; the CKA of
        the truncated to the exact ``K_bar`` is its square root (0.99 -> 0.995).
    precision : str
        ``fedhenn-precision``: dtype of the RAD, representations and factor on the
        wire, ``"float16"`` or ``"float32"``.
    """

    mode: str = HETEROGENEOUS
    kernel: str = "linear"
    unbiased: bool = False
    eta0: float = 0.001
    eta_schedule: str = "sqrt"
    rad_size: int = 5000
    rad_batch: int = 32
    align_every: int = 1
    kbar_weights: str = "uniform"
    kbar_energy: float = 0.99
    precision: str = "float16"

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FedHeNNOptions:
        """Read and validate the options from the run config.

        Raises
        ------
        ConfigError
            Naming the key, the value and the fix.
        """
        base = FedAvgOptions.parse(run_config)
        r = ConfigReader(run_config, "run-config")

        def choice(key: str, allowed: tuple[str, ...], default: str) -> str:
            value = r.get(key, str, default).strip().lower()
            if value not in allowed:
                raise ConfigError(
                    f"run-config '{key}' is '{value}'; use one of {', '.join(allowed)}"
                )
            return value

        def check(ok: bool, key: str, value: object, fix: str) -> None:
            if not ok:
                raise ConfigError(f"run-config '{key}' is {value!r}; {fix}")

        options = cls(
            arch=base.arch,
            exclude_unfit=base.exclude_unfit,
            mode=choice("fedhenn-mode", MODES, cls.mode),
            kernel=choice("cka-kernel", KERNELS, cls.kernel),
            unbiased=choice("cka-estimator", ESTIMATORS, "unbiased" if cls.unbiased else "biased")
            == "unbiased",
            eta0=r.get("eta0", float, cls.eta0),
            eta_schedule=choice("eta-schedule", SCHEDULES, cls.eta_schedule),
            rad_size=r.get("rad-size", int, cls.rad_size),
            rad_batch=r.get("rad-batch", int, cls.rad_batch),
            align_every=r.get("align-every", int, cls.align_every),
            kbar_weights=choice("kbar-weights", KBAR_WEIGHTS, cls.kbar_weights),
            kbar_energy=r.get("kbar-energy", float, cls.kbar_energy),
            precision=choice("fedhenn-precision", PRECISIONS, cls.precision),
        )
        check(options.eta0 >= 0, "eta0", options.eta0, "use a non-negative value, e.g. 0.001")
        check(
            options.rad_size >= MIN_RAD_ROWS,
            "rad-size",
            options.rad_size,
            f"use at least {MIN_RAD_ROWS} samples, e.g. 5000 (capped at the server pool)",
        )
        check(
            options.rad_batch == 0 or options.rad_batch >= MIN_RAD_ROWS,
            "rad-batch",
            options.rad_batch,
            f"use 0 (the whole RAD) or at least {MIN_RAD_ROWS} rows, e.g. 32",
        )
        check(options.align_every >= 1, "align-every", options.align_every, "use 1 or more")
        check(
            0.0 < options.kbar_energy <= 1.0,
            "kbar-energy",
            options.kbar_energy,
            "use a fraction in (0, 1], e.g. 0.99",
        )
        return options

    def eta(self, server_round: int) -> float:
        """Return ``eta(t) = eta0 * f(t)``, 0 in round 1 for the growing schedules."""
        steps = max(server_round - 1, 0)
        if self.eta_schedule == "sqrt":
            return self.eta0 * math.sqrt(steps)
        if self.eta_schedule == "linear":
            return self.eta0 * steps
        return self.eta0

    def describe(self) -> dict[str, Any]:
        """Return the options with their run-config names."""
        return {
            "fedhenn-mode": self.mode,
            "cka-kernel": self.kernel,
            "cka-estimator": "unbiased" if self.unbiased else "biased",
            "eta0": self.eta0,
            "eta-schedule": self.eta_schedule,
            "rad-size": self.rad_size,
            "rad-batch": self.rad_batch,
            "align-every": self.align_every,
            "kbar-weights": self.kbar_weights,
            "kbar-energy": self.kbar_energy,
            "fedhenn-precision": self.precision,
        }
