"""The manifest: the JSON commit marker of a version, written last.

It lists every file of every state with its size and checksum. A state entry may point at a file
of an older version (a RELOADABLE state whose content did not change): paths are relative to the
run root, not to the version directory.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from ..errors import IntegrityError
from ..storage.layout import is_valid_file_path
from .checksum import ALGORITHM

MANIFEST_FORMAT = "ray_ckpt.manifest/1"


@dataclass
class FileEntry:
    path: str  # relative to the run root, e.g. "v000000000100/policy/rank0.safetensors"
    size: int
    checksum: str
    role: str = "tensors"  # "tensors" | "table" | "buffer" (see formats.buffer_io)


@dataclass
class StateEntry:
    strategy: str
    status: str  # "stored" | "loader" (rebuilt by a loader, no bytes) | "pending" | "missing"
    files: Dict[str, List[FileEntry]] = field(default_factory=dict)  # rank (as str) -> files
    bytes: int = 0
    content_hash: Optional[str] = None  # RELOADABLE: digest of rank 0's files
    detail: str = ""
    replicated: bool = False

    def all_files(self) -> List[FileEntry]:
        return [f for fs in self.files.values() for f in fs]


@dataclass
class Manifest:
    run: str
    version: int
    step: int
    created_at: float
    states: Dict[str, StateEntry] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    checksum_algorithm: str = ALGORITHM
    format: str = MANIFEST_FORMAT

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.states.values())

    def referenced_paths(self) -> List[str]:
        return [f.path for s in self.states.values() for f in s.all_files()]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True, allow_nan=False).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, where: str = "manifest") -> "Manifest":
        try:
            d = json.loads(data)
            if d.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"unknown format {d.get('format')!r}")
            if d.get("checksum_algorithm", ALGORITHM) != ALGORITHM:
                raise ValueError(f"its checksums are {d['checksum_algorithm']!r}; this ray_ckpt verifies "
                                 f"{ALGORITHM!r} (written by an older ray_ckpt: re-save it with that one)")
            states = {}
            for name, s in d["states"].items():
                files = {r: [FileEntry(**f) for f in fs] for r, fs in s.pop("files").items()}
                for f in (f for fs in files.values() for f in fs):
                    if not is_valid_file_path(f.path):
                        raise ValueError(f"state {name!r} lists an invalid file path {f.path!r}")
                states[name] = StateEntry(files=files, **s)
            d["states"] = states
            return cls(**d)
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"{where}: unreadable manifest ({exc})") from None
