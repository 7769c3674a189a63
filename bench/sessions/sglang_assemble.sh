#!/usr/bin/env bash
# On the GPU machine: move one carried part folder of SGLang 0.5.16 into /tmp/stage-sglang; with --install, print the
# glibc, join the parts, install them into /tmp/site-sglang (their own --target: SGLang's transformers pin must not
# shadow vLLM's), and import SGLang's engine path. Made by bench/sglang_stage.py (see its docstring).
set -euo pipefail
part=${1:?usage: _assemble.sh .carry-sglang/pNN [--install]}
mkdir -p /tmp/stage-sglang && find "$part" -name "*.part[0-9][0-9][0-9]" -exec cp {} /tmp/stage-sglang/ \;
echo "staged $(ls /tmp/stage-sglang | wc -l) part files so far"
if [ "${2:-}" = "--install" ]; then
  ldd --version 2>&1 | head -1 || true   # (head closes the pipe: no pipefail exit) the sglang / sglang-kernel wheels are manylinux_2_34: glibc >= 2.34
  mkdir -p /tmp/wheels-sglang
  for first in /tmp/stage-sglang/*.part000; do
    base=$(basename "$first" .part000)
    cat /tmp/stage-sglang/"$base".part* > /tmp/wheels-sglang/"$base"
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-sglang \
    /tmp/wheels-sglang/*.whl
  echo "installed into /tmp/site-sglang: export PYTHONPATH=/tmp/site-sglang:/tmp/site"
  here=$(cd "$(dirname "$0")/../.." && pwd)
  PYTHONPATH=/tmp/site-sglang:/tmp/site${PYTHONPATH:+:$PYTHONPATH} python3 "$here/bench/sglang_stage.py" --check-imports \
    || echo "some imports failed: add the missing wheels (bench/sglang_stage.py --extra NAME==VERSION)"
fi
