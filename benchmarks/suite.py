"""The whole benchmark suite in one run on this machine: one table, a markdown file and PNG plots.

    python benchmarks/suite.py [--sizes 64,512,2048] [--repeats 3] [--dir DIR]
                               [--out benchmarks/RESULTS_suite.md] [--plots benchmarks/plots]
                               [--ref-mb 1024] [--quick]

Sections (every comparison is measured in the same run, on the same disk, interleaved per repeat):
  save        per size, from benchmarks/save_stall.py (measure_save): save() return, learner pause
              vs one memcpy, time to durable vs dd / torch.save / safetensors / DCP async_save
  restore     per size: engine.restore() of the state into the learner actor vs torch.load of a
              torch.save file and safetensors.torch.load_file of the same state (loaded in the same
              actor), and dd's read of the checkpoint file; the page cache is dropped before each
              (sync; echo 3 > /proc/sys/vm/drop_caches) when the machine allows it
  throughput  a learner running ~50 ms matmul steps, checkpointed every k steps, vs the same loop
              without checkpoints: steps/s ratio
  storage     5 versions of a run with a frozen reference model (RELOADABLE) and a small changing
              policy: bytes on disk vs 5 full copies, bytes written per version
  memory      object-store use and the writers' / coordinator's RSS before and after 20 saves of a
              64 MB state: no leak

Plots need matplotlib (``pip install -e ".[bench]"``); without it the table is still written.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ray  # noqa: E402
import torch  # noqa: E402

import ray_ckpt as rc  # noqa: E402
from ray_ckpt.storage.layout import version_dir  # noqa: E402
import save_stall as ss  # noqa: E402

MiB = 1 << 20
NAN = float("nan")


# ------------------------------------------------------------------------------- page cache
def drop_caches() -> Optional[str]:
    """sync and drop the page cache; None when done, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"


def resident_fraction(path: str) -> float:
    """Fraction of ``path``'s pages in the page cache (mmap + mincore); NaN if it cannot tell."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        finally:
            os.close(fd)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return NAN
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(addr, size, vec) != 0:
                return NAN
            import numpy as np

            return float((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) / n
        finally:
            libc.munmap(addr, size)
    except Exception:
        return NAN


class Cache:
    """Drops the page cache before a cold measurement and remembers whether that worked."""

    def __init__(self):
        self.error = drop_caches()
        self.resident: List[float] = []  # fraction of the measured file still cached after a drop

    @property
    def cold(self) -> bool:
        return self.error is None

    def before_read(self, path: str) -> None:
        if self.cold:
            self.error = drop_caches()
            self.resident.append(resident_fraction(path))
            print(f"  [cache] {os.path.basename(path)} {self.resident[-1]:.0%} resident after drop", file=sys.stderr)

    def label(self) -> str:
        if not self.cold:
            return f"warm cache (drop_caches failed: {self.error})"
        worst = max([r for r in self.resident if r == r] or [NAN])
        if worst == worst and worst > 0.05:
            return f"cache dropped, but up to {worst:.0%} of a file stayed cached"
        return "cold cache" + (f" (<= {worst:.0%} resident after drop)" if worst == worst else "")


# ------------------------------------------------------------------------------- helpers
def med(xs: List[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else NAN


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else NAN


def files_under(root: str, suffix: str = "") -> List[str]:
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if n.endswith(suffix)]
    return sorted(out)


def bytes_under(root: str) -> int:
    return sum(os.path.getsize(p) for p in files_under(root))


def _rss(_actor: Any = None) -> Dict[str, int]:
    """VmRSS and RssAnon of the calling process, in bytes (runs in an actor via __ray_call__)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def rss_of(handles: List[Any]) -> Dict[str, int]:
    tot = {"VmRSS": 0, "RssAnon": 0, "RssShmem": 0}
    for r in ray.get([h.__ray_call__.remote(_rss) for h in handles], timeout=60):
        for k in tot:
            tot[k] += r.get(k, 0)
    return tot


