"""``ReplicaStore``: the files of the newest versions, held in memory on one node for restores on
another (``create(..., peer_replicas=1)``). A plain object (no Ray), unit-tested without a cluster;
``replicas.ReplicaHolder`` is its Ray shell.

Why memory first: a node lost with its local disk takes the newest versions' files with it, and
with ``remote_every > 1`` those were never uploaded. A peer's memory serves them back at the speed
of the object transfer, and holding them costs no disk write on the training path.

Rules it keeps:

* every file is checked against its manifest size and checksum when it arrives: a replica is never
  a worse copy than the one it came from;
* a file is stored once, however many versions refer to it (a RELOADABLE state's file is named by
  the first version that wrote it), and goes when the last version holding it goes;
* at most ``keep`` versions are held (the newest by number); the bytes held in memory never exceed
  ``budget``: what does not fit is written to ``spill`` (the node's disk, atomically) and served
  from there.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ..errors import IntegrityError
from ..formats.checksum import digest
from ..formats.manifest import FileEntry
from ..storage.tier import Tier


@dataclass(frozen=True)
class HeldFile:
    entry: FileEntry  # as the manifest lists it (size, checksum, role)
    spilled: bool


@dataclass(frozen=True)
class StoreUsage:
    """What a holder holds: versions (newest last), bytes in memory, bytes spilled, its budget."""

    versions: Tuple[int, ...]
    memory_bytes: int
    spilled_bytes: int
    budget: int
    files: int


class ReplicaStore:
    def __init__(self, budget: int, keep: int, spill: Optional[Tier] = None):
        if budget < 0 or keep < 1:
            raise ValueError(f"a replica store needs budget >= 0 and keep >= 1, got {budget}, {keep}")
        self.budget, self.keep, self.spill = int(budget), int(keep), spill
        self._memory: Dict[str, Any] = {}  # path -> the bytes held in memory (any buffer)
        self._files: Dict[str, HeldFile] = {}
        self._versions: Dict[int, Set[str]] = {}  # version -> the paths it holds
        self._lock = threading.Lock()  # holders answer reads on several threads

    @property
    def memory_bytes(self) -> int:
        return sum(len(b) for b in self._memory.values())

    def put(self, version: int, files: Sequence[FileEntry], blobs: Sequence[Any]) -> int:
        """Hold ``files`` (their bytes in ``blobs``, in order) for ``version``. Each blob is checked
        against its entry first: IntegrityError naming the file, and nothing of the call is kept.
        Returns the bytes newly stored. Versions beyond the newest ``keep`` are dropped after."""
        if len(files) != len(blobs):
            raise ValueError(f"{len(files)} files but {len(blobs)} blobs")
        for f, b in zip(files, blobs):
            if len(b) != f.size or digest(b) != f.checksum:
                raise IntegrityError(f"replica of {f.path} (version {version}) does not match its manifest "
                                     f"({len(b)} bytes, {f.size} expected): refused")
        added = 0
        with self._lock:
            held = self._versions.setdefault(version, set())
            for f, b in zip(files, blobs):
                held.add(f.path)
                old = self._files.get(f.path)
                if old is not None and (old.entry.size, old.entry.checksum) == (f.size, f.checksum):
                    continue
                self._drop_file(f.path)
                added += self._store(f, b)
            for v in sorted(self._versions)[:-self.keep]:
                self._drop_version(v)
        return added

    def _store(self, f: FileEntry, blob: Any) -> int:
        if self.memory_bytes + f.size <= self.budget:
            self._memory[f.path] = blob  # kept as given: the caller hands over memory it owns
            self._files[f.path] = HeldFile(f, False)
        elif self.spill is not None:
            self.spill.put_bytes(f.path, bytes(blob))
            self._files[f.path] = HeldFile(f, True)
        else:
            raise IntegrityError(f"replica of {f.path}: {f.size} bytes do not fit the holder's memory budget "
                                 f"({self.budget - self.memory_bytes} of {self.budget} bytes free) and it has no "
                                 f"disk to spill to")
        return f.size

    def get(self, path: str) -> Optional[Any]:
        """The bytes held for ``path`` (memory or spill), None when not held. Not verified here: the
        reader checks them against the manifest it trusts (``capture.peer_reads``)."""
        with self._lock:
            held = self._files.get(path)
            if held is None:
                return None
            if not held.spilled:
                return self._memory[path]
        try:
            return self.spill.read_bytes(path)
        except FileNotFoundError:
            return None

    def get_range(self, path: str, begin: int, end: int) -> Optional[Any]:
        with self._lock:
            held = self._files.get(path)
            if held is None:
                return None
            if not held.spilled:
                return self._memory[path][begin:end]
        try:
            return self.spill.read_range(path, begin, end)
        except FileNotFoundError:
            return None

    def verify(self, path: str, checksum: str) -> Optional[str]:
        """Why the copy held of ``path`` is not a good copy of the file whose manifest names
        ``checksum`` (None: it is). Its bytes are hashed again: memory and spill files can be
        damaged after they arrived, and only a copy that verifies keeps a version listed."""
        with self._lock:
            held = self._files.get(path)
        if held is None:
            return "not held"
        data = self.get(path)
        if data is None:
            return "not held (its spill file is gone)"
        if held.entry.checksum != checksum:
            return "holds another version of the file (checksum differs from the manifest's)"
        if len(data) != held.entry.size or digest(data) != checksum:
            return "checksum mismatch (the copy is corrupt)"
        return None

    def in_memory(self, path: str) -> bool:
        return path in self._memory

    def entries(self, version: int) -> List[FileEntry]:
        """The files held for ``version`` (to copy them to another holder)."""
        with self._lock:
            return [self._files[p].entry for p in sorted(self._versions.get(version, ()))]

    def checksums(self) -> Dict[int, Dict[str, str]]:
        """version -> path -> checksum of every file held (a restarted coordinator adopts the
        copies whose checksums its manifests name)."""
        with self._lock:
            return {v: {p: self._files[p].entry.checksum for p in ps} for v, ps in self._versions.items()}

    def index(self) -> Dict[int, List[str]]:
        with self._lock:
            return {v: sorted(ps) for v, ps in self._versions.items()}

    def drop(self, versions: Sequence[int]) -> None:
        with self._lock:
            for v in versions:
                self._drop_version(v)

    def usage(self) -> StoreUsage:
        with self._lock:
            spilled = sum(h.entry.size for h in self._files.values() if h.spilled)
            return StoreUsage(tuple(sorted(self._versions)), self.memory_bytes, spilled, self.budget, len(self._files))

    def _drop_version(self, version: int) -> None:
        for path in self._versions.pop(version, set()):
            if not any(path in ps for ps in self._versions.values()):
                self._drop_file(path)

    def _drop_file(self, path: str) -> None:
        held = self._files.pop(path, None)
        self._memory.pop(path, None)
        if held is not None and held.spilled and self.spill is not None:
            self.spill.delete_file(path)
