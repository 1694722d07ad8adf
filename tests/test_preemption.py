"""Preemption notices: Ray drains a node with a deadline; the run copies what only that node holds
elsewhere first, and the trainer saves once more (coordinator/evacuation.py, client/preemption.py)."""
import asyncio
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import ray_ckpt as rc
from ray_ckpt.client.preemption import PreemptionNotices
from ray_ckpt.coordinator.evacuation import affected, at_risk
from ray_ckpt.formats.manifest import FileEntry, Manifest, StateEntry

HERE = os.path.dirname(os.path.abspath(__file__))


def _manifest(step: int, parts: dict) -> Manifest:
    """A committed version whose states are {name: (strategy, {rank: node})}."""
    states = {}
    for name, (strategy, ranks) in parts.items():
        files = {str(r): [FileEntry(f"v{step:012d}/{name}/rank{r}.safetensors", 10, "x" * 16, node=node)]
                 for r, node in ranks.items()}
        states[name] = StateEntry(strategy=strategy, status="stored", files=files)
    return Manifest(run="r", version=step, step=step, created_at=float(step), states=states)


def _file_nodes(committed):
    return {f.path: f.node for m in committed.values() for e in m.states.values() for f in e.all_files()}


def test_at_risk_is_what_only_a_drained_node_holds_newest_first():
    committed = {v: _manifest(v, {"policy": ("critical", {0: "A", 1: "B"}), "replay": ("best_effort", {0: "A"})})
                 for v in (1, 2, 3, 4)}
    committed[5] = _manifest(5, {"policy": ("critical", {0: "B", 1: "B"}), "replay": ("best_effort", {0: "A"})})
    nodes = _file_nodes(committed)
    # 2 is uploaded; 3 has a replica of its A file on C; 5's critical files are on B (its buffer on
    # A is best-effort: not worth a deadline)
    replicas = {3: {"v000000000003/policy/rank0.safetensors": {"C"}}}
    assert at_risk(committed, nodes, "H", {"A"}, {2}, replicas) == [4, 1]
    # a replica on a node that is drained too, or dead, does not count
    assert at_risk(committed, nodes, "H", {"A", "C"}, {2}, replicas) == [4, 3, 1]
    assert at_risk(committed, nodes, "H", {"A"}, {2}, replicas, alive={"A", "B", "H"}) == [4, 3, 1]
    # two nodes drained at once: both nodes' only copies
    assert at_risk(committed, nodes, "H", {"A", "B"}, set(), {}) == [5, 4, 3, 2, 1]
    assert at_risk(committed, nodes, "H", {"Z"}, set(), {}) == []
    # a file with no node recorded is on the coordinator's node's disk
    old = {7: _manifest(7, {"policy": ("critical", {0: None})})}
    assert at_risk(old, {}, "H", {"H"}, set(), {}) == [7] and at_risk(old, {}, "H", {"A"}, set(), {}) == []


def test_affected_names_the_states_and_ranks_written_on_the_drained_nodes():
    m = _manifest(9, {"policy": ("critical", {0: "A", 1: "B", 2: "A"}), "critic": ("critical", {0: "B"})})
    assert affected(m, _file_nodes({9: m}), "H", {"A"}) == (("policy",), {"policy": (0, 2)})
    assert affected(None, {}, "H", {"A"}) == ((), {})


class _Holders:
    """The replication's side that the evacuation reads (node table, replicas), with a copy away
    that never ends: a move in flight when its node goes."""

    def __init__(self, alive):
        self.alive, self.dead, self.copies, self.holders, self.draining = {n: {} for n in alive}, set(), {}, {}, set()

    async def copy_away(self, version, draining):
        await asyncio.Event().wait()


def _evacuation(committed):
    from ray_ckpt.coordinator.catalogue import Catalogue
    from ray_ckpt.coordinator.evacuation import Evacuation
    from ray_ckpt.coordinator.upload_plan import UploadPlan
    from ray_ckpt.metrics import Metrics
    from ray_ckpt.types import OnPreemption

    catalogue = Catalogue("r", committed)
    return Evacuation(OnPreemption.EVACUATE, catalogue, UploadPlan(1, True), None, _Holders({"A", "H"}),
                      _file_nodes(committed), "H", SimpleNamespace(critical_by_node={"A": 1}, draining=set()),
                      Metrics("r"), asyncio.ensure_future, lambda msg: None)


