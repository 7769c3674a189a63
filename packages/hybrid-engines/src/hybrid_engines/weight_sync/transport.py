"""The trainer's side of an engine's weight sync: each engine class names the transport its receiving code speaks.

An engine's ``init_weight_update_group`` / ``update_weights`` / ``update_weights_from_ipc`` expect one wire format;
the trainer must send exactly that one. So the sender belongs to the engine, not to the training loop: every engine
class has ``weight_transport()``, returning a :class:`WeightTransport` (plain and picklable: it travels to the
trainer's ranks through Ray), and the loop asks for it instead of choosing a sender itself.

:class:`WeightTransport` is hybrid-core's own format (the built-in and vLLM engines receive it with
``hybrid_core.weight_sync.WeightReceiver`` / ``load_ipc_bucket``); an engine library with its own receiving code
subclasses it (``hybrid_engines.weight_sync.sglang.SGLangTransport``). Two paths:

* broadcast -- the trainer's rank 0 joins a group with every engine worker (:meth:`~WeightTransport.join`), then
  streams the weights (:meth:`~WeightTransport.broadcast`) while the engines run ``update_weights(metas, ...)``;
* ipc -- every trainer rank packs buckets on its own GPU and hands each to the engine on that GPU
  (:meth:`~WeightTransport.send_ipc`); :meth:`~WeightTransport.encode_ipc` turns a packed bucket into what the
  engine's ``update_weights_from_ipc`` takes.

Verification: hybrid-core's format carries per-piece checksums that its receivers check after loading
(``hybrid_core.weight_sync.verify``); ``verifies`` says whether a transport does (``verify=`` is passed only then).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch

from hybrid_core.stats import TransferStats
from hybrid_core.weight_sync.group import GROUP_NAME


class WeightTransport:
    """hybrid-core's wire format: what :class:`~hybrid_engines.hf_engine.HFEngine` and the vLLM adapter receive."""

    #: short name, printed by ``--dry-run`` next to the sync path
    name = "hybrid"
    #: what each path puts on the wire (``--dry-run`` prints it)
    wire: ClassVar[dict[str, str]] = {
        "broadcast": "hybrid-core buckets: handshake, layout header, payload",
        "ipc": "hybrid-core CUDA-IPC buckets",
    }
    #: the largest tensor-parallel size the IPC path serves (None: any; a TP > 1 engine gets one bucket per GPU)
    ipc_max_tp: int | None = None
    #: the receivers check every sync against the sender's checksums (``broadcast``/``send_ipc`` take ``verify=``)
    verifies = True

    def refusal(self, mode: str, *, tp: int) -> str | None:
        """Why this transport cannot take ``mode`` ("ipc" / "broadcast") to engines of tensor-parallel size ``tp``."""
        if mode == "ipc" and self.ipc_max_tp is not None and tp > self.ipc_max_tp:
            return f"the {self.name} IPC path serves engines of TP <= {self.ipc_max_tp}, and these engines have TP {tp}"
        return None

    def describe(self, mode: str) -> str:
        return f"{mode} ({self.wire[mode]})"

    # ---- broadcast: the trainer's rank 0 ---------------------------------------------------------------------------
    def join(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        backend: str,
        timeout_s: float,
        device: torch.device | str | None,
        group_name: str = GROUP_NAME,
    ) -> Any:
        """Join the engines' weight-update group as rank 0 (the engines join at the same time)."""
        from hybrid_core.weight_sync import create_sync_group

        return create_sync_group(
            master_address,
            master_port,
            0,
            world_size,
            backend=backend,
            timeout_s=timeout_s,
            device=device,
            group_name=group_name,
        )

    def broadcast(
        self, group: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int, verify: bool = True
    ) -> TransferStats:
        """Stream ``named_tensors`` to every engine worker (which run ``update_weights`` with their metas);
        ``verify``: with checksums the engines check."""
        from hybrid_core.weight_sync import WeightSender

        sender = WeightSender(group, bucket_bytes=bucket_bytes, verify=verify)
        try:
            return sender.send(named_tensors)
        finally:
            sender.close()

    def close_group(self, group: Any) -> None:
        if group is not None:
            group.close()

    # ---- ipc: every trainer rank -----------------------------------------------------------------------------------
    def encode_ipc(self, buckets: Sequence[Any]) -> Any:
        """What the engine's ``update_weights_from_ipc`` takes for one delivery: ``buckets`` holds one packed
        ``IpcBucket`` per GPU of the engine (one for TP = 1). hybrid-core engines take the bucket (list) itself."""
        return buckets[0] if len(buckets) == 1 else list(buckets)

    def send_ipc(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        engine: Any,
        *,
        bucket_bytes: int,
        device: torch.device | str | None,
        timeout_s: float,
        peers: Sequence[int] | None = None,
        what: str = "rollout engine: update_weights_from_ipc",
        verify: bool = True,
    ) -> TransferStats:
        """Hand ``named_tensors`` to ``engine`` (a Ray actor on this rank's GPU) bucket by bucket.

        ``peers``: the trainer ranks whose GPUs one tensor-parallel engine spans (this rank among them, all calling
        this with the same stream, inside torch.distributed); they hand each bucket over together and the first of
        them calls the engine. Two buckets are in flight at most; every engine call is waited for under ``timeout_s``.
        ``verify``: every bucket carries its checksums; an engine's mismatch is raised here as
        :class:`~hybrid_core.errors.WeightSyncMismatch` naming the engine (``what``) and the parameter.
        """
        from hybrid_core.errors import RoleFailure
        from hybrid_core.remote import get_with_timeout
        from hybrid_core.weight_sync import IpcBucketSender, engine_group_callbacks
        from hybrid_core.weight_sync.verify import as_mismatch

        def submit(buckets):
            return engine.update_weights_from_ipc.remote(self.encode_ipc(buckets))

        def wait(ref):
            try:
                get_with_timeout(ref, timeout_s, what)
            except RoleFailure as e:
                mismatch = as_mismatch(e)
                if mismatch is None:
                    raise
                raise mismatch from e

        if peers is not None and len(peers) > 1:
            deliver, wait = engine_group_callbacks(peers, submit, wait)
        else:

            def deliver(bucket):
                return submit([bucket])

        sender = IpcBucketSender(bucket_bytes=bucket_bytes, device=device, verify=verify)
        try:
            return sender.send(named_tensors, deliver=deliver, wait=wait)
        finally:
            sender.close()  # the buckets' memory goes back before the trainer sleeps
