"""FedHeNN (Makhija et al., ICML 2022): align client representations through CKA.

Every client minimises ``task loss + eta(t) * (1 - CKA(K_i, K_target))`` where ``K_i``
is the kernel of its own representation (``forward_features``) of a Representation
Alignment Dataset (RAD) the server draws each round from its own pool
(``ServerEnv.server_pool.x``; labels are never read, client data never used).

One scheme, ``strategy="fedhenn"``, two variants (run-config ``fedhenn-mode``):

``homogeneous``
    All clients train one architecture (chosen as for ``fedavg``: the weakest
    device's, or ``fedavg-arch``); the server averages weights (FedAvg). The target
    is the kernel of the previous global model on this round's RAD: the client has
    the global weights, so it computes those representations itself (one no-grad,
    eval-mode pass over the RAD) and no kernel is ever sent.
``heterogeneous``
    Every client trains its own architecture (the device-aware choice) and keeps it
    in its state across rounds; no weights travel. Each round a client returns its
    representation of a fresh *probe* RAD; the server averages the clients' kernels
    into ``K_bar`` (uniform weights as in the paper, or by data size or model
    capacity) and sends it next round as a low-rank float16 factor together with
    that RAD (see :mod:`strategies.fedhenn.kbar`).

``eta(t) = eta0 * f(t)`` grows with the round as the paper prescribes; ``f`` is
``sqrt(t - 1)`` by default (the authors' script: ``eta0 * sqrt(iter)``, ``iter``
counted from 0), or ``t - 1``, or constant 1. With ``eta(t) = 0`` nothing of the
alignment happens (no RAD is sent, no extra forward pass, no random draw), so
homogeneous FedHeNN with ``eta0 = 0`` is FedAvg and heterogeneous is ``local``.

Local cost: instead of the whole RAD per minibatch (the authors' script), each
aligned step uses a random subset of ``rad-batch`` RAD rows (the target kernel's
rows for that subset are exact), every ``align-every`` steps, in eval mode (the
target kernels were computed in eval mode, and batch-norm statistics stay those of
the local data). Its forward and backward time is measured and reported per round
(``alignment_seconds``, ``alignment_share``).

Payload schema (records beside the foundation's ``config``/``arrays``/``metrics``):

- down ``fedhenn.align`` (ArrayRecord): ``x`` the RAD rows to align on; in
  heterogeneous mode also ``target``, the ``n x r`` factor of ``K_bar``. A node that
  returned its representation of that RAD when it was the probe keeps the RAD in its
  node state, so ``x`` is left out for it and config ``fedhenn-rad-round`` names the
  round whose probe to use (the RAD crosses the network once, not twice);
- down ``fedhenn.probe`` (ArrayRecord, heterogeneous): ``x`` the RAD to represent;
- down config ``fedhenn-eta`` (this round's eta) and ``fedhenn-mode``;
- up ``fedhenn.rep`` (ArrayRecord, heterogeneous, when probed): ``rep``, the
  ``n x feature_dim`` representation of the probe;
- up ``fedhenn.stats`` (MetricRecord): alignment timing and the mean CKA.
"""

from __future__ import annotations

from strategies.core.registry import Scheme, register_scheme
from strategies.fedhenn.client import FedHeNNClient
from strategies.fedhenn.options import FedHeNNOptions
from strategies.fedhenn.server import (
    FedHeNNHeterogeneousStrategy,
    FedHeNNHomogeneousStrategy,
    fedhenn_server,
)

SCHEME = register_scheme(
    Scheme(
        name="fedhenn",
        server=fedhenn_server,
        server_classes=(FedHeNNHomogeneousStrategy, FedHeNNHeterogeneousStrategy),
        client=FedHeNNClient,
        parse_options=FedHeNNOptions.parse,
        default_family="cnn",
        description=(
            "FedHeNN: CKA alignment of representations on a server-drawn RAD "
            "(fedhenn-mode heterogeneous: personal models; homogeneous: FedAvg)"
        ),
    )
)
