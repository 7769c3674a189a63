"""How many steps a run makes, said at the start and by ``--dry-run``, with why: prompts / --rollout_batch_size per
episode x --num_episodes (OpenRLHF's meaning), --max_steps only ending a run early. The dry-run's line for a few
combinations, and one short real run (its own local Ray, the demo model on one fake GPU) that makes exactly the
steps its line says."""

import json
import re

import pytest

from hybrid_algos.train.data import step_count
from hybrid_cli.main import main

SMALL = [
    "--task_length",
    "1",
    "--rollout_batch_size",
    "4",
    "--n_samples_per_prompt",
    "2",
    "--train_batch_size",
    "8",
    "--micro_train_batch_size",
    "8",
    "--seed",
    "7",
]
#: 10 prompts of the built-in task, 4 a step: 2 steps an episode, 2 prompts left out of each; --max_steps 6 not reached
NOT_REACHED = ["--max_samples", "10", "--max_steps", "6"]


def _steps_line(out: str) -> str:
    text = " ".join(out.split())  # the console wraps long lines
    match = re.search(r"steps: \d+ .*?max_epochs \d+\)", text)
    assert match, text
    return match.group(0)


def _dry_run(capsys, argv) -> str:
    assert main(["grpo", "--dry-run", *SMALL, *argv]) == 0
    return _steps_line(capsys.readouterr().out)


@pytest.mark.parametrize(
    "argv, steps, says",
    [
        (
            NOT_REACHED,
            2,
            "= 10 prompts / 4 per step x 1 episode (2 prompts left out of each episode: a step takes a whole "
            "--rollout_batch_size) (--max_steps 6 is not reached: it only ends a run early; raise "
            "--num_episodes to 3 or add prompts)",
        ),
        (
            [*NOT_REACHED, "--num_episodes", "3"],
            6,
            "x 3 episodes (2 prompts left out of each episode: a step takes a "
            "whole --rollout_batch_size) (= --max_steps 6)",
        ),
        # the built-in task makes prompts for --max_steps steps: a second episode is more than the run asks for
        (
            ["--max_steps", "3", "--num_episodes", "2"],
            3,
            "(--max_steps 3 ends the run before the prompts do: 6 = 12 prompts / 4 per step x 2 episodes)",
        ),
        (
            ["--max_samples", "8", "--max_steps", "none"],
            2,
            "= 8 prompts / 4 per step x 1 episode; each step 2 optimizer "
            "updates (8 samples / --train_batch_size 8 x --max_epochs 2)",
        ),
    ],
)
def test_dry_run_says_how_many_steps_and_why(capsys, argv, steps, says):
    line = _dry_run(capsys, argv)
    assert line.startswith(f"steps: {steps} ") and says in line, line


def test_the_count_is_the_smaller_of_the_prompts_and_max_steps():
    from types import SimpleNamespace

    def count(prompts, episodes, max_steps):
        config = SimpleNamespace(
            rollout_batch_size=128,
            num_episodes=episodes,
            max_steps=max_steps,
            samples_per_step=128,
            train_batch_size=128,
            max_epochs=1,
        )
        return step_count(config, prompts)

    # the report's case: --max_steps 6, 256 prompts, 128 a step, one episode: 2 steps, and the line says so
    assert count(256, 1, 6).total == 2 and "--max_steps 6 is not reached" in count(256, 1, 6).describe()
    assert count(256, 3, 6).total == 6 and count(256, 4, 6).total == 6 and count(256, 2, None).total == 4


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_real_run_makes_the_steps_its_line_says(tmp_path, capsys):
    import ray

    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

    ensure_cpu_ops_built()  # a fresh clone compiles DeepSpeed's CPU ops once: not this test's subject
    said = _dry_run(capsys, NOT_REACHED)
    run = tmp_path / "run"
    assert main(["grpo", *SMALL, *NOT_REACHED, "--save_path", str(run), "--no_final_checkpoint"]) == 0
    assert not ray.is_initialized()
    assert _steps_line(capsys.readouterr().out) == said  # the run starts with the dry run's line
    with open(run / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1]  # 2 steps, as said, not --max_steps 6
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
