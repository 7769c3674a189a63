"""What goes over the wire, in order, for one sync:

1. a handshake from rank 0: ``[MAGIC, PROTOCOL, bucket_bytes, verify]`` (receivers check they pack the same way;
   ``verify`` 1: this sync is checked, some buckets carry checksums);
2. per bucket, a fixed-size header ``[digest of the bucket's layout, bucket index, payload bytes, k]``, then the
   payload, then (k > 0) one int64 tensor ``[index in the bucket of each checked piece (k), their checksums (k)]``
   (``verify.py``; which pieces: ``sampling.py``, the sender's choice). A receiver posts the payload only after the
   header matched its own plan, so a metadata mismatch is a named error before any bytes are received or loaded,
   never a size mismatch inside the backend;
3. an end header ``[END, number of buckets, 0, 0]``, so a stream longer or shorter than the receivers' plan is an
   error too, not a hang.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .buckets import Bucket, Piece, layout_digest, used_bytes

MAGIC = 0x6879627269642D77  # "hybrid-w"
PROTOCOL = 4
HANDSHAKE_WORDS = 4
HEADER_WORDS = 4
END = -1


def handshake_tensor(bucket_bytes: int, device: torch.device, *, verify: bool = True) -> torch.Tensor:
    return torch.tensor([MAGIC, PROTOCOL, bucket_bytes, int(verify)], dtype=torch.int64, device=device)


def check_handshake(received: torch.Tensor, bucket_bytes: int, rank: int) -> bool:
    """Raises unless the sender speaks this protocol with these buckets; returns whether checksums follow."""
    magic, protocol, sender_bucket_bytes, verify = (int(v) for v in received.tolist())
    if magic != MAGIC or protocol != PROTOCOL:
        raise ConfigError(
            "weight_sync",
            f"rank {rank} got a handshake that is not hybrid's weight-sync protocol "
            f"v{PROTOCOL} (magic {magic:#x}, protocol {protocol}).",
            "Use the same hybrid version on the trainer and the engines, and a group used only for sync.",
        )
    if sender_bucket_bytes != bucket_bytes:
        raise ConfigError(
            "bucket_bytes",
            f"the sender packs {sender_bucket_bytes}-byte buckets but rank {rank} expects {bucket_bytes}.",
            "Pass the same bucket_bytes (weight_sync_bucket_mb) to both sides.",
        )
    return bool(verify)


def header_tensor(index: int, pieces: list[Piece], device: torch.device, checked: int = 0) -> torch.Tensor:
    return torch.tensor(
        [layout_digest(index, pieces), index, used_bytes(pieces), checked], dtype=torch.int64, device=device
    )


def end_tensor(n_buckets: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([END, n_buckets, 0, 0], dtype=torch.int64, device=device)


def check_header(received: torch.Tensor, expected: Bucket | None, n_planned: int, rank: int) -> int:
    """``expected`` is the next bucket of the receiver's plan, or None when the plan is done (an end is due).
    Returns how many checked pieces' checksums follow the payload."""
    digest, index, _, checked = (int(v) for v in received.tolist())
    fix = (
        "Give the receivers the TensorMetas of exactly the sender's stream, in the same order (same names, dtypes, "
        "shapes)."
    )
    if expected is None:
        if digest != END:
            raise ConfigError(
                "metas",
                f"rank {rank}: the sender streams more tensors than the {n_planned} buckets "
                "this receiver's metadata plans.",
                fix,
            )
        return 0
    if digest == END:
        raise ConfigError(
            "metas",
            f"rank {rank}: the sender's stream ended after {index} buckets, but this "
            f"receiver's metadata plans {n_planned}.",
            fix,
        )
    if digest != expected.digest() or index != expected.index:
        first = expected.pieces[0].meta if expected.pieces else None
        raise ConfigError(
            "metas",
            f"rank {rank}: weight-sync bucket {expected.index} from the sender does not hold "
            f"what this receiver's metadata says (expected it to start with {first}).",
            fix,
        )
    if not 0 <= checked <= len(expected.pieces):
        raise ConfigError(
            "weight_sync",
            f"rank {rank}: bucket {index} announces {checked} checksums for {len(expected.pieces)} pieces.",
            "Use the same hybrid version on the trainer and engines.",
        )
    return checked


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's data as a flat uint8 tensor (a view when it is already contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
