"""hybrid_engines: one inference-engine protocol with built-in (transformers), vLLM and SGLang backends.

Importing this package is light: the protocol types are imported eagerly; engines, the registry and the Ray helpers
on first use (``hybrid_engines.HFEngine`` and friends resolve lazily), and vLLM / SGLang only when their backend is
made.
"""

from __future__ import annotations

from typing import Any

from .protocol import GenerationOutput, InferenceEngine, MultimodalInput, PausableEngine, SamplingParams

__version__ = "0.1.0"

_LAZY = {
    "HFEngine": "hybrid_engines.hf_engine",
    "EngineStateError": "hybrid_engines.hf_engine",
    "make_engine": "hybrid_engines.registry",
    "engine_class": "hybrid_engines.registry",
    "register_engine": "hybrid_engines.registry",
    "EngineAdapter": "hybrid_engines.adapter",
    "EngineActor": "hybrid_engines.ray_engines",
    "EngineGroup": "hybrid_engines.ray_engines",
    "launch_engines": "hybrid_engines.ray_engines",
}

__all__ = [
    "GenerationOutput",
    "InferenceEngine",
    "MultimodalInput",
    "PausableEngine",
    "SamplingParams",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hybrid_engines' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
