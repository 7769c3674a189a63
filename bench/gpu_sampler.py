"""GPU memory per GPU per phase: nvidia-smi samples every GPU's used memory, the run's timeline names the phase.

Every process on a GPU counts (engines, trainer roles, CUDA contexts), which is what decides whether colocated
roles fit. ``<run_dir>/timeline.jsonl`` (written by the training loop) holds each step's phase spans in Unix time;
a sample belongs to the phase whose span contains it.

    sampler = start("/tmp/mem.csv")          # nvidia-smi in the background, 100 ms period
    ...run...
    sampler.terminate()
    table = peaks("/tmp/mem.csv", "<run_dir>/timeline.jsonl", skip_steps=1)   # {phase: {gpu: GiB}}
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
from collections import defaultdict

MIB_PER_GIB = 1024.0


def start(path: str, period_ms: int = 100) -> subprocess.Popen | None:
    """nvidia-smi writing samples to ``path``; None where there is no nvidia-smi (a CPU machine)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = open(path, "w")
    return subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,index,memory.used", "--format=csv,noheader,nounits", f"-lms={period_ms}"],
        stdout=out,
        stderr=subprocess.DEVNULL,
    )


def read_samples(path: str) -> list[tuple[float, int, float]]:
    """(unix time, GPU index, used GiB) per line; nvidia-smi's timestamps are local time."""
    samples = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((when, int(parts[1]), float(parts[2]) / MIB_PER_GIB))
        except ValueError:
            continue
    return samples


def read_spans(timeline_path: str, skip_steps: int = 0) -> list[tuple[str, float, float]]:
    spans = []
    for line in open(timeline_path):
        record = json.loads(line)
        if record["step"] >= skip_steps:
            spans += [(phase, start, end) for phase, start, end in record["spans"]]
    return spans


def peaks(samples_path: str, timeline_path: str, skip_steps: int = 0) -> dict[str, dict[int, float]]:
    """Highest used GiB per phase per GPU over the steps from ``skip_steps`` on."""
    samples = read_samples(samples_path) if os.path.exists(samples_path) else []
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for phase, start, end in read_spans(timeline_path, skip_steps):
        for when, gpu, gib in samples:
            if start <= when <= end and gib > out[phase].get(gpu, -1.0):
                out[phase][gpu] = gib
    return {phase: dict(sorted(per_gpu.items())) for phase, per_gpu in out.items()}


def render(table: dict[str, dict[int, float]]) -> str:
    gpus = sorted({g for per_gpu in table.values() for g in per_gpu})
    lines = [f"{'phase':<10}" + "".join(f"{'GPU ' + str(g):>10}" for g in gpus)]
    for phase, per_gpu in table.items():
        lines.append(f"{phase:<10}" + "".join(f"{per_gpu.get(g, float('nan')):>10.1f}" for g in gpus))
    return "\n".join(lines)
