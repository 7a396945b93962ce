#!/usr/bin/env bash
# Build the sm70 torch extension, run the GPU tests and the decode benchmark in one go
# (one device-machine call). Logs and JSON go to ${OUT:-/tmp/sm70-gpu-out}.
#   H200 (CUDA 13, no sm_70): TORCH_CUDA_ARCH_LIST=9.0 bash tests/gpu/run_on_device.sh
set -uo pipefail
OUT=${OUT:-/tmp/sm70-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export SM70_KERNELS_BUILD_DIR=${SM70_KERNELS_BUILD_DIR:-/tmp/sm70_ext}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/smi.txt" 2>&1
start=$(date +%s)
if ! $PY -c "from vllm_patch.ops.loader import load_ops; print(load_ops(verbose=True))" \
    >"$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
$PY -m pytest -q -m gpu --noconftest -p no:cacheprovider -rf tests/gpu "$@" >"$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -40
# BENCH_ARGS: extra benchmark options, e.g. "--m 1,2,4,8"
$PY bench/bench_decode_kernels.py --out "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
