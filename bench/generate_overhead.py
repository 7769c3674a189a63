"""Where our generate phase spends its time beyond vLLM's own ``LLM.generate`` (the residency issue, item 4).

Same model folder, same GPU, same batch as ``bench/e2e_gpu.py`` (8 prompts x 8 samples, <= 128 new tokens,
temperature 1, CUDA graphs on). Both engines (this process's and one Ray actor's) are built first and kept alive
(each takes ``--gpu_util`` of the GPU); then the variants run round-robin, one call each per round, for
``--repeats`` rounds after a warm-up round, so that drift of the machine (clocks, other processes' CPU) falls on
every variant alike. Median per variant:

    A   vllm.LLM.generate, n=8 per prompt, unseeded (vLLM alone, as a user would call it)
    B   A with the sampled token's log-prob per token (logprobs=0, flat), which the rollout correction needs
    C   one request per sample (n=1, log-probs) straight into vllm.LLM.generate: what the adapter sent until
        2026-11-24 (C - B: the rows' cost; the adapter now sends unseeded calls as B does)
    D   our VLLMEngine.generate in this process, with log-probs (D - B: what the adapter adds)
    D0  the same without log-probs (D0 - A)
    E   our EngineGroup.generate through a Ray actor, with log-probs: the training loop's generate phase by default
    E0  the same without log-probs: the loop's with the rollout correction off (no one asks for them then)
    F   the actor's own generate (collector paused), timed inside the actor; per call also the Ray hop (the driver's
        wall time minus the actor's) and what leaving the paused collector costs
    G   F with Ray's one torch thread (what the actor had before it took its GPU's share of the cores)

With ``--vllm_mp`` only A-D run, with vLLM's engine core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``,
vLLM's default, which our engines turn off): whether the way users call vLLM overlaps its output processing with the
next step enough to matter, and what our adapter costs there (writes ``genoverhead-mp.json``; records nothing).

``generate overhead vs vLLM alone %`` is recorded twice, each against vLLM asked for the same thing: (E0 - A) / A
(no log-probs) and (E - B) / B (with them); (E - A) / A, the default loop against plain vLLM, is in the notes of the
second row: it holds vLLM's own cost of the log-probs. The load average and the busiest processes are recorded before
and after: a timing taken while something else keeps the CPUs busy is not comparable.

    python bench/generate_overhead.py --model /tmp/peer/model          # prints a table, writes $OUT/genoverhead.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def machine_load() -> dict:
    """The load average and the five busiest processes (a noisy machine makes every timing here meaningless)."""
    top = subprocess.run(["ps", "-eo", "pcpu,pid,comm", "--sort=-pcpu"], capture_output=True, text=True).stdout
    return {"loadavg": os.getloadavg(), "cpus": os.cpu_count(), "busiest": top.splitlines()[1:6]}


def _tokens(out) -> int:
    total = 0
    for item in out or []:
        if hasattr(item, "outputs"):
            total += sum(len(o.token_ids) for o in item.outputs)
        elif isinstance(item, list):
            total += sum(len(o.token_ids) for o in item)
    return total


_START = time.time()


def _stamp(what: str) -> None:
    """Where the time goes (a run stopped at its call's limit still says how far it got)."""
    print(f"[{time.time() - _START:7.1f} s] {what}", flush=True)


def _summary(times: dict, tokens: dict) -> dict:
    return {
        name: {
            "median_s": statistics.median(t),
            "min_s": min(t),
            "times": t,
            "tokens": int(statistics.median(tokens[name])),
        }
        for name, t in times.items()
        if t
    }


def round_robin(variants: dict, repeats: int, checkpoint=None) -> dict:
    """Each variant once per round (one warm-up round first). A variant returns its outputs, or (seconds, outputs)
    when it times itself (inside an actor). After each round ``checkpoint`` gets the summary so far, so a run cut
    short keeps the rounds it finished."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[int]] = {name: [] for name in variants}
    for rnd in range(repeats + 1):
        for name, fn in variants.items():
            start = time.perf_counter()
            out = fn()
            wall = time.perf_counter() - start
            seconds, out = out if isinstance(out, tuple) else (wall, out)
            if rnd:  # round 0 warms up (CUDA graphs, allocator, Triton kernels)
                times[name].append(seconds)
                tokens[name].append(_tokens(out))
        _stamp(f"round {rnd} done" + (" (warm-up)" if not rnd else ""))
        if rnd and checkpoint:
            checkpoint(_summary(times, tokens))
    return _summary(times, tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/peer/model")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max_new", type=int, default=128)
    ap.add_argument("--gpu_util", type=float, default=0.18, help="each of the 2 engines' share of the GPU")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--record", action="store_true", help="append the row to bench/RESULTS.md")
    ap.add_argument(
        "--vllm_mp",
        action="store_true",
        help="A-D only, vLLM's engine core in its own process (vLLM's default; ours runs it in-process)",
    )
    args = ap.parse_args()
    if args.vllm_mp and args.record:
        ap.error("--vllm_mp times vLLM's multi-process mode beside our adapter; it records no row (drop --record)")
    _stamp("start")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
        "1" if args.vllm_mp else os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    )

    import json as _json
    import random

    import ray
    from transformers import AutoTokenizer

    from hybrid_core.cluster import connect, shutdown
    from hybrid_core.placement import PlacementSpec, place
    from hybrid_core.runtime_env import worker_runtime_env
    from hybrid_engines.protocol import SamplingParams
    from hybrid_engines.ray_engines import EngineActor, EngineGroup
    from hybrid_engines.vllm_engine import VLLMEngine

    _stamp("imports done")
    load_before = machine_load()
    tok = AutoTokenizer.from_pretrained(args.model)
    rng = random.Random(0)
    lines = [_json.loads(line)["prompt"] for line in open(os.path.join(os.path.dirname(args.model), "prompts.jsonl"))]
    prompts = [tok(rng.choice(lines), add_special_tokens=False)["input_ids"] for _ in range(args.prompts)]
    eos = tok.eos_token_id
    engine_kwargs = dict(
        model=args.model,
        gpu_memory_utilization=args.gpu_util,
        dtype="bfloat16",
        seed=0,
        enable_sleep_mode=True,
        enable_prefix_caching=False,
        max_model_len=max(map(len, prompts)) + args.max_new,
    )

    engine = VLLMEngine(**engine_kwargs)  # A and D: vLLM in this process
    _stamp("in-process engine built")
    import vllm

    llm = engine.llm
    req = [{"prompt_token_ids": p} for p in prompts]
    plain = vllm.SamplingParams(
        n=args.samples, temperature=1.0, max_tokens=args.max_new, stop_token_ids=[eos], detokenize=False
    )
    with_logprobs = vllm.SamplingParams(
        n=args.samples,
        temperature=1.0,
        max_tokens=args.max_new,
        stop_token_ids=[eos],
        detokenize=False,
        logprobs=0,
        flat_logprobs=True,
    )
    ours = SamplingParams(temperature=1.0, max_new_tokens=args.max_new, n=args.samples, stop_token_ids=(eos,))
    from hybrid_engines.sampling_map import expand_rows, vllm_sampling_kwargs

    rows = expand_rows(prompts, ours)  # what VLLMEngine.generate sends (unseeded: one SamplingParams for every row)
    row_requests = [{"prompt_token_ids": prompts[r.prompt]} for r in rows]
    row_params = vllm.SamplingParams(**vllm_sampling_kwargs(ours, seed=None, stop_at_eos=True))

    no_lp = dataclasses.replace(ours, logprobs=False)

    class TimedEngineActor(EngineActor):
        def timed_generate(self, prompt_token_ids, params, threads: int | None = None):
            """(seconds of the engine's generate, seconds until the collector is back on, outputs)."""
            import torch

            before = torch.get_num_threads()
            if threads:
                torch.set_num_threads(threads)
            try:
                start = time.perf_counter()
                with self._gc_pause:
                    out = self.engine.generate(prompt_token_ids, params)
                    generated = time.perf_counter()
                return generated - start, time.perf_counter() - start, out
            finally:
                torch.set_num_threads(before)

    variants = {
        "A vllm n=8": lambda: llm.generate(req, plain, use_tqdm=False),
        "B vllm n=8 logprobs": lambda: llm.generate(req, with_logprobs, use_tqdm=False),
        "C vllm rows logprobs": lambda: llm.generate(row_requests, row_params, use_tqdm=False),
        "D adapter in-process": lambda: engine.generate(prompts, ours),
        "D0 adapter no logprobs": lambda: engine.generate(prompts, no_lp),
    }
    out = os.environ.get("OUT")
    name = "genoverhead-mp.json" if args.vllm_mp else "genoverhead.json"

    def checkpoint(partial: dict) -> None:
        if out:
            with open(os.path.join(out, name), "w") as f:
                json.dump({**partial, "partial": True}, f, indent=1)

    if args.vllm_mp:
        results = round_robin(variants, args.repeats, checkpoint)
        results["machine_load"] = {"before": load_before, "after": machine_load()}
        engine.shutdown()
        _print_table(results, load_before)
        if out:
            with open(os.path.join(out, name), "w") as f:
                json.dump(results, f, indent=1)
        return 0

    # One engine actor, as the loop starts it (Ray's share of the GPU, one CPU thread); G and H change one thing each
    # for the length of their call, so no second engine has to be built (each takes ~40 s).
    cluster = connect(num_gpus=1)
    placed = place(PlacementSpec.from_ranges({"rollout": "0"}).plan())
    actor = (
        ray.remote(TimedEngineActor)
        .options(**placed.actor_options("rollout", 0), runtime_env=worker_runtime_env(), max_restarts=0)
        .remote("vllm", engine_kwargs)
    )
    ray.get(actor.ready.remote(), timeout=600)
    group = EngineGroup("rollout", "vllm", [actor], [1], timeout_s=600)
    _stamp("engine actor built")

    hops: dict[str, list[float]] = {}
    gc_exits: dict[str, list[float]] = {}

    def inside(name, threads=None):
        def call():
            start = time.perf_counter()
            generated, with_exit, out = ray.get(actor.timed_generate.remote(prompts, ours, threads), timeout=600)
            hops.setdefault(name, []).append(time.perf_counter() - start - with_exit)
            gc_exits.setdefault(name, []).append(with_exit - generated)
            return generated, out

        return call

    variants.update(
        {
            "E ray group": lambda: group.generate(prompts, ours),
            "E0 ray group no logprobs": lambda: group.generate(prompts, no_lp),
            "F in-actor": inside("F in-actor"),
            "G in-actor 1 thread": inside("G in-actor 1 thread", threads=1),
        }
    )
    threads = ray.get(actor.where.remote(), timeout=60)["torch_threads"]
    results = round_robin(variants, args.repeats, checkpoint)
    results["machine_load"] = {"before": load_before, "after": machine_load()}
    for variant in hops:  # the warm-up round's call is dropped, as for the timings
        results[variant]["ray_hop_median_s"] = statistics.median(hops[variant][1:])
        results[variant]["gc_exit_median_s"] = statistics.median(gc_exits[variant][1:])
    results["engine_actor_torch_threads"] = threads
    ray.get(actor.shutdown.remote(), timeout=120)
    ray.kill(actor)
    placed.remove()
    shutdown(cluster)
    engine.shutdown()

    _print_table(results, load_before)
    if out:
        with open(os.path.join(out, name), "w") as f:
            json.dump(results, f, indent=1)
    if args.record:
        from _common import Row, append_results

        med = {name: r["median_s"] for name, r in results.items() if isinstance(r, dict) and "median_s" in r}
        pct = lambda a, b: 100 * (med[a] / med[b] - 1)  # noqa: E731
        hop = results["F in-actor"]["ray_hop_median_s"]
        rows = [
            Row(
                "generate overhead vs vLLM alone %",
                pct("E0 ray group no logprobs", "A vllm n=8"),
                f"% (no log-probs on either side: our EngineGroup.generate through its Ray actor "
                f"{med['E0 ray group no logprobs']:.3f} s vs vllm.LLM.generate n={args.samples} alone "
                f"{med['A vllm n=8']:.3f} s, median of {args.repeats} round-robin calls; in-process adapter "
                f"{med['D0 adapter no logprobs']:.3f} s; the loop's generate with the rollout correction off; "
                f"goal <= 5)",
            ),
            Row(
                "generate overhead vs vLLM alone %",
                pct("E ray group", "B vllm n=8 logprobs"),
                f"% (with the sampled tokens' log-probs on both sides: ours {med['E ray group']:.3f} s vs vLLM alone "
                f"{med['B vllm n=8 logprobs']:.3f} s; the loop's default generate (the rollout correction needs "
                f"them) against plain vLLM: {pct('E ray group', 'A vllm n=8'):+.1f} %, of which vLLM's own log-prob "
                f"cost {pct('B vllm n=8 logprobs', 'A vllm n=8'):+.1f} %; in-actor {med['F in-actor']:.3f} s, Ray hop "
                f"{hop * 1000:.0f} ms, engine actor on {threads} torch threads "
                f"(1: {med['G in-actor 1 thread']:.3f} s); goal <= 5)",
            ),
        ]
        print(f"appended {append_results(rows, _device())} rows to bench/RESULTS.md")
    return 0


def _print_table(results: dict, load_before: dict) -> None:
    base = results["A vllm n=8"]["median_s"]
    print(
        f"\nload average before {load_before['loadavg']}, after {results['machine_load']['after']['loadavg']} "
        f"({load_before['cpus']} CPUs); vLLM engine core "
        f"{'in its own process' if os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING') == '1' else 'in-process'}"
    )
    print(f"{'variant':<26}{'median s':>10}{'min s':>9}{'tokens':>8}{'vs A %':>9}")
    for name, r in results.items():
        if isinstance(r, dict) and "median_s" in r:
            extra = (
                f"   hop {1000 * r['ray_hop_median_s']:.1f} ms, collector back on {1000 * r['gc_exit_median_s']:.1f} ms"
                if "ray_hop_median_s" in r
                else ""
            )
            print(
                f"{name:<26}{r['median_s']:>10.3f}{r['min_s']:>9.3f}{r['tokens']:>8}"
                f"{100 * (r['median_s'] / base - 1):>9.1f}{extra}"
            )


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    raise SystemExit(main())
