"""vLLM adapter: :class:`~hybrid_engines.protocol.InferenceEngine` on ``vllm.LLM`` (written against vLLM 0.26.0).

* Generation: token-id prompts (``{"prompt_token_ids": ids}``, vLLM's ``TokensPrompt``), one request per completion
  when samples are seeded or greedy, else one per prompt with ``n`` (:mod:`hybrid_engines.sampling_map`), logprobs
  of the sampled tokens under the raw model (``logprobs_mode="raw_logprobs"``: before temperature / top-k / top-p and
  logits processors).
* Sleep: ``LLM(enable_sleep_mode=True)``; ``sleep(1)`` offloads weights to host memory and drops the KV cache,
  ``sleep(2)`` drops both. ``wake_up(["weights"])`` and ``wake_up(["kv_cache"])`` map to vLLM's tags one to one, so
  weights can be refreshed before the KV cache takes its memory back. After a level-2 sleep ``generate`` is refused
  until every parameter was loaded again (vLLM 0.26 saves and restores buffers such as rotary caches itself, in
  ``Worker.sleep``/``wake_up``; the weights are garbage until re-synced).
* Weight updates: a worker extension (:mod:`hybrid_engines.vllm_worker`) joins hybrid-core's weight-sync group
  (broadcast path, ``update_weights``) or maps CUDA-IPC buckets of a colocated trainer (``update_weights_from_ipc``),
  and loads through the model's own ``load_weights``. The prefix cache is reset after every update.
* LoRA (``lora=AdapterSpec``: adapter-only weight sync, :mod:`hybrid_engines.weight_sync.adapter`): the engine is
  built with ``enable_lora=True``, ``max_lora_rank`` the smallest of vLLM's allowed ranks that holds the run's
  (:func:`vllm_max_lora_rank`) and one adapter slot; every update then carries the adapter's tensors alone, which
  the worker extension turns into vLLM's adapter in memory (no file) under the run's one id, replaced at each sync
  (a request paused across a sync goes on with the new adapter, as it would with new weights). From the first
  update on, every request carries that ``LoRARequest``; before it the engine serves the base, which is the policy
  then (PEFT starts each adapter's B at zero; a resumed run syncs before it generates).
* Partial rollouts (``pausable=True``; :class:`~hybrid_engines.protocol.PausableEngine`): ``generate`` adds its
  requests to the engine (``LLM._preprocess_cmpl_one`` renders them as ``LLM.generate`` does, then
  ``LLMEngine.add_request``) and steps it itself (``LLMEngine.step``), so calls from several threads share one
  running batch (continuous batching across calls: the tail of one rollout runs beside the next one's start).
  ``pause_generation()`` stops stepping at a step boundary and puts vLLM's scheduler in its ``keep`` pause
  (``LLM.sleep(level=0, mode="keep")``: the requests and their KV cache stay, nothing is scheduled); a weight update
  may then load new weights; ``resume_generation()`` wakes the scheduler (``LLM.wake_up(tags=["scheduling"])``) and
  stepping goes on. Each token is marked with the version of the weights of the step that sampled it (outputs are
  read as deltas, ``RequestOutputKind.DELTA``); async scheduling is off in this mode, so a step's tokens come from
  that step's forward pass. The prefix cache is reset once no request is in flight (while requests are paused it
  still holds their blocks; the training loop refuses prefix caching with partial rollouts).

Tensor parallelism over Ray (TP > 1), as vLLM 0.26 places workers (``v1/executor/ray_executor_v2.py``): build the
engine inside a Ray actor that was scheduled in the placement group (vLLM takes ``get_current_placement_group()``
then, ``engine/arg_utils.py``); give that actor no GPU of its own (``num_gpus=0``: the V2 Ray executor does not need
one on the driver); pass ``bundle_indices`` (one bundle per TP rank, in rank order, -> ``VLLM_RAY_BUNDLE_INDICES``)
and ``gpus_per_worker`` (the GPU fraction each worker takes from its bundle, e.g. 0.5 when the trainer shares the
GPU, -> ``VLLM_RAY_PER_WORKER_GPUS``). vLLM itself sets ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` for its
worker actors and maps each to its bundle's physical GPU, so nothing else is needed. TP = 1 runs in-process.

Environment set here when not already set (before vLLM is imported): ``VLLM_USE_FLASHINFER_SAMPLER=0`` (FlashInfer
otherwise JIT-compiles its sampler for minutes at start-up), ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core in
this process: one CUDA context, readable stack traces, objects passed to ``collective_rpc`` as they are; with it
set to 1, IPC buckets need ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to cross vLLM's msgpack channel) and, for a model
that is a local folder, ``HF_HUB_OFFLINE=1``.

Ports (``ports``: this engine's :class:`~hybrid_core.ports.PortWindow`, given by ``launch_engines``): vLLM 0.26 reads
no port argument for a single instance, only environment variables, so the adapter sets them (overriding inherited
values) before vLLM is imported: :func:`vllm_port_env` says which and why. Without ``ports`` vLLM picks its own,
which is safe for one engine per node only (two TP > 1 engines both start their TCPStore at port 100).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_core.errors import ConfigError, RemoteTimeout, RoleFailure
from hybrid_core.ports import PortWindow
from hybrid_core.stats import TransferStats

from .adapter import EngineAdapter, EnginePlan, EngineSettings, pooled_engine_kwargs
from .hf_engine import EngineStateError
from .protocol import WAKE_TAGS, GenerationOutput, SamplingParams
from .sampling_map import (
    check_prompts,
    expand_rows,
    finish_reason,
    per_prompt_requests,
    sampled_logprobs,
    vllm_sampling_kwargs,
)

WORKER_EXTENSION = "hybrid_engines.vllm_worker.HybridWorkerExtension"

#: Keyword arguments this adapter gives ``vllm.LLM`` (checked against ``LLM.__init__`` and ``EngineArgs`` by the
#: contract test; ``**extra`` from the caller goes through unchecked).
VLLM_LLM_KWARGS = (
    "model",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "enable_sleep_mode",
    "enforce_eager",
    "dtype",
    "seed",
    "max_model_len",
    "enable_prefix_caching",
    "worker_extension_cls",
    "logprobs_mode",
    "distributed_executor_backend",
    "async_scheduling",
    # LoRA (adapter-only sync)
    "enable_lora",
    "max_lora_rank",
    "max_loras",
    # vision-language prompts (engine_kwargs)
    "limit_mm_per_prompt",
)
#: ``vllm.LLM`` methods this adapter calls, with the keyword arguments it passes (contract-tested).
VLLM_LLM_METHODS = {
    "generate": ("prompts", "sampling_params", "use_tqdm", "lora_request"),
    "sleep": ("level",),
    "wake_up": ("tags",),
    "collective_rpc": ("method", "timeout", "args", "kwargs"),
    "reset_prefix_cache": (),
    # partial rollouts: rendering a prompt as generate does, and the level-0 ("keep") pause of the scheduler
    "_preprocess_cmpl_one": ("prompt", "tokenization_kwargs"),
}
#: ``vllm.LLM.sleep`` / ``wake_up`` arguments of the partial-rollout pause (level 0 keeps requests and memory).
VLLM_KEEP_PAUSE: dict[str, dict[str, Any]] = {
    "sleep": {"level": 0, "mode": "keep"},
    "wake_up": {"tags": ["scheduling"]},
}
#: ``LLMEngine`` (``LLM.llm_engine``) methods the stepping loop calls, with the arguments it passes.
VLLM_ENGINE_METHODS = {
    "add_request": ("request_id", "prompt", "params", "lora_request"),
    "step": (),
    "abort_request": ("request_ids",),
}
#: ``vllm.config.lora.MaxLoRARanks`` in 0.26 (contract-tested): the values ``max_lora_rank`` may take
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: ``vllm.lora.request.LoRARequest`` fields the adapter sets (contract-tested)
VLLM_LORA_REQUEST_FIELDS = ("lora_name", "lora_int_id", "lora_path")
#: the run's one adapter: its id in vLLM's LoRA manager (> 0), its name, and the path field vLLM requires, never
#: read (the adapter is in the manager before any request names it)
HYBRID_LORA_ID = 1
HYBRID_LORA: dict[str, Any] = {
    "lora_name": "hybrid-policy",
    "lora_int_id": HYBRID_LORA_ID,
    "lora_path": "hybrid-adapter-sent-by-tensor",
}


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM 0.26 accepts that holds an adapter of ``rank``."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ConfigError(
        "trainer.lora_rank",
        f"{rank}: vLLM serves adapters of rank <= {VLLM_MAX_LORA_RANKS[-1]}.",
        "Use a smaller --lora_rank, or --lora_sync merged.",
    )


#: vLLM 0.26 sleep-mode tags (``LLM.wake_up`` docstring: "weights", "kv_cache", "scheduling").
VLLM_WAKE_TAGS = {"weights": "weights", "kv_cache": "kv_cache"}

ENV_DEFAULTS = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

#: vLLM 0.26's port settings -> offset in the engine's port window (see :func:`vllm_port_env`)
VLLM_PORT_LAYOUT = {"VLLM_DP_MASTER_PORT": 0, "VLLM_PORT": 10}
#: ``RayExecutorV2._select_tcpstore_port``: the TCPStore search starts this far above the DP master port (local DP
#: rank 0) and tries this many ports before falling back to ``get_open_port``
VLLM_TCPSTORE_OFFSET, VLLM_TCPSTORE_TRIES = 100, 32
#: ``get_open_port`` keeps off the DP master port and the 9 above it (``utils/network_utils.py``)
VLLM_DP_RESERVED = 10


class VLLMEngine(EngineAdapter):
    """The vLLM backend. ``model``: a local folder or hub id (a hub id needs network access at start-up).

    ``weight_loading``: "direct" (default) copies received tensors in with ``load_weights``, exact for unquantized
    weights (vLLM 0.26's ``UnquantizedLinearMethod.process_weights_after_loading`` does nothing on CUDA); "layerwise"
    wraps each broadcast sync in vLLM's layerwise reload (for quantized models; not for the IPC path, whose buckets may
    split a layer). ``rpc_timeout_s`` bounds every ``collective_rpc`` (vLLM enforces it on multi-process executors;
    with TP = 1 the call runs in this process and the weight-sync group's own ``timeout_s`` bounds the transfer).
    """

    NEEDS_GPU = True
    #: takes gpu_memory_utilization x its GPU at start-up for weights + KV cache (the dry run's memory model)
    MEMORY_POOL = True
    #: vLLM samples seeded requests one by one (a per-request generator each decode step); unseeded, in one batch
    CHEAP_SEEDED_SAMPLING = False
    #: ports each engine's window must hold (the TCPStore search is the last of the layout); ``launch_engines`` gives
    #: every engine such a window, disjoint from the others' on its node
    PORTS_NEEDED = VLLM_TCPSTORE_OFFSET + VLLM_TCPSTORE_TRIES
    #: variables the adapter sets from the window: inherited alike by every engine, they would clash (refused)
    PORT_ENV = tuple(VLLM_PORT_LAYOUT)

    # weight_transport() and check_settings(): EngineAdapter's (hybrid-core's format, received by .vllm_worker)

    @classmethod
    def adapter_refusal(cls, spec: Any) -> str | None:
        """vLLM applies LoRA adapters of rank <= 512 (``enable_lora``), received by tensor in the worker extension."""
        if spec.rank > VLLM_MAX_LORA_RANKS[-1]:
            return f"vLLM serves adapters of rank <= {VLLM_MAX_LORA_RANKS[-1]}, and --lora_rank is {spec.rank}"
        return None

    @classmethod
    def engine_kwargs(cls, settings: EngineSettings, plan: EnginePlan) -> dict[str, Any]:
        """Every engine setting, under this constructor's names (:func:`.adapter.pooled_engine_kwargs`), and the
        images a prompt may hold: vLLM sizes its multimodal budget (and profiles its memory) by
        ``limit_mm_per_prompt``, and refuses a prompt with more images than it allows."""
        kwargs = pooled_engine_kwargs(settings, plan)
        if plan.max_images_per_prompt > 0:
            kwargs["limit_mm_per_prompt"] = {"image": plan.max_images_per_prompt}
        return kwargs

    def __init__(
        self,
        model: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = True,
        enforce_eager: bool = False,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        stop_at_eos: bool = True,
        weight_loading: str = "direct",
        placement_group: Any = None,
        bundle_indices: Sequence[int] | None = None,
        gpus_per_worker: float | None = None,
        rpc_timeout_s: float = 600.0,
        pausable: bool = False,
        ports: PortWindow | None = None,
        lora: Any = None,
        **extra: Any,
    ):
        _check_args(
            tensor_parallel_size, gpu_memory_utilization, weight_loading, bundle_indices, gpus_per_worker, rpc_timeout_s
        )
        _set_env_defaults(model)
        if ports is not None:
            os.environ.update(vllm_port_env(ports, os.environ))
        if tensor_parallel_size > 1:
            _set_ray_placement(placement_group, bundle_indices, gpus_per_worker)
        import vllm

        kwargs = dict(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            enforce_eager=enforce_eager,
            dtype=dtype,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="raw_logprobs",
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "ray"
        if pausable:
            kwargs["async_scheduling"] = False  # a step's tokens come from that step's forward (version marks)
        if lora is not None:  # adapter-only sync: one adapter slot, sized for the run's rank
            kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora.rank), max_loras=1)
        kwargs.update(extra)
        self._vllm = vllm
        self.llm = vllm.LLM(**kwargs)
        self.enable_sleep_mode = enable_sleep_mode
        self.stop_at_eos = stop_at_eos
        self.weight_loading = weight_loading
        self.rpc_timeout_s = rpc_timeout_s
        self._weights = "awake"  # "awake" | "offloaded" (sleep 1) | "discarded" (sleep 2)
        self._kv_awake = True
        self._kv_released = False  # the KV cache was freed alone (release_kv_cache), not by vLLM's sleep
        self._missing: tuple[int, list[str]] = (0, [])  # parameters still to load after a level-2 sleep
        self._group = False
        self._closed = False
        self.pausable = pausable
        self.ports = ports
        self.lora = lora
        self._lora_request: Any = None  # set by the first adapter sync; every request carries it from then on
        self._version = 0
        # the stepping loop of partial rollouts (see the module docstring)
        self._cv = threading.Condition()
        self._live: dict[str, _Live] = {}
        self._adds: list[tuple[str, dict, Any]] = []
        self._stepping = self._paused = self._prefix_stale = False
        self._request_ids = itertools.count()

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams, multimodal=None
    ) -> list[list[GenerationOutput]]:
        """``params.n`` completions per prompt, in prompt order; ``multimodal[i]``: prompt ``i``'s images, given to
        vLLM as the prompt's ``multi_modal_data`` (the token ids hold the placeholders, expanded)."""
        self._require_ready("generate")
        prompts = check_prompts(prompt_token_ids)
        mm = vllm_prompt_images(multimodal, len(prompts), pausable=self.pausable)
        rows = expand_rows(prompts, params)
        make = self._vllm.SamplingParams
        if per_prompt_requests(rows, params) and not self.pausable:  # vLLM fans each prompt out into n samples
            return self._generate_per_prompt(prompts, params, mm)
        if all(r.seed is None for r in rows):  # one object for every row
            sampling: Any = make(**vllm_sampling_kwargs(params, seed=None, stop_at_eos=self.stop_at_eos))
        else:
            sampling = [make(**vllm_sampling_kwargs(params, seed=r.seed, stop_at_eos=self.stop_at_eos)) for r in rows]
        requests = [{"prompt_token_ids": prompts[r.prompt], **mm[r.prompt]} for r in rows]
        if self.pausable:
            return self._generate_stepping(prompts, rows, requests, sampling, params)
        outputs = self.llm.generate(prompts=requests, sampling_params=sampling, use_tqdm=False, **self._with_lora())
        results: list[list[Any]] = [[None] * params.n for _ in prompts]
        for row, out in zip(rows, outputs, strict=True):
            results[row.prompt][row.sample] = self._output(prompts[row.prompt], out.outputs[0], params)
        return results

    def _generate_per_prompt(self, prompts, params: SamplingParams, mm=None) -> list[list[GenerationOutput]]:
        sampling = self._vllm.SamplingParams(
            **vllm_sampling_kwargs(params, seed=None, stop_at_eos=self.stop_at_eos, n=params.n)
        )
        outputs = self.llm.generate(
            prompts=[{"prompt_token_ids": p, **(mm[i] if mm else {})} for i, p in enumerate(prompts)],
            sampling_params=sampling,
            use_tqdm=False,
            **self._with_lora(),
        )
        results = []
        for prompt, out in zip(prompts, outputs, strict=True):
            if len(out.outputs) != params.n:
                raise RoleFailure(
                    f"vllm generate: a prompt came back with {len(out.outputs)} samples, not n={params.n}."
                )
            results.append([self._output(prompt, done, params) for done in out.outputs])
        return results

    def _output(self, prompt: list[int], done: Any, params: SamplingParams) -> GenerationOutput:
        ids = list(done.token_ids)
        return GenerationOutput(
            prompt_token_ids=prompt,
            token_ids=ids,
            logprobs=sampled_logprobs(ids, done.logprobs) if params.logprobs else None,
            finish_reason=finish_reason(done.finish_reason, engine="vllm"),
            weight_versions=[self._version] * len(ids),
        )

    # ---- partial rollouts: one stepping loop shared by every generate call ------------------------------------
    def _generate_stepping(self, prompts, rows, requests, sampling, params: SamplingParams):
        delta = self._vllm.sampling_params.RequestOutputKind.DELTA
        ids = []
        with self._cv:
            if not self._live and self._prefix_stale:
                self._reset_prefix_now()
            for i, (_row, request) in enumerate(zip(rows, requests)):
                sp = (sampling[i] if isinstance(sampling, list) else sampling).clone()
                sp.output_kind = delta
                rid = f"hybrid-{next(self._request_ids)}"
                self._live[rid] = _Live()
                self._adds.append((rid, request, sp))
                ids.append(rid)
            self._cv.notify_all()
        mine: list[_Live] | None  # the finished requests; None: this caller steps the engine first
        try:
            while True:
                with self._cv:
                    while True:
                        failed = next((self._live[r].error for r in ids if self._live[r].error), None)
                        if failed is not None:
                            raise failed
                        if all(self._live[r].finished for r in ids):
                            mine = [self._live.pop(r) for r in ids]
                            break
                        if not self._stepping and not self._paused:
                            self._stepping = True
                            mine = None
                            break
                        self._cv.wait(1.0)
                if mine is not None:
                    break
                try:
                    self._step_once()
                finally:
                    with self._cv:
                        self._stepping = False
                        self._cv.notify_all()
        except BaseException:
            with self._cv:
                gone = [r for r in ids if self._live.pop(r, None) is not None]
                self._adds = [a for a in self._adds if a[0] not in ids]
            if gone:
                try:
                    self.llm.llm_engine.abort_request(gone)
                except Exception:  # the error being raised is the one to report
                    pass
            raise
        results: list[list[Any]] = [[None] * params.n for _ in prompts]
        for row, live in zip(rows, mine):
            results[row.prompt][row.sample] = GenerationOutput(
                prompt_token_ids=prompts[row.prompt],
                token_ids=live.token_ids,
                logprobs=live.logprobs if params.logprobs else None,
                finish_reason=finish_reason(live.finish_reason, engine="vllm"),
                weight_versions=live.versions,
            )
        return results

    def _step_once(self) -> None:
        """Add what callers queued, run one engine step, and hand each request its new tokens (this thread is the
        only one touching the engine: ``_stepping`` is held, and weights change only while paused)."""
        engine = self.llm.llm_engine
        with self._cv:
            adds, self._adds = self._adds, []
        for rid, request, sp in adds:
            engine.add_request(rid, self.llm._preprocess_cmpl_one(request, None), sp, **self._with_lora())
        try:
            outputs = engine.step()
        except BaseException as error:
            with self._cv:
                for waiting in self._live.values():
                    waiting.error = waiting.error or error
            raise
        version = self._version
        with self._cv:
            for out in outputs:
                live = self._live.get(out.request_id)
                if live is None:
                    continue
                done = out.outputs[0]
                new = list(done.token_ids)
                live.token_ids.extend(new)
                live.versions.extend([version] * len(new))
                if new and done.logprobs is not None:
                    live.logprobs.extend(sampled_logprobs(new, done.logprobs))
                if out.finished:
                    live.finished, live.finish_reason = True, done.finish_reason
            self._cv.notify_all()

    def pause_generation(self, timeout_s: float = 600.0) -> dict:
        """Stop stepping at the next step boundary and freeze vLLM's scheduler keeping every request
        (``LLM.sleep(level=0, mode="keep")``); returns once no step runs."""
        self._require_open("pause_generation")
        if not self.pausable:
            raise ConfigError(
                "pausable",
                "this engine was built without pausable=True (partial rollouts).",
                "Build VLLMEngine(pausable=True).",
            )
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._paused = True
            while self._stepping:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RemoteTimeout(f"vllm pause_generation: the running step did not end within {timeout_s:g} s")
                self._cv.wait(left)
            live = len(self._live)
        self.llm.sleep(**VLLM_KEEP_PAUSE["sleep"])
        return {"parked": live, "version": self._version}

    def resume_generation(self) -> None:
        """Wake vLLM's scheduler (``LLM.wake_up(tags=["scheduling"])``) and let the callers step again."""
        self._require_open("resume_generation")
        if self.pausable:
            self.llm.wake_up(**VLLM_KEEP_PAUSE["wake_up"])
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def set_weight_version(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError("version", f"must be a whole number >= 0, got {version!r}.")
        with self._cv:
            self._version = version

    def _require_idle(self, what: str) -> None:
        """vLLM's sleep aborts the requests it holds: never while generations are in flight (paused or not)."""
        with self._cv:
            if self._live:
                raise EngineStateError(
                    f"{what}: {len(self._live)} request(s) are in flight; their generate calls must return first."
                )

    def _require_not_stepping(self, what: str) -> None:
        with self._cv:
            if self._live and not self._paused:
                raise EngineStateError(
                    f"{what}: generation is running; call pause_generation() first (partial "
                    "rollouts) or wait for generate to return."
                )

    # ---- sleep / wake ------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> TransferStats:
        """Level 1: weights to host memory, KV cache dropped; level 2: both dropped (re-sync weights before use).

        ``bytes`` is the device memory the call released. Sleeping while (partly) asleep first wakes what is asleep
        (vLLM ignores a sleep while any tag sleeps), so the requested level always holds afterwards."""
        if level not in (1, 2):
            raise ConfigError("level", f"sleep level must be 1 or 2, got {level!r}.")
        self._require_open("sleep")
        self._require_idle("sleep")
        if not self.enable_sleep_mode:
            raise ConfigError("enable_sleep_mode", "sleep needs the engine built with enable_sleep_mode=True.")
        if self._weights != "awake" and not self._kv_awake:
            return TransferStats(0, 0.0, f"vllm sleep{level}")  # already fully asleep; a deeper level frees no more
        if not self._kv_awake or self._weights != "awake":
            # vLLM's sleep unmaps every allocation, so what was freed alone must be mapped again first (the
            # residency planner never asks for this order: weights leave together with the KV cache).
            self.wake_up()
        free_before = self._free_bytes()
        start = time.perf_counter()
        self.llm.sleep(level=level)
        seconds = time.perf_counter() - start
        self._kv_awake = False
        if level == 1:
            self._weights = "offloaded"
        else:
            self._weights = "discarded"
        return TransferStats(max(self._free_bytes() - free_before, 0), seconds, f"vllm sleep{level}")

    def release_kv_cache(self) -> TransferStats:
        """Free the KV cache and keep the weights on the GPU (vLLM's ``sleep`` can only free both); the prefix cache
        is reset first, since the cached blocks' contents go with it. ``wake_up(["kv_cache"])`` maps it back."""
        self._require_open("release_kv_cache")
        self._require_idle("release_kv_cache")
        if not self.enable_sleep_mode:
            raise ConfigError(
                "enable_sleep_mode",
                "releasing the KV cache needs the engine built with "
                "enable_sleep_mode=True (vLLM's sleep-mode allocator).",
            )
        if not self._kv_awake:
            return TransferStats(0, 0.0, "vllm release kv")
        start = time.perf_counter()
        self.reset_prefix_cache()
        freed = sum(self._rpc("hybrid_release_kv_cache"))
        self._kv_awake, self._kv_released = False, True
        return TransferStats(freed, time.perf_counter() - start, "vllm release kv")

    def wake_up(self, tags: Sequence[str] | None = None) -> TransferStats:
        """Bring back "weights" and/or "kv_cache" (both when ``tags`` is None); ``bytes``: device memory re-taken."""
        self._require_open("wake_up")
        wanted = _check_tags(tags)
        sleeping = {"weights": self._weights != "awake", "kv_cache": not self._kv_awake}
        asleep = [t for t in wanted if sleeping[t]]
        if not asleep:
            return TransferStats(0, 0.0, "vllm wake")
        free_before = self._free_bytes()
        start = time.perf_counter()
        if "kv_cache" in asleep and self._kv_released:  # freed by release_kv_cache: vLLM does not know it sleeps
            self._rpc("hybrid_reacquire_kv_cache")
            self._kv_awake, self._kv_released = True, False
            asleep.remove("kv_cache")
        if asleep:
            self.llm.wake_up(tags=[VLLM_WAKE_TAGS[t] for t in asleep])
        seconds = time.perf_counter() - start
        if "weights" in asleep:
            if self._weights == "discarded":
                counts = self._rpc("hybrid_expect_full_reload")
                self._missing = (max(counts), ["(every parameter: weights were discarded by sleep level 2)"])
            self._weights = "awake"
        if "kv_cache" in asleep:
            self._kv_awake = True
        return TransferStats(max(free_before - self._free_bytes(), 0), seconds, "vllm wake")

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
        """Every worker joins the trainer's group as rank ``rank_offset + its TP rank`` (the trainer is rank 0)."""
        self._require_open("init_weight_update_group")
        workers = self.llm.llm_engine.vllm_config.parallel_config.world_size
        if rank_offset < 1 or rank_offset + workers > world_size:
            raise ConfigError(
                "rank_offset",
                f"this engine's {workers} worker(s) need ranks {rank_offset}.."
                f"{rank_offset + workers - 1} inside world_size={world_size}.",
                "Rank 0 is the trainer; give each engine a disjoint range of ranks >= 1.",
            )
        self._rpc(
            "hybrid_init_weight_group",
            master_address,
            master_port,
            rank_offset,
            world_size,
            backend,
            timeout_s,
            group_name,
            timeout=timeout_s + 30,
        )
        self._group = True

    def update_weights(self, metas: Sequence[Any], *, bucket_bytes: int) -> TransferStats:
        """Receive one sync from the trainer's ``WeightSender`` (rank 0) and load it; resets the prefix cache.

        The trainer must call ``WeightSender(group, bucket_bytes).send(named_tensors)`` at the same time, with the
        tensors ``metas`` describes, in that order (names as in the Hugging Face checkpoint)."""
        if not self._group:
            raise EngineStateError("update_weights: no weight-update group. Call init_weight_update_group first.")
        self._require_weights_on_device("update_weights")
        self._require_not_stepping("update_weights")
        wire = [(m.name, m.dtype, tuple(m.shape)) for m in metas]
        if self.lora is not None:  # the adapter's tensors alone
            results = self._rpc("hybrid_receive_adapter", wire, bucket_bytes, *self._adapter_args())
            self._lora_request = self._make_lora_request()
            return self._after_update(results, "vllm adapter sync")
        results = self._rpc("hybrid_receive_weights", wire, bucket_bytes, self.weight_loading == "layerwise")
        return self._after_update(results, "vllm weight sync")

    def update_weights_from_ipc(self, bucket: Any) -> TransferStats:
        """Load one CUDA-IPC bucket (``IpcBucket``) of a trainer on this engine's GPU, or a list of buckets, one per
        GPU of a TP > 1 engine (each worker takes the one on its GPU). Returns once copied; the sync's last delivery
        resets the prefix cache (once per sync, not per bucket)."""
        if self.weight_loading == "layerwise":
            raise ConfigError(
                "weight_loading",
                "the IPC path loads bucket by bucket, which layerwise reload cannot do "
                "(a bucket may hold part of a layer).",
                "Use update_weights (broadcast) for layerwise.",
            )
        self._require_weights_on_device("update_weights_from_ipc")
        self._require_not_stepping("update_weights_from_ipc")
        buckets = list(bucket) if isinstance(bucket, (list, tuple)) else [bucket]
        last = any(getattr(b, "last", True) for b in buckets)
        if self.lora is not None:  # the adapter's tensors alone; the last bucket makes them the adapter
            results = self._rpc("hybrid_load_adapter_ipc", buckets, *self._adapter_args())
            if last:
                self._lora_request = self._make_lora_request()
            return self._after_update(results, "vllm adapter sync ipc", reset=last)
        return self._after_update(self._rpc("hybrid_load_ipc", buckets), "vllm weight sync ipc", reset=last)

    def _adapter_args(self) -> tuple[dict[str, Any], int]:
        return self.lora.peft_config(), HYBRID_LORA_ID

    def _make_lora_request(self) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(**HYBRID_LORA)

    def _with_lora(self) -> dict[str, Any]:
        """``lora_request=`` for vLLM's calls once the adapter is loaded (nothing otherwise)."""
        return {} if self._lora_request is None else {"lora_request": self._lora_request}

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (their KV was computed with the old weights). With requests paused in flight
        (partial rollouts) their blocks are still in use: the reset happens once none is left."""
        self._require_open("reset_prefix_cache")
        with self._cv:
            if self._live:
                self._prefix_stale = True
                return
            self._reset_prefix_now()

    def _reset_prefix_now(self) -> None:
        self._prefix_stale = False
        if not self.llm.reset_prefix_cache():
            raise EngineStateError("reset_prefix_cache: vLLM could not reset the prefix cache (requests running?).")

    def shutdown(self) -> None:
        """Leave the weight-sync group and release the engine (its GPU memory with it)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._group:
                self._rpc("hybrid_close_weight_group")
        finally:
            engine = getattr(self.llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
            import gc

            gc.collect()

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        timeout = self.rpc_timeout_s if timeout is None else timeout
        try:
            return self.llm.collective_rpc(method, timeout=timeout, args=args)
        except TimeoutError as e:
            raise RemoteTimeout(f"vllm collective_rpc {method}: no answer within {timeout:g} s") from e

    def _free_bytes(self) -> int:
        return sum(self._rpc("hybrid_free_bytes"))

    def _after_update(self, results: list[dict[str, Any]], what: str, *, reset: bool = True) -> TransferStats:
        if self._missing[0]:
            worst = max(results, key=lambda r: r["missing_count"])
            self._missing = (worst["missing_count"], worst["missing"])
        if reset:
            self.reset_prefix_cache()
        return TransferStats(results[0]["bytes"], max(r["seconds"] for r in results), what)

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise EngineStateError(f"{what}: the engine was shut down.")

    def _require_weights_on_device(self, what: str) -> None:
        self._require_open(what)
        if self._weights != "awake":
            level = 1 if self._weights == "offloaded" else 2
            raise EngineStateError(
                f"{what}: the weights are asleep (sleep level {level}). Call wake_up(['weights']) first."
            )

    def _require_ready(self, what: str) -> None:
        self._require_weights_on_device(what)
        if not self._kv_awake:
            raise EngineStateError(f"{what}: the KV cache is asleep. Call wake_up(['kv_cache']) (or wake_up()) first.")
        count, names = self._missing
        if count:
            raise EngineStateError(
                f"{what}: {count} parameter(s) hold no weights since sleep(level=2), e.g. "
                f"{', '.join(names)}. Re-sync the weights (update_weights / "
                "update_weights_from_ipc) before generating."
            )


@dataclass
class _Live:
    """One request of the stepping loop: what it produced so far, token by token."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: Any = None
    error: BaseException | None = None


def _check_tags(tags: Sequence[str] | None) -> list[str]:
    if tags is None:
        return list(WAKE_TAGS)
    if isinstance(tags, str) or any(t not in WAKE_TAGS for t in tags):
        raise ConfigError("tags", f"unknown wake-up tags {tags!r}.", f"Use a subset of {list(WAKE_TAGS)}.")
    return list(dict.fromkeys(tags))


def _check_args(
    tp: int,
    gpu_mem: float,
    weight_loading: str,
    bundle_indices: Sequence[int] | None,
    gpus_per_worker: float | None,
    rpc_timeout_s: float,
) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError("tensor_parallel_size", f"must be an int >= 1, got {tp!r}.")
    if not 0 < gpu_mem <= 1:
        raise ConfigError(
            "gpu_memory_utilization",
            f"must be in (0, 1], got {gpu_mem!r}.",
            "It is the fraction of the GPU this engine may take (weights + KV cache).",
        )
    if weight_loading not in ("direct", "layerwise"):
        raise ConfigError("weight_loading", f"must be 'direct' or 'layerwise', got {weight_loading!r}.")
    if bundle_indices is not None and len(bundle_indices) != tp:
        raise ConfigError("bundle_indices", f"needs one bundle per TP rank ({tp}), got {list(bundle_indices)}.")
    if bundle_indices is not None and len(set(bundle_indices)) != len(bundle_indices):
        raise ConfigError(
            "bundle_indices",
            f"must not repeat a bundle, got {list(bundle_indices)}.",
            "vLLM places one TP worker per bundle (one GPU each).",
        )
    if gpus_per_worker is not None and not 0 < gpus_per_worker <= 1:
        raise ConfigError("gpus_per_worker", f"must be in (0, 1], got {gpus_per_worker!r}.")
    if not rpc_timeout_s > 0:
        raise ConfigError("rpc_timeout_s", f"must be positive, got {rpc_timeout_s!r}.")


def _set_env_defaults(model: str) -> None:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if os.path.isdir(str(model)):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder needs no hub lookups (and may have no network)


def vllm_port_env(window: PortWindow, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment that puts vLLM 0.26's ports for one engine inside ``window`` (read in this process and, through
    the Ray executor's copy of the driver environment, in its TP workers).

    * ``VLLM_DP_MASTER_PORT`` = start: with data parallel size 1 ``ParallelConfig.__post_init__`` takes
      ``data_parallel_master_port`` from it (an engine argument would be overwritten), and the Ray executor searches
      its TCPStore port (``torch.distributed`` init of the TP workers) in start + 100 .. start + 131. Unset, it is 0
      for every engine: all of them probe port 100 and the second TCPStore fails with ``EADDRINUSE``.
    * ``VLLM_PORT`` = start + 10: where ``get_open_port`` scans upward from (the TP = 1 executor's init port, the Ray
      executor's fallback when its 32 tries are taken). Above start + 9: ``get_open_port`` keeps off the DP master
      port and the 9 ports above it, and loops forever while its scan lands there.

    The TCPStore window moves with the local DP rank (``VLLM_DP_RANK_LOCAL``, default ``VLLM_DP_RANK``), so both must
    be 0: hybrid runs each engine as its own vLLM instance (its data parallelism is across engines)."""
    for name in ("VLLM_DP_RANK_LOCAL", "VLLM_DP_RANK"):
        if environ.get(name, "0").strip() not in ("", "0"):
            raise ConfigError(
                name,
                f"is {environ[name]!r}, but every hybrid vLLM engine is a single instance (local "
                "DP rank 0): vLLM would move its TCPStore port search out of the engine's port window.",
                f"Unset {name}.",
            )
    if window.size < VLLMEngine.PORTS_NEEDED:
        raise ConfigError(
            "ports",
            f"{window} has {window.size} ports; vLLM's layout needs {VLLMEngine.PORTS_NEEDED}.",
            "Allocate the windows with size >= VLLMEngine.PORTS_NEEDED (launch_engines does).",
        )
    return {name: str(window.port(offset)) for name, offset in VLLM_PORT_LAYOUT.items()}


def _set_ray_placement(
    placement_group: Any, bundle_indices: Sequence[int] | None, gpus_per_worker: float | None
) -> None:
    """What vLLM 0.26's Ray executor reads to place TP workers (see the module docstring)."""
    import ray

    current = ray.util.get_current_placement_group() if ray.is_initialized() else None
    if placement_group is not None and (current is None or current.id != placement_group.id):
        raise ConfigError(
            "placement_group",
            "vLLM 0.26 places its TP workers in the placement group of the Ray actor "
            "that builds the engine, and this process is not in the given one.",
            "Build VLLMEngine inside an actor scheduled with PlacementGroupSchedulingStrategy(placement_group=pg).",
        )
    if bundle_indices is not None:
        os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(int(b)) for b in bundle_indices)
    if gpus_per_worker is not None:
        os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(float(gpus_per_worker))


def vllm_prompt_images(multimodal, prompts: int, *, pausable: bool) -> list[dict[str, Any]]:
    """Per prompt the ``TokensPrompt`` keys of its images (``multi_modal_data``; ``{}`` for none). Partial rollouts
    (the stepping loop) do not carry images yet: refused, not dropped."""
    from .multimodal import check_multimodal, vllm_multimodal_data

    check_multimodal(multimodal, prompts)
    if multimodal is None:
        return [{} for _ in range(prompts)]
    if pausable and any(m is not None and m.images for m in multimodal):
        raise ConfigError(
            "partial_rollout",
            "the vLLM engine's partial rollouts (its stepping loop) do not take images yet.",
            "Drop --partial_rollout for vision-language training.",
        )
    return [vllm_multimodal_data(m) for m in multimodal]
