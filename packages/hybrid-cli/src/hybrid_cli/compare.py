"""``hybrid compare``: the same prompt token ids through two engines, greedy; where do they part ways?

The seed project checked SGLang against vLLM by hand when their training runs disagreed. This makes it one command::

    hybrid compare --backend_a vllm --backend_b hf --pretrain /models/llama-3-8b --prompt_data p.jsonl --input_key q

Engines run one after the other (A, shut down, then B) so two large engines never hold a GPU together. Reported:

* token agreement: generated positions that match before each sequence's first divergence, over all generated
  positions (the longer of the two completions per prompt); and the share of completions identical end to end;
* |logprob A - logprob B| for each position before the first divergence (after it the prefixes differ, so the
  numbers are not comparable): max and mean overall and per position index.

``--min_token_agreement X`` turns it into a gate: exit status 1 when agreement is below X.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hybrid_core.errors import ConfigError

from .flags import parse_mapping


@dataclass
class Agreement:
    """Greedy agreement of two engines over the same prompts."""

    prompts: int
    token_agreement: float  # matching positions before the first divergence / all generated positions
    identical_sequences: float  # share of prompts whose completions are equal
    max_abs_logprob_diff: float  # over positions before the first divergence
    mean_abs_logprob_diff: float
    first_divergence: list[int]  # per prompt: index of the first differing token (= length when identical)
    diverged: list[int]  # the prompts whose completions differ
    per_position: list[dict[str, float]] = field(default_factory=list)  # {"position", "compared", "mean", "max"}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def agreement(
    tokens_a: Sequence[Sequence[int]],
    tokens_b: Sequence[Sequence[int]],
    logprobs_a: Sequence[Sequence[float]] | None = None,
    logprobs_b: Sequence[Sequence[float]] | None = None,
) -> Agreement:
    """Compare two engines' completions of the same prompts (one completion per prompt, same order)."""
    if len(tokens_a) != len(tokens_b):
        raise ValueError(f"engine A answered {len(tokens_a)} prompts, engine B {len(tokens_b)}")
    agree = total = identical = 0
    diffs_at: dict[int, list[float]] = {}
    divergence, diverged = [], []
    for i, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        d = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        divergence.append(d)
        agree += d
        total += max(len(a), len(b))
        same = list(a) == list(b)
        identical += same
        if not same:
            diverged.append(i)
        if logprobs_a is not None and logprobs_b is not None:
            for k in range(d):
                diffs_at.setdefault(k, []).append(abs(float(logprobs_a[i][k]) - float(logprobs_b[i][k])))
    all_diffs = [x for values in diffs_at.values() for x in values]
    per_position = [
        {"position": k, "compared": len(v), "mean": sum(v) / len(v), "max": max(v)} for k, v in sorted(diffs_at.items())
    ]
    n = len(tokens_a)
    return Agreement(
        prompts=n,
        token_agreement=agree / total if total else 1.0,
        identical_sequences=identical / n if n else 1.0,
        max_abs_logprob_diff=max(all_diffs, default=0.0),
        mean_abs_logprob_diff=sum(all_diffs) / len(all_diffs) if all_diffs else 0.0,
        first_divergence=divergence,
        diverged=diverged,
        per_position=per_position,
    )


