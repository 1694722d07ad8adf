"""Peer replicas (``create(..., peer_replicas=N)``): the holders' store without Ray, the holders and
the peer reads on the session's Ray instance, and the node-loss scenario on a real multi-node
cluster (``peer_scenario.py``, its own process)."""
import os
import subprocess
import sys
import uuid

import pytest
import ray

import ray_ckpt as rc
from ray_ckpt.capture.peer_reads import NAMESPACE, PeerCopies, holder_name
from ray_ckpt.config import EngineConfig
from ray_ckpt.errors import IntegrityError
from ray_ckpt.formats.checksum import digest
from ray_ckpt.formats.manifest import FileEntry
from ray_ckpt.storage.checkpoint_io import read_files
from ray_ckpt.storage.layout import peer_spill_dir
from ray_ckpt.storage.tier import Tier
from ray_ckpt.writers.replica_store import ReplicaStore
from ray_ckpt.writers.replicas import ReplicaHolder

HERE = os.path.dirname(os.path.abspath(__file__))


def entry(path: str, data: bytes) -> FileEntry:
    return FileEntry(path, len(data), digest(data))


def files_of(version: int, sizes):
    out = []
    for i, n in enumerate(sizes):
        data = bytes((version * 31 + i + k) % 251 for k in range(n))
        out.append((entry(f"v{version:012d}/policy/rank{i}.safetensors", data), data))
    return out


# ---------------------------------------------------------------------- the store, no Ray
def test_store_keeps_its_memory_budget_spills_the_rest_and_serves_both(tmp_path):
    store = ReplicaStore(budget=2500, keep=3, spill=Tier(str(tmp_path / "spill"), "peer-spill"))
    for v in (1, 2, 3):
        fs = files_of(v, [1000, 1000])
        store.put(v, [f for f, _ in fs], [d for _, d in fs])
        assert store.memory_bytes <= 2500
    usage = store.usage()
    assert usage.versions == (1, 2, 3) and usage.memory_bytes <= 2500 and usage.spilled_bytes == 6000 - usage.memory_bytes
    for v in (1, 2, 3):  # every file is served, from memory or from the spill directory
        for f, data in files_of(v, [1000, 1000]):
            assert bytes(store.get(f.path)) == data
            assert bytes(store.get_range(f.path, 10, 20)) == data[10:20]
    # a fourth version: the oldest goes (keep=3), its spilled files leave the disk too
    fs = files_of(4, [1000, 1000])
    store.put(4, [f for f, _ in fs], [d for _, d in fs])
    assert store.usage().versions == (2, 3, 4)
    assert store.get(files_of(1, [1000])[0][0].path) is None
    spilled = [p for _, _, names in os.walk(tmp_path / "spill") for p in names]
    assert len(spilled) * 1000 == store.usage().spilled_bytes


def test_store_refuses_bytes_that_do_not_match_the_manifest():
    store = ReplicaStore(budget=10_000, keep=2)
    (f, data), = files_of(1, [100])
    with pytest.raises(IntegrityError, match="does not match its manifest"):
        store.put(1, [f], [data[:-1] + b"\x00"])
    assert store.usage().files == 0 and store.get(f.path) is None


def test_store_without_disk_refuses_what_does_not_fit():
    store = ReplicaStore(budget=500, keep=2)
    (f, data), = files_of(1, [1000])
    with pytest.raises(IntegrityError, match="memory budget"):
        store.put(1, [f], [data])


def test_a_file_referenced_by_two_versions_is_stored_once_and_kept_while_one_holds_it():
    store = ReplicaStore(budget=10_000, keep=2)
    (f, data), = files_of(1, [300])
    store.put(1, [f], [data])
    store.put(2, [f], [data])  # a RELOADABLE state: version 2 refers to version 1's file
    assert store.usage().files == 1 and store.memory_bytes == 300
    table = FileEntry("v000000000002/replay/rank0.table0.arrow", 4, digest(b"abcd"), role="table")
    store.put(2, [f, table], [data, b"abcd"])
    assert store.entries(2) == [f, table]  # as the manifest lists them, role included (sent on to other holders)
    store.drop([2])
    store.put(2, [f], [data])
    store.drop([1])
    assert bytes(store.get(f.path)) == data
    store.drop([2])
    assert store.get(f.path) is None


