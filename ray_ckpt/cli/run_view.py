"""A run root on either tier as the commands see it: opened from a URI (with ``--endpoint-override``
for S3-compatible servers), its versions listed, its manifests read on demand, ``VERSION`` arguments
resolved (a number, a version directory name or ``latest``), and the version directories without
manifest classified. The filesystem, S3 settings and hints, listing and reads are the storage
layer's (``ray_ckpt.storage``); URIs are shown without credentials (``redact_uri``)."""
from __future__ import annotations

import argparse
import contextlib
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pyarrow.fs as pafs

from ..config import signing_key_from_env
from ..errors import CheckpointError, one_line
from ..storage.checkpoint_io import read_manifest
from ..formats.manifest import Manifest
from ..storage import layout
from ..storage.filesystems import redact_uri, s3_hint
from ..storage.lost import read_lost
from ..storage.confined import open_regular
from ..storage.tier import Tier
from .common import CliError, UsageError, plural, vlist

def parse_version(text: str) -> Optional[int]:
    """``latest`` / ``-1`` -> None; ``100`` or ``v000000000100`` -> 100."""
    t = text.strip()
    if t.lower() in ("latest", "-1"):
        return None
    m = re.fullmatch(r"v?(\d+)", t)
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid VERSION {text!r}: give a version number (e.g. 100), a version directory "
            f"(v000000000100) or 'latest'")
    return int(m.group(1))


def command_parser(sub: Any, common: argparse.ArgumentParser, name: str, summary: str, description: str,
                   func: Any) -> argparse.ArgumentParser:
    """The subcommand ``name`` of a run: its URI argument, the common options (``common``), ``func``."""
    s = sub.add_parser(name, parents=[common], help=summary, description=description)
    s.add_argument("uri", metavar="URI")
    s.set_defaults(func=func)
    return s


def add_version_argument(parser: Any, what: str) -> None:
    parser.add_argument("version", metavar="VERSION", type=parse_version, nargs="?", default=None,
                        help=f"the version to {what} (default: latest)")


def endpoint_options(endpoint: str) -> Dict[str, Any]:
    """``--endpoint-override`` as S3 filesystem options: HOST:PORT (plain http) or an http(s) URL.
    Credentials and region come from the AWS_* environment through the S3 client itself."""
    scheme = "http"
    if "://" in endpoint:
        scheme, endpoint = endpoint.split("://", 1)
        if scheme not in ("http", "https"):
            raise UsageError(f"--endpoint-override: scheme must be http or https, got {scheme!r}")
    endpoint = endpoint.rstrip("/")
    if not endpoint:
        raise UsageError("--endpoint-override must be HOST:PORT or a http(s):// URL")
    return {"endpoint_override": endpoint, "scheme": scheme}


def open_tier(args: argparse.Namespace) -> Tier:
    """The run root ``args.uri`` as a Tier, checked to exist and to be a directory."""
    uri = args.uri
    if not uri or not uri.strip():
        raise UsageError("URI must not be empty")
    shown = redact_uri(uri)
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    options: Optional[Dict[str, Any]] = None
    endpoint = getattr(args, "endpoint_override", None)
    if endpoint:
        if scheme != "s3":
            raise UsageError(f"--endpoint-override only applies to s3:// URIs, not {shown!r}")
        options = endpoint_options(endpoint)
    try:
        tier = Tier(uri, "local" if scheme in ("", "file") else "remote", options)
    except ValueError as exc:
        raise CliError(one_line(exc)) from None
    try:
        info = tier.fs.get_file_info(tier.root)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot open {shown}: {one_line(exc)}{s3_hint(exc) if scheme == 's3' else ''}") from None
    if info.type == pafs.FileType.NotFound:
        what = "no such directory" if tier.is_local else "no such bucket or prefix (nothing is stored there)"
        raise CliError(f"{shown}: {what}")
    if info.type != pafs.FileType.Directory:
        raise CliError(f"{shown} is a file; URI must be a run's root directory (the one holding v000000000100/ ...)")
    return tier


