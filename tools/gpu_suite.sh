#!/bin/bash
# Every GPU check and the benchmarks, in one device call:
#   source .nvf/setup.sh; bash tools/gpu_suite.sh
# Writes JSON under $OUT (default ./gpu_out) and prints a short table last.
# ONLY="tests train" runs those steps, in that order (steps: tests fwd bwd train
# bench bisect dp dpbwd tp tpbwd gpt3; fwd and bwd are the tests step split in two). TESTS= and K= narrow the pytest step
# (e.g. TESTS=tests/test_gpu_backward.py K="not mesh"), TESTS_S bounds it (s);
# BISECT_FORMS (e.g. "bf16:cat bf16:cat:3d") the backward forms tried at once, BISECT_S
# their time bound, BISECT_EACH=1 then bisects each output of a failing form.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
ONLY=${ONLY:-tests train bench bisect dp tp gpt3}
TESTS=${TESTS:-tests} K=${K:-}
export PYTHONPATH=$PWD:${PYTHONPATH:-} NVIDIA_TF32_OVERRIDE=0 PYTHONUNBUFFERED=1
T=timeout

pytest_gpu() {  # name, files, -k expression
  # SIGINT, not SIGTERM, at the bound: pytest then still writes its report and summary.
  $T -s INT ${TESTS_S:-400} python3 -m pytest -v -m gpu $2 ${3:+-k "$3"} -p no:cacheprovider --junitxml="$OUT/gpu_$1.xml" 2>&1 \
    | tee "$OUT/$1.log" | grep -E "PASSED|FAILED|XFAIL|XPASS|ERROR|SKIPPED|passed|failed" | cut -c1-200 | tail -40
}
step_tests() { echo "== GPU tests (1x1): $TESTS ${K:+-k $K}"; pytest_gpu tests "$TESTS" "$K"; }
step_fwd() { echo "== GPU tests (1x1): the forward"; pytest_gpu tests_fwd tests/test_gpu.py ""; }
step_bwd() { echo "== GPU tests (1x1): the backward without a mesh"; pytest_gpu tests_bwd tests/test_gpu_backward.py "${BWD_K:-not mesh}"; }
step_bwdmesh() { echo "== GPU tests (1x1): the backward on a mesh"; pytest_gpu tests_bwdmesh tests/test_gpu_backward.py "mesh"; }
step_train() {
  echo "== benchmark: nanogpt forward+backward (a training step), with peak and saved memory"
  $T 240 python3 -m tpfuser.bench --preset nanogpt --train --json "$OUT/bench_nanogpt_train.json" --iters 30 2>&1 | tee "$OUT/train.log"
}
step_bench() {
  echo "== benchmark: nanogpt forward, nvFuser (1x1 mesh, and no mesh) vs eager vs torch.compile"
  $T 300 python3 -m tpfuser.bench --preset nanogpt --json "$OUT/bench_nanogpt.json" --iters 100
}
step_bisect() {
  echo "== the meshed backward (1x1) in each form at once; then each output alone of the failing ones"
  for form in ${BISECT_FORMS:-bf16:cat fp32:cat bf16:split bf16:cat:3d}; do
    $T $((${BISECT_S:-120} + 60)) python3 tools/backward_bisect.py ${BISECT_S:-120} $form ${BISECT_EACH:+--each} \
      > "$OUT/bisect_$form.log" 2>&1 &
  done
  wait
  cat "$OUT"/bisect_*.log | grep -E "^(bisect|stopped)" | cut -c1-400
}
step_dpbwd() {
  echo "== two ranks on one GPU, 2x1 mesh: training forward and backward, gradients against the whole batch's"
  $T 240 torchrun --standalone --nproc-per-node 2 tools/two_ranks.py dpbwd 2>&1 | grep -E "^rank|Error" | cut -c1-600
}
step_dp() {
  echo "== two ranks on one GPU, 2x1 mesh (data parallel, runs to the end)"
  $T 240 torchrun --standalone --nproc-per-node 2 tools/two_ranks.py dp 2>&1 | grep -E "^rank|Error" | cut -c1-400
}
step_tp() {
  echo "== two ranks on one GPU, 1x2 mesh: the collectives nvFuser posts before NCCL refuses"
  NVFUSER_DUMP=communication $T 120 torchrun --standalone --nproc-per-node 2 tools/two_ranks.py tp > "$OUT/tp_dump.log" 2>&1
  grep -E "^rank" "$OUT/tp_dump.log" | cut -c1-300
  python3 tools/collectives.py "$OUT/tp_dump.log" tiny 1 2 fp32 > "$OUT/tp_collectives.json"
  grep -m3 -i "communication" "$OUT/tp_dump.log" | cut -c1-400
  echo "== the same with sequence parallelism"
  NVFUSER_DUMP=communication $T 120 torchrun --standalone --nproc-per-node 2 tools/two_ranks.py sp > "$OUT/sp_dump.log" 2>&1
  python3 tools/collectives.py "$OUT/sp_dump.log" tiny 1 2 fp32 sp > "$OUT/sp_collectives.json"
  grep -m3 -i "communication" "$OUT/sp_dump.log" | cut -c1-400
}
step_tpbwd() {
  for which in tpbwd spbwd; do
    echo "== two ranks on one GPU, 1x2 mesh, the backward alone ($which): its first collective"
    NVFUSER_DUMP=communication $T 150 torchrun --standalone --nproc-per-node 2 tools/two_ranks.py $which > "$OUT/${which}_dump.log" 2>&1
    grep -E "^rank" "$OUT/${which}_dump.log" | cut -c1-300
    python3 tools/collectives.py "$OUT/${which}_dump.log" tiny 1 2 bf16 ${which%bwd} bwd > "$OUT/${which}_collectives.json"
    grep -m2 -i "posting communication" "$OUT/${which}_dump.log" | cut -c1-400
  done
}
step_gpt3() {
  echo "== benchmark: gpt3 forward at 1x1 (fewer samples: ~11 ms a call)"
  $T 300 python3 -m tpfuser.bench --preset gpt3 --impl nvfuser,eager,compile --json "$OUT/bench_gpt3.json" --iters 15
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])'; }
torchrun() { NVFUSER_MASTER_PORT=$(free_port) command torchrun "$@"; }
unset NVFUSER_MASTER_PORT   # single-process runs pick a free port (tpfuser/fusion.py): concurrent steps do not collide

# Steps joined by + run at the same time (e.g. ONLY="fwd+bwd+dp train"); their output is
# printed when the group ends. Only put correctness steps together: timings need the GPU alone.
for group in $ONLY; do
  if [[ $group != *+* ]]; then "step_$group"; continue; fi
  for step in ${group//+/ }; do "step_$step" > "$OUT/step_$step.txt" 2>&1 & done
  wait
  for step in ${group//+/ }; do cat "$OUT/step_$step.txt"; rm "$OUT/step_$step.txt"; done
done
echo "== summary"
python3 tools/summarize.py "$OUT"
# At most 8 files come back from the device: everything but the summary in one archive.
(cd "$OUT" && ls | grep -v -e '^summary.json$' -e '^run.tar.gz$' | tar czf run.tar.gz -T - --remove-files)
