#!/usr/bin/env bash
# On the GPU machine, from the repository root: the A/B for one shape, results under $OUT.
#   . .device/vllm/install.sh && bash tests/gpu/ab/device_run.sh tiny 540
#   . .device/vllm/install.sh && bash tests/gpu/ab/device_run.sh slice 330 --modes graphs \
#       --side-args "--max-len 33792 --max-batched 2048 --kv-gib 8 --util 0.3 --bench"
set -u
shape=${1:-tiny}
budget=${2:-540}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
mkdir -p "$OUT"
. tests/gpu/device_env.sh
shift 2 2>/dev/null || shift $#
python3 tests/gpu/ab/run_ab.py --shape "$shape" --out "$OUT" --budget-s "$budget" "$@"
if [[ -f "$OUT/sides_$shape.json" ]] && grep -q '"bench"' "$OUT/sides_$shape.json"; then
  python3 bench/bench_vllm_decode.py "$OUT/sides_$shape.json" --out "$OUT/h200_vllm_decode.json"
fi
if [[ -f "$OUT/sides_$shape.json" ]] && grep -q '"profile"' "$OUT/sides_$shape.json"; then
  python3 bench/profile_vllm_ops.py "$OUT/sides_$shape.json" --out "$OUT/h200_vllm_op_split.json"
fi
