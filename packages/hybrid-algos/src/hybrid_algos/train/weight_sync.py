"""Getting the actor's new weights into the engines after each update.

Two paths, chosen once at start-up:

* ``ipc`` — engines share the actor's GPUs (colocated, TP 1): each actor rank packs flat buckets on its own GPU and
  hands CUDA-IPC handles of them to the engine on that GPU; no copy leaves the device (shared memory on CPU).
* ``broadcast`` — engines on their own GPUs: a torch.distributed group (actor rank 0 + every engine worker) over
  NCCL (gloo on CPU) carries the buckets; ZeRO-3 shards are gathered one parameter at a time on the way.
"""

from __future__ import annotations

from hybrid_core.errors import ConfigError
from hybrid_core.remote import get_all_with_timeout
from hybrid_core.stats import TransferStats


def choose_mode(cfg, plan) -> str:
    """``auto`` → ipc when every engine is a TP-1 engine on a GPU the actor uses, else broadcast."""
    actor_gpus = {g for w in plan.roles["actor"].workers for g in w.gpus}
    engines = plan.roles["rollout"].workers
    colocated = all(len(w.gpus) == 1 and w.gpus[0] in actor_gpus for w in engines)
    one_per_gpu = len({w.gpus[0] for w in engines}) == len(engines) == len(actor_gpus)
    if cfg.weight_sync == "auto":
        return "ipc" if colocated and one_per_gpu else "broadcast"
    if cfg.weight_sync == "ipc" and not (colocated and one_per_gpu):
        raise ConfigError("weight_sync", "the ipc path needs one TP-1 engine on each actor GPU.",
                          "Use --weight_sync broadcast (or auto).")
    return cfg.weight_sync


class WeightSync:
    def __init__(self, mode: str, actor, engines, plan, *, bucket_bytes: int, backend: str, timeout_s: float):
        self.mode, self.actor, self.engines = mode, actor, engines
        self.bucket_bytes, self.backend, self.timeout_s = bucket_bytes, backend, timeout_s
        if mode == "ipc":
            # actor rank r -> the engine on the same GPU
            engine_of_gpu = {w.gpus[0]: e for e, w in enumerate(plan.roles["rollout"].workers)}
            self.engine_for_rank = [engine_of_gpu[w.gpus[0]] for w in plan.roles["actor"].workers]

    def setup(self) -> None:
        """Broadcast path: actor rank 0 and every engine worker rendezvous in a fresh group (both sides at once)."""
        if self.mode != "broadcast":
            return
        import ray

        rank0 = self.actor.workers[0]
        info = ray.get(rank0.where.remote(), timeout=self.timeout_s)
        port = ray.get(rank0.free_port.remote(), timeout=self.timeout_s)
        world = 1 + self.engines.num_workers
        engine_refs = self.engines.init_weight_update_group_async(info["node_ip"], port, backend=self.backend,
                                                                  timeout_s=self.timeout_s)
        actor_ref = rank0.init_sync_group.remote(info["node_ip"], port, world, self.backend)
        get_all_with_timeout([("actor rank 0: init weight-sync group", actor_ref),
                              *[(f"rollout engine {i}: init weight-sync group", r) for i, r in enumerate(engine_refs)]],
                             self.timeout_s)

    def sync(self, *, wake_engines: bool) -> TransferStats:
        if wake_engines:
            self.engines.wake_up(["weights"])
        if self.mode == "ipc":
            refs = [(f"actor rank {r}: send_weights_ipc",
                     w.send_weights_ipc.remote(self.engines.actors[self.engine_for_rank[r]], self.bucket_bytes, self.timeout_s))
                    for r, w in enumerate(self.actor.workers)]
            results = get_all_with_timeout(refs, self.timeout_s)
            stats = TransferStats(sum(r["bytes"] for r in results), max(r["seconds"] for r in results), "sync")
        else:
            import ray

            metas = ray.get(self.actor.workers[0].weight_metas.remote(), timeout=self.timeout_s)
            engine_refs = self.engines.update_weights_async(metas, bucket_bytes=self.bucket_bytes)
            actor_refs = [(f"actor rank {r}: send_weights", w.send_weights.remote(self.bucket_bytes))
                          for r, w in enumerate(self.actor.workers)]
            results = get_all_with_timeout(
                [*actor_refs, *[(f"rollout engine {i}: update_weights", r) for i, r in enumerate(engine_refs)]],
                self.timeout_s)
            stats = TransferStats(results[0]["bytes"], results[0]["seconds"], "sync")
        self.engines.reset_prefix_cache()
        return stats
