"""``--plugins``: the user's own files or modules, imported on the driver at config time and in every role worker.

The loss and estimator registries (:func:`hybrid_algos.register_policy_loss`,
:func:`hybrid_algos.register_advantage_estimator`) live per process, and Ray workers are processes of their own: a
loss registered only on the driver is not there when the policy worker looks ``--policy_loss_type`` up by name. So
every file or module a run needs is imported in each process that looks names up:

- on the driver by :meth:`RLConfig.validate <hybrid_algos.train.config.RLConfig.validate>`, before Ray starts (a
  missing file, a module that fails to import or an unknown name is a ``ConfigError`` then, the known names listed);
- in each role worker (actor, critic, reference, reward) when it is built (:func:`import_in_worker`), from the list
  the driver leaves in the workers' environment (:data:`ENV`, through :func:`hybrid_core.runtime_env.set_worker_env`).
  Engines get the list but import nothing: they look up no registry.

That list is ``--plugins`` plus the module of every loss or estimator registered in the driver's own process outside
hybrid (a script that registers one and then calls ``hybrid_algos.train.train(config)``). A script is imported in the
workers under another name than ``__main__``, so its ``if __name__ == "__main__":`` block does not run there (as with
``multiprocessing``'s spawn); a loss typed into an interactive session has no file to import and is refused.

Environments (``--agent_func_path``) run on the driver, where they are loaded; a plugin file may hold one too
(``--agent_func_path my_plugin.py:MyEnv``): importing the same file twice registers nothing twice.

A ``FILE.py`` travels to the workers by its absolute path: on a cluster of several machines it must be on a
filesystem they all see (else the worker's error says so); a module name must be importable on every node.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_core.errors import ConfigError

FIELD = "plugins"
#: The driver's list of what each worker imports: a JSON list of ``[module, file, by_name]``.
ENV = "HYBRID_WORKER_PLUGINS"
#: The name a driver script (``__main__``) is imported under in the workers.
DRIVER_SCRIPT = "hybrid_driver_script"
_FILE_PREFIX = "hybrid_plugin_"  # + the file's stem and a hash of its path: a plugin file's module name
_FIX = "Give the path of your .py file (--plugins my_losses.py) or an importable module (--plugins my_pkg.losses)."


class PluginError(ConfigError):
    """A ``--plugins`` entry that cannot be imported (it pickles whole, as every ``ConfigError`` does, so one raised
    in a Ray worker reaches the driver with its message and fix)."""


@dataclass(frozen=True)
class Plugin:
    """What one process imports: ``module`` is its name there (the same in every process)."""

    module: str
    file: str | None  # absolute; None for a module without a file
    by_name: bool  # import ``module`` by name (falling back to ``file``); else run ``file`` as ``module``


def parse(value: str | None) -> list[str]:
    """The entries of a ``--plugins`` value (comma-separated)."""
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def load(value: str | None) -> list[Plugin]:
    """Import every ``--plugins`` entry in this process (once); any problem is a ``ConfigError`` naming the entry."""
    return [_load_one(spec) for spec in parse(value)]


def prepare(value: str | None) -> list[Plugin]:
    """Driver side, at config time: import ``--plugins`` here and leave the workers' list in their environment."""
    from hybrid_core.runtime_env import set_worker_env

    loaded = load(value)
    plugins = list(dict.fromkeys([*loaded, *registered_here(loaded)]))
    # Always set, empty too: a second run in this process must not import the first one's files.
    set_worker_env({ENV: json.dumps([[p.module, p.file, p.by_name] for p in plugins]) if plugins else ""})
    return plugins


