"""Cold read + verify of one large checkpoint file, the ways restore could do it, in one run.

    python benchmarks/restore_read.py [--mb 2048] [--repeats 5] [--dir /work/bench_tmp]

Writes a file of random bytes once, then for each repeat drops the page cache (root only) before
each variant: ``dd bs=64M`` to /dev/null (the disk's buffered sequential read), and a private
mapping of the file hashed block by block by N threads (what ``Tier.read_verified`` does), with the
kernel's default readahead or with MADV_SEQUENTIAL. Prints the sorted times and the median.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ray_ckpt.formats import checksum


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def mapped(path: str, threads: int, advice) -> None:
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if advice is not None:
        m.madvise(advice)
    checksum.digest(m, threads=threads)
    m.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    d = args.dir or tempfile.mkdtemp(prefix="rc_rr_")
    path = os.path.join(d, "restore_read.bin")
    subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=64M", f"count={max(1, args.mb // 64)}",
                    "conv=fsync"], check=True, capture_output=True)
    variants = {
        "dd bs=64M": lambda: subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M"], check=True,
                                            capture_output=True),
        "mapped, 1 thread": lambda: mapped(path, 1, None),
        "mapped, 2 threads, MADV_SEQUENTIAL": lambda: mapped(path, 2, mmap.MADV_SEQUENTIAL),
        "mapped, 2 threads": lambda: mapped(path, 2, None),
        "mapped, 4 threads (restore's default)": lambda: mapped(path, 4, None),
    }
    times = {k: [] for k in variants}
    cold = True
    for i in range(args.repeats):
        names = list(variants)
        names = names[i % len(names):] + names[:i % len(names)]
        for name in names:
            cold = drop_caches() and cold
            t = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t)
    os.remove(path)
    print(f"{args.mb} MiB file, {args.repeats} repeats, {'cold' if cold else 'WARM (could not drop)'} page cache\n")
    print("| how | median s | all runs s |")
    print("|---|---|---|")
    for name, xs in times.items():
        print(f"| {name} | {statistics.median(xs):.2f} | {', '.join(f'{x:.2f}' for x in sorted(xs))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
