// The GPTQ-int8 GEMV family (M = 1..8 activation rows, decode and MTP verification):
//   gemv/gemv_common.cuh  weight layout, block shape, packed-half chunk math
//   gemv/stream.cuh       M = 1: streamed, pipelined, packed-half, 2 rows per warp
//   gemv/tensor_core.cuh  M = 2..8 on the tensor cores (arch::Sm70 m8n8k4 / arch::Sm80)
//   gemv/classic.cuh      M = 2..8 fallback (K or group size not a multiple of 128, small N)
//   gemv/launch.cuh       host side (nvcc only): which kernel, its grid, the launch
#pragma once

#include "gemv/classic.cuh"
#include "gemv/stream.cuh"
#include "gemv/tensor_core.cuh"
#include "gemv/launch.cuh"
