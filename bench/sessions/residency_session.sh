#!/usr/bin/env bash
# The GPU runs of the residency issue on one lent GPU (nvidia-h100-x1 or nvidia-h200), phase by phase: each phase
# fits one device call (< 10 min) and leaves its logs in $OUT/<phase>.tgz plus a short summary on stdout.
#
#   bash bench/sessions/residency_session.sh stage    # carry .whl + .device-carry: Ray, DeepSpeed, TRL; in the background the models
#                                                     # (STAGE_SIZES, default "1.5b 7b", plus 357m), DeepSpeed's Adam and, unless
#                                                     # STAGE_GPU_BENCHES=0, issue 24's and issue 20's GPU benches (rows: phase a)
#   bash .carry/pNN/_assemble.sh .carry/pNN  (p00..p05, then p06 --install)   # vLLM, see ../shared/device/README.md
#   bash bench/sessions/residency_session.sh bg       # where the background work stands
#   bash bench/sessions/residency_session.sh smoke    # KV-cache release on vLLM; a short auto run
#   bash bench/sessions/residency_session.sh a        # 357M: TRL | ours TRL-matched | ours ZeRO-3 + reference
#   bash bench/sessions/residency_session.sh b        # ~1.5B, 32 x 8, <= 1024 tokens: TRL | ours (auto)
#   bash bench/sessions/residency_session.sh c        # ~7B: ours (auto) | TRL, nothing beside them (CPU Adam needs the host)
#   bash bench/sessions/residency_session.sh prof     # 357M ZeRO-3 + reference, step 6 under the profilers (--profile_step)
#   bash bench/sessions/residency_session.sh c7       # ~7B in bf16 master weights + Adam state (TRL's precision) on 80 GB: the
#                                                     # model built on the GPU, then ours (C7_TRL=1: TRL too; else phase c7t)
#   bash bench/sessions/residency_session.sh z        # ZeRO-3 + reference: the code of commit ab94ac3 vs today's (carry .old: an
#                                                     # ignored folder holding that commit's packages/ and bench/)
#   bash bench/sessions/residency_session.sh d        # generate overhead alone (its engines take ~2.5 min to build), then 7B
#   bash bench/sessions/residency_session.sh suite    # the whole test suite on the machine's CPU, in the background (issue 23);
#                                                     # `bg` reports it, `suitelog` brings its log back; SUITE_CPUS=8-15 pins it
#                                                     # (then run the GPU phases beside it under `taskset -c 0-7`)
#   bash bench/sessions/residency_session.sh e        # ZeRO-3 + reference against TRL, interleaved twice (TRL, ours, TRL, ours)
#                                                     # with the machine's load sampled every 10 s; E_TURNS="1" or "2" runs one
#                                                     # turn per call, E_SGLANG=1 adds the same set-up on SGLang after the
#                                                     # first turn's (issue 19: next to the vLLM figure of the same call);
#                                                     # E_THREADS1=1 adds ours with the engine on one torch thread,
#                                                     # E_MICRO64=1 ours in TRL's micro-batch of 64, E_PROFILE=1 that run
#                                                     # again with step 6 under the profilers (--profile_step), E_EXTRA="FLAGS"
#                                                     # ours in TRL's micro-batch with those hybrid flags (an A/B variant)
#   bash bench/sessions/residency_session.sh tr       # issue 37: the train phase alone, DeepSpeed vs FSDP2 options (trainer_gpu.py)
#   bash bench/sessions/residency_session.sh pr       # issue 34: bench/peer_ratio.py (ours | TRL default | TRL sleep, 3 turns)
#   bash bench/sessions/residency_session.sh ws       # issue 34: the weight sync's verification cost, split and profiled
#   bash bench/sessions/residency_session.sh fs       # issue 37: DeepSpeed then FSDP2 on the 1.5B workload (train phase ratio;
#                                                     # FS_BACKEND=hf: the built-in engine, no vLLM needed)
#   bash bench/sessions/residency_session.sh f7       # issue 37: ~7B under FSDP2 in bf16, then TRL, the same call
#   bash bench/sessions/residency_session.sh f        # issue 21: async vs the synchronous auto plan, 1.5B, one GPU (F_MPS=1:
#                                                     # the async run under CUDA MPS)
#   bash bench/sessions/residency_session.sh g        # generate overhead (recorded; G_REC=0: not), the same with vLLM multi-process
#                                                     # (G_MP=0: not), then issue 22's agent rollouts (G_AGENTS=0: not)
#   bash bench/sessions/residency_session.sh h        # issue 22's agent rollouts (H_AGENTS=0: not), issue 19's demo on SGLang, the
#                                                     # suite's log
# Timed phases wait until the background work is done ("bg-all-done"): nothing else runs beside a timing.
# The machine goes back 30 s after a call ends: chain the calls (staging parts back to back), think between phases
# only while a long one runs. Start `suite` only where no timed phase follows on that machine (it takes ~20 min of
# 16 cores at -n 6 and slowed the GPU runs beside it by 1.5-2x on 2026-11-24).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD/packages/hybrid-core/src:$PWD/packages/hybrid-engines/src:$PWD/packages/hybrid-algos/src:$PWD/packages/hybrid-cli/src
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 TORCH_EXTENSIONS_DIR=/tmp/tx NCCL_NVLS_ENABLE=0 \
  TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-/tmp/out}; LOGS=/tmp/logs/$1; mkdir -p "$OUT" "$LOGS"
