"""``--agent_func_path``: load an environment file (OpenRLHF's or hybrid's) on the driver, before Ray starts.

Accepted forms: ``FILE.py`` (it defines ``AgentExecutor``, as OpenRLHF expects, or ``Environment``),
``FILE.py:NAME`` or ``package.module:NAME`` (``NAME`` is an OpenRLHF executor class or an environment class /
factory). Where OpenRLHF is not installed, a file importing ``openrlhf.utils.agent`` gets
:mod:`.openrlhf_standin` under that name while it loads (a log line says so); nothing else of OpenRLHF exists then,
and importing another name is an error naming it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import types
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_core.errors import ConfigError

from . import openrlhf_standin

if TYPE_CHECKING:
    from ..model_settings import ModelSettings

log = logging.getLogger(__name__)

FIELD = "agent_func_path"
STANDIN_MODULES = ("openrlhf", "openrlhf.utils", "openrlhf.utils.agent")


@dataclass
class AgentSpec:
    """A loaded environment: an OpenRLHF executor, or a factory of hybrid environments (one per sample)."""

    kind: str  # "openrlhf" | "environment"
    source: str  # what messages name: the file, or module:NAME
    executor: Any = None  # kind "openrlhf": the AgentExecutor instance
    factory: Callable[[], Any] | None = None  # kind "environment"
    standin: bool = False  # loaded with hybrid's stand-in for openrlhf.utils.agent
    builtin: bool = False  # a built-in task's environment


def split_path(path: str) -> tuple[str, str | None, bool]:
    """``(file or module, NAME or None, is a file)`` of an ``--agent_func_path`` value."""
    if path.endswith(".py") or os.path.isfile(path):
        return path, None, True
    target, sep, name = path.rpartition(":")
    if sep and target and name.isidentifier():
        return target, name, target.endswith(".py") or os.path.isfile(target)
    return path, None, False


def check_agent_path(path: str) -> None:
    """Cheap checks for ``RLConfig.validate``: the file exists, or the module can be found."""
    target, name, is_file = split_path(path)
    if is_file:
        if not os.path.isfile(target):
            raise ConfigError(
                FIELD,
                f"no file at {target!r}.",
                "Give the path of your agent's .py file (OpenRLHF's "
                "AgentExecutor, or a class Environment with reset / step).",
            )
        return
    if name is None:
        raise ConfigError(
            FIELD,
            f"{path!r} is neither a .py file nor module:NAME.",
            "E.g. --agent_func_path agent.py, agent.py:MyEnv or my_package.envs:MyEnv.",
        )
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ConfigError(
            FIELD, f"cannot find module {target!r}.", "Make it importable (PYTHONPATH), or give its .py file."
        )


def load_agent(path: str) -> AgentSpec:
    """Import the agent ``path`` names and say what it is; every problem is a ``ConfigError`` naming the file."""
    check_agent_path(path)
    target, name, is_file = split_path(path)
    with openrlhf_names() as standin:
        module = _import(target, is_file, path)
    if name is not None:
        if not hasattr(module, name):
            raise ConfigError(FIELD, f"{target} defines no {name!r}.", f"Define {name} in it, or name what it defines.")
        obj = getattr(module, name)
        kind = "openrlhf" if _is_executor_class(obj) else "environment"
    elif hasattr(module, "AgentExecutor"):
        obj, kind = module.AgentExecutor, "openrlhf"
    elif hasattr(module, "Environment"):
        obj, kind = module.Environment, "environment"
    else:
        raise ConfigError(
            FIELD,
            f"{path} defines neither AgentExecutor (OpenRLHF's agent files) nor Environment (hybrid's interface).",
            "Define one of them (see hybrid_algos.train.agents), or name the class: --agent_func_path FILE.py:NAME.",
        )
    if kind == "openrlhf":
        spec = AgentSpec("openrlhf", path, executor=_make_executor(obj, path), standin=standin)
        if standin:
            log.info(
                "agent %s: OpenRLHF is not installed; its imports of openrlhf.utils.agent got hybrid's stand-in "
                "(%s), installed only while the file loaded",
                path,
                ", ".join(openrlhf_standin.NAMES),
            )
        return spec
    if not callable(obj):
        raise ConfigError(
            FIELD,
            f"{path}: {getattr(obj, '__name__', name)} is a {type(obj).__name__}, not a class "
            "or factory of environments.",
            "Give a class with reset(prompt, label) and step(action).",
        )
    if isinstance(obj, type) and not callable(getattr(obj, "step", None)):
        raise ConfigError(
            FIELD,
            f"{path}: {obj.__name__} has no step method.",
            "Define step(self, action) -> StepResult (see hybrid_algos.train.agents.environment).",
        )
    return AgentSpec("environment", path, factory=obj, standin=standin)


def builtin_agent(models: ModelSettings) -> AgentSpec:
    """The environment of the models section's built-in agent task (``--task lookup``)."""
    from .lookup import LookupEnvironment

    return AgentSpec("environment", f"the built-in {models.task!r} task", factory=LookupEnvironment, builtin=True)


