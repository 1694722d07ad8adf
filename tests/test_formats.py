"""Formats, storage and retention without Ray: milliseconds each."""
import collections
import math
import os
import random
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

import ray_ckpt as rc
from ray_ckpt.coordinator.catalogue import Catalogue
from ray_ckpt.storage.checkpoint_io import content_hash, decode_files, read_files, write_flat
from ray_ckpt.formats.manifest import Manifest
from ray_ckpt.formats.tree import flatten
from ray_ckpt.storage.layout import validate_name
from ray_ckpt.storage.retention import RetentionPolicy, VersionInfo, plan_deletions
from ray_ckpt.storage.tier import Tier


def roundtrip(state, tmp_path, name="s", allow_pickle=False):
    tier = Tier(str(tmp_path), "local")
    files = write_flat(tier, 7, name, 0, flatten(state, state_name=name, allow_pickle=allow_pickle))
    bufs, used, problems = read_files([tier], files)
    assert used == "local" and problems == []
    return decode_files(files, bufs, name=name, allow_pickle=allow_pickle)


def assert_same(a, b, path="root"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                           b.view(-1).view(torch.uint8) if b.numel() else b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert type(k) is type(next(x for x in b if x == k)), f"{path}: key type of {k!r}"
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    elif isinstance(a, pa.Table):
        assert a.equals(b), path
    else:
        assert a == b, path


def test_every_supported_type_roundtrips_exactly(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 5)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),                      # OrderedDict
        "optimizer": opt.state_dict(),                    # int keys, nested lists, floats, tuples (betas)
        "torch_rng": torch.get_rng_state(),
        "np_rng": np.random.default_rng(3).bit_generator.state,
        "np_legacy_rng": np.random.RandomState(1).get_state(),
        "py_rng": random.Random(5).getstate(),            # tuple of 625 ints
        "dtypes": [torch.zeros(3, dtype=d) + 1 for d in (torch.bfloat16, torch.float16, torch.int8,
                                                          torch.bool, torch.float64, torch.uint8)],
        "odd": {"empty": torch.empty(0, 3), "scalar": torch.tensor(2.5), "noncontig": torch.arange(12.).view(3, 4).t(),
                "nan": float("nan"), "inf": -math.inf, "big": 2 ** 80, "none": None, "b": b"\x00\xff",
                "np_scalar": np.float32(1.25), "np_int": np.int64(-3), "dtype": torch.float32,
                "arr": np.arange(6, dtype=np.uint16).reshape(2, 3), "f16": np.ones(3, np.float16),
                "np_0d": np.array(3.5), "np_0d_int": np.array(7, dtype=np.int32)},  # shape () stays ()
        "table": pa.table({"obs": [[1.0, 2.0], [3.0, 4.0]], "reward": [0.5, -1.0], "done": [False, True]}),
        3: ("tuple", 1, 2.0, [None, True]),
        "rllib_style": {None: {"obs_filter": np.zeros(3)}, True: 1, False: "f"},  # None / bool keys
    }
    back = roundtrip(state, tmp_path)
    assert type(back["model"]) is collections.OrderedDict
    assert list(back["optimizer"]["state"].keys()) == [0, 1, 2, 3]
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    noncontig = state["odd"].pop("noncontig")
    got = back["odd"].pop("noncontig")
    assert torch.equal(noncontig, got)
    assert_same(state, back)
    # the optimizer state loads back into a fresh optimizer
    opt2 = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])


