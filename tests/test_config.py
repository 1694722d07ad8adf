"""EngineConfig: a run's root on each tier for every URI form pyarrow.fs documents (no Ray, no I/O
beyond resolving S3 URIs offline): the run lands in the path, ``?query`` settings survive."""
import os
from urllib.parse import parse_qs, urlsplit

import pyarrow.fs as pafs
import pytest

from ray_ckpt.config import EngineConfig
from ray_ckpt.storage.tier import Tier

RUN = "ppo-run"

# (remote_uri, the run root expected)
FORMS = [
    ("/abs/path", "/abs/path/ppo-run"),
    ("/abs/path/", "/abs/path/ppo-run"),
    ("file:///abs", "file:///abs/ppo-run"),
    ("file:///abs/", "file:///abs/ppo-run"),
    ("s3://bucket", "s3://bucket/ppo-run"),
    ("s3://bucket/prefix", "s3://bucket/prefix/ppo-run"),
    ("s3://bucket/prefix/", "s3://bucket/prefix/ppo-run"),
    ("s3://bucket/prefix?endpoint_override=127.0.0.1:9000&scheme=http",
     "s3://bucket/prefix/ppo-run?endpoint_override=127.0.0.1:9000&scheme=http"),
    ("s3://bucket/prefix/?endpoint_override=127.0.0.1:9000&scheme=http&region=us-east-1",
     "s3://bucket/prefix/ppo-run?endpoint_override=127.0.0.1:9000&scheme=http&region=us-east-1"),
    ("s3://bucket?region=eu-west-1", "s3://bucket/ppo-run?region=eu-west-1"),
    ("gs://bucket/p", "gs://bucket/p/ppo-run"),
    ("gs://bucket/p?endpoint_override=127.0.0.1:4443&scheme=http",
     "gs://bucket/p/ppo-run?endpoint_override=127.0.0.1:4443&scheme=http"),
    ("hdfs://host:8020/p", "hdfs://host:8020/p/ppo-run"),
    ("hdfs://host:8020/p?replication=2", "hdfs://host:8020/p/ppo-run?replication=2"),
]


def config(remote_uri, local_dir="/tmp/ckpt"):
    return EngineConfig(RUN, local_dir=local_dir, remote_uri=remote_uri)


@pytest.mark.parametrize("uri,want", FORMS, ids=[f[0] for f in FORMS])
def test_remote_root_appends_the_run_to_the_path_and_keeps_the_query(uri, want):
    root = config(uri).remote_root()
    assert root == want
    if "://" in uri:
        got, base = urlsplit(root), urlsplit(uri)
        assert got.scheme == base.scheme and got.netloc == base.netloc
        assert got.path.rstrip("/").endswith("/" + RUN)
        assert parse_qs(got.query) == parse_qs(base.query)  # every setting survives, unchanged


# with an endpoint or a region in the query, pyarrow resolves an S3 URI without a request (a bare
# s3://bucket would ask AWS for the bucket's region)
@pytest.mark.parametrize("uri", [f[0] for f in FORMS if f[0].startswith("s3://") and "?" in f[0]])
def test_pyarrow_reads_the_run_path_and_the_settings_of_s3_roots(uri):
    fs, path = pafs.FileSystem.from_uri(config(uri).remote_root())
    bucket_and_prefix = urlsplit(uri).netloc + urlsplit(uri).path.rstrip("/")
    assert path == f"{bucket_and_prefix}/{RUN}"
    if "endpoint_override" in uri:
        assert isinstance(fs, pafs.S3FileSystem)
        assert "127.0.0.1:9000" in repr(fs.__reduce__())  # the endpoint reached the filesystem
    if "region=" in uri:
        assert fs.region == parse_qs(urlsplit(uri).query)["region"][0]


def test_no_remote_tier():
    assert config(None).remote_root() is None and config(None).remote_tier() is None


@pytest.mark.parametrize("form", ["plain", "file_uri"])
def test_local_tiers_on_paths_and_file_uris_write_under_the_run(tmp_path, form):
    base = str(tmp_path / "ckpt")
    cfg = config(None, local_dir=base if form == "plain" else "file://" + base)
    tier = cfg.local_tier()
    assert isinstance(tier, Tier) and tier.is_local
    with tier.open_atomic("v1/x.bin") as sink:
        sink.write(b"abc")
    assert (tmp_path / "ckpt" / RUN / "v1" / "x.bin").read_bytes() == b"abc"


def test_file_uri_remote_tier_lands_in_the_run(tmp_path):
    tier = config("file://" + str(tmp_path / "remote")).remote_tier()
    assert tier.root.rstrip("/") == os.path.join(str(tmp_path), "remote", RUN)


def test_node_id_in_local_dir():
    cfg = config(None, local_dir="/mnt/nvme/{node_id}/ckpt")
    assert cfg.local_root(node_id="0123456789abcdef") == "/mnt/nvme/0123456789ab/ckpt/ppo-run"
    cfg = config(None, local_dir="file:///mnt/{node_id}?x=1")
    assert cfg.local_root(node_id="abcdef0123456789") == "file:///mnt/abcdef012345/ppo-run?x=1"


def test_the_environment_gives_a_key_ring_the_first_key_signs(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_CKPT_SIGNING_KEY", "new")
    monkeypatch.setenv("RAY_CKPT_VERIFY_KEYS", "old, older")
    assert EngineConfig(run="r", local_dir=str(tmp_path)).signing_key == (b"new", b"old", b"older")
    assert EngineConfig(run="r", local_dir=str(tmp_path), signing_key=b"mine").signing_key == b"mine"
    monkeypatch.delenv("RAY_CKPT_VERIFY_KEYS")
    assert EngineConfig(run="r", local_dir=str(tmp_path)).signing_key == b"new"
    monkeypatch.delenv("RAY_CKPT_SIGNING_KEY")
    monkeypatch.setenv("RAY_CKPT_VERIFY_KEYS", "old")
    with pytest.raises(ValueError, match="RAY_CKPT_VERIFY_KEYS is set but RAY_CKPT_SIGNING_KEY is not"):
        EngineConfig(run="r", local_dir=str(tmp_path))
