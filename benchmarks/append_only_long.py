"""What a version of an append-only state costs over a long run, with and without merging segments.

    python benchmarks/append_only_long.py [--rows 1000000] [--per-version 500] [--log-rows 18]
        [--versions 2100] [--at 10,100,500,2000] [--arms none,merge] [--fanout 16] [--verify-every 250]
        [--keep 2] [--dir DIR]

No Ray: per arm, the two append-only states of the RLlib callback's replay buffer are saved
``--versions`` times through the writer's own code (``checkpoint_io.write_append_only`` on a local
tier, each version over the previous one's files, as the coordinator's ``append_base_for`` gives
them): ``replay``, a FIFO buffer of ``--rows`` rows of a DQN CartPole transition's size that gains
``--per-version`` rows a version and, full from the first version on, loses as many from its
front; and ``replay_meta``, a log gaining ``--log-rows`` 264-byte rows a version whose rows live as
the callback's records do (:class:`Log`). Each version's manifest is the real ``Manifest`` the
coordinator commits: each state's entry with every file the part lists (each
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
both arms) and over the last ``--steady`` versions (once the first version's rows are evicted: the
steady state), the largest segment written after the first, and the time per version.
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


class Log:
    """A log like the RLlib callback's ``replay_meta``: each version appends ``per_version`` rows of
    a 256-byte blob; the last two (the meta record) are live in their own version only, the others
    (episodes, priorities) as long as the rows of that version live in the FIFO (``life`` versions);
    the first version's ``dict_rows`` (the dictionary record) stay live throughout."""

    def __init__(self, per_version: int, life: int, versions: int, dict_rows: int = 15, seed: int = 1):
        self.k, self.life, self.dict_rows = per_version, life, dict_rows
        total = dict_rows + per_version * versions
        self.blob = np.random.default_rng(seed).integers(0, 256, (total, 256), dtype=np.uint8)

    def state(self, version: int) -> dict:
        first = max(1, version - self.life + 1)
        starts = self.dict_rows + self.k * (np.arange(first, version + 1) - 1)
        ids = np.concatenate([np.arange(self.dict_rows)] + [np.arange(a, a + self.k - 2) for a in starts[:-1]]
                             + [np.arange(starts[-1], starts[-1] + self.k)]).astype(np.int64)
        return {"row_id": ids, "blob": self.blob[ids], "meta_at": int(ids[-2]), "format": "log"}


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


def run_arm(arm: str, args, bufs: dict, workdir: str) -> dict:
    """Save every state of ``bufs`` (name -> Fifo or Log) ``--versions`` times; per version and
    state, the bytes of its own segment and of its index, the live segments it lists, and the
    manifest's bytes."""
    tier = Tier(os.path.join(workdir, arm), "local")
    fanout = NEVER if arm == "none" else args.fanout
    base, prev, kept, secs = {name: [] for name in bufs}, None, [], []
    out = {name: {"seg": {}, "idx": {}, "n": {}} for name in bufs}
    out["man"] = {}
    for v in range(1, args.versions + 1):
        t0 = time.perf_counter()
        entries, states = {}, {}
        for name, buf in bufs.items():
            states[name] = state = buf.state(v)
            files, _ = checkpoint_io.write_append_only(tier, v, name, 0, flatten(state, state_name=name), base[name],
                                                       fanout=fanout)
            for f in files:
                f.node = f.node or NODE
            entries[name] = StateEntry("best_effort", "stored", files={"0": files}, bytes=sum(f.size for f in files))
            own = [f for f in files if f.role == ROLE_SEGMENT and f.path.startswith(f"v{v:012d}/")]
            out[name]["seg"][v] = sum(f.size for f in own)
            out[name]["idx"][v] = sum(f.size for f in files if f.role == ROLE_INDEX)
            out[name]["n"][v] = sum(f.role == ROLE_SEGMENT for f in files)
            base[name] = files
        m = Manifest("long-run", v, v, time.time(), states=entries)
        if prev is not None:
            m.previous_version, m.previous = prev.version, manifest_digest(prev)
        checkpoint_io.write_manifest(tier, m)
        kept.append(m)
        if len(kept) > args.keep:  # retention: keep_last=--keep, through the coordinator's deletion
            doomed = kept.pop(0)
            keep_paths = {p for km in kept for p in km.referenced_paths()}
            checkpoint_io.delete_version(tier, doomed.version, keep_paths, doomed.referenced_paths())
        secs.append(time.perf_counter() - t0)
        out["man"][v] = len(m.to_json())
        if v == args.versions or (args.verify_every and v % args.verify_every == 0):
            for name in bufs:
                _verify(tier, base[name], states[name], v, name)
        prev = m
    on_disk = sum(len(fs) for _, _, fs in os.walk(os.path.join(workdir, arm)))
    listed = len({p for km in kept for p in km.referenced_paths()}) + len(kept)
    assert on_disk == listed, f"{arm}: {on_disk} files on disk, the kept versions list {listed} (+ manifests)"
    out["s_per_version"] = statistics.median(secs)
    return out


