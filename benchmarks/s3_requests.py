"""Object-store request overheads of the remote tier, on a real S3-compatible server (SeaweedFS,
started here on 127.0.0.1), side by side in one run.

    python benchmarks/s3_requests.py [--versions 200] [--files 3] [--writes 100]

listing: ``Tier.version_dirs()`` of a run with --versions versions of --files objects each (what
         the coordinator and ``ray-ckpt ls`` do first), against the per-version way it used to
         be done: list the run root, then one HEAD per version's manifest.
writes:  --writes small objects under new version/state prefixes through ``Tier.put_bytes``,
         against the same writes preceded by ``create_dir(parent, recursive=True)`` (what the
         tier did before: on an object store that writes a marker object per level).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import pyarrow.fs as pafs

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from s3server import S3Server  # noqa: E402

from ray_ckpt.storage.layout import MANIFEST, parse_version_dir, version_dir  # noqa: E402
from ray_ckpt.storage.tier import Tier  # noqa: E402


def per_version_heads(tier: Tier) -> dict:
    out = {}
    for info in tier.fs.get_file_info(pafs.FileSelector(tier.root, allow_not_found=True)):
        v = parse_version_dir(info.base_name)
        if v is not None and info.type == pafs.FileType.Directory:
            out[v] = tier.exists(f"{info.base_name}/{MANIFEST}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=200)
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--writes", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="rc_s3req_")
    srv = S3Server(os.path.join(root, "s3")).start()
    try:
        tier = Tier(srv.uri("listing/run"), "remote", srv.options)
        for v in range(1, args.versions + 1):
            for i in range(args.files - 1):
                tier.put_bytes(f"{version_dir(v)}/s{i}/rank0.safetensors", b"x")
            if v % 10:  # every tenth version has no manifest (a save that never committed)
                tier.put_bytes(f"{version_dir(v)}/{MANIFEST}", b"{}")
        new, old = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            a = tier.version_dirs()
            new.append(time.perf_counter() - t)
            t = time.perf_counter()
            b = per_version_heads(tier)
            old.append(time.perf_counter() - t)
            assert a == b and len(a) == args.versions, (len(a), len(b))
        wt = Tier(srv.uri("writes/run"), "remote", srv.options)
        plain, with_dirs = [], []
        for r in range(args.repeats):
            t = time.perf_counter()
            for i in range(args.writes):
                wt.put_bytes(f"{version_dir(r * 2 * args.writes + i)}/state/rank0.table0.arrow", b"y" * 1024)
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            for i in range(args.writes):
                rel = f"{version_dir((r * 2 + 1) * args.writes + i)}/state/rank0.table0.arrow"
                wt.fs.create_dir(os.path.dirname(wt.abspath(rel)), recursive=True)
                wt.put_bytes(rel, b"y" * 1024)
            with_dirs.append(time.perf_counter() - t)
        med = statistics.median
        print(f"SeaweedFS on 127.0.0.1, {args.repeats} repeats (medians)\n")
        print("| what | ours s | before s | ratio |")
        print("|---|---|---|---|")
        print(f"| list a run of {args.versions} versions ({args.files} objects each) | {med(new):.3f} | "
              f"{med(old):.3f} | {med(new) / med(old):.2f}x |")
        print(f"| {args.writes} small object writes under new prefixes | {med(plain):.3f} | "
              f"{med(with_dirs):.3f} | {med(plain) / med(with_dirs):.2f}x |")
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
