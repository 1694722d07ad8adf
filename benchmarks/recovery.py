"""Recovery after a lost node: a state restored from a peer replica vs the local tier vs the remote
tier (a real S3-compatible server on 127.0.0.1), and the versions a node loss costs with and
without peer replicas, on a multi-node Ray cluster on this machine (ray.cluster_utils.Cluster).

    python benchmarks/recovery.py [--mb 1024] [--out benchmarks/RESULTS.md]

One learner actor holds ``--mb`` MB of float32 state on node A. Two runs save it at steps 1..7,
``remote_every=5`` (step 5 is uploaded to S3, 6 and 7 are not), ``keep_last=3``:
``repl`` with ``peer_replicas=1``, ``norepl`` without. Then:

1. local:  the learner's process is killed; Ray restarts it on A; ``repl.restore()`` reads A's disk;
2. peer:   node A is removed and its disk deleted; a new node D joins; the learner restarts there;
           ``repl.restore()`` reads version 7 from a peer replica;
3. remote: on D, ``norepl.restore()``: 6 and 7 were on A's disk only, so the newest it lists is 5,
           read from S3.

"node lost -> training" is from the node's removal (or the kill) to the end of the first training
step after the restore: it includes the new node joining and the actor's restart, which on a real
cluster depend on the autoscaler and the image, not on ray_ckpt. Every read goes over loopback here.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time

import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import ray_ckpt as rc  # noqa: E402
from s3server import S3Server  # noqa: E402


@ray.remote(max_restarts=-1, num_cpus=0.5, resources={"learner_slot": 1})
class Learner:
    def __init__(self, mb: int):
        self.t = torch.zeros(mb * (1 << 20) // 4)
        self.steps = 0

    def train(self) -> int:
        self.t.add_(1.0)
        self.steps += 1
        return self.steps

    def ckpt_get_state(self, name):
        return {"w": self.t, "steps": self.steps}

    def ckpt_set_state(self, name, state):
        self.t, self.steps = state["w"], state["steps"]

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()


def until(what, check, timeout=300.0, every=0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        time.sleep(every)


def node_of(actor, old_pid=None):
    """The actor's node once it answers from a process other than ``old_pid`` (a kill is async)."""
    try:
        if old_pid is not None and ray.get(actor.pid.remote(), timeout=30) == old_pid:
            return None
        return ray.get(actor.node.remote(), timeout=30)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
        return None


def recover(engine, learner, expect_steps: int, t_lost: float, step: int = -1) -> dict:
    t = time.perf_counter()
    report = engine.restore(step=step)
    restore_s = time.perf_counter() - t
    assert ray.get(learner.train.remote(), timeout=120) == expect_steps + 1, "restored the wrong step"
    st = report.states["policy"]
    assert st.status == "restored" and st.verified, st
    return {"version": report.version, "tier": str(st.tier), "restore_s": restore_s,
            "to_training_s": time.perf_counter() - t_lost, "bytes": st.bytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="rc_recovery_")
    srv = S3Server(os.path.join(root, "s3")).start()
    store = max(2 << 30, 4 * args.mb << 20)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "object_store_memory": store})
    node_a = cluster.add_node(num_cpus=1, resources={"learner_slot": 1}, object_store_memory=store)
    cluster.add_node(num_cpus=1, object_store_memory=store)
    rows, lost = [], {}
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        a = node_a.node_id
        learner = Learner.options(scheduling_strategy=NodeAffinitySchedulingStrategy(a, soft=True)).remote(args.mb)
        engines = {}
        for name, replicas in (("repl", 1), ("norepl", 0)):
            engines[name] = rc.CheckpointEngine.create(
                name, local_dir=os.path.join(root, "local", "{node_id}"), remote_uri=srv.uri("runs"),
                remote_options=srv.options, critical_writers=1, best_effort_writers=0, keep_last=3, remote_every=5,
                peer_replicas=replicas, peer_memory_mb=3 * args.mb)
            engines[name].register("policy", learner)
        assert node_of(learner) == a
        for step in range(1, 8):
            ray.get(learner.train.remote())
            handles = {n: e.save(step) for n, e in engines.items()}
            for h in handles.values():
                h.wait(timeout=600, durability="remote" if step == 5 else "local")
        handles["repl"].wait(timeout=600, durability="replicated")
        for e in engines.values():
            e.wait_until_finished()
            assert [m.version for m in e.list_checkpoints() if "remote" in m.tiers] == [5], e.list_checkpoints()
        print(f"saved steps 1..7 of {args.mb} MB in both runs; repl v7 held by {engines['repl'].status()['replicas'][7]}",
              flush=True)

        # 1. local: the process goes, the node stays
        old = ray.get(learner.pid.remote())
        pid_lost = time.perf_counter()
        ray.kill(learner, no_restart=False)
        until("the learner restarted on A", lambda: node_of(learner, old) == a)
        rows.append(("local (same node, process restarted)", recover(engines["repl"], learner, 7, pid_lost)))

        # 2. peer: node A and its disk go; a new node joins
        t_lost = time.perf_counter()
        cluster.remove_node(node_a)
        shutil.rmtree(os.path.join(root, "local", a[:12]), ignore_errors=True)
        node_d = cluster.add_node(num_cpus=1, resources={"learner_slot": 1}, object_store_memory=store)
        d = node_d.node_id
        until("the learner restarted on D", lambda: node_of(learner) == d)
        # the coordinator's second copy of A's files (sent when A was lost) is done before the read
        # is timed: on a real cluster a replacement node takes longer to join than that copy
        until("version 7 held twice again", lambda: len(engines["repl"].status()["replicas"].get(7, ())) >= 2)
        rows.append(("peer replica (node lost)", recover(engines["repl"], learner, 7, t_lost)))
        until("norepl's lost versions reported", lambda: len(engines["norepl"].status()["skipped_versions"]) >= 2)
        # 3. remote: the run without replicas lists 5 as its newest; read from S3
        t_remote = time.perf_counter()
        rows.append(("remote tier, S3 on loopback (node lost)", recover(engines["norepl"], learner, 5, t_remote)))
        rows[-1][1]["to_training_s"] = None  # the node loss was counted by the peer row
        for n, e in engines.items():
            listed = [m.version for m in e.list_checkpoints()]
            lost[n] = (max(listed), sorted(e.status()["skipped_versions"]))
        for e in engines.values():
            e.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)

    local_s = rows[0][1]["restore_s"]
    remote_s = rows[2][1]["restore_s"]
    lines = [f"`python benchmarks/recovery.py --mb {args.mb}` — {platform.node()}, {os.cpu_count()} cores, "
             f"4 Ray nodes on one machine (loopback), state {args.mb} MB",
             "",
             "| restore from | version | tier | restore s | GB/s | vs local | vs remote | node lost -> training s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for what, r in rows:
        gbs = r["bytes"] / r["restore_s"] / 1e9
        total = "—" if r["to_training_s"] is None else f"{r['to_training_s']:.1f}"
        lines.append(f"| {what} | {r['version']} | {r['tier']} | {r['restore_s']:.2f} | {gbs:.2f} | "
                     f"{r['restore_s'] / local_s:.2f}x | {r['restore_s'] / remote_s:.2f}x | {total} |")
    lines += ["", "| run | newest restorable after losing node A | steps rolled back | versions unlisted |",
              "| --- | --- | --- | --- |"]
    for n, (newest, unlisted) in lost.items():
        lines.append(f"| {n} (peer_replicas={1 if n == 'repl' else 0}) | {newest} | {7 - newest} | {unlisted or '—'} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
