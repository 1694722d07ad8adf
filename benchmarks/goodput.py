"""Goodput under seeded preemptions, measured on a multi-node Ray cluster on this machine (issue 45).

    python benchmarks/goodput.py --quick          # 64 MB state, 0.5 s steps, 2 schedules x 100 s, 1 event each (< ~5 min)
    python benchmarks/goodput.py                  # 64 MB state, 1 s steps, 3 schedules x 300 s, 3 events each (< ~20 min)
    python benchmarks/goodput.py --job rllib      # DQN on CartPole, a step is one train() (< ~20 min)
        [--mb N] [--phase-s S] [--every N] [--step-s S] [--notice-s S] [--replace-delay-s S]
        [--replace-at-removal] [--events N] [--seed N] [--costs benchmarks/goodput_costs.json] [--md FILE]

Goodput = steps of progress kept at the end of a phase ÷ the steps the same job makes in the same
wall time with no faults and no checkpoints (the ``baseline`` learner, run at the same time on a
node that is never preempted, so that it shares the machine's load with the arms).

The jobs (``--job``): ``toy`` (the default), one learner actor per arm holding ``--mb`` MB of float32
state; a step updates the whole state in place (``w.mul_(0.999).add_(0.001)``) and then sleeps
``--step-s`` seconds, which stands for the accelerator's compute (a sleep, so that five learners on
two cores do not measure each other's CPU use; the checkpointers' own CPU use still slows every arm
alike). Progress is a counter inside the state: a restored state brings back the progress it was
saved at. ``rllib``: an RLlib DQN per arm (:class:`RLlibLearner`), a step is one ``train()`` and
progress RLlib's iteration counter; the ray_ckpt arms save from ray_ckpt's RLlib callback, the
framework arm with RLlib's own ``save_to_path``.

Arms, side by side in one run, each learner on its own Ray node (``slot_<arm>``, 2 CPUs):

* ``none``       no checkpoints: a lost learner starts again from step 0;
* ``framework``  what a user does without ray_ckpt: every ``--every`` steps the loop calls
                 ``torch.save`` of the state (RLlib: ``save_to_path``) to a shared directory (the
                 "remote": the same disk for every node here), blocking; a restarted learner loads it;
* ``ray_ckpt``   ray_ckpt as its defaults give it at the same cadence: ``engine.save()`` every
                 ``--every`` steps, local tier per node and the remote tier (a real S3-compatible
                 server on 127.0.0.1, tests/s3server.py) every save (``remote_every=1``),
                 ``on_preemption="save"``: the coordinator copies a drained node's only copies away,
                 and the loop's ``engine.save_if_preempted()`` (RLlib: the callback) saves at the
                 next step after a notice, and again each time its newest save is off the node;
* ``rc_every``   ``engine.save()`` every step with ``peer_replicas=1`` (holders on the spare node),
                 the remote tier every ``--every`` saves, the notice's saves as ``ray_ckpt``'s.

Fault schedules (one phase of ``--phase-s`` seconds each, fresh learners and runs per phase), with
``--events`` preemptions at seeded times; each one takes every arm's node at once:

* ``no-notice``  the node is removed at once (processes killed, not gracefully) and its disk deleted;
* ``notice``     ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds
                 N`` first, the node removed at the deadline;
* ``mixed``      (default run only) each event is one or the other, seeded.

A replacement node with the same resources joins ``--replace-delay-s`` after the notice (asked for
when the notice comes, as an autoscaler told of a spot interruption does; ``--replace-at-removal``:
after the removal, as without notice) or after the removal; the learner (``max_restarts=-1``)
restarts there once its node is gone, and the arm restores (the RLlib job's ray_ckpt arms resume
inside ``build_algo()``: ``make_callback(..., resume=True)``). Measured costs go to
``benchmarks/goodput_costs.json`` (the RLlib job: ``goodput_costs_rllib.json``) for
``benchmarks/goodput_sim.py --costs``.

Every wait is bounded; a bound that expires prints what was waited on and the arm stops for the
rest of its phase (reported as ``stuck``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import ray_ckpt as rc  # noqa: E402
from s3server import S3Server  # noqa: E402

ARMS = ("none", "framework", "ray_ckpt", "rc_every")
T0 = time.monotonic()
MB = 1 << 20


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------- the job
@ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0.5)
class Learner:
    def __init__(self, mb: int, step_s: float, seed: int):
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(seed)
        self.w = torch.rand(mb * MB // 4, generator=g)
        self.steps = 0
        self.step_s = step_s

    def train(self) -> int:
        self.w.mul_(0.999).add_(0.001)
        time.sleep(self.step_s)  # the accelerator's compute
        self.steps += 1
        return self.steps

    def progress(self) -> int:
        return self.steps

    def ckpt_get_state(self, name):
        return {"w": self.w, "steps": self.steps}

    def ckpt_set_state(self, name, state):
        self.w, self.steps = state["w"], int(state["steps"])

    # the framework's own checkpointing: torch.save to shared storage, blocking
    def framework_save(self, path: str) -> float:
        t = time.perf_counter()
        tmp = path + ".tmp"
        torch.save({"w": self.w, "steps": self.steps}, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return time.perf_counter() - t

    def framework_load(self, path: str):
        t = time.perf_counter()
        if not os.path.exists(path):
            return 0, None
        st = torch.load(path)
        self.w, self.steps = st["w"], int(st["steps"])
        return self.steps, time.perf_counter() - t

    def where(self):
        return os.getpid(), ray.get_runtime_context().get_node_id()


@ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0.5)
class RLlibLearner:
    """The RLlib job: DQN on CartPole-v1 (``benchmarks/rllib_iteration.py``'s config: a prioritized
    buffer, no remote env runners, 500 sampled timesteps an iteration); one step is one ``train()``,
    progress is RLlib's own iteration counter. The ray_ckpt arms save from ray_ckpt's RLlib callback
    (``make_callback(run, every=..., resume=True)``, attached to the run the driver created), so a
    restarted learner resumes from the run's newest version inside ``build_algo()``, as a user's
    restarted job does; the framework arm saves with RLlib's ``save_to_path`` (blocking; RLlib's
    checkpoint holds no replay buffer) and restores with ``restore_from_path``."""

    def __init__(self, arm: str, run: str, every: int, seed: int):
        sys.path.insert(0, HERE)
        import rllib_iteration as bench
        from ray_ckpt.integrations import rllib as rr
        torch.set_num_threads(1)
        cfg = bench.dqn_config(seed)
        if arm in ("ray_ckpt", "rc_every"):
            cfg = cfg.callbacks(rr.make_callback(run, every=every if arm == "ray_ckpt" else 1, resume=True,
                                                 on_busy="queue"))
        t = time.perf_counter()
        self.algo = cfg.build_algo()
        self.build_s = time.perf_counter() - t
        self.cb = rr.find_callback(self.algo)
        self.pauses = 0  # save_call_ms entries already reported

    def train(self):
        """(iteration, [ms of each save() call this train() made])."""
        self.algo.train()
        new = []
        if self.cb is not None:
            new = self.cb.save_call_ms[self.pauses:]
            self.pauses = len(self.cb.save_call_ms)
        return int(self.algo.iteration), new

    def progress(self) -> int:
        return int(self.algo.iteration)

    def resumed(self):
        """(version, iteration, seconds, tier of the policy) of the resume at build_algo(), or None."""
        r = self.cb.resumed if self.cb is not None else None
        if r is None:
            return None
        tier = r.states.get("policy", "")
        tier = tier[tier.find("(") + 1:tier.find(")")] if "(" in tier else tier
        return r.version, r.iteration, r.seconds, tier

    def framework_save(self, path: str) -> float:
        t = time.perf_counter()
        tmp, old = path + ".tmp", path + ".old"
        shutil.rmtree(tmp, ignore_errors=True)
        self.algo.save_to_path(tmp)
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        return time.perf_counter() - t

    def framework_load(self, path: str):
        t = time.perf_counter()
        if not os.path.exists(path) and os.path.exists(path + ".old"):  # lost between the two renames
            path += ".old"
        if not os.path.exists(path):
            return 0, None
        self.algo.restore_from_path(path)
        return int(self.algo.iteration), time.perf_counter() - t

    def where(self):
        return os.getpid(), ray.get_runtime_context().get_node_id()


def bounded(what: str, fn, timeout: float):
    """Run ``fn`` in a thread; its result, or TimeoutError naming ``what`` after ``timeout`` s."""
    box = {}

    def run():
        try:
            box["ok"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["err"] = exc

    th = threading.Thread(target=run, daemon=True, name=f"bounded:{what}")
    th.start()
    th.join(timeout)
    if th.is_alive():
        raise TimeoutError(f"{what}: not within {timeout:.0f}s")
    if "err" in box:
        raise box["err"]
    return box["ok"]


def drain(address: str, node: str, seconds: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", address, "--node-id", node,
           "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot preemption (goodput.py)",
           "--deadline-remaining-seconds", str(seconds)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# ----------------------------------------------------------------------------- the cluster
class Nodes:
    """The arms' nodes: ``slot_<arm>`` resources, label zone=learners (peer holders go elsewhere)."""

    def __init__(self, cluster: Cluster, store: int, root: str):
        self.cluster, self.store, self.root = cluster, store, root
        self.node = {}
        self.replace_s = []
        self.lock = threading.Lock()

    def add(self, arm: str):
        t = time.perf_counter()
        n = self.cluster.add_node(num_cpus=2, resources={f"slot_{arm}": 1}, labels={"zone": "learners"},
                                  object_store_memory=self.store)
        dt = time.perf_counter() - t
        with self.lock:
            self.node[arm] = n
        return n, dt

    def remove(self, n) -> None:
        """Take node ``n`` away: its processes killed at once (a preemption's end), its disk deleted."""
        with self.lock:
            for arm in [a for a, x in self.node.items() if x is n]:
                del self.node[arm]
        self.cluster.remove_node(n, allow_graceful=False)
        shutil.rmtree(os.path.join(self.root, "local", n.node_id[:12]), ignore_errors=True)  # its disk goes too


