"""What a hostile node does: the attack and its intensity, from the run's config.

:class:`AttackSpec` is one attack with its parameters; :func:`attack_for` reads a
node's (node-config ``attack``, else the run's seeded draw,
:func:`tessera.attacks.attack_assignment`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera import attack_math
from tessera.attacks import attack_assignment
from tessera.config import ATTACKS, ConfigError, NodeConfig, RunConfig


@dataclass(frozen=True)
class AttackSpec:
    """One hostile behaviour and its intensity.

    Attributes
    ----------
    kind : str
        One of :data:`tessera.config.ATTACKS`.
    lam : float
        ``attack-lambda`` (backdoor intensity).
    scale : float
        ``attack-scale`` (boost and sign-flip factor; bound-riding's factor when
        ``clip_factor`` is 0).
    noise : float
        ``attack-noise`` (standard deviation of the added noise).
    seed : int
        Seeds the shuffled labels, the noise and dense-scale's signs (with the round).
    z : float
        ``attack-z``: ALIE's ``z``; 0 takes it from the paper's formula.
    epsilon : float
        ``attack-epsilon``: IPM's factor.
    perturbation : str
        ``attack-perturbation``: min-max/min-sum's direction (``std``, ``sign``, ``unit``).
    magnitude : float
        ``attack-magnitude``: dense-scale's ``M``.
    inflate : int
        ``attack-inflate``: inflate's factor on the claimed sizes.
    clip_factor : float
        Run-config ``clip-factor``: bound-riding's estimate of the server's bound.
    """

    kind: str
    lam: float = 1.0
    scale: float = 10.0
    noise: float = 1.0
    seed: int = 0
    z: float = 0.0
    epsilon: float = 0.5
    perturbation: str = "std"
    magnitude: float = 1e30
    inflate: int = 1000
    clip_factor: float = 3.0

    def __post_init__(self) -> None:
        """Check the attack name and the perturbation."""
        if self.kind not in ATTACKS:
            raise ConfigError(f"attack '{self.kind}' is unknown; use one of {', '.join(ATTACKS)}")
        if self.perturbation not in attack_math.PERTURBATIONS:
            raise ConfigError(
                f"attack perturbation '{self.perturbation}' is unknown; use one of "
                f"{', '.join(attack_math.PERTURBATIONS)}"
            )

    @property
    def riding_factor(self) -> float:
        """Bound-riding's multiple of a distance taken as the bound (``clip-factor``)."""
        return self.clip_factor if self.clip_factor > 0 else self.scale


def attack_for(run: RunConfig, node: NodeConfig) -> AttackSpec | None:
    """Return this node's attack: node-config ``attack``, else the run's seeded draw."""
    kind = node.attack
    if kind is None and node.partition_id is not None and node.num_partitions is not None:
        kind = attack_assignment(run, node.num_partitions).get(node.partition_id)
    if kind is None:
        return None
    seed = run.seed + 104729 * (node.partition_id if node.partition_id is not None else 0)
    return AttackSpec(
        kind,
        lam=run.attack.lam,
        scale=run.attack.scale,
        noise=run.attack.noise,
        seed=seed,
        z=run.attack.z,
        epsilon=run.attack.epsilon,
        perturbation=run.attack.perturbation,
        magnitude=run.attack.magnitude,
        inflate=run.attack.inflate,
        clip_factor=run.aggregation.clip_factor,
    )