def test_a_node_that_goes_takes_what_was_not_moved_and_a_late_upload_is_kept():
    """Unit (no Ray): node A, drained with 30 s left, goes early; what only it held and nothing moved
    is reported lost (the move in flight, the one waiting its turn, the one committed during the
    notice), not left out; one whose upload lands afterwards is reported kept."""
    async def scenario():
        committed = {v: _manifest(v, {"policy": ("critical", {0: "A"})}) for v in (1, 2)}
        ev = _evacuation(committed)
        await ev.poll({"A": time.time() + 30})
        await asyncio.sleep(0.05)
        assert ev.notice().moving == (2,)  # newest first; 1 waits behind it
        assert ev.notice().at_risk == (1, 2)  # what A would take if it went now
        ev.catalogue.committed[3] = _manifest(3, {"policy": ("critical", {0: "A"})})  # the last save
        ev.file_nodes.update(_file_nodes(ev.catalogue.committed))
        assert ev.notice().at_risk == (1, 2, 3)
        ev.replication.alive.pop("A")  # taken before its deadline: Ray lists it no more
        await ev.poll({})
        status = ev.status()
        ev._mover.cancel()
        assert status["active"] is False and sorted(status["lost"]) == [1, 2, 3], status
        assert "in progress" in status["lost"][2] and "before its turn" in status["lost"][1]
        ev.uploads.committed[3] = ev.catalogue.committed[3]  # its remote_every upload landed after all
        assert sorted(ev.status()["lost"]) == [1, 2] and 3 in ev.status()["moved"]

    asyncio.run(scenario())


class _Uploads:
    """The uploader's side the evacuation calls: uploads that land when the test says."""

    def __init__(self, plan):
        self.plan, self.calls = plan, {}

    def upload_now(self, version):
        self.calls[version] = asyncio.get_running_loop().create_future()
        return self.calls[version]

    def land(self, version, manifest):
        self.plan.committed[version] = manifest
        self.calls[version].set_result(None)

    def progress(self, version):
        return (0, 10)


class _CopyingHolders(_Holders):
    """Replica holders on node H that take a copy within 50 ms."""

    def __init__(self, alive, committed):
        super().__init__(alive)
        self.committed, self.sent = committed, []

    async def copy_away(self, version, draining):
        self.sent.append(version)
        await asyncio.sleep(0.05)
        for f in self.committed[version].states["policy"].all_files():
            self.copies.setdefault(version, {}).setdefault(f.path, set()).add("H")
        return []


def test_the_newest_version_whose_upload_lags_gets_a_replica_too(monkeypatch):
    """Unit (no Ray): a remote tier whose uploads do not land (a slow or saturated store). Node A
    drained: the newest version's upload has not landed within HEDGE_AFTER_S, so it also gets a
    replica on a node that stays (H) and counts as moved -- the trainer's next save may follow; the
    older one is not the newest and waits for its upload only (no replica: holders keep few
    versions), moved once it lands."""
    from ray_ckpt.coordinator import evacuation
    monkeypatch.setattr(evacuation, "HEDGE_AFTER_S", 0.1)

    async def scenario():
        committed = {v: _manifest(v, {"policy": ("critical", {0: "A"})}) for v in (1, 2)}
        ev = _evacuation(committed)
        ev.uploader = _Uploads(ev.uploads)
        ev.replication = _CopyingHolders({"A", "H"}, committed)
        await ev.poll({"A": time.time() + 30})
        for _ in range(100):
            if 2 in ev.notice().moved and 1 in ev.moving:
                break
            await asyncio.sleep(0.05)
        notice = ev.notice()
        assert notice.moved == (2,) and notice.at_risk == (1,) and notice.moving == (1,), notice
        assert ev.replication.sent == [2] and ev.hedged == {2}
        await asyncio.sleep(0.3)  # longer than HEDGE_AFTER_S: still no replica of 1
        assert ev.replication.sent == [2]
        ev.uploader.land(1, committed[1])
        for _ in range(100):
            if 1 in ev.notice().moved:
                break
            await asyncio.sleep(0.05)
        notice = ev.notice()
        ev._mover.cancel()
        assert notice.moved == (1, 2) and notice.at_risk == () and not notice.lost, notice

    asyncio.run(scenario())


