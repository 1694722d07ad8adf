"""Buffers as one Arrow IPC file: a state that is a dict of equally long numpy arrays (a replay or
rollout buffer, beside which plain scalars such as a write position may sit), or one Arrow table.

Such a state is a table: one row per transition, one column per field. Stored as an Arrow IPC file
(``rank0.arrow``) it opens in any Arrow tool (pandas, polars, DuckDB) with its field names, dtypes
and per-row shapes, and restores without copies: each array is a view into the verified file.

One-dimensional arrays are plain columns; an array of shape (n, d1, ...) is a column of Arrow's
``fixed_shape_tensor`` type with shape (d1, ...). ray_ckpt's structure (the same JSON that a
safetensors file carries, see :mod:`.tree`, scalars included) lives in the schema metadata, so the
state comes back with its exact types, dtypes and shapes; a table state keeps its own metadata.
States of any other shape (tensors, nested dicts, scalars) stay in safetensors: :func:`as_table`
says which.
"""
from __future__ import annotations

import json
from typing import Any, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from ..errors import IntegrityError
from . import safetensors_io
from .arrow_io import SEGMENT_FORMAT, open_validated
from .flat import Flat, pieces_of
from .nodes import structure_to_json

STRUCTURE_KEY = safetensors_io.STRUCTURE_KEY.encode()  # Arrow schema metadata: the same keys, as bytes
LEAVES_KEY = safetensors_io.LEAVES_KEY.encode()
FORMAT_KEY = safetensors_io.FORMAT_KEY.encode()
FORMAT_VERSION = b"buffer/1"
_KINDS = "fiub"  # float, signed, unsigned, bool: the dtypes Arrow has (complex and the rest are not)


def _is_scalar(node: Any) -> bool:
    """A JSON-scalar leaf of the structure (kept in the metadata, not a column)."""
    return node is None or isinstance(node, (bool, int, str)) or (
        isinstance(node, dict) and len(node) <= 2 and ("f" in node or "ns" in node))


def columns_of(structure: Any) -> Optional[List[Tuple[str, dict]]]:
    """(column name, numpy leaf node) per array of a buffer's top-level dict; None if not a buffer."""
    if not isinstance(structure, dict) or set(structure) - {"d", "o"} or not structure.get("d"):
        return None
    cols = []
    for key, node in structure["d"]:
        if not isinstance(key, str):
            return None
        if isinstance(node, dict) and "N" in node:
            cols.append((key, node))
        elif not _is_scalar(node):
            return None
    return cols or None


def _whole_table(structure: Any, flat: Flat) -> bool:
    """The state is one Arrow table (or record batch) and nothing else."""
    return (isinstance(structure, dict) and structure.get("A") == 0 and set(structure) <= {"A", "rb"}
            and len(flat.tables) == 1 and not flat.arrays)


def as_table(flat: Flat) -> Optional[pa.Table]:
    """``flat`` as an Arrow table if it is a buffer, else None.

    A buffer: one Arrow table; or a dict with str keys whose arrays (numpy, at least one dimension,
    one length, a bool, integer or floating dtype in native byte order) are its columns and whose
    other values are scalars (int, float, str, bool, None, numpy scalars). Torch tensors are
    weights, not buffers: they stay in safetensors. The table's columns hold the flat's own memory
    (arrays that travelled in pieces are joined: at most 4 MiB each).
    """
    if _whole_table(flat.structure, flat):
        table = flat.tables[0]
        return table.replace_schema_metadata({**(table.schema.metadata or {}), **_metadata(flat)})
    cols = columns_of(flat.structure)
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
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=_metadata(flat)))


def _metadata(flat: Flat) -> dict:
    return {FORMAT_KEY: FORMAT_VERSION, STRUCTURE_KEY: structure_to_json(flat.structure).encode(),
            LEAVES_KEY: json.dumps([info["name"] for info in flat.leaf_info]).encode()}


