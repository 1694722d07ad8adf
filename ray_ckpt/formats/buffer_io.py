"""Buffers (a dict of equally long numpy arrays: a replay or rollout buffer) as one Arrow IPC file.

Such a state is a table: one row per transition, one column per field. Stored as an Arrow IPC file
(``rank0.arrow``) it opens in any Arrow tool (pandas, polars, DuckDB) with its field names, dtypes
and per-row shapes, and restores without copies: each array is a view into the verified file.

One-dimensional arrays are plain columns; an array of shape (n, d1, ...) is a column of Arrow's
``fixed_shape_tensor`` type with shape (d1, ...). ray_ckpt's structure (the same JSON that a
safetensors file carries, see :mod:`.tree`) lives in the schema metadata, so the state comes back
with its exact types, dtypes and shapes. States of any other shape (tensors, nested dicts, scalars)
stay in safetensors: :func:`as_table` says which.
"""
from __future__ import annotations

import json
from typing import Any, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from ..errors import IntegrityError
from .tree import Flat, pieces_of, structure_to_json

STRUCTURE_KEY = b"ray_ckpt.structure"
LEAVES_KEY = b"ray_ckpt.leaves"
FORMAT_KEY = b"ray_ckpt.format"
FORMAT_VERSION = b"buffer/1"
_KINDS = "fiub"  # float, signed, unsigned, bool: the dtypes Arrow has (complex and the rest are not)


def _columns(structure: Any) -> Optional[List[Tuple[str, dict]]]:
    """(column name, numpy leaf node) per top-level key, if the state is a buffer; else None."""
    if not isinstance(structure, dict) or set(structure) != {"d"} or not structure["d"]:
        return None
    cols = []
    for key, node in structure["d"]:
        if not isinstance(key, str) or not isinstance(node, dict) or "N" not in node:
            return None
        cols.append((key, node))
    return cols


def as_table(flat: Flat) -> Optional[pa.Table]:
    """``flat`` as an Arrow table if it is a buffer, else None.

    A buffer: a dict with str keys whose values are all numpy arrays of at least one dimension, of
    one length, with a bool, integer or floating dtype in native byte order. The table's columns
    hold the flat's own memory (arrays that travelled in pieces are joined: at most 4 MiB each).
    """
    cols = _columns(flat.structure)
    if cols is None or flat.tables:
        return None
    rows = None
    for _, node in cols:
        dt, shape = np.dtype(node["dt"]), node["sh"]
        if dt.kind not in _KINDS or not dt.isnative or not shape or 0 in shape[1:]:
            return None
        if rows is None:
            rows = shape[0]
        elif shape[0] != rows:
            return None
    fields, arrays = [], []
    for name, node in cols:
        dt, shape = np.dtype(node["dt"]), node["sh"]
        parts = pieces_of(flat.arrays[node["N"]])
        raw = parts[0] if len(parts) == 1 else (np.concatenate(parts) if parts else np.empty(0, np.uint8))
        values = np.asarray(raw).view(dt)
        if dt.kind == "b":  # Arrow packs booleans into bits: the one column that is copied
            arr = pa.array(values, type=pa.bool_())
        else:
            vt = pa.from_numpy_dtype(dt)
            arr = pa.Array.from_buffers(vt, values.size, [None, pa.py_buffer(values)])
        if len(shape) > 1:
            width = int(np.prod(shape[1:]))
            arr = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(arr.type, shape[1:]),
                                                 pa.FixedSizeListArray.from_arrays(arr, width))
        fields.append(pa.field(name, arr.type, nullable=False))
        arrays.append(arr)
    meta = {FORMAT_KEY: FORMAT_VERSION, STRUCTURE_KEY: structure_to_json(flat.structure).encode(),
            LEAVES_KEY: json.dumps([info["name"] for info in flat.leaf_info]).encode()}
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=meta))


def read(buf: Any, *, path: str = "<buffer>") -> Tuple[Any, List[memoryview]]:
    """Parse a buffer file held in ``buf`` (bytes-like, verified). Returns (structure, per-leaf
    bytes) like :func:`.safetensors_io.read`: views into ``buf`` where the column lies in it (an
    uncompressed file), else copies (booleans, compressed files)."""
    try:
        table = pa.ipc.open_file(pa.py_buffer(buf)).read_all()
        meta = table.schema.metadata or {}
        if meta.get(FORMAT_KEY) != FORMAT_VERSION:
            raise ValueError(f"no {FORMAT_KEY.decode()}={FORMAT_VERSION.decode()} in its schema metadata")
        structure = json.loads(meta[STRUCTURE_KEY])
        cols = _columns(structure)
        if cols is None:
            raise ValueError("its structure is not a buffer's")
        views: List[Any] = [None] * len(cols)
        whole = memoryview(buf).cast("B")
        base = np.frombuffer(whole, np.uint8).ctypes.data if len(whole) else 0
        for name, node in cols:
            col = table.column(name)
            views[node["N"]] = _leaf_bytes(col, np.dtype(node["dt"]), whole, base)
        if any(v is None for v in views):
            raise ValueError("a leaf has no column")
    except (KeyError, ValueError, TypeError, pa.ArrowException) as exc:
        raise IntegrityError(f"{path}: not a ray_ckpt buffer file ({exc})") from None
    return structure, views


def _leaf_bytes(col: pa.ChunkedArray, dt: np.dtype, whole: memoryview, base: int) -> Any:
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if isinstance(arr, pa.ExtensionArray):
        arr = arr.storage.flatten()
    if dt.kind == "b":
        return memoryview(arr.to_numpy(zero_copy_only=False).astype(np.bool_).view(np.uint8)).cast("B")
    n = len(arr) * dt.itemsize
    data = arr.buffers()[1]
    if data is None or n == 0:
        return bytearray(0)
    start = data.address + arr.offset * dt.itemsize - base
    if 0 <= start and start + n <= len(whole):
        return whole[start: start + n]  # the verified file's own memory (writable when it is)
    return bytearray(memoryview(data)[arr.offset * dt.itemsize: arr.offset * dt.itemsize + n])
