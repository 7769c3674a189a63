"""The run section: where a run saves, how it resumes and logs, which Ray cluster it runs on and its deadlines.

:class:`RunSettings` is built from the flat config by ``RLConfig.run_settings()`` (the rows of
:data:`hybrid_algos.train.sections.TABLE`); :meth:`~RunSettings.validate` holds the checks of these settings, naming
each as ``run.name`` (the config turns that into the flag the user wrote).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from hybrid_core.errors import ConfigError


@dataclass(frozen=True)
class RunSettings:
    """The run section (field names: OpenRLHF's)."""

    # ---- saving
    save_path: str = "./runs/hybrid"
    ckpt_path: str | None = None  # default: <save_path>/checkpoints
    save_steps: int = -1  # checkpoint every N steps; -1: only after the last step
    save_hf_ckpt: bool = False
    max_ckpt_num: int = 3
    final_checkpoint: bool = True
    resume: bool = False
    resume_if_exists: bool = False
    overwrite: bool = False
    trust_checkpoint: bool = False
    # ---- logging
    logging_steps: int = 1
    profile_step: int = 0  # 1-based; 0: no profile
    use_wandb: str | None = field(default=None, repr=False)  # may hold an API key: never in a printed section
    wandb_project: str = "hybrid"
    wandb_run_name: str | None = None
    use_tensorboard: bool = True
    seed: int = 42
    # ---- Ray and deadlines
    address: str | None = None
    ray_temp_dir: str | None = None
    ray_log_max_mb: int = 100
    num_gpus: int | None = None
    call_timeout_s: float = 600.0
    step_timeout_s: float = 3600.0
    # ---- CUDA MPS (hybrid_core.mps_daemon: why off is the default)
    mps: str = "off"  # auto | on | off
    mps_engine_share: int | None = None  # the engines' SM percentage under MPS (the other workers: the rest)

    @property
    def checkpoint_dir(self) -> str:
        return self.ckpt_path or os.path.join(self.save_path, "checkpoints")

    @property
    def saves_checkpoints(self) -> bool:
        """Whether the run writes to (or reads from) its checkpoint folder at all."""
        return self.save_steps > 0 or self.final_checkpoint or self.resume or self.resume_if_exists

    def validate(self) -> RunSettings:
        """Check these settings; return self."""
        for name in ("logging_steps", "max_ckpt_num", "ray_log_max_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"run.{name}",
                    f"must be a positive integer, got {value!r}.",
                    f"Give run.{name} a whole number >= 1.",
                )
        step = self.profile_step
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(
                "run.profile_step",
                f"must be a step number >= 1 (0: no profile), got {step!r}.",
                "E.g. run.profile_step 5 profiles the fifth step (after the warm-up of the first ones).",
            )
        if self.save_steps == 0 or self.save_steps < -1:
            raise ConfigError(
                "run.save_steps",
                f"must be -1 (only the final save) or >= 1, got {self.save_steps}.",
                "E.g. run.save_steps 10 to checkpoint every 10 steps.",
            )
        if self.resume and self.overwrite:
            raise ConfigError(
                "run.overwrite",
                "run.overwrite deletes the run that run.resume would continue.",
                "Keep one of them: run.resume continues the run, run.overwrite replaces it.",
            )
        if self.resume and not os.path.isdir(self.checkpoint_dir):
            raise ConfigError(
                "run.resume",
                f"no checkpoint folder at {self.checkpoint_dir!r}.",
                "Point run.ckpt_path (or run.save_path) at the run to continue, or drop run.resume.",
            )
        for name in ("call_timeout_s", "step_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ConfigError(
                    f"run.{name}",
                    f"must be a finite number of seconds > 0, got {value}.",
                    f"Every wait has a deadline; e.g. run.{name} 600.",
                )
        from hybrid_core.mps_daemon import MODES

        if self.mps not in MODES:
            raise ConfigError(
                "run.mps",
                f"must be one of {', '.join(MODES)}, got {self.mps!r}.",
                "E.g. run.mps auto: a CUDA MPS daemon of the run's own where generation overlaps training.",
            )
        share = self.mps_engine_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, int) or not 1 <= share <= 99):
            raise ConfigError(
                "run.mps_engine_share",
                f"must be a whole percentage from 1 to 99 (the trainers get the rest), got {share!r}.",
                "E.g. run.mps_engine_share 60; leave it out for no SM limit.",
            )
        if self.address and self.num_gpus is not None:
            raise ConfigError(
                "run.num_gpus",
                f"cannot declare GPUs when joining the running cluster at {self.address}.",
                "Drop run.num_gpus; the cluster's own GPUs are used.",
            )
        return self