def object_store_used(settle_s: float = 15.0) -> float:
    """Bytes used in the object store (cluster - available), once the reported value settles:
    the raylet reports its resources about once a second."""
    last, stable_since, t_end = None, time.monotonic(), time.monotonic() + settle_s
    while True:
        used = ray.cluster_resources().get("object_store_memory", 0) - \
            ray.available_resources().get("object_store_memory", 0)
        now = time.monotonic()
        if used != last:
            last, stable_since = used, now
        elif now - stable_since >= 2.5 or now > t_end:
            return float(used)
        time.sleep(0.25)


# ------------------------------------------------------------------------------- restore
def _write_baselines(actor: Any, torch_path: str, st_path: str) -> int:
    """In the learner: torch.save and safetensors files of its state (fsynced)."""
    from safetensors.torch import save_file

    torch.save(actor.sd, torch_path)
    save_file(actor.sd, st_path)
    for p in (torch_path, st_path):
        ss.fsync_path(p)
    return sum(v.nbytes for v in actor.sd.values())


def _torch_load_into(actor: Any, path: str) -> None:
    ss.load_into(actor.sd, torch.load(path, weights_only=True))


def _st_load_into(actor: Any, path: str) -> None:
    from safetensors.torch import load_file

    ss.load_into(actor.sd, load_file(path))


def _timed(ref) -> float:
    t = time.perf_counter()
    ray.get(ref, timeout=1200)
    return time.perf_counter() - t


def dd_read(path: str) -> float:
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M"], check=True, capture_output=True)
    return time.perf_counter() - t


def measure_restore(mb: int, repeats: int, root: str, cache: Cache) -> Dict[str, Any]:
    learner = ss.Learner.remote(mb)
    ray.get(learner.ping.remote())
    run = f"suite_restore{mb}"
    eng = rc.CheckpointEngine.create(run, local_dir=os.path.join(root, "ckpt"), keep_last=1)
    eng.register("state", learner)
    res = eng.save(eng.current_step + 1).wait(timeout=1200)
    # this version's file (an older version left in --dir by an earlier run may not be deleted yet)
    ours = files_under(os.path.join(root, "ckpt", run, version_dir(res.version)), ".safetensors")
    if len(ours) != 1:
        raise RuntimeError(f"expected one checkpoint file under {run}, found {ours}")
    ours = ours[0]
    tp, sp = os.path.join(root, f"restore{mb}.pt"), os.path.join(root, f"restore{mb}.safetensors")
    nbytes = ray.get(learner.__ray_call__.remote(_write_baselines, tp, sp), timeout=1200)
    # warm-up of each code path (imports, first calls); not counted
    rep = eng.restore()
    if rep.states["state"].status != "restored":
        raise RuntimeError(f"restore failed: {rep}")
    ray.get(learner.__ray_call__.remote(_torch_load_into, tp))
    ray.get(learner.__ray_call__.remote(_st_load_into, sp))
    m: Dict[str, List[float]] = {k: [] for k in ("ours", "warm", "torch", "st", "dd")}
    tiers = set()
    for _ in range(repeats):
        t = time.perf_counter()
        eng.restore()
        m["warm"].append(time.perf_counter() - t)
        cache.before_read(ours)
        t = time.perf_counter()
        rep = eng.restore()
        m["ours"].append(time.perf_counter() - t)
        tiers.add(rep.states["state"].tier)
        cache.before_read(tp)
        m["torch"].append(_timed(learner.__ray_call__.remote(_torch_load_into, tp)))
        cache.before_read(sp)
        m["st"].append(_timed(learner.__ray_call__.remote(_st_load_into, sp)))
        cache.before_read(ours)
        m["dd"].append(dd_read(ours))
    eng.shutdown()
    ray.kill(learner)
    for p in (tp, sp):
        os.remove(p)
    out = {k: med(v) for k, v in m.items()}
    out.update(MB=mb, file_mb=os.path.getsize(ours) / MiB, state_mb=nbytes / MiB, tiers=sorted(map(str, tiers)))
    print(f"  restore {mb} MB done", file=sys.stderr)
    return out


