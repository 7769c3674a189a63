"""Getting the actor's new weights into the engines after each update.

Two paths, chosen once at start-up:

* ``ipc`` — engines share the actor's GPUs (colocated): each actor rank packs flat buckets on its own GPU and
  hands CUDA-IPC handles of them to the engine on that GPU; no copy leaves the device (shared memory on CPU). A TP > 1
  engine spans several actor ranks' GPUs: those ranks hand each bucket over together, one per GPU.
* ``broadcast`` — engines on their own GPUs: a torch.distributed group (actor rank 0 + every engine worker) over
  NCCL (gloo on CPU) carries the buckets; ZeRO-3 shards are gathered one parameter at a time on the way.
"""

from __future__ import annotations

from hybrid_core.errors import ConfigError
from hybrid_core.remote import get_all_with_timeout
from hybrid_core.stats import TransferStats


def choose_mode(cfg, plan) -> str:
    """``auto`` → ipc when every engine worker shares a GPU with exactly one actor rank (colocated, any TP), else
    broadcast. (Broadcast with colocated engines would put two ranks of one NCCL group on a GPU, which NCCL refuses.)"""
    actor = plan.roles["actor"].workers
    actor_gpus = [g for w in actor for g in w.gpus]
    engine_gpus = [g for w in plan.roles["rollout"].workers for g in w.gpus]
    shared = (all(len(w.gpus) == 1 for w in actor) and len(set(actor_gpus)) == len(actor_gpus)
              and sorted(engine_gpus) == sorted(actor_gpus))
    if cfg.weight_sync == "auto":
        return "ipc" if shared else "broadcast"
    if cfg.weight_sync == "ipc" and not shared:
        raise ConfigError("weight_sync", "the ipc path needs the engines' GPUs to be exactly the actor's GPUs, "
                          "one actor rank and one engine worker on each.", "Use --weight_sync broadcast (or auto).")
    if cfg.weight_sync == "broadcast" and set(engine_gpus) & set(actor[0].gpus) and _sync_uses_nccl(cfg):
        raise ConfigError("weight_sync", "the broadcast path over NCCL puts actor rank 0 and the engine workers in "
                          "one group, and an engine worker shares rank 0's GPU: NCCL refuses two ranks on one GPU.",
                          "Use --weight_sync auto (ipc for colocated engines), or put the engines on their own GPUs.")
    return cfg.weight_sync


def _sync_uses_nccl(cfg) -> bool:
    return cfg.vllm_sync_backend == "nccl" and cfg.backend != "hf"


class WeightSync:
    def __init__(self, mode: str, actor, engines, plan, *, bucket_bytes: int, backend: str, timeout_s: float):
        self.mode, self.actor, self.engines = mode, actor, engines
        self.bucket_bytes, self.backend, self.timeout_s = bucket_bytes, backend, timeout_s
        if mode == "ipc":
            # actor rank r -> the engine with a worker on r's GPU, and every actor rank that engine spans
            engine_of_gpu = {g: e for e, w in enumerate(plan.roles["rollout"].workers) for g in w.gpus}
            self.engine_for_rank = [engine_of_gpu[w.gpus[0]] for w in plan.roles["actor"].workers]
            self.peers = [[r for r, e in enumerate(self.engine_for_rank) if e == mine] for mine in self.engine_for_rank]

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
                     w.send_weights_ipc.remote(self.engines.actors[self.engine_for_rank[r]], self.bucket_bytes,
                                               self.timeout_s, self.peers[r]))
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
