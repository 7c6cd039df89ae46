"""Felo, Velo and the FedHe baseline: per-class features and logits across architectures.

Importing this package registers the schemes ``felo``, ``velo`` and ``fedhe``:

- :mod:`strategies.felo.knowledge`: per-class means on the client, count-weighted
  merging on the server, the payload schema and its validation (pure maths);
- :mod:`strategies.felo.cvae`: Velo's conditional VAE and its training;
- :mod:`~strategies.felo.options`, :mod:`~strategies.felo.loss` (the paper's equation
  (1)), :mod:`~strategies.felo.client`, :mod:`~strategies.felo.server` (Felo, FedHe),
  :mod:`~strategies.felo.velo` (Velo's server), and :mod:`~strategies.felo.scheme`,
  which registers the three schemes.
"""

from strategies.felo import scheme
from strategies.felo.client import FeloClient
from strategies.felo.options import FeloOptions
from strategies.felo.server import FedHeStrategy, FeloStrategy
from strategies.felo.velo import VeloStrategy

__all__ = [
    "FedHeStrategy",
    "FeloClient",
    "FeloOptions",
    "FeloStrategy",
    "VeloStrategy",
    "scheme",
]
