"""``ray-ckpt show URI [VERSION] [--json] [--max-leaves N]``: every state of a version, its files
and the dtypes / shapes of its tensors, read from the safetensors headers and Arrow footers only."""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict, Tuple

from ..errors import CheckpointError, IntegrityError, one_line
from ..formats.manifest import ROLE_BUFFER, ROLE_TABLE, ROLE_TENSORS, FileEntry, Manifest
from ..formats.safetensors_io import LEAVES_KEY, STRUCTURE_KEY, header_length
from ..storage import layout
from ..storage.tier import Tier
from .common import (EXIT_OK, add_json_flag, human, iso_time, non_negative_int, plural, print_json, printable,
                     rank_order, say)
from .run_view import Run, command_parser, add_version_argument, is_partial, open_input

SUMMARY = "show the states and files of a version"
DESCRIPTION = ("Show every state of a version: strategy, status, files (path, bytes, "
               "checksum) and the dtypes / shapes of its tensors (read from the "
               "safetensors headers only).")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    s = command_parser(sub, common, "show", SUMMARY, DESCRIPTION, run)
    add_version_argument(s, "show")
    add_json_flag(s)
    s.add_argument("--max-leaves", type=non_negative_int, default=50, metavar="N",
                   help="list at most N tensors per file (default 50; 0 = all)")


# ---------------------------------------------------------------- reading headers
def read_safetensors_header(tier: Tier, rel: str) -> Dict[str, Any]:
    """The JSON header of a safetensors file: its first 8 bytes and the header, nothing more. Not
    ``safetensors_io.parse_header``: ``show`` describes a damaged header as far as it can."""
    with open_input(tier, rel) as f:
        size = f.seek(0, 2)
        f.seek(0)
        n = header_length(f.read(8), size)
        return json.loads(f.read(n))


def _leaf_kinds(structure: Any) -> Tuple[Dict[int, Tuple[str, str]], int]:
    """leaf index -> (kind, logical dtype) from a ray_ckpt structure (node tags: see
    ``ray_ckpt.formats.tree``); and the number of other leaves."""
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
        elif "DT" in node:  # a DTensor leaf: this rank's local chunk (or a replica stored by another rank)
            if node["DT"] is not None:
                kinds[node["DT"]] = ("dtensor chunk", str(node.get("dt")))
            else:
                other += 1
        elif "A" not in node:  # a table has its own file
            other += 1
    return kinds, other


# safetensors dtype -> torch dtype name (ray_ckpt.formats.dtypes.torch_to_st reversed, without torch)
_ST_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
             "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
             "C64": "complex64"}


def tensor_summary(header: Dict[str, Any]) -> Dict[str, Any]:
    """Leaves of a ray_ckpt safetensors header: name, dtype, shape, bytes, kind (in leaf order)."""
    meta = header.get("__metadata__") or {}
    try:
        names = json.loads(meta[LEAVES_KEY])
    except (KeyError, ValueError, TypeError):
        names = [k for k in header if k != "__metadata__"]
    try:
        kinds, other = _leaf_kinds(json.loads(meta[STRUCTURE_KEY]))
    except (KeyError, ValueError, TypeError):
        kinds, other = {}, None
    leaves = []
    for i, name in enumerate(names):
        h = header.get(name) or {}
        off = h.get("data_offsets") or [0, 0]
        kind, logical = kinds.get(i, ("tensor", _ST_NAMES.get(h.get("dtype"), str(h.get("dtype")))))
        leaves.append({"name": name, "dtype": logical, "stored_as": h.get("dtype"),
                       "shape": None if kind == "pickle" else h.get("shape"),
                       "bytes": int(off[1]) - int(off[0]), "kind": kind})
    by_dtype: Dict[str, int] = {}
    for leaf in leaves:
        by_dtype[leaf["dtype"]] = by_dtype.get(leaf["dtype"], 0) + 1
    return {"leaves": leaves, "dtypes": by_dtype, "other_leaves": other,
            "tensor_bytes": sum(leaf["bytes"] for leaf in leaves)}


