"""Where our generate phase spends its time beyond vLLM's own ``LLM.generate`` (the residency issue, item 4).

Same model folder, same GPU, same batch as ``bench/e2e_gpu.py`` (8 prompts x 8 samples, <= 128 new tokens,
temperature 1, CUDA graphs on), each variant timed over ``--repeats`` calls after a warm-up, median reported:

    A  vllm.LLM.generate, n=8 per prompt (vLLM alone, as a user would call it)
    B  vllm.LLM.generate, 64 requests of n=1 with a seed each and logprobs=0 (our request shape, seeded)
    C  B without seeds
    D  our VLLMEngine.generate in this process (what the adapter adds on top of B or C)
    E  our EngineGroup.generate through a Ray actor (what the training loop calls)
    F  the same actor's engine.generate timed inside the actor (F - E: Ray's transfer and scheduling; F - D: what
       running in a Ray worker process costs the engine itself)
    G  F with the actor given 8 CPU threads (OMP_NUM_THREADS and torch's; Ray gives a fractional-GPU actor 1)
    H  F with Python's garbage collector off during the call (vLLM allocates many small objects per step)

``generate overhead vs vLLM alone %`` = (E - A) / A. F, G and H find where E's extra time goes.

    python bench/generate_overhead.py --model /tmp/peer/model          # prints a table, writes $OUT/genoverhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def timed(fn, repeats: int) -> dict:
    fn()  # warm-up (CUDA graphs, allocator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "times": times, "tokens": _tokens(out)}


def _tokens(out) -> int:
    total = 0
    for item in out or []:
        if hasattr(item, "outputs"):
            total += sum(len(o.token_ids) for o in item.outputs)
        elif isinstance(item, list):
            total += sum(len(o.token_ids) for o in item)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/peer/model")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max_new", type=int, default=128)
    ap.add_argument("--gpu_util", type=float, default=0.35)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    import json as _json
    import random

    from hybrid_engines.protocol import SamplingParams
    from hybrid_engines.vllm_engine import VLLMEngine
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    rng = random.Random(0)
    lines = [_json.loads(line)["prompt"] for line in open(os.path.join(os.path.dirname(args.model), "prompts.jsonl"))]
    prompts = [tok(rng.choice(lines), add_special_tokens=False)["input_ids"] for _ in range(args.prompts)]
    eos = tok.eos_token_id
    results: dict[str, dict] = {}

    engine = VLLMEngine(args.model, gpu_memory_utilization=args.gpu_util, enable_sleep_mode=True, dtype="bfloat16",
                        seed=0, max_model_len=max(map(len, prompts)) + args.max_new, enable_prefix_caching=False)
    import vllm

    llm = engine.llm
    req = [{"prompt_token_ids": p} for p in prompts]
    plain = vllm.SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_new, stop_token_ids=[eos],
                                detokenize=False)
    results["A vllm n=8"] = timed(lambda: llm.generate(req, plain, use_tqdm=False), args.repeats)
    rows = [{"prompt_token_ids": p} for p in prompts for _ in range(args.samples)]
    step = iter(range(10_000))

    def seeded():
        k = next(step)
        params = [vllm.SamplingParams(n=1, temperature=1.0, max_tokens=args.max_new, stop_token_ids=[eos],
                                      seed=k * 1000 + i, logprobs=0, detokenize=False) for i in range(len(rows))]
        return llm.generate(rows, params, use_tqdm=False)

    results["B rows seeded"] = timed(seeded, args.repeats)
    unseeded = vllm.SamplingParams(n=1, temperature=1.0, max_tokens=args.max_new, stop_token_ids=[eos], logprobs=0,
                                   detokenize=False)
    results["C rows unseeded"] = timed(lambda: llm.generate(rows, unseeded, use_tqdm=False), args.repeats)
    flat = vllm.SamplingParams(n=1, temperature=1.0, max_tokens=args.max_new, stop_token_ids=[eos], logprobs=0,
                               detokenize=False, flat_logprobs=True)
    results["C2 rows unseeded flat logprobs"] = timed(lambda: llm.generate(rows, flat, use_tqdm=False), args.repeats)
    ours = lambda seed: SamplingParams(temperature=1.0, max_new_tokens=args.max_new, n=args.samples,  # noqa: E731
                                       stop_token_ids=(eos,), seed=seed)
    results["D adapter seeded"] = timed(lambda: engine.generate(prompts, ours(next(step))), args.repeats)
    results["D adapter unseeded"] = timed(lambda: engine.generate(prompts, ours(None)), args.repeats)
    engine.shutdown()
    del engine, llm
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()

    from hybrid_core.cluster import connect, shutdown
    from hybrid_core.placement import PlacementSpec, place
    from hybrid_engines.ray_engines import launch_engines

    cluster = connect(num_gpus=1)
    placed = place(PlacementSpec.from_ranges({"rollout": "0"}).plan())
    group = launch_engines(placed, "rollout", backend="vllm", timeout_s=600,
                           engine_kwargs=dict(model=args.model, gpu_memory_utilization=args.gpu_util, dtype="bfloat16",
                                              seed=0, enable_sleep_mode=True, enable_prefix_caching=False,
                                              max_model_len=max(map(len, prompts)) + args.max_new))
    results["E ray group seeded"] = timed(lambda: group.generate(prompts, ours(next(step))), args.repeats)
    results["E ray group unseeded"] = timed(lambda: group.generate(prompts, ours(None)), args.repeats)
    group.shutdown()
    placed.remove()

    # F, G, H: one actor like E's, timing inside itself; each variant in a fresh actor on a fresh placement
    import ray

    from hybrid_core.runtime_env import worker_runtime_env
    from hybrid_engines.ray_engines import EngineActor

    class TimedEngineActor(EngineActor):
        def threads(self, n: int) -> int:
            import torch

            torch.set_num_threads(n)
            return torch.get_num_threads()

        def timed_generate(self, prompt_token_ids, params, gc_off: bool = False):
            import gc

            if gc_off:
                gc.disable()
            try:
                start = time.perf_counter()
                out = self.engine.generate(prompt_token_ids, params)
                return time.perf_counter() - start, out
            finally:
                gc.enable()

    engine_kwargs = dict(model=args.model, gpu_memory_utilization=args.gpu_util, dtype="bfloat16", seed=0,
                         enable_sleep_mode=True, enable_prefix_caching=False,
                         max_model_len=max(map(len, prompts)) + args.max_new)
    for name, threads, gc_off in (("F in-actor unseeded", None, False), ("G in-actor 8 threads", 8, False),
                                  ("H in-actor gc off", None, True)):
        placed = place(PlacementSpec.from_ranges({"rollout": "0"}).plan())
        env = worker_runtime_env({"OMP_NUM_THREADS": str(threads)} if threads else None)
        actor = ray.remote(TimedEngineActor).options(**placed.actor_options("rollout", 0), runtime_env=env,
                                                     max_restarts=0).remote("vllm", engine_kwargs)
        ray.get(actor.ready.remote(), timeout=600)
        if threads:
            ray.get(actor.threads.remote(threads), timeout=60)
        inside: list[float] = []

        def call():
            seconds, out = ray.get(actor.timed_generate.remote(prompts, ours(None), gc_off), timeout=600)
            inside.append(seconds)
            return out

        outside = timed(call, args.repeats)
        inside = inside[1:]  # the warm-up call is not counted
        results[name] = {"median_s": statistics.median(inside), "min_s": min(inside), "times": inside,
                         "tokens": outside["tokens"], "round_trip_median_s": outside["median_s"]}
        ray.get(actor.shutdown.remote(), timeout=120)
        ray.kill(actor)
        placed.remove()
    shutdown(cluster)

    base = results["A vllm n=8"]["median_s"]
    print(f"\n{'variant':<34}{'median s':>10}{'min s':>9}{'tokens':>8}{'vs A %':>9}")
    for name, r in results.items():
        print(f"{name:<34}{r['median_s']:>10.3f}{r['min_s']:>9.3f}{r['tokens']:>8}{100 * (r['median_s'] / base - 1):>9.1f}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "genoverhead.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
