#!/usr/bin/env python3
"""GPU proof of the SGLang adapter (issue 19): sleep, wake by parts, weight updates in SGLang's own formats, greedy
checks, and vLLM vs SGLang on the same prompts and weights -- the issue's rows in one call.

On one GPU (SGLang 0.5.16 staged by bench/sglang_stage.py): a random Llama saved to /tmp is served by
``SGLangEngine``. Two level-1 sleep/wake cycles (device memory left measured, weights and KV cache woken separately
and timed, greedy outputs compared with the first run after each); a level-2 sleep, then new weights from a trainer
*process* on the same GPU through ``SGLangTransport``'s CUDA-IPC payloads (``update_weights_from_tensor``), and one
more level-1 cycle (the new weights must survive it). With two GPUs visible, a third set of weights comes over
SGLang's own NCCL group from a trainer on GPU 0. After each update the engine's greedy tokens are scored
teacher-forced by the updated model (``bench/engines_gpu.py``'s check, reused). Finally vLLM (a subprocess with the
vLLM carry's path) generates greedily from the same model folder and prompts, and ``hybrid compare``'s agreement
gives the per-token log-prob difference of the two engines.

    export PYTHONPATH=/tmp/site-sglang:/tmp/site:$PWD/packages/hybrid-core/src
    export PYTHONPATH=$PYTHONPATH:$PWD/packages/hybrid-engines/src:$PWD/packages/hybrid-cli/src
    python bench/sglang_gpu.py                # on the GPU machine; --record appends the rows to bench/RESULTS.md
    python bench/sglang_gpu.py --dry          # CPU: models, reference path, IPC payload round trip, compare, rows
    python bench/sglang_gpu.py --append-from sglang_gpu.json   # here, after a GPU run: its rows into RESULTS.md

Every phase runs in its own try/except (a failure is recorded, later phases still run); JSON goes to
``$OUT/sglang_gpu.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for pkg in ("hybrid-core", "hybrid-engines", "hybrid-cli"):  # runnable from a plain checkout
    sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))
sys.path.insert(0, str(HERE))

import engines_gpu as eg  # noqa: E402  (the vLLM bench: models, prompts, teacher-forced check, trainer helpers)
from _common import Row, append_results, code_id, measured_code, print_table  # noqa: E402

UNITS = {  # first column of bench/RESULTS.md, as issue 19 names them
    "sglang sleep GiB left": "GiB in use on the engine's GPU after sleep (level 1; all processes)",
    "sglang sleep level 2 GiB left": "GiB in use after a level-2 sleep",
    "sglang wake s": "s (weights, then KV cache + CUDA graphs; median of the level-1 cycles)",
    "sglang wake weights s": "s (resume_memory_occupation weights; median)",
    "sglang wake kv_cache s": "s (resume_memory_occupation kv_cache + cuda_graph; median)",
    "sglang weight update GB/s": "GB/s (colocated, CUDA-IPC flattened buckets -> update_weights_from_tensor)",
    "sglang weight update NCCL GB/s": "GB/s (SGLang's own group, GPU 0 -> GPU 1, flattened buckets)",
    "sglang greedy tokens argmax or near-tie after update %": "% of teacher-forced tokens that are the updated "
    "model's argmax or within 0.02 nats of it (worst update)",
    "sglang outputs identical after every sleep/wake cycle": "1 = yes (greedy, vs the first run; 0 = no)",
    "vllm vs sglang logprob diff mean": "nats per token (greedy, same prompts and weights, positions before the "
    "first divergence)",
    "vllm vs sglang logprob diff max": "nats per token (as above)",
    "vllm vs sglang token agreement %": "% of generated positions before the first divergence",
}


# ---- trainer processes (the trainer's side is SGLangTransport, as in the training loop) ----------------------------
def sglang_ipc_trainer(conn, gpu: str, model_dir: str, dtype: str, bucket_bytes: int) -> None:
    """Colocated trainer: packs its parameters into CUDA-IPC buckets and sends SGLang's serialized form of each."""
    try:
        from hybrid_core.weight_sync import IpcBucketSender
        from hybrid_engines.weight_sync.sglang import SGLangTransport

        model = eg._trainer_model(gpu, model_dir, dtype)
        transport, sender = SGLangTransport(), IpcBucketSender(bucket_bytes, device="cuda:0")
        acked: set[int] = set()

        def wait(index: int) -> None:
            while index not in acked:
                acked.add(conn.recv())

        def deliver(bucket) -> int:
            conn.send(("bucket", transport.encode_ipc([bucket])))
            return bucket.index

        conn.recv()  # "go"
        stats = sender.send(model.named_parameters(), deliver, wait)
        conn.send(("done", stats.as_dict()))
        conn.recv()  # "bye"
        sender.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def sglang_nccl_trainer(conn, gpu: str, model_dir: str, dtype: str, bucket_bytes: int, port: int) -> None:
    """Trainer on another GPU: rank 0 of SGLang's weight-update group, one broadcast stream per "go"."""
    try:
        from hybrid_engines.weight_sync.sglang import SGLangTransport

        model = eg._trainer_model(gpu, model_dir, dtype)
        transport = SGLangTransport()
        group = transport.join(
            "127.0.0.1", port, 2, backend="nccl", timeout_s=300, device="cuda:0", group_name="hybrid-bench"
        )
        while conn.recv() == "go":
            conn.send(
                ("done", transport.broadcast(group, model.named_parameters(), bucket_bytes=bucket_bytes).as_dict())
            )
        transport.close_group(group)
    except Exception:
        conn.send(("error", traceback.format_exc()))


