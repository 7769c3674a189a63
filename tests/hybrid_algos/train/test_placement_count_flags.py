"""OpenRLHF's count flags -> plan (``placement.counted_roles``, the meaning of the flags, laid out by
hybrid_core.placement.counts): the seeds' 8-GPU and 70B (48-GPU) examples, and the flag errors, in flag words."""

from dataclasses import replace

import pytest

from hybrid_algos.train.placement import counted_roles
from hybrid_algos.train.recipes import PPO
from hybrid_algos.train.sections import flag_words
from hybrid_core.errors import ConfigError, PlacementError
from hybrid_core.placement import PlacementSpec
from hybrid_core.placement.settings import PlacementSettings

#: PPO's roles as a run without on-policy distillation has them (the teacher, placed on the actor's GPUs by its
#: counts, is a role only with --teacher_pretrain); the optional reference and reward model stay: the counts decide them
RUN = replace(
    PPO,
    roles=tuple(r for r in PPO.roles if r.name != "teacher"),
    phases=tuple(p for p in PPO.phases if p.role != "teacher"),
)

#: what a flag left out means here (as hybrid-core's count layout took them before the flags' meaning moved here)
UNSET = dict(critic_num_gpus_per_node=0, ref_num_gpus_per_node=0, reward_num_gpus_per_node=0, colocate_all_models=False)


def from_counts(vllm_num_engines=0, vllm_tensor_parallel_size=1, cluster_gpus=None, num_nodes=None, **flags):
    """The spec of OpenRLHF's flags for PPO's roles (a role of 0 GPUs is absent; 0 engines: one on each actor GPU),
    with errors in flag words."""
    flags = {**UNSET, **flags}
    settings = PlacementSettings(
        colocate_all=flags.pop("colocate_all_models"), gpus_per_node=flags.pop("gpus_per_node", None), **flags
    )

    class Spec:
        def plan(self):
            with flag_words():
                roles = counted_roles(settings, RUN, vllm_num_engines, vllm_tensor_parallel_size)
                spec = PlacementSpec.from_counts(
                    roles, gpus_per_node=settings.gpus_per_node, cluster_gpus=cluster_gpus, num_nodes=num_nodes
                )
                return spec.plan()

    return Spec()


def openrlhf_8gpu(**overrides):
    """The 8-GPU hybrid-engine command of the OpenRLHF docs (reference 001): REINFORCE, so no critic."""
    flags = dict(
        actor_num_nodes=1,
        actor_num_gpus_per_node=8,
        ref_num_nodes=1,
        ref_num_gpus_per_node=8,
        reward_num_nodes=1,
        reward_num_gpus_per_node=8,
        critic_num_nodes=0,
        critic_num_gpus_per_node=0,
        vllm_num_engines=8,
        vllm_tensor_parallel_size=1,
        colocate_all_models=True,
        colocate_actor_ref=False,
        colocate_critic_reward=False,
        gpus_per_node=8,
    )
    flags.update(overrides)
    return from_counts(**flags)


def openrlhf_70b(**overrides):
    """The '70B model on 48 GPUs' hybrid-engine command of the Hybrid Engine guide (reference 000)."""
    flags = dict(
        colocate_all_models=True,
        vllm_num_engines=4,
        vllm_tensor_parallel_size=4,
        actor_num_nodes=1,
        actor_num_gpus_per_node=16,
        critic_num_nodes=1,
        critic_num_gpus_per_node=16,
        reward_num_nodes=1,
        reward_num_gpus_per_node=8,
        ref_num_nodes=1,
        ref_num_gpus_per_node=8,
    )
    flags.update(overrides)
    return from_counts(**flags)


def gpu_map(plan):
    return {name: role.gpus for name, role in plan.roles.items()}


