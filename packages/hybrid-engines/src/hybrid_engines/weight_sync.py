"""Getting a trainer's new weights into its engines after each update, in the engines' own wire format.

Two paths, chosen once before Ray starts (:func:`choose_sync_mode`, from the run's settings and placement plan):

* ``ipc`` -- engines share the trainer's GPUs (colocated): each trainer rank packs flat buckets on its own GPU and
  hands them to the engine on that GPU; no copy leaves the device (shared memory on CPU). A TP > 1 engine spans
  several trainer ranks' GPUs: those ranks hand each bucket over together, one per GPU.
* ``broadcast`` -- engines on GPUs of their own: a torch.distributed group (trainer rank 0 + every engine worker)
  over NCCL (gloo on CPU) carries the buckets; ZeRO-3 shards are gathered one parameter at a time on the way.

Either way the trainer side is the engine's :class:`~hybrid_engines.weight_transport.WeightTransport`
(``engine_class(backend).weight_transport()``): an engine that receives SGLang's format gets SGLang's sender.

:class:`WeightSync` drives one run's syncs: made once, ``setup()``, then ``sync(wake_engines=...)`` after each
update, ``close()`` at the end. The trainer role it drives (``trainer``: an object with ``.workers``, Ray actor
handles in rank order) must expose, per worker, the methods of :class:`TrainerWeightSource` (mix it into the worker
class) plus ``where()`` and ``free_port(host)``.
"""

from __future__ import annotations

from typing import Any

from hybrid_core.errors import ConfigError
from hybrid_core.remote import get_all_with_timeout
from hybrid_core.stats import TransferStats

from .registry import engine_spec
from .weight_transport import WeightTransport

MODES = ("auto", "ipc", "broadcast")


# ---- before Ray: which path, and can the loop run it ------------------------------------------------------------------
def choose_sync_mode(settings: Any, plan: Any, *, trainer_role: str = "actor", engine_role: str = "rollout") -> str:
    """``"ipc"`` or ``"broadcast"`` for this plan, or a :class:`ConfigError` naming why the run cannot sync.

    ``settings``: anything with ``backend`` (engine name), ``weight_sync`` ("auto" | "ipc" | "broadcast") and
    ``vllm_sync_backend`` ("nccl" | "gloo" | None: nccl), e.g. the training config. ``auto`` is ipc when every
    engine worker shares a GPU with exactly one trainer rank (colocated, any TP), else broadcast. Refused: a path the engine's transport
    does not serve, an engine placement the engine cannot take, and broadcast over NCCL with an engine worker on the
    trainer rank 0's GPU (NCCL refuses two ranks of one group on a GPU)."""
    mode = getattr(settings, "weight_sync", "auto")
    if mode not in MODES:
        raise ConfigError("weight_sync", f"must be one of {list(MODES)}, got {mode!r}.")
    cls = engine_spec(settings.backend)
    trainer = plan.roles[trainer_role].workers
    engines = plan.roles[engine_role]
    trainer_gpus = [g for w in trainer for g in w.gpus]
    engine_gpus = [g for w in engines.workers for g in w.gpus]
    shared = (all(len(w.gpus) == 1 for w in trainer) and len(set(trainer_gpus)) == len(trainer_gpus)
              and sorted(engine_gpus) == sorted(trainer_gpus))
    refusal = getattr(cls, "placement_refusal", None)
    problem = refusal(tp=engines.tp, shares_gpus=bool(set(engine_gpus) & set(trainer_gpus))) if refusal else None
    if problem:
        raise ConfigError("backend", f"--backend {settings.backend} cannot run this placement: {problem}.",
                          "Use --backend vllm for this placement, or tensor-parallel size 1.")
    if mode == "auto":
        mode = "ipc" if shared else "broadcast"
    elif mode == "ipc" and not shared:
        raise ConfigError("weight_sync", "the ipc path needs the engines' GPUs to be exactly the actor's GPUs, "
                          "one actor rank and one engine worker on each.", "Use --weight_sync broadcast (or auto).")
    elif mode == "broadcast" and set(engine_gpus) & set(trainer[0].gpus) and _uses_nccl(settings, cls):
        raise ConfigError("weight_sync", "the broadcast path over NCCL puts actor rank 0 and the engine workers in "
                          "one group, and an engine worker shares rank 0's GPU: NCCL refuses two ranks on one GPU.",
                          "Use --weight_sync auto (ipc for colocated engines), or put the engines on their own GPUs.")
    transport = cls.weight_transport()
    problem = transport.refusal(mode, tp=engines.tp)
    if problem:
        raise ConfigError("weight_sync", f"--backend {settings.backend}: {problem}.",
                          "Use another --weight_sync path or placement, or --backend vllm.")
    return mode


