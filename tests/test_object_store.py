"""Mapping the object store ahead of snapshots (``prefault_object_store``): the mechanism on a
shared-memory mapping of our own, without Ray, and end to end in a small Ray instance of its own
(a separate process, so the session's object store is not committed to RAM by the test)."""
import json
import mmap
import os
import subprocess
import sys

import pytest

from ray_ckpt.capture.object_store import PrefaultStatus, populate, store_regions

HERE = os.path.dirname(os.path.abspath(__file__))
SHM = "/dev/shm"


def resident_bytes(lo: int, pid: str = "self") -> int:
    """Rss of the mapping that starts at ``lo`` in /proc/<pid>/smaps."""
    found = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                found = int(head.split("-")[0], 16) == lo
            elif found and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {lo:#x}")


def _shared_map(path: str, size: int, shared: bool = True) -> mmap.mmap:
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDWR)
    try:
        flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _address(m: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(m))


@pytest.fixture
def shm_dir(tmp_path):
    if not os.path.isdir(SHM):
        pytest.skip("no /dev/shm on this machine")
    d = os.path.join(SHM, f"ray_ckpt_test_{os.getpid()}_{tmp_path.name}")
    os.makedirs(d)
    yield d
    for name in os.listdir(d):
        os.remove(os.path.join(d, name))
    os.rmdir(d)


def test_store_regions_are_the_shared_writable_plasma_mappings(shm_dir):
    size = 4 << 20
    plasma = _shared_map(os.path.join(shm_dir, "plasmaTEST"), size)
    other = _shared_map(os.path.join(shm_dir, "notplasma"), size)
    private = _shared_map(os.path.join(shm_dir, "plasmaPRIVATE"), size, shared=False)
    try:
        starts = {lo: hi for lo, hi in store_regions()}
        assert starts.get(_address(plasma)) == _address(plasma) + size
        assert _address(other) not in starts  # not the object store's file
        assert _address(private) not in starts  # a private copy is not the shared store
    finally:
        for m in (plasma, other, private):
            m.close()


def test_populate_makes_the_whole_mapping_resident(shm_dir):
    size = 96 << 20  # more than one madvise step
    m = _shared_map(os.path.join(shm_dir, "plasmaTEST"), size)
    try:
        m[:5] = b"hello"  # existing bytes are not changed by mapping the pages
        lo = _address(m)
        assert resident_bytes(lo) < size // 8
        status = populate([(lo, lo + size)], PrefaultStatus())
        if status.error and "MADV_POPULATE_WRITE" in status.error:
            pytest.skip(status.error)
        assert status.done and status.error is None and status.bytes_done == size
        assert resident_bytes(lo) == size
        assert m[:5] == b"hello" and m[size - 1:] == b"\0"
    finally:
        m.close()


def test_populate_stops_with_a_reason_on_an_unmapped_range():
    status = populate([(4096, 4096 + (1 << 20))], PrefaultStatus())  # page 1: never mapped
    assert status.done and status.bytes_done == 0
    assert status.error and status.error.startswith("stopped after 0 MiB")


@pytest.mark.slow  # 20-35 s: starts a Ray of its own
@pytest.mark.timeout(240)
def test_engine_maps_the_object_store_into_provider_actors():
    out = subprocess.run([sys.executable, os.path.join(HERE, "prefault_scenario.py")], capture_output=True,
                         text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r["on"]["status"]["error"] and "MADV_POPULATE_WRITE" in r["on"]["status"]["error"]:
        pytest.skip(r["on"]["status"]["error"])
    store = r["store_bytes"]
    # with the option: the learner's view of the whole store is mapped, before its first save
    assert r["on"]["status"]["done"] and r["on"]["status"]["bytes_done"] == store
    assert r["on"]["resident_before_save"] == store
    # a learner that Ray restarted (a new process) maps it again when the restore reaches it
    restart = r["on"]["restart"]
    assert restart["new_process"] and restart["restored_equal"]
    assert restart["status"]["bytes_done"] == store and restart["resident"] == store
    # without it: only what the learner's saves touched
    assert r["off"]["off_status"]["bytes_done"] == 0 and not r["off"]["off_status"]["done"]
    assert r["off"]["resident_after_save"] < store
    # and saving and restoring are unchanged
    assert r["on"]["restored_equal"] and r["off"]["restored_equal"]
