#!/usr/bin/env bash
# Issue 18: verl 0.9.1 itself beside `hybrid grpo` on one lent GPU, phase by phase (each phase fits one device call,
# < 10 min; logs in $OUT/verl_<phase>.tgz, JSONs in $OUT, a summary on stdout).
# On a machine already staged by bench/sessions/residency_session.sh (stage, then the vLLM .carry parts), while it is warm:
#
#   bash bench/sessions/verl_session.sh stage   # carry [".carry-verl"]: verl + what the image lacks -> /tmp/site-verl (a
#                                               # wheel only where its modules are missing: nothing already there is shadowed);
#                                               # composes verl's config with our overrides; imports verl's run path if vLLM is
#                                               # staged (else says so)
#   bash bench/sessions/verl_session.sh check   # (no carry, no GPU taken) the import pre-flight alone: verl's run path, vLLM's
#                                               # OpenAI server included -- run it after the vLLM carry, before a / a2
#   bash bench/sessions/verl_session.sh a       # 357M, no reference, KL 0: verl | ours (e2e_gpu.py --kl 0 --zero_stage 1 --micro 64)
#   bash bench/sessions/verl_session.sh a2      # 357M, reference + low-var KL loss: verl | ours (e2e_gpu.py default set-up)
#
# Each pair prints the comparison table. To record it, run here (not on the device: its repo copy is thrown away)
#   python bench/verl_peer.py compare --verl FILES/verl-357m-matched.json \
#       --ours FILES/e2e-grpo-357m-colocated-verl.json --record
# which writes rows only for what completed, and the speedup only when both runs of the call completed.
# VERL_ARGS (e.g. "--legacy" for verl's deprecated main_ppo_v0 trainer) is passed to verl_peer.py in a and a2.
set -uo pipefail
cd "$(dirname "$0")/../.."
PHASE=${1:-}
case "$PHASE" in stage|check|a|a2) ;; *) echo "usage: bash bench/sessions/verl_session.sh stage|check|a|a2"; exit 2;; esac
PEER=verl   # the log folders' prefix
source bench/sessions/_peer_session.sh   # environment, OUT, LOGS, PY, left, pack, wait_for, free_gpu_after, ours
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
preflight() {  # every module of verl's run path (vLLM's server included) imports, with versions; no GPU taken.
  # verl's processes see /tmp/site without trl (bench/verl_peer.py's without_trl): so does this check.
  local path; path=$(cd bench && $PY -c "from verl_peer import environment; print(environment('$SITE')['PYTHONPATH'])")
  PYTHONPATH=$path $PY bench/verl_stage.py --check-imports 2>&1 | grep -v "^WARNING\|UserWarning\|warnings.warn" \
    | cut -c1-400
}
pair() {  # $1 verl JSON, $2 ours JSON: the table (not recorded here)
  $PY bench/verl_peer.py compare --verl "$OUT/$1" --ours "$OUT/$2"
}

case "$PHASE" in
stage)
  [ -d .carry-verl ] || { echo "carry .carry-verl with this call"; exit 1; }
  mkdir -p $SITE
  if [ -z "${VERL_STAGE_DRY:-}" ]; then
    # Each carried wheel only where the environment verl runs under lacks its modules: a package the image or
    # /tmp/site already has is never shadowed by another version (the script prints what it installed and skipped).
    PYTHONPATH=$SITE:$PYTHONPATH $PY bench/verl_stage.py --install-absent .carry-verl/*.whl --target $SITE || exit 1
    # TransferQueue's wheel also installs its examples and tests as top-level packages: not part of the library.
    rm -rf $SITE/recipe $SITE/scripts $SITE/tests $SITE/tutorial
  else
    ls .carry-verl/*.whl | sed 's#.*/#  #'
  fi
  # Pre-flight, no GPU taken: verl's run path imports vLLM (its OpenAI server too), so only once vLLM is staged ...
  if PYTHONPATH=$SITE:$PYTHONPATH $PY bench/verl_stage.py --vllm-staged; then
    preflight
  else
    echo "vLLM not staged yet: the vLLM-dependent imports are checked by \`bash bench/sessions/verl_session.sh check\`" \
      "after the vLLM carry"
  fi
  # ... and verl's own Hydra config accepts our overrides, and its agent loop renders our prompts token for token.
  for a in "--setup matched" "--setup lowvar"; do
    # shellcheck disable=SC2086
    $PY bench/verl_peer.py --site $SITE --dry $a 2>&1 | grep -E "^verl|^prompt|^the rendered|Error|refused" \
      | tail -25 | cut -c1-1500
  done
  pack stage
  ;;
check)
  preflight; exit $?
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
