"""The kernels' own 12-bit and fp16 value code (csrc/allreduce/int12.cuh: encode, pack8,
unpack8, int12_add_word, fp16_add_word, all __host__ __device__) compiled by the CUDA 12
nvcc of CI (build/ci/cuda-12.4, .ci/setup.d/40-cuda12-nvcc.sh) into a host program and run
on the CPU, judged by the independent checker of tests/test_allreduce_int12.py on every
fp16 pattern, the byte layout and the same sums. So the kernels' arithmetic is checked bit
for bit without a GPU; what it cannot check (peer memory, the handshake) is left to
tests/test_allreduce_gpu.py. Plausible bugs in the C++ (a wrong shift in pack8 or unpack8,
an off-by-one rounding bias) are compiled too and must fail. Without nvcc the test skips,
except under CI=true, where it fails.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# a module object, so its tests are not collected a second time here
import test_allreduce_int12 as chk

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
NVCC = ROOT / "build" / "ci" / "cuda-12.4" / "bin" / "nvcc"
HEADER = CSRC / "allreduce" / "int12.cuh"

PROGRAM = r"""
#include <cstdio>
#include <cstring>
#include <vector>
#include "allreduce/int12.cuh"
using namespace sm70;

static std::vector<uint32_t> read_list() {
  size_t n = 0;
  if (scanf("%zu", &n) != 1) return {};
  std::vector<uint32_t> v(n);
  for (auto& x : v) scanf("%u", &x);
  return v;
}
static void put(const char* key, const std::vector<uint32_t>& v, bool last = false) {
  printf("\"%s\": [", key);
  for (size_t i = 0; i < v.size(); ++i) printf(i ? ",%u" : "%u", v[i]);
  printf(last ? "]\n" : "],\n");
}
static uint32_t word(uint32_t lo, uint32_t hi) { return (lo & 0xffffu) | (hi << 16); }

