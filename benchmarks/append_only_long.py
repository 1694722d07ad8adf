"""What a version of an append-only state costs over a long run, with and without merging segments.

    python benchmarks/append_only_long.py [--rows 1000000] [--per-version 500] [--versions 2100]
        [--at 10,100,500,2000] [--arms none,merge] [--fanout 16] [--verify-every 250] [--dir DIR]

No Ray: per arm, a FIFO buffer of ``--rows`` rows that gains ``--per-version`` rows a version (and,
once full, loses as many from its front) is saved ``--versions`` times through the writer's own
code (``checkpoint_io.write_append_only`` on a local tier, each version over the previous one's
files, as the coordinator's ``append_base_for`` gives them). Each version's manifest is the real
``Manifest`` the coordinator commits: the state's entry with every file the part lists (each
``FileEntry`` with a Ray node id, as ``commits.record`` sets it), the run name, step, time and the
digest of the previous manifest; its size is ``len(Manifest.to_json())``, the bytes written as
``manifest.json``. It is written, and retention keeps the last ``--keep`` versions through
``checkpoint_io.delete_version`` with the kept versions' paths, as the coordinator does, so a
merged-away segment is deleted once no kept version lists it. Every ``--verify-every`` versions (and
the last) the version is read back through ``read_files`` + ``decode_files`` and compared with the
buffer bit for bit.

Arms: ``none``, the writer with no merging (a fanout no run of segments reaches: what a version
cost before merging); ``merge``, the writer's policy (``formats/compaction.py``, base ``--fanout``).
The buffer's first version is the whole buffer (prefilled full), so evictions run from version 2.

Printed per arm: at each ``--at`` version, the bytes of the version's own segment (new rows plus
what it absorbed), its index, its manifest, their sum and the live segments it lists; then over all
versions the mean of each (the amortised cost, first version left out: it is the whole buffer in
both arms), the largest segment written after the first, and the time per version.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ray_ckpt.formats.manifest import ROLE_INDEX, ROLE_SEGMENT, Manifest, StateEntry, manifest_digest  # noqa: E402
from ray_ckpt.formats.tree import flatten  # noqa: E402
from ray_ckpt.storage import checkpoint_io  # noqa: E402
from ray_ckpt.storage.tier import Tier  # noqa: E402

NODE = hashlib.sha224(b"node").hexdigest()  # a Ray node id: 56 hex digits
NEVER = 1 << 40  # a fanout no run of segments reaches: no merging


class Fifo:
    """All the rows a run will hold, made once; version v's buffer is a window of them."""

    def __init__(self, rows: int, per_version: int, versions: int, seed: int = 0):
        total = rows + per_version * versions
        rng = np.random.default_rng(seed)
        self.rows, self.k = rows, per_version
        self.cols = {  # a DQN CartPole row: ~69 bytes
            "row_id": np.arange(total, dtype=np.int64),
            "obs": rng.standard_normal((total, 4)).astype(np.float32),
            "next_obs": rng.standard_normal((total, 4)).astype(np.float32),
            "action": rng.integers(0, 2, total).astype(np.int64),
            "reward": np.ones(total, np.float32),
            "terminated": rng.random(total) < 0.05,
            "prio": rng.random(total),
            "prio_k": np.zeros(total, np.int8),
            "t": rng.integers(0, 500, total).astype(np.int16),
        }

    def state(self, version: int) -> dict:
        hi = self.rows + self.k * (version - 1)
        lo = hi - self.rows
        out = {k: v[lo:hi] for k, v in self.cols.items()}
        out["next_id"] = int(hi)
        return out