# ------------------------------------------------------------------------------- throughput
@ray.remote(num_cpus=1)
class Trainer:
    """A learner whose step is ~step_s of single-threaded 1024x1024 float32 matmuls."""

    def __init__(self, mb: int, step_s: float = 0.05):
        torch.set_num_threads(1)
        self.sd = ss.make_state(mb)
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(1024, 1024, generator=g)
        self.b = torch.randn(1024, 1024, generator=g)
        self.c = torch.empty(1024, 1024)
        for _ in range(3):
            torch.mm(self.a, self.b, out=self.c)
        per = []
        for _ in range(5):
            t = time.perf_counter()
            torch.mm(self.a, self.b, out=self.c)
            per.append(time.perf_counter() - t)
        self.mm_s = statistics.median(per)
        self.reps = max(1, round(step_s / self.mm_s))

    def info(self) -> Dict[str, float]:
        return {"reps": self.reps, "mm_ms": self.mm_s * 1e3}

    def step(self) -> float:
        for _ in range(self.reps):
            torch.mm(self.a, self.b, out=self.c)  # same operands every time: no denormal drift
        self.sd["layer0.w"][:1] += 1.0  # the state changes from step to step
        return float(self.c[0, 0])

    def ckpt_get_state(self, name):
        return self.sd

    def ckpt_set_state(self, name, state):
        self.sd = state


def measure_throughput(mb: int, steps: int, every: int, repeats: int, root: str,
                       **engine_options) -> Dict[str, Any]:
    trainer = Trainer.remote(mb)
    info = ray.get(trainer.info.remote())
    eng = rc.CheckpointEngine.create("suite_throughput", local_dir=os.path.join(root, "ckpt"), keep_last=2,
                                     **engine_options)
    eng.register("learner", trainer)
    ss.wait_prefault(trainer, engine_options)
    eng.save(eng.current_step + 1).wait(timeout=1200)  # writers started; not counted
    for _ in range(3):
        ray.get(trainer.step.remote())

    def loop(with_ckpt: bool):
        base = eng.current_step
        handles = []
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            ray.get(trainer.step.remote())
            if with_ckpt and s % every == 0:
                handles.append(eng.save(base + s))
        t1 = time.perf_counter()
        for h in handles:
            h.wait(timeout=1200)
        return steps / (t1 - t0), time.perf_counter() - t0, len(handles)

    plain, ckpt, drained, saves = [], [], [], 0
    for _ in range(repeats):  # interleaved
        plain.append(loop(False)[0])
        r = loop(True)
        ckpt.append(r[0])
        drained.append(r[1])
        saves = r[2]
    eng.shutdown()
    ray.kill(trainer)
    out = {"MB": mb, "plain": med(plain), "ckpt": med(ckpt), "drained_s": med(drained), "saves": saves,
           "steps": steps, "every": every, "step_ms": 1e3 / med(plain), **info}
    print(f"  throughput done ({info['reps']} matmuls of {info['mm_ms']:.1f} ms per step)", file=sys.stderr)
    return out


# ------------------------------------------------------------------------------- storage
def _bump(actor: Any) -> None:
    for v in actor.sd.values():
        v.add_(1.0)


def measure_storage(ref_mb: int, policy_mb: int, versions: int, root: str) -> Dict[str, Any]:
    ref = ss.Learner.remote(ref_mb)
    policy = ss.Learner.remote(policy_mb)
    ray.get([ref.ping.remote(), policy.ping.remote()])
    run = "suite_storage"
    run_dir = os.path.join(root, "ckpt", run)
    shutil.rmtree(run_dir, ignore_errors=True)  # this suite's own run: counted from empty
    eng = rc.CheckpointEngine.create(run, local_dir=os.path.join(root, "ckpt"))
    eng.register("reference", ref, strategy=rc.Strategy.RELOADABLE)
    eng.register("policy", policy)
    written, durable = [], []
    for i in range(versions):
        ray.get(policy.__ray_call__.remote(_bump))
        t = time.perf_counter()
        written.append(eng.save(i + 1).wait(timeout=1200).bytes_written)
        durable.append(time.perf_counter() - t)
    metas = eng.list_checkpoints()
    eng.shutdown()
    ray.kill(ref)
    ray.kill(policy)
    on_disk = bytes_under(run_dir)
    ref_files = [p for p in files_under(run_dir) if f"{os.sep}reference{os.sep}" in p]
    full = written[0]  # version 1 is a full version (files + manifest): what a naive save writes every time
    out = {"ref_mb": ref_mb, "policy_mb": policy_mb, "versions": versions, "written": written,
           "durable": durable, "on_disk": on_disk, "naive": versions * written[0], "full_version": full,
           "ref_files": len(ref_files), "committed": len(metas)}
    shutil.rmtree(run_dir, ignore_errors=True)
    print("  storage done", file=sys.stderr)
    return out


