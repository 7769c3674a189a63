"""SGLang adapter: :class:`~hybrid_engines.protocol.InferenceEngine` on ``sglang.Engine`` (SGLang 0.5.16 and 0.5.23).

Every SGLang name used here was read in the 0.5.16 and 0.5.23 wheels; where a server argument is defined is noted
next to it (0.5.23's ``srt/arg_groups/fields/<file>.py``; 0.5.16 has them all in ``srt/server_args.py``).
``tests/hybrid_engines/contracts`` checks the names against the installed package.

Facts this adapter is built on (each one differs from what the seed project assumed):

* Engine methods report failure as ``(False, message)`` instead of raising: every result is checked here.
* From 0.5.23 on, ``update_weights_from_distributed`` / ``update_weights_from_tensor`` only run inside a
  weight-update session (``begin_weight_update()`` ... ``end_weight_update()``,
  ``managers/scheduler_components/weight_updater.py``); 0.5.16 has no sessions. The adapter opens one per sync when
  the engine has them.
* Logprobs are temperature-scaled unless ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (``layers/sampler.py``, read when the
  scheduler process imports it); it is set here, before the engine starts, so logprobs are the raw model's.
* ``sampling_seed`` is ignored unless the engine runs with ``enable_deterministic_inference`` (``sampling/
  sampling_batch_info.py``). The protocol's seeded sampling is reproducible (the training loop seeds every step), so
  ``deterministic=True`` is the default here (batch-invariant kernels: slower); with ``deterministic=False`` seeded
  requests are refused. In deterministic mode SGLang gives every request without a seed the seed 42, so the ``n``
  samples of a prompt would all be the same sequence (a GRPO group with one answer: zero advantage, nothing learnt;
  seen on the GPU, 2026-11-24): unseeded rows get a fresh seed each here, drawn from the operating system's entropy
  (so engines of one run, which share ``seed``, do not draw alike). The training loop builds the engine
  deterministic only when it samples seeded (``--seeded_sampling``).
* Sleep frees the tags "weights", "kv_cache" and "cuda_graph" (``srt/constants.py``), each paused and resumed on
  its own by torch_memory_saver (``region(tag)`` / ``pause(tag)`` / ``resume(tag)`` in both versions), so weights
  come back before the KV cache. With ``enable_weights_cpu_backup`` the weights come back on resume (buffers such
  as rotary caches are stashed and restored by SGLang itself); without it they are garbage until re-synced. That is
  a server setting, so level 1 needs ``weights_cpu_backup=True``; level 2 always asks for a re-sync.

Weight sync: SGLang has its own group and wire formats, not hybrid-core's; the trainer's side of them is
:class:`~hybrid_engines.weight_sync.sglang.SGLangTransport` (``SGLangEngine.weight_transport()``). Broadcast:
``update_weights(metas, bucket_bytes=...)`` receives the trainer's :func:`send_to_sglang` in flattened buckets cut by
:func:`sglang_bucket_plan`. Colocated: ``update_weights_from_ipc`` forwards the trainer's serialized buckets
(``SGLangIpcPayload``) to ``update_weights_from_tensor(load_format="flattened_bucket")``, which maps the trainer's
CUDA memory in SGLang's scheduler; TP = 1 only.

Partial rollouts (``pausable=True``; :class:`~hybrid_engines.protocol.PausableEngine`): SGLang's event loop
(``Engine.loop``) runs in a thread of its own, and every ``Engine`` call made from other threads is sent to it (the
adapter gives the engine a loop stand-in whose ``run_until_complete`` does that), so generate calls from several
threads, pauses and weight updates all reach one engine. ``generate`` streams each row (``async_generate(...,
stream=True)``: cumulative ``output_ids``) and marks every token that arrives with the current weight version.
``pause_generation()`` is the tokenizer manager's ``pause_generation(PauseGenerationReqInput(mode="retract"))``:
running requests go back to the waiting queue with their tokens, their KV cache is freed (so the weight update may
flush the cache) and is recomputed with the new weights after ``continue_generation(ContinueGenerationReqInput())``
(``resume_generation()``). Tokens produced before the pause and still in SGLang's output pipe when it returns are
drained for ``PAUSE_DRAIN_S`` before the pause is reported, so they keep the old version.

Placement: TP = 1 and TP > 1 without a placement group use ``sglang.Engine`` on the GPUs this process sees
(``base_gpu_id`` onwards). TP > 1 with ``placement_group``/``bundle_indices`` uses SGLang's ``RayEngine``, whose
scheduler actors each take a whole GPU: refused (clear error) when ``gpus_per_worker`` < 1, i.e. GPUs shared, and
refused by the training loop's plan check (:meth:`SGLangEngine.placement_refusal`).

Ports (``ports``: this engine's :class:`~hybrid_core.ports.PortWindow`, given by ``launch_engines``): the server
arguments ``port`` and ``nccl_port`` come from the window (:func:`sglang_port_args`), so engines side by side never
share SGLang's default ``port`` 30000 nor race for a random ``nccl_port``. ``dist_init_addr`` stays SGLang's: unset,
``sglang.Engine`` initialises torch.distributed at 127.0.0.1:``nccl_port`` and ``RayEngine`` at its rank-0 node's IP
and ``nccl_port`` (``srt/ray/engine.py``), both inside the window.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hybrid_core.errors import ConfigError, RoleFailure
from hybrid_core.ports import PortWindow
from hybrid_core.stats import TransferStats

from .adapter import EngineAdapter, EnginePlan, EngineSettings, pooled_engine_kwargs
from .hf_engine import EngineStateError
from .protocol import WAKE_TAGS, GenerationOutput, SamplingParams
from .sampling_map import check_prompts, expand_rows, finish_reason, sglang_sampling_params
from .weight_sync.sglang import (  # noqa: F401  (the trainer's side, re-exported for custom loops)
    FLATTENED,
    SGLangIpcPayload,
    SGLangTransport,
    flatten_bucket,
    send_to_sglang,
    sglang_bucket_plan,
    sglang_trainer_group,
)

#: Our argument -> ``sglang.Engine`` / ``ServerArgs`` field (the contract test checks each field exists).
SGLANG_SERVER_ARGS = {
    "model": "model_path",  # fields/model.py
    "tensor_parallel_size": "tp_size",  # fields/parallel.py
    "gpu_memory_utilization": "mem_fraction_static",  # fields/schedule.py: weights + KV pool, as vLLM's
    "enable_sleep_mode": "enable_memory_saver",  # fields/exec_.py: needed by release/resume_memory_occupation
    "weights_cpu_backup": "enable_weights_cpu_backup",  # fields/exec_.py
    "enforce_eager": "disable_cuda_graph",  # fields/exec_.py (cuda_graph_hook.py: both phases); seed had it negated
    "dtype": "dtype",  # fields/model.py
    "seed": "random_seed",  # fields/device.py
    "max_model_len": "context_length",  # fields/model.py
    "enable_prefix_caching": "disable_radix_cache",  # fields/memory.py, negated
    "deterministic": "enable_deterministic_inference",  # fields/exec_.py: makes sampling_seed work
    "base_gpu_id": "base_gpu_id",  # fields/device.py
}
#: ``sglang.Engine`` methods used, with the keyword arguments passed (contract-tested).
SGLANG_ENGINE_METHODS = {
    "generate": ("input_ids", "sampling_params", "return_logprob", "image_data"),
    "release_memory_occupation": ("tags",),
    "resume_memory_occupation": ("tags",),
    "init_weights_update_group": (
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "group_name",
        "backend",
    ),
    "update_weights_from_distributed": ("names", "dtypes", "shapes", "group_name", "flush_cache", "load_format"),
    "update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
    "flush_cache": (),
    "shutdown": (),
}
#: Weight-update session methods: 0.5.23 requires them around every weight update; 0.5.16 has none.
SGLANG_SESSION_METHODS = ("begin_weight_update", "end_weight_update")
#: Our wake tags -> SGLang memory tags (srt/constants.py); CUDA graphs belong to the decode path: with the KV cache.
SGLANG_TAGS = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}
#: Partial rollouts: the tokenizer manager's pause / continue (``srt/managers/tokenizer_manager.py``), their request
#: types (``srt/managers/io_struct.py``) and the pause mode used.
SGLANG_PAUSE = {
    "pause": ("pause_generation", "PauseGenerationReqInput", {"mode": "retract"}),
    "resume": ("continue_generation", "ContinueGenerationReqInput", {}),
}
#: ``Engine.async_generate`` keyword arguments of a streamed row (contract-tested).
SGLANG_STREAM_ARGS = ("input_ids", "sampling_params", "return_logprob", "stream")
#: Seconds a pause waits, once SGLang reports it, for tokens already on their way out of the scheduler.
PAUSE_DRAIN_S = 0.05
#: Tokens SGLang keeps back from ``context_length``: its scheduler accepts an input only when shorter than
#: ``context_length - 1 - 5`` (srt/managers/tp_worker.py: max_req_len, then max_req_len - 5 for the input), where
#: vLLM's ``max_model_len`` bounds prompt + completion exactly. A tiny demo (3-token prompts, max_model_len 5) found it.
SGLANG_CONTEXT_RESERVE = 6
#: ``ServerArgs`` port fields -> offset in the engine's port window (:func:`sglang_port_args`)
SGLANG_PORT_ARGS = {"port": 0, "nccl_port": 1}
#: DP attention derives its ZMQ ports from ``port``: ``port + ZMQ_TCP_PORT_DELTA`` (233) and the ports above it (6
#: in 0.5.16; 0.5.23's Rust server adds one per DP rank; ``PortArgs.init_new`` in srt/server_args.py): a window of
#: 256 holds them for up to 16 DP ranks
SGLANG_DERIVED_PORTS = 256
#: The SGLang versions this adapter was checked against (contract tests on CPU; 0.5.16 also run on a GPU).
TESTED_VERSIONS = ("0.5.16", "0.5.23")


def sglang_context_length(model: Any, max_model_len: int | None) -> int | None:
    """SGLang's ``context_length`` for a vLLM-style ``max_model_len`` (prompt + completion): that many tokens more
    than SGLang keeps back, but never past the model's own positions (SGLang refuses a longer context)."""
    if max_model_len is None:
        return None
    wanted = max_model_len + SGLANG_CONTEXT_RESERVE
    try:
        with open(os.path.join(str(model), "config.json")) as f:
            positions = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        positions = None  # a hub name or no config: SGLang checks the length itself
    return min(wanted, positions) if isinstance(positions, int) and positions > 0 else wanted


