"""Trainer -> inference engines weight sync in flat buckets.

* Broadcast path: ``create_sync_group`` (a dedicated torch.distributed group, NCCL on GPU, gloo on CPU),
  ``WeightSender`` on the trainer's rank 0 and ``WeightReceiver`` on each engine worker. Receivers get the
  ``TensorMeta`` list up front and plan the same buckets (``plan_buckets``) as the sender.
* Colocated path: ``IpcBucketSender`` hands CUDA-IPC (CPU: shared-memory) buckets to the engine on the same GPU,
  which reads them with ``open_ipc_bucket`` / ``load_ipc_bucket``; ``engine_group_callbacks`` when a TP > 1 engine
  spans several trainer ranks' GPUs.
* Both verify every sync by default (``verify.py``): per-piece checksums from the sender, recomputed by the receiver
  over what the engine loaded; a mismatch raises ``WeightSyncMismatch`` naming the parameter. Which pieces
  (``sampling.py``, ``VerifyPolicy``): all of them in a run's first sync, then a rotating sample (``full``: all).
"""

from .buckets import Bucket, Piece, plan_buckets
from .group import SyncGroup, create_sync_group
from .ipc import (
    IpcBucket,
    IpcBucketSender,
    IpcHandle,
    engine_group_callbacks,
    load_ipc_bucket,
    open_ipc_bucket,
    release_ipc_mappings,
)
from .meta import TensorMeta
from .receiver import WeightReceiver
from .sampling import VerifyPolicy
from .sender import DEFAULT_BUCKET_BYTES, WeightSender
from .verify import checksum, checksum_path

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "IpcBucket",
    "IpcBucketSender",
    "IpcHandle",
    "Piece",
    "SyncGroup",
    "TensorMeta",
    "VerifyPolicy",
    "WeightReceiver",
    "WeightSender",
    "checksum",
    "checksum_path",
    "create_sync_group",
    "engine_group_callbacks",
    "load_ipc_bucket",
    "open_ipc_bucket",
    "plan_buckets",
    "release_ipc_mappings",
]
