"""OpenRLHF-style placement flags -> the fields of a :class:`~hybrid_core.placement.PlacementSpec`.

The rules follow OpenRLHF's launcher:

* each role gets ``<role>_num_nodes x <role>_num_gpus_per_node`` GPUs; 0 means the role is absent (no critic for
  GRPO/REINFORCE, no reference without a KL term); the rollout gets ``vllm_num_engines x vllm_tensor_parallel_size``;
* ``colocate_all_models``: every role sits on the actor's GPUs (a role with fewer GPUs than the actor takes the
  first ones), and the engines must fill the actor's GPUs exactly: actor GPUs == engines x TP (the seeds' rule);
* ``colocate_actor_ref``: the reference sits on the actor's GPUs; ``colocate_critic_reward``: the reward model sits
  on the critic's GPUs;
* every role not colocated gets its own block of GPUs, in the order actor, rollout, critic, reference, reward;
* ``engines_on_actor`` (hybrid's meaning of OpenRLHF's ``--vllm_num_engines 0``, "generate with the actor"): the
  engines sit on the actor's GPUs, one per GPU, without colocating anything else;
* nodes: without ``gpus_per_node``, a role placed on several nodes (``<role>_num_nodes`` > 1) says how large a node
  is (its GPUs per node), as OpenRLHF assumes; tensor-parallel engines then stay within a node.

OpenRLHF's ``vllm_enable_sleep`` / ``deepspeed_enable_sleep`` say what roles keep on their GPUs, not where they run:
they are read by the residency planner (:mod:`hybrid_core.residency`), not here.
"""

from __future__ import annotations

from typing import Any

from ..errors import PlacementError
from .checks import cluster_size, require_int

#: The keyword arguments of :func:`spec_fields_from_counts` that mirror OpenRLHF flags (handy to copy from an argparse
#: namespace: ``{k: getattr(args, k) for k in COUNT_FIELDS}``).
COUNT_FIELDS = (
    "actor_num_nodes",
    "actor_num_gpus_per_node",
    "critic_num_nodes",
    "critic_num_gpus_per_node",
    "ref_num_nodes",
    "ref_num_gpus_per_node",
    "reward_num_nodes",
    "reward_num_gpus_per_node",
    "vllm_num_engines",
    "vllm_tensor_parallel_size",
    "colocate_all_models",
    "colocate_actor_ref",
    "colocate_critic_reward",
)

# role -> (nodes flag, GPUs-per-node flag)
_COUNT_FLAGS = {
    "actor": ("actor_num_nodes", "actor_num_gpus_per_node"),
    "critic": ("critic_num_nodes", "critic_num_gpus_per_node"),
    "reference": ("ref_num_nodes", "ref_num_gpus_per_node"),
    "reward": ("reward_num_nodes", "reward_num_gpus_per_node"),
}
_TRAINERS = ("actor", "critic")


