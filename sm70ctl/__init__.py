"""sm70ctl: run a modern hybrid LLM through vLLM on NVIDIA V100 (sm_70) GPUs."""

__version__ = "0.1.0"