# ----------------------------------------------------------------------------- one arm's loop
class Arm(threading.Thread):
    def __init__(self, arm: str, phase: str, args, learner, engine, shared: str, stop: threading.Event,
                 notices: dict):
        super().__init__(daemon=True, name=f"arm-{arm}")
        self.arm, self.phase, self.args, self.learner, self.engine = arm, phase, args, learner, engine
        self.shared, self.stop_ev, self.notices = shared, stop, notices
        self.path = os.path.join(shared, f"{arm}.pt")
        self.progress = 0
        self.made = 0  # train() calls that returned
        self.restarts = 0
        self.restore_s = []  # (tier, seconds)
        self.down_s = []  # node lost -> training again
        self.detect_s = []
        self.save_pause = []
        self.save_errors = 0
        self.ver = 0
        self.ver_progress = {}
        self.framework_saved = 0
        self.stuck = None
        self.restore_failed = 0
        self.notice_seen = {}  # noticed_at -> seconds from the drain to the loop seeing it
        self.notice_saved = []  # seconds from the drain to the first save for the notice committed
        self.notice_firsts = set()  # noticed_at of the notices saved for
        self.drains_watched = set()  # RLlib job: the drains whose first save after them is being timed
        self.progress_log = []  # RLlib job: (unix time, iteration) as each train() returned
        self.pid = None
        self._after_save = None
        self.handles = []  # the newest saves' handles: what had committed when the node went
        self.baseline = None  # set by run_phase: the no-fault learner's step times

    # the learner's answers, bounded
    def _get(self, ref, what, timeout):
        return ray.get(ref, timeout=timeout)

    def run(self):
        try:
            self.pid = self._get(self.learner.where.remote(), "where", 120)[0]
            while not self.stop_ev.is_set():
                try:
                    t = time.perf_counter()
                    p = self._get(self.learner.train.remote(), "train", self.args.step_s + 60)
                    dur = time.perf_counter() - t
                    if isinstance(p, tuple):  # the RLlib job: (iteration, the callback's save() calls in ms)
                        p, save_ms = p
                        self.save_pause.extend(ms / 1000 for ms in save_ms)
                except Exception as exc:  # noqa: BLE001 - a lost learner, or one that stopped answering
                    self._after_save = None
                    self._recover(exc)
                    continue
                self.progress, self.made = p, self.made + 1
                if self.args.job == "rllib" and self.arm in ("ray_ckpt", "rc_every"):
                    self.progress_log = (self.progress_log + [(time.time(), p)])[-50:]
                    self._time_notice_save()
                if self._after_save is not None:
                    # the loop's pause for a save: the save() call, and what the step after it took
                    # longer than a step of the baseline (the learner actor serves the capture first)
                    normal = self.baseline.step_median()
                    self.save_pause.append(self._after_save + max(0.0, dur - normal) if normal else self._after_save)
                    self._after_save = None
                try:
                    self._checkpoint(p)
                except Exception as exc:  # noqa: BLE001
                    if self._alive():
                        self.save_errors += 1
                        say(f"{self.phase}/{self.arm}: save error (learner alive): {type(exc).__name__}: "
                            f"{str(exc)[:300]}")
                    else:
                        self._recover(exc)
        except StopArm as exc:
            self.stuck = str(exc)
            say(f"{self.phase}/{self.arm}: STUCK for the rest of the phase: {exc}")
        except Exception:  # noqa: BLE001
            self.stuck = traceback.format_exc(limit=3)
            say(f"{self.phase}/{self.arm}: FAILED: {self.stuck}")

    def _alive(self) -> bool:
        try:
            return self._get(self.learner.where.remote(), "where", 10)[0] == self.pid
        except Exception:  # noqa: BLE001
            return False

    def _checkpoint(self, p: int) -> None:
        every = self.args.every
        if self.arm == "framework":
            if p % every == 0:
                t = time.perf_counter()
                self._get(self.learner.framework_save.remote(self.path), "the framework's save", 300)
                self.save_pause.append(time.perf_counter() - t)
                self.framework_saved = p
            return
        if self.arm not in ("ray_ckpt", "rc_every") or self.args.job == "rllib":
            return  # the RLlib job's arms save from ray_ckpt's callback, inside train()
        # what a loop of the user's own does with ray_ckpt: the saves for a notice whatever the
        # cadence (on_preemption="save", the default), then its own cadence
        self._notice()
        t = time.perf_counter()
        h = self.engine.save_if_preempted(self.ver + 1)
        if h is not None:
            self.ver += 1
            self.ver_progress[self.ver] = p
            self._after_save = time.perf_counter() - t
            self._watch_last_save(h)
        elif self.arm == "rc_every" or p % every == 0:
            self._save(p)

    def _save(self, p: int) -> None:
        t = time.perf_counter()
        h = self.engine.save(self.ver + 1)
        self.handles = (self.handles + [h])[-40:]
        self.ver += 1
        self.ver_progress[self.ver] = p
        self._after_save = time.perf_counter() - t

    def _notice(self) -> None:
        n = self.engine.preemption()
        if n is not None and n.noticed_at not in self.notice_seen:
            drained = (self.notices.get("drained_at") or {}).get(self.arm)
            self.notice_seen[n.noticed_at] = (time.time() - drained) if drained else None

    def _watch_last_save(self, h) -> None:
        drained = (self.notices.get("drained_at") or {}).get(self.arm)
        n = self.engine.preemption()
        left = max(1.0, n.seconds_left()) if n is not None else self.args.notice_s
        # the first save for a notice is the one notice_to_saved_s times; the next ones follow it
        # each time the newest is off the drained node (save_if_preempted keeps saving)
        first = n is None or n.noticed_at not in self.notice_firsts
        if n is not None:
            self.notice_firsts.add(n.noticed_at)

        def wait():
            try:
                h.wait(timeout=left)
                if drained and first:
                    self.notice_saved.append(time.time() - drained)
                say(f"{self.phase}/{self.arm}: {'first' if first else 'next'} save for the notice committed "
                    f"(version {h.step}, progress {self.ver_progress.get(h.step)})"
                    + (f" {time.time() - drained:.1f}s after the drain" if drained else ""))
            except Exception as exc:  # noqa: BLE001
                say(f"{self.phase}/{self.arm}: the save for the notice did not commit in {left:.0f}s: "
                    f"{type(exc).__name__}: {str(exc)[:200]}")
        threading.Thread(target=wait, daemon=True).start()

    def _time_notice_save(self) -> None:
        """RLlib job: the callback saves for a notice inside ``train()`` (the driver calls no
        ``save_if_preempted``), so the first save after a drain is timed from the driver: from
        ``ray drain-node`` returning until the run lists a version of an iteration after the one
        the learner had finished at the drain (the iteration in progress then, saved at its end
        for the notice, or by rc_every's every-iteration cadence)."""
        drained = (self.notices.get("drained_at") or {}).get(self.arm)
        if not drained or drained in self.drains_watched or self.engine is None:
            return
        self.drains_watched.add(drained)
        done = [p for t, p in self.progress_log if t <= drained]
        before = done[-1] if done else 0
        bound = drained + self.args.notice_s + 5

        def watch():
            while time.time() < bound and not self.stop_ev.is_set():
                try:
                    if any(s > before for s in self.engine.all_steps()):
                        self.notice_saved.append(time.time() - drained)
                        say(f"{self.phase}/{self.arm}: first save after the notice committed "
                            f"{time.time() - drained:.1f}s after the drain (an iteration after {before})")
                        return
                except Exception:  # noqa: BLE001 - the coordinator busy: asked again
                    pass
                time.sleep(0.1)
            say(f"{self.phase}/{self.arm}: no save after iteration {before} committed before the deadline")
        threading.Thread(target=watch, daemon=True).start()

    def _recover(self, exc: Exception) -> None:
        t_lost = time.time()
        removed = (self.notices.get("removed_at") or {}).get(self.arm)
        if removed and t_lost - removed < 120:
            self.detect_s.append(t_lost - removed)
        say(f"{self.phase}/{self.arm}: learner lost at progress {self.progress} ({type(exc).__name__}); "
            f"waiting for its restart")
        self.restarts += 1
        bound = self.args.replace_delay_s + 240
        deadline = time.monotonic() + bound
        last = None
        while True:
            if self.stop_ev.is_set():
                raise StopArm(f"the phase ended while waiting for the learner's restart (last answer: {last!r})")
            if time.monotonic() > deadline:
                raise StopArm(f"the learner's restart on a replacement node: not within {bound:.0f}s "
                              f"(last answer: {last!r})")
            try:
                pid, node = self._get(self.learner.where.remote(), "where", 10)
                if pid != self.pid:
                    self.pid = pid
                    break
                last = f"still the old process {pid} on {node[:12]}"
            except Exception as e:  # noqa: BLE001
                last = f"{type(e).__name__}: {str(e)[:160]}"
            time.sleep(0.5)
        t_back = time.time()
        if self.handles:
            committed, failed, pending = [], [], []
            for h in self.handles:
                try:
                    if not h.done():
                        pending.append(h.step)
                    elif h.exception(timeout=1) is None:
                        committed.append(h.step)
                    else:
                        failed.append(h.step)
                except Exception:  # noqa: BLE001
                    failed.append(h.step)
            say(f"{self.phase}/{self.arm}: the last {len(self.handles)} saves when the learner came back: committed "
                f"{_ranges(committed)}; failed {_ranges(failed)}; pending {_ranges(pending)}")
            self.handles = []
        self.progress = 0
        if self.arm == "framework":
            p, dt = self._get(self.learner.framework_load.remote(self.path), "the framework's load", 300)
            self.progress = p
            if dt is not None:
                self.restore_s.append(("remote", dt))
        elif self.arm in ("ray_ckpt", "rc_every") and self.args.job == "rllib":
            # the callback (resume=True) restored the run's newest version inside build_algo()
            r = self._get(self.learner.resumed.remote(), "resumed", 60)
            if r is None:
                try:
                    newest = self.engine.latest_step() if self.engine is not None else None
                except Exception as e:  # noqa: BLE001 - not known: counted as a failure
                    newest = f"not known ({type(e).__name__})"
                if newest is not None:  # a committed version it should have resumed: a failure
                    self.restore_failed += 1
                say(f"{self.phase}/{self.arm}: nothing resumed, starting from 0 (the run's newest committed "
                    f"version: {newest})")
            else:
                version, self.progress, secs, tier = r
                self.restore_s.append((tier, secs))
                say(f"{self.phase}/{self.arm}: resumed version {version} (iteration {self.progress}) from {tier} "
                    f"in {secs:.2f}s")
        elif self.arm in ("ray_ckpt", "rc_every"):
            t = time.perf_counter()
            try:
                report = bounded(f"{self.arm}: engine.restore()", lambda: self.engine.restore(), 300)
                st = report.states["policy"]
                self.restore_s.append((str(st.tier), time.perf_counter() - t))
                self.progress = self._get(self.learner.progress.remote(), "progress", 30)
                say(f"{self.phase}/{self.arm}: restored version {report.version} (progress {self.progress}) from "
                    f"{st.tier} in {time.perf_counter() - t:.2f}s")
            except TimeoutError as e:
                raise StopArm(str(e)) from None
            except Exception as e:  # noqa: BLE001 - nothing restorable: the fresh learner starts at 0
                self.restore_failed += 1
                say(f"{self.phase}/{self.arm}: restore failed, starting from 0: {type(e).__name__}: {str(e)[:300]}")
        self.down_s.append(time.time() - t_lost)
        say(f"{self.phase}/{self.arm}: training again at progress {self.progress}, "
            f"{time.time() - t_back:.1f}s after the restart, {time.time() - t_lost:.1f}s after the loss")

    def kept(self) -> int:
        """Progress kept at the end: the live learner's, else the newest restorable checkpoint's."""
        try:
            return int(self._get(self.learner.progress.remote(), "progress", 15))
        except Exception:  # noqa: BLE001
            pass
        if self.arm == "framework":
            return self.framework_saved
        if self.engine is not None:
            try:
                listed = bounded("list_checkpoints", self.engine.list_checkpoints, 30)
                vs = [m.version for m in listed]
                if not vs:
                    return 0
                # the RLlib callback's versions are iterations
                return max(vs) if self.args.job == "rllib" else self.ver_progress.get(max(vs), 0)
            except Exception:  # noqa: BLE001
                return 0
        return 0