def test_openrlhf_8gpu_example_puts_every_model_on_the_same_8_gpus():
    plan = openrlhf_8gpu().plan()
    assert plan.num_gpus == 8
    assert list(plan.roles) == ["actor", "rollout", "reference", "reward"]  # no critic: REINFORCE
    for gpu in range(8):
        assert plan.roles_on_gpu(gpu) == ["actor", "rollout", "reference", "reward"]
        assert sum(plan.worker_on_gpu(r, gpu).num_gpus for r in plan.roles) <= 1.0
    for name, role in plan.roles.items():
        assert [w.gpus for w in role.workers] == [(g,) for g in range(8)], name
        assert all(w.num_gpus == 0.25 for w in role.workers)
    assert plan.roles["rollout"].tp == 1


def test_openrlhf_70b_flags_need_16_gpus_not_48():
    """--colocate_all_models colocates *all* models (001: "Colocate vLLM Engines, Actor, Reference, Reward and
    Critic"; OpenRLHF puts them all in the actor's placement group), so the guide's 48-GPU command needs 16 GPUs:
    actor, engines and critic on 0-15, reference and reward on the first 8 of them."""
    plan = openrlhf_70b().plan()
    assert plan.num_gpus == 16
    assert gpu_map(plan) == {
        "actor": tuple(range(16)),
        "rollout": tuple(range(16)),
        "critic": tuple(range(16)),
        "reference": tuple(range(8)),
        "reward": tuple(range(8)),
    }
    assert [w.gpus for w in plan.roles["rollout"].workers] == [
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        (8, 9, 10, 11),
        (12, 13, 14, 15),
    ]
    # five roles share GPUs 0-7, three share 8-15; fractions fill each GPU without exceeding it
    assert plan.worker_on_gpu("actor", 0).num_gpus == 0.2
    assert plan.worker_on_gpu("actor", 8).num_gpus == 0.3333
    assert plan.roles["rollout"].workers[1].num_gpus == 0.2 and plan.roles["rollout"].workers[2].num_gpus == 0.3333


def test_guide_48_gpu_total_is_engines_sharing_the_actor_and_everything_else_separate():
    """The guide's arithmetic (16 vLLM+actor shared + critic 16 + reward 8 + reference 8 = 48) describes a layout
    where only the engines share the actor's GPUs. No OpenRLHF flag set gives that layout, but RLinf-style ranges
    do, and then the plan count agrees with the guide."""
    plan = PlacementSpec.from_ranges(
        {"actor": "0-15", "rollout": "0-15", "critic": "16-31", "reward": "32-39", "reference": "40-47"},
        tp={"rollout": 4},
        gpus_per_node=8,
        num_nodes=6,
    ).plan()
    assert plan.num_gpus == 48
    assert [plan.roles_on_gpu(g) for g in (0, 15, 16, 32, 47)] == [
        ["actor", "rollout"],
        ["actor", "rollout"],
        ["critic"],
        ["reward"],
        ["reference"],
    ]


def test_guide_64_gpu_count_without_hybrid_engine():
    """Without colocation every role gets its own GPUs. The 48-GPU command's counts then need 16+16+16+8+8 = 64;
    the guide's own 'without hybrid engine' command (reward and reference 16 each) needs 80, not the 64 it states:
    its sum leaves out the reference model's 16 GPUs."""
    no_hybrid = dict(colocate_all_models=False)
    assert openrlhf_70b(**no_hybrid).plan().num_gpus == 64
    plan = openrlhf_70b(reward_num_gpus_per_node=16, ref_num_gpus_per_node=16, **no_hybrid).plan()
    assert plan.num_gpus == 80
    assert gpu_map(plan) == {
        "actor": tuple(range(0, 16)),
        "rollout": tuple(range(16, 32)),
        "critic": tuple(range(32, 48)),
        "reference": tuple(range(48, 64)),
        "reward": tuple(range(64, 80)),
    }
    assert all(len(plan.roles_on_gpu(g)) == 1 for g in range(80))


