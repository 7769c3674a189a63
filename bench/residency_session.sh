#!/usr/bin/env bash
# The GPU runs of the residency issue on one lent GPU (nvidia-h100-x1 or nvidia-h200), phase by phase: each phase
# fits one device call (< 10 min) and leaves its logs in $OUT/<phase>.tgz plus a short summary on stdout.
#
#   bash bench/residency_session.sh stage    # carry .whl + .device-carry: Ray, DeepSpeed, TRL; models build in background
#   bash .carry/pNN/_assemble.sh .carry/pNN  (p00..p05, then p06 --install)   # vLLM, see ../shared/device/README.md
#   bash bench/residency_session.sh smoke    # KV-cache release on vLLM; a short auto run
#   bash bench/residency_session.sh a        # 357M: TRL | ours TRL-matched | ours ZeRO-3 + reference | generate overhead
#   bash bench/residency_session.sh b        # ~1.5B, 32 x 8, <= 1024 tokens: TRL | ours (auto)
#   bash bench/residency_session.sh c        # ~7B: ours (auto) | TRL; the CPU learning tests beside it
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD/packages/hybrid-core/src:$PWD/packages/hybrid-engines/src:$PWD/packages/hybrid-algos/src:$PWD/packages/hybrid-cli/src
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 TORCH_EXTENSIONS_DIR=/tmp/tx NCCL_NVLS_ENABLE=0 \
  TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-/tmp/out}; LOGS=/tmp/logs/$1; mkdir -p "$OUT" "$LOGS"
PY=python3
t0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - t0) )); }   # seconds left of a phase budget
pack() { tar -czf "$OUT/$1.tgz" -C /tmp/logs "$1" 2>/dev/null; }
wait_for() { for i in $(seq 120); do grep -q "$1" /tmp/logs/stage_bg.log 2>/dev/null && return 0; sleep 5; done; return 1; }
trl() {  # $1 label, then the peer's arguments
  local label=$1; shift
  RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 \
    timeout $(left 560) $PY bench/trl_grpo_peer.py "$@" > $LOGS/trl_$label.log 2>&1
  echo "trl $label rc=$?"; grep RESULT $LOGS/trl_$label.log | tail -1 | tee $OUT/trl_$label.json
}
ours() {  # $1 label, then e2e_gpu.py arguments
  local label=$1; shift
  OUT=$LOGS timeout $(left 560) $PY bench/e2e_gpu.py --tag $label "$@" > $LOGS/ours_$label.log 2>&1
  echo "ours $label rc=$?"; grep -E "median step|^peak |generated tokens" $LOGS/ours_$label.log | tail -6
  cp $LOGS/e2e-*$label*.json $OUT/ 2>/dev/null
  for run in /tmp/peer*/runs/*$label; do  # what the offline analysis needs: phases, plan, metrics, memory samples
    mkdir -p $LOGS/run_$label; cp $run/metrics.jsonl $run/timeline.jsonl $run/residency.json $LOGS/run_$label/ 2>/dev/null
    cp $(dirname $(dirname $run))/mem-*$label*.csv $LOGS/run_$label/ 2>/dev/null
  done
}

case "$1" in
stage)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .device-carry/*.whl || exit 1
  ldd --version | head -1
  # Background (own session, outlives this call): the models the later phases load, and DeepSpeed's CUDA Adam.
  setsid nohup bash -c "$PY bench/peer_workload.py /tmp/peer 357m && echo built357; \
    $PY -c 'from deepspeed.ops.op_builder import FusedAdamBuilder as B; B().load()' && echo builtadam; \
    $PY bench/peer_workload.py /tmp/peer-1.5b 1.5b && echo built15; \
    $PY bench/peer_workload.py /tmp/peer-7b 7b && echo built7; echo done" > /tmp/logs/stage_bg.log 2>&1 < /dev/null &
  echo "staged base wheels; background builds started"
  ;;
smoke)
  wait_for built357; wait_for builtadam
  OUT=$LOGS timeout 150 $PY bench/residency_gpu.py --model /tmp/peer/model > $LOGS/residency_gpu.log 2>&1
  echo "kv release rc=$?"; tail -5 $LOGS/residency_gpu.log; cp $LOGS/residency_gpu.json $OUT/ 2>/dev/null
  ours smoke --size 357m --steps 4 --warmup 1 --zero_stage 1 --micro 64 -- --residency_pins actor.optimizer=offload rollout.kv_cache=release
  pack smoke
  ;;
a)
  wait_for built357; wait_for builtadam
  trl 357m /tmp/peer/model vllm --steps 6
  ours matched --size 357m --steps 10 --warmup 2 --kl 0 --zero_stage 1 --micro 64
  ours zero3ref --size 357m --steps 10 --warmup 2
  OUT=$LOGS timeout $(left 580) $PY bench/generate_overhead.py --model /tmp/peer/model > $LOGS/genoverhead.log 2>&1
  echo "generate overhead rc=$?"; tail -12 $LOGS/genoverhead.log; cp $LOGS/genoverhead.json $OUT/ 2>/dev/null
  pack a
  ;;
b)
  wait_for built15
  trl 1.5b /tmp/peer-1.5b/model vllm --prompts 32 --max_new 1024 --micro 8 --ckpt --steps 3 --gpu_util 0.3
  ours 1.5b --size 1.5b --steps 4 --warmup 1 --kl 0 --zero_stage 1 --micro 8 --gpu_util 0.3
  pack b
  ;;
c)
  wait_for built7
  ( cd /tmp && CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu OMP_NUM_THREADS=2 timeout 560 $PY -m pytest -q -p no:randomly -x -n 4 \
      $OLDPWD/tests/hybrid_algos/train/test_learning.py > $LOGS/cpu_learning.log 2>&1; echo "cpu learning rc=$?" >> $LOGS/cpu_learning.log ) &
  ours 7b --size 7b --steps 3 --warmup 1 --gpu_util 0.2 --micro 4
  trl 7b /tmp/peer-7b/model vllm --prompts 16 --max_new 512 --micro 4 --ckpt --steps 2 --gpu_util 0.2
  wait; tail -5 $LOGS/cpu_learning.log
  pack c
  ;;
esac
