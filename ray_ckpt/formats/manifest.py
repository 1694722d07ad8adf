"""The manifest: the JSON commit marker of a version, written last.

It lists every file of every state with its size and checksum. A state entry may point at a file
of an older version (a RELOADABLE state whose content did not change): paths are relative to the
run root, not to the version directory.

Two optional fields tie manifests to their run and to each other (both absent from the JSON when
unset, so such manifests are byte for byte what earlier ray_ckpt versions wrote and read):

* ``previous`` (with ``previous_version``): :func:`manifest_digest` of the manifest of the version
  committed before this one: a manifest copied in from elsewhere, or an older one put back in
  place of a newer one, breaks the chain (:func:`chain_problems`).
* ``signature``: HMAC-SHA256 of the canonical JSON of every other field under a key the run is
  configured with (:func:`sign_manifest`, :func:`verify_signature`); a reader given the key refuses
  unsigned and mis-signed manifests.

A file entry's optional ``node`` (absent when unset, likewise) is the Ray node whose local tier the
file was written on: a restarted coordinator learns from it which versions a node's loss costs.
The digests and the signature cover it like every other field.

This module knows nothing of storage: the path rule below is the layout's
(``storage.layout`` re-exports it).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Union

from ..errors import IntegrityError
from .checksum import ALGORITHM

MANIFEST_FORMAT = "ray_ckpt.manifest/1"
DIGEST_PREFIX = "sha256:"
_OPTIONAL = ("previous", "previous_version", "signature")  # left out of the JSON when None

_FILE_PATH = re.compile(r"^v\d{12}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def is_valid_file_path(rel: str) -> bool:
    """A manifest's file path: ``v<12 digits>/<state>/<file>``, nothing that could leave the run root."""
    return isinstance(rel, str) and bool(_FILE_PATH.match(rel)) and ".." not in rel


# a FileEntry's role, stored in the manifest: what its bytes are
ROLE_TENSORS = "tensors"  # a safetensors file (formats.safetensors_io)
ROLE_TABLE = "table"      # an Arrow table inside a state (formats.arrow_io)
ROLE_BUFFER = "buffer"    # a whole state as one Arrow file (formats.buffer_io)
ROLE_SEGMENT = "segment"  # an append-only buffer's rows added by one version (formats.segments)
ROLE_INDEX = "index"      # ... and what its rows are made of (formats.segments)


@dataclass
class FileEntry:
    path: str  # relative to the run root, e.g. "v000000000100/policy/rank0.safetensors"
    size: int
    checksum: str
    role: str = ROLE_TENSORS  # one of the ROLE_* above
    node: Optional[str] = None  # the Ray node whose local tier holds the file (None: not recorded)


