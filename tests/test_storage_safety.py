"""Odd or hostile storage (issue 13): symlinks, special files, edited headers with valid checksums,
copied manifests, signatures, leftovers, secrets in URIs. Real files, links and FIFOs; no Ray.

Every call that could block on a FIFO runs under ``bounded`` (a thread joined with a timeout, the
FIFO's write end opened afterwards so that a stuck reader is released either way)."""
import ast
import json
import os
import pathlib
import random
import socket
import struct
import threading

import numpy as np
import pyarrow as pa
import pytest

import ray_ckpt as rc
from ray_ckpt.storage.checkpoint_io import (decode_files, delete_version, read_files, read_manifest, scan, stray_files,
                                    write_flat, write_manifest)
from ray_ckpt.formats import arrow_io, buffer_io, safetensors_io
from ray_ckpt.formats.checksum import digest
from ray_ckpt.formats.manifest import (FileEntry, Manifest, StateEntry, chain_problems, manifest_digest,
                                       sign_manifest, verify_signature)
from ray_ckpt.formats.tree import flatten
from ray_ckpt.storage import layout
from ray_ckpt.storage.filesystems import join_uri, redact_uri, resolve_filesystem
from ray_ckpt.storage.local_files import TMP_MARK, hash_file, map_file
from ray_ckpt.storage.tier import Tier

ROOT = pathlib.Path(__file__).resolve().parent.parent
V = layout.version_dir


def bounded(fn, timeout=20.0, fifos=()):
    """fn() in a thread, at most ``timeout`` seconds: returns its value or raises its exception;
    a call still blocked fails the test (after releasing any reader stuck on ``fifos``)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    hung = t.is_alive()
    for p in fifos:  # a reader blocked in open() of the FIFO returns once a writer appears
        try:
            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    if hung:
        t.join(5)
        pytest.fail(f"{fn} did not return within {timeout} s (blocked on a FIFO?)")
    if "error" in out:
        raise out["error"]
    return out["value"]


def commit(tier, version, state, name="policy"):
    files = write_flat(tier, version, name, 0, flatten(state, state_name=name))
    m = Manifest("run", version, version, 0.0)
    m.states[name] = StateEntry("critical", "stored", files={"0": files})
    write_manifest(tier, m)
    return m, files


def tree_of(path):
    """Every path below ``path`` (no links followed) with its bytes (files) or target (links)."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, path)] = (os.readlink(p) if os.path.islink(p)
                                             else open(p, "rb").read() if os.path.isfile(p) else "dir")
    return out


@pytest.fixture
def outside(tmp_path):
    """A directory outside the run root, with files a confused deletion would remove."""
    d = tmp_path / "outside"
    (d / "sub").mkdir(parents=True)
    (d / "rank0.safetensors").write_bytes(b"not yours")
    (d / "manifest.json").write_bytes(b"{}")
    (d / "sub" / "keep.txt").write_bytes(b"keep me")
    return d


@pytest.fixture
def tier(tmp_path):
    return Tier(str(tmp_path / "run"), "local")


STATE = {"w": np.arange(12, dtype=np.float32), "b": np.ones(3), "step": 7}  # tensors: safetensors file


# ------------------------------------------------------------------------- symbolic links
def test_listing_never_enters_a_linked_directory(tier, tmp_path, outside):
    m, files = commit(tier, 1, STATE)
    os.symlink(outside, tmp_path / "run" / V(1) / "elsewhere")
    os.symlink(outside / "rank0.safetensors", tmp_path / "run" / V(1) / "policy" / "file-link")
    listed = tier.list_files(V(1))
    assert f"{V(1)}/elsewhere" in listed and f"{V(1)}/policy/file-link" in listed  # the links, as entries
    assert not any("keep.txt" in p or p.endswith("elsewhere/rank0.safetensors") for p in listed)
    assert sorted(listed) == sorted([files[0].path, layout.manifest_path(1), f"{V(1)}/elsewhere",
                                     f"{V(1)}/policy/file-link"])
    assert tier.list_files(f"{V(1)}/elsewhere") == []  # a link given as the directory: not entered
    assert stray_files(tier, 1, m) == [f"{V(1)}/elsewhere", f"{V(1)}/policy/file-link"]


