"""The placement section: which GPUs each role gets.

Two ways to say it, as :mod:`.spec` takes them: per-role counts with colocation switches (OpenRLHF's launcher:
``<role>_num_nodes x <role>_num_gpus_per_node``; the training loop turns them into :class:`~.counts.CountedRole`
for its recipe's roles, see ``hybrid_algos.train.placement``), or RLinf-style GPU ranges per role (``ranges``,
which replace the counts). The engines' counts (how many, how wide) are the engine section's and come as arguments
where they are needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class PlacementSettings:
    """``actor``/``critic``/``ref``/``reward``: each role's nodes and GPUs per node (0 GPUs: the role runs nowhere).
    ``colocate_all``: every role on the actor's GPUs, the engines filling them; ``colocate_actor_ref``: the
    reference on the actor's; ``colocate_critic_reward``: the reward model on the critic's. ``ranges``: role -> GPU
    range (``{"actor": "0-7", "rollout": "4-7"}``), instead of the counts. ``gpus_per_node``: the cluster's node
    size (None: what the multi-node roles imply, or what Ray reports)."""

    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1
    critic_num_nodes: int = 1
    critic_num_gpus_per_node: int = 1
    ref_num_nodes: int = 1
    ref_num_gpus_per_node: int = 1
    reward_num_nodes: int = 1
    reward_num_gpus_per_node: int = 1
    colocate_all: bool = True
    colocate_actor_ref: bool = False
    colocate_critic_reward: bool = False
    ranges: Mapping[str, str] | None = None
    gpus_per_node: int | None = None

    def validate(self) -> PlacementSettings:
        """What can be checked before the recipe says which roles run (the layout's own checks come with the plan:
        :meth:`~.spec.PlacementSpec.plan`)."""
        for name in ("actor_num_nodes", "actor_num_gpus_per_node"):  # every recipe trains an actor
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"placement.{name}",
                    f"must be a positive integer, got {value!r}.",
                    f"Give placement.{name} a whole number >= 1.",
                )
        for name in ("colocate_all", "colocate_actor_ref", "colocate_critic_reward"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # a config file's "yes" would read as true
                raise ConfigError(
                    f"placement.{name}",
                    f"expected true or false, got {value!r}.",
                    f"Set placement.{name} to True or False.",
                )
        return self

    def count(self, prefix: str) -> tuple[int, int]:
        """(nodes, GPUs per node) of the counts named ``<prefix>_num_nodes`` / ``<prefix>_num_gpus_per_node``."""
        return getattr(self, f"{prefix}_num_nodes"), getattr(self, f"{prefix}_num_gpus_per_node")

    def world_size(self, prefix: str) -> int:
        """GPUs of the role counted by ``prefix`` (nodes x GPUs per node)."""
        nodes, per_node = self.count(prefix)
        return nodes * per_node