def test_a_drained_node_whose_trainer_asked_for_notices_is_the_runs_before_its_first_save():
    """Unit (no Ray): node B holds no file, writer or replica of the run (its trainer has not saved
    yet: goodput.py's RLlib job, a save every 10 iterations, drained at iteration 5); drained, it is
    not the run's until a process there asks for the notice (``engine.preemption()`` sends its node),
    then it is, so that the trainer's last save is taken; when B goes, it is forgotten."""
    async def scenario():
        ev = _evacuation({1: _manifest(1, {"policy": ("critical", {0: "A"})})})
        deadline = time.time() + 30
        await ev.poll({"B": deadline})
        assert ev.active() is None
        ev.asked_from("B")
        await ev.poll({"B": deadline})
        notice = ev.active()
        assert notice is not None and notice.nodes == ("B",) and notice.lost == {}, notice
        ev.replication.alive.pop("B", None)
        await ev.poll({})
        assert ev.active() is None and "B" not in ev.asking

    asyncio.run(scenario())


class _Loop(PreemptionNotices):
    """A training loop's engine as ``save_if_preempted`` sees it (the mixin of CheckpointEngine),
    with the notice the coordinator would answer set by the test."""

    def __init__(self, on_preemption="save"):
        self.config = SimpleNamespace(on_preemption=on_preemption)
        self._last_saved, self._notice_node, self.notice, self.saved = 0, "T", None, []
        self._last_pushed = {}  # submit(): (state, rank) -> step

    def preemption(self, max_age=0):
        return self.notice

    def save(self, step, on_busy=None, metrics=None):
        self._last_saved = step
        self.saved.append(step)
        return step


def test_save_if_preempted_saves_at_the_notice_then_again_each_time_the_newest_save_is_safe():
    """Unit (no Ray): a loop calls ``save_if_preempted`` each step. It saves at the first step after
    the notice; then not while that save is uncommitted or still only on the drained node; again once
    it has a copy elsewhere; never for a save that was lost, after the deadline, for a notice that
    is not about the trainer's parts or node, nor with ``on_preemption="evacuate"``; a new notice
    gets its first save."""
    from dataclasses import replace

    from ray_ckpt.types import PreemptionNotice

    loop = _Loop()
    assert loop.save_if_preempted(1) is None
    n = PreemptionNotice(nodes=("A",), deadline=time.time() + 30, noticed_at=100.0, states=("policy",))
    loop.notice = n
    assert loop.save_if_preempted(5) == 5
    assert loop.save_if_preempted(6) is None  # 5 not committed yet
    loop.notice = replace(n, saved_step=5, at_risk=(5,), moving=(5,))
    assert loop.save_if_preempted(6) is None  # committed, still only on A
    loop.notice = replace(n, saved_step=5, moved=(5,))
    assert loop.save_if_preempted(5) is None  # a step already saved
    assert loop.save_if_preempted(7) == 7
    loop.notice = replace(n, saved_step=7, lost={7: "the deadline passed"})
    assert loop.save_if_preempted(8) is None
    loop.notice = replace(n, saved_step=7, deadline=time.time() - 1)
    assert loop.save_if_preempted(8) is None
    loop.notice = replace(n, saved_step=7, moved=(7,))
    assert loop.save_if_preempted(8) == 8
    assert loop.saved == [5, 7, 8]

    # a notice about a replica holder's node: one save, not more
    other = PreemptionNotice(nodes=("B",), deadline=time.time() + 30, noticed_at=200.0)
    loop.notice = other
    assert loop.save_if_preempted(9) == 9
    loop.notice = replace(other, saved_step=9, moved=(9,))
    assert loop.save_if_preempted(10) is None
    # ... unless it drains the trainer's own node
    loop.notice = replace(other, nodes=("B", "T"), saved_step=9, moved=(9,))
    assert loop.save_if_preempted(10) == 10

    evacuate = _Loop(on_preemption="evacuate")
    evacuate.notice = n
    assert evacuate.save_if_preempted(5) is None and evacuate.saved == []

    # a trainer that pushes its parts (submit(): Ray Train's checkpointer, OpenRLHF's strategy) asks
    # preemption_save_due() and pushes: its newest push is what must be safe before the next one
    pusher = _Loop()
    pusher.notice = n
    assert pusher.preemption_save_due() is n
    pusher._last_pushed[("policy", 0)] = 5
    pusher.notice = replace(n, saved_step=5, at_risk=(5,))
    assert pusher.preemption_save_due() is None
    pusher.notice = replace(n, saved_step=5, moved=(5,))
    assert pusher.preemption_save_due() is not None


