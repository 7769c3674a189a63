"""Model folders read before Ray starts: a damaged ``config.json``, missing tokenizer files or a model that ships
its own code are reported naming the folder, the file and the fix -- not as a traceback from inside transformers.

``--trust_remote_code`` (off by default) is the one switch for code a model folder ships (``auto_map`` in its
``config.json`` or ``tokenizer_config.json``): every transformers ``from_pretrained`` of the run (actor, critic,
reference, reward model, tokenizer, the engines) gets it, and without it such a folder is refused here.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal, overload

from hybrid_core.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")


@overload
def read_json(field: str, path: str, *, required: Literal[True] = ...) -> dict[str, Any]: ...
@overload
def read_json(field: str, path: str, *, required: bool) -> dict[str, Any] | None: ...


def read_json(field: str, path: str, *, required: bool = True) -> dict[str, Any] | None:
    """A JSON file of a model folder; a ConfigError names ``field``, the file and where it is broken."""
    if not os.path.exists(path):
        if required:
            raise ConfigError(
                field,
                f"{os.path.dirname(path)} has no {os.path.basename(path)}.",
                "Give a Hugging Face model folder (config.json, weights and tokenizer files).",
            )
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except UnicodeDecodeError:
        raise ConfigError(field, f"{path} is not UTF-8 text.", "Restore the file from the model's source.") from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            field,
            f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}).",
            "Restore the file from the model's source (it may be truncated or edited by hand).",
        ) from None
    except OSError as e:
        raise ConfigError(field, f"{path} cannot be read ({e.strerror}).", "Check the file's permissions.") from None
    if not isinstance(value, dict):
        raise ConfigError(
            field,
            f"{path} holds a JSON {type(value).__name__}, not an object.",
            "Restore the file from the model's source.",
        )
    return value


def check_model_folder(field: str, path: str, *, trust_remote_code: bool) -> None:
    """``config.json`` reads, transformers knows the architecture, and shipped code is only run when allowed."""
    config = read_json(field, os.path.join(path, "config.json"))
    tokenizer_config = read_json(field, os.path.join(path, "tokenizer_config.json"), required=False) or {}
    shipped = [
        f"{name}: auto_map"
        for name, cfg in (("config.json", config), ("tokenizer_config.json", tokenizer_config))
        if cfg.get("auto_map")
    ]
    if shipped and not trust_remote_code:
        raise ConfigError(
            "trust_remote_code",
            f"{path} ships its own Python code ({', '.join(shipped)}), which runs only with --trust_remote_code.",
            "Read that code, then add --trust_remote_code; or "
            "use a model whose architecture transformers has built in.",
        )
    model_type = config.get("model_type")
    if not shipped:
        from transformers import CONFIG_MAPPING, __version__

        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            raise ConfigError(
                field,
                f"{path}/config.json has model_type {model_type!r}, which transformers {__version__} does not know.",
                "Upgrade transformers, or check the model folder.",
            )


def check_reward_head(path: str, *, random_head: bool, trust_remote_code: bool) -> str | None:
    """``--reward_pretrain`` holds the weights of the head it is scored with (``score.weight`` for most models), read
    from the weight files' indexes or headers, no weights loaded; else a ConfigError naming the missing weights and
    the fix. transformers would load such a folder (a causal LM, say) with a randomly initialised head and rewards
    that are noise. ``random_head`` (``--reward_random_head``) allows it: the note to print is returned instead (None
    when there is nothing to say). A folder whose weight names cannot be read without loading them is let through."""
    head = reward_head_names(path, trust_remote_code=trust_remote_code)
    names = checkpoint_tensor_names(path)
    if head is None or names is None:
        return None
    missing = [n for n in head if n not in names]
    if not missing:
        return (
            f"--reward_random_head: not used: {path} has its reward head ({', '.join(head)})." if random_head else None
        )
    config = read_json("reward_pretrain", os.path.join(path, "config.json")) or {}
    architectures = ", ".join(a for a in config.get("architectures") or () if isinstance(a, str)) or "no architectures"
    what = "a causal LM" if architectures.endswith("ForCausalLM") else "a model"
    heads = {*_HEAD_LIKE, *(n.split(".")[0] for n in missing)}
    others = sorted(n for n in names if n.split(".")[0] in heads)  # e.g. lm_head.weight, or value_head.weight
    instead = f"; it has {', '.join(others[:4])}" if others else ""
    problem = (
        f"{path} holds {what} ({architectures}): its weights have no reward head ({', '.join(missing)} "
        f"missing{instead})"
    )
    if random_head:
        return f"--reward_random_head: {problem}; the head is initialised at random (its rewards are noise)."
    raise ConfigError(
        "reward_pretrain",
        f"{problem}; the reward model would score with a random head (rewards that are noise).",
        "Give a reward model: a sequence-classification folder with its trained head (OpenRLHF's "
        "train_rm saves one, value_head_prefix 'score'), or use a rule reward (--reward_fn); or pass "
        "--reward_random_head to score with a randomly initialised head (tests and benchmarks only).",
    )


#: First parts of weight names that are a model's head, not its backbone: named when the reward head is missing.
_HEAD_LIKE = ("lm_head", "score", "value_head", "classifier", "v_head")


def reward_head_names(path: str, *, trust_remote_code: bool) -> list[str] | None:
    """The weights ``AutoModelForSequenceClassification`` puts on top of the backbone for this folder's config
    (``["score.weight"]`` for Llama, Qwen, Mistral...), from a model built on the meta device (no memory); None
    when transformers has no such model for it (loading it says so)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, TypeError, ImportError, OSError):
        return None
    backbone = f"{model.base_model_prefix}."
    return [n for n in model.state_dict() if not n.startswith(backbone)] or None


