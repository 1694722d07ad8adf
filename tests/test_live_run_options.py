"""Issue 29, "safe to operate": the options of a live run (create() of a running run with other
options raises naming each, reconfigure=True changes the live ones) and ``ray-ckpt gc`` on a run
whose owner's lease is fresh (refused naming the owner, ``--force``, ``--dry-run``)."""
import json
import os
import re
import time

import pytest

import ray_ckpt as rc
from ray_ckpt.cli import main
from ray_ckpt.config import EngineConfig
from ray_ckpt.coordinator.live_options import LIVE, check, differences, option_names

SMALL = dict(critical_writers=1, best_effort_writers=0)


def _save(eng, *steps):
    for step in steps:
        eng.save(step).wait(timeout=60)


def _until(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cond()


# ---------------------------------------------------------------------------- plain Python
def test_every_option_is_compared_and_secrets_never_shown():
    running = EngineConfig(run="r", local_dir="/tmp/x", keep_last=5, signing_key=b"old-key",
                           remote_options={"secret_key": "s3cr3t"})
    asked = EngineConfig(run="r", local_dir="/tmp/x", keep_last=1, signing_key=b"new-key", rank_timeout_s=5,
                         remote_options={"secret_key": "zz9-secret"})
    names = set(option_names())
    assert {"keep_last", "signing_key", "rank_timeout_s", "local_dir", "upload_retries", "extra"} <= names
    # an option not passed is not compared (rank_timeout_s here); local_dir / remote_uri always are
    assert [d[0] for d in differences(running, asked, ["keep_last", "signing_key"])] == ["keep_last", "signing_key"]
    with pytest.raises(rc.InvalidArgumentError) as exc:
        check("r", running, asked, ["keep_last", "signing_key", "rank_timeout_s", "remote_options"], False)
    msg = str(exc.value)
    for text in ("keep_last=5 (running) vs 1 (asked)", "signing_key differs", "rank_timeout_s=600.0",
                 "remote_options differs", "reconfigure=True"):
        assert text in msg, msg
    for secret in ("old-key", "new-key", "s3cr3t", "zz9-secret"):
        assert secret not in msg
    # reconfigure: live ones are returned, a fixed one refuses everything
    assert check("r", running, asked, ["keep_last", "signing_key", "rank_timeout_s"], True) == {
        "keep_last": 1, "signing_key": b"new-key", "rank_timeout_s": 5}
    with pytest.raises(rc.InvalidArgumentError, match="remote_options differs.*needs a new run"):
        check("r", running, asked, ["keep_last", "remote_options"], True)
    assert "local_dir" not in LIVE and "critical_writers" not in LIVE and "keep_last" in LIVE
    # compared as normalised: keep_best as a list or a tuple, a directory with a trailing slash
    a = EngineConfig(run="r", local_dir="/tmp/x/", keep_best=["reward", "max", 2])
    b = EngineConfig(run="r", local_dir="/tmp/x", keep_best=("reward", "max", 2))
    assert differences(a, b, ["keep_best"]) == []


# ---------------------------------------------------------------------------- a live run
def test_create_of_a_live_run_with_other_options_raises_naming_each(engine_factory, tmp_path, run_name):
    eng = engine_factory(keep_last=5, signing_key=b"first-key", **SMALL)
    eng.register("w", lambda: {"x": [1]}, loader=lambda s: None)
    _save(eng, 1)
    local, remote = str(tmp_path / "local"), f"file://{tmp_path / 'remote'}"
    with pytest.raises(rc.InvalidArgumentError) as exc:
        rc.CheckpointEngine.create(run_name, local_dir=local, remote_uri=remote, keep_last=1,
                                   signing_key=b"new-key", rank_timeout_s=5)
    msg = str(exc.value)
    for name in ("keep_last=5 (running) vs 1 (asked)", "signing_key differs", "rank_timeout_s=600.0 (running) vs 5"):
        assert name in msg, msg
    assert "first-key" not in msg and "new-key" not in msg
    # nothing changed: the run keeps its options
    assert rc.CheckpointEngine.connect(run_name).config.keep_last == 5
    # the same options again (a restarted driver), or only the tiers, attach as before
    again = engine_factory(keep_last=5, signing_key=b"first-key", **SMALL)
    assert again.reconfigured == [] and again.config.keep_last == 5
    plain = engine_factory()
    assert plain.config.keep_last == 5 and [m.step for m in plain.list_checkpoints()] == [1]


def test_reconfigure_applies_retention_live_and_refuses_local_dir(engine_factory, tmp_path, run_name):
    eng = engine_factory(keep_last=5, **SMALL)
    eng.register("w", lambda: {"x": [1, 2, 3]}, loader=lambda s: None)
    _save(eng, 1, 2, 3)
    assert [m.step for m in eng.list_checkpoints()] == [1, 2, 3]
    # an option that cannot change live: refused naming it, and nothing changed (keep_last neither)
    with pytest.raises(rc.InvalidArgumentError) as exc:
        engine_factory(local_dir=str(tmp_path / "elsewhere"), keep_last=1, reconfigure=True, **SMALL)
    assert "local_dir=" in str(exc.value) and "needs a new run" in str(exc.value)
    assert rc.CheckpointEngine.connect(run_name).config.keep_last == 5
    with pytest.raises(rc.InvalidArgumentError, match="critical_writers=1 .* needs a new run"):
        engine_factory(critical_writers=3, best_effort_writers=0, reconfigure=True)
    new = engine_factory(keep_last=1, rank_timeout_s=30.0, reconfigure=True, **SMALL)
    assert new.reconfigured == ["keep_last", "rank_timeout_s"]
    assert new.config.keep_last == 1 and new.config.rank_timeout_s == 30.0
    _until(lambda: [m.step for m in new.list_checkpoints()] == [3])  # pruned at once, in the background
    new.register("w", lambda: {"x": [4]}, loader=lambda s: None, replace=True)
    _save(new, 4)  # and after every commit: only the newest stays
    _until(lambda: [m.step for m in new.list_checkpoints()] == [4])
    assert sorted(p for p in os.listdir(tmp_path / "local" / run_name) if p.startswith("v")) == ["v000000000004"]


# ---------------------------------------------------------------------------- gc and the owner
def _gc(capsys, *args):
    code = main([str(a) for a in ("gc", *args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_gc_follows_the_owner_record_lease_without_ray(tmp_path, capsys):
    """A fresh lease refuses (even with nothing to delete); an expired or unreadable one does not."""
    from test_cli_output import make_run

    from ray_ckpt.storage.ownership import OWNER_FILE, OwnerRecord

    root = make_run(tmp_path / "run", versions=(1, 2, 3))
    now = time.time()
    fresh = OwnerRecord("c" * 16, "02000000", 3, "trainer-7", 4242, now - 100, now - 10, 60.0)
    (root / OWNER_FILE).write_bytes(fresh.to_json())
    code, _out, err = _gc(capsys, root, "--keep-last", "5")
    assert code == 1 and "job 02000000" in err and "trainer-7" in err and "token 3" in err, err
    m = re.search(r"lease expires in (\d+)s", err)
    assert m and 45 <= int(m.group(1)) <= 50, err
    expired = OwnerRecord("c" * 16, "02000000", 3, "trainer-7", 4242, now - 500, now - 200, 60.0)
    (root / OWNER_FILE).write_bytes(expired.to_json())
    code, out, err = _gc(capsys, root, "--keep-last", "1", "--json")
    assert code == 0 and json.loads(out)["live_owner"] is None and "owned by" not in err
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("v")) == ["v000000000003"]
    (root / OWNER_FILE).write_bytes(b"{not json")
    code, out, err = _gc(capsys, root, "--keep-last", "1")
    assert code == 0 and "cannot read the run's owner record" in err


def test_gc_on_a_live_run_is_refused_naming_the_owner_unless_forced(engine_factory, tmp_path, run_name, capsys):
    eng = engine_factory(**SMALL)
    eng.register("w", lambda: {"x": [1]}, loader=lambda s: None)
    _save(eng, 1, 2, 3)
    root = tmp_path / "local" / run_name
    versions = lambda: sorted(p for p in os.listdir(root) if p.startswith("v"))  # noqa: E731
    assert versions() == ["v000000000001", "v000000000002", "v000000000003"]

    code, out, err = _gc(capsys, root, "--keep-last", "1")
    assert code != 0 and "gc refused" in err and "owned by a live engine" in err, err
    assert "job " in err and "lease expires in" in err and "--force" in err
    assert len(err.strip().splitlines()) == 1
    assert versions() == ["v000000000001", "v000000000002", "v000000000003"]

    code, out, err = _gc(capsys, root, "--keep-last", "1", "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["dry_run"] and [d["version"] for d in doc["deleted"]] == [1, 2]
    assert "lease_expires_in_s" in doc["live_owner"] and "owned by a live engine" in err
    code, out, err = _gc(capsys, root, "--keep-last", "1", "--dry-run")
    assert code == 0 and "would delete version 1" in out and "would delete version 2" in out
    assert versions() == ["v000000000001", "v000000000002", "v000000000003"]

    code, out, err = _gc(capsys, root, "--keep-last", "1", "--force")
    assert code == 0, err
    assert "--force: deleting anyway" in err and "told the live engine" in err and "deleted 2 versions" in out
    assert versions() == ["v000000000003"]
    # the live engine noticed before the files went: it never lists what gc removed (from the local
    # tier: versions 1 and 2 are still on the remote one)
    assert {m.step: m.tiers for m in eng.list_checkpoints()} == {1: ("remote",), 2: ("remote",),
                                                                   3: ("local", "remote")}
    _save(eng, 4)
    assert eng.restore(step=1).step == 1  # read from the remote tier
    assert [m.step for m in eng.list_checkpoints()] == [1, 2, 3, 4]
    eng.save(5).wait(timeout=60, durability="remote")
    code, out, err = _gc(capsys, tmp_path / "remote" / run_name, "--keep-last", "3", "--force")
    assert code == 0 and "deleted 2 versions" in out, err
    assert {m.step: m.tiers for m in eng.list_checkpoints()} == {3: ("local", "remote"), 4: ("local", "remote"),
                                                                   5: ("local", "remote")}

    eng.shutdown()  # the lease is released: gc goes on without --force
    code, out, err = _gc(capsys, root, "--keep-last", "1")
    assert code == 0 and "owned by" not in err and "deleted 2 versions" in out, err


def test_gc_force_on_the_local_tier_loses_that_copy_only(engine_factory, tmp_path, run_name, capsys):
    """Issue 44: versions gc --force deletes from the local tier stay listed (their remote copies are
    intact) and restore from the remote tier bit-exact."""
    import numpy as np

    eng = engine_factory(**SMALL)
    state = {}
    eng.register("w", lambda: dict(state), loader=lambda s: state.update(s))
    saved = {}
    for step in (1, 2, 3, 4):
        state["x"] = np.random.default_rng(step).standard_normal(1000)
        saved[step] = state["x"].copy()
        eng.save(step).wait(timeout=60, durability="remote")
    code, out, err = _gc(capsys, tmp_path / "local" / run_name, "--keep-last", "1", "--force")
    assert code == 0 and "deleted 3 versions" in out, err
    assert sorted(p for p in os.listdir(tmp_path / "local" / run_name) if p.startswith("v")) == ["v000000000004"]
    assert {m.step: m.tiers for m in eng.list_checkpoints()} == {1: ("remote",), 2: ("remote",), 3: ("remote",),
                                                                   4: ("local", "remote")}
    for step in (2, 1):
        state.clear()
        report = eng.restore(step=step)
        assert report.step == step and report.states["w"].tier is rc.TierName.REMOTE, report
        assert state["x"].tobytes() == saved[step].tobytes()
    assert eng.restore().step == 4 and state["x"].tobytes() == saved[4].tobytes()
