"""The built-in inference engine: a transformers causal LM with batched KV-cache decoding, on CPU or GPU.

It is the embedded default (tests, the demo, machines without vLLM/SGLang) and the fallback backend. It implements
the whole :class:`~hybrid_engines.protocol.InferenceEngine` protocol for real:

* ``generate`` — see :mod:`hybrid_engines.hf_generation` (batching, cache) and :mod:`hybrid_engines.hf_sampling`
  (sampling, per-row seeds). Log-probabilities are those of the raw model (float32 ``log_softmax`` of the logits,
  before temperature / top-k / top-p / min-tokens suppression).
* Images (``multimodal``, vision-language folders such as Qwen2-VL, loaded as ``AutoModelForImageTextToText``): the
  engine makes each prompt's pixel values with the folder's image processor and prefills with them and the 3-D
  rotary positions (:mod:`hybrid_engines.multimodal`, the same function as the trainer's forward).
* Stop tokens are ``params.stop_token_ids`` plus, when ``stop_at_eos`` (default, as vLLM and SGLang do), the
  model's EOS ids from its generation config (or config). A stop token ends its completion and is included in it.
* ``sleep(1)`` offloads parameters *and* buffers to host memory with hybrid_core's ``StateOffloader``; ``sleep(2)``
  frees the parameters without a copy (buffers such as rotary ``inv_freq`` are not weights the trainer sends, so
  they stay, on the device: discarding them corrupts outputs). Either way the device caching allocator is emptied.
* The KV cache lives only inside one ``generate`` call, so there is none to free between calls; the "kv_cache" wake
  tag is kept as a state (sleep clears it, ``wake_up(["kv_cache"])`` sets it) so that a loop that would fail on vLLM
  by generating before waking the KV cache fails here too, with a clear error.
* After ``sleep(2)``, ``wake_up(["weights"])`` allocates uninitialised parameters; every parameter must then be
  loaded (``update_weights`` / ``update_weights_from_ipc``) before ``generate`` accepts a call.
* LoRA (``lora=AdapterSpec``, adapter-only weight sync: :mod:`hybrid_engines.weight_sync.adapter`): the model is
  wrapped with PEFT's ``LoraConfig`` of the run (its LoRA layers inside the transformers model, which generates as
  before), and every weight update then carries the adapter's ``lora_A`` / ``lora_B`` tensors alone, under their
  PEFT saved-adapter names, loaded in place into the layers' own tensors (and read back from them by the sync's
  verification). The base is never merged or sent again; a sync that leaves an adapter tensor out is refused
  naming it (a half-updated adapter would generate silently wrong).
* Partial rollouts (:class:`~hybrid_engines.protocol.PausableEngine`): calls may come from several threads (a Ray
  actor with ``max_concurrency`` > 1). One decoding loop runs at a time (its KV cache is what the memory budget
  counts); ``pause_generation()`` parks it between two decoding steps with its rows and cache, a weight update may
  then load new weights, and ``resume_generation()`` lets it go on. A weight update, sleep or KV release while a loop
  is decoding and not parked is refused. Every token records the weight version that sampled it
  (``set_weight_version``).
"""

from __future__ import annotations

import contextlib
import gc
import random
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hybrid_core.errors import ConfigError, HybridError
from hybrid_core.stats import TransferStats

from .adapter import EngineAdapter, EnginePlan, EngineSettings
from .hf_generation import decode
from .hf_sampling import row_seeds, row_uniforms
from .hf_weights import NamedWeights
from .protocol import WAKE_TAGS, GenerationOutput, MultimodalInput, SamplingParams

if TYPE_CHECKING:
    from hybrid_core.weight_sync import SyncGroup

    from .weight_sync.adapter import AdapterSpec


class EngineStateError(HybridError, RuntimeError):
    """The engine was asked for something its state does not allow (asleep, weights discarded, shut down)."""