def test_a_state_without_tensors_restores_without_importing_torch(tmp_path):
    """A process that restores a replay buffer, RNG states or a table need not pay torch's import
    (~3 CPU-s of a fresh process): torch is imported at the first tensor leaf, not before."""
    code = f"""
import sys
import numpy as np, pyarrow as pa
from ray_ckpt.storage.checkpoint_io import decode_files, read_files, write_flat
from ray_ckpt.formats.tree import flatten
from ray_ckpt.storage.tier import Tier
state = {{"obs": np.arange(12, dtype=np.float32).reshape(3, 4), "table": pa.table({{"r": [0.5, -1.0]}}),
         "rng": np.random.default_rng(3).bit_generator.state, "n": 3}}
tier = Tier({str(tmp_path)!r}, "local")
files = write_flat(tier, 1, "replay", 0, flatten(state, state_name="replay"))
bufs, used, problems = read_files([tier], files)
back = decode_files(files, bufs, name="replay")
assert back["obs"].tobytes() == state["obs"].tobytes() and back["table"].equals(state["table"])
assert back["rng"] == state["rng"] and back["n"] == 3
print("torch imported" if "torch" in sys.modules else "no torch")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no torch"


def _replay(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((n, 4, 3), dtype=np.float32), "action": rng.integers(0, 6, n),
            "reward": rng.standard_normal(n).astype(np.float16), "done": rng.random(n) < 0.1,
            "logp": rng.standard_normal((n, 1)), "env_id": rng.integers(0, 255, n, dtype=np.uint8)}


def test_a_buffer_is_one_arrow_file_that_any_arrow_tool_reads(tmp_path):
    """A replay buffer (a dict of equally long arrays) is stored as ``<state>/rank0.arrow``: one
    row per transition, a column per field, per-row shapes as Arrow's fixed_shape_tensor; it comes
    back exact (types, dtypes, shapes) and writable, as views of the verified file."""
    state = _replay(1000)
    tier = Tier(str(tmp_path), "local")
    files = write_flat(tier, 1, "replay", 0, flatten(state, state_name="replay"))
    assert [(f.path, f.role) for f in files] == [("v000000000001/replay/rank0.arrow", "buffer")]
    table = pa.ipc.open_file(str(tmp_path / files[0].path)).read_all()  # plain pyarrow, no ray_ckpt
    assert table.column_names == list(state) and table.num_rows == 1000
    assert table.schema.field("obs").type == pa.fixed_shape_tensor(pa.float32(), [4, 3])
    assert np.array_equal(table.column("obs").combine_chunks().to_numpy_ndarray(), state["obs"])
    assert np.array_equal(table.column("done").to_numpy(), state["done"])
    assert table.schema.field("reward").type == pa.float16()
    bufs, _, _ = read_files([tier], files)
    back = decode_files(files, bufs, name="replay")
    assert_same(state, back)
    assert np.shares_memory(back["obs"], np.frombuffer(bufs[0], np.uint8))  # no copy on restore
    back["obs"][0, 0, 0] = 42.0  # a restored buffer is the user's to fill again
    assert back["obs"][0, 0, 0] == 42.0 and all(a.flags.writeable for a in back.values())
    assert content_hash(flatten(state)) == files[0].checksum
    zstd = write_flat(tier, 2, "replay", 0, flatten(state), compression="zstd")
    assert zstd[0].size < files[0].size
    assert_same(state, decode_files(zstd, read_files([tier], zstd)[0], name="replay"))
    empty = {k: v[:0] for k, v in state.items()}
    got = decode_files(*(lambda fs: (fs, read_files([tier], fs)[0]))(write_flat(tier, 3, "e", 0, flatten(empty))),
                       name="e")
    assert_same(empty, got)


@pytest.mark.parametrize("state", [
    {"a": np.zeros(3), "b": np.zeros(4)},                       # lengths differ
    {"a": torch.zeros(3), "b": torch.zeros(3)},                  # tensors: weights, not a buffer
    {"a": np.zeros(3), "t": {"b": 1}},                           # a container beside the arrays
    {"n": 3, "s": "x"},                                          # scalars only
    {"a": np.array(1.0)},                                        # 0-d
    {1: np.zeros(3)},                                            # int keys
    {"a": np.zeros(3, np.complex64)},                            # no Arrow type
    {"a": np.zeros(3, ">f4")},                                   # not native byte order
    {"a": {"b": np.zeros(3)}},                                   # nested
    {},
])
def test_other_states_stay_in_safetensors(tmp_path, state):
    tier = Tier(str(tmp_path), "local")
    files = write_flat(tier, 1, "s", 0, flatten(state))
    assert [f.role for f in files] == ["tensors"]
    assert_same(state, decode_files(files, read_files([tier], files)[0], name="s"))


def test_a_buffer_with_scalars_and_a_table_state_are_arrow_files_too(tmp_path):
    """A replay buffer keeps its write position and size beside its arrays (scalars: in the
    metadata); a state that is one Arrow table is that table's file, its own metadata kept."""
    tier = Tier(str(tmp_path), "local")
    buf = dict(_replay(50), ptr=17, size=50, full=False, gamma=0.99, note="per", seed=np.int64(3), none=None)
    table = pa.table({"obs": [[1.0, 2.0], [3.0, 4.0]], "reward": [0.5, -1.0]}).replace_schema_metadata({"k": "v"})
    batch = table.to_batches()[0]
    for i, state in enumerate([buf, table, batch, collections.OrderedDict(a=np.arange(3), b=np.ones(3))]):
        files = write_flat(tier, i + 1, "replay", 0, flatten(state))
        assert [(f.path, f.role) for f in files] == [(f"v{i + 1:012d}/replay/rank0.arrow", "buffer")]
        back = decode_files(files, read_files([tier], files)[0], name="replay")
        if isinstance(state, pa.Table):
            assert back.equals(state) and back.schema.metadata == {b"k": b"v"}
            assert pa.ipc.open_file(str(tmp_path / files[0].path)).read_all().column_names == ["obs", "reward"]
        elif isinstance(state, pa.RecordBatch):
            assert isinstance(back, pa.RecordBatch) and back.equals(state)
        else:
            assert_same(state, back)


