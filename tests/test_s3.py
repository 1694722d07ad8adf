"""The remote tier on a real S3-compatible server (SeaweedFS ``weed mini``, credentials enforced).

No moto, no fakes: bytes go over HTTP to a server started by the ``s3_server`` fixture, which these
tests also stop and restart to simulate an outage of the remote store.
"""
import os
import time

import numpy as np
import pyarrow.fs as pafs
import pytest
import ray
import torch

import ray_ckpt as rc
from ray_ckpt.storage.checkpoint_io import delete_version
from ray_ckpt.storage.tier import Tier, resolve_filesystem

# ----------------------------------------------------------------------------- helpers


@ray.remote(num_cpus=0.25)
class S3Learner:
    """Torch MLP + Adam; deterministic given its seed."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def train(self, n: int = 1) -> None:
        for _ in range(n):
            x = torch.randn(16, 8, generator=self.gen)
            loss = (self.model(x) - 1.0).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()

    def ckpt_get_state(self, name):
        if name == "policy":
            return self.model.state_dict()
        if name == "optimizer":
            return self.opt.state_dict()
        raise KeyError(name)

    def ckpt_set_state(self, name, state):
        if name == "policy":
            self.model.load_state_dict(state)
        elif name == "optimizer":
            self.opt.load_state_dict(state)
        else:
            raise KeyError(name)

    def snapshot(self):
        """Deep copies of everything a restore must bring back bit-exact."""
        opt = self.opt.state_dict()
        return {
            "policy": {k: v.clone() for k, v in self.model.state_dict().items()},
            "opt_state": {pid: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                          for pid, st in opt["state"].items()},
            "opt_groups": opt["param_groups"],
        }


def assert_same(a, b):
    assert a["policy"].keys() == b["policy"].keys()
    for k in a["policy"]:
        assert torch.equal(a["policy"][k], b["policy"][k]), k
    assert list(a["opt_state"]) == list(b["opt_state"])
    assert all(isinstance(k, int) for k in b["opt_state"]), "optimizer state keys must stay integers"
    for pid in a["opt_state"]:
        assert a["opt_state"][pid].keys() == b["opt_state"][pid].keys()
        for k, v in a["opt_state"][pid].items():
            w = b["opt_state"][pid][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (pid, k)
    assert a["opt_groups"] == b["opt_groups"]


def bucket_files(s3_server, prefix: str) -> dict:
    """key (relative to prefix) -> FileInfo, read with a plain pyarrow S3FileSystem."""
    fs = s3_server.filesystem()
    base = f"{s3_server.bucket}/{prefix.strip('/')}"
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    return {i.path[len(base) + 1:]: i for i in infos if i.type == pafs.FileType.File}


def vdir(version: int) -> str:
    return f"v{version:012d}"


@pytest.fixture(scope="module")
def learner(ray_session):
    actor = S3Learner.remote(seed=7)
    ray.get(actor.train.remote(3))
    yield actor
    ray.kill(actor)


@pytest.fixture
def s3_prefix(run_name):
    return f"runs-{run_name}"


# ----------------------------------------------------------------------------- Tier on S3 (no Ray)


def test_tier_operations_on_s3(s3_server, tmp_path):
    tier = Tier(s3_server.uri("tier-ops/run"), "remote", s3_server.options)
    assert not tier.is_local and isinstance(tier.fs, pafs.S3FileSystem)
    assert tier.root == f"{s3_server.bucket}/tier-ops/run"
    tier.check_writable()
    assert tier.version_dirs() == {}  # missing root: empty, not an error

    payload = os.urandom(3 << 20) + b"tail"
    with tier.open_atomic(f"{vdir(1)}/policy/rank0.safetensors") as sink:
        for off in range(0, len(payload), 1 << 20):
            sink.write(payload[off: off + (1 << 20)])
    size, digest = sink.size, sink.digest()
    assert size == len(payload)
    n2, d2 = tier.put_bytes(f"{vdir(2)}/policy/rank0.safetensors", b"abc")
    tier.put_bytes(f"{vdir(2)}/manifest.json", b"{}")

    assert tier.exists(f"{vdir(1)}/policy/rank0.safetensors")
    assert not tier.exists(f"{vdir(1)}/manifest.json")
    assert tier.version_dirs() == {1: False, 2: True}
    assert bytes(tier.read_verified(f"{vdir(1)}/policy/rank0.safetensors", size, digest)) == payload
    assert sorted(tier.list_files(vdir(2))) == [f"{vdir(2)}/manifest.json", f"{vdir(2)}/policy/rank0.safetensors"]
    with pytest.raises(rc.IntegrityError, match="checksum mismatch"):
        tier.read_verified(f"{vdir(2)}/policy/rank0.safetensors", n2, "0" * 32)
    with pytest.raises(rc.IntegrityError, match="size"):
        tier.read_verified(f"{vdir(2)}/policy/rank0.safetensors", n2 + 1, d2)
    with pytest.raises(FileNotFoundError):
        tier.read_verified(f"{vdir(3)}/policy/rank0.safetensors", 1, d2)

    # copy_to both ways: S3 -> local disk -> S3 (another prefix)
    local = Tier(str(tmp_path / "local" / "run"), "local")
    assert tier.copy_to(local, f"{vdir(1)}/policy/rank0.safetensors") == (size, digest)
    assert (tmp_path / "local" / "run" / vdir(1) / "policy" / "rank0.safetensors").read_bytes() == payload
    other = Tier(s3_server.uri("tier-ops/copy"), "remote", s3_server.options)
    assert local.copy_to(other, f"{vdir(1)}/policy/rank0.safetensors") == (size, digest)
    assert bytes(other.read_verified(f"{vdir(1)}/policy/rank0.safetensors", size, digest)) == payload

    # delete (missing is fine) and prune: a directory that still holds a file is kept
    tier.delete_file(f"{vdir(2)}/manifest.json")
    tier.delete_file(f"{vdir(2)}/manifest.json")
    assert tier.version_dirs() == {1: False, 2: False}
    tier.prune_empty_dirs(vdir(2))
    assert tier.exists(f"{vdir(2)}/policy/rank0.safetensors")
    tier.delete_file(f"{vdir(2)}/policy/rank0.safetensors")
    tier.prune_empty_dirs(vdir(2))
    assert tier.version_dirs() == {1: False}
    assert not tier.exists(vdir(2))
    # what storage holds matches, seen by a plain client
    assert sorted(bucket_files(s3_server, "tier-ops/run")) == [f"{vdir(1)}/policy/rank0.safetensors"]

    # a Tier travels to other processes by URI + options (Ray pickles it)
    import pickle

    again = pickle.loads(pickle.dumps(tier))
    assert again.version_dirs() == {1: False}

    # retention's delete_version on S3: manifest first, then unreferenced files, then empty "dirs"
    for rel in (f"{vdir(5)}/a/rank0.safetensors", f"{vdir(5)}/b/rank0.safetensors", f"{vdir(5)}/manifest.json"):
        tier.put_bytes(rel, b"x")
    assert delete_version(tier, 5, {f"{vdir(5)}/b/rank0.safetensors"}) == [f"{vdir(5)}/a/rank0.safetensors"]
    assert tier.version_dirs()[5] is False and tier.list_files(vdir(5)) == [f"{vdir(5)}/b/rank0.safetensors"]
    delete_version(tier, 5, set())
    assert 5 not in tier.version_dirs()


def test_uploads_are_rate_limited(s3_server, tmp_path):
    """upload_max_mb_s: a writer's uploads go out 8 MiB at a time at the limit's pace (a checkpoint
    upload must not take the network from training), and arrive whole and verified."""
    from ray_ckpt.storage.checkpoint_io import write_flat
    from ray_ckpt.formats.tree import flatten
    from ray_ckpt.writers.part_writer import PartWriter

    local = Tier(str(tmp_path / "local"), "local")
    remote = Tier(s3_server.uri("limited/run"), "remote", s3_server.options)
    state = {"w": torch.randint(0, 255, (12 << 20,), dtype=torch.uint8)}
    files = write_flat(local, 1, "policy", 0, flatten(state))
    rate = 8e6
    writer = PartWriter(local, remote, upload_bytes_per_s=rate)
    t = time.perf_counter()
    assert writer.upload([f.__dict__ for f in files]) == files[0].size
    assert time.perf_counter() - t >= (files[0].size - (8 << 20)) / rate * 0.99  # ~0.55 s; unlimited ~0.05 s
    assert bytes(remote.read_verified(files[0].path, files[0].size, files[0].checksum)) == \
        (tmp_path / "local" / files[0].path).read_bytes()


def test_failed_write_leaves_no_object_on_s3(s3_server):
    tier = Tier(s3_server.uri("partial/run"), "remote", s3_server.options)
    rel = f"{vdir(1)}/policy/rank0.safetensors"
    with pytest.raises(RuntimeError, match="serialiser failed"):
        with tier.open_atomic(rel) as sink:
            sink.write(b"x" * 1000)
            raise RuntimeError("serialiser failed")
    assert not tier.exists(rel)
    assert bucket_files(s3_server, "partial/run") == {}


def test_s3_from_environment(s3_server, monkeypatch):
    """Without remote_options: AWS_* variables, with AWS_ENDPOINT_URL(_S3) as the endpoint."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: AWS_ENDPOINT_URL_S3 wins
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    fs, path = resolve_filesystem(s3_server.uri("env/run/"))
    assert isinstance(fs, pafs.S3FileSystem) and path == f"{s3_server.bucket}/env/run"
    assert fs.region == "us-east-1"
    tier = Tier(s3_server.uri("env/run"), "remote")
    tier.check_writable()
    tier.put_bytes("a/b.bin", b"hello")
    assert bytes(tier.read_bytes("a/b.bin")) == b"hello"
    assert "a/b.bin" in bucket_files(s3_server, "env/run")

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    assert bytes(Tier(s3_server.uri("env/run"), "remote").read_bytes("a/b.bin")) == b"hello"