# ---- the command ---------------------------------------------------------------------------------------------------
def add_compare_flags(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument
    from hybrid_engines.registry import backend_names

    p("--backend_a", required=True, choices=backend_names(), help="first engine backend")
    p("--backend_b", required=True, choices=backend_names(), help="second engine backend")
    p("--pretrain", help="model folder (default: the tiny built-in demo model)")
    p("--pretrain_b", help="engine B's model folder (default: --pretrain), e.g. to check a weight sync")
    p("--prompt_data", help="JSONL/JSON/Parquet file or datasets folder (default: the built-in task's prompts)")
    p("--input_key", help="field holding the prompt")
    p("--apply_chat_template", action="store_true", help="render prompts with the tokenizer's chat template")
    p("--prompt_split", default="train", help="split of a datasets folder")
    p("--task", default="copy", help="built-in task when no --prompt_data")
    p("--task_length", type=int, default=2, help="symbols per built-in task prompt")
    p("--max_samples", type=int, default=32, help="prompts to compare")
    p("--prompt_max_len", type=int, default=1024, help="longer prompts are dropped")
    p("--generate_max_len", type=int, default=64, help="new tokens per completion")
    p("--dtype_a", help="engine A dtype (float32, bfloat16, ...; default: the model's)")
    p("--dtype_b", help="engine B dtype")
    p("--batch_size_a", type=int, help="hf engine A: rows decoded together")
    p("--batch_size_b", type=int, help="hf engine B: rows decoded together")
    p("--engine_args_a", nargs="+", metavar="KEY=VALUE", default=[], help="extra engine A arguments")
    p("--engine_args_b", nargs="+", metavar="KEY=VALUE", default=[], help="extra engine B arguments")
    p("--seed", type=int, default=0)
    p("--trust_remote_code", action="store_true", help="run the Python code a model folder ships (auto_map)")
    p("--min_token_agreement", type=float, help="exit with status 1 when token agreement is below this (0-1)")
    p("--json", metavar="FILE", help="also write the report as JSON")


def run_compare(args: argparse.Namespace, *, console: Any = None) -> int:
    """Run both engines on the prompts and print the report; returns the exit status."""
    from rich.console import Console

    console = console or Console()
    if args.max_samples < 1 or args.generate_max_len < 1:
        raise ConfigError("max_samples" if args.max_samples < 1 else "generate_max_len", "must be >= 1.")
    for which in ("a", "b"):
        if getattr(args, f"batch_size_{which}") is not None and getattr(args, f"backend_{which}") != "hf":
            raise ConfigError(
                f"batch_size_{which}",
                "only the hf backend takes a batch size.",
                f"Use --engine_args_{which} with the engine's own setting.",
            )
    if args.prompt_data is not None and not args.input_key:
        raise ConfigError("input_key", "--prompt_data needs --input_key.", "Add e.g. --input_key prompt.")
    with tempfile.TemporaryDirectory(prefix="hybrid-compare-") as tmp:
        model_a = args.pretrain or _tiny_model(tmp, args.seed)
        model_b = args.pretrain_b or model_a
        from hybrid_algos.train.model_files import check_model_folder

        for name, path in (("pretrain", model_a), ("pretrain_b", model_b)):
            if not os.path.isdir(path):
                raise ConfigError(name, f"no model folder at {path!r}.", "Give a local Hugging Face model folder.")
            check_model_folder(name, path, trust_remote_code=args.trust_remote_code)
        prompt_ids = compare_prompts(args, model_a)
        out_a = generate(args.backend_a, model_a, prompt_ids, args, "a")
        out_b = generate(args.backend_b, model_b, prompt_ids, args, "b")
    result = agreement(
        *[[o.token_ids for o in outs] for outs in (out_a, out_b)],
        *[[o.logprobs or [] for o in outs] for outs in (out_a, out_b)],
    )
    _print_report(console, args, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=2)
    if args.min_token_agreement is not None and result.token_agreement < args.min_token_agreement:
        console.print(
            f"[red]token agreement {result.token_agreement:.4f} < --min_token_agreement "
            f"{args.min_token_agreement}[/red]"
        )
        return 1
    return 0


def compare_prompts(args: argparse.Namespace, model_path: str) -> list[list[int]]:
    """Prompt token ids from --prompt_data (or the built-in task), encoded with the model's tokenizer."""
    from transformers import AutoTokenizer

    from hybrid_algos.train.data import load_prompt_set
    from hybrid_algos.train.model_settings import ModelSettings
    from hybrid_algos.train.rollout_settings import RolloutSettings
    from hybrid_algos.train.tasks import task_from_config

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=getattr(args, "trust_remote_code", False))
    rollout = RolloutSettings(
        prompt_data=args.prompt_data,
        input_key=args.input_key,
        apply_chat_template=args.apply_chat_template,
        prompt_split=args.prompt_split,
        max_samples=args.max_samples,
        prompt_max_len=args.prompt_max_len,
        rollout_batch_size=1,
        max_steps=args.max_samples,
        seed=args.seed,
    )
    task = task_from_config(ModelSettings(task=args.task, task_length=args.task_length))
    prompts, _ = load_prompt_set(rollout, tokenizer, task if args.prompt_data is None else None)
    return [list(p.prompt_ids) for p in prompts[: args.max_samples]]


def generate(backend: str, model: str, prompt_ids: list[list[int]], args: argparse.Namespace, which: str) -> list:
    """Greedy completions (with log-probs) of one engine; the engine is shut down before returning."""
    from hybrid_engines import SamplingParams, make_engine

    kwargs: dict[str, Any] = {
        "model": model,
        "seed": args.seed,
        "trust_remote_code": getattr(args, "trust_remote_code", False),
    }
    dtype = getattr(args, f"dtype_{which}")
    if dtype:
        kwargs["dtype"] = dtype
    batch = getattr(args, f"batch_size_{which}")
    if batch is not None:
        kwargs["max_batch_size"] = batch
    extra = getattr(args, f"engine_args_{which}")
    if extra:
        try:
            kwargs.update(parse_mapping(extra))
        except (ValueError, TypeError):
            raise ConfigError(f"engine_args_{which}", f"cannot read {extra!r}.", "Write KEY=VALUE words.") from None
    engine = make_engine(backend, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=args.generate_max_len, logprobs=True)
        return [outs[0] for outs in engine.generate(prompt_ids, params)]
    finally:
        engine.shutdown()


def _tiny_model(tmp: str, seed: int) -> str:
    from hybrid_algos.train.tiny import save_tiny_model

    return save_tiny_model(os.path.join(tmp, "tiny-model"), seed=seed)


def _print_report(console: Any, args: argparse.Namespace, r: Agreement) -> None:
    from rich.table import Table

    a = f"{args.backend_a}" + (f" ({args.dtype_a})" if args.dtype_a else "")
    b = f"{args.backend_b}" + (f" ({args.dtype_b})" if args.dtype_b else "")
    table = Table(title=f"greedy agreement: {a} vs {b}, {r.prompts} prompts")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("token agreement (before first divergence)", f"{100 * r.token_agreement:.2f} %")
    table.add_row("identical sequences", f"{100 * r.identical_sequences:.2f} %")
    table.add_row("max |logprob A - B|", f"{r.max_abs_logprob_diff:.3e}")
    table.add_row("mean |logprob A - B|", f"{r.mean_abs_logprob_diff:.3e}")
    if r.diverged:
        first = min(r.diverged, key=lambda i: r.first_divergence[i])
        table.add_row("prompts that diverge", f"{len(r.diverged)} / {r.prompts}")
        table.add_row("earliest divergence", f"prompt {first}, generated token {r.first_divergence[first]}")
    console.print(table)
    if r.per_position:
        pos = Table(title="|logprob A - B| per position (prefixes equal)")
        for col in ("position", "compared", "mean", "max"):
            pos.add_column(col, justify="right")
        for row in r.per_position:
            pos.add_row(str(row["position"]), str(row["compared"]), f"{row['mean']:.3e}", f"{row['max']:.3e}")
        console.print(pos)
