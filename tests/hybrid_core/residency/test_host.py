"""What a residency plan keeps in host memory, per node, as a pure function of the layout and the moves; the refusal
of a plan that overfills a node, and the notes near the capacity."""

import pytest
from ppo_phases import build_layout, plan_residency, size_role

from hybrid_core.errors import PlacementError
from hybrid_core.placement import PlacementSpec
from hybrid_core.residency import (
    PROCESS_BYTES,
    GiB,
    GpuShare,
    HostBudget,
    RoleSize,
    Workload,
    host_use,
    local_budget,
    model_shape,
)
from hybrid_core.residency.host import NEAR_FULL, available_memory


def size(role, kind, states, host_optimizer=0.0, **host):
    return RoleSize(
        role,
        kind,
        {k: v * GiB for k, v in states.items()},
        {},
        0.0,
        host={k: v * GiB for k, v in host.items()},
        host_optimizer=host_optimizer * GiB,
    )


ACTOR = size("actor", "trainer", {"params": 2, "grads": 3, "optimizer": 12, "cache": 1}, host_optimizer=16)
REFERENCE = size("reference", "frozen", {"params": 5, "cache": 1})
ROLLOUT = size("rollout", "engine", {"weights": 7, "kv_cache": 20})


def test_offloaded_states_count_discarded_and_released_ones_do_not():
    layout = {0: (GpuShare(ACTOR), GpuShare(REFERENCE), GpuShare(ROLLOUT))}
    moves = {
        ("actor", "params"): "offload",
        ("actor", "grads"): "resident",
        ("actor", "optimizer"): "offload",
        ("actor", "cache"): "release",
        ("reference", "params"): "offload",
        ("reference", "cache"): "release",
        ("rollout", "weights"): "discard",
        ("rollout", "kv_cache"): "release",
    }
    (node,) = host_use(layout, moves).values()
    assert node.items == {
        ("actor", "params"): 2 * GiB,
        ("actor", "optimizer"): 12 * GiB,
        ("reference", "params"): 5 * GiB,
    }
    assert node.offloaded == 19 * GiB and node.optimizer == 0 and node.states == 19 * GiB
    assert node.processes == 3 + 1  # three workers and the driver
    assert node.total == 19 * GiB + 4 * PROCESS_BYTES
    # a level-1 engine sleep backs its weights up to host; everything resident keeps nothing there
    level1 = host_use(layout, {**moves, ("rollout", "weights"): "offload"})[0]
    assert level1.offloaded == 26 * GiB and level1.items[("rollout", "weights")] == 7 * GiB
    assert host_use(layout, {})[0].states == 0


def test_cpu_adam_is_eighteen_bytes_per_parameter_of_the_rank_s_zero_partition_plus_deepspeed_s_buffers():
    from transformers import LlamaConfig

    shape = model_shape(
        LlamaConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    )
    P = shape.num_params
    staging = 2 * 1000 * 64  # ZeRO-1/2: one bf16 host buffer of the largest parameter (the embeddings)

    def actor(zero_stage, adam_offload, ranks=4, **kw):
        work = Workload(
            bf16=True, zero_stage=zero_stage, adam_offload=adam_offload, prompt_len=16, generate_len=16, **kw
        )
        return size_role("actor", shape, work, ranks=ranks, tp=1, gpu_bytes=80 * GiB)

    # fp32 master weights and their fp32 gradients, Adam m and v, and a bf16 partition: the gradient partitions under
    # ZeRO-3, under ZeRO-1/2 the copy the updated weights pass through (param_buffer_of_bit16_for_cpu_offload_groups:
    # what a 6.5B model's run was killed for on a 125 GiB host) -- tests/hybrid_algos/train/test_bf16_optimizer.py
    # measures them on a real DeepSpeed engine
    offloaded = actor(3, True)
    assert offloaded.host == {"cpu_adam": 18 * P / 4} and offloaded.states["optimizer"] == 0  # nothing on the GPU
    assert actor(1, True).host["cpu_adam"] == 18 * P / 4 + staging
    # ZeRO-2 accumulates an update's micro-batches in one more bf16 host buffer per parameter
    assert actor(2, True).host["cpu_adam"] == 20 * P / 4 + staging
    assert actor(2, True, gradient_accumulation=False).host["cpu_adam"] == 18 * P / 4 + staging
    assert actor(0, True).host["cpu_adam"] == 18 * P  # ZeRO-0: every rank holds all of it
    on_gpu = actor(2, False)
    assert on_gpu.host == {} and on_gpu.host_optimizer == 20 * P / 4 + staging  # what the "host" move would cost
    assert size_role("reference", shape, Workload(), ranks=4, tp=1, gpu_bytes=80 * GiB).host_optimizer == 0
    # the plan counts it under adam_offload whatever the moves, and under the planner's "host" move
    layout = {0: (GpuShare(offloaded),)}
    assert host_use(layout, {})[0].optimizer == 18 * P / 4
    layout = {0: (GpuShare(on_gpu),)}
    assert host_use(layout, {("actor", "optimizer"): "host"})[0].items == {("actor", "cpu_adam"): on_gpu.host_optimizer}
    assert host_use(layout, {("actor", "optimizer"): "offload"})[0].items == {("actor", "optimizer"): 12 * P / 4}


