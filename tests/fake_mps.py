"""A stand-in ``nvidia-cuda-mps-control`` for the MPS tests: no MPS daemon can run on a CPU machine."""

from __future__ import annotations

import os
import textwrap

from hybrid_core.mps_daemon import CONTROL

FAKE_CONTROL = """\
    #!/bin/sh
    # a stand-in for nvidia-cuda-mps-control: -d opens the control pipe and returns (the real one forks);
    # "quit" on stdin closes it
    echo "$@" >> "$CUDA_MPS_LOG_DIRECTORY/calls"
    if [ "$1" = "-d" ]; then
        [ -n "$FAKE_MPS_FAIL" ] && { echo "cannot start: $FAKE_MPS_FAIL" >&2; exit 3; }
        mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"
        exit 0
    fi
    read cmd
    [ "$cmd" = "quit" ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
    exit 0
"""


def write_fake_control(folder) -> str:
    """The stand-in binary in ``folder`` (put it on PATH to be found by name)."""
    path = os.path.join(folder, CONTROL)
    with open(path, "w") as f:
        f.write(textwrap.dedent(FAKE_CONTROL))
    os.chmod(path, 0o755)
    return path
