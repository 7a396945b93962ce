"""How long `sm70ctl env check` takes (target: median under 0.5 s), and where the time goes.

Measures, on this machine:
  - `sm70ctl env check` as a fresh process (what a user waits for), N runs, wall and CPU;
  - the same with an .env file and a dozen variables set;
  - in-process: schema load, pydantic model build, one load_settings() call.
Prints a table on stderr, then one JSON document on the last line of stdout. Where the
import time goes: `python -X importtime -m sm70ctl env check`.

    python bench/bench_env_check.py --runs 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup_timing import machine, spread, time_runs

TARGET_S = 0.5
CHECK = [sys.executable, "-m", "sm70ctl", "env", "check"]
SOME = {
    "SM70_PORT": "8100", "SM70_MAX_NUM_SEQS": "8", "SM70_KV_CACHE_BYTES": "9GiB",
    "SM70_STARTUP_TIMEOUT": "10m", "SM70_CUDAGRAPH_SIZES": "4,8,16",
    "SM70_SPEC_TOKENS": "3", "SM70_LOG_LEVEL": "debug", "SM70_GDN_CHUNK_SIZE": "32",
}


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("SM70_")}


def in_process() -> dict[str, float]:
    code = (
        "import time; t0=time.perf_counter();"
        "from sm70ctl.settings.schema import load_schema; load_schema(); t1=time.perf_counter();"
        "import sm70ctl.settings.model; t2=time.perf_counter();"
        "from sm70ctl.settings import load_settings; load_settings({}); t3=time.perf_counter();"
        "load_settings({}); t4=time.perf_counter();"
        "print(t1-t0, t2-t1, t3-t2, t4-t3)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True,
                         text=True, check=True).stdout.split()
    keys = ("schema_load_s", "model_build_s", "first_load_s", "second_load_s")
    return dict(zip(keys, (float(x) for x in out), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    where = machine()
    env = _clean_env()
    plain = time_runs(CHECK, env, args.runs)
    with tempfile.TemporaryDirectory() as tmp:
        env_file = Path(tmp) / "prod.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in SOME.items()))
        with_file = time_runs([*CHECK, "--env-file", str(env_file)],
                              {**env, "SM70_PORT": "8200"}, args.runs)
    parts = in_process()
    median = statistics.median(plain.wall_s)
    result = {
        "what": "sm70ctl env check, fresh process per run",
        "measured": True,
        **where,
        "runs": args.runs,
        "wall_s": spread(plain.wall_s),
        "cpu_s": spread(plain.cpu_s),
        "env_file_wall_s": spread(with_file.wall_s),
        **{k: round(v, 4) for k, v in parts.items()},
        "target_s": TARGET_S,
        "within_target": median < TARGET_S,
    }
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"sm70ctl env check ({args.runs} runs, {where['date']}, "
                            f"{where['cpus']} CPUs, load {where['load_1m_at_start']})")
        for col in ("measure", "min s", "median s", "max s"):
            table.add_column(col, justify="right" if col != "measure" else "left")
        for key in ("wall_s", "cpu_s", "env_file_wall_s"):
            table.add_row(key, *(f"{result[key][k]:.3f}" for k in ("min", "median", "max")))
        for key in parts:
            table.add_row(key, "", f"{result[key]:.4f}", "")
        Console(stderr=True).print(table)
    except ImportError:
        pass
    print(json.dumps(result))


if __name__ == "__main__":
    main()
