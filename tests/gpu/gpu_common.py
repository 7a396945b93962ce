"""Shared pieces of the GPU tests: random operands, the error models the checks use, and
the architecture paths to run (imported by the tests after their torch guard).

Error models (y = the op's fp16 output, want = the float64 product of the same quantised
operands, u = 2^-11 the unit roundoff of fp16, every bound per output):
- M = 1 streamed GEMV (packed-half math: 4-product fp16 partials per 16-code chunk, then
  fp32): |y - want| <= u |want| + 2 u sum_k |x_k w_kn|; its error follows sum |x w| rather
  than |y|, so an output that nearly cancels has a large relative error however good the
  kernel, and vectors of 17+ outputs also keep rel_err < 2e-3.
- tensor-core GEMV (M = 2..8): each 128-k unit sums exact products of fp16 x with the biased
  codes 1024 + q and the constant -(1024 + z) in fp32, so its rounding follows the biased
  operands: T = sum_k |x_k| s (2048 + q + z). Worst case, each fp32 add (tensor cores may
  truncate: 2^-23) errs by its running sum, which stays below the unit's biased terms plus
  its partials, about 3 T 2^-23; the bound takes 2^-20 T, then (units + 8) 2^-24 S for the
  fp32 sum of the scaled unit sums and reductions (S = sum_k |x_k w_kn|), then u |want|.
- classic GEMV (fp32 FMA chains): u |want| + (K / 8 + 16) 2^-24 S.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

FP16_U = 2.0**-11
TC_UNIT = 128  # k per tensor-core unit
TC_MIN_ROWS = 1024  # fewer rows stay on the classic kernel (the launcher's rule)
ERROR_LOG_ENV = "SM70_GPU_ERROR_LOG"  # JSON lines of measured error / bound, when set


def arch_paths() -> list[str]:
    """"native" everywhere; "sm70" too where it differs (sm_80+, where m8n8k4 is emulated)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 8:
        return ["native", "sm70"]
    return ["native"]


def record(metric: str, value: float) -> None:
    """Append one measured figure of the current test to the error log (if asked for)."""
    path = os.environ.get(ERROR_LOG_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"test": test, "metric": metric, "value": value}) + "\n")


def child_marker(env_var: str, parent: str) -> pytest.MarkDecorator:
    """Skip a test unless this is the child pytest that `run_child_tests` starts with
    `env_var` set (`parent`: the test that starts it)."""
    return pytest.mark.skipif(os.environ.get(env_var) != "1", reason=f"runs in {parent}")


def run_child_tests(test_file: str, env_var: str, passed: int) -> None:
    """Run `test_file`'s child_ tests in a child pytest with `env_var` = 1 (a crash inside
    an op's error path then ends that child, not the whole GPU run); all must pass, and
    `passed` of them must have run."""
    path = Path(test_file).resolve()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--noconftest", "-p",
         "no:cacheprovider", "-k", "child_", str(path)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, env_var: "1"}, cwd=path.parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{passed} passed" in proc.stdout, proc.stdout[-2000:]


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    out = out.to(torch.float64)
    want = want.to(torch.float64)
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - want).norm() / want.norm().clamp_min(1e-30))


def poison(nbytes: int) -> None:
    """Leave NaNs in the allocator's cache so an output the op forgets to write fails."""
    t = torch.full((nbytes // 2 + 64,), float("nan"), dtype=torch.float16, device="cuda")
    del t


# ------------------------------------------------------------------ GEMV operands
def random_repacked(n: int, k: int, g: int, gen: torch.Generator):
    """Random codes and (scale, zero) in the GEMV layout directly (any N, any K % g == 0)."""
    qw = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
    sz = torch.empty(n, k // g, 2, device="cuda", dtype=torch.float16)
    sz[..., 0] = (torch.rand(n, k // g, device="cuda", generator=gen) * 2e-3 + 1e-4).half()
    sz[..., 1] = torch.randint(1, 256, (n, k // g), device="cuda", generator=gen).half()
    return qw, sz


def gemv_path(m: int, n: int, k: int, g: int) -> str:
    """Which kernel the op runs for this shape (mirrors the launcher's rule)."""
    if m == 1:
        return "stream"
    if n >= TC_MIN_ROWS and k % TC_UNIT == 0 and g % TC_UNIT == 0:
        return "tensor_core"
    return "classic"


@dataclass
class GemvCase:
    """One GEMV's operands and its float64 answer, with the magnitudes the bounds use."""

    x: torch.Tensor  # [M, K] fp16
    qw: torch.Tensor  # [N, K] uint8
    sz: torch.Tensor  # [N, K/G, 2] fp16
    g: int
    bias: torch.Tensor | None
    want: torch.Tensor  # [M, N] float64

    @property
    def path(self) -> str:
        return gemv_path(self.x.shape[0], self.qw.shape[0], self.qw.shape[1], self.g)

    # The magnitudes are sums of positive terms: float32 holds them to ~1e-6, plenty for a
    # bound, at half the memory of float64 on the lm_head's 635M weights.
    def _expand(self) -> tuple[torch.Tensor, torch.Tensor]:
        gi = torch.arange(self.qw.shape[1], device=self.qw.device) // self.g
        return self.sz[..., 0].float()[:, gi], self.sz[..., 1].float()[:, gi]

    def magnitude(self) -> torch.Tensor:
        """S = sum_k |x_k w_kn| (+ |bias_n|), [M, N]."""
        s, z = self._expand()
        mag = (self.x.float().abs() @ (s * (self.qw.float() - z)).abs_().t()).double()
        return mag + (0 if self.bias is None else self.bias.double().abs())

    def biased_magnitude(self) -> torch.Tensor:
        """T = sum_k |x_k| s (2048 + q + z), [M, N]: the tensor-core unit sums' terms."""
        s, z = self._expand()
        return (self.x.float().abs() @ (s * (2048.0 + self.qw.float() + z)).t()).double()

    def bound(self) -> torch.Tensor:
        k = self.qw.shape[1]
        out = FP16_U * self.want.abs()
        if self.path == "stream":
            return out + 2 * FP16_U * self.magnitude()
        if self.path == "tensor_core":
            units = k // TC_UNIT
            return (out + 2.0**-20 * self.biased_magnitude()
                    + (units + 8) * 2.0**-24 * self.magnitude())
        return out + (k / 8 + 16) * 2.0**-24 * self.magnitude()


def gemv_case(x, qw, sz, g, bias=None) -> GemvCase:
    from vllm_patch.ops import reference as ref

    want = ref.gemv_reference(x, ref.dequant_repacked(qw, sz, g), bias)
    return GemvCase(x, qw, sz, g, bias, want)


def assert_gemv_within_bound(y: torch.Tensor, case: GemvCase, what: object = None) -> None:
    """Every output within its path's error model; 17+ outputs also within rel_err 2e-3."""
    assert y.shape == case.want.shape and y.dtype == torch.float16, (y.shape, y.dtype)
    assert torch.isfinite(y).all(), f"non-finite output {what}"
    err = (y.double() - case.want).abs()
    ratio = float((err / case.bound()).max())
    record(f"{case.path}_error_over_bound", ratio)
    assert ratio <= 1.0, f"{case.path} error {ratio:.3g}x its bound {what}"
    if case.want.shape[-1] >= 17:
        rel = rel_err(y, case.want)
        record(f"{case.path}_rel_err", rel)
        assert rel < 2e-3, (rel, what)