def _verify(tier, files, state, v, name):
    bufs, _, _ = checkpoint_io.read_files([tier], files)
    back = checkpoint_io.decode_files(files, bufs, name=name, as_numpy=True)
    for k, want in state.items():
        got = back[k]
        same = (np.array_equal(got, want) and got.dtype == want.dtype) if isinstance(want, np.ndarray) else got == want
        assert same, f"version {v}: {name} {k!r} did not come back bit-exact"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--per-version", type=int, default=500)
    ap.add_argument("--log-rows", type=int, default=18, help="rows a version adds to the log state (0: no log)")
    ap.add_argument("--versions", type=int, default=2100)
    ap.add_argument("--at", default="10,100,500,2000")
    ap.add_argument("--arms", default="none,merge")
    ap.add_argument("--fanout", type=int, default=16)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--steady", type=int, default=512, help="also the mean of the last this many versions")
    ap.add_argument("--verify-every", type=int, default=250)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    at = [int(x) for x in args.at.split(",") if int(x) <= args.versions]
    life = args.rows // args.per_version
    workdir = tempfile.mkdtemp(prefix="append_only_long_", dir=args.dir)
    fifo = Fifo(args.rows, args.per_version, args.versions)
    bufs = {"replay": fifo}
    if args.log_rows:
        bufs["replay_meta"] = Log(args.log_rows, life, args.versions)
    row_bytes = sum(c.itemsize * (c[0].size if c.ndim > 1 else 1) for c in fifo.cols.values())
    print(f"FIFO buffer `replay` of {args.rows:,} rows ({row_bytes} bytes each), +{args.per_version} rows a version "
          f"(rows live {life} versions)" + (f"; log `replay_meta` +{args.log_rows} rows of 264 bytes a version"
                                          if args.log_rows else "")
          + f"; {args.versions} versions, keep_last={args.keep}; load average {_load()}")
    try:
        totals = {}
        for arm in args.arms.split(","):
            r = run_arm(arm, args, bufs, workdir)
            shutil.rmtree(os.path.join(workdir, arm), ignore_errors=True)
            totals[arm] = _table(arm, args, r, list(bufs), at)
        if len(totals) == 2:
            a, b = totals.values()
            print(f"\namortised bytes a version ({' -> '.join(totals)}): {a:,.0f} -> {b:,.0f} ({b / a:.3f}x)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _table(arm: str, args, r: dict, names: list, at: list) -> float:
    """Print an arm's table; return its mean bytes a version (versions 2 on)."""
    print(f"\n{arm} (fanout {'-' if arm == 'none' else args.fanout}): bytes of a version (segment: its new "
          f"rows + the rows it absorbed; live segments: what its manifest and index list)")
    print("| version | " + " | ".join(f"{n} segment | {n} index" for n in names)
          + " | manifest | total | live segments |")
    print("|---" * (2 * len(names) + 4) + "|")
    later = range(2, args.versions + 1)

    def row(label, pick):
        segs, idxs = [pick(r[n]["seg"]) for n in names], [pick(r[n]["idx"]) for n in names]
        man = pick(r["man"])
        tot = sum(segs) + sum(idxs) + man
        live = " + ".join(f"{pick(r[n]['n']):,.0f}" for n in names)
        print(f"| {label} | " + " | ".join(f"{a:,.0f} | {b:,.0f}" for a, b in zip(segs, idxs))
              + f" | {man:,.0f} | {tot:,.0f} | {live} |")
        return tot

    for v in at:
        row(str(v), lambda d: d[v])
    total = row(f"mean of 2-{args.versions}", lambda d: statistics.fmean(d[u] for u in later))
    if args.steady and args.steady < args.versions - 1:
        last = range(args.versions - args.steady + 1, args.versions + 1)
        row(f"mean of {last[0]}-{last[-1]}", lambda d: statistics.fmean(d[u] for u in last))
    big = max(r[n]["seg"][u] for n in names for u in later)
    print(f"largest segment after the first version: {big:,} bytes; median {r['s_per_version'] * 1e3:.1f} ms "
          f"a version (writes + manifest + retention); load average {_load()}")
    return total


def _load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


if __name__ == "__main__":
    main()
