"""Path layout of a run and validation of user-given names (no path traversal, ever). Every path
inside a run's root is built here; other modules name files only through these functions and
constants.

  <root>/<run>/owner.json                                the run's owner lease (storage/ownership.py)
               head.json                                 the newest committed step (storage/head.py)
               gc_notice.json                            versions ``ray-ckpt gc --force`` is deleting
               lost_versions.json                        versions lost with a node (storage/lost.py)
               v000000000100/<state>/rank0.safetensors   tensors and the nested structure
                             <state>/rank0.table0.arrow     Arrow tables inside such a state
                             <state>/rank0.arrow            a buffer (a dict of equally long arrays)
                             <state>/rank0.segment.arrow    an append-only buffer: the rows this version added
                             <state>/rank0.index.json       ... and what its rows are made of (formats.segments)
                             manifest.json            <- written last: the commit marker
"""
from __future__ import annotations

import re
from typing import Optional

from ..errors import InvalidArgumentError
from ..formats.manifest import is_valid_file_path  # the rule lives beside the manifest it checks

MANIFEST = "manifest.json"
OWNER_FILE = "owner.json"
HEAD_FILE = "head.json"
NOTICE_FILE = "gc_notice.json"
LOST_FILE = "lost_versions.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
_VERSION_DIR = re.compile(r"^v(\d{12})$")

__all__ = ["MANIFEST", "OWNER_FILE", "HEAD_FILE", "NOTICE_FILE", "LOST_FILE", "validate_name", "is_valid_file_path", "version_dir", "parse_version_dir", "manifest_path",
           "in_version", "tensors_file", "table_file", "buffer_file", "segment_file", "segment_index_file", "join_uri",
           "peer_spill_dir"]


def validate_name(name: object, what: str = "name") -> str:
    """A run or state name becomes a path component: allow letters, digits, '_', '-', '.' only.

    Raises :class:`~ray_ckpt.errors.InvalidArgumentError` (a ``ValueError``)."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise InvalidArgumentError(
            f"invalid {what} {name!r}: use 1-128 letters, digits, '_', '-' or '.', starting with a "
            f"letter or digit (no '/', '\\', '..' or spaces: it becomes a path component)"
        )
    if what == "state name" and name == MANIFEST:  # its directory would take the commit marker's path
        raise InvalidArgumentError(f"invalid {what} {name!r}: {MANIFEST} is the name of a version's manifest")
    return name


def version_dir(version: int) -> str:
    return f"v{version:012d}"


def parse_version_dir(name: str) -> Optional[int]:
    m = _VERSION_DIR.match(name)
    return int(m.group(1)) if m else None


def manifest_path(version: int) -> str:
    return f"{version_dir(version)}/{MANIFEST}"


def in_version(path: str, version: int) -> bool:
    """Whether ``path`` (relative to the run's root) lies in ``version``'s own directory."""
    return path.startswith(version_dir(version) + "/")


def tensors_file(version: int, state: str, rank: int) -> str:
    return f"{version_dir(version)}/{state}/rank{rank}.safetensors"


def table_file(version: int, state: str, rank: int, index: int) -> str:
    return f"{version_dir(version)}/{state}/rank{rank}.table{index}.arrow"


def buffer_file(version: int, state: str, rank: int) -> str:
    return f"{version_dir(version)}/{state}/rank{rank}.arrow"


def segment_file(version: int, state: str, rank: int) -> str:
    return f"{version_dir(version)}/{state}/rank{rank}.segment.arrow"


def segment_index_file(version: int, state: str, rank: int) -> str:
    return f"{version_dir(version)}/{state}/rank{rank}.index.json"


PEER_SPILL_DIR = ".ray_ckpt_peer"  # never a run's name: run names start with a letter or digit


def peer_spill_dir(run: str, key: str) -> str:
    """Where replica holder ``key`` of ``run`` spills what its memory budget does not hold,
    relative to the local tier's base directory (beside the runs, inside no run's root)."""
    return f"{PEER_SPILL_DIR}/{run}/{key}"


def join_uri(base: str, run: str) -> str:
    """A run's root under ``base`` (a path or a URI whose ``?query`` settings are kept): see
    :func:`.filesystems.join_uri`."""
    from .filesystems import join_uri as _join_uri

    return _join_uri(base, run)
