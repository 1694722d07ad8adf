"""Preemption notices on a real multi-node Ray cluster on one machine (ray.cluster_utils.Cluster),
drained with Ray's own ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``.

Run by tests/test_preemption.py in its own process (a Cluster needs its own ray.init). Prints
"PREEMPTION OK" and exits 0 when every check holds; an AssertionError otherwise.

Two runs, each with per-node local tiers and a remote tier it uploads to only every 100th save
(so without a notice, nothing of them is off their learner's node):

  run "evac": the learner on node A saves steps 1-7; A gets a 30 s notice. Every version is copied
      to the remote tier before the deadline; the trainer's save_if_preempted() saves step 8 at its
      next step, and step 9 once step 8 is off node A; A is removed at the end; the learner restarts
      on node B and restore() brings back step 9 bit-exact from the remote tier; step 7 is still
      listed and loads.
  run "peer": no remote tier; the same learner's steps 1-3 on node A's disk only. A's notice copies
      them to a replica holder on a node that stays; after A is gone, step 3 loads from it.
  run "short": the learner on node C saves 6 large versions, uploads throttled to 1 MB/s (none
      can land before the deadline); C gets a notice at the same time as A (two nodes drained at
      once). The newest version goes first: its upload lags, so it gets a replica on a node that
      stays as well and is kept; the others are reported lost, and once C is gone they are not
      listed; the newest loads bit-exact from the replica holder.
"""
import os
import subprocess
import sys
import tempfile
import time

import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ray_ckpt as rc  # noqa: E402
from actors import Learner, remote  # noqa: E402

T0 = time.monotonic()


def say(msg) -> None:
    print(f"[{time.monotonic() - T0:5.1f}s] {msg}", flush=True)


