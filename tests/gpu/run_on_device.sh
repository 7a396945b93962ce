#!/usr/bin/env bash
# Build the sm70 ops, run the GPU tests and the mutation check in one go (one device-machine
# call); optionally the decode benchmark. Logs and JSON go to ${OUT:-/tmp/sm70-gpu-out}
# (at most 8 files, the device tool's limit). Exit status: the build's when it fails, else
# the tests', else the mutation check's (0 only when all pass).
#   H200 (CUDA 13, no sm_70): TORCH_CUDA_ARCH_LIST=9.0 bash tests/gpu/run_on_device.sh
#   MUTANTS=0 skips the mutation check; BENCH=1 adds bench/bench_decode_kernels.py
#   (BENCH_ARGS: its options); extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/sm70-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export SM70_KERNELS_BUILD_DIR=${SM70_KERNELS_BUILD_DIR:-/tmp/sm70_ext}
export SM70_MUTANTS_DIR=${SM70_MUTANTS_DIR:-/tmp/sm70_mutants}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export SM70_GPU_ERROR_LOG="$OUT/errors.jsonl"
: >"$SM70_GPU_ERROR_LOG"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/smi.txt" 2>&1
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }

# the mutants compile beside the baseline build and the tests (CPU-bound while they run)
mut_pid=
if [ "${MUTANTS:-1}" != 0 ]; then
  nice -n 10 $PY tests/gpu/mutants.py --build-only --jobs 3 >"$OUT/mutants.log" 2>&1 &
  mut_pid=$!
fi
if ! $PY -c "from vllm_patch.ops.loader import load_ops; print(load_ops(verbose=True))" \
    >"$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40
  stamp "build failed"
  [ -n "$mut_pid" ] && kill "$mut_pid" 2>/dev/null
  exit 1
fi
stamp "build done: $(tail -1 "$OUT/build.log")"

$PY -m pytest -q -m gpu --noconftest -p no:cacheprovider -rf tests/gpu "$@" >"$OUT/tests.log" 2>&1
tests_rc=$?
stamp "tests rc=$tests_rc"
grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -40

mut_rc=0
if [ -n "$mut_pid" ]; then
  wait "$mut_pid"
  build_rc=$?
  stamp "mutant builds rc=$build_rc"
  $PY tests/gpu/mutants.py --run-only --parallel "${MUTANT_PARALLEL:-3}" \
    --out "$OUT/mutants.json" >>"$OUT/mutants.log" 2>&1
  mut_rc=$?
  [ "$build_rc" != 0 ] && mut_rc=$build_rc
  stamp "mutants rc=$mut_rc"
  grep -E "killed|NOT|failed|error" "$OUT/mutants.log" | tail -20
fi

if [ "${BENCH:-0}" = 1 ]; then
  $PY bench/bench_decode_kernels.py --out "$OUT/bench.json" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  stamp "bench rc=$?"
fi
[ "$tests_rc" != 0 ] && exit "$tests_rc"
exit "$mut_rc"
