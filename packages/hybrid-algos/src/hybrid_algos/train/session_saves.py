"""A session's saves: the driver's state and every trainer's DeepSpeed state in a checkpoint (:mod:`.checkpoint`),
a resume from one (chosen and checked by ``prepare``), and the trained policy in Hugging Face format at the end. Each
asks the residency owner for the recipe's phase in which the role holds what it saves or loads.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from typing import Any

from .session_state import SessionState

log = logging.getLogger(__name__)


class SessionSaves(SessionState):
    """The checkpoint part of :class:`~.session.TrainingSession`."""

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    def driver_state(self, next_step: int) -> dict[str, Any]:
        """Plain data only (saved as JSON): nothing read back from a checkpoint can run code."""
        kl = self.ctx.kl_controller
        return {
            "next_step": next_step,
            "kl": kl.state_dict() if kl is not None else None,
            "reward_norm": self.reward.state_dict(),
            "history": self.history,
            **self.prep.config_record,  # "config" and "essentials": what a resume is checked against
            # batches generated ahead of the trainer (asynchronous training), which a resumed run trains on, and the
            # generation in flight, which it makes again from the prompts and seed recorded
            **(
                self.runner.checkpoint_state(next_step)
                if self.runner is not None
                else {"async_queue": [], "async_in_flight": None}
            ),
        }

    def save_checkpoint(self, next_step: int) -> str:
        def save_roles(folder: str) -> None:
            for group in (self.actor, self.critic):
                if group is not None:
                    # DeepSpeed saves from the GPU
                    self.started_owner.to_phase_state(self.prep.recipe.train_phase(group.role))
                    group.call("save_checkpoint", os.path.join(folder, group.role), "state")

        return self.ckpt.save(next_step, save_roles, self.driver_state(next_step))

    def _resume(self, point) -> None:
        """Load ``point`` (a :class:`~.resume.ResumePoint` chosen and checked by ``prepare``) into every role."""
        path, state = point.path, point.state
        for group in (self.actor, self.critic):
            if group is not None:
                # DeepSpeed loads into the GPU
                self.started_owner.to_phase_state(self.prep.recipe.train_phase(group.role))
                group.call("load_checkpoint", os.path.join(path, group.role), "state")
        if self.ctx.kl_controller is not None and state["kl"] is not None:
            self.ctx.kl_controller.load_state_dict(state["kl"])
        self.reward.load_state_dict(state["reward_norm"])
        self.history = list(state["history"])
        self.start_step = int(state["next_step"])
        from .resume import drop_steps_from

        # the steps done after this checkpoint are done again: their spans go (the writer appends at the new end)
        drop_steps_from(os.path.join(self.prep.run_dir, "timeline.jsonl"), self.start_step)
        self.restored_queue = list(state.get("async_queue") or [])
        self.restored_in_flight = state.get("async_in_flight")  # None in checkpoints of older versions
        if self.restored_queue and not self.settings.rollout.async_train:
            log.warning(
                "the checkpoint holds %d batches generated ahead (--async_train); this run is synchronous "
                "and generates them again",
                len(self.restored_queue),
            )
        # The engines still hold the pretrained weights: give them the restored actor's. The first step's phases
        # then move everything where the plan wants it, as after any sync.
        self.started_owner.to_phase_state(self.prep.recipe.work_phase("sync"))
        self.weight_sync.sync(wake_engines=False)
        log.info("resumed from %s at step %d", path, self.start_step)

    def save_final_model(self) -> str:
        """The trained policy in Hugging Face format, written atomically to ``<save_path>/final``."""
        from .checkpoint import CheckpointError, out_of_space

        final = os.path.join(self.prep.run_dir, "final")
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            # the actor's weights on its GPUs (the recipe's phase that trains it): it saves from there
            self.started_owner.to_phase_state(self.prep.recipe.train_phase(self.actor.role))
            self.actor.call("save_pretrained", tmp, self.prep.model_path)
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)  # an interrupted or failed save leaves nothing half-written
            if isinstance(error, Exception) and out_of_space(error, self.prep.run_dir):
                raise CheckpointError(
                    f"no space left on device: the final model did not fit in {self.prep.run_dir}. "
                    "Fix: free disk space (or keep fewer checkpoints: --max_ckpt_num), then "
                    "--resume to save it."
                ) from error
            raise
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        return final
