"""The actor's train phase with and without packing (--packing_samples) on a ragged-length rollout.

One data-parallel rank of the real actor (``PolicyWorker``: DeepSpeed, the registry's PPO loss, the chunked LM
head) trains on the same rollout twice: with padded micro-batches and with packed ones (each micro-batch's
samples concatenated into one row, position ids restarting per sample, attention within each sample only through
``hybrid_algos.train.packed_attention``: one varlen flash call on CUDA, or a causal SDPA per sample). Prompt and
response lengths are drawn ragged (a long-tailed response length, as reasoning rollouts have),
so a padded micro-batch is mostly padding. Goal: ``train s packed`` <= 0.7 x ``train s padded``.

    python bench/packing_gpu.py                    # GPU: the ~1B Llama of bench/_common.py, bf16, ZeRO-2
    python bench/packing_gpu.py --record           # ... and append the rows to bench/RESULTS.md
    python bench/packing_gpu.py --dynamic          # also packed + token-budget micro-batches (--use_dynamic_batch)
    python bench/packing_gpu.py --small            # tiny model on CPU: checks the logic, numbers mean nothing
    python bench/packing_gpu.py --packed-attention auto segments sdpa-mask   # time each packed attention path

``--packed-attention`` sets ``HYBRID_PACKED_ATTENTION`` for each packed run (``auto``: varlen where it can run;
``varlen`` / ``segments`` forced; ``sdpa-mask``: transformers' dense N x N block-diagonal mask, the old path); the
first one is ``train s packed`` and the ratio, the others get their own rows. The table names the path that ran.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

import torch

from _common import ROOT, Row, append_results, build_llama, device_label, free_port, print_table

for _pkg in ("hybrid-core", "hybrid-engines", "hybrid-algos"):  # run from a plain checkout too
    sys.path.insert(0, str(ROOT / "packages" / _pkg / "src"))

from hybrid_algos.train import packed_attention  # noqa: E402  (after the path set-up above)

MODES = packed_attention.MODES


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model and lengths (runs on CPU)")
    ap.add_argument("--samples", type=int, default=64, help="samples in the rollout (one optimizer update)")
    ap.add_argument("--micro", type=int, default=8, help="micro_train_batch_size (samples)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    ap.add_argument(
        "--response-len",
        type=int,
        nargs=2,
        default=(32, 1536),
        metavar=("MIN", "MAX"),
        help="log-uniform between MIN and MAX (prompt + response <= the model's 2048 positions)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed train calls per mode (after one warm-up)")
    ap.add_argument("--dynamic", action="store_true", help="also: packed + --use_dynamic_batch")
    ap.add_argument("--max-tokens", type=int, default=16384, help="train_max_tokens_per_gpu of --dynamic")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument(
        "--packed-attention",
        nargs="+",
        default=["auto"],
        choices=MODES,
        metavar="MODE",
        help=f"packed attention path(s) to time, of {', '.join(MODES)} (the first is the headline)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md")
    args = ap.parse_args()
    if args.small:
        args.samples, args.micro, args.repeats = 16, 4, 2
        args.prompt_len, args.response_len, args.max_tokens = (4, 16), (2, 48), 128
    return args


def ragged_rollout(args, vocab: int):
    """Prompt-major groups of 8 samples; lengths ragged; advantages random (the phase's cost does not depend on
    them)."""
    from hybrid_algos.train.experience import Rollout

    g = torch.Generator().manual_seed(args.seed)
    lo, hi = args.response_len
    prompts, completions = [], []
    for _ in range(args.samples // 8):
        plen = int(torch.randint(args.prompt_len[0], args.prompt_len[1] + 1, (1,), generator=g))
        prompts.append(torch.randint(3, vocab, (plen,), generator=g).tolist())
        group = []
        for _ in range(8):
            rlen = int(
                torch.exp(
                    torch.empty(1).uniform_(
                        float(torch.log(torch.tensor(float(lo)))),
                        float(torch.log(torch.tensor(float(hi)))),
                        generator=g,
                    )
                )
            )
            group.append(torch.randint(3, vocab, (rlen,), generator=g).tolist())
        completions.append(group)
    ro = Rollout.from_generations(prompts, completions, pad_id=0)
    adv = torch.randn(ro.action_mask.shape, generator=g) * ro.action_mask
    return ro.with_(advantages=adv, returns=adv.clone())


def make_worker(args, model_dir: str, device, **changes):
    from hybrid_algos.train.config import GRPOConfig
    from hybrid_algos.train.workers.policy import PolicyWorker

    cfg = GRPOConfig(
        rollout_batch_size=args.samples // 8,
        n_samples_per_prompt=8,
        train_batch_size=args.samples,
        micro_train_batch_size=args.micro,
        micro_rollout_batch_size=args.micro,
        max_epochs=1,
        zero_stage=2,
        bf16=device.type == "cuda",
        deepspeed_enable_sleep=False,
        init_kl_coef=0.0,
        use_kl_loss=False,
        enable_vllm_is_correction=False,
        actor_learning_rate=1e-6,
        gradient_checkpointing=args.gradient_checkpointing,
        prompt_max_len=4096,
        generate_max_len=8192,
        **changes,
    )
    worker = PolicyWorker("actor", 0, 1, cfg, tempfile.mkdtemp(prefix="packing-bench-"))
    worker.where = lambda: {}  # no Ray here
    worker.setup(model_dir, "127.0.0.1", free_port(), total_steps=10)
    return worker


def ran_paths(calls_before: dict) -> str:
    """Which attention the packed run's layers took (calls counted by hybrid_algos.train.packed_attention)."""
    new = {k: v - calls_before.get(k, 0) for k, v in packed_attention.CALLS.items() if v > calls_before.get(k, 0)}
    packed = {k: v for k, v in new.items() if k != "sdpa"}
    return "+".join(sorted(packed)) if packed else "transformers' own (dense N x N mask under sdpa)"


