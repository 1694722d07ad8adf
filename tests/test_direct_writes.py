"""O_DIRECT block writes with bounce buffers kept between files (``storage.local_files.BOUNCE``):
each file holds exactly its own bytes and its digest is the streamed one, whatever an earlier,
larger file left in a reused buffer. Plain pytest, no Ray."""
from __future__ import annotations

import os

import numpy as np
import pytest

from ray_ckpt.formats import checksum
from ray_ckpt.formats.checksum import STRIDE
from ray_ckpt.storage import local_files


def _pieces(rng: np.random.Generator, sizes):
    """Consecutive pieces of random bytes (boundaries at odd offsets, like tensors after a header)."""
    return [memoryview(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]


def _write(path: str, pieces):
    size = sum(len(p) for p in pieces)
    digests = local_files.write_direct(path, pieces, size, 2, None)
    if digests is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    return checksum.combine(digests, size)


def test_reused_bounce_buffers_write_exactly_each_files_bytes(tmp_path):
    rng = np.random.default_rng(17)
    files = [
        _pieces(rng, [4100, 3 * STRIDE - 77, STRIDE + 5, 513]),  # several strides, a padded last one
        _pieces(rng, [8, STRIDE // 2 + 7]),                      # smaller: a reused buffer's stale tail
        _pieces(rng, [STRIDE]),                                  # exactly one aligned stride
        _pieces(rng, [1]),
    ]
    for i, pieces in enumerate(files):
        path = os.path.join(tmp_path, f"f{i}")
        digest = _write(path, pieces)
        want = b"".join(bytes(p) for p in pieces)
        with open(path, "rb") as f:
            assert f.read() == want, f"file {i}"
        assert digest == checksum.digest(want), f"file {i}"