def test_workers_multiply_and_nodes_split_by_gpus_per_node():
    layout = {g: (GpuShare(ACTOR), GpuShare(REFERENCE, workers=2)) for g in range(4)}
    moves = {("actor", "optimizer"): "host", ("reference", "params"): "offload"}
    one = host_use(layout, moves)  # no node size: one node
    assert list(one) == [0] and one[0].optimizer == 4 * 16 * GiB and one[0].offloaded == 4 * 2 * 5 * GiB
    assert one[0].processes == 4 * 3 + 1
    two = host_use(layout, moves, gpus_per_node=2)
    assert sorted(two) == [0, 1]
    for node in two.values():  # GPUs 0-1 on node 0, 2-3 on node 1
        assert node.optimizer == 2 * 16 * GiB and node.offloaded == 2 * 2 * 5 * GiB
    assert (two[0].processes, two[1].processes) == (7, 6)  # the driver runs on node 0
    assert host_use(layout, moves, gpus_per_node=2, driver=False)[0].processes == 6


def test_a_real_layout_over_two_nodes_holds_each_node_s_own_ranks_partitions():
    from transformers import LlamaConfig

    shape = model_shape(
        LlamaConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    placement = PlacementSpec.from_ranges({"actor": "0-7", "rollout": "0-7"}, gpus_per_node=4).plan()
    work = Workload(bf16=True, zero_stage=3, adam_offload=True, prompt_len=16, generate_len=16)
    layout = build_layout(placement, {"actor": shape, "rollout": shape}, work, 80 * GiB)
    plan = plan_residency(layout, 80 * GiB, host=HostBudget(64 * GiB, "--host_memory_gb", placement.gpus_per_node))
    uses = plan.host_use()
    assert sorted(uses) == [0, 1]
    for use in uses.values():  # 4 of the 8 ranks each: half of the 18 bytes per parameter
        assert use.optimizer == pytest.approx(4 * 18 * shape.num_params / 8)


def _tight_plan(capacity_gib, **budget):
    """One GPU too small for the actor's 60 GiB optimizer: the planner keeps it in host memory (CPU Adam, 80 GiB)."""
    actor = size("actor", "trainer", {"params": 4, "grads": 4, "optimizer": 60, "cache": 0}, host_optimizer=80)
    layout = {0: (GpuShare(actor), GpuShare(size("rollout", "engine", {"weights": 4, "kv_cache": 10})))}
    host = HostBudget(
        capacity_gib * GiB if capacity_gib is not None else None, budget.pop("source", "--host_memory_gb"), **budget
    )
    plan = plan_residency(layout, 40 * GiB, usable=1.0, host=host)
    assert plan.move("actor", "optimizer") == "host" and plan.fits()
    return plan


def test_a_plan_that_overfills_host_memory_is_refused_with_the_numbers_and_a_fix():
    plan = _tight_plan(64)
    with pytest.raises(PlacementError) as err:
        plan.check()
    text = str(err.value)
    assert err.value.field == "residency.host_memory_gb"  # core's words; the run's boundary says the flag
    assert "node 0: the plan keeps 80.0 GiB in host memory > 64.0 GiB available (--host_memory_gb)" in text
    assert "actor optimizer (CPU Adam) 80.0" in text and "3 processes" in text
    assert "Fix:" in text and "trainer.zero_stage 3" in text and "more host memory" in text
    assert (
        "host (node 0): 89.0 GiB of 64.0 GiB available, OVER: optimizer (CPU Adam) 80.0, offloaded 0.0" in plan.render()
    )
    # the states fit but not with the processes' ~9 GiB beside them: refused too, saying so
    with pytest.raises(PlacementError) as err:
        _tight_plan(85).check()
    assert (
        "80.0 GiB in host memory (actor optimizer (CPU Adam) 80.0 GiB) and its 3 processes need about 9 GiB "
        "more (an estimate): 89.0 GiB > 85.0 GiB available" in str(err.value)
    )
    _tight_plan(89.5).check()  # room for both


def test_the_process_estimate_alone_never_refuses_a_plan():
    tiny = size("actor", "trainer", {"params": 0.1, "grads": 0.1, "optimizer": 0.5, "cache": 0})
    layout = {0: (GpuShare(tiny), GpuShare(size("rollout", "engine", {"weights": 0.1, "kv_cache": 1})))}
    plan = plan_residency(layout, 40 * GiB, usable=1.0, host=HostBudget(2 * GiB, "--host_memory_gb"))
    plan.check()  # 3 processes (~9 GiB, an estimate) on 2 GiB: a note, not a refusal
    assert any(n.startswith("host (node 0)") for n in plan.all_notes())


def test_offloaded_states_over_the_capacity_name_the_pin_that_frees_them():
    layout = {0: (GpuShare(ACTOR), GpuShare(ROLLOUT))}
    plan = plan_residency(
        layout,
        80 * GiB,
        mode="all-sleep",
        engine_sleep_level=1,
        host=HostBudget(10 * GiB, "MemAvailable of this machine", local=True),
    )
    assert plan.move("rollout", "weights") == "offload"
    with pytest.raises(PlacementError) as err:
        plan.check()
    text = str(err.value)
    assert "the plan keeps 24.0 GiB" in text and "actor optimizer (offloaded) 12.0" in text
    assert "rollout weights (offloaded) 7.0" in text
    assert "residency.pins actor.optimizer=resident" in text
    assert "how much they have: residency.host_memory_gb N" in text  # local: say so


def test_near_the_capacity_with_the_processes_is_a_note_not_a_refusal():
    plan = _tight_plan(92)  # 80 GiB of states + ~9 GiB for three processes > 90 % of 92
    plan.check()
    (note,) = [n for n in plan.all_notes() if n.startswith("host (node 0)")]
    assert "80.0 GiB of states + ~9 GiB for 3 processes (an estimate) = 89.0 GiB" in note
    assert f"over {NEAR_FULL:.0%} of the 92.0 GiB available" in note
    assert "tight" in plan.render() and f"note: {note}" in plan.render()
    roomy = _tight_plan(200)
    assert not any(n.startswith("host") for n in roomy.all_notes()) and ", ok:" in roomy.render()
    data = plan.to_dict()
    assert data["host"]["available"] == 92 * GiB and data["host"]["source"] == "--host_memory_gb"
    node = data["host"]["nodes"]["0"]
    assert node["optimizer_cpu_adam"] == 80 * GiB and node["offloaded"] == 0 and node["processes"] == 3
    assert node["process_bytes"] == 3 * PROCESS_BYTES and node["items"] == {"actor.cpu_adam": 80 * GiB}
    assert note in data["notes"]


def test_unknown_capacity_and_other_nodes_are_said():
    unknown = _tight_plan(None, source="this machine's available memory is unknown (no /proc/meminfo)")
    unknown.check()  # nothing to check against
    assert any(n.startswith("host memory not checked") and "80.0 GiB" in n for n in unknown.all_notes())
    assert "not checked" in unknown.render()
    layout = {g: (GpuShare(ACTOR),) for g in range(16)}
    local = plan_residency(layout, 80 * GiB, host=HostBudget(500 * GiB, "MemAvailable of this machine", 8, local=True))
    assert any("node 1 is assumed to have as much available as this machine" in n for n in local.all_notes())
    given = plan_residency(layout, 80 * GiB, host=HostBudget(500 * GiB, "--host_memory_gb", 8))
    assert not any("assumed" in n for n in given.all_notes())
    assert "host (node 0):" in given.render() and "host (node 1):" in given.render()
    # a plan made without a budget still says what it keeps, and that it did not check
    assert "host (node 0): " in plan_residency(layout, 80 * GiB).render()


def test_memavailable_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   125829120 kB\n")
    assert available_memory(str(meminfo)) == 125829120 * 1024
    budget = local_budget(8, meminfo=str(meminfo), environ={})
    # 125 GiB in all, 120 available; Ray's memory monitor kills workers above 95 % of the total: 6.25 GiB never usable
    assert budget.bytes == pytest.approx(113.75 * GiB) and budget.local and budget.gpus_per_node == 8
    assert "Ray's memory monitor" in budget.source and "95%" in budget.source
    assert local_budget(meminfo=str(meminfo), environ={"RAY_memory_usage_threshold": "0.9"}).bytes == pytest.approx(
        107.5 * GiB
    )
    assert local_budget(meminfo=str(meminfo), environ={"RAY_memory_monitor_refresh_ms": "0"}).bytes == 120 * GiB
    missing = local_budget(meminfo=str(tmp_path / "absent"))
    assert missing.bytes is None and "unknown" in missing.source
    meminfo.write_text("MemTotal: 1 kB\n")  # an old kernel without MemAvailable
    assert local_budget(meminfo=str(meminfo)).bytes is None
