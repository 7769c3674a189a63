"""``--dry-run``: everything a run checks before it starts, and what it would put on each GPU -- without Ray or a GPU.

Prints the placement plan (GPU x roles, who sleeps), the prompt set (records read, dropped), and the GPU-memory
budget per phase (:mod:`hybrid_cli.memory`) for every group of GPUs holding the same roles. A plan that does not fit
fails with the GPU, the phase and the numbers (exit status 2).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from hybrid_core.errors import ConfigError, PlacementError

from . import memory
from .memory import GiB

DEFAULT_GPU_GIB = 80.0
_COLUMNS = (("weights", ("weights",)), ("grads", ("gradients",)), ("optimizer", ("optimizer",)),
            ("activations", ("activations", "logits", "zero3_gather")), ("KV cache", ("kv_cache",)),
            ("other", ("context", "sync_bucket")))


def dry_run(config: Any, *, gpu_memory_gb: float | None = None, notes: Sequence[str] = (),
            console: Console | None = None) -> int:
    """Validate ``config`` (already ``validate()``-d) all the way, print plan and budget; 0 when it fits."""
    console = console or Console(width=None if _is_terminal() else 132)
    for note in notes:
        console.print(f"note: {note}")
    from hybrid_algos.train.model_files import check_model_folder

    for name in ("pretrain", "reward_pretrain", "critic_pretrain"):  # a damaged folder is named, not a traceback
        if getattr(config, name) is not None:
            check_model_folder(name, getattr(config, name), trust_remote_code=config.trust_remote_code)
    plan = build_plan(config)
    console.print(f"[bold]{config.algorithm}[/bold]: {plan.num_gpus} GPU(s), backend {config.backend}, "
                  f"advantage estimator {config.advantage_estimator}")
    console.print(plan.render())
    console.print(f"weight sync: {choose_mode(config, plan)} (actor -> engines after each update)")
    console.print(describe_prompts(config))
    console.print(describe_reward(config))
    if config.use_wandb and importlib.util.find_spec("wandb") is None:
        console.print("warning: --use_wandb, but wandb is not installed here; the run will stop before it starts "
                      "unless it is (pip install wandb).")
    gpu_bytes = (gpu_memory_gb if gpu_memory_gb is not None else detect_gpu_gib()) * GiB
    if gpu_bytes <= 0:
        raise PlacementError("gpu_memory_gb", f"must be > 0, got {gpu_memory_gb}.")
    budget = memory_budget(config, plan, gpu_bytes)
    for table in budget_tables(budget):
        console.print(table)
    budget.check()
    worst = budget.worst()
    console.print(f"fits: the fullest GPU is GPU {worst.gpu} in phase {worst.phase}: "
                  f"{worst.total / GiB:.1f} of {gpu_bytes / GiB:.1f} GiB. Dry run only: no Ray started, no GPU taken.")
    return 0


def build_plan(config: Any):
    """The placement plan the run would use (the training loop's own function, so the two cannot disagree)."""
    from hybrid_algos.train.placement import build_plan as plan_for_config

    return plan_for_config(config)


def choose_mode(config: Any, plan: Any) -> str:
    """The weight-sync path the run would take (the training loop's choice; an impossible one raises here)."""
    from hybrid_algos.train.weight_sync import choose_mode as mode_for_plan

    return mode_for_plan(config, plan)


def detect_gpu_gib() -> float:
    """The first local GPU's memory in GiB, or DEFAULT_GPU_GIB without one."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GiB
    except Exception:  # no driver, broken install: the default is a budget, not a measurement
        pass
    return DEFAULT_GPU_GIB


# ---- models and prompts ------------------------------------------------------------------------------------------
def hf_config(path: str | None, config: Any):
    """The transformers config of a model folder (config.json only, no weights), or the tiny demo model's."""
    if path is None:
        from hybrid_algos.train.tiny import tiny_model_config

        return tiny_model_config(**config.tiny_model)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code)


