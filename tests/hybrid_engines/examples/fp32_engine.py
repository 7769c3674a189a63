"""An engine of your own in one file: the built-in engine, always in float32, decoding at most 8 rows at a time.

A run in bf16 may still want its samples' log-probs in float32 (the mismatch correction compares them with the
trainer's); this engine gives that, and bounds its decoding batch so its KV cache stays small. Everything the
training loop needs to know about it is here: how to build it from the run's settings (``engine_kwargs``); what it
refuses (``check_settings``: the built-in engine's, one GPU per engine), its weight-sync transport and its limits are
the built-in engine's. One line registers it (``register_engine("hf-fp32", "fp32_engine:Fp32HFEngine")``, see
test_example_engine.py), and ``--backend hf-fp32`` then runs it; no file of hybrid names it.
"""

from __future__ import annotations

from typing import Any

from hybrid_engines.adapter import EnginePlan, EngineSettings
from hybrid_engines.hf_engine import HFEngine


class Fp32HFEngine(HFEngine):
    """The built-in engine in float32 whatever the run's precision, ``MAX_ROWS`` rows decoded together."""

    MAX_ROWS = 8

    @classmethod
    def engine_kwargs(cls, settings: EngineSettings, plan: EnginePlan) -> dict[str, Any]:
        return {
            "model": plan.model_path,
            "seed": settings.seed,
            "trust_remote_code": settings.trust_remote_code,
            "dtype": "float32",
            "max_batch_size": cls.MAX_ROWS,
        }
