"""Prompt datasets: local JSONL / JSON / Parquet files, ``datasets`` folders (``save_to_disk``), Hugging Face ids
already in the local cache, or the built-in task.

``load_prompts(rollout, tokenizer, task)`` (``rollout``: the rollout section, :mod:`.rollout_settings`) returns a
list of :class:`~hybrid_algos.train.tasks.Prompt` (token ids, text, label). What happens to each record:

* ``--prompt_data a,b`` reads several datasets (OpenRLHF's comma list; ``name@subfolder`` reads a subfolder). Without
  ``--prompt_data_probs`` they are concatenated; with ``--prompt_data_probs 0.7,0.3`` they are interleaved as
  OpenRLHF does (``datasets.interleave_datasets``, "all_exhausted"): each prompt comes from a dataset drawn with those
  weights (seeded by ``--seed``), a dataset that runs out starts over, until every dataset has been seen whole.
* ``--max_samples N`` keeps the first N records of each dataset (before anything else, as OpenRLHF does).
* ``--input_key`` names the prompt field: a string, or a list of chat messages (``[{"role", "content"}, ...]``).
* ``--apply_chat_template`` renders the field with the tokenizer's chat template and ``add_generation_prompt=True``
  (a plain string becomes one user message). The rendered text already holds the template's BOS, so it is encoded
  with ``add_special_tokens=False``; plain text without a template is encoded with the tokenizer's special tokens.
* ``--prompt_max_len``: longer prompts are **dropped, not truncated**: cutting the end loses the generation prompt
  and cutting the start loses the instruction; either way the model is asked something else. Dropped prompts are
  counted (``PromptStats``) and logged; dropping all of them is an error.
* ``--label_key`` (optional) is passed to rule rewards as the prompt's label.
* ``--input_template "User: {}\\nAssistant: "`` wraps each plain-text prompt (not with ``--apply_chat_template``).

A model or dataset given as a Hugging Face id (``org/name``) that is not a local path is looked up in the local
Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) by
:func:`resolve_local_paths`: nothing is downloaded at run time, and a missing id is an error naming the cache folder
it looked for.

Parquet needs ``pyarrow`` and ``datasets`` folders need ``datasets``: both are the ``hybrid-cli[data]`` extra.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_core.errors import ConfigError

from .input_template import apply_input_template
from .prompt_sources import parse_probs, split_sources
from .tasks import BOS, FIRST_SYMBOL_ID, SEP, LookupTask, Prompt, SyntheticTask

if TYPE_CHECKING:
    from .rollout_settings import RolloutSettings

log = logging.getLogger(__name__)

#: Built-in task prompts made when neither --max_steps nor --max_samples asks for fewer.
SYNTHETIC_PROMPTS = 1024
DATA_EXTRA = "pip install 'hybrid-cli[data]'"
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class PromptStats:
    """How a prompt set was built: records read, prompts kept, prompts dropped for length."""

    source: str
    records: int
    kept: int
    dropped_too_long: int
    max_prompt_len: int

    def describe(self) -> str:
        text = f"{self.kept} prompts from {self.source} ({self.records} records read"
        if self.dropped_too_long:
            text += f", {self.dropped_too_long} dropped: longer than prompt_max_len={self.max_prompt_len} tokens"
        return text + ")"


def load_prompts(
    rollout: RolloutSettings, tokenizer: Any, task: SyntheticTask | LookupTask | None = None, *, vision: Any = None
) -> list[Prompt]:
    """The prompts of a run: ``rollout.prompt_data`` encoded with ``tokenizer``, or the built-in ``task``'s prompts
    (``task_from_config(models)``; needed when there is no prompt data). ``vision``: the model's
    :class:`~hybrid_algos.train.vision.VisionProcessor` when the prompts hold images
    (``rollout.max_images_per_prompt`` > 0: :mod:`.images`, :mod:`.vision`)."""
    return load_prompt_set(rollout, tokenizer, task, vision=vision)[0]


def load_prompt_set(
    rollout: RolloutSettings, tokenizer: Any, task: SyntheticTask | LookupTask | None = None, *, vision: Any = None
) -> tuple[list[Prompt], PromptStats]:
    """Like :func:`load_prompts`, also returning what was read and dropped."""
    if rollout.prompt_data is None:
        if task is None:
            raise TypeError("load_prompt_set: without prompt data, the built-in task (task=...) makes the prompts")
        return synthetic_prompts(rollout, task, tokenizer)
    if not rollout.input_key:
        raise ConfigError(
            "input_key",
            "--prompt_data needs --input_key to say which field holds the prompt.",
            "Add e.g. --input_key prompt.",
        )
    sources = split_sources(rollout.prompt_data)
    weights = parse_probs(rollout.prompt_data_probs, len(sources))
    groups, read, dropped = [], 0, 0
    for source in sources:
        records = read_records(source.path, split=rollout.prompt_split, given=source.given)
        records = records[: rollout.max_samples]
        if rollout.max_images_per_prompt > 0 or vision is not None:
            prompts, lost = _encode_with_images(records, rollout, vision, source.given, source.path)
            groups.append(prompts)
            read, dropped = read + len(records), dropped + lost
            continue
        from .vision import check_text_records

        check_text_records(records, rollout, source.given, source.path)
        prompts, lost = encode_records(
            records,
            tokenizer,
            input_key=rollout.input_key,
            label_key=rollout.label_key,
            apply_chat_template=rollout.apply_chat_template,
            prompt_max_len=rollout.prompt_max_len,
            source=source.given,
            input_template=rollout.input_template,
        )
        groups.append(prompts)
        read, dropped = read + len(records), dropped + lost
    if weights is None:
        prompts = [p for group in groups for p in group]
    else:
        prompts = interleave(groups, weights, seed=rollout.seed)
    where = rollout.prompt_data if weights is None else f"{rollout.prompt_data} (mixed {rollout.prompt_data_probs})"
    stats = PromptStats(where, read, len(prompts), dropped, rollout.prompt_max_len)
    if dropped:
        log.warning("%s", stats.describe())
    return prompts, stats


def _encode_with_images(
    records: list[dict[str, Any]], rollout: RolloutSettings, vision: Any, source: str, path: str
) -> tuple[list[Prompt], int]:
    from .vision import encode_image_records

    if vision is None:
        raise TypeError("load_prompt_set: prompts with images need the model's processor (vision=...)")
    _check_key("input_key", rollout.input_key or "", records, source)
    if rollout.label_key:
        _check_key("label_key", rollout.label_key, records, source)
    return encode_image_records(
        records,
        vision,
        input_key=rollout.input_key or "",
        image_key=rollout.image_key,
        max_images=rollout.max_images_per_prompt,
        label_key=rollout.label_key,
        apply_chat_template=rollout.apply_chat_template,
        prompt_max_len=rollout.prompt_max_len,
        source=source,
        path=path,
        input_template=rollout.input_template,
    )


# ---- how many steps the prompts make -------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepCount:
    """The steps of a run and why, with OpenRLHF's meaning of the flags: a step generates for one
    ``--rollout_batch_size`` of prompts and trains on it; ``--num_episodes`` is the number of passes over the prompt
    set (each pass shuffled afresh; a last part smaller than a rollout batch is left out of that pass, where OpenRLHF
    would train on a smaller batch); ``--max_epochs`` is passes over each rollout batch (optimizer updates, not
    steps). ``--max_steps`` (hybrid's; OpenRLHF's unreleased ``--max_global_steps``) only ends a run early: the
    smaller of it and what the prompts allow wins, and it never adds episodes."""

    prompts: int
    per_step: int  # --rollout_batch_size
    episodes: int  # --num_episodes
    max_steps: int | None
    updates_per_step: int  # optimizer updates of one step: samples / --train_batch_size x --max_epochs
    samples_per_step: int
    train_batch_size: int
    max_epochs: int

    @property
    def per_episode(self) -> int:
        return self.prompts // self.per_step

    @property
    def from_prompts(self) -> int:
        return self.per_episode * self.episodes

    @property
    def total(self) -> int:
        return self.from_prompts if self.max_steps is None else min(self.from_prompts, self.max_steps)

    def describe(self) -> str:
        """One line: the count, the arithmetic, and what to change when --max_steps is not reached."""
        episodes = f"{self.episodes} episode{'s' if self.episodes != 1 else ''}"
        why = f"{self.prompts} prompts / {self.per_step} per step x {episodes}"
        left = self.prompts % self.per_step
        if left:
            why += f" ({left} prompts left out of each episode: a step takes a whole --rollout_batch_size)"
        if self.max_steps is None:
            line = f"steps: {self.total} = {why}"
        elif self.max_steps < self.from_prompts:
            line = (
                f"steps: {self.total} (--max_steps {self.max_steps} ends the run before the prompts do: "
                f"{self.from_prompts} = {why})"
            )
        elif self.max_steps == self.from_prompts:
            line = f"steps: {self.total} = {why} (= --max_steps {self.max_steps})"
        else:
            need = -(-self.max_steps // self.per_episode)
            line = (
                f"steps: {self.total} = {why} (--max_steps {self.max_steps} is not reached: it only ends a run "
                f"early; raise --num_episodes to {need} or add prompts)"
            )
        updates = f"{self.updates_per_step} optimizer update{'s' if self.updates_per_step != 1 else ''}"
        return (
            f"{line}; each step {updates} ({self.samples_per_step} samples / --train_batch_size "
            f"{self.train_batch_size} x --max_epochs {self.max_epochs})"
        )


def step_count(rollout: RolloutSettings, prompts: int) -> StepCount:
    """How many steps ``prompts`` prompts make under the rollout section ``rollout`` (the loop runs exactly
    ``.total``)."""
    if prompts < rollout.rollout_batch_size:
        raise ConfigError(
            "rollout_batch_size",
            f"only {prompts} prompts, fewer than one rollout batch ({rollout.rollout_batch_size}).",
            "Lower --rollout_batch_size or give more prompts.",
        )
    samples = rollout.samples_per_step
    return StepCount(
        prompts,
        rollout.rollout_batch_size,
        rollout.num_episodes,
        rollout.max_steps,
        samples // rollout.train_batch_size * rollout.max_epochs,
        samples,
        rollout.train_batch_size,
        rollout.max_epochs,
    )


# ---- several datasets (which ones and their weights: :mod:`.prompt_sources`) -------------------------------------
def interleave(groups: Sequence[Sequence[Any]], weights: Sequence[float], *, seed: int) -> list[Any]:
    """Draw each item's dataset with ``weights``; a dataset that runs out starts over, until every dataset has been
    seen whole (OpenRLHF's ``interleave_datasets(..., stopping_strategy="all_exhausted")``)."""
    rng = random.Random(seed)
    positions = [0] * len(groups)
    unseen = {i for i, g in enumerate(groups) if g}
    order = list(range(len(groups)))
    out = []
    while unseen:
        i = rng.choices(order, weights=weights)[0]
        group = groups[i]
        if not group:
            continue
        out.append(group[positions[i] % len(group)])
        positions[i] += 1
        if positions[i] >= len(group):
            unseen.discard(i)
    return out


# ---- Hugging Face ids from the local cache ---------------------------------------------------------------------------
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".py")


