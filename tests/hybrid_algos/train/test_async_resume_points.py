"""Lossless resume of asynchronous training (issue 41), killed at several points: a checkpoint keeps every batch
generated ahead of the trainer, a generation in flight is made again after ``--resume`` exactly as it was, and the
resumed run continues step for step as the run that never stopped.

Real runs on a local Ray with two fake GPUs (the built-in engine, DeepSpeed on CPU); the failures are real ones,
injected with ``HYBRID_FAULT`` (hybrid_core/faults.py): a process that exits, or a call that raises. Each kill
point's runs are compared, step by step, with one uninterrupted run of the same settings (shared by the module).
"""

from __future__ import annotations

import pytest
from tiny_runs import TINY, tiny_config

from hybrid_algos.train import train
from hybrid_algos.train.checkpoint import CheckpointManager
from hybrid_core.errors import HybridError

pytestmark = pytest.mark.usefixtures("two_gpu_ray")

#: staleness 2: two batches may wait ahead of the trainer (checkpoints after steps 2 and 4, and the last one)
TWO = dict(max_steps=5, save_steps=2, async_train=True, async_max_staleness=2)
#: one-step-off
ONE = dict(max_steps=5, save_steps=2, async_train=True, async_max_staleness=1)


def _comparable(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith("time/") and k != "async/wait_s"}


class _Steps:
    """The metrics of every step a run finished (a killed run returns no summary)."""

    def __init__(self):
        self.seen = []

    def on_step(self, metrics):
        self.seen.append(metrics)


_straight: dict[str, list[dict]] = {}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run of a setting (``"TWO"`` / ``"ONE"``), made once per module on first use."""

    def history(name: str) -> list[dict]:
        if name not in _straight:
            summary = train(tiny_config(tmp_path_factory.mktemp(f"straight-{name}"), **globals()[name]))
            _straight[name] = summary["history"]
        return _straight[name]

    return history


def _killed(tmp_path, monkeypatch, settings, fault):
    """A run that ``fault`` ends; the steps it finished and the error it ended with."""
    monkeypatch.setenv("HYBRID_FAULT", fault)
    steps = _Steps()
    with pytest.raises(HybridError) as info:
        train(tiny_config(tmp_path, **settings), callbacks=[steps])
    monkeypatch.delenv("HYBRID_FAULT")  # the resumed run's workers must not inherit it
    return steps.seen, str(info.value)


def _state(tmp_path):
    """The driver state of the checkpoint a resume would take."""
    ckpt = CheckpointManager(str(tmp_path / "checkpoints"))
    path, _ = ckpt.latest()
    return ckpt.load_driver_state(path)


def _checkpoint(tmp_path):
    """(next step, [(step, generation version) of each batch queued, then of the generation in flight]) of the
    checkpoint a resume would take. Which of the batches ahead were done when the checkpoint was taken, and which one
    was still being generated, depends on timing (the generation right after a weight update races the save), so
    the tests look at them together: every one is kept, as a batch or as the record of a generation to make again."""
    state = _state(tmp_path)
    ahead = [(b["step"], b["version"]) for b in state["async_queue"]]
    in_flight = state["async_in_flight"]
    if in_flight is not None:
        ahead.append((in_flight["step"], in_flight["version"]))
    return state["next_step"], ahead


def _same_steps(got, expected, first):
    """``got`` are steps ``first``, ``first + 1``, ... and equal the uninterrupted run's, step for step."""
    assert [int(m["step"]) for m in got] == list(range(first, first + len(got)))
    for m in got:
        assert _comparable(m) == _comparable(expected[int(m["step"])]), f"step {int(m['step']) + 1} differs"


def test_engine_dies_generating_ahead_while_the_checkpoint_is_saved(tmp_path, monkeypatch, straight):
    """Staleness 2, points (a) and (c): the weight update after step 2 lets the producer start batch 5 (index 4,
    version 2) at once, and the checkpoint after step 2 is saved while it runs; the engine's process exits in that
    generation (a second after it started: the checkpoint is written by then). The checkpoint holds the two batches
    queued ahead (3 and 4, made with versions 0 and 1) and the record of the one in flight (batch 5: version 2, its
    prompts and seed), which the resume generates again with the restored weights, token for token.

    Step 3 trains on the queue but does not finish: its weight update (to version 3) is where batch 5, the last one
    version 2 generates, must be done (the rule of :mod:`hybrid_algos.train.async_loop` that makes every batch's
    version fixed), so the run ends there with the engine's death, having finished steps 1 and 2 (an earlier
    version of this test expected step 3 to finish, which the rule rules out)."""
    expected = straight("TWO")
    done, error = _killed(tmp_path, monkeypatch, TWO, "rollout:generate:die:5")  # batches 1-4 are calls 1-4
    assert "rollout" in error and "died" in error and "step 5" in error, error  # it died generating batch 5
    state = _state(tmp_path)
    assert [(b["step"], b["version"]) for b in state["async_queue"]] == [(2, 0), (3, 1)]
    in_flight = state["async_in_flight"]  # the engine died in it: it cannot have been done by then
    assert (in_flight["step"], in_flight["version"]) == (4, 2), in_flight
    assert len(in_flight["prompts"]) == TINY["rollout_batch_size"] and in_flight["seed"] is not None, in_flight
    _same_steps(done, expected, 0)
    assert len(done) == 2  # step 3 trained on the queue; its weight update waited for the lost batch 5

    resumed = train(tiny_config(tmp_path, **TWO, resume=True))
    assert resumed["start_step"] == 2 and len(resumed["history"]) == 5
    # batches 3 and 4 are the checkpoint's (versions 0 and 1: the engines held version 2 at the resume), batch 5 the
    # regenerated one
    assert [m["async/generation_version"] for m in resumed["history"]] == [0, 0, 0, 1, 2]
    _same_steps(resumed["history"], expected, 0)


