"""The one interface every inference engine implements.

Engines take prompt *token ids*, never strings: re-tokenising inside an engine was one of the suspects when
vLLM and SGLang disagreed in the seed project, and the trainer already holds the exact ids it will score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from hybrid_core.errors import ConfigError
from hybrid_core.stats import TransferStats
from hybrid_core.weight_sync import TensorMeta

#: ``wake_up`` tags, as vLLM names them: weights and KV cache come back separately so that weights can be
#: refreshed (weight sync) before the KV cache takes its memory.
WAKE_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by every backend (each adapter maps them to its engine's own names)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1  # samples per prompt
    seed: int | None = None
    logprobs: bool = True  # return the log-probability of each generated token

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature}.", "Use 0 for greedy decoding.")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError("top_k", f"must be -1 (off) or >= 1, got {self.top_k}.")
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(
                "min_new_tokens", f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}."
            )
        if self.n < 1:
            raise ConfigError("n", f"samples per prompt must be >= 1, got {self.n}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class GenerationOutput:
    """One sampled completion.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the model's own distribution (raw logits, before
    temperature / top-k / top-p), which is what the trainer recomputes and compares against.

    ``weight_versions[i]`` is the version of the weights that sampled ``token_ids[i]`` (the engine's
    :meth:`PausableEngine.set_weight_version`; 0 until one is set). A generation paused for a weight update and resumed
    (partial rollouts) holds tokens of two or more versions; None where the engine does not say.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" (a stop token was produced; it is included) or "length"
    extra: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[int] | None = None


@dataclass(frozen=True, eq=False)
class MultimodalInput:
    """A prompt's images, given to ``generate`` beside its token ids (``multimodal[i]`` for prompt ``i``).

    ``images``: the encoded image files (PNG / JPEG bytes), what vLLM (``multi_modal_data``) and SGLang
    (``image_data``) decode and process themselves. ``image_grid_thw`` ``[images, 3]``: each image's patch grid as
    the model's processor made it when the prompt was encoded -- the prompt's token ids already hold each image's
    placeholder tokens, expanded to ``grid.prod() / merge_size**2``. ``pixel_values`` ``[patches, dim]``: the
    processor's pixels, when the caller has them (the built-in engine and the trainer otherwise make them with the
    model folder's image processor, checked against the grid: :mod:`hybrid_engines.multimodal`)."""

    images: tuple[bytes, ...]
    pixel_values: Any = None
    image_grid_thw: Any = None


@runtime_checkable
class InferenceEngine(Protocol):
    """What the training loop needs from an inference engine.

    ``generate`` returns, per prompt, ``params.n`` completions. ``sleep(level=1)`` offloads weights to host memory
    and frees the KV cache; ``level=2`` discards weights too, so weights must be re-synced (``update_weights``)
    before the next ``generate``. ``wake_up(tags)`` brings back "weights" and/or "kv_cache" (all when ``None``).
    ``release_kv_cache()`` frees the KV cache alone.

    ``multimodal`` (optional): per prompt its :class:`MultimodalInput` or None (text only). An engine that cannot
    take images refuses a call that has any, naming the backend; it never drops them.
    """

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        multimodal: Sequence[MultimodalInput | None] | None = None,
    ) -> list[list[GenerationOutput]]: ...

    def sleep(self, level: int = 1) -> TransferStats: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> TransferStats: ...

    def release_kv_cache(self) -> TransferStats:
        """Free the KV cache only, keeping the weights on the GPU; ``wake_up(["kv_cache"])`` brings it back (empty).
        What the residency planner asks for when the weights may stay but the cache's memory is needed."""
        ...

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "hybrid-weight-sync",
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> None: ...

    def update_weights(self, metas: Sequence[TensorMeta], *, bucket_bytes: int) -> TransferStats: ...

    def update_weights_from_ipc(self, bucket: Any) -> TransferStats:
        """Load one delivery of a colocated trainer's sync; once the delivery marked ``last`` is loaded, no prefix
        cached with the old weights is reused (the caller need not call ``reset_prefix_cache``)."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class PausableEngine(Protocol):
    """What asynchronous training with partial rollouts adds (``hybrid_algos.train.async_rollout``): a weight update
    may land while ``generate`` calls are running, without waiting for them to finish.

    ``pause_generation()`` returns once every running generation is parked between two decoding steps, keeping its
    unfinished sequences (and their KV cache); a weight update (``update_weights`` / ``update_weights_from_ipc``) and
    ``set_weight_version`` may then run from another thread; ``resume_generation()`` lets the parked generations go
    on with the new weights. Every token records the version of the weights that sampled it
    (``GenerationOutput.weight_versions``). Engines run these calls concurrently with ``generate``: their Ray actor
    is started with ``max_concurrency`` > 1 for partial rollouts (:func:`~hybrid_engines.ray_engines.launch_engines`).
    """

    def pause_generation(self, timeout_s: float = 600.0) -> dict: ...

    def resume_generation(self) -> None: ...

    def set_weight_version(self, version: int) -> None: ...