def hub_cache_dir() -> str:
    """Where huggingface_hub keeps downloads: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(explicit)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(home), "hub")


def looks_like_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and not value.lower().endswith(_DATA_SUFFIXES) and not os.path.exists(value)


def cached_snapshot(repo_id: str, kind: str) -> tuple[str | None, str]:
    """(the local snapshot folder of ``repo_id`` in the Hugging Face cache or None, the cache folder looked in).

    The cache holds ``{models,datasets}--ORG--NAME/refs/main`` (the commit) and ``snapshots/<commit>/`` (the files);
    without refs/main the newest snapshot is taken."""
    repo_dir = os.path.join(hub_cache_dir(), f"{kind}s--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo_dir, "snapshots")
    ref = os.path.join(repo_dir, "refs", "main")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
        if os.path.isdir(os.path.join(snapshots, commit)):
            return os.path.join(snapshots, commit), repo_dir
    if os.path.isdir(snapshots):
        found = sorted((os.path.join(snapshots, d) for d in os.listdir(snapshots)), key=os.path.getmtime)
        if found:
            return found[-1], repo_dir
    return None, repo_dir


def resolve_local_paths(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Model and dataset ids (``org/name``) in ``values`` replaced by their folders in the local Hugging Face cache.

    Returns the changed settings and a note per id. An id that is not cached is a ConfigError naming the cache folder
    (nothing is downloaded at run time)."""
    changes: dict[str, Any] = {}
    notes: list[str] = []
    for name in ("pretrain", "reward_pretrain", "critic_pretrain", "teacher_pretrain"):
        value = values.get(name)
        if isinstance(value, str) and looks_like_hub_id(value):
            path = _from_cache(name, value, "model")
            changes[name] = path
            notes.append(f"--{name} {value}: the Hugging Face cache's copy at {path}")
    for field in ("prompt_data", "eval_dataset"):  # the evaluation's prompts are read like the training's
        data = values.get(field)
        if not isinstance(data, str):
            continue
        parts = []
        for part in (p.strip() for p in data.split(",")):
            name, at, sub = part.partition("@")
            if looks_like_hub_id(name):
                path = _from_cache(field, name, "dataset")
                notes.append(f"--{field} {name}: the Hugging Face cache's copy at {path}")
                part = f"{path}{at}{sub}"
            parts.append(part)
        if ",".join(parts) != data:
            changes[field] = ",".join(parts)
    return changes, notes