def run_arm(arm: str, args, fifo: Fifo, workdir: str) -> dict:
    tier = Tier(os.path.join(workdir, arm), "local")
    fanout = NEVER if arm == "none" else args.fanout
    base, prev, kept = [], None, []
    seg_b, idx_b, man_b, n_segs, secs = {}, {}, {}, {}, []
    for v in range(1, args.versions + 1):
        state = fifo.state(v)
        t0 = time.perf_counter()
        files, _ = checkpoint_io.write_append_only(tier, v, "replay", 0, flatten(state, state_name="replay"), base,
                                                   fanout=fanout)
        for f in files:
            f.node = f.node or NODE
        m = Manifest("long-run", v, v, time.time(), states={
            "replay": StateEntry("best_effort", "stored", files={"0": files}, bytes=sum(f.size for f in files))})
        if prev is not None:
            m.previous_version, m.previous = prev.version, manifest_digest(prev)
        checkpoint_io.write_manifest(tier, m)
        kept.append(m)
        if len(kept) > args.keep:  # retention: keep_last=--keep, through the coordinator's deletion
            doomed = kept.pop(0)
            keep_paths = {p for km in kept for p in km.referenced_paths()}
            checkpoint_io.delete_version(tier, doomed.version, keep_paths, doomed.referenced_paths())
        secs.append(time.perf_counter() - t0)
        own = [f for f in files if f.role == ROLE_SEGMENT and f.path.startswith(f"v{v:012d}/")]
        seg_b[v] = sum(f.size for f in own)
        idx_b[v] = sum(f.size for f in files if f.role == ROLE_INDEX)
        man_b[v] = len(m.to_json())
        n_segs[v] = sum(f.role == ROLE_SEGMENT for f in files)
        if v == args.versions or (args.verify_every and v % args.verify_every == 0):
            _verify(tier, files, state, v)
        base, prev = files, m
    on_disk = sum(len(fs) for _, _, fs in os.walk(os.path.join(workdir, arm)))
    listed = len({p for km in kept for p in km.referenced_paths()}) + len(kept)
    assert on_disk == listed, f"{arm}: {on_disk} files on disk, the kept versions list {listed} (+ manifests)"
    later = range(2, args.versions + 1)
    return {"seg": seg_b, "idx": idx_b, "man": man_b, "n": n_segs,
            "mean": {k: statistics.fmean(d[v] for v in later) for k, d in (("seg", seg_b), ("idx", idx_b),
                                                                          ("man", man_b), ("n", n_segs))},
            "max_seg": max(seg_b[v] for v in later), "s_per_version": statistics.median(secs)}


def _verify(tier, files, state, v):
    bufs, _, _ = checkpoint_io.read_files([tier], files)
    back = checkpoint_io.decode_files(files, bufs, name="replay", as_numpy=True)
    for k, want in state.items():
        got = back[k]
        same = (np.array_equal(got, want) and got.dtype == want.dtype) if isinstance(want, np.ndarray) else got == want
        assert same, f"version {v}: column {k!r} did not come back bit-exact"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--per-version", type=int, default=500)
    ap.add_argument("--versions", type=int, default=2100)
    ap.add_argument("--at", default="10,100,500,2000")
    ap.add_argument("--arms", default="none,merge")
    ap.add_argument("--fanout", type=int, default=16)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--verify-every", type=int, default=250)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    at = [int(x) for x in args.at.split(",") if int(x) <= args.versions]
    workdir = tempfile.mkdtemp(prefix="append_only_long_", dir=args.dir)
    fifo = Fifo(args.rows, args.per_version, args.versions)
    row_bytes = sum(c.itemsize * (c[0].size if c.ndim > 1 else 1) for c in fifo.cols.values())
    print(f"FIFO buffer of {args.rows:,} rows ({row_bytes} bytes each), +{args.per_version} rows a version "
          f"(rows live {args.rows // args.per_version} versions), {args.versions} versions, keep_last={args.keep}; "
          f"load average {open('/proc/loadavg').read().split()[:3]}")
    try:
        results = {}
        for arm in args.arms.split(","):
            results[arm] = r = run_arm(arm, args, fifo, workdir)
            print(f"\n{arm} (fanout {'-' if arm == 'none' else args.fanout}): bytes of a version "
                  f"(segment = its new rows + the rows it absorbed)")
            print("| version | segment | index | manifest | total | live segments |\n|---|---|---|---|---|---|")
            for v in at:
                tot = r["seg"][v] + r["idx"][v] + r["man"][v]
                print(f"| {v} | {r['seg'][v]:,} | {r['idx'][v]:,} | {r['man'][v]:,} | {tot:,} | {r['n'][v]} |")
            mean = r["mean"]
            tot = mean["seg"] + mean["idx"] + mean["man"]
            print(f"| mean of versions 2-{args.versions} | {mean['seg']:,.0f} | {mean['idx']:,.0f} | {mean['man']:,.0f} "
                  f"| {tot:,.0f} | {mean['n']:.1f} |")
            print(f"largest segment after the first: {r['max_seg']:,} bytes; median {r['s_per_version'] * 1e3:.1f} ms "
                  f"a version (write + manifest + retention); load average {open('/proc/loadavg').read().split()[:3]}")
            shutil.rmtree(os.path.join(workdir, arm), ignore_errors=True)
        if len(results) == 2:
            a, b = (results[x]["mean"] for x in args.arms.split(","))
            ta, tb = (m["seg"] + m["idx"] + m["man"] for m in (a, b))
            print(f"\namortised bytes a version: {ta:,.0f} -> {tb:,.0f} ({tb / ta:.3f}x)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
