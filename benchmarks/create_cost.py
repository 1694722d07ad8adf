"""Where a ``CheckpointEngine.create()`` (and its ``shutdown()``) goes, phase by phase.

The test suite creates an engine ~140 times; each create starts Python worker processes (the
coordinator, then its writers) on a 2-core machine. This script times, for N fresh runs on the
same Ray cluster as the tests use (``num_cpus=4``, local), the phases of create() as its code runs
them, plus what happens inside the coordinator's process (from ``init_times``, and its process's
start time from /proc), and prints a table of medians. Run::

    .venv/bin/python benchmarks/create_cost.py --runs 8 [--no-prestart] [--plain]

Phases (seconds, wall clock, from the driver unless said):
  config+tiers   EngineConfig and the writable checks of the tiers
  owner          reading, claiming and writing the owner record
  (then, unless --no-prestart, run_lifetime.prestart_writer_processes: no-op tasks, not awaited)
  coord_proc     actor submitted -> the coordinator's worker process exists (/proc start time)
  coord_imports  its process exists -> its __init__ starts (Python, Ray worker, ray_ckpt imports)
  coord_pools    __init__: WriterPools (submits the writer actors; does not wait for them)
  coord_recover  __init__: scanning the tiers (recovery.py)
  coord_up       actor submitted -> config() answered (the coordinator is up)
  writers_up     config() answered -> ready() answered (every writer started)
  writer_procs   writers asked for (coordinator __init__) -> the last writer's process exists
                 (_min: the first's; negative: an idle worker process Ray had already started)
  cpu_*          CPU seconds used by then: the coordinator's process, the writers' (sum), raylet and
                 GCS server, this driver (2 cores: ~2 CPU-s per wall second at most)
  first_calls    engine construction (last_version) + set_owner + the owner lease
  create         total of create() as measured around the phases above
  shutdown       engine.shutdown() (quiesce, kill, wait until gone)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import ray

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import ray_ckpt as rc  # noqa: E402
from ray_ckpt.client import run_lifetime  # noqa: E402
from ray_ckpt.config import EngineConfig  # noqa: E402
from ray_ckpt.client.coordinator_client import ask_coordinator  # noqa: E402
from ray_ckpt.coordinator.lease import OwnerLease, ray_identity, read_owner, write_owner  # noqa: E402
from ray_ckpt.ray_internals import job_alive  # noqa: E402
from ray_ckpt.storage.ownership import claim  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")
with open("/proc/uptime") as f:  # not /proc/stat's btime: whole seconds, up to 1 s early
    _BOOT = time.time() - float(f.read().split()[0])


def _pid_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _ray_daemons() -> list:
    """PIDs of this machine's raylet and GCS server (their CPU is part of every actor start)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as f:
                    if f.read().strip() in ("raylet", "gcs_server"):
                        out.append(int(d))
            except OSError:
                pass
    return out


def _actor_cpu(actor) -> float:
    def probe(self):
        import os as _os
        with open(f"/proc/{_os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _os.sysconf("SC_CLK_TCK")
    return ray.get(actor.__ray_call__.remote(probe), timeout=60)


def _proc_started(actor) -> float:
    """Wall-clock start of the actor's process (from /proc; 10 ms resolution) and its init_times."""
    def probe(self):
        import os as _os
        with open(f"/proc/{_os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return ticks, getattr(self, "init_times", {})
    ticks, times = ray.get(actor.__ray_call__.remote(probe), timeout=60)
    return _BOOT + ticks / _TICK, times


PRESTART = True


def one_create(root: str, i: int) -> dict:
    run = f"create-cost-{os.getpid()}-{i}"
    ph: dict = {}
    daemons = _ray_daemons()
    cpu0 = sum(_pid_cpu(p) for p in daemons), time.process_time()
    t0 = time.time()
    config = EngineConfig(run=run, local_dir=root)
    config.local_tier().check_writable()
    t1 = time.time()
    ph["config+tiers"] = t1 - t0
    tiers = [config.local_tier()]
    cluster, job = ray_identity()
    record = claim(read_owner(tiers), cluster, job, takeover=False, run=run, lease_s=60.0, job_alive=job_alive)
    write_owner(tiers, record)
    t2 = time.time()
    ph["owner"] = t2 - t1
    if PRESTART:
        run_lifetime.prestart_writer_processes(config)
    coord = run_lifetime.open_coordinator.__globals__["_start_coordinator"](config)
    existing = ray.get(coord.config.remote(), timeout=120)
    t3 = time.time()
    ray.get(coord.ready.remote(), timeout=120)
    t4 = time.time()
    proc, it = _proc_started(coord)
    ph["coord_proc"] = proc - t2
    ph["coord_imports"] = it["init"] - proc
    ph["coord_pools"] = it["pools"] - it["init"]
    ph["coord_recover"] = it["recovered"] - it["pools"]
    ph["coord_up"] = t3 - t2
    ph["writers_up"] = t4 - t3
    writers = ray.get(coord.writers.remote(), timeout=60)
    starts = [_proc_started(w)[0] for w in writers["critical"] + writers["best_effort"]]
    ph["writer_procs"] = max(starts) - it["pools"]  # the last writer's process exists, after they were asked for
    ph["writer_procs_min"] = min(starts) - it["pools"]
    ph["cpu_coordinator"] = _actor_cpu(coord)
    ph["cpu_writers"] = sum(_actor_cpu(w) for w in writers["critical"] + writers["best_effort"])
    ph["cpu_raylet+gcs"] = sum(_pid_cpu(p) for p in daemons) - cpu0[0]
    ph["cpu_driver"] = time.process_time() - cpu0[1]
    engine = rc.CheckpointEngine(coord, existing)
    engine._owner, engine._token = True, record.token
    ask_coordinator(run, coord.set_owner.remote(record.token), "the owner token")
    engine._lease = OwnerLease(tiers, record, run)
    t5 = time.time()
    ph["first_calls"] = t5 - t4
    ph["create"] = t5 - t0
    engine.shutdown()
    ph["shutdown"] = time.time() - t5
    return ph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--no-prestart", action="store_true",
                    help="without run_lifetime.prestart_writer_processes (create() as it was before it)")
    ap.add_argument("--plain", action="store_true", help="time rc.CheckpointEngine.create() itself too")
    args = ap.parse_args()
    global PRESTART
    PRESTART = not args.no_prestart
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as root:
        one_create(root, -1)  # warm-up: the first create also pays for this driver's imports
        rows = [one_create(root, i) for i in range(args.runs)]
        plain = []
        for i in range(args.runs if args.plain else 0):
            t0 = time.time()
            eng = rc.CheckpointEngine.create(f"create-plain-{os.getpid()}-{i}", local_dir=root)
            t1 = time.time()
            eng.shutdown()
            plain.append((t1 - t0, time.time() - t1))
    print(f"create() phases, {args.runs} runs after 1 warm-up (median / min / max, s); load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| phase | median | min | max |\n|---|---|---|---|")
    for k in rows[0]:
        vals = [r[k] for r in rows]
        print(f"| {k} | {statistics.median(vals):.3f} | {min(vals):.3f} | {max(vals):.3f} |")
    if plain:
        for j, name in enumerate(("rc.CheckpointEngine.create()", "shutdown()")):
            vals = [p[j] for p in plain]
            print(f"| {name} | {statistics.median(vals):.3f} | {min(vals):.3f} | {max(vals):.3f} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
