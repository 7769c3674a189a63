"""Driving one run's weight syncs: :class:`WeightSync` on the driver, :class:`TrainerWeightSource` in the trainer's
workers.

:class:`WeightSync` is made once per run on the path :func:`~hybrid_engines.weight_sync.choice.choose_sync` chose,
``setup()``, then ``sync(wake_engines=...)`` after each update, ``close()`` at the end. The trainer role it drives
(``trainer``: an object with ``.workers``, Ray actor handles in rank order) must expose, per worker, the methods of
:class:`TrainerWeightSource` (mix it into the worker class) plus ``where()`` and ``free_port(host)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from hybrid_core.errors import ConfigError
from hybrid_core.remote import get_all_with_timeout
from hybrid_core.stats import TransferStats

from ..registry import engine_spec
from .transport import WeightTransport


# ---- the trainer's workers -------------------------------------------------------------------------------------------
class TrainerWeightSource:
    """Mixed into the trainer's worker (a Ray actor): its side of :class:`WeightSync`.

    The worker provides ``named_weights()`` (full tensors in checkpoint names; under ZeRO-3 every rank iterates
    together), ``weight_metas()``, ``rank`` and ``device``; for adapter-only syncs (``adapter=True``, LoRA:
    :mod:`.adapter`) also ``adapter_weights()`` / ``adapter_metas()``, the same for the adapter's tensors alone.
    """

    _weight_group: Any = None

    if TYPE_CHECKING:  # for mypy only: what the worker this is mixed into provides (see the docstring)
        rank: int
        device: Any

        def named_weights(self) -> Iterator[tuple[str, Any]]: ...

        def adapter_weights(self) -> Iterator[tuple[str, Any]]: ...

    def _sync_tensors(self, adapter: bool) -> Iterator[tuple[str, Any]]:
        """What one sync sends: the full weights, or (``adapter``) the LoRA adapter's tensors alone."""
        return self.adapter_weights() if adapter else self.named_weights()

    def init_sync_group(
        self,
        transport: WeightTransport,
        master_addr: str,
        master_port: int,
        world_size: int,
        backend: str,
        timeout_s: float,
    ) -> None:
        """Rank 0 joins the engines' weight-update group as its sender (rank 0 of that group)."""
        if self.rank == 0:
            self._weight_group = transport.join(
                master_addr, master_port, world_size, backend=backend, timeout_s=timeout_s, device=self.device
            )

    def send_weights(
        self, transport: WeightTransport, bucket_bytes: int, verify: Any = True, adapter: bool = False
    ) -> dict:
        """Broadcast the weights to every engine worker (rank 0 sends; other ranks only help gather ZeRO-3 shards);
        ``verify``: with the checksums the engines check (where the transport has them); ``adapter``: the LoRA
        adapter's tensors alone."""
        weights = self._sync_tensors(adapter)
        if self.rank != 0:
            for _ in weights:
                pass
            return TransferStats(0, 0.0, "sync").as_dict()
        return transport.broadcast(
            self._weight_group, weights, bucket_bytes=bucket_bytes, **_verify_kwargs(transport, verify)
        ).as_dict()

    def send_weights_ipc(
        self,
        transport: WeightTransport,
        engine: Any,
        bucket_bytes: int,
        timeout_s: float,
        peers: list[int] | None = None,
        engine_index: int | None = None,
        verify: Any = True,
        adapter: bool = False,
    ) -> dict:
        """Colocated: hand buckets on this rank's GPU to the engine there (``peers``: the ranks one TP engine
        spans, this one among them; ``engine_index``: that engine's number, for errors; ``adapter``: the LoRA
        adapter's tensors alone)."""
        engine_name = "rollout engine" if engine_index is None else f"rollout engine {engine_index}"
        return transport.send_ipc(
            self._sync_tensors(adapter),
            engine,
            bucket_bytes=bucket_bytes,
            device=self.device,
            timeout_s=timeout_s,
            peers=peers,
            what=f"{engine_name} (on actor rank {self.rank}'s GPU): update_weights_from_ipc",
            **_verify_kwargs(transport, verify),
        ).as_dict()

    def close_sync_group(self, transport: WeightTransport) -> None:
        group, self._weight_group = self._weight_group, None
        transport.close_group(group)


