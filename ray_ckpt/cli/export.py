"""``ray-ckpt export URI [VERSION] --state NAME --to DIR [--rank R] [--force] [--json]``: verify one
state's part, then write it as plain safetensors (its tensor leaves) + JSON (its structure and other
leaves) + Arrow IPC files (its tables), all or nothing."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..checkpoint_io import decode_files, rank_files, read_files
from ..errors import CheckpointError, one_line
from ..formats.manifest import Manifest, StateEntry
from ..storage import layout
from ..storage.local_files import local_atomic
from .common import EXIT_OK, CliError, UsageError, add_json_flag, non_negative_int, print_json, say
from .run_view import Run, command_parser, add_version_argument


SUMMARY = "export one state as plain safetensors + JSON"
DESCRIPTION = ("Verify, then write DIR/NAME.safetensors (the tensor leaves, named by "
               "their key path, e.g. 'fc.weight' or 'state/0/exp_avg'; loadable with "
               "safetensors.torch.load_file) and DIR/NAME.json (the structure and the "
               "non-tensor leaves). Arrow tables go to DIR/NAME.tableI.arrow.")


def _to_torch(arr: Any, info: Dict[str, Any]):
    """A flat uint8 leaf (from tree.flatten) -> a torch tensor of its safetensors dtype and shape."""
    import torch

    from ..formats.tree import _torch_to_st

    st = info["dtype"]
    dt = {v: k for k, v in _torch_to_st().items()}.get(st)
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


def _read_state(run: Run, m: Manifest, name: str, rank: int) -> Tuple[StateEntry, List[Any], Any]:
    """(entry, its files, the decoded state): every file verified (size and checksum) on the way."""
    entry: Optional[StateEntry] = m.states.get(name)
    if entry is None:
        raise CliError(f"version {m.version} has no state {name!r} (it has: {', '.join(sorted(m.states)) or 'none'})")
    if entry.status != "stored":
        raise CliError(f"state {name!r} of version {m.version} has no stored bytes: it is {entry.status}"
                       + (f" ({entry.detail})" if entry.detail else ""))
    files = rank_files(entry, name, rank)
    try:
        bufs, _tier, _problems = read_files([run.tier], files)
    except CheckpointError as exc:
        raise CliError(f"cannot export state {name!r} of version {m.version}: {one_line(exc)}") from None
    try:
        return entry, files, decode_files(files, bufs, name=name, as_numpy=False)
    except CheckpointError as exc:
        msg = one_line(exc)
        if "pickled" in msg:
            msg = f"state {name!r} holds pickled objects; export does not unpickle (it would run code)"
        raise CliError(msg) from None


def run(args: argparse.Namespace) -> int:
    from ..formats.tree import flatten, structure_to_json

    name, rank = args.state, args.rank
    out_dir, st_path, json_path = _check_arguments(args)
    run = Run.open(args)
    m = run.manifest(args.version)
    entry, files, state = _read_state(run, m, name, rank)
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


def _write_export(out_dir: Path, st_path: Path, json_path: Path, tensors: Dict[str, Any], tables: List[Any],
                  table_files: List[str], doc: Dict[str, Any], m: Manifest) -> None:
    """Write every output under a temporary name first (``local_atomic``), then rename them all: no
    half export on failure."""
    import pyarrow as pa
    from safetensors.torch import save_file

    with contextlib.ExitStack() as stack:  # renames on success, removes every temporary file on failure
        tmp = stack.enter_context(local_atomic(str(st_path)))
        save_file(tensors, tmp, metadata={"format": "pt", "ray_ckpt.run": m.run,
                                          "ray_ckpt.version": str(m.version), "ray_ckpt.step": str(m.step)})
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
    s.add_argument("--to", required=True, metavar="DIR", help="output directory (created if needed)")
    s.add_argument("--rank", type=non_negative_int, default=0, metavar="R", help="which rank's part (default 0)")
    s.add_argument("--force", action="store_true", help="overwrite existing output files")
    add_json_flag(s)
