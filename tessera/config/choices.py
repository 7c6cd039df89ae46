"""The closed sets of values some run-config keys take, as ``Literal`` types."""

from __future__ import annotations

from typing import Literal, get_args

Partitioner = Literal["iid", "dirichlet", "pathological"]
PARTITIONERS: tuple[Partitioner, ...] = get_args(Partitioner)
FlatInput = Literal["signal", "square"]
FLAT_INPUTS: tuple[FlatInput, ...] = ("signal", "square")
"""How convolutional models read flat ``(D,)`` samples (run-config ``flat-input``):
as a one-channel signal of length ``D`` (1-d convolutions) or zero-padded and reshaped
into a square one-channel image (2-d convolutions)."""
KnowledgeMerge = Literal["mean", "median", "trimmed-mean"]
KNOWLEDGE_MERGES: tuple[KnowledgeMerge, ...] = get_args(KnowledgeMerge)
"""How per-client knowledge (class features/logits, kernels) is merged: run-config
``knowledge-merge``."""
ATTACKS = (
    "label-flip",
    "backdoor",
    "boost",
    "sign-flip",
    "noise",
    "free-rider",
    "alie",
    "ipm",
    "min-max",
    "min-sum",
    "mimic",
    "dense-scale",
    "bound-riding",
    "ratchet",
    "inflate",
    "inflate-boost",
)
"""Hostile behaviours of the attack harness (run-config/node-config ``attack``)."""
OMNISCIENT_ATTACKS = ("alie", "ipm", "min-max", "min-sum", "mimic")
"""Attacks that forge their update from the honest updates of the round (as in the
papers): only the in-process grid can show them those (:mod:`client_app.attacks`),
so a real simulation or deployment refuses them. ``bound-riding`` is omniscient in
the in-process grid and uses its own update elsewhere."""
Personalise = Literal["none", "finetune", "ditto", "rep"]
PERSONALISE_MODES: tuple[Personalise, ...] = get_args(Personalise)
"""How a node of a weight-sharing scheme personalises (run-config ``personalise``):
not at all, fine-tuning a copy, Ditto's proximal personal model, FedRep's personal
head."""
AttackPerturbation = Literal["std", "sign", "unit"]
ATTACK_PERTURBATIONS: tuple[AttackPerturbation, ...] = get_args(AttackPerturbation)
"""Min-max/min-sum perturbation directions (run-config ``attack-perturbation``)."""
PreAggregation = Literal["none", "nnm", "bucketing"]
PRE_AGGREGATIONS: tuple[PreAggregation, ...] = get_args(PreAggregation)
"""How the aggregators that keep the round's updates mix them before their rule
(run-config ``pre-aggregation``): not at all, nearest-neighbour mixing, bucketing."""
SimEngine = Literal["direct", "indexed", "flower"]
SIM_ENGINES: tuple[SimEngine, ...] = get_args(SimEngine)
"""How a simulation hands the server's messages to Flower's engine (run-config
``sim-engine``, :mod:`tessera.sim_engine`): each one to the engine's queue as it is
stored, from a store indexed by node; from the indexed store at the engine's next
sweep (every 0.1 s); or Flower's own store and sweep, untouched."""
NORMS = ("batch", "static-batch", "group", "none")
"""The normalisation layers a model can be built with (run-config ``norm``; the
factories are :mod:`models.norm`'s, which a test holds to this list)."""
SIM_DEVICE_PROFILES = ("cpu-small", "cpu-medium", "cpu-large", "jetson-orin", "gpu-server")
"""The device profiles a simulated node can emulate (run-config
``sim-device-profiles``; the profiles are :mod:`client_app.device`'s, which a test holds
to this list)."""
