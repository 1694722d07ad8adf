"""The engine end to end on a real local Ray instance (no mocks).

The provider actors (learner, flaky, frozen, weird, big state, replay buffers) come from the
session's pool and are reset at each test (conftest.py's ``provider``): a fresh actor is a process
that imports torch and, at its first optimizer, torch._dynamo (~6 CPU-s for a Learner on 2 cores),
which was most of these tests' time."""
import json
import os
import shutil
import time

import pytest
import ray
import torch

import ray_ckpt as rc
from ray_ckpt.ray_internals import actor_ready
from actors import FreshBigState, FreshFlaky, FreshFrozen, FreshLearner, FreshReplay, FreshWeird

pytestmark = pytest.mark.timeout(240)


_RUN_RECORDS = ("owner.json", "head.json")  # with their ".tmp-*" while the engine rewrites them


def _listing(run_dir) -> list:
    """A run directory's entries other than its owner and head records (rewritten in the background)."""
    return sorted(n for n in os.listdir(run_dir) if not n.startswith(_RUN_RECORDS))


# One critical writer and no best-effort pool, for tests that save one version at a time and where
# the pools' sizes are not the point: every writer is a process to start (seconds on 2 cores).
LEAN = {"critical_writers": 1, "best_effort_writers": 0}
NO_BEST_EFFORT_POOL = {"best_effort_writers": 0}  # no best-effort state registered: its pool is unused