# ------------------------------------------------------------------------------- memory
def measure_memory(mb: int, saves: int, root: str) -> Dict[str, Any]:
    learner = ss.Learner.remote(mb)
    ray.get(learner.ping.remote())
    eng = rc.CheckpointEngine.create("suite_memory", local_dir=os.path.join(root, "ckpt"), keep_last=2)
    eng.register("state", learner)
    base = eng.current_step
    for i in range(2):  # warm-up: writers started and their first buffers allocated; not counted
        eng.save(base + i + 1).wait(timeout=600)
    w = ray.get(eng._coordinator.writers.remote(), timeout=60)
    writers = list(w["critical"]) + list(w["best_effort"])
    coord = [eng._coordinator]

    def snap():
        return {"store": object_store_used(), "writers": rss_of(writers), "coord": rss_of(coord)}

    before = snap()
    peak = {"store": 0.0, "in_flight": 0}
    done = threading.Event()

    def sample():  # while the saves run: object-store use and versions in flight, every 50 ms
        while not done.is_set():
            used = ray.cluster_resources().get("object_store_memory", 0) - \
                ray.available_resources().get("object_store_memory", 0)
            peak["store"] = max(peak["store"], used)
            peak["in_flight"] = max(peak["in_flight"], len(eng.status()["in_flight"]))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.perf_counter()
    handles = [eng.save(base + 3 + i) for i in range(saves)]  # on_busy="wait": at most 2 in flight
    for h in handles:
        h.wait(timeout=600)
    seconds = time.perf_counter() - t
    done.set()
    sampler.join(timeout=10)
    after = snap()
    eng.shutdown()
    ray.kill(learner)
    print("  memory done", file=sys.stderr)
    return {"MB": mb, "saves": saves, "before": before, "after": after, "seconds": seconds,
            "n_writers": len(writers), "peak": peak, "max_in_flight": eng.config.max_in_flight}


