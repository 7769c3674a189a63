"""Multi-turn agent rollouts on vLLM: ``agent rollout tokens/s`` with and without prefix caching (issue 22).

The 357M workload model of ``bench/peer_workload.py`` (random weights, word-level vocabulary, 32-token prompts)
talks to a tool for 3 turns: each turn generates up to ``--turn-tokens`` tokens, the tool replies with
``--reply-tokens`` tokens (a "tool output" of random words), and the third turn ends the episode. 8 prompts x 8
samples, through the same code the training loop runs (``hybrid_algos.train.agents.AgentRollout``: every sample a
coroutine, environment steps concurrent, one engine call per turn through a Ray ``EngineGroup``). Every turn sends
the whole conversation again, so with ``--enable_prefix_caching`` vLLM reuses the KV of the turns before.

``agent rollout tokens/s`` = tokens the model generated / wall seconds of the whole rollout (engine calls and tool
steps); the median of ``--repeats`` rollouts after one warm-up. The engine's share and each turn's seconds are
printed too.

    python bench/peer_workload.py /tmp/peer                   # once: the model folder and prompts
    python bench/agent_gpu.py --model /tmp/peer/model         # GPU (vLLM): table, $OUT/agent_gpu.json
    python bench/agent_gpu.py --model /tmp/peer/model --record      # ... and append the rows to bench/RESULTS.md
    python bench/agent_gpu.py --small                         # CPU: tiny model, the built-in engine (logic only)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import ROOT, Row, append_results, print_table  # noqa: E402

for _pkg in ("hybrid-core", "hybrid-engines", "hybrid-algos"):  # run from a plain checkout too
    sys.path.insert(0, str(ROOT / "packages" / _pkg / "src"))


class ToolEnvironment:
    """A tool that answers every turn with ``reply_tokens`` random words (after a short await, as a real tool call
    would), for ``turns`` turns; reward: the fraction of the model's words equal to the prompt's first word."""

    turns, reply_tokens, latency_s, vocab = 3, 128, 0.0, 1021

    def __init__(self) -> None:
        self.turn, self.hits, self.words, self.first = 0, 0, 0, ""

    async def reset(self, prompt: str, label) -> None:
        self.first = prompt.split()[0]
        self.rng = random.Random(prompt)
        return None

    async def step(self, action: str):
        from hybrid_algos.train.agents import StepResult

        self.turn += 1
        words = action.split()
        self.hits += sum(w == self.first for w in words)
        self.words += len(words)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if self.turn >= self.turns:
            return StepResult(reward=self.hits / max(self.words, 1), done=True)
        reply = " ".join(f"t{self.rng.randrange(self.vocab)}" for _ in range(self.reply_tokens))
        return StepResult(feedback=" " + reply, reward=0.0, done=False)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/peer/model", help="bench/peer_workload.py's folder (357m)")
    ap.add_argument("--backend", default=None, choices=("vllm", "hf"), help="default: vllm (hf with --small)")
    ap.add_argument("--small", action="store_true", help="a tiny variant of the workload on CPU (checks the logic)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8, help="conversations per prompt")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=128, help="new tokens per turn (random weights: all of them)")
    ap.add_argument("--reply-tokens", type=int, default=256, help="tokens of each tool reply")
    ap.add_argument("--tool-latency", type=float, default=0.0, help="seconds each tool step awaits")
    ap.add_argument("--repeats", type=int, default=3, help="timed rollouts per setting (after one warm-up)")
    ap.add_argument("--gpu-util", type=float, default=0.5)
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md")
    args = ap.parse_args()
    args.backend = args.backend or ("hf" if args.small else "vllm")
    if args.small:
        args.prompts, args.samples, args.turn_tokens, args.reply_tokens, args.repeats = 4, 2, 8, 8, 2
    return args


def workload(args) -> tuple[str, list]:
    """The model folder and the prompts (``Prompt`` objects of the first ``--prompts`` lines)."""
    from transformers import AutoTokenizer

    from hybrid_algos.train.tasks import Prompt
    from peer_workload import build

    if args.small:
        root = tempfile.mkdtemp(prefix="agent-bench-")
        model, data = build(root, size="357m", layers=2, hidden=56, prompts=16)
    else:
        model, data = args.model, os.path.join(os.path.dirname(args.model), "prompts.jsonl")
        if not os.path.exists(os.path.join(model, "config.json")):
            model, data = build(os.path.dirname(args.model), size="357m")
    tok = AutoTokenizer.from_pretrained(model)
    lines = [json.loads(line)["prompt"] for line in open(data)][: args.prompts]
    return model, [Prompt(list(tok(text, add_special_tokens=False)["input_ids"]), text) for text in lines]


def run_setting(args, model: str, prompts: list, prefix_caching: bool) -> dict:
    from transformers import AutoTokenizer

    from hybrid_algos.train.agents import AgentRollout, summarize
    from hybrid_algos.train.agents.loader import AgentSpec
    from hybrid_algos.train.config import GRPOConfig
    from hybrid_core.cluster import connect, shutdown
    from hybrid_core.placement import PlacementSpec, place
    from hybrid_engines.protocol import SamplingParams
    from hybrid_engines.ray_engines import launch_engines

    tok = AutoTokenizer.from_pretrained(model)
    budget = args.turns * args.turn_tokens + (args.turns - 1) * args.reply_tokens
    longest = max(len(p.prompt_ids) for p in prompts)
    kwargs = dict(model=model, seed=0)
    if args.backend == "vllm":
        kwargs.update(
            gpu_memory_utilization=args.gpu_util,
            dtype="bfloat16",
            enable_sleep_mode=False,
            enable_prefix_caching=prefix_caching,
            max_model_len=longest + budget,
        )
    cluster = connect(num_gpus=1)
    placed = place(PlacementSpec.from_ranges({"rollout": "0"}).plan())
    engines = launch_engines(placed, "rollout", backend=args.backend, engine_kwargs=kwargs, timeout_s=900)
    ToolEnvironment.turns, ToolEnvironment.reply_tokens = args.turns, args.reply_tokens
    ToolEnvironment.latency_s = args.tool_latency
    config = GRPOConfig(max_turns=args.turns, max_new_tokens_per_turn=args.turn_tokens, agent_timeout_s=120)
    agent = AgentRollout(
        AgentSpec("environment", "bench/agent_gpu.py:ToolEnvironment", factory=ToolEnvironment), config, tok
    )
    eos = tok.eos_token_id
    results = []
    try:
        for i in range(args.repeats + 1):
            sampling = SamplingParams(
                temperature=1.0,
                max_new_tokens=budget,
                n=args.samples,
                stop_token_ids=(eos,) if eos is not None else (),
                seed=1000 + i,
            )
            batch = agent.run(engines, prompts, sampling, step=i)
            m = summarize([batch])
            m["agent/conversation_tokens"] = m["agent/model_tokens"] + m["agent/env_tokens"]
            if i:  # the first is a warm-up (CUDA graphs, allocator)
                results.append(m)
    finally:
        agent.close()
        engines.shutdown()
        placed.remove()
        shutdown(cluster)
    keys = sorted(results[0])
    med = {k: statistics.median(r[k] for r in results if k in r) for k in keys}
    conversations = args.prompts * args.samples
    med["tokens_per_s"] = med["agent/model_tokens"] * conversations / med["agent/rollout_s"]
    med["all_tokens_per_s"] = med["agent/conversation_tokens"] * conversations / med["agent/rollout_s"]
    med["runs"] = [r["agent/rollout_s"] for r in results]
    return med


def main() -> int:
    args = parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    model, prompts = workload(args)
    label = "357M" if not args.small else "tiny"
    settings = {"off": False, "on": True}
    out: dict = {"args": vars(args), "settings": {}}
    for name, flag in settings.items():
        out["settings"][name] = run_setting(args, model, prompts, flag)
    rows = []
    for name in settings:
        m = out["settings"][name]
        what = f"{args.turns}-turn task, {label}, {args.backend}, prefix caching {name}"
        rows.append(
            Row(
                f"agent rollout tokens/s ({what})",
                m["tokens_per_s"],
                "model tokens/s (whole rollout)",
                record=not args.small,
            )
        )
        rows.append(Row(f"agent rollout s ({what})", m["agent/rollout_s"], "s", record=False))
        rows.append(
            Row(f"agent engine share ({what})", m["agent/generate_s"] / m["agent/rollout_s"], "fraction", record=False)
        )
        for t in range(1, args.turns + 1):
            if f"agent/turn{t}/generate_s" in m:
                rows.append(Row(f"  turn {t} generate s ({name})", m[f"agent/turn{t}/generate_s"], "s", record=False))
                rows.append(Row(f"  turn {t} tool s ({name})", m[f"agent/turn{t}/env_s"], "s", record=False))
    speedup = out["settings"]["on"]["tokens_per_s"] / out["settings"]["off"]["tokens_per_s"]
    rows.append(
        Row(
            f"agent rollout speedup from prefix caching ({args.turns}-turn task, {label}, {args.backend})",
            speedup,
            "x",
            record=args.backend == "vllm" and not args.small,
        )
    )
    if args.backend == "hf":
        print("note: the built-in engine keeps no prefix cache; 'on' and 'off' run the same code (logic check only)")
    print_table(
        f"agent rollouts: {args.prompts} prompts x {args.samples} samples, {args.turns} turns of <= "
        f"{args.turn_tokens} tokens, tool replies of {args.reply_tokens} tokens",
        rows,
    )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "agent_gpu.json").write_text(json.dumps(out, indent=1, default=str))
    if args.record:
        import torch

        from _common import device_label

        device = device_label(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        print(f"appended {append_results(rows, device)} rows to bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
