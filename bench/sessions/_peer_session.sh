# Sourced by bench/sessions/openrlhf_session.sh and bench/sessions/verl_session.sh from the repository root, with PEER (the log folders'
# prefix) and PHASE set: the environment of every run, OUT / LOGS / PY, the phase clock (left) and pack, waiting for
# the staged models, freeing the GPU after a peer's run, and our run of the same workload.
export PYTHONPATH=/tmp/site:$PWD/packages/hybrid-core/src:$PWD/packages/hybrid-engines/src:$PWD/packages/hybrid-algos/src:$PWD/packages/hybrid-cli/src${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 TORCH_EXTENSIONS_DIR=/tmp/tx NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-/tmp/out}; LOGS=/tmp/logs/${PEER}_$PHASE; mkdir -p "$OUT" "$LOGS"
PY=${PY:-python3}   # PY, EXTRA_PYTHONPATH and the scripts' *_SITE / *_STAGE_DRY: for checking them off the device
t0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - t0) )); }   # seconds left of a phase budget
pack() { tar -czf "$OUT/${PEER}_$1.tgz" -C /tmp/logs "${PEER}_$1" 2>/dev/null; }
wait_for() { for i in $(seq 120); do grep -q "$1" /tmp/logs/stage_bg.log 2>/dev/null && return 0; sleep 5; done
             echo "not ready: '$1' missing from /tmp/logs/stage_bg.log (run bench/sessions/residency_session.sh stage first)"; return 1; }
gpu_apps() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null; }
gpu_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1; }
free_gpu_after() {  # $1 the peer's name: what its run left on the GPU (a run stopped at its time limit) is its own
  sleep 3; local left_over; left_over=$(gpu_apps)
  if [ -n "$left_over" ]; then
    echo "left on the GPU after $1: $left_over"
    for pid in $(echo "$left_over" | cut -d, -f1); do kill "$pid" 2>/dev/null; done; sleep 5
    for pid in $(gpu_apps | cut -d, -f1); do kill -9 "$pid" 2>/dev/null; done
  fi
  # Ray's workers and vLLM's engine process exit on their own once the driver is gone: wait for the memory.
  for i in $(seq 30); do [ "$(gpu_used)" -lt 2000 ] 2>/dev/null && break; sleep 2; done
  echo "GPU memory in use before our run: $(gpu_used) MiB"
}
ours() {  # $1 label, then e2e_gpu.py arguments
  local label=$1; shift
  rm -rf /tmp/peer*/runs/*-$label   # a fresh run folder: the JSON must describe this call's run only
  OUT=$LOGS timeout $(left 570) $PY bench/e2e_gpu.py --tag $label "$@" > $LOGS/ours_$label.log 2>&1
  echo "ours $label rc=$?"; grep -E "median step|^(generate|infer|train|sync) " $LOGS/ours_$label.log | tail -6
  cp $LOGS/e2e-*$label.json $OUT/ 2>/dev/null
}