def test_colocate_actor_ref_and_critic_reward_pair_the_models():
    """The two-pair layout of reference 004 (1 GPU each, 4 roles, no vLLM colocation)."""
    plan = from_counts(
        actor_num_gpus_per_node=1,
        critic_num_gpus_per_node=1,
        ref_num_gpus_per_node=1,
        reward_num_gpus_per_node=1,
        vllm_num_engines=1,
        colocate_actor_ref=True,
        colocate_critic_reward=True,
    ).plan()
    assert gpu_map(plan) == {"actor": (0,), "rollout": (1,), "critic": (2,), "reference": (0,), "reward": (2,)}
    assert plan.worker_on_gpu("actor", 0).num_gpus == plan.worker_on_gpu("reference", 0).num_gpus == 0.5
    assert plan.shared_gpus("critic") == (2,) and plan.shared_gpus("rollout") == ()


def test_roles_with_zero_gpus_are_absent_and_no_engines_means_one_on_each_actor_gpu():
    plan = openrlhf_8gpu(ref_num_nodes=0, reward_num_gpus_per_node=0, vllm_num_engines=0).plan()
    assert list(plan.roles) == ["actor", "rollout"]
    assert plan.num_gpus == 8 and plan.roles["rollout"].gpus == plan.roles["actor"].gpus


def test_a_role_the_counts_do_not_place_needs_ranges():
    from hybrid_algos.train.recipe import RoleSpec

    judge = RoleSpec("judge", "frozen", "hybrid_algos.train.workers.frozen:ReferenceWorker")
    recipe = replace(RUN, roles=(*RUN.roles, judge))
    with pytest.raises(ConfigError, match="role 'judge' has no count settings") as err, flag_words():
        counted_roles(PlacementSettings(), recipe, 1, 1)
    assert err.value.field == "placement" and "--placement" in str(err.value)


def test_a_distillation_teacher_sits_on_the_actors_gpus():
    settings = PlacementSettings(actor_num_gpus_per_node=4, ref_num_gpus_per_node=2, colocate_all=True)
    with flag_words():
        roles = counted_roles(settings, PPO, 4, 1)  # PPO with every optional role, the teacher included
        plan = PlacementSpec.from_counts(roles).plan()
    assert plan.roles["teacher"].gpus == plan.roles["actor"].gpus == (0, 1, 2, 3)
    assert plan.roles["reference"].gpus == (0, 1)


def e(field, *fragments):
    return field, fragments


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            dict(vllm_num_engines=4),
            e("vllm_num_engines", "actor_num_gpus_per_node (= 8) must equal", "(= 4 x 1 = 4)", "--vllm_num_engines 8"),
        ),
        (
            dict(actor_num_gpus_per_node=6, vllm_num_engines=1, vllm_tensor_parallel_size=4),
            e("vllm_num_engines", "= 1 x 4 = 4", "divides 6"),
        ),
        (dict(actor_num_gpus_per_node=16), e("actor_num_gpus_per_node", "16 GPUs per node", "nodes have 8")),
        (dict(actor_num_gpus_per_node=-1), e("actor_num_gpus_per_node", "at least 0")),
        (dict(actor_num_nodes=0), e("actor_num_gpus_per_node", "the actor has no GPUs")),
        (dict(vllm_tensor_parallel_size=0), e("vllm_tensor_parallel_size", "at least 1")),
        (dict(vllm_num_engines=-2), e("vllm_num_engines", "at least 0")),
        (dict(vllm_tensor_parallel_size=16, vllm_num_engines=1), e("vllm_tensor_parallel_size", "node of 8 GPUs")),
        (
            dict(critic_num_nodes=1, critic_num_gpus_per_node=16, gpus_per_node=16),
            e("critic_num_gpus_per_node", "asks for 16 GPUs and the actor has 8"),
        ),
        (dict(colocate_all_models=False, colocate_critic_reward=True), e("colocate_critic_reward", "no critic")),
        (
            dict(colocate_all_models=False, colocate_actor_ref=True, ref_num_gpus_per_node=0),
            e("colocate_actor_ref", "no reference model"),
        ),
        (
            dict(cluster_gpus=4, gpus_per_node=None),
            e("actor_num_gpus_per_node", "outside the cluster's 4 GPUs", "the plan needs 8 GPUs"),
        ),
        (
            dict(colocate_all_models=False, cluster_gpus=16),
            e(
                "ref_num_gpus_per_node",
                "reference would use GPUs 16-23",
                "outside the cluster's 16 GPUs",
                "needs 32 GPUs (actor 0-7, rollout 8-15, reference 16-23, reward 24-31)",
            ),
        ),
        (dict(num_nodes=2, cluster_gpus=8), e("cluster_gpus", "num_nodes x gpus_per_node = 2 x 8 = 16")),
        (dict(gpus_per_node="8"), e("gpus_per_node", "expected a whole number, got '8'")),
    ],
)
def test_invalid_flags_name_the_field_and_the_fix(overrides, expected):
    field, fragments = expected
    with pytest.raises(PlacementError) as err:
        openrlhf_8gpu(**overrides).plan()
    assert err.value.field == field
    for fragment in fragments:
        assert fragment in str(err.value)
    assert err.value.fix, "every placement error says how to fix it"
    assert isinstance(err.value, ConfigError)


