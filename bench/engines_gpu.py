#!/usr/bin/env python3
"""GPU proof of the vLLM adapter (issue 5): generate, sleep levels, wake, weight updates, greedy match.

On one GPU: a random Llama saved to /tmp is served by ``VLLMEngine``; it sleeps at level 1 and 2 (device memory left
is measured), wakes (timed), and after the level-2 sleep gets new weights from a trainer *process* on the same GPU
by CUDA IPC. With two GPUs visible the trainer of a second update sits on GPU 0 and sends over hybrid-core's NCCL
weight-sync group to the engine on GPU 1. After each update the engine's greedy outputs are compared with the
built-in engine (``HFEngine``) holding the same new weights.

Every phase runs in its own try/except: a failure is recorded (JSON in ``$OUT/engines_gpu.json`` when ``$OUT`` is
set, and printed) and the phases that do not depend on it still run.

    python bench/engines_gpu.py                 # on the GPU machine (vLLM 0.26 installed)
    python bench/engines_gpu.py --record        # ... and append the metric rows to bench/RESULTS.md
    python bench/engines_gpu.py --dry           # CPU: build the model folders + tokenizer, check the reference path
    python bench/engines_gpu.py --append-from engines_gpu.json   # append rows of a finished run (no GPU)

Default dtype is float32: random weights give near-uniform logits, and bfloat16 rounding alone then flips greedy
choices between two correct engines; in float32 a mismatch means a wrong weight. ``--dtype bfloat16`` also works
(and is used automatically if vLLM refuses float32).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for pkg in ("hybrid-core", "hybrid-engines"):  # runnable from a plain checkout (PYTHONPATH not needed)
    sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))

METRICS = {  # first column of bench/RESULTS.md, exactly as issue 5 names them -> unit
    "vllm sleep level 1 GiB left": "GiB",
    "vllm sleep level 2 GiB left": "GiB",
    "vllm wake s": "s",
    "vllm weight update GB/s": "GB/s",
    "vllm weight update NCCL GB/s": "GB/s",
    "vllm greedy match after update %": "%",
    # every greedy token of the updated engine is the built-in model's argmax or within TIE_TOL of it (see below)
    "vllm greedy tokens argmax or near-tie after update %": "%",
}
SIZES = {  # Llama shapes; "medium" is ~0.4 B parameters (1.6 GB in float32)
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
    "small": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=8192,
    ),
    "medium": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=8192,
    ),
}
HEADER = "| metric | value | unit | device | date | command |\n| --- | --- | --- | --- | --- | --- |\n"


# ---- model folders ---------------------------------------------------------------------------------------------------
def build_models(root: Path, size: str, seeds=(0, 1, 2)) -> dict[int, str]:
    """One folder per seed: random Llama (safetensors) + a WordLevel tokenizer, both from local code only."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SIZES[size]
    config = LlamaConfig(
        **shape, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False
    )
    dirs = {}
    for seed in seeds:
        path = root / f"llama-{size}-seed{seed}"
        if not (path / "config.json").exists():
            torch.manual_seed(seed)
            LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
            save_tokenizer(shape["vocab_size"], path)
        dirs[seed] = str(path)
    return dirs


def save_tokenizer(vocab_size: int, path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    ).save_pretrained(path)


def make_prompts(vocab_size: int, count: int = 16, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(8, 33))] for _ in range(count)]


def weight_metas(model_dir: str, dtype: str):
    """The TensorMetas of the checkpoint's parameters in ``named_parameters`` order, as the trainer sends them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybrid_core.weight_sync import TensorMeta

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return [TensorMeta(n, dtype, tuple(p.shape)) for n, p in model.named_parameters()]


def reference(model_dir: str, prompts, params, dtype: str, device: str):
    """The built-in engine's completions (ids, logprobs) with the weights of ``model_dir``."""
    from hybrid_engines.hf_engine import HFEngine

    engine = HFEngine(model_dir, device=device, dtype=dtype)
    try:
        return flatten(engine.generate(prompts, params))
    finally:
        engine.shutdown()