def test_deleting_a_version_unlinks_links_and_never_their_targets(tier, tmp_path, outside):
    before = tree_of(outside)
    m, files = commit(tier, 1, STATE)
    commit(tier, 2, STATE)
    run = tmp_path / "run"
    os.symlink(outside, run / V(1) / "linked-state")  # a linked directory inside a version
    os.symlink(outside / "rank0.safetensors", run / V(1) / "policy" / "rank1.safetensors")
    # a manifest naming a file behind a linked state directory of another version
    os.symlink(outside, run / V(2) / "other")
    referenced = m.referenced_paths() + [f"{V(2)}/other/rank0.safetensors"]
    deleted = delete_version(tier, 1, set(), referenced)
    assert sorted(deleted) == sorted([files[0].path, f"{V(1)}/linked-state", f"{V(1)}/policy/rank1.safetensors"])
    assert not (run / V(1)).exists() and not os.path.lexists(run / V(1))
    assert tree_of(outside) == before  # every file and directory outside the run root is intact
    assert os.path.islink(run / V(2) / "other")  # not deleted through, not deleted (v2 is kept)


def test_a_linked_version_directory_is_not_ours_to_list_restore_or_empty(tier, tmp_path, outside):
    commit(tier, 1, STATE)
    other = Tier(str(tmp_path / "other_run"), "local")  # a committed version of another run, linked in
    commit(other, 1, STATE)
    run = tmp_path / "run"
    os.symlink(outside, run / V(5))  # no manifest
    os.symlink(tmp_path / "other_run" / V(1), run / V(6))  # with a manifest (of version 1)
    (run / V(7)).write_bytes(b"a file, not a directory")
    before, before_other = tree_of(outside), tree_of(tmp_path / "other_run")
    assert tier.version_dirs() == {1: True}
    assert tier.odd_entries() == {5: "a symbolic link", 6: "a symbolic link", 7: "a regular file"}
    committed, partial, bad = scan(tier)
    assert sorted(committed) == [1] and partial == []
    assert len(bad) == 3 and all("not a version directory" in b for b in bad)
    assert "symbolic link" in bad[0] and V(5) in bad[0]
    for v in (5, 6):
        assert delete_version(tier, v, set(), []) == []  # even when asked: nothing behind the link
        with pytest.raises(rc.IntegrityError, match="symbolic link"):
            read_manifest(tier, v)
    assert tree_of(outside) == before and tree_of(tmp_path / "other_run") == before_other
    assert os.path.islink(run / V(5)) and os.path.islink(run / V(6))
    # writing a version whose directory is a link is refused: nothing is written behind it
    with pytest.raises(rc.SaveError, match=f"{V(5)} is a link or not a directory: ray_ckpt never writes through"):
        write_flat(tier, 5, "policy", 0, flatten(STATE, state_name="policy"))
    with pytest.raises(rc.IntegrityError, match="never writes through"):
        tier.put_bytes(layout.manifest_path(5), b"{}")
    assert tree_of(outside) == before


