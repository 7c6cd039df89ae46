"""The sub-model schemes' options and the slices they allow.

Run-config ``submodel-*`` (:class:`SubModelOptions`): the global model
(``submodel-global``, default the smallest sectioned model of the family), the
widths a node may train (``submodel-widths``, HeteroFL's ``1, 1/2, 1/4, 1/8``),
masking of absent classes and HeteroFL's scaler. :func:`candidate_specs` lists the
slices a scheme allows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from models.spec import SubModelSpec
from tessera.config import ConfigError, ConfigReader, RunConfig

__all__ = [
    "COVERAGE_AGGREGATORS",
    "DEFAULT_WIDTHS",
    "SubModelOptions",
    "candidate_specs",
    "check_aggregator",
    "depth_levels",
    "resolve_global",
    "validate_submodel",
]


SubModelOptionsT = TypeVar("SubModelOptionsT", bound="SubModelOptions")
"""The options type of one sub-model scheme (a :class:`SubModelOptions`)."""

COVERAGE_AGGREGATORS = ("mean", "norm-clip")
"""Aggregators that fold partial (sliced) updates by coverage; the buffered robust
rules (median, trimmed mean, Krum) compare whole updates and refuse slices."""

DEFAULT_WIDTHS = (1.0, 0.5, 0.25, 0.125)
"""HeteroFL's width levels a-d (``submodel-widths``)."""


def _parse_widths(text: str) -> tuple[float, ...]:
    try:
        widths = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        widths = []
    if not widths or any(not 0 < w <= 1 for w in widths) or len(set(widths)) != len(widths):
        raise ConfigError(
            f"run-config 'submodel-widths' is {text!r}; give distinct width ratios in "
            f"(0, 1] separated by commas, e.g. '1,0.5,0.25,0.125'"
        )
    return tuple(sorted(widths, reverse=True))


@dataclass(frozen=True)
class SubModelOptions:
    """Options every sub-model scheme reads (run-config ``submodel-*``).

    Attributes
    ----------
    global_model : str or None
        Registered sectioned model to slice (``submodel-global``); None: the
        family's smallest sectioned model.
    widths : tuple[float, ...]
        Width ratios a node may train (``submodel-widths``), largest first.
    mask_classes : bool
        Mask the logits of classes absent from a node's training data in its loss
        (``submodel-mask-classes``, default true; HeteroFL's masked cross-entropy).
    scaler : bool
        Divide every convolution's output by the width ratio in training
        (``submodel-scaler``, default true; HeteroFL's scaler).
    width_flexible, depth_flexible : bool
        Whether a node may cut its slice in width, in depth: the scheme's own, not
        run-config keys (each scheme's options class sets its defaults).
    """

    global_model: str | None = None
    widths: tuple[float, ...] = DEFAULT_WIDTHS
    mask_classes: bool = True
    scaler: bool = True
    width_flexible: bool = True
    depth_flexible: bool = True

    @classmethod
    def read(cls, run_config: Mapping[str, Any]) -> dict[str, Any]:
        """Return the common options as keyword arguments (for subclasses' ``parse``)."""
        r = ConfigReader(run_config, "run-config")
        global_model = r.optional_str("submodel-global")
        if global_model is not None:
            from models.slicing import global_config

            try:
                global_config(global_model)
            except ValueError as err:
                raise ConfigError(f"run-config 'submodel-global': {err}") from None
        return {
            "global_model": global_model,
            "widths": _parse_widths(
                r.get("submodel-widths", str, ",".join(f"{w:g}" for w in cls.widths))
            ),
            "mask_classes": r.get("submodel-mask-classes", bool, cls.mask_classes),
            "scaler": r.get("submodel-scaler", bool, cls.scaler),
        }

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> SubModelOptions:
        """Read the options from the run config."""
        return cls(**cls.read(run_config))

    def model_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments of :func:`models.get_model` for every slice (none).

        Client and server build their models with these, so both build the same
        architecture (NeFL adds ``block_step``).
        """
        return {}


def resolve_global(name: str | None, family: str) -> str:
    """Return the global model: ``name``, or the smallest sectioned model of ``family``.

    Raises
    ------
    ConfigError
        If ``family`` has no sectioned model (nothing to slice).
    """
    from models import list_models, model_entry
    from models.slicing import SectionedConfig

    if name:
        return name
    for model in list_models(family):
        if isinstance(model_entry(model).config, SectionedConfig):
            return model
    raise ConfigError(
        f"model family '{family}' has no model with sections to slice; set run-config "
        f"'model-family' to 'preresnet' or 'mobilenetv2' (or leave it empty), or name "
        f"one with 'submodel-global'"
    )


def depth_levels(depths: Sequence[int], min_depth: int) -> list[tuple[int, ...]]:
    """Return the depth slices of a global model, deepest first.

    Level ``k`` keeps ``min(D_s, k)`` blocks of section ``s`` (at least
    ``min(min_depth, D_s)``), for ``k`` from the deepest section down to
    ``min_depth``; repeated levels are listed once.

    Examples
    --------
    >>> depth_levels((1, 2, 3, 4, 3, 3, 1), 2)
    [(1, 2, 3, 4, 3, 3, 1), (1, 2, 3, 3, 3, 3, 1), (1, 2, 2, 2, 2, 2, 1)]
    """
    levels: list[tuple[int, ...]] = []
    for k in range(max(depths), min_depth - 1, -1):
        level = tuple(max(min(d, k), min(min_depth, d)) for d in depths)
        if level not in levels:
            levels.append(level)
    return levels or [tuple(depths)]


def candidate_specs(
    full: SubModelSpec, min_depth: int, widths: Sequence[float], *, width: bool, depth: bool
) -> list[SubModelSpec]:
    """Return the slices a scheme allows: widths x depth levels, largest first.

    Parameters
    ----------
    full : SubModelSpec
        The global model's spec (width 1, every block).
    min_depth : int
        Fewest blocks a section keeps (:attr:`models.spec.Layout.min_depth`).
    widths : Sequence[float]
        Width ratios (used when ``width``).
    width, depth : bool
        Whether the scheme slices in width and in depth.
    """
    ws = sorted(set(widths) | {1.0}, reverse=True) if width else [1.0]
    ds = depth_levels(full.depths, min_depth) if depth else [full.depths]
    return [SubModelSpec(w, d) for w in ws for d in ds]


def check_aggregator(scheme: str, aggregator: str, allowed: tuple[str, ...]) -> None:
    """Refuse an aggregator a sub-model scheme cannot use, naming those it can.

    Raises
    ------
    ConfigError
        If ``aggregator`` is not in ``allowed``.
    """
    if aggregator not in allowed:
        raise ConfigError(
            f"run-config 'aggregator' is '{aggregator}', which '{scheme}' cannot use: it "
            f"needs one that averages partial updates by coverage; use one of "
            f"{', '.join(allowed)}"
        )


def validate_submodel(run: RunConfig, options: SubModelOptions) -> None:
    """Refuse an aggregator the sub-model schemes cannot use (their ``validate`` hook)."""
    check_aggregator(run.scheme.strategy, run.aggregation.aggregator, COVERAGE_AGGREGATORS)
