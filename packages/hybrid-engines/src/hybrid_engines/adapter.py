"""What an engine class tells the rest of hybrid before any engine exists: its settings' checks, its constructor's
arguments, its weight-sync transport and its limits.

Adding an engine is one adapter file (a class deriving :class:`EngineAdapter`) plus one registry line
(:func:`hybrid_engines.registry.register_engine`, or a line in ``registry.BACKENDS``). The training loop never names
an engine: it validates the run's :class:`EngineSettings` with ``engine_spec(backend).check_settings(settings)``
(at config time) and builds every engine with ``engine_spec(backend).engine_kwargs(settings, plan)``
(:class:`EnginePlan`: what the loop knows once the run is planned). Nothing here imports torch or an engine library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_core.errors import ConfigError

if TYPE_CHECKING:
    from .weight_sync.transport import WeightTransport


@dataclass(frozen=True)
class EngineSettings:
    """The run's engine section, in the engines' own words (the training config maps its flags onto these:
    ``RLConfig.engine_settings()``)."""

    backend: str = "hf"  # the registry name the run asked for
    num_engines: int = 1  # engines of the rollout role; 0: one built-in engine on each actor GPU
    tensor_parallel_size: int = 1  # GPUs per engine
    gpu_memory_utilization: float = 0.5  # the share of its GPU an engine with a memory pool takes at start-up
    enforce_eager: bool = False  # no CUDA graphs
    enable_prefix_caching: bool = True
    bf16: bool = True  # the run computes in bf16 (each engine picks its dtype from it)
    seed: int = 0
    trust_remote_code: bool = False  # let the model folder's own code run


@dataclass(frozen=True)
class EnginePlan:
    """What the training loop knows about the engines it is about to start."""

    model_path: str  # the weights they load at start-up (synced from the trainer afterwards)
    max_model_len: int | None = None  # the longest sequence a rollout can make (prompt + completion)
    shares_gpus: bool = False  # a trainer shares the engines' GPUs: the residency plan may free their memory
    seeded_sampling: bool = False  # every sample carries a seed of its own
    partial_rollout: bool = False  # weight updates may land while a generation is in flight (pause / resume)


class EngineAdapter:
    """The class-level side of an engine (an adapter class derives from it; instances are the engines).

    Class attributes the loop and the planner read: ``NEEDS_GPU`` (it serves from CUDA devices only),
    ``MEMORY_POOL`` (it takes ``gpu_memory_utilization`` of its GPU at start-up: the dry run's memory model),
    ``CHEAP_SEEDED_SAMPLING`` (a seed per sample costs nothing: ``--seeded_sampling``'s default), and for engines
    that open ports, ``PORTS_NEEDED`` / ``PORT_ENV`` (:func:`hybrid_core.ports.engine_windows`)."""

    NEEDS_GPU = False
    MEMORY_POOL = False
    CHEAP_SEEDED_SAMPLING = False

    @classmethod
    def check_settings(cls, settings: EngineSettings) -> None:
        """Refuse, as a :class:`ConfigError` naming the flag and the fix, settings this engine cannot run (called
        by the config's validation, before anything starts). By default: one engine on each actor GPU without a
        count (``--vllm_num_engines 0``) is the built-in engine's alone."""
        if settings.num_engines == 0:
            raise ConfigError(
                "vllm_num_engines",
                f"0 engines means generating on the actor's GPUs with the built-in "
                f"engine, but --backend is {settings.backend}.",
                "Use --backend hf, or give --vllm_num_engines N for N separate engines.",
            )

    @classmethod
    def engine_kwargs(cls, settings: EngineSettings, plan: EnginePlan) -> dict[str, Any]:
        """The constructor's keyword arguments for every engine of the run (``launch_engines`` adds the placement's:
        GPUs, placement group, ports)."""
        raise NotImplementedError(
            f"{cls.__name__} does not say how the training loop builds it: give it an "
            "engine_kwargs(settings, plan) classmethod."
        )

    @classmethod
    def weight_transport(cls) -> WeightTransport:
        """The trainer's side of this engine's weight sync; by default hybrid-core's own format (what
        ``hybrid_core.weight_sync.WeightReceiver`` / ``load_ipc_bucket`` receive)."""
        from .weight_sync.transport import WeightTransport

        return WeightTransport()

    @classmethod
    def placement_refusal(cls, *, tp: int, shares_gpus: bool) -> str | None:
        """Why the training loop cannot place these engines (tensor-parallel size ``tp``; ``shares_gpus``: with a
        trainer on their GPUs), checked before Ray starts; None: it can."""
        return None


def pooled_engine_kwargs(settings: EngineSettings, plan: EnginePlan) -> dict[str, Any]:
    """The arguments every engine with a memory pool of its own takes, under vLLM's names (the SGLang adapter maps
    them to its server arguments): every engine setting, with or without partial rollouts (the planner budgeted
    these values)."""
    kwargs: dict[str, Any] = {
        "model": plan.model_path,
        "seed": settings.seed,
        "trust_remote_code": settings.trust_remote_code,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "dtype": "bfloat16" if settings.bf16 else "auto",
        "max_model_len": plan.max_model_len,
        # sleep mode (the engine's own allocator) whenever the engines share a GPU: the residency plan may free
        # their KV cache or weights, and a refined plan may start to
        "enable_sleep_mode": plan.shares_gpus,
    }
    if plan.partial_rollout:  # only adds: generation goes through the adapters' pausable paths
        kwargs["pausable"] = True
    return kwargs
