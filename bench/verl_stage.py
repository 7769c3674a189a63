#!/usr/bin/env python3
"""Stage verl 0.9.1 for the lent GPU machine (Python 3.12, torch 2.11.0+cu130, transformers 5.17 preinstalled; Ray
2.60, DeepSpeed 0.19.8, vLLM 0.26.0, datasets and TRL 1.16 already carried into /tmp/site by the other stages).

  python3 bench/verl_stage.py           # here: .stage-verl/ (wheels) -> .carry-verl/ (one folder, a few MiB)
  python3 bench/verl_stage.py --dry     # here, no downloads: the plan
  # on the device (carry [".carry-verl"]): bash bench/sessions/verl_session.sh stage
  #   installs --no-deps into /tmp/site-verl (their own --target) each wheel whose modules the environment lacks
  #   (--install-absent), then, once vLLM is staged, runs --check-imports there
  #   (alone, after the vLLM carry: bash bench/sessions/verl_session.sh check)

What is carried, and why (verl 0.9.1's Requires-Dist, read in its wheel, against what the device has):

* ``verl==0.9.1`` itself, pure Python, installed ``--no-deps``: its metadata caps ``transformers<5.11`` (a packaging
  pin; its ``vllm`` extra pins vllm 0.24.0 / transformers 5.9.0) -- the device keeps its transformers 5.17 and vLLM
  0.26.0. Its vLLM server code checks the version (>= 0.22) and inspects ``build_app`` / ``init_app_state`` /
  ``AsyncLLM.from_vllm_config`` signatures; every ``vllm.*`` name it imports exists in 0.26.0.
* ``transferqueue==0.1.11``: verl 0.9.1's default trainer (``trainer.use_v1=true``) moves batches through it.
* ``tensordict==0.10.0``: verl wants ``>=0.8,<=0.10.0`` and TransferQueue ``>=0.10.0``. Its one compiled module
  (``tensordict/_C``) links only libstdc++ / libc (pybind11, not libtorch), so a cp312 manylinux_2_28 wheel works
  with any torch; ``pyvers<0.2`` is its pin, ``orjson`` its optional JSON backend (verl's file logger needs it too).
* ``hydra-core``, ``omegaconf==2.3.0`` (hydra 1.3 wants < 2.4), ``antlr4-python3-runtime==4.9.3`` (hydra's pin; an
  sdist only, built here into a pure wheel), ``codetiming``, ``torchdata`` (StatefulDataLoader), ``pylatexenc``.
* ``model-hosting-container-standards==0.1.16`` (vLLM 0.26.0 wants ``>=0.1.14,<1``) with its ``jmespath`` and
  ``supervisor``: verl starts vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``), whose SageMaker router
  imports it at module level; our own vLLM use (``LLM``) never imports the server, so the vLLM carry lacks it (found
  missing on the GPU, 2026-11-24). Its other requirements (fastapi, starlette, pydantic, httpx, setuptools) are
  already there. The whole server closure, read statically and imported on CPU beside the unpacked vLLM wheel,
  needs nothing else that the image, the vLLM carry and /tmp/site do not hold.
* Not carried: ``wandb`` (the runs log to console + file), ``ray[default]`` extras, ``mathruler`` / ``qwen_vl_utils`` /
  ``torchcodec`` (vision and math recipes), flash-attn (none for torch 2.11: ``attn_implementation=sdpa`` and
  ``use_remove_padding=False``; verl's padding helpers fall back to torch). Already on the device: accelerate, peft,
  pandas, pyarrow, tensorboard, cloudpickle, psutil, prometheus-client (image); datasets, dill, msgspec, pyzmq,
  cachetools, fastapi, uvicorn (/tmp/site).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from importlib.machinery import PathFinder

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STAGE, CARRY = ".stage-verl", ".carry-verl"
LIMIT = 60 * 2**20  # one device call carries 64 MiB with the project tree
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
WHEELS = [
    "verl==0.9.1",
    "transferqueue==0.1.11",
    "tensordict==0.10.0",
    "pyvers==0.1.0",
    "orjson==3.13.0",
    "hydra-core==1.3.8",
    "omegaconf==2.3.0",
    "codetiming==1.4.0",
    "torchdata==0.11.0",
    "pylatexenc==2.11",
    "model-hosting-container-standards==0.1.16",
    "jmespath==1.1.0",
    "supervisor==4.3.0",
]
SDISTS = ["antlr4-python3-runtime==4.9.3"]  # pure Python, no wheel on PyPI: built here
#: what `python -m verl.trainer.main_ppo` with the FSDP engine, vLLM rollout, agent loop and reward loop imports
CHECK_MODULES = (
    "hydra",
    "omegaconf",
    "antlr4",
    "codetiming",
    "tensordict",
    "torchdata.stateful_dataloader",
    "orjson",
    "transfer_queue",
    "verl",
    "verl.trainer.main_ppo",
    "verl.trainer.main_ppo_v0",
    "verl.trainer.ppo.v1.trainer_sync",
    "verl.trainer.ppo.v1.agent_loop_tq",
    "verl.workers.engine_workers",
    "verl.workers.engine.fsdp",
    "verl.utils.dataset.rl_dataset",
    "verl.experimental.agent_loop",
    "verl.experimental.reward_loop",
    "verl.checkpoint_engine",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.openai.api_server",
    "verl.workers.rollout.vllm_rollout.vllm_async_server",
    "verl.workers.rollout.vllm_rollout.utils",
)
VERSIONS = (
    "verl",
    "transferqueue",
    "tensordict",
    "hydra-core",
    "omegaconf",
    "torch",
    "transformers",
    "vllm",
    "ray",
    "datasets",
    "pyarrow",
    "pandas",
    "peft",
    "accelerate",
)


def download(dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platform_args,
            "-d",
            dest,
            *WHEELS,
        ],
        check=True,
    )
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dest, *SDISTS], check=True)


def carry(stage: str, out: str) -> list[str]:
    """The staged wheels copied into one carry folder (the device installs them from there); refuses when they
    would not fit one call."""
    wheels = sorted(glob.glob(os.path.join(stage, "*.whl")))
    total = sum(os.path.getsize(w) for w in wheels)
    if total > LIMIT:
        raise SystemExit(
            f"{total / 2**20:.1f} MiB of wheels do not fit one device call ({LIMIT / 2**20:.0f} MiB): "
            "cut them into parts as bench/sglang_stage.py does"
        )
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for w in wheels:
        shutil.copy(w, out)
    return [os.path.join(out, os.path.basename(w)) for w in wheels]


#: top-level folders some wheels ship beside their library (TransferQueue's examples and tests): never a reason to
#: think the library is already there
NOT_LIBRARY = {"tests", "test", "scripts", "recipe", "tutorial", "examples", "docs", "benchmarks"}


def wheel_modules(wheel: str) -> tuple[str, str, list[str]]:
    """A wheel's distribution name, version and the top-level modules it installs (its examples/tests left out)."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        meta = z.read(f"{info}/METADATA").decode("utf-8", "replace")
        tops_file = f"{info}/top_level.txt"
        if tops_file in names:
            tops = [t.strip() for t in z.read(tops_file).decode().splitlines() if t.strip()]
        else:  # read the layout itself
            tops = []
            for n in names:
                first, nested = n.split("/")[0], "/" in n
                if first.endswith((".dist-info", ".data", ".libs")) or first == "__pycache__":
                    continue
                if nested:
                    mod = first
                elif first.endswith((".py", ".so", ".pyd")):
                    mod = first.split(".")[0]
                else:
                    continue
                if mod not in tops:
                    tops.append(mod)
    name = re.search(r"^Name: *(.+)$", meta, re.M).group(1).strip()
    version = re.search(r"^Version: *(.+)$", meta, re.M).group(1).strip()
    library = [t for t in tops if t not in NOT_LIBRARY] or tops
    return name, version, library