def checkpoint_tensor_names(path: str) -> set[str] | None:
    """The tensor names of a model folder's weights, from ``*.safetensors`` headers or an index file (no tensor
    read); a single ``pytorch_model.bin`` is opened memory-mapped. None when there are no weights it can read."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        data = read_json("reward_pretrain", os.path.join(path, index), required=False)
        if data is not None and isinstance(data.get("weight_map"), dict):
            return set(data["weight_map"])
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        names: set[str] = set()
        for name in files:
            names |= _safetensors_names(os.path.join(path, name))
        return names
    bin_path = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(bin_path):
        import torch

        try:
            return set(torch.load(bin_path, map_location="cpu", mmap=True, weights_only=True))
        except Exception:  # an old (non-zip) pickle cannot be memory-mapped: let the load report it
            return None
    return None


def _safetensors_names(path: str) -> set[str]:
    """A safetensors file starts with the length of its JSON header (8 bytes, little-endian), then the header."""
    import struct

    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise ConfigError(
            "reward_pretrain",
            f"{path} is not a readable safetensors file ({e}).",
            "Restore the weights from the model's source (the file may be truncated).",
        ) from None
    return {k for k in header if k != "__metadata__"}


def load_tokenizer(field: str, path: str, *, trust_remote_code: bool) -> Any:
    """The folder's tokenizer; a folder without tokenizer files, or one transformers cannot read, is a ConfigError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError, ValueError, TypeError, KeyError... for unreadable folders
        present = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(path, f))]
        problem = (
            f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES[:4])}, ...)."
            if not present
            else f"the tokenizer in {path} cannot be loaded: {type(e).__name__}: {_first_line(e)}"
        )
        raise ConfigError(
            field,
            problem,
            "Copy the tokenizer files of the model (tokenizer.json, "
            "tokenizer_config.json, special_tokens_map.json) into the folder.",
        ) from None


def check_same_tokenizer(field: str, path: str, tokenizer: Any, *, trust_remote_code: bool) -> None:
    """A model that scores the policy's token ids (a distillation teacher) must read them as the policy does: the
    same vocabulary, and logits over every id of it. Otherwise a ConfigError naming the first difference."""
    theirs = load_tokenizer(field, path, trust_remote_code=trust_remote_code)
    ours_vocab, their_vocab = tokenizer.get_vocab(), theirs.get_vocab()
    if ours_vocab != their_vocab:
        differ = sorted(t for t in set(ours_vocab) | set(their_vocab) if ours_vocab.get(t) != their_vocab.get(t))
        raise ConfigError(
            field,
            f"the tokenizer in {path} is not the policy's ({len(their_vocab)} tokens against {len(ours_vocab)}; "
            f"{len(differ)} differ, e.g. {differ[0]!r}: {their_vocab.get(differ[0])} here, "
            f"{ours_vocab.get(differ[0])} in the policy's): it would score other tokens than the policy sampled.",
            "Use a teacher of the policy's model family (the same tokenizer files).",
        )
    config = read_json(field, os.path.join(path, "config.json"))
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if isinstance(size, int) and size < len(ours_vocab):
        raise ConfigError(
            field,
            f"{path}'s model has logits for {size} token ids; the tokenizer has {len(ours_vocab)}.",
            "Use a teacher whose vocab_size covers its tokenizer.",
        )


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else ""
