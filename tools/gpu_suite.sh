#!/bin/bash
# Every GPU check and the benchmarks, in one device call, from the repository alone
# (in the package's environment: `make`'s .venv activated, or torch and nvFuser installed):
#   bash tools/gpu_suite.sh
# Writes JSON under $OUT (default ./gpu_out) and prints a short table last.
# Ranks that share a GPU run through the package's own launcher (tpfuser.dist.sharegpu).
#
# ONLY="fwd+bwd train" picks the steps, in order; steps joined by + run at once:
#   tests  pytest -m gpu on TESTS (default tests/), narrowed by K, bound TESTS_S (s); TEST_JOBS=n: in n
#          pytest processes at once, balanced by their committed times (TEST_LINES="1 3": only those)
#   fwd, bwd, bwdmesh   the forward tests; the backward's without and with a mesh (BWD_K narrows)
#   train, bench, gpt3  benchmarks: nanogpt fwd+bwd, nanogpt fwd, gpt3 fwd (ITERS samples, 30; gpt3
#           half); bounds TRAIN_S, BENCH_S, GPT3_S (the graph peers add torch.compile's and the
#           captures' time); TRAIN_IMPLS, BENCH_IMPLS, GPT3_IMPLS: --impl for each (default: the
#           bench's); the GPU's clocks and power sampled meanwhile (clocks_<step>.csv)
#   peers, peersfwd, peerstrain, peersgpt3  benchmarks against the peers a user would pick (torch.compile
#           max-autotune, Thunder: its wheels from tools/peer_wheels.sh installed first), with --profile (each
#           kernel against its work, the idle gaps): nanogpt fwd then fwd+bwd (peersfwd, peerstrain: one); gpt3 fwd. PEERS_IMPLS, PEERS_TRAIN_IMPLS, PEERS_GPT3_IMPLS:
#           --impl for each; bounds PEERS_S, PEERS_TRAIN_S, PEERS_GPT3_S (max-autotune tunes GEMMs for minutes)
#   speed   candidate schedules (SPEED_SCHEDULES: names or files) beside the default, reduce-overhead and Thunder's
#           graphs: nanogpt forward and training step, profiled (the peers step's benches and files); then each
#           checked at nanogpt 1x1 (SPEED_CHECKS: quick jobs instead); bounds PEERS_S, PEERS_TRAIN_S, QUICK_S
#   fmprobe  nvFuser's own matmul kernels (fuse_matmul) on a linear and its epilogues, against ATen's GEMM
#           (tools/probes/fuse_matmul_probe.py; FMPROBE_PRESETS, default "nanogpt gpt3"); bound FMPROBE_S
#   mesh    every mesh checked to the end, forward and backward, its ranks sharing the GPU
#           (tools/mesh_suite.py; MESH picks groups or jobs, default "tiny nanogpt gpt3"; bound MESH_S)
#   overlap  the overlapped linears (tools/overlap_check.py) at tp 2 and 4, side by side, ranks sharing
#           the GPU (correctness and the communications posted; not speed); bound OVERLAP_S
#   overlapped  the overlapped schedules checked on every rank (`check --collectives --share-gpu`),
#           OVERLAP_JOBS picks some ("tp2c4 tp4c4 sp2c4 sp4c4 tp2c2 sp2c2 str2c4 strsp2c4", or tp8c4,
#           dp2tp2); bound OVERLAP_S
#   race  the chunked row-parallel all-reduce on 2 ranks sharing the GPU: the GPU test with
#           CUDA_DEVICE_MAX_CONNECTIONS=1, then the run without it recorded (race_control.json:
#           a negative control, a record, not a test); bound OVERLAP_S
#   onehead  the one-head-per-rank reproducer (tools/repro_one_head.py, every form) at tp 2 with 2 and
#           4 heads and at tp 8 with 8, side by side, ranks sharing the GPU; bound ONEHEAD_S
#   onehead2  one head per rank: tiny with 2 heads at tp 2 under each candidate schedule
#           (ONEHEAD_SCHEDULES, default tools/schedules/onehead-*.json), side by side; bound ONEHEAD_S
#   rsrepro  nvFuser 0.2.36 and a reduce-scatter chunked on the stream axis
#           (tools/probes/repro_chunked_reduce_scatter.py, 2 ranks sharing the GPU); bound RSREPRO_S
#   graphs  CUDA graphs: tests/test_gpu_graphs.py at 1x1, and `check --graphs` at 1x2 and 2x2
#           (replays against the called block, bit for bit), side by side; bound GRAPHS_S
#   startup  the first call in fresh processes (bench --startup): nanogpt's forward and training step, every
#           implementation (STARTUP_IMPLS: --impl), at the default schedule; nvFuser alone at the schedules
#           STARTUP_SCHEDULES (names or files; set empty: none); gpt3's forward, nvFuser and torch.compile
#           (STARTUP_GPT3=0: not). Alone on the machine (compiles are CPU-bound)
#   firstcall  tools/probes/first_call_probe.py, one fresh process each, one after another: the first call
#           fusion by fusion (segmenting, compile, kernels) for each of FIRSTCALL_RUNS ("schedule:pass:threads[:flags]",
#           pass train or forward, threads NVFUSER_NUM_THREADS or - for nvFuser's default, flags the probe's
#           without their dashes, joined by commas, e.g. no-twins; a schedule by name or
#           file, e.g. tools/schedules/first-call-*.json); bound FIRSTCALL_S each
#   calibrate  tools/calibrate.py for CALIBRATE_PRESETS (default "gpt3 nanogpt") at tp 1 2 4 5 8, into
#           $OUT/calibration.json (CALIBRATE_ARGS: more arguments, e.g. --no-beside); bound CALIBRATE_S
#   main    `make`'s job (`tpfuser main`: check of both dtypes, the default preset, 1x1), timed whole into
#           $OUT/main.json (wall seconds, exit code); MAIN_ARGS: more arguments; bound MAIN_S. Alone on the machine
#   quick   correctness at the default and the overlapped schedules, side by side: nanogpt 1x1, tiny 1x2 and
#           2x2 (ranks sharing the GPU), TP and SP, fp32 and bf16, forward and backward, collectives as planned
#           (QUICK_JOBS picks some: "nano11 tiny12 tiny12sp tiny22 ovl12 ovl12sp", or tiny22sp, tiny14sp; JOB@SCHEDULE runs
#           any but the ovl ones at a named schedule or a schedule file, e.g. "tiny12sp@megatron-sp-cut-linears"); bound QUICK_S
#   multi   several GPUs, a GPU per rank: tools/multigpu.py, every schedule at tp 2, 4, 8 (nanogpt 5) checked on
#           every rank, then its forward and training step benched (--profile: each rank's collectives from its
#           trace), torch's peers (dtensor, dtensor-async), the machine's curves (tools/comm_curves.py) and
#           calibration, and plan --predict held against each; its state in MULTI_STATE (default
#           results/tmp/multigpu: a later call goes on where one stopped), its table and an archive of the state
#           in $OUT/multigpu; MULTI_ARGS: more arguments (--jobs gpt3_tp8_*; on one GPU: --gpus 2 --share-gpu,
#           not for speed); bound MULTI_S (the tool ends its last step and writes its table before it)
# SUITE_S: no step starts after this many seconds. At most 8 files come back from
# the device: the summary, and everything else in run.tar.gz.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
# The default: every check (side by side), then the benchmarks (alone). About 12
# minutes on one H200; a 600 s device call takes it in two halves.
ONLY=${ONLY:-fwd+bwd+bwdmesh graphs mesh train bench gpt3}
TESTS=${TESTS:-tests} K=${K:-}
export PYTHONPATH=$PWD:${PYTHONPATH:-} NVIDIA_TF32_OVERRIDE=0 PYTHONUNBUFFERED=1
export TPFUSER_GPU_RECORD=$OUT/gpu_record.jsonl   # the figures behind the GPU tests (tests/conftest.py)
# Every step's time bound is cut to what is left before SUITE_END_S (s), so
# that the summary and the archive are always written within a device call.
END=$((SECONDS + ${SUITE_END_S:-100000}))
T() {   # T bound [timeout's options] -- command...
  local s=$1 opts=(); shift
  while [[ $1 != -- ]]; do opts+=("$1"); shift; done; shift
  local left=$((END - SECONDS)); (( left < s )) && s=$left; (( s < 1 )) && s=1
  timeout "${opts[@]}" "$s" "$@"
}

