#!/usr/bin/env python3
"""Adapter-only weight sync under LoRA (issue 39) against the merged full-weights sync, on one GPU with vLLM.

On a random-weight Qwen2-shaped folder (``bench/peer_workload.py``: ``7b`` by default, ``1.5b`` / ``357m`` smaller) a
trainer *process* on the engine's GPU holds the base and a LoRA adapter (rank ``--rank`` on every linear layer,
random A and B in bf16: a trained adapter's shape and bytes) and syncs it into a ``VLLMEngine`` in this process by
CUDA IPC buckets (``IpcBucketSender``, verification ``sampled`` as in a run), ``--syncs`` times per phase:

* ``lora`` -- the engine is built with the adapter's spec (``enable_lora``, ``max_lora_rank``); each sync sends the
  lora_A / lora_B tensors alone, which the worker extension makes vLLM's adapter by tensor. Then the engine
  generates (greedy, with the adapter's ``LoRARequest``) and the trainer scores the same tokens with the merged HF
  model (``W + alpha / r * B @ A``, teacher-forced): the log-probs must agree, and differ from the base's.
* ``full`` -- the baseline, what a LoRA run pays without adapter support: a plain engine receives the merged full
  weights each sync (merged on the fly, as ``peft_weights.PeftExport.merged`` does).

Each phase runs in a process of its own (a fresh vLLM each). Rows (``<size>``: 7B, 1.5B, 357M): ``lora sync s
<size>`` (median of the syncs after the first; goal <= 0.05 at 7B), ``lora full-weights sync s <size>`` (the
baseline), ``lora sync speedup vs full <size> x``, ``lora adapter MB <size>``, ``lora engine vs merged logprob diff
<size>`` (mean |engine - merged HF| over the generated tokens), plus printed-only diagnostics (the max, the base's
shift, the first sync, the engine's share of a sync and its last call's, where the adapter is built). Agreement is
judged against ``--tolerance`` or, if larger, 3x the floor: the engine's own distance to HF on the *base* (its greedy
tokens before the first adapter sync, scored by the HF base), the two implementations' bf16 noise. Exit 1 when the
engine does not generate with the adapter.

    python bench/lora_gpu.py                         # 7B on the GPU (vLLM 0.26); the folder is built when missing
    python bench/lora_gpu.py --size 1.5b --record    # smaller; --record appends the rows to bench/RESULTS.md
    python bench/lora_gpu.py --engine hf --tiny      # CPU: the built-in engine, shared-memory buckets (logic only)

``PEER_BUILD_DEVICE=cuda`` builds a missing folder on the GPU (seconds for 7B instead of ~9 min on the CPU). With
``$OUT`` set, both phases' raw numbers go to ``$OUT/lora_gpu.json``. At 7B each phase starts vLLM and loads the
base in the trainer process (a few minutes in all): keep ``--syncs`` small on a 10-minute device call.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _common import Row, append_results, device_label, print_table

ROOT = Path(__file__).resolve().parents[1]
for _pkg in ("hybrid-core", "hybrid-engines"):  # runnable from a plain checkout
    sys.path.insert(0, str(ROOT / "packages" / _pkg / "src"))

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # PEFT's all-linear here
LABELS = {"7b": "7B", "1.5b": "1.5B", "357m": "357M"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=tuple(LABELS), default="7b", help="bench/peer_workload.py's shape")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide variant of the shape (CPU checks)")
    ap.add_argument("--workdir", default=None, help="the workload's folder (default /tmp/peer-<size>)")
    ap.add_argument("--engine", choices=("vllm", "hf"), default="vllm", help="hf: the built-in engine (CPU: logic)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--syncs", type=int, default=6, help="syncs per phase (the first is reported apart)")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--gpu-mem", type=float, default=0.45, help="vLLM's gpu_memory_utilization")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="mean |engine - merged| log-prob allowed (or 3x the engine's own distance to HF on the base, if larger)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="seconds for any one wait")
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md")
    ap.add_argument("--phase", choices=("lora", "full"), default=None, help=argparse.SUPPRESS)  # a child's
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---- the trainer process -------------------------------------------------------------------------------------------
def make_adapter(model, rank: int, seed: int = 7) -> dict:
    """wire name -> tensor (PEFT's saved-adapter names), A then B for each linear layer, in the model's dtype.
    A as PEFT draws it (kaiming-uniform scale), B small but non-zero: what some training leaves."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in TARGETS:
            continue
        w = module.weight
        a = (torch.rand(rank, w.shape[1], generator=g) * 2 - 1) / w.shape[1] ** 0.5
        b = torch.randn(w.shape[0], rank, generator=g) * 0.1
        prefix = f"base_model.model.{name}"
        out[f"{prefix}.lora_A.weight"] = a.to(w.device, w.dtype)
        out[f"{prefix}.lora_B.weight"] = b.to(w.device, w.dtype)
    return out


def merged_stream(model, adapter: dict, scaling: float):
    """The merged full weights, layer by layer (W + scaling * B @ A in float32, in W's dtype), as the fallback sends."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            prefix = f"base_model.model.{name.removesuffix('.weight')}"
            a = adapter.get(f"{prefix}.lora_A.weight")
            if a is None:
                yield name, p.data
                continue
            b = adapter[f"{prefix}.lora_B.weight"]
            yield name, (p.data.float() + scaling * (b.float() @ a.float())).to(p.dtype)


def merge_in_place(model, adapter: dict, scaling: float) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            prefix = f"base_model.model.{name.removesuffix('.weight')}"
            if f"{prefix}.lora_A.weight" in adapter:
                a, b = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]
                p.data.copy_((p.data.float() + scaling * (b.float() @ a.float())).to(p.dtype))


def token_logprobs(model, prompts, completions) -> list[list[float]]:
    """Teacher-forced log-probs of each completion's tokens under ``model`` (float32 log-softmax)."""
    import torch

    out = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, completions):
            ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            chosen = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
            out.append(chosen.tolist())
    return out