def describe_sync(settings: Any, plan: Any) -> str:
    """One line for ``--dry-run``: the path, the wire format and the group backend (raises like the chooser)."""
    mode = choose_sync_mode(settings, plan)
    transport = engine_spec(settings.backend).weight_transport()
    over = f" over {group_backend(settings)} (gloo on a machine without CUDA)" if mode == "broadcast" else ""
    return f"{transport.describe(mode)}{over}"


def sync_backend_note(settings: Any, mode: str) -> str | None:
    """What an explicit ``--vllm_sync_backend`` does on the path chosen (``mode``), when it is not what it says: the
    ipc path has no collective group, so the backend of one is not used. NCCL could not carry it anyway: actor rank
    0 and the engine on its GPU would be two ranks of one group on one GPU, which NCCL refuses (the chooser refuses
    ``--weight_sync broadcast`` over NCCL there). OpenRLHF does the same with ``--vllm_sync_backend nccl
    --colocate_all_models``: CUDA IPC. None when the flag is unset (the default) or means what it says."""
    asked = getattr(settings, "vllm_sync_backend", None)
    if asked is None or mode != "ipc":
        return None
    why = (f"--vllm_sync_backend {asked}: not used: the engines share the actor's GPUs, so the weights go to them by "
           "CUDA IPC (shared memory without CUDA), with no collective group (as OpenRLHF does with "
           "--colocate_all_models)")
    if asked == "nccl":
        return (f"{why}; NCCL cannot hold actor rank 0 and the engine on its GPU in one group (two ranks on one GPU). "
                "To broadcast anyway: --weight_sync broadcast --vllm_sync_backend gloo (through host memory, slower).")
    return f"{why}. To broadcast over {asked} anyway: --weight_sync broadcast (slower)."


def group_backend(settings: Any) -> str:
    """The broadcast group's backend asked for: ``vllm_sync_backend``, nccl when unset (OpenRLHF's default)."""
    return getattr(settings, "vllm_sync_backend", None) or "nccl"


def sync_backend(settings: Any) -> str:
    """The broadcast group's backend here: ``vllm_sync_backend`` (default nccl) with CUDA, gloo without."""
    import torch

    return group_backend(settings) if torch.cuda.is_available() else "gloo"


def _uses_nccl(settings: Any, engine_cls: type) -> bool:
    """NCCL is what the group will use: asked for, and the engines need a GPU (the built-in engine on a machine
    without CUDA syncs over gloo)."""
    if group_backend(settings) != "nccl":
        return False
    if getattr(engine_cls, "NEEDS_GPU", False):
        return True
    import torch

    return torch.cuda.is_available()


