"""The engines by name: one line per backend. ``import hybrid_engines`` never imports vLLM or SGLang.

Each line names the adapter module and class, the library it drives and the pip extra that installs it. An adapter
class (:class:`~hybrid_engines.adapter.EngineAdapter`) carries what the rest of hybrid needs to know about its
engine -- ``check_settings(settings)`` (called by :func:`validate_settings`), ``engine_kwargs(settings, plan)``,
``weight_transport()``, ``NEEDS_GPU``, ``placement_refusal(tp=, shares_gpus=)`` -- so adding an engine is one adapter
file and one line: here, or :func:`register_engine` from your own code (a ``--plugins`` file, a test), which also
reaches the engine actors.

Adapter modules import their library only when an engine is built, so :func:`engine_spec` (the class, for plans and
dry runs) works where the library is missing; :func:`engine_class` / :func:`make_engine` need it, and a missing one
is a :class:`ConfigError` that names the pip extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_core.errors import ConfigError

if TYPE_CHECKING:
    from .adapter import EngineAdapter, EngineSettings


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


_BUILT_IN = tuple(BACKENDS)
#: The backends :func:`register_engine` added in the driver, as every Ray worker started afterwards sees them (an
#: engine actor looks its backend up by name in a process of its own).
ENV = "HYBRID_ENGINE_BACKENDS"


def register_engine(name: str, target: str, *, library: str | None = None, extra: str | None = None) -> None:
    """Add the backend ``name``: ``target`` is ``"module:Class"``, an adapter class importable by module name in
    every process that builds the engine (``library`` / ``extra``: the package it needs and what installs it).

    Registering the same line again does nothing; another target under a name already taken is refused."""
    module, _, cls = target.partition(":")
    if not isinstance(name, str) or not name.strip() or not module or not cls.isidentifier():
        raise ConfigError(
            "backend",
            f"register_engine({name!r}, {target!r}): needs a name and 'module:Class'.",
            "E.g. register_engine('my-engine', 'my_pkg.my_engine:MyEngine').",
        )
    entry = Backend(module, cls, library, extra)
    known = BACKENDS.get(name)
    if known is not None and known != entry:
        raise ConfigError(
            "backend",
            f"backend {name!r} is {known.module}:{known.cls} already.",
            "Register your engine under another name.",
        )
    BACKENDS[name] = entry
    from hybrid_core.runtime_env import set_worker_env

    added = {n: [e.module, e.cls, e.library, e.extra] for n, e in BACKENDS.items() if n not in _BUILT_IN}
    set_worker_env({ENV: json.dumps(added)})


def backend_names() -> tuple[str, ...]:
    """Every registered backend name, in registration order."""
    return tuple(BACKENDS)


def _backend(backend: str) -> Backend:
    if backend not in BACKENDS and os.environ.get(ENV):  # a Ray worker: the driver's registrations
        for name, fields in json.loads(os.environ[ENV]).items():
            BACKENDS.setdefault(name, Backend(*fields))
    if backend not in BACKENDS:
        raise ConfigError("backend", f"unknown inference backend {backend!r}.", f"Use one of {list(BACKENDS)}.")
    return BACKENDS[backend]


def engine_spec(backend: str) -> type[EngineAdapter]:
    """The engine class of ``backend`` without requiring its library (its module imports it lazily): for plans,
    weight-sync choices and dry runs."""
    from .adapter import EngineAdapter

    entry = _backend(backend)
    cls = getattr(importlib.import_module(entry.module), entry.cls)
    if not (isinstance(cls, type) and issubclass(cls, EngineAdapter)):
        raise ConfigError(
            "backend",
            f"backend {backend!r} names {entry.module}:{entry.cls}, which is not an engine adapter.",
            "Derive the class from hybrid_engines.adapter.EngineAdapter.",
        )
    return cls


def validate_settings(settings: EngineSettings) -> EngineSettings:
    """Every check of the run's engine section made before anything starts, naming ``engine.<field>``: a
    registered backend, the settings' own (:meth:`~hybrid_engines.adapter.EngineSettings.validate`), then what the
    backend's adapter refuses (its ``check_settings``). Returns ``settings``."""
    names = backend_names()
    if settings.backend not in names:
        raise ConfigError(
            "engine.backend",
            f"{settings.backend!r} is not one of {', '.join(names)}.",
            "engine.backend hf runs anywhere; vllm/sglang need the extras.",
        )
    engine_spec(settings.backend).check_settings(settings.validate())
    return settings


def library_missing(backend: str) -> str | None:
    """None when ``backend``'s library is installed here, else what to do about it."""
    entry = _backend(backend)
    if entry.library is None or importlib.util.find_spec(entry.library) is not None:
        return None
    return f"the {backend} backend needs the {entry.library!r} package: pip install '{entry.extra}'"


def engine_class(backend: str) -> type[EngineAdapter]:
    """The engine class of ``backend``, importing its library now (a missing one is a ConfigError)."""
    entry = _backend(backend)
    if entry.library is not None:
        try:
            importlib.import_module(entry.library)
        except ImportError as e:
            raise ConfigError(
                "backend",
                f"the {backend} backend needs the {entry.library!r} package, which cannot be imported here ({e}).",
                f"pip install '{entry.extra}' (or choose backend 'hf').",
            ) from e
    return engine_spec(backend)


def make_engine(backend: str = "hf", **kwargs: Any):
    """An engine of ``backend`` built with ``kwargs`` (each backend documents its own; all take ``model``)."""
    return engine_class(backend)(**kwargs)
