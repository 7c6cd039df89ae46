"""The prototype and head family: personal models that share prototypes or one head.

Importing this package registers the schemes ``fedproto``, ``fedtgp``, ``fedgh`` and
``lg-fedavg``. Shared, one concern a module:

- :mod:`~strategies.prototypes.options`: ``feature-dim`` (and ``proto-lambda``), and
  the projected model every node trains;
- :mod:`~strategies.prototypes.payload`: the prototype record and its checks;
- :mod:`~strategies.prototypes.head`: the global head's arrays and their checks;
- :mod:`~strategies.prototypes.merge`: the robust merge (Felo's bounded,
  count-weighted merge, reused);
- :mod:`~strategies.prototypes.client`: the personal projected model, the
  prototype objective (cross-entropy plus the prototype term) and the global head
  put in;
- :mod:`~strategies.prototypes.server`: prototypes in, global prototypes or a
  global head out;
- :mod:`~strategies.prototypes.trainable`: FedTGP's prototype network, adaptive
  margin and contrastive loss, and the server's SGD loop.

One module per scheme: :mod:`~strategies.prototypes.fedproto`,
:mod:`~strategies.prototypes.fedtgp`, :mod:`~strategies.prototypes.fedgh` and
:mod:`~strategies.prototypes.lgfedavg`.
"""

from strategies.prototypes import fedgh, fedproto, fedtgp, lgfedavg

__all__ = ["fedgh", "fedproto", "fedtgp", "lgfedavg"]