@dataclass
class StateEntry:
    strategy: str
    status: str  # "stored" | "loader" (rebuilt by a loader, no bytes) | "pending" | "missing"
    files: Dict[str, List[FileEntry]] = field(default_factory=dict)  # rank (as str) -> files
    bytes: int = 0
    content_hash: Optional[str] = None  # RELOADABLE: digest of rank 0's files
    detail: str = ""
    replicated: bool = False
    # a sharded (DTensor) state: its shard index (``formats.shard_index.ShardIndex.to_json()``: every
    # tensor's global shape, dtype and stored chunks with per-piece digests) plus ``"heads"``, where
    # rank 0's file keeps its header and non-sharded leaves; None (absent from the JSON) otherwise
    shards: Optional[Dict[str, Any]] = None

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
    previous: Optional[str] = None  # manifest_digest() of the predecessor's manifest (see chain_problems)
    previous_version: Optional[int] = None  # the version that digest is of
    signature: Optional[str] = None  # hex HMAC-SHA256 (see sign_manifest)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.states.values())

    def referenced_paths(self) -> List[str]:
        return [f.path for s in self.states.values() for f in s.all_files()]

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        for k in _OPTIONAL:
            if d[k] is None:
                del d[k]
        for s in d["states"].values():
            if s.get("shards") is None:
                s.pop("shards", None)  # unsharded entries stay byte for byte what they were
            for fs in s["files"].values():
                for f in fs:
                    if f.get("node") is None:
                        f.pop("node", None)
        return d

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, allow_nan=False).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, where: str = "manifest", key: Optional[bytes] = None) -> "Manifest":
        """Parse and check a manifest. With ``key``, its signature must verify under that key.

        Raises IntegrityError naming ``where`` for anything that is not a well-formed manifest."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            if key is not None:
                _verify(d, key)
            if d.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"unknown format {d.get('format')!r}")
            if d.get("checksum_algorithm", ALGORITHM) != ALGORITHM:
                raise ValueError(f"its checksums are {d['checksum_algorithm']!r}; this ray_ckpt verifies "
                                 f"{ALGORITHM!r} (written by an older ray_ckpt: re-save it with that one)")
            if not isinstance(d.get("version"), int) or isinstance(d["version"], bool) or d["version"] < 0:
                raise ValueError(f"version {d.get('version')!r} is not a non-negative integer")
            if not isinstance(d.get("states"), dict):
                raise ValueError("'states' is not an object")
            states = {}
            for name, s in d["states"].items():
                if not isinstance(s, dict) or not isinstance(s.get("files"), dict):
                    raise ValueError(f"state {name!r} is not an object with 'files'")
                files = {}
                for r, fs in s.pop("files").items():
                    if not isinstance(fs, list):
                        raise ValueError(f"state {name!r} rank {r!r}: files is not a list")
                    files[r] = [FileEntry(**f) for f in fs]
                for f in (f for fs in files.values() for f in fs):
                    if not is_valid_file_path(f.path):
                        raise ValueError(f"state {name!r} lists an invalid file path {f.path!r}")
                    if not isinstance(f.size, int) or isinstance(f.size, bool) or f.size < 0:
                        raise ValueError(f"state {name!r} file {f.path!r}: size {f.size!r} is not a byte count")
                    if not isinstance(f.checksum, str):
                        raise ValueError(f"state {name!r} file {f.path!r}: checksum {f.checksum!r} is not a string")
                    if f.node is not None and (not isinstance(f.node, str) or not f.node):
                        raise ValueError(f"state {name!r} file {f.path!r}: node {f.node!r} is not a node id")
                if s.get("shards") is not None and not isinstance(s["shards"], dict):
                    raise ValueError(f"state {name!r}: 'shards' is not an object")
                states[name] = StateEntry(files=files, **s)
            d["states"] = states
            return cls(**d)
        except IntegrityError as exc:
            raise IntegrityError(f"{where}: {exc}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise IntegrityError(f"{where}: unreadable manifest ({exc})") from None


# ------------------------------------------------------------------------- digests and signatures
def _canonical(d: Mapping[str, Any]) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode()


def _as_dict(manifest_or_bytes: Union[Manifest, bytes, bytearray, memoryview]) -> Dict[str, Any]:
    if isinstance(manifest_or_bytes, Manifest):
        return manifest_or_bytes.to_dict()
    try:
        d = json.loads(bytes(manifest_or_bytes))
    except ValueError as exc:
        raise IntegrityError(f"unreadable manifest ({exc})") from None
    if not isinstance(d, dict):
        raise IntegrityError("unreadable manifest (not a JSON object)")
    return d


def manifest_digest(manifest_or_bytes: Union[Manifest, bytes, bytearray, memoryview]) -> str:
    """``"sha256:<hex>"`` of a manifest's canonical JSON (sorted keys, no spaces; unset optional
    fields left out; the signature included). The same for a Manifest and for the bytes it was
    written as or read from, whitespace aside. Raises IntegrityError for bytes that are not JSON."""
    return DIGEST_PREFIX + hashlib.sha256(_canonical(_as_dict(manifest_or_bytes))).hexdigest()


def _signed_bytes(d: Mapping[str, Any]) -> bytes:
    return _canonical({k: v for k, v in d.items() if k != "signature"})


def signing_keys(key: Any) -> List[bytes]:
    """A signing key, or a key ring (a list or tuple: the first signs, every one verifies), as the
    list of its keys."""
    keys = list(key) if isinstance(key, (list, tuple)) else [key]
    if not keys or any(not isinstance(k, (bytes, bytearray)) or not k for k in keys):
        raise TypeError("a manifest signing key must be non-empty bytes (or a non-empty list of them)")
    return [bytes(k) for k in keys]


def sign_manifest(manifest: Manifest, key: Any) -> Manifest:
    """Set ``manifest.signature`` to the hex HMAC-SHA256, under ``key`` (a ring's first key), of the
    canonical JSON of all its other fields; returns the manifest. Sign last: any later change breaks it."""
    manifest.signature = None
    manifest.signature = hmac.new(signing_keys(key)[0], _signed_bytes(manifest.to_dict()),
                                  hashlib.sha256).hexdigest()
    return manifest


def sign_record(record: Mapping[str, Any], key: Any) -> Dict[str, Any]:
    """A small JSON record (e.g. the run's head record) with its ``signature`` under ``key`` (a
    ring's first key), made as a manifest's; :func:`verify_signature` checks it."""
    out = {k: v for k, v in record.items() if k != "signature"}
    out["signature"] = hmac.new(signing_keys(key)[0], _signed_bytes(out), hashlib.sha256).hexdigest()
    return out


def _verify(d: Mapping[str, Any], key: Any) -> None:
    keys = signing_keys(key)
    sig = d.get("signature")
    if sig is None:
        raise IntegrityError("manifest is not signed, and this run requires signed manifests")
    signed = _signed_bytes(d)
    if not isinstance(sig, str) or not any(
            hmac.compare_digest(sig, hmac.new(k, signed, hashlib.sha256).hexdigest()) for k in keys):
        raise IntegrityError("manifest signature does not verify (edited, or signed with another key"
                             + (f" than the {len(keys)} of the key ring" if len(keys) > 1 else "") + ")")


def verify_signature(manifest_bytes: Union[bytes, bytearray, memoryview], key: bytes, *,
                     where: str = "manifest") -> None:
    """Check a stored manifest's signature under ``key``: IntegrityError naming ``where`` when it is
    unsigned, mis-signed or not a JSON object (``Manifest.from_json(..., key=key)`` does this too)."""
    try:
        _verify(_as_dict(manifest_bytes), key)
    except IntegrityError as exc:
        raise IntegrityError(f"{where}: {exc}") from None


def chain_digest(manifest: Manifest) -> str:
    """The digest a successor records as ``previous``: :func:`manifest_digest` of the manifest
    without its signature and without its best-effort states — the parts of a committed manifest
    that never change (a best-effort part landing late rewrites its entry, legitimately, possibly
    after a newer version recorded this one)."""
    d = manifest.to_dict()
    d.pop("signature", None)
    d["states"] = {n: e for n, e in d["states"].items() if e.get("strategy") != "best_effort"}
    return DIGEST_PREFIX + hashlib.sha256(_canonical(d)).hexdigest()


def chain_problems(manifests: Mapping[int, Manifest]) -> List[str]:
    """Breaks in the ``previous`` chain among committed ``manifests`` (by version): a manifest whose
    ``previous_version`` is present but whose digest is not ``previous``, or that names itself or a
    newer version. Manifests without ``previous`` and predecessors deleted by retention are fine."""
    problems = []
    for v in sorted(manifests):
        m = manifests[v]
        if m.previous is None:
            continue
        pv = m.previous_version
        if pv is None or not isinstance(pv, int) or pv >= v:
            problems.append(f"version {v}: its previous version {pv!r} is not an older version")
        elif pv in manifests and chain_digest(manifests[pv]) != m.previous:
            problems.append(f"version {v}: the manifest of version {pv} is not the one it was committed after "
                            f"(digest {chain_digest(manifests[pv])}, recorded {m.previous})")
    return problems


def chain_suspects(manifests: Mapping[int, Manifest]) -> Dict[int, str]:
    """Versions not to trust, by the ``previous`` chain: a predecessor whose manifest is not the
    one its successor was committed after (replaced, e.g. an older copy put back), and a manifest
    that names itself or a newer version as its predecessor. Version -> why."""
    out: Dict[int, str] = {}
    for v in sorted(manifests):
        m = manifests[v]
        if m.previous is None:
            continue
        pv = m.previous_version
        if not isinstance(pv, int) or pv >= v:
            out[v] = f"its manifest names version {pv!r} as its predecessor, not an older version"
        elif pv in manifests and chain_digest(manifests[pv]) != m.previous:
            out[pv] = (f"its manifest is not the one version {v} was committed after (replaced or rolled back "
                       f"since: digest {chain_digest(manifests[pv])}, recorded {m.previous})")
    return out