def flatten(outputs):
    return [(o.token_ids, o.logprobs) for per_prompt in outputs for o in per_prompt]


def compare(ours, ref) -> dict:
    same = [a[0] == b[0] for a, b in zip(ours, ref)]
    diffs = [abs(x - y) for a, b, ok in zip(ours, ref, same) if ok and a[1] and b[1] for x, y in zip(a[1], b[1])]
    return {
        "match_pct": 100.0 * sum(same) / max(len(same), 1),
        "completions": len(same),
        "max_abs_logprob_diff": max(diffs, default=None),
    }


#: A greedy choice whose log-prob is within this of the reference model's best token is a near-tie: two correct
#: engines may break it either way (kernels differ; float32 log-probs here differ by up to ~0.004, Triton kernels use
#: TF32). Five times that bound; a wrong weight moves log-probs by far more.
TIE_TOL = 0.02


def teacher_forced(model_dir: str, prompts, ours, dtype: str, device: str) -> dict:
    """Score the engine's greedy completions with the built-in model, token by token on the engine's own context.

    For every generated token: is it the reference's argmax, or within ``TIE_TOL`` of it (a near-tie), and how far
    apart are the two log-probs of that token? This checks every token, also after a completion has diverged from
    the reference's own greedy run, which exact sequence matching cannot.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    n = argmax = ties = 0
    worst_gap = worst_diff = 0.0
    per_prompt = len(ours) // max(len(prompts), 1)
    with torch.no_grad():
        for i, (tokens, logprobs) in enumerate(ours):
            if not tokens:
                continue
            prompt = prompts[i // per_prompt]
            ids = torch.tensor([prompt + tokens], device=device)
            lp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
            chosen = lp.gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0]
            gap = lp.max(-1).values - chosen
            n += len(tokens)
            argmax += int((gap == 0).sum())
            ties += int(((gap > 0) & (gap <= TIE_TOL)).sum())
            worst_gap = max(worst_gap, float(gap.max()))
            if logprobs:
                worst_diff = max(worst_diff, float((chosen.cpu() - torch.tensor(logprobs)).abs().max()))
    del model
    return {
        "tokens": n,
        "argmax_pct": 100.0 * argmax / max(n, 1),
        "near_tie_pct": 100.0 * ties / max(n, 1),
        "argmax_or_tie_pct": 100.0 * (argmax + ties) / max(n, 1),
        "worst_gap": worst_gap,
        "max_abs_logprob_diff": worst_diff,
    }


# ---- trainer processes -----------------------------------------------------------------------------------------------
def _trainer_model(gpu: str, model_dir: str, dtype: str):
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before this process touches CUDA
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to("cuda:0")


def ipc_trainer(conn, gpu: str, model_dir: str, dtype: str, bucket_bytes: int) -> None:
    """Colocated trainer: packs its parameters into CUDA-IPC buckets; the engine process loads each and acks it."""
    try:
        from hybrid_core.weight_sync import IpcBucketSender

        model = _trainer_model(gpu, model_dir, dtype)
        sender = IpcBucketSender(bucket_bytes, device="cuda:0")
        acked: set[int] = set()

        def wait(index: int) -> None:
            while index not in acked:
                acked.add(conn.recv())

        def deliver(bucket) -> int:
            conn.send(("bucket", bucket))
            return bucket.index

        conn.recv()  # "go"
        stats = sender.send(model.named_parameters(), deliver, wait)
        conn.send(("done", stats.as_dict()))
        conn.recv()  # "bye"
        sender.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def nccl_trainer(conn, gpu: str, model_dir: str, dtype: str, bucket_bytes: int, port: int) -> None:
    """Trainer on another GPU: rank 0 of hybrid-core's NCCL weight-sync group, sends the stream once per "go"."""
    try:
        from hybrid_core.weight_sync import WeightSender, create_sync_group

        model = _trainer_model(gpu, model_dir, dtype)
        group = create_sync_group("127.0.0.1", port, 0, 2, backend="nccl", timeout_s=300, device="cuda:0")
        sender = WeightSender(group, bucket_bytes)
        while conn.recv() == "go":
            conn.send(("done", sender.send(model.named_parameters()).as_dict()))
        group.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _answer(conn, timeout_s: float = 600):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"trainer process: no answer within {timeout_s} s")
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(f"trainer process failed:\n{payload}")
    return kind, payload


