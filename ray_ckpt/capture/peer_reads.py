"""Reading from peer replicas: the tier between a node's own disk and the remote one.

With ``create(..., peer_replicas=N)`` each committed version's critical files are also held in the
memory of ``ReplicaHolder`` actors (``writers/replicas.py``) on other nodes. A restore on a node
whose local tier lacks a file (a new node after a preemption) asks those holders before the remote
tier. :class:`PeerCopies` has the reading side of a tier (``read_verified``, ``read_range``), so the
readers that walk tiers in order (``checkpoint_io.read_files``, ``range_reader.RangeReader``) use it
unchanged; every byte it returns is checked by them against the manifest (``read_verified`` here
checks size and checksum itself, as the disk tiers do), so a corrupt replica is passed over like a
corrupt file and the next copy is read.

Holders are found by name (``holder_name``), so a process that reads needs no handle from the
coordinator: a provider actor restarted on a new node finds them the same way. Its ``name`` is
``peer:<node>`` of the holder the last good read came from: what a ``RestoreReport`` shows.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import ray

from ..errors import IntegrityError, one_line
from ..formats.checksum import digest
from ..storage.local_files import host_buffer
from ..storage.tier import VERIFY_THREADS

log = logging.getLogger("ray_ckpt")

NAMESPACE = "ray_ckpt"
PREFIX = "ray_ckpt.replica."
INDEX_TIMEOUT_S = 10.0  # a holder that does not answer within this (its node going) is passed over
READ_TIMEOUT_S = 300.0


def holder_name(run: str, key: str) -> str:
    """The Ray actor name of ``run``'s replica holder ``key`` (a node id's first 12 characters)."""
    return f"{PREFIX}{run}.{key}"


def holder_handles(run: str) -> Dict[str, Any]:
    """key -> handle of every replica holder of ``run`` that Ray lists by name."""
    prefix = holder_name(run, "")
    out: Dict[str, Any] = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a.get("name", "") if isinstance(a, dict) else str(a)
        if a.get("namespace") == NAMESPACE and name.startswith(prefix):
            try:
                out[name[len(prefix):]] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # gone between the listing and the lookup
                continue
    return out


def _writable(data: Any) -> Any:
    """The bytes in fresh writable memory, as the disk tiers return them: what Ray hands over lies
    in its object store, read-only, and the decoded tensors become the provider's live state."""
    buf = host_buffer(len(data))
    memoryview(buf)[:] = memoryview(data).cast("B")
    return buf


class PeerCopies:
    """The replica holders of one run, read like a tier (see the module docstring)."""

    def __init__(self, run: str):
        self.run = run
        self.name = "peer"
        self._where: Optional[Dict[str, List[Tuple[str, Any]]]] = None  # path -> [(key, holder)]

    def __repr__(self) -> str:
        return f"PeerCopies({self.run!r})"

    def describe(self, rel: str) -> str:
        return f"peer replicas of {rel}"

    def scrub(self, text: str) -> str:
        return text

    def _holders_of(self, rel: str) -> List[Tuple[str, Any]]:
        if self._where is None:
            self._where = {}
            try:
                holders = holder_handles(self.run)
            except Exception as exc:  # not connected to Ray, or the GCS is busy: no peers to read
                log.info("no peer replicas listed for run %r: %s", self.run, one_line(exc))
                holders = {}
            calls = {key: h.index.remote() for key, h in holders.items()}
            ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=INDEX_TIMEOUT_S) \
                if calls else ([], [])
            for key, ref in calls.items():
                if ref not in ready:
                    continue
                try:
                    index = ray.get(ref)
                except ray.exceptions.RayError:  # a holder whose node is gone
                    continue
                for paths in index.values():
                    for p in paths:
                        self._where.setdefault(p, []).append((key, holders[key]))
        return self._where.get(rel, [])

    def _read(self, rel: str, call: str, *args: Any) -> Iterator[Tuple[str, Any]]:
        """(holder, its bytes of ``rel``) for each holder that has it, nearest call first; raises
        FileNotFoundError when none has it, IntegrityError naming every failure after the last."""
        holders = self._holders_of(rel)
        if not holders:
            raise FileNotFoundError(rel)
        errors = []
        for key, h in holders:
            try:
                refs = ray.get(h.ref_of.remote(rel), timeout=READ_TIMEOUT_S) if call == "get" else None
                data = ray.get(refs[0] if refs else getattr(h, call).remote(rel, *args), timeout=READ_TIMEOUT_S)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
                errors.append(f"peer:{key}: {one_line(exc)[:200]}")
                continue
            if data is None:
                errors.append(f"peer:{key}: no longer held")
                continue
            yield key, data
        raise _NoneLeft(errors)

    def read_verified(self, rel: str, size: int, checksum: str) -> Any:
        errors = []
        try:
            for key, data in self._read(rel, "get"):
                if len(data) == size and digest(data, VERIFY_THREADS) == checksum:
                    self.name = f"peer:{key}"
                    return _writable(data)
                errors.append(f"peer:{key}: checksum mismatch (replica is corrupt)")
                log.warning("peer replica of %s on %s does not match its manifest: passed over", rel, key)
        except _NoneLeft as exc:
            errors += exc.errors
        raise IntegrityError(f"no peer replica of {rel} verified ({'; '.join(errors)})")

    def read_range(self, rel: str, begin: int, end: int) -> Any:
        """Bytes ``[begin, end)`` of the first holder that has ``rel``; checked by the caller against
        per-piece digests (a bad range there makes it try the next tier)."""
        errors = []
        try:
            for key, data in self._read(rel, "get_range", begin, end):
                if len(data) == end - begin:
                    self.name = f"peer:{key}"
                    return _writable(data)
                errors.append(f"peer:{key}: holds {len(data)} of the range's {end - begin} bytes")
        except _NoneLeft as exc:
            errors += exc.errors
        raise IntegrityError(f"no peer replica of {rel} holds bytes {begin}..{end} ({'; '.join(errors)})")


class _NoneLeft(IntegrityError):
    """Every holder of a file was tried (``errors``: why each that returned nothing failed); the
    caller names these with what it refused itself, so no message ends in an empty list."""

    def __init__(self, errors: List[str]):
        super().__init__("; ".join(errors))
        self.errors = list(errors)
