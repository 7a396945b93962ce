"""How long `sm70ctl env check` takes (target: under 0.5 s), and where the time goes.

Measures, on this machine:
  - `sm70ctl env check` as a fresh process (what a user waits for), N runs;
  - the same with an .env file and a dozen variables set;
  - in-process: schema parse, pydantic model build, one load_settings() call.
Prints a rich table, then one JSON document on the last line of stdout.

    python bench/bench_env_check.py --runs 10
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

TARGET_S = 0.5
CHECK = [sys.executable, "-m", "sm70ctl", "env", "check"]
SOME = {
    "SM70_PORT": "8100", "SM70_MAX_NUM_SEQS": "8", "SM70_KV_CACHE_BYTES": "9GiB",
    "SM70_STARTUP_TIMEOUT": "10m", "SM70_CUDAGRAPH_SIZES": "1,2,4,8,16",
    "SM70_SPEC_TOKENS": "3", "SM70_LOG_LEVEL": "debug", "SM70_GDN_CHUNK_SIZE": "32",
}


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("SM70_")}


def time_process(cmd: list[str], env: dict[str, str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")
    return times


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
    keys = ("schema_parse_s", "model_build_s", "first_load_s", "second_load_s")
    return dict(zip(keys, (float(x) for x in out), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()

    env = _clean_env()
    plain = time_process(CHECK, env, args.runs)
    with tempfile.TemporaryDirectory() as tmp:
        env_file = Path(tmp) / "prod.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in SOME.items()))
        with_file = time_process([*CHECK, "--env-file", str(env_file)],
                                 {**env, "SM70_PORT": "8200"}, args.runs)
    parts = in_process()
    result = {
        "machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
        "runs": args.runs,
        "env_check_median_s": round(statistics.median(plain), 4),
        "env_check_max_s": round(max(plain), 4),
        "env_check_env_file_median_s": round(statistics.median(with_file), 4),
        **{k: round(v, 4) for k, v in parts.items()},
        "target_s": TARGET_S,
        "within_target": statistics.median(plain) < TARGET_S,
    }
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="sm70ctl env check (measured here)")
        table.add_column("measure")
        table.add_column("seconds", justify="right")
        for key, value in result.items():
            if key.endswith("_s"):
                table.add_row(key, f"{value:.4f}")
        Console(stderr=True).print(table)
    except ImportError:
        pass
    print(json.dumps(result))


if __name__ == "__main__":
    main()