def test_engines_may_not_straddle_a_node_boundary():
    with pytest.raises(PlacementError) as err:
        from_counts(actor_num_gpus_per_node=6, vllm_num_engines=2, vllm_tensor_parallel_size=4, gpus_per_node=8).plan()
    assert err.value.field == "vllm_tensor_parallel_size"
    assert "rollout engine 0 would span GPUs 6-9, across a node boundary" in str(err.value)


def test_reward_on_critic_gpus_must_fit():
    with pytest.raises(PlacementError) as err:
        from_counts(
            actor_num_gpus_per_node=1,
            critic_num_gpus_per_node=2,
            reward_num_gpus_per_node=4,
            colocate_critic_reward=True,
        ).plan()
    assert err.value.field == "reward_num_gpus_per_node"
    assert "--colocate_critic_reward puts the reward on the critic's GPUs" in str(err.value)


def test_the_colocation_switches_are_true_or_false():
    with pytest.raises(ConfigError, match="expected true or false") as err:
        PlacementSettings(colocate_all="yes").validate()  # type: ignore[arg-type]
    assert err.value.field == "placement.colocate_all"


# ---- no engines: one on each actor GPU (OpenRLHF: generate with the actor) -------------------------------------------
def test_engines_on_the_actor_s_gpus_leave_the_other_roles_where_they_were():
    plan = from_counts(
        actor_num_gpus_per_node=4, critic_num_gpus_per_node=2, ref_num_gpus_per_node=1, reward_num_gpus_per_node=1
    ).plan()
    assert plan.num_gpus == 8
    assert plan.roles["rollout"].gpus == plan.roles["actor"].gpus == (0, 1, 2, 3)
    assert [w.gpus for w in plan.roles["rollout"].workers] == [(0,), (1,), (2,), (3,)]
    assert plan.roles["critic"].gpus == (4, 5) and plan.roles["reference"].gpus == (6,)
    assert plan.roles["reward"].gpus == (7,)


def test_engines_on_the_actor_with_colocated_reference():
    plan = from_counts(actor_num_gpus_per_node=2, ref_num_gpus_per_node=2, colocate_actor_ref=True).plan()
    assert plan.num_gpus == 2 and plan.roles["reference"].gpus == plan.roles["rollout"].gpus == (0, 1)


def test_multi_node_roles_imply_the_node_size():
    plan = from_counts(
        actor_num_nodes=2, actor_num_gpus_per_node=8, vllm_num_engines=4, vllm_tensor_parallel_size=4,
        colocate_all_models=True,
    ).plan()  # fmt: skip
    assert plan.gpus_per_node == 8 and plan.num_gpus == 16 and "on 2 nodes (8 GPUs per node)" in plan.render()
    assert all(len({plan.node_of(g) for g in w.gpus}) == 1 for w in plan.roles["rollout"].workers)
    with pytest.raises(PlacementError, match="across a node boundary"):  # engines of 4 on nodes of 6
        from_counts(
            actor_num_nodes=2, actor_num_gpus_per_node=6, vllm_num_engines=3, vllm_tensor_parallel_size=4,
            colocate_all_models=True,
        ).plan()  # fmt: skip