def test_replication_sends_the_most_urgent_first_and_the_newest_version_first():
    """The replication's lock (no Ray): with version 1's sends under way and versions 2, 3 and 4
    waiting, a preemption's copy away of version 2 goes first, then 4, 3, 2 (not 2, 3, 4 as they
    arrived); a waiter cancelled while queued is skipped, and one cancelled as the lock came to it
    passes the lock on."""
    import asyncio

    from ray_ckpt.coordinator.priority_lock import PriorityLock

    async def scenario():
        lock, order = PriorityLock(), []
        gate = asyncio.Event()

        async def send(priority, name, hold=None):
            async with lock.hold(priority):
                order.append(name)
                if hold is not None:
                    await hold.wait()

        first = asyncio.ensure_future(send((0, 1), "v1", gate))
        await asyncio.sleep(0)
        waiters = [asyncio.ensure_future(send(p, n)) for p, n in
                   (((0, 2), "v2"), ((0, 3), "v3"), ((0, 5), "v5"), ((0, 4), "v4"), ((2, 2), "away v2"))]
        await asyncio.sleep(0)
        waiters[2].cancel()  # v5 gives up while queued
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *waiters, return_exceptions=True)
        assert order == ["v1", "away v2", "v4", "v3", "v2"] and not lock.locked

        # cancelled after the lock was handed to it, before it ran: the next waiter still gets it
        gate2, order2 = asyncio.Event(), []
        holder = asyncio.ensure_future(send((0, 1), "a", gate2))
        await asyncio.sleep(0)

        async def record(priority, name):
            async with lock.hold(priority):
                order2.append(name)

        x, y = asyncio.ensure_future(record((0, 9), "x")), asyncio.ensure_future(record((0, 8), "y"))
        await asyncio.sleep(0)
        gate2.set()
        await asyncio.sleep(0)  # holder released: x is handed the lock, not yet resumed
        x.cancel()
        await asyncio.gather(holder, x, y, return_exceptions=True)
        assert order2 == ["y"] and not lock.locked

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_peer_replicas_option_is_validated():
    with pytest.raises(ValueError, match="peer_replicas must be an integer >= 0"):
        EngineConfig("r", "/tmp/x", peer_replicas=-1)
    with pytest.raises(ValueError, match="peer_keep"):
        EngineConfig("r", "/tmp/x", peer_keep=0)
    with pytest.raises(ValueError, match="peer_memory_mb"):
        EngineConfig("r", "/tmp/x", peer_memory_mb="lots")


# ---------------------------------------------------------------------- holders, one node
@pytest.mark.timeout(120)
def test_a_corrupt_replica_is_refused_by_checksum_and_the_next_copy_is_read(ray_session, tmp_path):
    run = f"peer-{uuid.uuid4().hex[:6]}"
    cfg = EngineConfig(run, str(tmp_path / "local"), peer_replicas=1, peer_memory_mb=0)  # every file spills
    fs = files_of(7, [4000, 2000])
    holders = {key: ReplicaHolder.options(name=holder_name(run, key), namespace=NAMESPACE).remote(cfg, key)
               for key in ("nodeaaaaaaaa", "nodebbbbbbbb")}
    try:
        for h in holders.values():
            assert ray.get(h.hold.remote(7, [f for f, _ in fs], *[d for _, d in fs]), timeout=60) == 6000
        # the first holder's spilled copy of the first file is damaged on its disk
        spill = tmp_path / "local" / peer_spill_dir(run, "nodeaaaaaaaa") / fs[0][0].path
        raw = bytearray(spill.read_bytes())
        raw[100] ^= 0xFF
        spill.write_bytes(bytes(raw))
        peers = PeerCopies(run)
        bufs, used, problems = read_files([Tier(str(tmp_path / "empty"), "local"), peers], [f for f, _ in fs])
        assert [bytes(b) for b in bufs] == [d for _, d in fs]
        assert used.startswith("peer:")
        # the damaged copy was read first, refused, and the other holder's copy used
        assert peers.name == "peer:nodebbbbbbbb" or used == "peer:nodebbbbbbbb"
        usage = ray.get(holders["nodeaaaaaaaa"].usage.remote())
        assert usage.memory_bytes == 0 and usage.spilled_bytes == 6000  # a budget of 0: nothing in memory
        # both copies damaged: no good copy, named as such
        spill_b = tmp_path / "local" / peer_spill_dir(run, "nodebbbbbbbb") / fs[0][0].path
        spill_b.write_bytes(bytes(raw))
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            read_files([PeerCopies(run)], [fs[0][0]])
    finally:
        for h in holders.values():
            ray.kill(h)