def test_a_linked_checkpoint_file_is_refused_and_the_remote_copy_used(tmp_path, outside):
    local, remote = Tier(str(tmp_path / "l"), "local"), Tier(str(tmp_path / "r"), "remote")
    m, files = commit(local, 1, STATE)
    for f in files:
        local.copy_to(remote, f.path)
    p = tmp_path / "l" / files[0].path
    os.replace(p, outside / "moved.safetensors")
    os.symlink(outside / "moved.safetensors", p)  # same bytes, behind a link
    with pytest.raises(rc.IntegrityError, match=f"{p} is a symbolic link, not a regular file"):
        local.read_verified(files[0].path, files[0].size, files[0].checksum)
    with pytest.raises(rc.IntegrityError, match="symbolic link"):
        local.read_bytes(files[0].path)
    with pytest.raises(rc.IntegrityError, match="symbolic link"):
        local.copy_to(remote, files[0].path)
    with pytest.raises(rc.IntegrityError, match="symbolic link"):
        map_file(str(p))
    with pytest.raises(rc.IntegrityError, match="symbolic link"):
        hash_file(str(p), 2)
    bufs, used, problems = read_files([local, remote], files)
    assert used == "remote" and "symbolic link" in problems[0]
    assert decode_files(files, bufs, name="policy", as_numpy=True)["step"] == 7
    # a linked state directory: the path is refused at the link, whatever lies behind it
    os.unlink(p)
    os.replace(tmp_path / "l" / V(1) / "policy", outside / "policy")
    os.symlink(outside / "policy", tmp_path / "l" / V(1) / "policy")
    with pytest.raises(rc.IntegrityError, match=f"{V(1)}/policy is a symbolic link, not a directory"):
        local.read_verified(files[0].path, files[0].size, files[0].checksum)
    assert not local.exists(files[0].path) and local.exists(f"{V(1)}/policy")


# ------------------------------------------------------------------------- special files
def test_a_fifo_in_place_of_a_state_file_is_an_integrity_error_not_a_hang(tmp_path):
    local, remote = Tier(str(tmp_path / "l"), "local"), Tier(str(tmp_path / "r"), "remote")
    m, files = commit(local, 1, STATE)
    for f in files:
        local.copy_to(remote, f.path)
    p = tmp_path / "l" / files[0].path
    p.unlink()
    os.mkfifo(p)
    f = files[0]
    for call in (lambda: local.read_verified(f.path, f.size, f.checksum), lambda: local.read_bytes(f.path),
                 lambda: local.copy_to(remote, f.path), lambda: local.hash_file(f.path),
                 lambda: hash_file(str(p), 2), lambda: map_file(str(p))):
        with pytest.raises(rc.IntegrityError, match=f"{p} is a FIFO, not a regular file"):
            bounded(call, fifos=[p])
    bufs, used, problems = bounded(lambda: read_files([local, remote], files), fifos=[p])
    assert used == "remote" and "FIFO" in problems[0]
    with pytest.raises(rc.IntegrityError, match="FIFO"):
        bounded(lambda: read_files([local], files), fifos=[p])
    assert stray_files(local, 1, m) == []  # named by the manifest: bad, not stray
    assert bounded(lambda: delete_version(local, 1, set(), m.referenced_paths()), fifos=[p]) == [f.path]
    assert not os.path.lexists(tmp_path / "l" / V(1))


def test_a_device_in_place_of_a_state_file_is_refused_unread(tmp_path):
    """/dev/zero's device (an endless read) and a link to /dev/zero: refused before any byte is read."""
    tier = Tier(str(tmp_path / "l"), "local")
    m, files = commit(tier, 1, STATE)
    f = files[0]
    p = tmp_path / "l" / f.path
    p.unlink()
    os.symlink("/dev/zero", p)
    with pytest.raises(rc.IntegrityError, match=f"{p} is a symbolic link"):
        bounded(lambda: tier.read_verified(f.path, f.size, f.checksum))
    p.unlink()
    try:
        os.mknod(p, 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    for call in (lambda: tier.read_verified(f.path, f.size, f.checksum), lambda: tier.read_bytes(f.path),
                 lambda: hash_file(str(p), 2)):
        with pytest.raises(rc.IntegrityError, match=f"{p} is a character device, not a regular file"):
            bounded(call)
    assert delete_version(tier, 1, set(), m.referenced_paths()) == [f.path]
    assert os.path.exists("/dev/zero")


def test_a_fifo_or_socket_in_place_of_a_manifest_is_reported_by_scan_not_a_hang(tier, tmp_path):
    commit(tier, 1, STATE)
    commit(tier, 2, STATE)
    commit(tier, 3, STATE)
    run = tmp_path / "run"
    fifo = run / V(2) / "manifest.json"
    fifo.unlink()
    os.mkfifo(fifo)
    sock_path = run / V(3) / "manifest.json"
    sock_path.unlink()
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(sock_path))
        committed, partial, bad = bounded(lambda: scan(tier), fifos=[fifo])
    finally:
        sock.close()
    assert sorted(committed) == [1] and partial == []  # neither is a partial version to remove
    assert "is a FIFO" in bad[0] and V(2) in bad[0] and "is a socket" in bad[1] and V(3) in bad[1]
    assert tier.exists(layout.manifest_path(2))


