"""What every role worker (a Ray actor holding one model replica or shard) shares.

Workers are created by :class:`hybrid_core.roles.RoleGroup` on the bundles the placement plan assigns, and moved
on and off their GPU by the residency owner (:mod:`hybrid_core.residency`) through ``offload`` / ``reload``. Each
one can dump the Python stacks of all its threads into the run's log folder on request — answered on a separate
control thread, so a worker stuck in a collective still reports where it is.

A worker is given the run's :class:`~hybrid_algos.train.train_settings.TrainSettings` and reads its sections
(``settings.trainer``, ``settings.algorithm``, ``settings.rollout``, ``settings.run``, ``settings.models``), never the
flat config's names.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

import torch

from hybrid_core.stats import TransferStats

from ..deepspeed_setup import local_device

if TYPE_CHECKING:
    from hybrid_core.offload import StateMover

    from ..train_settings import TrainSettings


class RoleWorker:
    """Base of the actor / critic / reference / reward workers."""

    def __init__(self, role: str, rank: int, world_size: int, settings: TrainSettings, log_dir: str):
        self.role, self.rank, self.world_size = role, rank, world_size
        self.settings = settings
        self.trainer = settings.trainer  # DeepSpeed, precision, optimizer, how passes are batched
        self.algorithm = settings.algorithm  # the losses the trained roles compute
        self.device = local_device()
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        # open for the worker's life: faulthandler writes a crash's stack into it at any time
        self._stack_file = open(os.path.join(log_dir, f"stacks-{role}-{rank}.txt"), "a")  # noqa: SIM115
        faulthandler.enable(self._stack_file)  # a hard crash leaves its stack in the run's log folder
        self.offloader: StateMover | None = None  # set by subclasses: offload(states) / reload()
        self.trim_cache = False  # the residency plan releases this role's allocator cache after each phase
        # The CPU threads this worker was given (Ray sets OMP_NUM_THREADS from the actor's CPUs; 1 for a share of
        # a GPU), never torch's own default (every core): a CPU run's numerics depend on the thread count, so two
        # runs of the same config agree only if it is fixed, whatever else the machine runs.
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or 1)))
        torch.manual_seed(settings.run.seed + rank)
        # The user's --plugins and the driver's own registrations: this process's registries get their entries
        # (the policy loss is looked up by name here).
        from ..plugins import import_in_worker

        import_in_worker(f"{role} rank {rank}")

    # ---- identity / rendezvous -------------------------------------------------------------------------------------
    def where(self) -> dict[str, Any]:
        import ray

        return {
            "role": self.role,
            "rank": self.rank,
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "device": str(self.device),
        }

    @staticmethod
    def free_port(host: str = "127.0.0.1") -> int:
        """A port free on ``host`` (the group's rendezvous address, where rank 0's store will listen)."""
        from hybrid_core.rendezvous import free_port

        return free_port(host)

    def ping(self) -> bool:
        return True

    def freeze_gc(self) -> None:
        """Call at the end of set-up: collect, then move everything built so far out of the garbage collector's view
        (``gc.freeze()``).

        DeepSpeed's offload_states runs gc.collect() three times; with transformers and DeepSpeed imported, each full
        collection walks millions of objects (0.8 s each on a CPU core, measured). Frozen objects are skipped, so a
        sleep costs milliseconds instead of seconds.
        """
        gc.collect()
        gc.freeze()

    # ---- --profile_step ---------------------------------------------------------------------------------------------
    def start_profile(self) -> None:
        from ..profiling import WorkerProfiler

        self._profiler: WorkerProfiler | None = WorkerProfiler()
        self._profiler.start()

    def stop_profile(self, folder: str) -> str:
        """Write this worker's profile of the step into ``folder``; returns the table's path."""
        profiler, self._profiler = getattr(self, "_profiler", None), None
        if profiler is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: stop_profile without start_profile")
        return profiler.stop(folder, f"{self.role}-{self.rank}")

    # ---- residency -------------------------------------------------------------------------------------------------
    def set_residency(self, trim_cache: bool) -> None:
        """What the residency plan asks of this role besides moves: trim its allocator cache after each phase."""
        self.trim_cache = trim_cache

    def offload(self, states: list[str]) -> dict:
        """Move ``states`` (e.g. ["optimizer"], or a frozen model's ["params"]) to host memory."""
        if self.offloader is None:
            raise RuntimeError(f"{self.role} has no offloader: it cannot move {states} off its GPU")
        stats = self.offloader.offload(states)
        self._release_cache()
        return stats.as_dict()

    def reload(self, states: list[str] | None = None) -> dict:
        if self.offloader is None:
            return TransferStats(0, 0.0, f"{self.role} reload").as_dict()
        return self.offloader.reload(states).as_dict()

    def end_phase(self) -> None:
        """Called at the end of every phase method: trim the allocator cache when the plan says so."""
        if self.trim_cache:
            self._release_cache()

    def _release_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def gpu_memory(self) -> dict[str, Any] | None:
        """Free/total bytes of this worker's GPU and its process list (for the wake check); None on CPU."""
        import dataclasses

        from hybrid_core.gpu_memory import probe

        memory = probe(self.device) if self.device.type == "cuda" else None
        return dataclasses.asdict(memory) if memory is not None else None

    # ---- diagnosis -------------------------------------------------------------------------------------------------
    def dump_stacks(self) -> str:
        """Write every thread's Python stack to the log folder and return it (runs on the control thread)."""
        frames = sys._current_frames()
        lines = [f"=== {self.role} rank {self.rank} pid {os.getpid()} at {time.strftime('%H:%M:%S')} ==="]
        for thread_id, frame in frames.items():
            lines.append(f"--- thread {thread_id} ---")
            lines.extend(line.rstrip() for line in traceback.format_stack(frame))
        text = "\n".join(lines) + "\n"
        self._stack_file.write(text)
        self._stack_file.flush()
        return text
