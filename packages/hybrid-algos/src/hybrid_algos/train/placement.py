"""The training config's placement: OpenRLHF counts (or RLinf-style ranges) -> a validated hybrid-core plan.

Roles the algorithm does not use get no GPUs: no critic unless the estimator is GAE, no reference without a KL
term (``init_kl_coef`` 0, with or without ``use_kl_loss``), no reward model with a rule-based reward. The CLI's
``--dry-run`` prints exactly this plan. ``vllm_num_engines`` 0 puts one engine on each actor GPU (OpenRLHF: generate
with the actor); ``ref_reward_offload`` lets the reference and reward models sleep between their turns.
"""

from __future__ import annotations

from hybrid_core.placement import PlacementPlan, PlacementSpec, parse_gpu_range

from .config import RLConfig


def build_plan(cfg: RLConfig) -> PlacementPlan:
    if cfg.placement is not None:
        roles = {role: rng for role, rng in cfg.placement.items() if _role_used(cfg, role)}
        sleep = set()
        if cfg.vllm_enable_sleep:
            sleep.add("rollout")
        if cfg.deepspeed_enable_sleep:
            sleep |= {"actor", "critic"}
        if getattr(cfg, "ref_reward_offload", False):
            sleep |= {"reference", "reward"}
        # Only a role that shares a GPU has anyone to make room for.
        gpus = {role: set(parse_gpu_range(rng, f"placement.{role}")) for role, rng in roles.items()}
        shared = {r for r in roles if any(gpus[r] & gpus[o] for o in roles if o != r)}
        return PlacementSpec.from_ranges(roles, tp={"rollout": cfg.vllm_tensor_parallel_size},
                                         sleep=sleep & shared, gpus_per_node=cfg.gpus_per_node).plan()
    return PlacementSpec.from_counts(
        actor_num_nodes=cfg.actor_num_nodes, actor_num_gpus_per_node=cfg.actor_num_gpus_per_node,
        critic_num_nodes=cfg.critic_num_nodes, critic_num_gpus_per_node=cfg.critic_num_gpus_per_node if cfg.uses_critic else 0,
        ref_num_nodes=cfg.ref_num_nodes, ref_num_gpus_per_node=cfg.ref_num_gpus_per_node if cfg.uses_reference else 0,
        reward_num_nodes=cfg.reward_num_nodes,
        reward_num_gpus_per_node=cfg.reward_num_gpus_per_node if cfg.reward_pretrain else 0,
        vllm_num_engines=cfg.vllm_num_engines or cfg.actor_world_size,
        vllm_tensor_parallel_size=cfg.vllm_tensor_parallel_size if cfg.vllm_num_engines else 1,
        colocate_all_models=cfg.colocate_all_models, colocate_actor_ref=cfg.colocate_actor_ref,
        colocate_critic_reward=cfg.colocate_critic_reward, vllm_enable_sleep=cfg.vllm_enable_sleep,
        deepspeed_enable_sleep=cfg.deepspeed_enable_sleep, gpus_per_node=cfg.gpus_per_node,
        engines_on_actor=cfg.vllm_num_engines == 0, frozen_sleep=getattr(cfg, "ref_reward_offload", False),
    ).plan()


def _role_used(cfg: RLConfig, role: str) -> bool:
    if role == "critic":
        return cfg.uses_critic
    if role == "reference":
        return cfg.uses_reference
    if role == "reward":
        return cfg.reward_pretrain is not None
    return True