def drain(address: str, node: str, seconds: int) -> None:
    """Ray's own preemption drain (what the autoscaler does when the cloud warns)."""
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", address, "--node-id", node,
           "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot preemption (test)",
           "--deadline-remaining-seconds", str(seconds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def wait_for(what: str, check, timeout: float, show=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s {show()}"
        time.sleep(0.2)


def equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="rc_preempt_")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    node_a = cluster.add_node(num_cpus=1, resources={"learner_slot": 1})
    node_b = cluster.add_node(num_cpus=1, resources={"learner_slot": 1})
    node_c = cluster.add_node(num_cpus=1)
    stop_at_exit = None
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        a, b, c = node_a.node_id, node_b.node_id, node_c.node_id
        say("cluster of 4 nodes up")
        torch.set_num_threads(1)
        local = os.path.join(root, "local", "{node_id}")
        remote_uri = "file://" + os.path.join(root, "remote")
        learner = remote(Learner, max_restarts=1, resources={"learner_slot": 1},
                         scheduling_strategy=NodeAffinitySchedulingStrategy(a, soft=True)).remote(seed=3, hidden=8192)
        big = remote(Learner, num_cpus=0.2, scheduling_strategy=NodeAffinitySchedulingStrategy(c, soft=False)
                     ).remote(seed=4, hidden=262144)
        evac = rc.CheckpointEngine.create("evac", local_dir=local, remote_uri=remote_uri, remote_every=100,
                                          critical_writers=1, best_effort_writers=0, writer_placement_s=5)
        short = rc.CheckpointEngine.create("short", local_dir=local, remote_uri=remote_uri, remote_every=100,
                                           critical_writers=1, best_effort_writers=0, writer_placement_s=5,
                                           upload_max_mb_s=1.0)
        peer = rc.CheckpointEngine.create("peer", local_dir=local, critical_writers=1, best_effort_writers=0,
                                          writer_placement_s=5)
        assert ray.get([learner.node.remote(), big.node.remote()], timeout=120) == [a, c]
        peer.register("policy", learner)
        for name in ("policy", "optimizer", "rng"):
            evac.register(name, learner)
        for name in ("policy", "optimizer"):
            short.register(name, big)
        for step in range(1, 8):
            ray.get(learner.train.remote(1))
            evac.save(step).wait(timeout=120)
            if step <= 3:
                peer.save(step).wait(timeout=120)
            if step == 3:
                at_3 = {k[2:]: v for k, v in ray.get(learner.snapshot.remote()).items() if k.startswith("p.")}
        for step in range(1, 7):
            ray.get(big.train.remote(1))
            short.save(step).wait(timeout=120)
        short_6 = {k[2:]: v for k, v in ray.get(big.snapshot.remote()).items() if k.startswith("p.")}
        assert [m.tiers for m in evac.list_checkpoints()] == [("local",)] * 7, evac.list_checkpoints()
        assert evac.preemption() is None and evac.save_if_preempted(7) is None
        say("evac: steps 1-7 on node A's disk only; short: steps 1-6 (~22 MB each) on node C's disk only")

        # verl's driver: the run's notices forwarded into verl's own expiry check (a real verl function)
        from ray_ckpt.integrations.verl import forward_preemption_notices
        from verl.utils.checkpoint.checkpoint_manager import should_save_ckpt_esi
        forwarder = stop_at_exit = forward_preemption_notices(evac, poll_s=0.2)
        assert not should_save_ckpt_esi(max_steps_duration=5.0)

        # ---------------------------------------------------------------- two notices at once
        drain(cluster.address, a, 30)
        drain(cluster.address, c, 8)
        noticed = time.time()
        say("nodes A (30 s) and C (8 s) drained for preemption")
        n = wait_for("evac's notice", lambda: evac.preemption(max_age=0), 15)
        assert n.nodes == (a,) and 20 < n.seconds_left() <= 30, n
        assert "policy" in n.states and n.ranks["policy"] == (0,), n
        # the trainer's next step boundary: one more save, whatever the cadence
        ray.get(learner.train.remote(1))
        handle = evac.save_if_preempted(8)
        assert handle is not None and handle.wait(timeout=n.seconds_left()).step == 8
        assert evac.save_if_preempted(8) is None, "a step saved already"
        wait_for("verl's expiry check sees the notice", lambda: should_save_ckpt_esi(max_steps_duration=5.0), 5)
        assert forwarder.notices == 1, forwarder.notices
        n = wait_for("evac: every version moved", lambda: (lambda x: x if x and set(x.moved) >= set(range(1, 9))
                                                           else None)(evac.preemption(max_age=0)), 25)
        assert not n.lost and n.saved_step == 8 and not n.at_risk, n
        # step 8 is off node A: the trainer's next step boundary saves again, and that step is moved too
        ray.get(learner.train.remote(1))
        handle = evac.save_if_preempted(9)
        assert handle is not None and handle.wait(timeout=n.seconds_left()).step == 9, "no save after 8 was moved"
        n = wait_for("evac: step 9 moved", lambda: (lambda x: x if x and 9 in x.moved else None)(
            evac.preemption(max_age=0)), 25)
        assert not n.lost and n.saved_step == 9, n
        say(f"evac: moved {list(n.moved)} in {time.time() - noticed:.1f}s of 30; status: {evac.status()['preemption']}")
        expected = ray.get(learner.snapshot.remote())
        # an operator's view: ray-ckpt ls of the remote tier, asking the live coordinator for the notice
        ls = subprocess.run([sys.executable, "-m", "ray_ckpt.cli", "ls", os.path.join(root, "remote", "evac"),
                             "--ray-address", cluster.address], capture_output=True, text=True, timeout=120)
        assert ls.returncode == 0 and "preemption notice: node(s) " + a[:12] in ls.stdout, ls.stdout + ls.stderr
        assert "moved to safety: [1, 2, 3, 4, 5, 6, 7, 8, 9]" in ls.stdout, ls.stdout
        say("ray-ckpt ls --ray-address shows the notice:\n" + ls.stdout.strip().split("preemption")[-1])
        np_ = wait_for("peer: steps 1-3 copied to a holder", lambda: (lambda x: x if x and set(x.moved) >= {1, 2, 3}
                                                                      else None)(peer.preemption(max_age=0)), 25,
                       lambda: f"notice: {peer.preemption(max_age=0)}; status: {peer.status()}")
        say(f"peer (no remote tier): moved {list(np_.moved)} to replica holders {peer.status()['replicas']}")

        # the short deadline: let it pass, then the node goes
        wait_for("short: the deadline passed", lambda: time.time() > noticed + 9, 15)
        ns = wait_for("short's notice", lambda: short.preemption(max_age=0), 5)
        say(f"short at its deadline: {ns}")
        assert ns.moved == (6,) and sorted(ns.lost) == [1, 2, 3, 4, 5], f"the newest, as a replica, only: {ns}"
        cluster.remove_node(node_c)
        cluster.remove_node(node_a)
        say("nodes A and C removed at their deadlines")

        # ---------------------------------------------------------------- after the nodes are gone
        wait_for("short: lost versions unlisted", lambda: {m.step for m in short.list_checkpoints()}
                 == set(ns.moved), 30)
        skipped = short.status()["skipped_versions"]
        assert set(ns.lost) <= set(skipped), skipped
        status = wait_for("short: the notice ended", lambda: (lambda st: st if st["active"] is False else None)(
            short.status()["preemption"]), 30, lambda: short.status()["preemption"])
        assert status["lost"], status
        say(f"short: listed {[m.step for m in short.list_checkpoints()]}; lost {sorted(ns.lost)} not listed")
        got, rep = short.load("policy", step=6, with_report=True)
        assert rep.tier == "peer" and equal(got, short_6), f"step 6 from {rep.tier}: not the saved bytes"
        say(f"short: step 6 loads bit-exact from {rep.tier} (its upload never landed)")

        wait_for("the notice ended: verl's check is clear again", lambda: not should_save_ckpt_esi(5.0), 30)
        forwarder.stop()
        wait_for("learner restarted on node B", lambda: _node(learner) == b, 120)
        report = evac.restore()
        say(report)
        assert report.step == 9, report
        # from the remote tier, or from a replica holder where step 9's upload had not landed within
        # HEDGE_AFTER_S on this busy machine (the holders are read first: the nearer tier)
        assert all(report.states[n].tier == "remote" or report.states[n].tier == "peer"
                   for n in ("policy", "optimizer")), report
        assert equal(ray.get(learner.snapshot.remote()), expected), "restored state differs from the saved one"
        assert all("remote" in m.tiers for m in evac.list_checkpoints()), evac.list_checkpoints()
        assert evac.load("policy", step=7).keys() == expected_keys(expected)
        got = peer.load("policy", step=3)
        assert equal(got, at_3), "step 3 read back from the replica holder differs from the saved state"
        assert {m.step for m in peer.list_checkpoints()} == {1, 2, 3}, peer.list_checkpoints()
        say("peer: step 3 loads from a replica holder after node A is gone")
        evac.shutdown()
        short.shutdown()
        peer.shutdown()
        say("PREEMPTION OK")
        return 0
    finally:
        if stop_at_exit is not None:
            stop_at_exit.stop()
        ray.shutdown()
        cluster.shutdown()


def expected_keys(snapshot) -> set:
    return {k[2:] for k in snapshot if k.startswith("p.")}


def _node(actor):
    try:
        return ray.get(actor.node.remote(), timeout=20)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