def test_a_cancelled_drain_loses_nothing():
    async def scenario():
        ev = _evacuation({1: _manifest(1, {"policy": ("critical", {0: "A"})})})
        await ev.poll({"A": time.time() + 30})
        await asyncio.sleep(0.05)
        await ev.poll({})  # the drain ends long before its deadline, the node still listed: it stays
        status = ev.status()
        ev._mover.cancel()
        assert status["active"] is False and status["lost"] == {} and status["nodes"] == ["A"], status

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_notices_upload_takes_the_writers_urgent_slot_not_the_routine_queue(ray_session, tmp_path):
    """A writer's two routine upload slots busy with older versions' files and more calls queued
    behind them (Ray runs a concurrency group's calls in arrival order): the upload of a version a
    notice copies away (``upload_urgent``, which the uploader uses for it) starts at once and lands
    before them, and before an older version's urgent copy that began first (the last save, committed
    during the notice, after the older copies started); the same small file sent the routine way lands
    after the queue; the routine uploads already running give way to the urgent ones (the big urgent
    copy, begun after them, ends first). Real writer actor, real files, a file:// remote tier with the writer's upload
    rate limit."""
    import numpy as np
    import ray
    from ray_ckpt.config import EngineConfig
    from ray_ckpt.formats.tree import flatten
    from ray_ckpt.storage.checkpoint_io import write_flat
    from ray_ckpt.writers.pools import WriterActor
    cfg = EngineConfig(run="urgent", local_dir=str(tmp_path / "local"), remote_uri=f"file://{tmp_path / 'remote'}",
                       upload_max_mb_s=16.0)
    local = cfg.local_tier()
    sizes = {1: 40 << 20, 2: 40 << 20, 3: 40 << 20, 4: 64 << 10, 5: 64 << 10, 6: 40 << 20}
    files = {v: write_flat(local, v, "s", 0, flatten({"x": np.full(n, v, np.uint8)}, state_name="s"))
             for v, n in sizes.items()}
    writer = WriterActor.options(num_cpus=0.05).remote(cfg, "critical")
    ray.get(writer.remove_temporaries.remote(0), timeout=60)  # started
    routine = {v: writer.upload.remote(files[v]) for v in (1, 2, 3, 5)}  # 5: small, queued behind 3
    older = writer.upload_urgent.remote(files[6])  # an older version's copy away, begun first
    urgent = writer.upload_urgent.remote(files[4])
    order = []
    pending = list(routine.values()) + [older, urgent]
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=60)
        assert done, "an upload did not end within 60 s"
        order.append(done[0])
    names = {ref: v for v, ref in routine.items()}
    names[urgent], names[older] = "urgent", "older"
    order = [names[r] for r in order]
    assert order.index("urgent") < order.index(1) and order.index("urgent") < order.index(5), order
    assert order.index("urgent") < order.index("older"), order
    assert order.index("older") < order.index(1) and order.index("older") < order.index(2), order  # they gave way
    assert order.index(5) > order.index(1), order  # the routine small file waited for a slot
    assert ray.get(urgent) == sum(f.size for f in files[4])
    remote = cfg.remote_tier()
    assert all(remote.exists(f.path) for v in sizes for f in files[v])
    # a routine call for files an urgent one copied (queued before it) copies them no more, once
    assert ray.get(writer.upload.remote(files[4]), timeout=60) == 0
    assert ray.get(writer.upload.remote(files[4]), timeout=60) == sum(f.size for f in files[4])


