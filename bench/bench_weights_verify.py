"""Benchmark `weights verify`: sha256 throughput, and the fast (stat) vs full (re-hash) paths.

    python bench/bench_weights_verify.py --mib 1024 --files 4 --out verify.json

Builds a synthetic checkpoint folder (random shards plus a manifest written the way
`weights fetch` writes it) in a temporary folder, then times, in this run on this machine:
  * sha256_gbps: hashing every shard once more (files in the page cache after the warm-up);
  * verify_fast_s: `verify_folder` with an unchanged stat cache (reads no file data);
  * verify_full_s: `verify_folder(full=True)` (re-hashes everything).
The 32 GB projection is sha256_gbps scaled to the int8 checkpoint's size (about 32 GB,
FACTS.md): projected, not measured, and only for a checkpoint already in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sm70ctl.output import Output, make_table
from sm70ctl.weights.manifest import FileEntry, Manifest, StatStamp, sha256_file, write_manifest
from sm70ctl.weights.verify import verify_folder

CHECKPOINT_BYTES = 32e9


def build(folder: Path, mib: int, files: int) -> int:
    per = mib * 2**20 // files
    manifest = Manifest(name="bench", repo_id="bench/synthetic", revision="0" * 40, complete=True)
    for i in range(files):
        path = folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        with open(path, "wb") as f:
            left = per
            while left:
                n = min(left, 64 * 2**20)
                f.write(os.urandom(n))
                left -= n
        sha = sha256_file(path)
        manifest.files[path.name] = FileEntry(size=per, lfs_sha256=sha, sha256=sha,
                                              stat=StatStamp.of(path))
    write_manifest(folder, manifest)
    return per * files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="total size of the synthetic shards")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--json", action="store_true", help="print only JSON")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="sm70-bench-verify-") as tmp:
        folder = Path(tmp)
        total = build(folder, args.mib, args.files)
        t = time.perf_counter()
        for p in sorted(folder.glob("*.safetensors")):
            sha256_file(p)
        hash_s = time.perf_counter() - t
        t = time.perf_counter()
        fast = verify_folder(folder, check_quant=False)
        fast_s = time.perf_counter() - t
        t = time.perf_counter()
        full = verify_folder(folder, full=True, check_quant=False)
        full_s = time.perf_counter() - t
        assert fast.ok and full.ok and fast.hashed == 0 and full.hashed == args.files

    gbps = total / hash_s / 1e9
    data = {
        "bytes": total,
        "files": args.files,
        "sha256_gbps": round(gbps, 3),
        "verify_fast_s": round(fast_s, 4),
        "verify_full_s": round(full_s, 3),
        "projected_full_verify_32gb_cached_s": round(CHECKPOINT_BYTES / 1e9 / gbps, 1),
    }
    if args.out:
        args.out.write_text(json.dumps(data, indent=2) + "\n")

    def render(console) -> None:
        console.print(make_table(
            f"weights verify on {total / 2**20:.0f} MiB in {args.files} files (measured here)",
            ["metric", "value"],
            [(k, v) for k, v in data.items()],
        ))

    Output(args.json).emit(data, render)


if __name__ == "__main__":
    main()