# ------------------------------------------------------------------------------- table
COLUMNS = ["section", "what", "MB", "ray_ckpt", "compared with", "their value", "ratio", "notes"]


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def build_rows(save_rows, restore_rows, thr, storage, memory, cache: Cache) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []

    def add(section, what, mb, ours, ref_name, ref, r=None, notes=""):
        rows.append({"section": section, "what": what, "MB": mb, "ray_ckpt": ours, "compared with": ref_name,
                     "their value": ref, "ratio": ratio(ours, ref) if r is None else r, "notes": notes})

    for s in save_rows:
        mb = s["MB"]
        add("save", "save() returns, ms", mb, s["save() ms"], "DCP async_save returns, ms", s["dcp stall ms"])
        add("save", "learner pause, ms", mb, s["pause ms"], "memcpy of the state, ms", s["memcpy ms"],
            notes="floor: one copy_ into a preallocated buffer")
        add("save", "time to durable, s", mb, s["durable s"], "dd conv=fsync write, s", s["dd s"],
            notes=f"{s['written MB']:.0f} MB written; SaveResult.stages: writer waited "
                  f"{s['snapshot wait s']:.3g} s for the snapshot, wrote + checksummed + fsynced in "
                  f"{s['write s']:.3g} s")
        add("save", "time to durable, s", mb, s["durable s"], "dd oflag=direct conv=fsync write, s", s["dd direct s"],
            notes="the disk without the page cache (tensors files from 128 MiB are written with O_DIRECT)")
        add("save", "time to durable, s", mb, s["durable s"], "torch.save + fsync (blocks), s", s["torch.save s"])
        add("save", "time to durable, s", mb, s["durable s"], "safetensors save_file + fsync, s",
            s["safetensors s"])
        add("save", "time to durable, s", mb, s["durable s"], "DCP async_save until done, s", s["dcp durable s"])
    cache_note = cache.label()
    for r in restore_rows:
        mb = r["MB"]
        tier = ",".join(r["tiers"])
        add("restore", "restore() into the actor, s", mb, r["ours"], "torch.load into the actor, s", r["torch"],
            notes=f"{cache_note}; tier {tier}; warm-cache restore() {r['warm']:.3g} s")
        add("restore", "restore() into the actor, s", mb, r["ours"], "safetensors load_file into the actor, s",
            r["st"], notes=cache_note)
        add("restore", "restore() into the actor, s", mb, r["ours"], "dd read of the file, s", r["dd"],
            notes=f"{cache_note}; disk read {r['file_mb'] / r['dd']:.0f} MB/s" if r["dd"] == r["dd"] else cache_note)
    for t in thr or []:
        add("throughput", f"steps/s, save every {t['every']} steps", t["MB"], t["ckpt"],
            "steps/s without checkpoints", t["plain"],
            notes=f"{t['steps']} steps of {t['step_ms']:.0f} ms ({t['reps']} x 1024^2 matmul, 1 thread); "
                  f"{t['saves']} saves, one per {t['every'] * t['step_ms'] / 1e3:.1f} s; all durable "
                  f"{t['drained_s']:.2f} s after the loop began")
    if storage:
        st = storage
        tag = f"ref {st['ref_mb']} + policy {st['policy_mb']}"
        add("storage", f"bytes on disk for {st['versions']} versions, MB", tag, st["on_disk"] / MiB,
            f"{st['versions']} full copies, MB", st["naive"] / MiB,
            notes=f"{st['ref_files']} reference file(s) on disk for {st['committed']} committed versions")
        later = st["written"][1:]
        add("storage", "bytes_written of version 1, MB", tag, st["written"][0] / MiB,
            "one full version, MB", st["full_version"] / MiB)
        if later:
            lo, hi = f"{min(later) / MiB:.3g}", f"{max(later) / MiB:.3g}"
            add("storage", f"bytes_written of versions 2-{st['versions']}, MB", tag, statistics.mean(later) / MiB,
                "one full version, MB", st["full_version"] / MiB,
                notes=f"each {lo}" + (f"-{hi}" if hi != lo else "") + " MB: the reference is not rewritten; "
                      f"save() to durable {med(st['durable'][1:]):.3g} s (version 1: {st['durable'][0]:.3g} s)")
    if memory:
        b, a = memory["before"], memory["after"]
        n, mb = memory["saves"], memory["MB"]
        pk = memory["peak"]
        add("memory", f"object store peak during {n} back-to-back saves, MB", mb, pk["store"] / MiB,
            "max_in_flight x state, MB", memory["max_in_flight"] * mb,
            notes=f"sampled every 50 ms (the raylet reports about once a second, so a short peak can be "
                  f"missed); most versions in flight seen: {pk['in_flight']} (on_busy='wait')")
        add("memory", f"object store used after {n} saves, MB", mb, a["store"] / MiB, "before, MB",
            b["store"] / MiB, r=NAN, notes=f"delta {(a['store'] - b['store']) / MiB:+.1f} MB")
        aw, bw = a["writers"], b["writers"]
        for key, what in (("VmRSS", "VmRSS"), ("RssAnon", "RssAnon (private)")):
            note = f"sum of {memory['n_writers']} writers; delta {(aw[key] - bw[key]) / MiB:+.1f} MB"
            if key == "VmRSS":
                note += (f", of which mapped object-store pages (RssShmem) "
                         f"{(aw['RssShmem'] - bw['RssShmem']) / MiB:+.1f} MB")
            add("memory", f"writers' {what} after {n} saves, MB", mb, aw[key] / MiB, "before, MB", bw[key] / MiB,
                notes=note)
        add("memory", f"coordinator VmRSS after {n} saves, MB", mb, a["coord"]["VmRSS"] / MiB, "before, MB",
            b["coord"]["VmRSS"] / MiB, notes=f"delta {(a['coord']['VmRSS'] - b['coord']['VmRSS']) / MiB:+.1f} MB")
    return rows