@pytest.mark.timeout(120)
def test_replicated_durability_on_one_node_raises_naming_the_missing_peer(ray_session, tmp_path):
    run = f"peer1-{uuid.uuid4().hex[:6]}"
    engine = rc.CheckpointEngine.create(run, local_dir=str(tmp_path / "local"), critical_writers=1,
                                        best_effort_writers=0, peer_replicas=1)
    try:
        engine.register("policy", lambda: {"w": __import__("torch").arange(10.0)}, loader=lambda s: None)
        h = engine.save(1)
        assert h.wait(timeout=60).version == 1
        with pytest.raises(rc.SaveError, match="no node outside node .* to hold a copy"):
            h.wait(timeout=60, durability="replicated")
        assert [m.tiers for m in engine.list_checkpoints()] == [("local",)]
        # the shortfall is in status() too, not only in the handle of whoever waited
        assert "no node outside node" in engine.status()["replica_problems"][1], engine.status()
    finally:
        engine.shutdown()
    no_peers = rc.CheckpointEngine.create(run + "x", local_dir=str(tmp_path / "local2"), critical_writers=1,
                                          best_effort_writers=0)
    try:
        no_peers.register("policy", lambda: {"w": __import__("torch").arange(3.0)}, loader=lambda s: None)
        with pytest.raises(rc.SaveError, match="keeps no peer replicas"):
            no_peers.save(1).wait(timeout=60, durability="replicated")
    finally:
        no_peers.shutdown()


