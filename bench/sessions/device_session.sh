#!/usr/bin/env bash
# The GPU runs of one lent-machine session (nvidia-h200-x2), phase by phase: each phase fits one device call
# (< 10 min) and leaves its logs in $OUT/<phase>.tgz plus a short summary on stdout.
#
#   bash bench/sessions/device_session.sh stage     # carry .whl + .device-carry: Ray, DeepSpeed, TRL; builds in background
#   bash .carry/pNN/_assemble.sh .carry/pNN  (p00..p05, then p06 --install)   # vLLM, see ../shared/device/README.md
#   bash bench/sessions/device_session.sh a         # issue 8: GRPO as the issue sets it + demo learning (GPU 0) | TRL + ours matched (GPU 1)
#   bash bench/sessions/device_session.sh b         # issue 8 split; issue 5 engine check; issue 9 wake guard
#   TP=1 bash bench/sessions/device_session.sh c    # issue 10, the seed's 8-GPU command scaled to 2 GPUs
#   bash bench/sessions/device_session.sh d         # issue 9 wake guard alone (re-run after a fix)
#   bash .carry-sglang/pNN/_assemble.sh .carry-sglang/pNN  (p00.., last with --install)   # SGLang 0.5.16: bench/sglang_stage.py
#   bash bench/sessions/device_session.sh sg1       # issue 19: SGLang engine rows + vLLM vs SGLang (bench/sglang_gpu.py)
#   bash bench/sessions/device_session.sh sg2       # issue 19: GRPO colocated on the e2e workload, vLLM then SGLang, same call
#                                                   # (then sg3's demo, when over 200 s of the call are left)
#   bash bench/sessions/device_session.sh sg3       # issue 19: the built-in demo learning with --backend sglang
#   bash bench/sessions/device_session.sh sg4       # issue 19 on nvidia-h200-x2: split placement over SGLang's NCCL group
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD/packages/hybrid-core/src:$PWD/packages/hybrid-engines/src:$PWD/packages/hybrid-algos/src:$PWD/packages/hybrid-cli/src
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 TORCH_EXTENSIONS_DIR=/tmp/tx NCCL_NVLS_ENABLE=0 \
  TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; LOGS=/tmp/logs/$1; mkdir -p "$OUT" "$LOGS"
PY=python3
t0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - t0) )); }   # seconds left of a phase budget
pack() { tar -czf "$OUT/$1.tgz" -C /tmp/logs "$1" 2>/dev/null; find "$OUT" -maxdepth 1 -type f | head -8; }

