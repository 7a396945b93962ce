"""How long `sm70ctl doctor --json` takes on this machine (target: under 2 s).

    python bench/bench_doctor.py --runs 7 --out doctor-bench.json

Each run is a fresh process (`python -m sm70ctl doctor --json`), so the figure includes
interpreter start-up and imports, like a user's. Reported: wall time per run (min,
median, max) and, from the JSON the doctor prints, the time each probe took (probes run
concurrently, so the slowest one bounds the total). Every figure is measured in this run,
on this machine; nothing is projected. Exit codes 0 and 1 both count as a completed run
(a machine that fails checks still gets a report); anything else aborts the benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 2.0


def one_run(extra: list[str]) -> tuple[float, dict]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "sm70ctl", "doctor", "--json", *extra],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"doctor exited {proc.returncode}:\n{proc.stderr}")
    return wall, json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    ap.add_argument("--env-file", help="passed to the doctor")
    args = ap.parse_args()
    extra = ["--env-file", args.env_file] if args.env_file else []

    one_run(extra)  # warm the page cache and __pycache__ once; not counted
    walls, probe_times = [], {}
    for _ in range(args.runs):
        wall, report = one_run(extra)
        walls.append(wall)
        for name, seconds in report["probes"]["seconds"].items():
            probe_times.setdefault(name, []).append(seconds)

    result = {
        "what": "sm70ctl doctor --json, fresh process per run",
        "measured": True,
        "runs": args.runs,
        "wall_s": {
            "min": round(min(walls), 3),
            "median": round(statistics.median(walls), 3),
            "max": round(max(walls), 3),
        },
        "target_s": TARGET_S,
        "under_target": max(walls) < TARGET_S,
        "probe_median_s": {k: round(statistics.median(v), 3) for k, v in probe_times.items()},
        "python": sys.version.split()[0],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    from rich.console import Console

    from sm70ctl.output import make_table

    rows = [("total (wall)", *(f"{result['wall_s'][k]:.3f}" for k in ("min", "median", "max")))]
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
            f"sm70ctl doctor --json ({args.runs} runs; {verdict} {TARGET_S} s)",
            ["", "min s", "median s", "max s"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