PY=python3
t0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - t0) )); }   # seconds left of a phase budget
# a run's deadline: what is left of the phase's budget (PHASE_BUDGET, default 560 s), at most RUN_TIMEOUT when set
run_limit() { local b; b=$(left ${PHASE_BUDGET:-560}); [ -n "${RUN_TIMEOUT:-}" ] && [ "$RUN_TIMEOUT" -lt "$b" ] && b=$RUN_TIMEOUT; echo $b; }
pack() { tar -czf "$OUT/$1.tgz" -C /tmp/logs "$1" 2>/dev/null; }
wait_for() { for i in $(seq 120); do grep -q "$1" /tmp/logs/stage_bg.log 2>/dev/null && return 0; sleep 5; done; return 1; }
# Rows a bench appends on the device go to this call's copy of RESULTS.md, which the next call's transfer replaces:
# send them to the phase's logs instead (they come back in <phase>.tgz and are appended here by hand).
export BENCH_RESULTS=$LOGS/rows.md
suite_running() { [ -f /tmp/logs/suite/suite.log ] && ! grep -q "^suite rc=" /tmp/logs/suite/suite.log; }
cleanup() {  # nothing of an earlier run may share the machine with a timing: stray Ray clusters and GPU processes
  # (`ray stop` kills every Ray cluster of the machine: not while the test suite's own clusters run beside us)
  suite_running || ray stop --force > /dev/null 2>&1
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  sleep 2; echo "before the timings: load $(cut -d' ' -f1-3 /proc/loadavg), GPU memory in use" \
    "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null)"
}
monitor() {  # the load and the busiest processes every 10 s, beside the timings (a noisy neighbour shows here)
  ( while true; do echo "$(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"; ps -eo pcpu,pid,comm --sort=-pcpu | sed -n 2,6p
      sleep 10; done > $LOGS/cpu_monitor.log 2>&1 ) &
  MON=$!
}
trl() {  # $1 label, then the peer's arguments
  local label=$1; shift
  RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 \
    timeout $(run_limit) $PY bench/trl_grpo_peer.py "$@" > $LOGS/trl_$label.log 2>&1
  echo "trl $label rc=$?"; grep RESULT $LOGS/trl_$label.log | tail -1 | tee $OUT/trl_$label.json
}
ours() {  # $1 label, then e2e_gpu.py arguments
  local label=$1; shift
  OUT=$LOGS timeout $(run_limit) $PY bench/e2e_gpu.py --tag $label "$@" > $LOGS/ours_$label.log 2>&1
  echo "ours $label rc=$?"; grep -E "median step|^peak |generated tokens" $LOGS/ours_$label.log | tail -6
  cp $LOGS/e2e-*$label*.json $OUT/ 2>/dev/null
  for run in /tmp/peer*/runs/*$label; do  # what the offline analysis needs: phases, plan, metrics, memory samples
    mkdir -p $LOGS/run_$label; cp $run/metrics.jsonl $run/timeline.jsonl $run/residency.json $LOGS/run_$label/ 2>/dev/null
    cp $(dirname $(dirname $run))/mem-*$label*.csv $LOGS/run_$label/ 2>/dev/null
    cp -r $run/profile $LOGS/run_$label/ 2>/dev/null  # --profile_step's tables and traces
  done
}

case "$1" in
stage)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .device-carry/*.whl || exit 1
  ldd --version | head -1; nproc; free -g | head -2
  # Background (own session, outlives this call), while the vLLM parts are carried in: the models the later phases
  # load (CPU), DeepSpeed's CUDA Adam, then the GPU benches that need no vLLM (issues 24 and 20; they record into
  # this copy's RESULTS.md, which `pack` brings back). Timed phases wait for "done": nothing else runs beside them.
  # They run from a copy of the tree (the next call's transfer replaces this one) and append rows to
  # /tmp/logs/bg/rows.md (BENCH_RESULTS), which phase a brings back.
  mkdir -p /tmp/logs/bg /tmp/bgrepo && cp -r bench packages /tmp/bgrepo/
  ( cd /tmp/bgrepo && export BENCH_RESULTS=/tmp/logs/bg/rows.md \
      PYTHONPATH=/tmp/site:$(printf '/tmp/bgrepo/packages/%s/src:' hybrid-core hybrid-engines hybrid-algos hybrid-cli)
    refpeak="timeout 200 $PY bench/reference_peak_gpu.py --shape 1b --record > /tmp/logs/bg/refpeak_1b.log 2>&1; \
        timeout 300 $PY bench/reference_peak_gpu.py --shape 8b --record > /tmp/logs/bg/refpeak_8b.log 2>&1;"
    [ "${STAGE_REFPEAK:-1}" = 1 ] || refpeak=""
    gpu="( $refpeak \
        RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561 timeout 900 \
          $PY bench/packing_gpu.py --record --dynamic --packed-attention auto segments sdpa-mask \
          > /tmp/logs/bg/packing.log 2>&1; echo gpubench ) &"
    [ "${STAGE_GPU_BENCHES:-1}" = 1 ] || gpu=""
    # STAGE_SMOKE=1: FSDP2 end to end on the GPU with the built-in engine (357M, 3 steps), a check before the timed
    # phases (its log: /tmp/logs/bg/smoke_f2.log, "smoke rc=" in stage_bg.log)
    smoke="OUT=/tmp/logs/bg timeout 400 $PY bench/e2e_gpu.py --size 357m --backend hf --trainer fsdp2 --steps 3 \
        --warmup 1 --micro 16 --tag smoke > /tmp/logs/bg/smoke_f2.log 2>&1; echo smoke rc=\$?;"
    [ "${STAGE_SMOKE:-0}" = 1 ] || smoke=""
    builds=""; for size in ${STAGE_SIZES-1.5b 7b}; do
      builds="$builds $PY bench/peer_workload.py /tmp/peer-$size $size && echo built${size//./}; "; done
    setsid nohup bash -c "$PY bench/peer_workload.py /tmp/peer 357m && echo built357; \
      $PY -c 'from deepspeed.ops.op_builder import FusedAdamBuilder as B; B().load()' && echo builtadam; \
      $smoke $gpu $builds wait; echo bg-all-done" \
      > /tmp/logs/stage_bg.log 2>&1 < /dev/null & )
  echo "staged base wheels; background builds and benches started"
  ;;
bg)
  # where the background work stands (any time while the machine is warm)
  cat /tmp/logs/stage_bg.log; for f in /tmp/logs/bg/*.log; do echo "== $f"; tail -6 $f; done
  cat /tmp/logs/bg/rows.md 2>/dev/null
  [ -f /tmp/logs/suite/suite.log ] && { echo "== suite"; tail -c 600 /tmp/logs/suite/suite.log; }
  tar -czf "$OUT/bg.tgz" -C /tmp/logs bg
  ;;
suite)
  # The test suite as CI runs it, on this machine's CPU (the GPU hidden; hidden GPUs are declared as fake ones), from
  # a copy of the tree (the next call's transfer replaces this one), in its own session so it outlives the call.
  rm -rf /tmp/suiterepo /tmp/logs/suite; mkdir -p /tmp/suiterepo /tmp/logs/suite
  # the packages staged so far, frozen for the suite (vLLM installed into /tmp/site later must not change it mid-run)
  rm -rf /tmp/site-suite; cp -r /tmp/site /tmp/site-suite
  tar --exclude='./.carry*' --exclude=./.whl --exclude=./.device-carry --exclude=./.old --exclude=./.git -cf - . \
    | tar -xf - -C /tmp/suiterepo
  # Its own TORCH_EXTENSIONS_DIR: DeepSpeed's CPU accelerator builds its Adam under the CUDA op's name (fused_adam),
  # and in the GPU runs' /tmp/tx it replaced their CUDA kernel -- a GPU actor then died in Adam_Optimizer::Step_AVX.
  # The packages are on PYTHONPATH, not installed: a `hybrid` shim stands in for the console script.
  mkdir -p /tmp/suitebin && printf '#!/bin/sh\nexec %s -m hybrid_cli "$@"\n' "$(command -v $PY)" > /tmp/suitebin/hybrid
  chmod +x /tmp/suitebin/hybrid
  ( cd /tmp/suiterepo && export CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu BENCH_RESULTS=/tmp/logs/suite/rows.md \
      TORCH_EXTENSIONS_DIR=/tmp/tx-cpu PATH=/tmp/suitebin:$PATH \
      PYTHONPATH=/tmp/site-suite:$(printf '/tmp/suiterepo/packages/%s/src:' hybrid-core hybrid-engines hybrid-algos hybrid-cli)
    # SUITE_CPUS (e.g. 8-15): the suite on those cores only, so GPU runs pinned to the others beside it keep theirs
    env -u RAY_AUTH_MODE setsid nohup ${SUITE_CPUS:+taskset -c $SUITE_CPUS} bash -c "s=\$(date +%s); $PY -m pytest -n ${SUITE_WORKERS:-8} --dist loadfile \
      -p no:randomly -q --timeout 900 > /tmp/logs/suite/suite.log 2>&1; echo \"suite rc=\$? in \$(( \$(date +%s) - s )) s\" \
      >> /tmp/logs/suite/suite.log" < /dev/null > /dev/null 2>&1 & )
  echo "suite started: $(lscpu | grep -E 'Model name|^CPU\(s\)' | tr -s ' ' | paste -sd';')"
  ;;
suitelog)
  # SUITE_WAIT=N: wait up to N s for the suite to finish first
  for i in $(seq $(( ${SUITE_WAIT:-0} / 10 ))); do suite_running || break; sleep 10; done
  tail -c 3000 /tmp/logs/suite/suite.log; tar -czf "$OUT/suite.tgz" -C /tmp/logs suite
  ;;
e)
  # ZeRO-3 + reference (issue 17's second figure): the same code ran 0.79-1.11 s/step across calls, phases moving
  # together, so TRL and ours take turns twice in one call and the ratio is of the medians of both turns each.
  wait_for bg-all-done; cleanup; monitor
  lscpu | grep -E "Model name|NUMA|MHz" | tr -s ' '; nvidia-smi topo -m 2>/dev/null | head -3
  sglang=${E_SGLANG:-0}
  for turn in ${E_TURNS:-1 2}; do
    trl 357m_$turn /tmp/peer/model vllm --steps 6; cleanup
    ours z3i$turn --size 357m --steps 10 --warmup 2; cleanup
    if [ "${E_THREADS1:-0}" = 1 ]; then  # the same run with the engine actor on Ray's one torch thread (A/B)
      HYBRID_ENGINE_THREADS=1 ours z3t1_$turn --size 357m --steps 10 --warmup 2; cleanup
    fi
    if [ "${E_MICRO64:-0}" = 1 ]; then  # the same set-up trained in TRL's micro-batch (64 completions, one per step)
      ours z3m64_$turn --size 357m --steps 10 --warmup 2 --micro 64; cleanup
    fi
    if [ -n "${E_EXTRA:-}" ]; then  # an A/B variant: TRL's micro-batch with these hybrid flags added
      ours z3x_$turn --size 357m --steps 10 --warmup 2 --micro 64 -- $E_EXTRA; cleanup
    fi
    if [ "${E_PROFILE:-0}" = 1 ]; then  # TRL's micro-batch again, step 6 under the profilers (--profile_step)
      ours z3prof_$turn --size 357m --steps 8 --warmup 2 --micro 64 -- --profile_step 6; cleanup
    fi
    if [ "$sglang" = 1 ]; then sglang=0
      # issue 19: the same set-up on SGLang, next to this call's vLLM figure (SGLang carry staged)
      PYTHONPATH=/tmp/site-sglang:$PYTHONPATH OUT=$LOGS timeout $(left 585) $PY bench/e2e_gpu.py --algo grpo --size 357m \
        --steps 10 --warmup 2 --backend sglang --tag sglang > $LOGS/e2e_sglang.log 2>&1
      echo "sglang grpo rc=$?"; grep -E "median step|^(generate|infer|train|sync) " $LOGS/e2e_sglang.log | tail -6
      cp $LOGS/e2e-*sglang*.json $OUT/ 2>/dev/null; cleanup
    fi
  done
  kill $MON 2>/dev/null
  $PY - $OUT <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
trl = [json.loads(open(f).read().split("RESULT", 1)[-1])["median_step_s"]
       for f in sorted(glob.glob(f"{out}/trl_357m_*.json")) if open(f).read().strip()]
ours = [json.load(open(f))["step_s"] for f in sorted(glob.glob(f"{out}/e2e-*z3i*.json"))]
m64 = [json.load(open(f))["step_s"] for f in sorted(glob.glob(f"{out}/e2e-*z3m64*.json"))]
x = [json.load(open(f))["step_s"] for f in sorted(glob.glob(f"{out}/e2e-*z3x_*.json"))]
if trl and x:
    print(f"variant (E_EXTRA) in TRL's micro-batch: {statistics.median(trl) / statistics.median(x):.3f} "
          f"(TRL {statistics.median(trl):.3f} s / ours {statistics.median(x):.3f} s)")
print("TRL per turn", trl, "ours per turn", ours, "ours in micro-batches of 64", m64)
if trl and ours:
    print(f"speedup vs TRL ZeRO-3+ref x = {statistics.median(trl) / statistics.median(ours):.3f} "
          f"(TRL {statistics.median(trl):.3f} s / ours {statistics.median(ours):.3f} s)")
if trl and m64:
    print(f"speedup vs TRL ZeRO-3+ref x, TRL's micro-batch = {statistics.median(trl) / statistics.median(m64):.3f} "
          f"(TRL {statistics.median(trl):.3f} s / ours {statistics.median(m64):.3f} s)")
PY
  pack e
  ;;
ws)
  # issue 34: the weight sync's verification cost, split per side (--verbose) with both sides' profiles (--profile);
  # WS_RECORD=1 records the rows (into this phase's rows.md)
  cleanup; OUT=$LOGS timeout $(left ${PHASE_BUDGET:-300}) $PY bench/weight_sync.py --mode ipc --verbose ${WS_PROFILE---profile} \
    ${WS_RECORD:+--record} ${WS_ARGS:-} > $LOGS/weight_sync.log 2>&1
  echo "weight sync rc=$?"; grep -vE "^\s*$" $LOGS/weight_sync.log | tail -${WS_LINES:-60}; cat $LOGS/rows.md 2>/dev/null
  pack ws
  ;;
tr)
  # issue 37: the train phase alone (bench/trainer_gpu.py): DeepSpeed ZeRO-1 against FSDP2 and its options, one GPU,
  # the same micro-batches; TR_ARGS replaces the default shape/variants, TR_PROFILE=1 profiles each variant's last step
  wait_for builtadam; cleanup
  RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 OUT=$LOGS timeout $(left ${PHASE_BUDGET:-300}) $PY bench/trainer_gpu.py \
    ${TR_ARGS:---size 1.5b --micro 8 --seq 1280 --micro_batches 16 --steps 3} ${TR_PROFILE:+--profile} \
    > $LOGS/trainer.log 2>&1
  echo "trainer rc=$?"; grep -vE "^\s*$|^-+" $LOGS/trainer.log | tail -${TR_LINES:-16}; cp $LOGS/trainer_gpu.json $OUT/ 2>/dev/null
  pack tr
  ;;
pr)
  # issue 34 section 5: bench/peer_ratio.py's fair protocol, ours against TRL at its default and with sleep, turns
  # alternating in this call; PR_WORKLOAD (default 357m-matched), PR_PEERS, PR_TURNS (default 3), PR_TIMEOUT per side;
  # PR_OFFSET=N: a call of PR_TURNS=1 continuing N earlier ones (ours took ~240 s at 357M: three turns of three sides
  # do not fit one call), their JSONs joined afterwards by `python bench/peer_ratio.py report a.json b.json c.json`
  # --record (a call of fewer than 3 turns records nothing: peer_ratio.py refuses --record there)
  wait_for built357; wait_for builtadam; cleanup; monitor
  timeout $(left ${PHASE_BUDGET:-585}) $PY bench/peer_ratio.py --workload ${PR_WORKLOAD:-357m-matched} \
    ${PR_PEERS:+--peers $PR_PEERS} --turns ${PR_TURNS:-3} ${PR_OFFSET:+--turn_offset $PR_OFFSET} --run_timeout ${PR_TIMEOUT:-240} --out $LOGS/ratio \
    $([ "${PR_TURNS:-3}" -ge 3 ] && echo --record) \
    > $LOGS/peer_ratio.log 2>&1
  echo "peer ratio rc=$?"; grep -vE "^\s*$" $LOGS/peer_ratio.log | tail -${PR_LINES:-40}; cat $LOGS/rows.md 2>/dev/null
  cp $LOGS/ratio/*.json $OUT/ 2>/dev/null; kill $MON 2>/dev/null
  pack pr
  ;;
fs)
  # issue 37: the trainer backends on the 1.5B workload (reference + KL, vLLM colocated, one GPU), DeepSpeed
  # (--zero_stage 3: one rank runs it as ZeRO-1) then FSDP2, the same call; FS_STEPS measured steps after one warm-up
  wait_for built15; wait_for builtadam; cleanup; monitor
  # FS_BACKEND=hf: the built-in engine (no vLLM carried; the train phase is the same work)
  fsb="--backend ${FS_BACKEND:-vllm}"
  # FS_DS=0: FSDP2 only (the DeepSpeed run of an earlier call stands: its json is in that call's $OUT)
  [ "${FS_DS:-1}" = 1 ] && { ours fs_ds --size 1.5b --steps ${FS_STEPS:-4} --warmup 1 --micro 8 --gpu_util 0.3 $fsb -- ${FS_FLAGS:-}; cleanup; }
  ours fs_f2 --size 1.5b --steps ${FS_STEPS:-4} --warmup 1 --micro 8 --gpu_util 0.3 $fsb --trainer fsdp2 -- ${FS_FLAGS:-}
  grep -E "Error|error:" $LOGS/ours_fs_f2.log | tail -5
  kill $MON 2>/dev/null
  $PY - $OUT <<'PY'
import glob, json, sys
runs = {k: json.load(open(f)) for k in ("fs_ds", "fs_f2") for f in glob.glob(f"{sys.argv[1]}/e2e-*{k}*.json")}
if len(runs) == 2 and all("phases_s" in r for r in runs.values()):
    ds, f2 = (runs[k]["phases_s"]["train"] for k in ("fs_ds", "fs_f2"))
    print(f"fsdp2 vs deepspeed train x = {ds / f2:.3f} (train DeepSpeed {ds:.3f} s / FSDP2 {f2:.3f} s); step "
          f"{runs['fs_ds']['step_s']:.3f} / {runs['fs_f2']['step_s']:.3f} s; peak error FSDP2 "
          f"{runs['fs_f2'].get('peaks', {}).get('worst_error_pct')}")
PY
  pack fs
  ;;
f7)
  # issue 37: ~7B (bench/peer_workload.py's 6.5B Qwen2 shape) under FSDP2 in TRL's precision (bf16 master weights and
  # Adam state) + reference + vLLM on one GPU, then TRL on the same folder (F7_TRL=0: not), the same call
  rm -rf /tmp/peer*/runs /tmp/logs/ratio  # the 7B save needs the disk (64 GB: ENOSPC on 2026-12-04)
  cleanup; monitor; free -g | head -2
  if [ ! -f /tmp/peer-7b/model/config.json ]; then
    PEER_BUILD_DEVICE=cuda timeout 300 $PY bench/peer_workload.py /tmp/peer-7b 7b > $LOGS/build7b.log 2>&1
    echo "7b build rc=$? in $(( $(date +%s) - t0 )) s"; cleanup
  fi
  # F7_WARMUP (default 1): the steps dropped on both sides (one clock: bench/_common.py)
  ours f7 --size 7b --steps ${F7_STEPS:-3} --warmup ${F7_WARMUP:-1} --gpu_util 0.2 --micro 4 --trainer fsdp2 -- \
    --bf16_master_weights --bf16_optimizer_states --no_final_checkpoint ${F7_FLAGS:-}
  grep -E "^(generate|infer|train|sync|sleep|wake) |residency|peak error|Error|error:" $LOGS/ours_f7.log | tail -14
  if [ "${F7_TRL:-1}" = 1 ]; then cleanup
    trl 7b /tmp/peer-7b/model vllm --prompts 16 --max_new 512 --micro 4 --ckpt --steps ${F7_TRL_STEPS:-${F7_STEPS:-3}} \
      --warmup ${F7_WARMUP:-1} --gpu_util 0.2
  fi
  kill $MON 2>/dev/null; free -g | head -2
  $PY - $OUT <<'PY'
import glob, json, sys
out = sys.argv[1]
ours = [json.load(open(f)) for f in glob.glob(f"{out}/e2e-*f7*.json")]
trl = [json.loads(open(f).read().split("RESULT", 1)[-1]) for f in glob.glob(f"{out}/trl_7b.json") if open(f).read().strip()]
if ours and trl and "step_s" in ours[0]:
    print(f"speedup vs TRL 7B x = {trl[0]['median_step_s'] / ours[0]['step_s']:.3f} (TRL {trl[0]['median_step_s']:.2f} s / "
          f"ours FSDP2 {ours[0]['step_s']:.2f} s)")
PY
  pack f7
  ;;
f)
  # issue 21: --async_train against the synchronous auto plan on the 1.5B workload, one GPU, same call
  wait_for built15; wait_for builtadam; cleanup; monitor
  # F_MPS=1: the asynchronous run under CUDA MPS (a private control daemon for that run; the sync run without)
  OUT=$LOGS timeout 575 $PY bench/async_gpu.py --size 1.5b --workdir /tmp/peer-1.5b --sync_plans auto --steps 4 \
    --warmup 1 --record ${F_MPS:+--async_under_mps} > $LOGS/async.log 2>&1
  echo "async rc=$?"; grep -E "^\[|async speedup|appended|mps" $LOGS/async.log | tail -8; cp $LOGS/async-*.json $OUT/ 2>/dev/null
  kill $MON 2>/dev/null; cat $LOGS/rows.md 2>/dev/null
  pack f
  ;;