def _ranges(xs) -> str:
    xs = sorted(xs)
    if not xs:
        return "—"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


class StopArm(Exception):
    pass


class Baseline(threading.Thread):
    def __init__(self, learner, stop):
        super().__init__(daemon=True, name="baseline")
        self.learner, self.stop_ev, self.steps, self.err = learner, stop, 0, None
        self.step_times = []

    def step_median(self):
        recent = self.step_times[-60:]
        return statistics.median(recent) if recent else None

    def run(self):
        try:
            while not self.stop_ev.is_set():
                t = time.perf_counter()
                p = ray.get(self.learner.train.remote(), timeout=120)
                self.steps = p[0] if isinstance(p, tuple) else p
                self.step_times.append(time.perf_counter() - t)
        except Exception as exc:  # noqa: BLE001
            self.err = repr(exc)
            say(f"baseline failed: {exc!r}")


# ----------------------------------------------------------------------------- schedules
def schedule(kind: str, phase_s: float, events: int, seed: int, notice_s: int, tail_s: float,
             start_s: float = 8.0):
    """Seeded event times: one per slot of the phase, none in its first ``start_s`` seconds nor
    in the last ``tail_s``."""
    rng = random.Random(f"{seed}:{kind}")
    span = max(10.0, phase_s - start_s - tail_s)
    slot = span / events
    out = []
    for i in range(events):
        # an event no sooner than ``tail_s`` after the one before (the time a loss takes to recover
        # from here), at a seeded point of its slot
        t = start_s + i * slot + rng.uniform(0.0, max(5.0, slot - tail_s))
        with_notice = kind == "notice" or (kind == "mixed" and rng.random() < 0.5)
        out.append((round(t, 1), with_notice))
    return out