# ---- the driver ----------------------------------------------------------------------------------------------------
class WeightSync:
    """One run's weight syncs from ``trainer`` (its workers mix in :class:`TrainerWeightSource`) to ``engines``
    (an :class:`~hybrid_engines.ray_engines.EngineGroup`), on the path ``mode`` (``SyncChoice.mode``).

    ``backend``: the broadcast group's (``SyncChoice.group_backend``). ``transport``: the trainer's side; default the
    engines' own (``engine_spec(engines.backend)``, as ``SyncChoice.transport``). ``bucket_bytes`` and ``verify``:
    the run's :class:`~.settings.SyncSettings` (``bucket_bytes``, ``verify``: "sampled", the default, or True: the
    first sync checks every piece, later ones a rotating sample, ``hybrid_core.weight_sync.sampling``; "full": every
    piece of every sync; "off" or False: none): every sync is checked by the engines against the trainer's
    checksums, and a mismatch ends it with :class:`~hybrid_core.errors.WeightSyncMismatch` naming the engine and the
    parameter (a transport without checksums, SGLang's, is not checked:
    :func:`~hybrid_engines.weight_sync.choice.verify_note`). ``adapter_only``: a LoRA run whose engines take the
    adapter alone (:mod:`.adapter`; they were built with its spec): each sync sends only its tensors."""

    def __init__(
        self,
        mode: str,
        actor: Any,
        engines: Any,
        plan: Any,
        *,
        bucket_bytes: int,
        backend: str,
        timeout_s: float,
        transport: WeightTransport | None = None,
        trainer_role: str = "actor",
        engine_role: str = "rollout",
        verify: bool | str = True,
        adapter_only: bool = False,
    ):
        if mode not in ("ipc", "broadcast"):
            raise ConfigError("mode", f"must be 'ipc' or 'broadcast', got {mode!r}.", "Use choose_sync(...).mode.")
        self.mode, self.actor, self.engines = mode, actor, engines
        self.adapter_only = adapter_only
        self.bucket_bytes, self.backend, self.timeout_s = bucket_bytes, backend, timeout_s
        if transport is None and engines is not None:
            transport = engine_spec(engines.backend).weight_transport()
        self.transport = transport
        from hybrid_core.weight_sync.sampling import mode_of

        self.verify = mode_of(verify)
        self._checked_syncs = 0  # this run's syncs so far (the first one, after a start or a resume, checks all)
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
        engine_refs = self.engines.init_weight_update_group_async(
            host, port, backend=self.backend, timeout_s=self.timeout_s
        )
        trainer_ref = rank0.init_sync_group.remote(self.transport, host, port, world, self.backend, self.timeout_s)
        get_all_with_timeout(
            [
                ("actor rank 0: init weight-sync group", trainer_ref),
                *[(f"rollout engine {i}: init weight-sync group", r) for i, r in enumerate(engine_refs)],
            ],
            self.timeout_s,
        )
        self._joined = True

    def _policy(self) -> Any:
        from hybrid_core.weight_sync.sampling import VerifyPolicy

        policy = VerifyPolicy(self.verify, self._checked_syncs)
        self._checked_syncs += 1
        return policy

    def sync(self, *, wake_engines: bool) -> TransferStats:
        """Send the trainer's current weights to every engine; returns bytes and seconds of the send."""
        policy = self._policy()
        if wake_engines:
            self.engines.wake_up(["weights"])
        if self.mode == "ipc":
            refs = [
                (
                    f"actor rank {r}: send_weights_ipc to rollout engine {self.engine_for_rank[r]}",
                    w.send_weights_ipc.remote(
                        self.transport,
                        self.engines.actors[self.engine_for_rank[r]],
                        self.bucket_bytes,
                        self.timeout_s,
                        self.peers[r],
                        self.engine_for_rank[r],
                        policy,
                        self.adapter_only,
                    ),
                )
                for r, w in enumerate(self.actor.workers)
            ]
            results = _wait_for_sync(refs, self.timeout_s)
            # the engines dropped their prefix caches with the last delivery (the protocol says so)
            return TransferStats(sum(r["bytes"] for r in results), max(r["seconds"] for r in results), "sync")
        else:
            import ray

            if not self._joined:
                raise ConfigError(
                    "weight_sync",
                    "sync() before setup(): the broadcast group does not exist yet.",
                    "Call WeightSync.setup() once after the engines start.",
                )
            source = self.actor.workers[0]
            metas_of = source.adapter_metas if self.adapter_only else source.weight_metas
            metas = ray.get(metas_of.remote(), timeout=self.timeout_s)
            engine_refs = self.engines.update_weights_async(metas, bucket_bytes=self.bucket_bytes)
            actor_refs = [
                (
                    f"actor rank {r}: send_weights",
                    w.send_weights.remote(self.transport, self.bucket_bytes, policy, self.adapter_only),
                )
                for r, w in enumerate(self.actor.workers)
            ]
            results = _wait_for_sync(
                [*actor_refs, *[(f"rollout engine {i}: update_weights", r) for i, r in enumerate(engine_refs)]],
                self.timeout_s,
            )
            stats = TransferStats(results[0]["bytes"], results[0]["seconds"], "sync")
        self.engines.reset_prefix_cache()
        return stats

    def close(self) -> None:
        """Release the trainer's side of the broadcast group (the engines release theirs at shutdown)."""
        if not self._joined:
            return
        self._joined = False
        get_all_with_timeout(
            [("actor rank 0: close weight-sync group", self.actor.workers[0].close_sync_group.remote(self.transport))],
            min(self.timeout_s, 60.0),
        )


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


def _verify_kwargs(transport: WeightTransport, verify: Any) -> dict:
    """``verify=`` for a transport with checksums; nothing for one without (it has no such argument)."""
    return {"verify": verify} if getattr(transport, "verifies", False) else {}