g)
  # issue 17's generate overhead (recorded), then issue 22's agent rollouts with and without prefix caching
  wait_for bg-all-done; cleanup; monitor
  if [ "${G_REC:-1}" = 1 ]; then  # G_REC=0: only the multi-process variant below
    OUT=$LOGS timeout 300 $PY bench/generate_overhead.py --model /tmp/peer/model --repeats 10 --record \
      > $LOGS/genoverhead.log 2>&1
    echo "generate overhead rc=$?"; grep -E "^\[|^[A-H]0? |variant|load average|appended" $LOGS/genoverhead.log | tail -26
    cp $LOGS/genoverhead.json $OUT/ 2>/dev/null; cleanup
  fi
  if [ "${G_MP:-1}" = 1 ]; then  # the same A-D with vLLM's engine core in its own process (vLLM's default)
    OUT=$LOGS timeout 200 $PY bench/generate_overhead.py --model /tmp/peer/model --repeats 10 --vllm_mp \
      > $LOGS/genoverhead-mp.log 2>&1
    echo "generate overhead (vLLM multi-process) rc=$?"; grep -E "^\[|^[A-D] |variant|load average" \
      $LOGS/genoverhead-mp.log | tail -10
    cp $LOGS/genoverhead-mp.json $OUT/ 2>/dev/null; cleanup
  fi
  if [ "${G_AGENTS:-1}" = 1 ]; then
    OUT=$LOGS timeout $(left 585) $PY bench/agent_gpu.py --model /tmp/peer/model --record > $LOGS/agent.log 2>&1
    echo "agents rc=$?"; tail -14 $LOGS/agent.log; cp $LOGS/agent_gpu.json $OUT/ 2>/dev/null
  fi
  kill $MON 2>/dev/null; cat $LOGS/rows.md 2>/dev/null
  pack g
  ;;