def _found_in(module: str, path: list[str]) -> str | None:
    """The sys.path entry that provides ``module`` (a real module or package, not a bare namespace), else None."""
    try:
        spec = PathFinder.find_spec(module, path)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin in (None, "namespace"):
        return None
    where = os.path.dirname(spec.origin)
    if spec.submodule_search_locations is not None:  # a package: its __init__ sits one folder down
        where = os.path.dirname(where)
    return os.path.realpath(where)


def _version_in(dist: str, where: str) -> str | None:
    want = re.sub(r"[-_.]+", "-", dist).lower()
    for d in metadata.distributions(path=[where]):
        if re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() == want:
            return d.version
    return None


def plan_install(wheels: list[str], target: str, path: list[str] | None = None) -> list[tuple[str, bool, str]]:
    """For each carried wheel: (wheel, install?, why). A wheel whose modules the environment (``path``, default
    sys.path: the PYTHONPATH verl runs under) already provides from elsewhere -- the image or /tmp/site -- is not
    installed: the carried copy would shadow that one with another version. Found in ``target`` itself (a stage run
    before), it is re-installed only where the version differs."""
    path = list(sys.path if path is None else path)
    target = os.path.realpath(target)
    plan = []
    for wheel in wheels:
        dist, version, modules = wheel_modules(wheel)
        found = {m: _found_in(m, path) for m in modules}
        elsewhere = {m: w for m, w in found.items() if w and w != target}
        if elsewhere:
            m, where = next(iter(elsewhere.items()))
            have = _version_in(dist, where)
            plan.append(
                (
                    wheel,
                    False,
                    f"{m} already provided by {where} ({dist} {have or 'version unknown'}"
                    f"{'' if have == version else f'; carried {version} not installed'})",
                )
            )
        elif any(found.values()):
            have = _version_in(dist, target)
            if have == version:
                plan.append((wheel, False, f"{dist} {version} already staged in {target}"))
            else:
                plan.append((wheel, True, f"{dist} {have or '?'} in {target} replaced by {version}"))
        else:
            plan.append((wheel, True, f"{', '.join(modules)} absent"))
    return plan


