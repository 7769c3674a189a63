"""How robustly the CPU learning test's settings learn: several seeds of each algorithm, one line each.

    python bench/learning_seeds.py                          # the test's settings, seeds 1-3, ppo / reinforce / grpo
    python bench/learning_seeds.py --seeds 1-8 --algos grpo --set adam_betas=0.9,0.95 n_samples_per_prompt=8 \\
        train_batch_size=32 micro_train_batch_size=32 max_steps=48   # the settings before issue 23
    python bench/learning_seeds.py --demo --algos grpo ppo --seeds 42   # the demo (`hybrid grpo` with no flags)

Runs on the CPU (one local Ray with a fake GPU); prints, per run, the first step with a reward >= 0.9 (the test asks
for it by step 24), the step where the 5-step mean gets there, the mean of the last 8 steps (the test asks >= 0.9)
and of the last 5, and the seconds taken, then the rewards. Used for bench/NOTES.md
("Issue 23: learning on any CPU").
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "hybrid_algos", "train"))


def _seeds(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["ppo", "reinforce", "grpo"])
    parser.add_argument("--seeds", default="1-3", help="e.g. 1-8 or 1,4,7")
    parser.add_argument("--demo", action="store_true", help="the demo's settings (DEMO_SETTINGS) instead of the test's")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override settings")
    args = parser.parse_args()

    import ray

    from hybrid_algos.train import CONFIGS, train
    from hybrid_algos.train.config import DEMO_SETTINGS
    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

    if args.demo:
        settings = dict(DEMO_SETTINGS)
    else:
        from test_learning import SETTINGS

        settings = dict(SETTINGS)
    for item in args.set:
        key, _, value = item.partition("=")
        settings[key] = _value(value)
    ensure_cpu_ops_built()
    ray.init(address="local", num_gpus=1, include_dashboard=False)  # never another session's Ray on this machine
    print(f"settings: {settings}", flush=True)
    for algo in args.algos:
        for seed in _seeds(args.seeds):
            config = CONFIGS[algo](
                save_path=tempfile.mkdtemp(prefix=f"learn-{algo}-{seed}-"),
                **{**settings, "seed": seed, "final_checkpoint": False},
            )
            start = time.monotonic()
            rewards = [m["reward"] for m in train(config)["history"]]
            took = time.monotonic() - start
            smooth = [statistics.mean(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))]
            first = next((i + 1 for i, r in enumerate(rewards) if r >= 0.9), None)
            crossed = next((i + 1 for i, r in enumerate(smooth) if i >= 4 and r >= 0.9), None)
            print(
                f"{algo:9s} seed {seed:3d}: reward >= 0.9 first at step {first}, 5-step mean at step {crossed}; "
                f"last-8 mean {statistics.mean(rewards[-8:]):.3f}, last-5 {statistics.mean(rewards[-5:]):.3f}; "
                f"{took:.0f} s",
                flush=True,
            )
            print(f"    rewards {[round(r, 2) for r in rewards]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