def registered_here(loaded: Sequence[Plugin] = ()) -> list[Plugin]:
    """The modules outside hybrid that registered a loss or estimator in this process, as workers import them."""
    from hybrid_algos import get_advantage_estimator, get_policy_loss, list_advantage_estimators, list_policy_losses

    entries: list[tuple[str, str, Callable[..., Any]]] = [
        ("policy loss", n, get_policy_loss(n).fn) for n in list_policy_losses(False)
    ]
    entries += [("advantage estimator", n, get_advantage_estimator(n).fn) for n in list_advantage_estimators(False)]
    known = {p.module for p in loaded}
    found: dict[str, Plugin] = {}
    for kind, name, fn in entries:
        defined_in = getattr(fn, "__module__", None) or "?"
        if defined_in.split(".")[0] == "hybrid_algos" or defined_in in known or defined_in in found:
            continue
        module = sys.modules.get(defined_in)
        file = getattr(module, "__file__", None)
        if not file or not os.path.isfile(file):
            raise PluginError(
                FIELD,
                f"the {kind} {name!r} was registered in {defined_in!r}, which has no file the "
                "Ray workers could import (an interactive session or a notebook?).",
                "Put it in a .py file and name it: --plugins FILE.py.",
            )
        file = os.path.abspath(file)
        if defined_in == "__main__":
            found[defined_in] = Plugin(DRIVER_SCRIPT, file, by_name=False)
        else:
            found[defined_in] = Plugin(defined_in, file, by_name=not defined_in.startswith(_FILE_PREFIX))
    return list(found.values())


def import_in_worker(where: str = "this worker", environ: Mapping[str, str] | None = None) -> list[str]:
    """Worker side: import what the driver listed (:data:`ENV`); returns the module names. ``where`` names the
    worker in errors."""
    raw = (os.environ if environ is None else environ).get(ENV) or ""
    names = []
    for module, file, by_name in json.loads(raw) if raw else []:
        names.append(module)
        if module in sys.modules:
            continue
        if by_name and _findable(module):
            _guarded(functools.partial(importlib.import_module, module), module, where)
            continue
        if file is None:
            raise PluginError(
                FIELD,
                f"{where}: cannot import module {module!r} (on this node).",
                "Install it on every node, or add its folder to PYTHONPATH (forwarded to the workers).",
            )
        if not os.path.isfile(file):
            raise PluginError(
                FIELD,
                f"{where}: no file at {file} on this node (the driver imported it).",
                "Put the file on a filesystem every node sees, or install it as a package and name the "
                "module: --plugins my_pkg.losses.",
            )
        _guarded(functools.partial(_run_file, module, file), file, where)
    return names


# ---- importing ----------------------------------------------------------------------------------------------------
def module_name(path: str) -> str:
    """The module name of a plugin file: from its absolute path, so every process imports it under the same one."""
    stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(path))[0])
    return f"{_FILE_PREFIX}{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def _load_one(spec: str) -> Plugin:
    if spec.endswith(".py") or os.sep in spec or os.path.isfile(spec):
        path = os.path.abspath(spec)
        if not os.path.isfile(path):
            raise PluginError(FIELD, f"no file at {spec!r}.", _FIX)
        name = module_name(path)
        if name not in sys.modules:
            _guarded(lambda: _run_file(name, path), spec, None)
        return Plugin(name, path, by_name=False)
    if not all(part.isidentifier() for part in spec.split(".")):
        raise PluginError(FIELD, f"{spec!r} is neither a .py file nor a module name.", _FIX)
    if not _findable(spec):
        raise PluginError(
            FIELD,
            f"cannot find module {spec!r}.",
            "Make it importable (PYTHONPATH, which the workers get too) or give its .py file.",
        )
    module = _guarded(lambda: importlib.import_module(spec), spec, None)
    file = getattr(module, "__file__", None)
    return Plugin(spec, os.path.abspath(file) if file else None, by_name=True)


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _run_file(name: str, path: str) -> types.ModuleType:
    return run_file(name, path, PluginError(FIELD, f"cannot load {path!r} as a Python file.", _FIX))


def run_file(name: str, path: str, not_python: Exception) -> types.ModuleType:
    """Import the file ``path`` as module ``name`` (registered in ``sys.modules``, which dataclasses and pickling
    need; removed again if it raises); ``not_python`` is raised when it cannot be loaded as Python."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise not_python
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _guarded(run: Callable[[], Any], what: str, where: str | None) -> Any:
    """``run()``; what the user's code raises becomes a ConfigError naming it, the error and its line."""
    from .rewards import _import_fix, _message, _user_frame

    try:
        return run()
    except ConfigError:
        raise
    except Exception as e:  # ImportError, SyntaxError, anything the file raises at import time
        at = f"{where}: " if where else ""
        raise PluginError(
            FIELD, f"{at}importing {what!r} failed: {type(e).__name__}: {_message(e)}{_user_frame(e)}.", _import_fix(e)
        ) from None