@contextlib.contextmanager
def openrlhf_names() -> Iterator[bool]:
    """While the block runs, ``openrlhf.utils.agent`` is :mod:`.openrlhf_standin` if OpenRLHF is not installed;
    yields whether the stand-in is in place. What ``sys.modules`` held before is put back afterwards."""
    try:
        installed = importlib.util.find_spec("openrlhf") is not None
    except (ImportError, ValueError):
        installed = False
    if installed:
        yield False
        return
    saved = {k: sys.modules.get(k) for k in STANDIN_MODULES}
    package, utils = types.ModuleType("openrlhf"), types.ModuleType("openrlhf.utils")
    package.__path__, utils.__path__ = [], []  # packages with nothing else in them
    package.utils, utils.agent = utils, openrlhf_standin  # type: ignore[attr-defined]  # modules built here
    sys.modules.update({"openrlhf": package, "openrlhf.utils": utils, "openrlhf.utils.agent": openrlhf_standin})
    try:
        yield True
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value


def _import(target: str, is_file: bool, path: str) -> types.ModuleType:
    try:
        if not is_file:
            return importlib.import_module(target)
        from ..plugins import run_file

        return run_file(
            f"hybrid_agent_{uuid.uuid4().hex[:8]}",
            target,
            ConfigError(FIELD, f"cannot load {target!r} as a Python file.", "Give a .py file."),
        )
    except ConfigError:
        raise
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        if missing.startswith("openrlhf") or "openrlhf" in str(e):
            raise ConfigError(
                FIELD,
                f"{path} imports something of OpenRLHF that hybrid's stand-in does not have "
                f"({e}); OpenRLHF is not installed, and the stand-in provides only openrlhf.utils.agent's "
                f"{', '.join(openrlhf_standin.NAMES)}.",
                "Install OpenRLHF (pip install openrlhf), or import only those names.",
            ) from e
        raise ConfigError(
            FIELD, f"loading {path} failed: {type(e).__name__}: {e}.", "Install what it imports, or fix the import."
        ) from e
    except Exception as e:
        raise ConfigError(
            FIELD,
            f"loading {path} raised {type(e).__name__}: {e}.",
            f"Fix the file (python {target} shows the traceback).",
        ) from e


def _is_executor_class(obj: Any) -> bool:
    return isinstance(obj, type) and any(c.__name__ == "AgentExecutorBase" for c in obj.__mro__)


def _make_executor(cls: Any, path: str) -> Any:
    if not _is_executor_class(cls):
        raise ConfigError(
            FIELD,
            f"{path}: AgentExecutor must inherit from openrlhf.utils.agent's AgentExecutorBase "
            "(usually through MultiTurnAgentExecutor), as OpenRLHF requires.",
            "Write class AgentExecutor(MultiTurnAgentExecutor) with __init__ calling super().__init__(AgentInstance).",
        )
    try:
        return cls()
    except Exception as e:
        raise ConfigError(
            FIELD,
            f"{path}: AgentExecutor() raised {type(e).__name__}: {e}.",
            "OpenRLHF builds the executor with no arguments: its __init__ must take none (e.g. "
            "super().__init__(AgentInstance)).",
        ) from e
