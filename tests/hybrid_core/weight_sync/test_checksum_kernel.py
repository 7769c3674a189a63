"""The fused Triton checksum (``checksum_kernel.py``) gives the definition's value for every piece of a buffer.

The kernel runs on CUDA in production; here it runs in Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors),
which executes the same kernel code. The interpreter must be chosen before Triton is imported, so the check runs in
a child process. Skipped where Triton is not installed (the default test env has none; on a GPU the self-test in
``verify.checksum_path`` runs the compiled kernel against the definition before using it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

CHECK = r"""
import torch
from hybrid_core.weight_sync import checksum_kernel, verify

# start 3: the pieces sit at odd offsets (the byte-by-byte kernel); 0: on word boundaries (the whole-word kernel)
for s, start in [(s, start) for s in (1, 2, 4, 8) for start in (3, 0)]:
    g = torch.Generator().manual_seed(s)
    buf = torch.randint(-128, 128, (300_000,), generator=g, dtype=torch.int8)
    offsets, sizes, pos = [], [], start  # 3: odd offsets, a piece of many blocks, a block boundary, an empty piece
    for n in (s * 5, s * 4096, 0, s * 2049, s * 10000, s):
        offsets.append(pos)
        sizes.append(n)
        pos += n + 64 * s
    got = checksum_kernel.piece_checksums(buf, offsets, sizes, s).tolist()
    want = [verify._definition(buf[o : o + n], s) if n else 0 for o, n in zip(offsets, sizes)]
    assert got == want, (s, start, got, want)
    changed = buf.clone()
    changed[offsets[3] + 7] += 1  # one byte of the fourth piece: its checksum alone changes
    again = checksum_kernel.piece_checksums(changed, offsets, sizes, s).tolist()
    assert [a != b for a, b in zip(got, again)] == [False, False, False, True, False, False], (s, got, again)
    # the same pieces as separate tensors, read in place through their addresses (the receiver's engine tensors)
    parts = [buf[o : o + n].clone() for o, n in zip(offsets, sizes) if n]
    expect = [verify._definition(q, s) for q in parts]
    assert checksum_kernel.tensors_checksums(parts, s).tolist() == expect, (s, "tensors")
    parts[1][5] += 1  # one byte of the second tensor: its checksum alone changes
    again = checksum_kernel.tensors_checksums(parts, s).tolist()
    assert [a != b for a, b in zip(expect, again)] == [i == 1 for i in range(len(parts))], (s, "tensors")
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_every_piece_of_a_buffer_gets_the_definitions_checksum():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_layout_tables_stay_cached_across_a_runs_cycle_of_layouts(monkeypatch):
    """A sync cycles through ~80 layouts at 7B (buckets in full mode, sampled groups); a cache smaller than the cycle
    (64, FIFO, before) rebuilt every table before its next use. The tables are plain tensors: built on the CPU here."""
    import torch

    from hybrid_core.weight_sync import checksum_kernel as ck

    monkeypatch.setattr(ck, "_LAYOUTS", type(ck._LAYOUTS)())
    cpu = torch.device("cpu")
    keys = [((0, 8192 * i), (8192, 4096), 2) for i in range(120)]
    first = [ck._layout(cpu, o, n, s)[0][0] for o, n, s in keys]
    again = [ck._layout(cpu, o, n, s)[0][0] for o, n, s in keys]
    assert all(a is b for a, b in zip(first, again))  # every one a hit on the second pass
    monkeypatch.setattr(ck, "_MAX_LAYOUTS", 10)  # past the bound: the least recently used go first
    ck._layout(cpu, *keys[5][:2], 2)  # touched: now the most recent
    ck._layout(cpu, (0,), (64,), 2)
    assert len(ck._LAYOUTS) == 10
    assert ck._layout(cpu, *keys[5][:2], 2)[0][0] is first[5] and ck._layout(cpu, *keys[0][:2], 2)[0][0] is not first[0]
    monkeypatch.setattr(ck, "_MAX_LAYOUT_BYTES", 1)  # the device bytes bound keeps the newest alone
    ck._layout(cpu, (0,), (128,), 2)
    assert len(ck._LAYOUTS) == 1