def chaos(cluster_address, nodes: Nodes, events, args, t_start, notices: dict, log: list, done: threading.Event):
    order = list(ARMS)
    try:
        for i, (at, with_notice) in enumerate(events):
            wait = t_start + at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            order = order[1:] + order[:1]  # who is removed and replaced first rotates
            old = {a: nodes.node[a] for a in order}
            ids = {a: n.node_id for a, n in old.items()}
            notices["drained_at"], notices["removed_at"] = {}, {}
            replaced = False
            if with_notice:
                t = time.time()
                ends = {}

                def one(a, p):
                    try:
                        out, _ = p.communicate(timeout=60)
                        ends[a] = time.time()  # the drain is in force once the call returns
                        if p.returncode != 0:
                            say(f"chaos: drain of {a}'s node failed: {out[-400:]}")
                    except subprocess.TimeoutExpired:
                        p.kill()
                        say(f"chaos: drain of {a}'s node: ray drain-node did not return within 60s")
                ths = [threading.Thread(target=one, args=(a, drain(cluster_address, ids[a], args.notice_s)))
                       for a in order]
                for th in ths:
                    th.start()
                for th in ths:
                    th.join(70)
                notices["drained_at"] = dict(ends)
                say(f"chaos: event {i + 1}: every arm's node drained for preemption, deadline {args.notice_s}s "
                    f"(ray drain-node returned after " + ", ".join(f"{a} {ends[a] - t:.1f}s" for a in ends) + ")")
                if not args.replace_at_removal:
                    # the replacements are asked for at the notice (what an autoscaler told of a spot
                    # interruption does) and join --replace-delay-s after it, beside the draining nodes
                    left = t + args.replace_delay_s - time.time()
                    if left > 0:
                        time.sleep(left)
                    add_replacements(nodes, order, i)
                    replaced = True
                # each node goes at its own deadline (its drain call's return + the notice)
                for a in sorted(order, key=lambda a: ends.get(a, t)):
                    left = ends.get(a, t) + args.notice_s - time.time()
                    if left > 0:
                        time.sleep(left)
                    notices["removed_at"][a] = time.time()
                    nodes.remove(old[a])
                t = min(notices["removed_at"].values())
            else:
                t = time.time()
                for a in order:
                    notices["removed_at"][a] = time.time()
                    nodes.remove(old[a])
            say(f"chaos: event {i + 1}: every arm's node removed ({'at its deadline' if with_notice else 'no notice'}"
                f"; {time.time() - t:.1f}s)")
            if not replaced:
                time.sleep(args.replace_delay_s)
                add_replacements(nodes, order, i)
            log.append({"at": at, "notice": with_notice, "removed_at": t})
    except Exception:  # noqa: BLE001
        say(f"chaos FAILED: {traceback.format_exc(limit=4)}")
    finally:
        done.set()


