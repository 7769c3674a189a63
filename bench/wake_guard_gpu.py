"""Issue 9 on a GPU: another process takes the memory a sleeping role gave back; the next wake must fail with the
wake guard's error (who is awake, which processes hold the GPU, what to change), not a CUDA out-of-memory error
deep inside vLLM or DeepSpeed.

The run is the built-in demo with the vLLM engine, everything colocated and sleeping. Once two steps are done, a
"hog" process on the same GPU grabs every byte that becomes free (polling every millisecond) and holds it: when a
role sleeps, the hog takes what it freed, as a careless neighbour job would.

    python bench/wake_guard_gpu.py            # on a GPU machine with vLLM; prints a verdict, JSON to $OUT
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

HOG = r"""
import os, sys, time, torch
keep, held = int(sys.argv[1]), []
torch.cuda.init()
print(f"hog pid {os.getpid()} started", flush=True)
while True:
    free, _ = torch.cuda.mem_get_info()
    if free > keep + (64 << 20):
        try:
            held.append(torch.empty(free - keep, dtype=torch.uint8, device="cuda"))
            print(f"hog holds {sum(t.numel() for t in held) / 2**30:.1f} GiB", flush=True)
        except torch.OutOfMemoryError:
            pass
    time.sleep(0.001)
"""


def main() -> int:
    save = "/tmp/wake_guard_run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [
                *(
                    os.path.join(ROOT, "packages", p, "src")
                    for p in ("hybrid-core", "hybrid-engines", "hybrid-algos", "hybrid-cli")
                ),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    }
    cmd = [
        sys.executable,
        "-m",
        "hybrid_cli",
        "grpo",
        "--backend",
        "vllm",
        "--vllm_gpu_memory_utilization",
        "0.3",
        "--max_steps",
        "30",
        "--save_path",
        save,
        "--step_timeout_s",
        "120",
    ]
    print("command:", " ".join(cmd), flush=True)
    log_path = os.path.join(os.environ.get("OUT", "/tmp"), "wake_guard_run.log")
    metrics = os.path.join(save, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    start = time.time()
    with open(log_path, "w") as log:
        run = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        hog = None
        while run.poll() is None and time.time() - start < 420:
            if hog is None and os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 2:
                hog = subprocess.Popen(
                    [sys.executable, "-c", HOG, str(256 << 20)], stdout=log, stderr=subprocess.STDOUT
                )
                hog_started = time.time()
            time.sleep(0.2)
        if run.poll() is None:
            run.kill()
        rc = run.wait()
        if hog is not None:
            hog.kill()
            hog.wait()
    text = open(log_path, errors="replace").read()
    steps_done = sum(1 for _ in open(metrics)) if os.path.exists(metrics) else 0
    guard_lines = [line for line in text.splitlines() if "cannot wake on GPU" in line]
    result = {
        "rc": rc,
        "wall_s": round(time.time() - start, 1),
        "steps_done": steps_done,
        "hog_pid": hog.pid if hog else None,
        "seconds_from_hog_to_exit": round(time.time() - hog_started, 1) if hog else None,
        "guard_error": guard_lines[-1][-1500:] if guard_lines else None,
        "guard_names_hog": bool(hog and any(str(hog.pid) in line for line in guard_lines)),
        "cuda_oom_in_log": "out of memory" in text.lower() and not guard_lines,
        "command": " ".join(cmd),
    }
    result["verdict"] = (
        "PASS: the wake guard stopped the run with its own error"
        if guard_lines and rc != 0
        else "FAIL: no wake-guard error" + (" (CUDA OOM instead)" if "out of memory" in text.lower() else "")
    )
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wake_guard.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["verdict"].startswith("PASS") else 1


if __name__ == "__main__":
    raise SystemExit(main())
