"""FML (Shen et al. 2020, Federated Mutual Learning) as HtFLlib runs it: registration.

Every node keeps a personal model of its own architecture (the device-aware choice,
heterogeneous across nodes, kept in its state) and trains it together with a
shared *meme* model, one small architecture (run-config ``fml-meme-arch``) the same
on every node, each distilling into the other
(:mod:`strategies.fml.objective`). Only the meme's weights travel: the server sends
the global meme, the node replies with its trained meme, and the server averages
the memes of all nodes as one group through the run's aggregator
(:mod:`strategies.fml.server`). The reply's test accuracy is the personal model's;
the round's global accuracy the meme's on the server's test set.
"""

from __future__ import annotations

from strategies.core.registry import Scheme, register_scheme
from strategies.fml.client import FMLClient
from strategies.fml.options import FMLOptions
from strategies.fml.server import FMLStrategy

__all__ = ["SCHEME"]

SCHEME = register_scheme(
    Scheme(
        name="fml",
        server=FMLStrategy,
        client=FMLClient,
        parse_options=FMLOptions.parse,
        default_family="cnn",
        description=(
            "FML: personal models and one shared meme model trained by mutual "
            "distillation; only the meme is averaged"
        ),
    )
)