# ---- the trainer's workers -------------------------------------------------------------------------------------------
class TrainerWeightSource:
    """Mixed into the trainer's worker (a Ray actor): its side of :class:`WeightSync`.

    The worker provides ``named_weights()`` (full tensors in checkpoint names; under ZeRO-3 every rank iterates
    together), ``weight_metas()``, ``rank`` and ``device``.
    """

    _weight_group: Any = None

    def init_sync_group(self, transport: WeightTransport, master_addr: str, master_port: int, world_size: int,
                        backend: str, timeout_s: float) -> None:
        """Rank 0 joins the engines' weight-update group as its sender (rank 0 of that group)."""
        if self.rank == 0:
            self._weight_group = transport.join(master_addr, master_port, world_size, backend=backend,
                                                timeout_s=timeout_s, device=self.device)

    def send_weights(self, transport: WeightTransport, bucket_bytes: int, verify: bool = True) -> dict:
        """Broadcast the weights to every engine worker (rank 0 sends; other ranks only help gather ZeRO-3 shards);
        ``verify``: with the checksums the engines check (where the transport has them)."""
        weights = self.named_weights()
        if self.rank != 0:
            for _ in weights:
                pass
            return TransferStats(0, 0.0, "sync").as_dict()
        return transport.broadcast(self._weight_group, weights, bucket_bytes=bucket_bytes,
                                   **_verify_kwargs(transport, verify)).as_dict()

    def send_weights_ipc(self, transport: WeightTransport, engine: Any, bucket_bytes: int, timeout_s: float,
                         peers: list[int] | None = None, engine_index: int | None = None, verify: bool = True) -> dict:
        """Colocated: hand buckets on this rank's GPU to the engine there (``peers``: the ranks one TP engine
        spans, this one among them; ``engine_index``: that engine's number, for errors)."""
        engine_name = "rollout engine" if engine_index is None else f"rollout engine {engine_index}"
        return transport.send_ipc(self.named_weights(), engine, bucket_bytes=bucket_bytes, device=self.device,
                                  timeout_s=timeout_s, peers=peers,
                                  what=f"{engine_name} (on actor rank {self.rank}'s GPU): update_weights_from_ipc",
                                  **_verify_kwargs(transport, verify)).as_dict()

    def close_sync_group(self, transport: WeightTransport) -> None:
        group, self._weight_group = self._weight_group, None
        transport.close_group(group)


# ---- the driver ----------------------------------------------------------------------------------------------------
class WeightSync:
    """One run's weight syncs from ``trainer`` (its workers mix in :class:`TrainerWeightSource`) to ``engines``
    (an :class:`~hybrid_engines.ray_engines.EngineGroup`), on the path ``mode`` (from :func:`choose_sync_mode`).

    ``transport``: the trainer's side; default the engines' own (``engine_spec(engines.backend)``). ``verify``
    (default on): every sync is checked by the engines against the trainer's checksums, and a mismatch ends it with
    :class:`~hybrid_core.errors.WeightSyncMismatch` naming the engine and the parameter (``verify_weight_sync``;
    a transport without checksums, SGLang's, is not checked: :func:`verify_note`)."""

    def __init__(self, mode: str, actor: Any, engines: Any, plan: Any, *, bucket_bytes: int, backend: str,
                 timeout_s: float, transport: WeightTransport | None = None, trainer_role: str = "actor",
                 engine_role: str = "rollout", verify: bool = True):
        if mode not in ("ipc", "broadcast"):
            raise ConfigError("mode", f"must be 'ipc' or 'broadcast', got {mode!r}.", "Use choose_sync_mode(...).")
        self.mode, self.actor, self.engines = mode, actor, engines
        self.bucket_bytes, self.backend, self.timeout_s = bucket_bytes, backend, timeout_s
        if transport is None and engines is not None:
            transport = engine_spec(engines.backend).weight_transport()
        self.transport = transport
        self.verify = bool(verify)
        self._joined = False
        if mode == "ipc":
            # trainer rank r -> the engine with a worker on r's GPU, and every trainer rank that engine spans
            engine_of_gpu = {g: e for e, w in enumerate(plan.roles[engine_role].workers) for g in w.gpus}
            self.engine_for_rank = [engine_of_gpu[w.gpus[0]] for w in plan.roles[trainer_role].workers]
            self.peers = [[r for r, e in enumerate(self.engine_for_rank) if e == mine] for mine in self.engine_for_rank]

    def setup(self) -> None:
        """Broadcast path: trainer rank 0 and every engine worker rendezvous in a fresh group (both sides at once)."""
        if self.mode != "broadcast":
            return
        import ray

        from hybrid_core import rendezvous

        rank0 = self.actor.workers[0]
        info = ray.get(rank0.where.remote(), timeout=self.timeout_s)
        # loopback when actor rank 0 and every engine share a node (the group's listeners bind it), else rank 0's
        # cluster address
        engine_ips = [w["node_ip"] for w in self.engines.call("where", timeout_s=self.timeout_s)]
        host = rendezvous.choose([info["node_ip"], *engine_ips]).host
        port = ray.get(rank0.free_port.remote(host), timeout=self.timeout_s)
        world = 1 + self.engines.num_workers
        engine_refs = self.engines.init_weight_update_group_async(host, port, backend=self.backend,
                                                                  timeout_s=self.timeout_s)
        trainer_ref = rank0.init_sync_group.remote(self.transport, host, port, world, self.backend, self.timeout_s)
        get_all_with_timeout([("actor rank 0: init weight-sync group", trainer_ref),
                              *[(f"rollout engine {i}: init weight-sync group", r) for i, r in enumerate(engine_refs)]],
                             self.timeout_s)
        self._joined = True

    def sync(self, *, wake_engines: bool) -> TransferStats:
        """Send the trainer's current weights to every engine; returns bytes and seconds of the send."""
        if wake_engines:
            self.engines.wake_up(["weights"])
        if self.mode == "ipc":
            refs = [(f"actor rank {r}: send_weights_ipc to rollout engine {self.engine_for_rank[r]}",
                     w.send_weights_ipc.remote(self.transport, self.engines.actors[self.engine_for_rank[r]],
                                               self.bucket_bytes, self.timeout_s, self.peers[r],
                                               self.engine_for_rank[r], self.verify))
                    for r, w in enumerate(self.actor.workers)]
            results = _wait_for_sync(refs, self.timeout_s)
            # the engines dropped their prefix caches with the last delivery (the protocol says so)
            return TransferStats(sum(r["bytes"] for r in results), max(r["seconds"] for r in results), "sync")
        else:
            import ray

            if not self._joined:
                raise ConfigError("weight_sync", "sync() before setup(): the broadcast group does not exist yet.",
                                  "Call WeightSync.setup() once after the engines start.")
            metas = ray.get(self.actor.workers[0].weight_metas.remote(), timeout=self.timeout_s)
            engine_refs = self.engines.update_weights_async(metas, bucket_bytes=self.bucket_bytes)
            actor_refs = [(f"actor rank {r}: send_weights",
                           w.send_weights.remote(self.transport, self.bucket_bytes, self.verify))
                          for r, w in enumerate(self.actor.workers)]
            results = _wait_for_sync(
                [*actor_refs, *[(f"rollout engine {i}: update_weights", r) for i, r in enumerate(engine_refs)]],
                self.timeout_s)
            stats = TransferStats(results[0]["bytes"], results[0]["seconds"], "sync")
        self.engines.reset_prefix_cache()
        return stats

    def close(self) -> None:
        """Release the trainer's side of the broadcast group (the engines release theirs at shutdown)."""
        if not self._joined:
            return
        self._joined = False
        get_all_with_timeout([("actor rank 0: close weight-sync group",
                               self.actor.workers[0].close_sync_group.remote(self.transport))],
                             min(self.timeout_s, 60.0))


