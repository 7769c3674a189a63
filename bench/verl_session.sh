#!/usr/bin/env bash
# Issue 18: verl 0.9.1 itself beside `hybrid grpo` on one lent GPU, phase by phase (each phase fits one device call,
# < 10 min; logs in $OUT/verl_<phase>.tgz, JSONs in $OUT, a summary on stdout).
# On a machine already staged by bench/residency_session.sh (stage, then the vLLM .carry parts), while it is warm:
#
#   bash bench/verl_session.sh stage   # carry [".carry-verl"]: verl + what the image lacks -> /tmp/site-verl; imports
#                                      # verl's run path there (vLLM included) and composes its config with our overrides
#   bash bench/verl_session.sh a       # 357M, no reference, KL 0: verl | ours (e2e_gpu.py --kl 0 --zero_stage 1 --micro 64)
#   bash bench/verl_session.sh a2      # 357M, reference + low-var KL loss: verl | ours (e2e_gpu.py default set-up)
#
# Each pair prints the comparison table. To record it, run here (not on the device: its repo copy is thrown away)
#   python bench/verl_peer.py compare --verl FILES/verl-357m-matched.json \
#       --ours FILES/e2e-grpo-357m-colocated-verl.json --record
# which writes rows only for what completed, and the speedup only when both runs of the call completed.
# VERL_ARGS (e.g. "--legacy" for verl's deprecated main_ppo_v0 trainer) is passed to verl_peer.py in a and a2.
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-}; case "$PHASE" in stage|a|a2) ;; *) echo "usage: bash bench/verl_session.sh stage|a|a2"; exit 2;; esac
PEER=verl   # the log folders' prefix
source bench/_peer_session.sh   # environment, OUT, LOGS, PY, left, pack, wait_for, free_gpu_after, ours
SITE=${VERL_SITE:-/tmp/site-verl}   # verl and what it needs beside /tmp/site
VERL_ARGS=${VERL_ARGS:-}
peer() {  # $1 label, $2 seconds, then verl_peer.py arguments
  local label=$1 budget=$2; shift 2
  # shellcheck disable=SC2086
  OUT=$LOGS timeout $((budget + 60)) $PY bench/verl_peer.py --site $SITE --timeout $budget "$@" $VERL_ARGS \
    > $LOGS/verl_$label.log 2>&1
  echo "verl $label rc=$?"
  grep -E "median step|^(gen|reward|old_log_prob|ref|adv|update_actor|update_weights) |FAILED|PARTIAL|reward per step" \
    $LOGS/verl_$label.log | tail -10
  grep -q FAILED $LOGS/verl_$label.log && sed -n '/---- last traceback ----/,$p' $LOGS/verl_$label.log | tail -70 | cut -c1-600
  cp $LOGS/verl-*.json $OUT/ 2>/dev/null; cp /tmp/peer*/verl-*.log /tmp/peer*/verl-*.metrics.jsonl $LOGS/ 2>/dev/null
  free_gpu_after verl
}
pair() {  # $1 verl JSON, $2 ours JSON: the table (not recorded here)
  $PY bench/verl_peer.py compare --verl "$OUT/$1" --ours "$OUT/$2"
}

case "$PHASE" in
stage)
  [ -d .carry-verl ] || { echo "carry .carry-verl with this call"; exit 1; }
  ls .carry-verl/*.whl | sed 's#.*/#  #'
  if [ -z "${VERL_STAGE_DRY:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .carry-verl/*.whl \
      || exit 1
    # TransferQueue's wheel also installs its examples and tests as top-level packages: not part of the library.
    rm -rf $SITE/recipe $SITE/scripts $SITE/tests $SITE/tutorial
  fi
  # Pre-flight, no GPU taken: every module of verl's run path (vLLM's server included) imports, with versions ...
  PYTHONPATH=$SITE:$PYTHONPATH $PY bench/verl_stage.py --check-imports 2>&1 | grep -v "^WARNING\|UserWarning\|warnings.warn" \
    | cut -c1-400
  # ... and verl's own Hydra config accepts our overrides, and its agent loop renders our prompts token for token.
  for a in "--setup matched" "--setup lowvar"; do
    # shellcheck disable=SC2086
    $PY bench/verl_peer.py --site $SITE --dry $a 2>&1 | grep -E "^verl|^prompt|^the rendered|Error|refused" \
      | tail -25 | cut -c1-1500
  done
  pack stage
  ;;
a)
  wait_for built357 && wait_for builtadam || exit 1
  peer 357m 300 --size 357m --setup matched --steps 10 --warmup 2
  ours verl --size 357m --steps 10 --warmup 2 --kl 0 --zero_stage 1 --micro 64
  pair verl-357m-matched.json e2e-grpo-357m-colocated-verl.json
  pack a
  ;;
a2)
  wait_for built357 && wait_for builtadam || exit 1
  peer 357m_ref 300 --size 357m --setup lowvar --steps 10 --warmup 2
  ours verlref --size 357m --steps 10 --warmup 2
  pair verl-357m-lowvar.json e2e-grpo-357m-colocated-verlref.json
  pack a2
  ;;
esac
