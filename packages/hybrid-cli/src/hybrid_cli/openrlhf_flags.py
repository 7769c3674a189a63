"""Every flag of OpenRLHF's ``train_ppo_ray``, in both spellings, and what it means here.

``data/openrlhf_flags.json`` lists every flag of OpenRLHF 0.11.2's parser (dotted: ``--vllm.num_engines``), of the
flat-era releases before it (``--vllm_num_engines``), and those of OpenRLHF's main branch that its README and example
scripts use but no release has yet (``--algo.advantage.is_correction_enable``), read from the released wheels and the
main branch by ``packages/hybrid-cli/tools/extract_openrlhf_flags.py``; ``data/openrlhf_defaults_<release>.json``
holds each flag's default in 0.11.2 and in 0.10.1, the last flat release (:func:`release_defaults`). This module gives
each flag one :class:`Rule`:

* ``same(field)``: the same setting as hybrid's ``--field`` (the flag becomes another name of it);
* ``convert(fn)``: a value that needs translating (``--ds.param_dtype bf16`` is ``--bf16``);
* ``pending(field, neutral)``: a setting another part of hybrid is adding; until its config field exists, only the
  value that changes nothing (``--actor.policy_loss_type ppo``) is accepted;
* ``only(values)``: accepted with the values that change nothing (``--ds.ring_attn_size 1``), refused otherwise;
* ``note(why)``: accepted; it changes nothing here, and a printed note says why (``--local_rank``);
* ``refuse(why, instead)``: OpenRLHF-only; the error says what it does there and what to use instead.

A flat name follows its dotted successor's rule unless :data:`FLAT_RULES` gives it its own (a switch that became a
value, a value whose meaning changed). :func:`check_table` (and the test suite) makes sure every flag in the data file
has a rule: nothing OpenRLHF accepts is silently ignored.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybrid_core.errors import ConfigError

DATA_FILE = os.path.join(os.path.dirname(__file__), "data", "openrlhf_flags.json")


# ---- the data file ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenRLHFFlag:
    """One flag as OpenRLHF's parser defines it (from the data file)."""

    name: str
    action: str  # store | store_true | store_false
    type: str | None
    nargs: Any
    choices: tuple | None
    default: Any
    dotted: bool  # a flag of the newest release (else: a flat flag of an older one)
    successors: tuple[str, ...] = ()  # flat flag -> the dotted flag(s) it became
    flat: tuple[str, ...] = ()  # dotted flag -> its flat name(s)
    releases: tuple[str, ...] = ()  # flat flag: first and last release read that had it
    main_only: bool = False  # a flag of OpenRLHF's main branch that no release has yet

    @property
    def is_switch(self) -> bool:
        return self.action in ("store_true", "store_false")

    @property
    def arity(self) -> Any:
        """0 for a switch, 1 for one value, else argparse's nargs (2, '+', '*')."""
        if self.is_switch:
            return 0
        return 1 if self.nargs is None else self.nargs


@functools.cache
def load_data() -> dict[str, Any]:
    with open(DATA_FILE, encoding="utf-8") as f:
        return json.load(f)


@functools.cache
def openrlhf_flags() -> dict[str, OpenRLHFFlag]:
    """Every OpenRLHF flag name (dotted, flat, and the few from unreleased example scripts) -> its definition."""
    data = load_data()
    flags: dict[str, OpenRLHFFlag] = {}
    for r in data["flags"]:
        flags[r["name"]] = OpenRLHFFlag(
            r["name"],
            r["action"],
            r["type"],
            r["nargs"],
            _tuple(r["choices"]),
            r["default"],
            dotted=True,
            flat=tuple(r["flat"]),
        )
    for r in data["flat_flags"]:
        if r["name"] in flags:  # kept its name across the rename (--local_rank, --use_ms)
            continue
        flags[r["name"]] = OpenRLHFFlag(
            r["name"],
            r["action"],
            r["type"],
            r["nargs"],
            _tuple(r["choices"]),
            r["default"],
            dotted=False,
            successors=tuple(r["dotted"]),
            releases=tuple(r["releases"]),
        )
    for r in data.get("main_flags", ()):
        flags[r["name"]] = OpenRLHFFlag(
            r["name"],
            r["action"],
            r["type"],
            r["nargs"],
            _tuple(r["choices"]),
            r["default"],
            dotted=False,
            flat=tuple(r["flat"]),
            main_only=True,
        )
    for name, (action, nargs) in UNRELEASED_FLAGS.items():
        flags[name] = OpenRLHFFlag(name, action, "str", nargs, None, None, dotted=False)
    return flags


def openrlhf_release() -> str:
    return load_data()["release"]


#: The flat release whose defaults a flat command line gets: the last one before the dotted rename.
FLAT_RELEASE = "0.10.1"


@functools.cache
def release_defaults(release: str) -> dict[str, Any]:
    """Flag name -> its default in OpenRLHF ``release``'s parser (0.11.2: dotted names, 0.10.1: flat), as argparse
    gives it (``data/openrlhf_defaults_<release>.json``; a timestamp default is its strftime pattern)."""
    path = os.path.join(os.path.dirname(DATA_FILE), f"openrlhf_defaults_{release}.json")
    if not os.path.exists(path):
        raise ValueError(f"no defaults recorded for OpenRLHF {release} (have {openrlhf_release()} and {FLAT_RELEASE})")
    with open(path, encoding="utf-8") as f:
        return dict(json.load(f)["defaults"])


def _tuple(value: Any) -> tuple | None:
    return tuple(value) if value else None


