"""The train phase alone, DeepSpeed against FSDP2 and its options, on one GPU (issue 37: why FSDP2's train phase was
0.82x DeepSpeed's at 1.5B).

The same random micro-batches go through each backend's real engine (``trainer_backends``: DeepSpeed's ZeRO engine
as the trainer builds it, ``FSDP2Engine`` over ``shard_causal_lm``) with the loss path the policy worker uses
(``response_token_scores``: chunked log-probs of the response tokens), gradient checkpointing on, bf16 compute and
fp32 master weights: one update per step over ``--micro_batches`` micro-batches. A step is timed between CUDA
synchronisations; the first is a warm-up. No engine, Ray or vLLM is involved, so the difference is the trainer's.

Variants (``--variants``): ``ds`` (ZeRO-1, what ``--zero_stage 3`` runs on one rank), ``fsdp2`` (the backend's
options today: each layer's parameters freed after its forward, gathered again for the backward; fp32
reduce-scatter), ``fsdp2:keep`` (``reshard_after_forward=False``: gathered from the forward to the backward),
``fsdp2:bf16reduce`` (gradients reduced in bf16), combinations with ``+``: ``fsdp2:keep+bf16reduce``.
``--profile``: one more step of each variant under torch.profiler, not timed (top ops by device and CPU time).

    python bench/trainer_gpu.py --size 1.5b --micro 8 --seq 1280 --micro_batches 16 --steps 3
    python bench/trainer_gpu.py --size small --device cpu --steps 2        # logic check (gloo; no DeepSpeed Adam)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import free_port  # noqa: E402
from peer_workload import SHAPES, VOCAB  # noqa: E402


def model_config(size: str):
    from transformers import LlamaConfig

    if size == "small":
        layers, width, heads, kv, inter, tied = 2, 64, 4, 2, 128, False
    else:
        layers, width, heads, kv, inter, _, tied = SHAPES[size]
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=tied,
        rope_theta=1_000_000.0,
    )


def build_engine(variant: str, cfg, device: torch.device, args):
    from transformers import LlamaForCausalLM

    from hybrid_algos.train.models import install_token_scores

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.float32)  # fp32 master weights, as the trainers keep them
    model.config.use_cache = False
    install_token_scores(model)
    name, _, opts = variant.partition(":")
    flags = set(filter(None, opts.split("+")))
    if name == "ds":
        from hybrid_algos.train.trainer_backends.registry import make_training_engine
        from hybrid_algos.train.workers.settings import TrainerSettings

        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer = TrainerSettings(backend="deepspeed", zero_stage=1, bf16=True, gradient_checkpointing=True)
        shape = {"micro_batch": args.micro, "grad_accum": args.micro_batches, "total_updates": args.steps}
        return make_training_engine(trainer, model, 1e-6, shape, device)
    if name == "fsdp2":
        from hybrid_algos.train.trainer_backends.fsdp2_engine import FSDP2Engine
        from hybrid_algos.train.trainer_backends.fsdp2_setup import FSDP2Options

        unknown = flags - {"keep", "bf16reduce"}
        if unknown:
            raise SystemExit(f"variant {variant}: unknown options {sorted(unknown)} (keep, bf16reduce)")
        compute = torch.bfloat16 if device.type == "cuda" else torch.float32
        options = FSDP2Options(
            master_dtype=torch.float32,
            compute_dtype=compute,
            reduce_dtype=torch.bfloat16 if "bf16reduce" in flags else torch.float32,
            activation_checkpointing=True,
            reshard_after_forward="keep" not in flags,
        )
        return FSDP2Engine.build(model, options, device, lr=1e-6, betas=(0.9, 0.95), max_norm=1.0)
    raise SystemExit(f"unknown variant {variant!r} (ds, fsdp2[:keep|bf16reduce|keep+bf16reduce])")


def train_step(engine, batches, response_len: int) -> None:
    from hybrid_algos.train.models import response_token_scores

    engine.train()
    for i, (seqs, mask) in enumerate(batches):
        engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
        scores = response_token_scores(engine, seqs, mask, response_len)
        loss = -(scores.logprobs * mask[:, -response_len:]).sum() / mask[:, -response_len:].sum() / len(batches)
        engine.backward(loss)
        engine.step()


def run_variant(variant: str, cfg, device: torch.device, args) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.micro_batches):
        seqs = torch.randint(0, VOCAB - 3, (args.micro, args.seq), generator=g).to(device)
        batches.append((seqs, torch.ones_like(seqs)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = build_engine(variant, cfg, device, args)
    built = time.perf_counter() - t0
    times = []
    prof = None
    for step in range(args.steps + int(args.profile)):
        if step == args.steps:  # one step more under the profiler, not among the timed ones
            acts = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        sync()
        start = time.perf_counter()
        train_step(engine, batches, args.seq // 2)
        sync()
        seconds = time.perf_counter() - start
        if prof is not None:
            prof.__exit__(None, None, None)
        else:
            times.append(seconds)
        print(f"  {variant} step {step}{' (profiled)' if prof else ''}: {seconds:.3f} s", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    if prof is not None:
        table = prof.key_averages()
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"== {variant}: top ops by {sort}\n{table.table(sort_by=sort, row_limit=18)}", flush=True)
        print(f"== {variant}: top ops by CPU total\n{table.table(sort_by='cpu_time_total', row_limit=12)}", flush=True)
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    measured = times[1:] or times
    return {
        "variant": variant,
        "step_s": statistics.median(measured),
        "steps_s": times,
        "build_s": built,
        "peak_gib": peak,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("small", *SHAPES), default="1.5b")
    ap.add_argument("--micro", type=int, default=8, help="samples per micro-batch")
    ap.add_argument("--seq", type=int, default=1280, help="tokens per sample (the second half is the response)")
    ap.add_argument("--micro_batches", type=int, default=16, help="micro-batches per update")
    ap.add_argument("--steps", type=int, default=3, help="updates per variant; the first is a warm-up")
    ap.add_argument("--variants", nargs="+", default=["ds", "fsdp2", "fsdp2:keep", "fsdp2:keep+bf16reduce"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"), help="folder for trainer_gpu.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    from hybrid_algos.train.deepspeed_setup import init_distributed

    init_distributed(0, 1, "127.0.0.1", free_port(), timeout_s=600)  # one rank: DeepSpeed and FSDP2 both need a group
    cfg = model_config(args.size)
    results = []
    for variant in args.variants:
        try:
            results.append(run_variant(variant, cfg, device, args))
        except Exception as e:  # one variant failing (out of memory) leaves the others' figures
            traceback.print_exc()
            print(f"{variant}: failed: {type(e).__name__}: {e}", flush=True)
            results.append({"variant": variant, "error": f"{type(e).__name__}: {e}"})
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    tokens = args.micro * args.seq * args.micro_batches
    print(f"\ntrain phase, {args.size}, {args.micro_batches} x {args.micro} x {args.seq} tokens a step, {device}")
    print(f"{'variant':<26} {'s/step':>8} {'tokens/s':>10} {'peak GiB':>9} {'vs ds':>6}")
    ds = next((r["step_s"] for r in results if r["variant"] == "ds" and "step_s" in r), None)
    for r in results:
        if "step_s" not in r:
            print(f"{r['variant']:<26} {'failed':>8}  {r['error'][:80]}")
            continue
        ratio = f"{ds / r['step_s']:.3f}" if ds else "-"
        print(f"{r['variant']:<26} {r['step_s']:>8.3f} {tokens / r['step_s']:>10.0f} {r['peak_gib']:>9.2f} {ratio:>6}")
    with open(os.path.join(args.out, "trainer_gpu.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
