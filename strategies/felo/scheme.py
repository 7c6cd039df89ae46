"""Felo, Velo and FedHe: heterogeneous models that share per-class features and logits.

Paper: "Felo and Velo: data-free heterogeneous federated learning with mid-level
features and logits" (sections 3 and 4). One room for three related schemes:

``felo``
    Each client trains, then sends the per-class means of its features (in the common
    feature space, see :mod:`models.projection`) and logits with the class counts.
    The server averages them per class, weighted by counts, and sends the averages
    back as the next round's targets. With ``felo-share-weights=true`` (the default,
    as in the paper) the weights are also averaged within each architecture group
    (exactly ``fedavg-groups``); with ``false`` only knowledge crosses the network
    and every client keeps its personal model in its state.
``velo``
    Felo whose server keeps a dataset of every per-class feature vector it received,
    trains a conditional VAE (:mod:`strategies.felo.cvae`) on it every
    ``cvae-interval`` rounds, and sends the decoder's synthetic per-class features
    (the mean of ``cvae-samples`` decoded samples) instead of plain averages; logits
    are averaged as in Felo. Training time and loss go to the round metrics
    (``cvae_seconds``, ``cvae_loss``).
``fedhe``
    The FedHe baseline (Chan and Ngai, 2021): logits only, no features, no weights,
    plain zoo models (no projection); personal models persist on the clients.

Local objective, the paper's equation (1), per minibatch of ``N`` samples::

    L = 1/N sum_i [ CE(z_i, y_i) + alpha * m_i * ( MSE(f_i, F[y_i]) + KL_T(Z[y_i] || z_i) ) ]

with ``f_i``/``z_i`` the sample's features/logits, ``F[c]``/``Z[c]`` the server's
targets of class ``c``, ``m_i = 1`` when the server has knowledge of ``y_i`` and 0
otherwise (no target term; round 1 is plain cross-entropy), ``MSE`` the mean over the
feature entries and ``KL_T(a || b) = T^2 * KL(softmax(a/T) || softmax(b/T))``, the
distillation KL of Hinton et al. with the server's logits as the teacher. FedHe drops
the MSE term.
"""

from __future__ import annotations

from strategies.core.registry import Scheme, register_scheme
from strategies.felo.client import FeloClient
from strategies.felo.options import FeloOptions
from strategies.felo.server import FedHeStrategy, FeloStrategy
from strategies.felo.velo import VeloStrategy

FELO = register_scheme(
    Scheme(
        name="felo",
        server=FeloStrategy,
        client=FeloClient,
        parse_options=FeloOptions.parse,
        default_family="cnn",
        description="Felo: per-class features and logits, FedAvg within architecture groups",
        personalise=True,
    )
)


VELO = register_scheme(
    Scheme(
        name="velo",
        server=VeloStrategy,
        client=FeloClient,
        parse_options=FeloOptions.parse,
        default_family="cnn",
        description="Velo: Felo with CVAE-generated per-class features on the server",
        personalise=True,
    )
)


FEDHE = register_scheme(
    Scheme(
        name="fedhe",
        server=FedHeStrategy,
        client=FeloClient,
        parse_options=FeloOptions.parse_fedhe,
        default_family="cnn",
        description="FedHe: per-class logits only, personal models, no weights shared",
    )
)