pytest_gpu() {  # name, files, -k expression
  # SIGINT, not SIGTERM, at the bound: pytest then still writes its report and summary.
  T ${TESTS_S:-400} -s INT -- python3 -m pytest -v -m gpu $2 ${3:+-k "$3"} -p no:cacheprovider --junitxml="$OUT/gpu_$1.xml" 2>&1 \
    | tee "$OUT/$1.log" | grep -E "PASSED|FAILED|XFAIL|XPASS|ERROR|SKIPPED|passed|failed" | cut -c1-200 | tail -40
}
shim_path() {   # the default-stream shim nvFuser 0.2.36's host IR needs on ranks sharing a GPU
  # (tpfuser/dist/shim/default_stream.c; SHIM_SO: one built elsewhere and carried, where this machine has no C compiler)
  [[ -n ${SHIM_SO:-} ]] && { echo "$SHIM_SO"; return; }
  python3 -c "from tpfuser.dist.sharegpu import build_default_stream_shim as b; print(b())"
}
# A tool on N ranks sharing GPU 0: torchrun --nproc-per-node N "${SHARED_RANKS[@]}" SCRIPT ARGS..., each rank
# set up by tpfuser.dist.sharegpu (NCCL's hosts, nvFuser's store; TPFUSER_DEFAULT_STREAM_SHIM preloaded when set)
SHARED_RANKS=(-m tpfuser.dist.sharegpu --script)
step_tests() {
  echo "== GPU tests (1x1): $TESTS ${K:+-k $K}${TEST_JOBS:+, in $TEST_JOBS pytest processes at once}"
  if [[ -z ${TEST_JOBS:-} ]]; then pytest_gpu tests "$TESTS" "$K"; return; fi
  # the selection as TEST_JOBS lines balanced by their committed times; TEST_LINES picks some (1-based)
  local lines i=0
  mapfile -t lines < <(python3 tools/gpu_coverage.py --split "$TEST_JOBS" --tests $TESTS ${K:+-k "$K"})
  for line in "${lines[@]}"; do
    i=$((i + 1))
    [[ -z ${TEST_LINES:-} || " $TEST_LINES " == *" $i "* ]] || continue
    pytest_gpu tests_$i "$line" "" > "$OUT/tests_$i.txt" 2>&1 &
  done
  wait
  ls "$OUT"/tests_[0-9]*.txt | sort -V | xargs cat   # line 10 after line 9
}
step_fwd() { echo "== GPU tests (1x1): the forward"; pytest_gpu tests_fwd tests/test_gpu.py ""; }
step_bwd() { echo "== GPU tests (1x1): the backward without a mesh"; pytest_gpu tests_bwd tests/test_gpu_backward.py "${BWD_K:+($BWD_K) and }not mesh"; }
step_bwdmesh() { echo "== GPU tests (1x1): the backward on a mesh"; pytest_gpu tests_bwdmesh tests/test_gpu_backward.py "${BWD_K:+($BWD_K) and }mesh"; }
clocks() {   # clocks NAME command...: the command, with the GPU's SM clock, power, temperature and
  # clock-limit reasons sampled every 250 ms into $OUT/clocks_NAME.csv (the bench prints its phases' start times)
  local name=$1 pid rc; shift
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 250 > "$OUT/clocks_$name.csv" 2>&1 &
  pid=$!
  "$@"; rc=$?
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  return $rc
}
step_train() {
  echo "== benchmark: nanogpt forward+backward (a training step), with peak and saved memory"
  clocks train T ${TRAIN_S:-360} -- python3 -m tpfuser.bench --preset nanogpt --train --profile --json "$OUT/bench_nanogpt_train.json" \
    --iters ${ITERS:-30} ${TRAIN_IMPLS:+--impl "$TRAIN_IMPLS"} 2>&1 | tee "$OUT/train.log"
}
step_bench() {
  echo "== benchmark: nanogpt forward, nvFuser (1x1 mesh, and no mesh) vs eager vs torch.compile"
  clocks nanogpt T ${BENCH_S:-420} -- python3 -m tpfuser.bench --preset nanogpt --profile --json "$OUT/bench_nanogpt.json" \
    --iters $((${ITERS:-30} * 3)) ${BENCH_IMPLS:+--impl "$BENCH_IMPLS"} 2>&1 | tee "$OUT/bench.log"
}
step_mesh() {
  echo "== every mesh to the end, ranks sharing the GPU (tools/mesh_suite.py ${MESH:-tiny nanogpt gpt3})"
  mkdir -p "$OUT/mesh"
  T ${MESH_S:-540} -- python3 tools/mesh_suite.py "$OUT/mesh" ${MESH:-tiny nanogpt gpt3} 2>&1 | tee "$OUT/mesh.log" | tail -40
}
step_graphs() {
  echo "== CUDA graphs: replays equal to the called block (1x1 tests; check --graphs at 1x2 and 2x2, ranks sharing the GPU)"
  pytest_gpu tests_graphs tests/test_gpu_graphs.py "" > "$OUT/graphs_tests.txt" 2>&1 &
  for mesh in 1x2 2x2; do
    T ${GRAPHS_S:-400} -- python3 -m tpfuser.cli check --preset tiny --dp ${mesh%x*} --tp ${mesh#*x} --dtype fp32 bf16 \
      --graphs --share-gpu --json "$OUT/graphs_$mesh.json" > "$OUT/graphs_$mesh.txt" 2>&1 &
  done
  wait
  cat "$OUT/graphs_tests.txt"; grep -h -E "^(check|dtype|fp32|bf16|all|SOME)" "$OUT"/graphs_1x2.txt "$OUT"/graphs_2x2.txt | cut -c1-220
}
step_overlap() {
  echo "== overlapped linears: chunks on streams against the whole linear, ranks sharing the GPU"
  local shim tp; shim=$(shim_path) || return
  for tp in 2 4; do
    TPFUSER_DEFAULT_STREAM_SHIM=$shim TPFUSER_SHIM_LOG=1 NVFUSER_MASTER_PORT=$((29800 + tp)) T ${OVERLAP_S:-300} -- \
      python3 -m torch.distributed.run --standalone --nproc-per-node $tp "${SHARED_RANKS[@]}" tools/overlap_check.py --json "$OUT/overlap_tp$tp.json" > "$OUT/overlap_tp$tp.txt" 2>&1 &
  done
  wait
  grep -h "^rank 0" "$OUT"/overlap_tp*.txt | cut -c1-220
}
step_onehead() {
  echo "== one head per rank: the q/k/v split and its gradient in each form (tools/repro_one_head.py)"
  local run
  for run in 2:2 2:4 8:8; do
    NVFUSER_MASTER_PORT=$((29700 + ${run%:*} * 10 + ${run#*:})) T ${ONEHEAD_S:-240} -- \
      python3 -m torch.distributed.run --standalone --nproc-per-node ${run%:*} "${SHARED_RANKS[@]}" tools/repro_one_head.py ${run#*:} > "$OUT/onehead_tp${run%:*}_h${run#*:}.txt" 2>&1 &
  done
  wait
  grep -h "^rank 0:" "$OUT"/onehead_*.txt | cut -c1-400
}
step_gpt3() {
  echo "== benchmark: gpt3 forward at 1x1 (fewer samples: ~11 ms a call)"
  clocks gpt3 T ${GPT3_S:-300} -- python3 -m tpfuser.bench --preset gpt3 --profile --json "$OUT/bench_gpt3.json" \
    --iters $(((${ITERS:-30} + 1) / 2)) ${GPT3_IMPLS:+--impl "$GPT3_IMPLS"} 2>&1 | tee "$OUT/gpt3.log"
}
PEERS="compile-reduce-overhead,compile-max-autotune,thunder,thunder-graph"
step_peers() { step_peersfwd; step_peerstrain; }
step_peersfwd() {
  echo "== benchmark: nanogpt forward against torch.compile max-autotune and Thunder, profiled"
  clocks peers T ${PEERS_S:-240} -- python3 -m tpfuser.bench --preset nanogpt --profile --json "$OUT/bench_peers_nanogpt.json" \
    --iters $((${ITERS:-30} * 3)) --impl "${PEERS_IMPLS:-nvfuser-graph,nvfuser,eager,$PEERS,gemms,gemms+attention}" 2>&1 | tee "$OUT/peers.log"
}
step_peerstrain() {
  echo "== benchmark: nanogpt training step against torch.compile max-autotune and Thunder, profiled"
  clocks peers_train T ${PEERS_TRAIN_S:-360} -- python3 -m tpfuser.bench --preset nanogpt --train --profile \
    --json "$OUT/bench_peers_nanogpt_train.json" --iters ${ITERS:-30} \
    --impl "${PEERS_TRAIN_IMPLS:-nvfuser-graph,nvfuser,eager,$PEERS}" 2>&1 | tee "$OUT/peers_train.log"
}
step_peersgpt3() {
  echo "== benchmark: gpt3 forward against torch.compile max-autotune and Thunder, profiled"
  clocks peersgpt3 T ${PEERS_GPT3_S:-300} -- python3 -m tpfuser.bench --preset gpt3 --profile --json "$OUT/bench_peers_gpt3.json" \
    --iters $(((${ITERS:-30} + 1) / 2)) --impl "${PEERS_GPT3_IMPLS:-nvfuser-graph,eager,$PEERS}" 2>&1 | tee "$OUT/peersgpt3.log"
}

SPEED_SCHEDULES=${SPEED_SCHEDULES:-megatron-inline-masks tools/schedules/speed-qkv-view.json tools/schedules/speed-hash-uint64.json tools/schedules/speed-qkv-view-masks-inline.json tools/schedules/speed-qkv-view-masks-inline-uint64.json}
step_speed() {   # the peers' benches (peersfwd, peerstrain) with these implementations, then the checks
  local s impls="nvfuser-graph" jobs=""
  for s in $SPEED_SCHEDULES; do impls+=",nvfuser-graph@$s"; jobs+=" nano11@$s"; done
  PEERS_IMPLS="$impls,compile-reduce-overhead,thunder-graph" PEERS_TRAIN_IMPLS="$impls,compile-reduce-overhead" step_peers
  QUICK_JOBS=${SPEED_CHECKS:-$jobs} step_quick
}

step_fmprobe() {
  echo "== nvFuser's own matmul kernels (fuse_matmul) at the block's shapes, against ATen's GEMM (tools/probes/fuse_matmul_probe.py)"
  T ${FMPROBE_S:-300} -- python3 tools/probes/fuse_matmul_probe.py --preset ${FMPROBE_PRESETS:-nanogpt gpt3} \
    --json "$OUT/fmprobe.json" 2>&1 | tee "$OUT/fmprobe.log" | grep -v "^\[" | tail -24
}

step_startup() {
  echo "== the first call, each in a fresh process (bench --startup)"
  local s impls=(${STARTUP_IMPLS:+--impl "$STARTUP_IMPLS"})
  T ${STARTUP_S:-200} -- python3 -m tpfuser.bench --preset nanogpt --startup "${impls[@]}" --json "$OUT/startup_nanogpt.json" 2>&1 | tail -8
  T ${STARTUP_S:-200} -- python3 -m tpfuser.bench --preset nanogpt --startup --train "${impls[@]}" --json "$OUT/startup_nanogpt_train.json" 2>&1 | tail -8
  for s in ${STARTUP_SCHEDULES-megatron-whole megatron tools/schedules/masks-only.json}; do
    local opt=--schedule; [[ -f $s ]] && opt=--schedule-file
    local tag=$(basename "$s" .json)
    T ${STARTUP_S:-200} -- python3 -m tpfuser.bench --preset nanogpt --startup --impl nvfuser $opt "$s" \
      --json "$OUT/startup_nanogpt_$tag.json" 2>&1 | tail -3
    [[ $tag == megatron-whole ]] && continue   # its training step: 57.6 s, measured before (NOTES.md)
    T ${STARTUP_S:-200} -- python3 -m tpfuser.bench --preset nanogpt --startup --train --impl nvfuser $opt "$s" \
      --json "$OUT/startup_nanogpt_train_$tag.json" 2>&1 | tail -3
  done
  [[ ${STARTUP_GPT3:-1} == 1 ]] || return 0
  T ${STARTUP_S:-200} -- python3 -m tpfuser.bench --preset gpt3 --startup --impl nvfuser,compile \
    --json "$OUT/startup_gpt3.json" 2>&1 | tail -4
}
quick_job() {   # name, then check's arguments
  local name=$1; shift
  T ${QUICK_S:-300} -- python3 -m tpfuser.cli check --collectives --json "$OUT/quick_$name.json" "$@" > "$OUT/quick_$name.txt" 2>&1
}
quick_tag() {   # a quick job's file tag: JOB, or JOB_SCHEDULE for JOB@SCHEDULE (a file's path with . for /)
  local j=${1//\//.}; [[ $j == *@* ]] && echo "${j%%@*}_${j#*@}" || echo "$j"
}
step_quick() {
  echo "== correctness at the default and overlapped schedules (ranks sharing the GPU)"
  local jobs=${QUICK_JOBS:-nano11 tiny12 tiny12sp tiny22 ovl12 ovl12sp} j base tag sched
  for j in $jobs; do
    base=${j%%@*} sched=(); tag=$(quick_tag "$j")
    [[ $j == *@* ]] && sched=(--schedule "${j#*@}")
    case $base in
      nano11) quick_job $tag --preset nanogpt --dtype fp32 bf16 "${sched[@]}" & ;;
      tiny12) quick_job $tag --preset tiny --tp 2 --dtype fp32 bf16 --share-gpu --graphs "${sched[@]}" & ;;
      tiny12sp) quick_job $tag --preset tiny --tp 2 --sp --dtype fp32 bf16 --share-gpu "${sched[@]}" & ;;
      tiny22) quick_job $tag --preset tiny --dp 2 --tp 2 --dtype fp32 bf16 --share-gpu "${sched[@]}" & ;;
      tiny22sp) quick_job $tag --preset tiny --dp 2 --tp 2 --sp --dtype fp32 bf16 --share-gpu "${sched[@]}" & ;;
      tiny14sp) quick_job $tag --preset tiny --tp 4 --sp --dtype fp32 bf16 --share-gpu "${sched[@]}" & ;;
      ovl12) quick_job $tag --preset tiny --tp 2 --schedule megatron-overlap --dtype fp32 bf16 --share-gpu --graphs & ;;
      ovl12sp) quick_job $tag --preset tiny --tp 2 --schedule megatron-sp-overlap --dtype fp32 bf16 --share-gpu & ;;
      *) echo "unknown quick job $j" ;;
    esac
  done
  wait
  for j in $jobs; do
    echo "-- $j"; grep -h -E "^(check|fp32|bf16|all|SOME)|Error|error:" "$OUT/quick_$(quick_tag "$j").txt" | cut -c1-260 | head -20
  done
}

