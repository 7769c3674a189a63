"""Start a worker script (fsdp2_worker.py unless told) once per rank on a free local port and collect each rank's
RESULT line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("fsdp2_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(mode: str, world_size: int, folder: Path, timeout_s: float = 180, worker: Path = WORKER) -> list[dict]:
    """Every rank's result, rank 0 first; fails with the ranks' output if any rank failed."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world_size)}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")  # 2 shared cores
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), mode, str(folder)],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = []
    try:
        outputs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, (out, err) in zip(procs, outputs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert p.returncode == 0 and len(lines) == 1, f"rank exited {p.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
        results.append(json.loads(lines[0][len("RESULT ") :]))
    return sorted(results, key=lambda r: r["rank"])