# ---- the run ---------------------------------------------------------------------------------------------------------
class Run:
    def __init__(self, args):
        self.args, self.metrics, self.info, self.errors = args, {}, {}, []

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        print(f"-- {name}", flush=True)
        try:
            yield
            self.info.setdefault("phase_s", {})[name] = round(time.perf_counter() - start, 3)
        except Exception as e:
            self.errors.append({"phase": name, "error": repr(e), "traceback": traceback.format_exc()})
            print(f"!! {name} failed: {e!r}", flush=True)


def visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return [g.strip() for g in env.split(",") if g.strip()]
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return [str(i) for i in range(int(out.stdout.strip() or 0))]


def used_gib() -> float:
    """Device memory in use on this process's GPU (every process on it counts), GiB."""
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return round((total - free) / 2**30, 3)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(ctx, target, *args):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return parent, proc


def stop(proc, timeout_s: float = 60) -> None:
    proc.join(timeout_s)
    if proc.is_alive():
        proc.terminate()


def run_gpu(args, run: Run) -> None:
    gpus = visible_gpus()
    if not gpus:
        raise SystemExit("no GPU visible: use --dry on a CPU machine")
    engine_gpu = gpus[1] if len(gpus) >= 2 else gpus[0]
    os.environ["CUDA_VISIBLE_DEVICES"] = engine_gpu  # this process (and vLLM in it) sees only the engine's GPU
    import torch

    from hybrid_engines.hf_engine import EngineStateError
    from hybrid_engines.protocol import SamplingParams
    from hybrid_engines.vllm_engine import VLLMEngine

    dirs = build_models(Path(args.workdir), args.size)
    prompts = make_prompts(SIZES[args.size]["vocab_size"])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    ctx = mp.get_context("spawn")
    run.info.update(engine_gpu=engine_gpu, gpus=gpus, size=args.size, bucket_bytes=args.bucket_mb << 20)
    outputs = {}
    engine = None
    with run.phase("engine start"):
        for dtype in dict.fromkeys([args.dtype, "bfloat16"]):
            try:
                start = time.perf_counter()
                engine = VLLMEngine(
                    dirs[0],
                    dtype=dtype,
                    gpu_memory_utilization=args.gpu_mem,
                    enforce_eager=True,
                    max_model_len=1024,
                    seed=0,
                )
                run.info.update(dtype=dtype, engine_start_s=round(time.perf_counter() - start, 2))
                break
            except Exception as e:  # float32 refused: say so and go on in bfloat16
                run.errors.append({"phase": f"engine start ({dtype})", "error": repr(e)})
        run.info["device"] = torch.cuda.get_device_name(0)
    if engine is None:
        return
    dtype = run.info["dtype"]
    with run.phase("generate"):
        outputs["w0"] = flatten(engine.generate(prompts, greedy))
        seeded = SamplingParams(temperature=1.0, n=2, seed=3, max_new_tokens=16)
        a, b = engine.generate(prompts[:4], seeded), engine.generate(prompts[:4], seeded)
        run.info["seeded_sampling_reproducible"] = flatten(a) == flatten(b)
        run.info["gib_used_awake"] = used_gib()
    with run.phase("sleep level 1 + wake"):
        run.info["sleep1"] = engine.sleep(1).as_dict()
        run.metrics["vllm sleep level 1 GiB left"] = used_gib()
        start = time.perf_counter()
        engine.wake_up(["weights"])
        engine.wake_up(["kv_cache"])
        run.metrics["vllm wake s"] = round(time.perf_counter() - start, 4)
        run.info["identical_after_level1_wake"] = flatten(engine.generate(prompts, greedy)) == outputs["w0"]
    with run.phase("sleep level 2"):
        run.info["sleep2"] = engine.sleep(2).as_dict()
        run.metrics["vllm sleep level 2 GiB left"] = used_gib()
        start = time.perf_counter()
        engine.wake_up(["weights"])
        run.info["level2_wake_weights_s"] = round(time.perf_counter() - start, 4)
        try:
            engine.generate(prompts[:1], greedy)
            run.info["level2_guard"] = "MISSING: generate ran on discarded weights"
        except EngineStateError as e:
            run.info["level2_guard"] = f"ok: {e}"
    with run.phase("weight update by CUDA IPC"):
        parent, proc = spawn(ctx, ipc_trainer, engine_gpu, dirs[1], dtype, args.bucket_mb << 20)
        try:
            parent.send("go")
            while True:
                kind, payload = _answer(parent)
                if kind == "done":
                    break
                engine.update_weights_from_ipc(payload)
                parent.send(payload.index)
            parent.send("bye")
            run.info["ipc_trainer"] = payload
            run.metrics["vllm weight update GB/s"] = round(payload["gbps"], 3)
        finally:
            stop(proc)
        engine.wake_up(["kv_cache"])
        outputs["w1"] = flatten(engine.generate(prompts, greedy))
    if len(gpus) >= 2:
        with run.phase("weight update over NCCL"):
            engine.sleep(2)
            engine.wake_up(["weights"])
            port = free_port()
            parent, proc = spawn(ctx, nccl_trainer, gpus[0], dirs[2], dtype, args.bucket_mb << 20, port)
            try:
                engine.init_weight_update_group("127.0.0.1", port, 1, 2, backend="nccl", timeout_s=300)
                metas = weight_metas(dirs[2], dtype)
                parent.send("go")
                engine_stats = engine.update_weights(metas, bucket_bytes=args.bucket_mb << 20)
                _, sent = _answer(parent)
                run.info["nccl"] = {"trainer": sent, "engine": engine_stats.as_dict()}
                run.metrics["vllm weight update NCCL GB/s"] = round(sent["gbps"], 3)
                engine.wake_up(["kv_cache"])
                outputs["w2"] = flatten(engine.generate(prompts, greedy))
                engine.weight_loading = "layerwise"  # same weights again through vLLM's layerwise reload
                parent.send("go")
                engine.update_weights(metas, bucket_bytes=args.bucket_mb << 20)
                _answer(parent)
                run.info["layerwise_reload_same_outputs"] = flatten(engine.generate(prompts, greedy)) == outputs["w2"]
                engine.weight_loading = "direct"
            finally:
                parent.send("stop")
                stop(proc)
    else:
        run.info["nccl"] = "skipped: needs 2 GPUs (NCCL refuses two ranks on one GPU)"
    with run.phase("reference (built-in engine)"):
        matches = {}
        for key, seed in (("w0", 0), ("w1", 1), ("w2", 2)):
            if key in outputs:
                matches[key] = compare(outputs[key], reference(dirs[seed], prompts, greedy, dtype, "cuda"))
        run.info["greedy_vs_builtin"] = matches
        updated = [m["match_pct"] for k, m in matches.items() if k != "w0"]
        if updated:
            run.metrics["vllm greedy match after update %"] = round(min(updated), 2)
    with run.phase("teacher-forced check (built-in model)"):
        forced = {
            key: teacher_forced(dirs[seed], prompts, outputs[key], dtype, "cuda")
            for key, seed in (("w0", 0), ("w1", 1), ("w2", 2))
            if key in outputs
        }
        run.info["greedy_teacher_forced"] = forced
        updated = [f["argmax_or_tie_pct"] for k, f in forced.items() if k != "w0"]
        if updated:
            run.metrics["vllm greedy tokens argmax or near-tie after update %"] = round(min(updated), 2)
    with run.phase("shutdown"):
        engine.shutdown()


