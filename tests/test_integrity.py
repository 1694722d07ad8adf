"""Storage that lies: copied, edited, unreadable or unsigned manifests are never restored as
something they are not, and what was passed over is said (restore report, status)."""
import json
import shutil
import time

import pytest
import ray

import ray_ckpt as rc
from actors import FreshLearner

pytestmark = pytest.mark.timeout(240)


# one state, saved one version at a time: one critical writer and no best-effort pool are enough
# (each writer is a process to start; the pools' sizes are not what these tests are about)
LEAN = {"remote_uri": None, "critical_writers": 1, "best_effort_writers": 0}


def _three_versions(engine_factory, provider, **kw):
    learner = provider(FreshLearner, seed=3)  # the session's pooled actor (conftest.py), reset
    eng = engine_factory(**LEAN, **kw)
    eng.register("policy", learner)
    for step in (1, 2, 3):
        ray.get(learner.train.remote())
        eng.save(step).result(timeout=60)
    return eng, learner


def _reopen(eng, engine_factory, learner, **kw):
    eng.shutdown()
    eng2 = engine_factory(**LEAN, **kw)  # a new coordinator rebuilds its catalogue from storage
    eng2.register("policy", learner)
    return eng2


def _manifest(tmp_path, run_name, v):
    return tmp_path / "local" / run_name / f"v{v:012d}" / "manifest.json"


def test_a_copied_manifest_and_an_unreadable_one_are_skipped_and_said(engine_factory, tmp_path, run_name, provider):
    eng, learner = _three_versions(engine_factory, provider)
    _manifest(tmp_path, run_name, 3).write_bytes(_manifest(tmp_path, run_name, 1).read_bytes())  # copied in
    eng2 = _reopen(eng, engine_factory, learner)
    assert [m.version for m in eng2.list_checkpoints()] == [1, 2]
    assert "version 1" in eng2.status()["skipped_versions"][3]
    report = eng2.restore()
    assert report.version == 2 and "version 1" in report.skipped_versions[3]
    assert "skipped newer version 3" in str(report)
    _manifest(tmp_path, run_name, 2).write_bytes(b"{ not json")
    eng3 = _reopen(eng2, engine_factory, learner)
    report = eng3.restore()
    assert report.version == 1 and set(report.skipped_versions) == {2, 3}
    assert "unreadable manifest" in report.skipped_versions[2]


def test_a_replaced_manifest_breaks_the_chain_of_its_successor(engine_factory, tmp_path, run_name, provider):
    eng, learner = _three_versions(engine_factory, provider)
    m2 = json.loads(_manifest(tmp_path, run_name, 2).read_bytes())
    m1 = json.loads(_manifest(tmp_path, run_name, 1).read_bytes())
    assert m2["previous_version"] == 1 and m2["previous"].startswith("sha256:")
    m1["metrics"] = {"reward": 1e9}  # an older manifest "improved" in place: checksums of files still match
    _manifest(tmp_path, run_name, 1).write_text(json.dumps(m1))
    eng2 = _reopen(eng, engine_factory, learner)
    assert [m.version for m in eng2.list_checkpoints()] == [2, 3]
    assert "not the one version 2 was committed after" in eng2.status()["skipped_versions"][1]


def test_signed_manifests_refuse_edits_and_unsigned_ones(engine_factory, tmp_path, run_name, provider):
    eng, learner = _three_versions(engine_factory, provider, signing_key=b"k" * 32)
    m3 = json.loads(_manifest(tmp_path, run_name, 3).read_bytes())
    assert len(m3["signature"]) == 64
    m3["step"] = 30  # an edit that keeps the JSON valid
    _manifest(tmp_path, run_name, 3).write_text(json.dumps(m3))
    del m3["signature"]
    m3["step"] = 2
    eng2 = _reopen(eng, engine_factory, learner, signing_key=b"k" * 32)
    assert [m.version for m in eng2.list_checkpoints()] == [1, 2]
    assert "signature does not verify" in eng2.status()["skipped_versions"][3]
    report = eng2.restore()
    assert report.version == 2 and 3 in report.skipped_versions
    with pytest.raises(rc.InvalidArgumentError, match="signing_key"):
        engine_factory(remote_uri=None, signing_key=b"")
    assert "k" * 32 not in repr(eng2.config)