def dir_files(tier: Tier, rel: str) -> List[Tuple[str, int, Optional[float]]]:
    """(path relative to the run root, size, mtime) of every file below ``rel``: ``Tier.list_files``
    with sizes and times (locally from ``lstat``: links are entries, never followed)."""
    if tier.is_local:
        out = []
        for r in tier.list_files(rel):
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                st = os.lstat(tier.abspath(r))
                out.append((r, st.st_size, (st.st_mtime_ns + 500) // 1000 / 1e6))  # µs, as pyarrow
        return out
    try:
        infos = tier.fs.get_file_info(pafs.FileSelector(tier.abspath(rel), recursive=True, allow_not_found=True))
    except FileNotFoundError:
        return []
    base = tier.root.rstrip("/") + "/"
    return [(i.path[len(base):] if i.path.startswith(base) else i.path, i.size or 0,
             i.mtime.timestamp() if i.mtime is not None else None) for i in infos if i.type == pafs.FileType.File]


@contextlib.contextmanager
def open_input(tier: Tier, rel: str) -> Iterator[Any]:
    """A seekable binary file of ``rel`` (locally a regular file reached without following links,
    else NotOurs: never a FIFO that would hang, never a file outside the run root)."""
    if tier.is_local:
        with os.fdopen(open_regular(tier.root, rel), "rb") as f:
            yield f
    else:
        f = tier.fs.open_input_file(tier.abspath(rel))
        try:
            yield f
        finally:
            f.close()


def is_partial(m: Manifest) -> bool:
    return any(e.status in ("missing", "pending") for e in m.states.values())


class Run:
    """The versions under one run root, with manifests read on demand."""

    def __init__(self, tier: Tier):
        self.tier = tier
        self.uri = redact_uri(tier.uri)  # what is shown
        try:
            self.dirs: Dict[int, bool] = tier.version_dirs()  # version -> has manifest.json
        except OSError as exc:
            raise CliError(f"cannot list {self.uri}: {one_line(exc)}") from None
        self._manifests: Dict[int, Manifest] = {}
        self._errors: Dict[int, str] = {}
        self._uncommitted: Optional[Dict[int, Dict[str, Any]]] = None
        self.lost = read_lost(tier)  # versions lost with a node: their manifests are not restorable

    @classmethod
    def open(cls, args: argparse.Namespace) -> "Run":
        return cls(open_tier(args))

    @property
    def versions(self) -> List[int]:
        return sorted(self.dirs)

    @property
    def with_manifest(self) -> List[int]:
        return sorted(v for v, has in self.dirs.items() if has)

    @property
    def without_manifest(self) -> List[int]:
        return sorted(v for v, has in self.dirs.items() if not has)

    def load(self, v: int) -> Optional[Manifest]:
        """The manifest of ``v``, or None (and ``error(v)`` says why) when it is unreadable."""
        if v in self._manifests:
            return self._manifests[v]
        if v in self._errors:
            return None
        try:
            # a key ring in the environment: the run's manifests must verify under it (as the engine checks)
            m = read_manifest(self.tier, v, signing_key_from_env())
            if m.version != v:
                raise CheckpointError(f"{self.tier.describe(layout.manifest_path(v))}: manifest says version "
                                      f"{m.version}, but it lies in {layout.version_dir(v)}/")
            self._manifests[v] = m
            return m
        except FileNotFoundError:
            self._errors[v] = f"version {v}: manifest.json disappeared while reading (deleted concurrently?)"
        except (CheckpointError, OSError, ValueError) as exc:
            self._errors[v] = one_line(exc)
        return None

    def error(self, v: int) -> str:
        return self._errors.get(v, "")

    def committed(self) -> Dict[int, Manifest]:
        """Every readable manifest, less those of versions recorded lost with a node."""
        lost = self.lost_here()
        out = {}
        for v in self.with_manifest:
            m = self.load(v)
            if m is not None and v not in lost:
                out[v] = m
        return out

    def lost_here(self) -> Dict[int, str]:
        """version -> why, for the manifests on this tier whose versions were lost with a node
        (``storage/lost.py``): not restorable, whatever their manifest says."""
        out = {}
        for v, e in self.lost.items():
            m = self.load(v) if self.dirs.get(v) else None
            if m is not None and e.matches(m):
                out[v] = e.why
        return out

    def uncommitted(self) -> Dict[int, Dict[str, Any]]:
        """Version directories without manifest, each classified:

        retired    every file in it is referenced by a committed version (a RELOADABLE state stored
                   once, whose own version was deleted): part of the kept data, not a checkpoint
        in_flight  newer than the newest committed version: a save may still be writing it
        abandoned  older than the newest committed version and not (only) shared files: a save
                   that never committed, or files that deleted versions left behind
        """
        if self._uncommitted is None:
            committed = self.committed()
            referenced = {p for m in committed.values() for p in m.referenced_paths()}
            newest = max(committed) if committed else None
            self._uncommitted = {v: self._classify(v, committed, referenced, newest) for v in self.without_manifest}
        return self._uncommitted

    def _classify(self, v: int, committed: Dict[int, Manifest], referenced: set,
                  newest: Optional[int]) -> Dict[str, Any]:
        files = dir_files(self.tier, layout.version_dir(v))
        rels = [rel for rel, _size, _mtime in files]
        if rels and all(r in referenced for r in rels):
            kind = "retired"
            users = sorted(u for u, m in committed.items() if set(m.referenced_paths()) & set(rels))
            detail = (f"no manifest; holds {plural(len(rels), 'file')} still referenced by "
                      f"version{'s' if len(users) != 1 else ''} {vlist(users)}")
        elif newest is None or v > newest:
            kind = "in_flight"
            detail = (f"no manifest; {plural(len(rels), 'file')}; newer than the newest committed version: "
                      f"probably still being written")
        else:
            kind = "abandoned"
            detail = (f"no manifest; {plural(len(rels), 'file')}; older than the newest committed version: "
                      f"a save that never committed or leftovers (remove with 'gc --partial')")
        return {"kind": kind, "files": files, "rels": rels, "detail": detail}

    def no_versions_hint(self) -> str:
        """For a root without versions: its subdirectories that look like run roots, if any."""
        fs, root = self.tier.fs, self.tier.root.rstrip("/")
        try:
            subdirs = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
                             if i.type == pafs.FileType.Directory)[:50]
            runs = []
            for d in subdirs:
                children = fs.get_file_info(pafs.FileSelector(f"{root}/{d}", allow_not_found=True))
                if any(c.type == pafs.FileType.Directory and layout.parse_version_dir(c.base_name) is not None
                       for c in children):
                    runs.append(d)
        except (OSError, ValueError):
            return ""
        if not runs:
            return ""
        shown = ", ".join(runs[:5]) + (", ..." if len(runs) > 5 else "")
        return f" (URI must be a run's root; did you mean {self.uri.rstrip('/')}/{runs[0]}? runs here: {shown})"

    def require_versions(self) -> None:
        if not self.dirs:
            raise CliError(f"{self.uri} holds no checkpoint versions{self.no_versions_hint()}")

    def require_committed(self) -> None:
        self.require_versions()
        if not self.with_manifest:
            raise CliError(f"{self.uri} has no committed version (version directories without manifest: "
                           f"{vlist(self.without_manifest)})")

    def manifest(self, version: Optional[int]) -> Manifest:
        """The committed manifest of ``version`` (None: the newest version that has one) or a CliError."""
        if version is None:
            self.require_committed()
            version = self.with_manifest[-1]
        elif version not in self.dirs:
            have = vlist(self.with_manifest) if self.with_manifest else "none"
            raise CliError(f"version {version} not found in {self.uri} (committed versions: {have})")
        elif not self.dirs[version]:
            raise CliError(f"version {version} in {self.uri} has no manifest: it is still being written or was "
                           f"abandoned, so it is not a committed checkpoint")
        m = self.load(version)
        if m is None:
            raise CliError(self.error(version))
        return m
