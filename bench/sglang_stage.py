#!/usr/bin/env python3
"""Stage SGLang 0.5.16 for the lent GPU machine (Python 3.12, torch 2.11.0+cu130, transformers 5.17 preinstalled).

The pattern of ../shared/device/make_wheelhouse.py, for SGLang: wheels downloaded here (``--no-deps``, cp312,
manylinux), cut into parts of at most 60 MiB (a device call carries 64 MiB), joined and installed there with
``bench/sessions/sglang_assemble.sh`` into their own ``--target`` (/tmp/site-sglang), so they shadow nothing of vLLM's
carry:

  python3 bench/sglang_stage.py                  # here: .stage-sglang/ (wheels) -> .carry-sglang/p00 .. pNN
  python3 bench/sglang_stage.py --dry            # here, no downloads: the plan, and the part cutting checked on fakes
  # on the device, back to back while warm (the reply says warm: true), call k carrying [".carry-sglang/pKK"]:
  bash .carry-sglang/pKK/_assemble.sh .carry-sglang/pKK              # k < last
  bash .carry-sglang/pNN/_assemble.sh .carry-sglang/pNN --install    # last: joins, installs, checks the imports
  export PYTHONPATH=/tmp/site-sglang:/tmp/site                       # SGLang's pins first; Ray/DeepSpeed/vLLM after

What is carried, and why (read in the 0.5.16 wheel and found by importing its engine path on CPU):

* ``sglang==0.5.16`` (pins torch==2.11.0, the image's) and its kernels ``sglang-kernel==0.4.5`` (383 MB: most of the
  parts); ``torch_memory_saver`` (``enable_memory_saver``: sleep/wake by tag; 0.0.10 pauses and resumes "weights",
  "kv_cache" and "cuda_graph" each on its own); ``flashinfer-python==0.6.14`` and its helpers only with
  ``--with-flashinfer`` (the vLLM 0.26 carry in /tmp/site already has that very version).
* ``transformers==5.12.1`` and ``tokenizers==0.22.2``: SGLang 0.5.16 pins transformers 5.12.1 and registers a
  "qwen3_asr" config that transformers 5.17 (the image's) already has, so its import fails there; 5.12.1 in turn
  takes tokenizers <= 0.23.0 (the image has 0.23.2). This is the clash that keeps SGLang and vLLM in separate targets.
* Pure-Python modules that its engine, scheduler, model runner, Llama/Qwen2/Qwen3 models and attention backends import
  at start-up and the image lacks (IPython, mistral_common, einops, opentelemetry-api, msgspec, pyzmq, orjson, ...).
* Not carried: the optional kernel packages its metadata lists (flash-attn-4, helion, tilelang, sgl-deep-gemm,
  nvidia-cutlass-dsl, quack-kernels, tokenspeed_mla, humming-kernels, sgl-deep-ep, kernels): a dense bf16
  Llama/Qwen on Hopper runs on sglang-kernel's FA3 and FlashInfer; none is imported unguarded on that path.

glibc: the sglang and sglang-kernel wheels are manylinux_2_34 (glibc >= 2.34); the image's Python 3.12.3 is Ubuntu
24.04's (glibc 2.39). The last part's install prints ``ldd --version`` first, so a mismatch shows at once. If an import
still fails there, ``--extra NAME==VERSION`` adds a wheel (carry it in a small extra folder while the machine is warm).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STAGE, CARRY = ".stage-sglang", ".carry-sglang"
LIMIT = 60 * 2**20  # per part; a device call carries 64 MiB with the project tree
PLATFORMS = (
    "manylinux_2_39_x86_64",
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
SGLANG = [
    "sglang==0.5.16",
    "sglang-kernel==0.4.5",
    "torch_memory_saver==0.0.10",
    # the transformers 0.5.16 pins (the image's 5.17 breaks its import) and the tokenizers that one accepts
    "transformers==5.12.1",
    "tokenizers==0.22.2",
    # imported on the engine's start-up path, missing on the image
    "ipython",
    "traitlets",
    "decorator",
    "jedi",
    "parso",
    "matplotlib-inline",
    "pexpect",
    "ptyprocess",
    "prompt-toolkit",
    "wcwidth",
    "stack-data",
    "asttokens",
    "executing",
    "pure-eval",
    "pygments",
    "mistral-common",
    "pycountry",
    "pydantic-extra-types",
    "einops",
    "opentelemetry-api",
    "importlib-metadata",
    "zipp",
    "msgspec",
    "pyzmq",
    "orjson",
    "pybase64",
    "setproctitle",
    "uvloop",
    "fastapi",
    "starlette",
    "uvicorn",
    "h11",
    "click",
    "python-multipart",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "annotated-doc",
    "aiohttp",
    "aiohappyeyeballs",
    "aiosignal",
    "attrs",
    "frozenlist",
    "multidict",
    "propcache",
    "yarl",
    "openai==2.6.1",
    "anyio",
    "sniffio",
    "distro",
    "httpx",
    "httpcore",
    "jiter",
    "partial-json-parser",
    "compressed-tensors",
    "gguf",
    "xgrammar==0.2.1",
    "soundfile",
    "cffi",
    "pycparser",
    "loguru",
    "nvidia-ml-py",
    "watchfiles",
    "zstandard",
    "dill",
    "jsonschema",
    "referencing",
    "rpds-py",
    "jsonschema-specifications",
    "interegular",
    "llguidance>=1.7.6,<2",
    "outlines-core",
    "blobfile==3.0.0",
    "pycryptodomex",
    "lxml",
    "psutil",
]
FLASHINFER = [
    "flashinfer-python==0.6.14",
    "apache-tvm-ffi==0.1.11",
    "nvidia-cudnn-frontend",
    "cuda-python",
    "cuda-bindings",
    "cuda-pathfinder",
]
# What the device check imports: SGLang's engine path for a dense Llama / Qwen model.
CHECK_MODULES = (
    "sglang",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama",
    "sglang.srt.models.qwen2",
    "sglang.srt.models.qwen3",
    "sglang.srt.layers.attention.flashattention_backend",
    "sglang.srt.layers.attention.flashinfer_backend",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.utils.torch_memory_saver_adapter",
    "torch_memory_saver",
    "sgl_kernel",
    "flashinfer",
)


def download(specs: list[str], dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [
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
        *specs,
    ]
    subprocess.run(cmd, check=True)


def ignored(path: str) -> bool:
    """The staged folders must stay out of git (.gitignore lists them); refuse to stage into a tracked folder."""
    out = subprocess.run(["git", "check-ignore", "-q", path + "/"], cwd=ROOT, capture_output=True)
    return out.returncode == 0


def chunk(src_dir: str, out_dir: str, limit: int = LIMIT) -> int:
    """Cut every file of ``src_dir`` into ``NAME.partNNN`` pieces packed into ``out_dir/pKK`` folders of at most
    ``limit`` bytes each (a file may span folders); each folder gets a copy of the assemble script."""
    shutil.rmtree(out_dir, ignore_errors=True)
    parts, cur, size = [], [], 0
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        total, off, i = os.path.getsize(path), 0, 0
        with open(path, "rb") as fh:
            while off < total:
                n = min(limit - size, total - off)
                if n <= 0:
                    parts.append(cur)
                    cur, size = [], 0
                    continue
                cur.append((f"{name}.part{i:03d}", fh.read(n)))
                size, off, i = size + n, off + n, i + 1
    if cur:
        parts.append(cur)
    for k, files in enumerate(parts):
        d = os.path.join(out_dir, f"p{k:02d}")
        os.makedirs(d)
        for name, data in files:
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        shutil.copy(os.path.join(HERE, "sessions", "sglang_assemble.sh"), os.path.join(d, "_assemble.sh"))
    return len(parts)


def glibc_needed(wheels: list[str]) -> tuple[int, int]:
    """The newest glibc any wheel's manylinux tag asks for (manylinux2014 = 2.17, manylinux1 = 2.5)."""
    need = (2, 5)
    for w in wheels:
        for tag in os.path.basename(w)[:-4].split("-")[-1].split("."):
            if tag.startswith("manylinux_"):
                major, minor = tag.split("_")[1:3]
                need = max(need, (int(major), int(minor)))
            elif tag.startswith("manylinux2014"):
                need = max(need, (2, 17))
    return need


