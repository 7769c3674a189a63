"""Turn-taking on shared GPUs: the asyncio logic alone, then the Ray actor with role workers on fake GPUs."""

import asyncio
import pickle
import random
import time

import pytest
import ray

from hybrid_core.cluster import gpus_hidden_as_fakes
from hybrid_core.errors import ConfigError, TurnTimeout
from hybrid_core.placement import PlacementSpec, place
from hybrid_core.remote import get_with_timeout
from hybrid_core.turnstile import Turnstile, TurnstileMisuse, TurnTable
from timing_bounds import HANG_S

TIMEOUT = 60


def run(coro):
    return asyncio.run(coro)


async def settle():
    for _ in range(5):  # let woken waiters run
        await asyncio.sleep(0)


# ---- the logic (asyncio, no Ray) -------------------------------------------------------------------------------
def test_a_role_waits_until_the_holder_releases():
    async def scenario():
        table = TurnTable()
        assert await table.acquire("actor", [0, 1], 1) is None
        waiting = asyncio.create_task(table.acquire("rollout", [1], 5))
        await settle()
        assert not waiting.done() and table.holders() == {0: "actor", 1: "actor"}
        await table.release("actor", [0, 1])
        assert await waiting is None
        assert table.holders() == {0: None, 1: "rollout"}

    run(scenario())


def test_ranks_of_one_role_share_its_turn_and_each_must_release():
    async def scenario():
        table = TurnTable()
        assert await table.acquire("actor", [0, 1], 1) is None
        assert await table.acquire("actor", [1], 1) is None  # rank 1 of the same role: no wait
        waiting = asyncio.create_task(table.acquire("rollout", [1], 5))
        await table.release("actor", [0, 1])
        await settle()
        assert not waiting.done() and table.holders()[1] == "actor"  # one hold of GPU 1 left
        await table.release("actor", [1])
        assert await waiting is None

    run(scenario())


def test_a_turn_on_several_gpus_is_all_or_nothing():
    async def scenario():
        table = TurnTable()
        await table.acquire("actor", [1], 1)
        rollout = asyncio.create_task(table.acquire("rollout", [0, 1], 5))
        await settle()
        assert table.holders() == {0: None, 1: "actor"}  # rollout took nothing while it waits
        # GPU 0 is free, but rollout asked for it first: a later single-GPU role queues behind it rather than
        # starving a wide (tensor-parallel) turn.
        critic = asyncio.create_task(table.acquire("critic", [0], 5))
        await settle()
        assert not critic.done()
        await table.release("actor", [1])
        assert await rollout is None and table.holders() == {0: "rollout", 1: "rollout"}
        await table.release("rollout", [0, 1])
        assert await critic is None

    run(scenario())


def test_waiters_are_served_first_come_first_served():
    async def scenario():
        table = TurnTable()
        await table.acquire("actor", [0], 1)
        rollout = asyncio.create_task(table.acquire("rollout", [0], 5))
        await settle()
        critic = asyncio.create_task(table.acquire("critic", [0], 5))
        await settle()
        await table.release("actor", [0])
        assert await rollout is None
        await settle()
        assert not critic.done()  # it asked later, so it still waits for rollout
        await table.release("rollout", [0])
        assert await critic is None

    run(scenario())


def test_the_holder_may_extend_its_turn_past_the_queue():
    async def scenario():
        table = TurnTable()
        await table.acquire("actor", [0], 1)
        rollout = asyncio.create_task(table.acquire("rollout", [0, 1], 5))
        await settle()
        # GPU 1 is free and rollout asked first, but rollout waits for actor: letting it block actor would deadlock.
        assert await table.acquire("actor", [1], 0.5) is None
        await table.release("actor", [0])
        await table.release("actor", [1])
        assert await rollout is None

    run(scenario())


def test_roles_on_different_gpus_do_not_wait_for_each_other():
    async def scenario():
        table = TurnTable()
        results = await asyncio.gather(
            table.acquire("actor", [0], 0.5), table.acquire("rollout", [1], 0.5), table.acquire("critic", [2, 3], 0.5)
        )
        assert results == [None, None, None]
        assert table.holders() == {0: "actor", 1: "rollout", 2: "critic", 3: "critic"}

    run(scenario())


