"""Is CUDA MPS running for this process's GPUs? Without it, kernels of different processes on one GPU take turns
(time-slicing); under MPS they run at the same time. That decides what overlapping two roles on a shared GPU gains
(asynchronous training on shared GPUs), so a run says which case it is in.

A CUDA process joins MPS when the control daemon's pipe exists in ``CUDA_MPS_PIPE_DIRECTORY`` (default
``/tmp/nvidia-mps``), the folder the daemon was started with. Ray's workers inherit the driver's environment.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def mps_pipe_directory(env: Mapping[str, str] | None = None) -> str | None:
    """The MPS control daemon's pipe folder when one is running there for this environment, else None."""
    env = os.environ if env is None else env
    folder = env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY
    try:
        mode = os.stat(os.path.join(folder, "control")).st_mode
    except OSError:
        return None
    return folder if stat.S_ISFIFO(mode) else None


def mps_note(env: Mapping[str, str] | None = None) -> str:
    """One sentence for a run's notes: what sharing a GPU between two busy processes means here."""
    folder = mps_pipe_directory(env)
    if folder is not None:
        return f"CUDA MPS is running ({folder}): the processes' kernels run at the same time on a shared GPU"
    return (
        "CUDA MPS is not running: the processes' kernels take turns on a shared GPU, so running both at once gains "
        "only what each leaves idle (start nvidia-cuda-mps-control -d first to let them run together; see the "
        "README, 'Asynchronous training')"
    )