def _from_cache(field: str, repo_id: str, kind: str) -> str:
    path, looked = cached_snapshot(repo_id, kind)
    if path is None:
        what = "model" if kind == "model" else "dataset"
        raise ConfigError(
            field,
            f"{repo_id!r} is not a local path, and the Hugging Face cache has no {what} of that "
            f"name (looked for {looked}); {what}s are not downloaded at run time.",
            f"Download it once where there is network access (`hf download {repo_id}"
            f"{' --repo-type dataset' if kind == 'dataset' else ''}`, into the same cache or "
            "HF_HOME), or give a local folder.",
        )
    return path


def synthetic_prompts(
    rollout: RolloutSettings, task: SyntheticTask | LookupTask, tokenizer: Any | None = None
) -> tuple[list[Prompt], PromptStats]:
    """``task``'s prompts: enough for ``max_steps`` steps (or SYNTHETIC_PROMPTS), capped by max_samples."""
    if tokenizer is not None:
        _check_task_vocab(tokenizer, task.num_symbols)
    wanted = rollout.rollout_batch_size * rollout.max_steps if rollout.max_steps else SYNTHETIC_PROMPTS
    count = min(rollout.max_samples, max(wanted, rollout.rollout_batch_size))
    prompts = task.prompts(count, seed=rollout.seed)
    longest = max(len(p.prompt_ids) for p in prompts)
    if longest > rollout.prompt_max_len:
        raise ConfigError(
            "prompt_max_len",
            f"the built-in task's prompts are {longest} tokens, more than prompt_max_len={rollout.prompt_max_len}.",
            f"Use --prompt_max_len {longest} or more.",
        )
    return prompts, PromptStats(f"built-in task {task.name!r}", count, count, 0, rollout.prompt_max_len)