class HFEngine(EngineAdapter):
    """Built-in transformers engine.

    ``model``: a path / hub id (loaded with ``AutoModelForCausalLM``), a built ``PreTrainedModel`` (used as is, not
    copied: the engine moves it, and its sleep frees it), or a config (random weights drawn under ``seed``: tests and
    benchmarks). ``device`` defaults to CUDA when present; ``dtype`` to the
    model's own. ``max_batch_size`` bounds the rows (prompts x n) decoded together, rounded to whole prompts.
    ``seed`` seeds the weights of a config-built model and the seeds of calls whose ``params.seed`` is ``None``.
    ``trust_remote_code`` lets transformers run the code a model folder ships (off: such a folder is refused).
    ``lora``: the LoRA adapter this engine applies (adapter-only weight sync; see the module docstring).
    """

    NEEDS_GPU = False  # runs on CPU too
    CHEAP_SEEDED_SAMPLING = True  # a seed per sample costs nothing here (one noise draw per row, batched)
    # weight_transport(): hybrid-core's own format (EngineAdapter's)

    @classmethod
    def placement_refusal(cls, *, tp: int, shares_gpus: bool) -> str | None:
        return f"the built-in engine runs on one GPU, and these engines have TP {tp}" if tp > 1 else None

    @classmethod
    def adapter_refusal(cls, spec: AdapterSpec) -> str | None:
        """The built-in engine applies adapters through PEFT (the trainer's own LoRA code), when it is installed."""
        import importlib.util

        return None if importlib.util.find_spec("peft") else "peft is not installed where the engines run"

    @classmethod
    def check_settings(cls, settings: EngineSettings) -> None:
        """One GPU per engine; ``engine.num_engines`` 0 (an engine on each actor GPU) is this engine's."""
        if settings.tensor_parallel_size > 1:
            raise ConfigError(
                "engine.tensor_parallel_size",
                f"the built-in engine (engine.backend hf) runs on one GPU, but "
                f"engine.tensor_parallel_size = {settings.tensor_parallel_size}.",
                "Use engine.tensor_parallel_size 1 with engine.backend hf, or engine.backend vllm / sglang.",
            )

    @classmethod
    def engine_kwargs(cls, settings: EngineSettings, plan: EnginePlan) -> dict[str, Any]:
        """The model, seed and dtype: this engine pauses at a weight update whatever it was built with, keeps no
        memory pool to size and has no context limit to set."""
        kwargs: dict[str, Any] = {
            "model": plan.model_path,
            "seed": settings.seed,
            "trust_remote_code": settings.trust_remote_code,
            "dtype": "bfloat16" if settings.bf16 else "float32",
        }
        if plan.lora is not None:
            kwargs["lora"] = plan.lora
        return kwargs

    def __init__(
        self,
        model: Any,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        seed: int = 0,
        max_batch_size: int = 256,
        stop_at_eos: bool = True,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        lora: AdapterSpec | None = None,
    ):
        if max_batch_size < 1:
            raise ConfigError("max_batch_size", f"must be >= 1, got {max_batch_size}.")
        self.device = torch.device(device) if device is not None else _default_device()
        self.max_batch_size = max_batch_size
        self.model = (
            _build_model(model, _as_dtype(dtype), seed, attn_implementation, trust_remote_code).to(self.device).eval()
        )
        self.model.requires_grad_(False)
        self.lora = lora
        self._adapter: dict[str, str] = {}  # wire name -> the engine's parameter (LoRA: the adapter's tensors)
        self._adapter_seen: set[str] = set()  # what the IPC sync under way has loaded of them
        if lora is not None:
            self.model, self._adapter = _with_adapter(self.model, lora, self.device)
        self.weights = NamedWeights(self.model, self.device, aliases=self._adapter)
        self._rng = random.Random(seed)
        self._eos = _eos_ids(self.model) if stop_at_eos else ()
        self._vocab = self.model.get_input_embeddings().num_embeddings
        text_config = self.model.config.get_text_config()  # a vision-language config keeps these in text_config
        pad = getattr(text_config, "pad_token_id", None)
        self._pad_id = pad if isinstance(pad, int) and 0 <= pad < self._vocab else 0
        self._image_source = model if isinstance(model, str) else None  # its image processor, when images come
        self._image_processor: Any = None
        self._trust_remote_code = trust_remote_code
        self._max_len = getattr(text_config, "max_position_embeddings", None)
        self._keep_last = "logits_to_keep" in _forward_params(self.model)
        self._offloader = None
        self._weights_state = "awake"  # "awake" | "offloaded" (sleep 1) | "discarded" (sleep 2)
        self._kv_awake = True
        self._group: SyncGroup | None = None
        self._closed = False
        # partial rollouts: the decoding loops running, those parked at a pause, and the weight version
        self._cond = threading.Condition()
        self._decode_lock = threading.Lock()
        self._running = self._parked = 0
        self._paused = False
        self._version = 0
        self.pause_timeout_s = 600.0  # a parked loop that is never resumed ends with an error, not a hang

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        multimodal: Sequence[MultimodalInput | None] | None = None,
    ) -> list[list[GenerationOutput]]:
        """``params.n`` completions per prompt, in prompt order; ``multimodal[i]``: prompt ``i``'s images (their
        pixel values made here with the model folder's image processor: :mod:`hybrid_engines.multimodal`)."""
        self._require_ready("generate")
        prompts = self._check_prompts(prompt_token_ids, params)
        images = self._pixel_inputs(multimodal, len(prompts))
        stop = sorted(set(params.stop_token_ids) | set(self._eos))
        bad = [s for s in stop if not 0 <= s < self._vocab]
        if bad:
            raise ConfigError("stop_token_ids", f"ids {bad} are outside the vocabulary [0, {self._vocab}).")
        stop_ids = torch.tensor(stop, dtype=torch.long, device=self.device)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seeds = None if params.greedy else row_seeds(seed, prompts, params.n)

        results: list[list[GenerationOutput] | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad less
        per_batch = max(1, self.max_batch_size // params.n)
        for start in range(0, len(order), per_batch):
            chunk = order[start : start + per_batch]
            uniforms = None
            if seeds is not None:
                chunk_seeds = [seeds[i * params.n + j] for i in chunk for j in range(params.n)]
                uniforms = row_uniforms(chunk_seeds, params.max_new_tokens, self.device)
            with self._decoding():
                batch = decode(
                    self.model,
                    [prompts[i] for i in chunk],
                    params,
                    stop_ids=stop_ids,
                    uniforms=uniforms,
                    pad_id=self._pad_id,
                    keep_last_logits=self._keep_last,
                    with_logprobs=params.logprobs,
                    before_forward=self._before_forward,
                    multimodal=[images[i] for i in chunk] if images is not None else None,
                )
            tokens, logprobs = batch.tokens.tolist(), batch.logprobs.tolist()
            lengths, stopped, versions = batch.lengths.tolist(), batch.stopped.tolist(), batch.versions.tolist()
            for c, i in enumerate(chunk):
                outs = []
                for j in range(params.n):
                    r, length = c * params.n + j, lengths[c * params.n + j]
                    outs.append(
                        GenerationOutput(
                            prompt_token_ids=list(prompts[i]),
                            token_ids=tokens[r][:length],
                            logprobs=logprobs[r][:length] if params.logprobs else None,
                            finish_reason="stop" if stopped[r] else "length",
                            weight_versions=versions[r][:length],
                        )
                    )
                results[i] = outs
        return results  # type: ignore[return-value]

    def _pixel_inputs(self, multimodal, prompts: int) -> list[MultimodalInput | None] | None:
        from .multimodal import check_multimodal, load_image_processor, with_pixels

        check_multimodal(multimodal, prompts)
        if multimodal is None or all(m is None or not m.images for m in multimodal):
            return None
        if self._image_processor is None and any(m is not None and m.pixel_values is None for m in multimodal):
            if self._image_source is None:
                raise ConfigError(
                    "multimodal",
                    "this engine was built from a model object, so it has no image processor to make pixel values.",
                    "Build it from the model folder, or pass MultimodalInput(pixel_values=...).",
                )
            self._image_processor = load_image_processor(self._image_source, trust_remote_code=self._trust_remote_code)
        return with_pixels(multimodal, self._image_processor)

    # ---- partial rollouts: pause, weight update, resume -------------------------------------------------------
    def pause_generation(self, timeout_s: float = 600.0) -> dict:
        """Park every running decoding loop before its next forward pass (rows and KV cache kept); returns once they
        are parked (``{"parked": loops, "version": v}``). New loops park before their first forward pass."""
        self._require_open("pause_generation")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            while self._parked < self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineStateError(
                        f"pause_generation: a decoding loop did not reach its next step within {timeout_s:g} s."
                    )
                self._cond.wait(left)
            return {"parked": self._parked, "version": self._version}

    def resume_generation(self) -> None:
        """Let the parked loops go on (with whatever weights are loaded now)."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def set_weight_version(self, version: int) -> None:
        """The version the next forward passes use: tokens sampled from now on are marked with it."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError("version", f"must be a whole number >= 0, got {version!r}.")
        with self._cond:
            self._version = version

    def _before_forward(self) -> int:
        with self._cond:
            if self._paused:
                self._parked += 1
                self._cond.notify_all()
                deadline = time.monotonic() + self.pause_timeout_s
                try:
                    while self._paused:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise EngineStateError(
                                f"generate: paused for more than {self.pause_timeout_s:g} s and "
                                "never resumed (resume_generation)."
                            )
                        self._cond.wait(left)
                finally:
                    self._parked -= 1
            return self._version

    @contextlib.contextmanager
    def _decoding(self):
        with self._decode_lock:  # one decoding loop at a time: its KV cache is the one the memory budget counts
            with self._cond:
                self._running += 1
            try:
                yield
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    def _require_not_decoding(self, what: str) -> None:
        """A loop that is decoding (not parked) reads the weights and its cache: nothing may change them now."""
        with self._cond:
            if self._running > self._parked:
                raise EngineStateError(
                    f"{what}: generation is running; call pause_generation() first (partial "
                    "rollouts) or wait for generate to return."
                )

    # ---- sleep / wake ------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> TransferStats:
        """Level 1: weights to host memory; level 2: weights freed (re-sync before use). Frees the KV cache.

        Sleeping while asleep changes nothing (weights already offloaded stay offloaded)."""
        if level not in (1, 2):
            raise ConfigError("level", f"sleep level must be 1 or 2, got {level!r}.")
        self._require_open("sleep")
        self._require_not_decoding("sleep")
        start = time.perf_counter()
        stats = TransferStats(0, 0.0, f"sleep{level}")
        if self._weights_state == "awake":
            if level == 1:
                stats = self._get_offloader().sleep()
                self._weights_state = "offloaded"
            else:
                self.weights.discard()
                self._weights_state = "discarded"
        self._kv_awake = False
        _empty_device_cache(self.device)
        return TransferStats(stats.bytes, time.perf_counter() - start, f"sleep{level}")

    def release_kv_cache(self) -> TransferStats:
        """Free the KV cache, keep the weights. This engine builds its cache per ``generate`` call, so only the
        allocator's cached blocks are given back."""
        self._require_open("release_kv_cache")
        self._require_not_decoding("release_kv_cache")
        start = time.perf_counter()
        self._kv_awake = False
        _empty_device_cache(self.device)
        return TransferStats(0, time.perf_counter() - start, "release kv")

    def wake_up(self, tags: Sequence[str] | None = None) -> TransferStats:
        """Bring back "weights" and/or "kv_cache" (both when ``tags`` is None)."""
        self._require_open("wake_up")
        if isinstance(tags, str):
            raise ConfigError("tags", f"expected a list of tags, got the string {tags!r}.", f'Use ["{tags}"].')
        tags = list(WAKE_TAGS if tags is None else tags)
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise ConfigError("tags", f"unknown wake-up tags {unknown!r}.", f"Use a subset of {list(WAKE_TAGS)}.")
        start = time.perf_counter()
        moved = 0
        if "weights" in tags:
            if self._weights_state == "offloaded":
                moved = self._get_offloader().wake().bytes
            elif self._weights_state == "discarded":
                self.weights.allocate()  # contents undefined until update_weights fills every parameter
            self._weights_state = "awake"
        if "kv_cache" in tags:
            self._kv_awake = True
        return TransferStats(moved, time.perf_counter() - start, "wake")

    # ---- weight updates ----------------------------------------------------------------------------------------
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
    ) -> None:
        """Join the trainer's weight-sync group as rank ``rank_offset`` (the trainer sends from rank 0)."""
        from hybrid_core.weight_sync import create_sync_group

        self._require_open("init_weight_update_group")
        if not 0 < rank_offset < world_size:
            raise ConfigError(
                "rank_offset",
                f"must be in [1, world_size={world_size}), got {rank_offset}.",
                "Rank 0 is the trainer; engine workers take ranks 1..world_size-1.",
            )
        if self._group is not None:
            _destroy(self._group)
        self._group = create_sync_group(
            master_address,
            master_port,
            rank_offset,
            world_size,
            backend=backend,
            timeout_s=timeout_s,
            device=self.device,
            group_name=group_name,
        )

    def update_weights(self, metas: Sequence[Any], *, bucket_bytes: int) -> TransferStats:
        """Receive the tensors ``metas`` describes from rank 0, bucket by bucket, into the parameters of those names.

        Bad metas (unknown name, wrong shape) are reported after the transfer has been drained, so the sender is
        never left hanging in a collective."""
        from hybrid_core.weight_sync import WeightReceiver

        if self._group is None:
            raise EngineStateError("update_weights: no weight-update group. Call init_weight_update_group first.")
        self._require_weights_on_device("update_weights")
        self._require_not_decoding("update_weights")
        problem = self.weights.check([(m.name, tuple(m.shape)) for m in metas])
        left_out = self._adapter_left_out({m.name for m in metas})
        if left_out:
            problem = " and ".join(p for p in (problem, left_out) if p)
        receiver = WeightReceiver(self._group, bucket_bytes, self.device)
        if problem:
            receiver.receive(metas, lambda items: None)
            raise ConfigError("metas", problem, "Send the engine model's own parameter names and shapes.")
        stats = receiver.receive(metas, self.weights.load, self.weights.read_back)  # verified against the model
        _synchronize(self.device)
        return stats

    def update_weights_from_ipc(self, bucket: Any) -> TransferStats:
        """Load one CUDA-IPC (or CPU shared-memory) bucket from a colocated trainer; returns once copied, so the
        sender may reuse the buffer. The last bucket of a sync also unmaps the trainer's buffers."""
        from hybrid_core.weight_sync import load_ipc_bucket

        self._require_weights_on_device("update_weights_from_ipc")
        self._require_not_decoding("update_weights_from_ipc")

        def load(items):
            problem = self.weights.check([(name, tuple(t.shape)) for name, t in items])
            if problem:
                raise ConfigError("bucket", problem, "Send the engine model's own parameter names and shapes.")
            self.weights.load(items)
            self._adapter_seen.update(name for name, _ in items)
            _synchronize(self.device)

        if self._adapter and getattr(bucket, "index", 0) == 0:
            self._adapter_seen = set()  # a new sync
        stats = load_ipc_bucket(bucket, load, self.weights.read_back)  # verified against the model
        if self._adapter and getattr(bucket, "last", True):
            left_out = self._adapter_left_out(self._adapter_seen)
            if left_out:
                raise EngineStateError(f"update_weights_from_ipc: {left_out}")
        return stats

    def _adapter_left_out(self, names: set[str]) -> str | None:
        """Under LoRA, the adapter tensors a sync of ``names`` leaves out (None: it brings all of them)."""
        missing = sorted(set(self._adapter) - names)
        if not missing:
            return None
        return (
            f"the sync leaves {len(missing)} of the adapter's {len(self._adapter)} tensors out, e.g. {missing[:3]} "
            "(the engine would generate with a stale adapter)"
        )

    def reset_prefix_cache(self) -> None:
        """Nothing to do: this engine keeps no prefix cache across calls (the KV cache lives inside ``generate``)."""

    def shutdown(self) -> None:
        """Leave the weight-sync group and free the model; the engine accepts no further calls."""
        if self._closed:
            return
        if self._group is not None:
            _destroy(self._group)
            self._group = None
        self._closed = True
        self.model = None
        self.weights = None  # type: ignore[assignment]
        self._offloader = None
        gc.collect()
        _empty_device_cache(self.device)

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _get_offloader(self):
        if self._offloader is None:
            from hybrid_core.offload import StateOffloader

            self._offloader = StateOffloader(self.model)
        return self._offloader

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise EngineStateError(f"{what}: the engine was shut down.")

    def _require_weights_on_device(self, what: str) -> None:
        self._require_open(what)
        if self._weights_state != "awake":
            level = 1 if self._weights_state == "offloaded" else 2
            raise EngineStateError(
                f"{what}: the weights are asleep (sleep level {level}). Call wake_up(['weights']) first."
            )

    def _require_ready(self, what: str) -> None:
        self._require_weights_on_device(what)
        if not self._kv_awake:
            raise EngineStateError(f"{what}: the KV cache is asleep. Call wake_up(['kv_cache']) (or wake_up()) first.")
        missing = self.weights.unloaded()
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise EngineStateError(
                f"{what}: weights were discarded by sleep(level=2) and {shown} have not been "
                "loaded since. Call update_weights (or update_weights_from_ipc) with every weight."
            )

    def _check_prompts(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or len(prompts) == 0:
            raise ConfigError(
                "prompt_token_ids",
                "expected a non-empty list of token-id lists.",
                "Tokenize the prompts first; engines take token ids, not strings.",
            )
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)) or len(p) == 0:
                raise ConfigError("prompt_token_ids", f"prompt {i} is empty or not a list of token ids.")
            ids = [int(t) for t in p]
            if min(ids) < 0 or max(ids) >= self._vocab:
                raise ConfigError("prompt_token_ids", f"prompt {i} has ids outside the vocabulary [0, {self._vocab}).")
            if self._max_len is not None and len(ids) + params.max_new_tokens > self._max_len:
                raise ConfigError(
                    "max_new_tokens",
                    f"prompt {i} ({len(ids)} tokens) + max_new_tokens="
                    f"{params.max_new_tokens} exceeds the model's {self._max_len} positions.",
                    "Shorten the prompt or lower max_new_tokens.",
                )
            out.append(ids)
        return out


