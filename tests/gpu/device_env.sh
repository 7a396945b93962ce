# Sourced on the GPU machine after `. .device/vllm/install.sh`: the wheels vLLM's quantized-
# checkpoint paths import that the bundle lacks (carried in .device/extra), and the humming
# stand-in where the real humming-kernels cannot be imported there (its cuda-bindings are not in
# the image). $OUT/env_probe.txt says which ran.
if ls .device/extra/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/vllm-extra .device/extra/*.whl
  export PYTHONPATH="/tmp/vllm-extra${PYTHONPATH:+:$PYTHONPATH}"
fi
_probe="import compressed_tensors, humming.dtypes, humming.layer, humming.schema, humming.config, humming.utils.weight"
if python3 -c "$_probe" > "$OUT/env_probe.txt" 2>&1; then
  echo "humming: the real humming-kernels package" >> "$OUT/env_probe.txt"
else
  rm -rf /tmp/vllm-extra/humming
  export PYTHONPATH="$PWD/tests/gpu/ab/shims:$PYTHONPATH"
  python3 -c "$_probe" >> "$OUT/env_probe.txt" 2>&1
  echo "humming: the stand-in tests/gpu/ab/shims/humming (real one failed to import, above)" >> "$OUT/env_probe.txt"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, vllm, transformers; print(torch.__version__, vllm.__version__, transformers.__version__)" > "$OUT/versions.txt" 2>&1