def _check_task_vocab(tokenizer: Any, num_symbols: int) -> None:
    """The built-in tasks speak the tiny model's vocabulary; another model's tokenizer would score garbage."""
    want = {"<bos>": BOS, "<sep>": SEP, "s0": FIRST_SYMBOL_ID, f"s{num_symbols - 1}": FIRST_SYMBOL_ID + num_symbols - 1}
    got = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in want}
    if got != want:
        raise ConfigError(
            "prompt_data",
            "the built-in tasks use the tiny demo model's vocabulary, which this --pretrain tokenizer does not have.",
            "Give your own prompts with --prompt_data FILE --input_key KEY (and a reward), "
            "or drop --pretrain to train the demo model.",
        )


# ---- reading records ---------------------------------------------------------------------------------------------
def read_records(path: str, *, split: str = "train", given: str | None = None) -> list[dict[str, Any]]:
    """All records of a JSONL/JSON/Parquet file, a ``datasets`` folder, or a folder of such files (sorted)."""
    if not os.path.exists(path):
        raise ConfigError(
            "prompt_data",
            f"no file or folder at {path!r}"
            + (f" (from {given!r})" if given and given != path else "")
            + " (datasets are not downloaded at run time).",
            "Give a local JSONL/Parquet file or a datasets folder (Dataset.save_to_disk).",
        )
    records = _read_folder(path, split) if os.path.isdir(path) else _read_file(path)
    if not records:
        raise ConfigError("prompt_data", f"{path!r} holds no records.", "Point --prompt_data at a non-empty dataset.")
    return records