def test_timeout_names_the_holder_and_the_gpu():
    async def scenario():
        table = TurnTable()
        await table.acquire("actor", [2, 3], 1)
        started = time.monotonic()
        message = await table.acquire("rollout", [1, 2], 0.3)
        assert 0.25 < time.monotonic() - started < HANG_S  # it waited out its 0.3 s (the bound only catches a hang)
        assert message.startswith("rollout waited 0.3 s for its turn on GPUs 1-2: actor holds GPU 2 (for ")
        assert "Fix:" in message and "actor sleeps and releases" in message
        assert table.holders() == {1: None, 2: "actor", 3: "actor"} and table.state()["waiting"] == []

    run(scenario())


def test_timeout_behind_the_queue_names_who_asked_first():
    async def scenario():
        table = TurnTable()
        await table.acquire("actor", [0], 1)
        critic = asyncio.create_task(table.acquire("critic", [0, 1], 5))
        await settle()
        message = await table.acquire("rollout", [1], 0.2)
        assert "critic asked first for GPU 1 and is still waiting" in message
        critic.cancel()

    run(scenario())


def test_release_of_a_gpu_not_held_is_reported_and_changes_nothing():
    async def scenario():
        table = TurnTable()
        await table.acquire("actor", [0], 1)
        message = await table.release("rollout", [0, 1])
        assert "rollout released GPUs it does not hold (GPU 0 is held by actor, GPU 1 is free)" in message
        assert table.holders()[0] == "actor"
        assert await table.release_all("actor") == [0]
        assert table.holders()[0] is None

    run(scenario())


def test_random_concurrent_schedule_keeps_one_role_per_gpu():
    """Many asyncio tasks (several ranks per role) taking random turns; an in-process monitor checks exclusivity."""

    async def scenario(seed):
        rng = random.Random(seed)
        table = TurnTable()
        awake = {}  # gpu -> {role: ranks awake}
        violations, concurrent_roles = [], set()

        async def rank(role, gpus):
            for _ in range(20):
                await asyncio.sleep(rng.uniform(0, 0.002))
                assert await table.acquire(role, gpus, 10) is None
                for g in gpus:
                    others = [r for r, n in awake.setdefault(g, {}).items() if n and r != role]
                    if others:
                        violations.append((g, role, others))
                    awake[g][role] = awake[g].get(role, 0) + 1
                concurrent_roles.add(frozenset(r for here in awake.values() for r, n in here.items() if n))
                await asyncio.sleep(rng.uniform(0, 0.002))
                for g in gpus:
                    awake[g][role] -= 1
                assert await table.release(role, gpus) is None

        ranks = [
            ("actor", [0]),
            ("actor", [1]),
            ("actor", [2]),
            ("rollout", [0, 1]),
            ("rollout", [2, 3]),
            ("critic", [1]),
            ("critic", [3]),
            ("reference", [0, 1, 2, 3]),
        ]
        await asyncio.gather(*(rank(role, gpus) for role, gpus in ranks))
        return violations, concurrent_roles, table.holders()

    for seed in range(3):
        violations, concurrent_roles, holders = run(scenario(seed))
        assert violations == []
        assert max(len(c) for c in concurrent_roles) >= 2  # disjoint turns did overlap: no global lock
        assert set(holders.values()) == {None}