def _wait_for_sync(named_refs: list, timeout_s: float) -> list:
    """``get_all_with_timeout``, where an engine's failed verification surfaces as
    :class:`~hybrid_core.errors.WeightSyncMismatch` (its message names the engine's call and the parameter)."""
    from hybrid_core.errors import RoleFailure
    from hybrid_core.weight_sync.verify import as_mismatch

    try:
        return get_all_with_timeout(named_refs, timeout_s)
    except RoleFailure as e:
        mismatch = as_mismatch(e)
        if mismatch is None:
            raise
        raise mismatch from e


def _verify_kwargs(transport: WeightTransport, verify: bool) -> dict:
    """``verify=`` for a transport with checksums; nothing for one without (it has no such argument)."""
    return {"verify": verify} if getattr(transport, "verifies", False) else {}


def verify_note(settings: Any) -> str | None:
    """What ``verify_weight_sync`` (on by default) cannot do for this backend, said at start; None where every sync
    is checked. SGLang receives in its own code and format, with no checksums to compare."""
    if not getattr(settings, "verify_weight_sync", True):
        return ("--no_verify_weight_sync: the engines' weights are not checked against the trainer's after each "
                "sync")
    transport = engine_spec(settings.backend).weight_transport()
    if getattr(transport, "verifies", False):
        return None
    return (f"--backend {settings.backend}: weight syncs are not verified: the engine receives them in its own code "
            f"and format ({transport.name}), which carries no checksums; the built-in (hf) and vLLM engines are "
            "checked after every sync")