def _read_file(path: str) -> list[dict[str, Any]]:
    lower = path.lower()
    if lower.endswith(".parquet"):
        return _read_parquet(path)
    if lower.endswith(".json"):
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _not_utf8(path, e) from None
        if text.lstrip().startswith("["):
            try:
                records = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError("prompt_data", f"{path!r} is not valid JSON: {e}.") from None
            return _check_dicts(records, path)
    if lower.endswith((".jsonl", ".json")):
        return _read_jsonl(path)
    raise ConfigError(
        "prompt_data",
        f"cannot tell the format of {path!r} from its name.",
        "Use a .jsonl, .json or .parquet file, or a datasets folder.",
    )


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    records = []
    with open(path, "rb") as f:  # decoded line by line: a byte that is not UTF-8 is named with its line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(path, e, f"line {lineno}, ") from None
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(
                    "prompt_data",
                    f"{path!r} line {lineno} is not valid JSON: {e.msg}.",
                    "Write one JSON object per line.",
                ) from None
    return _check_dicts(records, path)


def _not_utf8(path: str, e: UnicodeDecodeError, where: str = "") -> ConfigError:
    return ConfigError(
        "prompt_data",
        f"{path!r} is not UTF-8 text: {where}byte {e.start + 1} "
        f"({e.object[e.start : e.start + 1]!r}) cannot be decoded.",
        "Save it as UTF-8 (e.g. iconv -f latin1 -t utf-8 in.jsonl > out.jsonl).",
    )


def _check_dicts(records: Any, path: str) -> list[dict[str, Any]]:
    if not isinstance(records, list):
        raise ConfigError("prompt_data", f"{path!r} must hold a list of records (JSON objects).")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ConfigError("prompt_data", f"record {i} of {path!r} is a {type(record).__name__}, not a JSON object.")
    return records


def _read_parquet(path: str) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            "prompt_data", f"reading the Parquet file {path!r} needs pyarrow, which is not installed.", DATA_EXTRA
        ) from None
    return pq.read_table(path).to_pylist()


def _read_folder(path: str, split: str) -> list[dict[str, Any]]:
    if any(
        os.path.exists(os.path.join(path, marker))
        for marker in ("dataset_info.json", "state.json", "dataset_dict.json")
    ):
        return _read_saved_dataset(path, split)
    files = _data_files(path)
    if not files:
        raise ConfigError(
            "prompt_data",
            f"the folder {path!r} is neither a datasets folder (save_to_disk) nor holds .jsonl/.json/.parquet files.",
            "Point --prompt_data at a data file or a datasets folder.",
        )
    # A hub-style folder (data/train-0000.parquet, data/test-....parquet): keep the split's files when named so.
    in_split = [f for f in files if split in os.path.basename(f)]
    records: list[dict[str, Any]] = []
    for f in in_split or files:
        records.extend(_read_file(f))
    return records