# ------------------------------------------------------------------------- manifests
def test_a_manifest_copied_into_another_versions_directory_is_refused(tier, tmp_path):
    commit(tier, 1, STATE)
    commit(tier, 2, STATE)
    run = tmp_path / "run"
    (run / V(3)).mkdir()
    (run / V(3) / "manifest.json").write_bytes((run / V(1) / "manifest.json").read_bytes())
    (run / V(2) / "manifest.json").write_bytes((run / V(1) / "manifest.json").read_bytes())  # rolled back
    with pytest.raises(rc.IntegrityError, match=r"manifest says version 1, but it lies in v000000000003/"):
        read_manifest(tier, 3)
    committed, partial, bad = scan(tier)
    assert sorted(committed) == [1] and partial == []
    assert len(bad) == 2 and "version 2:" in bad[0] and "version 3:" in bad[1]
    assert all("manifest says version 1" in b and "manifest.json" in b for b in bad)


def _manifest(version=3, previous=None):
    m = Manifest("run", version, 30, 1700000000.25, metrics={"loss": 0.5})
    m.states["p"] = StateEntry("critical", "stored", files={"0": [FileEntry(f"{V(version)}/p/rank0.safetensors",
                                                                             10, "ab" * 16)]}, bytes=10)
    return m


def test_manifest_chain_fields_roundtrip_and_are_absent_when_unset():
    plain = _manifest()
    assert b"previous" not in plain.to_json() and b"signature" not in plain.to_json()  # as before
    one = _manifest(1)
    two = _manifest(2)
    two.previous, two.previous_version = manifest_digest(one), 1
    back = Manifest.from_json(two.to_json())
    assert back.previous == manifest_digest(one) and back.previous_version == 1 and back == two
    assert manifest_digest(one) == manifest_digest(one.to_json())  # object or bytes: the same digest
    assert manifest_digest(one).startswith("sha256:") and manifest_digest(two) != manifest_digest(one)
    assert manifest_digest(json.dumps(json.loads(one.to_json())).encode()) == manifest_digest(one)  # whitespace
    assert chain_problems({1: one, 2: two}) == []
    assert chain_problems({2: two}) == []  # its predecessor deleted by retention: fine
    forged = _manifest(1)
    forged.step = 999
    problems = chain_problems({1: forged, 2: two})
    assert len(problems) == 1 and "version 2: the manifest of version 1 is not the one" in problems[0]
    two.previous_version = 2
    assert "not an older version" in chain_problems({2: two})[0]
    with pytest.raises(rc.IntegrityError, match="unreadable manifest"):
        manifest_digest(b"not json")