int main() {
  const auto stream = read_list(), bytes = read_list(), a = read_list(), b = read_list();
  std::vector<uint32_t> codes(65536), decoded(4096), packed, unpacked, s12, s12r, s16;
  for (uint32_t h = 0; h < 65536; ++h) codes[h] = int12_encode(h);
  for (uint32_t c = 0; c < 4096; ++c) {  // the float the kernels add, as its bits
    const float f = int12_decode(c);
    std::memcpy(&decoded[c], &f, 4);
  }
  for (size_t i = 0; i < stream.size(); i += 8) {
    uint4 v{word(stream[i], stream[i + 1]), word(stream[i + 2], stream[i + 3]),
            word(stream[i + 4], stream[i + 5]), word(stream[i + 6], stream[i + 7])};
    uint32_t p[3];
    int12_pack8(v, p);
    for (uint32_t w : p)
      for (int k = 0; k < 4; ++k) packed.push_back((w >> (8 * k)) & 0xffu);
  }
  for (size_t i = 0; i < bytes.size(); i += 12) {
    uint32_t p[3], c[8];
    for (int w = 0; w < 3; ++w)
      p[w] = bytes[i + 4 * w] | (bytes[i + 4 * w + 1] << 8) | (bytes[i + 4 * w + 2] << 16) |
             (bytes[i + 4 * w + 3] << 24);
    int12_unpack8(p, c);
    for (uint32_t x : c) unpacked.push_back(x << 4);
  }
  for (size_t i = 0; i < a.size(); i += 2) {
    // rank 0 holds a, rank 1 holds b; each adds the other's codes to its own value
    const uint32_t r0 =
        int12_add_word(word(a[i], a[i + 1]), int12_encode(b[i]), int12_encode(b[i + 1]));
    const uint32_t r1 =
        int12_add_word(word(b[i], b[i + 1]), int12_encode(a[i]), int12_encode(a[i + 1]));
    const uint32_t f = fp16_add_word(word(a[i], a[i + 1]), word(b[i], b[i + 1]));
    s12.push_back(r0 & 0xffffu); s12.push_back(r0 >> 16);
    s12r.push_back(r1 & 0xffffu); s12r.push_back(r1 >> 16);
    s16.push_back(f & 0xffffu); s16.push_back(f >> 16);
  }
  printf("{\n");
  put("codes", codes); put("decoded", decoded); put("packed", packed);
  put("unpacked", unpacked); put("sum12", s12); put("sum12_swapped", s12r);
  put("sum16", s16, true);
  printf("}\n");
  return 0;
}
"""

# (name, old, new): plausible bugs in the kernels' C++, each must occur once in int12.cuh
MUTANTS = (
    ("pack8-shift", "(c[2] << 24)", "(c[2] << 20)"),
    ("unpack8-shift", "c[3] = (p[1] >> 4) & 0xfffu;", "c[3] = (p[1] >> 5) & 0xfffu;"),
    ("round-bias", "(mag + 7u + ((mag >> 4) & 1u)) >> 4", "(mag + 8u + ((mag >> 4) & 1u)) >> 4"),
    ("saturation", "kInt12MaxFinite = 0x7bfu", "kInt12MaxFinite = 0x7c0u"),
    ("decode-shift", "((c & 0xfffu) << 4)", "((c & 0xfffu) << 3)"),
    ("own-value-unquantised", "int12_round(own & 0xffffu) + int12_decode(lo)",
     "__half2float(__ushort_as_half((unsigned short)(own & 0xffffu))) + int12_decode(lo)"),
    ("fp16-sum-rounded-twice", "__floats2half2_rn(fa.x + fb.x, fa.y + fb.y)",
     "__floats2half2_rn(__half2float(__float2half_rz(fa.x + fb.x)), fa.y + fb.y)"),
)


def request() -> dict:
    req = chk.request([])
    if len(req["a"]) % 2:  # the program adds two values per word
        req["a"].append(0)
        req["b"].append(0)
    return req


def compile_and_run(tmp: Path, header_text: str, req: dict) -> dict:
    inc = tmp / "inc"
    (inc / "allreduce").mkdir(parents=True, exist_ok=True)
    (inc / "common").mkdir(exist_ok=True)
    (inc / "allreduce" / "int12.cuh").write_text(header_text)
    (inc / "common" / "sm70.cuh").write_text((CSRC / "common" / "sm70.cuh").read_text())
    src = tmp / "int12_host.cu"
    src.write_text(PROGRAM)
    exe, obj = tmp / "int12_host", tmp / "int12_host.o"
    # compile with nvcc (the host side of a .cu, as the extension's), link with the host
    # compiler: CI's assembled toolkit has no device-link stub, and nothing here is linked
    # for the device
    lib = NVCC.parents[1] / "lib64"
    for cmd in (
        [str(NVCC), "-std=c++17", "-O1", "-arch=sm_70", f"-I{inc}", "-c", str(src), "-o", str(obj)],
        ["c++", str(obj), f"-L{lib}", "-lcudart", f"-Wl,-rpath,{lib}", "-o", str(exe)],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join(f"{len(v)} {' '.join(map(str, v))}"
                    for v in (req["stream"], req["bytes"], req["a"], req["b"]))
    run = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout)
    # the checker also compares a bound the reference reports; the kernel has none, so give
    # it the stated one (the checker applies the formula itself too)
    got["bound"] = [(2**-7 + 2**-10) * (abs(chk.f16(x)) + abs(chk.f16(y))) + 2**-19
                    for x, y in zip(req["a"], req["b"], strict=True)]
    return got


def decode_problems(got: dict) -> list[str]:
    """int12_decode(c) is the float of the fp16 pattern c << 4 (NaN codes: a NaN)."""
    out = []
    for c, bits in enumerate(got["decoded"]):
        f = struct.unpack("<f", struct.pack("<I", bits))[0]
        want = chk.f16(c << 4)
        if math.isnan(want):
            ok = math.isnan(f)
        else:
            ok = f == want and math.copysign(1, f) == math.copysign(1, want)
        if not ok:
            out.append(f"int12_decode({c:#05x}) = {f}, expected {want}")
    # the checker's own decode rule then holds by construction
    got["decoded"] = [c << 4 for c in range(4096)]
    return out


@pytest.fixture(scope="module")
def nvcc() -> Path:
    if not NVCC.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"no CUDA 12 nvcc at {NVCC} (CI must provide it)")
        pytest.skip(f"no CUDA 12 nvcc at {NVCC}")
    return NVCC


def test_the_kernels_value_code_meets_the_format(nvcc: Path, tmp_path: Path) -> None:
    req = request()
    got = compile_and_run(tmp_path, HEADER.read_text(), req)
    assert decode_problems(got) == []
    assert chk.problems(req, got) == []


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_a_plausible_bug_in_the_kernel_code_is_caught(nvcc: Path, tmp_path: Path,
                                                      mutant: tuple[str, str, str]) -> None:
    _, old, new = mutant
    text = HEADER.read_text()
    assert text.count(old) == 1, old
    req = request()
    got = compile_and_run(tmp_path, text.replace(old, new), req)
    assert decode_problems(got) + chk.problems(req, got) != []