def add_replacements(nodes: Nodes, order, i: int) -> None:
    for a in order:
        _, dt = nodes.add(a)
        nodes.replace_s.append(dt)
    say(f"chaos: event {i + 1}: replacement nodes joined (add_node "
        f"{', '.join(f'{x:.1f}' for x in nodes.replace_s[-len(order):])}s)")


# ----------------------------------------------------------------------------- costs measured apart
def calibrate(args, root, srv, spare_id) -> dict:
    """Local and remote restore times and the save pause on a quiet cluster (no faults)."""
    out = {}
    learner = Learner.options(resources={"slot_base": 1},
                              scheduling_strategy=NodeAffinitySchedulingStrategy(spare_id, soft=False)
                              ).remote(args.mb, 0.0, 7)
    ray.get(learner.train.remote(), timeout=120)
    eng = rc.CheckpointEngine.create("cal", local_dir=os.path.join(root, "local", "{node_id}"),
                                     remote_uri=srv.uri("runs"), remote_options=srv.options, critical_writers=1,
                                     best_effort_writers=0, remote_every=1)
    try:
        eng.register("policy", learner)
        pauses = []
        for step in range(1, 4):
            t = time.perf_counter()
            ray.get(learner.train.remote(), timeout=120)
            normal = time.perf_counter() - t
            t = time.perf_counter()
            h = eng.save(step)
            ray.get(learner.train.remote(), timeout=120)  # waits behind the capture on the learner
            pauses.append(time.perf_counter() - t - normal)
            h.wait(timeout=300, durability="remote")
        out["save_pause_s"] = statistics.median(pauses)
        t = time.perf_counter()
        rep = bounded("calibration restore (local)", eng.restore, 300)
        out["local"] = (str(rep.states["policy"].tier), time.perf_counter() - t)
        # the local copy gone: the same version from the remote tier
        shutil.rmtree(os.path.join(root, "local", spare_id[:12], "cal"), ignore_errors=True)
        t = time.perf_counter()
        rep = bounded("calibration restore (remote)", eng.restore, 300)
        out["remote"] = (str(rep.states["policy"].tier), time.perf_counter() - t)
        p = os.path.join(root, "cal.pt")
        saves = [ray.get(learner.framework_save.remote(p), timeout=300) for _ in range(3)]
        out["framework_save_pause_s"] = statistics.median(saves)
        out["framework_load_s"] = ray.get(learner.framework_load.remote(p), timeout=300)[1]
    finally:
        try:
            bounded("cal shutdown", lambda: eng.shutdown(timeout=30), 60)
        except Exception as exc:  # noqa: BLE001
            say(f"calibration: shutdown: {exc!r}")
        ray.kill(learner)
    say(f"calibration: {out}")
    return out


