"""Peer replicas on a real multi-node Ray cluster on one machine (ray.cluster_utils.Cluster).

Run by tests/test_peer_replicas.py in its own process (a Cluster needs its own ray.init). Prints
"PEER OK" and exits 0 when every check holds; an AssertionError otherwise.

  1. 3 nodes (head H, A with the learner, B), ``peer_replicas=1``, ``remote_every=5``: versions 1..7
     are saved; 7 is never uploaded; ``wait(durability="replicated")`` returns once another node's
     holder has its files, and the version is listed on the "peer" tier;
  2. node A is removed and its local disk deleted: versions 5 (uploaded), 6 and 7 (held by peers)
     stay listed; 1-4, on A's disk only, are reported lost and no longer listed; the coordinator
     sends a second copy of A's files of 6 and 7 to another node;
  3. a new node D joins (the learner restarts there); node B is removed too: version 7 is held again
     by live holders (listed on "peer");
  4. restore on D: version 7, bit-exact with an uninterrupted run, read from a peer replica (the
     report says ``tier="peer"`` and the holder's node);
  5. a holder's process is killed: Ray restarts it empty, the coordinator notices and sends the
     newest versions to it again;
  6. version 8 is saved on D: the holders drop 6 (peer_keep=2), its last copies (A's disk is
     gone): 6 is reported lost too. The coordinator is killed and restarted by Ray: versions 1-4
     and 6 (recorded lost on H's disk) are still not listed; the holders outlived it: at the next
     save (9) it adopts their copies of 7 and 8, and 7, dropped by the holders for 9, is reported
     lost as it would have been without the restart (its manifest says A wrote it);
  7. a node E joins, node D (which wrote 8 before the restart) is removed with its disk: the
     restarted coordinator knows from 8's manifest that D held its files, and sends 8 a second
     copy from the surviving one, as it would have without the restart; 8 and 9 stay listed.
     ``shutdown()`` stops the holders.
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

T0 = time.monotonic()


def say(msg) -> None:
    print(f"[{time.monotonic() - T0:5.1f}s] {msg}", flush=True)


def until(what, check, timeout=120.0, every=0.3):
    """``check()``'s first truthy value within ``timeout`` seconds; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s"
        time.sleep(every)


