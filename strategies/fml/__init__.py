"""FML, Federated Mutual Learning: personal models and one averaged meme model.

Importing this package registers ``strategy="fml"``. One concern a module:

- :mod:`~strategies.fml.options`: ``fml-meme-arch``, ``fml-alpha``, ``fml-beta``;
- :mod:`~strategies.fml.pair`: the personal model and the meme held as one module;
- :mod:`~strategies.fml.objective`: the mutual objective (cross-entropy plus KL
  towards the other model's prediction);
- :mod:`~strategies.fml.client`: the node's lifecycle (meme in, both trained, meme
  out, personal model kept);
- :mod:`~strategies.fml.server`: the global meme, averaged as one group;
- :mod:`~strategies.fml.scheme`: the registration.
"""

from strategies.fml import scheme
from strategies.fml.objective import mutual_losses
from strategies.fml.options import FMLOptions

__all__ = ["FMLOptions", "mutual_losses", "scheme"]
