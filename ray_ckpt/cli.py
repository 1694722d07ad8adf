"""``ray-ckpt``: inspect, verify, prune and export the checkpoints of a run, without a Ray cluster.

    ray-ckpt ls      URI [--json]
    ray-ckpt show    URI VERSION [--json] [--max-leaves N]
    ray-ckpt verify  URI [VERSION | --all] [--progress | --no-progress]
    ray-ckpt gc      URI --keep-last N [--keep-every K] [--keep-best METRIC:max|min:N] [--partial] [--dry-run]
    ray-ckpt export  URI VERSION --state NAME --to DIR [--rank R] [--force]
    ray-ckpt demo    [ARGS...]

URI is a run's root on either tier: the directory or prefix that directly holds the version
directories (``v000000000100/``): a path, a ``file://`` URI or an ``s3://bucket/prefix`` URI (any
``pyarrow.fs`` URI). S3 credentials come from the usual ``AWS_*`` environment variables;
``--endpoint-override HOST:PORT`` (or a ``http(s)://`` URL) points at an S3-compatible server.
VERSION is a version number (``100``), a version directory name (``v000000000100``) or ``latest``.

Every error is one line on stderr starting with ``ray-ckpt: error:``; the exit status is 2 for
usage errors and 1 for failures (including a failed verification).

This module uses only the Ray-free layers (``checkpoint_io``, ``storage``, ``formats``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import pyarrow.fs as pafs

from .checkpoint_io import decode_files, delete_version, rank_files, read_files, read_manifest
from .errors import CheckpointError, one_line
from .formats.checksum import ALGORITHM, CHUNK, new_hasher
from .formats.manifest import FileEntry, Manifest, StateEntry
from .storage import layout
from .storage.retention import RetentionPolicy, VersionInfo, plan_deletions
from .storage.local_files import hash_file as hash_local_file
from .storage.tier import TMP_MARK, VERIFY_THREADS, Tier

PROG = "ray-ckpt"
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
PROGRESS_AUTO_BYTES = 256 << 20  # verify shows progress by itself from this many bytes on
MAX_HEADER = 100 << 20  # safetensors' own limit on a header's size
MAX_ERROR_CHARS = 600


class CliError(Exception):
    """A failure reported as one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAIL):
        super().__init__(message)
        self.code = code


class UsageError(CliError):
    def __init__(self, message: str):
        super().__init__(message, EXIT_USAGE)


# ============================================================================ small helpers
def human(n: Optional[int]) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        x /= 1024.0
        if x < 1024 or unit == "PiB":
            return f"{x:.1f} {unit}"
    return f"{n} B"  # pragma: no cover


def iso_time(ts: Optional[float]) -> str:
    if ts is None:
        return "-"
    try:
        return _dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return "-"