step_race() {
  echo "== the chunked row-parallel all-reduce (host IR, 4 chunks, 2 ranks sharing the GPU): with CUDA_DEVICE_MAX_CONNECTIONS=1"
  pytest_gpu race tests/test_gpu_overlap.py ""
  echo "-- without it (a record, not a test: what the race gives, mismatch or not; race_control.json)"
  local shim; shim=$(shim_path) || return
  ( unset CUDA_DEVICE_MAX_CONNECTIONS
    TPFUSER_DEFAULT_STREAM_SHIM=$shim NVFUSER_MASTER_PORT=29861 T ${OVERLAP_S:-300} -- \
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 "${SHARED_RANKS[@]}" tools/overlap_check.py --only row --chunks 1 4 --json "$OUT/race_control.json" \
    > "$OUT/race_control.txt" 2>&1 )
  grep -h "^rank 0" "$OUT/race_control.txt" | cut -c1-300
}
step_onehead2() {
  echo "== one head per rank: tiny with 2 heads at tp 2, each candidate schedule (tools/schedules/onehead-*.json)"
  local f
  for f in ${ONEHEAD_SCHEDULES:-tools/schedules/onehead-*.json}; do
    local tag=$(basename "$f" .json)
    T ${ONEHEAD_S:-300} -- python3 -m tpfuser.cli check --preset tiny --n-head 2 --tp 2 --dtype fp32 bf16 --share-gpu \
      --schedule-file "$f" --json "$OUT/$tag.json" > "$OUT/$tag.txt" 2>&1 &
  done
  wait
  for f in ${ONEHEAD_SCHEDULES:-tools/schedules/onehead-*.json}; do
    local tag=$(basename "$f" .json); echo "-- $tag"
    grep -h -E "^(check|fp32|bf16|all|SOME)|rank 0: .*failed" "$OUT/$tag.txt" | cut -c1-300 | head -8
  done
}
step_rsrepro() {
  echo "== nvFuser 0.2.36 and a chunked reduce-scatter (tools/probes/repro_chunked_reduce_scatter.py, 2 ranks sharing the GPU)"
  local shim; shim=$(shim_path) || return
  TPFUSER_DEFAULT_STREAM_SHIM=$shim NVFUSER_MASTER_PORT=29871 T ${RSREPRO_S:-180} -- \
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 "${SHARED_RANKS[@]}" tools/probes/repro_chunked_reduce_scatter.py > "$OUT/rsrepro.txt" 2>&1
  grep -h "^rank 0" "$OUT/rsrepro.txt" | cut -c1-400
}
overlap_job() {   # name, then check's arguments
  local name=$1; shift
  T ${OVERLAP_S:-400} -- python3 -m tpfuser.cli check --collectives --share-gpu --json "$OUT/ovl_$name.json" "$@" \
    > "$OUT/ovl_$name.txt" 2>&1
}
step_overlapped() {
  echo "== the overlapped schedules checked on every rank, ranks sharing the GPU (OVERLAP_JOBS)"
  local jobs=${OVERLAP_JOBS:-tp2c4 tp4c4 sp2c4 sp4c4 tp2c2 sp2c2 str2c4 strsp2c4} j
  for j in $jobs; do
    case $j in
      tp2c4) overlap_job $j --preset tiny --tp 2 --schedule megatron-overlap --dtype fp32 bf16 --graphs & ;;
      tp4c4) overlap_job $j --preset tiny --tp 4 --schedule megatron-overlap --dtype fp32 bf16 & ;;
      sp2c4) overlap_job $j --preset tiny --tp 2 --schedule megatron-sp-overlap --dtype fp32 bf16 --graphs & ;;
      sp4c4) overlap_job $j --preset tiny --tp 4 --schedule megatron-sp-overlap --dtype fp32 bf16 & ;;
      tp2c2) overlap_job $j --preset tiny --tp 2 --schedule megatron-overlap --chunks 2 --dtype fp32 bf16 & ;;
      sp2c2) overlap_job $j --preset tiny --tp 2 --schedule megatron-sp-overlap --chunks 2 --dtype fp32 bf16 & ;;
      str2c4) overlap_job $j --preset tiny --tp 2 --schedule megatron-overlap-streams --dtype fp32 bf16 --forward-only & ;;
      strsp2c4) overlap_job $j --preset tiny --tp 2 --schedule megatron-sp-overlap-streams --dtype fp32 bf16 --forward-only & ;;
      tp8c4) overlap_job $j --preset tiny --tp 8 --schedule megatron-overlap --dtype fp32 bf16 & ;;
      dp2tp2) overlap_job $j --preset tiny --dp 2 --tp 2 --schedule megatron-sp-overlap --dtype fp32 bf16 & ;;
      *) echo "unknown overlap job $j" ;;
    esac
  done
  wait
  for j in $jobs; do echo "-- $j"; grep -h -E "^(check|fp32|bf16|all|SOME)|rank 0: .*failed" "$OUT/ovl_$j.txt" | cut -c1-300 | head -12; done
}