def spec_fields_from_counts(
    *,
    actor_num_nodes: int = 1,
    actor_num_gpus_per_node: int = 1,
    critic_num_nodes: int = 1,
    critic_num_gpus_per_node: int = 0,
    ref_num_nodes: int = 1,
    ref_num_gpus_per_node: int = 0,
    reward_num_nodes: int = 1,
    reward_num_gpus_per_node: int = 0,
    vllm_num_engines: int = 0,
    vllm_tensor_parallel_size: int = 1,
    colocate_all_models: bool = False,
    colocate_actor_ref: bool = False,
    colocate_critic_reward: bool = False,
    gpus_per_node: int | None = None,
    cluster_gpus: int | None = None,
    num_nodes: int | None = None,
    engines_on_actor: bool = False,
) -> dict[str, Any]:
    """Translate OpenRLHF placement flags into a spec's fields (roles: actor, rollout, critic, reference, reward):
    ``PlacementSpec.from_counts(**flags)`` is ``PlacementSpec(**spec_fields_from_counts(**flags))``. (Fields, not the
    spec: this module sits below :mod:`.spec`, which builds the spec from them.)

    ``gpus_per_node`` is the cluster's GPUs per node (a role's GPUs-per-node may not exceed it; engines may not
    straddle nodes); the cluster size is ``cluster_gpus`` or ``num_nodes x gpus_per_node`` (unchecked when
    neither is given: :func:`~hybrid_core.placement.place` then checks it against Ray).
    """
    if gpus_per_node is None and num_nodes is None:
        gpus_per_node = _node_size_from_roles(
            (actor_num_nodes, actor_num_gpus_per_node),
            (critic_num_nodes, critic_num_gpus_per_node),
            (ref_num_nodes, ref_num_gpus_per_node),
            (reward_num_nodes, reward_num_gpus_per_node),
        )
    cluster_gpus = cluster_size(cluster_gpus, gpus_per_node, num_nodes)  # checks gpus_per_node before it is used
    sizes = {
        "actor": _role_size("actor", actor_num_nodes, actor_num_gpus_per_node, gpus_per_node),
        "critic": _role_size("critic", critic_num_nodes, critic_num_gpus_per_node, gpus_per_node),
        "reference": _role_size("reference", ref_num_nodes, ref_num_gpus_per_node, gpus_per_node),
        "reward": _role_size("reward", reward_num_nodes, reward_num_gpus_per_node, gpus_per_node),
    }
    require_int(vllm_num_engines, "vllm_num_engines", minimum=0)
    tp = require_int(vllm_tensor_parallel_size, "vllm_tensor_parallel_size", minimum=1)
    if gpus_per_node is not None and tp > gpus_per_node:
        raise PlacementError(
            "vllm_tensor_parallel_size",
            f"an engine of {tp} GPUs does not fit on a node of "
            f"{gpus_per_node} GPUs (tensor parallelism stays within a node).",
            f"Use --vllm_tensor_parallel_size <= {gpus_per_node}.",
        )
    sizes["rollout"] = vllm_num_engines * tp
    for flag, value in (
        ("colocate_all_models", colocate_all_models),
        ("colocate_actor_ref", colocate_actor_ref),
        ("colocate_critic_reward", colocate_critic_reward),
        ("engines_on_actor", engines_on_actor),
    ):
        if not isinstance(value, bool):
            raise PlacementError(flag, f"expected true or false, got {value!r}.", f"Set {flag} to True or False.")
    if sizes["actor"] == 0:
        raise PlacementError(
            "actor_num_gpus_per_node",
            "the actor has no GPUs (actor_num_nodes x "
            f"actor_num_gpus_per_node = {actor_num_nodes} x {actor_num_gpus_per_node}).",
            "Give the actor at least one GPU, e.g. --actor_num_gpus_per_node 1.",
        )

    gpus = _lay_out(
        sizes,
        tp,
        vllm_num_engines,
        colocate_all_models or engines_on_actor,
        colocate_actor_ref,
        colocate_critic_reward,
        engines_only=engines_on_actor and not colocate_all_models,
    )
    gpu_fields = {role: _COUNT_FLAGS[role][1] for role in _COUNT_FLAGS}
    gpu_fields["rollout"] = "vllm_num_engines"
    return dict(
        gpus=gpus,
        tp={"rollout": tp} if "rollout" in gpus else {},
        cluster_gpus=cluster_gpus,
        gpus_per_node=gpus_per_node,
        gpu_fields=gpu_fields,
        tp_fields={"rollout": "vllm_tensor_parallel_size"},
    )


def _role_size(role: str, nodes: int, per_node: int, gpus_per_node: int | None) -> int:
    nodes_flag, per_node_flag = _COUNT_FLAGS[role]
    require_int(nodes, nodes_flag, minimum=0)
    require_int(per_node, per_node_flag, minimum=0)
    if gpus_per_node is not None and per_node > gpus_per_node:
        raise PlacementError(
            per_node_flag,
            f"{per_node} GPUs per node, but the cluster's nodes have {gpus_per_node}.",
            f"Use more nodes ({nodes_flag}) with at most {gpus_per_node} GPUs each.",
        )
    return nodes * per_node


def _node_size_from_roles(*roles: tuple[int, int]) -> int | None:
    """GPUs per node as the multi-node roles imply it (the largest of their GPUs per node), else None."""
    sizes = [
        per_node
        for nodes, per_node in roles
        if isinstance(nodes, int) and isinstance(per_node, int) and nodes > 1 and per_node > 0
    ]
    return max(sizes) if sizes else None


