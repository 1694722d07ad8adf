"""Save stall, learner pause and time-to-durable of ray_ckpt, side by side with torch.save,
safetensors, torch DCP async_save and dd, in one run on one disk.

    python benchmarks/save_stall.py [--sizes 64,512,2048] [--dir /path/on/the/disk] [--repeats 3]

State: a model-like dict of float32 tensors (weights + two Adam moments) of the given total size.
Columns (medians over --repeats; every repeat measures each contender once, interleaved):
  save() ms        how long engine.save() takes to return to the driver
  pause ms         how long the learner actor is busy with the snapshot: a no-op call queued right
                   after the snapshot runs at this time after save() (half an idle actor-call round
                   trip subtracted), vs memcpy ms = one copy_ of the bytes into a preallocated buffer
  durable s        save() until the local version is committed (fsynced files + manifest)
  torch.save s     torch.save + fsync of the same state, in the learner's place (it blocks)
  safetensors s    safetensors.torch.save_file + fsync
  dcp stall / s    torch.distributed.checkpoint.async_save: call return, and until its future is done
  dd s             dd bs=64M conv=fsync of the same number of bytes (the disk's sequential write floor
                   through the page cache); dd direct s: the same with oflag=direct (bypassing it)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import ray
import torch

import ray_ckpt as rc


def make_state(mb: int) -> dict:
    n = mb * (1 << 20) // 4 // 3  # weights + exp_avg + exp_avg_sq
    per = max(1, n // 8)
    sd = {}
    for i in range(8):
        for kind in ("w", "m", "v"):
            sd[f"layer{i}.{kind}"] = torch.randn(per)
    return sd


def load_into(sd, state) -> None:
    """What a trainer's load_state_dict does: copy into the tensors it already has (so a restored
    state's buffers, e.g. a mapped file, are released once the call returns)."""
    if set(state) != set(sd):
        raise ValueError("restored state has other keys than the learner's")
    with torch.no_grad():
        for k, v in state.items():
            sd[k].copy_(v)


@ray.remote(num_cpus=0.5)
class Learner:
    def __init__(self, mb: int):
        torch.set_num_threads(1)
        self.sd = make_state(mb)

    def ckpt_get_state(self, name):
        return self.sd

    def ckpt_set_state(self, name, state):
        load_into(self.sd, state)

    def ping(self):
        return time.perf_counter()

    def memcpy_s(self) -> float:
        dst = {k: torch.empty_like(v) for k, v in self.sd.items()}
        for k, v in self.sd.items():  # first touch of the destination pages is not part of a copy
            dst[k].copy_(v)
        t = time.perf_counter()
        for k, v in self.sd.items():
            dst[k].copy_(v)
        return time.perf_counter() - t


def wait_prefault(actor, engine_options: dict) -> None:
    """With ``prefault_object_store``, register() starts mapping the store in the actor in the
    background; a benchmark waits for it to end (a one-time cost, reported, not timed as a save)."""
    if not engine_options.get("prefault_object_store"):
        return
    from ray_ckpt.capture.object_store import prefault_in_actor

    st = ray.get(actor.__ray_call__.remote(prefault_in_actor, 600))
    print(f"  object store mapped in the learner: {st['bytes_done'] >> 20} of {st['total_bytes'] >> 20} MiB, "
          f"{st['seconds']:.1f} s{'; ' + st['error'] if st['error'] else ''}", file=sys.stderr)


def _rtt(learner) -> float:
    t = time.perf_counter()
    ray.get(learner.ping.remote())
    return time.perf_counter() - t


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def bench_torch_save(sd, d) -> float:
    p = os.path.join(d, "torch.pt")
    t = time.perf_counter()
    torch.save(sd, p)
    fsync_path(p)
    dt = time.perf_counter() - t
    os.remove(p)
    return dt


def bench_safetensors(sd, d) -> float:
    from safetensors.torch import save_file

    p = os.path.join(d, "st.safetensors")
    t = time.perf_counter()
    save_file(sd, p)
    fsync_path(p)
    dt = time.perf_counter() - t
    os.remove(p)
    return dt


def bench_dd(nbytes: int, d, oflag=None) -> float:
    """dd bs=64M conv=fsync of ``nbytes`` (``oflag="direct"``: bypassing the page cache)."""
    p = os.path.join(d, "dd.bin")
    count = max(1, nbytes // (64 << 20))
    extra = [f"oflag={oflag}"] if oflag else []
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={p}", "bs=64M", f"count={count}", "conv=fsync", *extra],
                   check=True, capture_output=True)
    dt = (time.perf_counter() - t) * nbytes / (count * (64 << 20))
    os.remove(p)
    return dt


_pg_ready = False