step_firstcall() {
  echo "== the first call fusion by fusion, one fresh process each (tools/probes/first_call_probe.py)"
  local run sched kind threads tag
  for run in ${FIRSTCALL_RUNS:-megatron:train:- megatron-cut-linears:train:-}; do
    IFS=: read -r sched kind threads flags <<< "$run"
    threads=${threads:--}
    if [[ $kind != train && $kind != forward ]]; then echo "firstcall $run: expected schedule:train|forward[:threads[:flags]]"; continue; fi
    tag=${sched%.json}; tag=firstcall_${tag//\//.}_${kind}_${threads/-/default}${flags:+_${flags//,/_}}   # a name, or its file's path with . for /
    ( [[ $threads != - ]] && export NVFUSER_NUM_THREADS=$threads
      T ${FIRSTCALL_S:-120} -- python3 tools/probes/first_call_probe.py --schedule "$sched" \
        $([[ $kind == forward ]] && echo --forward) ${flags:+$(printf -- ' --%s' ${flags//,/ })} > "$OUT/$tag.json" 2> "$OUT/$tag.err" )
    if line=$(python3 tools/probes/first_call_probe.py --line "$OUT/$tag.json" 2>/dev/null); then
      echo "$tag: $line"
    else
      echo "$tag: no result: $(tail -1 "$OUT/$tag.err" | cut -c1-200)"
    fi
  done
}
step_main() {
  echo "== make's job, timed: tpfuser main ${MAIN_ARGS:-}"
  local begun=$SECONDS rc
  T ${MAIN_S:-300} -- python3 -m tpfuser.cli main ${MAIN_ARGS:-} > "$OUT/main.txt" 2>&1; rc=$?
  python3 -c "import json,sys; json.dump({'command': 'tpfuser main ' + sys.argv[3], 'wall_s': int(sys.argv[1]), 'rc': int(sys.argv[2])}, open(sys.argv[4], 'w'))" \
    $((SECONDS - begun)) $rc "${MAIN_ARGS:-}" "$OUT/main.json"
  grep -v "^rank 0:" "$OUT/main.txt" | tail -12; echo "tpfuser main: $((SECONDS - begun)) s, exit $rc"
}

step_calibrate() {
  echo "== calibration: one rank's pieces timed on this GPU (tools/calibrate.py ${CALIBRATE_PRESETS:-gpt3 nanogpt})"
  T ${CALIBRATE_S:-300} -- python3 tools/calibrate.py --preset ${CALIBRATE_PRESETS:-gpt3 nanogpt} --tp 1 2 4 5 8 \
    ${CALIBRATE_ARGS:-} --json "$OUT/calibration.json" 2>&1 | tee "$OUT/calibrate.log" | tail -30
}

step_multi() {
  echo "== several GPUs: every schedule timed and held against plan --predict (tools/multigpu.py ${MULTI_ARGS:-})"
  local s=$((END - SECONDS)); (( s > ${MULTI_S:-540} )) && s=${MULTI_S:-540}
  T $s -- python3 tools/multigpu.py --out "${MULTI_STATE:-results/tmp/multigpu}" --send "$OUT/multigpu" \
    --deadline-s $((s - 20)) ${MULTI_ARGS:-} 2>&1 | tee "$OUT/multi.log" | tail -60
}

unset NVFUSER_MASTER_PORT   # single-process runs pick a free port (tpfuser/dist/world.py): concurrent steps do not collide

# Steps joined by + run at the same time (e.g. ONLY="fwd+bwd+dp train"); their output is
# printed when the group ends. Only put correctness steps together: timings need the GPU alone.
DEADLINE=$((SECONDS + ${SUITE_S:-100000}))   # SUITE_S: no step starts later than this (s)
for group in $ONLY; do
  if (( SECONDS > DEADLINE )); then echo "== $group: not started, past SUITE_S=$SUITE_S s"; continue; fi
  if [[ $group != *+* ]]; then "step_$group"; continue; fi
  for step in ${group//+/ }; do "step_$step" > "$OUT/step_$step.txt" 2>&1 & done
  wait
  for step in ${group//+/ }; do cat "$OUT/step_$step.txt"; rm "$OUT/step_$step.txt"; done
done
echo "== summary"
python3 tools/summarize.py "$OUT"
# At most 8 files come back from the device: everything but the summary in one archive.
(cd "$OUT" && ls | grep -v -e '^summary.json$' -e '^run.tar.gz$' | tar czf run.tar.gz -T - --remove-files)