def test_signed_manifests_verify_and_unsigned_or_edited_ones_are_refused(tier):
    key, other = b"k" * 32, b"o" * 32
    m = sign_manifest(_manifest(), key)
    data = m.to_json()
    verify_signature(data, key)
    assert Manifest.from_json(data, key=key) == m
    assert Manifest.from_json(data) == m  # without a key the signature is carried, not checked
    with pytest.raises(rc.IntegrityError, match="signed with another key"):
        verify_signature(data, other)
    edited = json.loads(data)
    edited["step"] = 31
    with pytest.raises(rc.IntegrityError, match="where.json: manifest signature does not verify"):
        verify_signature(json.dumps(edited).encode(), key, where="where.json")
    with pytest.raises(rc.IntegrityError, match="does not verify"):
        Manifest.from_json(json.dumps(edited).encode(), key=key)
    with pytest.raises(rc.IntegrityError, match="is not signed"):
        Manifest.from_json(_manifest().to_json(), key=key)
    assert json.loads(data)["signature"] != sign_manifest(_manifest(), other).signature
    # stored and read back through a tier: read_manifest and scan take the key
    write_manifest(tier, sign_manifest(_manifest(1), key))
    unsigned = _manifest(2)
    write_manifest(tier, unsigned)
    assert read_manifest(tier, 1, key).signature is not None
    committed, partial, bad = scan(tier, key)
    assert sorted(committed) == [1] and partial == [] and "version 2:" in bad[0] and "is not signed" in bad[0]
    assert sorted(scan(tier)[0]) == [1, 2]


@pytest.mark.parametrize("doc", [b"[]", b'{"format": "ray_ckpt.manifest/1", "states": {"p": 3}}',
                                 b'{"format": "ray_ckpt.manifest/1", "version": "1", "states": {}}',
                                 b'{"format": "ray_ckpt.manifest/1", "run": "r", "version": 1, "step": 1, '
                                 b'"created_at": 0, "states": {"p": {"strategy": "c", "status": "stored", '
                                 b'"files": {"0": [{"path": "v000000000001/p/r", "size": -1, "checksum": "x"}]}}}}'])
def test_malformed_manifests_are_integrity_errors(doc):
    with pytest.raises(rc.IntegrityError, match="here.json: unreadable manifest"):
        Manifest.from_json(doc, where="here.json")


# ------------------------------------------------------------------------- leftovers
def test_stray_files_lists_leftover_temporaries_in_a_committed_version(tier, tmp_path):
    m, files = commit(tier, 1, STATE)
    assert stray_files(tier, 1, m) == []
    tmp = f"{files[0].path}{TMP_MARK}0123456789ab"
    (tmp_path / "run" / tmp).write_bytes(b"half a file")
    (tmp_path / "run" / V(1) / "notes.txt").write_bytes(b"by hand")
    assert stray_files(tier, 1, m) == sorted([tmp, f"{V(1)}/notes.txt"])
    # a file of an older version the manifest refers to is not a stray of that older version
    m2 = Manifest("run", 2, 2, 0.0, states={"policy": StateEntry("reloadable", "stored", files={"0": files})})
    write_manifest(tier, m2)
    assert stray_files(tier, 2, m2) == []


# ------------------------------------------------------------------------- edited headers, valid checksums
def _tensors_file(tier, state=STATE):
    files = write_flat(tier, 1, "policy", 0, flatten(state, state_name="policy"))
    f = next(f for f in files if f.role == "tensors")
    return f, bytes(tier.read_bytes(f.path))


def _rewrite(tier, f, data):
    """Replace ``f`` with ``data`` and an entry whose size and checksum match it (the attacker case)."""
    tier.put_bytes(f.path, data)
    return FileEntry(f.path, len(data), digest(data), f.role)


def _with_header(data, edit):
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


def _set(key, field, value):
    def edit(h):
        h[key][field] = value
    return edit