def _data_files(path: str) -> list[str]:
    """The data files under ``path`` (sorted; hidden ones left out, as glob does), each read once: a linked folder
    is followed the first time it is met only -- a link back up (a loop) made glob list the same files once per
    level until the path was too long (41 times)."""
    seen: set[str] = set()
    files: dict[str, str] = {}  # real path -> the path it was first found under
    for folder, dirs, names in os.walk(path, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if not name.startswith(".") and name.lower().endswith(_FILE_SUFFIXES):
                files.setdefault(os.path.realpath(os.path.join(folder, name)), os.path.join(folder, name))
    return sorted(files.values())


def _read_saved_dataset(path: str, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "prompt_data",
            f"{path!r} is a datasets folder; reading it needs the datasets package, which is not installed.",
            DATA_EXTRA,
        ) from None
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(
                "prompt_split",
                f"{path!r} has no split {split!r}; it has: {', '.join(loaded)}.",
                f"Use --prompt_split {next(iter(loaded))}.",
            )
        loaded = loaded[split]
    return loaded.to_list()


# ---- encoding ----------------------------------------------------------------------------------------------------
def encode_records(
    records: Sequence[dict[str, Any]],
    tokenizer: Any,
    *,
    input_key: str,
    label_key: str | None = None,
    apply_chat_template: bool = False,
    prompt_max_len: int = 1024,
    source: str = "prompt_data",
    input_template: str | None = None,
) -> tuple[list[Prompt], int]:
    """Token ids of every record's prompt; returns the prompts and how many were dropped for length."""
    _check_key("input_key", input_key, records, source)
    if label_key:
        _check_key("label_key", label_key, records, source)
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "apply_chat_template",
            "the tokenizer has no chat template.",
            "Drop --apply_chat_template, or use a model folder whose tokenizer_config.json has a chat_template.",
        )
    prompts, dropped = [], 0
    for i, record in enumerate(records):
        value = record[input_key]
        text = _render(value, tokenizer, apply_chat_template, i, input_key, source)
        if input_template and not apply_chat_template:
            text = apply_input_template(input_template, text)
        ids = list(tokenizer(text, add_special_tokens=not apply_chat_template)["input_ids"])
        if len(ids) > prompt_max_len:
            dropped += 1
            continue
        if not ids:
            raise ConfigError("input_key", f"record {i} of {source!r} has an empty prompt in {input_key!r}.")
        prompts.append(Prompt(ids, text, label=record[label_key] if label_key else None))
    if not prompts:
        raise ConfigError(
            "prompt_max_len",
            f"all {len(records)} prompts of {source!r} are longer than prompt_max_len={prompt_max_len} tokens.",
            "Raise --prompt_max_len.",
        )
    return prompts, dropped


def _check_key(flag: str, key: str, records: Sequence[dict[str, Any]], source: str) -> None:
    for i, record in enumerate(records):
        if key not in record:
            keys = ", ".join(sorted(record)) or "(none)"
            raise ConfigError(
                flag,
                f"record {i} of {source!r} has no key {key!r}; its keys are: {keys}.",
                f"Use --{flag} with one of those keys.",
            )


def _render(value: Any, tokenizer: Any, apply_chat_template: bool, index: int, key: str, source: str) -> str:
    is_messages = isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    if apply_chat_template:
        if isinstance(value, str):
            value = [{"role": "user", "content": value}]
        elif not is_messages or not value:
            raise ConfigError(
                "input_key",
                f"record {index} of {source!r}: {key!r} is neither a string nor a list of "
                "chat messages ({'role': ..., 'content': ...}).",
            )
        return tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True)
    if is_messages:
        raise ConfigError(
            "apply_chat_template",
            f"{key!r} in {source!r} holds chat messages, not text.",
            "Add --apply_chat_template to render them with the tokenizer's chat template.",
        )
    if not isinstance(value, str):
        raise ConfigError(
            "input_key",
            f"record {index} of {source!r}: {key!r} is a {type(value).__name__}, not text.",
            "Point --input_key at a text field (or a list of chat messages with --apply_chat_template).",
        )
    return value
