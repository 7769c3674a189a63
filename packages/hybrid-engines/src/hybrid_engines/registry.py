"""Build an inference engine by backend name, importing heavy backends only when asked for.

``import hybrid_engines`` never imports vLLM or SGLang: each adapter module is imported the first time its backend is
made, and a missing library becomes a :class:`ConfigError` that names the pip extra to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from hybrid_core.errors import ConfigError

#: backend name -> (module, class, the library it needs, pip extra)
BACKENDS: dict[str, tuple[str, str, str | None, str | None]] = {
    "hf": ("hybrid_engines.hf_engine", "HFEngine", None, None),
    "vllm": ("hybrid_engines.vllm_engine", "VLLMEngine", "vllm", "hybrid-engines[vllm]"),
    "sglang": ("hybrid_engines.sglang_engine", "SGLangEngine", "sglang", "hybrid-engines[sglang]"),
}


def engine_class(backend: str) -> type:
    """The engine class of ``backend`` ("hf", "vllm" or "sglang"), importing its module now."""
    if backend not in BACKENDS:
        raise ConfigError("backend", f"unknown inference backend {backend!r}.", f"Use one of {sorted(BACKENDS)}.")
    module_name, class_name, library, extra = BACKENDS[backend]
    if library is not None:
        try:
            importlib.import_module(library)
        except ImportError as e:
            raise ConfigError("backend", f"the {backend} backend needs the {library!r} package, which cannot be "
                              f"imported here ({e}).", f"pip install '{extra}' (or choose backend 'hf').") from e
    module = importlib.import_module(module_name)
    return getattr(module, class_name)


def make_engine(backend: str = "hf", **kwargs: Any):
    """An engine of ``backend`` built with ``kwargs`` (each backend documents its own; all take ``model``)."""
    return engine_class(backend)(**kwargs)