def equal_snapshots(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def register_learner(eng, learner):
    eng.register("policy", learner, strategy=rc.Strategy.CRITICAL)
    eng.register("optimizer", learner, strategy=rc.Strategy.CRITICAL)
    eng.register("rng", learner, strategy=rc.Strategy.CRITICAL)


def wait_restarted(actor, old_pid, timeout=60):
    """ray.kill is asynchronous: poll (bounded) until a new process answers."""
    deadline = time.time() + timeout
    while True:
        try:
            pid = ray.get(actor.pid.remote(), timeout=10)
            if pid != old_pid:
                return pid
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.time() < deadline, "actor was not restarted in time"
        time.sleep(0.1)


def test_exact_resume_after_killed_learner(engine_factory, provider):
    learner = provider(FreshLearner, seed=1)
    trained = learner.train.remote(6)  # the uninterrupted run (from the same seed); runs while the engine starts
    eng = engine_factory(keep_last=2, **LEAN)
    ray.get(trained)
    expected = ray.get(learner.snapshot.remote())
    ray.get(learner.reset.remote(seed=1))  # the interrupted run, from the same seed again
    register_learner(eng, learner)
    for step in (1, 2, 3):
        ray.get(learner.train.remote())
        h = eng.save(step)
    h.wait(timeout=60)
    old_pid = ray.get(learner.pid.remote())
    ray.get(learner.train.remote())          # progress after the last save is lost on preemption
    ray.kill(learner, no_restart=False)      # preemption: Ray restarts the actor with fresh weights
    report = eng.restore()                   # at once, while Ray restarts it: the restore waits for it
    assert ray.get(learner.pid.remote()) != old_pid  # restored into the new process
    assert report.version == 3 and report.step == 3
    assert {n: (r.status, r.tier, r.verified) for n, r in report.states.items()} == {
        n: ("restored", "local", True) for n in ("policy", "optimizer", "rng")}
    assert eng.current_step == 3
    ray.get(learner.train.remote(3))
    assert equal_snapshots(ray.get(learner.snapshot.remote()), expected), "resumed run differs from uninterrupted"


def test_corrupt_local_file_restored_from_remote(engine_factory, tmp_path, run_name, provider):
    learner = provider(FreshLearner, seed=2)
    eng = engine_factory(**LEAN)
    register_learner(eng, learner)
    ray.get(learner.train.remote(2))
    before = ray.get(learner.snapshot.remote())
    assert eng.save(2).wait(timeout=60, durability="remote").durability == "remote"
    path = tmp_path / "local" / run_name / "v000000000002" / "policy" / "rank0.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    os.remove(tmp_path / "local" / run_name / "v000000000002" / "optimizer" / "rank0.safetensors")
    ray.get(learner.train.remote(2))
    # one state read into this process says where it came from, as a restore does
    policy, rep = eng.load("policy", step=2, with_report=True)
    assert equal_snapshots(policy, eng.load("policy", step=2))
    assert rep.status == "restored" and rep.tier == "remote" and rep.verified and "checksum mismatch" in rep.detail
    assert eng.load("rng", step=2, with_report=True)[1].tier == "local"
    report = eng.restore()
    assert report.states["policy"].tier == "remote" and "checksum mismatch" in report.states["policy"].detail
    assert report.states["optimizer"].tier == "remote" and "missing" in report.states["optimizer"].detail
    assert report.states["rng"].tier == "local"
    assert equal_snapshots(ray.get(learner.snapshot.remote()), before)


def test_interrupted_write_is_never_listed_nor_restored(engine_factory, tmp_path, run_name, provider):
    """A version directory without manifest (a crash mid-write) is never listed nor restored; the
    next coordinator removes it, but not the files committed versions refer to that lie in the
    directory of a version retention deleted (a RELOADABLE state stored once)."""
    learner, frozen = provider(FreshLearner, seed=3), provider(FreshFrozen)
    eng = engine_factory(keep_last=1, **LEAN)
    register_learner(eng, learner)
    eng.register("reference", frozen, strategy=rc.Strategy.RELOADABLE)
    eng.save(1).wait(timeout=60)
    eng.save(2).wait(timeout=60)  # version 1 deleted; its reference file stays (version 2 refers to it)
    run_dir = tmp_path / "local" / run_name
    deadline = time.time() + 30
    while (run_dir / "v000000000001" / "policy").exists():
        assert time.time() < deadline, "retention did not delete version 1"
        time.sleep(0.05)
    shared = run_dir / "v000000000001" / "reference" / "rank0.safetensors"
    assert shared.exists()
    # a version directory without manifest, as a crash mid-write leaves it
    partial = run_dir / "v000000000005" / "policy"
    partial.mkdir(parents=True)
    (partial / "rank0.safetensors").write_bytes(b"\x00" * 64)
    eng.shutdown()
    eng2 = engine_factory(keep_last=1, **LEAN)
    assert [m.version for m in eng2.list_checkpoints()] == [2]
    assert not (run_dir / "v000000000005").exists() and shared.exists()
    register_learner(eng2, learner)
    eng2.register("reference", frozen, strategy=rc.Strategy.RELOADABLE)
    report = eng2.restore()
    assert report.version == 2 and report.states["reference"].status == "restored"
    with pytest.raises(rc.RestoreError, match="no committed checkpoint at step 5"):
        eng2.restore(step=5)
    # load() fetches one state's entry (coordinator.stored_state), and says what else the version has
    want = ray.get(frozen.ckpt_get_state.remote("reference"))["w"]
    assert torch.equal(torch.as_tensor(eng2.load("reference", step=2)["w"]), want)
    with pytest.raises(rc.RestoreError, match=r"step 2 of run .* has no state 'nope' \(it has: .*reference"):
        eng2.load("nope", step=2)
    with pytest.raises(rc.RestoreError, match="no committed checkpoint at step 5"):
        eng2.load("reference", step=5)


def test_coordinator_killed_and_recreated_with_catalogue(engine_factory, run_name, provider):
    learner = provider(FreshLearner, seed=4)
    eng = engine_factory(**LEAN)
    register_learner(eng, learner)
    for s in (1, 2):
        eng.save(s).wait(timeout=60)
    listed = [(m.version, m.step, m.states) for m in eng.list_checkpoints()]
    coord = ray.get_actor(f"ray_ckpt.coordinator.{run_name}", namespace="ray_ckpt")
    started = eng.status()["started_at"]
    ray.kill(coord, no_restart=False)     # Ray restarts it by name; it rebuilds from storage
    deadline = time.time() + 60           # ray.kill is asynchronous: wait for the new process
    while True:
        try:
            if eng.status()["started_at"] != started:
                break
        except rc.CheckpointError as exc:  # not Ray's errors: ours, saying what happened
            assert "not reachable" in str(exc) or "did not answer" in str(exc), exc
        assert time.time() < deadline, "coordinator was not restarted in time"
        time.sleep(0.2)
    again = [(m.version, m.step, m.states) for m in eng.list_checkpoints()]
    assert again == listed
    assert rc.CheckpointEngine.connect(run_name).list_checkpoints()[-1].version == 2
    assert eng.save(3).wait(timeout=60).version == 3


def _wait_dead(actor, timeout=60):
    deadline = time.time() + timeout
    while True:  # ray.kill is asynchronous
        try:
            ray.get(actor.last_version.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        assert time.time() < deadline, "the actor did not die"
        time.sleep(0.1)


def test_a_coordinator_killed_for_good_is_created_again_by_the_driver(engine_factory, tmp_path, run_name, provider):
    """ray.kill without restart: the driver's engine creates the coordinator again by name (it
    rebuilds its catalogue from storage); the save that found it dead fails loudly, the next works."""
    learner = provider(FreshLearner, seed=13)
    eng = engine_factory(**LEAN)
    register_learner(eng, learner)
    eng.save(1).wait(timeout=60, durability="remote")
    # what a coordinator killed mid-save leaves: a version directory without manifest on each tier
    cut_off = [tmp_path / tier / run_name / "v000000000007" / "policy" / "rank0.safetensors"
               for tier in ("local", "remote")]
    for p in cut_off:
        p.parent.mkdir(parents=True)
        p.write_bytes(b"half a file")
    ray.kill(eng._coordinator)  # no_restart=True: Ray will not bring it back
    _wait_dead(eng._coordinator)
    assert [m.version for m in eng.list_checkpoints()] == [1]  # a new coordinator, rebuilt from storage
    for p in cut_off:  # it removed them before taking a save, committed files untouched
        assert not p.parent.parent.exists(), p
    assert eng.restore().version == 1
    assert eng.save(2).wait(timeout=60).version == 2
    ray.kill(eng._coordinator)
    _wait_dead(eng._coordinator)
    h = eng.save(3)
    with pytest.raises(rc.SaveError, match="died while step 3 was in flight.*a new coordinator was created"):
        h.wait(timeout=60)
    assert eng.save(4).wait(timeout=60, durability="remote").version == 4
    assert [m.version for m in eng.list_checkpoints()] == [1, 2, 4]
    assert eng.restore().version == 4


def test_bad_inputs_fail_at_the_call_before_any_byte(engine_factory, tmp_path, run_name, provider):
    learner, weird = provider(FreshLearner, seed=5), provider(FreshWeird)
    eng = engine_factory(**LEAN)
    for bad in ("../escape", "a/b", "..", "x y", ""):
        with pytest.raises(rc.InvalidArgumentError, match="invalid state name"):
            eng.register(bad, learner)
    eng.register("policy", learner)
    with pytest.raises(rc.InvalidArgumentError, match="already registered.*replace=True"):
        eng.register("policy", learner)
    eng.register("policy", learner, replace=True)
    with pytest.raises(rc.InvalidArgumentError, match="unknown strategy"):
        eng.register("optimizer", learner, strategy="sometimes")
    with pytest.raises(rc.InvalidArgumentError, match="provider must be"):
        eng.register("x", 42)
    with pytest.raises(rc.InvalidArgumentError, match="invalid run name"):
        rc.CheckpointEngine.create("../run", local_dir=str(tmp_path))
    eng.save(10).wait(timeout=60)
    for step in (10, 9):
        with pytest.raises(rc.SaveError, match="steps must increase"):
            eng.save(step)
    with pytest.raises(rc.SaveError, match="non-negative integer"):
        eng.save(-1)
    with pytest.raises(rc.SaveError, match="on_busy"):
        eng.save(11, on_busy="later")
    eng.register("norm", lambda: {"mean": object()}, loader=lambda s: None)
    with pytest.raises(rc.UnsupportedTypeError, match=r"'norm'.*\['mean'\]"):
        eng.save(11)
    assert _listing(tmp_path / "local" / run_name) == ["v000000000010"]  # nothing written
    eng.unregister("norm")
    # an actor's unsupported object is found in the actor: the handle fails, naming state and key path
    eng.register("weird", weird)
    h = eng.save(12)
    with pytest.raises(rc.UnsupportedTypeError, match=r"weird.*\['bad'\]\['inner'\]"):
        h.wait(timeout=60)  # the same class as the in-process callable's error above
    assert [m.version for m in eng.list_checkpoints()] == [10]
    eng.unregister("weird")
    assert eng.save(13).wait(timeout=60).version == 13
    # version 12's other parts may still have been writing when its handle failed: their files go
    # once they end (bounded wait)
    deadline = time.time() + 30
    while _listing(tmp_path / "local" / run_name) != ["v000000000010", "v000000000013"]:
        assert time.time() < deadline, os.listdir(tmp_path / "local" / run_name)
        time.sleep(0.1)
    # every name that becomes a path is checked at the call, with the same error class
    with pytest.raises(rc.InvalidArgumentError, match="manifest"):
        eng.register("manifest.json", learner)
    with pytest.raises(rc.InvalidArgumentError, match="invalid state name"):
        eng.load(13, "../policy")
    with pytest.raises(rc.InvalidArgumentError, match="invalid state name"):
        eng.submit(14, "a/b", {"w": torch.ones(1)})
    with pytest.raises(rc.InvalidArgumentError, match="invalid run name"):
        rc.CheckpointEngine.connect("../run")


def test_a_provider_that_refuses_its_state_fails_the_restore_by_name(engine_factory, provider):
    """A provider whose ckpt_set_state raises: restore raises RestoreError naming that state and
    what was loaded, not a bare Ray error."""
    flaky, learner = provider(FreshFlaky), provider(FreshLearner, seed=12)
    eng = engine_factory(**LEAN)
    eng.register("w", flaky)
    eng.register("policy", learner)
    eng.save(1).wait(timeout=60)
    ray.get(flaky.set_failing.remote(True))
    with pytest.raises(rc.RestoreError, match=r"w: .*set_state refused on purpose.*loaded: policy"):
        eng.restore()
    ray.get(flaky.set_failing.remote(False))
    assert eng.restore().states["w"].status == "restored"
    rank = rc.CheckpointEngine.connect(eng.run)
    rank.shutdown()  # an engine from connect() only detaches: the run goes on
    with pytest.raises(rc.CheckpointError, match="was shut down"):
        rank.list_checkpoints()
    assert [m.version for m in eng.list_checkpoints()] == [1]
    eng.shutdown()
    eng.shutdown()  # a second call does nothing
    for call in (eng.list_checkpoints, eng.save, lambda: eng.load(1, "policy")):
        with pytest.raises(rc.CheckpointError, match="was shut down"):
            call()
    # the coordinator is gone when shutdown() returns (ray.kill alone only asks)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor_ready(eng._coordinator), timeout=10)


def test_retention_keeps_newest_and_never_deletes_early(engine_factory, tmp_path, run_name, provider):
    learner = provider(FreshLearner, seed=6)
    eng = engine_factory(keep_last=2, keep_every=4, **LEAN)
    register_learner(eng, learner)
    for s in range(1, 8):
        ray.get(learner.train.remote())
        eng.save(s).wait(timeout=60, durability="remote")
    deadline = time.time() + 30  # retention runs right after each commit, in the coordinator
    while _listing(tmp_path / "local" / run_name) != [f"v{v:012d}" for v in (4, 6, 7)]:
        assert time.time() < deadline, os.listdir(tmp_path / "local" / run_name)
        time.sleep(0.1)
    metas = eng.list_checkpoints()
    assert [m.version for m in metas] == [4, 6, 7]
    assert metas[-1].tiers == ("local", "remote")
    assert eng.restore().version == 7


def test_reloadable_state_is_stored_once(engine_factory, tmp_path, run_name, provider):
    frozen = provider(FreshFrozen)
    learner = provider(FreshLearner, seed=7)
    eng = engine_factory(**LEAN)
    eng.register("policy", learner)
    eng.register("reference", frozen, strategy=rc.Strategy.RELOADABLE)
    eng.register("tokenizer", None, strategy=rc.Strategy.RELOADABLE, loader=lambda: None)
    r1 = eng.save(1).wait(timeout=60)
    r2 = eng.save(2).wait(timeout=60)
    assert r2.bytes_written < r1.bytes_written - 256 * 256 * 4
    assert not (tmp_path / "local" / run_name / "v000000000002" / "reference").exists()
    report = eng.restore()
    assert report.states["reference"].status == "restored"
    assert report.states["tokenizer"].status == "reloaded"
    assert eng.load(2, "reference")["w"].shape == (256, 256)


def test_best_effort_failure_is_reported_not_fatal(engine_factory, provider):
    learner, weird = provider(FreshLearner, seed=8), provider(FreshWeird)
    eng = engine_factory(critical_writers=1)  # one critical state: a second critical writer is idle
    eng.register("policy", learner)
    eng.register("replay", weird, strategy=rc.Strategy.BEST_EFFORT)
    h = eng.save(1)
    assert h.wait(timeout=60).version == 1                      # the commit does not wait for it
    h.wait(timeout=60, best_effort=True)                        # this does: written or reported
    assert eng.list_checkpoints()[0].missing == ("replay",) and eng.list_checkpoints()[0].pending == ()
    report = eng.restore(strict=True)
    assert report.states["policy"].status == "restored"
    assert report.states["replay"].status == "missing" and "inner" in report.states["replay"].detail


def test_save_returns_in_milliseconds_while_large_save_in_flight(engine_factory, provider):
    big = provider(FreshBigState, 300)
    eng = engine_factory(remote_uri=None, max_in_flight=2, **NO_BEST_EFFORT_POOL)
    eng.register("big", big)
    ray.get(big.checksum.remote())
    t0 = time.perf_counter()
    h1 = eng.save(1)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    h2 = eng.save(2, on_busy="queue")
    second = time.perf_counter() - t0
    assert not h1.done(), "the 300 MB save should still be in flight"
    h3 = eng.save(3, on_busy="skip")
    assert h3.skipped and h3.wait().skipped
    assert first < 0.25 and second < 0.25, (first, second)  # the 300 MB save itself takes seconds
    r1 = h1.wait(timeout=120)
    assert r1.bytes_written > 300 * (1 << 20)
    # where the time went, for a person reading the result: each stage inside the save's own time
    assert set(r1.stages) == {"snapshot_wait_s", "write_s", "manifest_s"}, r1.stages
    assert all(v >= 0 for v in r1.stages.values())
    assert r1.stages["snapshot_wait_s"] + r1.stages["write_s"] <= r1.seconds, (r1.stages, r1.seconds)
    assert h2.wait(timeout=120).version == 2
    want = ray.get(big.checksum.remote())
    ray.get(big.ckpt_set_state.remote("big", {"big": torch.zeros(1)}))
    eng.restore()
    assert ray.get(big.checksum.remote()) == want


def test_writer_killed_mid_write(engine_factory, tmp_path, run_name, provider):
    big = provider(FreshBigState, 200)
    eng = engine_factory(remote_uri=None, critical_writers=1, best_effort_writers=0)
    eng.register("big", big)
    writer = ray.get(eng._coordinator.writers.remote())["critical"][0]
    h = eng.save(1)
    time.sleep(0.05)  # let the write start; either outcome below is allowed by the design
    ray.kill(writer, no_restart=False)
    try:
        result = h.wait(timeout=120)
        assert result.version == 1  # completed on the restarted writer
    except rc.SaveError as exc:
        assert "step 1" in str(exc) or "writer" in str(exc).lower()
    versions = [m.version for m in eng.list_checkpoints()]
    assert versions in ([], [1])
    assert eng.save(2).wait(timeout=120).version == 2
    assert eng.restore().version == 2


def test_remote_cadence_and_per_tier_retention(engine_factory, tmp_path, run_name, provider):
    learner = provider(FreshLearner, seed=9)
    eng = engine_factory(remote_every=2, keep_last=1, remote_keep_last=2, **NO_BEST_EFFORT_POOL)
    register_learner(eng, learner)
    handles = [eng.save(s) for s in range(1, 7)]
    for s, h in enumerate(handles, start=1):
        if s % 2 == 0:
            assert h.wait(timeout=60, durability="remote").durability == "remote"
        else:
            h.wait(timeout=60)
            with pytest.raises(rc.SaveError, match="remote_every=2"):
                h.wait(timeout=60, durability="remote")
    remote_dir = tmp_path / "remote" / run_name
    deadline = time.time() + 30  # retention of each tier runs after the uploads, in the coordinator
    while True:
        remote_listing = _listing(remote_dir)
        tiers = {m.version: m.tiers for m in eng.list_checkpoints()}
        if remote_listing == ["v000000000004", "v000000000006"] and tiers == {4: ("remote",),
                                                                               6: ("local", "remote")}:
            break
        assert time.time() < deadline, (remote_listing, tiers)
        time.sleep(0.1)
    # a corrupt remote copy does not matter while the local one is good
    p = remote_dir / "v000000000006" / "policy" / "rank0.safetensors"
    p.write_bytes(p.read_bytes()[:-1] + b"\x00")
    assert eng.restore().states["policy"].tier == "local"
    # version 4 exists only remotely: restored from there
    assert {r.tier for r in eng.restore(step=4).states.values()} == {"remote"}


def test_remote_cadence_names_versions_and_a_failed_turn_passes_on(engine_factory, tmp_path, run_name, provider):
    """remote_every=2 uploads versions 2, 4, 6 whatever order they commit in; if version 4 fails,
    version 5 (the next to commit) is uploaded instead, then 6 as planned."""
    flaky = provider(FreshFlaky)
    eng = engine_factory(remote_every=2, keep_last=10, remote_keep_last=10, **NO_BEST_EFFORT_POOL)
    eng.register("w", flaky)
    # saves in flight together may commit in any order: the uploaded versions stay 2 and 4
    handles = [eng.save(s, on_busy="queue") for s in range(1, 5)]
    for h in handles:
        h.wait(timeout=60)
    uploaded = []
    for h in handles:
        try:
            uploaded.append(h.wait(timeout=60, durability="remote").version)
        except rc.SaveError as exc:
            assert "remote_every=2" in str(exc), exc
    assert uploaded == [2, 4]
    ray.get(flaky.set_failing.remote(True))
    with pytest.raises(rc.SaveError, match="capture failed on purpose"):
        eng.save(5).wait(timeout=60)  # version 5: not due
    with pytest.raises(rc.SaveError, match="capture failed on purpose"):
        eng.save(6).wait(timeout=60)  # version 6: due, failed
    ray.get(flaky.set_failing.remote(False))
    assert eng.save(7).wait(timeout=60, durability="remote").version == 7  # took version 6's turn
    assert eng.save(8).wait(timeout=60, durability="remote").version == 8  # due as planned
    with pytest.raises(rc.SaveError, match="remote_every=2"):
        eng.save(9).wait(timeout=60, durability="remote")
    remote_versions = sorted(m.version for m in eng.list_checkpoints() if "remote" in m.tiers)
    assert remote_versions == [2, 4, 7, 8], remote_versions
    # turns count saves, not step numbers: saving every 100 steps with remote_every=4 uploads the 4th
    eng4 = engine_factory(run=run_name + "b", remote_every=4, keep_last=10, remote_keep_last=10, **NO_BEST_EFFORT_POOL)
    eng4.register("w", flaky)
    assert eng4.status()["saves_until_upload"] == 4
    handles = [eng4.save(s, on_busy="queue") for s in range(100, 700, 100)]
    assert [h.wait(timeout=60).version for h in handles] == [100, 200, 300, 400, 500, 600]
    assert handles[3].wait(timeout=60, durability="remote").version == 400
    for h in handles[:3] + handles[4:]:
        with pytest.raises(rc.SaveError, match="remote_every=4 uploads one in every 4"):
            h.wait(timeout=60, durability="remote")
    assert eng4.status()["saves_until_upload"] == 2  # 500 and 600 counted since 400


def _block_remote(remote_run):
    """Make the remote run root unusable (a file where its directory was): uploads fail and retry."""
    aside = remote_run.with_name(remote_run.name + ".aside")
    remote_run.rename(aside)
    remote_run.write_bytes(b"not a directory")
    return lambda: (remote_run.unlink(), aside.rename(remote_run))


def _wait_upload_error(eng, version, timeout=60):
    deadline = time.time() + timeout
    while not ray.get(eng._coordinator.remote_error.remote(version), timeout=10):
        assert time.time() < deadline, f"version {version}'s upload never failed"
        time.sleep(0.1)


def test_an_upload_a_killed_coordinator_left_undone_is_resumed(engine_factory, tmp_path, run_name):
    """Committed locally, not yet uploaded, coordinator killed: the coordinator created again
    uploads that version (it rebuilt its catalogue from both tiers), and a fresh node restores it
    from the remote tier alone."""
    state = {"w": torch.arange(1000.0)}
    got = {}
    eng = engine_factory(**LEAN)
    eng.register("policy", lambda: state, loader=lambda s: got.update(s))
    eng.save(1).wait(timeout=60, durability="remote")
    unblock = _block_remote(tmp_path / "remote" / run_name)
    state["w"] = state["w"] * 2
    assert eng.save(2).wait(timeout=60).version == 2
    _wait_upload_error(eng, 2)
    coord = eng._coordinator
    eng._owner = False  # stands for a driver that is gone too: nothing creates the coordinator again
    ray.kill(coord, no_restart=True)
    _wait_dead(coord)
    unblock()
    eng2 = engine_factory(**LEAN)
    eng2.register("policy", lambda: state, loader=lambda s: got.update(s))
    deadline = time.time() + 60
    while (tiers := {m.version: m.tiers for m in eng2.list_checkpoints()}).get(2) != ("local", "remote"):
        assert time.time() < deadline, tiers
        time.sleep(0.1)
    assert eng2.wait_until_finished(timeout=60) == []
    shutil.rmtree(tmp_path / "local" / run_name / "v000000000002")  # as on a fresh node
    report = eng2.restore()
    assert report.version == 2 and report.states["policy"].tier == "remote"
    assert torch.equal(got["w"], state["w"])


def test_an_upload_whose_local_copy_is_corrupt_fails_loudly_and_passes_its_turn(engine_factory, tmp_path,
                                                                               run_name):
    """Retrying cannot repair a local file that no longer matches its manifest: the upload stops
    with a clear error on the handle, and the next version to commit is uploaded instead."""
    state = {"w": torch.arange(1000.0)}
    eng = engine_factory(remote_every=2, **LEAN)
    eng.register("policy", lambda: state, loader=lambda s: None)
    eng.save(1).wait(timeout=60)
    unblock = _block_remote(tmp_path / "remote" / run_name)
    h2 = eng.save(2)
    h2.wait(timeout=60)
    _wait_upload_error(eng, 2)
    p = tmp_path / "local" / run_name / "v000000000002" / "policy" / "rank0.safetensors"
    p.write_bytes(p.read_bytes()[:-1] + b"\x01")
    unblock()
    with pytest.raises(rc.SaveError, match=r"step 2 .*cannot be uploaded.*does not match its manifest"):
        h2.wait(timeout=120, durability="remote")
    assert eng.save(3).wait(timeout=60, durability="remote").version == 3  # took version 2's turn
    assert sorted(m.version for m in eng.list_checkpoints() if "remote" in m.tiers) == [3]
    assert not (tmp_path / "remote" / run_name / "v000000000002").exists()


def test_an_fsspec_filesystem_is_a_remote_tier(engine_factory, tmp_path, run_name):
    """remote_options={"filesystem": fs}: an fsspec filesystem (here fsspec's own local one, through
    pyarrow's PyFileSystem(FSSpecHandler)) is the remote tier of every writer actor; a fresh node
    restores from it."""
    import fsspec

    state = {"w": torch.randn(300, 7)}
    got = {}
    root = tmp_path / "fsspec-remote"
    eng = engine_factory(remote_uri=f"file://{root}", remote_options={"filesystem": fsspec.filesystem("file")}, **LEAN)
    eng.register("policy", lambda: state, loader=lambda s: got.update(s))
    assert eng.save(1).wait(timeout=60, durability="remote").durability == "remote"
    assert sorted(p.name for p in (root / run_name / "v000000000001").iterdir()) == ["manifest.json", "policy"]
    shutil.rmtree(tmp_path / "local" / run_name / "v000000000001")
    report = eng.restore()
    assert report.states["policy"].tier == "remote" and torch.equal(got["w"], state["w"])
    with pytest.raises(rc.InvalidArgumentError, match="pyarrow.fs.FileSystem or an fsspec filesystem"):
        engine_factory(run=run_name + "x", remote_options={"filesystem": "s3"})


def test_restore_with_rewind_continues_from_an_older_version(engine_factory, tmp_path, run_name, provider):
    learner = provider(FreshLearner, seed=10)
    eng = engine_factory(**LEAN)
    register_learner(eng, learner)
    snaps = {}
    for s in range(1, 5):
        ray.get(learner.train.remote())
        eng.save(s).wait(timeout=60, durability="remote")
        snaps[s] = ray.get(learner.snapshot.remote())
    eng.restore(step=2)
    with pytest.raises(rc.SaveError, match="steps must increase"):
        eng.save(3)                      # without rewind, v3 and v4 are still there
    report = eng.restore(step=2, rewind=True)
    assert report.rewound == (3, 4) and equal_snapshots(ray.get(learner.snapshot.remote()), snaps[2])
    assert [m.version for m in eng.list_checkpoints()] == [1, 2]
    assert _listing(tmp_path / "local" / run_name) == ["v000000000001", "v000000000002"]
    assert _listing(tmp_path / "remote" / run_name) == ["v000000000001", "v000000000002"]
    ray.get(learner.train.remote())
    assert eng.save(3).wait(timeout=60).version == 3   # the same step numbers again
    assert eng.restore().version == 3


def test_full_disk_fails_the_save_clearly_and_keeps_older_versions(small_disk, engine_factory, run_name):
    """The failure model's 'disk full': the save's handle raises SaveError naming the cause, the
    committed version is still listed and restores bit-exactly, nothing of the failed version is
    left on the disk, and once there is room again the next save commits."""
    disk = small_disk(96)
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}  # 1 MiB
    restored = {}
    eng = engine_factory(local_dir=str(disk), remote_uri=None, **LEAN)
    eng.register("policy", lambda: state, loader=lambda s: restored.update(s))
    assert eng.save(1).wait(timeout=60).version == 1
    first = {k: v.clone() for k, v in state.items()}
    state["w"] = torch.ones(40 << 20, dtype=torch.float32)  # 160 MiB: written with O_DIRECT, block by block
    with pytest.raises(rc.SaveError, match="No space left on device"):
        eng.save(2).wait(timeout=120)
    assert [m.version for m in eng.list_checkpoints()] == [1]
    left = sorted(str(p.relative_to(disk / run_name)) for p in (disk / run_name).rglob("*") if not p.name.startswith(_RUN_RECORDS))
    assert left == ["v000000000001", "v000000000001/manifest.json", "v000000000001/policy",
                    "v000000000001/policy/rank0.safetensors"], left
    report = eng.restore()
    assert report.version == 1 and report.states["policy"].status == "restored"
    assert torch.equal(restored["w"], first["w"])
    state["w"] = torch.full((1 << 18,), 2.0)
    assert eng.save(3).wait(timeout=60).version == 3
    assert [m.version for m in eng.list_checkpoints()] == [1, 3]


def test_best_effort_writes_are_rate_limited_and_do_not_hold_the_commit(engine_factory):
    """best_effort_max_mb_s: a 24 MiB replay buffer at 10 MB/s takes at least its share of time
    (chunks of 8 MiB are scheduled 0.84 s apart: the last two >= 1.68 s after the first), the version commits while it is still being
    written, and it restores bit-exactly."""
    replay = {"obs": torch.randint(0, 255, (24 << 20,), dtype=torch.uint8)}
    policy = {"w": torch.randn(1000)}
    got = {}
    eng = engine_factory(best_effort_max_mb_s=10, critical_writers=1)
    eng.register("policy", lambda: policy, loader=lambda s: got.update(policy=s))
    eng.register("replay", lambda: replay, strategy=rc.Strategy.BEST_EFFORT, loader=lambda s: got.update(replay=s))
    t0 = time.perf_counter()
    h = eng.save(1)
    assert h.wait(timeout=60).version == 1
    assert eng.list_checkpoints()[0].pending == ("replay",)  # committed without waiting for it
    h.wait(timeout=60, best_effort=True)
    assert time.perf_counter() - t0 >= (24 - 8) * (1 << 20) / 10e6
    assert eng.list_checkpoints()[0].pending == () and eng.list_checkpoints()[0].missing == ()
    report = eng.restore(strict=True)
    assert report.states["replay"].status == "restored"
    assert torch.equal(got["replay"]["obs"], replay["obs"]) and torch.equal(got["policy"]["w"], policy["w"])


def test_a_replay_buffer_is_an_arrow_file_and_restores_exactly(engine_factory, tmp_path, run_name, provider):
    """A best-effort replay buffer (a dict of equally long arrays) lands as replay/rank0.arrow on
    both tiers, readable by pyarrow alone, and a fresh buffer actor gets it back bit-exact and
    can go on filling it."""
    import numpy as np
    import pyarrow as pa

    buf = provider(FreshReplay, seed=4)
    fresh = provider(FreshReplay, seed=99, _slot=1)  # to restore into, later
    eng = engine_factory(critical_writers=1)
    eng.register("replay", buf, strategy=rc.Strategy.BEST_EFFORT)
    ray.get(buf.add.remote(1200))
    eng.save(1).wait(timeout=60, best_effort=True)
    ray.get(buf.add.remote(300))
    h = eng.save(2)
    h.wait(timeout=60, best_effort=True)
    want = ray.get(buf.contents.remote())
    for tier in ("local", "remote"):
        path = tmp_path / tier / run_name / "v000000000002" / "replay" / "rank0.arrow"
        if tier == "remote":
            h.wait(timeout=60, durability="remote")
            deadline = time.time() + 30
            while not path.exists():  # the best-effort part joins the remote copy after it lands
                assert time.time() < deadline, "replay buffer never reached the remote tier"
                time.sleep(0.1)
        table = pa.ipc.open_file(str(path)).read_all()
        assert table.num_rows == 5000 and table.column_names == ["obs", "action", "reward", "done"]
        assert np.array_equal(table.column("action").to_numpy(), want["action"])
    eng.register("replay", fresh, strategy=rc.Strategy.BEST_EFFORT, replace=True)
    report = eng.restore()
    assert report.states["replay"].status == "restored" and report.states["replay"].verified
    got = ray.get(fresh.contents.remote())
    assert all(got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and
               got[k].tobytes() == want[k].tobytes() for k in want)
    ray.get(fresh.add.remote(10))  # restored arrays are writable


def test_shutdown_lets_saves_and_retention_in_flight_finish(engine_factory, tmp_path, run_name, provider):
    """shutdown() right after save() calls that nobody waited for: the saves commit, retention
    ends, and nothing is still writing or deleting once it returns (a user may remove the
    directory next)."""
    learner = provider(FreshLearner, seed=3)
    eng = engine_factory(keep_last=1, remote_uri=None, **LEAN)
    eng.register("policy", learner)
    for step in (1, 2, 3):
        ray.get(learner.train.remote())
        eng.save(step)
    eng.shutdown()
    run_dir = tmp_path / "local" / run_name
    left = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    assert left == ["head.json", "v000000000003", "v000000000003/manifest.json", "v000000000003/policy",
                    "v000000000003/policy/rank0.safetensors"], left
    assert json.loads((run_dir / "head.json").read_bytes())["step"] == 3  # written before shutdown returned


def test_shutdown_lets_go_of_the_provider_actors_the_user_dropped(engine_factory):
    """A provider actor whose last handle the user dropped stops once the engine shuts down, even
    while Python's cycle collector has not run (the engine and its helpers refer to each other):
    otherwise it keeps its process and CPUs until some later collection."""
    import gc

    from actors import Replay, remote

    buf = remote(Replay).remote(capacity=64)
    actor_id = buf._actor_id.hex()
    eng = engine_factory(remote_uri=None, **LEAN)
    eng.register("buffer", buf, strategy="best_effort")
    assert eng.save(1).wait(120).step == 1
    gc.collect()
    gc.disable()  # what a test cannot rely on: a collection happening to run in between
    try:
        eng.shutdown()
        del buf
        deadline = time.monotonic() + 60
        while ray._private.state.actors(actor_id)["State"] != "DEAD":
            assert time.monotonic() < deadline, "the provider actor is still alive 60 s after shutdown()"
            time.sleep(0.2)
    finally:
        gc.enable()


@pytest.mark.timeout(120)
def test_small_in_process_states_are_the_bytes_of_their_save(engine_factory, run_name):
    """Small in-process states travel inline in the save call, not through one object-store put
    each (capture.calls._sendable): still the state's bytes at save(), whatever the caller changes
    in place afterwards -- in the stored version and in the snapshot that handle.refs() hands out --
    while a large one beside them still goes through the object store."""
    import numpy as np

    counters = {"step": np.arange(4, dtype=np.int64), "lr": np.float64(0.5)}
    big = {"w": np.ones(1 << 17, np.float32)}  # 512 KiB: above the inline limit
    eng = engine_factory(**LEAN)
    eng.register("counters", lambda: counters)
    eng.register("weights", lambda: big)
    h = eng.save(1)
    counters["step"] += 100  # in place, right after save() returned
    big["w"] *= 3
    h.wait(timeout=60)
    assert eng.load("counters", 1)["step"].tolist() == [0, 1, 2, 3]
    assert float(eng.load("weights", 1)["w"].max()) == 1.0
    (ref,) = h.refs("counters")
    assert isinstance(ref, ray.ObjectRef)
    assert rc.state_from_snapshot(ref)["step"].tolist() == [0, 1, 2, 3]
    assert float(rc.state_from_snapshot(h.refs("weights")[0])["w"].max()) == 1.0
    # a caller that keeps handles of ended saves lets go of their snapshots (the RLlib callback does)
    h.release_snapshots()
    with pytest.raises(rc.InvalidArgumentError, match="released"):
        h.refs("weights")
    assert h.wait(timeout=5).version == 1  # the handle itself still answers


@pytest.mark.timeout(120)
def test_no_garbage_collection_runs_inside_save(engine_factory, run_name):
    """save() pauses the collector while it captures (capture/gc_pause.py): a capture's thousands of
    short-lived containers are freed by reference counting instead of being moved up the
    generations, where they set off the full collections that pause a training process for
    tenths of a second; the collector is on again when save() returns, and off if it was off."""
    import gc

    import numpy as np

    def busy_state():
        scratch = [{"i": i, "v": [i]} for i in range(50_000)]  # ~100k containers, alive until return
        return {"n": np.array([len(scratch)])}

    eng = engine_factory(**LEAN)
    eng.register("busy", busy_state)
    ran = []

    def watch(phase, info):
        if phase == "start":
            ran.append(info["generation"])

    assert gc.isenabled()
    gc.collect()  # the young generation empty: save()'s own few allocations before its capture start none
    gc.callbacks.append(watch)
    try:
        h1 = eng.save(1)
        during, ran[:] = list(ran), []
        gc.disable()
        try:
            h2 = eng.save(2)
            assert not gc.isenabled()  # the caller's choice is kept
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(watch)
    assert during == [], f"collections of generations {during} ran inside save()"
    assert gc.isenabled()
    assert h1.wait(timeout=60).version == 1 and h2.wait(timeout=60).version == 2
    assert eng.load("busy", 2)["n"].tolist() == [50_000]
    # without the pause the same capture runs collections (what the test would see if it broke)
    gc.callbacks.append(watch)
    try:
        busy_state()
    finally:
        gc.callbacks.remove(watch)
    assert ran, "the provider's containers set off no collection: this test shows nothing"
