"""LoRA on the actor and the critic: PEFT adapters over a frozen base (``--lora_rank``, ``--lora_alpha``,
``--lora_dropout``, ``--lora_target_modules``; OpenRLHF's ``--lora_rank`` / ``--ds.lora.*``).

Only the adapters train: gradients and optimizer state exist for them alone (the memory model counts them,
:func:`adapter_param_count`), under either trainer backend. Where the engines can apply the adapter (the built-in
engine and vLLM) they load the base once and each sync sends only the adapter's tensors (:func:`sync_choice`,
``hybrid_engines.weight_sync.adapter``: ``--lora_sync auto|adapter|merged``); elsewhere (SGLang, engines sleeping at
level 2, ``--lora_sync merged``) they receive full weights -- each adapted layer merged, ``W + (alpha / r) B A``,
under the base model's names (:mod:`.trainer_backends.peft_weights`) -- and the run's start says which and why.
The final model is saved merged (a plain
Hugging Face folder) with the adapter beside it (``adapter/``, PEFT's format). With a KL term the reference is the
frozen base itself -- the actor's forward with its adapters off (recipes.py's ``reference_base`` phase) -- so no
reference model is loaded and the planner holds one copy of the weights.

One flag for both trained roles, as OpenRLHF's ``--lora_rank``: PPO's critic (``hybrid ppo``, GAE) gets adapters of
the same rank, alpha, dropout and targets on its backbone, and its value head -- new, or a reward model's -- trains
whole beside them (PEFT's ``modules_to_save``: :func:`value_head_name`), so its gradients and optimizer state are
for the adapters and the head alone (:func:`adapter_param_count` with ``value_head``). The critic sends no weights
anywhere; its checkpoints hold its adapters and head (the backend's state, and ``adapter/`` in PEFT's format).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from hybrid_core.errors import ConfigError

#: PEFT's shorthand for every linear layer but the output head
ALL_LINEAR = "all-linear"


def target_modules(trainer: Any) -> str | list[str]:
    """The settings' ``lora_target_modules`` as PEFT takes them."""
    text = trainer.lora_target_modules.strip()
    return ALL_LINEAR if text == ALL_LINEAR else [t for t in (p.strip() for p in text.split(",")) if t]


def validate_lora(trainer: Any) -> None:
    """The LoRA settings' checks (:meth:`TrainerSettings.validate` calls it), naming ``trainer.<field>``."""
    rank = trainer.lora_rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError(
            "trainer.lora_rank", f"must be a whole number >= 0, got {rank!r}.", "E.g. 16; 0 trains every weight."
        )
    if not trainer.lora:
        return
    if not trainer.lora_alpha > 0:
        raise ConfigError("trainer.lora_alpha", f"must be > 0, got {trainer.lora_alpha}.", "E.g. 2 x the rank.")
    if not 0 <= trainer.lora_dropout < 1:
        raise ConfigError(
            "trainer.lora_dropout", f"must be in [0, 1), got {trainer.lora_dropout}.", "E.g. 0 (OpenRLHF's default)."
        )
    if not target_modules(trainer):
        raise ConfigError(
            "trainer.lora_target_modules",
            "names no module.",
            "Use all-linear, or module names such as q_proj,k_proj,v_proj,o_proj.",
        )
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(
            "trainer.lora_rank",
            "LoRA adapters are PEFT's, and peft is not installed.",
            "pip install 'hybrid-algos[train,lora]' (or 'peft>=0.13').",
        )


def lora_config(trainer: Any, value_head: str | None = None) -> Any:
    """PEFT's config: a causal LM's adapters, or (``value_head``: the head module's name) a value model's, whose
    head trains whole beside them (``modules_to_save``; PEFT gives it no adapter, even under all-linear)."""
    from peft import LoraConfig

    return LoraConfig(
        r=trainer.lora_rank,
        lora_alpha=trainer.lora_alpha,
        lora_dropout=trainer.lora_dropout,
        target_modules=target_modules(trainer),
        bias="none",
        task_type="CAUSAL_LM" if value_head is None else "TOKEN_CLS",
        modules_to_save=None if value_head is None else [value_head],
    )


#: The value head of a transformers ``*ForTokenClassification`` model (models.load_critic): ``score`` (Llama, Qwen,
#: Mistral, Gemma, ...) or ``classifier`` (the BERT-style ones)
VALUE_HEADS = ("score", "classifier")


def value_head_name(model: Any) -> str:
    """The critic's head module (what trains whole beside the adapters); a ConfigError for a model without one."""
    import torch

    for name in VALUE_HEADS:
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return name
    raise ConfigError(
        "trainer.lora_rank",
        f"the critic's model ({type(model).__name__}) has no value head named {' or '.join(VALUE_HEADS)}, so LoRA "
        "cannot train its head beside the adapters.",
        "Use GRPO / REINFORCE++ (no critic) with --lora_rank, or drop --lora_rank.",
    )