def table(rows: List[List[str]], header: List[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = []
    for r in [header] + rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def _vdir(v: int) -> str:
    return layout.version_dir(v)


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


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def _keep_best(text: str) -> Tuple[str, str, int]:
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0] or parts[1] not in ("max", "min") or not parts[2].isdigit() \
            or int(parts[2]) < 1:
        raise argparse.ArgumentTypeError(f"expected METRIC:max|min:N (e.g. reward:max:2), got {text!r}")
    return parts[0], parts[1], int(parts[2])


# ============================================================================ opening a run
def open_tier(args: argparse.Namespace) -> Tier:
    """The run root ``args.uri`` as a Tier, checked to exist and to be a directory."""
    uri = args.uri
    if not uri or not uri.strip():
        raise UsageError("URI must not be empty")
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    remote = scheme not in ("", "file")
    options: Optional[Dict[str, Any]] = None
    endpoint = getattr(args, "endpoint_override", None)
    if endpoint:
        if scheme != "s3":
            raise UsageError(f"--endpoint-override only applies to s3:// URIs, not {uri!r}")
        options = _s3_options(endpoint)
    try:
        tier = Tier(uri, "remote" if remote else "local", options)
    except ValueError as exc:
        raise CliError(one_line(exc)) from None
    try:
        info = tier.fs.get_file_info(tier.root)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot open {uri}: {one_line(exc)}{_s3_hint(exc) if scheme == 's3' else ''}") from None
    if info.type == pafs.FileType.NotFound:
        what = "no such directory" if tier.is_local else "no such bucket or prefix (nothing is stored there)"
        raise CliError(f"{uri}: {what}")
    if info.type != pafs.FileType.Directory:
        raise CliError(f"{uri} is a file; URI must be a run's root directory (the one holding v000000000100/ ...)")
    return tier


def _s3_options(endpoint: str) -> Dict[str, Any]:
    scheme = "http"
    if "://" in endpoint:
        scheme, endpoint = endpoint.split("://", 1)
        if scheme not in ("http", "https"):
            raise UsageError(f"--endpoint-override: scheme must be http or https, got {scheme!r}")
    endpoint = endpoint.rstrip("/")
    if not endpoint:
        raise UsageError("--endpoint-override must be HOST:PORT or a http(s):// URL")
    opts: Dict[str, Any] = {"endpoint_override": endpoint, "scheme": scheme}
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        opts["access_key"], opts["secret_key"] = key, secret
        if os.environ.get("AWS_SESSION_TOKEN"):
            opts["session_token"] = os.environ["AWS_SESSION_TOKEN"]
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        opts["region"] = region
    return opts


def _s3_hint(exc: BaseException) -> str:
    text = str(exc)
    if any(k in text for k in ("ACCESS_DENIED", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                               "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH")):
        return " (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
    if any(k in text for k in ("NETWORK_CONNECTION", "Could not connect", "curlCode: 7", "curlCode: 28")):
        return " (the S3 endpoint cannot be reached: check --endpoint-override or AWS_ENDPOINT_URL)"
    return ""


def _list_dir_files(tier: Tier, rel: str) -> List[pafs.FileInfo]:
    try:
        infos = tier.fs.get_file_info(pafs.FileSelector(tier.abspath(rel), recursive=True, allow_not_found=True))
    except FileNotFoundError:
        return []
    return [i for i in infos if i.type == pafs.FileType.File]


def _rel(tier: Tier, path: str) -> str:
    base = tier.root.rstrip("/") + "/"
    return path[len(base):] if path.startswith(base) else path


class Run:
    """The versions under one run root, with manifests read on demand."""

    def __init__(self, tier: Tier):
        self.tier = tier
        try:
            self.dirs: Dict[int, bool] = tier.version_dirs()  # version -> has manifest.json
        except OSError as exc:
            raise CliError(f"cannot list {tier.uri}: {one_line(exc)}") from None
        self._manifests: Dict[int, Manifest] = {}
        self._errors: Dict[int, str] = {}
        self._uncommitted: Optional[Dict[int, Dict[str, Any]]] = None

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
            m = read_manifest(self.tier, v)
            if m.version != v:
                raise CheckpointError(f"{self.tier.describe(layout.manifest_path(v))}: manifest says version "
                                      f"{m.version}, but it lies in {_vdir(v)}/")
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
        """Every readable manifest."""
        out = {}
        for v in self.with_manifest:
            m = self.load(v)
            if m is not None:
                out[v] = m
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
            out: Dict[int, Dict[str, Any]] = {}
            for v in self.without_manifest:
                infos = _list_dir_files(self.tier, _vdir(v))
                rels = [_rel(self.tier, i.path) for i in infos]
                if rels and all(r in referenced for r in rels):
                    kind = "retired"
                    users = sorted(u for u, m in committed.items() if set(m.referenced_paths()) & set(rels))
                    detail = (f"no manifest; holds {_n(len(rels), 'file')} still referenced by "
                              f"version{'s' if len(users) != 1 else ''} {_vlist(users)}")
                elif newest is None or v > newest:
                    kind = "in_flight"
                    detail = (f"no manifest; {_n(len(rels), 'file')}; newer than the newest committed version: "
                              f"probably still being written")
                else:
                    kind = "abandoned"
                    detail = (f"no manifest; {_n(len(rels), 'file')}; older than the newest committed version: "
                              f"a save that never committed or leftovers (remove with 'gc --partial')")
                out[v] = {"kind": kind, "infos": infos, "rels": rels, "detail": detail}
            self._uncommitted = out
        return self._uncommitted

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
        return f" (URI must be a run's root; did you mean {self.tier.uri.rstrip('/')}/{runs[0]}? runs here: {shown})"

    def manifest(self, version: Optional[int]) -> Manifest:
        """The committed manifest of ``version`` (None: the newest version that has one) or a CliError."""
        uri = self.tier.uri
        if version is None:
            if not self.with_manifest:
                if not self.dirs:
                    raise CliError(f"{uri} holds no checkpoint versions{self.no_versions_hint()}")
                raise CliError(f"{uri} has no committed version (version directories without manifest: "
                               f"{_vlist(self.without_manifest)})")
            version = self.with_manifest[-1]
        elif version not in self.dirs:
            have = _vlist(self.with_manifest) if self.with_manifest else "none"
            raise CliError(f"version {version} not found in {uri} (committed versions: {have})")
        elif not self.dirs[version]:
            raise CliError(f"version {version} in {uri} has no manifest: it is still being written or was "
                           f"abandoned, so it is not a committed checkpoint")
        m = self.load(version)
        if m is None:
            raise CliError(self.error(version))
        return m


def _vlist(vs: Sequence[int], limit: int = 12) -> str:
    vs = list(vs)
    if len(vs) > limit:
        return ", ".join(map(str, vs[: limit // 2])) + ", ..., " + ", ".join(map(str, vs[-limit // 2:]))
    return ", ".join(map(str, vs))


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _is_partial(m: Manifest) -> bool:
    return any(e.status in ("missing", "pending") for e in m.states.values())


# ============================================================================ ls
def cmd_ls(args: argparse.Namespace) -> int:
    run = Run(open_tier(args))
    if not run.dirs:
        hint = run.no_versions_hint()
        if hint:  # a directory of runs, not a run: almost certainly the wrong URI
            raise CliError(f"{run.tier.uri} holds no checkpoint versions{hint}")
    uncommitted = run.uncommitted()
    rows: List[Dict[str, Any]] = []
    for v in run.versions:
        row: Dict[str, Any] = {"version": v, "dir": _vdir(v)}
        if run.dirs[v]:
            m = run.load(v)
            if m is None:
                row.update(step=None, created_at=None, bytes=None, states={}, committed=False,
                           status="unreadable", detail=run.error(v))
            else:
                row.update(step=m.step, created_at=m.created_at, bytes=m.bytes,
                           states={n: e.status for n, e in sorted(m.states.items())}, committed=True,
                           status="partial" if _is_partial(m) else "complete", metrics=dict(m.metrics),
                           detail="; ".join(f"{n}: {e.status}{' - ' + e.detail if e.detail else ''}"
                                            for n, e in sorted(m.states.items())
                                            if e.status in ("missing", "pending")))
        else:
            u = uncommitted[v]
            mtimes = [i.mtime.timestamp() for i in u["infos"] if i.mtime is not None]
            row.update(step=None, created_at=max(mtimes) if mtimes else None,
                       bytes=sum(i.size or 0 for i in u["infos"]), states={}, committed=False,
                       status="retired" if u["kind"] == "retired" else "partial", kind=u["kind"],
                       detail=u["detail"])
        row["created"] = iso_time(row["created_at"])
        rows.append(row)
    if args.json:
        print(json.dumps({"uri": run.tier.uri, "versions": rows}, indent=1, sort_keys=True))
        return EXIT_OK
    if not rows:
        print(f"no checkpoint versions in {run.tier.uri}{run.no_versions_hint()}")
        return EXIT_OK
    body = [[str(r["version"]), "-" if r["step"] is None else str(r["step"]), r["created"], human(r["bytes"]),
             ",".join(n if s in ("stored", "loader") else f"{n}({s})" for n, s in r["states"].items()) or "-",
             r["status"]] for r in rows]
    print(table(body, ["VERSION", "STEP", "CREATED", "SIZE", "STATES", "STATUS"]))
    notes = [f"  {r['dir']}: {r['detail']}" for r in rows if r["status"] != "complete" and r.get("detail")]
    if notes:
        print("notes:")
        print("\n".join(notes))
    return EXIT_OK


# ============================================================================ show
def read_safetensors_header(tier: Tier, rel: str) -> Dict[str, Any]:
    """The JSON header of a safetensors file: its first 8 bytes and the header, nothing more."""
    f = tier.fs.open_input_file(tier.abspath(rel))
    try:
        size = f.size()
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"file too short ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER):
            raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
        return json.loads(f.read(n))
    finally:
        f.close()


def _leaf_kinds(structure: Any) -> Tuple[Dict[int, Tuple[str, str]], int]:
    """leaf index -> (kind, logical dtype) from a ray_ckpt structure; and the number of other leaves."""
    kinds: Dict[int, Tuple[str, str]] = {}
    other = 0
    stack = [structure]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            other += 1
            continue
        if "d" in node:
            stack.extend(v for _k, v in node["d"])
        elif "l" in node or "u" in node:
            stack.extend(node.get("l", node.get("u")))
        elif "T" in node:
            kinds[node["T"]] = ("tensor", str(node.get("dt")))
        elif "N" in node:
            try:
                import numpy as np

                dt = np.dtype(node.get("dt")).name
            except TypeError:
                dt = str(node.get("dt"))
            kinds[node["N"]] = ("numpy", dt)
        elif "P" in node:
            kinds[node["P"]] = ("pickle", "pickled object")
        elif "A" in node:
            pass  # a table: its own file
        else:
            other += 1
    return kinds, other


_ST_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
             "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
             "C64": "complex64"}


def tensor_summary(header: Dict[str, Any]) -> Dict[str, Any]:
    """Leaves of a ray_ckpt safetensors header: name, dtype, shape, bytes, kind (in leaf order)."""
    meta = header.get("__metadata__") or {}
    try:
        names = json.loads(meta["ray_ckpt.leaves"])
    except (KeyError, ValueError, TypeError):
        names = [k for k in header if k != "__metadata__"]
    try:
        kinds, other = _leaf_kinds(json.loads(meta["ray_ckpt.structure"]))
    except (KeyError, ValueError, TypeError):
        kinds, other = {}, None
    leaves = []
    for i, name in enumerate(names):
        h = header.get(name) or {}
        off = h.get("data_offsets") or [0, 0]
        kind, logical = kinds.get(i, ("tensor", _ST_NAMES.get(h.get("dtype"), str(h.get("dtype")))))
        shape = h.get("shape")
        if kind == "pickle":
            shape = None
        leaves.append({"name": name, "dtype": logical, "stored_as": h.get("dtype"), "shape": shape,
                       "bytes": int(off[1]) - int(off[0]), "kind": kind})
    by_dtype: Dict[str, int] = {}
    for leaf in leaves:
        by_dtype[leaf["dtype"]] = by_dtype.get(leaf["dtype"], 0) + 1
    return {"leaves": leaves, "dtypes": by_dtype, "other_leaves": other,
            "tensor_bytes": sum(leaf["bytes"] for leaf in leaves)}


def table_summary(tier: Tier, rel: str) -> Dict[str, Any]:
    import pyarrow as pa

    f = tier.fs.open_input_file(tier.abspath(rel))
    try:
        reader = pa.ipc.open_file(f)  # reads the footer (schema, batch index) only
        schema = reader.schema
        return {"columns": [{"name": fld.name, "type": str(fld.type)} for fld in schema],
                "record_batches": reader.num_record_batches}
    finally:
        f.close()


def _file_details(tier: Tier, f: FileEntry) -> Dict[str, Any]:
    d: Dict[str, Any] = {"path": f.path, "bytes": f.size, "checksum": f.checksum, "role": f.role}
    try:
        if f.role == "tensors":
            d["tensors"] = tensor_summary(read_safetensors_header(tier, f.path))
        elif f.role in ("table", "buffer"):
            d["table"] = table_summary(tier, f.path)
    except FileNotFoundError:
        d["problem"] = "file is missing"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        d["problem"] = f"cannot read its header: {one_line(exc)}"
    return d


def cmd_show(args: argparse.Namespace) -> int:
    run = Run(open_tier(args))
    m = run.manifest(args.version)
    states = {}
    for name in sorted(m.states):
        e = m.states[name]
        ranks = {}
        for rank in sorted(e.files, key=lambda r: int(r) if str(r).isdigit() else 0):
            ranks[rank] = [_file_details(run.tier, f) for f in e.files[rank]]
        states[name] = {"strategy": e.strategy, "status": e.status, "bytes": e.bytes, "detail": e.detail,
                        "content_hash": e.content_hash, "replicated": e.replicated, "ranks": ranks}
    doc = {"uri": run.tier.uri, "run": m.run, "version": m.version, "step": m.step, "created_at": m.created_at,
           "created": iso_time(m.created_at), "bytes": m.bytes, "metrics": dict(m.metrics),
           "checksum_algorithm": m.checksum_algorithm, "status": "partial" if _is_partial(m) else "complete",
           "states": states}
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
        return EXIT_OK
    own = layout.version_dir(m.version) + "/"
    print(f"run {m.run!r}  version {m.version} ({_vdir(m.version)})  step {m.step}  created {doc['created']}  "
          f"size {human(m.bytes)}  {doc['status']}")
    if m.metrics:
        print("metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(m.metrics.items())))
    limit = args.max_leaves
    for name, s in states.items():
        extra = []
        if s["replicated"]:
            extra.append("replicated")
        if s["content_hash"]:
            extra.append(f"content {s['content_hash'][:16]}")
        print(f"\nstate {name}  strategy={s['strategy']}  status={s['status']}  {human(s['bytes'])}"
              + (f"  ({', '.join(extra)})" if extra else ""))
        if s["detail"]:
            print(f"  detail: {s['detail']}")
        for rank, files in s["ranks"].items():
            print(f"  rank {rank}:")
            for d in files:
                shared = "" if d["path"].startswith(own) else \
                    f"  [shared: stored once, in {d['path'].split('/', 1)[0]}]"
                size = human(d["bytes"]) + (f" ({d['bytes']} B)" if d["bytes"] >= 1024 else "")
                print(f"    {d['path']}  {size}  {m.checksum_algorithm}:"
                      f"{d['checksum']}  {d['role']}{shared}")
                if "problem" in d:
                    print(f"      ! {d['problem']}")
                if "tensors" in d:
                    t = d["tensors"]
                    counts = ", ".join(f"{dt} x{n}" for dt, n in sorted(t["dtypes"].items()))
                    other = ("" if t["other_leaves"] is None else
                             f"; {t['other_leaves']} other leaf" if t["other_leaves"] == 1 else
                             f"; {t['other_leaves']} other leaves")
                    print(f"      {_n(len(t['leaves']), 'tensor')}, {human(t['tensor_bytes'])}"
                          + (f" ({counts})" if counts else "") + other)
                    leaves = t["leaves"] if limit == 0 else t["leaves"][:limit]
                    if leaves:
                        w = max(len(leaf["name"]) for leaf in leaves)
                        for leaf in leaves:
                            shape = "-" if leaf["shape"] is None else "[" + ", ".join(map(str, leaf["shape"])) + "]"
                            kind = "" if leaf["kind"] == "tensor" else f"  ({leaf['kind']})"
                            print(f"        {leaf['name'].ljust(w)}  {leaf['dtype']:<9} {shape:<16} "
                                  f"{human(leaf['bytes'])}{kind}")
                    if len(leaves) < len(t["leaves"]):
                        print(f"        ... {len(t['leaves']) - len(leaves)} more (--max-leaves 0 shows all)")
                if "table" in d:
                    cols = d["table"]["columns"]
                    shown = ", ".join(f"{c['name']}: {c['type']}" for c in cols[:8])
                    shown += ", ..." if len(cols) > 8 else ""
                    print(f"      arrow table: {len(cols)} columns, {d['table']['record_batches']} record "
                          f"batch(es): {shown}")
    return EXIT_OK


# ============================================================================ verify
class Progress:
    """'verify: 1.2 GiB / 3.4 GiB (35%)' on stderr: rewritten in place on a terminal, one line per
    10% otherwise. Plain text, no dependency."""

    def __init__(self, total: int, enabled: bool, label: str = "verify"):
        self.total, self.enabled, self.label = total, enabled and total > 0, label
        self.done = 0
        self.tty = sys.stderr.isatty()
        self._last_t = 0.0
        self._last_decile = -1
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:  # called from the threads hashing a file's blocks
            self._add(n)

    def _add(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        pct = int(100 * self.done / self.total) if self.total else 100
        if self.tty:
            now = time.monotonic()
            if now - self._last_t >= 0.2 or self.done >= self.total:
                self._last_t = now
                sys.stderr.write(f"\r{self.label}: {human(self.done)} / {human(self.total)} ({pct}%)   ")
                sys.stderr.flush()
        elif pct // 10 > self._last_decile:
            self._last_decile = pct // 10
            sys.stderr.write(f"{self.label}: {human(self.done)} / {human(self.total)} ({pct}%)\n")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def hash_file(tier: Tier, rel: str, progress: Progress) -> Tuple[int, str]:
    """(size, digest) of ``rel``: a local file by blocks in parallel, a remote one streamed in CHUNK
    pieces."""
    path = tier.abspath(rel)
    if tier.is_local:  # checksum blocks read in parallel
        return hash_local_file(path, VERIFY_THREADS, progress.add)
    h = new_hasher()
    size = 0
    with tier.fs.open_input_stream(path) as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            h.update(chunk)
            size += len(chunk)
            progress.add(len(chunk))
    return size, h.hexdigest()


def check_file(tier: Tier, f: FileEntry, progress: Progress) -> Optional[Tuple[str, str]]:
    """None when ``f`` matches its manifest entry, else (KIND, what is wrong)."""
    try:
        info = tier.fs.get_file_info(tier.abspath(f.path))
        if info.type == pafs.FileType.NotFound:
            progress.add(f.size)
            return "MISSING", "the file does not exist"
        if info.type != pafs.FileType.File:
            progress.add(f.size)
            return "MISSING", "not a regular file"
        if info.size is not None and info.size != f.size:
            progress.add(f.size)
            return "SIZE", f"{info.size} bytes, the manifest says {f.size}"
        size, digest = hash_file(tier, f.path, progress)
    except FileNotFoundError:
        return "MISSING", "the file does not exist"
    except OSError as exc:
        return "UNREADABLE", one_line(exc)
    if size != f.size:
        return "SIZE", f"{size} bytes, the manifest says {f.size}"
    if digest != f.checksum:
        return "CORRUPT", f"{ALGORITHM} checksum mismatch (the bytes differ from what was written)"
    return None


def cmd_verify(args: argparse.Namespace) -> int:
    run = Run(open_tier(args))
    notes: List[str] = []
    if args.all:
        if not run.dirs:
            raise CliError(f"{run.tier.uri} holds no checkpoint versions{run.no_versions_hint()}")
        targets = run.with_manifest
        if not targets:
            raise CliError(f"{run.tier.uri} has no committed version (version directories without manifest: "
                           f"{_vlist(run.without_manifest)})")
        for v, u in run.uncommitted().items():
            if u["kind"] == "retired":
                notes.append(f"note: {_vdir(v)} has no manifest of its own; its files were verified as part "
                             f"of the versions that refer to them")
            else:
                why = "probably being written" if u["kind"] == "in_flight" else "a save that never committed"
                notes.append(f"note: {_vdir(v)} has no manifest ({why}); not verified")
    else:
        targets = [run.manifest(args.version).version]
    bad_manifests: Dict[int, str] = {}
    manifests: Dict[int, Manifest] = {}
    for v in targets:
        m = run.load(v)
        if m is None:
            bad_manifests[v] = run.error(v)
        elif m.checksum_algorithm != ALGORITHM:
            bad_manifests[v] = (f"unsupported checksum algorithm {m.checksum_algorithm!r} (this ray-ckpt "
                                f"checks {ALGORITHM})")
        else:
            manifests[v] = m
    # every distinct file once, even when several versions refer to it (a RELOADABLE state)
    unique: Dict[str, FileEntry] = {}
    conflicts: Dict[str, Tuple[str, str]] = {}
    for v, m in manifests.items():
        for f in (f for e in m.states.values() for f in e.all_files()):
            seen = unique.setdefault(f.path, f)
            if (seen.size, seen.checksum) != (f.size, f.checksum):
                conflicts[f.path] = ("CONFLICT", f"manifests disagree about its size or checksum (see version {v})")
    total = sum(f.size for f in unique.values())
    enabled = (args.progress is True) or (args.progress is None and total >= PROGRESS_AUTO_BYTES)
    progress = Progress(total, enabled)
    results: Dict[str, Optional[Tuple[str, str]]] = {}
    try:
        for path, f in unique.items():
            results[path] = conflicts.get(path) or check_file(run.tier, f, progress)
    finally:
        progress.finish()
    n_bad = 0
    for v in targets:
        if v in bad_manifests:
            n_bad += 1
            print(f"version {v}: BAD MANIFEST: {bad_manifests[v]}")
            continue
        m = manifests[v]
        lines = []
        files = 0
        for name in sorted(m.states):
            e = m.states[name]
            if e.status in ("missing", "pending"):
                lines.append(f"  note: state {name!r} is {e.status} in the manifest"
                             + (f" ({e.detail})" if e.detail else "") + " - nothing to verify")
            for rank in sorted(e.files, key=lambda r: int(r) if str(r).isdigit() else 0):
                for f in e.files[rank]:
                    files += 1
                    problem = results.get(f.path)
                    if problem:
                        n_bad += 1
                        lines.append(f"  {problem[0]:<10} {f.path}  (state {name!r}, rank {rank}): {problem[1]}")
        failed = [ln for ln in lines if not ln.startswith("  note:")]
        size = sum(f.size for e in m.states.values() for f in e.all_files())
        if failed:
            print(f"version {v} (step {m.step}): FAILED, {len(failed)} of {_n(files, 'file')} bad")
        else:
            print(f"version {v} (step {m.step}): OK, {_n(files, 'file')}, {human(size)} verified")
        for ln in lines:
            print(ln)
    for note in notes:
        print(note)
    if n_bad:
        raise CliError(f"verification failed: {_n(n_bad, 'problem')} in {_n(len(targets), 'version')} of "
                       f"{run.tier.uri} (listed above)")
    print(f"OK: {_n(len(targets), 'version')}, {_n(len(unique), 'distinct file')}, {human(total)} verified "
          f"({ALGORITHM})")
    return EXIT_OK


# ============================================================================ gc
def cmd_gc(args: argparse.Namespace) -> int:
    if args.keep_last is None and args.keep_every is None and args.keep_best is None:
        raise UsageError("gc needs a retention rule: --keep-last N and/or --keep-every K (or --keep-best)")
    try:
        policy = RetentionPolicy(args.keep_last, args.keep_every, args.keep_best)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    tier = open_tier(args)
    run = Run(tier)
    dry = args.dry_run
    verb = "would delete" if dry else "deleted"
    committed = run.committed()
    unreadable = [v for v in run.with_manifest if v not in committed]
    for v in unreadable:
        print(f"warning: leaving {_vdir(v)} alone: {run.error(v)}", file=sys.stderr)
    if not committed:
        print(f"nothing to do: {tier.uri} has no committed version"
              + (f" (versions without manifest: {_vlist(run.without_manifest)}; gc never deletes those "
                 f"unless a newer version is committed)" if run.without_manifest else ""))
        return EXIT_OK
    newest = max(committed)
    infos = [VersionInfo(v, m.step, m.metrics) for v, m in committed.items()]
    doomed = plan_deletions(policy, infos)
    if newest in doomed:  # RetentionPolicy.keep always keeps the newest; never trust that blindly
        doomed.remove(newest)
    kept = sorted(v for v in committed if v not in doomed)
    keep_paths: Set[str] = {p for v in kept for p in committed[v].referenced_paths()}
    uncommitted = run.uncommitted()
    in_flight = [v for v, u in uncommitted.items() if u["kind"] == "in_flight"]
    abandoned = [v for v, u in uncommitted.items() if u["kind"] == "abandoned"]
    if in_flight:
        print(f"warning: leaving {_vlist([_vdir(v) for v in in_flight])} alone: newer than the newest committed "
              f"version {newest} and without manifest (a save may be in flight)", file=sys.stderr)
    print(f"keeping {_n(len(kept), 'version')}: {_vlist(kept)} (newest: {newest})")
    total_files = total_bytes = n_versions = n_dirs = 0
    targets = [(v, f"version {v} (step {committed[v].step})") for v in doomed]
    # directories that only held shared files (their own version was deleted earlier) whose files
    # no kept version refers to any more: complete files nobody can restore, never in flight
    targets += [(v, f"{_vdir(v)} (shared files of deleted versions)") for v, u in uncommitted.items()
                if u["kind"] == "retired" and any(r not in keep_paths for r in u["rels"])]
    if args.partial:
        targets += [(v, f"uncommitted {_vdir(v)} (no manifest)") for v in abandoned]
    targets.sort()
    for v, label in targets:
        sizes = {_rel(tier, i.path): (i.size or 0) for i in _list_dir_files(tier, _vdir(v))}
        sizes.pop(layout.manifest_path(v), None)
        to_go = sorted(p for p in sizes if p not in keep_paths)
        shared = sorted(p for p in sizes if p in keep_paths)
        if not dry:
            try:
                to_go = sorted(delete_version(tier, v, keep_paths))
            except OSError as exc:
                raise CliError(f"deleting {_vdir(v)} from {tier.uri} failed: {one_line(exc)}"
                               + (f" (deleted {_n(n_versions, 'version')} before it)" if n_versions else "")) from None
        size = sum(sizes.get(p, 0) for p in to_go)
        if v in committed:
            n_versions += 1
        else:
            n_dirs += 1
        total_files += len(to_go)
        total_bytes += size
        keep_note = (f"; kept {_n(len(shared), 'shared file')} that kept versions still refer to"
                     if shared else "")
        print(f"{verb} {label}: {_n(len(to_go), 'file')}, {human(size)}{keep_note}")
        if args.verbose:
            for p in to_go:
                print(f"  {p}")
            for p in shared:
                print(f"  kept {p}")
    if not args.partial and abandoned:
        print(f"note: {_vlist([_vdir(v) for v in abandoned])} (older than version {newest}) "
              f"{'has' if len(abandoned) == 1 else 'have'} no manifest (a save that never committed, or "
              f"leftovers); "
              f"pass --partial to remove {'it' if len(abandoned) == 1 else 'them'}")
    prefix = "gc (dry run): would delete" if dry else "gc: deleted"
    dirs = f" and {n_dirs} other version director{'y' if n_dirs == 1 else 'ies'}" if n_dirs else ""
    print(f"{prefix} {_n(n_versions, 'version')}{dirs}, {_n(total_files, 'file')}, {human(total_bytes)}")
    return EXIT_OK


# ============================================================================ export
def _to_torch(arr: Any, info: Dict[str, Any]):
    """A flat uint8 leaf (from tree.flatten) -> a torch tensor of its safetensors dtype and shape."""
    import torch

    from .formats.tree import _torch_to_st

    st = info["dtype"]
    dt = {v: k for k, v in _torch_to_st().items()}.get(st)
    u8 = torch.from_numpy(arr.copy()) if arr.size else torch.empty(0, dtype=torch.uint8)
    if dt is None or (st == "U8" and info["itemsize"] != 1):
        return u8, False  # no safetensors dtype: exported as raw bytes
    if not arr.size:
        return torch.empty(info["shape"], dtype=dt), True
    return u8.view(dt).reshape(info["shape"]), True


def _readable(node: Any, names: List[str], leaf_meta: Dict[int, dict], tables: List[str]) -> Any:
    """The ray_ckpt structure as plain JSON a person (or another tool) can read."""
    import math

    if node is None or isinstance(node, (bool, int, str)):
        return node
    if "f" in node:
        x = float.fromhex(node["f"])
        return x if math.isfinite(x) else str(x)
    if "d" in node:
        return {str(k): _readable(v, names, leaf_meta, tables) for k, v in node["d"]}
    if "l" in node or "u" in node:
        return [_readable(v, names, leaf_meta, tables) for v in node.get("l", node.get("u"))]
    for key, kind in (("T", "tensor"), ("N", "numpy")):
        if key in node:
            i = node[key]
            out = {kind: names[i], "dtype": node.get("dt"), "shape": node.get("sh")}
            if not leaf_meta.get(i, {}).get("typed", True):
                out["stored_as"] = "uint8 bytes (no safetensors dtype)"
            return out
    if "A" in node:
        return {"arrow_table": tables[node["A"]]}
    if "ns" in node:
        import numpy as np

        v = np.frombuffer(bytes.fromhex(node["h"]), dtype=np.dtype(node["ns"]))[0].item()
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)
        elif isinstance(v, complex):
            v = [v.real, v.imag]
        elif isinstance(v, bytes):
            v = v.hex()
        return {"numpy_scalar": v, "dtype": node["ns"]}
    if "b" in node:
        return {"bytes_base64": node["b"]}
    if "tdt" in node:
        return {"torch_dtype": node["tdt"]}
    return node


def cmd_export(args: argparse.Namespace) -> int:
    from .formats.tree import flatten, structure_to_json

    name, rank = args.state, args.rank
    out_dir = Path(args.to).expanduser()
    st_path, json_path = out_dir / f"{name}.safetensors", out_dir / f"{name}.json"
    try:
        layout.validate_name(name, "state name")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if out_dir.exists() and not out_dir.is_dir():
        raise CliError(f"--to {args.to}: exists and is not a directory")
    if not args.force:
        for p in (st_path, json_path):
            if p.exists():
                raise CliError(f"{p} already exists; pass --force to overwrite it")
    run = Run(open_tier(args))
    m = run.manifest(args.version)
    entry: Optional[StateEntry] = m.states.get(name)
    if entry is None:
        raise CliError(f"version {m.version} has no state {name!r} (it has: {', '.join(sorted(m.states)) or 'none'})")
    if entry.status != "stored":
        raise CliError(f"state {name!r} of version {m.version} has no stored bytes: it is {entry.status}"
                       + (f" ({entry.detail})" if entry.detail else ""))
    files = rank_files(entry, name, rank)
    try:
        bufs, _tier, _problems = read_files([run.tier], files)  # verifies size + checksum of every file
    except CheckpointError as exc:
        raise CliError(f"cannot export state {name!r} of version {m.version}: {one_line(exc)}") from None
    try:
        state = decode_files(files, bufs, name=name, as_numpy=False)
    except CheckpointError as exc:
        msg = one_line(exc)
        if "pickled" in msg:
            msg = f"state {name!r} holds pickled objects; export does not unpickle (it would run code)"
        raise CliError(msg) from None
    flat = flatten(state, state_name=name)
    tensors = {}
    typed: Dict[int, dict] = {}
    for i, (arr, info) in enumerate(zip(flat.arrays, flat.leaf_info)):
        tensors[info["name"]], ok = _to_torch(arr, info)
        typed[i] = {"typed": ok}
    names = [info["name"] for info in flat.leaf_info]
    table_files = [f"{name}.table{i}.arrow" for i in range(len(flat.tables))]
    doc = {
        "format": "ray_ckpt.export/1",
        "run": m.run, "version": m.version, "step": m.step, "state": name, "rank": rank,
        "strategy": entry.strategy, "source": [f.path for f in files], "tensors_file": st_path.name,
        "tables": table_files,
        "tree": _readable(flat.structure, names, typed, table_files),
        "structure": json.loads(structure_to_json(flat.structure)),  # exact: ray_ckpt.formats.tree.unflatten
        "leaves": names,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_export(out_dir, st_path, json_path, tensors, flat.tables, table_files, doc, m)
    print(f"exported state {name!r} rank {rank} of version {m.version} (step {m.step}), verified:")
    print(f"  {st_path}  ({len(tensors)} tensors)")
    print(f"  {json_path}  (structure and non-tensor leaves)")
    for t in table_files:
        print(f"  {out_dir / t}  (Arrow IPC table)")
    return EXIT_OK


def _write_export(out_dir: Path, st_path: Path, json_path: Path, tensors: Dict[str, Any], tables: List[Any],
                  table_files: List[str], doc: Dict[str, Any], m: Manifest) -> None:
    """Write every output under a temporary name first, then rename: no half export on failure."""
    import pyarrow as pa
    from safetensors.torch import save_file

    tag = f"{TMP_MARK}{os.getpid()}"
    pending: List[Tuple[Path, Path]] = []
    try:
        tmp = st_path.with_name(st_path.name + tag)
        pending.append((tmp, st_path))
        save_file(tensors, str(tmp), metadata={"format": "pt", "ray_ckpt.run": m.run,
                                               "ray_ckpt.version": str(m.version), "ray_ckpt.step": str(m.step)})
        for t, fname in zip(tables, table_files):
            tmp = out_dir / (fname + tag)
            pending.append((tmp, out_dir / fname))
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
                w.write_table(t)
        tmp = json_path.with_name(json_path.name + tag)
        pending.append((tmp, json_path))
        tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        for src, dst in pending:
            os.replace(src, dst)
    except BaseException:
        for src, _dst in pending:
            try:
                src.unlink()
            except OSError:
                pass
        raise


# ============================================================================ demo
def demo_path() -> Path:
    return Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def cmd_demo(args: argparse.Namespace) -> int:
    import runpy

    path = demo_path()
    if not path.is_file():
        raise CliError(f"the demo script was not found at {path} (it ships with the source checkout of "
                       f"ray_ckpt, in examples/demo.py)")
    saved = sys.argv
    sys.argv = [str(path)] + list(args.demo_args or [])
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return EXIT_OK
        if isinstance(code, int):
            return code
        raise CliError(f"demo: {code}") from None
    finally:
        sys.argv = saved
    return EXIT_OK


# ============================================================================ argument parsing
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Inspect, verify, prune and export ray_ckpt checkpoints "
                                       "(no Ray cluster needed).",
                epilog="URI: a run's root (the directory or prefix holding v000000000100/ ...), as a "
                       "path, file:// or s3:// URI. VERSION: a number, a version directory name or 'latest'.")
    p.add_argument("--debug", action="store_true", help="show a traceback on unexpected errors")
    from . import __version__

    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    common = _Parser(add_help=False)
    common.add_argument("--endpoint-override", "--s3-endpoint", dest="endpoint_override", metavar="HOST:PORT",
                        help="S3-compatible endpoint for s3:// URIs (HOST:PORT is plain http; give "
                             "https://HOST:PORT for TLS). Credentials: AWS_ACCESS_KEY_ID / "
                             "AWS_SECRET_ACCESS_KEY; region: AWS_REGION")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    s = sub.add_parser("ls", parents=[common], help="list the versions of a run",
                       description="List the versions of a run: version, step, creation time, size, "
                                   "states and status (complete / partial / retired / unreadable).")
    s.add_argument("uri", metavar="URI")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("show", parents=[common], help="show the states and files of a version",
                       description="Show every state of a version: strategy, status, files (path, bytes, "
                                   "checksum) and the dtypes / shapes of its tensors (read from the "
                                   "safetensors headers only).")
    s.add_argument("uri", metavar="URI")
    s.add_argument("version", metavar="VERSION", type=parse_version, nargs="?", default=None,
                   help="the version to show (default: latest)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--max-leaves", type=_non_negative_int, default=50, metavar="N",
                   help="list at most N tensors per file (default 50; 0 = all)")
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("verify", parents=[common], help="re-read files and check sizes and checksums",
                       description="Re-read every file listed by the manifest(s) and check its size and "
                                   "checksum. Exit status 1 if anything is wrong.")
    s.add_argument("uri", metavar="URI")
    g = s.add_mutually_exclusive_group()
    g.add_argument("version", metavar="VERSION", type=parse_version, nargs="?", default=None,
                   help="the version to verify (default: latest)")
    g.add_argument("--all", action="store_true", help="verify every committed version")
    pg = s.add_mutually_exclusive_group()
    pg.add_argument("--progress", dest="progress", action="store_true", default=None,
                    help="always show progress on stderr (default: only from 256 MiB on)")
    pg.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("gc", parents=[common], help="delete old versions by a retention rule",
                       description="Delete committed versions that the retention rule does not keep (the "
                                   "same rules as the engine: newest N, every K-th step, best by a metric; "
                                   "the newest committed version is always kept). Files that kept versions "
                                   "refer to (a RELOADABLE state stored once) are never deleted.")
    s.add_argument("uri", metavar="URI")
    s.add_argument("--keep-last", type=_positive_int, metavar="N", help="keep the N newest versions")
    s.add_argument("--keep-every", type=_positive_int, metavar="K",
                   help="also keep every version whose step is a multiple of K")
    s.add_argument("--keep-best", type=_keep_best, metavar="METRIC:max|min:N",
                   help="also keep the N best versions by a metric given to save(metrics=...)")
    s.add_argument("--partial", action="store_true",
                   help="also remove version directories without a manifest that are older than the newest "
                        "committed version (abandoned saves); never newer ones, which may be in flight. "
                        "Files that kept versions refer to are never deleted; shared files that no kept "
                        "version refers to any more are deleted without this flag")
    s.add_argument("--dry-run", "-n", action="store_true", help="print what would be deleted; delete nothing")
    s.add_argument("--verbose", "-v", action="store_true", help="list every file")
    s.set_defaults(func=cmd_gc)

    s = sub.add_parser("export", parents=[common], help="export one state as plain safetensors + JSON",
                       description="Verify, then write DIR/NAME.safetensors (the tensor leaves, named by "
                                   "their key path, e.g. 'fc.weight' or 'state/0/exp_avg'; loadable with "
                                   "safetensors.torch.load_file) and DIR/NAME.json (the structure and the "
                                   "non-tensor leaves). Arrow tables go to DIR/NAME.tableI.arrow.")
    s.add_argument("uri", metavar="URI")
    s.add_argument("version", metavar="VERSION", type=parse_version, nargs="?", default=None,
                   help="the version to export (default: latest)")
    s.add_argument("--state", required=True, metavar="NAME", help="the state to export")
    s.add_argument("--to", required=True, metavar="DIR", help="output directory (created if needed)")
    s.add_argument("--rank", type=_non_negative_int, default=0, metavar="R", help="which rank's part (default 0)")
    s.add_argument("--force", action="store_true", help="overwrite existing output files")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("demo", help="run examples/demo.py (from a source checkout)",
                       description="Run the example in examples/demo.py; extra arguments are passed to it.")
    s.add_argument("demo_args", nargs=argparse.REMAINDER, metavar="ARGS")
    s.set_defaults(func=cmd_demo)
    return p


def _error(message: str) -> None:
    try:
        text = " ".join(str(message).split())
        if len(text) > MAX_ERROR_CHARS:
            text = text[: MAX_ERROR_CHARS - 3] + "..."
        sys.stderr.write(f"{PROG}: error: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ray-ckpt``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv[:1] or os.environ.get("RAY_CKPT_DEBUG") == "1"
    try:
        head = [a for a in argv[:2] if a == "--debug"]
        if argv[len(head):len(head) + 1] == ["demo"]:  # everything after 'demo' belongs to the demo
            debug = debug or bool(head)
            return cmd_demo(argparse.Namespace(demo_args=argv[len(head) + 1:]))
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help / --version
            return exc.code if isinstance(exc.code, int) else EXIT_OK
        debug = debug or args.debug
        return int(args.func(args) or 0)
    except CliError as exc:
        _error(str(exc))
        return exc.code
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:  # e.g. `ray-ckpt ls URI | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_FAIL
    except (CheckpointError, OSError, ValueError) as exc:
        if debug:
            raise
        _error(_describe(exc))
        return EXIT_FAIL
    except Exception as exc:  # never a traceback for the user; --debug shows it
        if debug:
            raise
        _error(f"unexpected {type(exc).__name__}: {one_line(exc)} (run with --debug for a traceback)")
        return EXIT_FAIL


def _describe(exc: BaseException) -> str:
    if isinstance(exc, PermissionError) and getattr(exc, "filename", None):
        return f"permission denied: {exc.filename}"
    return one_line(exc)


if __name__ == "__main__":
    sys.exit(main())