def table_summary(tier: Tier, rel: str) -> Dict[str, Any]:
    import pyarrow as pa

    with open_input(tier, rel) as f:
        reader = pa.ipc.open_file(f)  # reads the footer (schema, batch index) only
        return {"columns": [{"name": fld.name, "type": str(fld.type)} for fld in reader.schema],
                "record_batches": reader.num_record_batches}


def _file_details(tier: Tier, f: FileEntry) -> Dict[str, Any]:
    d: Dict[str, Any] = {"path": f.path, "bytes": f.size, "checksum": f.checksum, "role": f.role}
    try:
        if f.role == ROLE_TENSORS:
            d["tensors"] = tensor_summary(read_safetensors_header(tier, f.path))
        elif f.role in (ROLE_TABLE, ROLE_BUFFER):
            d["table"] = table_summary(tier, f.path)
    except FileNotFoundError:
        d["problem"] = "file is missing"
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as exc:
        d["problem"] = f"cannot read its header: {one_line(exc)}"
    return d


def sharded_summary(shards: Any) -> Dict[str, Any]:
    """The DTensor leaves of a sharded state's index (manifest only): key -> global shape, dtype,
    how it was sharded (mesh, placements), its stored chunks and their bytes. Parsed and checked
    like a restore parses it (``ShardIndex.from_json``), so a damaged index is named as a problem."""
    from ..formats.shard_index import ShardIndex

    try:
        index = ShardIndex.from_json(shards, require_digests=False)
    except IntegrityError as exc:
        return {"problem": f"malformed shard index ({one_line(exc)})"}
    return {key: {"shape": list(m.global_shape), "dtype": m.dtype, "mesh": list(m.mesh_shape),
                  "placements": list(m.placements), "chunks": len(m.chunks),
                  "chunk_bytes": sum(c.nbytes for c in m.chunks), "files": len({c.file for c in m.chunks})}
            for key, m in index.items()}


def describe(run: Run, m: Manifest) -> Dict[str, Any]:
    """The ``show --json`` document of manifest ``m``."""
    states = {}
    for name in sorted(m.states):
        e = m.states[name]
        ranks = {rank: [_file_details(run.tier, f) for f in e.files[rank]] for rank in rank_order(e.files)}
        states[name] = {"strategy": e.strategy, "status": e.status, "bytes": e.bytes, "detail": e.detail,
                        "content_hash": e.content_hash, "replicated": e.replicated, "ranks": ranks}
        if e.shards is not None:
            states[name]["sharded"] = sharded_summary(e.shards)
    return {"uri": run.uri, "run": m.run, "version": m.version, "step": m.step, "created_at": m.created_at,
            "created": iso_time(m.created_at), "bytes": m.bytes, "metrics": dict(m.metrics),
            "checksum_algorithm": m.checksum_algorithm, "status": "partial" if is_partial(m) else "complete",
            "states": states}


# ---------------------------------------------------------------- text output
def _print_tensors(t: Dict[str, Any], limit: int) -> None:
    counts = ", ".join(f"{dt} x{n}" for dt, n in sorted(t["dtypes"].items()))
    other = ("" if t["other_leaves"] is None else
             f"; {t['other_leaves']} other leaf" if t["other_leaves"] == 1 else
             f"; {t['other_leaves']} other leaves")
    say(f"      {plural(len(t['leaves']), 'tensor')}, {human(t['tensor_bytes'])}"
        + (f" ({counts})" if counts else "") + other)
    leaves = t["leaves"] if limit == 0 else t["leaves"][:limit]
    names = [printable(leaf["name"]) for leaf in leaves]
    w = max(map(len, names), default=0)
    for name, leaf in zip(names, leaves):
        shape = "-" if leaf["shape"] is None else "[" + ", ".join(map(str, leaf["shape"])) + "]"
        kind = "" if leaf["kind"] == "tensor" else f"  ({leaf['kind']})"
        say(f"        {name.ljust(w)}  {leaf['dtype']:<9} {shape:<16} {human(leaf['bytes'])}{kind}")
    if len(leaves) < len(t["leaves"]):
        say(f"        ... {len(t['leaves']) - len(leaves)} more (--max-leaves 0 shows all)")