class SGLangEngine(EngineAdapter):
    """The SGLang backend (same constructor spirit as :class:`~hybrid_engines.vllm_engine.VLLMEngine`)."""

    #: SGLang serves from CUDA devices only (the built-in engine also runs on CPU)
    NEEDS_GPU = True
    #: takes gpu_memory_utilization x its GPU at start-up for weights + KV cache (the dry run's memory model)
    MEMORY_POOL = True
    #: SGLang samples seeded requests one by one (a per-request generator each decode step); unseeded, in one batch
    CHEAP_SEEDED_SAMPLING = False
    #: ports each engine's window must hold (``launch_engines`` gives every engine its own window)
    PORTS_NEEDED = SGLANG_DERIVED_PORTS
    #: SGLang's ports are server arguments, so no environment variable would put engines on one port
    PORT_ENV: tuple[str, ...] = ()

    @classmethod
    def weight_transport(cls) -> SGLangTransport:
        """The trainer's side of this engine's weight sync (SGLang's own group and formats)."""
        return SGLangTransport()

    @classmethod
    def adapter_refusal(cls, spec: Any) -> str | None:
        """Under LoRA this adapter sends merged full weights: it does not hand SGLang an adapter by tensor (SGLang's
        receiving code is its own, in its own formats; adding the adapter path there is not built)."""
        return "the SGLang adapter does not load LoRA adapters by tensor (not built; SGLang receives merged weights)"

    @classmethod
    def engine_kwargs(cls, settings: EngineSettings, plan: EnginePlan) -> dict[str, Any]:
        """Every engine setting (:func:`~hybrid_engines.adapter.pooled_engine_kwargs`), plus ``deterministic``:
        SGLang honours seeds only in its slower deterministic mode, so only when the loop seeds its samples."""
        return {**pooled_engine_kwargs(settings, plan), "deterministic": plan.seeded_sampling}

    @classmethod
    def placement_refusal(cls, *, tp: int, shares_gpus: bool) -> str | None:
        """Why the training loop cannot place these engines (None: it can)."""
        if tp > 1:
            return (
                "SGLang runs TP > 1 through its RayEngine, whose scheduler actors each take a whole GPU "
                "(num_gpus=1, srt/ray/engine.py), while hybrid's engine actor holds part of the first GPU of its "
                "bundles" + (" and the trainer shares them" if shares_gpus else "")
            )
        return None

    def __init__(
        self,
        model: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = True,
        weights_cpu_backup: bool = True,
        enforce_eager: bool = False,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        stop_at_eos: bool = True,
        deterministic: bool = True,
        base_gpu_id: int = 0,
        placement_group: Any = None,
        bundle_indices: Sequence[int] | None = None,
        gpus_per_worker: float | None = None,
        pausable: bool = False,
        call_timeout_s: float = 600.0,
        ports: PortWindow | None = None,
        **extra: Any,
    ):
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size", f"must be an int >= 1, got {tensor_parallel_size!r}.")
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {gpu_memory_utilization!r}.")
        _require_raw_logprobs()
        if os.path.isdir(str(model)):
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        engine_cls = _engine_class(tensor_parallel_size, placement_group, bundle_indices, gpus_per_worker)
        ours = dict(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            weights_cpu_backup=weights_cpu_backup,
            enforce_eager=enforce_eager,
            dtype=dtype,
            seed=seed,
            max_model_len=sglang_context_length(model, max_model_len),
            enable_prefix_caching=not enable_prefix_caching,  # SGLang's field is disable_radix_cache
            deterministic=deterministic,
            base_gpu_id=base_gpu_id,
        )
        kwargs = {SGLANG_SERVER_ARGS[k]: v for k, v in ours.items()}
        if ports is not None:
            kwargs.update(sglang_port_args(ports, extra))
        kwargs.update(extra)
        if tensor_parallel_size > 1 and placement_group is not None:  # RayEngine pops it (srt/ray/engine.py)
            kwargs["placement_group"] = placement_group
        self.engine = engine_cls(**kwargs)
        self.tp = tensor_parallel_size
        self.ports = ports
        self.enable_sleep_mode, self.weights_cpu_backup = enable_sleep_mode, weights_cpu_backup
        self.stop_at_eos, self.deterministic = stop_at_eos, deterministic
        self._unseeded = random.SystemRandom()  # seeds of unseeded rows in deterministic mode (see the module doc)
        self._asleep: set[str] = set()  # our tags currently released
        self._needs_sync = False  # weights garbage until a weight update (sleep level 2 / no CPU backup)
        self._group_name: str | None = None
        self._ipc_session: _UpdateSession | None = None
        self._closed = False
        self.pausable, self.call_timeout_s = pausable, call_timeout_s
        self._version = 0
        self._paused = False
        self._in_flight = 0
        self._lock = threading.Lock()
        self._loop_thread: _LoopThread | None = None
        if pausable:
            self._loop_thread = _LoopThread(self.engine, call_timeout_s)

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams, multimodal=None
    ) -> list[list[GenerationOutput]]:
        """``params.n`` completions per prompt, in prompt order; ``multimodal[i]``: prompt ``i``'s images, given to
        SGLang as the request's ``image_data`` (the token ids hold the placeholders, expanded)."""
        self._require_ready("generate")
        prompts = check_prompts(prompt_token_ids)
        images = sglang_prompt_images(multimodal, len(prompts), pausable=self.pausable)
        rows = expand_rows(prompts, params)
        if not self.deterministic and any(r.seed is not None for r in rows):
            raise ConfigError(
                "seed",
                "SGLang ignores per-request seeds unless the engine runs deterministic "
                "inference, and this engine was built with deterministic=False.",
                "Build SGLangEngine(deterministic=True) (the default), or sample with seed=None.",
            )
        sampling = [
            sglang_sampling_params(params, seed=self._row_seed(r.seed, params), stop_at_eos=self.stop_at_eos)
            for r in rows
        ]
        if self.pausable:
            return self._generate_streamed(prompts, rows, sampling, params)
        extra = {} if images is None else {"image_data": [images[r.prompt] for r in rows]}
        outs = self.engine.generate(
            input_ids=[prompts[r.prompt] for r in rows],
            sampling_params=sampling,
            return_logprob=params.logprobs,
            **extra,
        )
        return self._outputs(prompts, rows, outs, params)

    def _row_seed(self, seed: int | None, params: SamplingParams) -> int | None:
        """The row's ``sampling_seed``: its own, or in deterministic mode a fresh one (SGLang would use 42 for all)."""
        if seed is not None or not self.deterministic or params.greedy:
            return seed
        return self._unseeded.getrandbits(63)

    def _outputs(self, prompts, rows, outs, params: SamplingParams) -> list[list[GenerationOutput]]:
        """SGLang's answers per row as ``GenerationOutput`` per prompt and sample; a streamed row (partial rollouts)
        brings its tokens' weight versions, a plain one was sampled by the current weights."""
        results: list[list[Any]] = [[None] * params.n for _ in prompts]
        for row, out in zip(rows, outs, strict=True):
            ids = list(out["output_ids"])
            meta = out["meta_info"]
            logprobs = None
            if params.logprobs:
                steps = meta["output_token_logprobs"]  # [(logprob, token_id, text or None)] per output token
                if [int(s[1]) for s in steps] != ids:
                    raise RoleFailure("sglang generate: output_token_logprobs do not line up with output_ids.")
                logprobs = [float(s[0]) for s in steps]
            results[row.prompt][row.sample] = GenerationOutput(
                prompt_token_ids=prompts[row.prompt],
                token_ids=ids,
                logprobs=logprobs,
                finish_reason=finish_reason(meta["finish_reason"], engine="sglang"),
                weight_versions=out.get("versions", [self._version] * len(ids)),
            )
        return results

    # ---- partial rollouts ----------------------------------------------------------------------------------------
    def _generate_streamed(self, prompts, rows, sampling, params: SamplingParams):
        async def row_stream(ids: list[int], sp: dict) -> dict:
            stream = await self.engine.async_generate(
                input_ids=ids, sampling_params=sp, return_logprob=params.logprobs, stream=True
            )
            versions: list[int] = []
            last: dict = {}
            async for chunk in stream:  # cumulative output_ids: what arrived now was sampled by the current weights
                got = len(chunk["output_ids"])
                versions.extend([self._version] * (got - len(versions)))
                last = chunk
            return {**last, "versions": versions}

        async def every_row() -> list:
            return await asyncio.gather(*(row_stream(prompts[r.prompt], sp) for r, sp in zip(rows, sampling)))

        with self._lock:
            self._in_flight += 1
        try:
            outs = self._pausable_loop().run(every_row(), "generate")
        finally:
            with self._lock:
                self._in_flight -= 1
        return self._outputs(prompts, rows, outs, params)

    def pause_generation(self, timeout_s: float = 600.0) -> dict:
        """Retract every running request (tokens kept, KV freed; recomputed after resume) and stop scheduling."""
        self._require_open("pause_generation")
        if not self.pausable:
            raise ConfigError(
                "pausable",
                "this engine was built without pausable=True (partial rollouts).",
                "Build SGLangEngine(pausable=True).",
            )
        method, request, kwargs = SGLANG_PAUSE["pause"]
        self._pausable_loop().run(
            self._manager_call(method, request, kwargs, drain=PAUSE_DRAIN_S), "pause_generation", timeout_s
        )
        with self._lock:
            self._paused = True
            return {"parked": self._in_flight, "version": self._version}

    def resume_generation(self) -> None:
        self._require_open("resume_generation")
        if not self.pausable:
            return
        method, request, kwargs = SGLANG_PAUSE["resume"]
        self._pausable_loop().run(self._manager_call(method, request, kwargs), "resume_generation")
        with self._lock:
            self._paused = False

    def set_weight_version(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError("version", f"must be a whole number >= 0, got {version!r}.")
        with self._lock:
            self._version = version

    async def _manager_call(self, method: str, request: str, kwargs: dict, drain: float = 0.0) -> Any:
        from sglang.srt.managers import io_struct

        result = await getattr(self.engine.tokenizer_manager, method)(getattr(io_struct, request)(**kwargs))
        if drain:
            await asyncio.sleep(drain)
        return result

    def _require_not_generating(self, what: str) -> None:
        with self._lock:
            if self._in_flight and not self._paused:
                raise EngineStateError(
                    f"{what}: generation is running; call pause_generation() first (partial "
                    "rollouts) or wait for generate to return."
                )

    # ---- sleep / wake ------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> TransferStats:
        """Release weights, KV cache and CUDA graphs. ``bytes`` is 0: SGLang does not report what it freed."""
        if level not in (1, 2):
            raise ConfigError("level", f"sleep level must be 1 or 2, got {level!r}.")
        self._require_open("sleep")
        if not self.enable_sleep_mode:
            raise ConfigError("enable_sleep_mode", "sleep needs the engine built with enable_sleep_mode=True.")
        if level == 1 and not self.weights_cpu_backup:
            raise ConfigError(
                "level",
                "sleep level 1 keeps the weights, which needs SGLangEngine(weights_cpu_backup="
                "True) (SGLang's enable_weights_cpu_backup).",
                "Use level 2 and re-sync the weights.",
            )
        start = time.perf_counter()
        awake = [t for t in WAKE_TAGS if t not in self._asleep]
        if awake:
            self._check(self.engine.release_memory_occupation(tags=_sglang_tags(awake)), "release_memory_occupation")
        self._asleep = set(WAKE_TAGS)
        if level == 2 or not self.weights_cpu_backup:
            self._needs_sync = self._needs_sync or "weights" in awake
        return TransferStats(0, time.perf_counter() - start, f"sglang sleep{level}")

    def release_kv_cache(self) -> TransferStats:
        """Free the KV cache (and the decode CUDA graphs that belong to it), keep the weights."""
        self._require_open("release_kv_cache")
        if not self.enable_sleep_mode:
            raise ConfigError(
                "enable_sleep_mode", "releasing the KV cache needs the engine built with enable_sleep_mode=True."
            )
        start = time.perf_counter()
        if "kv_cache" not in self._asleep:
            self._check(
                self.engine.release_memory_occupation(tags=_sglang_tags(["kv_cache"])), "release_memory_occupation"
            )
            self._asleep.add("kv_cache")
        return TransferStats(0, time.perf_counter() - start, "sglang release kv")

    def wake_up(self, tags: Sequence[str] | None = None) -> TransferStats:
        self._require_open("wake_up")
        wanted = list(WAKE_TAGS) if tags is None else list(dict.fromkeys(tags))
        if isinstance(tags, str) or any(t not in WAKE_TAGS for t in wanted):
            raise ConfigError("tags", f"unknown wake-up tags {tags!r}.", f"Use a subset of {list(WAKE_TAGS)}.")
        asleep = [t for t in wanted if t in self._asleep]
        start = time.perf_counter()
        if asleep:
            self._check(self.engine.resume_memory_occupation(tags=_sglang_tags(asleep)), "resume_memory_occupation")
        self._asleep -= set(asleep)
        return TransferStats(0, time.perf_counter() - start, "sglang wake")

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
        """SGLang's TP ranks join as ``rank_offset + tp_rank``; the trainer joins with :func:`sglang_trainer_group`.

        ``timeout_s`` is not SGLang's to take (its group uses torch's default timeout); the caller's Ray call
        deadline bounds this call."""
        self._require_open("init_weight_update_group")
        if rank_offset < 1 or rank_offset + self.tp > world_size:
            raise ConfigError(
                "rank_offset",
                f"the engine's {self.tp} TP rank(s) need ranks {rank_offset}.."
                f"{rank_offset + self.tp - 1} inside world_size={world_size}.",
            )
        self._check(
            self.engine.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            ),
            "init_weights_update_group",
        )
        self._group_name = group_name

    def update_weights(self, metas: Sequence[Any], *, bucket_bytes: int) -> TransferStats:
        """Receive the trainer's :func:`send_to_sglang` broadcasts (same ``metas`` order and ``bucket_bytes``)."""
        if self._group_name is None:
            raise EngineStateError("update_weights: no weight-update group. Call init_weight_update_group first.")
        self._require_weights_on_device("update_weights")
        self._require_not_generating("update_weights")
        start = time.perf_counter()
        with self._session():
            for bucket in sglang_bucket_plan(metas, bucket_bytes):
                self._check(
                    self.engine.update_weights_from_distributed(
                        names=[m.name for m in bucket],
                        dtypes=[m.dtype for m in bucket],
                        shapes=[list(m.shape) for m in bucket],
                        group_name=self._group_name,
                        flush_cache=False,
                        load_format=FLATTENED,
                    ),
                    "update_weights_from_distributed",
                )
        return TransferStats(sum(m.nbytes for m in metas), time.perf_counter() - start, "sglang weight sync")

    def update_weights_from_ipc(self, bucket: Any) -> TransferStats:
        """Load one delivery of a colocated trainer (TP = 1): an :class:`SGLangIpcPayload` (made by
        ``SGLangTransport`` in the trainer process), or a hybrid-core ``IpcBucket`` (encoded here; its handle still
        names the trainer's memory, which SGLang's scheduler maps). The first delivery of a sync opens a weight-update
        session, the last closes it and flushes the cache; until then the engine counts as mid-update."""
        if self.tp != 1:
            raise ConfigError(
                "tensor_parallel_size",
                "the SGLang IPC path supports TP = 1 only.",
                "Use update_weights (broadcast) for TP > 1.",
            )
        self._require_weights_on_device("update_weights_from_ipc")
        self._require_not_generating("update_weights_from_ipc")
        payload = (
            bucket
            if isinstance(bucket, SGLangIpcPayload)
            else SGLangIpcPayload.of(list(bucket) if isinstance(bucket, (list, tuple)) else [bucket])
        )
        if payload.data and len(payload.data) != self.tp:
            raise ConfigError(
                "bucket",
                f"got {len(payload.data)} serialized bucket(s) for an engine of TP {self.tp}.",
                "Send one per TP rank (SGLangTransport.encode_ipc).",
            )
        start = time.perf_counter()
        if payload.index == 0 or self._ipc_session is None:
            self._close_ipc_session(ok=False)  # a sync that never finished: its session is dropped
            self._ipc_session = self._session()
            self._ipc_session.__enter__()
        try:
            if payload.data:
                self._check(
                    self.engine.update_weights_from_tensor(
                        named_tensors=list(payload.data), load_format=FLATTENED, flush_cache=False
                    ),
                    "update_weights_from_tensor",
                )
        except BaseException:
            self._close_ipc_session(ok=False)
            raise
        if payload.last:
            self._close_ipc_session(ok=True)
        return TransferStats(payload.nbytes, time.perf_counter() - start, "sglang weight sync ipc")

    def _close_ipc_session(self, *, ok: bool) -> None:
        session, self._ipc_session = self._ipc_session, None
        if session is not None:
            session.__exit__(None if ok else RuntimeError, None, None)

    def reset_prefix_cache(self) -> None:
        self._require_open("reset_prefix_cache")
        self._check(self.engine.flush_cache(), "flush_cache")

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.engine.shutdown()
            finally:
                if self._loop_thread is not None:
                    self._loop_thread.stop()

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _session(self) -> _UpdateSession:
        return _UpdateSession(self)

    @staticmethod
    def _check(result: Any, what: str) -> Any:
        """SGLang returns ``(success, message)`` (or an object with ``.success``) instead of raising."""
        ok, message = result if isinstance(result, tuple) else (getattr(result, "success", True), result)
        if ok is False:
            raise RoleFailure(f"sglang {what} failed: {message}")
        return result

    def _pausable_loop(self) -> _LoopThread:
        """The event-loop thread that streams, pauses and resumes: a pausable engine's (built in ``__init__``)."""
        assert self._loop_thread is not None, "only a pausable engine streams, pauses or resumes"
        return self._loop_thread

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise EngineStateError(f"{what}: the engine was shut down.")

    def _require_weights_on_device(self, what: str) -> None:
        self._require_open(what)
        if "weights" in self._asleep:
            raise EngineStateError(f"{what}: the weights are asleep. Call wake_up(['weights']) first.")

    def _require_ready(self, what: str) -> None:
        self._require_weights_on_device(what)
        if "kv_cache" in self._asleep:
            raise EngineStateError(f"{what}: the KV cache is asleep. Call wake_up(['kv_cache']) (or wake_up()) first.")
        if self._ipc_session is not None:
            raise EngineStateError(f"{what}: a weight update by IPC is in progress (its last bucket has not arrived).")
        if self._needs_sync:
            raise EngineStateError(
                f"{what}: the weights were discarded by sleep. Re-sync them (update_weights / "
                "update_weights_from_ipc) before generating."
            )