# ---- the Ray actor --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    with gpus_hidden_as_fakes(4):  # GPUs hidden for a CPU run: Ray refuses fakes otherwise
        ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def make_classes():
    # Defined in a function so Ray pickles them by value (workers cannot import test modules).
    @ray.remote(num_cpus=0)
    class Monitor:
        """Sees every wake and sleep in the order they happen; flags two roles awake on one GPU."""

        def __init__(self):
            self.awake, self.open, self.intervals, self.violations = {}, {}, [], []

        def wake(self, role, rank, gpus):
            now = time.monotonic()
            for g in gpus:
                others = {r for r, _ in self.awake.get(g, set()) if r != role}
                if others:
                    self.violations.append((g, role, sorted(others)))
                self.awake.setdefault(g, set()).add((role, rank))
            self.open[(role, rank)] = now

        def sleep(self, role, rank, gpus):
            for g in gpus:
                self.awake[g].discard((role, rank))
            self.intervals.append((role, rank, tuple(gpus), self.open.pop((role, rank)), time.monotonic()))

        def report_and_reset(self):
            report = self.intervals, self.violations
            self.awake, self.open, self.intervals, self.violations = {}, {}, [], []
            return report

    @ray.remote
    class RoleWorker:
        def __init__(self, role, rank, gpus, turnstile):
            self.role, self.rank, self.gpus, self.turnstile = role, rank, gpus, turnstile

        def gpu_ids(self):
            return ray.get_gpu_ids()

        def run(self, monitor, seed, steps, gap_s, awake_s, take_turns=True):
            """Wake and sleep ``steps`` times at random moments, telling the monitor each time."""
            rng = random.Random(seed)
            for _ in range(steps):
                time.sleep(rng.uniform(0, gap_s))
                if take_turns:
                    self.turnstile.acquire(self.role, self.gpus, timeout_s=TIMEOUT)
                ray.get(monitor.wake.remote(self.role, self.rank, self.gpus), timeout=TIMEOUT)
                time.sleep(rng.uniform(0, awake_s))
                ray.get(monitor.sleep.remote(self.role, self.rank, self.gpus), timeout=TIMEOUT)
                if take_turns:
                    self.turnstile.release(self.role, self.gpus)
            return steps

        def hold(self, gpus):
            self.turnstile.acquire(self.role, gpus, timeout_s=TIMEOUT)
            return True

    return Monitor, RoleWorker


def overlaps(intervals):
    """Pairs of intervals of different roles on a common GPU that overlap in time."""
    found = []
    for i, (role_a, _, gpus_a, start_a, end_a) in enumerate(intervals):
        for role_b, _, gpus_b, start_b, end_b in intervals[i + 1 :]:
            if role_a != role_b and set(gpus_a) & set(gpus_b) and start_a < end_b and start_b < end_a:
                found.append((role_a, role_b, sorted(set(gpus_a) & set(gpus_b))))
    return found


@pytest.fixture(scope="module")
def placed_workers(cluster):
    """Six role workers on three shared fake GPUs: actor on 0-2, a TP-2 engine on 0-1, critic on 1-2."""
    plan = PlacementSpec.from_ranges({"actor": "0-2", "rollout": "0-1", "critic": "1-2"}, tp={"rollout": 2}).plan()
    placed = place(plan, timeout_s=TIMEOUT)
    turnstile = Turnstile.create("test-turnstile-schedule", timeout_s=TIMEOUT)
    Monitor, RoleWorker = make_classes()
    workers = {}
    for name, role in plan.roles.items():
        for w in role.workers:
            workers[(name, w.rank)] = RoleWorker.options(**placed.actor_options(name, w.rank)).remote(
                name, w.rank, list(w.gpus), turnstile
            )
    monitor = Monitor.remote()
    yield plan, placed, turnstile, workers, monitor, RoleWorker
    ray.kill(monitor)
    for worker in workers.values():
        ray.kill(worker)
    turnstile.kill()
    placed.remove()


def run_schedule(placed_workers, seed, take_turns, steps, gap_s, awake_s):
    _plan, _placed, _turnstile, workers, monitor, _ = placed_workers
    refs = [
        worker.run.remote(monitor, seed * 100 + i, steps, gap_s, awake_s, take_turns)
        for i, worker in enumerate(workers.values())
    ]
    assert get_with_timeout(refs, TIMEOUT, "schedule") == [steps] * len(workers)
    intervals, violations = get_with_timeout(monitor.report_and_reset.remote(), TIMEOUT, "monitor")
    assert len(intervals) == steps * len(workers)
    return intervals, violations