def bench_dcp(sd, d):
    """torch DCP async_save, single rank on gloo. Returns (stall s, time to durable s) or None."""
    global _pg_ready
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if not _pg_ready:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("gloo", rank=0, world_size=1)
            _pg_ready = True
        p = os.path.join(d, f"dcp{time.time_ns()}")
        t = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=p)
        stall = time.perf_counter() - t
        fut.result()
        durable = time.perf_counter() - t  # DCP's FileSystemWriter fsyncs its files by default
        shutil.rmtree(p, ignore_errors=True)
        return stall, durable
    except Exception as exc:  # report, don't hide
        print(f"  (dcp async_save unavailable: {exc})", file=sys.stderr)
        return None


def measure_save(mb: int, repeats: int, root: str, **engine_options) -> dict:
    """One row of the table for a state of ``mb`` MB: medians over ``repeats`` interleaved repeats.

    Needs a running Ray instance; creates (and shuts down) its own learner actor and engine (run
    ``bench<mb>`` under ``<root>/ckpt``, keep_last=1). The keys are the table's columns."""
    learner = Learner.remote(mb)
    ray.get(learner.ping.remote())
    eng = rc.CheckpointEngine.create(f"bench{mb}", local_dir=os.path.join(root, "ckpt"), keep_last=1,
                                     **engine_options)
    eng.register("state", learner)
    wait_prefault(learner, engine_options)
    base = eng.current_step  # > 0 when --dir holds versions of an earlier run: steps must increase
    eng.save(base + 1).wait(timeout=600)  # warm-up: writers started, pages touched; not counted
    rtt = statistics.median(_rtt(learner) for _ in range(5))
    sd = make_state(mb)
    nbytes = sum(v.nbytes for v in sd.values())
    m = {k: [] for k in ("stall", "pause", "durable", "torch", "st", "dcp_stall", "dcp_dur", "dd", "dd_direct",
                         "wait_s", "write_s")}
    written = 0
    # interleaved: every repeat measures each contender once, so a slow spell of the disk hits all
    # of them; and the order rotates from repeat to repeat, because this VM's disk writes at a
    # fraction of its speed for seconds after a burst (a 2 GB save took 6 s right after 6 GB of
    # other writes, 1.2-1.3 s otherwise): whoever runs right after the others' writes pays for them
    def ours(i):
        t0 = time.perf_counter()
        h = eng.save(base + i + 2)
        t1 = time.perf_counter()
        after = ray.get(learner.ping.remote())
        res = h.wait(timeout=600)
        t2 = time.perf_counter()
        m["wait_s"].append(res.stages.get("snapshot_wait_s", float("nan")))
        m["write_s"].append(res.stages.get("write_s", float("nan")))
        m["stall"].append((t1 - t0) * 1e3)
        m["pause"].append(max(0.0, after - t0 - rtt / 2) * 1e3)
        m["durable"].append(t2 - t0)
        return res.bytes_written

    def dcp(i):
        r = bench_dcp(sd, root)
        if r:
            m["dcp_stall"].append(r[0] * 1e3)
            m["dcp_dur"].append(r[1])

    contenders = [ours, lambda i: m["torch"].append(bench_torch_save(sd, root)),
                  lambda i: m["st"].append(bench_safetensors(sd, root)), dcp,
                  lambda i: m["dd"].append(bench_dd(nbytes, root)),
                  lambda i: m["dd_direct"].append(bench_dd(nbytes, root, oflag="direct"))]
    for i in range(repeats):
        k = i % len(contenders)
        for run in contenders[k:] + contenders[:k]:
            out = run(i)
            if run is ours:
                written = out
    memcpy = statistics.median(ray.get(learner.memcpy_s.remote()) for _ in range(3)) * 1e3
    eng.shutdown()
    ray.kill(learner)
    sd = None  # free the driver copy before the next size
    med = {k: (statistics.median(v) if v else float("nan")) for k, v in m.items()}
    print(f"  {mb} MB done (actor call round trip {rtt * 1e3:.1f} ms, half of it subtracted from "
          f"the pause)", file=sys.stderr)
    return {
        "MB": mb, "save() ms": med["stall"], "pause ms": med["pause"], "memcpy ms": memcpy,
        "pause/memcpy": med["pause"] / memcpy, "durable s": med["durable"],
        "torch.save s": med["torch"], "safetensors s": med["st"],
        "dcp stall ms": med["dcp_stall"], "dcp durable s": med["dcp_dur"], "dd s": med["dd"],
        "dd direct s": med["dd_direct"], "durable/dd": med["durable"] / med["dd"], "torch.save/durable": med["torch"] / med["durable"],
        "written MB": written / (1 << 20),
        "snapshot wait s": med["wait_s"], "write s": med["write_s"],  # SaveResult.stages
    }


def format_table(rows: list) -> str:
    cols = list(rows[0].keys())
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        table.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,512,2048", help="state sizes in MB")
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    args = ap.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="ray_ckpt_bench_")
    os.makedirs(root, exist_ok=True)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=6 << 30)
    rows = []
    try:
        for mb in [int(x) for x in args.sizes.split(",")]:
            rows.append(measure_save(mb, args.repeats, root))
    finally:
        ray.shutdown()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    text = format_table(rows)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
