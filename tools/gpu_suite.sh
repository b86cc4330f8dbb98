#!/bin/bash
# Every GPU check and the first benchmark, in one device call:
#   source .nvf/setup.sh; bash tools/gpu_suite.sh
# Writes JSON under $OUT (default ./gpu_out) and prints a short table last.
# ONLY="tests bench" (a subset of: bisect variants tests dp tp bench train gpt3) runs part of it;
# TESTS= and K= narrow the pytest step (e.g. TESTS=tests/test_gpu_backward.py K="not mesh").
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
ONLY=${ONLY:-bisect tests dp tp bench train gpt3}
TESTS=${TESTS:-tests} K=${K:-}
want() { [[ " $ONLY " == *" $1 "* ]]; }
export PYTHONPATH=$PWD:${PYTHONPATH:-} NVIDIA_TF32_OVERRIDE=0 PYTHONUNBUFFERED=1
T=timeout

want bisect && echo "== 0. which outputs of the meshed backward nvFuser fails to compile, and the error" && \
$T 200 python3 tools/backward_bisect.py ${BISECT_S:-120} 2>&1 | grep -E "^(bisect|stopped)" | cut -c1-400

want variants && echo "== 0b. which schedule of the training fusions nvFuser compiles (NOTES.md)" && \
{ $T 420 python3 tools/backward_variants.py > "$OUT/variants.log" 2>&1; grep -E "^(tiny|nanogpt)" "$OUT/variants.log" || tail -20 "$OUT/variants.log"; }

want tests && echo "== 1. GPU tests (1x1 mesh)" && \
$T 400 python3 -m pytest -q -m gpu $TESTS ${K:+-k "$K"} -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -25

want dp && echo "== 2. two ranks on one GPU, 2x1 mesh (data parallel, runs to the end)" && \
$T 240 torchrun --standalone --nproc-per-node 2 tools/two_ranks.py dp 2>&1 | grep -E "^rank|Error" | cut -c1-400

if want tp; then
  echo "== 3. two ranks on one GPU, 1x2 mesh: the collectives nvFuser posts before NCCL refuses"
  NVFUSER_DUMP=communication $T 120 torchrun --standalone --nproc-per-node 2 tools/two_ranks.py tp > "$OUT/tp_dump.log" 2>&1
  grep -E "^rank" "$OUT/tp_dump.log" | cut -c1-300
  python3 tools/collectives.py "$OUT/tp_dump.log" tiny 1 2 fp32 > "$OUT/tp_collectives.json"
  grep -m3 -i "communication" "$OUT/tp_dump.log" | cut -c1-400
  echo "== 3b. the same with sequence parallelism"
  NVFUSER_DUMP=communication $T 120 torchrun --standalone --nproc-per-node 2 tools/two_ranks.py sp > "$OUT/sp_dump.log" 2>&1
  python3 tools/collectives.py "$OUT/sp_dump.log" tiny 1 2 fp32 sp > "$OUT/sp_collectives.json"
  grep -m3 -i "communication" "$OUT/sp_dump.log" | cut -c1-400
fi

want bench && echo "== 4. benchmark: nanogpt forward, nvFuser (1x1 mesh, and no mesh) vs eager vs torch.compile" && \
$T 300 python3 -m tpfuser.bench --preset nanogpt --json "$OUT/bench_nanogpt.json" --iters 100

want train && echo "== 5. benchmark: nanogpt forward+backward (a training step), with peak and saved memory" && \
$T 300 python3 -m tpfuser.bench --preset nanogpt --train --json "$OUT/bench_nanogpt_train.json" --iters 50

want gpt3 && echo "== 6. benchmark: gpt3 forward at 1x1 (fewer samples: ~11 ms a call)" && \
$T 300 python3 -m tpfuser.bench --preset gpt3 --impl nvfuser,eager,compile --json "$OUT/bench_gpt3.json" --iters 15

echo "== summary"
python3 tools/summarize.py "$OUT"