case "$1" in
stage)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .device-carry/*.whl || exit 1
  # Background (own session, outlives this call): the models the later phases load, and DeepSpeed's CUDA Adam.
  setsid nohup bash -c "$PY bench/peer_workload.py /tmp/peer; $PY bench/openrlhf_001.py --gpus 2 --build_only;
    $PY -c 'from deepspeed.ops.op_builder import FusedAdamBuilder as B; B().load()'; echo done" \
    > /tmp/logs/stage_bg.log 2>&1 < /dev/null &
  echo "staged base wheels; background builds started"
  ;;
a)
  # GPU 0: the issue's set-up (ZeRO-3 actor + reference), then the built-in demo on vLLM (learning curve).
  # GPU 1: TRL (vLLM colocate), then ours in the set-up matched to TRL's defaults (no reference, ZeRO-1, 1 micro-batch).
  for i in $(seq 60); do [ -f /tmp/peer/model/config.json ] && grep -q done /tmp/logs/stage_bg.log && break; sleep 5; done
  ( export CUDA_VISIBLE_DEVICES=1
    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 \
      timeout 200 $PY bench/trl_grpo_peer.py /tmp/peer/model vllm > $LOGS/trl_vllm.log 2>&1
    OUT=$LOGS timeout $(left 585) $PY bench/e2e_gpu.py --algo grpo --steps 10 --warmup 2 --kl 0 --zero_stage 1 --micro 64 \
      --tag trl-matched > $LOGS/e2e_matched.log 2>&1 ) &
  gpu1=$!
  export CUDA_VISIBLE_DEVICES=0
  OUT=$LOGS timeout 330 $PY bench/e2e_gpu.py --algo grpo --steps 10 --warmup 2 > $LOGS/e2e_grpo.log 2>&1
  echo "colocated grpo rc=$?"; tail -12 $LOGS/e2e_grpo.log
  timeout $(left 585) $PY -m hybrid_cli grpo --backend vllm --vllm_gpu_memory_utilization 0.3 --save_path /tmp/demo_gpu \
    > $LOGS/demo_vllm.log 2>&1; echo "demo rc=$?"
  cp /tmp/demo_gpu/metrics.jsonl $LOGS/demo_metrics.jsonl 2>/dev/null; tail -4 $LOGS/demo_vllm.log
  wait $gpu1
  grep RESULT $LOGS/trl_vllm.log | tail -1; tail -12 $LOGS/e2e_matched.log
  pack a
  ;;
b)
  # Both GPUs: engine on GPU 1, trainer on GPU 0; must also exit cleanly (NCCL groups abort at close).
  s=$(date +%s); OUT=$LOGS timeout 330 $PY bench/e2e_gpu.py --algo grpo --split --steps 10 --warmup 2 \
    > $LOGS/e2e_split.log 2>&1; echo "split rc=$? wall=$(( $(date +%s) - s )) s"; tail -12 $LOGS/e2e_split.log
  OUT=$LOGS timeout 170 $PY bench/engines_gpu.py > $LOGS/engines_gpu.log 2>&1; echo "engines rc=$?"
  grep -A12 '"greedy_teacher_forced"' $LOGS/engines_gpu.json | head -30
  CUDA_VISIBLE_DEVICES=1 OUT=$LOGS timeout $(left 585) $PY bench/wake_guard_gpu.py > $LOGS/wake_guard.log 2>&1
  echo "wake guard rc=$?"; tail -14 $LOGS/wake_guard.log
  pack b
  ;;
d)
  CUDA_VISIBLE_DEVICES=0 OUT=$LOGS timeout 420 $PY bench/wake_guard_gpu.py > $LOGS/wake_guard.log 2>&1
  echo "wake guard rc=$?"; tail -14 $LOGS/wake_guard.log; grep -m3 "cannot wake" $LOGS/wake_guard_run.log | cut -c1-1500
  pack d
  ;;
sg1)
  # SGLang's own pins (transformers 5.12.1) first, only for the SGLang processes; vLLM runs on /tmp/site alone.
  PYTHONPATH=/tmp/site-sglang:$PYTHONPATH OUT=$LOGS timeout 540 $PY bench/sglang_gpu.py > $LOGS/sglang_gpu.log 2>&1
  echo "sglang_gpu rc=$?"; grep -A16 "^sglang_gpu" $LOGS/sglang_gpu.log; grep -m5 '"errors"\|!!' $LOGS/sglang_gpu.log
  if [ "$(left 585)" -gt 240 ] && [ -n "${SG1_THEN:-}" ]; then  # room left: a GPU bench that had to wait (SG1_THEN)
    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561 timeout $(left 585) $SG1_THEN \
      > $LOGS/then.log 2>&1; echo "then rc=$?"; tail -14 $LOGS/then.log
  fi
  pack sg1
  ;;
sg2)
  OUT=$LOGS timeout 300 $PY bench/e2e_gpu.py --algo grpo --steps 10 --warmup 2 > $LOGS/e2e_vllm.log 2>&1
  echo "vllm grpo rc=$?"; tail -12 $LOGS/e2e_vllm.log
  PYTHONPATH=/tmp/site-sglang:$PYTHONPATH OUT=$LOGS timeout $(left 585) $PY bench/e2e_gpu.py --algo grpo --steps 10 \
    --warmup 2 --backend sglang --tag sglang > $LOGS/e2e_sglang.log 2>&1
  echo "sglang grpo rc=$?"; tail -12 $LOGS/e2e_sglang.log
  if [ "$(left 585)" -gt 200 ]; then  # room left: sg3's demo in this call (it stops at the call's limit otherwise)
    PYTHONPATH=/tmp/site-sglang:$PYTHONPATH timeout $(left 585) $PY -m hybrid_cli grpo --backend sglang \
      --vllm_gpu_memory_utilization 0.3 --save_path /tmp/demo_sglang > $LOGS/demo_sglang.log 2>&1; echo "demo rc=$?"
    cp /tmp/demo_sglang/metrics.jsonl $LOGS/demo_metrics.jsonl 2>/dev/null; tail -4 $LOGS/demo_sglang.log
  fi
  pack sg2
  ;;
sg3)
  PYTHONPATH=/tmp/site-sglang:$PYTHONPATH timeout 585 $PY -m hybrid_cli grpo --backend sglang \
    --vllm_gpu_memory_utilization 0.3 --save_path /tmp/demo_sglang > $LOGS/demo_sglang.log 2>&1; echo "demo rc=$?"
  cp /tmp/demo_sglang/metrics.jsonl $LOGS/demo_metrics.jsonl 2>/dev/null; tail -4 $LOGS/demo_sglang.log
  pack sg3
  ;;
sg4)
  s=$(date +%s); PYTHONPATH=/tmp/site-sglang:$PYTHONPATH OUT=$LOGS timeout 420 $PY bench/e2e_gpu.py --algo grpo --split \
    --steps 10 --warmup 2 --backend sglang --tag sglang > $LOGS/e2e_split_sglang.log 2>&1
  echo "sglang split rc=$? wall=$(( $(date +%s) - s )) s"; tail -12 $LOGS/e2e_split_sglang.log
  pack sg4
  ;;
c)
  for i in $(seq 60); do grep -q done /tmp/logs/stage_bg.log 2>/dev/null && break; sleep 5; done
  OUT=$LOGS timeout 570 $PY bench/openrlhf_001.py --gpus 2 --tp ${TP:-1} --max_len 256 --steps 6 > $LOGS/r001.log 2>&1
  echo "001 tp${TP:-1} rc=$?"; tail -25 $LOGS/r001.log
  pack c
  ;;
esac