def test_bad_s3_options_are_clear_errors():
    with pytest.raises(rc.InvalidArgumentError, match="cannot open storage URI"):
        resolve_filesystem("s3://bucket/x", {"endpoint": "nope"})  # not an S3FileSystem argument
    with pytest.raises(ValueError, match="no bucket"):
        resolve_filesystem("s3://", {"region": "us-east-1"})
    with pytest.raises(ValueError, match="only understood for s3:// and gs://"):
        resolve_filesystem("file:///tmp/x", {"region": "us-east-1"})


def test_wrong_credentials_fail_fast_at_tier(s3_server):
    for bad in ({"secret_key": "not-the-secret"}, {"access_key": "nobody"}):
        tier = Tier(s3_server.uri("creds/run"), "remote", dict(s3_server.options, **bad))
        t0 = time.monotonic()
        with pytest.raises(rc.CheckpointError, match="remote tier .* is not writable.*access denied"):
            tier.check_writable()
        assert time.monotonic() - t0 < 10


def test_missing_bucket_is_a_clear_error(s3_server):
    tier = Tier("s3://no-such-bucket-here/run", "remote", s3_server.options)
    with pytest.raises(rc.CheckpointError, match="not writable.*bucket does not exist"):
        tier.check_writable()


def test_dead_endpoint_fails_fast(s3_server):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tier = Tier(s3_server.uri("dead/run"), "remote", dict(s3_server.options, endpoint_override=f"127.0.0.1:{port}"))
    t0 = time.monotonic()
    with pytest.raises(rc.CheckpointError, match="not writable.*cannot be reached"):
        tier.check_writable()
    assert time.monotonic() - t0 < 15