def test_keys_rotate_with_a_key_ring_and_untrusted_versions_are_never_written_over(engine_factory, tmp_path,
                                                                                  run_name, provider):
    old, new = b"o" * 32, b"n" * 32
    eng, learner = _three_versions(engine_factory, provider, signing_key=old)
    v3 = _manifest(tmp_path, run_name, 3).read_bytes()
    # the key rotated by replacing it: nothing the old key signed verifies, so nothing is listed ...
    eng2 = _reopen(eng, engine_factory, learner, signing_key=new)
    assert eng2.list_checkpoints() == [] and set(eng2.status()["skipped_versions"]) == {1, 2, 3}
    # ... and a save of one of those steps is refused, not written over the version it would replace
    with pytest.raises(rc.SaveError, match=r"step 3 .* is not trusted \(.*signature does not verify.*never "
                                           r"written over"):
        eng2.save(3).result(timeout=60)
    assert _manifest(tmp_path, run_name, 3).read_bytes() == v3
    eng2.save(4).result(timeout=60)  # a later step is fine, signed with the new key
    # rotated with a key ring instead: the new key signs, both verify; every version is back
    eng3 = _reopen(eng2, engine_factory, learner, signing_key=[new, old])
    assert [m.version for m in eng3.list_checkpoints()] == [1, 2, 3, 4]
    assert eng3.restore(step=3).version == 3 and eng3.restore().version == 4
    eng3.save(5).result(timeout=60)
    # the ring's first key signed version 5: with the new key alone, 4 and 5 verify, the old ones not
    eng4 = _reopen(eng3, engine_factory, learner, signing_key=new)
    assert [m.version for m in eng4.list_checkpoints()] == [4, 5]
    with pytest.raises(rc.InvalidArgumentError, match="empty key ring"):
        engine_factory(remote_uri=None, signing_key=[])


def test_an_untrusted_remote_copy_is_never_uploaded_over(engine_factory, tmp_path, run_name, provider):
    old, new = b"o" * 32, b"n" * 32
    remote = {"remote_uri": f"file://{tmp_path / 'remote'}", "critical_writers": 1, "best_effort_writers": 0}
    learner = provider(FreshLearner, seed=4)
    eng = engine_factory(**remote, signing_key=old)
    eng.register("policy", learner)
    eng.save(1).wait(timeout=60, durability="remote")
    remote_v1 = tmp_path / "remote" / run_name / "v000000000001" / "manifest.json"
    signed_by_old = remote_v1.read_bytes()
    eng.shutdown()
    # the run goes on elsewhere with a new key and its own local tier, first without the remote tier
    other = {"local_dir": str(tmp_path / "other")}
    eng2 = engine_factory(**LEAN, **other, signing_key=new)
    eng2.register("policy", learner)
    ray.get(learner.train.remote())
    eng2.save(1).result(timeout=60)
    eng2.shutdown()
    # with the remote tier back, local version 1 (trusted) is owed an upload, but the remote tier
    # holds another version 1 that the new key does not verify: it stays as found
    eng3 = engine_factory(**remote, **other, signing_key=new)
    eng3.register("policy", learner)
    deadline = time.monotonic() + 60
    while "is not uploaded: the remote tier holds a copy" not in (eng3.status()["last_error"] or ""):
        assert time.monotonic() < deadline, eng3.status()
        time.sleep(0.1)
    assert "step 1 of run" in eng3.status()["last_error"] and "never written over" in eng3.status()["last_error"]
    assert eng3.save(2).wait(timeout=60, durability="remote").version == 2  # later versions upload as usual
    assert remote_v1.read_bytes() == signed_by_old
    assert [m.version for m in eng3.list_checkpoints()] == [1, 2]


def test_newest_versions_deleted_behind_the_engines_back_are_reported_and_their_steps_not_reused(
        engine_factory, tmp_path, run_name, provider):
    eng, learner = _three_versions(engine_factory, provider, signing_key=b"k" * 32)
    shutil.rmtree(_manifest(tmp_path, run_name, 3).parent)  # the newest version lost; 1 and 2 still chain
    eng2 = _reopen(eng, engine_factory, learner, signing_key=b"k" * 32)
    assert [m.version for m in eng2.list_checkpoints()] == [1, 2]
    why = eng2.status()["skipped_versions"][3]
    assert "committed before" in why and "head record names step 3" in why and "newest version found is 2" in why
    report = eng2.restore()
    assert report.version == 2 and "now missing" in report.skipped_versions[3]
    with pytest.raises(rc.SaveError, match="step 3 is not after the last saved step 3"):
        eng2.save(3)  # step 3 named another version: never reused
    eng2.save(4).result(timeout=60)
    # rewind is how a user goes back on purpose: the head comes down with the versions it deletes
    eng3 = _reopen(eng2, engine_factory, learner, signing_key=b"k" * 32)
    assert eng3.status()["skipped_versions"] == {}  # the head names 4, which is there
    assert eng3.restore(step=2, rewind=True).rewound == (4,)
    eng3.save(3).result(timeout=60)
    eng4 = _reopen(eng3, engine_factory, learner, signing_key=b"k" * 32)
    assert [m.version for m in eng4.list_checkpoints()] == [1, 2, 3] and eng4.status()["skipped_versions"] == {}
    # a head record edited to claim a newer step does not verify under the run's key: not trusted
    head = tmp_path / "local" / run_name / "head.json"
    edited = json.loads(head.read_bytes())
    assert edited["step"] == 3 and len(edited["signature"]) == 64
    head.write_text(json.dumps(dict(edited, step=9)))
    eng5 = _reopen(eng4, engine_factory, learner, signing_key=b"k" * 32)
    assert eng5.status()["skipped_versions"] == {}
    eng5.save(4).result(timeout=60)
