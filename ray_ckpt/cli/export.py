"""``ray-ckpt export URI [VERSION] --state NAME --to DIR|FILE.safetensors [--rank R] [--max-shard-size SIZE]
[--force] [--progress | --no-progress] [--json]``: verify one state's part, then write it as plain
safetensors (its tensor leaves) + JSON (its structure and other leaves) + Arrow IPC files (its
tables), all or nothing.

A sharded (DTensor) state is exported as its full tensors, assembled from every rank's chunks
(unless ``--rank`` asks for one rank's local part). ``--to FILE.safetensors`` writes the tensors
alone into that one file, or, past ``--max-shard-size``, in Hugging Face's sharded layout
(``FILE-00001-of-0000N.safetensors`` + ``FILE.safetensors.index.json``)."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..storage.checkpoint_io import decode_files, rank_files, read_files
from ..errors import CheckpointError, one_line
from ..formats.manifest import Manifest, StateEntry
from ..storage import layout
from ..storage.local_files import local_atomic
from .common import EXIT_OK, CliError, UsageError, add_json_flag, human, non_negative_int, print_json, say
from .progress import AUTO_BYTES, Progress, add_progress_flags, wanted
from .run_view import Run, command_parser, add_version_argument


SUMMARY = "export one state as plain safetensors + JSON"
DESCRIPTION = ("Verify, then write DIR/NAME.safetensors (the tensor leaves, named by "
               "their key path, e.g. 'fc.weight' or 'state/0/exp_avg'; loadable with "
               "safetensors.torch.load_file) and DIR/NAME.json (the structure and the "
               "non-tensor leaves). Arrow tables go to DIR/NAME.tableI.arrow. A sharded "
               "(DTensor) state is exported as full tensors merged from every rank's chunks. "
               "--to FILE.safetensors writes only the tensors, to that file (or Hugging Face's "
               "sharded layout with FILE.safetensors.index.json past --max-shard-size).")


def _to_torch(arr: Any, info: Dict[str, Any]):
    """A flat uint8 leaf (from tree.flatten) -> a torch tensor of its safetensors dtype and shape."""
    import torch

    from ..formats.dtypes import torch_to_st

    st = info["dtype"]
    dt = {v: k for k, v in torch_to_st().items()}.get(st)
    u8 = torch.from_numpy(arr.copy()) if arr.size else torch.empty(0, dtype=torch.uint8)
    if dt is None or (st == "U8" and info["itemsize"] != 1):
        return u8, False  # no safetensors dtype: exported as raw bytes
    if not arr.size:
        return torch.empty(info["shape"], dtype=dt), True
    return u8.view(dt).reshape(info["shape"]), True


def _readable(node: Any, names: List[str], typed: Dict[int, bool], tables: List[str]) -> Any:
    """The ray_ckpt structure (node tags: see ``ray_ckpt.formats.tree``) as plain JSON a person (or
    another tool) can read."""
    if node is None or isinstance(node, (bool, int, str)):
        return node
    if "f" in node:
        x = float.fromhex(node["f"])
        return x if math.isfinite(x) else str(x)
    if "d" in node:
        return {str(k): _readable(v, names, typed, tables) for k, v in node["d"]}
    if "l" in node or "u" in node:
        return [_readable(v, names, typed, tables) for v in node.get("l", node.get("u"))]
    for key, kind in (("T", "tensor"), ("N", "numpy")):
        if key in node:
            i = node[key]
            out = {kind: names[i], "dtype": node.get("dt"), "shape": node.get("sh")}
            if not typed.get(i, True):
                out["stored_as"] = "uint8 bytes (no safetensors dtype)"
            return out
    if "A" in node:
        return {"arrow_table": tables[node["A"]]}
    if "ns" in node:
        return {"numpy_scalar": _numpy_scalar(node), "dtype": node["ns"]}
    if "b" in node:
        return {"bytes_base64": node["b"]}
    if "tdt" in node:
        return {"torch_dtype": node["tdt"]}
    return node


def _numpy_scalar(node: Dict[str, Any]) -> Any:
    import numpy as np

    v = np.frombuffer(bytes.fromhex(node["h"]), dtype=np.dtype(node["ns"]))[0].item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, complex):
        return [v.real, v.imag]
    if isinstance(v, bytes):
        return v.hex()
    return v


def _check_arguments(args: argparse.Namespace) -> Tuple[Path, Path, Path]:
    """(output directory, NAME.safetensors, NAME.json), refused before anything is read."""
    name = args.state
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
    return out_dir, st_path, json_path


def _read_state(run: Run, m: Manifest, name: str, rank: int, show: Optional[bool] = None
                ) -> Tuple[StateEntry, List[Any], Any]:
    """(entry, its files, the decoded state): every file verified (size and checksum) on the way,
    with progress per file read (``show``: None = from ``AUTO_BYTES`` on)."""
    entry = _stored_entry(m, name)
    files = rank_files(entry, name, rank)
    total = sum(f.size for f in files)
    progress = Progress(total, total >= AUTO_BYTES if show is None else show, "export: reading")
    bufs: List[Any] = []
    try:
        for f in files:
            bufs += read_files([run.tier], [f])[0]
            progress.add(f.size)
    except CheckpointError as exc:
        raise CliError(f"cannot export state {name!r} of version {m.version}: {one_line(exc)}") from None
    finally:
        progress.finish()
    try:
        return entry, files, decode_files(files, bufs, name=name, as_numpy=False)
    except CheckpointError as exc:
        msg = one_line(exc)
        if "pickled" in msg:
            msg = f"state {name!r} holds pickled objects; export does not unpickle (it would run code)"
        raise CliError(msg) from None


def parse_size(text: str) -> int:
    """'5GB' (10^9, as Hugging Face counts), '500MiB', '1048576' -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        n = int(float(num) * units[t[len(num):].strip()])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1048576)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return n


