"""``train(config)``: the whole job — :func:`~.prepare.prepare` (before Ray), the Ray cluster, the
:class:`~.session.TrainingSession` (set-up, the steps, checkpoints, the final model) under SIGTERM and a watch on
Ray's GCS — and the tear-down of everything the run started, however it ends.

The per-algorithm entry points (``hybrid_algos.train.train_ppo`` ...) only choose a config and a recipe
(:mod:`.recipes`); what a step does is :mod:`.step`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from hybrid_core.errors import HybridError

from .checkpoint import CheckpointManager
from .config import RLConfig
from .prepare import Prepared, prepare
from .session import TrainingSession, emit

log = logging.getLogger(__name__)


def train(config: RLConfig, *, callbacks: Sequence[Any] = (), recipe: Any = None) -> dict[str, Any]:
    """Run a whole training job; returns a summary (steps, final metrics, saved paths). ``recipe``: its roles and
    phases (default: the config's, :func:`~.recipes.recipe_for`).

    In the main thread, SIGTERM is preemption (:class:`~.failures.Preemption`): the step running finishes, a
    checkpoint is saved, then :class:`~.failures.Terminated` (a KeyboardInterrupt) is raised; a lost Ray GCS ends the
    run at once with :class:`~.failures.ClusterLost`. However it ends, the roles, engines, a Ray started here and
    every process they started on this node (:mod:`hybrid_core.run_processes`) are ended before it returns."""
    from hybrid_core.mps_daemon import daemon_for_run

    prep = prepare(config, recipe)
    try:  # `--mps on|auto`: the run's own CUDA MPS daemon outlives Ray's workers (started before, stopped after)
        with daemon_for_run(prep.mps, os.path.join(prep.run_dir, "logs", "mps"), prep.settings.run.ray_temp_dir):
            return _train_prepared(prep, callbacks)
    finally:
        prep.locks.release()  # the folder is free for the next run (a run that dies leaves a lock that is stale)


def _train_prepared(prep: Prepared, callbacks: Sequence[Any]) -> dict[str, Any]:
    from hybrid_core.cluster import connect, gcs_answers, shutdown
    from hybrid_core.run_processes import RUN_TAG_ENV, end_leftovers, new_tag
    from hybrid_core.runtime_env import set_worker_env

    from .cluster_watch import ClusterWatch
    from .deepspeed_ops import ensure_cpu_ops_built
    from .failures import ClusterLost, Terminated, explain, resume_hint, sigterm_as_interrupt

    run = prep.settings.run
    address = run.address or os.environ.get("RAY_ADDRESS")
    if address and not _ray_connected():  # a cluster that is not there fails now, not after the ops are built
        from hybrid_core.cluster import check_gcs

        check_gcs(address, source="address" if run.address else "RAY_ADDRESS")
    built_s = ensure_cpu_ops_built()  # before any worker: one build, not one per role racing for torch's lock
    if built_s > 5:
        log.info("set-up: DeepSpeed CPU ops ready in %.1f s", built_s)

    tag = new_tag()
    set_worker_env({RUN_TAG_ENV: tag})  # every worker, and what it starts, carries it: ended at the very end
    from .sections import flag_words

    with flag_words():  # core's errors name the run's settings
        cluster = connect(
            run.address,
            num_gpus=run.num_gpus if run.num_gpus is not None else (None if address else prep.plan.num_gpus),
            temp_dir=run.ray_temp_dir,
            log_max_mb=run.ray_log_max_mb,
        )
    session = None
    watch = ClusterWatch(cluster.address)
    try:
        with sigterm_as_interrupt() as preemption, watch:  # after connect: ray.init replaces the SIGTERM handler
            ended = False
            try:
                session = TrainingSession(prep)
                session.preemption = preemption
                try:
                    session.start()
                except HybridError as e:  # the role and GPU that failed are in e; say it was the start-up
                    raise explain("start-up", e, log_dir=session.log_dir, ckpt=session.ckpt) from e
                emit(
                    callbacks,
                    "on_start",
                    {
                        "plan": prep.plan,
                        "residency": prep.residency,
                        "total_steps": prep.total_steps,
                        "run_dir": prep.run_dir,
                        "lines": prep.start_lines,
                        "config": prep.config,
                        "start_step": session.start_step,
                    },
                )
                summary = session.run(callbacks)
                emit(callbacks, "on_end", summary)
                ended = True
                return summary
            except KeyboardInterrupt as e:
                if preemption.requested and not isinstance(e, Terminated):  # the watch's interrupt after SIGTERM
                    raise Terminated(
                        "Ray's GCS stopped too (the signal reached Ray's processes as well), so no "
                        "checkpoint could be saved."
                    ) from None
                if watch.lost:
                    steps = len(session.history) if session is not None else 0
                    raise ClusterLost(
                        f"Ray's GCS at {cluster.address} stopped answering after step {steps}; no "
                        f"Ray call can succeed without it, so the run ends. "
                        f"{resume_hint(CheckpointManager(run.checkpoint_dir))}"
                    ) from None
                raise
            finally:
                if session is not None:  # a dead GCS makes every Ray call of the tear-down wait: none is made then
                    session.close(cluster_lost=watch.lost or not gcs_answers(cluster.address, 1.0), hurry=not ended)
    finally:
        try:
            if cluster.started_here:
                shutdown(cluster)
        finally:
            end_leftovers(tag)  # vLLM's / SGLang's child processes a killed actor leaves behind, on this node


def _ray_connected() -> bool:
    import ray

    return ray.is_initialized()
