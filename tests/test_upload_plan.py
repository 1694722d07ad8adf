"""The Ray-free pieces of the coordinator: the upload plan, the typed protocol, restore's plan stage."""
import dataclasses

import pytest

import ray_ckpt as rc
from ray_ckpt.formats.manifest import FileEntry, Manifest, StateEntry
from ray_ckpt.protocol import CoordinatorStatus, PartPlan, PartStatus, SaveOutcome, VersionStatus
from ray_ckpt.storage.retention import RetentionPolicy
from ray_ckpt.coordinator.upload_plan import UploadPlan


def _manifest(v, files=("policy",), shared=None):
    m = Manifest("run", v, v, 0.0)
    for name in files:
        m.states[name] = StateEntry("critical", "stored", files={"0": [
            FileEntry(f"v{v:012d}/{name}/rank0.safetensors", 10, f"c{v}")]}, bytes=10)
    if shared:
        m.states["ref"] = StateEntry("reloadable", "stored", files={"0": [FileEntry(shared, 5, "s")]}, bytes=5)
    return m


def test_every_mth_save_is_uploaded_and_a_failed_turn_passes_to_the_next_commit():
    plan = UploadPlan(every=2, enabled=True)
    for v, due in [(1, False), (2, True), (3, False), (4, True), (5, False)]:
        plan.opened(v, due)
    assert "remote_every=2" in plan.on_commit(1)
    assert plan.on_commit(2) is None and 2 in plan.uploading
    plan.missed(4)                      # version 4 (due) failed locally
    assert plan.owed
    assert plan.on_commit(3) is None    # the next to commit takes its turn
    assert not plan.owed and "not uploaded" in plan.on_commit(5)


def test_upload_bookkeeping_files_once_errors_and_giving_up():
    plan = UploadPlan(every=1, enabled=True)
    m1 = _manifest(1, shared="v000000000001/ref/rank0.safetensors")
    m2 = _manifest(2, shared="v000000000001/ref/rank0.safetensors")
    plan.opened(1, True)
    assert plan.on_commit(1) is None
    files = plan.files_to_upload(m1)
    assert len(files) == 2
    plan.failed(1, "connection refused", permanent=False)   # retried: still uploading, error shown
    assert 1 in plan.uploading and plan.upload_state(1) == "uploading (last error: connection refused)"
    plan.files_uploaded(files)
    assert plan.succeeded(1, m1, files) == 15 + len(m1.to_json())
    assert plan.should_stop(1, m1) and 1 not in plan.uploading and plan.errors == {}
    # the RELOADABLE file stored once is uploaded once
    assert [f.path for f in plan.files_to_upload(m2)] == ["v000000000002/policy/rank0.safetensors"]
    plan.opened(2, True)
    plan.on_commit(2)
    plan.failed(2, "local copy is corrupt", permanent=True)
    assert 2 in plan.given_up and 2 not in plan.uploading and plan.owed
    assert plan.should_stop(2, m2)


def test_a_restarted_plan_owes_the_newest_local_version_when_enough_are_newer():
    remote = {1: _manifest(1)}
    assert UploadPlan(2, True, remote, local_committed=[1, 2]).resume == []      # one newer: not due yet
    plan = UploadPlan(2, True, remote, local_committed=[1, 2, 3])
    assert plan.resume == [3] and 3 in plan.uploading
    assert plan.take_resume() == [3] and plan.resume == []
    assert UploadPlan(1, False, {}, local_committed=[1, 2]).resume == []         # no remote tier


def test_a_restarted_plan_resyncs_a_remote_copy_older_than_the_local_one():
    """A best-effort part that joined version 1's local manifest after its upload, and a coordinator
    restarted before the re-sync: the new plan uploads version 1 again (its new file only)."""
    remote = {1: _manifest(1), 2: _manifest(2)}
    local = {1: _manifest(1, files=("policy", "replay")), 2: _manifest(2)}
    plan = UploadPlan(5, True, remote, local_committed=local)
    assert plan.take_resume() == [1] and 1 in plan.uploading
    assert [f.path for f in plan.files_to_upload(local[1])] == ["v000000000001/replay/rank0.safetensors"]
    assert UploadPlan(5, True, remote, local_committed=dict(remote)).resume == []  # the same: nothing owed


def test_remote_retention_keeps_shared_files_and_uploads_in_progress():
    shared = "v000000000001/ref/rank0.safetensors"
    plan = UploadPlan(1, True, {v: _manifest(v, shared=shared) for v in (1, 2, 3)})
    local = {4: _manifest(4, shared=shared)}
    plan.opened(4, True)
    plan.on_commit(4)  # uploading: protected, and its files are kept
    gone = plan.plan_retention(RetentionPolicy(keep_last=1), local)
    assert [d.version for d in gone] == [1, 2]
    assert shared in gone[0].keep and shared in plan.paths
    assert sorted(plan.committed) == [3]
    assert [d.version for d in plan.plan_rewind(0)] == [3] and plan.committed == {}


def test_save_result_carries_every_field_of_the_coordinator_outcome():
    outcome = SaveOutcome(7, 7, "local", 123, ("policy", "replay"), 0.5, {"write_s": 0.1}, ("replay",), (),
                          rank_zero_only=True)
    result = outcome.result()
    for f in dataclasses.fields(SaveOutcome):
        assert getattr(result, f.name) == getattr(outcome, f.name), f.name


def test_status_is_typed_and_reads_as_before():
    st = CoordinatorStatus("run", (VersionStatus(3, 3, "writing (0/1 parts)", (PartStatus("shard", 1, "pending"),)),
                                   VersionStatus(2, None, "committed", upload="uploading")),
                           0, 0, 1, 0, 1, 0, None, 0.0, "node", {"n": 2}, False)
    d = st.to_dict()
    assert d["in_flight"][3]["parts"] == {"shard/rank1": "pending"}
    assert d["in_flight"][2] == {"stage": "committed", "remote": "uploading"}


def test_restore_plan_refuses_a_rank_local_state_on_another_world_size_before_touching_actors():
    ray = pytest.importorskip("ray")  # noqa: F841  (imported by ray_ckpt.restore; no cluster is started)
    from ray_ckpt.capture.providers import Registration
    from ray_ckpt.client.restore import plan
    from ray_ckpt.capture.snapshot import ActorProvider

    m = Manifest("run", 5, 5, 0.0)
    m.states["shard"] = StateEntry("critical", "stored", files={str(r): [
        FileEntry(f"v000000000005/shard/rank{r}.safetensors", 1, "x")] for r in range(4)})
    reg = Registration("shard", None, rc.Strategy.CRITICAL, world_size=2,
                       rank_providers=[ActorProvider(object()), ActorProvider(object())])
    with pytest.raises(rc.RestoreError, match=r"saved by 4 ranks.*2 rank providers.*world size 4 != 2"):
        plan(m, {"shard": reg}, ["shard"])
    reg4 = dataclasses.replace(reg, world_size=4, rank_providers=[ActorProvider(object())] * 4)
    p = plan(m, {"shard": reg4}, ["shard"])
    assert [(a.name, a.rank) for a in p.actor_reads] == [("shard", r) for r in range(4)]


def test_part_plans_from_the_engine_reach_the_catalogue_typed():
    from ray_ckpt.coordinator.catalogue import Catalogue

    cat = Catalogue("run")
    cat.begin(1, 1, [PartPlan("policy", rc.Strategy.CRITICAL), PartPlan("ref", rc.Strategy.RELOADABLE, loader=True)])
    assert set(cat.pending[1].parts) == {("policy", 0)} and cat.pending[1].loader_states == {"ref"}