class _UpdateSession:
    """One weight update: ``begin_weight_update`` ... ``end_weight_update`` where the engine has them (0.5.23), then
    one cache flush (the loads pass flush_cache=False). A failed update leaves the weights counted as not synced."""

    def __init__(self, engine: SGLangEngine):
        self.e = engine
        self.sessions = all(callable(getattr(engine.engine, m, None)) for m in SGLANG_SESSION_METHODS)

    def __enter__(self) -> None:
        if self.sessions:
            self.e._check(self.e.engine.begin_weight_update(), "begin_weight_update")

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self.sessions:
            self.e._check(self.e.engine.end_weight_update(), "end_weight_update")
        if exc_type is None:
            self.e._needs_sync = False
            self.e.reset_prefix_cache()


class _LoopThread:
    """SGLang's event loop, run in a thread of its own (partial rollouts). The engine's ``loop`` attribute becomes a
    stand-in whose ``run_until_complete`` submits the coroutine to that thread and waits (under ``timeout_s``), so
    every ``Engine`` method keeps working from any thread, while generations run."""

    def __init__(self, engine: Any, timeout_s: float):
        self.loop = engine.loop
        self.timeout_s = timeout_s
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-event-loop", daemon=True)
        self.thread.start()
        engine.loop = self

    def run(self, coro: Any, what: str, timeout_s: float | None = None) -> Any:
        import concurrent.futures

        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            from hybrid_core.errors import RemoteTimeout

            raise RemoteTimeout(f"sglang {what}: no answer within {timeout:g} s") from None

    def run_until_complete(self, coro: Any) -> Any:
        return self.run(coro, getattr(coro, "__qualname__", "call"))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def __getattr__(self, name: str) -> Any:  # anything else SGLang asks of its loop
        return getattr(self.loop, name)


