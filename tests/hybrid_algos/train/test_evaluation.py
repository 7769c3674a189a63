"""The evaluation's parts without a run: its schedule, its metrics (pass@k at the threshold), its seeds, the
held-out prompts read like the training prompts, and the evaluation section's refusals (before Ray starts)."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.eval_settings import EvalSettings
from hybrid_algos.train.evaluation import eval_metrics, eval_seed, eval_steps_of, load_eval_prompts
from hybrid_algos.train.rollout_settings import RolloutSettings
from hybrid_algos.train.tiny import build_tiny_tokenizer
from hybrid_core.errors import ConfigError


@pytest.fixture
def held_out(tmp_path) -> str:
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"<bos> s{s} <sep>", "label": [s]}) + "\n" for s in range(4)))
    return str(path)


def test_the_schedule_is_every_n_steps_and_the_last():
    assert eval_steps_of(4, 10) == [4, 8, 10]
    assert eval_steps_of(5, 10) == [5, 10]
    assert eval_steps_of(-1, 10) == [10]  # -1: only after the last step
    assert eval_steps_of(1, 3) == [1, 2, 3]


def test_pass_at_k_is_the_share_of_prompts_with_a_sample_at_the_threshold():
    # 3 prompts x 2 samples, prompt-major: one right answer, one half right pair, one pair of right answers
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 1.0])
    lengths = torch.tensor([2, 2, 1, 3, 2, 2])
    m = eval_metrics(scores, lengths, 2, threshold=1.0)
    assert m["eval/reward_mean"] == pytest.approx(4 / 6)
    assert m["eval/pass@2"] == pytest.approx(2 / 3) and m["eval/prompts"] == 3
    assert m["eval/response_length"] == pytest.approx(2.0)
    assert eval_metrics(scores, lengths, 2, threshold=0.5)["eval/pass@2"] == 1.0  # half right passes at 0.5
    assert eval_metrics(scores, lengths, 1, threshold=1.0)["eval/pass@1"] == pytest.approx(3 / 6)


def test_seeds_are_the_evaluation_s_own():
    seeds = {eval_seed(42, step, call) for step in range(20) for call in range(3)}
    assert len(seeds) == 60 and all(0 <= s < 2**63 for s in seeds)
    rollout_seeds = {42 * 1_000_003 + step for step in range(20)}  # session.sampling's
    assert not seeds & rollout_seeds
    assert eval_seed(42, 3, 0) == eval_seed(42, 3, 0)  # reproducible (a resumed run evaluates the same)


def test_held_out_prompts_are_read_like_the_training_prompts(held_out):
    rollout = RolloutSettings(input_key="prompt", label_key="label", prompt_max_len=8)
    prompts, stats = load_eval_prompts(rollout, EvalSettings(dataset=held_out), build_tiny_tokenizer())
    assert [p.prompt_ids for p in prompts] == [[1, 4 + s, 3] for s in range(4)]  # the built-in task's own ids
    assert [p.label for p in prompts] == [[s] for s in range(4)] and stats.kept == 4
    with pytest.raises(ConfigError) as e:  # a record without the prompt key: named as the evaluation's
        load_eval_prompts(RolloutSettings(input_key="question"), EvalSettings(dataset=held_out), build_tiny_tokenizer())
    assert e.value.field == "input_key" and "evaluation prompts" in e.value.problem and "'question'" in e.value.problem


@pytest.mark.parametrize(
    "settings, field, fragment",
    [
        ({"eval_steps": 0}, "eval_steps", "-1 (once, after the last step) or a whole number >= 1"),
        ({"eval_steps": -2}, "eval_steps", "got -2"),
        ({"eval_n_samples_per_prompt": 0}, "eval_n_samples_per_prompt", ">= 1, got 0"),
        ({"eval_temperature": -0.5}, "eval_temperature", ">= 0"),
        ({"eval_dataset": "/no/such/eval.jsonl"}, "eval_dataset", "no file or folder at '/no/such/eval.jsonl'"),
        ({"input_key": None}, "eval_dataset", "--input_key (the field that holds a prompt) is not given"),
        ({"async_train": True}, "eval_dataset", "an asynchronous run (--async_train)"),
    ],
)
def test_bad_evaluation_settings_are_refused_naming_the_flag(held_out, settings, field, fragment):
    base = {"eval_dataset": held_out, "input_key": "prompt", "label_key": "label"}
    with pytest.raises(ConfigError) as e:
        GRPOConfig(**{**base, **settings}).validate()
    assert e.value.field == field and fragment in str(e.value) and e.value.fix, str(e.value)


def test_the_section_speaks_its_own_words(held_out):
    """What the config turns into flags: a reward model's run is refused in the section's words (a reward model
    would need its own phase in the evaluation; rule rewards score on the driver)."""
    with pytest.raises(ConfigError) as e:
        EvalSettings(dataset=held_out).validate(input_key="prompt", reward_model=True)
    assert e.value.field == "evaluation.dataset" and "models.reward_pretrain" in e.value.problem


def test_evaluation_settings_without_a_dataset_are_refused():
    with pytest.raises(ConfigError) as e:
        GRPOConfig(eval_steps=5).validate()
    assert e.value.field == "eval_steps" and "no --eval_dataset" in e.value.problem


def test_the_recipe_has_the_eval_phase_only_with_a_dataset(held_out):
    from hybrid_algos.train.recipes import recipe_for

    with_eval = GRPOConfig(eval_dataset=held_out, input_key="prompt").validate()
    assert [p.name for p in recipe_for(with_eval).residency_phases()][-1] == "eval"
    assert "eval" not in [p.name for p in recipe_for(GRPOConfig()).residency_phases()]


def test_an_eval_dataset_id_is_read_from_the_local_hugging_face_cache(tmp_path, monkeypatch):
    """OpenRLHF's scripts name their eval sets by id (``--eval.dataset OpenRLHF/aime-2024``): the cache's copy is
    read, as for --prompt_data (nothing is downloaded), and an id not there is named."""
    from hybrid_algos.train.data import resolve_local_paths

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snapshot = cache / "datasets--OpenRLHF--aime-2024" / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    (cache / "datasets--OpenRLHF--aime-2024" / "refs").mkdir()
    (cache / "datasets--OpenRLHF--aime-2024" / "refs" / "main").write_text("c0ffee")
    changes, notes = resolve_local_paths({"eval_dataset": "OpenRLHF/aime-2024"})
    assert changes == {"eval_dataset": str(snapshot)} and "--eval_dataset OpenRLHF/aime-2024" in notes[0]
    with pytest.raises(ConfigError) as e:
        resolve_local_paths({"eval_dataset": "OpenRLHF/not-cached"})
    assert e.value.field == "eval_dataset"


def test_a_recipe_without_the_eval_phase_is_refused_before_ray(held_out, tmp_path):
    """A recipe of your own that lacks the evaluation's phase would never evaluate: refused, naming the fix."""
    from dataclasses import replace

    from hybrid_algos.train.prepare import prepare
    from hybrid_algos.train.recipes import GRPO

    recipe = replace(GRPO, phases=tuple(p for p in GRPO.phases if p.name != "eval"))
    config = GRPOConfig(save_path=str(tmp_path / "run"), eval_dataset=held_out, input_key="prompt")
    with pytest.raises(ConfigError) as e:
        prepare(config, recipe)
    assert e.value.field == "eval_dataset" and "recipes.EVAL" in e.value.fix
