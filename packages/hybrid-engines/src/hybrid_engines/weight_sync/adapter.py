"""Adapter-only weight sync for LoRA runs: the engines load the base once and receive only the adapter each step.

Under LoRA the trainer's base is frozen, so after an update only the adapter's ``lora_A`` / ``lora_B`` tensors
changed. Where the engine can apply an adapter itself (the built-in engine wraps its model with PEFT; vLLM with
``enable_lora``), each sync sends just those tensors, over the same bucketed transport and with the same per-bucket
checksums as a full sync; elsewhere the merged full weights go (``W + scaling * B @ A``, the fallback).

:class:`AdapterSpec` is what an engine is built with (rank, alpha, target modules; dropout does nothing at
inference): its :meth:`~AdapterSpec.peft_config` is PEFT's ``adapter_config.json`` content, which vLLM's
``PEFTHelper.from_dict`` and PEFT's ``LoraConfig`` both read. The tensors travel under PEFT's saved-adapter names
(``base_model.model.<module>.lora_A.weight``, no adapter name: :func:`wire_name`), the names vLLM's
``LoRAModel.from_lora_tensors`` parses.

:func:`choose_adapter_sync` decides, before Ray starts, which of the two a run uses and says why (the line the run
starts with and the dry run prints): ``sync.lora`` ``auto`` (adapter-only where the engine takes it), ``adapter``
(refused where it cannot) or ``merged``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybrid_core.errors import ConfigError

from ..registry import engine_spec
from .settings import SyncSettings

#: PEFT's prefix of a saved adapter's tensor names (``PeftModel`` wraps the transformers model as base_model.model)
PEFT_PREFIX = "base_model.model."
ADAPTER_PARTS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class AdapterSpec:
    """The LoRA adapter an engine applies: plain LoRA on linear layers (no bias, no DoRA, no modules_to_save)."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]  # "all-linear" or module names

    def peft_config(self) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` fields for this adapter (dropout 0: it does nothing at inference)."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": int(self.rank),
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": targets,
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
        }

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def wire_name(param: str, adapter: str = "default") -> str | None:
    """The wire (PEFT saved-adapter) name of a PEFT model's parameter ``param`` -- ``...q_proj.lora_A.default.weight``
    -> ``...q_proj.lora_A.weight`` --, or None when it is not one of ``adapter``'s A / B weights."""
    parts = param.split(".")
    for i, part in enumerate(parts[:-2]):
        if part in ADAPTER_PARTS and parts[i + 1] == adapter and parts[i + 2 :] == ["weight"]:
            return ".".join([*parts[: i + 1], "weight"])
    return None


@dataclass(frozen=True)
class AdapterChoice:
    """A LoRA run's sync payload: ``spec`` when the engines take the adapter alone (None: merged full weights), and
    the line that says which and why."""

    spec: AdapterSpec | None
    line: str

    @property
    def adapter_only(self) -> bool:
        return self.spec is not None


def choose_adapter_sync(
    settings: SyncSettings, backend: str, spec: AdapterSpec | None, *, engine_sleep_level: int | None = None
) -> AdapterChoice | None:
    """Adapter-only or merged for a run whose actor trains ``spec`` (None: no LoRA, nothing to choose -> None).

    Merged where ``settings.lora`` says so, where the engine class cannot load adapters
    (``engine_spec(backend).adapter_refusal(spec)``), or where the engines discard their weights when they sleep
    (``engine_sleep_level`` 2: the base would then have to be sent again after every sleep). ``sync.lora adapter``
    turns each of those into a :class:`ConfigError` instead."""
    mode = settings.validate().lora
    if spec is None:
        return None
    why = None
    if mode == "merged":
        why = "sync.lora merged asks for it"
    else:
        why = engine_spec(backend).adapter_refusal(spec)
        if why is None and engine_sleep_level == 2:
            why = (
                "engine.sleep_level 2 discards the engines' weights at every sleep, so each sync would have to "
                "send the base again"
            )
        if why is not None and mode == "adapter":
            raise ConfigError(
                "sync.lora",
                f"adapter-only sync is not possible here: {why}.",
                "Use sync.lora auto (merged full weights where the engines cannot take the adapter) or merged.",
            )
    if why is not None:
        return AdapterChoice(
            None,
            f"LoRA weight sync: merged full weights (W + scaling * B @ A under the base names) every step, "
            f"because {why}",
        )
    return AdapterChoice(
        spec,
        f"LoRA weight sync: adapter only -- the engines load the base once and receive the lora_A / lora_B "
        f"tensors each step (rank {spec.rank}, alpha {spec.alpha:g}), checked like any sync; sync.lora merged "
        "sends merged full weights instead",
    )