# ----------------------------------------------------------------------------- one phase
def run_phase(kind, args, root, srv, cluster, nodes: Nodes, spare_id, results, costs):
    say(f"=== phase {kind}: {args.phase_s:.0f}s")
    shared = os.path.join(root, "shared", kind)
    os.makedirs(shared, exist_ok=True)
    local = os.path.join(root, "local", "{node_id}")
    learners, engines = {}, {}
    rllib = args.job == "rllib"
    # the RLlib callback registers its states itself (and its metrics best-effort: one writer for them)
    common = dict(local_dir=local, remote_uri=srv.uri("runs"), remote_options=srv.options, critical_writers=1,
                  best_effort_writers=1 if rllib else 0, keep_last=3, remote_keep_last=2, on_preemption="save")
    runs = {"ray_ckpt": f"gp-{args.job}-{kind}-c", "rc_every": f"gp-{args.job}-{kind}-d"}
    # created by the driver, so that the run outlives any learner; the RLlib callback attaches to it
    engines["ray_ckpt"] = rc.CheckpointEngine.create(runs["ray_ckpt"], remote_every=1, **common)
    engines["rc_every"] = rc.CheckpointEngine.create(runs["rc_every"], remote_every=args.every, peer_replicas=1,
                                                     peer_domain_label="zone",
                                                     peer_memory_mb=256 if rllib else 4 * args.mb, **common)
    for i, arm in enumerate(ARMS):
        opts = {"resources": {f"slot_{arm}": 1}}
        learners[arm] = (RLlibLearner.options(**opts).remote(arm, runs.get(arm, ""), args.every, i) if rllib
                         else Learner.options(**opts).remote(args.mb, args.step_s, i))
    base_opts = {"resources": {"slot_base": 1},
                 "scheduling_strategy": NodeAffinitySchedulingStrategy(spare_id, soft=False)}
    base = (RLlibLearner.options(**base_opts).remote("none", "", args.every, 99) if rllib
            else Learner.options(**base_opts).remote(args.mb, args.step_s, 99))
    ray.get([a.where.remote() for a in learners.values()] + [base.where.remote()], timeout=300)
    if not rllib:
        for arm, e in engines.items():
            e.register("policy", learners[arm])
    stop, done, notices, log = threading.Event(), threading.Event(), {}, []
    threads = {arm: Arm(arm, kind, args, learners[arm], engines.get(arm), shared, stop, notices) for arm in ARMS}
    bl = Baseline(base, stop)
    for th in threads.values():
        th.baseline = bl
    events = schedule(kind, args.phase_s, args.events, args.seed, args.notice_s,
                      tail_s=args.notice_s + args.replace_delay_s + 45, start_s=args.start_s)
    say(f"schedule {kind}: " + ", ".join(f"t={t}s{' notice' if n else ' no notice'}" for t, n in events))
    t_start = time.monotonic()
    for th in (*threads.values(), bl):
        th.start()
    timer = threading.Timer(args.phase_s, stop.set)  # the phase ends on time, whatever the chaos does
    timer.start()
    # the faults run here: Cluster.add_node installs signal handlers, which only the main thread may
    chaos(cluster.address, nodes, events, args, t_start, notices, log, done)
    while not stop.is_set():
        time.sleep(0.5)
    wall = time.monotonic() - t_start
    for th in (*threads.values(), bl):
        th.join(args.step_s + 70)
        if th.is_alive():
            say(f"{kind}: thread {th.name} still in a call {args.step_s + 70:.0f}s after the stop; counted as it stands")
    if len(log) < len(events):
        say(f"{kind}: only {len(log)} of {len(events)} events completed")
    baseline = max(1, bl.steps)
    for arm, th in threads.items():
        kept = th.kept()
        rs = th.restore_s
        results.append({
            "arm": arm, "schedule": kind, "wall_s": wall, "baseline_steps": bl.steps, "kept": kept,
            "made": th.made, "lost": max(0, th.made - kept), "goodput": kept / baseline,
            "restarts": th.restarts, "restore_s": sum(s for _, s in rs), "restore_tiers": [t for t, _ in rs],
            "down_s": th.down_s, "save_pause_med_s": statistics.median(th.save_pause) if th.save_pause else None,
            "saves": len(th.save_pause), "save_errors": th.save_errors, "restore_failed": th.restore_failed,
            "stuck": th.stuck, "events": len(log)})
        costs["pauses"].setdefault(arm, []).extend(th.save_pause)
        costs["restores"].extend(rs)
        costs["detect"].extend(th.detect_s)
        costs["notice_seen"].extend(v for v in th.notice_seen.values() if v is not None)
        costs["notice_saved"].extend(th.notice_saved)
        if arm == "rc_every":
            say(f"{kind}/rc_every status: preemption={_status(engines['rc_every']).get('preemption')}")
    costs["step"].extend(bl.step_times)
    say(f"phase {kind}: baseline {bl.steps} steps; " + "; ".join(
        f"{r['arm']} kept {r['kept']} ({100 * r['goodput']:.0f}%)" for r in results if r["schedule"] == kind))
    for arm, e in engines.items():
        try:
            bounded(f"{arm} shutdown", lambda e=e: e.shutdown(timeout=30), 60)
        except Exception as exc:  # noqa: BLE001
            say(f"{kind}/{arm}: shutdown: {type(exc).__name__}: {str(exc)[:200]}")
    for a in (*learners.values(), base):
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001
            pass
    time.sleep(2.0)


