"""Preemption across nodes, on a real multi-node Ray cluster on one machine (ray.cluster_utils.Cluster).

Run by tests/test_multinode.py in its own process (a Cluster needs its own ray.init). Prints
"MULTINODE OK" and exits 0 when every check holds; an AssertionError otherwise.

  1. the learner runs on node A; its critical writer runs on A too (files land in A's local tier);
  2. the version is committed remotely; node A is removed (preemption);
  3. the learner restarts on node B, whose local tier lacks the version: restore reads the remote
     tier, the report says "remote", and training continues bit-identically;
  4. a node C left without CPU for a writer: its learner's state is written by writers elsewhere
     within a bound, and status() names the node (never a silent hang).
"""
import os
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
    """Each line with the seconds since start: where a slow run spends its time."""
    print(f"[{time.monotonic() - T0:5.1f}s] {msg}", flush=True)


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="rc_multinode_")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    node_a = cluster.add_node(num_cpus=1, resources={"learner_slot": 1})
    node_b = cluster.add_node(num_cpus=1, resources={"learner_slot": 1})
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        say("cluster of 3 nodes up")
        a, b = node_a.node_id, node_b.node_id

        # a state over 100 KB lives in the object store of the learner's node (smaller ones are inlined
        # into the owner's memory, and any writer is as close to them as another)
        learner = remote(Learner, max_restarts=1, resources={"learner_slot": 1},
                         scheduling_strategy=NodeAffinitySchedulingStrategy(a, soft=True)).remote(seed=11, hidden=8192)
        # the uninterrupted run, trained here while the learner's process starts (a reference actor
        # would be one more torch process to start on 2 cores); one thread, as in a Ray worker
        # (num_cpus < 1: OMP_NUM_THREADS=1), so that the float sums run in the same order
        torch.set_num_threads(1)
        reference = Learner(seed=11, hidden=8192)
        reference.train(5)
        expected = reference.snapshot()
        say("reference trained in the driver")
        # one critical writer per node and no best-effort pool (nothing best-effort is registered):
        # every writer is a process to start, and each node's pool is what this scenario is about
        engine = rc.CheckpointEngine.create("multinode", local_dir=os.path.join(root, "local", "{node_id}"),
                                            remote_uri="file://" + os.path.join(root, "remote"),
                                            critical_writers=1, best_effort_writers=0, writer_placement_s=5)
        assert ray.get(learner.node.remote()) == a
        for name in ("policy", "optimizer", "rng"):
            engine.register(name, learner)
        ray.get(learner.train.remote(2))
        result = engine.save(2).wait(timeout=120, durability="remote")
        assert result.durability == "remote", result
        on_a = os.path.join(root, "local", a[:12], "multinode", "v000000000002", "policy", "rank0.safetensors")
        written = sorted(os.path.relpath(os.path.join(d, f), root)
                         for d, _, fs in os.walk(os.path.join(root, "local")) for f in fs)
        assert os.path.exists(on_a), (f"critical writer did not write on the learner's node: {on_a} missing; "
                                      f"files: {written}; status: {engine.status()}")
        head = ray.get_runtime_context().get_node_id()
        say(f"saved version 2 on node A ({a[:12]}) and uploaded it; coordinator on "
              f"{engine.status()['node'][:12]}, head {head[:12]}, "
              f"writers {engine.status()['writer_nodes']}")
        # the coordinator lives on the head node: a worker's preemption never takes it (and the
        # saves it holds) down
        assert engine.status()["node"] == head, (engine.status()["node"], head)
        coordinator_started = engine.status()["started_at"]

        cluster.remove_node(node_a)  # preemption of node A
        say("node A removed")
        deadline = time.time() + 120
        while True:
            try:
                if ray.get(learner.node.remote(), timeout=20) == b:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                    ray.exceptions.GetTimeoutError):
                pass
            assert time.time() < deadline, "learner was not restarted on node B"
            time.sleep(0.2)
        say(f"learner restarted on node B ({b[:12]})")
        report = engine.restore()
        say(report)
        assert report.version == 2
        for name, st in report.states.items():
            assert st.status == "restored" and st.verified, (name, st)
        # the large states were written on A's disk, which is gone: B reads them from the remote tier
        # (the small "rng" state was inlined in the driver's memory and written on the coordinator's node)
        assert report.states["policy"].tier == "remote" and report.states["optimizer"].tier == "remote", report
        ray.get(learner.train.remote(3))
        got = ray.get(learner.snapshot.remote())
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), \
            "training after the cross-node restore differs from the uninterrupted run"
        assert engine.save(5).wait(timeout=120).version == 5  # saving works on the new node
        status = engine.status()
        assert (status["node"], status["started_at"]) == (head, coordinator_started), status  # never restarted

        # 4. a node with no CPU left for a writer (critical_cpus=0.25): its learner's state is written,
        #    once writer_placement_s has passed, by the head node's writers reading it over the network
        node_c = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        c = node_c.node_id
        on_c = NodeAffinitySchedulingStrategy(c, soft=False)
        learner_c = remote(Learner, num_cpus=0.1, scheduling_strategy=on_c).remote(seed=5, hidden=8192)
        hog = remote(Learner, num_cpus=0.9, scheduling_strategy=on_c).remote()
        assert ray.get([learner_c.node.remote(), hog.node.remote()], timeout=120) == [c, c]
        engine.register("policy_c", rc.actor_method(learner_c, "model"))
        t = time.monotonic()
        assert engine.save(6).wait(timeout=120).version == 6
        unplaced = engine.status()["unplaced_writers"]
        assert c[:12] in unplaced and "num_cpus=0.25" in unplaced[c[:12]], unplaced
        say(f"node C has no CPU for a writer: version 6 committed in {time.monotonic() - t:.1f}s by writers "
            f"elsewhere ({unplaced[c[:12]]})")
        # ... and once the node has a CPU free again, a later attempt places its writers (the first
        # after 2 x writer_placement_s): its learner's state is written on its own disk again
        ray.kill(hog)
        step, deadline = 7, time.monotonic() + 120
        while c[:12] in engine.status()["unplaced_writers"]:
            assert time.monotonic() < deadline, f"node C's writers were never placed again: {engine.status()}"
            assert engine.save(step).wait(timeout=120).version == step
            step += 1
            time.sleep(0.5)
        assert engine.save(step).wait(timeout=120).version == step
        on_c_disk = os.path.join(root, "local", c[:12], "multinode", f"v{step:012d}", "policy_c", "rank0.safetensors")
        assert os.path.exists(on_c_disk) and c[:12] in engine.status()["writer_nodes"], engine.status()
        say(f"node C's writers placed again after its CPU was freed; version {step} written on its disk")
        engine.shutdown()
        say("MULTINODE OK")
        return 0
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
