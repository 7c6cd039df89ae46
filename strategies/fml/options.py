"""FML's options: the meme model's architecture and the two mutual-learning weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.config import ConfigError, ConfigReader

__all__ = ["FMLOptions"]


@dataclass(frozen=True)
class FMLOptions:
    """Options of ``fml`` (run-config ``fml-meme-arch``, ``fml-alpha``, ``fml-beta``).

    Attributes
    ----------
    meme_arch : str
        The registered model every node trains as its meme, the one model that
        travels (``fml-meme-arch``; default ``cnn-2``, the second smallest of the
        scheme's ``cnn`` family: ``cnn-1``'s 346 parameters stay near chance on
        digits). Any registered model will do: every one builds for every
        input kind, images, signals and flat vectors (:mod:`models.inputs`).
    alpha : float
        Weight of the personal model's cross-entropy; ``1 - alpha`` weighs its KL
        towards the meme's prediction (``fml-alpha``, in [0, 1]; the paper's and
        HtFLlib's scripts' 0.5).
    beta : float
        Weight of the meme's cross-entropy; ``1 - beta`` weighs its KL towards the
        personal model's prediction (``fml-beta``, in [0, 1]; 0.5 likewise).
    """

    meme_arch: str = "cnn-2"
    alpha: float = 0.5
    beta: float = 0.5

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FMLOptions:
        """Read and check the three keys.

        Raises
        ------
        ConfigError
            If ``fml-meme-arch`` names no registered model, or a weight is outside
            [0, 1]; the message names the key and the fix.
        """
        from models import list_models

        reader = ConfigReader(run_config, "run-config")
        meme = reader.get("fml-meme-arch", str, cls.meme_arch).strip()
        known = list_models()
        if meme not in known:
            raise ConfigError(
                f"run-config 'fml-meme-arch' is '{meme}', which is not a registered model; "
                f"use one of {', '.join(known)}, e.g. cnn-2 (a small CNN)"
            )
        weights = {}
        for key, default in (("fml-alpha", cls.alpha), ("fml-beta", cls.beta)):
            value = reader.get(key, float, default)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(
                    f"run-config '{key}' is {value!r}; use a weight in [0, 1], e.g. 0.5 "
                    "(1 is cross-entropy alone, 0 the KL term alone)"
                )
            weights[key] = value
        return cls(meme_arch=meme, alpha=weights["fml-alpha"], beta=weights["fml-beta"])