def tiers_of(engine, version):
    return next((m.tiers for m in engine.list_checkpoints() if m.version == version), ())


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="rc_peer_")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    node_a = cluster.add_node(num_cpus=1, resources={"learner_slot": 1})
    node_b = cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        a, b = node_a.node_id, node_b.node_id
        head = ray.get_runtime_context().get_node_id()
        say("cluster of 3 nodes up")
        # states over 100 KB live in the object store of the learner's node: written on A's disk
        learner = remote(Learner, max_restarts=1, resources={"learner_slot": 1},
                         scheduling_strategy=NodeAffinitySchedulingStrategy(a, soft=True)).remote(seed=3, hidden=8192)
        torch.set_num_threads(1)  # as in a Ray worker: the float sums run in the same order
        reference = Learner(seed=3, hidden=8192)
        reference.train(7)
        expected = reference.snapshot()
        engine = rc.CheckpointEngine.create("peer", local_dir=os.path.join(root, "local", "{node_id}"),
                                            remote_uri="file://" + os.path.join(root, "remote"),
                                            critical_writers=1, best_effort_writers=0, writer_placement_s=90,
                                            peer_replicas=1, remote_every=5)
        assert ray.get(learner.node.remote(), timeout=120) == a
        for name in ("policy", "optimizer", "rng"):
            engine.register(name, learner)
        handles = {}
        for step in range(1, 8):
            ray.get(learner.train.remote(1))
            handles[step] = engine.save(step)
        # the newest peer_keep=2 versions held by a peer (sends go newest first: 7 may be held before 6)
        for step in (7, 6):
            result = handles[step].wait(timeout=120, durability="replicated")
            assert result.version == step and result.durability == "replicated", result
        engine.wait_until_finished()
        assert tiers_of(engine, 7) == ("local", "peer"), engine.list_checkpoints()
        held = engine.status()["replicas"][7]
        # the command line shows them too, asking the live coordinator (storage cannot say)
        import contextlib
        import io

        from ray_ckpt.cli.main import main as cli

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli(["ls", os.path.join(root, "local", head[:12], "peer"), "--ray-address", "auto"]) == 0
        row7 = next(line for line in out.getvalue().splitlines() if line.split()[:1] == ["7"])
        assert "REPLICAS" in out.getvalue() and all(n in row7 for n in held), out.getvalue()
        assert set(held) - {a[:12]}, (held, a[:12])  # A's own files are held elsewhere (A may hold H's)
        on_a = os.path.join(root, "local", a[:12], "peer", "v000000000007", "policy", "rank0.safetensors")
        assert os.path.exists(on_a), "the learner's state was not written on its own node"
        say(f"7 versions saved; version 7 (not uploaded) is on A's disk and held by {held}")

        cluster.remove_node(node_a)
        shutil.rmtree(os.path.join(root, "local", a[:12]))
        say("node A removed, its disk deleted")
        # A's files lost their disk copy: a second holder gets them (H and B both hold them)
        until("a second copy of A's files after A was lost",
              lambda: set(engine.status()["replicas"].get(7, ())) >= {head[:12], b[:12]})
        status = engine.status()
        # versions 1-4: on A's disk only (not uploaded: remote_every=5; older than the newest
        # peer_keep=2 the holders keep): reported lost, no longer listed; 5 (remote), 6 and 7 (peers) are
        lost = status["skipped_versions"]
        assert sorted(lost) == [1, 2, 3, 4] and all("lost with node " + a[:12] in why for why in lost.values()), status
        # its writers went with it: no later retention pass asks them to delete anything
        assert a[:12] not in status["writer_nodes"], status["writer_nodes"]
        assert [m.version for m in engine.list_checkpoints()] == [5, 6, 7], engine.list_checkpoints()
        assert tiers_of(engine, 5) == ("local", "remote") and "peer" in tiers_of(engine, 6), engine.list_checkpoints()
        say(f"version 7 re-replicated: held by {status['replicas'][7]}; versions 1-4 reported lost")
        out = io.StringIO()  # their manifests are still on H's disk: storage alone says they are lost
        with contextlib.redirect_stdout(out):
            assert cli(["ls", os.path.join(root, "local", head[:12], "peer")]) == 0
        status_of = {line.split()[0]: line.split()[-1] for line in out.getvalue().splitlines() if line[:1].isdigit()}
        assert [status_of[str(v)] for v in range(1, 8)] == ["lost"] * 4 + ["complete"] * 3, out.getvalue()

        node_d = cluster.add_node(num_cpus=1, resources={"learner_slot": 1})
        cluster.wait_for_nodes()
        d = node_d.node_id
        until("the learner restarted on node D", lambda: _node_of(learner) == d, timeout=180)
        cluster.remove_node(node_b)
        say("learner restarted on D; node B removed")
        until("version 7 held by live replicas again after B was lost",
              lambda: "peer" in tiers_of(engine, 7) and b[:12] not in engine.status()["replicas"].get(7, ()))
        say(f"version 7 held by {engine.status()['replicas'][7]}")

        report = engine.restore()
        say(report)
        assert report.version == 7, report
        for name in ("policy", "optimizer"):
            st = report.states[name]
            assert st.status == "restored" and st.verified and st.tier == rc.TierName.PEER and st.node, (name, st)
        got = ray.get(learner.snapshot.remote())
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), \
            "the state restored from the peer replica differs from the uninterrupted run"
        # 5. a holder's process dies (Ray restarts it, empty): the coordinator sees it and sends again
        from ray_ckpt.capture.peer_reads import holder_handles

        key = engine.status()["replicas"][7][0]
        ray.kill(holder_handles("peer")[key], no_restart=False)
        def held_again():
            try:
                return 7 in ray.get(holder_handles("peer")[key].index.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                return False  # still restarting

        until("version 7 held again after a holder restarted",
              lambda: held_again() and key in engine.status()["replicas"].get(7, ()) and "peer" in tiers_of(engine, 7))
        say(f"holder {key} restarted empty; version 7 sent to it again")
        with_lost = engine.status()["skipped_versions"]
        assert sorted(with_lost) == [1, 2, 3, 4], with_lost  # B's loss cost nothing more
        # 6. version 8 saved on D: the holders keep the newest 2, so 6 (A's) now exists nowhere
        ray.get(learner.train.remote(1))
        assert engine.save(8).wait(timeout=120, durability="replicated").version == 8
        assert os.path.exists(os.path.join(root, "local", d[:12], "peer", "v000000000008", "policy", "rank0.safetensors"))
        from ray_ckpt.storage.checkpoint_io import read_manifest
        from ray_ckpt.storage.tier import Tier

        m8 = read_manifest(Tier(os.path.join(root, "local", head[:12], "peer")), 8)
        assert {f.node for f in m8.states["policy"].all_files()} == {d}, m8  # the manifest names D
        until("version 6 reported lost once the holders dropped it",
              lambda: sorted(engine.status()["skipped_versions"]) == [1, 2, 3, 4, 6])
        # the coordinator restarts (Ray restarts it by name, it rebuilds from storage): 1-4 and 6 stay unlisted
        from ray_ckpt.protocol import NAMESPACE, actor_name

        coordinator = ray.get_actor(actor_name("peer"), namespace=NAMESPACE)
        pid = _pid(coordinator)
        os.kill(pid, 9)  # its process dies (the head node's: this machine); Ray restarts it
        until("the restarted coordinator answering", lambda: _pid(coordinator) not in (None, pid), timeout=120)
        assert sorted(engine.status()["skipped_versions"]) == [1, 2, 3, 4, 6], engine.status()
        assert [m.version for m in engine.list_checkpoints()] == [5, 7, 8], engine.list_checkpoints()
        # ... and the holders (detached) outlived it: at the next save it adopts their copies of 8;
        # 7 (A's files), dropped by the holders for 9, now exists nowhere: reported lost
        ray.get(learner.train.remote(1))
        assert engine.save(9).wait(timeout=120, durability="replicated").version == 9
        until("version 7 reported lost once the holders dropped it after the restart",
              lambda: sorted(engine.status()["skipped_versions"]) == [1, 2, 3, 4, 6, 7])
        until("version 8 held by the adopted holders", lambda: "peer" in tiers_of(engine, 8))
        assert [m.version for m in engine.list_checkpoints()] == [5, 8, 9], engine.list_checkpoints()
        policy8 = m8.states["policy"].all_files()[0].path
        assert _holders_of(policy8, 8) == {head[:12]}, _holders_of(policy8, 8)  # D's file: held on H only
        say(f"coordinator restarted: versions 1-4 and 6 still reported lost, 7 lost when dropped; 8 adopted, "
            f"9 replicated: {engine.status()['replicas']}")
        # 7. D, which wrote 8 before the restart, is lost: 8 gets a second copy (its manifest says D held it)
        node_e = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        e = node_e.node_id
        cluster.remove_node(node_d)
        shutil.rmtree(os.path.join(root, "local", d[:12]))
        say("node E joined; node D removed, its disk deleted")
        until("a second copy of D's files of version 8 after D was lost",
              lambda: _holders_of(policy8, 8) == {head[:12], e[:12]})
        assert [m.version for m in engine.list_checkpoints()] == [5, 8, 9], engine.list_checkpoints()
        assert sorted(engine.status()["skipped_versions"]) == [1, 2, 3, 4, 6, 7], engine.status()
        say(f"version 8 re-replicated after the restart: held by {engine.status()['replicas'][8]}")
        engine.shutdown()
        until("the holders stopped with the run", lambda: not holder_handles("peer"), timeout=60)
        say("PEER OK")
        return 0
    finally:
        ray.shutdown()
        cluster.shutdown()


def _pid(actor):
    try:
        return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=10)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
        return None


def _holders_of(path, version):
    """The nodes (first 12 characters) whose live holder has ``path`` of ``version``."""
    from ray_ckpt.capture.peer_reads import holder_handles

    out = set()
    for key, holder in holder_handles("peer").items():
        try:
            if path in ray.get(holder.index.remote(), timeout=20).get(version, ()):
                out.add(key)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            continue  # a dead node's holder
    return out


def _node_of(actor):
    try:
        return ray.get(actor.node.remote(), timeout=20)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
