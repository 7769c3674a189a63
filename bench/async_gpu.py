"""Asynchronous training against the synchronous loop, end to end through the CLI (bench/e2e_gpu.py's runs).

* ``async speedup colocated x`` (one GPU): the best synchronous colocated plan (``--residency auto`` and
  ``all-sleep``, the faster of the two) against ``--async_train`` on the same GPU -- generation of batch k+1 runs
  next to training on batch k when the residency plan keeps the engine's weights and KV cache beside the trainer
  (the run's summary says ``shared``; when they do not fit, the run takes synchronous turns and says so, and the
  row is not recorded). Goal >= 1.3.
* ``async speedup split x`` (``--gpus 2``): one-step-off (``--async_train``) against the synchronous split run
  (engine on GPU 1, trainer on GPU 0). Goal >= 1.5.
* ``partial rollout speedup x`` (``--gpus 2``): ``--async_train --partial_rollout`` against ``--async_train``
  alone, split. The workload's random model at temperature 1 stops at its end-of-sequence token at random, so
  response lengths spread from a few tokens to --generate_max_len: the long tail a weight update no longer waits
  for.

Per-step time: the median ``time/step`` of the steps after the warm-up. For an asynchronous run it is the trainer's
step including its wait for the batch, so it is the loop's wall-clock per step, as for the synchronous runs.

CUDA MPS: ``--mps on`` gives every run ``--mps on`` (each starts and stops a CUDA MPS daemon of its own; its log
in ``<run>/logs/mps``), so the synchronous baseline is measured under the same MPS condition as the asynchronous
run and a ratio is the overlap's alone. ``--async_under_mps`` (older) puts only the asynchronous colocated run under
MPS.

    python bench/async_gpu.py --size 1.5b                  # one H100: the colocated row
    python bench/async_gpu.py --size 1.5b --gpus 2         # two GPUs: also the split and partial-rollout rows
    python bench/async_gpu.py --size 1.5b --gpus 2 --record   # ... and append the rows to bench/RESULTS.md
    python bench/async_gpu.py --size 1.5b --mps on         # every run under the run's own CUDA MPS daemon
    python bench/async_gpu.py --small                      # tiny model, built-in engine, CPU: checks the logic
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import ROOT, Row, append_results, print_table  # noqa: E402
from e2e_gpu import WORKLOADS, command, summarize  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(WORKLOADS), default="1.5b")
    ap.add_argument("--backend", default="vllm")
    ap.add_argument("--gpus", type=int, default=1, choices=(1, 2), help="2: also the split and partial rows")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gpu_util", type=float, default=0.35)
    ap.add_argument(
        "--sync_plans",
        nargs="+",
        default=["auto", "all-sleep"],
        choices=["auto", "all-sleep"],
        help="the synchronous colocated plans to time (the fastest is the baseline); 'auto' alone keeps "
        "a 1.5B run inside one device call -- all-sleep moves more bytes each turn than auto",
    )
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--small", action="store_true", help="2-layer model, --backend hf, short runs (CPU)")
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md")
    ap.add_argument(
        "--mps",
        choices=("on", "off"),
        default="off",
        help="on: every run (the synchronous baselines and the asynchronous runs) with the run's own CUDA MPS "
        "daemon (--mps on of the run), so a ratio is the overlap's alone, not MPS's",
    )
    ap.add_argument(
        "--async_under_mps",
        action="store_true",
        help="only the asynchronous colocated run with --mps on (the synchronous runs without): the older "
        "comparison, which credits MPS's gain to the overlap; --mps on measures both sides under it",
    )
    args = ap.parse_args()
    if args.small:
        args.backend, args.steps, args.warmup, args.size = "hf", 3, 1, "357m"
    return args


def run(
    args,
    model: str,
    data: str,
    name: str,
    *,
    split: bool,
    residency: str = "auto",
    extra: tuple[str, ...] = (),
) -> dict:
    e2e = SimpleNamespace(
        size=args.size,
        algo="grpo",
        backend=args.backend,
        zero_stage=1 if args.small else 3,
        micro=32,
        steps=args.steps,
        lr=1e-6,
        kl=0.001,
        gpu_util=args.gpu_util,
        residency=residency,
        sleep_level=0,
        ckpt=False,
        split=split,
        enforce_eager=False,
        extra=[],
    )
    save = os.path.join(args.workdir, "runs", f"async-{name}")
    cmd = [*command(e2e, model, data, save), "--overwrite", *extra]
    if args.mps == "on" and "--mps" not in extra:  # the run starts and stops its own daemon
        cmd += ["--mps", "on"]
    if args.small:  # short generations, no bf16 kernels needed on a CPU
        cmd += [
            "--generate_max_len",
            "16",
            "--no_bf16",
            "--rollout_batch_size",
            "4",
            "--n_samples_per_prompt",
            "2",
            "--train_batch_size",
            "8",
            "--micro_train_batch_size",
            "8",
            "--micro_rollout_batch_size",
            "8",
        ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [
                *(
                    str(ROOT / "packages" / p / "src")
                    for p in ("hybrid-core", "hybrid-engines", "hybrid-algos", "hybrid-cli")
                ),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    }
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    start = time.time()
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"[{name}] failed (exit {proc.returncode})")
    result = summarize(os.path.join(save, "metrics.jsonl"), args.warmup)
    result["wall_s"] = time.time() - start
    result["async"] = _async_mode(save)
    print(
        f"[{name}] median step {result['step_s']:.3f} s, async mode {result['async']}, wall {result['wall_s']:.0f} s",
        flush=True,
    )
    return result


def _async_mode(save: str) -> str:
    """The mode the run took: asynchronous steps report ``async/*`` metrics; the residency plan's notes say when
    --async_train fell back to synchronous turns."""
    with open(os.path.join(save, "metrics.jsonl")) as f:
        if any("async/staleness_max" in json.loads(line) for line in f):
            return "async"
    try:
        notes = " ".join(json.load(open(os.path.join(save, "residency.json"))).get("notes", []))
    except OSError:
        notes = ""
    return "sync (fell back)" if "synchronous turns" in notes else "sync"


def main() -> int:
    args = parse_args()
    from peer_workload import build

    args.workdir = args.workdir or f"/tmp/async-{args.size}{'-small' if args.small else ''}"
    model, data = build(args.workdir, size=args.size, **({"layers": 2, "hidden": 112} if args.small else {}))
    rows: list[Row] = []
    results = {}
    # one GPU: the best synchronous colocated plan against async on the shared GPU
    for residency in args.sync_plans:
        results[f"sync-colocated-{residency}"] = run(
            args, model, data, f"sync-colocated-{residency}", split=False, residency=residency
        )
    best = min((r["step_s"], k) for k, r in results.items())
    if args.async_under_mps and args.mps == "off":
        results["async-colocated"] = run(
            args, model, data, "async-colocated-mps", split=False, extra=("--async_train", "--mps", "on")
        )
    else:
        results["async-colocated"] = run(args, model, data, "async-colocated", split=False, extra=("--async_train",))
    fell_back = results["async-colocated"]["async"] != "async"
    rows.append(
        Row(
            "async speedup colocated x",
            best[0] / results["async-colocated"]["step_s"],
            f"x (sync: {best[1]} {best[0]:.2f} s/step, of {'/'.join(args.sync_plans)}; "
            f"async {results['async-colocated']['step_s']:.2f} "
            f"s/step{_mps_words(args)}"
            f"{'; FELL BACK to synchronous turns' if fell_back else ''}; goal >= 1.3)",
            record=not fell_back,
        )
    )
    if args.gpus == 2:
        results["sync-split"] = run(args, model, data, "sync-split", split=True)
        results["async-split"] = run(args, model, data, "async-split", split=True, extra=("--async_train",))
        results["async-split-partial"] = run(
            args, model, data, "async-split-partial", split=True, extra=("--async_train", "--partial_rollout")
        )
        rows.append(
            Row(
                "async speedup split x",
                results["sync-split"]["step_s"] / results["async-split"]["step_s"],
                f"x (sync split {results['sync-split']['step_s']:.2f} s/step, one-step-off "
                f"{results['async-split']['step_s']:.2f}; goal >= 1.5)",
            )
        )
        rows.append(
            Row(
                "partial rollout speedup x",
                results["async-split"]["step_s"] / results["async-split-partial"]["step_s"],
                f"x (one-step-off {results['async-split']['step_s']:.2f} s/step, with partial rollouts "
                f"{results['async-split-partial']['step_s']:.2f}; split)",
            )
        )
    device = "cpu (--small: logic check)" if args.small else _gpu_label(args.gpus)
    print_table(f"asynchronous training, {args.size} ({device})", rows)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"async-{args.size}.json"), "w") as f:
            json.dump(
                {k: {kk: vv for kk, vv in v.items() if kk != "phases_s"} for k, v in results.items()}, f, indent=1
            )
    if args.record and not args.small:
        print(f"appended {append_results(rows, device)} rows to bench/RESULTS.md")
    return 0


def _mps_words(args) -> str:
    if args.mps == "on":
        return "; every run under CUDA MPS"
    return " under CUDA MPS (synchronous runs without)" if args.async_under_mps else ""


def _gpu_label(gpus: int) -> str:
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{gpus}x {name}" if gpus > 1 else name


if __name__ == "__main__":
    sys.exit(main())