def _engine_class(
    tp: int, placement_group: Any, bundle_indices: Sequence[int] | None, gpus_per_worker: float | None
) -> type:
    """``sglang.Engine`` (schedulers as subprocesses on this process's GPUs), or for TP > 1 on given Ray bundles
    SGLang's own ``RayEngine`` (``srt/ray/engine.py``: one scheduler actor per bundle, in the order of
    ``SGLANG_RAY_BUNDLE_INDICES``). Its scheduler actors take ``num_gpus=1`` each, so their GPUs cannot be shared."""
    import sglang

    if tp == 1 or placement_group is None:
        return sglang.Engine
    if gpus_per_worker is not None and gpus_per_worker < 1:
        raise ConfigError(
            "gpus_per_worker",
            f"SGLang 0.5.23 gives each TP scheduler a whole GPU (num_gpus=1 in "
            f"srt/ray/engine.py), so it cannot run on {gpus_per_worker} of a GPU shared with another "
            "role.",
            "Give SGLang's TP > 1 engines GPUs of their own (and the engine actor num_gpus=0), "
            "or use vLLM for colocated tensor parallelism.",
        )
    if bundle_indices is not None:
        if len(bundle_indices) != tp:
            raise ConfigError("bundle_indices", f"needs one bundle per TP rank ({tp}), got {list(bundle_indices)}.")
        os.environ["SGLANG_RAY_BUNDLE_INDICES"] = ",".join(str(int(b)) for b in bundle_indices)
    from sglang.srt.ray.engine import RayEngine

    return RayEngine


