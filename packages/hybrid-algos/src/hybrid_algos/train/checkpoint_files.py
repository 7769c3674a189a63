"""Every file of a checkpoint, as it was written: size and CRC-32, recorded at save time and checked on resume.

DeepSpeed's own loader notices neither a flipped byte inside a tensor (it loads the wrong weights silently) nor a
missing shard in a way that names it (an ``AssertionError`` deep in its loader). So a save records each file's size
and CRC-32 (``zlib.crc32``: checksumming runs at disk speed, several files at once), and a resume checks them
before anything is loaded: a checkpoint whose files differ is damaged, named, and skipped for the previous one, as
a damaged ``latest.json`` or driver state is (see :meth:`.checkpoint.CheckpointManager.resume_point`).
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_CHUNK = 8 << 20


def crc32(path: str) -> str:
    value = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            value = zlib.crc32(chunk, value)  # releases the GIL on large buffers: files checksum in parallel
    return f"{value:08x}"


def _files(folder: str, skip: tuple[str, ...]) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel not in skip:
                out.append(rel)
    return sorted(out)


def _workers(n: int) -> int:
    return max(1, min(n, 8, os.cpu_count() or 1))


def record(folder: str, *, skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size": bytes, "crc32": hex}}`` of every file under ``folder`` but ``skip``."""
    files = _files(folder, skip)
    with ThreadPoolExecutor(_workers(len(files))) as pool:
        sums = list(pool.map(lambda rel: crc32(os.path.join(folder, rel)), files))
    return {rel: {"size": os.path.getsize(os.path.join(folder, rel)), "crc32": s} for rel, s in zip(files, sums)}


def problems(folder: str, manifest: dict[str, Any]) -> list[str]:
    """What differs between ``folder`` and its ``manifest``: missing files, other sizes, other checksums (sizes
    first: a truncated or missing shard is found without reading anything)."""
    found, to_sum = [], []
    for rel, want in sorted(manifest.items()):
        path = os.path.join(folder, rel)
        try:
            size = os.path.getsize(path)
        except OSError:
            found.append(f"{path} is missing")
            continue
        if not isinstance(want, dict) or size != want.get("size"):
            found.append(f"{path} has {size} bytes, {want.get('size') if isinstance(want, dict) else '?'} when saved")
        else:
            to_sum.append((rel, path, want.get("crc32")))
    with ThreadPoolExecutor(_workers(len(to_sum))) as pool:
        sums = list(pool.map(lambda item: crc32(item[1]), to_sum))
    for (_rel, path, want), got in zip(to_sum, sums):
        if got != want:
            found.append(f"{path} differs from what was saved (CRC-32 {got}, {want} when saved)")
    return found
