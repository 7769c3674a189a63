"""Running a peer framework's trainer (OpenRLHF, verl) as a child process group for a benchmark: its output teed to
a log with the arrival time of every line, stopped once its steps are logged (a grace period to exit) or at a
timeout, and everything it left in its group killed so that nothing holds the GPU or our pipe afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable


def run_peer(cmd: list[str], env: dict, log_path: str, *, timeout: float, expected_steps: int, grace: float,
             count_steps: Callable[[list], int], echo: tuple[str, ...], echo_width: int | None = None) -> dict:
    """Run ``cmd`` in its own process group; lines containing one of ``echo`` are also printed (cut at
    ``echo_width``). ``count_steps(lines)`` says how many steps the ``(time, line)`` list so far holds."""
    start = time.time()
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            errors="replace", start_new_session=True)

    def pump():
        with open(log_path, "w") as log:
            for line in proc.stdout:
                lines.append((time.time(), line.rstrip("\n")))
                log.write(line)
                log.flush()
                if any(marker in line for marker in echo):
                    shown = line if echo_width is None or len(line) <= echo_width else line[:echo_width] + "\n"
                    sys.stdout.write(shown)
                    sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stopped = None
    last_step_seen = None
    while proc.poll() is None:
        time.sleep(1)
        if last_step_seen is None and count_steps(list(lines)) >= expected_steps:
            last_step_seen = time.time()
        if last_step_seen is not None and time.time() - last_step_seen > grace:
            stopped = "after_last_step"
        elif time.time() - start > timeout:
            stopped = "timeout"
        if stopped:
            stop_group(proc)
            break
    proc.wait()
    try:  # what the run left behind in its own process group (Ray's workers, vLLM's engine) holds our pipe open
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    reader.join(timeout=10)
    return {"rc": proc.returncode, "stopped": stopped, "wall_s": time.time() - start, "lines": lines}


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, then SIGKILL it if it has not exited."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
