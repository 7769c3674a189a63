"""``--dry-run`` prints exactly what it printed when these files were captured: the README's demo (``hybrid grpo
--dry-run``), ``hybrid ppo --dry-run`` and three held-in OpenRLHF command lines (001, and two of 004: vLLM and
SGLang), with their models and data replaced by the local stand-ins of conftest.py.

It pins behaviour across refactors of the step (recipes, residency inputs, placement): the placement table, the
weight-sync choice, the step count, every phase's residency and peak, and the notes must stay byte for byte. What
depends on the machine is normalised: temp paths, this machine's GPU (none is assumed: CUDA is reported absent) and
its host memory. No Ray is started. After a deliberate change of the output, regenerate the files with
``HYBRID_REGEN_GOLDEN=1 pytest tests/hybrid_cli/test_dry_run_golden.py`` and review the diff.
"""

import os
import re

import pytest

from hybrid_cli import dry_run as dry_run_module
from hybrid_cli.main import main

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "dry_run_golden")

#: name -> (subcommand, stored reference command line or None, extra flags)
CASES = {
    "grpo_demo": ("grpo", None, []),
    "ppo_demo": ("ppo", None, []),
    "001_hybrid_8gpu": ("ppo", "001_hybrid_8gpu.args", ["--gpu_memory_gb", "80"]),
    "004_test_job_3gpu": ("ppo", "004_test_job_3gpu.args", ["--gpu_memory_gb", "80"]),
    "004_comparison_01": ("ppo", "004_comparison_01.args", ["--gpu_memory_gb", "80"]),
    # a 1.1B model's config on a 30 GiB GPU shared by four roles: the planner's moves are pinned too (the tiny
    # models above fit whole)
    "ppo_1b_30gb": ("ppo", "sized", ["--gpu_memory_gb", "30"]),
}
#: a TinyLlama-1.1B-shaped config (sized from config.json alone: no weights are read by a dry run)
SIZED = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)


def sized_model(tiny_dir: str, folder) -> str:
    """The tiny model's tokenizer with a 1.1B model's config.json."""
    import json
    import shutil

    folder.mkdir()
    for name in os.listdir(tiny_dir):
        if name != "config.json" and not name.endswith((".safetensors", ".bin")):
            shutil.copy(os.path.join(tiny_dir, name), folder / name)
    with open(os.path.join(tiny_dir, "config.json")) as f:
        config = {**json.load(f), **SIZED}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture
def as_ci_machine(monkeypatch, tmp_path):
    """No local GPU (the budget is the flags' or the default), unwrapped lines, a scratch working folder."""
    import torch
    from rich.console import Console

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    # one line per printed line: wrapping at the console's width would move with the length of a temp path
    monkeypatch.setattr(dry_run_module, "Console", lambda **kw: Console(**{**kw, "width": 100_000}))
    monkeypatch.chdir(tmp_path)


def normalise(text: str, paths: dict[str, str]) -> str:
    for path, name in sorted(paths.items(), key=lambda kv: -len(kv[0])):  # longest first: nested folders
        text = text.replace(path, name)
    text = re.sub(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/[^\s'\")]*", "<tmp>", text)
    text = re.sub(r"_\d{4}T\d\d:\d\d\b", "_<MMDDTHH:MM>", text)  # OpenRLHF's default run name has the time in it
    lines = []
    for line in text.splitlines():
        line = line.rstrip()
        if line.startswith("host memory: "):  # this machine's MemAvailable, or why it is not checked
            line = "host memory: <this machine>"
        line = re.sub(r"of [\d.]+ GiB available, \w+; available: .*$", "<host capacity>", line)
        line = line.replace("needed (available memory unknown: not checked)", "<host capacity>")
        if re.match(r"warning: the \w+ backend needs the '\w+' package", line):  # installed here or not
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_output_is_unchanged(name, as_ci_machine, request, capsys):
    import ray

    command, stored, extra = CASES[name]
    paths = {}
    argv = []
    tmp = request.getfixturevalue("tmp_path")
    if stored == "sized":
        argv = ["--pretrain", sized_model(request.getfixturevalue("tiny_model_dir"), tmp / "sized")]
    elif stored is not None:
        argv = request.getfixturevalue("reference_argv")(stored)
        paths = {
            request.getfixturevalue("tiny_model_dir"): "<policy>",
            request.getfixturevalue("tiny_reward_dir"): "<reward>",
            request.getfixturevalue("prompts_jsonl"): "<prompts>",
        }
    paths[str(tmp)] = "<run>"
    status = main([command, *argv, "--dry-run", *extra])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert not ray.is_initialized()  # a dry run never starts Ray
    got = normalise(out, paths)
    path = os.path.join(GOLDEN, f"{name}.txt")
    if os.environ.get("HYBRID_REGEN_GOLDEN"):
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(got)
    with open(path) as f:
        want = f.read()
    assert got == want, f"--dry-run output of {name} changed (see {path}; regenerate only for an intended change)"