def test_workers_sit_on_their_shared_fake_gpus(placed_workers):
    plan, placed, _, workers, _, _ = placed_workers
    for (name, rank), worker in workers.items():
        first = plan.roles[name].workers[rank].gpus[0]
        found = get_with_timeout(worker.gpu_ids.remote(), TIMEOUT, "gpu ids")
        assert [str(g) for g in found] == [str(placed.device(first).gpu_id)]  # fake GPUs' ids come back as text


def test_random_wake_sleep_schedule_never_has_two_roles_awake_on_a_gpu(placed_workers):
    intervals, violations = run_schedule(placed_workers, seed=1, take_turns=True, steps=15, gap_s=0.01, awake_s=0.01)
    assert violations == []
    assert overlaps(intervals) == []
    _, _, turnstile, _, _, _ = placed_workers
    assert set(turnstile.holders().values()) == {None}  # every turn was given back


def test_the_same_schedule_without_turns_does_overlap(placed_workers):
    """Control: proves the monitor would see a broken turnstile."""
    intervals, violations = run_schedule(placed_workers, seed=2, take_turns=False, steps=8, gap_s=0.002, awake_s=0.03)
    assert violations and overlaps(intervals)


def test_timeout_names_the_role_holding_the_gpu(cluster):
    turnstile = Turnstile.create("test-turnstile-timeout", timeout_s=TIMEOUT)
    try:
        turnstile.acquire("actor", [0, 1])
        with pytest.raises(TurnTimeout) as err:
            turnstile.acquire("rollout", [1, 2], timeout_s=0.5)
        assert "rollout waited 0.5 s for its turn on GPUs 1-2: actor holds GPU 1" in str(err.value)
        assert turnstile.holders() == {0: "actor", 1: "actor", 2: None}
        turnstile.release("actor", [0, 1])
        with turnstile.turn("rollout", [1, 2], timeout_s=5):
            assert turnstile.holders()[1] == "rollout"
        assert turnstile.holders()[1] is None
    finally:
        turnstile.kill()


def test_a_dead_holder_is_named_and_release_all_frees_its_gpus(placed_workers):
    _, _, _, _, _, RoleWorker = placed_workers
    turnstile = Turnstile.create("test-turnstile-dead", timeout_s=TIMEOUT)
    try:
        crashing = RoleWorker.options(num_cpus=0).remote("critic", 0, [3], turnstile)
        assert get_with_timeout(crashing.hold.remote([3]), TIMEOUT, "hold")
        ray.kill(crashing)  # dies mid-turn, never releases
        with pytest.raises(TurnTimeout) as err:
            turnstile.acquire("actor", [3], timeout_s=0.3)
        assert "critic holds GPU 3" in str(err.value)
        assert turnstile.release_all("critic") == [3]
        turnstile.acquire("actor", [3], timeout_s=1)
    finally:
        turnstile.kill()


def test_create_gets_the_existing_turnstile_and_handles_travel(cluster):
    first = Turnstile.create("test-turnstile-shared", timeout_s=TIMEOUT)
    try:
        first.acquire("rollout", [0])
        again = Turnstile.create("test-turnstile-shared")
        copy = pickle.loads(pickle.dumps(Turnstile.get("test-turnstile-shared")))
        assert again.holders() == copy.holders() == {0: "rollout"}
        with pytest.raises(TurnstileMisuse) as err:
            copy.release("actor", [0])
        assert "actor released GPUs it does not hold (GPU 0 is held by rollout)" in str(err.value)
    finally:
        first.kill()


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda ts: ts.acquire("", [0]), "role"),
        (lambda ts: ts.acquire("actor", []), "gpus"),
        (lambda ts: ts.acquire("actor", [-1]), "gpus"),
        (lambda ts: ts.acquire("actor", "0"), "gpus"),
        (lambda ts: ts.acquire("actor", [0], timeout_s=0), "timeout_s"),
        (lambda ts: ts.acquire("actor", [0], timeout_s=float("inf")), "timeout_s"),
    ],
)
def test_bad_arguments_are_config_errors(call, field):
    turnstile = Turnstile(actor=None, name="unused")  # checked before any call reaches Ray
    with pytest.raises(ConfigError) as err:
        call(turnstile)
    assert err.value.field == field