# ----------------------------------------------------------------------------- engine on S3 (Ray)


def _engine(engine_factory, s3_server, prefix, learner, critical_writers=1, **kw):
    eng = engine_factory(remote_uri=s3_server.uri(prefix), remote_options=s3_server.options,
                         critical_writers=critical_writers, best_effort_writers=0, **kw)
    eng.register("policy", learner)
    eng.register("optimizer", learner)
    return eng


def test_save_is_remote_durable_and_restores_from_s3(engine_factory, s3_server, s3_prefix, learner, tmp_path,
                                                     run_name):
    eng = _engine(engine_factory, s3_server, s3_prefix, learner)
    ray.get(learner.train.remote(2))
    saved = ray.get(learner.snapshot.remote())
    h = eng.save(10)
    res = h.wait(timeout=60, durability="remote")
    assert (res.version, res.step, res.durability) == (10, 10, "remote")
    assert h.wait(timeout=10).durability == "local"

    # (a) the objects are in the bucket, byte-identical to the local tier; the manifest is there too
    objs = bucket_files(s3_server, f"{s3_prefix}/{run_name}")
    want = {f"{vdir(10)}/policy/rank0.safetensors", f"{vdir(10)}/optimizer/rank0.safetensors",
            f"{vdir(10)}/manifest.json"}
    assert want <= set(objs), sorted(objs)
    assert not [k for k in objs if ".tmp-" in k or ".ray_ckpt_probe" in k]
    local_root = tmp_path / "local" / run_name
    fs = s3_server.filesystem()
    for rel in want:
        with fs.open_input_file(f"{s3_server.bucket}/{s3_prefix}/{run_name}/{rel}") as f:
            assert f.read() == (local_root / rel).read_bytes(), rel
    # manifest written last (object stores keep second-resolution mtimes)
    assert objs[f"{vdir(10)}/manifest.json"].mtime >= max(i.mtime for k, i in objs.items() if k in want)
    metas = eng.list_checkpoints()
    assert [(m.version, set(m.tiers)) for m in metas] == [(10, {"local", "remote"})]

    # (b) corrupt the local policy file, delete the local optimizer file: restore reads S3
    policy_file = local_root / vdir(10) / "policy" / "rank0.safetensors"
    data = bytearray(policy_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    policy_file.write_bytes(bytes(data))
    (local_root / vdir(10) / "optimizer" / "rank0.safetensors").unlink()
    ray.get(learner.train.remote(3))  # move away from the saved state
    assert not torch.equal(ray.get(learner.snapshot.remote())["policy"]["0.weight"], saved["policy"]["0.weight"])

    report = eng.restore()
    assert (report.version, report.step) == (10, 10)
    for name in ("policy", "optimizer"):
        st = report.states[name]
        assert (st.status, st.tier, st.verified) == ("restored", "remote", True), (name, st)
    assert "checksum mismatch" in report.states["policy"].detail
    assert "missing" in report.states["optimizer"].detail
    assert_same(saved, ray.get(learner.snapshot.remote()))

    # load() in the driver: the same bytes, integer optimizer keys
    opt = eng.load(name="optimizer")
    assert sorted(opt["state"]) == sorted(saved["opt_state"]) and all(isinstance(k, int) for k in opt["state"])
    for pid, st in saved["opt_state"].items():
        assert torch.equal(torch.as_tensor(np.asarray(opt["state"][pid]["exp_avg"])), st["exp_avg"])


def test_remote_outage_local_commits_go_on_then_upload_resumes(engine_factory, s3_server, s3_prefix,
                                                               learner, run_name, tmp_path):
    eng = _engine(engine_factory, s3_server, s3_prefix, learner, critical_writers=2)  # the default pool
    ray.get(learner.train.remote(1))
    assert eng.save(1).wait(timeout=60, durability="remote").durability == "remote"

    s3_server.stop()
    try:
        ray.get(learner.train.remote(1))
        saved = ray.get(learner.snapshot.remote())
        t_save = time.monotonic()
        h = eng.save(2)
        res = h.wait(timeout=60)  # the local tier does not need the remote store
        print(f"local commit during the outage: {time.monotonic() - t_save:.2f}s")
        assert (res.version, res.durability) == (2, "local")
        t0 = time.monotonic()
        with pytest.raises(rc.SaveError, match=r"step 2 .* not durable on the remote tier after 1s") as ei:
            h.wait(timeout=1, durability="remote")  # waited out on purpose: 1 s is enough
        print("remote wait during the outage:", ei.value)
        assert time.monotonic() - t0 < 20
        # the coordinator reports why (after the writer's own retries have failed once)
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            err = eng.status()["last_error"] or ""
            if "step 2 upload" in err:
                break
            time.sleep(0.5)
        assert "step 2 upload" in err and "127.0.0.1" in err, err
        print(f"first upload error after {time.monotonic() - t0:.2f}s: {err}")
        with pytest.raises(rc.SaveError, match="last upload error: .*failed after") as ei:
            h.wait(timeout=1, durability="remote")
        print("remote wait later in the outage:", ei.value)
        ray.get(learner.train.remote(1))
        t_save = time.monotonic()
        h3 = eng.save(3)
        assert h3.wait(timeout=60).durability == "local"
        local_commit_s = time.monotonic() - t_save
        print(f"second local commit during the outage: {local_commit_s:.2f}s")
        assert [(m.version, set(m.tiers)) for m in eng.list_checkpoints()] == [(1, {"local", "remote"}),
                                                                               (2, {"local"}), (3, {"local"})]
    finally:
        s3_server.start()

    # the coordinator keeps retrying (backoff capped at 30 s): version 2 becomes remote-durable
    t0 = time.monotonic()
    res = h.wait(timeout=90, durability="remote")
    assert (res.version, res.durability) == (2, "remote")
    took = time.monotonic() - t0
    print(f"remote-durable {took:.2f}s after the server came back")
    assert took < 90
    objs = bucket_files(s3_server, f"{s3_prefix}/{run_name}")
    assert {f"{vdir(2)}/manifest.json", f"{vdir(2)}/policy/rank0.safetensors",
            f"{vdir(2)}/optimizer/rank0.safetensors"} <= set(objs)
    assert h3.wait(timeout=90, durability="remote").durability == "remote"
    assert [(m.version, set(m.tiers)) for m in eng.list_checkpoints()] == [(1, {"local", "remote"}),
                                                                           (2, {"local", "remote"}),
                                                                           (3, {"local", "remote"})]
    st = eng.status()
    assert st["remote_committed"] == 3 and not st["in_flight"], st
    # what was uploaded after the outage is the saved state: restore it from S3 alone
    local_v2 = tmp_path / "local" / run_name / vdir(2)
    for name in ("policy", "optimizer"):
        (local_v2 / name / "rank0.safetensors").unlink()
    ray.get(learner.train.remote(1))
    report = eng.restore(step=2)
    assert report.version == 2 and {n: s.tier for n, s in report.states.items()} == {"policy": "remote",
                                                                                      "optimizer": "remote"}
    assert_same(saved, ray.get(learner.snapshot.remote()))

    # uploads run in their own concurrency group: an outage never queues local writes behind them
    assert local_commit_s < 5.0, f"a local commit during the outage took {local_commit_s:.1f}s"


def test_wrong_credentials_fail_at_create(engine_factory, s3_server, s3_prefix):
    t0 = time.monotonic()
    with pytest.raises(rc.CheckpointError) as ei:
        engine_factory(remote_uri=s3_server.uri(s3_prefix),
                       remote_options=dict(s3_server.options, secret_key="wrong-secret"))
    assert time.monotonic() - t0 < 15
    msg = str(ei.value)
    assert "remote tier" in msg and "not writable" in msg and "access denied" in msg, msg
    assert "wrong-secret" not in msg and s3_server.secret_key not in msg
    assert bucket_files(s3_server, s3_prefix) == {}