def install_absent(wheels: list[str], target: str) -> int:
    """Installs (pip --no-deps --target) the carried wheels the environment lacks, and says what it skipped."""
    plan = plan_install(wheels, target)
    for wheel, install, why in plan:
        print(f"{'install' if install else 'skip   '} {os.path.basename(wheel)}: {why}")
    chosen = [w for w, install, _ in plan if install]
    print(f"carried wheels: {len(chosen)} to install into {target}, {len(plan) - len(chosen)} skipped")
    if not chosen:
        return 0
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            target,
            *chosen,
        ]
    ).returncode


def vllm_staged() -> bool:
    return _found_in("vllm", sys.path) is not None


def check_imports() -> int:
    """On the device, with PYTHONPATH=/tmp/site-verl:/tmp/site: every module of verl's run path, and the versions."""
    for name in VERSIONS:
        try:
            print(f"{name:<16} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            print(f"{name:<16} MISSING")
    failed = 0
    for mod in CHECK_MODULES:
        try:
            importlib.import_module(mod)
            print(f"import ok   {mod}")
        except Exception as e:  # noqa: BLE001 -- report every module, not only the first failure
            failed += 1
            print(f"import FAIL {mod}: {type(e).__name__}: {e}")
    print("verl import check:", "all ok" if not failed else f"{failed} failed")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="print the plan only")
    ap.add_argument("--check-imports", action="store_true", help="(device) import verl's run path")
    ap.add_argument(
        "--install-absent",
        nargs="+",
        metavar="WHEEL",
        help="(device) install those of these wheels whose modules the environment lacks into --target",
    )
    ap.add_argument("--target", default="/tmp/site-verl", help="where --install-absent installs")
    ap.add_argument("--vllm-staged", action="store_true", help="exit 0 where vLLM is importable, else 1")
    a = ap.parse_args()
    if a.vllm_staged:
        return 0 if vllm_staged() else 1
    if a.install_absent:
        return install_absent(a.install_absent, a.target)
    if a.check_imports:
        return check_imports()
    os.chdir(ROOT)
    print("wheels:", " ".join(WHEELS + SDISTS))
    if a.dry:
        return 0
    shutil.rmtree(STAGE, ignore_errors=True)
    download(STAGE)
    files = carry(STAGE, CARRY)
    total = sum(os.path.getsize(f) for f in files) / 2**20
    for f in files:
        print(f"  {os.path.basename(f):<75} {os.path.getsize(f) / 2**20:6.2f} MiB")
    print(
        f'{CARRY}/: {len(files)} wheels, {total:.1f} MiB. On the device, with carry ["{CARRY}"]: '
        "bash bench/sessions/verl_session.sh stage"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
