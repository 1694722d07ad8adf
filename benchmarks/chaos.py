"""Chaos run: a real RL training loop checkpointed by ray_ckpt while a seeded fault injector breaks things.

The demo's learner (torch MLP, Adam, its RNG streams through ``rc.rng_state()``, an observation
normaliser, an Arrow replay buffer registered BEST_EFFORT) trains CartPole from two rollout actors;
the local tier is a small tmpfs (mounted here when this process may mount; otherwise a temporary
directory, and the disk-full fault is left out), the remote tier a real S3 server (SeaweedFS, from
``tests/s3server.py``). For ``--minutes`` the loop trains and saves without waiting while, every
``--fault-gap`` seconds, one fault is injected, the kind drawn from a seeded shuffle of:

  learner      ray.kill the learner (Ray restarts it); the loop restores the latest committed version
  rollout      ray.kill a rollout actor (Ray restarts it); the loop restores likewise
  writer       ray.kill a critical writer right after a save was issued
  coordinator  ray.kill the coordinator (no_restart=False: Ray recreates it) right after a save
  s3           stop the S3 server, train on for a few seconds, start it again
  disk_full    fill the local tmpfs with one file, train on for a few seconds, remove it
  corrupt      flip one byte of a ``.safetensors`` file of a listed version on one tier (local file,
               or the S3 object rewritten through pyarrow's S3 filesystem)

Every save records, on the driver, the SHA-256 of every state it captured: each provider actor is
asked for the digest of its states right after the save call (actor calls run in order: train,
snapshot, digest, next train). A save is *acknowledged* when ``handle.result()`` returns.

After every fault (once the run saved again) and at the end the run checks:
  * every acknowledged version is still listed (retention keeps everything in this run);
  * every listed version loads (``engine.load`` of each of its stored states) bit-exact to the
    digest recorded when it was saved; a state whose every copy was corrupted by the injector may
    fail to load, loudly: counted apart, as "lost to corruption on every tier"; a corrupted local
    copy must come back from the remote tier (checked with the tier the read used). After a fault
    this covers every version not verified before, every version whose tiers changed, every
    corrupted one and a seeded sample of ``--check-sample`` verified ones (loading all of them after
    every fault would take most of a long run); at the end, every listed version;
  * the run saved again (an acknowledged save issued after the fault cleared) within
    ``--recover-bound`` seconds: the time it took is the fault's time to recover;
  * every restore after a preemption brings back exactly the recorded digests.
At the end, every version listed on the remote tier is also read from the remote tier alone.

It prints a table and exits 1 if a must-be-zero row is not zero.

    python benchmarks/chaos.py --minutes 10 --seed 1 [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import ray
import torch

import ray_ckpt as rc
from ray_ckpt.cli.demo_run import Learner, RolloutWorker

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

LEARNER_STATES = ("policy", "optimizer", "rng", "obs_norm", "replay")
BEST_EFFORT = {"replay"}
ROLLOUTS = 2  # rollout actors by default (--rollouts)
KINDS = ("learner", "rollout", "writer", "coordinator", "s3", "disk_full", "corrupt")

if __name__ != "__main__":  # imported (tests): Ray workers cannot import this file, ship its functions by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ----------------------------------------------------------------------------- digests
def _feed(h: "hashlib._Hash", obj: Any) -> None:
    """A canonical digest of a state: structure, container and leaf types, dtypes, shapes, bytes."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(b"T" + str(t.dtype).encode() + repr(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        h.update(b"A" + obj.dtype.str.encode() + repr(obj.shape).encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, np.generic):
        h.update(b"S" + obj.dtype.str.encode() + obj.tobytes())
    elif isinstance(obj, (pa.Table, pa.RecordBatch)):
        h.update(b"P" + str(obj.schema.remove_metadata()).encode() + str(obj.num_rows).encode())
        for col in obj.columns:
            _feed_arrow(h, col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
    elif isinstance(obj, dict):
        h.update(b"D%d" % len(obj))
        for k in sorted(obj, key=lambda k: (type(k).__name__, repr(k))):
            _feed(h, k)
            _feed(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update((b"L" if isinstance(obj, list) else b"U") + b"%d" % len(obj))
        for x in obj:
            _feed(h, x)
    elif isinstance(obj, float):
        h.update(b"F" + struct.pack("<d", obj))
    elif obj is None or isinstance(obj, (bool, int, str, bytes)):
        h.update(b"Y" + type(obj).__name__.encode() + b":" + repr(obj).encode())
    elif isinstance(obj, torch.dtype):
        h.update(b"DT" + str(obj).encode())
    else:
        raise TypeError(f"chaos digest: unsupported leaf {type(obj).__name__}")


def _feed_arrow(h, arr: pa.Array) -> None:
    h.update(b"C" + str(arr.type).encode() + b"%d/%d" % (len(arr), arr.null_count))
    if pa.types.is_fixed_size_list(arr.type):
        _feed_arrow(h, arr.flatten())
    elif arr.null_count == 0 and (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)
                                  or pa.types.is_boolean(arr.type)):
        h.update(np.ascontiguousarray(arr.to_numpy(zero_copy_only=False)).tobytes())
    else:
        h.update(repr(arr.to_pylist()).encode())


def digest(obj: Any) -> str:
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _actor_digests(actor, names):
    """Runs inside a provider actor (``__ray_call__``): the digest of each of its states, now."""
    return {n: digest(actor.ckpt_get_state(n)) for n in names}


# ----------------------------------------------------------------------------- helpers
class Mount:
    """A small tmpfs for the local tier (so it can be filled), or a plain directory where this
    process may not mount one."""

    def __init__(self, base: str, mb: int):
        self.path = os.path.join(base, "localdisk")
        os.makedirs(self.path)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", self.path],
                           capture_output=True, text=True)
        self.tmpfs = r.returncode == 0
        self.note = "" if self.tmpfs else f"cannot mount a tmpfs ({(r.stderr or '').strip() or r.returncode})"

    def fill(self, path: str, limit_bytes: int = 8 << 30) -> int:
        """Write ``path`` until the filesystem is full (ENOSPC); returns the bytes written."""
        chunk = b"\0" * (1 << 20)
        n = 0
        with open(path, "wb", buffering=0) as f:
            while n < limit_bytes:
                try:
                    n += f.write(chunk)
                except OSError:
                    break
        # fill the last partial MiB too
        with open(path + ".tail", "wb", buffering=0) as f:
            for _ in range(256):
                try:
                    f.write(b"\0" * 4096)
                except OSError:
                    break
        return n

    def close(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", "-l", self.path], capture_output=True)


def wait_restarted(actor, old_pid: int, timeout: float) -> float:
    """Wait (bounded) until ``actor`` answers from a new process; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if ray.get(actor.pid.remote(), timeout=10) != old_pid:
                return time.monotonic() - t0
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"actor not restarted within {timeout}s")


def _table(rows: List[Tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    v = max(len(x) for _, x in rows)
    line = "+-" + "-" * w + "-+-" + "-" * v + "-+"
    return "\n".join([line] + [f"| {k:<{w}} | {x:>{v}} |" for k, x in rows] + [line])


# ----------------------------------------------------------------------------- the run
class Chaos:
    def __init__(self, args, srv, base: str, log=print):
        self.args = args
        self.srv = srv
        self.log = log
        self.rng = random.Random(args.seed)
        self.run = f"chaos-{args.seed}-{uuid.uuid4().hex[:6]}"
        self.mount = Mount(base, args.tmpfs_mb)
        self.local_dir = self.mount.path
        self.kinds = [k for k in args.kinds if k != "disk_full" or self.mount.tmpfs]
        self.notes: List[str] = []
        if "disk_full" in args.kinds and not self.mount.tmpfs:
            self.notes.append(f"disk_full faults skipped: {self.mount.note}")
        # bookkeeping
        self.digests: Dict[int, Dict[str, str]] = {}      # version -> state -> sha256 when captured
        self.acked: Dict[int, float] = {}                  # version -> time acknowledged
        self.pending: List[Tuple[int, Any, float]] = []    # (version, handle, issued at)
        self.corrupted: Dict[Tuple[int, str], set] = collections.defaultdict(set)  # (v, state) -> tiers
        self.faults = collections.Counter()
        self.failed_saves = collections.Counter()          # reason -> count
        self.unexplained: List[str] = []                   # save failures with no fault around them
        self.skipped_saves = 0
        self.hung: List[str] = []
        self.lost: Dict[Tuple[int, str], str] = {}         # must be 0
        self.missing_versions: Dict[int, str] = {}         # acknowledged, listed on no tier: must be 0
        self.wrong: Dict[Tuple[int, str], str] = {}        # must be 0
        self.lost_corrupt: Dict[Tuple[int, str], str] = {} # every copy corrupted by us, refused loudly
        self.remote_wrong: Dict[Tuple[int, str], str] = {}
        self.be_not_remote: set = set()  # (version, best-effort state) in the local copy, not yet in the remote one
        self.restore_failures: List[str] = []
        self.not_recovered: List[str] = []
        self.recover: Dict[str, List[float]] = collections.defaultdict(list)
        self.remote_resume: List[float] = []
        self.served_remote = 0                             # corrupted local copies read from remote
        self.restores: List[Tuple[str, int, float, str]] = []
        self.be_missing = 0
        self.checks = 0
        self.verified: Dict[int, Tuple[str, ...]] = {}     # version -> its tiers when it last checked out
        self.versions_checked = 0
        self.transient: List[str] = []                     # failed to load at one check, loaded at a later one
        self.check_seconds = 0.0
        self.loads = 0
        self.last_fault_t = -1e9
        self.events: List[str] = []

    # ------------------------------------------------------------------ setup / teardown
    def start(self) -> None:
        a = self.args
        self.learner = Learner.options(max_restarts=-1, max_task_retries=0).remote(a.seed)
        self.workers = [RolloutWorker.options(max_restarts=-1, max_task_retries=0).remote(a.seed * 100 + i)
                        for i in range(a.rollouts)]
        self.eng = rc.CheckpointEngine.create(
            self.run, local_dir=self.local_dir, remote_uri=self.srv.uri("chaos"), remote_options=self.srv.options,
            keep_last=None, remote_every=1, max_in_flight=2, startup_timeout=120)
        for name in LEARNER_STATES:
            self.eng.register(name, self.learner,
                              strategy=rc.Strategy.BEST_EFFORT if name in BEST_EFFORT else rc.Strategy.CRITICAL)
        for i, w in enumerate(self.workers):
            self.eng.register(f"rollout{i}", w, strategy=rc.Strategy.CRITICAL)
        self.s3fs = self.srv.filesystem()
        self.remote_prefix = f"{self.srv.bucket}/chaos/{self.run}"

    def close(self) -> None:
        if not self.srv.running():
            try:
                self.srv.start()
            except Exception as exc:
                self.log(f"could not restart the S3 server at the end: {exc}")
        for p in (os.path.join(self.local_dir, "fill"), os.path.join(self.local_dir, "fill.tail")):
            if os.path.exists(p):
                os.unlink(p)
        try:
            self.eng.shutdown(timeout=60)
        except Exception as exc:
            self.log(f"engine shutdown: {exc}")
        for actor in [self.learner] + self.workers:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.mount.close()

    # ------------------------------------------------------------------ training and saving
    def train_step(self) -> None:
        weights = self.learner.weights.remote()
        batches = [w.sample.remote(weights) for w in self.workers]
        ray.get(self.learner.train.remote(batches), timeout=120)

    def provider_digests(self) -> Dict[str, str]:
        refs = [self.learner.__ray_call__.remote(_actor_digests, LEARNER_STATES)]
        refs += [w.__ray_call__.remote(_actor_digests, ["rollout"]) for w in self.workers]
        got = ray.get(refs, timeout=120)
        out = dict(got[0])
        for i, d in enumerate(got[1:]):
            out[f"rollout{i}"] = d["rollout"]
        return out

    def save(self, step: int) -> Optional[Any]:
        h = self.eng.save(step, on_busy="skip")
        # the snapshot calls were queued on each provider before this: the digests are of the saved state
        dig = self.provider_digests()
        if h.skipped:
            self.skipped_saves += 1
            return None
        self.digests[step] = dig
        self.pending.append((step, h, time.monotonic()))
        return h

    def reap(self, block_s: float = 0.0) -> None:
        """Collect finished saves (waiting at most ``block_s`` for all of them)."""
        deadline = time.monotonic() + block_s
        while True:
            keep = []
            for v, h, t in self.pending:
                if h.done():
                    self._settle(v, h)
                elif time.monotonic() - t > self.args.save_timeout:
                    self.hung.append(f"version {v}: no outcome {self.args.save_timeout:.0f}s after save()")
                    self.events.append(f"HUNG save {v}")
                else:
                    keep.append((v, h, t))
            self.pending = keep
            if not self.pending or time.monotonic() >= deadline:
                return
            ray.wait([h._ref for _, h, _ in self.pending], num_returns=1,
                     timeout=min(1.0, max(0.01, deadline - time.monotonic())))

    def _settle(self, v: int, h: Any) -> None:
        try:
            h.result(timeout=30)
            self.acked[v] = time.monotonic()
        except rc.CheckpointError as exc:
            msg = str(exc).splitlines()[0]
            reason = ("disk full" if "No space" in msg or "ENOSPC" in msg or "disk full" in msg.lower()
                      else "coordinator died" if "coordinator" in msg and "died" in msg
                      else "writer died" if "writer" in msg.lower() and ("died" in msg or "kill" in msg.lower())
                      else "other")
            self.failed_saves[reason] += 1
            if time.monotonic() - self.last_fault_t > self.args.fault_window:
                self.unexplained.append(f"version {v}: {msg[:300]}")
            self.events.append(f"save {v} failed ({reason}): {msg[:200]}")
        except Exception as exc:  # not one of ours: a bug worth reporting
            self.failed_saves["non-CheckpointError " + type(exc).__name__] += 1
            self.unexplained.append(f"version {v}: {type(exc).__name__}: {str(exc)[:300]}")

    # ------------------------------------------------------------------ restores after a preemption
    def restore_after_preemption(self, kind: str) -> None:
        self.reap(block_s=60)  # saves in flight end first (bounded): restore what committed
        t0 = time.monotonic()
        try:
            rep = self.eng.restore(fallback=True)
        except Exception as exc:
            self.restore_failures.append(f"after {kind}: {type(exc).__name__}: {str(exc)[:300]}")
            self.events.append(f"RESTORE FAILED after {kind}: {exc}")
            return
        secs = time.monotonic() - t0
        tiers = sorted({str(getattr(r.tier, "value", r.tier)) for r in rep.states.values() if r.tier})
        self.restores.append((kind, rep.version, secs, ",".join(tiers)))
        want = self.digests.get(rep.version)
        got = self.provider_digests()
        for name, r in rep.states.items():
            if r.status != "restored":
                if name not in BEST_EFFORT:
                    self.restore_failures.append(f"after {kind}: {name} of v{rep.version} {r.status}: {r.detail}")
                continue
            if want is None or got.get(name) != want.get(name):
                self.wrong[(rep.version, name)] = f"restore() after {kind} brought back other bytes"
        self.events.append(f"restored v{rep.version} after {kind} in {secs:.2f}s from {tiers}")

    # ------------------------------------------------------------------ faults
    def next_kind(self) -> str:
        if not getattr(self, "_bag", None):
            self._bag = list(self.kinds)
            self.rng.shuffle(self._bag)
        return self._bag.pop()

    def inject(self, kind: str, step: int) -> Tuple[float, Optional[Any]]:
        """Inject one fault; returns (when it cleared, an action to run when it should end)."""
        self.faults[kind] += 1
        now = time.monotonic()
        self.last_fault_t = now
        self.events.append(f"[{now - self.t_start:7.1f}s] fault {kind} at step {step}")
        if kind in ("learner", "rollout"):
            actor = self.learner if kind == "learner" else self.rng.choice(self.workers)
            pid = ray.get(actor.pid.remote(), timeout=30)
            ray.kill(actor, no_restart=False)
            wait_restarted(actor, pid, 120)
            self.restore_after_preemption(kind)
            return now, None
        if kind in ("writer", "coordinator"):
            self.save(step)  # a save in flight when it dies
            time.sleep(self.rng.uniform(0.0, 0.05))
            if kind == "writer":
                writers = ray.get(self.eng._coordinator.writers.remote(), timeout=60)["critical"]
                ray.kill(self.rng.choice(writers), no_restart=False)
            else:
                ray.kill(self.eng._coordinator, no_restart=False)
            return time.monotonic(), None
        if kind == "s3":
            self.srv.stop()
            until = time.monotonic() + self.rng.uniform(*self.args.outage_s)

            def end():
                self.srv.start()
                self.events.append("s3 server started again")
            return now, (until, end)  # local saves must go on during the outage: recovery counts from the stop
        if kind == "disk_full":
            fill = os.path.join(self.local_dir, "fill")
            n = self.mount.fill(fill)
            self.events.append(f"filled the local disk with {n / 1e6:.1f} MB")
            until = time.monotonic() + self.rng.uniform(*self.args.outage_s)

            def end():
                os.unlink(fill)
                if os.path.exists(fill + ".tail"):
                    os.unlink(fill + ".tail")
                self.events.append("local disk freed")
            return None, (until, end)
        if kind == "corrupt":
            if not self.corrupt_one():  # nothing listed yet: not counted, drawn again later
                self.faults[kind] -= 1
                self._bag.insert(0, kind)
            return now, None
        raise ValueError(kind)

    def corrupt_one(self) -> bool:
        metas = [m for m in self.eng.list_checkpoints() if m.version in self.digests]
        if not metas:
            self.events.append("corrupt: no listed version yet")
            return False
        m = self.rng.choice(metas)
        tier = self.rng.choice(sorted(m.tiers))
        man = self.eng._manifest(version=m.version)
        names = sorted(n for n, e in man.states.items() if e.status == "stored"
                       and any(f.path.endswith(".safetensors") for f in e.files.get("0", [])))
        name = self.rng.choice(names)
        f = next(f for f in man.states[name].files["0"] if f.path.endswith(".safetensors"))
        off = self.rng.randrange(f.size // 2, f.size)
        if tier == "local":
            path = os.path.join(self.local_dir, self.run, f.path)
            with open(path, "r+b") as fh:
                fh.seek(off)
                b = fh.read(1)
                fh.seek(off)
                fh.write(bytes([b[0] ^ 0xFF]))
        else:
            key = f"{self.remote_prefix}/{f.path}"
            with self.s3fs.open_input_stream(key) as src:
                data = bytearray(src.read())
            data[off] ^= 0xFF
            with self.s3fs.open_output_stream(key) as out:
                out.write(bytes(data))
        self.corrupted[(m.version, name)].add(tier)
        self.events.append(f"corrupted {f.path} on the {tier} tier (byte {off} of {f.size})")
        return True

    # ------------------------------------------------------------------ checks
    def check(self, final: bool = False) -> None:
        t0 = time.monotonic()
        self.checks += 1
        listed = {m.version: m for m in self.eng.list_checkpoints()}
        for v in self.acked:
            if v not in listed:
                self.missing_versions[v] = "acknowledged, listed on no tier"
        if final:
            todo = sorted(listed)
        else:  # new or changed versions, every corrupted one, and a seeded sample of the others
            hit = {v for v, _ in self.corrupted}
            todo = [v for v in sorted(listed) if v in hit or self.verified.get(v) != listed[v].tiers]
            rest = sorted(set(listed) - set(todo))
            todo += self.rng.sample(rest, min(len(rest), self.args.check_sample))
        for v in todo:
            meta = listed[v]
            want = self.digests.get(v)
            self.versions_checked += 1
            ok = True
            if want is None:
                self.lost[(v, "*")] = "listed, but no save of this run made it"
                continue
            try:
                man = self.eng._manifest(version=v)
            except Exception as exc:
                self.lost[(v, "manifest")] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            for name, entry in man.states.items():
                if entry.status != "stored":
                    if name in BEST_EFFORT:
                        self.be_missing += final
                    else:
                        self.lost[(v, name)] = f"critical state {entry.status}"
                    continue
                self.loads += 1
                try:
                    got = digest(self.eng.load(name, step=v))
                except Exception as exc:
                    why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    if set(meta.tiers) <= self.corrupted.get((v, name), set()):
                        self.lost_corrupt[(v, name)] = why
                    elif isinstance(exc, rc.CheckpointError) and self.corrupted.get((v, name)):
                        # a corrupted copy and a good one the engine did not find: a loss all the same
                        self.lost[(v, name)] = why + f" (corrupted on {sorted(self.corrupted[(v, name)])}, " \
                                                     f"listed on {list(meta.tiers)})"
                    else:
                        self.lost[(v, name)] = why
                    ok = False
                    continue
                if self.lost.pop((v, name), None) is not None:  # failed at an earlier check, loads now
                    self.transient.append(f"{v}/{name}")
                if got != want.get(name):
                    self.wrong[(v, name)] = "load() returned other bytes than were saved"
                    ok = False
            if ok:
                self.verified[v] = meta.tiers
        # corrupted local copies must come back from the remote tier
        from ray_ckpt.storage.checkpoint_io import rank_files
        from ray_ckpt.capture.restored import read_state, tiers_of
        for (v, name), tiers in self.corrupted.items():
            if tiers == {"local"} and v in listed and "remote" in listed[v].tiers and final:
                try:
                    man = self.eng._manifest(version=v)
                    _, used, _ = read_state(tiers_of(self.eng.config), rank_files(man.states[name], name, 0), name)
                    self.served_remote += used == "remote"
                except Exception:
                    pass
        if final:  # every remote copy on its own, as its REMOTE manifest lists it
            from ray_ckpt.storage.checkpoint_io import read_manifest
            remote = self.eng.config.remote_tier()
            for v, meta in listed.items():
                if "remote" not in meta.tiers or v not in self.digests:
                    continue
                man = self.eng._manifest(version=v)
                try:
                    remote_states = read_manifest(remote, v).states
                except Exception as exc:
                    self.remote_wrong[(v, "manifest")] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    continue
                for name, entry in man.states.items():
                    if entry.status != "stored":
                        continue
                    r_entry = remote_states.get(name)
                    if r_entry is None or r_entry.status != "stored":
                        # a best-effort part that landed after the version's upload: the local
                        # manifest gained it, the remote copy is re-synced after (reported, not lost)
                        if name in BEST_EFFORT:
                            self.be_not_remote.add((v, name))
                        else:
                            self.remote_wrong[(v, name)] = "a critical state of the local copy is not in the remote copy"
                        continue
                    try:
                        st, _, _ = read_state([remote], rank_files(r_entry, name, 0), name)
                        if digest(st) != self.digests[v].get(name):
                            self.remote_wrong[(v, name)] = "remote copy holds other bytes"
                    except Exception as exc:
                        if "remote" not in self.corrupted.get((v, name), set()):
                            self.remote_wrong[(v, name)] = f"{type(exc).__name__}: {str(exc)[:200]}"
        self.check_seconds += time.monotonic() - t0

    # ------------------------------------------------------------------ the loop
    def loop(self) -> None:
        a = self.args
        self.t_start = time.monotonic()
        end = self.t_start + a.minutes * 60
        next_fault = self.t_start + self.rng.uniform(*a.fault_gap)
        active = None          # (kind, cleared_at or None, ending (until, fn) or None, versions before)
        step = 0
        cap = end + a.every_kind_cap_s
        while True:
            now = time.monotonic()
            if now >= end and active is None and not self._kinds_owed(now < cap):
                break
            step += 1
            try:
                self.train_step()
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self.events.append(f"training call failed unexpectedly: {type(exc).__name__}; restoring")
                time.sleep(1)
                self.restore_after_preemption("unexpected actor failure")
                continue
            if step % a.save_every == 0:
                self.save(step)
            self.reap()
            now = time.monotonic()
            if active is not None:
                kind, cleared, ending, _ = active
                if ending is not None and now >= ending[0]:
                    ending[1]()
                    ending = None
                    if cleared is None:
                        cleared = time.monotonic()
                    active = (kind, cleared, None, _)
                if cleared is not None and ending is None:
                    resumed = [v for v, t in self.acked.items() if t >= cleared and v > active[3]]
                    if resumed:
                        secs = min(self.acked[v] for v in resumed) - cleared
                        self.recover[kind].append(secs)
                        if kind == "s3":  # and uploads resume: the newest acknowledged version reaches S3
                            self.await_remote(max(self.acked))
                        self.reap(block_s=30)
                        self.check()
                        self.events.append(f"  recovered from {kind} in {secs:.2f}s; checked")
                        active = None
                        next_fault = time.monotonic() + self.rng.uniform(*a.fault_gap)
                    elif now - cleared > a.recover_bound:
                        self.not_recovered.append(f"{kind}: no acknowledged save {a.recover_bound:.0f}s after it cleared")
                        self.events.append(f"  NOT recovered from {kind} within {a.recover_bound}s")
                        self.recover[kind].append(now - cleared)
                        self.reap(block_s=30)
                        self.check()
                        active = None
                        next_fault = time.monotonic() + self.rng.uniform(*a.fault_gap)
            elif now >= next_fault and (now < end or self._kinds_owed(now < cap)):
                kind = self.next_kind()
                step += 1
                before = step
                cleared, ending = self.inject(kind, step)
                active = (kind, cleared, ending, before)
        self.reap(block_s=a.save_timeout)
        self.await_remote(max(self.acked) if self.acked else None)
        self.check(final=True)

    def _kinds_owed(self, in_time: bool) -> bool:
        """With --every-kind: a kind not injected yet keeps the run going past --minutes (bounded by
        --every-kind-cap-s), so a short run still injects every kind once."""
        return self.args.every_kind and in_time and any(self.faults[k] == 0 for k in self.kinds)

    def await_remote(self, v: Optional[int]) -> None:
        """Bounded: wait until version ``v`` is on the remote tier (uploads resume after an outage)."""
        if v is None:
            return
        t0 = time.monotonic()
        try:
            ray.get(self.eng._coordinator.wait.remote(v, "remote"), timeout=self.args.recover_bound)
            self.remote_resume.append(time.monotonic() - t0)
        except Exception as exc:
            self.events.append(f"version {v} not on the remote tier after {self.args.recover_bound}s: "
                               f"{type(exc).__name__}: {str(exc)[:200]}")
            self.remote_resume.append(float("inf"))

    # ------------------------------------------------------------------ report
    def report(self) -> Dict[str, Any]:
        listed = self.eng.list_checkpoints()
        worst = max((max(v) for v in self.recover.values() if v), default=0.0)
        r = {
            "run": self.run, "seed": self.args.seed, "minutes": self.args.minutes,
            "local_tier": "tmpfs" if self.mount.tmpfs else "tmp dir",
            "faults": dict(self.faults),
            "saves_issued": len(self.digests), "saves_skipped_busy": self.skipped_saves,
            "acknowledged": len(self.acked), "failed_saves": dict(self.failed_saves),
            "listed": len(listed), "on_remote": sum("remote" in m.tiers for m in listed),
            "lost": len(self.lost) + len(self.missing_versions), "wrong": len(self.wrong),
            "lost_to_corruption_every_tier": len(self.lost_corrupt),
            "remote_copies_wrong": len(self.remote_wrong),
            "restore_failures": len(self.restore_failures),
            "not_recovered": len(self.not_recovered), "hung_saves": len(self.hung),
            "unexplained_failures": len(self.unexplained), "best_effort_missing": self.be_missing,
            "best_effort_not_yet_remote": len(self.be_not_remote),
            "transient_load_failures": len(self.transient),
            "recover_s": {k: [round(x, 3) for x in v] for k, v in self.recover.items()},
            "worst_recover_s": round(worst, 3),
            "remote_resume_s": [round(x, 2) for x in self.remote_resume],
            "restores": [(k, v, round(s, 3), t) for k, v, s, t in self.restores],
            "corrupted": {f"{v}/{n}": sorted(t) for (v, n), t in self.corrupted.items()},
            "corrupt_local_served_from_remote": self.served_remote,
            "checks": self.checks, "loads_verified": self.loads, "versions_checked": self.versions_checked, "check_seconds": round(self.check_seconds, 1),
            "details": {
                "lost": {f"{v}/{n}": w for (v, n), w in self.lost.items()} | {str(v): w for v, w in self.missing_versions.items()},
                "wrong": {f"{v}/{n}": w for (v, n), w in self.wrong.items()},
                "lost_to_corruption_every_tier": {f"{v}/{n}": w for (v, n), w in self.lost_corrupt.items()},
                "remote_wrong": {f"{v}/{n}": w for (v, n), w in self.remote_wrong.items()},
                "restore_failures": self.restore_failures, "not_recovered": self.not_recovered,
                "hung": self.hung, "unexplained": self.unexplained, "transient_load_failures": self.transient,
            },
            "notes": self.notes,
        }
        return r


MUST_BE_ZERO = ("lost", "wrong", "restore_failures", "not_recovered", "hung_saves", "remote_copies_wrong")


def render(r: Dict[str, Any]) -> str:
    rows = [(f"faults injected: {k}", str(r["faults"].get(k, 0))) for k in KINDS]
    rows += [("faults injected: total", str(sum(r["faults"].values()))),
             ("saves issued / skipped (busy)", f"{r['saves_issued']} / {r['saves_skipped_busy']}"),
             ("versions acknowledged", str(r["acknowledged"])),
             ("saves failed loudly (SaveError)", str(sum(r["failed_saves"].values()))),
             ("versions listed / on remote tier", f"{r['listed']} / {r['on_remote']}"),
             ("versions lost (must be 0)", str(r["lost"])),
             ("wrong restores (must be 0)", str(r["wrong"])),
             ("remote copies wrong (must be 0)", str(r["remote_copies_wrong"])),
             ("restore() failures (must be 0)", str(r["restore_failures"])),
             ("faults not recovered in bound (must be 0)", str(r["not_recovered"])),
             ("saves with no outcome (must be 0)", str(r["hung_saves"])),
             ("lost to corruption on every tier", str(r["lost_to_corruption_every_tier"])),
             ("save failures outside a fault", str(r["unexplained_failures"])),
             ("best-effort states missing (reported)", str(r["best_effort_missing"])),
             ("best-effort parts not yet in the remote copy", str(r["best_effort_not_yet_remote"])),
             ("loads that failed once, then worked", str(r["transient_load_failures"])),
             ("worst time to recover", f"{r['worst_recover_s']:.2f} s")]
    for k in KINDS:
        if r["recover_s"].get(k):
            rows.append((f"  worst recovery: {k}", f"{max(r['recover_s'][k]):.2f} s"))
    if r["remote_resume_s"]:
        rows.append(("worst wait for remote durability", f"{max(r['remote_resume_s']):.2f} s"))
    rows.append(("checks / versions checked / state loads",
                 f"{r['checks']} / {r['versions_checked']} / {r['loads_verified']}"))
    return _table(rows)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=4, help="save every N training steps")
    ap.add_argument("--fault-gap", type=float, nargs=2, default=(10.0, 25.0), metavar=("MIN", "MAX"),
                    help="seconds between a fault's check and the next fault")
    ap.add_argument("--outage-s", type=float, nargs=2, default=(3.0, 8.0), metavar=("MIN", "MAX"),
                    help="how long the S3 server stays down / the disk stays full")
    ap.add_argument("--kinds", default=",".join(KINDS), help="fault kinds, comma-separated")
    ap.add_argument("--recover-bound", type=float, default=90.0)
    ap.add_argument("--save-timeout", type=float, default=180.0)
    ap.add_argument("--fault-window", type=float, default=60.0,
                    help="a save failing this long after the last fault is reported as unexplained")
    ap.add_argument("--check-sample", type=int, default=25,
                    help="after a fault, also re-check this many already verified versions (all at the end)")
    ap.add_argument("--every-kind", action="store_true",
                    help="run on past --minutes until every fault kind was injected once (the short form)")
    ap.add_argument("--every-kind-cap-s", type=float, default=300.0,
                    help="with --every-kind: at most this many seconds past --minutes")
    ap.add_argument("--rollouts", type=int, default=ROLLOUTS,
                    help="rollout actors (each is a torch process to start; the test's short form uses 1)")
    ap.add_argument("--tmpfs-mb", type=int, default=256)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--events", action="store_true", help="print the event log")
    args = ap.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    bad = set(args.kinds) - set(KINDS)
    if args.rollouts < 1:
        ap.error("--rollouts must be at least 1 (the rollout fault kills one)")
    if bad:
        ap.error(f"unknown fault kinds {sorted(bad)}; known: {', '.join(KINDS)}")
    return args


def main(argv=None, s3_server=None, log=print) -> Tuple[int, Dict[str, Any]]:
    """Run the chaos loop; returns (exit status, results). Uses the running Ray instance if there
    is one (else starts a local one) and ``s3_server`` if given (else starts one)."""
    args = parse(argv)
    base = args.dir or tempfile.mkdtemp(prefix="ray_ckpt_chaos_")
    os.makedirs(base, exist_ok=True)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    srv = s3_server
    if srv is None:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from s3server import S3Server

        srv = S3Server(os.path.join(base, "s3")).start()
    chaos = Chaos(args, srv, base, log)
    t0 = time.monotonic()
    try:
        chaos.start()
        chaos.loop()
        result = chaos.report()
    except BaseException:
        log("chaos run aborted:\n" + traceback.format_exc())
        log("\n".join(chaos.events[-40:]))
        raise
    finally:
        chaos.close()
        if s3_server is None:
            srv.stop()
        if started_ray:
            ray.shutdown()
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if args.events:
        log("\n".join(chaos.events))
    log(f"chaos run {result['run']}: {args.minutes} min, seed {args.seed}, local tier on "
        f"{result['local_tier']}, remote tier on S3 ({srv.endpoint}); wall {result['wall_s']} s")
    for n in result["notes"]:
        log(f"note: {n}")
    log(render(result))
    bad = [k for k in MUST_BE_ZERO if result[k]]
    for k, d in result["details"].items():
        if d:
            log(f"{k}: {json.dumps(d, indent=1)[:3000]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if bad:
        log("FAILED: " + ", ".join(f"{k}={result[k]}" for k in bad))
    return (1 if bad else 0), result


if __name__ == "__main__":
    raise SystemExit(main()[0])