def _lay_out(
    sizes: dict[str, int],
    tp: int,
    engines: int,
    colocate_all: bool,
    colocate_actor_ref: bool,
    colocate_critic_reward: bool,
    engines_only: bool = False,
) -> dict[str, tuple[int, ...]]:
    """Role -> GPUs: colocated roles reuse a host role's GPUs, the others get the next free block.
    ``engines_only``: only the engines go on the actor's GPUs (the other roles as without colocation)."""
    if engines_only:
        laid = _lay_out(sizes, tp, engines, False, colocate_actor_ref, colocate_critic_reward)
        if sizes["rollout"] != sizes["actor"]:
            raise PlacementError(
                "vllm_num_engines",
                f"engines on the actor's GPUs must be one per actor GPU ({sizes['actor']}), got {engines} x {tp}.",
                f"Use {sizes['actor']} engines of 1 GPU.",
            )
        rollout = laid.pop("rollout")  # its own block: give it back and shift the roles after it down
        shifted = {r: tuple(g - len(rollout) if g > rollout[-1] else g for g in gs) for r, gs in laid.items()}
        return {
            "actor": shifted["actor"],
            "rollout": shifted["actor"],
            **{r: g for r, g in shifted.items() if r != "actor"},
        }
    gpus: dict[str, tuple[int, ...]] = {}
    next_free = 0

    def new_block(size: int) -> tuple[int, ...]:
        nonlocal next_free
        block = tuple(range(next_free, next_free + size))
        next_free += size
        return block

    def on_host(role: str, host: str, flag: str) -> tuple[int, ...]:
        nodes_flag, per_node_flag = _COUNT_FLAGS[role]
        if sizes[role] > sizes[host]:
            raise PlacementError(
                per_node_flag,
                f"--{flag} puts the {role} on the {host}'s GPUs, but the {role} asks "
                f"for {sizes[role]} GPUs and the {host} has {sizes[host]}.",
                f"Give the {role} at most {sizes[host]} GPUs ({nodes_flag} x {per_node_flag}), or drop --{flag}.",
            )
        return gpus[host][: sizes[role]]

    gpus["actor"] = new_block(sizes["actor"])
    if sizes["rollout"]:
        if colocate_all:
            if sizes["rollout"] != sizes["actor"]:
                raise PlacementError(
                    "vllm_num_engines", _engines_problem(sizes["actor"], engines, tp), _engines_fix(sizes["actor"], tp)
                )
            gpus["rollout"] = gpus["actor"]
        else:
            gpus["rollout"] = new_block(sizes["rollout"])
    if sizes["critic"]:
        if colocate_all:
            gpus["critic"] = on_host("critic", "actor", "colocate_all_models")
        else:
            gpus["critic"] = new_block(sizes["critic"])
    if sizes["reference"]:
        if colocate_all or colocate_actor_ref:
            gpus["reference"] = on_host(
                "reference", "actor", "colocate_all_models" if colocate_all else "colocate_actor_ref"
            )
        else:
            gpus["reference"] = new_block(sizes["reference"])
    elif colocate_actor_ref and not colocate_all:
        raise PlacementError(
            "colocate_actor_ref",
            "there is no reference model to colocate (ref_num_nodes x ref_num_gpus_per_node = 0).",
            "Drop --colocate_actor_ref, or give the reference GPUs.",
        )
    if sizes["reward"]:
        if colocate_all:
            gpus["reward"] = on_host("reward", "actor", "colocate_all_models")
        elif colocate_critic_reward:
            if "critic" not in gpus:
                raise PlacementError(
                    "colocate_critic_reward",
                    "there is no critic to colocate the reward model with "
                    "(critic_num_nodes x critic_num_gpus_per_node = 0).",
                    "Drop --colocate_critic_reward, or give the critic GPUs.",
                )
            gpus["reward"] = on_host("reward", "critic", "colocate_critic_reward")
        else:
            gpus["reward"] = new_block(sizes["reward"])
    elif colocate_critic_reward and not colocate_all:
        raise PlacementError(
            "colocate_critic_reward",
            "there is no reward model to colocate (reward_num_nodes x reward_num_gpus_per_node = 0).",
            "Drop --colocate_critic_reward, or give the reward model GPUs.",
        )
    return gpus


def _engines_problem(actor_gpus: int, engines: int, tp: int) -> str:
    return (
        f"--colocate_all_models puts the engines on the actor's GPUs, so actor_num_nodes x "
        f"actor_num_gpus_per_node (= {actor_gpus}) must equal vllm_num_engines x vllm_tensor_parallel_size "
        f"(= {engines} x {tp} = {engines * tp})."
    )


def _engines_fix(actor_gpus: int, tp: int) -> str:
    if actor_gpus % tp == 0:
        return (
            f"Use --vllm_num_engines {actor_gpus // tp} with --vllm_tensor_parallel_size {tp}, or change the "
            f"actor's GPUs to vllm_num_engines x vllm_tensor_parallel_size."
        )
    return (
        f"{actor_gpus} actor GPUs cannot hold engines of {tp} GPUs: pick a --vllm_tensor_parallel_size that "
        f"divides {actor_gpus}, or change the actor's GPUs to vllm_num_engines x vllm_tensor_parallel_size."
    )
