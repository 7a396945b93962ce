"""Stand-in for the `humming` package (humming-kernels), used on the H200 test machine ONLY
when the real one cannot be imported there (its cuda-bindings dependency is not in the image
and does not fit the carried bundle).

Why it exists: vLLM 0.22.1 imports every quantization method's module the first time any
quantized checkpoint is seen (`get_quantization_config`), and `quantization/humming.py`
imports `humming` at module level on CUDA. Only names are needed at import time; the A/B
never selects the humming method (sm70_gptq claims the checkpoint first). Every attribute is
a class that raises when used, so a code path that really needed humming fails loudly.
device_run.sh says in env_probe.txt whether the real package or this stand-in was used.
"""

from humming._absent import absent_module_getattr

__getattr__ = absent_module_getattr(__name__)