# ---- rules ----------------------------------------------------------------------------------------------------------
@dataclass
class Context:
    """What a conversion may look at: every OpenRLHF flag given (name -> raw value), hybrid's own settings given, and
    the settings converted so far; it may add notes."""

    given: dict[str, Any]
    fields: dict[str, Any]
    known_fields: frozenset[str]
    out: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    overrides: set[str] = field(default_factory=set)  # settings a conversion must set even if given directly

    def value(self, *names: str, default: Any = None) -> Any:
        """The raw value of the first of ``names`` given (any spelling), else ``default``."""
        for name in names:
            for spelling in spellings(name):
                if spelling in self.given:
                    return self.given[spelling]
        return default


def _no_conversion(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    raise AssertionError(f"--{flag}: only a convert rule converts a value")  # the table is checked


@dataclass(frozen=True)
class Rule:
    kind: str  # same | convert | pending | only | note | refuse
    field: str | None = None
    fields: tuple[str, ...] = ()  # convert: every setting the conversion may set (``field`` is the first)
    fn: Callable[[Any, Context, str], dict[str, Any]] = _no_conversion  # convert: the conversion
    neutral: tuple[Any, ...] = ()
    why: str = ""
    instead: str = ""


def same(name: str) -> Rule:
    return Rule("same", field=name)


def convert(fn: Callable[[Any, Context, str], dict[str, Any]], *fields: str) -> Rule:
    return Rule("convert", fn=fn, field=fields[0] if fields else None, fields=tuple(fields))


def pending(name: str, *neutral: Any, why: str) -> Rule:
    return Rule("pending", field=name, neutral=neutral, why=why)


def only(*neutral: Any, why: str, instead: str = "") -> Rule:
    return Rule("only", neutral=neutral, why=why, instead=instead)


def note(why: str) -> Rule:
    return Rule("note", why=why)


def refuse(why: str, instead: str = "") -> Rule:
    return Rule("refuse", why=why, instead=instead)


# ---- conversions ----------------------------------------------------------------------------------------------------
def _param_dtype(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    if str(value) == "bf16":
        return {"bf16": True}
    raise _refused(flag, "fp16 mixed precision (with loss scaling)", "Use --bf16 (bf16 needs no loss scaling).")


def _attn_implementation(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    text = str(value)
    if text.startswith("flash_attention"):
        if text != "flash_attention_2":
            ctx.notes.append(
                f"--{flag} {text}: hybrid's trainers use FlashAttention-2 when flash-attn is installed, "
                "else PyTorch SDPA (--flash_attn)."
            )
        return {"flash_attn": True}
    if text == "sdpa":
        return {"flash_attn": False}
    raise _refused(
        flag,
        f"the {text!r} attention kernel",
        "hybrid's trainers use FlashAttention-2 (--flash_attn, falling back to PyTorch SDPA) or, without "
        "--flash_attn, transformers' default; use --ds.attn_implementation flash_attention_2 or sdpa.",
    )


def _max_len(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    """OpenRLHF's total length (prompt + completion) as hybrid's two limits: a completion gets ``max_new_tokens``
    (else what the prompt budget leaves), and prompts longer than the rest are dropped, so prompt + completion never
    exceeds it."""
    total = _int(value, flag)
    new = ctx.value("rollout.max_new_tokens")
    new = ctx.fields.get("generate_max_len", new)
    if new is not None:
        new = _int(new, "rollout.max_new_tokens")
        if new >= total:
            raise ConfigError(
                flag,
                f"--{flag} {total} leaves no room for a prompt next to {new} new tokens.",
                "Give a total length above --rollout.max_new_tokens.",
            )
        prompt = ctx.fields.get("prompt_max_len", total - new)
        gen = new
    else:
        prompt = ctx.fields.get("prompt_max_len", ctx.value("prompt_max_len"))
        prompt = _int(prompt, "prompt_max_len") if prompt is not None else min(1024, total // 2)
        if prompt >= total:
            raise ConfigError(
                flag,
                f"--{flag} {total} leaves no room for a completion after prompts of up to "
                f"{prompt} tokens (--prompt_max_len).",
                "Raise the total or lower --prompt_max_len.",
            )
        gen = total - prompt
    if prompt + gen > total:
        raise ConfigError(
            "prompt_max_len",
            f"--prompt_max_len {prompt} + {gen} new tokens exceed --{flag} {total}.",
            f"Use --prompt_max_len {total - gen} or less.",
        )
    ctx.notes.append(
        f"--{flag} {total} (prompt + completion): prompts of up to {prompt} tokens (--prompt_max_len; "
        f"longer ones are dropped, not cut) and completions of up to {gen} (--generate_max_len)."
    )
    return {"prompt_max_len": prompt, "generate_max_len": gen}


def _max_new_tokens(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    if ctx.value("data.max_len") is not None:
        return {}  # _max_len splits the total with it
    return {"generate_max_len": _int(value, flag)}


def _generate_batch(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    if value in (None, "None"):
        return {}
    batch = ctx.fields.get("rollout_batch_size") or ctx.value("rollout.batch_size")
    if batch is not None and _int(value, flag) == _int(batch, "rollout.batch_size"):
        return {}
    raise _refused(
        flag,
        "generating more prompts than a rollout batch (over-sampling for the asynchronous trainer)",
        "hybrid generates exactly --rollout_batch_size prompts per step; drop this flag.",
    )


def _lora_targets(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    """OpenRLHF's ``--target_modules a b`` (several words) -> ``lora_target_modules a,b``; without adapters OpenRLHF
    reads none, and neither does hybrid (said in a note)."""
    names = [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value).split()
    rank = ctx.fields.get("lora_rank", ctx.value("ds.lora.rank", default=0))
    if not _int(rank, "ds.lora.rank"):
        ctx.notes.append(f"--{flag} {' '.join(names)}: no LoRA adapters (--lora_rank 0), so no target is read.")
        return {}
    return {"lora_target_modules": ",".join(names)}


def _remote_reward(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    urls = [u.strip() for u in str(value).split(",") if u.strip()]
    files = [u for u in urls if not u.startswith(("http://", "https://"))]
    if files and len(urls) > 1:
        raise ConfigError(
            flag,
            f"--{flag} mixes a reward file with other rewards ({value}).",
            "Give one .py file, or one or more http(s):// reward servers separated by commas.",
        )
    if files and not files[0].endswith(".py"):
        raise ConfigError(
            flag,
            f"--{flag} {files[0]!r} is neither an http(s):// URL nor a .py file.",
            "Give the URL of a reward server or a Python file defining reward_func(queries, prompts, labels).",
        )
    out: dict[str, Any] = {"reward_fn": ",".join(urls)}
    rm = ctx.fields.get("reward_pretrain") or ctx.value("reward.model_name_or_path")
    if rm:  # OpenRLHF then runs no reward model: the reward model's path only initialises the critic
        out["reward_pretrain"] = None
        ctx.overrides.add("reward_pretrain")
        if not (ctx.fields.get("critic_pretrain") or ctx.value("critic.model_name_or_path")):
            out["critic_pretrain"] = rm
            ctx.overrides.add("critic_pretrain")
        ctx.notes.append(
            f"--{flag} is the reward, so no reward model runs (as in OpenRLHF); --reward_pretrain {rm} "
            "only initialises the critic."
        )
    return out


def _reward_models(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    if "," in str(value):
        raise _refused(
            flag,
            "several reward models whose scores are combined",
            "Give one --reward_pretrain (or one reward function/server with --reward_fn).",
        )
    return {"reward_pretrain": str(value)}


def _tensorboard_dir(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    ctx.notes.append(f"--{flag} {value}: TensorBoard logs go to <save_path>/tensorboard here.")
    return {"use_tensorboard": True}


def _lr_scheduler(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    from hybrid_algos.train.workers.settings import LR_SCHEDULERS

    if str(value) not in LR_SCHEDULERS:
        raise _refused(
            flag,
            f"the {value!r} learning-rate schedule",
            f"hybrid has {' and '.join(LR_SCHEDULERS)} (linear warm-up over --lr_warmup_ratio, then "
            "constant or a cosine decay to --min_lr_ratio).",
        )
    if flag.startswith("critic."):  # one schedule for both trainers
        return _shared_optimizer("lr_scheduler", number=False)(value, ctx, flag)
    return {"lr_scheduler": str(value)}


def _shared_optimizer(field_name: str, number: bool = True) -> Callable[[Any, Context, str], dict[str, Any]]:
    """Critic optimizer settings: hybrid has one for both trainers, so the critic's must agree with the actor's."""

    def fn(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
        parse = _number_or_pair if number else str
        actor_flag = "actor." + flag.split(".", 1)[1]
        actor = ctx.fields.get(field_name, ctx.value(actor_flag))
        mine = parse(value)
        if actor is None:
            return {field_name: mine}
        if parse(actor) != mine:
            raise ConfigError(
                flag,
                f"--{flag} {value} differs from the actor's {actor}; hybrid has one --{field_name} for both trainers.",
                f"Give both the same --{field_name}.",
            )
        return {}

    return fn


def _estimator(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    if str(value) == "flash_reinforce":
        raise _refused(
            flag,
            "FlashREINFORCE's estimator (reward minus the rollout-batch mean, no groups)",
            "The closest here is --advantage_estimator reinforce (batch-normalised returns).",
        )
    return {"advantage_estimator": str(value)}


def _kl_k3(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    return {"kl_estimator": "k3"}


def _max_steps(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    return {"max_steps": _int(value, flag)}


def _offload_frozen(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    return {"ref_reward_offload": True} if value else {}


def _is_level(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    """``--algo.advantage.is_correction_level off|token|seq`` (+ ``_mode mask|clip``) in the flat era's terms:
    ``--enable_vllm_is_correction --vllm_is_correction_type tis|icepop|seq-mask-tis``."""
    level = str(value)
    if level == "off":  # OpenRLHF's default: no correction (hybrid's own default is on, so it is said)
        return _pending_values(
            ctx, flag, {"enable_vllm_is_correction": False}, "importance-sampling correction of the engines' log-probs"
        )
    mode = str(ctx.value("algo.advantage.is_correction_mode", default="mask"))
    kind = {("token", "clip"): "tis", ("token", "mask"): "icepop", ("seq", "mask"): "seq-mask-tis"}.get((level, mode))
    if kind is None:
        raise ConfigError(
            flag,
            f"--{flag} {level} with --algo.advantage.is_correction_mode {mode} is not a "
            "correction OpenRLHF defines (sequence level only masks).",
            "Use token with mask or clip, or seq with mask.",
        )
    values: dict[str, Any] = {"enable_vllm_is_correction": True}
    if kind != "tis":  # the flat era's default type
        values["vllm_is_correction_type"] = kind
    return _pending_values(ctx, flag, values, "importance-sampling correction of the engines' log-probs")


def _is_mode(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    if str(ctx.value("algo.advantage.is_correction_level", default="off")) == "off" and str(value) == "mask":
        return {}  # OpenRLHF's default, and without a level it does nothing there either
    if str(ctx.value("algo.advantage.is_correction_level", default="off")) == "off":
        ctx.notes.append(
            f"--{flag} {value} has no effect without --algo.advantage.is_correction_level (as in OpenRLHF)."
        )
    return {}  # read by _is_level


def _is_threshold(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    """The bounds of the correction, given even where they equal OpenRLHF's default (0.5, 5.0): hybrid's own default
    is each type's (tis: no lower bound, 2.0), so OpenRLHF's must be set. Without a correction OpenRLHF reads no
    bounds, and neither does hybrid (a note says so)."""
    words = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
    numbers = [float(w) for w in words]
    if len(numbers) == 1:
        numbers = [0.0, numbers[0]]
    if len(numbers) != 2:
        raise ConfigError(flag, f"--{flag} takes HIGH or LOW HIGH, got {value!r}.", "E.g. 0.5 5.0.")
    if not correction_on(ctx):
        ctx.notes.append(
            f"--{flag} {_show(value)} has no effect without the correction (--algo.advantage."
            "is_correction_level token|seq, or --enable_vllm_is_correction), as in OpenRLHF."
        )
        return {}
    return _pending_values(
        ctx,
        flag,
        {"vllm_is_truncated_threshold": tuple(numbers)},
        "importance-sampling correction of the engines' log-probs",
    )


def correction_on(ctx: Context) -> bool:
    """Whether the line turns the correction on, in any of its spellings (0.11.2's level, the main branch's and the
    flat era's switch, hybrid's own ``--enable_vllm_is_correction``); not said: off, OpenRLHF's default."""
    level = ctx.value("algo.advantage.is_correction_level")
    if level is not None:
        return str(level) != "off"
    if "enable_vllm_is_correction" in ctx.fields:
        return bool(ctx.fields["enable_vllm_is_correction"])
    switch = ctx.value("algo.advantage.is_correction_enable", "enable_vllm_is_correction")
    if switch is None:
        return False
    return switch if isinstance(switch, bool) else str(switch).lower() in ("true", "1", "yes", "on")


def _flat_is_type(value: Any, ctx: Context, flag: str) -> dict[str, Any]:
    if str(value) == "tis":
        return {}  # the flat era's default
    return _pending_values(
        ctx, flag, {"vllm_is_correction_type": str(value)}, "importance-sampling correction of the engines' log-probs"
    )


def _pending_values(ctx: Context, flag: str, values: dict[str, Any], what: str) -> dict[str, Any]:
    missing = [k for k in values if k not in ctx.known_fields]
    if missing:
        raise _refused(flag, what, "hybrid does not have it yet; drop this flag.", pending_field=missing[0])
    return values


# ---- the table ------------------------------------------------------------------------------------------------------
_MUON = "the Muon optimizer (hybrid trains with Adam)"
_VLM = "a frozen vision encoder in vision-language training (the vision tower trains with the rest for now)"

#: The rule of every flag of OpenRLHF 0.11.2's parser.
DOTTED_RULES: dict[str, Rule] = {
    # placement
    "ref.num_nodes": same("ref_num_nodes"),
    "ref.num_gpus_per_node": same("ref_num_gpus_per_node"),
    "reward.num_nodes": same("reward_num_nodes"),
    "reward.num_gpus_per_node": same("reward_num_gpus_per_node"),
    "actor.num_nodes": same("actor_num_nodes"),
    "actor.num_gpus_per_node": same("actor_num_gpus_per_node"),
    "critic.num_nodes": same("critic_num_nodes"),
    "critic.num_gpus_per_node": same("critic_num_gpus_per_node"),
    "train.colocate_actor_ref": same("colocate_actor_ref"),
    "train.colocate_critic_reward": same("colocate_critic_reward"),
    "train.colocate_all": same("colocate_all_models"),
    # engines
    "vllm.num_engines": same("vllm_num_engines"),
    "vllm.tensor_parallel_size": same("vllm_tensor_parallel_size"),
    "vllm.sync_backend": same("vllm_sync_backend"),
    "vllm.sync_with_ray": refuse(
        "sending the weights to the engines through Ray's object store",
        "hybrid streams them in buckets over --vllm_sync_backend (nccl/gloo), or by CUDA IPC "
        "when the engines share the actor's GPUs; drop this flag.",
    ),
    "vllm.enable_prefix_caching": same("enable_prefix_caching"),
    "vllm.enforce_eager": same("enforce_eager"),
    "vllm.enable_sleep": same("vllm_enable_sleep"),
    "vllm.gpu_memory_utilization": same("vllm_gpu_memory_utilization"),
    "algo.advantage.is_correction_level": convert(_is_level, "enable_vllm_is_correction"),
    "algo.advantage.is_correction_mode": convert(_is_mode),
    "algo.advantage.is_correction_gating": only(
        "ratio",
        why="gating the correction by a divergence (a trust region)",
        instead="hybrid's correction (when available) gates by the ratio.",
    ),
    "algo.advantage.is_correction_threshold": convert(_is_threshold, "vllm_is_truncated_threshold"),
    # asynchronous training
    "train.async_enable": same("async_train"),
    # how many batches the generator may run ahead of the trainer: the staleness bound of hybrid's queue
    "train.async_queue_size": same("async_max_staleness"),
    "train.partial_rollout_enable": same("partial_rollout"),
    # checkpoints
    "eval.steps": same("eval_steps"),
    "ckpt.save_steps": same("save_steps"),
    "logger.logging_steps": same("logging_steps"),
    "ckpt.path": same("ckpt_path"),
    "ckpt.save_hf": same("save_hf_ckpt"),
    "ckpt.disable_ds": refuse(
        "checkpoints without the DeepSpeed (optimizer) state",
        "hybrid's checkpoints are resume points and keep it; for Hugging Face weights only use "
        "--save_steps -1 (the final model) or --save_hf_ckpt.",
    ),
    "ckpt.max_num": same("max_ckpt_num"),
    "ckpt.max_mem": only(
        "inf",
        float("inf"),
        why="a disk budget for checkpoints",
        instead="Use --max_ckpt_num to bound how many are kept.",
    ),
    "ckpt.load_enable": same("resume_if_exists"),  # load one if there is one, else start fresh
    "ckpt.best_metric_key": note(
        "it picks the best checkpoint by an evaluation metric; hybrid logs the eval/ metrics "
        "(--eval_dataset) but keeps the newest checkpoints (--max_ckpt_num)."
    ),
    "ds.use_universal_ckpt": refuse(
        "DeepSpeed universal checkpoints (reshardable to another GPU count)",
        "hybrid resumes on the same placement; drop this flag.",
    ),
    # DeepSpeed
    "local_rank": note("the DeepSpeed launcher's rank; hybrid starts its workers through Ray."),
    "ds.zero_stage": same("zero_stage"),
    "actor.gradient_checkpointing_enable": same("gradient_checkpointing"),
    "ds.deepcompile": refuse("DeepSpeed's compiler (DeepCompile)", "drop this flag."),
    "ds.param_dtype": convert(_param_dtype, "bf16"),
    "train.enable_ema": refuse("an exponential moving average of the actor's weights", "drop this flag."),
    "train.ema_beta": only(0.992, why="the EMA coefficient (hybrid keeps no EMA)", instead="drop this flag."),
    "ds.zpg": only(1, why="ZeRO++ hierarchical partitioning", instead="drop this flag (ZeRO runs unpartitioned)."),
    "ds.adam_offload": same("adam_offload"),
    "ds.attn_implementation": convert(_attn_implementation, "flash_attn"),
    "ds.experts_implementation": only(
        None, why="choosing the MoE expert kernel", instead="transformers picks it; drop this flag."
    ),
    "ds.use_liger_kernel": refuse("Liger's fused kernels", "drop this flag."),
    "ds.grad_accum_dtype": only(None, why="a separate gradient-accumulation dtype", instead="drop this flag."),
    "ds.overlap_comm": refuse("DeepSpeed's overlap_comm", "drop this flag."),
    "actor.gradient_checkpointing_reentrant": refuse(
        "reentrant gradient checkpointing",
        "hybrid uses the non-reentrant form with --gradient_checkpointing; drop this flag.",
    ),
    "data.disable_fast_tokenizer": refuse("the slow (Python) tokenizers", "drop this flag."),
    "data.dataloader_num_workers": note("prompts are read and encoded once, on the driver; there is no dataloader."),
    "ds.enable_sleep": same("deepspeed_enable_sleep"),
    "ds.tensor_parallel_size": only(
        1,
        why="tensor parallelism of the trainers (DeepSpeed AutoTP)",
        instead="hybrid's trainers are data parallel; shard a model that does not fit one "
        "GPU with --zero_stage 3 (and --adam_offload).",
    ),
    "ds.packing_samples": same("packing_samples"),
    "train.dynamic_batch_enable": pending("use_dynamic_batch", False, why="token-budget dynamic batching"),
    "rollout.max_tokens_per_gpu": pending("rollout_max_tokens_per_gpu", None, why="token-budget dynamic batching"),
    "train.max_tokens_per_gpu": pending("train_max_tokens_per_gpu", 16192, why="token-budget dynamic batching"),
    "ds.load_in_4bit": refuse("4-bit (QLoRA) training", "drop this flag."),
    "ds.lora.rank": same("lora_rank"),
    "ds.lora.alpha": same("lora_alpha"),
    "ds.lora.target_modules": convert(_lora_targets, "lora_target_modules"),
    "ds.lora.dropout": same("lora_dropout"),
    # batch shape, lengths
    "ckpt.output_dir": same("save_path"),
    "train.num_episodes": same("num_episodes"),
    "rollout.batch_size": same("rollout_batch_size"),
    "rollout.vllm_generate_batch_size": convert(_generate_batch),
    "rollout.micro_batch_size": same("micro_rollout_batch_size"),
    "train.max_epochs": same("max_epochs"),
    "data.max_len": convert(_max_len, "prompt_max_len", "generate_max_len"),
    "rollout.max_new_tokens": convert(_max_new_tokens, "generate_max_len"),
    "data.max_samples": same("max_samples"),
    # the algorithm
    "actor.eps_clip": same("eps_clip"),
    "actor.eps_clip_low_high": same("eps_clip_low_high"),
    "actor.dual_clip": same("dual_clip"),
    "critic.value_clip": same("value_clip"),
    "algo.advantage.lambd": same("lambd"),
    "algo.advantage.gamma": same("gamma"),
    "train.micro_batch_size": same("micro_train_batch_size"),
    "train.batch_size": same("train_batch_size"),
    "reward.normalize_enable": same("normalize_reward"),
    "rollout.top_p": same("top_p"),
    "rollout.temperature": same("temperature"),
    "train.seed": same("seed"),
    "train.full_determinism_enable": refuse(
        "deterministic kernels everywhere (torch.use_deterministic_algorithms)",
        "hybrid seeds every worker (--seed); drop this flag.",
    ),
    "critic.freezing_steps": only(-1, why="warming the critic up while the actor stays frozen", instead="drop it."),
    "rollout.n_samples_per_prompt": same("n_samples_per_prompt"),
    "critic.save_value_network": refuse(
        "saving the critic as a Hugging Face model",
        "the critic's state is in every checkpoint (--save_steps); drop this flag.",
    ),
    "algo.kl.target": same("kl_target"),
    "algo.kl.horizon": same("kl_horizon"),
    "algo.kl.init_coef": same("init_kl_coef"),
    "actor.policy_loss_type": pending("policy_loss_type", "ppo", why="policy losses other than PPO's clipped loss"),
    "actor.loss_agg_mode": same("loss_agg_mode"),
    "algo.kl.estimator": same("kl_estimator"),
    "algo.kl.unbiased_gradient": refuse(
        "the importance-weighted (unbiased) gradient of the KL loss", "drop this flag."
    ),
    "actor.aux_loss_coef": only(0, why="the MoE load-balancing loss", instead="drop this flag."),
    "actor.entropy_coef": same("entropy_loss_coef"),
    "reward.clip_range": same("reward_clip_range"),
    "actor.optim": only("adam", why=_MUON, instead="drop this flag."),
    "actor.muon.lr": only(0.02, why=_MUON, instead="drop this flag."),
    "actor.muon.momentum": only(0.95, why=_MUON, instead="drop this flag."),
    "actor.muon.ns_steps": only(5, why=_MUON, instead="drop this flag."),
    "actor.muon.nesterov": only(True, why=_MUON, instead="drop this flag."),
    "actor.muon.no_nesterov": refuse(_MUON, "drop this flag."),
    "actor.adam.lr": same("actor_learning_rate"),
    "actor.adam.betas": same("adam_betas"),
    "actor.adam.eps": only(1e-8, why="Adam's epsilon (hybrid uses 1e-8)", instead="drop this flag."),
    "actor.adam.weight_decay": same("l2"),
    "actor.lr_scheduler": convert(_lr_scheduler, "lr_scheduler"),
    "actor.lr_warmup_ratio": same("lr_warmup_ratio"),
    "actor.min_lr_ratio": same("min_lr_ratio"),
    "actor.max_norm": same("max_norm"),
    "critic.optim": only("adam", why=_MUON, instead="drop this flag."),
    "critic.muon.lr": only(0.02, why=_MUON, instead="drop this flag."),
    "critic.muon.momentum": only(0.95, why=_MUON, instead="drop this flag."),
    "critic.muon.ns_steps": only(5, why=_MUON, instead="drop this flag."),
    "critic.muon.nesterov": only(True, why=_MUON, instead="drop this flag."),
    "critic.muon.no_nesterov": refuse(_MUON, "drop this flag."),
    "critic.adam.lr": same("critic_learning_rate"),
    "critic.adam.betas": convert(_shared_optimizer("adam_betas"), "adam_betas"),
    "critic.adam.eps": only(1e-8, why="Adam's epsilon (hybrid uses 1e-8)", instead="drop this flag."),
    "critic.adam.weight_decay": convert(_shared_optimizer("l2"), "l2"),
    "critic.lr_scheduler": convert(_lr_scheduler, "lr_scheduler"),
    "critic.lr_warmup_ratio": convert(_shared_optimizer("lr_warmup_ratio"), "lr_warmup_ratio"),
    "critic.min_lr_ratio": convert(_shared_optimizer("min_lr_ratio"), "min_lr_ratio"),
    "critic.max_norm": convert(_shared_optimizer("max_norm"), "max_norm"),
    "algo.advantage.estimator": convert(_estimator, "advantage_estimator"),
    "algo.kl.use_loss": same("use_kl_loss"),
    "algo.advantage.no_std_norm": refuse(
        "advantages centred but not divided by their standard deviation",
        "use --advantage_estimator dr_grpo (Dr. GRPO: no std division).",
    ),
    "reward.overlong_buffer_len": same("overlong_buffer_len"),
    "reward.overlong_penalty_factor": same("overlong_penalty_factor"),
    "reward.stop_properly_penalty_coef": only(
        None,
        why="rescaling the reward of completions cut at --generate_max_len",
        instead="add it to your reward function (completions cut short end without the EOS token).",
    ),
    "ds.ring_attn_size": only(
        1,
        why="ring attention (sequence parallelism across GPUs)",
        instead="hybrid's trainers hold whole sequences; lower --generate_max_len or use "
        "--gradient_checkpointing for long contexts.",
    ),
    "ds.ring_attn_head_stride": only(
        1, why="ring attention (sequence parallelism across GPUs)", instead="drop this flag."
    ),
    # models and rewards
    "actor.model_name_or_path": same("pretrain"),
    "reward.model_name_or_path": convert(_reward_models, "reward_pretrain"),
    "reward.remote_url": convert(_remote_reward, "reward_fn"),
    "critic.model_name_or_path": same("critic_pretrain"),
    "ds.value_head_prefix": only(
        "score",
        why="a custom name for the reward/critic value head",
        instead="hybrid reads the head transformers' sequence-classification models have.",
    ),
    "ref.offload": convert(_offload_frozen, "ref_reward_offload"),
    "reward.offload": convert(_offload_frozen, "ref_reward_offload"),
    "train.agent_func_path": same("agent_func_path"),
    # data
    "data.prompt_dataset": same("prompt_data"),
    "data.prompt_probs": same("prompt_data_probs"),
    "data.prompt_split": same("prompt_split"),
    "eval.dataset": same("eval_dataset"),
    "eval.split": same("eval_split"),
    "eval.temperature": same("eval_temperature"),
    "eval.n_samples_per_prompt": same("eval_n_samples_per_prompt"),
    "data.input_key": same("input_key"),
    "data.label_key": same("label_key"),
    "data.input_template": same("input_template"),
    "data.apply_chat_template": same("apply_chat_template"),
    # logging
    "logger.wandb.key": same("use_wandb"),
    "logger.wandb.org": refuse("Weights & Biases organisations", "set WANDB_ENTITY in the environment instead."),
    "logger.wandb.group": refuse("Weights & Biases run groups", "set WANDB_RUN_GROUP in the environment instead."),
    "logger.wandb.project": same("wandb_project"),
    "logger.wandb.run_name": same("wandb_run_name"),
    "algo.dynamic_filtering_enable": pending(
        "dynamic_filtering", False, why="dynamic sampling (filtering groups by reward)"
    ),
    "algo.dynamic_filtering_range": pending(
        "dynamic_filtering_reward_range", (0.0, 1.0), why="dynamic sampling (filtering groups by reward)"
    ),
    "data.image_key": same("image_key"),  # vision-language prompts: train/images.py
    "data.max_images_per_prompt": same("max_images_per_prompt"),
    "actor.freeze_visual_encoder": refuse(_VLM, "drop this flag."),
    "logger.tensorboard_dir": convert(_tensorboard_dir, "use_tensorboard"),
    "use_ms": refuse(
        "downloading models and data from ModelScope",
        "models and data are never downloaded at run time: give local folders, or ids already in the "
        "Hugging Face cache.",
    ),
}

#: Flat flags whose meaning is not their dotted successor's.
FLAT_RULES: dict[str, Rule] = {
    "enable_vllm_is_correction": pending(
        "enable_vllm_is_correction", False, why="importance-sampling correction of the engines' log-probs"
    ),
    "vllm_is_correction_type": convert(_flat_is_type, "vllm_is_correction_type"),
    "vllm_is_truncated_threshold": convert(_is_threshold, "vllm_is_truncated_threshold"),
    "use_tensorboard": convert(_tensorboard_dir, "use_tensorboard"),
    "max_len": convert(_max_len, "prompt_max_len", "generate_max_len"),
    "max_new_tokens": convert(_max_new_tokens, "generate_max_len"),
    # removed before the dotted rename
    "actor_init_on_gpu": note(
        "OpenRLHF itself stopped using it (it was removed in 0.10.2); hybrid loads weights "
        "on the host and DeepSpeed moves them to the GPU."
    ),
    "bf16": same("bf16"),
    "flash_attn": same("flash_attn"),
    "prompt_max_len": same("prompt_max_len"),
    "generate_max_len": same("generate_max_len"),
    "disable_trace_cache": refuse("a ZeRO-3 prefetch switch of OpenRLHF 0.3-0.4", "drop this flag."),
    "perf": note("hybrid always reports each phase's time (metrics.jsonl and timeline.jsonl)."),
    "pretrain_data": refuse("the PTX loss (pre-training data mixed into the PPO update)", "drop this flag."),
    "pretrain_data_probs": refuse("the PTX loss (pre-training data mixed into the PPO update)", "drop this flag."),
    "pretrain_split": refuse("the PTX loss (pre-training data mixed into the PPO update)", "drop this flag."),
    "ptx_coef": note("it weighs the PTX loss, which runs only with --pretrain_data (not supported here)."),
    "torch_compile": refuse("torch.compile of the trainers", "drop this flag."),
    "use_kl_estimator_k3": convert(_kl_k3, "kl_estimator"),
}

#: Flags of OpenRLHF example scripts from a pull-request branch that never reached a release
#: (examples/scripts/train_ppo_llama_ray_with_dynamic_sampling.sh, 2025-04): name -> (argparse action, nargs).
UNRELEASED_FLAGS = {
    "custom_experience_filter": ("store", None),
    "store_extra_buffers": ("store_true", None),
    "max_global_steps": ("store", None),
}
UNRELEASED_RULES: dict[str, Rule] = {
    "custom_experience_filter": refuse(
        "filtering experiences with your own Python (an unreleased OpenRLHF branch)",
        "filter groups by reward with --dynamic_filtering --dynamic_filtering_reward_range "
        "LOW HIGH, or score unwanted samples in your --reward_fn.",
    ),
    "store_extra_buffers": refuse(
        "keeping filtered samples for later steps (an unreleased OpenRLHF branch)", "drop this flag."
    ),
    "max_global_steps": convert(_max_steps, "max_steps"),
}

#: Flags of OpenRLHF's main branch that no release has yet (its README and example scripts use them): the flat era's
#: correction flags in dotted spelling (0.11.2 spells them ``--algo.advantage.is_correction_level`` / ``_mode``).
MAIN_RULES: dict[str, Rule] = {
    "algo.advantage.is_correction_enable": FLAT_RULES["enable_vllm_is_correction"],
    "algo.advantage.is_correction_type": FLAT_RULES["vllm_is_correction_type"],
}


#: OpenRLHF flags spelled like a hybrid setting whose rule is not plainly that setting, and why that is fine:
#: ``--use_tensorboard DIR`` (OpenRLHF: a folder) is told apart from hybrid's switch by its value (flags.py).
OWN_MEANING_OK = frozenset({"use_tensorboard"})


# ---- lookups ------------------------------------------------------------------------------------------------------
def rule_for(name: str) -> Rule:
    """The rule of an OpenRLHF flag name (either spelling)."""
    if name in FLAT_RULES:
        return FLAT_RULES[name]
    if name in UNRELEASED_RULES:
        return UNRELEASED_RULES[name]
    if name in MAIN_RULES:
        return MAIN_RULES[name]
    if name in DOTTED_RULES:
        return DOTTED_RULES[name]
    flag = openrlhf_flags()[name]
    return DOTTED_RULES[flag.successors[0]]


@functools.cache
def _spellings() -> dict[str, tuple[str, ...]]:
    """Each name's other spellings: a dotted name's flat names, a flat name's dotted successors (not their siblings:
    --critic.adam.betas is not a spelling of --actor.adam.betas, though both were --adam_betas)."""
    return {flag.name: tuple(sorted({flag.name, *flag.flat, *flag.successors})) for flag in openrlhf_flags().values()}


def spellings(name: str) -> tuple[str, ...]:
    return _spellings().get(name, (name,))


def check_table(config_fields: Iterable[str] = ()) -> list[str]:
    """Problems with the table: a flag of the data file without a rule, a rule for a flag that does not exist, or an
    OpenRLHF flag spelled like one of hybrid's settings (``config_fields``) but meaning something else (hybrid's
    parser takes that spelling as its own setting)."""
    flags = openrlhf_flags()
    problems = []
    for name in set(config_fields) & set(flags):
        rule = rule_for(name)
        # a conversion onto the same setting only adds checks (several reward models, flash_reinforce) that the
        # flat spelling, older than them, never needed
        if not (rule.kind in ("same", "pending", "convert") and rule.field == name) and name not in OWN_MEANING_OK:
            problems.append(f"--{name} is a hybrid setting but its OpenRLHF rule is {rule.kind} {rule.field}")
    problems += [
        f"--{n} (OpenRLHF {openrlhf_release()}) has no rule"
        for n, f in flags.items()
        if f.dotted and n not in DOTTED_RULES
    ]
    problems += [
        f"--{n}: successor {s} has no rule" for n, f in flags.items() for s in f.successors if s not in DOTTED_RULES
    ]
    problems += [
        f"--{n} has no rule"
        for n, f in flags.items()
        if not f.dotted
        and not f.successors
        and n not in FLAT_RULES
        and n not in UNRELEASED_RULES
        and n not in MAIN_RULES
    ]
    problems += [f"rule for unknown flag --{n}" for n in (*DOTTED_RULES, *FLAT_RULES, *MAIN_RULES) if n not in flags]
    return problems


# ---- translating given flags ----------------------------------------------------------------------------------------
def translate(
    given: Mapping[str, Any],
    fields: Mapping[str, Any],
    specs: Mapping[str, Any],
    convert_value: Callable[[Any, Any], Any],
) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """The hybrid settings and notes for the OpenRLHF flags in ``given`` (name -> raw value: text, a list of words,
    or True/False for a switch; YAML values from a config file).

    ``fields`` are hybrid's own settings given beside them (they win, and conversions read them); ``specs`` the config
    fields that exist (``FlagSpec`` by name) and ``convert_value(spec, raw)`` turns a raw value into a field's type.
    Returns the settings (those not given directly), the notes, and the settings that must win over ones given
    directly (``--remote_rm_url`` makes OpenRLHF run no reward model, even with ``--reward_pretrain``). Raises a
    ConfigError for a refused flag, naming it (as spelled) and what to use instead.
    """
    ctx = Context(dict(given), dict(fields), frozenset(specs))
    for name, raw in given.items():
        rule = rule_for(name)
        flag = openrlhf_flags()[name]
        if flag.is_switch and rule.kind in ("refuse", "only") and _switch_value(flag, raw) == bool(flag.default):
            continue  # a switch set to its default (a config file's `ds.deepcompile: false`) changes nothing
        if rule.kind == "same":
            if rule.field is None or rule.field not in specs:
                raise _refused(name, f"a setting hybrid does not have ({rule.field})", "drop this flag.")
            value = _switch_value(flag, raw) if flag.is_switch else convert_value(specs[rule.field], raw)
            ctx.out[rule.field] = value
        elif rule.kind == "convert":
            ctx.out.update(rule.fn(raw, ctx, name))
        elif rule.kind == "pending":
            value = _switch_value(flag, raw) if flag.is_switch else raw
            if rule.field is not None and rule.field in specs:
                ctx.out[rule.field] = convert_value(specs[rule.field], value)
            elif not _is_neutral(value, rule.neutral):
                raise _refused(name, rule.why, "hybrid does not have it yet; drop this flag.", pending_field=rule.field)
        elif rule.kind == "only":
            value = _switch_value(flag, raw) if flag.is_switch else raw
            if not _is_neutral(value, rule.neutral):
                raise _refused(name, rule.why, rule.instead)
            ctx.notes.append(f"--{name} {_show(raw)}: the value that changes nothing ({rule.why} is OpenRLHF-only).")
        elif rule.kind == "note":
            ctx.notes.append(f"--{name} has no effect here: {rule.why}")
        elif rule.kind == "refuse":
            raise _refused(name, rule.why, rule.instead)
        else:  # pragma: no cover - the table is checked
            raise AssertionError(rule.kind)
    # hybrid's own settings given beside the OpenRLHF ones win, except where OpenRLHF's meaning overrides them
    return ({k: v for k, v in ctx.out.items() if k not in fields}, ctx.notes, {k: ctx.out[k] for k in ctx.overrides})


def _switch_value(flag: OpenRLHFFlag, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw if flag.action == "store_true" else not raw
    text = str(raw).lower()
    if text not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise ConfigError(flag.name, f"--{flag.name} is a switch, got {raw!r}.", "Write it without a value.")
    on = text in ("true", "1", "yes", "on")
    return on if flag.action == "store_true" else not on


def _is_neutral(value: Any, neutral: Iterable[Any]) -> bool:
    for n in neutral:
        if value is None or n is None:
            if (value is None and n is None) or (str(value) in ("None", "none", "null") and n is None):
                return True
            continue
        if isinstance(n, bool) or isinstance(value, bool):
            if value == n:
                return True
            continue
        if isinstance(n, tuple):
            try:
                if tuple(float(v) for v in _words(value)) == tuple(float(x) for x in n):
                    return True
            except (TypeError, ValueError):
                pass
            continue
        if isinstance(n, (int, float)):
            try:
                if float(value) == float(n):
                    return True
            except (TypeError, ValueError):
                pass
            continue
        if str(value) == str(n) or (isinstance(value, (list, tuple)) and " ".join(map(str, value)) == str(n)):
            return True
    return False


def _words(value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    return str(value).replace(",", " ").split()


def _show(raw: Any) -> str:
    if raw is True:
        return ""
    return " ".join(map(str, raw)) if isinstance(raw, (list, tuple)) else str(raw)


def _int(value: Any, flag: str) -> int:
    try:
        number = float(value)
        if not number.is_integer():
            raise ValueError
        return int(number)
    except (TypeError, ValueError):
        raise ConfigError(flag, f"--{flag} takes a whole number, got {value!r}.", "E.g. 2048.") from None


def _number_or_pair(value: Any) -> Any:
    words = _words(value)
    numbers = tuple(float(w) for w in words)
    return numbers[0] if len(numbers) == 1 else numbers


def _refused(flag: str, why: str, instead: str = "", *, pending_field: str | None = None) -> ConfigError:
    problem = f"--{flag} is OpenRLHF-only: {why}."
    if pending_field:
        problem = f"--{flag}: {why} is not in hybrid yet (no {pending_field!r} setting)."
    return ConfigError(flag, problem, instead or "Drop this flag.")