# ---- measuring ---------------------------------------------------------------------------------------------------
_NVML_INDEX = [0]  # the engine's GPU as NVML numbers it (physical; CUDA_VISIBLE_DEVICES does not apply)


def used_gib(gpu_index: int | None = None) -> float:
    """Device memory in use on the engine's GPU by every process, from NVML (this process holds no CUDA context of
    its own while SGLang is measured); torch's view when NVML is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(_NVML_INDEX[0] if gpu_index is None else gpu_index)
        return round(pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30, 3)
    except Exception:  # no NVML bindings: torch's device-wide figure (adds this process's context)
        return eg.used_gib()


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def cycle(engine, prompts, greedy, expected, run, label: str) -> None:
    """One level-1 sleep / wake (weights, then KV cache) / generate; records memory, times and sameness."""
    engine.sleep(1)
    run.info.setdefault("gib_left_level1", []).append(used_gib())
    start = time.perf_counter()
    engine.wake_up(["weights"])
    mid = time.perf_counter()
    engine.wake_up(["kv_cache"])
    end = time.perf_counter()
    run.info.setdefault("wake_weights_s", []).append(round(mid - start, 4))
    run.info.setdefault("wake_kv_s", []).append(round(end - mid, 4))
    same = eg.flatten(engine.generate(prompts, greedy)) == expected
    run.info.setdefault("identical_after_cycle", {})[label] = same


def vllm_outputs(model_dir: str, prompts, new_tokens: int, dtype: str, gpu_mem: float, timeout_s: float = 420):
    """Greedy ids + logprobs from vLLM, in a subprocess on the vLLM carry's path (/tmp/site, no SGLang pins)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "vllm.json")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "site-sglang" not in p
        )
        cmd = [
            sys.executable,
            __file__,
            "--vllm-generate",
            str(out),
            "--model",
            model_dir,
            "--dtype",
            dtype,
            "--new-tokens",
            str(new_tokens),
            "--gpu-mem",
            str(gpu_mem),
            "--prompts",
            json.dumps(prompts),
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(
                f"vLLM subprocess failed (rc {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return json.loads(out.read_text())


def vllm_generate(args) -> int:
    from hybrid_engines.protocol import SamplingParams
    from hybrid_engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(
        args.model,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_mem,
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
    )
    outs = eg.flatten(
        engine.generate(json.loads(args.prompts), SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens))
    )
    engine.shutdown()
    Path(args.vllm_generate).write_text(json.dumps(outs))
    return 0


def compare_engines(a, b) -> dict:
    """``hybrid compare``'s agreement of two engines' greedy (ids, logprobs) lists."""
    from hybrid_cli.compare import agreement

    res = agreement([x[0] for x in a], [y[0] for y in b], [x[1] for x in a], [y[1] for y in b])
    return {
        "token_agreement": res.token_agreement,
        "identical_sequences": res.identical_sequences,
        "mean_abs_logprob_diff": res.mean_abs_logprob_diff,
        "max_abs_logprob_diff": res.max_abs_logprob_diff,
    }


# ---- the GPU run -------------------------------------------------------------------------------------------------
def run_gpu(args, run) -> None:
    gpus = eg.visible_gpus()
    if not gpus:
        raise SystemExit("no GPU visible: use --dry on a CPU machine")
    engine_gpu = gpus[1] if len(gpus) >= 2 else gpus[0]
    _NVML_INDEX[0] = int(engine_gpu) if engine_gpu.isdigit() else 0
    os.environ["CUDA_VISIBLE_DEVICES"] = engine_gpu  # SGLang's scheduler (a subprocess) sees only the engine's GPU
    from hybrid_engines.hf_engine import EngineStateError
    from hybrid_engines.protocol import SamplingParams
    from hybrid_engines.sglang_engine import SGLangEngine

    dirs = eg.build_models(Path(args.workdir), args.size)
    prompts = eg.make_prompts(eg.SIZES[args.size]["vocab_size"])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    ctx = mp.get_context("spawn")
    run.info.update(engine_gpu=engine_gpu, gpus=gpus, size=args.size, bucket_bytes=args.bucket_mb << 20)
    outputs, engine = {}, None
    with run.phase("engine start"):
        for dtype in dict.fromkeys([args.dtype, "bfloat16"]):
            try:
                start = time.perf_counter()
                # float32: SGLang's Hopper default (FA3) takes 16-bit inputs only; its Triton kernels take float32
                backend = args.attention_backend or ("triton" if dtype == "float32" else None)
                extra = {"attention_backend": backend} if backend else {}
                engine = SGLangEngine(
                    dirs[0],
                    dtype=dtype,
                    gpu_memory_utilization=args.gpu_mem,
                    enforce_eager=args.enforce_eager,
                    max_model_len=1024,
                    seed=0,
                    deterministic=args.deterministic,
                    **extra,
                )
                run.info["attention_backend"] = backend or "SGLang's default"
                run.info.update(dtype=dtype, engine_start_s=round(time.perf_counter() - start, 2))
                break
            except Exception as e:  # float32 refused: say so and go on in bfloat16
                run.errors.append(
                    {"phase": f"engine start ({dtype})", "error": repr(e), "traceback": traceback.format_exc()}
                )
        import sglang

        run.info["sglang"] = sglang.__version__
        run.info["gib_used_awake"] = used_gib()
    if engine is None:
        return
    dtype = run.info["dtype"]
    with run.phase("generate"):
        outputs["w0"] = eg.flatten(engine.generate(prompts, greedy))
    with run.phase("sleep/wake cycles (level 1)"):
        for k in range(args.cycles):
            cycle(engine, prompts, greedy, outputs["w0"], run, f"w0 cycle {k + 1}")
        run.metrics["sglang sleep GiB left"] = max(run.info["gib_left_level1"])
        run.metrics["sglang wake weights s"] = median(run.info["wake_weights_s"])
        run.metrics["sglang wake kv_cache s"] = median(run.info["wake_kv_s"])
        run.metrics["sglang wake s"] = median(
            [a + b for a, b in zip(run.info["wake_weights_s"], run.info["wake_kv_s"])]
        )
    with run.phase("sleep level 2"):
        engine.sleep(2)
        run.metrics["sglang sleep level 2 GiB left"] = used_gib()
        engine.wake_up(["weights"])
        try:
            engine.generate(prompts[:1], greedy)
            run.info["level2_guard"] = "MISSING: generate ran on discarded weights"
        except EngineStateError as e:
            run.info["level2_guard"] = f"ok: {e}"
    with run.phase("weight update by CUDA IPC"):
        parent, proc = eg.spawn(ctx, sglang_ipc_trainer, engine_gpu, dirs[1], dtype, args.bucket_mb << 20)
        try:
            parent.send("go")
            while True:
                kind, payload = eg._answer(parent)
                if kind == "done":
                    break
                engine.update_weights_from_ipc(payload)
                parent.send(payload.index)
            parent.send("bye")
            run.info["ipc_trainer"] = payload
            run.metrics["sglang weight update GB/s"] = round(payload["gbps"], 3)
        finally:
            eg.stop(proc)
        engine.wake_up(["kv_cache"])
        outputs["w1"] = eg.flatten(engine.generate(prompts, greedy))
        cycle(engine, prompts, greedy, outputs["w1"], run, "w1 after update")  # the new weights survive a sleep
    if len(gpus) >= 2:
        with run.phase("weight update over NCCL"):
            engine.sleep(2)
            engine.wake_up(["weights"])
            port = eg.free_port()
            parent, proc = eg.spawn(ctx, sglang_nccl_trainer, gpus[0], dirs[2], dtype, args.bucket_mb << 20, port)
            try:
                engine.init_weight_update_group("127.0.0.1", port, 1, 2, backend="nccl", group_name="hybrid-bench")
                parent.send("go")
                engine_stats = engine.update_weights(eg.weight_metas(dirs[2], dtype), bucket_bytes=args.bucket_mb << 20)
                _, sent = eg._answer(parent)
                run.info["nccl"] = {"trainer": sent, "engine": engine_stats.as_dict()}
                run.metrics["sglang weight update NCCL GB/s"] = round(sent["gbps"], 3)
            finally:
                parent.send("stop")
                eg.stop(proc)
            engine.wake_up(["kv_cache"])
            outputs["w2"] = eg.flatten(engine.generate(prompts, greedy))
    else:
        run.info["nccl"] = "skipped: needs 2 GPUs (NCCL refuses two ranks on one GPU)"
    with run.phase("shutdown"):
        engine.shutdown()
    same = run.info.get("identical_after_cycle", {})
    if same:
        run.metrics["sglang outputs identical after every sleep/wake cycle"] = int(all(same.values()))
    with run.phase("teacher-forced check (built-in model)"):
        forced = {
            key: eg.teacher_forced(dirs[seed], prompts, outputs[key], dtype, "cuda")
            for key, seed in (("w0", 0), ("w1", 1), ("w2", 2))
            if key in outputs
        }
        run.info["greedy_teacher_forced"] = forced
        updated = [f["argmax_or_tie_pct"] for k, f in forced.items() if k != "w0"]
        if updated:
            run.metrics["sglang greedy tokens argmax or near-tie after update %"] = round(min(updated), 2)
    with run.phase("vllm vs sglang (hybrid compare's agreement)"):
        theirs = vllm_outputs(dirs[0], prompts, args.new_tokens, dtype, args.gpu_mem)
        res = compare_engines(theirs, outputs["w0"])
        run.info["vllm_vs_sglang"] = res
        run.metrics["vllm vs sglang logprob diff mean"] = round(res["mean_abs_logprob_diff"], 5)
        run.metrics["vllm vs sglang logprob diff max"] = round(res["max_abs_logprob_diff"], 5)
        run.metrics["vllm vs sglang token agreement %"] = round(100 * res["token_agreement"], 2)
    run.info["device"] = _device_name()


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "?"


# ---- the CPU check -----------------------------------------------------------------------------------------------
def run_dry(args, run) -> None:
    """CPU: the model folders, the teacher-forced reference, SGLang's IPC payload of a bucket read back, the engine
    comparison, and the rows (written to a scratch file, never to RESULTS.md)."""
    import pickle

    import torch

    from hybrid_core.weight_sync import IpcBucketSender
    from hybrid_engines.protocol import SamplingParams
    from hybrid_engines.weight_sync.sglang import SGLangTransport

    dirs = eg.build_models(Path(args.workdir), "tiny")
    prompts = eg.make_prompts(eg.SIZES["tiny"]["vocab_size"], count=4)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    ref = eg.reference(dirs[1], prompts, greedy, "float32", "cpu")
    run.info["teacher_forced_self"] = eg.teacher_forced(dirs[1], prompts, ref, "float32", "cpu")
    assert run.info["teacher_forced_self"]["argmax_or_tie_pct"] == 100.0
    same = compare_engines(ref, eg.reference(dirs[1], prompts, greedy, "float32", "cpu"))
    assert same["token_agreement"] == 1.0 and same["max_abs_logprob_diff"] == 0.0
    other = compare_engines(ref, eg.reference(dirs[2], prompts, greedy, "float32", "cpu"))
    assert other["token_agreement"] < 1.0
    run.info["compare_self"], run.info["compare_other_weights"] = same, other
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dirs[1])
    got = {}

    def deliver(bucket):
        payload = SGLangTransport().encode_ipc([bucket])
        obj = pickle.loads(payload.data[0])
        flat = obj["flattened_tensor"]
        got.update(
            {m.name: flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape).clone() for m in obj["metadata"]}
        )

    sender = IpcBucketSender(1 << 16, device="cpu")
    sender.send(model.named_parameters(), deliver=deliver, wait=lambda _: None)
    sender.close()
    assert all(torch.equal(got[n], p) for n, p in model.named_parameters())
    run.info["ipc_payload_round_trip_tensors"] = len(got)
    run.metrics.update({"sglang sleep GiB left": 0.0, "sglang wake s": 0.0})  # row formatting check only
    scratch = Path(args.workdir, "RESULTS.dry.md")
    rows = [Row(name, value, UNITS[name]) for name, value in run.metrics.items()]
    written = append_results(rows, "cpu (dry)", path=scratch)
    assert written == len(rows) and scratch.read_text().count("| sglang ") >= 2
    run.metrics.clear()
    run.info["rows_format_checked"] = str(scratch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry", action="store_true", help="CPU: logic check, no SGLang / vLLM / GPU")
    p.add_argument("--record", action="store_true", help="append the metric rows to bench/RESULTS.md (GPU runs only)")
    p.add_argument("--size", choices=sorted(eg.SIZES), default="medium")
    # bfloat16: SGLang 0.5.16's rmsnorm kernel refuses float32, and a scheduler that fails makes SGLang SIGQUIT its
    # parent -- this process -- so there is no falling back from float32 within one run
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--gpu-mem", type=float, default=0.3, help="SGLang mem_fraction_static / vLLM gpu_memory_utilization"
    )
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--cycles", type=int, default=2, help="level-1 sleep/wake cycles before the update")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--attention-backend", help="SGLang attention backend (default: triton in float32, else SGLang's)")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="SGLang's deterministic inference (what the training loop uses for seeded sampling)",
    )
    p.add_argument("--workdir", default="/tmp/hybrid_sglang_gpu")
    p.add_argument("--append-from", help="append the rows of a finished GPU run's sglang_gpu.json to RESULTS.md, exit")
    p.add_argument("--vllm-generate", help=argparse.SUPPRESS)  # internal: the vLLM subprocess
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vllm_generate:
        return vllm_generate(args)
    if args.append_from:
        done = json.loads(Path(args.append_from).read_text())
        if done.get("device", "cpu (dry)").startswith("cpu"):
            raise SystemExit("not a GPU run: rows are recorded from GPU runs only")
        rows = [Row(name, value, UNITS[name]) for name, value in done["metrics"].items() if value is not None]
        sys.argv = done["argv"]  # the command column names the run that measured, not this append
        print(f"appended {append_results(rows, done['device'], code=measured_code(done))} rows to bench/RESULTS.md")
        return 0
    run = eg.Run(args)
    (run_dry if args.dry else run_gpu)(args, run)
    device = run.info.get("device", "cpu (dry)")
    rows = [Row(name, value, UNITS[name]) for name, value in run.metrics.items() if value is not None]
    if rows:
        print_table("sglang_gpu", rows)
    print(
        json.dumps(
            {"info": run.info, "errors": [e["phase"] + ": " + e["error"] for e in run.errors]}, indent=1, default=str
        )
    )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "sglang_gpu.json").write_text(
            json.dumps(
                {
                    "device": device,
                    "code": code_id(),  # what --append-from records as the measured code
                    "argv": [sys.argv[0], *(argv if argv is not None else sys.argv[1:])],
                    "metrics": run.metrics,
                    "info": run.info,
                    "errors": run.errors,
                },
                indent=1,
                default=str,
            )
        )
    if args.record and not args.dry and rows:
        print(f"appended {append_results(rows, device)} rows to bench/RESULTS.md")
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
