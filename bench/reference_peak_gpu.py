"""The reference phase at a long context: the residency plan's predicted peak against what the pass really takes
(issue 24: the dry-run budget once refused OpenRLHF's shipped recipes for fully padded fp32 reference logits).

The reference model's forward pass exactly as ``ReferenceWorker.logprobs`` runs it (the trainer's chunked log-prob
head, ``install_token_scores``, bf16, the loop's attention choice) on one micro-batch of ``--micro`` sequences of
``--prompt_len`` + ``--response_len`` tokens, against the reference role's share of the plan's ``reference`` phase
(``build_residency``, as ``hybrid ... --dry-run`` and a run compute it: weights, one layer's activations, one logits
chunk, the allocator cache floor and the CUDA context).

Measured: the GPU's used memory before the model is built (the CUDA context of this process; nothing else should
run on the GPU) plus the allocator's peak reservation over building the model and running the pass.

Shapes (random weights, built on the GPU; nothing is downloaded): ``1b`` = Llama-3.2-1B's (hidden 2048, 16 layers,
intermediate 8192, 32/8 heads, vocabulary 128256, tied), ``8b`` = Llama-3-8B's (hidden 4096, 32 layers, 14336,
32/8 heads, 128256). The default batch is issue 24's: 32 sequences x (1024 + 1024) tokens.

    python bench/reference_peak_gpu.py --shape 1b --record       # rows: reference phase peak GiB predicted / measured
    python bench/reference_peak_gpu.py --shape 8b --micro 16 --record
    python bench/reference_peak_gpu.py --small                    # CPU: a tiny model, the code path only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, append_results, device_label, print_table

for _pkg in ("hybrid-core", "hybrid-engines", "hybrid-algos"):  # a plain checkout (no editable install)
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "packages", _pkg, "src")
    )

#: name -> (hidden, layers, intermediate, heads, kv heads, vocabulary, tied embeddings)
SHAPES = {
    "1b": (2048, 16, 8192, 32, 8, 128256, True),
    "8b": (4096, 32, 14336, 32, 8, 128256, False),
    "tiny": (64, 2, 128, 4, 2, 512, True),
}
GiB = 2**30


def model_config(shape: str, max_len: int):
    from transformers import LlamaConfig

    hidden, layers, inter, heads, kv, vocab, tied = SHAPES[shape]
    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=max(max_len, 128),
    )


def predicted_bytes(folder: str, args, gpu_bytes: float) -> tuple[float, dict[str, float]]:
    """The reference role's bytes on its GPU in the ``reference`` phase, from the run's own planner."""
    from hybrid_algos.train import CONFIGS
    from hybrid_algos.train.placement import build_plan, build_residency

    config = CONFIGS["ppo"](
        pretrain=folder,
        reward_fn="bench_reward:none",
        init_kl_coef=0.001,
        bf16=True,
        flash_attn=args.flash_attn,
        micro_rollout_batch_size=args.micro,
        micro_train_batch_size=args.micro,
        train_batch_size=args.micro,
        rollout_batch_size=args.micro,
        n_samples_per_prompt=1,
        prompt_max_len=args.prompt_len,
        generate_max_len=args.response_len,
        backend="hf",
        residency="all-sleep",
    )
    plan, _ = build_residency(
        config,
        build_plan(config),
        folder,
        prompt_len=args.prompt_len,
        generate_len=args.response_len,
        gpu_bytes=gpu_bytes,
    )
    items = {item: v for (role, item), v in plan.breakdown(0, "reference").items() if role == "reference"}
    return sum(items.values()), items


def measure(model_cfg, args, device) -> tuple[float, float]:
    """(bytes used before building the model, allocator peak reservation over building it and one pass)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybrid_algos.train.models import install_token_scores, response_logprobs
    from hybrid_algos.train.workers.policy import attn_implementation

    class Flags:
        flash_attn = args.flash_attn

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.init()
        torch.zeros(1, device=device)  # the CUDA context exists before the baseline is read
        free, total = torch.cuda.mem_get_info(device)
        before = total - free
        torch.cuda.reset_peak_memory_stats(device)
    else:
        before = 0
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            model_cfg, dtype=torch.bfloat16, attn_implementation=attn_implementation(Flags)
        )
    model = install_token_scores(model.eval().requires_grad_(False))
    gen = torch.Generator().manual_seed(0)
    length = args.prompt_len + args.response_len
    sequences = torch.randint(0, model_cfg.vocab_size, (args.micro, length), generator=gen).to(device)
    mask = torch.ones_like(sequences)
    mask[: args.micro // 2, : args.prompt_len // 4] = 0  # left padding on half the rows, as rollouts have
    with torch.no_grad():
        lp = response_logprobs(model, sequences, mask, args.response_len, temperature=1.0)
    assert lp.shape == (args.micro, args.response_len) and torch.isfinite(lp).all()
    peak = torch.cuda.max_memory_reserved(device) if cuda else 0
    return float(before), float(peak)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--prompt_len", type=int, default=1024)
    ap.add_argument("--response_len", type=int, default=1024)
    ap.add_argument("--flash_attn", action="store_true", help="the trainers' --flash_attn (else SDPA)")
    ap.add_argument("--small", action="store_true", help="CPU, tiny model: the code path only, no figures")
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md")
    args = ap.parse_args()
    import torch

    if args.small:
        args.shape, args.micro, args.prompt_len, args.response_len = "tiny", 4, 16, 16
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.small else torch.device("cpu")
    model_cfg = model_config(args.shape, args.prompt_len + args.response_len)
    folder = tempfile.mkdtemp(prefix="refpeak-")
    model_cfg.save_pretrained(folder)  # config.json only: the planner sizes from it, the pass builds on the GPU
    with open(os.path.join(folder, "bench_reward.py"), "w") as f:
        f.write("def none(*args, **kwargs):\n    return [0.0]\n")
    sys.path.insert(0, folder)
    gpu_bytes = float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else 80 * GiB
    predicted, items = predicted_bytes(folder, args, gpu_bytes)
    before, peak = measure(model_cfg, args, device)
    measured = before + peak
    rows = [
        Row(
            "reference phase peak GiB predicted",
            predicted / GiB,
            f"GiB ({args.shape}, {args.micro} x ({args.prompt_len} + {args.response_len}) tokens, vocabulary "
            f"{model_cfg.vocab_size}; " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in items.items()) + ")",
            record=device.type == "cuda",
        )
    ]
    if device.type == "cuda":
        error = 100 * (predicted - measured) / measured
        rows += [
            Row(
                "reference phase peak GiB measured",
                measured / GiB,
                f"GiB (context {before / GiB:.2f} + allocator peak {peak / GiB:.2f}; same shape; predicted "
                f"{error:+.1f} %)",
            ),
            Row("reference phase peak error %", abs(error), "% |predicted - measured| / measured", record=False),
        ]
    print_table(f"reference phase at {args.prompt_len + args.response_len} tokens on {device_label(device)}", rows)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"reference_peak_{args.shape}.json"), "w") as f:
            json.dump({"predicted": predicted, "items": items, "before": before, "peak": peak}, f, indent=1)
    if args.record and device.type == "cuda":
        append_results(rows, device_label(device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
