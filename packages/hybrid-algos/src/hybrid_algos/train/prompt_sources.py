"""The datasets ``--prompt_data`` names and their weights (``--prompt_data_probs``): what they are, and that they exist.

Below :mod:`.data` (which reads them) and :mod:`.rollout_settings` (whose check calls :func:`check_prompt_sources`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hybrid_core.errors import ConfigError


@dataclass(frozen=True)
class Source:
    """One dataset of --prompt_data: what was given, and the local path it is read from."""

    given: str
    path: str


def split_sources(prompt_data: str) -> list[Source]:
    """``a,b@sub`` -> the datasets to read (``name@subfolder`` reads a subfolder, as in OpenRLHF)."""
    out = []
    for part in (p.strip() for p in prompt_data.split(",")):
        if not part:
            raise ConfigError(
                "prompt_data",
                f"{prompt_data!r} has an empty entry.",
                "Separate datasets with single commas: --prompt_data a.jsonl,b.jsonl.",
            )
        path, _, sub = part.partition("@")
        out.append(Source(part, os.path.join(path, sub) if sub else path))
    return out


def parse_probs(probs: str | None, count: int) -> list[float] | None:
    """--prompt_data_probs: one positive weight per dataset (normalised), or None to concatenate."""
    if probs is None:
        return None
    try:
        weights = [float(w) for w in str(probs).split(",")]
    except ValueError:
        raise ConfigError(
            "prompt_data_probs",
            f"expected comma-separated numbers, got {probs!r}.",
            "E.g. --prompt_data_probs 0.7,0.3.",
        ) from None
    if len(weights) != count:
        raise ConfigError(
            "prompt_data_probs",
            f"{len(weights)} weights for {count} dataset(s) of --prompt_data.",
            "Give one weight per dataset, in the same order.",
        )
    if any(not (w > 0) or w == float("inf") for w in weights):
        raise ConfigError(
            "prompt_data_probs",
            f"every weight must be a positive number, got {probs!r}.",
            "Drop a dataset from --prompt_data instead of giving it weight 0.",
        )
    total = sum(weights)
    return [w / total for w in weights]


def check_prompt_sources(prompt_data: str, probs: str | None = None) -> None:
    """Every dataset of --prompt_data exists locally (ids are resolved before, see resolve_local_paths)."""
    sources = split_sources(prompt_data)
    for source in sources:
        if not os.path.exists(source.path):
            raise ConfigError(
                "prompt_data",
                f"no file or folder at {source.path!r}"
                + (f" (from {prompt_data!r})" if len(sources) > 1 else "")
                + ".",
                "Give local JSONL/Parquet files or datasets folders, or Hugging Face ids already in the local cache.",
            )
    parse_probs(probs, len(sources))
