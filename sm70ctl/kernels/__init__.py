"""Volta (sm_70) CUDA kernels: NVRTC compile checks, torch extension loader, references.

Light on import: nothing here imports torch or sm70ctl.settings at import time, so CI (no
torch) can use the NVRTC checker and GPU machines need only torch, pytest and numpy.
"""
