#!/usr/bin/env bash
# Issue 18 part 2: OpenRLHF 0.11.2 itself beside `hybrid grpo` on one lent GPU, phase by phase (each phase fits one
# device call, < 10 min; logs in $OUT/orl_<phase>.tgz, JSONs in $OUT, a summary on stdout).
# On a machine already staged by bench/sessions/residency_session.sh (stage, then the vLLM .carry parts), while it is warm:
#
#   bash bench/sessions/openrlhf_session.sh stage   # carry [".carry-openrlhf"]: OpenRLHF + what the image lacks -> /tmp/site-orl;
#                                                   # imports OpenRLHF's launcher (vLLM included) and parses our command lines
#   bash bench/sessions/openrlhf_session.sh a       # 357M, ZeRO-1 no reference: OpenRLHF | ours (e2e_gpu.py --kl 0 --zero_stage 1 --micro 64)
#   bash bench/sessions/openrlhf_session.sh a2      # 357M, ZeRO-3 + reference:  OpenRLHF | ours (e2e_gpu.py default set-up)
#   bash bench/sessions/openrlhf_session.sh b       # 1.5B, 32 x 8, <= 1024 tokens: OpenRLHF | ours  (1 warm-up + 2 steps each)
#
# Each pair prints the comparison table. To record it, run here (not on the device: its repo copy is thrown away)
#   python bench/openrlhf_peer.py compare --openrlhf FILES/openrlhf-357m-matched.json \
#       --ours FILES/e2e-grpo-357m-colocated-orl.json --record
# which writes rows only for what completed, and speedups only when both runs of the call completed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PHASE=${1:-}; case "$PHASE" in stage|a|a2|b) ;; *) echo "usage: bash bench/sessions/openrlhf_session.sh stage|a|a2|b"; exit 2;; esac
PEER=orl   # the log folders' prefix
source bench/sessions/_peer_session.sh   # environment, OUT, LOGS, PY, left, pack, wait_for, free_gpu_after, ours
SITE=${ORL_SITE:-/tmp/site-orl}   # OpenRLHF and what it needs beside /tmp/site
orl() {  # $1 label, $2 seconds, then openrlhf_peer.py arguments
  local label=$1 budget=$2; shift 2
  OUT=$LOGS timeout $((budget + 60)) $PY bench/openrlhf_peer.py --site $SITE --timeout $budget "$@" > $LOGS/orl_$label.log 2>&1
  echo "openrlhf $label rc=$?"
  grep -E "median step|^(generation|make_experience|ppo_train|broadcast) |FAILED|reward per step" $LOGS/orl_$label.log | tail -8
  grep -q FAILED $LOGS/orl_$label.log && sed -n '/---- last traceback ----/,$p' $LOGS/orl_$label.log | tail -70
  cp $LOGS/openrlhf-*.json $OUT/ 2>/dev/null; cp /tmp/peer*/openrlhf-*.log $LOGS/ 2>/dev/null
  free_gpu_after OpenRLHF
}
pair() {  # $1 OpenRLHF JSON, $2 ours JSON: the table (not recorded here)
  $PY bench/openrlhf_peer.py compare --openrlhf "$OUT/$1" --ours "$OUT/$2"
}

case "$PHASE" in
stage)
  [ -d .carry-openrlhf ] || { echo "carry .carry-openrlhf with this call"; exit 1; }
  # Install each carried wheel into $SITE unless the image or /tmp/site already has its top-level package
  # (OpenRLHF itself always; its wheel also installs a top-level `tests` package, hence a target of its own).
  $PY - "$SITE" .carry-openrlhf/*.whl <<'EOF' || exit 1
import importlib.util, os, subprocess, sys, zipfile
site, wheels = sys.argv[1], sys.argv[2:]
todo = []
for w in wheels:
    names = {n.split("/")[0] for n in zipfile.ZipFile(w).namelist()}
    top = sorted(n[:-3] if n.endswith(".py") else n for n in names
                 if not n.endswith((".dist-info", ".data")) and n not in ("tests",) and not n.endswith(".pth"))
    if not top:  # OpenRLHF: everything under openrlhf-X.data/purelib
        top = ["openrlhf"]
    missing = [t for t in top if importlib.util.find_spec(t) is None]
    print(f"{w.split('/')[-1][:60]:<60} {'install' if missing or 'openrlhf' in top else 'present'} ({', '.join(top)})")
    if missing or "openrlhf" in top:
        todo.append(w)
if os.environ.get("ORL_STAGE_DRY"):  # print the decisions only (checking this script off the device)
    raise SystemExit(0)
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                "--no-cache-dir", "--upgrade", "--target", site, *todo], check=True)
EOF
  # Pre-flight, no GPU taken: OpenRLHF's launcher imports (vLLM, DeepSpeed, Ray, peft, the flash_attn stand-in) and
  # its own parser + checks accept each command line the phases run.
  for a in "--size 357m --setup matched" "--size 357m --setup zero3ref" "--size 1.5b --setup matched --steps 7 --warmup 2"; do
    $PY bench/openrlhf_peer.py --site $SITE --check $a 2>&1 | grep -v "^INFO\|^WARNING\|^\[" | tail -25 | cut -c1-1200
  done
  $PY -c "import sys; sys.path[:0] = ['bench/openrlhf_standin', '$SITE']
import transformers.utils.import_utils as u; print('transformers sees flash-attn 2:', u.is_flash_attn_2_available())"
  ;;
a)
  wait_for built357 && wait_for builtadam || exit 1
  orl 357m 300 --size 357m --setup matched --steps 10 --warmup 2
  ours orl --size 357m --steps 10 --warmup 2 --kl 0 --zero_stage 1 --micro 64
  pair openrlhf-357m-matched.json e2e-grpo-357m-colocated-orl.json
  pack a
  ;;
a2)
  wait_for built357 && wait_for builtadam || exit 1
  orl 357m_z3 300 --size 357m --setup zero3ref --steps 10 --warmup 2
  ours orlz3 --size 357m --steps 10 --warmup 2
  pair openrlhf-357m-zero3ref.json e2e-grpo-357m-colocated-orlz3.json
  pack a2
  ;;
b)
  wait_for built15 || exit 1
  # the peer's clock needs >= 5 measured steps after the 2 warm-up ones (bench/_common.py): 7 steps of ~31 s plus
  # start-up fill most of a call; the fair median of 3 same-call ratios is bench/peer_ratio.py's (bench/sessions/)
  orl 1.5b 560 --size 1.5b --setup matched --steps 7 --warmup 2 --grace 30
  # B_OURS_STEPS / B_OURS_EXTRA (hybrid flags, e.g. "--packing_samples --use_dynamic_batch"): our side of the pair
  ours orl15 --size 1.5b --steps ${B_OURS_STEPS:-7} --warmup 2 --kl 0 --zero_stage 1 --micro 8 --gpu_util 0.3 \
    ${B_OURS_EXTRA:+-- $B_OURS_EXTRA}
  pair openrlhf-1.5b-matched.json e2e-grpo-1.5b-colocated-orl15.json
  pack b
  ;;
esac
