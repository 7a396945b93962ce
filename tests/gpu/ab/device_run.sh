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
# Wheels vLLM's code paths need that the bundle lacks (compressed-tensors: every quantized
# checkpoint imports it in get_quantization_config), carried in .device/extra.
# humming-kernels likewise (quantization/humming.py imports it on CUDA); where it cannot be
# imported (its cuda-bindings are not in the image) the stand-in in tests/gpu/ab/shims is used.
if ls .device/extra/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/vllm-extra .device/extra/*.whl
  export PYTHONPATH="/tmp/vllm-extra:$PYTHONPATH"
fi
probe="import compressed_tensors, humming.dtypes, humming.layer, humming.schema, humming.config, humming.utils.weight"
if python3 -c "$probe" > "$OUT/env_probe.txt" 2>&1; then
  echo "humming: the real humming-kernels package" >> "$OUT/env_probe.txt"
else
  rm -rf /tmp/vllm-extra/humming
  export PYTHONPATH="$PWD/tests/gpu/ab/shims:$PYTHONPATH"
  python3 -c "$probe" >> "$OUT/env_probe.txt" 2>&1
  echo "humming: the stand-in tests/gpu/ab/shims/humming (real one failed to import, above)" >> "$OUT/env_probe.txt"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, vllm, transformers; print(torch.__version__, vllm.__version__, transformers.__version__)" > "$OUT/versions.txt" 2>&1
shift 2 2>/dev/null || shift $#
python3 tests/gpu/ab/run_ab.py --shape "$shape" --out "$OUT" --budget-s "$budget" "$@"
if [[ -f "$OUT/sides_$shape.json" ]] && grep -q '"bench"' "$OUT/sides_$shape.json"; then
  python3 bench/bench_vllm_decode.py "$OUT/sides_$shape.json" --out "$OUT/h200_vllm_decode.json"
fi
if [[ -f "$OUT/sides_$shape.json" ]] && grep -q '"profile"' "$OUT/sides_$shape.json"; then
  python3 bench/profile_vllm_ops.py "$OUT/sides_$shape.json" --out "$OUT/h200_vllm_op_split.json"
fi