def _status(engine):
    try:
        return bounded("status", engine.status, 20)
    except Exception as exc:  # noqa: BLE001
        return {"error": repr(exc)}


def med(xs):
    return round(statistics.median(xs), 3) if xs else None


COSTS = {"toy": "goodput_costs.json", "rllib": "goodput_costs_rllib.json"}  # each job's measured costs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--job", choices=("toy", "rllib"), default="toy",
                    help="toy: the demo learner (--mb of state, --step-s a step); rllib: DQN on CartPole "
                         "(RLlibLearner), a step is one train()")
    ap.add_argument("--replace-at-removal", action="store_true",
                    help="ask for a noticed node's replacement only when it is removed (default: at the notice)")
    ap.add_argument("--mb", type=int, default=None)
    ap.add_argument("--phase-s", type=float, default=None)
    ap.add_argument("--events", type=int, default=None)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--step-s", type=float, default=None)
    ap.add_argument("--notice-s", type=int, default=15)
    ap.add_argument("--replace-delay-s", type=float, default=5.0)
    ap.add_argument("--schedules", default=None, help="comma-separated: no-notice,notice,mixed")
    ap.add_argument("--seed", type=int, default=45)
    ap.add_argument("--start-s", type=float, default=8.0,
                    help="no event in a phase's first seconds. Each phase starts its arms' engines anew (on "
                         "2 cores their writer processes take the first ~10 s starting); a long job meets a "
                         "preemption in its first minute rarely. 8 s: the RESULTS table's runs")
    ap.add_argument("--costs", default=None, help="where the measured costs go (default: "
                    "benchmarks/goodput_costs.json for the toy job, which goodput_sim.py reads by default, and "
                    "benchmarks/goodput_costs_rllib.json for the RLlib job; --quick writes none unless given)")
    ap.add_argument("--md", default=None, help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    # 64 MB: at 128 MB every 0.5 s, this 2-core machine could not keep the every-step arm's
    # replicas and the uploads up with the saves (see RESULTS); the default run steps once a second
    if args.costs is None and not args.quick:  # a smoke run never replaces the measured costs
        args.costs = os.path.join(HERE, COSTS[args.job])
    args.mb = args.mb or 64
    args.step_s = args.step_s or (0.5 if args.quick else 1.0)
    args.phase_s = args.phase_s or (100.0 if args.quick else 300.0)
    args.events = args.events or (1 if args.quick else 3)
    kinds = (args.schedules or ("no-notice,notice" if args.quick else "no-notice,notice,mixed")).split(",")
    cmd = "python benchmarks/goodput.py " + " ".join(argv if argv is not None else sys.argv[1:])

    root = tempfile.mkdtemp(prefix="rc_goodput_")
    srv = S3Server(os.path.join(root, "s3")).start()
    store = max(512 * MB, 6 * args.mb * MB)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "object_store_memory": 512 * MB})
    spare = cluster.add_node(num_cpus=2, resources={"slot_base": 1}, labels={"zone": "spare"},
                             object_store_memory=max(store, 8 * args.mb * MB))
    nodes = Nodes(cluster, store, root)
    results, costs = [], {"pauses": {}, "restores": [], "detect": [], "notice_seen": [], "notice_saved": [],
                          "step": []}
    cal = {}
    try:
        for arm in ARMS:
            nodes.add(arm)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        say(f"cluster up: head + spare + {len(ARMS)} arm nodes (2 CPUs each); state {args.mb} MB; "
            f"step {args.step_s}s; cadence {args.every}; notice {args.notice_s}s; replacement after "
            f"{args.replace_delay_s}s")
        try:
            if args.job == "toy":  # the sim's costs: the toy job's
                cal = calibrate(args, root, srv, spare.node_id)
        except Exception:  # noqa: BLE001
            say(f"calibration failed: {traceback.format_exc(limit=3)}")
        for kind in kinds:
            run_phase(kind, args, root, srv, cluster, nodes, spare.node_id, results, costs)
            write_outputs(args, cmd, results, costs, cal, nodes)  # partial figures survive a later failure
    finally:
        try:
            ray.shutdown()
        finally:
            cluster.shutdown()
            srv.stop()
            shutil.rmtree(root, ignore_errors=True)
    write_outputs(args, cmd, results, costs, cal, nodes, final=True)
    return 0