@pytest.mark.timeout(180)
def test_a_routine_upload_queued_behind_older_ones_is_sent_urgently_at_a_notice(engine_factory, run_name):
    """Every version uploaded (``remote_every=1``) through one writer whose two routine slots hold
    two big older versions (rate-limited) with a third queued: version 4 (small), committed and its
    routine upload call queued behind them, is asked for by a notice (``upload_now``, what the
    evacuation calls). Its queued call is sent again through the urgent slots and the version is on
    the remote tier while the older ones are still uploading (the routine call, when its turn comes,
    skips what the urgent one copied: the writer test above); all four end up on the remote tier."""
    import numpy as np
    import ray
    from ray_ckpt.protocol import NAMESPACE, actor_name
    eng = engine_factory(critical_writers=1, best_effort_writers=0, remote_every=1, upload_max_mb_s=16.0)
    sizes = {1: 40 << 20, 2: 40 << 20, 3: 40 << 20, 4: 64 << 10}
    now = {}
    eng.register("s", lambda: {"x": np.full(sizes[now["v"]], now["v"], np.uint8)}, loader=lambda st: None)
    handles = {}
    for v in sizes:
        now["v"] = v
        handles[v] = eng.save(v)
        handles[v].wait(timeout=60)  # committed locally: its upload call is sent at once
    coordinator = ray.get_actor(actor_name(run_name), namespace=NAMESPACE)

    def notice(self):  # what the evacuation does for a drained node's newest version, on the actor's loop
        async def now():
            self.uploader.upload_now(4)
        loop = self.uploader.futures[4].get_loop()  # made at version 4's commit
        asyncio.run_coroutine_threadsafe(now(), loop).result(timeout=10)
    ray.get(coordinator.__ray_call__.remote(notice), timeout=30)
    handles[4].wait(timeout=60, durability="remote")
    tiers = {m.version: set(m.tiers) for m in eng.list_checkpoints()}
    assert "remote" not in tiers[1] and "remote" not in tiers[2] and "remote" not in tiers[3], tiers
    for v in (1, 2, 3):
        handles[v].wait(timeout=120, durability="remote")
    assert all("remote" in set(m.tiers) for m in eng.list_checkpoints())
    assert eng.load("s", step=4)["x"].tobytes() == np.full(64 << 10, 4, np.uint8).tobytes()


def test_on_preemption_is_validated_at_create(ray_session, tmp_path):
    with pytest.raises(rc.InvalidArgumentError, match="on_preemption must be 'save', 'evacuate' or 'ignore'"):
        rc.CheckpointEngine.create("badpreempt", local_dir=str(tmp_path), on_preemption="panic")


def test_no_notice_no_extra_save(engine_factory, provider):
    from actors import FreshLearner

    engine = engine_factory()
    engine.register("policy", provider(FreshLearner, seed=1))
    assert engine.save(1).wait(timeout=60).step == 1
    assert engine.preemption(max_age=0) is None
    assert engine.save_if_preempted(2) is None
    assert engine.status()["preemption"] is None
    assert [m.step for m in engine.list_checkpoints()] == [1]


def run_scenario(script: str, tmp_path, ok: str, timeout: float) -> None:
    """Run a multi-node scenario in its own process (a Cluster needs its own ray.init, apart from
    the session's instance); it prints ``ok`` and exits 0 when every check holds."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), str(tmp_path)],
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and ok in proc.stdout, out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_drained_nodes_versions_are_moved_before_the_deadline_and_the_last_save_taken(tmp_path):
    run_scenario("preemption_scenario.py", tmp_path, "PREEMPTION OK", 400)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_rllib_callback_saves_at_the_next_iteration_after_a_notice(tmp_path):
    run_scenario("rllib_preemption_scenario.py", tmp_path, "RLLIB PREEMPTION OK", 400)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_mailbox_lost_with_its_node_is_replaced_beside_the_coordinator(tmp_path):
    # benchmarks/goodput.py's RLlib job: a learner restarted after its node's preemption could not
    # register its states, Ray handing out the run's dead mailbox by name
    run_scenario("mailbox_scenario.py", tmp_path, "MAILBOX OK", 280)
