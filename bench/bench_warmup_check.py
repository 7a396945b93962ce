"""How long `sm70ctl warmup --check` takes on a warm cache (the target is under 3 s).

    python bench/bench_warmup_check.py [--runs 10] [--serve-python .serve-venv/bin/python]

Fills a throw-away cache first (`sm70ctl warmup --device cpu` with the CPU test profile,
which has nothing to compile, so the cache is warm at once), then times:
  * cli: the whole command as a user runs it (a fresh `python -m sm70ctl` process each time:
    interpreter start, imports, settings, fingerprint, manifest read);
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

TARGET_S = 3.0


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

        cli = []
        for _ in range(args.runs):
            t = time.perf_counter()
            r = subprocess.run([*cmd, "--check"], env=env, capture_output=True, text=True)
            cli.append(time.perf_counter() - t)
            if r.returncode != 0:
                raise SystemExit(f"expected warm, got: {r.stdout}{r.stderr}")

        os.environ.update(env)
        from sm70ctl.settings import load_settings
        from sm70ctl.runtime.cache_status import cache_status

        settings = load_settings(env_file=REPO / "tests" / "e2e" / "cpu.env")
        inproc = []
        for _ in range(args.runs):
            t = time.perf_counter()
            verdict, _ = cache_status(settings, "cpu", os.environ)
            inproc.append(time.perf_counter() - t)
            assert verdict.warm, verdict.reason
        torch_imported = "torch" in sys.modules

    data = {
        "serve_python": str(args.serve_python),
        "runs": args.runs,
        "cli_median_s": round(statistics.median(cli), 3),
        "cli_max_s": round(max(cli), 3),
        "in_process_median_s": round(statistics.median(inproc), 3),
        "in_process_max_s": round(max(inproc), 3),
        "torch_imported": torch_imported,
        "target_s": TARGET_S,
        "under_target": max(cli) < TARGET_S and not torch_imported,
    }
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sm70ctl warmup --check on a warm cache (measured here)")
    for col in ("what", "median s", "max s"):
        table.add_column(col)
    table.add_row("whole command (fresh process)", f"{data['cli_median_s']:.3f}",
                  f"{data['cli_max_s']:.3f}")
    table.add_row("cache_status() in process", f"{data['in_process_median_s']:.3f}",
                  f"{data['in_process_max_s']:.3f}")
    Console(stderr=True).print(table)
    print(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