def _print_sharded(sh: Dict[str, Any], limit: int) -> None:
    if "problem" in sh:
        say(f"  ! sharded: {sh['problem']}")
        return
    n = len(sh)
    say(f"  sharded: {n} DTensor {'leaf' if n == 1 else 'leaves'} (global shapes; chunks in the rank files "
        f"below; restorable on any world size)")
    items = list(sh.items()) if limit == 0 else list(sh.items())[:limit]
    names = [printable(k) for k, _ in items]
    w = max(map(len, names), default=0)
    for name, (_k, t) in zip(names, items):
        shape = "[" + ", ".join(map(str, t["shape"] or [])) + "]"
        layout_ = f"mesh {t['mesh']} {','.join(map(str, t['placements'] or []))}" if t.get("mesh") else ""
        say(f"    {name.ljust(w)}  {str(t['dtype']):<9} {shape:<16} {plural(t['chunks'], 'chunk')} in "
            f"{plural(t['files'], 'file')}, {human(t['chunk_bytes'])}  {printable(layout_)}".rstrip())
    if len(items) < len(sh):
        say(f"    ... {len(sh) - len(items)} more (--max-leaves 0 shows all)")


def _print_file(d: Dict[str, Any], own: int, algorithm: str, limit: int) -> None:
    shared = "" if layout.in_version(d["path"], own) else f"  [shared: stored once, in {d['path'].split('/', 1)[0]}]"
    size = human(d["bytes"]) + (f" ({d['bytes']} B)" if d["bytes"] >= 1024 else "")
    say(f"    {d['path']}  {size}  {algorithm}:{d['checksum']}  {d['role']}{shared}")
    if "problem" in d:
        say(f"      ! {d['problem']}")
    if "tensors" in d:
        _print_tensors(d["tensors"], limit)
    if "table" in d:
        cols = d["table"]["columns"]
        shown = ", ".join(f"{c['name']}: {c['type']}" for c in cols[:8]) + (", ..." if len(cols) > 8 else "")
        say(f"      arrow table: {len(cols)} columns, {d['table']['record_batches']} record batch(es): {shown}")


def _print_doc(doc: Dict[str, Any], limit: int) -> None:
    own = doc["version"]
    say(f"run {doc['run']!r}  version {doc['version']} ({layout.version_dir(doc['version'])})  step {doc['step']}  "
        f"created {doc['created']}  size {human(doc['bytes'])}  {doc['status']}")
    if doc["metrics"]:
        say("metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(doc["metrics"].items())))
    for name, s in doc["states"].items():
        extra = (["replicated"] if s["replicated"] else []) + \
            ([f"content {s['content_hash'][:16]}"] if s["content_hash"] else [])
        say()
        say(f"state {name}  strategy={s['strategy']}  status={s['status']}  {human(s['bytes'])}"
            + (f"  ({', '.join(extra)})" if extra else ""))
        if s["detail"]:
            say(f"  detail: {s['detail']}")
        if "sharded" in s:
            _print_sharded(s["sharded"], limit)
        for rank, files in s["ranks"].items():
            say(f"  rank {rank}:")
            for d in files:
                _print_file(d, own, doc["checksum_algorithm"], limit)


def run(args: argparse.Namespace) -> int:
    run = Run.open(args)
    doc = describe(run, run.manifest(args.version))
    if args.json:
        print_json(doc)
    else:
        _print_doc(doc, args.max_leaves)
    return EXIT_OK