def run_dry(args, run: Run) -> None:
    """CPU check: model folders, tokenizer and the reference path, without vLLM."""
    from transformers import AutoTokenizer

    from hybrid_engines.protocol import SamplingParams

    dirs = build_models(Path(args.workdir), "tiny")
    tok = AutoTokenizer.from_pretrained(dirs[0])
    run.info["tokenizer_roundtrip"] = tok.decode(tok("w5 w7 w9")["input_ids"]) == "w5 w7 w9"
    prompts = make_prompts(SIZES["tiny"]["vocab_size"], count=4)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    ref = reference(dirs[1], prompts, greedy, "float32", "cpu")
    run.info["reference_self_match"] = compare(ref, reference(dirs[1], prompts, greedy, "float32", "cpu"))
    # the tie check: the built-in engine's own greedy tokens are all argmax; another model's are mostly not
    run.info["teacher_forced_self"] = teacher_forced(dirs[1], prompts, ref, "float32", "cpu")
    run.info["teacher_forced_other_weights"] = teacher_forced(dirs[2], prompts, ref, "float32", "cpu")
    run.info["metas"] = len(weight_metas(dirs[2], "float32"))
    run.info["dirs"] = dirs


# ---- reporting -------------------------------------------------------------------------------------------------------
def record(results: dict, path: Path = ROOT / "bench" / "RESULTS.md") -> int:
    """Append one row per metric (creating the file with its header); returns the rows written."""
    from _common import tag_unit  # the unit cell names the measured code, as every bench's rows do

    date = results.get("date", datetime.date.today().isoformat())
    rows = [
        f"| {name} | {value} | {tag_unit(METRICS[name], results.get('code'))} | {results.get('device', '?')} | "
        f"{date} | `{results['command']}` |\n"
        for name, value in results["metrics"].items()
        if value is not None
    ]
    if not path.exists():
        path.write_text(HEADER)
    with path.open("a") as f:
        f.writelines(rows)
    return len(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry", action="store_true", help="CPU: build the model folders and tokenizer, check, exit")
    p.add_argument("--record", action="store_true", help="append the metric rows to bench/RESULTS.md")
    p.add_argument("--append-from", help="append the rows of a results JSON to bench/RESULTS.md and exit")
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--gpu-mem", type=float, default=0.3, help="vLLM gpu_memory_utilization")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--workdir", default="/tmp/hybrid_engines_gpu")
    args = p.parse_args(argv)
    if args.append_from:
        print(f"appended {record(json.loads(Path(args.append_from).read_text()))} rows")
        return 0
    run = Run(args)
    (run_dry if args.dry else run_gpu)(args, run)
    from _common import code_id

    results = {
        "command": "python bench/engines_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "code": code_id(),  # --append-from records the code that measured, not the tree it is appended from
        "date": datetime.date.today().isoformat(),
        "device": run.info.get("device", "cpu (dry)"),
        "metrics": run.metrics,
        "info": run.info,
        "errors": run.errors,
    }
    print("\n| metric | value | unit |\n| --- | --- | --- |")
    for name, unit in METRICS.items():
        print(f"| {name} | {run.metrics.get(name, 'n/a')} | {unit} |")
    print(
        json.dumps(
            {"info": run.info, "errors": [e["phase"] + ": " + e["error"] for e in run.errors]}, indent=1, default=str
        )
    )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "engines_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    if args.record and not args.dry:
        print(f"appended {record(results)} rows to bench/RESULTS.md")
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
