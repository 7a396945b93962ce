"""The two-GPU tensor-parallel all-reduce (issue 26): the 12-bit exchange format and its
plain-PyTorch reference (`int12`), the buffer arithmetic and the choice of which all-reduce
serves a call (`selection`, pure Python), and the vLLM communicator that would plug our
kernels in (`communicator`: written, NOT RUN on two GPUs, and not registered by the plugin
until it has run; see vllm_patch/runtime_patches/README.md).

Importing this package imports neither torch nor vLLM.
"""
