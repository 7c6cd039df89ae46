"""The groups of a run config about hostile nodes.

The server's merge and its bounds (:class:`AggregationConfig`), and the attack
harness (:class:`AttackConfig`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, cast

from tessera.config.choices import (
    ATTACK_PERTURBATIONS,
    ATTACKS,
    KNOWLEDGE_MERGES,
    PRE_AGGREGATIONS,
    AttackPerturbation,
    KnowledgeMerge,
    PreAggregation,
)
from tessera.config.groups import Group
from tessera.config.reader import (
    LIMITS,
    MAX_FLOAT32,
    ConfigReader,
    parse_csv,
    require,
)

__all__ = ["AggregationConfig", "AttackConfig"]


@dataclass(frozen=True)
class AggregationConfig(Group):
    """How the server merges replies, and the bounds that keep one reply from ruling.

    Attributes
    ----------
    aggregator : str
        The aggregation rule (:mod:`strategies.core.aggregators`).
    trim_fraction : float
        Share trimmed at each end by ``trimmed-mean``.
    krum_byzantine : int
        Hostile nodes Krum tolerates.
    clip_norm : float
        The L2 bound of ``clipped-mean``.
    clip_factor : float
        The bound on an update's distance, as a multiple of the cohort's median; 0 off.
    weight_cap : float
        Cap on a reply's claimed examples, as a multiple of the cohort's median; 0 off.
    weight_trim : float
        Share of the cohort whose largest claimed training-set sizes are cut to the
        next largest claim; 0 off.
    bound_growth : float
        Factor by which the clip bound may move per round.
    cohort_bound : bool
        Bound each architecture group's updates by the whole cohort's median distance
        too, relative to each model's norm (group-averaging schemes).
    bound_stretch : float
        How far a node's clip bound may grow (and shrink) with its share of the
        round's examples, as a multiple; 0 or 1 off.
    clip_ceiling : float
        Cap on the bound, as a multiple of the global model's norm; 0 off.
    server_trust : bool
        Drop updates pointing away from the server's own update.
    trust_threshold : float
        The cosine below which an update is dropped.
    knowledge_merge : KnowledgeMerge
        How per-client knowledge (features, logits, kernels) is merged.
    knowledge_clip_factor : float
        The bound on a knowledge row's norm, as a multiple of the median; 0 off.
    pre_aggregation : PreAggregation
        How the buffered aggregators mix the round's updates first.
    bucket_size : int
        Updates per bucket of ``pre-aggregation=bucketing``.
    cc_tau : float
        The clipping radius of ``centered-clip``; 0 the median distance.
    cc_iterations : int
        How many times ``centered-clip`` moves its centre.
    """

    aggregator: str
    trim_fraction: float
    krum_byzantine: int
    clip_norm: float
    clip_factor: float
    weight_cap: float
    weight_trim: float
    bound_growth: float
    cohort_bound: bool
    bound_stretch: float
    clip_ceiling: float
    server_trust: bool
    trust_threshold: float
    knowledge_merge: KnowledgeMerge
    knowledge_clip_factor: float
    pre_aggregation: PreAggregation
    bucket_size: int
    cc_tau: float
    cc_iterations: int

    @classmethod
    def read(cls, r: ConfigReader) -> AggregationConfig:
        """Read the group from ``r``."""
        return cls(
            aggregator=r.get("aggregator", str).strip().lower(),
            trim_fraction=r.get("trim-fraction", float),
            krum_byzantine=r.get("krum-byzantine", int),
            clip_norm=r.get("clip-norm", float),
            clip_factor=r.get("clip-factor", float),
            weight_cap=r.get("weight-cap", float),
            weight_trim=r.get("weight-trim", float),
            bound_growth=r.get("bound-growth", float),
            cohort_bound=r.get("cohort-bound", bool),
            bound_stretch=r.get("bound-stretch", float),
            clip_ceiling=r.get("clip-ceiling", float),
            server_trust=r.get("server-trust", bool),
            trust_threshold=r.get("trust-threshold", float),
            knowledge_merge=cast("KnowledgeMerge", r.get("knowledge-merge", str).strip().lower()),
            knowledge_clip_factor=r.get("knowledge-clip-factor", float),
            pre_aggregation=cast("PreAggregation", r.get("pre-aggregation", str).strip().lower()),
            bucket_size=r.get("bucket-size", int),
            cc_tau=r.get("cc-tau", float),
            cc_iterations=r.get("cc-iterations", int),
        )

    def validate(self) -> None:
        """Check the rules' parameters and the bounds."""
        require(
            0.0 <= self.trim_fraction < 0.5,
            "trim-fraction",
            self.trim_fraction,
            "use a fraction in [0, 0.5), e.g. 0.1",
        )
        require(
            self.krum_byzantine >= 0,
            "krum-byzantine",
            self.krum_byzantine,
            "use the number of hostile nodes to tolerate, 0 or more",
        )
        require(self.clip_norm > 0, "clip-norm", self.clip_norm, "use a positive L2 norm")
        require(
            self.clip_factor == 0 or self.clip_factor >= 1,
            "clip-factor",
            self.clip_factor,
            "use 0 (no bound) or a multiple >= 1 of the cohort's median distance, e.g. 3",
        )
        require(
            self.knowledge_merge in KNOWLEDGE_MERGES,
            "knowledge-merge",
            self.knowledge_merge,
            f"use one of {', '.join(KNOWLEDGE_MERGES)}",
        )
        require(
            self.weight_cap == 0 or self.weight_cap >= 1,
            "weight-cap",
            self.weight_cap,
            "use 0 (no cap) or a multiple >= 1 of the cohort's median claimed training-set "
            "size, e.g. 2",
        )
        require(
            0.0 <= self.weight_trim < 0.5,
            "weight-trim",
            self.weight_trim,
            "use 0 (off) or the share of the cohort, below 0.5, whose largest claimed "
            "training-set sizes are cut to the next largest claim, e.g. 0.2",
        )
        require(
            self.bound_growth > 1,
            "bound-growth",
            self.bound_growth,
            "use a factor > 1 by which the clip bound may move per round, e.g. 2",
        )
        require(
            self.bound_stretch == 0 or 1 <= self.bound_stretch <= 100,
            "bound-stretch",
            self.bound_stretch,
            "use 0 (every node the same bound) or a multiple in [1, 100] by which a node's "
            "bound may grow with its share of the round's examples, e.g. 2",
        )
        require(
            self.clip_ceiling >= 0,
            "clip-ceiling",
            self.clip_ceiling,
            "use 0 (off) or a non-negative multiple of the global model's norm, e.g. 4",
        )
        require(
            self.knowledge_clip_factor == 0 or self.knowledge_clip_factor >= 1,
            "knowledge-clip-factor",
            self.knowledge_clip_factor,
            "use 0 (no bound) or a multiple >= 1 of the cohort's median row norm, e.g. 3",
        )
        require(
            -1 <= self.trust_threshold < 1,
            "trust-threshold",
            self.trust_threshold,
            "use a cosine in [-1, 1), e.g. 0 (drop updates that point away from the "
            "server's own update); switch the check off with server-trust=false",
        )
        require(
            self.pre_aggregation in PRE_AGGREGATIONS,
            "pre-aggregation",
            self.pre_aggregation,
            f"use one of {', '.join(PRE_AGGREGATIONS)}",
        )
        require(
            self.bucket_size >= 1,
            "bucket-size",
            self.bucket_size,
            "use 1 or more updates per bucket, e.g. 2",
        )
        require(
            self.cc_tau >= 0,
            "cc-tau",
            self.cc_tau,
            "use 0 (the median distance) or a positive L2 radius",
        )
        require(
            self.cc_iterations >= 1,
            "cc-iterations",
            self.cc_iterations,
            "use 1 or more iterations, e.g. 3",
        )


