"""A damaged peer replica after a node loss, on a real multi-node Ray cluster on one machine.

Run by tests/test_peer_replicas.py in its own process (a Cluster needs its own ray.init). Prints
"DAMAGE OK" and exits 0 when every check holds; an AssertionError otherwise.

  1. 3 nodes (head H with the coordinator, A with the learner, B), ``peer_replicas=1``,
     ``remote_every=2``: steps 1, 2, 3 are saved on A's disk; 2 is uploaded; 3 is held by a peer
     replica and listed as ("local", "peer");
  2. the bytes of step 3's replica are damaged in its holder's memory (what a reader gets from
     that holder no longer matches the manifest);
  3. node A is removed and its disk deleted: step 3, whose last copy fails verification, leaves the
     list as soon as Ray's node table says A is dead, and ``status()["skipped_versions"]`` says why (its replica failed verification:
     checksum mismatch); step 1 (dropped by the holders, peer_keep=2) is lost with its own reason;
     step 2 stays listed (remote, and its replica verified);
  4. the learner restarts on a new node D; plain ``restore()`` restores step 2, bit-exact, and its
     report names step 3 as skipped with why.
"""
import os
import shutil
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
from peer_scenario import _node_of, say, until  # noqa: E402


def listed(engine):
    return {m.version: m.tiers for m in engine.list_checkpoints()}


def damage(holder, path):
    """Flip one byte of what holder serves for ``path`` (its memory copy and the object readers get)."""
    import numpy as np

    data = np.array(holder.store._memory[path], copy=True)
    data[len(data) // 2] ^= 0xFF
    ref = ray.put(data)
    holder.store._memory[path] = ray.get(ref)
    holder.refs[path] = ref
    return True


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="rc_damage_")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    node_a = cluster.add_node(num_cpus=1, resources={"learner_slot": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        a = node_a.node_id
        learner = remote(Learner, max_restarts=1, resources={"learner_slot": 1},
                         scheduling_strategy=NodeAffinitySchedulingStrategy(a, soft=True)).remote(seed=5, hidden=8192)
        engine = rc.CheckpointEngine.create("damage", local_dir=os.path.join(root, "local", "{node_id}"),
                                            remote_uri="file://" + os.path.join(root, "remote"),
                                            critical_writers=1, best_effort_writers=0, writer_placement_s=90,
                                            peer_replicas=1, remote_every=2)
        assert ray.get(learner.node.remote(), timeout=120) == a
        for name in ("policy", "optimizer", "rng"):
            engine.register(name, learner)
        for step in (1, 2, 3):
            ray.get(learner.train.remote(1))
            if step == 2:
                expected = ray.get(learner.snapshot.remote())
            h = engine.save(step)
            if step == 2:
                h.wait(timeout=120, durability="remote")
        assert h.wait(timeout=120, durability="replicated").version == 3
        engine.wait_until_finished()
        assert listed(engine)[3] == ("local", "peer"), listed(engine)
        say(f"steps 1-3 saved on A; listed {listed(engine)}; replicas {engine.status()['replicas']}")

        from ray_ckpt.capture.peer_reads import holder_handles
        from ray_ckpt.protocol import NAMESPACE, actor_name

        m3 = ray.get(ray.get_actor(actor_name("damage"), namespace=NAMESPACE).manifest.remote(3))
        policy3 = m3.states["policy"].all_files()[0].path
        damaged = []
        for key, holder in holder_handles("damage").items():
            if policy3 in ray.get(holder.index.remote(), timeout=30).get(3, ()):
                assert ray.get(holder.__ray_call__.remote(damage, policy3), timeout=30)
                damaged.append(key)
        assert damaged, "no holder held step 3"
        assert listed(engine)[3] == ("local", "peer")  # A (the writer) lives: its disk copy is good
        say(f"step 3's replica of {policy3} damaged on {damaged}")

        t0 = time.monotonic()
        cluster.remove_node(node_a, allow_graceful=False)  # lost, not stopped: Ray learns it by health checks
        shutil.rmtree(os.path.join(root, "local", a[:12]))
        seen: dict = {}

        def judged():  # when Ray's node table says A is dead, and when steps 1 and 3 leave the list
            now = time.monotonic() - t0
            if not any(n["NodeID"] == a and n["Alive"] for n in ray.nodes()):
                seen.setdefault("ray_knows", now)
            tiers = listed(engine)
            if "ray_knows" in seen and now > seen["ray_knows"] + 1.5:  # listed as local while its disk is gone
                assert 1 not in tiers and 3 not in tiers, f"{now:.1f}s: {tiers}"
            return 1 not in tiers and 3 not in tiers

        until("steps 1 and 3 unlisted after A was lost", judged, every=0.1)
        unlisted_s = time.monotonic() - t0
        until("steps 1 and 3 judged lost", lambda: {1, 3} <= set(engine.status()["skipped_versions"]))
        status = engine.status()
        why3, why1 = status["skipped_versions"][3], status["skipped_versions"][1]
        assert "lost with node " + a[:12] in why3 and "failed verification" in why3 and "checksum mismatch" in why3, why3
        assert "dropped it" in why1 and "peer_keep=2" in why1, why1
        assert "no live peer replica" not in why3 + why1
        tiers = listed(engine)
        assert sorted(tiers) == [2] and "remote" in tiers[2], tiers
        say(f"A removed: Ray listed it dead after {seen['ray_knows']:.1f}s, steps 1 and 3 unlisted after "
            f"{unlisted_s:.1f}s; why: {why3!r}; step 1: {why1!r}; listed {tiers}")

        cluster.add_node(num_cpus=1, resources={"learner_slot": 1})
        cluster.wait_for_nodes()
        until("the learner restarted on a new node", lambda: _node_of(learner) not in (None, a), timeout=180)
        report = engine.restore()  # plain: the newest listed version, which is the newest restorable
        say(report)
        assert report.version == 2 and 3 in report.skipped_versions, report
        assert "failed verification" in report.skipped_versions[3], report.skipped_versions
        for name in ("policy", "optimizer"):
            st = report.states[name]
            assert st.status == "restored" and st.verified and st.tier in (rc.TierName.PEER, rc.TierName.REMOTE), st
            assert isinstance(st.tier, rc.TierName) and (st.node is not None) == (st.tier == rc.TierName.PEER), st
        got = ray.get(learner.snapshot.remote())
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), \
            "the restored step 2 differs from the state saved at step 2"
        engine.shutdown()
        say("DAMAGE OK")
        return 0
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
