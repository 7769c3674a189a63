"""The one place that decides the environment of every Ray worker hybrid starts.

Ray workers do not inherit the driver's shell: a variable such as LD_LIBRARY_PATH set in ``.bashrc`` is missing in a
job submitted with ``ray job submit`` (the seed lost days to this). Every actor hybrid creates takes
``worker_runtime_env()``, which carries the driver's values of the variables below plus anything the user adds,
and runs :func:`hybrid_core.stacks.install` in each worker before its actor is built (stacks on request).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

#: Forwarded from the driver when set there (exact names, then prefixes).
FORWARDED = (
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "CUDA_HOME",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TORCH_EXTENSIONS_DIR",
    "TORCH_CUDA_ARCH_LIST",
    "TOKENIZERS_PARALLELISM",
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
    "RAY_AUTH_MODE",
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
)
FORWARDED_PREFIXES = ("NCCL_", "VLLM_", "SGLANG_", "HYBRID_", "TORCH_NCCL_", "CUDA_DEVICE_", "DS_")

_extra: dict[str, str] = {}


def set_worker_env(env: Mapping[str, str]) -> None:
    """Add variables every worker started after this call sees (e.g. the CLI's ``KEY=VALUE`` pairs)."""
    for key, value in env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            from .errors import ConfigError

            raise ConfigError("env", f"{key!r} is not a valid environment variable name.")
        _extra[key] = str(value)


def drop_worker_env(names: Iterable[str]) -> None:
    """Take back variables :func:`set_worker_env` added (a run's own, once it ended), for workers started later."""
    for key in names:
        _extra.pop(key, None)


def worker_env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a worker gets: the forwarded ones present in ``environ`` (default: os.environ) plus extras."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k in FORWARDED or k.startswith(FORWARDED_PREFIXES)}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked tokenizers deadlock warnings otherwise
    env.update(_extra)
    return env


#: Ray's per-worker setup hook is read from this variable when the worker process starts. Ray documents the hook only
#: as a job-level ``runtime_env`` field; setting the variable per actor gives each hybrid worker the hook without
#: taking the job-level one away from the user's own jobs.
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
SETUP_HOOK = "hybrid_core.stacks.install"


def worker_runtime_env(extra: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A Ray ``runtime_env`` for ``Actor.options(runtime_env=...)``: merged by Ray with the job's own."""
    env = worker_env_vars()
    if extra:
        env.update(extra)
    env.setdefault(SETUP_HOOK_ENV, SETUP_HOOK)
    return {"env_vars": env}