def sglang_port_args(window: PortWindow, extra: Mapping[str, Any]) -> dict[str, int]:
    """``port`` and ``nccl_port`` inside ``window`` (see the module docstring); a port argument given too is refused:
    it would be the same for every engine."""
    given = [k for k in (*SGLANG_PORT_ARGS, "dist_init_addr") if k in extra]
    if given:
        raise ConfigError(
            given[0],
            f"is given to every SGLang engine alike, but {window.owner} has a port window of "
            "its own and takes its ports from it.",
            f"Drop {', '.join(given)} from the engine kwargs; move the windows with HYBRID_ENGINE_BASE_PORT=<port>.",
        )
    if window.size < SGLangEngine.PORTS_NEEDED:
        raise ConfigError(
            "ports",
            f"{window} has {window.size} ports; SGLang's layout needs {SGLangEngine.PORTS_NEEDED}.",
            "Allocate the windows with size >= SGLangEngine.PORTS_NEEDED (launch_engines does).",
        )
    return {name: window.port(offset) for name, offset in SGLANG_PORT_ARGS.items()}


def _sglang_tags(tags: Iterable[str]) -> list[str]:
    return [s for t in tags for s in SGLANG_TAGS[t]]


def _require_raw_logprobs() -> None:
    value = os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    if value.strip().lower() not in ("1", "true", "yes", "on"):
        raise ConfigError(
            "SGLANG_RETURN_ORIGINAL_LOGPROB",
            f"is {value!r}: SGLang would return temperature-scaled "
            "logprobs, but the protocol promises the raw model's.",
            "Unset it or set it to 1.",
        )


def sglang_prompt_images(multimodal, prompts: int, *, pausable: bool) -> list[Any] | None:
    """Per prompt its images for SGLang's ``image_data`` (None: a text-only call). Streamed rows (partial rollouts)
    do not carry images yet: refused, not dropped."""
    from .multimodal import check_multimodal, sglang_image_data

    check_multimodal(multimodal, prompts)
    if multimodal is None or all(m is None or not m.images for m in multimodal):
        return None
    if pausable:
        raise ConfigError(
            "partial_rollout",
            "the SGLang engine's partial rollouts (streamed rows) do not take images yet.",
            "Drop --partial_rollout for vision-language training.",
        )
    return [sglang_image_data(m) for m in multimodal]