def check_imports() -> int:
    """On the device after install: import SGLang's engine path; print each failure with the module missing."""
    import importlib
    import traceback
    import warnings

    warnings.filterwarnings("ignore")
    failed = 0
    for m in CHECK_MODULES:
        try:
            importlib.import_module(m)
            print(f"ok      {m}")
        except BaseException as e:  # noqa: BLE001  (report every kind, go on)
            failed += 1
            missing = getattr(e, "name", None)
            print(
                f"FAILED  {m}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                + (f"  [missing module: {missing}]" if missing else "")
            )
            traceback.print_exc(limit=-3, file=sys.stdout)
    import sglang
    import torch
    import transformers

    print(f"sglang {sglang.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
    return 1 if failed else 0


def dry() -> int:
    """No network: print the plan, and check the part cutting and the glibc reading on fake files."""
    import tempfile

    print(f"would download {len(SGLANG)} wheels (--with-flashinfer adds {len(FLASHINFER)}): {' '.join(SGLANG)}")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "src"), os.path.join(tmp, "out")
        os.makedirs(src)
        sizes = {
            "big-0.1-cp312-cp312-manylinux_2_34_x86_64.whl": 250_001,
            "small-1.0-py3-none-any.whl": 9_000,
            "mid-2.0-cp39-abi3-manylinux2014_x86_64.whl": 120_000,
        }
        blobs = {n: os.urandom(s) for n, s in sizes.items()}
        for n, b in blobs.items():
            open(os.path.join(src, n), "wb").write(b)
        n_parts = chunk(src, out, limit=100_000)
        pieces: dict[str, list[tuple[str, bytes]]] = {}
        for d in sorted(os.listdir(out)):
            folder = sum(
                os.path.getsize(os.path.join(out, d, f))
                for f in os.listdir(os.path.join(out, d))
                if f != "_assemble.sh"
            )
            assert folder <= 100_000, (d, folder)
            for f in os.listdir(os.path.join(out, d)):
                if f != "_assemble.sh":
                    pieces.setdefault(f.rsplit(".part", 1)[0], []).append(
                        (f, open(os.path.join(out, d, f), "rb").read())
                    )
        for n, b in blobs.items():
            assert b"".join(data for _, data in sorted(pieces[n])) == b, n
        need = glibc_needed(list(sizes))
        print(f"dry: {n_parts} parts of <= 100000 B rebuild the 3 files exactly; glibc needed {need[0]}.{need[1]}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="no downloads: the plan, and the cutting checked on fakes")
    ap.add_argument("--check-imports", action="store_true", help="on the device, after install: import the engine path")
    ap.add_argument("--with-flashinfer", action="store_true", help="also carry flashinfer 0.6.14 (no vLLM carry there)")
    ap.add_argument("--extra", nargs="*", default=[], help="more NAME==VERSION wheels (found missing on the device)")
    a = ap.parse_args()
    if a.check_imports:
        return check_imports()
    if a.dry:
        return dry()
    os.chdir(ROOT)
    for path in (STAGE, CARRY):
        if not ignored(path):
            raise SystemExit(f"{path}/ is not git-ignored: add /{path}/ to .gitignore before staging into it")
    shutil.rmtree(STAGE, ignore_errors=True)
    download(SGLANG + (FLASHINFER if a.with_flashinfer else []) + a.extra, STAGE)
    wheels = sorted(glob.glob(os.path.join(STAGE, "*.whl")))
    for w in wheels:
        zipfile.ZipFile(w).testzip()
    need = glibc_needed(wheels)
    total = sum(os.path.getsize(w) for w in wheels) / 2**20
    n = chunk(STAGE, CARRY)
    print(
        f"{len(wheels)} wheels, {total:.0f} MiB -> {n} parts in {CARRY}/ (p00..p{n - 1:02d}); glibc needed "
        f">= {need[0]}.{need[1]}. Device calls, back to back:"
    )
    for k in range(n):
        last = " --install" if k == n - 1 else ""
        print(f'  carry [".{CARRY[1:]}/p{k:02d}"]: bash {CARRY}/p{k:02d}/_assemble.sh {CARRY}/p{k:02d}{last}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
