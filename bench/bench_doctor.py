"""How long `sm70ctl doctor --json` takes on this machine (target: median under 1 s).

    python bench/bench_doctor.py --runs 7 --out doctor-bench.json

Each run is a fresh process (`python -m sm70ctl doctor --json`), so the figure includes
interpreter start-up and imports, like a user's. Reported: wall and CPU time per run (min,
median, max), the machine, the date and the load, and, from the JSON the doctor prints, the
time each probe took (probes run concurrently, so the slowest one bounds the total). Every
figure is measured in this run, on this machine; nothing is projected. Exit codes 0 and 1
both count as a completed run (a machine that fails checks still gets a report); anything
else aborts the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import write_json
from startup_timing import machine, spread, time_runs

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    ap.add_argument("--env-file", help="passed to the doctor")
    args = ap.parse_args()
    extra = ["--env-file", args.env_file] if args.env_file else []

    where = machine()
    cmd = [sys.executable, "-m", "sm70ctl", "doctor", "--json", *extra]
    runs = time_runs(cmd, os.environ, args.runs, cwd=ROOT, ok=(0, 1))
    walls, cpus, probe_times = runs.wall_s, runs.cpu_s, {}
    for stdout in runs.stdout:
        for name, seconds in json.loads(stdout)["probes"]["seconds"].items():
            probe_times.setdefault(name, []).append(seconds)

    result = {
        "what": "sm70ctl doctor --json, fresh process per run",
        "measured": True,
        **where,
        "runs": args.runs,
        "wall_s": spread(walls),
        "cpu_s": spread(cpus),
        "target_s": TARGET_S,
        "under_target": statistics.median(walls) < TARGET_S,
        "probe_median_s": {k: round(statistics.median(v), 3) for k, v in probe_times.items()},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        write_json(args.out, result, indent=2, newline=True)

    from rich.console import Console

    from sm70ctl.output import make_table

    rows = [(f"total ({kind})", *(f"{result[key][k]:.3f}" for k in ("min", "median", "max")))
            for kind, key in (("wall", "wall_s"), ("CPU", "cpu_s"))]
    for name, values in probe_times.items():
        rows.append(
            (
                f"probe: {name}",
                f"{min(values):.3f}",
                f"{statistics.median(values):.3f}",
                f"{max(values):.3f}",
            )
        )
    verdict = "under" if result["under_target"] else "OVER"
    Console(stderr=True).print(
        make_table(
            f"sm70ctl doctor --json ({args.runs} runs, {where['date']}, {where['cpus']} CPUs, "
            f"load {where['load_1m_at_start']}; median {verdict} {TARGET_S} s)",
            ["", "min s", "median s", "max s"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