def render(rows: List[Dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = []
        for c in COLUMNS:
            v = r[c]
            cells.append((fmt(v) + "x") if c == "ratio" and isinstance(v, float) and v == v else fmt(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


LEGEND = """\
Columns: `section` — which benchmark; `what` — the quantity ray_ckpt is measured on, with its unit;
`MB` — the state size (storage: the reference and policy sizes); `ray_ckpt` — our value (median over
the repeats); `compared with` / `their value` — the baseline measured in the same run on the same disk;
`ratio` — ray_ckpt / their value (below 1x: ray_ckpt is faster or smaller, except for throughput
where it is steps/s with checkpoints / steps/s without, so 1x is no slow-down); `notes` — context.

- save: `save() returns` is how long `engine.save()` blocks the driver (vs how long DCP `async_save`
  blocks its caller); `learner pause` is how long the learner actor is busy with the snapshot (a no-op
  call queued behind it, half an idle round trip subtracted), vs one memcpy of the same bytes; `time
  to durable` is from `save()` until the version's files and manifest are fsynced and committed, vs
  `dd bs=64M conv=fsync` of the same bytes, `torch.save` + fsync, `safetensors` + fsync (both block
  the learner for that long) and DCP `async_save` until its future is done (single rank, gloo).
- restore: `engine.restore()` end to end (manifest, read, checksum verify, decode, staged load into
  the learner actor, apply), vs `torch.load(weights_only=True)` and `safetensors.torch.load_file` of
  files of the same state loaded into the same actor, and `dd if=<our file> of=/dev/null bs=64M`
  (the disk's read floor). The page cache is dropped before each when the machine allows it.
- throughput: a learner actor doing steps of single-threaded 1024x1024 float32 matmuls; the driver
  calls one step at a time and saves every k steps without waiting; steps/s up to the last step
  (the saves' writes overlap training; the time until every save is durable is in the notes).
- storage: a RELOADABLE frozen reference model plus a CRITICAL policy that changes every version;
  on-disk bytes of the run (all files, manifests included) vs 5 full copies; per-version
  `SaveResult.bytes_written`.
- memory: object store use (`cluster_resources - available_resources`, once the reported value
  settles) and the RSS of the writer actors and the coordinator (from `/proc/self/status` in each
  process via `__ray_call__`), after 2 warm-up saves and after N more saves of a 64 MB state
  (keep_last=2). VmRSS counts object-store pages a writer has mapped (RssShmem); RssAnon is the
  private memory a leak would grow.
"""


# ------------------------------------------------------------------------------- plots
def make_plots(plots_dir: str, save_rows, restore_rows, thr, storage) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  matplotlib is not installed (pip install -e '.[bench]'): no plots", file=sys.stderr)
        return []
    os.makedirs(plots_dir, exist_ok=True)
    made = []

    def finish(fig, ax, name, title, ylabel, log=True, legend=True):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        if legend:
            ax.legend(fontsize=8)
        fig.tight_layout()
        p = os.path.join(plots_dir, name)
        fig.savefig(p, dpi=120)
        plt.close(fig)
        made.append(p)

    def by_size(ax, rows, series, xs_key="MB"):
        xs = [r[xs_key] for r in rows]
        for key, label, style in series:
            ax.plot(xs, [r[key] for r in rows], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("state size, MB")

    if save_rows:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        by_size(ax, save_rows, [("save() ms", "ray_ckpt save() returns", "o-"),
                                ("pause ms", "ray_ckpt learner pause", "s-"),
                                ("memcpy ms", "memcpy of the state (floor)", "kx--"),
                                ("dcp stall ms", "DCP async_save returns", "^-")])
        finish(fig, ax, "save_stall.png", "Save stall and learner pause", "ms")
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        by_size(ax, save_rows, [("durable s", "ray_ckpt save() -> committed", "o-"),
                                ("dd s", "dd conv=fsync (disk floor)", "kx--"),
                                ("torch.save s", "torch.save + fsync", "s-"),
                                ("safetensors s", "safetensors + fsync", "v-"),
                                ("dcp durable s", "DCP async_save -> done", "^-")])
        finish(fig, ax, "time_to_durable.png", "Time to durable", "s")
    if restore_rows:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        by_size(ax, restore_rows, [("ours", "ray_ckpt restore() into the actor", "o-"),
                                   ("torch", "torch.load into the actor", "s-"),
                                   ("st", "safetensors load_file into the actor", "v-"),
                                   ("dd", "dd read (disk floor)", "kx--")])
        finish(fig, ax, "restore.png", "Restore", "s")
    if thr:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        labels, vals, colors = [], [], []
        for t in thr:
            labels += [f"no ckpt\n(run k={t['every']})", f"save every\n{t['every']} steps"]
            vals += [t["plain"], t["ckpt"]]
            colors += ["#888", "#1f77b4"]
        bars = ax.bar(labels, vals, color=colors)
        for b_, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}", (b_.get_x() + b_.get_width() / 2, v), ha="center", va="bottom")
        ax.set_ylim(0, max(vals) * 1.15)
        ax.set_xlabel(f"{thr[0]['MB']} MB state, {thr[0]['step_ms']:.0f} ms steps")
        finish(fig, ax, "throughput.png", "Training throughput: " + ", ".join(
            f"k={t['every']}: {ratio(t['ckpt'], t['plain']):.3f}" for t in thr), "steps/s", log=False,
            legend=False)
    if storage:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        n = storage["versions"]
        xs = list(range(1, n + 1))
        ax.bar([x - 0.2 for x in xs], [w / MiB for w in storage["written"]], width=0.4, label="ray_ckpt bytes_written")
        ax.bar([x + 0.2 for x in xs], [storage["full_version"] / MiB] * n, width=0.4, color="#888",
               label="a full copy")
        ax.set_xticks(xs)
        ax.set_xlabel("version")
        ax.set_ylim(0, storage["full_version"] / MiB * 1.35)
        finish(fig, ax, "storage.png",
               f"Bytes written per version (ref {storage['ref_mb']} MB RELOADABLE + policy {storage['policy_mb']} MB)",
               "MB", log=False)
    return made


# ------------------------------------------------------------------------------- main
def machine_info(root: str) -> str:
    import pyarrow
    import safetensors

    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / (1 << 20):.0f} GiB RAM"
    except OSError:
        pass
    try:
        fs = subprocess.run(["df", "-T", root], capture_output=True, text=True).stdout.splitlines()[-1].split()
        disk = f"{fs[0]} ({fs[1]})"
    except Exception:
        disk = "?"
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, {mem}, disk of --dir: {disk}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, ray {ray.__version__}, pyarrow "
            f"{pyarrow.__version__}, safetensors {safetensors.__version__}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,512,2048", help="state sizes in MB for save and restore")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per measurement (default 3; --quick: 1)")
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS_suite.md"), help="markdown file (overwritten)")
    ap.add_argument("--plots", default=os.path.join(HERE, "plots"), help="folder for the PNG plots")
    ap.add_argument("--ref-mb", type=int, default=None, help="frozen reference model, MB (default 1024; --quick: 64)")
    ap.add_argument("--policy-mb", type=int, default=None, help="changing policy, MB (default 16; --quick: 4)")
    ap.add_argument("--train-mb", type=int, default=None,
                    help="state of the throughput run, MB (default 512, or the smallest size if all are below 512)")
    ap.add_argument("--steps", type=int, default=None, help="throughput steps per run (default 60; --quick: 30)")
    ap.add_argument("--every", default="10,50",
                    help="checkpoint every k steps in the throughput run; a comma list runs each k")
    ap.add_argument("--mem-saves", type=int, default=20, help="saves of the memory run")
    ap.add_argument("--object-store-mb", type=int, default=None)
    ap.add_argument("--only", default="save,restore,throughput,storage,memory", help="sections to run")
    ap.add_argument("--quick", action="store_true", help="smaller defaults, for a smoke run")
    ap.add_argument("--write-threads", type=int, default=None,
                    help="EngineConfig.write_threads for the save and throughput sections (default: the engine's)")
    ap.add_argument("--plasma-dir", default=None,
                    help="Ray's object store directory (ray.init _plasma_directory), e.g. a tmpfs mounted with huge=always")
    ap.add_argument("--direct-io", choices=("on", "off"), default=None,
                    help="EngineConfig.direct_io for the save and throughput sections (default: the engine's)")
    ap.add_argument("--prefault", choices=("on", "off"), default=None,
                    help="EngineConfig.prefault_object_store for the save and throughput sections")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    repeats = args.repeats or (1 if args.quick else 3)
    ref_mb = args.ref_mb or (64 if args.quick else 1024)
    policy_mb = args.policy_mb or (4 if args.quick else 16)
    steps = args.steps or (30 if args.quick else 60)
    train_mb = args.train_mb or (512 if max(sizes) >= 512 else min(sizes))
    only = {s.strip() for s in args.only.split(",")}
    store_mb = args.object_store_mb or max(2048, 3 * max(sizes + [ref_mb + policy_mb, train_mb]))
    root = args.dir or tempfile.mkdtemp(prefix="ray_ckpt_suite_")
    os.makedirs(root, exist_ok=True)
    cmdline = "python benchmarks/suite.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = datetime.datetime.now()
    load0 = os.getloadavg()
    cache = Cache()
    print(f"page cache: {'can be dropped' if cache.cold else cache.error}", file=sys.stderr)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=store_mb * MiB,
             **({"_plasma_directory": args.plasma_dir} if args.plasma_dir else {}))
    save_rows, restore_rows, thr, storage, memory = [], [], None, None, None
    engine_options: Dict[str, Any] = {} if args.write_threads is None else {"write_threads": args.write_threads}
    if args.direct_io is not None:
        engine_options["direct_io"] = args.direct_io == "on"
    if args.prefault is not None:
        engine_options["prefault_object_store"] = args.prefault == "on"
    try:
        if "save" in only:
            for mb in sizes:
                save_rows.append(ss.measure_save(mb, repeats, root, **engine_options))
        if "restore" in only:
            for mb in sizes:
                restore_rows.append(measure_restore(mb, repeats, root, cache))
        if "throughput" in only:
            thr = [measure_throughput(train_mb, max(steps, 3 * k), k, repeats, root, **engine_options)
                   for k in sorted({int(x) for x in str(args.every).split(",") if x.strip()})]
        if "storage" in only:
            storage = measure_storage(ref_mb, policy_mb, 5, root)
        if "memory" in only:
            memory = measure_memory(64, args.mem_saves, root)
    finally:
        ray.shutdown()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    rows = build_rows(save_rows, restore_rows, thr, storage, memory, cache)
    table = render(rows)
    print(table)
    plots = make_plots(args.plots, save_rows, restore_rows, thr, storage)
    load1 = os.getloadavg()
    doc = [
        "# Benchmark suite results", "",
        f"Command: `{cmdline.strip()}`", "",
        f"Run {started:%Y-%m-%d %H:%M}, {(datetime.datetime.now() - started).total_seconds():.0f} s; "
        f"machine: {machine_info(args.dir or tempfile.gettempdir())}. Load average "
        f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end. Page cache for restores: {cache.label()}. "
        f"Repeats: {repeats} (medians).", "",
        table, "", LEGEND,
    ]
    if plots:
        doc += ["Plots:", ""] + [f"![{os.path.basename(p)}]({os.path.relpath(p, os.path.dirname(os.path.abspath(args.out)))})"
                                 for p in plots] + [""]
    with open(args.out, "w") as f:
        f.write("\n".join(doc))
    print(f"\nwrote {args.out}" + (f" and {len(plots)} plots under {args.plots}" if plots else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