def read(buf: Any, *, path: str = "<buffer>") -> Tuple[Any, List[Any], List[pa.Table]]:
    """Parse a buffer file held in ``buf`` (bytes-like, verified). Returns (structure, per-leaf
    bytes, tables) for :func:`.tree.unflatten`: leaf bytes are views into ``buf`` where the column
    lies in it (an uncompressed file), else copies (booleans, compressed files)."""
    try:
        table = open_validated(buf)  # validated in full: offsets and lengths inside the file
        meta = table.schema.metadata or {}
        if meta.get(FORMAT_KEY) not in (FORMAT_VERSION, SEGMENT_FORMAT):
            raise ValueError(f"no {FORMAT_KEY.decode()}={FORMAT_VERSION.decode()} in its schema metadata")
        structure = json.loads(meta[STRUCTURE_KEY])
        if isinstance(structure, dict) and structure.get("A") == 0:  # the state is this table
            own = {k: v for k, v in meta.items() if k not in (FORMAT_KEY, STRUCTURE_KEY, LEAVES_KEY)}
            return structure, [], [table.replace_schema_metadata(own or None)]
        cols = columns_of(structure)
        if cols is None:
            raise ValueError("its structure is not a buffer's")
        views: List[Any] = [None] * len(cols)
        whole = memoryview(buf).cast("B")
        base = np.frombuffer(whole, np.uint8).ctypes.data if len(whole) else 0
        for name, node in cols:
            if not isinstance(node.get("N"), int) or not 0 <= node["N"] < len(views) or views[node["N"]] is not None:
                raise ValueError(f"column {name!r}: leaf index {node.get('N')!r} is not one of 0..{len(views) - 1}")
            if table.schema.get_field_index(name) < 0:
                raise ValueError(f"column {name!r} is not in the file")
            col = table.column(name)
            views[node["N"]] = _leaf_bytes(col, np.dtype(node["dt"]), node.get("sh"), name, whole, base)
    except (KeyError, ValueError, TypeError, IndexError, OverflowError, AttributeError, RecursionError,
            OSError, pa.ArrowException) as exc:  # pyarrow's IPC errors include OSError
        raise IntegrityError(f"{path}: not a ray_ckpt buffer file ({exc})") from None
    return structure, views, []


def _leaf_bytes(col: pa.ChunkedArray, dt: np.dtype, shape: Any, name: str, whole: memoryview, base: int) -> Any:
    """The bytes of one column, after checking that the column is what the structure says it is:
    its value type ``dt``, ``shape[0]`` rows of ``shape[1:]`` each (no nulls)."""
    if (not isinstance(shape, list) or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ValueError(f"column {name!r}: shape {shape!r} is not a list of non-negative integers")
    if dt.kind not in _KINDS or not dt.isnative:
        raise ValueError(f"column {name!r}: dtype {dt} is not a buffer column's")
    if len(col) != shape[0] or col.null_count:
        raise ValueError(f"column {name!r}: {len(col)} rows ({col.null_count} null), the structure says {shape[0]}")
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    width = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    if len(shape) > 1:
        if not isinstance(arr, pa.ExtensionArray) or not isinstance(arr.type, pa.FixedShapeTensorType) \
                or list(arr.type.shape) != list(shape[1:]):
            raise ValueError(f"column {name!r} is {arr.type}, the structure says a tensor of shape {shape[1:]}")
        arr = arr.storage.flatten()
    elif isinstance(arr, pa.ExtensionArray):
        raise ValueError(f"column {name!r} is {arr.type}, the structure says plain values")
    want = pa.bool_() if dt.kind == "b" else pa.from_numpy_dtype(dt)
    if arr.type != want or len(arr) != shape[0] * width or arr.null_count:
        raise ValueError(f"column {name!r}: {len(arr)} values of {arr.type}, the structure says "
                         f"{shape[0] * width} of {want}")
    if dt.kind == "b":
        return memoryview(arr.to_numpy(zero_copy_only=False).view(np.uint8)).cast("B")  # unpacked: a new array
    n = len(arr) * dt.itemsize
    data = arr.buffers()[1]
    if data is None or n == 0:
        return bytearray(0)
    start = data.address + arr.offset * dt.itemsize - base
    if 0 <= start and start + n <= len(whole):
        return whole[start: start + n]  # the verified file's own memory (writable when it is)
    return bytearray(memoryview(data)[arr.offset * dt.itemsize: arr.offset * dt.itemsize + n])
