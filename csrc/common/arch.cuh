// Architecture tags: which tensor-core instruction shape a kernel instantiation is built
// around (the role of CUTLASS's arch::Sm70 / arch::Sm80 tags).
//
// arch::Sm70 is what a V100 runs: mma.sync m8n8k4, native on Volta. arch::Sm80 is the
// m16n8k16 instantiation for the sm_80+ test GPU (H200), where m8n8k4 is emulated and far
// slower; it exists so that GPU measures the kernels' memory pipelines at full speed,
// never for serving. The host picks the tag once per launch from the device's compute
// capability and the process-wide path (torch.ops.sm70.set_arch_path: "sm70" forces
// arch::Sm70 on any GPU, so the Volta code is checked for correctness there).
#pragma once

namespace sm70 {
namespace arch {

struct Sm70 {
  static constexpr bool kM16n8k16 = false;  // mma.sync.m8n8k4 (Volta)
};

struct Sm80 {
  static constexpr bool kM16n8k16 = true;  // mma.sync.m16n8k16 (sm_80+)
};

}  // namespace arch
}  // namespace sm70