def trainer(conn, phase: str, model_dir: str, device: str, rank: int, alpha: float, bucket_bytes: int) -> None:
    """Sends one sync per "go" (the adapter, or the merged full weights), answers "score" with the base's and the
    merged model's log-probs of the engine's tokens."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from hybrid_core.weight_sync import IpcBucketSender

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        adapter = make_adapter(model, rank)
        scaling = alpha / rank
        sender = IpcBucketSender(bucket_bytes, device=device, verify="sampled")
        acked: set[int] = set()

        def wait(index: int) -> None:
            while index not in acked:
                acked.add(conn.recv())

        def deliver(bucket) -> int:
            conn.send(("bucket", bucket))
            return bucket.index

        conn.send(("ready", {"adapter_bytes": sum(t.numel() * t.element_size() for t in adapter.values())}))
        while True:
            command = conn.recv()
            if command == "go":
                acked.clear()
                stream = iter(adapter.items()) if phase == "lora" else merged_stream(model, adapter, scaling)
                conn.send(("done", sender.send(stream, deliver, wait).as_dict()))
            elif isinstance(command, tuple) and command[0] == "score":
                _, prompts, completions, base_completions = command
                base = token_logprobs(model, prompts, completions)
                floor = token_logprobs(model, prompts, base_completions)  # the engine's base tokens, the HF base
                merge_in_place(model, adapter, scaling)  # the reference the engine must match
                merged = token_logprobs(model, prompts, completions)
                conn.send(("scores", {"base": base, "merged": merged, "floor": floor}))
            else:
                break
        sender.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _answer(conn, timeout_s: float):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"trainer process: no answer within {timeout_s:g} s")
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(f"trainer process failed:\n{payload}")
    return kind, payload


# ---- one phase (a child process: a fresh engine) --------------------------------------------------------------------
def run_phase(args) -> dict:
    import torch

    from hybrid_engines.protocol import SamplingParams
    from hybrid_engines.weight_sync.adapter import AdapterSpec

    model_dir = workload(args)
    spec = AdapterSpec(args.rank, args.alpha, TARGETS)
    lora = spec if args.phase == "lora" else None
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if args.engine == "vllm":
        from hybrid_engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(
            model_dir,
            dtype="bfloat16",
            gpu_memory_utilization=args.gpu_mem,
            enforce_eager=True,
            max_model_len=1024,
            seed=0,
            enable_sleep_mode=False,
            lora=lora,
        )
    else:
        from hybrid_engines.hf_engine import HFEngine

        engine = HFEngine(model_dir, device=device, lora=lora, dtype="bfloat16" if device != "cpu" else "float32")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=trainer,
        args=(child, args.phase, model_dir, device, args.rank, args.alpha, args.bucket_mb << 20),
        daemon=True,
    )
    proc.start()
    result: dict = {"phase": args.phase, "device": device_label(device), "engine": args.engine}
    try:
        _, ready = _answer(parent, args.timeout)
        result.update(ready)
        import random

        rng = random.Random(0)
        prompts = [[rng.randrange(1000) for _ in range(24)] for _ in range(args.prompts)]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
        # before the first adapter sync the engine serves the base: its distance to the HF base on the same tokens is
        # the two implementations' own noise (bf16 kernels), the floor the adapter's agreement is judged against
        base_outs = engine.generate(prompts, greedy) if args.phase == "lora" else None
        seconds, nbytes, engine_s, last_call_s = [], [], [], []
        for _ in range(args.syncs):
            parent.send("go")
            calls = []
            while True:
                kind, payload = _answer(parent, args.timeout)
                if kind == "done":
                    break
                start = time.perf_counter()
                engine.update_weights_from_ipc(payload)
                calls.append(time.perf_counter() - start)
                parent.send(payload.index)
            seconds.append(payload["seconds"])
            nbytes.append(payload["bytes"])
            engine_s.append(sum(calls))
            last_call_s.append(calls[-1] if calls else 0.0)  # the last bucket: the adapter is built there
        result.update(seconds=seconds, bytes=nbytes, engine_seconds=engine_s, last_call_seconds=last_call_s)
        if args.phase == "lora":
            outs = engine.generate(prompts, greedy)
            completions = [per[0].token_ids for per in outs]
            base_completions = [per[0].token_ids for per in base_outs]
            parent.send(("score", prompts, completions, base_completions))
            _, scores = _answer(parent, args.timeout)
            engine_lp = [lp for per in outs for lp in per[0].logprobs]
            merged_lp = [lp for per in scores["merged"] for lp in per]
            base_lp = [lp for per in scores["base"] for lp in per]
            engine_base_lp = [lp for per in base_outs for lp in per[0].logprobs]
            floor_lp = [lp for per in scores["floor"] for lp in per]
            diffs = [abs(a - b) for a, b in zip(engine_lp, merged_lp)]
            shift = [abs(a - b) for a, b in zip(base_lp, merged_lp)]
            floor = [abs(a - b) for a, b in zip(engine_base_lp, floor_lp)]
            result.update(
                tokens=len(diffs),
                mean_diff=statistics.fmean(diffs),
                max_diff=max(diffs),
                base_shift=statistics.fmean(shift),
                base_floor=statistics.fmean(floor),
            )
        parent.send("bye")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
        engine.shutdown()
    return result


def workload(args) -> str:
    sys.path.insert(0, str(ROOT / "bench"))
    import peer_workload

    root = args.workdir or f"/tmp/peer-{args.size}{'-tiny' if args.tiny else ''}"
    extra = {"layers": 2, "hidden": 64} if args.tiny else {}
    model_dir, _ = peer_workload.build(root, size=args.size, **extra)
    return model_dir


# ---- the parent: both phases, the table --------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.phase is not None:
        result = run_phase(args)
        Path(args.out).write_text(json.dumps(result))
        return 0
    workload(args)  # built once, before either phase's engine takes the GPU
    results = {}
    child_argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--record"]
    for phase in ("lora", "full"):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        command = [sys.executable, __file__, *child_argv, "--phase", phase, "--out", out]
        done = subprocess.run(command, timeout=args.timeout * 3)
        if done.returncode != 0 or not os.path.getsize(out):
            print(f"phase {phase} failed (rc {done.returncode})", file=sys.stderr)
            return 1
        results[phase] = json.loads(Path(out).read_text())
        os.unlink(out)
    lora, full = results["lora"], results["full"]
    size = LABELS[args.size] + (" tiny" if args.tiny else "")
    steady = {p: statistics.median(r["seconds"][1:] or r["seconds"]) for p, r in results.items()}
    rows = [
        Row(f"lora sync s {size}", steady["lora"], f"s per adapter-only sync (rank {args.rank}, median; goal <= 0.05)"),
        Row(f"lora full-weights sync s {size}", steady["full"], "s per merged full-weights sync (the baseline)"),
        Row(f"lora sync speedup vs full {size} x", steady["full"] / steady["lora"], "x"),
        Row(f"lora adapter MB {size}", lora["bytes"][-1] / 2**20, "MB sent per adapter-only sync"),
        Row(f"lora full-weights MB {size}", full["bytes"][-1] / 2**20, "MB sent per full sync", record=False),
        Row(
            f"lora engine vs merged logprob diff {size}",
            lora["mean_diff"],
            f"mean |engine - merged HF| (nats; the base's own engine vs HF: {lora['base_floor']:.4f})",
        ),
        Row(f"lora engine vs HF base logprob diff {size}", lora["base_floor"], "nats (the floor)", record=False),
        Row(
            f"lora engine share of the sync {size}",
            statistics.median(lora["engine_seconds"][1:] or lora["engine_seconds"]),
            f"s in the engine's update calls (median; the last, which builds the adapter: "
            f"{statistics.median(lora['last_call_seconds'][1:] or lora['last_call_seconds']):.4f} s)",
            record=False,
        ),
        Row(f"lora engine vs merged max logprob diff {size}", lora["max_diff"], "nats", record=False),
        Row(
            f"lora base vs merged logprob shift {size}", lora["base_shift"], "nats (the adapter's effect)", record=False
        ),
        Row(f"lora first sync s {size}", lora["seconds"][0], "s (every piece checked)", record=False),
    ]
    print_table(f"adapter-only vs merged weight sync, {args.engine}, {lora['device']}", rows)
    if os.environ.get("OUT"):  # a lent machine's results folder: both phases' raw numbers
        Path(os.environ["OUT"], "lora_gpu.json").write_text(json.dumps(results, indent=1))
    # agreement: within the tolerance, or within 3x the two implementations' own distance on the base (the adapter
    # adds its own bf16 rounding: the engine's x @ A @ B against the merged W + s * B @ A)
    allowed = max(args.tolerance, 3 * lora["base_floor"])
    ok = lora["bytes"][-1] == lora["adapter_bytes"] and lora["mean_diff"] <= allowed
    ok = ok and lora["base_shift"] > 3 * lora["mean_diff"]  # the adapter is what the engine applies, not the base
    print(
        f"{'OK' if ok else 'FAILED'}: the engine generates with the adapter (mean diff {lora['mean_diff']:.4f} vs the "
        f"merged model, allowed {allowed:.4f}: the base's own {lora['base_floor']:.4f} x 3 or --tolerance; "
        f"{lora['base_shift']:.4f} vs the base, over {lora['tokens']} tokens); each sync sent "
        f"{lora['bytes'][-1]} bytes (the adapter: {lora['adapter_bytes']})"
    )
    if args.record and ok:
        print(f"recorded {append_results(rows, lora['device'])} rows")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
