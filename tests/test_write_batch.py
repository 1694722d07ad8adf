"""Many small parts written as one durable batch (issue 15): what a reader can observe before,
during and after a batch, including a writer process killed in the middle of one."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from ray_ckpt.checkpoint_io import decode_files, read_files
from ray_ckpt.errors import SaveError
from ray_ckpt.formats.tree import flatten
from ray_ckpt.storage.durable_batch import DurableBatch
from ray_ckpt.storage.local_files import TMP_MARK
from ray_ckpt.storage.tier import Tier
from ray_ckpt.writers import PartWriter


def _state(rank: int, n: int = 256) -> dict:
    return {"w": np.full(n, rank, np.float32), "step": rank}


def _load(tier: Tier, part) -> dict:
    bufs, _used, _problems = read_files([tier], list(part.files))
    return decode_files(list(part.files), bufs, name="s", as_numpy=True)


def _listing(root) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_batch_writes_every_part_and_they_load_back(tmp_path):
    tier = Tier(str(tmp_path), "local")
    writer = PartWriter(tier)
    parts = [("s", r, flatten(_state(r))) for r in range(40)] + [("t", 0, SaveError("snapshot lost"))]
    out = writer.write_parts(3, parts)
    assert isinstance(out[-1], SaveError) and "snapshot lost" in str(out[-1])
    for r, part in enumerate(out[:-1]):
        got = _load(tier, part)
        assert np.array_equal(got["w"], np.full(256, r, np.float32)) and got["step"] == r
    assert not [p for p in _listing(tmp_path) if TMP_MARK in p]  # every temporary name was renamed


def test_nothing_has_its_final_name_before_commit_and_abort_leaves_nothing(tmp_path):
    tier = Tier(str(tmp_path), "local")
    batch = DurableBatch()
    for i in range(3):
        with batch.open_atomic(tier, f"v1/s/rank{i}.bin") as sink:
            sink.write(b"x" * 100)
    assert all(TMP_MARK in p for p in _listing(tmp_path))  # written, not yet visible under a final name
    batch.abort()
    assert _listing(tmp_path) == []
    batch2 = DurableBatch()
    with pytest.raises(RuntimeError, match="serialiser"):
        with batch2.open_atomic(tier, "v1/s/rank9.bin") as sink:
            sink.write(b"y" * 10)
            raise RuntimeError("serialiser failed")
    assert _listing(tmp_path) == []  # a failed file leaves nothing, not even its temporary name
    batch2.commit()  # an empty batch commits
    with pytest.raises(RuntimeError, match="already"):
        batch2.commit()


def test_a_writer_killed_mid_batch_never_leaves_a_partial_file_under_a_final_name(tmp_path):
    """A child process writes a batch of 400 parts and is SIGKILLed while it writes: whatever it
    left, every file with a final name is whole (it loads and equals what was written), the rest
    are temporary names only; a new batch over the same version then commits every part."""
    tier = Tier(str(tmp_path), "local")
    parts = [("s", r, flatten(_state(r, 16_384))) for r in range(400)]  # 64 KiB each
    pid = os.fork()
    if pid == 0:  # the writer: write, then exit (the parent kills it long before, in practice)
        try:
            PartWriter(tier).write_parts(1, parts)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    vdir = tmp_path / "v000000000001"
    while time.monotonic() < deadline:  # kill it once its batch has files under temporary names
        if vdir.exists() and len([p for p in vdir.rglob(f"*{TMP_MARK}*")]) >= 20:
            break
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    left = _listing(tmp_path)
    assert any(TMP_MARK in p for p in left), "the kill should have landed mid-batch"
    finals = [p for p in left if TMP_MARK not in p]
    for rel in finals:  # a final name, if any, holds the whole file (renamed only after its sync)
        rank = int(rel.rsplit("rank", 1)[1].split(".")[0])
        want = PartWriter(Tier(str(tmp_path / "ref"), "local")).write_parts(1, [parts[rank]])[0]
        assert (tmp_path / rel).read_bytes() == (tmp_path / "ref" / want.files[0].path).read_bytes()
    out = PartWriter(tier).write_parts(1, parts)  # the retry (or the next version) goes through
    assert all(not isinstance(o, BaseException) for o in out)
    for r in (0, 199, 399):
        assert np.array_equal(_load(tier, out[r])["w"], np.full(16_384, r, np.float32))
