"""One owner per run: a second driver is refused, a takeover fences the old owner's saves."""
import os
import subprocess
import sys
import time

import pytest
import ray
import torch

import ray_ckpt as rc
from ray_ckpt.storage.ownership import OwnerRecord, claim, fence_error

HERE = os.path.dirname(os.path.abspath(__file__))


def test_claim_rules_without_storage():
    now = 1000.0
    first = claim(None, "c1", "j1", takeover=False, run="r", now=now)
    assert first.token == 1
    assert claim(first, "c1", "j1", takeover=False, run="r", now=now + 5).token == 1      # the owner again
    with pytest.raises(rc.OwnershipError, match=r"owned by job j1 of Ray cluster c1.*takeover=True"):
        claim(first, "c2", "j9", takeover=False, run="r", now=now + 5)
    assert claim(first, "c2", "j9", takeover=True, run="r", now=now + 5).token == 2       # taken over
    assert claim(first, "c2", "j9", takeover=False, run="r", now=now + 61).token == 2     # lease expired
    dead = claim(first, "c1", "j2", takeover=False, run="r", now=now + 5, job_alive=lambda j: False)
    assert dead.token == 2 and dead.job == "j2"                                           # same cluster, job gone
    with pytest.raises(rc.OwnershipError):
        claim(first, "c1", "j2", takeover=False, run="r", now=now + 5, job_alive=lambda j: True)
    assert fence_error(dead, 1, "r") and "stale" in fence_error(dead, 1, "r")
    assert fence_error(dead, 2, "r") is None and fence_error(None, 1, "r") is None
    with pytest.raises(rc.IntegrityError, match="unreadable owner record"):
        OwnerRecord.from_json(b'{"token": "x"}')


# one critical writer and no best-effort pool: one small state saved at a time (every writer is a
# process to start, seconds on a 2-core machine)
LEAN = {"critical_writers": 1, "best_effort_writers": 0}


def _start(args, tmp_path):
    out = open(tmp_path / "driver.log", "w+")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "owner_scenario.py")] + args,
                            stdout=out, stderr=subprocess.STDOUT, cwd=HERE)
    return proc, out


def _wait_line(proc, out, prefix, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        out.seek(0)
        for line in out.read().splitlines():
            if line.startswith(prefix):
                return line
        if proc.poll() is not None and prefix != "":
            out.seek(0)
            pytest.fail(f"the other driver ended without {prefix!r}:\n{out.read()[-3000:]}")
        time.sleep(0.1)
    out.seek(0)
    pytest.fail(f"no {prefix!r} from the other driver within {timeout}s:\n{out.read()[-3000:]}")


@pytest.mark.slow  # 20-35 s: starts a second Ray cluster
@pytest.mark.timeout(420)
def test_a_second_cluster_is_refused_and_a_takeover_fences_the_old_owner(engine_factory, tmp_path, run_name):
    shared = str(tmp_path / "shared")
    go = str(tmp_path / "go")
    proc, out = _start([shared, run_name, go], tmp_path)  # driver A: a Ray cluster of its own
    try:
        _wait_line(proc, out, "SAVED 1")
        with pytest.raises(rc.OwnershipError, match=r"is owned by job .* takeover=True"):
            engine_factory(local_dir=shared, remote_uri=None, **LEAN)
        eng = engine_factory(local_dir=shared, remote_uri=None, **LEAN, takeover=True)
        state = {"w": torch.full((8,), 5.0)}
        eng.register("policy", lambda: state, loader=lambda s: None)
        assert eng.save(5).result(timeout=120).version == 5
        open(go, "w").close()
        line = _wait_line(proc, out, ("COMMITTED", "REFUSED"))
        assert "taken over" in line and "stale" in line
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
    assert [m.version for m in eng.list_checkpoints()] == [1, 5]
    assert not os.path.exists(os.path.join(shared, run_name, "v000000000006"))
    assert torch.equal(eng.load("policy", step=5)["w"], torch.full((8,), 5.0))


@pytest.mark.timeout(300)
def test_a_restarted_driver_on_the_same_cluster_goes_on_once_the_old_job_is_gone(engine_factory, tmp_path,
                                                                                 run_name, ray_session):
    shared = str(tmp_path / "shared")
    address = ray.get_runtime_context().gcs_address
    proc, out = _start([shared, run_name, str(tmp_path / "go"), address, "--exit-without-shutdown"], tmp_path)
    try:
        _wait_line(proc, out, "SAVED 1")
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
    deadline = time.time() + 60
    while True:  # the job is marked dead by the cluster a moment after its driver exits
        try:
            eng = engine_factory(local_dir=shared, remote_uri=None, **LEAN)
            break
        except rc.OwnershipError:
            assert time.time() < deadline, "the dead job still owns the run after 60 s"
            time.sleep(0.5)
    assert [m.version for m in eng.list_checkpoints()] == [1]
