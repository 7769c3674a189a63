"""Inference engines as Ray actors on the GPUs a placement plan gives them, driven as one group with deadlines.

    placed = place(plan)                                    # hybrid_core.placement
    engines = launch_engines(placed, "rollout", backend="hf", engine_kwargs={"model": path})
    outputs = engines.generate(prompt_ids, SamplingParams(...))   # split across engines, gathered in order
    engines.sleep(1); engines.wake_up(["weights"])
    refs = engines.init_weight_update_group(addr, port, backend="nccl")   # + the trainer joins as rank 0
    refs = engines.update_weights(metas, bucket_bytes=...)                # + the trainer sends, concurrently

Engine ``r`` of a role is worker ``r`` of that role in the plan: its actor is created with
``placed.actor_options(role, r)`` (its first plan GPU's bundle). A tensor-parallel engine (TP > 1, vLLM/SGLang)
gets ``placement_group`` and ``bundle_indices`` in its engine kwargs and places its own TP workers on those bundles;
its actor then takes half of the worker's GPU fraction on the first bundle and the adapter is told the other half
per TP worker (``gpus_per_worker``, passed when the adapter accepts it), so the fractions on a shared GPU still sum
to at most 1.

Which GPUs an engine process sees (CUDA_VISIBLE_DEVICES; the rule :func:`cuda_visibility` implements):

* By default Ray sets an actor's CUDA_VISIBLE_DEVICES to the GPU(s) it reserved. With
  ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` (set so that DeepSpeed ranks can index devices by local rank,
  and so that colocated processes agree on device indices for CUDA IPC) Ray leaves it alone and every actor sees
  all GPUs of its node. hybrid forwards that variable to every worker (``hybrid_core.runtime_env``).
* TP = 1, built-in engine: the environment is never changed; the engine runs on ``cuda:i``, ``i`` the local index
  of its Ray GPU (``cuda:0`` without NOSET, where that GPU is all the process sees).
* TP = 1, vLLM / SGLang: these libraries use the first visible device, so under NOSET the actor sets
  CUDA_VISIBLE_DEVICES to its Ray GPU before the engine starts (without NOSET Ray already did).
* TP > 1: the actor reserved only part of its first GPU, and the engine starts its TP workers itself on the
  bundles it was given, each made to see its own GPU by the engine (vLLM's Ray executor does this). A
  CUDA_VISIBLE_DEVICES inherited from the actor would hide those GPUs, so the actor removes it, with or without NOSET.
"""

from __future__ import annotations

import gc
import inspect
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_core.errors import ConfigError
from hybrid_core.faults import maybe_inject
from hybrid_core.remote import get_all_with_timeout

from .protocol import GenerationOutput, SamplingParams

if TYPE_CHECKING:
    from hybrid_core.ports import PortWindow

NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
#: the torch CPU threads of every engine actor, whatever the backend (default: :func:`engine_threads` decides)
ENGINE_THREADS_ENV = "HYBRID_ENGINE_THREADS"
_RAY_STEP = 10_000  # Ray accounts GPU fractions in steps of 1e-4


def cuda_visibility(backend: str, tp_size: int, noset: bool, ray_gpu_ids: Sequence[Any]) -> tuple[str, str | None]:
    """What an engine actor does to CUDA_VISIBLE_DEVICES: ("keep", None), ("set", ids) or ("unset", None)."""
    if tp_size > 1:
        return "unset", None
    if noset and backend != "hf" and ray_gpu_ids:
        return "set", ",".join(str(g) for g in ray_gpu_ids)
    return "keep", None