smoke)
  wait_for built357; wait_for builtadam
  OUT=$LOGS timeout 150 $PY bench/residency_gpu.py --model /tmp/peer/model > $LOGS/residency_gpu.log 2>&1
  echo "kv release rc=$?"; tail -5 $LOGS/residency_gpu.log; cp $LOGS/residency_gpu.json $OUT/ 2>/dev/null
  ours smoke --size 357m --steps 4 --warmup 1 --zero_stage 1 --micro 64 -- --residency_pins actor.optimizer=offload rollout.kv_cache=release
  pack smoke
  ;;
a)
  wait_for bg-all-done; uptime
  trl 357m /tmp/peer/model vllm --steps 6
  ours matched --size 357m --steps 10 --warmup 2 --kl 0 --zero_stage 1 --micro 64
  ours zero3ref --size 357m --steps 10 --warmup 2
  cp -r /tmp/logs/bg $LOGS/ 2>/dev/null; cat /tmp/logs/bg/rows.md 2>/dev/null
  pack a
  ;;
b)
  wait_for built15
  trl 1.5b /tmp/peer-1.5b/model vllm --prompts 32 --max_new 1024 --micro 8 --ckpt --steps 3 --gpu_util 0.3
  ours 1.5b --size 1.5b --steps 6 --warmup 1 --kl 0 --zero_stage 1 --micro 8 --gpu_util 0.3
  pack b
  ;;
