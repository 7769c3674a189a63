"""Core's residency takes the step as input: a made-up step whose roles and phases share no name with PPO's is
sized and planned correctly -- working memory where each phase says its roles work, engine weights held from the
phase that fills them to the one that uses them, absent roles' phases skipped, a recipe's mistakes refused."""

import pytest
from transformers import LlamaConfig

from hybrid_core.placement import PlacementSpec
from hybrid_core.residency import GiB, Phase, Workload, build_layout, model_shape, plan_residency, size_role
from hybrid_core.residency.steps import needed_in

KINDS = {"student": "trainer", "judge": "frozen", "sampler": "engine"}
STEP = (
    Phase("draw", "sampler", {"sampler": ("weights", "kv_cache")}, work=("generate",)),
    Phase("judging", "judge", {"judge": ("params",)}, work=("infer",)),
    Phase("learn", "student", {"student": ("params", "grads", "optimizer")}, work=("train",)),
    Phase(
        "push",
        "student",
        {"student": ("params",), "sampler": ("weights",)},
        work=("sync",),
        holds={("sampler", "weights"): "draw"},
    ),
)
WORK = Workload(engine_pool=False, prompt_len=64, generate_len=64, rollout_samples=8, sync_bucket_bytes=1 << 20)


def shape():
    return model_shape(
        LlamaConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )


def layout():
    placement = PlacementSpec.from_ranges({"student": "0", "judge": "0", "sampler": "0"}).plan()
    s = shape()
    return build_layout(placement, {r: s for r in KINDS}, WORK, 4 * GiB, kinds=KINDS, phases=STEP)


def test_working_memory_is_where_each_phase_says_its_roles_work():
    sizes = {share.role: share.size for share in layout()[0]}
    assert set(sizes["student"].working) == {"learn", "push"}
    assert set(sizes["sampler"].working) == {"draw", "push"}
    assert set(sizes["judge"].working) == {"judging"}
    assert "sync_bucket" in sizes["student"].working["push"] and "activations" in sizes["student"].working["learn"]
    assert sizes["sampler"].working["draw"]["kv_cache"] > 0  # the built-in engine's cache is working memory
    # a phase of two kinds of work holds the larger one
    both = Phase("learn", "student", {"student": ("params",)}, work=("infer", "train"))
    train_only = size_role("student", shape(), WORK, kind="trainer", phases=(STEP[2],), ranks=1, tp=1, gpu_bytes=GiB)
    larger = size_role("student", shape(), WORK, kind="trainer", phases=(both,), ranks=1, tp=1, gpu_bytes=GiB)
    assert larger.working_total("learn") >= train_only.working_total("learn") > 0


def test_the_made_up_step_is_planned():
    plan = plan_residency(layout(), 4 * GiB, phases=STEP, mode="all-sleep", engine_sleep_level=2)
    assert [p.name for p in plan.phases] == ["draw", "judging", "learn", "push"]
    # the sampler's weights, refreshed by "push", stay until "draw" (a discard after the push would lose them)
    assert [p.name for p in plan.phases if plan.present("sampler", "weights", p.name)] == ["draw", "push"]
    assert [p.name for p in plan.phases if plan.present("judge", "params", p.name)] == ["judging"]
    assert plan.move("sampler", "weights") == "discard" and plan.fits()
    assert plan_residency(layout(), 80 * GiB, phases=STEP).moves.keys() == plan.moves.keys()  # auto: the same keys


def test_a_span_goes_around_the_end_of_the_step():
    step = (*STEP[:3], STEP[3], Phase("tally", "judge", {"judge": ("params",)}, work=("infer",)))
    assert needed_in(step, "sampler", "weights") == {"draw", "push", "tally"}


def test_a_phase_of_an_absent_role_is_skipped():
    placement = PlacementSpec.from_ranges({"student": "0", "sampler": "0"}).plan()
    s = shape()
    kinds = {"student": "trainer", "sampler": "engine"}
    lay = build_layout(placement, {"student": s, "sampler": s}, WORK, 4 * GiB, kinds=kinds, phases=STEP)
    assert [p.name for p in plan_residency(lay, 4 * GiB, phases=STEP).phases] == ["draw", "learn", "push"]


def test_a_recipes_mistakes_are_refused():
    wrong_work = (Phase("draw", "sampler", {"sampler": ("weights",)}, work=("train",)),)
    with pytest.raises(ValueError, match=r"sampler \(kind engine\) cannot train"):
        size_role("sampler", shape(), WORK, kind="engine", phases=wrong_work, ranks=1, tp=1, gpu_bytes=GiB)
    with pytest.raises(ValueError, match="no kind given for role"):
        build_layout(
            PlacementSpec.from_ranges({"student": "0", "sampler": "0"}).plan(),
            {"student": shape(), "sampler": shape()},
            WORK,
            GiB,
            kinds={"student": "trainer"},
            phases=STEP,
        )
    bad_span = (
        STEP[0],
        Phase(
            "push",
            "student",
            {"student": ("params",), "sampler": ("weights",)},
            work=("sync",),
            holds={("sampler", "weights"): "nowhere"},
        ),
    )
    with pytest.raises(ValueError, match="until 'nowhere', which is no phase"):
        plan_residency(layout(), 4 * GiB, phases=bad_span)
    with pytest.raises(ValueError, match=r"judge \(kind frozen\) has no state grads"):
        plan_residency(layout(), 4 * GiB, phases=(*STEP, Phase("x", "judge", {"judge": ("grads",)})))
