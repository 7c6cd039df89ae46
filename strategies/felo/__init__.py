"""Felo, Velo and the FedHe baseline: per-class features and logits across architectures.

Importing this package registers the schemes ``felo``, ``velo`` and ``fedhe``:

- :mod:`strategies.felo.knowledge`: per-class means on the client, count-weighted
  merging on the server, the payload schema and its validation (pure maths);
- :mod:`strategies.felo.cvae`: Velo's conditional VAE and its training;
- :mod:`strategies.felo.scheme`: options, the client objective (the paper's equation
  (1)) and the three server strategies.
"""

from strategies.felo.scheme import (
    FedHeStrategy,
    FeloClient,
    FeloOptions,
    FeloStrategy,
    VeloStrategy,
)

__all__ = ["FedHeStrategy", "FeloClient", "FeloOptions", "FeloStrategy", "VeloStrategy"]
