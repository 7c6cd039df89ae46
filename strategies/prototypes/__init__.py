"""The prototype family: FedProto and FedTGP, personal models that share per-class prototypes.

Importing this package registers the schemes ``fedproto`` and ``fedtgp``. Shared,
one concern a module:

- :mod:`~strategies.prototypes.options`: ``feature-dim`` and ``proto-lambda``, and the
  projected model every node trains;
- :mod:`~strategies.prototypes.payload`: the prototype record and its checks;
- :mod:`~strategies.prototypes.merge`: the robust merge (Felo's bounded,
  count-weighted merge, reused);
- :mod:`~strategies.prototypes.client`: the objective (cross-entropy plus the
  prototype term) and the reply;
- :mod:`~strategies.prototypes.server`: prototypes in, global prototypes out;
- :mod:`~strategies.prototypes.trainable`: FedTGP's prototype network, adaptive
  margin and contrastive loss.

One module per scheme: :mod:`~strategies.prototypes.fedproto` and
:mod:`~strategies.prototypes.fedtgp`.
"""

from strategies.prototypes import fedproto, fedtgp

__all__ = ["fedproto", "fedtgp"]