# ---------------------------------------------------------------------- nodes lost, several nodes
def _scenario(script: str, tmp_path, done: str) -> None:
    """Run ``script`` in its own process (a multi-node Cluster needs its own ray.init, apart from
    the session's instance); it prints ``done`` when every check held."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), str(tmp_path)],
                          capture_output=True, text=True, timeout=580)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and done in proc.stdout, out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_node_loss_restores_the_newest_version_from_a_peer_replica(tmp_path):
    _scenario("peer_scenario.py", tmp_path, "PEER OK")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_damaged_replica_after_node_loss_leaves_the_list_and_restore_takes_the_newest_good_version(tmp_path):
    _scenario("peer_damage_scenario.py", tmp_path, "DAMAGE OK")  # the script's docstring says what it checks


def test_the_store_verifies_what_it_holds_again_memory_and_spill(tmp_path):
    store = ReplicaStore(budget=1500, keep=2, spill=Tier(str(tmp_path / "spill"), "peer-spill"))
    fs = files_of(3, [1000, 1000])  # one in memory, one spilled
    store.put(3, [f for f, _ in fs], [d for _, d in fs])
    assert [store.verify(f.path, f.checksum) for f, _ in fs] == [None, None]
    mem, = [f for f, _ in fs if store.in_memory(f.path)]
    disk, = [f for f, _ in fs if not store.in_memory(f.path)]
    store._memory[mem.path] = bytearray(store._memory[mem.path])
    store._memory[mem.path][7] ^= 0xFF  # bit rot in memory, after the checked arrival
    raw = bytearray((tmp_path / "spill" / disk.path).read_bytes())
    raw[7] ^= 0xFF
    (tmp_path / "spill" / disk.path).write_bytes(bytes(raw))
    assert store.verify(mem.path, mem.checksum) == "checksum mismatch (the copy is corrupt)"
    assert store.verify(disk.path, disk.checksum) == "checksum mismatch (the copy is corrupt)"
    assert store.verify("v000000000009/x", "0" * 32) == "not held"


def test_a_state_report_names_its_tier_with_one_type_and_the_peer_node_apart():
    peer = rc.StateReport("restored", "peer:nodeaaaaaaaa", True)  # the form before `node` existed
    assert peer.tier is rc.TierName.PEER and isinstance(peer.tier, rc.TierName) and peer.node == "nodeaaaaaaaa"
    assert rc.StateReport("restored", rc.TierName.PEER, True, node="nodebbbbbbbb").source == "peer:nodebbbbbbbb"
    for name in ("local", "remote"):
        r = rc.StateReport("restored", name, True)
        assert r.tier is rc.TierName(name) and r.node is None and r.source == name
    assert rc.StateReport("missing", None, False).source == "-"
    report = rc.RestoreReport(3, 3, {"policy": peer})
    assert "tier=peer:nodeaaaaaaaa" in str(report)


@pytest.mark.timeout(120)
def test_no_peer_copy_left_names_each_refusal_without_empty_parts(ray_session, tmp_path):
    run = f"peerx-{uuid.uuid4().hex[:6]}"
    cfg = EngineConfig(run, str(tmp_path / "local"), peer_replicas=1, peer_memory_mb=0)
    (f, data), = files_of(4, [500])
    holder = ReplicaHolder.options(name=holder_name(run, "nodecccccccc"), namespace=NAMESPACE).remote(cfg, "nodecccccccc")
    try:
        ray.get(holder.hold.remote(4, [f], data), timeout=60)
        spill = tmp_path / "local" / peer_spill_dir(run, "nodecccccccc") / f.path
        raw = bytearray(spill.read_bytes())
        raw[3] ^= 0xFF
        spill.write_bytes(bytes(raw))
        with pytest.raises(IntegrityError) as err:
            PeerCopies(run).read_verified(f.path, f.size, f.checksum)
        assert str(err.value) == (f"no peer replica of {f.path} verified "
                                  f"(peer:nodecccccccc: checksum mismatch (replica is corrupt))"), str(err.value)
        assert ray.get(holder.verify.remote({f.path: f.checksum}), timeout=60) == {
            f.path: "checksum mismatch (the copy is corrupt)"}
    finally:
        ray.kill(holder)


def test_placement_never_the_writers_node_nor_its_failure_domain_least_loaded_first():
    from ray_ckpt.coordinator.replication import Replication

    def placement(label):
        r = Replication(EngineConfig("r", "/tmp/x", peer_replicas=1, peer_domain_label=label), None, None, None,
                        None, {}, {}, "head", lambda c: None, lambda m: None)
        r.alive = {"n1": {"zone": "a"}, "n2": {"zone": "a"}, "n3": {"zone": "b"}, "n4": {}, "n5": {"zone": "c"}}
        return r

    r = placement("zone")
    assert r._targets("n1", set(), 1) == ["n3"]  # not n1 itself, not n2 (zone a), not n4 (no zone)
    r.held_bytes["n3"] = 10
    assert r._targets("n1", set(), 1) == ["n5"]  # least loaded first
    assert r._targets("n1", {"n5"}, 1) == ["n3"]  # not a node that has a copy
    assert r._targets("n1", set(), 5) == ["n5", "n3"]  # fewer than asked: the caller reports the shortfall
    r = placement(None)
    assert r._targets("n1", set(), 2) == ["n2", "n3"] and "n1" not in r._targets("n1", set(), 9)


def test_a_version_whose_only_copy_was_on_a_node_ray_lists_dead_is_not_listed_before_it_is_judged():
    """Between Ray's node table saying a node is dead and the coordinator's watch loop judging it
    (its next poll, or a repair pass it waits for), a version whose only copy was on that node is
    not listed as if its local copy were there. No Ray: the node table read is set by hand."""

    from ray_ckpt.coordinator.catalogue import Catalogue
    from ray_ckpt.coordinator.queries import CoordinatorQueries
    from ray_ckpt.coordinator.replication import Replication
    from ray_ckpt.coordinator.upload_plan import UploadPlan
    from ray_ckpt.formats.manifest import Manifest, StateEntry

    def manifest(v):
        f = FileEntry(f"v{v:012d}/policy/rank0.safetensors", 3, digest(b"abc"), node="a" * 56)
        return Manifest("r", v, v, float(v), {"policy": StateEntry("critical", "stored", {"0": [f]}, 3)})

    ms = {v: manifest(v) for v in (1, 2, 3)}
    catalogue = Catalogue("r", {1: ms[1], 2: ms[2]})
    uploads = UploadPlan(1, True, {3: ms[3]}, catalogue.committed)  # 3: on the remote tier too
    catalogue.committed[3] = ms[3]
    files = {m.states["policy"].all_files()[0].path: "a" * 56 for m in ms.values()}
    r = Replication(EngineConfig("r", "/tmp/x", peer_replicas=1), None, None, catalogue, uploads, {}, files, "h" * 56,
                    lambda c: None, lambda m: None)
    r.copies = {2: {ms[2].states["policy"].all_files()[0].path: {"b" * 56}}}  # 2: held by a peer on node b
    q = CoordinatorQueries("r", catalogue, uploads, {}, None)
    q.replication = r
    r._started, r._table_at, r._table_dead = True, float("inf"), set()  # node a alive (read "now": never again)
    assert [m.version for m in q.list()] == [1, 2, 3] and q.manifest(-1).version == 3
    r._table_dead = {"a" * 56}  # Ray's node table now lists node a dead; the watch loop has not judged it
    assert {m.version: m.tiers for m in q.list()} == {2: ("local", "peer"), 3: ("local", "remote")}
    assert [m.version for m in q.manifests()] == [3, 2]
    assert "node aaaaaaaaaaaa died and held v000000000001/policy/rank0.safetensors" in q.skipped_versions()[1]
    r.dead.add("a" * 56)  # judged: what it decided is what is listed (here: nothing was forgotten)
    assert [m.version for m in q.list()] == [1, 2, 3]


def test_a_version_being_judged_is_never_both_unlisted_and_missing_from_the_skipped_versions(tmp_path):
    """While the watch loop judges a dead node (it awaits the holders' verifications and the disk),
    the queries' thread answers: a version whose only copy was there is not listed and is named
    in skipped_versions, before, during and after the judgement. (It was neither for that while,
    so a test that saw it unlisted then found skipped_versions empty.) No Ray: the node table read
    is set by hand, and the local tier's exists(), which the judgement awaits, asks the queries."""
    import asyncio

    from ray_ckpt.coordinator.catalogue import Catalogue
    from ray_ckpt.coordinator.queries import CoordinatorQueries
    from ray_ckpt.coordinator.replication import Replication
    from ray_ckpt.coordinator.upload_plan import UploadPlan
    from ray_ckpt.formats.manifest import Manifest, StateEntry

    def manifest(v):
        f = FileEntry(f"v{v:012d}/policy/rank0.safetensors", 3, digest(b"abc"), node=NODE_A)
        return Manifest("r", v, v, float(v), {"policy": StateEntry("critical", "stored", {"0": [f]}, 3)})

    cfg = EngineConfig("r", str(tmp_path), peer_replicas=1)
    local = cfg.local_tier()
    ms = {v: manifest(v) for v in (1, 2)}
    catalogue = Catalogue("r", dict(ms))
    uploads = UploadPlan(1, True, {}, catalogue.committed)
    skipped = {}
    files = {m.states["policy"].all_files()[0].path: NODE_A for m in ms.values()}
    r = Replication(cfg, local, None, catalogue, uploads, skipped, files, NODE_H, lambda c: None, lambda m: None)
    q = CoordinatorQueries("r", catalogue, uploads, skipped, None)
    q.replication = r
    r._started, r._table_at, r._table_dead = True, float("inf"), {NODE_A}  # Ray lists A dead; not judged yet
    seen = []
    real_exists = local.exists

    def exists(path):  # on a thread, as the judgement calls it: what a user asking now is told
        seen.append(([m.version for m in q.list()], sorted(q.skipped_versions())))
        return real_exists(path)

    local.exists = exists
    assert ([m.version for m in q.list()], sorted(q.skipped_versions())) == ([], [1, 2])
    asyncio.run(r.nodes_lost({NODE_A}))
    assert seen and all(answer == ([], [1, 2]) for answer in seen), seen
    assert ([m.version for m in q.list()], sorted(q.skipped_versions())) == ([], [1, 2])
    assert skipped[1].startswith(f"lost with node {NODE_A[:12]}") and not r.judging


# ---------------------------------------------------------------------- which node holds a file, across restarts
NODE_H, NODE_A, NODE_B, NODE_C = ("h" * 56, "a" * 56, "b" * 56, "c" * 56)


def test_the_manifest_records_each_files_node_under_its_signature_and_older_manifests_still_read():
    from ray_ckpt.formats.manifest import Manifest, StateEntry, manifest_digest, sign_manifest

    def manifest(node):
        f = FileEntry("v000000000001/policy/rank0.safetensors", 3, digest(b"abc"), node=node)
        return Manifest("r", 1, 1, 1.0, {"policy": StateEntry("critical", "stored", {"0": [f]}, 3)})

    back = Manifest.from_json(manifest(NODE_A).to_json())
    assert back.states["policy"].files["0"][0].node == NODE_A
    assert b'"node"' not in manifest(None).to_json()  # unrecorded: the JSON earlier ray_ckpt wrote and reads
    assert Manifest.from_json(manifest(None).to_json()).states["policy"].files["0"][0].node is None
    assert manifest_digest(manifest(NODE_A)) != manifest_digest(manifest(NODE_B))
    signed = sign_manifest(manifest(NODE_A), b"key").to_json()
    Manifest.from_json(signed, key=b"key")
    with pytest.raises(IntegrityError, match="signature does not verify"):  # the node is signed like the rest
        Manifest.from_json(signed.replace(NODE_A.encode(), NODE_B.encode()), key=b"key")
    with pytest.raises(IntegrityError, match="is not a node id"):
        Manifest.from_json(manifest(NODE_A).to_json().replace(f'"{NODE_A}"'.encode(), b"7"))


def test_a_restarted_coordinator_judges_a_node_loss_by_the_nodes_its_manifests_record(tmp_path):
    """Which node wrote each file is in its manifest: a coordinator started again rebuilds the map
    from storage (recover()), and a node lost after the restart costs what it cost before: versions
    whose files were on that node's disk only are reported lost and no longer listed; one a peer
    holds keeps being listed and gets a second copy from that peer; one whose last copy the holders
    drop later (older than the newest peer_keep) is reported lost then."""
    import asyncio

    from ray_ckpt.coordinator.recovery import recover
    from ray_ckpt.coordinator.replication import Replication
    from ray_ckpt.formats.manifest import Manifest, StateEntry
    from ray_ckpt.storage.checkpoint_io import write_manifest
    from ray_ckpt.storage.lost import read_lost

    cfg = EngineConfig("r", str(tmp_path), peer_replicas=1, peer_keep=2)
    local = cfg.local_tier()  # node H's disk: the coordinator's, where the manifests are
    written = {}
    for v, node in ((1, NODE_A), (2, NODE_A), (3, NODE_A), (4, NODE_H)):  # the files themselves are on A's disk
        f = entry(f"v{v:012d}/policy/rank0.safetensors", bytes([v]) * 100)
        f.node = node
        written[f.path] = node
        write_manifest(local, Manifest("r", v, v, 100.0 + v, {"policy": StateEntry("critical", "stored", {"0": [f]},
                                                                                     f.size)}))
    found = recover(cfg, local, None)  # the restart
    assert found.file_nodes == written
    errors = []
    r = Replication(cfg, local, None, found.catalogue, found.uploads, found.skipped, found.file_nodes, NODE_H,
                    lambda c: None, errors.append)
    r.alive = {n: {} for n in (NODE_H, NODE_B, NODE_C)}
    r.table_dead = {NODE_A, "x" * 56}  # A died while no coordinator watched; x wrote nothing of this run
    assert r.died_unwatched() == {NODE_A}
    v3 = found.catalogue.committed[3].states["policy"].files["0"][0]
    r.copies = {3: {v3.path: {NODE_B}}, 4: {}}  # adopted: B's holder has version 3
    asyncio.run(r.nodes_lost({NODE_A}))
    assert sorted(found.catalogue.committed) == [3, 4] and sorted(found.skipped) == [1, 2]
    assert all(why.startswith(f"lost with node {NODE_A[:12]}") for why in found.skipped.values())
    assert sorted(read_lost(local)) == [1, 2] and "versions [1, 2] can no longer be restored" in errors[-1]
    assert r.died_unwatched() == set()
    # version 3's writer's disk is gone: a second copy, from B's holder, to a node other than B
    assert r._plan(3) == ({("holder", NODE_B, NODE_C): [v3]}, [])
    # two newer versions replicated: the holders drop version 3, its last copies
    r.copies.update({5: {}, 6: {}})
    assert r._prune() == [3, 4]
    assert asyncio.run(r._judge([3, 4], "dropped")) == [3]
    assert sorted(found.catalogue.committed) == [4] and sorted(read_lost(local)) == [1, 2, 3]