def job_line(args) -> str:
    """What a step of the measured job is, for the costs' ``measured_on``."""
    if args.job == "rllib":
        return "RLlib DQN on CartPole, a step is one train(), its replay buffer saved by ray_ckpt's arms"
    return f"state {args.mb} MB float32, a step {args.step_s:g} s"


def write_outputs(args, cmd, results, costs, cal, nodes, final=False):
    by_tier = {}
    for tier, s in costs["restores"]:
        by_tier.setdefault(tier.split(":")[0], []).append(s)  # "peer:<holder>" (RLlib's resume report) is "peer"
    for tier in ("local", "remote"):
        if tier in cal and cal[tier][0] == tier:
            by_tier.setdefault(tier, []).append(cal[tier][1])
    rc_pauses = costs["pauses"].get("ray_ckpt", [])
    out = {
        "save_pause_s": med(rc_pauses) or cal.get("save_pause_s"),
        "restore_s": {t: med(by_tier.get(t, [])) for t in ("local", "peer", "remote")},
        "notice_to_saved_s": med(costs["notice_saved"]),
        "replace_node_s": med(nodes.replace_s),
        "step_s": med(costs["step"]),
        "framework_save_pause_s": med(costs["pauses"].get("framework", [])) or cal.get("framework_save_pause_s"),
        "measured_on": (f"{platform.node()}: {os.cpu_count()} cores, "
                        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, shared with "
                        f"other work; ray.cluster_utils.Cluster on one machine (loopback S3, one disk); "
                        f"{job_line(args)}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cmd}"),
        "notes": {
            "save_pause_s": "ray_ckpt arm, median over its saves under faults: the engine.save() call plus what "
                            "the next step took beyond the baseline's median step (the learner serves the "
                            "capture first)",
            "save_pause_every_step_s": med(costs["pauses"].get("rc_every", [])),
            "restore_s": "median engine.restore() per tier it read from; local and remote include a quiet "
                         "calibration restore; framework torch.load not included",
            "notice_to_saved_s": ("from `ray drain-node` returning until the run lists a version of an iteration "
                                  "after the one finished at the drain (the callback's save for the notice, both "
                                  "ray_ckpt arms)" if args.job == "rllib" else
                                  "from `ray drain-node` returning to the save made by save_if_preempted() "
                                  "committed (both ray_ckpt arms)"),
            "time_to_notice_s": med(costs["notice_seen"]),
            "detect_s": med(costs["detect"]),
            "replace_node_s": "Cluster.add_node() of a replacement (2 CPUs) until it is registered alive",
            "framework_save_pause_s": "median blocking torch.save + fsync to the shared dir",
            "calibration": {k: v for k, v in cal.items()},
        },
    }
    if args.costs:
        with open(args.costs, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    lines = ["| schedule | arm | goodput % | steps kept | baseline steps | steps lost | restarts | time restoring s "
             "| restore tiers | down s (each loss) | save pause med s (saves) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        pause = "—" if r["save_pause_med_s"] is None else f"{r['save_pause_med_s']:.3f} ({r['saves']})"
        note = " STUCK" if r["stuck"] else ""
        note += f" restore failed x{r['restore_failed']}" if r["restore_failed"] else ""
        note += f" save errors x{r['save_errors']}" if r["save_errors"] else ""
        lines.append(f"| {r['schedule']} | {r['arm']}{note} | {100 * r['goodput']:.1f} | {r['kept']} | "
                     f"{r['baseline_steps']} | {r['lost']} | {r['restarts']} | {r['restore_s']:.2f} | "
                     f"{','.join(r['restore_tiers']) or '—'} | {', '.join(f'{d:.0f}' for d in r['down_s']) or '—'} | "
                     f"{pause} |")
    table = "\n".join(lines)
    if final:
        print("\n" + table + "\n", flush=True)
        print(f"costs -> {args.costs or '(not written: --quick)'}:\n" + json.dumps(out, indent=2), flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n\n```json\n" + json.dumps(out, indent=2) + "\n```\n")
            f.write("\n<!-- raw -->\n```json\n" + json.dumps(results, indent=1, default=str) + "\n```\n")


if __name__ == "__main__":
    raise SystemExit(main())