@pytest.mark.parametrize("edit,match", [
    (_set("w", "data_offsets", [0, 10 ** 6]), r"tensor 'w': data_offsets \[0, 1000000\] run past the data"),
    (_set("w", "data_offsets", [-8, 40]), r"tensor 'w': data_offsets \[-8, 40\] are not \[begin, end\]"),
    (_set("w", "data_offsets", [40, 0]), r"tensor 'w': data_offsets \[40, 0\] are not \[begin, end\]"),
    (_set("w", "data_offsets", ["0", "48"]), r"tensor 'w': data_offsets"),
    (_set("w", "data_offsets", [0]), r"tensor 'w': data_offsets"),
    (_set("w", "shape", [13]), r"tensor 'w': data_offsets .* hold 48 bytes, but F32 \[13\] needs 52"),
    (_set("w", "shape", [-12]), r"tensor 'w': shape \[-12\]"),
    (_set("w", "dtype", "F128"), r"tensor 'w': unknown dtype 'F128'"),
    (_set("w", "dtype", "F64"), r"tensor 'w': .* F64 \[12\] needs 96"),
    (lambda h: h["w"].update(data_offsets=list(h["b"]["data_offsets"]), dtype="F64", shape=[3]),
     r"overlap those of tensor"),
    (lambda h: h.update(w=[1, 2]), r"tensor 'w': its entry is not an object"),
    (lambda h: h.pop("w"), r"tensor 'w' \(a leaf\) is not in the header"),
    (lambda h: h["__metadata__"].update(x=5), r"__metadata__ is not an object of strings"),
    (lambda h: h["__metadata__"].pop("ray_ckpt.structure"), r"no 'ray_ckpt.structure'"),
    (lambda h: h["__metadata__"].update({"ray_ckpt.leaves": '["w", "w", "b"]'}), "names a tensor twice"),
])
def test_an_edited_safetensors_header_with_a_valid_checksum_is_refused(tier, edit, match):
    f, data = _tensors_file(tier)
    bad = _rewrite(tier, f, _with_header(data, edit))
    bufs, used, problems = read_files([tier], [bad])  # the checksum matches: read and verified
    assert problems == []
    with pytest.raises(rc.IntegrityError, match=match) as err:
        decode_files([bad], bufs, name="policy")
    assert f.path in str(err.value)


@pytest.mark.parametrize("header_len", [0, 1, 2 ** 63, 10 ** 9])
def test_an_insane_header_length_is_refused(tier, header_len):
    f, data = _tensors_file(tier)
    bad = _rewrite(tier, f, struct.pack("<Q", header_len) + data[8:])
    bufs, _, _ = read_files([tier], [bad])
    with pytest.raises(rc.IntegrityError, match=f"{f.path}: .*header length {header_len}"):
        decode_files([bad], bufs, name="policy")
    with pytest.raises(rc.IntegrityError, match="too short"):
        safetensors_io.read(b"\x01\x00", path="tiny")


def test_random_header_damage_with_valid_checksums_is_only_ever_an_integrity_error(tier):
    """Fuzz: bytes of the header changed at random; parsing either succeeds with in-bounds views or
    raises IntegrityError (never TypeError, KeyError, struct.error ...)."""
    _, data = _tensors_file(tier)
    (n,) = struct.unpack_from("<Q", data, 0)
    rng = random.Random(13)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(400):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(0, 8 + n)] = rng.choice(b'0123456789-[]{}",:. eE' + bytes([rng.randrange(256)]))
        try:
            structure, views = safetensors_io.read(bytes(b), path="fuzzed")
            assert all(len(v) <= len(b) for v in views)
            outcomes["ok"] += 1
        except rc.IntegrityError as exc:
            assert str(exc).startswith("fuzzed: ")
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100


def _arrow_bytes(table):
    sink = pa.BufferOutputStream()
    arrow_io.write(table, sink)
    return sink.getvalue().to_pybytes()


def _break_string_offsets(data, offsets):
    """Point a string column's last offset past its data: a structural error only full validation sees."""
    needle = struct.pack(f"<{len(offsets)}i", *offsets)
    at = data.find(needle)
    assert at > 0 and data.count(needle) == 1
    at += 4 * (len(offsets) - 1)
    return data[:at] + struct.pack("<i", 1 << 20) + data[at + 4:]


