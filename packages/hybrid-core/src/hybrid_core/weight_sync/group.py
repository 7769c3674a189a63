"""A torch.distributed process group made only for weight sync, with a deadline on every collective.

It is built directly from a ``TCPStore`` (rank 0 hosts it) as a standalone ``ProcessGroupGloo`` /
``ProcessGroupNCCL`` backend: the default group is never touched, because the trainer already has DeepSpeed's and
each engine has its own (vLLM's, SGLang's). Rank 0 is the trainer's rank 0 (the sender), ranks 1.. are the engine
workers.

Deadlines: gloo enforces the timeout itself; for NCCL the host polls the work until the deadline and then aborts the
communicator (the GPU kernel would otherwise wait forever). Either way the caller gets :class:`RemoteTimeout`
naming the collective, and the group is marked broken (a later call fails at once instead of mismatching).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import rendezvous
from ..errors import ConfigError, RemoteTimeout, RoleFailure

GROUP_NAME = "hybrid-weight-sync"


@dataclass
class SyncGroup:
    """A live weight-sync group: this process's ``rank`` in it, the backend and the device its buffers live on."""

    backend_pg: Any
    store: Any
    rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout_s: float
    broken: str | None = field(default=None)

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, what: str) -> PendingWork:
        """Start an asynchronous broadcast of ``tensor`` from ``src``; ``.wait()`` it (with the group's deadline)."""
        self._check_usable(what)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        try:
            work = self.backend_pg.broadcast([tensor], opts)
        except RuntimeError as e:
            raise self._failure(what, e) from e
        return PendingWork(self, work, what, time.monotonic() + self.timeout_s)

    def close(self) -> None:
        """Release the communicator (and the store, on rank 0).

        Abort first: NCCL's orderly shutdown waits for every peer to shut down too, and at the end of a run the
        trainer and the engines close one after the other - an engine stuck waiting for the trainer hung a run's
        exit (seen on 2 GPUs). Aborting a communicator nobody uses any more loses nothing."""
        for name in ("abort", "shutdown"):
            fn = getattr(self.backend_pg, name, None)
            if fn is not None:
                try:
                    fn()
                    break
                except RuntimeError:
                    continue
        self.broken = self.broken or "closed"

    # ---- internals -------------------------------------------------------------------------------------------------
    def _check_usable(self, what: str) -> None:
        if self.broken:
            raise RoleFailure(
                f"weight-sync group (rank {self.rank}/{self.world_size}): cannot run {what}: the "
                f"group is unusable ({self.broken}); create a new one."
            )

    def _failure(self, what: str, error: BaseException) -> Exception:
        text = _first_line(error)
        self.broken = f"{what} failed"
        where = f"weight-sync group rank {self.rank}/{self.world_size} ({self.backend}): {what}"
        if _is_timeout(text):
            return RemoteTimeout(f"{where}: no partner within {self.timeout_s:g} s ({text})")
        return RoleFailure(f"{where}: {text}")


@dataclass
class PendingWork:
    group: SyncGroup
    work: Any
    what: str
    deadline: float

    def wait(self) -> None:
        """Block until done (gloo) / until the device has it (NCCL), or raise :class:`RemoteTimeout` at the deadline."""
        g = self.group
        if g.backend == "nccl":
            while not self.work.is_completed():
                if time.monotonic() > self.deadline:
                    g.broken = f"{self.what} timed out"
                    g.close()
                    raise RemoteTimeout(
                        f"weight-sync group rank {g.rank}/{g.world_size} (nccl): {self.what}: not done "
                        f"within {g.timeout_s:g} s; the communicator was aborted."
                    )
                time.sleep(0.00005)
            return
        try:
            self.work.wait(timedelta(seconds=max(self.deadline - time.monotonic(), 0.001)))
        except RuntimeError as e:
            raise g._failure(self.what, e) from e


