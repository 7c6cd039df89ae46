"""Local training only: the floor every heterogeneous scheme must beat.

With run-config ``local-like`` naming another scheme, each client trains alone on
exactly the architectures that scheme would give it (its family, its candidate
architectures such as sub-model slices, its model construction), so a scheme whose
family is not the default ``cnn`` is compared with a floor of its own architectures.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models.base import TesseraModel
from models.spec import ModelRef
from strategies.core.client import ClientAlgorithm
from strategies.core.registry import Scheme, SchemeError, get_scheme, register_scheme
from strategies.core.strategy import HeteroStrategy
from tessera.config import ConfigError, ConfigReader, RunConfig

NAME = "local"
DEFAULT_FAMILY = "cnn"


@dataclass(frozen=True)
class LocalOptions:
    """Run-config ``local-like``: the scheme whose architectures the clients train alone.

    Attributes
    ----------
    like : str or None
        A registered scheme other than ``local``; None (``local-like = ""``): the
        ``cnn`` family, as any scheme without a family of its own.
    like_options : Any
        That scheme's own options, parsed from the same run-config (they decide
        e.g. which sub-model slices a device may pick).
    """

    like: str | None = None
    like_options: Any = None

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> LocalOptions:
        """Read ``local-like`` (and the named scheme's options) from the run-config."""
        like = ConfigReader(run_config, "run-config").get("local-like", str, "").strip()
        if not like:
            return cls()
        if like == NAME:
            raise ConfigError(
                "run-config 'local-like' is 'local'; name another scheme (e.g. 'fedfa') "
                "or leave it empty"
            )
        try:
            scheme = get_scheme(like)
        except SchemeError as err:
            raise ConfigError(f"run-config 'local-like': {err}") from None
        return cls(like=like, like_options=scheme.parse_options(run_config))

    def family(self) -> str:
        """Return the architecture family when run-config ``model-family`` is empty."""
        if self.like is None:
            return DEFAULT_FAMILY
        return get_scheme(self.like).family(self.like_options)


class LocalStrategy(HeteroStrategy[LocalOptions]):
    """Sends only the round's config; nothing is aggregated."""

    @functools.cached_property
    def like_refs(self) -> dict[str, ModelRef]:
        """The ``local-like`` scheme's candidates by printed name (empty without one)."""
        options = self.options
        if options.like is None:
            return {}
        client = get_scheme(options.like).client(run=self.env.run, options=options.like_options)
        return {ref.name: ref for ref in client.candidate_archs(self.env.family)}

    def known_archs(self) -> list[str]:
        """Return the ``local-like`` scheme's candidates (its slices), else every model."""
        if self.options.like is None:
            return super().known_archs()
        return list(self.like_refs)

    def model_ref(self, arch: str) -> ModelRef:
        """Return the ``local-like`` scheme's slice named ``arch``, else the default."""
        ref = self.like_refs.get(arch)
        return ref if ref is not None else super().model_ref(arch)


class LocalClient(ClientAlgorithm[LocalOptions]):
    """Keeps its own model across rounds and never shares it."""

    def __init__(self, *, run: RunConfig, options: LocalOptions) -> None:
        super().__init__(run=run, options=options)
        self.keeps_personal_model = True
        self.sends_weights = False
        like = options.like
        self.like: ClientAlgorithm[Any] | None = (
            None if like is None else get_scheme(like).client(run=run, options=options.like_options)
        )

    def candidate_archs(self, family: str) -> list[ModelRef]:
        """Return the ``local-like`` scheme's candidates (e.g. its slices), else the family's."""
        if self.like is None:
            return super().candidate_archs(family)
        return self.like.candidate_archs(family)

    def build_model(
        self, ref: ModelRef, *, input_shape: tuple[int, ...], num_classes: int
    ) -> TesseraModel:
        """Build ``ref`` as the ``local-like`` scheme does, else as the zoo does."""
        if self.like is None:
            return super().build_model(ref, input_shape=input_shape, num_classes=num_classes)
        return self.like.build_model(ref, input_shape=input_shape, num_classes=num_classes)


SCHEME = register_scheme(
    Scheme(
        name=NAME,
        server=LocalStrategy,
        client=LocalClient,
        parse_options=LocalOptions.parse,
        default_family=DEFAULT_FAMILY,
        description="each client trains alone on its own architecture (no communication)",
        family_of=LocalOptions.family,
    )
)
