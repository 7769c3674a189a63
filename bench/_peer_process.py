"""Running a peer framework's trainer (OpenRLHF, verl) as a child process group for a benchmark: its output teed to
a log with the arrival time of every line, stopped once its steps are logged (a grace period to exit) or at a
timeout, and everything it left in its group killed so that nothing holds the GPU or our pipe afterwards. Also what
both peers' scripts share around it: the workloads, the per-step summary, the reading of a failure, versions and
the GPU's name."""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

#: size -> (prompts per step, samples, max new tokens, prompt max len, micro rollout batch); = bench/e2e_gpu.py
WORKLOADS = {
    "357m": (8, 8, 128, 64, 64),
    "1.5b": (32, 8, 1024, 256, 16),
    # issue 38's 4-GPU workloads (bench/peers.py G7 / P8)
    "qwen2.5-7b": (64, 8, 1024, 512, 16),
    "llama3-8b": (256, 1, 1024, 512, 16),
}
#: size -> (train micro batch, gradient checkpointing, vLLM memory fraction); = bench/sessions/residency_session.sh
#: for the one-GPU sizes, bench/peer_ratio.py's G7 / P8 for the others
DEFAULTS = {
    "357m": (64, False, 0.35),
    "1.5b": (8, True, 0.3),
    "qwen2.5-7b": (8, True, 0.3),
    "llama3-8b": (4, True, 0.3),
}


def run_peer(
    cmd: list[str],
    env: dict,
    log_path: str,
    *,
    timeout: float,
    expected_steps: int,
    grace: float,
    count_steps: Callable[[list], int],
    echo: tuple[str, ...],
    echo_width: int | None = None,
) -> dict:
    """Run ``cmd`` in its own process group; lines containing one of ``echo`` are also printed (cut at
    ``echo_width``). ``count_steps(lines)`` says how many steps the ``(time, line)`` list so far holds."""
    start = time.time()
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        errors="replace",
        start_new_session=True,
    )

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


def summarize_steps(
    steps: list[dict], warmup: int, *, step: str, phase: str, phases: Sequence[str], response_len: str, reward: str
) -> dict:
    """Median per-step times after ``warmup`` steps (all steps if there are no more than that). ``steps`` are
    ``{"step", "status": {metric: value}, "t": arrival time or None}``; the keyword arguments name the peer's metrics
    (``phase`` is a format string of one phase name)."""
    steady = steps[warmup:] or steps
    med = lambda key: statistics.median(s["status"].get(key, 0.0) for s in steady)  # noqa: E731
    out = {
        "steps": len(steps),
        "steady_steps": len(steady),
        "step_s": med(step),
        "phases_s": {p: med(phase.format(p)) for p in phases},
        "response_len": med(response_len),
        "rewards": [s["status"].get(reward) for s in steps],
        "step_times": [s["status"].get(step) for s in steps],
    }
    arrivals = [s["t"] for s in steps if s["t"] is not None]
    if len(arrivals) == len(steps) and len(steps) > warmup + 1:
        gaps = [b - a for a, b in zip(arrivals[warmup:], arrivals[warmup + 1 :])]
        out["wall_step_s"] = statistics.median(gaps)
    return out


def failure(log_lines: list[str], keep: int = 60) -> dict:
    """What stopped a run: the last Python traceback in its log (Ray prints the actors' too) and the log's tail."""
    tail = log_lines[-keep:]
    tb_start = max((i for i, ln in enumerate(log_lines) if "Traceback (most recent call last)" in ln), default=None)
    traceback = []
    if tb_start is not None:
        for line in log_lines[tb_start : tb_start + 80]:
            traceback.append(line)
            if traceback and re.match(r"^(\(\w+ pid=\d+\)\s*)?[A-Za-z_.]+(Error|Exception|Exit)\b", line.strip()):
                break
    errors = [ln for ln in log_lines if re.search(r"\b[A-Z]\w*(Error|Exception)\b", ln)][-5:]
    return {"traceback": traceback, "error_lines": errors, "log_tail": tail}


def installed_version(name: str, env: Mapping[str, str]) -> str | None:
    """The version of ``name`` as the run's environment sees it (its own site folder first)."""
    proc = subprocess.run(
        [sys.executable, "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
        env=dict(env),
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() or None


def gpu_name() -> str:
    """The GPU's name from nvidia-smi (not torch: a CUDA context here would hold memory beside the run)."""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        ).stdout.split("\n")
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    names = [n.strip() for n in names if n.strip()]
    return names[0] if len(names) == 1 else (f"{len(names)}x {names[0]}" if names else "cpu")