def create_sync_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    device: torch.device | str | None = None,
    group_name: str = GROUP_NAME,
) -> SyncGroup:
    """Join (rank 0: host) a weight-sync group of ``world_size`` processes; every rank must call this.

    ``backend``: "nccl" (buffers on ``device``, a CUDA device) or "gloo" (buffers on the CPU). Returns once every rank
    has joined and a first tiny broadcast went through, or raises :class:`RemoteTimeout` after ``timeout_s``.
    """
    _validate(master_port, rank, world_size, backend, timeout_s)
    if backend == "nccl":
        on = torch.device(device if device is not None else "cuda")
        if on.type != "cuda":
            raise ConfigError(
                "device",
                f"the nccl backend needs a CUDA device, got {on}.",
                'Pass device="cuda:N" or use backend="gloo".',
            )
        if on.index is None:
            on = torch.device("cuda", torch.cuda.current_device())
    else:
        on = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    where = f"weight-sync group {group_name!r} at {master_address}:{master_port} (rank {rank} of {world_size})"
    # every listener on the rendezvous address only (loopback on one node): hybrid_core.rendezvous
    bind = rendezvous.bind_address(master_address)
    if backend == "nccl":
        rendezvous.use_interface(bind)  # NCCL's sockets (a process's first NCCL group fixes them); gloo's: below
    try:
        store = rendezvous.open_store(
            master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout, what=where
        )
        prefixed = dist.PrefixStore(group_name, store)
        if backend == "nccl":
            pg = _nccl_backend(prefixed, rank, world_size, timeout, group_name)
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, rendezvous.gloo_options(bind, timeout))
    except (RuntimeError, TimeoutError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        text = _first_line(e)
        if _is_timeout(text) or isinstance(e, TimeoutError):
            raise RemoteTimeout(f"{where}: the other ranks did not join within {timeout_s:g} s ({text})") from e
        raise RoleFailure(f"{where}: could not create the {backend} group: {text}") from e
    group = SyncGroup(pg, store, rank, world_size, backend, on, timeout_s)
    hello = torch.tensor([world_size], dtype=torch.int64, device=on)
    group.broadcast(hello, what="join handshake").wait()  # also builds the NCCL communicator now, not in the first sync
    if int(hello.item()) != world_size:
        raise ConfigError(
            "world_size",
            f"rank 0 declared world_size {int(hello.item())}, this rank {world_size}.",
            "Give every rank of the weight-sync group the same world_size (1 + engine workers).",
        )
    try:  # the group formed: the store stops listening once every rank is done with it
        store.close_when_formed(rank, world_size, key=f"{group_name}/formed")
    except (RuntimeError, TimeoutError) as e:
        raise RemoteTimeout(
            f"{where}: not every rank finished joining within {timeout_s:g} s ({_first_line(e)})"
        ) from e
    return group


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _is_timeout(text: str) -> bool:
    text = text.lower()
    return "timeout" in text or "timed out" in text


def _nccl_backend(store: Any, rank: int, world_size: int, timeout: timedelta, group_name: str) -> Any:
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise ConfigError("backend", "this torch build has no NCCL.", 'Use backend="gloo".')
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    for name, value in (("group_name", group_name), ("global_ranks_in_group", list(range(world_size)))):
        try:
            setattr(opts, name, value)
        except (AttributeError, TypeError):  # older torch: optional metadata
            pass
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def _validate(master_port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    if backend not in ("gloo", "nccl"):
        raise ConfigError(
            "backend", f"must be 'gloo' or 'nccl', got {backend!r}.", "Use nccl between GPUs, gloo on CPU."
        )
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("world_size", f"must be >= 1, got {world_size!r}.", "Use 1 + the number of engine workers.")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(
            "rank",
            f"must be in [0, {world_size}), got {rank!r}.",
            "Rank 0 is the trainer's sender; engine workers take 1..world_size-1.",
        )
    if not 0 < master_port < 65536:
        raise ConfigError(
            "master_port", f"must be a TCP port, got {master_port!r}.", "Use a free port of rank 0's host."
        )
    if not timeout_s > 0:
        raise ConfigError("timeout_s", f"must be positive, got {timeout_s!r}.", "Use e.g. 600.")