def test_a_large_buffer_in_pieces_is_written_by_blocks_with_the_streamed_bytes(tmp_path):
    """Columns of a few MiB travel through Ray in 1 MiB pieces; a buffer over PARALLEL_FROM goes
    through the block writer (threads, O_DIRECT): the same file either way."""
    import pickle

    from ray_ckpt.storage.checkpoint_io import PARALLEL_FROM

    state = _replay(PARALLEL_FROM // 56 + 999, seed=3)  # 57 bytes a row
    small = {k: v[:40_000] for k, v in state.items()}  # obs 1.9 MB: travels in pieces
    for st in (small, state):
        flat = flatten(st)
        bufs = []
        data = pickle.dumps(flat, protocol=5, buffer_callback=bufs.append)
        moved = pickle.loads(data, buffers=[b.raw() for b in bufs])
        tier = Tier(str(tmp_path), "local")
        streamed = write_flat(tier, 1, "r", 0, flat)
        blocks = write_flat(tier, 2, "r", 0, moved, threads=2, direct=True)
        assert (streamed[0].size, streamed[0].checksum) == (blocks[0].size, blocks[0].checksum)
        assert content_hash(moved) == streamed[0].checksum
        assert_same(st, decode_files(blocks, read_files([tier], blocks)[0], name="r"))
        shutil.rmtree(tmp_path / "v000000000001"), shutil.rmtree(tmp_path / "v000000000002")


def test_file_is_plain_safetensors(tmp_path):
    from safetensors.torch import load_file

    sd = {"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3).to(torch.bfloat16)}
    tier = Tier(str(tmp_path), "local")
    files = write_flat(tier, 1, "policy", 0, flatten(sd))
    loaded = load_file(str(tmp_path / files[0].path))
    assert set(loaded) == {"fc.weight", "fc.bias"}
    assert torch.equal(loaded["fc.weight"], sd["fc.weight"]) and loaded["fc.bias"].dtype == torch.bfloat16


class Opaque:
    pass


def test_unsupported_object_names_state_and_key_path():
    with pytest.raises(rc.UnsupportedTypeError) as ei:
        flatten({"state": {0: {"step": Opaque()}}}, state_name="optimizer")
    msg = str(ei.value)
    assert "'optimizer'" in msg and "['state'][0]['step']" in msg and "Opaque" in msg and "allow_pickle" in msg


def test_pickle_only_when_allowed(tmp_path):
    state = {"obj": Opaque.__name__, "x": collections.Counter(a=2)}  # Counter: a dict subclass
    with pytest.raises(rc.UnsupportedTypeError):
        flatten(state)
    back = roundtrip(state, tmp_path, allow_pickle=True)
    assert back["x"] == collections.Counter(a=2)
    tier = Tier(str(tmp_path), "local")
    files = write_flat(tier, 2, "s", 0, flatten(state, allow_pickle=True))
    bufs, _, _ = read_files([tier], files)
    with pytest.raises(rc.RestoreError, match="allow_pickle"):
        decode_files(files, bufs, name="s", allow_pickle=False)


def test_corrupt_local_falls_back_to_remote(tmp_path):
    local, remote = Tier(str(tmp_path / "l"), "local"), Tier(str(tmp_path / "r"), "remote")
    files = write_flat(local, 1, "p", 0, flatten({"w": torch.arange(100.)}))
    for f in files:
        local.copy_to(remote, f.path)
    p = tmp_path / "l" / files[0].path
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    bufs, used, problems = read_files([local, remote], files)
    assert used == "remote" and "checksum mismatch" in problems[0]
    assert torch.equal(decode_files(files, bufs, name="p")["w"], torch.arange(100.))
    (tmp_path / "r" / files[0].path).unlink()
    with pytest.raises(rc.IntegrityError, match="no good copy"):
        read_files([local, remote], files)


def _mapped(path) -> bool:
    with open("/proc/self/maps") as f:
        return any(str(path) in line for line in f)


def test_large_local_file_is_mapped_verified_private_and_released(tmp_path):
    """Large local files are restored from a private mapping: corruption is still caught, writing a
    restored tensor never reaches the file, and the mapping goes away with the last tensor (no
    garbage collection needed: the decoder keeps no reference cycle)."""
    import gc

    local, remote = Tier(str(tmp_path / "l"), "local"), Tier(str(tmp_path / "r"), "remote")
    w = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: above the mapping threshold
    files = write_flat(local, 1, "p", 0, flatten({"w": w, "step": 3}))
    path = tmp_path / "l" / files[0].path
    original = path.read_bytes()
    gc.disable()
    try:
        bufs, used, _ = read_files([local], files)
        state = decode_files(files, bufs, name="p")
        del bufs
        assert _mapped(path) and torch.equal(state["w"], w) and state["step"] == 3
        state["w"].add_(1)  # private: the file keeps its bytes
        assert path.read_bytes() == original
        del state
        assert not _mapped(path), "the restored file is still mapped after its tensors were dropped"
    finally:
        gc.enable()
    for f in files:
        local.copy_to(remote, f.path)
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    bufs, used, problems = read_files([local, remote], files)
    assert used == "remote" and "checksum mismatch" in problems[0]
    assert torch.equal(decode_files(files, bufs, name="p")["w"], w)


def test_block_parallel_write_equals_one_stream(tmp_path):
    """A large file written by several threads, block by block, has the same bytes and checksum
    as the single-stream write, the content hash and any split of the stream through the hasher;
    and it restores bit-exactly."""
    from ray_ckpt.storage.checkpoint_io import PARALLEL_FROM
    from ray_ckpt.formats.checksum import BLOCK, new_hasher

    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randint(0, 255, (BLOCK + 3,), dtype=torch.uint8, generator=g),  # straddles blocks
             "b": torch.randn(21_000_011, generator=g), "c": torch.arange(5), "step": 9}
    flat = flatten(state)
    assert flat.nbytes >= PARALLEL_FROM
    tier = Tier(str(tmp_path), "local")
    par = write_flat(tier, 1, "s", 0, flat, threads=3)
    one = write_flat(tier, 2, "s", 0, flat, threads=1)
    data = (tmp_path / par[0].path).read_bytes()
    assert data == (tmp_path / one[0].path).read_bytes()
    assert (par[0].size, par[0].checksum) == (one[0].size, one[0].checksum) == (len(data), content_hash(flat))
    h = new_hasher()
    rng, pos = random.Random(0), 0
    while pos < len(data):  # odd piece sizes: block boundaries fall inside pieces
        n = rng.randrange(1, 40 << 20)
        h.update(data[pos: pos + n])
        pos += n
    assert h.hexdigest() == par[0].checksum
    bufs, used, _ = read_files([tier], par)
    assert_same(decode_files(par, bufs, name="s"), state)
    del bufs
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    with open(tmp_path / par[0].path, "r+b") as f:  # one flipped byte in the third block
        f.seek(2 * BLOCK + 12345)
        b = f.read(1)
        f.seek(2 * BLOCK + 12345)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(rc.IntegrityError, match="checksum mismatch"):
        read_files([tier], par)


def _resident_bytes(path) -> int:
    """How much of ``path`` is in the page cache (util-linux fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         check=True, capture_output=True, text=True).stdout
    return int(out.strip())


@pytest.mark.parametrize("threads", [1, 2])
def test_direct_io_write_has_the_same_bytes_and_leaves_the_page_cache_alone(tmp_path, threads):
    """O_DIRECT writes go through aligned buffers and pad the last chunk: the file must still be
    byte-for-byte the buffered file (exact size, same checksum), and its pages are not left in
    the page cache (what direct I/O is for)."""
    from ray_ckpt.storage.checkpoint_io import PARALLEL_FROM
    from ray_ckpt.formats.checksum import BLOCK

    g = torch.Generator().manual_seed(threads)
    state = {"a": torch.randint(0, 255, (BLOCK + 4099,), dtype=torch.uint8, generator=g),
             "b": torch.randn(BLOCK // 4 + 7, generator=g), "step": 3}
    flat = flatten(state)
    assert flat.nbytes >= PARALLEL_FROM
    tier = Tier(str(tmp_path), "local")
    direct = write_flat(tier, 1, "s", 0, flat, threads=threads, direct=True)
    fs_type = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout
    if shutil.which("fincore") and "tmpfs" not in fs_type:  # tmpfs *is* the page cache
        assert _resident_bytes(tmp_path / direct[0].path) < direct[0].size // 10
    buffered = write_flat(tier, 2, "s", 0, flat, threads=1)
    data = (tmp_path / direct[0].path).read_bytes()
    assert len(data) == direct[0].size and direct[0].size % 4096  # the padding was cut off
    assert data == (tmp_path / buffered[0].path).read_bytes()
    assert direct[0].checksum == buffered[0].checksum == content_hash(flat)
    bufs, _, _ = read_files([tier], direct)
    assert_same(decode_files(direct, bufs, name="s"), state)
    del bufs
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_a_large_table_is_written_by_blocks_with_the_streamed_bytes(tmp_path):
    """Replay buffers are the largest state of many RL runs: an uncompressed table from 128 MiB is
    written like a large tensors file (threads, O_DIRECT, straight from the table's memory); the
    file is byte-for-byte the streamed Arrow IPC file, it leaves the page cache alone, and it reads
    back equal. A compressed table is streamed (its buffers are made while writing)."""
    from ray_ckpt.storage.checkpoint_io import PARALLEL_FROM

    n = PARALLEL_FROM // 12 + 1001  # rows of 12 bytes: just over the limit, not a multiple of 4096
    rng = np.random.default_rng(5)
    table = pa.table({"obs": rng.standard_normal(n, dtype=np.float32),
                      "act": rng.integers(0, 1 << 40, n, dtype=np.int64)})
    assert table.nbytes >= PARALLEL_FROM
    state = {"replay": table, "size": n}
    flat = flatten(state)
    tier = Tier(str(tmp_path), "local")
    blocks = write_flat(tier, 1, "r", 0, flat, threads=2, direct=True)
    streamed = write_flat(tier, 2, "r", 0, flat, threads=1)
    (tb,), (ts,) = [[e for e in entries if e.role == "table"] for entries in (blocks, streamed)]
    fs_type = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout
    if shutil.which("fincore") and "tmpfs" not in fs_type:
        assert _resident_bytes(tmp_path / tb.path) < tb.size // 10
    assert (tb.size, tb.checksum) == (ts.size, ts.checksum) and tb.size % 4096
    assert (tmp_path / tb.path).read_bytes() == (tmp_path / ts.path).read_bytes()
    bufs, _, _ = read_files([tier], blocks)
    back = decode_files(blocks, bufs, name="r")
    assert back["size"] == n and back["replay"].equals(table)
    del bufs, back
    zstd = write_flat(tier, 3, "r", 0, flat, compression="zstd", threads=2, direct=True)
    bufs, _, _ = read_files([tier], zstd)
    assert decode_files(zstd, bufs, name="r")["replay"].equals(table)


def test_direct_io_falls_back_to_buffered_writes_where_there_is_none(tmp_path, monkeypatch):
    """A platform without O_DIRECT (macOS) gets the ordinary write, same bytes and checksum."""
    from ray_ckpt.storage.checkpoint_io import PARALLEL_FROM

    flat = flatten({"w": torch.arange(PARALLEL_FROM // 8 + 5, dtype=torch.float64)})
    tier = Tier(str(tmp_path), "local")
    expected = write_flat(tier, 1, "s", 0, flat, threads=1)
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    got = write_flat(tier, 2, "s", 0, flat, threads=2, direct=True)
    assert (got[0].size, got[0].checksum) == (expected[0].size, expected[0].checksum)
    assert (tmp_path / got[0].path).read_bytes() == (tmp_path / expected[0].path).read_bytes()


@pytest.mark.parametrize("mb,direct", [(8, False), (160, True)], ids=["stream", "direct-blocks"])
def test_full_disk_is_a_clear_save_error_and_leaves_nothing(small_disk, mb, direct):
    """ENOSPC half way through a file, on either write path: SaveError naming the state, the file
    and the cause; no temporary or partial file left behind; what was there before is intact."""
    disk = small_disk(mb // 2)
    tier = Tier(str(disk / "run"), "local")
    small = write_flat(tier, 1, "s", 0, flatten({"w": torch.arange(1000)}))
    big = flatten({"w": torch.zeros(mb << 18)})  # mb MiB of float32
    with pytest.raises(rc.SaveError, match=r"writing state 's' rank 0 of step 2 .*No space left on device"):
        write_flat(tier, 2, "s", 0, big, threads=2, direct=direct)
    assert sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if p.is_file()) == [f"run/{small[0].path}"]
    bufs, _, _ = read_files([tier], small)
    assert torch.equal(decode_files(small, bufs, name="s")["w"], torch.arange(1000))


def test_direct_io_must_be_a_bool(tmp_path):
    from ray_ckpt.config import EngineConfig

    with pytest.raises(ValueError, match="direct_io must be True or False"):
        EngineConfig(run="r", local_dir=str(tmp_path), direct_io="yes")
    with pytest.raises(ValueError, match="prefault_object_store must be True or False"):
        EngineConfig(run="r", local_dir=str(tmp_path), prefault_object_store=1)


@pytest.mark.parametrize("size", [0, 1, 64 << 20, (64 << 20) + 12345], ids=["empty", "1B", "block", "block+"])
def test_digest_at_block_edges_is_the_same_threaded_or_streamed(size):
    """Empty, tiny, exactly one block, one block and a bit: every way of computing a digest agrees,
    and a different size (trailing zero byte) gives a different digest."""
    from ray_ckpt.formats.checksum import BLOCK, digest, new_hasher

    assert BLOCK == 64 << 20
    data = bytes(size)
    h = new_hasher()
    h.update(data)
    assert digest(data, 1) == digest(data, 2) == h.hexdigest()
    assert digest(data + b"\0") != digest(data)


def test_content_hash_is_stable_and_equals_file_checksum(tmp_path):
    flat = flatten({"w": torch.ones(10)})
    tier = Tier(str(tmp_path), "local")
    files = write_flat(tier, 1, "ref", 0, flat)
    assert content_hash(flat) == content_hash(flatten({"w": torch.ones(10)})) == files[0].checksum
    assert content_hash(flatten({"w": torch.zeros(10)})) != files[0].checksum


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".hidden", "a b", "x" * 200, None, "a\\b", "..", 3])
def test_path_like_names_refused(bad):
    with pytest.raises(ValueError, match="invalid"):
        validate_name(bad)


def test_retention_policies_compose():
    vs = [VersionInfo(v, v * 10, {"reward": float(r)}) for v, r in zip(range(1, 11), [5, 9, 1, 2, 3, 8, 0, 1, 1, 2])]
    assert RetentionPolicy(keep_last=2).keep(vs) == {9, 10}
    assert RetentionPolicy(keep_every=40).keep(vs) == {4, 8, 10}
    assert RetentionPolicy(keep_best=("reward", "max", 2)).keep(vs) == {2, 6, 10}
    assert RetentionPolicy(keep_last=1, keep_every=50, keep_best=("reward", "min", 1)).keep(vs) == {5, 7, 10}
    # the newest is never deleted, in-flight versions are never candidates
    assert 10 not in plan_deletions(RetentionPolicy(keep_best=("reward", "max", 1)), vs)
    assert 3 not in plan_deletions(RetentionPolicy(keep_last=1), vs, in_flight=[3])
    assert plan_deletions(RetentionPolicy(), vs) == []
    with pytest.raises(ValueError):
        RetentionPolicy(keep_last=0)


def test_catalogue_commits_only_when_critical_parts_are_written():
    cat = Catalogue("run")
    cat.begin(5, 5, [{"name": "policy", "strategy": "critical"}, {"name": "replay", "strategy": "best_effort"}])
    assert not cat.ready_to_commit(5)
    cat.part_written(5, "policy", 0, {"files": [{"path": "v000000000005/policy/rank0.safetensors", "size": 1,
                                                 "checksum": "x"}], "written": 1})
    assert cat.ready_to_commit(5) and not cat.settled(5)
    m = cat.manifest_for(5)
    assert m.states["replay"].status == "pending" and m.states["policy"].status == "stored"
    cat.mark_committed(5, m)
    assert not cat.part_failed(5, "replay", 0, "disk full")  # best-effort: not fatal
    assert cat.manifest_for(5).states["replay"].status == "missing"
    assert Manifest.from_json(cat.manifest_for(5).to_json()).states["policy"].files["0"][0].size == 1
    with pytest.raises(rc.SaveError, match="already exists"):
        cat.begin(5, 5, [])
    cat.begin(6, 6, [{"name": "policy", "strategy": "critical"}])
    assert cat.part_failed(6, "policy", 0, "boom")  # critical: the version fails
    assert not cat.ready_to_commit(6)


def test_retention_keeps_the_file_a_writer_may_refer_to_instead_of_writing():
    """A RELOADABLE part is offered the files of earlier versions with the same content; until
    it is written, retention (which may run when another version commits) must keep them."""
    from ray_ckpt.storage.retention import RetentionPolicy as Policy

    ref = {"path": "v000000000001/reference/rank0.safetensors", "size": 10, "checksum": "c1", "role": "tensors"}
    cat = Catalogue("run")
    cat.begin(1, 1, [{"name": "reference", "strategy": "reloadable"}])
    cat.part_written(1, "reference", 0, {"files": [ref], "written": 10, "content_hash": "h"})
    cat.mark_committed(1, cat.manifest_for(1))
    cat.finish(1)
    cat.begin(2, 2, [{"name": "reference", "strategy": "reloadable"}])
    cat.begin(3, 3, [{"name": "other", "strategy": "critical"}])
    part = cat.pending[2].parts[("reference", 0)]
    assert cat.reuse_for(part) == {"h": [dict(ref, node=None)]}  # node: where it was written (unknown here)
    cat.part_written(3, "other", 0, {"files": [{"path": "v000000000003/other/rank0.safetensors", "size": 1,
                                               "checksum": "x"}], "written": 1})
    cat.mark_committed(3, cat.manifest_for(3))  # version 3 commits first: retention may drop version 1
    cat.finish(3)
    doomed = set(cat.plan_retention(Policy(keep_last=1)))
    assert doomed == {1}
    assert ref["path"] in cat.kept_paths(doomed)  # version 2's writer may still refer to it
    cat.part_written(2, "reference", 0, {"files": [ref], "written": 0, "content_hash": "h"})
    assert ref["path"] in cat.kept_paths(doomed)  # now as a file of version 2 itself


def test_a_push_that_overtakes_the_same_ranks_earlier_push_breaks_no_barrier():
    """Ray may run an async actor's calls out of order: rank 0's push for step 20 can reach the
    coordinator before its push for step 10. Its engine says which step it pushed before, so
    version 10 is not failed for a rank that did not skip it; a rank that skipped it still fails it."""
    cat = Catalogue("run")
    cat.declare("shard", "critical", 2)
    cat.accept_push(10, 10, "shard", 1)  # rank 1 at step 10
    cat.accept_push(20, 20, "shard", 0)  # rank 0's step 20 arrives first
    assert cat.barrier_violations(20, "shard", 0, after=10) == []  # its step 10 is on the way
    cat.accept_push(10, 10, "shard", 0)
    assert cat.barrier_violations(10, "shard", 0, after=-1) == []
    cat.accept_push(30, 30, "shard", 1)
    assert cat.barrier_violations(30, "shard", 1, after=10) == [20]  # rank 1 skipped step 20


def test_manifest_with_path_traversal_is_refused():
    m = Manifest("run", 1, 1, 0.0)
    from ray_ckpt.formats.manifest import FileEntry, StateEntry

    m.states["p"] = StateEntry("critical", "stored", files={"0": [FileEntry("../../etc/passwd", 1, "x")]})
    with pytest.raises(rc.IntegrityError, match="invalid file path"):
        Manifest.from_json(m.to_json())


def test_manifest_with_other_checksum_algorithm_is_refused_clearly():
    m = Manifest("run", 1, 1, 0.0, checksum_algorithm="xxh3_128")
    with pytest.raises(rc.IntegrityError, match="its checksums are 'xxh3_128'; this ray_ckpt verifies"):
        Manifest.from_json(m.to_json())
    assert Manifest.from_json(Manifest("run", 1, 1, 0.0).to_json()).version == 1


def test_deleting_versions_removes_shared_files_once_unreferenced(tmp_path):
    from ray_ckpt.storage.checkpoint_io import delete_version, write_manifest
    from ray_ckpt.formats.manifest import StateEntry

    tier = Tier(str(tmp_path), "local")
    shared = write_flat(tier, 1, "ref", 0, flatten({"w": torch.ones(4)}))
    manifests = {}
    for v in (1, 2):  # v2 refers to v1's file (a RELOADABLE state stored once)
        m = Manifest("run", v, v, 0.0)
        m.states["ref"] = StateEntry("reloadable", "stored", files={"0": shared})
        write_manifest(tier, m)
        manifests[v] = m
    assert delete_version(tier, 1, set(manifests[2].referenced_paths()), manifests[1].referenced_paths()) == []
    assert (tmp_path / shared[0].path).exists()  # still used by v2
    assert delete_version(tier, 2, set(), manifests[2].referenced_paths()) == [shared[0].path]
    assert not (tmp_path / "v000000000001").exists() and not (tmp_path / "v000000000002").exists()


def test_host_staging_path_reuses_buffers_and_keeps_bytes(tmp_path):
    """The device->host staging path (pinned buffers + side stream on CUDA), run on CPU tensors."""
    from ray_ckpt.capture.snapshot import HostStaging, capture

    staging = HostStaging(stage_cpu=True)
    model = torch.nn.Linear(16, 8)
    first = capture(model.state_dict(), "policy", staging=staging)
    ptrs = {k: b.data_ptr() for k, b in staging.buffers.items()}
    assert set(ptrs) == {"weight", "bias"}
    # the staged copy is a snapshot: later in-place training does not change it
    with torch.no_grad():
        model.weight.add_(1.0)
    back = decode_files(*_write_read(first, tmp_path, 1), name="policy")
    assert not torch.equal(back["weight"], model.weight)
    second = capture(model.state_dict(), "policy", staging=staging)
    assert {k: b.data_ptr() for k, b in staging.buffers.items()} == ptrs  # reused across saves
    back2 = decode_files(*_write_read(second, tmp_path, 2), name="policy")
    assert torch.equal(back2["weight"], model.weight) and torch.equal(back2["bias"], model.bias)


def _write_read(flat, tmp_path, version):
    tier = Tier(str(tmp_path), "local")
    files = write_flat(tier, version, "policy", 0, flat)
    bufs, _, _ = read_files([tier], files)
    return files, bufs


def test_driver_save_joins_a_version_its_ranks_opened_first():
    """Ray orders calls per caller only: rank pushes may reach the coordinator before the driver's save."""
    cat = Catalogue("run")
    cat.declare("shard", "critical", world_size=2)
    cat.accept_push(4, 4, "shard", 0)
    cat.begin(4, 4, [{"name": "reference", "strategy": "reloadable"}])  # merged, not refused
    assert set(cat.pending[4].parts) == {("shard", 0), ("shard", 1), ("reference", 0)}
    for name, rank in [("shard", 0), ("shard", 1)]:
        cat.part_written(4, name, rank, {"files": [], "written": 0})
    assert not cat.ready_to_commit(4)  # the driver's part is awaited too
    with pytest.raises(rc.SaveError, match="already exists"):
        cat.begin(4, 4, [{"name": "other", "strategy": "critical"}])  # only once


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_write_threads_must_be_a_positive_integer(bad, tmp_path):
    from ray_ckpt.config import EngineConfig

    with pytest.raises(ValueError, match="write_threads must be an integer >= 1"):
        EngineConfig(run="r", local_dir=str(tmp_path), write_threads=bad)
    assert not any(tmp_path.iterdir()), "nothing may be written for a bad configuration"


@pytest.mark.parametrize("path", ["stream", "blocks", "direct"])
def test_rate_limited_local_writes_take_their_time_and_write_the_same_bytes(tmp_path, path):
    """A tier with a RateLimit schedules each 8 MiB chunk's write at the limit's pace (no burst
    from idle credit), on every write path; the bytes and digest are those of an unlimited write."""
    from ray_ckpt.storage.checkpoint_io import PARALLEL_FROM
    from ray_ckpt.formats.checksum import STRIDE
    from ray_ckpt.storage.tier import RateLimit

    mb = 24 if path == "stream" else PARALLEL_FROM >> 20
    flat = flatten({"w": torch.randint(0, 255, (mb << 20,), dtype=torch.uint8)})
    free = Tier(str(tmp_path / "free"), "local")
    limited = Tier(str(tmp_path / "limited"), "local")
    rate = (mb << 20) / 0.6  # the whole file in ~0.6 s
    limited.rate_limit = RateLimit(rate)
    kw = {"stream": {}, "blocks": {"threads": 2}, "direct": {"threads": 2, "direct": True}}[path]
    expected = write_flat(free, 1, "s", 0, flat, **kw)
    t = time.perf_counter()
    got = write_flat(limited, 1, "s", 0, flat, **kw)
    assert time.perf_counter() - t >= (got[0].size - STRIDE) / rate * 0.99
    assert (got[0].size, got[0].checksum) == (expected[0].size, expected[0].checksum)
    assert (tmp_path / "limited" / got[0].path).read_bytes() == (tmp_path / "free" / expected[0].path).read_bytes()


@pytest.mark.parametrize("bad", [0, -5, "fast", True])
@pytest.mark.parametrize("option", ["best_effort_max_mb_s", "upload_max_mb_s"])
def test_rate_limits_are_validated(tmp_path, bad, option):
    from ray_ckpt.config import EngineConfig

    with pytest.raises(ValueError, match=f"{option} must be a number > 0"):
        EngineConfig(run="r", local_dir=str(tmp_path), **{option: bad})


def test_a_flat_travels_in_pieces_and_writes_the_same_file(tmp_path):
    """Ray copies every out-of-band buffer over 1 MiB with threads it starts for that buffer, so
    arrays up to 8 MiB travel as 1 MiB pieces (what Ray's serializer sees is pickle protocol 5 with
    out-of-band buffers, as here); the file and its digest do not change."""
    import io
    import pickle

    from ray_ckpt.formats import safetensors_io
    from ray_ckpt.formats.flat import PIECE, SPLIT_UP_TO, Pieces

    sizes = [0, 100, PIECE, PIECE + 1, SPLIT_UP_TO - 5, SPLIT_UP_TO, SPLIT_UP_TO + 1, 2 * SPLIT_UP_TO + 3]
    rng = np.random.default_rng(7)
    state = {f"t{n}": torch.from_numpy(rng.integers(0, 255, n, dtype=np.uint8)) for n in sizes}
    state["meta"] = {"step": 3}
    flat = flatten(state, state_name="s")
    buffers = []
    data = pickle.dumps(flat, protocol=5, buffer_callback=buffers.append)
    moved = pickle.loads(data, buffers=[b.raw() for b in buffers])

    assert sorted(len(b.raw()) for b in buffers)[-2:] == [SPLIT_UP_TO + 1, 2 * SPLIT_UP_TO + 3]  # whole
    split = [a for a in moved.arrays if isinstance(a, Pieces)]
    assert sorted(a.nbytes for a in split) == [PIECE + 1, SPLIT_UP_TO - 5, SPLIT_UP_TO]
    assert all(len(p) <= PIECE for a in split for p in a.parts)
    assert moved.nbytes == flat.nbytes

    def file_bytes(f):
        sink = io.BytesIO()
        safetensors_io.write(f, sink)
        return sink.getvalue()

    assert file_bytes(moved) == file_bytes(flat)
    assert content_hash(moved) == content_hash(flat)
    tier = Tier(str(tmp_path), "local")
    entry, = write_flat(tier, 1, "s", 0, moved)
    back = decode_files([entry], read_files([tier], [entry])[0], name="s")
    assert all(torch.equal(back[k], v) for k, v in state.items() if k != "meta") and back["meta"] == {"step": 3}
    for direct in (False, True):  # the block writer of large files (threads, O_DIRECT) takes pieces too
        size, digest = tier.write_blocks(f"blocks{int(direct)}", safetensors_io.file_views(moved), 2, direct)
        with open(tier.abspath(f"blocks{int(direct)}"), "rb") as f:
            assert f.read() == file_bytes(flat)
        assert (size, digest) == (entry.size, entry.checksum)