def time_mode(
    args, model_dir, rollout, device, label: str, attention: str | None = None, **changes
) -> tuple[float, float, str]:
    if attention is not None:
        os.environ[packed_attention.ENV] = attention
    calls = dict(packed_attention.CALLS)
    worker = make_worker(args, model_dir, device, **changes)
    times, stats = [], {}
    for i in range(args.repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        stats = worker.train(rollout, step=i, kl_coef=0.0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first call is a warm-up (kernels, allocator)
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    path = ran_paths(calls) if changes.get("packing_samples") else "padded"
    print(
        f"{label}: {[round(x, 3) for x in times]} s, {stats.get('actor/micro_batches', 0):.0f} micro-batches, "
        f"peak {peak:.1f} GiB, attention: {path}",
        flush=True,
    )
    del worker
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return statistics.median(times), peak, path


def main() -> int:
    args = parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.small else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

    if device.type == "cpu":
        ensure_cpu_ops_built()
    with tempfile.TemporaryDirectory(prefix="packing-model-") as model_dir:
        model = build_llama(args.small, "cpu", torch.bfloat16 if device.type == "cuda" else torch.float32)
        model.save_pretrained(model_dir)
        vocab = model.config.vocab_size
        del model
        rollout = ragged_rollout(args, vocab)
        real = int(rollout.attention_mask.sum())
        padded = sum(mb.sequences.numel() for mb in rollout.micro_batches(args.micro))
        print(
            f"rollout: {rollout.batch_size} samples, {real} real tokens, {padded} tokens in padded micro-batches "
            f"({real / padded:.0%} real)",
            flush=True,
        )
        t_pad, m_pad, _ = time_mode(args, model_dir, rollout, device, "padded")
        first, *others = args.packed_attention
        t_pack, m_pack, path = time_mode(
            args, model_dir, rollout, device, f"packed ({first})", first, packing_samples=True
        )
        rows = [
            Row(
                "train s padded",
                t_pad,
                f"s (median of {args.repeats}; {args.samples} samples, micro-batches "
                f"of {args.micro}, {padded} tokens incl. padding)",
            ),
            Row(
                "train s packed",
                t_pack,
                f"s (median of {args.repeats}; same rollout, {real} real tokens; attention: {path})",
            ),
            Row("packed / padded x", t_pack / t_pad, f"x (goal <= 0.7; attention: {path})"),
            Row("real-token share %", 100 * real / padded, "% of the padded micro-batches' tokens", record=False),
        ]
        if device.type == "cuda":
            rows += [
                Row("train peak GiB padded", m_pad, "GiB (torch max allocated)", record=False),
                Row("train peak GiB packed", m_pack, "GiB (torch max allocated)", record=False),
            ]
        if args.dynamic:
            t_dyn, _, p = time_mode(
                args,
                model_dir,
                rollout,
                device,
                "packed + dynamic batch",
                first,
                packing_samples=True,
                use_dynamic_batch=True,
                train_max_tokens_per_gpu=args.max_tokens,
            )
            rows.append(
                Row(
                    "train s packed dynamic",
                    t_dyn,
                    f"s (median of {args.repeats}; train_max_tokens_per_gpu {args.max_tokens}; attention: {p})",
                )
            )
        # The other attention paths last, each allowed to fail: a dense N x N mask can run out of memory after the
        # runs before it (DeepSpeed engines do not hand all of their memory back), and the rows above must survive.
        for mode in others:
            try:
                t, _, p = time_mode(args, model_dir, rollout, device, f"packed ({mode})", mode, packing_samples=True)
            except torch.OutOfMemoryError as e:
                print(f"packed ({mode}): out of memory ({str(e).splitlines()[0]})", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                continue
            rows.append(
                Row(
                    f"train s packed {mode}",
                    t,
                    f"s (median of {args.repeats}; attention: {p}; {t / t_pad:.3f} x padded)",
                )
            )
    label = device_label(device)
    print_table(f"train phase, padded vs packed ({label})", rows)
    if args.record and not args.small:
        print(f"appended {append_results(rows, label)} rows to bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