def role_models(config: Any, roles: Sequence[str]) -> dict[str, memory.ModelShape]:
    """The model shape of each role in the plan (policy models with an LM head, critic/reward with a value head)."""
    policy = memory.model_shape(hf_config(config.pretrain, config))
    out = {}
    for role in roles:
        canonical = memory.canonical_role(role)
        if canonical == "reward":
            out[role] = memory.model_shape(hf_config(config.reward_pretrain, config), value_head=True)
        elif canonical == "critic":
            source = config.critic_pretrain or config.reward_pretrain or config.pretrain
            out[role] = memory.model_shape(hf_config(source, config), value_head=True)
        else:
            out[role] = policy
    return out


def describe_prompts(config: Any) -> str:
    """Load and encode the prompts exactly as the run would, and say how many there are."""
    from hybrid_algos.train.data import load_prompt_set

    prompts, stats = load_prompt_set(config, _tokenizer(config))
    if len(prompts) < config.rollout_batch_size:
        raise ConfigError("rollout_batch_size", f"{stats.describe()}: fewer than one rollout batch "
                          f"(rollout_batch_size = {config.rollout_batch_size}).",
                          "Lower --rollout_batch_size or give more prompts.")
    return f"prompts: {stats.describe()}"


def describe_reward(config: Any) -> str:
    """Where rewards come from; a run with its own prompts needs a reward model or a reward function."""
    if config.reward_fn is not None:
        from hybrid_algos.train.rewards import load_reward_fn

        load_reward_fn(config.reward_fn)  # imports the user's module now: a typo fails here, not after Ray starts
        return f"reward: function {config.reward_fn}"
    if config.reward_pretrain is not None:
        return f"reward: model {config.reward_pretrain}"
    if config.prompt_data is not None:
        raise ConfigError("reward_pretrain", "no reward: a --prompt_data run needs --reward_pretrain or --reward_fn.",
                          "Add --reward_fn my_module:my_reward (rule-based) or --reward_pretrain DIR.")
    return f"reward: the built-in task {config.task!r}'s rule"


def _is_terminal() -> bool:
    return Console().is_terminal


def _tokenizer(config: Any):
    if config.pretrain is None:
        from hybrid_algos.train.tiny import build_tiny_tokenizer

        return build_tiny_tokenizer(int(config.tiny_model.get("num_symbols", 8)))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.pretrain, trust_remote_code=config.trust_remote_code)


# ---- the budget --------------------------------------------------------------------------------------------------
def memory_budget(config: Any, plan: Any, gpu_bytes: float) -> memory.MemoryBudget:
    roles = []
    for name, role in plan.roles.items():
        gpus = tuple(g for w in role.workers for g in w.gpus)
        roles.append(memory.RolePlacement(name, ranks=len(role.workers), tp=role.tp, sleeps=role.sleeps, gpus=gpus))
    return memory.estimate(config, roles, role_models(config, list(plan.roles)), gpu_bytes)


def budget_tables(budget: memory.MemoryBudget) -> list[Table]:
    """One table per group of GPUs with the same roles: a row per phase, GiB per kind of memory."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for gpu, roles in budget.roles_on_gpu.items():
        groups.setdefault(roles, []).append(gpu)
    tables = []
    for roles, gpus in groups.items():
        table = Table(title=f"GPU memory per phase, GiB: GPU {_span(gpus)} ({', '.join(roles)}), "
                            f"{budget.gpu_bytes / GiB:.1f} GiB each")
        table.add_column("phase")
        for title, _ in _COLUMNS:
            table.add_column(title, justify="right")
        table.add_column("total", justify="right")
        table.add_column("", justify="left")
        for phase in (p for p in budget.phases if p.gpu == gpus[0]):
            items = phase.by_item()
            cells = [_gib(sum(items.get(k, 0.0) for k in keys)) for _, keys in _COLUMNS]
            fits = phase.total <= budget.gpu_bytes
            table.add_row(phase.phase, *cells, _gib(phase.total), "ok" if fits else "[red]OVER[/red]")
        tables.append(table)
    return tables


def _gib(value: float) -> str:
    gib = value / GiB
    if value == 0:
        return "-"
    return f"{gib:.1f}" if gib >= 10 else f"{gib:.2f}" if gib >= 0.1 else f"{gib:.4f}" if gib >= 1e-4 else "~0"


def _span(gpus: list[int]) -> str:
    from hybrid_core.placement.ranges import format_gpus

    return format_gpus(gpus)