@dataclass(frozen=True)
class AttackConfig(Group):
    """The attack harness: which hostile behaviours, on what share, how hard.

    Every key is ``attack-<field>`` (``kinds`` is ``attack``, ``lam`` is
    ``attack-lambda``); :mod:`client_app.attacks` says what each does.

    Attributes
    ----------
    kinds : tuple[str, ...]
        The attacks, drawn in turn by the hostile partitions; empty for none.
    fraction : float
        Share of partitions that attack.
    lam, scale, noise, z, epsilon, magnitude : float
        Each attack's intensity.
    perturbation : AttackPerturbation
        Min-max/min-sum direction.
    inflate : int
        Factor by which ``inflate`` multiplies its claimed counts.
    """

    KEY_PREFIX: ClassVar[str] = "attack-"

    kinds: tuple[str, ...] = field(metadata={"key": "attack"})
    fraction: float
    lam: float = field(metadata={"key": "attack-lambda"})
    scale: float
    noise: float
    z: float
    epsilon: float
    perturbation: AttackPerturbation
    magnitude: float
    inflate: int

    @classmethod
    def read(cls, r: ConfigReader) -> AttackConfig:
        """Read the group from ``r``."""
        return cls(
            kinds=tuple(a.lower() for a in parse_csv(r.optional_str("attack"), key="attack")),
            fraction=r.get("attack-fraction", float),
            lam=r.get("attack-lambda", float),
            scale=r.get("attack-scale", float),
            noise=r.get("attack-noise", float),
            z=r.get("attack-z", float),
            epsilon=r.get("attack-epsilon", float),
            perturbation=cast(
                "AttackPerturbation", r.get("attack-perturbation", str).strip().lower()
            ),
            magnitude=r.get("attack-magnitude", float),
            inflate=r.get("attack-inflate", int),
        )

    def validate(self) -> None:
        """Check the attack names and intensities."""
        unknown = [a for a in self.kinds if a not in ATTACKS]
        require(
            not unknown,
            "attack",
            ",".join(self.kinds),
            f"name attacks among {', '.join(ATTACKS)} (comma-separated), or leave it empty",
        )
        require(
            0.0 <= self.fraction <= 1.0,
            "attack-fraction",
            self.fraction,
            "use the share of partitions that attack, in [0, 1]",
        )
        require(
            math.isfinite(self.lam) and self.lam >= 0,
            "attack-lambda",
            self.lam,
            "use a non-negative intensity, e.g. 1.0",
        )
        require(
            math.isfinite(self.scale) and self.scale > 0,
            "attack-scale",
            self.scale,
            "use a positive factor, e.g. 10",
        )
        require(
            math.isfinite(self.noise) and self.noise >= 0,
            "attack-noise",
            self.noise,
            "use a non-negative standard deviation, e.g. 1.0",
        )
        require(
            self.z >= 0,
            "attack-z",
            self.z,
            "use 0 (ALIE's z from the paper's formula) or a positive z, e.g. 1.5",
        )
        require(
            self.epsilon > 0,
            "attack-epsilon",
            self.epsilon,
            "use a positive IPM factor, e.g. 0.5 (0.1 to 100 in the paper)",
        )
        require(
            self.perturbation in ATTACK_PERTURBATIONS,
            "attack-perturbation",
            self.perturbation,
            f"use one of {', '.join(ATTACK_PERTURBATIONS)} (min-max/min-sum direction)",
        )
        require(
            0 < self.magnitude <= MAX_FLOAT32,
            "attack-magnitude",
            self.magnitude,
            f"use a positive magnitude of at most {MAX_FLOAT32:g} (float32 weights stay "
            "finite), e.g. 1e30",
        )
        require(
            1 <= self.inflate <= LIMITS["attack-inflate"].high,
            "attack-inflate",
            self.inflate,
            LIMITS["attack-inflate"].fix,
        )