def _full_tensors(run: Run, m: Manifest, name: str) -> Tuple[StateEntry, Dict[str, Any], int]:
    """(entry, key -> full tensor, bytes read) of a sharded state: every chunk range-read and verified."""
    from ..storage.sharded_io import full_tensors

    entry = _stored_entry(m, name)
    try:
        tensors, reader = full_tensors([run.tier], entry, name)
    except CheckpointError as exc:
        raise CliError(f"cannot export state {name!r} of version {m.version}: {one_line(exc)}") from None
    return entry, tensors, reader.bytes


def _stored_entry(m: Manifest, name: str) -> StateEntry:
    entry: Optional[StateEntry] = m.states.get(name)
    if entry is None:
        raise CliError(f"version {m.version} has no state {name!r} (it has: {', '.join(sorted(m.states)) or 'none'})")
    if entry.status != "stored":
        raise CliError(f"state {name!r} of version {m.version} has no stored bytes: it is {entry.status}"
                       + (f" ({entry.detail})" if entry.detail else ""))
    return entry


def _plan_shards(tensors: Dict[str, Any], stem: str, limit: Optional[int]) -> List[Tuple[str, List[str]]]:
    """[(file name, keys)]: one file, or consecutive groups of at most ``limit`` bytes (a tensor
    larger than the limit gets a file of its own), named as Hugging Face names them."""
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    if limit is None or sum(sizes.values()) <= limit:
        return [(f"{stem}.safetensors", list(tensors))]
    groups: List[List[str]] = [[]]
    used = 0
    for k in tensors:
        if groups[-1] and used + sizes[k] > limit:
            groups.append([])
            used = 0
        groups[-1].append(k)
        used += sizes[k]
    n = len(groups)
    return [(f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def _run_file(args: argparse.Namespace) -> int:
    """--to FILE.safetensors: the state's tensors (full tensors of a sharded state) in one file or
    in Hugging Face's sharded layout; nothing else."""
    from safetensors.torch import save_file

    name, target = args.state, Path(args.to).expanduser()
    try:
        layout.validate_name(name, "state name")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    out_dir, stem = target.parent, target.name[: -len(".safetensors")]
    if not stem:
        raise UsageError(f"--to {args.to}: the file needs a name before .safetensors")
    if out_dir.exists() and not out_dir.is_dir():
        raise CliError(f"--to {args.to}: {out_dir} is not a directory")
    run_ = Run.open(args)
    m = run_.manifest(args.version)
    entry = _stored_entry(m, name)
    if entry.shards is not None and args.rank is None:
        entry, tensors, nread = _full_tensors(run_, m, name)
        source, what = [f.path for f in entry.all_files()], "full tensors merged from every rank's chunks"
    else:
        rank = 0 if args.rank is None else args.rank
        entry, files, state = _read_state(run_, m, name, rank, args.progress)
        from ..formats.tree import flatten

        flat = flatten(state, state_name=name)  # torch and numpy array leaves, named by key path
        typed = [(info["name"], _to_torch(arr, info)) for arr, info in zip(flat.arrays, flat.leaf_info)]
        tensors = {k: t for k, (t, has_dtype) in typed if has_dtype}
        source, what, nread = [f.path for f in files], f"rank {rank}'s part", sum(f.size for f in files)
    tensors = {k: t.contiguous() for k, t in tensors.items()}
    plan = _plan_shards(tensors, stem, args.max_shard_size)
    outputs = [out_dir / f for f, _ in plan] + ([out_dir / f"{stem}.safetensors.index.json"] if len(plan) > 1 else [])
    if not args.force:
        for p in outputs:
            if p.exists():
                raise CliError(f"{p} already exists; pass --force to overwrite it")
    meta = {**_export_metadata(m), "ray_ckpt.state": name}
    out_dir.mkdir(parents=True, exist_ok=True)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    progress = Progress(total, wanted(args, total >= AUTO_BYTES and len(plan) > 1), "export: writing")
    with contextlib.ExitStack() as stack:  # all files appear together, or none
        stack.callback(progress.finish)
        for fname, keys in plan:
            tmp = stack.enter_context(local_atomic(str(out_dir / fname)))
            save_file({k: tensors[k] for k in keys}, tmp, metadata=meta)
            progress.add(sum(tensors[k].numel() * tensors[k].element_size() for k in keys))
        if len(plan) > 1:
            tmp = stack.enter_context(local_atomic(str(outputs[-1])))
            index = {"metadata": {"total_size": total, **meta},
                     "weight_map": {k: fname for fname, keys in plan for k in keys}}
            Path(tmp).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    files_out = [{"path": str(out_dir / f), "role": "tensors", "tensors": len(keys)} for f, keys in plan]
    if len(plan) > 1:
        files_out.append({"path": str(outputs[-1]), "role": "index"})
    if args.json:
        print_json({"uri": run_.uri, "run": m.run, "version": m.version, "step": m.step, "state": name,
                    "rank": args.rank, "sharded": entry.shards is not None, "verified": True, "source": source,
                    "bytes_read": nread, "tensor_bytes": total, "files": files_out})
        return EXIT_OK
    say(f"exported state {name!r} of version {m.version} (step {m.step}), {what}, verified: "
        f"{len(tensors)} tensors, {human(total)}")
    for d in files_out:
        say(f"  {d['path']}" + (f"  ({d['tensors']} tensors)" if d["role"] == "tensors" else "  (index)"))
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    from ..formats.nodes import structure_to_json
    from ..formats.tree import flatten

    if str(args.to).endswith(".safetensors"):
        return _run_file(args)
    if args.max_shard_size is not None:
        raise UsageError("--max-shard-size goes with --to FILE.safetensors")
    name = args.state
    out_dir, st_path, json_path = _check_arguments(args)
    run = Run.open(args)
    m = run.manifest(args.version)
    if args.rank is None and _stored_entry(m, name).shards is not None:
        from ..storage.sharded_io import load_full

        entry = _stored_entry(m, name)
        try:
            state = load_full([run.tier], entry, name)[0]
        except CheckpointError as exc:
            raise CliError(f"cannot export state {name!r} of version {m.version}: {one_line(exc)}") from None
        rank: Any = "all (full tensors)"
        files = entry.all_files()
    else:
        rank = 0 if args.rank is None else args.rank
        entry, files, state = _read_state(run, m, name, rank, args.progress)
    flat = flatten(state, state_name=name)
    tensors, typed = {}, {}
    for i, (arr, info) in enumerate(zip(flat.arrays, flat.leaf_info)):
        tensors[info["name"]], typed[i] = _to_torch(arr, info)
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
    written = [{"path": str(st_path), "role": "tensors", "tensors": len(tensors)},
               {"path": str(json_path), "role": "structure"}]
    written += [{"path": str(out_dir / t), "role": "table"} for t in table_files]
    if args.json:
        print_json({"uri": run.uri, "run": m.run, "version": m.version, "step": m.step, "state": name, "rank": rank,
                    "verified": True, "source": doc["source"], "files": written})
        return EXIT_OK
    say(f"exported state {name!r} rank {rank} of version {m.version} (step {m.step}), verified:")
    say(f"  {st_path}  ({len(tensors)} tensors)")
    say(f"  {json_path}  (structure and non-tensor leaves)")
    for t in table_files:
        say(f"  {out_dir / t}  (Arrow IPC table)")
    return EXIT_OK


def _export_metadata(m: Manifest) -> Dict[str, str]:
    """The ``__metadata__`` of an exported safetensors file: the version it came from."""
    return {"format": "pt", "ray_ckpt.run": m.run, "ray_ckpt.version": str(m.version), "ray_ckpt.step": str(m.step)}


def _write_export(out_dir: Path, st_path: Path, json_path: Path, tensors: Dict[str, Any], tables: List[Any],
                  table_files: List[str], doc: Dict[str, Any], m: Manifest) -> None:
    """Write every output under a temporary name first (``local_atomic``), then rename them all: no
    half export on failure."""
    import pyarrow as pa
    from safetensors.torch import save_file

    with contextlib.ExitStack() as stack:  # renames on success, removes every temporary file on failure
        tmp = stack.enter_context(local_atomic(str(st_path)))
        save_file(tensors, tmp, metadata=_export_metadata(m))
        for t, fname in zip(tables, table_files):
            tmp = stack.enter_context(local_atomic(str(out_dir / fname)))
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
                w.write_table(t)
        tmp = stack.enter_context(local_atomic(str(json_path)))
        Path(tmp).write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    s = command_parser(sub, common, "export", SUMMARY, DESCRIPTION, run)
    add_version_argument(s, "export")
    s.add_argument("--state", required=True, metavar="NAME", help="the state to export")
    s.add_argument("--to", required=True, metavar="DIR|FILE.safetensors",
                   help="output directory (created if needed), or a .safetensors file for the tensors alone")
    s.add_argument("--rank", type=non_negative_int, default=None, metavar="R",
                   help="which rank's part (default 0; a sharded state: its full tensors)")
    s.add_argument("--max-shard-size", type=parse_size, default=None, metavar="SIZE",
                   help="with --to FILE.safetensors: split into Hugging Face shards of at most SIZE "
                        "(e.g. 5GB) with FILE.safetensors.index.json")
    s.add_argument("--force", action="store_true", help="overwrite existing output files")
    add_progress_flags(s, auto="from 256 MiB on")
    add_json_flag(s)
