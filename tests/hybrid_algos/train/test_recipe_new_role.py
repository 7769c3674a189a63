"""Adding a role is one recipe entry: a judge (a second frozen scorer reusing the reference worker, its own model
folder; recipes.py's distillation teacher is made the same way) and the phase that scores the rollout with it --
planned by the residency planner like any role, and its phase run on a real judge worker (a real tiny model in a
Ray actor on a fake GPU).

The whole training loop is not run here (it would take minutes on CI's two cores): the plan is the one a run makes
(``placement.build_plan`` + ``build_residency``, as ``prepare`` calls them), and the phase is step.py's function
called as the step calls it.
"""

import os

import pytest
import ray
import torch

from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.experience import Rollout
from hybrid_algos.train.placement import build_plan, build_residency
from hybrid_algos.train.recipe import PhaseSpec, Recipe, RoleSpec
from hybrid_algos.train.recipes import GRPO
from hybrid_algos.train.step import PHASES, StepContext, StepState
from hybrid_algos.train.tiny import save_tiny_model
from hybrid_core.residency import GiB, HostBudget
from hybrid_core.stats import PhaseTimer

JUDGE_LAYERS = 3  # the policy has 2: a different model, with different bytes


def judge_recipe(folder: str) -> Recipe:
    """GRPO plus a judge: one role entry and one phase entry (and its function, registered below)."""
    judge = RoleSpec(
        "judge", "frozen", "hybrid_algos.train.workers.frozen:ReferenceWorker", model=lambda config, policy: folder
    )
    scoring = PhaseSpec("judge", "judge", {"judge": ("params",)}, work=("infer",), run="judge_logprobs")
    phases = list(GRPO.phases)
    phases.insert(phases.index(next(p for p in phases if p.name == "actor_train")), scoring)
    return Recipe("grpo+judge", (*GRPO.roles, judge), tuple(phases))


def judge_logprobs(ctx, state) -> None:
    """The phase's function: the judge's log-probs of the rollout's tokens, left for a later phase."""
    judge = ctx.role("judge")
    with state.timer.phase("infer"):
        parts = judge.call_sharded("logprobs", state.rollout.split(judge.world_size))
    state.extras["judge_logprobs"] = torch.cat(parts)
    state.metrics["judge/logprob_mean"] = float(state.extras["judge_logprobs"][state.rollout.action_mask > 0].mean())


@pytest.fixture(autouse=True)
def no_ray_left():
    """The in-process worker below asks Ray for its context, which starts a local Ray: shut it down after each test
    (a cluster left behind broke later modules of the same xdist worker)."""
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(PHASES, "judge_logprobs", judge_logprobs)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return (
        save_tiny_model(str(root / "policy")),
        save_tiny_model(str(root / "judge"), seed=3, num_hidden_layers=JUDGE_LAYERS),
    )


def config(tmp_path, **kw):
    ranges = {"actor": "0", "rollout": "0", "reference": "0", "judge": "0"}
    return GRPOConfig(placement=ranges, num_gpus=1, save_path=str(tmp_path / "run"), **kw).validate()


def test_the_planner_plans_the_judge_like_any_role(models, tmp_path):
    policy, judge = models
    cfg = config(tmp_path, residency="all-sleep")
    recipe = judge_recipe(judge).for_config(cfg)
    placement = build_plan(cfg, recipe)
    assert set(placement.roles) == {"actor", "rollout", "reference", "judge"}
    plan, _ = build_residency(
        cfg,
        placement,
        policy,
        prompt_len=8,
        generate_len=8,
        gpu_bytes=80 * GiB,
        host=HostBudget(None, "not checked here"),
        recipe=recipe,
    )
    assert [p.name for p in plan.phases] == ["generate", "reference", "judge", "actor_train", "sync"]
    # its own model's bytes (3 layers, not the policy's 2), and only where its phase needs them (all-sleep)
    share = next(s for s in plan.layout[0] if s.role == "judge")
    reference = next(s for s in plan.layout[0] if s.role == "reference")
    assert share.size.kind == "frozen" and share.size.states["params"] > reference.size.states["params"]
    assert [p.name for p in plan.phases if plan.present("judge", "params", p.name)] == ["judge"]
    assert share.size.working["judge"]["activations"] > 0  # its forward pass is counted in its phase
    assert "judge[params]" in plan.render()


def test_the_judge_phase_runs_on_a_real_judge_worker(models, tmp_path, registered):

    from hybrid_algos.train.workers.frozen import ReferenceWorker
    from hybrid_core.placement import PlacementSpec, place
    from hybrid_core.roles import RoleGroup

    policy, judge = models
    cfg = config(tmp_path, bf16=False)
    recipe = judge_recipe(judge).for_config(cfg)
    prompts = [[1, 5, 6], [1, 7]]
    rollout = Rollout.from_generations(prompts, [[[8, 9, 2]], [[5, 2]]], pad_id=0)
    ray.init(address="local", num_gpus=1, num_cpus=2, include_dashboard=False)  # not one running beside
    try:
        placed = place(PlacementSpec.from_ranges({"judge": "0"}).plan(), timeout_s=120)
        spec = recipe.role("judge")
        group = RoleGroup("judge", spec.worker_class(), placed, cfg.settings(), str(tmp_path / "logs"), timeout_s=120)
        group.call("setup", spec.model_folder(cfg, policy))
        ctx = StepContext(
            settings=cfg.settings(),
            actor=None,
            engines=None,
            weight_sync=None,
            reward=None,
            residency=None,
            pad_id=0,
            roles={"judge": group},
            recipe=recipe,
        )
        state = StepState(0, None, None, PhaseTimer(), rollout)
        PHASES[next(p for p in recipe.phases if p.name == "judge").function](ctx, state)
    finally:
        ray.shutdown()
    got = state.extras["judge_logprobs"]

    def local(path):  # the same worker class in this process: what the judge's folder gives
        worker = ReferenceWorker("judge", 0, 1, cfg.settings(), str(tmp_path / "logs"))
        worker.setup(path)
        return worker.logprobs(rollout)

    assert got.shape == rollout.action_mask.shape
    assert torch.allclose(got, local(judge), atol=1e-5)  # the judge's own model scored the rollout
    assert not torch.allclose(got * rollout.action_mask, local(policy) * rollout.action_mask)  # not the policy
    assert state.metrics["judge/logprob_mean"] < 0 and state.timer.seconds.get("infer", 0) > 0
    assert os.path.isdir(judge)
