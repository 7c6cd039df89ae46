"""The attack harness: hostile clients built from the project's own client lifecycle.

An :class:`AttackClient` wraps any scheme's :class:`~strategies.core.client.ClientAlgorithm`
(it is a :class:`~strategies.core.client.ClientWrapper`), so every scheme can be evaluated
against the same attacks, and its replies are built exactly as an honest node's are
(the same records, the same Flower encoding). With ``w0`` the weights the node
started the round from, ``w`` those it trained honestly and ``u = w - w0`` its
update (learned parameters only; batch-norm statistics are sent as trained, as a
careful attacker would, since a negative running variance is rejected at
validation):

- ``label-flip``: trains on labels ``y -> C - 1 - y`` (its knowledge, for knowledge
  schemes, is computed on the flipped labels too);
- ``backdoor``: FedFA's label shuffling with intensity ``lambda`` (run-config
  ``attack-lambda``): it also trains a copy of ``w0`` on randomly shuffled labels,
  giving ``w_s``, and sends ``w + lambda (w_s - w0)``;
- ``boost``: sends ``w0 + s u`` with ``s`` = ``attack-scale``, and scales every
  other floating payload (features, logits, representations, prototypes) by ``s``;
- ``sign-flip``: sends ``w0 - s u`` and negates (and scales) the payloads;
- ``noise``: adds Gaussian noise of standard deviation ``attack-noise`` to the
  weights and payloads;
- ``free-rider``: sends back the weights it received (``w0``) and the payload of the
  untrained model: it takes the federation's model and contributes nothing;
- ``dense-scale``: every learned coordinate ``w0 +- M`` (``attack-magnitude``, random
  signs seeded per node and round), and every floating payload value ``+-M``;
- ``bound-riding``: ``w0 - 0.99 B u / |u|`` with ``B`` = ``clip-factor`` x ``|u|``
  (its own distance stands in for the cohort's median; ``attack-scale`` when
  ``clip-factor`` is 0), payloads likewise; in the in-process grid it is omniscient
  (below);
- ``ratchet``: ``w0 + r u`` with ``r = 1e3`` in odd rounds and ``1e-9`` in even
  ones (payloads likewise), to move a cohort-relative bound up and down;
- ``inflate``: a self-consistent lie about its size: the handshake's ``num-train``
  and every label count multiplied by ``attack-inflate`` (so they still sum to
  ``num-train``), and its replies' ``num-examples`` equal to that ``num-train`` x
  ``local-epochs``; it trains honestly;
- ``inflate-boost``: both at once: ``inflate``'s lie about its size and ``boost``'s
  update. Against the bounded ``mean`` it is the attacker a size-dependent bound
  (``bound-stretch``) and the weight cap (``weight-cap``) meet at their limits: it
  weighs the most any node may and its bound is stretched the most.

**Omniscient attacks** (``alie``, ``ipm``, ``min-max``, ``min-sum``, ``mimic``, and
``bound-riding`` in the in-process grid) forge their update from the honest updates
of the round, as in their papers (the maths: :mod:`tessera.attack_math`). Only the
in-process grid (:class:`tessera.local_grid.LocalGrid`) can show a node those:
:func:`install_omniscient` gives it an :class:`OmniscientAttack` hook per hostile
node, which the grid calls with the node's own honest reply and the other replies
of the batch. The hook turns each reply into a flat float64 update (learned
parameters of the ``arrays`` record, by :func:`strategies.core.aggregators.entry_kind`,
minus the same entries of the weights the node was sent, or minus zero where the
server sent none), counts as honest the nodes the run's draw does not make hostile
whose entries have the same names and shapes as the attacker's (its architecture or
slice), forges the update and builds the reply as the handler builds it (same
records and metrics, ``Message(content, reply_to=instruction)``). Every other floating
payload record (Felo's per-class features and logits, FedProto's and FedTGP's
per-class prototypes, FedHeNN's representations) is forged with the same maths over
the honest nodes' record of the same name when its floating arrays have the same
shapes and its ``class-ids`` (if any) are equal, with zero as reference; otherwise the
payload is left as the node computed it, as the harness leaves it for the attacks
that change weights only. A real simulation or deployment cannot run the
omniscient-only attacks: the ServerApp refuses them
(:func:`tessera.attacks.require_client_side`), and their :class:`AttackClient` alone
sends honest replies.

The honest parts of the reply (example counts, metrics) are left as they are but
for ``inflate`` and ``inflate-boost``: the validation of claimed sizes is tested separately
(``tests/test_untrusted.py``). Which nodes attack: :mod:`tessera.attacks`.

The modules, one concern each: :mod:`client_app.attacks.spec` (:class:`AttackSpec`,
:func:`attack_for`), :mod:`client_app.attacks.vectors` (replies as flat updates),
:mod:`client_app.attacks.client` (:class:`AttackClient`, :func:`with_attack`) and
:mod:`client_app.attacks.omniscient` (:class:`OmniscientAttack`,
:func:`install_omniscient`).
"""

from client_app.attacks.client import (
    PAYLOAD_ATTACKS,
    WEIGHT_ATTACKS,
    AttackClient,
    flip_labels,
    with_attack,
)
from client_app.attacks.omniscient import (
    FORGED_IN_GRID,
    ROW_KEYS,
    OmniscientAttack,
    install_omniscient,
)
from client_app.attacks.spec import AttackSpec, attack_for
from client_app.attacks.vectors import (
    flatten,
    unflatten,
    weight_keys,
    weight_start,
    weight_update,
)

__all__ = [
    "FORGED_IN_GRID",
    "PAYLOAD_ATTACKS",
    "ROW_KEYS",
    "WEIGHT_ATTACKS",
    "AttackClient",
    "AttackSpec",
    "OmniscientAttack",
    "attack_for",
    "flatten",
    "flip_labels",
    "install_omniscient",
    "unflatten",
    "weight_keys",
    "weight_start",
    "weight_update",
    "with_attack",
]