def test_trainer_dies_between_checkpoints_and_the_resume_regenerates_what_was_lost(tmp_path, monkeypatch, straight):
    """Staleness 2, point (b): the actor's process exits in step 4's update, after step 3 trained past the
    checkpoint of step 2 and batch 5 (the last of the run's five) was generated ahead: all of that is lost, and the
    resume from the checkpoint of step 2 (batches 3 and 4 queued, batch 5 queued or recorded as in flight) makes it
    again exactly."""
    expected = straight("TWO")
    done, error = _killed(tmp_path, monkeypatch, TWO, "actor:train:die:4")
    assert "actor rank 0: train" in error and "died" in error and "step 4" in error, error
    _same_steps(done, expected, 0)
    assert len(done) == 3  # step 3 finished after the checkpoint: it is done again
    assert _checkpoint(tmp_path) == (2, [(2, 0), (3, 1), (4, 2)])

    resumed = train(tiny_config(tmp_path, **TWO, resume=True))
    assert resumed["start_step"] == 2
    _same_steps(resumed["history"], expected, 0)
    assert len(resumed["history"]) == 5


def test_one_step_off_dies_while_saving_and_resumes_from_the_checkpoint_before(tmp_path, monkeypatch, straight):
    """Staleness 1, point (d): the actor's process exits while it saves the checkpoint of step 4 (the generation of
    batch 5 in flight). Nothing of that checkpoint is kept; the resume takes the one of step 2 (batch 3 queued) and
    does steps 3-5 again as the uninterrupted run did them. The generation of batch 4 (version 2), which the weight
    update after step 2 let start, is in that checkpoint too: queued, or recorded as in flight."""
    expected = straight("ONE")
    done, error = _killed(tmp_path, monkeypatch, ONE, "actor:save_checkpoint:die:2")
    assert "actor rank 0: save_checkpoint" in error and "died" in error, error
    _same_steps(done, expected, 0)
    assert len(done) == 4
    assert _checkpoint(tmp_path) == (2, [(2, 1), (3, 2)])

    resumed = train(tiny_config(tmp_path, **ONE, resume=True))
    assert resumed["start_step"] == 2
    assert [m["async/generation_version"] for m in resumed["history"]] == [0, 0, 1, 2, 3]
    _same_steps(resumed["history"], expected, 0)


def test_the_generation_in_flight_is_recorded_and_made_again_from_the_record():
    """The checkpoint records the generation in flight (or due to start) with its prompts and seed, and the resumed
    producer makes that generation from the record, not from its own data order (which gives the same prompts and
    seed for the same --seed and step: the real runs above check the batch comes out the same); other batches come
    from the data order."""
    from types import SimpleNamespace

    from hybrid_algos.train.async_loop import AsyncRunner
    from hybrid_engines.protocol import SamplingParams

    prompts = [f"prompt {i}" for i in range(8)]

    def session(order_from: int, seed_from: int):
        return SimpleNamespace(
            settings=SimpleNamespace(
                rollout=SimpleNamespace(async_max_staleness=2, partial_rollout=False),
                run=SimpleNamespace(step_timeout_s=5),
            ),
            prep=SimpleNamespace(total_steps=5, prompts=prompts),
            ctx=None,
            start_step=2,
            engines=SimpleNamespace(set_weight_version=lambda version: None),
            prompts_for=lambda j: prompts[order_from + j : order_from + j + 2],
            sampling=lambda j: SamplingParams(seed=seed_from + j),
        )

    saving = AsyncRunner(session(0, 100), "split")
    due = saving.checkpoint_state(2)  # nothing queued: batch 3 (index 2, version 2) is due to start
    assert due == {"async_queue": [], "async_in_flight": {"step": 2, "version": 2, "prompts": [2, 3], "seed": 102}}
    saving.generating, saving.generating_what = 2, (prompts[5:7], 7, 2)  # running, with these prompts and seed
    running = saving.checkpoint_state(2)["async_in_flight"]
    assert running == {"step": 2, "version": 2, "prompts": [5, 6], "seed": 7}

    resumed = AsyncRunner(session(1, 500), "split", [], running)  # a data order and seeds unlike the saved run's
    made, sampling = resumed._inputs(2)
    assert made == prompts[5:7] and sampling.seed == 7  # the record's
    made, sampling = resumed._inputs(3)
    assert made == prompts[4:6] and sampling.seed == 503  # the data order's
    ignored = AsyncRunner(session(1, 500), "split", [], {**running, "step": 3})  # not the next generation: unused
    assert ignored._inputs(3)[0] == prompts[4:6]