def _build_model(
    model: Any, dtype: torch.dtype | None, seed: int, attn_implementation: str | None, trust_remote_code: bool = False
):
    from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

    from .multimodal import auto_model_class

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if isinstance(model, PreTrainedModel):
        return model.to(dtype) if dtype is not None else model
    if isinstance(model, PretrainedConfig):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            built = auto_model_class(model).from_config(model, **kwargs)
        return built.to(dtype) if dtype is not None else built
    if isinstance(model, str):
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        return auto_model_class(config).from_pretrained(  # a vision-language folder is not a causal LM class
            model, dtype=dtype if dtype is not None else "auto", trust_remote_code=trust_remote_code, **kwargs
        )
    raise ConfigError("model", f"expected a path, a PreTrainedModel or a PretrainedConfig, got {type(model).__name__}.")


def _with_adapter(model: Any, spec: AdapterSpec, device: torch.device) -> tuple[Any, dict[str, str]]:
    """``model`` with the LoRA layers of ``spec`` inside it (PEFT's ``get_peft_model``; the transformers model is kept,
    so generation is unchanged), and each adapter tensor's wire name -> its parameter name in that model."""
    from peft import LoraConfig, get_peft_model

    from .weight_sync.adapter import PEFT_PREFIX, wire_name

    config = {k: v for k, v in spec.peft_config().items() if k != "peft_type"}
    dtype = model.get_input_embeddings().weight.dtype
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)  # B starts at zero (the adapter does nothing until the first sync); A is drawn
        wrapped = get_peft_model(model, LoraConfig(**config)).get_base_model()
    wrapped.requires_grad_(False)
    names = {}
    for name, p in wrapped.named_parameters():
        wire = wire_name(name)
        if wire is not None:
            names[PEFT_PREFIX + wire] = name
            p.data = p.data.to(dtype)  # in the engine's dtype, as vLLM keeps adapters (PEFT would keep fp32)
    return wrapped.eval(), names


def _as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return None if dtype == "auto" else dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ConfigError("dtype", f"unknown dtype {dtype!r}.", "Use bfloat16, float16, float32 or auto.")
    return value


def _eos_ids(model) -> tuple[int, ...]:
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config.get_text_config(), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def _forward_params(model) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # freed KV blocks go back to the driver, not just to torch's caching allocator


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _destroy(group) -> None:
    close = getattr(group, "destroy", None) or getattr(group, "close", None)
    if close is not None:
        close()
