"""How long `sm70ctl warmup --check` takes on a warm cache (target: median under 1 s).

    python bench/bench_warmup_check.py [--runs 10] [--serve-python .serve-venv/bin/python]

Fills a throw-away cache first (`sm70ctl warmup --device cpu` with the CPU test profile,
which has nothing to compile, so the cache is warm at once), then times:
  * cli: the whole command as a user runs it (a fresh `python -m sm70ctl` process each time:
    interpreter start, imports, settings, fingerprint, manifest read), wall and CPU time,
    with the machine, the date and the load;
  * in_process: `cache_status()` alone, and whether torch got imported (it must not).
The serving interpreter defaults to .serve-venv (real torch and vLLM metadata to read);
without it the tool's own python stands in. Prints a table and one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from startup_timing import machine, spread, time_runs  # noqa: E402

TARGET_S = 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    default_py = REPO / ".serve-venv" / "bin" / "python"
    ap.add_argument("--serve-python", type=Path,
                    default=default_py if default_py.is_file() else Path(sys.executable))
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
        env.update({"SM70_CACHE_DIR": f"{tmp}/cache", "SM70_LOG_DIR": f"{tmp}/logs",
                    "SM70_SERVE_PYTHON": str(args.serve_python),
                    "SM70_MODEL_DIR": tmp})
        profile = ["--device", "cpu", "--env-file", str(REPO / "tests" / "e2e" / "cpu.env")]
        cmd = [sys.executable, "-m", "sm70ctl", "warmup", *profile]
        subprocess.run(cmd, env=env, check=True, capture_output=True)

        where = machine()
        cli = time_runs([*cmd, "--check"], env, args.runs)  # exit 1 (cold) stops it

        os.environ.update(env)
        from sm70ctl.runtime.cache_status import cache_status
        from sm70ctl.settings import load_settings

        settings = load_settings(env_file=REPO / "tests" / "e2e" / "cpu.env")
        inproc = []
        for _ in range(args.runs):
            t = time.perf_counter()
            verdict, _ = cache_status(settings, "cpu", os.environ)
            inproc.append(time.perf_counter() - t)
            assert verdict.warm, verdict.reason
        torch_imported = "torch" in sys.modules

    data = {
        "what": "sm70ctl warmup --check on a warm cache, fresh process per run",
        "measured": True,
        **where,
        "serve_python": str(args.serve_python),
        "runs": args.runs,
        "wall_s": spread(cli.wall_s),
        "cpu_s": spread(cli.cpu_s),
        "in_process_s": spread(inproc),
        "torch_imported": torch_imported,
        "target_s": TARGET_S,
        "under_target": statistics.median(cli.wall_s) < TARGET_S and not torch_imported,
    }
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"sm70ctl warmup --check on a warm cache ({args.runs} runs, "
                        f"{where['date']}, {where['cpus']} CPUs, "
                        f"load {where['load_1m_at_start']})")
    for col in ("what", "min s", "median s", "max s"):
        table.add_column(col)
    for label, key in (("whole command, wall", "wall_s"), ("whole command, CPU", "cpu_s"),
                       ("cache_status() in process", "in_process_s")):
        table.add_row(label, *(f"{data[key][k]:.3f}" for k in ("min", "median", "max")))
    Console(stderr=True).print(table)
    print(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