def test_a_table_file_with_broken_offsets_and_a_valid_checksum_is_refused(tier):
    state = {"w": np.arange(5, dtype=np.float32), "t": pa.table({"s": ["a", "bb", "cccccc"]})}
    files = write_flat(tier, 1, "policy", 0, flatten(state, state_name="policy"))
    table_entry = next(f for f in files if f.role == "table")
    data = bytes(tier.read_bytes(table_entry.path))
    bad = _rewrite(tier, table_entry, _break_string_offsets(data, [0, 1, 3, 9]))
    entries = [f if f.role != "table" else bad for f in files]
    bufs, _, problems = read_files([tier], entries)
    assert problems == []
    with pytest.raises(rc.IntegrityError, match=f"{bad.path}: not a valid Arrow IPC file"):
        decode_files(entries, bufs, name="policy")
    with pytest.raises(rc.IntegrityError, match="t.arrow: not a valid Arrow IPC file"):
        arrow_io.read(b"ARROW1\x00\x00garbage", path="t.arrow")


def test_a_buffer_file_with_broken_offsets_or_a_lying_structure_is_refused(tier):
    files = write_flat(tier, 1, "table", 0, flatten(pa.table({"s": ["x", "yy", "zzzz"]}), state_name="table"))
    assert files[0].role == "buffer"
    data = bytes(tier.read_bytes(files[0].path))
    bad = _rewrite(tier, files[0], _break_string_offsets(data, [0, 1, 3, 7]))
    bufs, _, _ = read_files([tier], [bad])
    with pytest.raises(rc.IntegrityError, match=f"{bad.path}: not a ray_ckpt buffer file"):
        decode_files([bad], bufs, name="table")
    # a replay buffer whose structure says float64 (N, 4) while the column is float32 (N, 2)
    state = {"obs": np.zeros((6, 2), np.float32), "act": np.arange(6), "ptr": 3}
    flat = flatten(state, state_name="buf")
    table = buffer_io.as_table(flat)
    meta = dict(table.schema.metadata)
    structure = json.loads(meta[buffer_io.STRUCTURE_KEY])
    for lie, match in [({"dt": "<f8"}, "column 'obs': 12 values of float, the structure says 12 of double"),
                       ({"sh": [6, 4]}, "the structure says a tensor of shape \\[4\\]"),
                       ({"sh": [7, 2]}, "column 'obs': 6 rows"),
                       ({"N": 5}, "leaf index 5"),
                       ({"dt": "O"}, "is not a buffer column's")]:
        s = json.loads(json.dumps(structure))
        node = next(n for k, n in s["d"] if k == "obs")
        node.update(lie)
        lying = table.replace_schema_metadata({**meta, buffer_io.STRUCTURE_KEY: json.dumps(s).encode()})
        with pytest.raises(rc.IntegrityError, match=match):
            buffer_io.read(_arrow_bytes(lying), path="buf.arrow")
    struct_, views, _ = buffer_io.read(_arrow_bytes(table), path="buf.arrow")  # the truth still reads
    assert len(views) == 2


def test_random_damage_to_a_buffer_file_is_only_ever_an_integrity_error():
    state = {"obs": np.arange(40, dtype=np.float32).reshape(10, 4), "act": np.arange(10), "ptr": 3}
    data = _arrow_bytes(buffer_io.as_table(flatten(state, state_name="buf")))
    rng = random.Random(12)
    refused = 0
    for _ in range(300):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            buffer_io.read(bytes(b), path="fuzzed.arrow")
        except rc.IntegrityError as exc:
            assert str(exc).startswith("fuzzed.arrow: ")
            refused += 1
    assert refused > 20


# ------------------------------------------------------------------------- secrets and URIs
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzEXAMPLEKEY"


