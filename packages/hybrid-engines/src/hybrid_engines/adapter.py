"""What an engine class tells the rest of hybrid before any engine exists: its settings' checks, its constructor's
arguments, its weight-sync transport and its limits.

Adding an engine is one adapter file (a class deriving :class:`EngineAdapter`) plus one registry line
(:func:`hybrid_engines.registry.register_engine`, or a line in ``registry.BACKENDS``). The training loop never names
an engine: it validates the run's :class:`EngineSettings` with :func:`hybrid_engines.registry.validate_settings`
(at config time: :meth:`EngineSettings.validate`, then ``engine_spec(backend).check_settings(settings)``) and builds
every engine with ``engine_spec(backend).engine_kwargs(settings, plan)`` (:class:`EnginePlan`: what the loop knows once
the run is planned). Nothing here imports torch or an engine library.
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
    ``RLConfig.engine_settings()``). Its errors name these settings as ``engine.<field>``; the training config says
    them in its flags' words."""

    backend: str = "hf"  # the registry name the run asked for
    num_engines: int = 1  # engines of the rollout role; 0: one built-in engine on each actor GPU
    tensor_parallel_size: int = 1  # GPUs per engine
    gpu_memory_utilization: float = 0.5  # the share of its GPU an engine with a memory pool takes at start-up
    enforce_eager: bool = False  # no CUDA graphs
    enable_prefix_caching: bool = True
    bf16: bool = True  # the run computes in bf16 (each engine picks its dtype from it)
    seed: int = 0
    trust_remote_code: bool = False  # let the model folder's own code run
    sleep: bool | None = None  # engines sleep between generations; None: the residency plan decides
    sleep_level: int | None = None  # when engine weights leave: 1 to host memory, 2 discarded; None: the planner's
    seeded_sampling: bool | None = None  # a seed per sample; None: where the engine says it is cheap (seeds_samples)

    def validate(self) -> EngineSettings:
        """Refuse, as a :class:`ConfigError` naming the setting and the fix, what no engine can run; return self.
        What the backend itself refuses is its adapter's (``check_settings``): both, and a registered backend, are
        checked by :func:`hybrid_engines.registry.validate_settings` (the registry imports this module, so the
        lookup cannot live here)."""
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(
                "engine.tensor_parallel_size",
                f"must be a positive integer, got {tp!r}.",
                "Give engine.tensor_parallel_size a whole number >= 1.",
            )
        count = self.num_engines
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(
                "engine.num_engines",
                f"must be a whole number >= 0, got {count!r}.",
                "Give the number of engines; 0 puts a built-in engine on each actor GPU.",
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                "engine.gpu_memory_utilization",
                f"must be in (0, 1], got {self.gpu_memory_utilization}.",
                "It is a fraction of the GPU, e.g. engine.gpu_memory_utilization 0.5.",
            )
        if self.sleep_level not in (None, 1, 2):
            raise ConfigError(
                "engine.sleep_level",
                f"must be 1 or 2, got {self.sleep_level}.",
                "1 keeps the weights in host memory, 2 discards them; use engine.sleep_level 1.",
            )
        return self


@dataclass(frozen=True)
class EnginePlan:
    """What the training loop knows about the engines it is about to start."""

    model_path: str  # the weights they load at start-up (synced from the trainer afterwards)
    max_model_len: int | None = None  # the longest sequence a rollout can make (prompt + completion)
    shares_gpus: bool = False  # a trainer shares the engines' GPUs: the residency plan may free their memory
    seeded_sampling: bool = False  # every sample carries a seed of its own (the adapter's seeds_samples(settings))
    partial_rollout: bool = False  # weight updates may land while a generation is in flight (pause / resume)
    # adapter-only sync: the engines apply this LoRA adapter (a weight_sync.adapter.AdapterSpec; None: full weights)
    lora: Any = None
    max_images_per_prompt: int = 0  # the most images one prompt holds (0: text); engines that budget them take it


class EngineAdapter:
    """The class-level side of an engine (an adapter class derives from it; instances are the engines).

    Class attributes the loop and the planner read: ``NEEDS_GPU`` (it serves from CUDA devices only),
    ``MEMORY_POOL`` (it takes ``gpu_memory_utilization`` of its GPU at start-up: the dry run's memory model),
    ``CHEAP_SEEDED_SAMPLING`` (a seed per sample costs nothing: ``engine.seeded_sampling``'s default), and for engines
    that open ports, ``PORTS_NEEDED`` / ``PORT_ENV`` (:func:`hybrid_core.ports.engine_windows`)."""

    NEEDS_GPU = False
    MEMORY_POOL = False
    CHEAP_SEEDED_SAMPLING = False

    @classmethod
    def check_settings(cls, settings: EngineSettings) -> None:
        """Refuse, as a :class:`ConfigError` naming the setting (``engine.<field>``) and the fix, settings this
        engine cannot run (called by the config's validation, before anything starts, on settings that passed
        :meth:`EngineSettings.validate`). By default: one engine on each actor GPU without a count
        (``engine.num_engines`` 0) is the built-in engine's alone."""
        if settings.num_engines == 0:
            raise ConfigError(
                "engine.num_engines",
                f"0 engines means generating on the actor's GPUs with the built-in "
                f"engine, but engine.backend is {settings.backend}.",
                "Use engine.backend hf, or give engine.num_engines N for N separate engines.",
            )

    @classmethod
    def seeds_samples(cls, settings: EngineSettings) -> bool:
        """Whether every sample carries a seed of its own: ``settings.seeded_sampling``, by default where that is
        cheap (``CHEAP_SEEDED_SAMPLING``; vLLM and SGLang sample seeded requests one by one, and are seeded once
        from ``settings.seed`` instead)."""
        return cls.CHEAP_SEEDED_SAMPLING if settings.seeded_sampling is None else bool(settings.seeded_sampling)

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

    @classmethod
    def adapter_refusal(cls, spec: Any) -> str | None:
        """Why these engines cannot take the LoRA adapter ``spec`` alone at each sync (the run then sends merged full
        weights: :mod:`.weight_sync.adapter`); None: they can. By default they cannot: an engine that can is built
        with ``lora=spec`` (``engine_kwargs`` reads ``plan.lora``) and loads the adapter's tensors, under their
        wire names, in ``update_weights`` / ``update_weights_from_ipc``."""
        return f"{cls.__name__} does not load LoRA adapters"


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
    if plan.lora is not None:  # adapter-only sync: the engine applies the run's LoRA adapter
        kwargs["lora"] = plan.lora
    return kwargs