c)
  # nothing beside it: the 7B plan keeps the actor's Adam state in host memory (CPU Adam needs the cores and ~97 GiB)
  wait_for bg-all-done; cleanup; monitor; free -g | head -2
  ours 7b --size 7b --steps 3 --warmup 1 --gpu_util 0.2 --micro 4
  trl 7b /tmp/peer-7b/model vllm --prompts 16 --max_new 512 --micro 4 --ckpt --steps 2 --gpu_util 0.2
  kill $MON 2>/dev/null; free -g | head -2
  pack c
  ;;
prof)
  # the ZeRO-3 + reference set-up in TRL's micro-batch, step 6 under the profilers (--profile_step): where the
  # seconds of train, reference and sync go (tables and traces in prof.tgz)
  wait_for built357; wait_for builtadam; cleanup
  ours z3prof --size 357m --steps 7 --warmup 2 --micro 64 -- --profile_step 6 ${PROF_EXTRA:-}
  for f in $LOGS/run_z3prof/profile/step6/*.txt; do echo "== $f"; head -${PROF_LINES:-30} $f; done
  pack prof
  ;;
build7b)
  # the ~7B model folder, initialised on the GPU (nothing else runs: seconds, against ~9 min on the CPU)
  cleanup; [ -f /tmp/peer-7b/model/config.json ] || PEER_BUILD_DEVICE=cuda timeout 500 $PY bench/peer_workload.py \
    /tmp/peer-7b 7b > $LOGS/build7b.log 2>&1; echo "7b build rc=$? in $(( $(date +%s) - t0 )) s"; du -sh /tmp/peer-7b/model
  ;;
c7)
  # ~7B with ZeRO-3 + reference + vLLM on one 80 GB GPU, trained in bf16 (master weights and Adam state, as TRL
  # trains it; C7_FLAGS): the model is built on the GPU first (nothing runs beside it), then ours (auto plan).
  # C7_TRL=1: TRL on the same folder after ours, in the same call (or run `c7t` in the next call).
  cleanup; monitor; free -g | head -2
  if [ ! -f /tmp/peer-7b/model/config.json ]; then
    PEER_BUILD_DEVICE=cuda timeout 300 $PY bench/peer_workload.py /tmp/peer-7b 7b > $LOGS/build7b.log 2>&1
    echo "7b build rc=$? in $(( $(date +%s) - t0 )) s"; cleanup
  fi
  ours 7bbf16 --size 7b --steps ${C7_STEPS:-3} --warmup 1 --gpu_util 0.2 --micro 4 -- ${C7_FLAGS---bf16_master_weights --bf16_optimizer_states --no_final_checkpoint}
  grep -E "^(generate|infer|train|sync|sleep|wake) |residency|peak error|Error|error:" $LOGS/ours_7bbf16.log | tail -14
  if [ "${C7_TRL:-0}" = 1 ]; then cleanup
    trl 7b /tmp/peer-7b/model vllm --prompts 16 --max_new 512 --micro 4 --ckpt --steps 2 --gpu_util 0.2
  fi
  kill $MON 2>/dev/null; free -g | head -2
  pack c7
  ;;
c7t)
  # TRL on c7's 7B folder (the same machine, the next call)
  cleanup; trl 7b /tmp/peer-7b/model vllm --prompts 16 --max_new 512 --micro 4 --ckpt --steps 2 --gpu_util 0.2
  pack c7t
  ;;
z)
  # the ZeRO-3 + reference set-up: yesterday's code (.old, commit ab94ac3: 0.69 s/step on an H100) against today's,
  # and today's without the reference (KL 0); then the generate-overhead variants
  wait_for built357; wait_for builtadam; uptime
  ours z3new --size 357m --steps 10 --warmup 2
  ( cd .old && OUT=$LOGS timeout 200 $PY bench/e2e_gpu.py --tag z3old --size 357m --steps 10 --warmup 2 \
      > $LOGS/ours_z3old.log 2>&1; echo "old z3 rc=$?"; grep -E "median step" $LOGS/ours_z3old.log | tail -2 )
  cp $LOGS/e2e-*z3old*.json $OUT/ 2>/dev/null
  ours z3nokl --size 357m --steps 10 --warmup 2 --kl 0
  OUT=$LOGS timeout $(left 590) $PY bench/generate_overhead.py --model /tmp/peer/model --repeats 10 \
    > $LOGS/genoverhead.log 2>&1
  echo "generate overhead rc=$?"; tail -9 $LOGS/genoverhead.log; cp $LOGS/genoverhead.json $OUT/ 2>/dev/null
  pack z
  ;;
d)
  # the generate-overhead variants on a quiet machine, the ZeRO-3 + reference set-up again, then 7B (auto) on 80 GB
  # (the generate-overhead script builds three engines first, ~2.5 min: it needs ~5 min of the call)
  wait_for bg-all-done; uptime
  OUT=$LOGS timeout 330 $PY bench/generate_overhead.py --model /tmp/peer/model > $LOGS/genoverhead.log 2>&1
  echo "generate overhead rc=$?"; tail -9 $LOGS/genoverhead.log; cp $LOGS/genoverhead.json $OUT/ 2>/dev/null
  ours zero3ref2 --size 357m --steps 10 --warmup 2
  ours 7b --size 7b --steps 3 --warmup 1 --gpu_util 0.2 --micro 4
  pack d
  ;;
h)
  # issue 22's agent rollouts (vLLM), then issue 19's built-in demo on SGLang (SGLang carry staged), then the suite's log
  wait_for built357; cleanup
  if [ "${H_AGENTS:-1}" = 1 ]; then  # H_AGENTS=0: the SGLang demo only
    OUT=$LOGS timeout 300 $PY bench/agent_gpu.py --model /tmp/peer/model --record > $LOGS/agent.log 2>&1
    echo "agents rc=$?"; tail -14 $LOGS/agent.log; cp $LOGS/agent_gpu.json $OUT/ 2>/dev/null; cleanup
  fi
  PYTHONPATH=/tmp/site-sglang:$PYTHONPATH timeout $(left 480) $PY -m hybrid_cli grpo --backend sglang \
    --vllm_gpu_memory_utilization 0.3 --save_path /tmp/demo_sglang_h > $LOGS/demo_sglang.log 2>&1; echo "demo rc=$?"
  cp /tmp/demo_sglang_h/metrics.jsonl $LOGS/demo_metrics.jsonl 2>/dev/null; tail -4 $LOGS/demo_sglang.log
  cat $LOGS/rows.md 2>/dev/null; tail -c 1500 /tmp/logs/suite/suite.log; cp -r /tmp/logs/suite $LOGS/ 2>/dev/null
  pack h
  ;;
esac