def adapter_spec(trainer: Any) -> Any:
    """The adapter the engines apply under adapter-only sync (``hybrid_engines.weight_sync.adapter.AdapterSpec``)."""
    from hybrid_engines.weight_sync.adapter import AdapterSpec

    targets = target_modules(trainer)
    return AdapterSpec(trainer.lora_rank, trainer.lora_alpha, targets if isinstance(targets, str) else tuple(targets))


def sync_choice(settings: Any) -> Any:
    """A run's ``AdapterChoice`` (adapter-only or merged syncs, and the line saying why), or None without LoRA;
    ``settings``: the run's ``TrainSettings``. Raises the ``sync.lora adapter`` refusals (before Ray starts)."""
    from hybrid_engines.weight_sync.adapter import choose_adapter_sync

    spec = adapter_spec(settings.trainer) if settings.trainer.lora else None
    return choose_adapter_sync(
        settings.sync, settings.engine.backend, spec, engine_sleep_level=settings.engine.sleep_level
    )


def apply_lora(model: Any, trainer: Any, *, value_head: bool = False) -> Any:
    """``model`` wrapped with the adapters (PEFT freezes every base weight); ``value_head``: ``model`` is the
    critic's value model, whose head trains whole (:func:`value_head_name`). With gradient checkpointing the
    inputs' embeddings require gradients, else a checkpointed segment whose inputs need none would give the
    adapters inside it no gradient."""
    from peft import get_peft_model

    head = value_head_name(model) if value_head else None
    targets = target_modules(trainer)
    if head is not None and not isinstance(targets, str) and head in targets:  # all-linear leaves the head alone
        raise ConfigError(
            "trainer.lora_target_modules",
            f"{head!r} is the critic's value head, which trains whole beside the adapters: it takes no adapter.",
            f"Drop {head} from --lora_target_modules (the actor's LM head is lm_head).",
        )
    if trainer.gradient_checkpointing:
        model.enable_input_require_grads()
    return get_peft_model(model, lora_config(trainer, head))


#: the counts made, by the config's content and the LoRA settings (the planner sizes the models again on a replan)
_COUNTS: dict[tuple, int] = {}


def adapter_param_count(
    hf_config: Any, trainer: Any, *, value_head: bool = False, trust_remote_code: bool = False
) -> int:
    """The parameters that train under LoRA for a model of ``hf_config``: PEFT applied to the model built on the meta
    device (exact, nothing allocated). ``value_head``: the critic's value model (models.load_critic), whose count is
    its adapters and its whole head. A target naming no module of the model is a ConfigError here, before Ray
    starts."""
    key = (hf_config.to_json_string(), trainer.lora_rank, trainer.lora_target_modules, value_head, trust_remote_code)
    if key in _COUNTS:
        return _COUNTS[key]
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    with torch.device("meta"):
        if value_head:  # as load_critic builds it: a one-output token head
            config = copy.deepcopy(hf_config)
            config.num_labels = 1
            model = AutoModelForTokenClassification.from_config(config, trust_remote_code=trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
        try:
            model = apply_lora(model, dataclasses.replace(trainer, gradient_checkpointing=False), value_head=value_head)
        except ConfigError:
            raise
        except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
            raise ConfigError(
                "trainer.lora_target_modules",
                f"{trainer.lora_target_modules!r}: {str(e).splitlines()[0][:300]}",
                "Name modules the model has (e.g. q_proj,v_proj for Llama / Qwen), or use all-linear.",
            ) from None
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    _COUNTS[key] = count
    return count


def critic_count(hf_config: Any, trainer: Any, *, trust_remote_code: bool = False) -> tuple[int, int]:
    """The critic's trained parameters under LoRA (adapters and value head) and its total, for :func:`describe`;
    ``hf_config``: the config of the critic's folder (``Recipe.role("critic").model_folder``)."""
    from hybrid_core.residency.memory import count_params

    return (
        adapter_param_count(hf_config, trainer, value_head=True, trust_remote_code=trust_remote_code),
        count_params(hf_config, value_head=True, trust_remote_code=trust_remote_code),
    )


def describe(
    trainer: Any, adapters: int, total: int, *, reference: bool = False, critic: tuple[int, int] | None = None
) -> str:
    """The dry run's and the start's line about LoRA (``reference``: the run has a KL term, whose reference is then
    the actor's frozen base; ``critic``: the run trains a critic, its trained and total parameters)."""
    return (
        f"LoRA: rank {trainer.lora_rank}, alpha {trainer.lora_alpha}, targets {trainer.lora_target_modules}: "
        f"{adapters / 1e6:.2f}M adapter parameters train ({100 * adapters / max(total, 1):.2f} % of "
        f"{total / 1e9:.2f}B), the base is frozen"
        + (
            "; the reference is that frozen base (the actor's forward with its adapters off): no reference model "
            "is loaded (OpenRLHF loads a second copy; the log-probs are the same)"
            if reference
            else ""
        )
        + (
            f"; the critic too (one --lora_rank for both, as OpenRLHF's): {critic[0] / 1e6:.2f}M adapter and "
            f"value-head parameters train ({100 * critic[0] / max(critic[1], 1):.2f} % of {critic[1] / 1e9:.2f}B), "
            "its base frozen, its value head whole"
            if critic is not None
            else ""
        )
    )
