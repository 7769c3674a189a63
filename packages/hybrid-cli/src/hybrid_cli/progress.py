"""The training display: a rich progress bar (step, reward, KL, seconds per phase) and a summary table at the end.

On a terminal the bar updates in place; elsewhere (``ray job submit`` logs, CI) one line per step is printed
instead, so logs stay readable.
"""

from __future__ import annotations

import math
import os
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

#: Phases shown, in step order (metric ``time/<phase>``).
PHASES = ("generate", "infer", "train", "sync", "sleep", "wake", "eval")


def step_line(m: dict[str, Any]) -> str:
    """``reward 0.512  kl 0.0031  | generate 1.20s infer 0.31s ...  step 2.1s`` for one step's metrics."""
    parts = [f"reward {_num(m.get('reward'))}", f"kl {_num(m.get('kl'), 4)}"]
    if "eval/reward_mean" in m:  # a step the held-out prompts were evaluated after (--eval_dataset)
        passed = next((f"  {k[5:]} {_num(v)}" for k, v in m.items() if k.startswith("eval/pass@")), "")
        parts.append(f"eval {_num(m['eval/reward_mean'])}{passed}")
    times = " ".join(f"{p} {m[f'time/{p}']:.2f}s" for p in PHASES if m.get(f"time/{p}"))
    text = "  ".join(parts)
    if times:
        text += f"  | {times}"
    if "time/step" in m:
        text += f"  step {m['time/step']:.2f}s"
    return text


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    value = float(value)
    return "nan" if math.isnan(value) else f"{value:.{digits}f}"


class ProgressDisplay:
    """A training callback (``on_start`` / ``on_step`` / ``on_end``) that shows progress and a final summary."""

    def __init__(self, console: Console | None = None, *, live: bool | None = None):
        self.console = console or Console()
        self.live = self.console.is_terminal if live is None else live
        self.history: list[dict[str, Any]] = []
        self.total_steps = 0
        self.start_step = 0
        self._progress: Progress | None = None
        self._task = None

    def on_start(self, info: dict[str, Any]) -> None:
        self.total_steps = int(info.get("total_steps") or 0)
        self.start_step = int(info.get("start_step") or 0)
        plan = info.get("plan")
        if plan is not None and hasattr(plan, "render"):
            self.console.print(plan.render(), markup=False)
        residency = info.get("residency")
        if residency is not None:
            from hybrid_algos.train.sections import flag_text

            self.console.print(flag_text(residency.render()), markup=False)  # core names settings, users read flags
        if info.get("run_dir"):
            self.console.print(f"run folder: {info['run_dir']}", markup=False)
        for line in info.get("lines") or ():  # the step count and why; flags the run does not use as given
            self.console.print(line, markup=False)
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"),
                console=self.console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=self.total_steps or None, completed=self.start_step, stats=""
            )

    def on_step(self, metrics: dict[str, Any]) -> None:
        self.history.append(dict(metrics))
        line = step_line(metrics)
        # 1-based, as in errors, checkpoint names and --profile_step (the metric is the loop's 0-based index)
        done = int(metrics["step"]) + 1 if "step" in metrics else len(self.history)
        if self._progress is not None:
            self._progress.update(self._task, completed=done, stats=line)
        else:
            self.console.print(f"step {done}/{self.total_steps or '?'}  {line}", markup=False)

    def on_end(self, summary: dict[str, Any]) -> None:
        self.close()
        self.console.print(summary_table(self.history, summary))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def summary_table(history: list[dict[str, Any]], summary: dict[str, Any] | None = None) -> Table:
    """Steps, reward (first / last / best), final KL, mean seconds per phase and bytes moved, the set-up's seconds,
    saved paths."""
    table = Table(title="training summary", show_header=True)
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("steps", str(len(history)))
    rewards = [float(m["reward"]) for m in history if m.get("reward") is not None]
    if rewards:
        table.add_row("reward first / last / best", f"{rewards[0]:.3f} / {rewards[-1]:.3f} / {max(rewards):.3f}")
    evals = [float(m["eval/reward_mean"]) for m in history if m.get("eval/reward_mean") is not None]
    if evals:
        table.add_row("eval reward first / last / best", f"{evals[0]:.3f} / {evals[-1]:.3f} / {max(evals):.3f}")
    if history and history[-1].get("kl") is not None:
        table.add_row("KL (last step)", f"{float(history[-1]['kl']):.4f}")
    for phase in (*PHASES, "step"):
        values = [float(m[f"time/{phase}"]) for m in history if m.get(f"time/{phase}") is not None]
        if values and any(values):
            table.add_row(f"{phase} s/step (mean)", f"{sum(values) / len(values):.2f}")
    for what in ("sleep", "wake", "sync"):
        values = [float(m[f"bytes/{what}"]) for m in history if m.get(f"bytes/{what}")]
        if values:
            table.add_row(f"{what} GB/step (mean)", f"{sum(values) / len(values) / 1e9:.3f}")
    setup = (summary or {}).get("setup_seconds") or {}
    if setup:  # where a run's start went (placement, models, engines, weight sync): the slowest stages first
        slowest = sorted(setup.items(), key=lambda kv: -kv[1])[:4]
        table.add_row("set-up s", f"{sum(setup.values()):.1f} ({', '.join(f'{k} {v:.1f}' for k, v in slowest)})")
    for key in ("run_dir", "final_model", "last_checkpoint"):  # saved places, only those that exist
        value = (summary or {}).get(key)
        if isinstance(value, str) and os.path.exists(value):
            table.add_row(key, value)
    return table
