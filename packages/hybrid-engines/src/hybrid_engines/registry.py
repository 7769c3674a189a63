"""The engines by name: one line per backend. ``import hybrid_engines`` never imports vLLM or SGLang.

Each line names the adapter module and class, the library it drives and the pip extra that installs it. An adapter
class carries what the rest of hybrid needs to know about its engine, so adding an engine is one adapter file and
one line here: ``weight_transport()`` (the trainer's side of its weight sync), and optionally ``NEEDS_GPU`` and
``placement_refusal(tp=, shares_gpus=)`` (placements the training loop must refuse before Ray starts).

Adapter modules import their library only when an engine is built, so :func:`engine_spec` (the class, for plans and
dry runs) works where the library is missing; :func:`engine_class` / :func:`make_engine` need it, and a missing one
is a :class:`ConfigError` that names the pip extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

from hybrid_core.errors import ConfigError


@dataclass(frozen=True)
class Backend:
    module: str  # the adapter module
    cls: str  # the engine class in it
    library: str | None = None  # the package it drives (None: nothing beyond hybrid's own dependencies)
    extra: str | None = None  # what to pip install for it


#: backend name -> where its adapter lives. The training config's ``--backend`` choices come from here.
BACKENDS: dict[str, Backend] = {
    "hf": Backend("hybrid_engines.hf_engine", "HFEngine"),
    "vllm": Backend("hybrid_engines.vllm_engine", "VLLMEngine", "vllm", "hybrid-engines[vllm]"),
    "sglang": Backend("hybrid_engines.sglang_engine", "SGLangEngine", "sglang", "hybrid-engines[sglang]"),
}


def backend_names() -> tuple[str, ...]:
    """Every registered backend name, in registration order."""
    return tuple(BACKENDS)


def _backend(backend: str) -> Backend:
    if backend not in BACKENDS:
        raise ConfigError("backend", f"unknown inference backend {backend!r}.", f"Use one of {list(BACKENDS)}.")
    return BACKENDS[backend]


def engine_spec(backend: str) -> type:
    """The engine class of ``backend`` without requiring its library (its module imports it lazily): for plans,
    weight-sync choices and dry runs."""
    entry = _backend(backend)
    return getattr(importlib.import_module(entry.module), entry.cls)


def library_missing(backend: str) -> str | None:
    """None when ``backend``'s library is installed here, else what to do about it."""
    entry = _backend(backend)
    if entry.library is None or importlib.util.find_spec(entry.library) is not None:
        return None
    return f"the {backend} backend needs the {entry.library!r} package: pip install '{entry.extra}'"


def engine_class(backend: str) -> type:
    """The engine class of ``backend``, importing its library now (a missing one is a ConfigError)."""
    entry = _backend(backend)
    if entry.library is not None:
        try:
            importlib.import_module(entry.library)
        except ImportError as e:
            raise ConfigError("backend", f"the {backend} backend needs the {entry.library!r} package, which cannot be "
                              f"imported here ({e}).", f"pip install '{entry.extra}' (or choose backend 'hf').") from e
    return engine_spec(backend)


def make_engine(backend: str = "hf", **kwargs: Any):
    """An engine of ``backend`` built with ``kwargs`` (each backend documents its own; all take ``model``)."""
    return engine_class(backend)(**kwargs)
