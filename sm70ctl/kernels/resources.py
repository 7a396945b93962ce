"""The resource report of every kernel instantiation: registers, shared memory, spills.

Compiles the instantiations in sm70ctl.kernels.variants with NVRTC 12.8 and reads ptxas -v:
the Volta list for sm_70, the H200 timing instantiations (m16n8k16) for sm_90. The report
is plain JSON, {arch: {label: {registers, static_smem, stack_frame, spill_stores,
spill_loads}}}, so a restructuring can be diffed against it and CI can pin it
(tests/data/kernel_resources.json, compared by tests/test_kernels_compile.py).

    python -m sm70ctl.kernels.resources [-o report.json] [--diff expected.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

from sm70ctl.kernels import nvrtc
from sm70ctl.kernels.variants import H200_VARIANTS, VARIANTS, KernelVariant

Report = dict[str, dict[str, dict[str, int]]]


def compile_resources(
    variants: Sequence[KernelVariant],
    tc: nvrtc.Toolchain,
    arch: str,
    include_dirs: Sequence[Path] = (),
) -> dict[str, nvrtc.Resources]:
    """Resources of each variant (by label), one NVRTC program per header."""
    out: dict[str, nvrtc.Resources] = {}
    for header in sorted({v.header for v in variants}):
        mine = [v for v in variants if v.header == header]
        ptx, _, lowered = nvrtc.nvrtc_compile(
            f'#include "{header}"\n',
            f"{Path(header).name}.cu",
            [v.expr for v in mine],
            tc,
            arch=arch,
            include_dirs=include_dirs,
        )
        res = nvrtc.ptxas_resources(ptx, tc, arch=arch)
        for v in mine:
            out[v.label] = res[lowered[v.expr]]
    return out


def to_report(per_arch: dict[str, dict[str, nvrtc.Resources]]) -> Report:
    """Plain-data form of the resources, sorted for stable diffs (pure)."""
    return {
        arch: {label: asdict(r) for label, r in sorted(res.items())}
        for arch, res in sorted(per_arch.items())
    }


def diff_reports(expected: Report, actual: Report) -> list[str]:
    """One line per instantiation whose resources differ, or that is missing or new (pure)."""
    lines = []
    for arch in sorted(set(expected) | set(actual)):
        exp, act = expected.get(arch, {}), actual.get(arch, {})
        for label in sorted(set(exp) | set(act)):
            if label not in act:
                lines.append(f"{arch} {label}: missing (expected {exp[label]})")
            elif label not in exp:
                lines.append(f"{arch} {label}: new, not pinned ({act[label]})")
            elif exp[label] != act[label]:
                changed = {
                    k: f"{exp[label].get(k)} -> {v}"
                    for k, v in act[label].items()
                    if exp[label].get(k) != v
                }
                lines.append(f"{arch} {label}: {changed}")
    return lines


def build_report(tc: nvrtc.Toolchain, include_dirs: Iterable[Path] = ()) -> Report:
    incs = tuple(include_dirs)
    return to_report(
        {
            "sm_70": compile_resources(VARIANTS, tc, "sm_70", incs),
            "sm_90": compile_resources(H200_VARIANTS, tc, "sm_90", incs),
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sm70ctl.kernels.resources", description=__doc__)
    ap.add_argument("-o", "--output", type=Path, help="write the report here (else stdout)")
    ap.add_argument("--diff", type=Path, help="compare with this report; exit 1 on a change")
    ap.add_argument(
        "-I", dest="include", type=Path, action="append", default=[],
        help="extra include folder (besides csrc/)",
    )
    args = ap.parse_args(argv)
    try:
        report = build_report(nvrtc.find_toolchain(), args.include)
    except (nvrtc.NvrtcUnavailable, nvrtc.CompileFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=1) + "\n"
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    if args.diff:
        lines = diff_reports(json.loads(args.diff.read_text()), report)
        for line in lines:
            print(line, file=sys.stderr)
        print(f"{len(lines)} instantiation(s) differ from {args.diff}", file=sys.stderr)
        return 1 if lines else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
