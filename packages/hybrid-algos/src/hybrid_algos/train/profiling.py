"""``--profile_step N``: one step of a run under the profilers, to see where its seconds go.

Every trainer worker (actor, critic, reference, reward model) runs the torch profiler (CPU, and CUDA where there is a
GPU) from the start of step N to its end; the driver runs cProfile over the same step. Each writes a table (the
busiest operators, or functions) and the workers a Chrome trace (chrome://tracing, Perfetto) into
``<save_path>/profile/step<N>/``. The engines are not profiled (vLLM and SGLang have profilers of their own).
The profiled step runs slower than the others: read its tables for where time goes, not for how long it takes.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

#: operators / functions listed per table
TOP = 40


def profile_folder(run_dir: str, step: int) -> str:
    """Where step ``step``'s (1-based) tables and traces go."""
    return os.path.join(run_dir, "profile", f"step{step}")


@contextmanager
def profiled_step(groups: Sequence[Any], folder: str) -> Iterator[None]:
    """Profile the step run inside: every worker of ``groups`` (``RoleGroup``) with torch, the driver with cProfile."""
    os.makedirs(folder, exist_ok=True)
    for group in groups:
        group.call("start_profile")
    driver = cProfile.Profile()
    driver.enable()
    try:
        yield
    finally:
        driver.disable()
        for group in groups:
            group.call("stop_profile", folder)
        text = io.StringIO()
        pstats.Stats(driver, stream=text).sort_stats("cumulative").print_stats(TOP)
        with open(os.path.join(folder, "driver.txt"), "w") as f:
            f.write(text.getvalue())


class WorkerProfiler:
    """A worker's side: the torch profiler between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self._prof: Any = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, record_shapes=False)
        self._prof.__enter__()

    def stop(self, folder: str, name: str) -> str:
        """Write ``<name>.txt`` (the busiest operators by device time, then by host time) and ``<name>.trace.json``
        into ``folder``; returns the table's path."""
        if self._prof is None:
            raise RuntimeError("stop_profile without start_profile")
        prof, self._prof = self._prof, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        averages = prof.key_averages()
        sections = []
        if torch.cuda.is_available():
            sections.append(("by device time (self)", "self_cuda_time_total"))
        sections += [
            ("by host time (total, with callees)", "cpu_time_total"),
            ("by host time (self)", "self_cpu_time_total"),
        ]
        path = os.path.join(folder, f"{name}.txt")
        with open(path, "w") as f:
            for title, key in sections:
                f.write(f"# {name}: operators {title}\n{averages.table(sort_by=key, row_limit=TOP)}\n\n")
        prof.export_chrome_trace(os.path.join(folder, f"{name}.trace.json"))
        return path
