"""The residency moves an engine makes that vLLM itself does not offer, checked on a GPU: free the KV cache alone
(weights stay), map it back, and generate the same greedy tokens as before.

    python bench/residency_gpu.py --model /tmp/peer/model     # prints a table, writes $OUT/residency_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="/tmp/peer/model")
    ap.add_argument("--gpu_util", type=float, default=0.35)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    from hybrid_engines.protocol import SamplingParams
    from hybrid_engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(
        args.model,
        gpu_memory_utilization=args.gpu_util,
        enable_sleep_mode=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=256,
    )
    prompts = [[5 + i, 17, 3 * i + 1, 99] for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32, n=1)
    before = [o[0].token_ids for o in engine.generate(prompts, greedy)]
    free0 = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    released = engine.release_kv_cache()
    release_s = time.perf_counter() - start
    free1 = torch.cuda.mem_get_info()[0]
    refused = False
    try:
        engine.generate(prompts, greedy)
    except Exception:  # generating without a KV cache must be refused, not crash the engine
        refused = True
    start = time.perf_counter()
    engine.wake_up(["kv_cache"])
    wake_s = time.perf_counter() - start
    after = [o[0].token_ids for o in engine.generate(prompts, greedy)]
    cycles = []
    for _ in range(3):  # repeated cycles stay correct
        engine.release_kv_cache()
        engine.wake_up(["kv_cache"])
        cycles.append([o[0].token_ids for o in engine.generate(prompts, greedy)] == before)
    result = {
        "kv_release_gib": (free1 - free0) / 2**30,
        "kv_release_reported_gib": released.bytes / 2**30,
        "kv_release_s": release_s,
        "kv_reacquire_s": wake_s,
        "generate_refused_while_released": refused,
        "greedy_identical_after_release": after == before,
        "cycles_identical": cycles,
    }
    engine.shutdown()
    print(json.dumps(result, indent=1))
    print(
        f"\nvllm kv release GiB   {result['kv_release_gib']:.2f}\nvllm kv release s     {release_s:.4f}\n"
        f"vllm kv reacquire s   {wake_s:.4f}\ngreedy identical      {after == before and all(cycles)}"
    )
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "residency_gpu.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if after == before and all(cycles) and refused else 1


if __name__ == "__main__":
    raise SystemExit(main())
