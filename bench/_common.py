"""Shared by the bench scripts: imports from a source checkout, the model under test, a printed table, and rows
appended to bench/RESULTS.md (``| metric | value | unit | device | date | command |``, append only; the unit cell
ends with ``; code <id>``, the :func:`code_id` of the code that was measured)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# BENCH_RESULTS: another file to append to (a lent machine's runs in the background, collected afterwards)
RESULTS = Path(os.environ.get("BENCH_RESULTS") or ROOT / "bench" / "RESULTS.md")
HEADER = "| metric | value | unit | device | date | command |\n| --- | --- | --- | --- | --- | --- |\n"

# NVLink multicast must stay off on the shared GPU hosts (children inherit these).
for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)

try:  # run from a plain checkout too (the GPU machine has no editable install)
    import hybrid_core  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "packages" / "hybrid-core" / "src"))


#: how a row's unit cell names the code that measured it (bench/readme_figures.py reads it back)
CODE_TAG = "; code "


def code_id(root: Path = ROOT) -> str:
    """The identity of the measured code: the first 10 hex of sha256 over the sorted (relative path, bytes) of
    ``packages/*/src/**/*.py``. Computed from the tree itself because the lent GPU machine gets a copy of the working
    tree without .git (no revision to read there), so both machines get the same id for the same code, uncommitted
    edits included. bench/ and tests/ are left out: the harness is edited for reasons that do not change what the
    packages do (another bench, a docstring, this file, readme_figures.py), and counting those would split one
    code's reruns into single rows and defeat the median; a bench that changes how it measures says so in its rows'
    unit text or metric name."""
    digest = hashlib.sha256()
    for path in sorted(root.glob("packages/*/src/**/*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        # lengths first: no two different trees give the same byte stream
        digest.update(b"%d:%b%d:%b" % (len(rel), rel, len(data), data))
    return digest.hexdigest()[:10]


def tag_unit(unit: str, code: str | None = None) -> str:
    """A RESULTS.md unit cell naming the code that measured the row (default: this tree's :func:`code_id`)."""
    return f"{unit}{CODE_TAG}{code or code_id()}"


def measured_code(*runs: dict[str, Any]) -> str:
    """The code id recorded in the first of ``runs`` (JSONs of runs, read back to be recorded afterwards) that holds
    one, else this tree's: rows recorded here from a device run name the code the device measured."""
    return next((run["code"] for run in runs if run.get("code")), None) or code_id()


@dataclass
class Row:
    metric: str
    value: float
    unit: str
    record: bool = True  # False: printed only (diagnostics), not appended to RESULTS.md


def llama_config(small: bool, size: str = "1b"):
    """The ~1B Llama of the issue (hidden 2048, 16 layers, intermediate 5632, vocab 32000), a Llama-2-7B-shaped one
    (``size`` "7b": hidden 4096, 32 layers, intermediate 11008; 6.7B), or a tiny one."""
    from transformers import LlamaConfig

    if small:
        return LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=128,
        )
    if size == "7b":
        return LlamaConfig(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        )
    if size != "1b":
        raise ValueError(f"llama_config: size {size!r} is not 1b or 7b")
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def build_llama(small: bool, device, dtype, size: str = "1b"):
    """A randomly initialised model built directly on ``device`` in ``dtype`` (nothing is downloaded); ``size`` as
    for :func:`llama_config`."""
    import torch
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(small, size))
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype)


def device_label(device) -> str:
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        count = torch.cuda.device_count()
        return f"{count}x {torch.cuda.get_device_name(device)}" if count > 1 else torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


#: the one clock of every peer comparison: wall time between step ends, the same warm-up dropped on every side
WARMUP_STEPS = 2
MIN_MEASURED_STEPS = 5


def steady_step_times(step_ends: list[float], warmup: int = WARMUP_STEPS) -> list[float]:
    """Seconds per step from the wall-clock times at which steps 1, 2, ... ended, for the steps after ``warmup``.

    Step k's time is ``end[k] - end[k-1]`` (step 1 has no start on this clock, so it is always a warm-up step): it
    holds everything the step cost, its callbacks, metrics, checkpoints and re-planning included. Used alike for
    ours (``wall_time`` of metrics.jsonl) and every peer (their trainer's step-end callback), so the ratio of two
    medians compares the same thing."""
    if warmup < 1:
        raise ValueError("warmup must be >= 1: the first step has no start on a step-end clock")
    return [b - a for a, b in zip(step_ends[warmup - 1 :], step_ends[warmup:])]


def median_step(step_ends: list[float], warmup: int = WARMUP_STEPS) -> float | None:
    """The median of :func:`steady_step_times`, or None with fewer than ``MIN_MEASURED_STEPS`` measured steps."""
    import statistics

    steady = steady_step_times(step_ends, warmup)
    return statistics.median(steady) if len(steady) >= MIN_MEASURED_STEPS else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_table(title: str, rows: list[Row]) -> None:
    width = max([len(r.metric) for r in rows] + [6])
    print(f"\n{title}")
    print(f"{'metric':<{width}}  {'value':>12}  unit")
    print(f"{'-' * width}  {'-' * 12}  {'-' * 24}")
    for r in rows:
        print(f"{r.metric:<{width}}  {_fmt(r.value):>12}  {r.unit}{'' if r.record else '  (not recorded)'}")


def append_results(
    rows: list[Row], device: str, path: Path = RESULTS, command: str | None = None, code: str | None = None
) -> int:
    """Append the recordable rows to RESULTS.md (created with its header if missing); returns how many. ``command``:
    the command line that measured them (default: this process's; another when the rows are recorded afterwards
    from a run's JSON); ``code``: the :func:`code_id` of the code that measured them (default: this tree's), appended
    to each row's unit cell."""
    command = command or shlex.join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    command = command.replace("|", "\\|")
    code = code or code_id()
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    lines = [
        f"| {r.metric} | {_fmt(r.value)} | {tag_unit(r.unit, code)} | {device} | {date} | `{command}` |\n"
        for r in rows
        if r.record
    ]
    new = not path.exists() or path.stat().st_size == 0
    needs_newline = not new and not path.read_bytes().endswith(b"\n")
    with open(path, "a") as f:
        if new:
            f.write(HEADER)
        elif needs_newline:
            f.write("\n")
        f.writelines(lines)
    return len(lines)


def _fmt(value: float) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)
