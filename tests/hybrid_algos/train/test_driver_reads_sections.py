"""Below ``train(config)`` the driver reads sections (``TrainSettings``), never the flat ``RLConfig``.

The flat config is validated and turned into sections once, in ``prepare``; the few places that take the flat form
on purpose are listed in ``FLAT_ENTRIES`` / ``FLAT_READS`` with why. Everywhere else in the driver's modules, this
test refuses a parameter annotated ``RLConfig``, a read of some ``.config`` attribute or of a ``cfg`` / ``config``
parameter's attribute, a call of the config's section builders (``rollout_settings()``, ``settings()``), and a read of
a name only the flat config has (``init_kl_coef``, ``vllm_num_engines``...; not one the driver's own objects also
have): each is the flat config read again.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import hybrid_algos.train as train_package
from hybrid_algos.train.config import RLConfig
from hybrid_algos.train.sections import SECTIONS, section_class
from hybrid_algos.train.train_settings import TrainSettings

TRAIN = Path(train_package.__file__).parent

#: modules of the flat form itself (not the driver): the config and its table, the rules on its fields, the recipes
#: (their optional roles and folders are named in flat words: prepare resolves them), the resume check (a
#: checkpoint saves the flat config), credentials in it, the plugins it imports; workers/ has its own test
FLAT_MODULES = {
    "__init__.py",
    "config.py",
    "sections.py",
    "inactive.py",
    "demo.py",
    "recipe.py",
    "recipes.py",
    "resume.py",
    "redact.py",
    "plugins.py",
}

#: (module, function) -> why it takes the flat config
FLAT_ENTRIES = {
    ("loop.py", "train"): "the public entry: takes the user's RLConfig",
    ("prepare.py", "prepare"): "resolves the config's recipe",
    ("prepare.py", "_prepare"): "validates the config and turns it into sections once",
    ("placement.py", "build_plan"): "the CLI's --dry-run entry (flat), turned into sections at once",
    ("placement.py", "build_residency"): "the CLI's --dry-run entry (flat), turned into sections at once",
    ("placement.py", "gpu_memory"): "the CLI's --dry-run entry (flat), turned into sections at once",
    ("placement.py", "host_memory"): "the CLI's --dry-run entry (flat), turned into sections at once",
    ("placement.py", "with_planner_changes"): "writes the planner's changes back into the flat record a run saves",
}

#: (module, expression) -> why it reads the flat config there
FLAT_READS = {("loop.py", "prep.config"): "hands the applied flat config to on_start callbacks (a record, not read)"}

#: RLConfig's methods that build sections from the flat fields
SECTION_BUILDERS = {f"{name}_settings" for name in SECTIONS} | {"settings"}


def _flat_only_names() -> set[str]:
    """RLConfig's fields and properties that no section (nor TrainSettings) has under the same name."""
    flat = {f.name for f in dataclasses.fields(RLConfig)} | {
        n for n, v in vars(RLConfig).items() if isinstance(v, property)
    }
    sectioned = {n for n in dir(TrainSettings) if not n.startswith("_")} | set(TrainSettings.__dataclass_fields__)
    for name in SECTIONS:
        cls = section_class(name)
        sectioned |= {f.name for f in dataclasses.fields(cls)} | {n for n in dir(cls) if not n.startswith("_")}
    return flat - sectioned


def _own_names(texts: list[str]) -> set[str]:
    """Attributes the driver's own objects set or declare (a session's ``weight_sync``, a trainer's ``max_norm``):
    a flat field of the same name is not what they read."""
    out: set[str] = set()
    for tree in map(ast.parse, texts):
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                out.add(n.attr)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                out.add(n.target.id)
    return out


def _driver_modules() -> list[Path]:
    return sorted(p for p in TRAIN.rglob("*.py") if p.parent.name != "workers" and p.name not in FLAT_MODULES)


def _functions(tree: ast.AST):
    """(function name, node) of every function; methods count under their own name."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node


def _flat_reads(text: str, rel: str, flat_only: set[str]) -> list[str]:
    """Each flat read in the source ``text`` of module ``rel`` (a path under train/), outside ``FLAT_ENTRIES``."""
    tree = ast.parse(text)
    skip: set[int] = set()  # the nodes inside FLAT_ENTRIES' functions
    for name, node in _functions(tree):
        if (rel, name) in FLAT_ENTRIES:
            skip |= {id(n) for n in ast.walk(node)}
    # a parameter named cfg / config (what a flat config is passed as), wherever a function reads it
    flat_params: set[int] = set()
    for _, fn in _functions(tree):
        params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)} & {"cfg", "config"}
        flat_params |= {id(n) for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in params}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.arg) and node.annotation is not None and "RLConfig" in ast.unparse(node.annotation):
            found.append(f"{where}: parameter {node.arg} is an RLConfig")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            base = node.value
            hf_config = isinstance(base, ast.Name) and base.id in ("model", "m")  # a transformers model's config
            config_read = node.attr == "config" and not hf_config and (rel, ast.unparse(node)) not in FLAT_READS
            if config_read or id(base) in flat_params:
                found.append(f"{where}: reads {ast.unparse(node)}")
            elif node.attr in flat_only:
                found.append(f"{where}: reads the flat-only name {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in SECTION_BUILDERS
            and not node.args
        ):
            found.append(f"{where}: builds sections from a flat config: {ast.unparse(node)}")
    return found


def test_the_driver_below_train_reads_no_flat_config():
    flat_only = _flat_only_names()
    assert {"init_kl_coef", "vllm_num_engines", "actor_learning_rate"} <= flat_only  # the table renames these
    modules = _driver_modules()
    assert {"session.py", "step.py", "prepare.py", "dynamic_sampling.py"} <= {p.name for p in modules}
    texts = {p.relative_to(TRAIN).as_posix(): p.read_text() for p in modules}
    flat_only -= _own_names(list(texts.values()))
    found = [line for rel, text in texts.items() for line in _flat_reads(text, rel, flat_only)]
    assert found == [], "the flat config read below train():\n  " + "\n  ".join(found)


def test_the_check_sees_each_kind_of_flat_read():
    """Each pattern the test refuses is found where a module has it (the check is not blind), and an entry of
    ``FLAT_ENTRIES`` is exempt."""
    text = (
        "def f(session, x: 'RLConfig'):\n"
        "    a = session.config\n"
        "    b = session.settings.init_kl_coef\n"
        "    c = session.prep.rollout_settings()\n"
        "    return g(x)\n"
        "def g(cfg):\n"
        "    return cfg.seed\n"
    )
    found = _flat_reads(text, "session.py", _flat_only_names())
    assert [line.split(": ", 1)[1] for line in found] == [
        "parameter x is an RLConfig",
        "reads session.config",
        "reads the flat-only name session.settings.init_kl_coef",
        "builds sections from a flat config: session.prep.rollout_settings()",
        "reads cfg.seed",
    ], found
    exempt = _flat_reads(text.replace("def f(", "def train("), "loop.py", _flat_only_names())
    assert [line.split(": ", 1)[1] for line in exempt] == ["reads cfg.seed"]  # g is no entry