def test_redact_uri_strips_userinfo_and_secret_query_values():
    assert redact_uri(f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET}@bucket/prefix") == "s3://***@bucket/prefix"
    assert redact_uri("s3://bucket/p?endpoint_override=h:9000&scheme=http&secret_key=S3CR3T&access_key=AK&"
                      "session_token=T0K") == ("s3://bucket/p?endpoint_override=h:9000&scheme=http&secret_key=***&"
                                               "access_key=***&session_token=***")
    assert redact_uri("https://h/o?X-Amz-Signature=abc&X-Amz-Credential=def&v=1") == \
        "https://h/o?X-Amz-Signature=***&X-Amz-Credential=***&v=1"
    for plain in ("/abs/path", "file:///abs/path", "s3://bucket/prefix", "s3://bucket/runs@2024/x", "rel/dir"):
        assert redact_uri(plain) == plain


def test_secrets_never_appear_in_a_tiers_repr_or_errors():
    uri = (f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET.replace('/', '%2F').replace('+', '%2B')}@bucket/prefix"
           "?region=us-east-1&endpoint_override=127.0.0.1:9&scheme=http")
    tier = Tier(uri, "remote")
    assert tier.uri == uri  # still the URI that opens it
    for text in (repr(tier), tier.display, tier.describe("v000000000001/manifest.json")):
        assert SECRET not in text and "EXAMPLEKEY" not in text and "AKIAIOSFODNN7EXAMPLE" not in text
    assert repr(tier) == "Tier(remote, 's3://***@bucket/prefix?region=us-east-1&endpoint_override=127.0.0.1:9&" \
                         "scheme=http')"
    with pytest.raises(rc.CheckpointError) as err:  # port 9: connection refused at once
        bounded(tier.check_writable, timeout=120)
    assert "EXAMPLEKEY" not in str(err.value) and "s3://***@bucket/prefix" in str(err.value)
    for bad in (f"s3://AKIA:{SECRET}@/prefix", f"s3://bucket/prefix?secret_key={SECRET}&bogus_option=1",
                f"s3://bucket/prefix?session_token={SECRET}&region=us-east-1&scheme=gopher"):
        with pytest.raises(rc.InvalidArgumentError) as err:
            resolve_filesystem(bad)
        assert "EXAMPLEKEY" not in str(err.value) and "cannot open storage URI" in str(err.value), str(err.value)


@pytest.mark.parametrize("base,joined", [
    ("file:///abs/ckpt", "file:///abs/ckpt/run1"),
    ("file:///abs/ckpt/", "file:///abs/ckpt/run1"),
    ("/abs/ckpt", "/abs/ckpt/run1"),
    ("s3://bucket", "s3://bucket/run1"),
    ("s3://bucket/", "s3://bucket/run1"),
    ("s3://bucket/prefix?endpoint_override=localhost:9000&scheme=http",
     "s3://bucket/prefix/run1?endpoint_override=localhost:9000&scheme=http"),
    ("s3://bucket?region=us-east-1", "s3://bucket/run1?region=us-east-1"),
    ("gs://bucket/a/b/", "gs://bucket/a/b/run1"),
])
def test_join_uri_puts_the_run_before_the_query(base, joined):
    assert join_uri(base, "run1") == joined == layout.join_uri(base, "run1")


def test_join_uri_keeps_pyarrows_query_settings():
    fs, path = resolve_filesystem(join_uri("s3://bucket/prefix?endpoint_override=127.0.0.1:9&scheme=http&"
                                           "region=us-east-1", "run1"))
    assert path == "bucket/prefix/run1" and fs.region == "us-east-1"
    fs, path = resolve_filesystem(join_uri("file:///tmp/x", "run1"))
    assert path == "/tmp/x/run1"


# ------------------------------------------------------------------------- import direction
def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield ("." * node.level) + (node.module or "")


@pytest.mark.parametrize("package", ["formats", "storage"])
def test_imports_point_one_way_and_never_to_ray(package):
    for path in sorted((ROOT / "ray_ckpt" / package).glob("*.py")):
        for name in _imports(path):
            assert name != "ray" and not name.startswith("ray."), f"{path.name} imports {name}"
            if package == "formats":
                assert "storage" not in name, f"{path.name} imports {name}: formats/ must not import storage/"