def engine_threads(backend: str, cpus: int, gpus_on_node: int, override: str | None = None) -> int | None:
    """The torch CPU threads an engine actor runs with, or None to keep Ray's (``OMP_NUM_THREADS``: 1 for an actor
    holding a share of a GPU).

    vLLM's in-process engine core prepares every decode step with torch CPU ops: with Ray's one thread a 357M model's
    generate call took ~9 % longer on an H100 (``bench/generate_overhead.py`` variant G, 2026-11-24). The roles on a
    GPU take turns, so while the engine generates its GPU's share of the node's cores is free: ``cpus // GPUs of the
    node``, at most 8. The built-in engine keeps Ray's count: on CPU its numerics depend on the thread count, and two
    runs of one config must agree. ``HYBRID_ENGINE_THREADS=k`` sets ``k`` for every backend."""
    if override:
        try:
            threads = int(override)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ConfigError(
                ENGINE_THREADS_ENV,
                f"must be a whole number >= 1, got {override!r}.",
                "Unset it to let hybrid choose, or give the threads per engine.",
            )
        return threads
    if backend == "hf":
        return None
    return max(1, min(8, cpus // max(1, gpus_on_node)))


def _node_gpus() -> int:
    """GPUs Ray counts on this actor's node."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    return int(next((n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("NodeID") == node), 0))


class GcPause:
    """Python's cyclic garbage collector off while at least one generate call runs in this process.

    vLLM's and SGLang's engine loops are CPU-bound on small and mid-size models (one scheduler step per token), and
    every step allocates Python objects; the collections they trigger stole ~9 % of a 357M model's generate call in a
    Ray actor on an H100 (``bench/generate_overhead.py`` variant H, 2026-11-24). Nothing cyclic is freed later than
    the end of the call. Counted, so concurrent calls (partial rollouts) keep it off until the last one returns."""

    def __init__(self):
        self._lock, self._depth, self._was_enabled = threading.Lock(), 0, False

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._was_enabled:
                gc.enable()
        return False


def local_device_index(ray_gpu_id: Any, visible: str | None) -> int:
    """The CUDA index, inside this process, of the GPU Ray calls ``ray_gpu_id``."""
    if visible:
        ids = [v.strip() for v in visible.split(",")]
        if str(ray_gpu_id) in ids:
            return ids.index(str(ray_gpu_id))
    return int(ray_gpu_id)


class EngineActor:
    """One inference engine in its own Ray actor, built by :func:`~hybrid_engines.registry.make_engine`.

    Every :class:`~hybrid_engines.protocol.InferenceEngine` method is forwarded; ``where`` reports the node, Ray GPU
    ids and CUDA_VISIBLE_DEVICES (for checks and error messages). Create it through :func:`launch_engines`, or as
    ``ray.remote(EngineActor).options(...).remote(backend, engine_kwargs, tp_size=...)``.
    """

    def __init__(
        self, backend: str, engine_kwargs: Mapping[str, Any], *, tp_size: int = 1, role: str = "rollout", rank: int = 0
    ):
        import ray

        from .registry import make_engine

        self.role, self.rank, self.backend = role, rank, backend
        maybe_inject(role, "create", rank)  # HYBRID_FAULT=rollout:create:die: an engine that dies being built
        kwargs = dict(engine_kwargs)
        gpu_ids = list(ray.get_gpu_ids())
        noset = bool(os.environ.get(NOSET_ENV))
        action, value = cuda_visibility(backend, tp_size, noset, gpu_ids)
        if action == "set":
            os.environ["CUDA_VISIBLE_DEVICES"] = value  # type: ignore[assignment]
        elif action == "unset":
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if backend == "hf" and "device" not in kwargs and gpu_ids and _cuda_available():
            kwargs["device"] = f"cuda:{local_device_index(gpu_ids[0], os.environ.get('CUDA_VISIBLE_DEVICES'))}"
        threads = engine_threads(
            backend, len(os.sched_getaffinity(0)), _node_gpus(), os.environ.get(ENGINE_THREADS_ENV)
        )
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        self.engine = make_engine(backend, **kwargs)
        # Engines' sleep paths run gc.collect() (vLLM's CuMemAllocator does); with torch, transformers and the engine
        # imported, each full collection walks millions of objects (~0.8 s on a CPU core). Freezing what set-up built
        # takes it out of those walks.
        gc.collect()
        gc.freeze()
        self._gc_pause = GcPause()

    def ready(self) -> bool:
        return True

    def where(self) -> dict[str, Any]:
        import ray
        import torch

        return {
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pid": os.getpid(),
            "device": str(getattr(self.engine, "device", "")),
            "torch_threads": torch.get_num_threads(),
        }

    def generate(self, prompt_token_ids, params, multimodal=None):
        maybe_inject(self.role, "generate", self.rank)
        with self._gc_pause:
            if multimodal is None:  # text only: the call every engine takes
                return self.engine.generate(prompt_token_ids, params)
            return self.engine.generate(prompt_token_ids, params, multimodal)

    def generate_timed(self, prompt_token_ids, params, multimodal=None) -> dict[str, Any]:
        """``generate``, with when it ran in this process (Unix seconds): the step timeline of asynchronous training
        places generation next to the trainer's phases."""
        start = time.time()
        outputs = self.generate(prompt_token_ids, params, multimodal)
        return {"outputs": outputs, "start": start, "end": time.time()}

    # ---- partial rollouts (engines that implement hybrid_engines.protocol.PausableEngine) --------------------------
    def pause_generation(self, timeout_s: float = 600.0) -> dict:
        return self._pausable("pause_generation").pause_generation(timeout_s)

    def resume_generation(self) -> None:
        return self._pausable("resume_generation").resume_generation()

    def set_weight_version(self, version: int) -> None:
        setter = getattr(self.engine, "set_weight_version", None)
        if setter is not None:  # an engine that marks no versions has nothing to set
            setter(version)

    def _pausable(self, what: str):
        if not callable(getattr(self.engine, what, None)):
            raise ConfigError(
                "partial_rollout",
                f"the {self.backend} engine cannot pause a generation in flight ({what}).",
                "Drop --partial_rollout, or use --backend hf / vllm / sglang.",
            )
        return self.engine

    def sleep(self, level: int = 1):
        return self.engine.sleep(level)

    def wake_up(self, tags=None):
        return self.engine.wake_up(tags)

    def release_kv_cache(self):
        return self.engine.release_kv_cache()

    def init_weight_update_group(
        self,
        master_address,
        master_port,
        rank_offset,
        world_size,
        *,
        group_name="hybrid-weight-sync",
        backend="nccl",
        timeout_s=600.0,
    ):
        return self.engine.init_weight_update_group(
            master_address,
            master_port,
            rank_offset,
            world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
        )

    def update_weights(self, metas, *, bucket_bytes: int):
        return self.engine.update_weights(metas, bucket_bytes=bucket_bytes)

    def update_weights_from_ipc(self, bucket):
        return self.engine.update_weights_from_ipc(bucket)

    def reset_prefix_cache(self) -> None:
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        return self.engine.shutdown()


class EngineGroup:
    """The engines of one role, driven together. Every call waits under a deadline (``timeout_s``, or the
    per-call override) and a late or failed engine raises ``RemoteTimeout`` / ``RoleFailure`` naming the role, the
    engine rank and the method."""

    def __init__(
        self, role: str, backend: str, actors: list, tp_sizes: list[int], timeout_s: float, gpus: Sequence[int] = ()
    ):
        self.role, self.backend, self.actors, self.tp_sizes, self.timeout_s = role, backend, actors, tp_sizes, timeout_s
        self._gpus = sorted(gpus)
        self.engine_gpus: list[list[int]] = []  # each engine's plan GPUs (launch_engines): errors name them
        self.port_windows: list[PortWindow] = []  # each engine's ports (launch_engines), see Reserved.window

    @property
    def num_engines(self) -> int:
        return len(self.actors)

    @property
    def num_workers(self) -> int:
        """Ranks the engines take in a weight-sync group (one per GPU: TP workers each join)."""
        return sum(self.tp_sizes)

    def rank_offsets(self) -> list[int]:
        """Weight-sync rank of each engine's first worker: rank 0 is the trainer, then engines in order."""
        offsets, next_rank = [], 1
        for tp in self.tp_sizes:
            offsets.append(next_rank)
            next_rank += tp
        return offsets

    # ---- calls -----------------------------------------------------------------------------------------------------
    def _name(self, rank: int, method: str) -> str:
        from hybrid_core.roles import gpu_label

        gpus = self.engine_gpus[rank] if rank < len(self.engine_gpus) else []
        return f"{self.role} engine {rank}: {method}" + (f" on {gpu_label(gpus)}" if gpus else "")

    def wait(
        self, refs: Sequence[Any], method: str, timeout_s: float | None = None, ranks: Sequence[int] | None = None
    ) -> list[Any]:
        """Results of one call per engine (``ranks``: which engines the refs belong to; default all, in order)."""
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        named = [(self._name(r, method), ref) for r, ref in zip(ranks, refs)]
        return get_all_with_timeout(named, self.timeout_s if timeout_s is None else timeout_s)

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every engine and wait for all of them."""
        refs = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
        return self.wait(refs, method, timeout_s)

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        timeout_s: float | None = None,
        multimodal: Sequence[Any] | None = None,
    ) -> list[list[GenerationOutput]]:
        """Split the prompts across the engines, generate, and return the outputs in prompt order.

        Identical prompts go to the same engine, so a seeded call gives the same samples on any number of engines
        (the built-in engine keys its randomness on the prompt and on repeats of it within a call). ``multimodal``:
        each prompt's images (``MultimodalInput`` or None), sent with it."""
        shares = split_prompts(prompt_token_ids, self.num_engines)
        ranks = [r for r, share in enumerate(shares) if share]
        refs = [
            self.actors[r].generate.remote(
                [prompt_token_ids[i] for i in shares[r]], params, _share(multimodal, shares[r])
            )
            for r in ranks
        ]
        results = self.wait(refs, "generate", timeout_s, ranks)
        return _in_prompt_order(len(prompt_token_ids), shares, ranks, results)

    def submit_generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        what: str = "generate",
        multimodal: Sequence[Any] | None = None,
    ) -> PendingGeneration:
        """Start a generation without waiting for it (asynchronous training: it runs while the trainer works);
        :meth:`PendingGeneration.result` collects it, in prompt order, with when each engine ran it."""
        shares = split_prompts(prompt_token_ids, self.num_engines)
        ranks = [r for r, share in enumerate(shares) if share]
        refs = [
            self.actors[r].generate_timed.remote(
                [prompt_token_ids[i] for i in shares[r]], params, _share(multimodal, shares[r])
            )
            for r in ranks
        ]
        return PendingGeneration(self, len(prompt_token_ids), shares, ranks, refs, what)

    def pause_generation(self, *, timeout_s: float | None = None) -> list[dict]:
        """Park every engine's running generations (partial rollouts); returns once all of them are parked."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return self.call("pause_generation", timeout, timeout_s=timeout)

    def resume_generation(self, *, timeout_s: float | None = None) -> None:
        self.call("resume_generation", timeout_s=timeout_s)

    def set_weight_version(self, version: int, *, timeout_s: float | None = None) -> None:
        """Tokens every engine samples from now on are marked with ``version``."""
        self.call("set_weight_version", int(version), timeout_s=timeout_s)

    def sleep(self, level: int = 1, *, timeout_s: float | None = None) -> list:
        return self.call("sleep", level, timeout_s=timeout_s)

    def wake_up(self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None) -> list:
        return self.call("wake_up", list(tags) if tags is not None else None, timeout_s=timeout_s)

    def reset_prefix_cache(self, *, timeout_s: float | None = None) -> None:
        self.call("reset_prefix_cache", timeout_s=timeout_s)

    def release_kv_cache(self, *, timeout_s: float | None = None) -> list:
        return self.call("release_kv_cache", timeout_s=timeout_s)

    # ---- residency: the owner (hybrid_core.residency) starts these and waits for them itself -------------------------
    @property
    def gpus(self) -> list[int]:
        return list(self._gpus)

    def offload(self, states: Sequence[str], moves: Mapping[str, str]) -> list[tuple[str, Any]]:
        """Weights leaving take the KV cache with them: sleep level 1 (``offload``) or 2 (``discard``); the KV cache
        alone is released with the weights kept."""
        if "weights" in states:
            level = 1 if moves.get("weights") == "offload" else 2
            return [(self._name(r, f"sleep({level})"), a.sleep.remote(level)) for r, a in enumerate(self.actors)]
        return [(self._name(r, "release_kv_cache"), a.release_kv_cache.remote()) for r, a in enumerate(self.actors)]

    def reload(self, states: Sequence[str]) -> list[tuple[str, Any]]:
        return [
            (self._name(r, f"wake_up({list(states)})"), a.wake_up.remote(list(states)))
            for r, a in enumerate(self.actors)
        ]

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        backend: str = "nccl",
        timeout_s: float | None = None,
        group_name: str = "hybrid-weight-sync",
    ) -> list:
        """Start every engine joining the weight-sync group; returns one ref per engine (wait with :meth:`wait`).

        The world is 1 + :attr:`num_workers`; the trainer must join as rank 0 at the same time (the rendezvous
        needs every rank), which is why this does not block."""
        world = 1 + self.num_workers
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return [
            a.init_weight_update_group.remote(
                master_address, master_port, offset, world, group_name=group_name, backend=backend, timeout_s=timeout
            )
            for a, offset in zip(self.actors, self.rank_offsets())
        ]

    def update_weights(self, metas: Sequence[Any], *, bucket_bytes: int) -> list:
        """Start every engine receiving the broadcast of ``metas``; returns one ref per engine, so the trainer can
        send concurrently (wait with :meth:`wait`)."""
        return [a.update_weights.remote(list(metas), bucket_bytes=bucket_bytes) for a in self.actors]

    # Names the training loop uses; both forms return refs.
    init_weight_update_group_async = init_weight_update_group
    update_weights_async = update_weights

    def shutdown(self, *, timeout_s: float | None = None) -> None:
        """Shut every engine down, then end the actors (also when an engine fails to shut down in time)."""
        import ray

        try:
            self.call("shutdown", timeout_s=timeout_s)
        finally:
            for a in self.actors:
                try:
                    ray.kill(a)
                except Exception:  # already gone, or Ray itself is: the others are still ended
                    pass
            self.actors = []


@dataclass
class PendingGeneration:
    """A generation started by :meth:`EngineGroup.submit_generate`, not yet collected."""

    group: EngineGroup
    count: int
    shares: list[list[int]]
    ranks: list[int]
    refs: list[Any]
    what: str

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self, timeout_s: float | None = None) -> tuple[list[list[GenerationOutput]], float, float]:
        """(outputs in prompt order, first engine's start, last engine's end) -- Unix seconds; waits under the
        deadline, and a late or failed engine raises naming it and ``what`` the generation was for."""
        results = self.group.wait(self.refs, self.what, timeout_s, self.ranks)
        outputs = _in_prompt_order(self.count, self.shares, self.ranks, [r["outputs"] for r in results])
        return outputs, min(r["start"] for r in results), max(r["end"] for r in results)


def _in_prompt_order(count: int, shares: list[list[int]], ranks: list[int], results: list) -> list:
    out: list[Any] = [None] * count
    for r, res in zip(ranks, results):
        for i, outputs in zip(shares[r], res):
            out[i] = outputs
    return out


def _share(multimodal: Sequence[Any] | None, indices: Sequence[int]) -> list[Any] | None:
    """One engine's part of the prompts' multimodal inputs (None: a text-only call)."""
    if multimodal is None or all(m is None for m in multimodal):
        return None
    return [multimodal[i] for i in indices]


def split_prompts(prompts: Sequence[Sequence[int]], num_engines: int) -> list[list[int]]:
    """Prompt indices per engine: contiguous, balanced by count, with all copies of a prompt on one engine."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    shares: list[list[int]] = [[] for _ in range(num_engines)]
    total, assigned, engine = len(prompts), 0, 0
    for indices in groups.values():
        # move on once this engine holds its share of the prompts assigned so far
        while engine < num_engines - 1 and assigned >= (engine + 1) * total / num_engines:
            engine += 1
        shares[engine].extend(indices)
        assigned += len(indices)
    return [sorted(s) for s in shares]


def launch_engines(
    placed: Any,
    role: str = "rollout",
    backend: str = "hf",
    engine_kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 600.0,
    env_vars: Mapping[str, str] | None = None,
    max_concurrency: int = 1,
    reserved_ports: Sequence[Any] = (),
) -> EngineGroup:
    """Start one engine per worker of ``role`` in the placed plan and wait until all are built.

    ``engine_kwargs`` go to every engine (e.g. ``model``); tensor-parallel engines also get ``placement_group``,
    ``bundle_indices`` and ``gpus_per_worker`` (see the module docstring). ``timeout_s`` bounds the start-up and
    becomes the group's per-call deadline. ``env_vars`` are added to the actors' environment (on top of the
    variables :mod:`hybrid_core.runtime_env` forwards to every worker). ``max_concurrency`` > 1 lets an engine take
    calls while a ``generate`` runs (partial rollouts: pause, weight update, resume; its engine must implement
    :class:`~hybrid_engines.protocol.PausableEngine`); 1 (default) runs calls one after another, in order.
    Engines that open ports (vLLM, SGLang: ``PORTS_NEEDED``) each get ``ports``, a window of their own on their node,
    checked against each other, Ray's ports and ``reserved_ports`` (:class:`hybrid_core.ports.Reserved`, e.g. a
    trainer rendezvous port, or a running group's ``port_windows``) before any actor starts
    (:func:`hybrid_core.ports.engine_windows`)."""
    import ray

    from hybrid_core.ports import engine_windows
    from hybrid_core.runtime_env import worker_runtime_env

    from .registry import engine_class

    plan = placed.plan
    if role not in plan.roles:
        raise ConfigError(
            "role",
            f"the plan has no role {role!r} (roles: {', '.join(plan.roles)}).",
            "Give the engines' role GPUs in the placement.",
        )
    cls = engine_class(backend)  # a missing backend fails here, before any actor starts
    if max_concurrency > 1 and not callable(getattr(cls, "pause_generation", None)):
        raise ConfigError(
            "partial_rollout",
            f"{backend} engines cannot pause a generation in flight, so they cannot take calls while one runs.",
            "Drop --partial_rollout, or use --backend hf / vllm / sglang.",
        )
    tp = plan.roles[role].tp
    kwargs = dict(engine_kwargs or {})
    refusal = getattr(cls, "placement_refusal", None)
    problem = refusal(tp=tp, shares_gpus=bool(plan.shared_gpus(role))) if refusal else None
    if problem:
        raise ConfigError(
            f"{role}.tp",
            f"{backend} engines cannot take this placement: {problem}.",
            "Use tensor-parallel size 1, or backend 'vllm'.",
        )
    given_tp = kwargs.get("tensor_parallel_size")
    if given_tp is not None and given_tp != tp:
        raise ConfigError(
            "tensor_parallel_size",
            f"engine kwargs ask for {given_tp}, the plan gives {role} {tp}.",
            "Make the engines' tensor-parallel size match the placement.",
        )
    accepts = _accepted_kwargs(cls)
    if backend != "hf" and (accepts is None or "tensor_parallel_size" in accepts):
        kwargs.setdefault("tensor_parallel_size", tp)
    env = worker_runtime_env(env_vars)
    windows = engine_windows(placed, role, cls, backend, env["env_vars"], kwargs, reserved_ports)
    remote_cls = ray.remote(EngineActor)
    actors = []
    try:
        for rank in range(len(plan.roles[role].workers)):
            options, placement_kwargs = engine_placement(placed, role, rank, accepts)
            if windows:
                placement_kwargs["ports"] = windows[rank]
            actors.append(
                remote_cls.options(**options, runtime_env=env, max_restarts=0, max_concurrency=max_concurrency).remote(
                    backend, {**kwargs, **placement_kwargs}, tp_size=tp, role=role, rank=rank
                )
            )
        group = EngineGroup(role, backend, actors, [tp] * len(actors), timeout_s, gpus=plan.roles[role].gpus)
        group.engine_gpus = [list(w.gpus) for w in plan.roles[role].workers]
        group.port_windows = list(windows or ())  # another group beside it reserves these (Reserved.window)
        group.wait([a.ready.remote() for a in actors], "start")  # the first engine that dies ends the wait
    except BaseException:
        for a in actors:  # the others too: one still being built holds its GPU (and its child processes) otherwise
            try:
                ray.kill(a)
            except Exception:
                pass
        raise
    return group


def engine_placement(
    placed: Any, role: str, rank: int, accepts: set[str] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(actor options, extra engine kwargs)`` for engine ``rank`` of ``role``.

    TP 1: the worker's own options. TP > 1: the actor takes half the worker's fraction of its first GPU and captures
    child tasks (the engine's TP workers land in the same placement group); the engine gets ``placement_group``,
    ``bundle_indices`` and, when its constructor takes it, ``gpus_per_worker`` (the other half)."""
    tp = placed.plan.roles[role].tp
    if tp == 1:
        return placed.actor_options(role, rank), {}
    slot = placed.worker(role, rank)
    half = math.floor(slot.num_gpus * _RAY_STEP / 2) / _RAY_STEP
    options = placed.actor_options(role, rank, capture_child_tasks=True)
    options["num_gpus"] = half
    extra: dict[str, Any] = {
        "placement_group": placed.placement_group,
        "bundle_indices": placed.bundle_indices(role, rank),
    }
    if accepts is None or "gpus_per_worker" in accepts:
        extra["gpus_per_worker"] = half
    return options, extra


def _accepted_kwargs(cls: type[Any]) -> set[str] | None:
    """Keyword names the engine's constructor takes (None when it takes **kwargs)."""
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
